"""The server's device memory pools: one ``DevicePool`` per device, reserved once, and their
metrics.

A pool is reserved the first time a model is placed on its device, at the size the settings
give (bytes, or on a CUDA device a fraction of the memory free then), and lives as long as the
process: models come and go inside it (``DevicePool.admit`` / ``release``), the device memory
does not. On the CPU the same pool is reserved in host memory (``torch.empty`` touches no page
until it is written), so the CPU runs the very path a GPU runs.

Metrics (``batcher/metrics.py``) per device: bytes reserved, in use, largest free block,
fallbacks; ``refresh`` sets them, after a model is admitted or released and after each batch,
never per request.
"""

from __future__ import annotations

import dataclasses
import threading

import structlog
import torch

from batcher.errors import ResourceExhausted
from batcher.metrics import BatcherMetrics
from batcher.pool import DevicePool

log = structlog.get_logger(__name__)

DEFAULT_POOL_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class PoolSettings:
    """How each device's pool is reserved."""

    size_bytes: int = DEFAULT_POOL_BYTES
    """Bytes reserved per device (the CPU's pool always takes this)."""
    fraction_of_free: float | None = None
    """On a CUDA device: reserve this fraction of the memory free at the time, not size_bytes."""
    strict: bool = True
    """Refuse what does not fit (RESOURCE_EXHAUSTED); False: allocate outside, counted."""

    def __post_init__(self) -> None:
        if isinstance(self.size_bytes, bool) or not isinstance(self.size_bytes, int) or \
                self.size_bytes < 4096:
            raise ValueError(f"size_bytes must be an int >= 4096, got {self.size_bytes!r}")
        if self.fraction_of_free is not None and not 0.0 < self.fraction_of_free <= 1.0:
            raise ValueError(
                f"fraction_of_free must lie in (0, 1], got {self.fraction_of_free!r}")


class DevicePools:
    """The pool of each device, reserved on first use."""

    def __init__(self, settings: PoolSettings | None = None,
                 metrics: BatcherMetrics | None = None) -> None:
        self.settings = settings if settings is not None else PoolSettings()
        self._metrics = metrics
        self._pools: dict[str, DevicePool] = {}
        self._fallbacks_seen: dict[str, int] = {}
        self._lock = threading.Lock()

    def get(self, device: str) -> DevicePool:
        """``device``'s pool, reserving it now if this is its first model."""
        key = str(torch.device(device))
        with self._lock:
            pool = self._pools.get(key)
            if pool is None:
                pool = self._pools[key] = self._reserve(key)
        self.refresh(pool)
        return pool

    def pools(self) -> list[DevicePool]:
        with self._lock:
            return list(self._pools.values())

    def _reserve(self, device: str) -> DevicePool:
        s = self.settings
        by_fraction = s.fraction_of_free is not None and device.startswith("cuda")
        try:
            if by_fraction:
                pool = DevicePool(device, fraction_of_free=s.fraction_of_free, strict=s.strict)
            else:
                pool = DevicePool(device, s.size_bytes, strict=s.strict)
        except torch.OutOfMemoryError as exc:
            asked = f"{s.fraction_of_free} of the free memory" if by_fraction else \
                f"{s.size_bytes} bytes"
            raise ResourceExhausted(
                f"could not reserve the memory pool of {device} ({asked}): the device is out "
                "of memory; give a smaller --device-pool-bytes / --device-pool-fraction"
            ) from exc
        log.info("device_pool_reserved", device=device, bytes=pool.bytes_reserved,
                 strict=pool.strict)
        return pool

    def refresh(self, pool: DevicePool) -> None:
        """Set ``pool``'s gauges (and count its new fallbacks)."""
        metrics = self._metrics
        if metrics is None:
            return
        device = str(pool.device)
        metrics.pool_bytes_reserved.labels(device).set(pool.bytes_reserved)
        metrics.pool_bytes_in_use.labels(device).set(pool.bytes_in_use)
        metrics.pool_largest_free_block.labels(device).set(pool.largest_free_block)
        with self._lock:
            fallbacks = pool.fallbacks
            new = fallbacks - self._fallbacks_seen.get(device, 0)
            self._fallbacks_seen[device] = fallbacks
        if new:
            metrics.pool_fallbacks.labels(device).inc(new)
