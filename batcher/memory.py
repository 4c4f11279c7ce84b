"""The server's device memory pools: per device, one arena per loaded model, reserved at its
admission at exactly the size of its plan, and their metrics.

Nothing is reserved before a model is admitted. A model's arena (a ``DevicePool``) holds its
memory plan (every instance's batch input buffers and CUDA-graph buffers) and room for its
queued requests' staged inputs (the stager's cap), sized from those and nothing else; it is
reserved when the model is admitted (``DevicePools.reserve``) and given back when it unloads
(``DevicePools.release``), so what a device's pools hold is the sum of its loaded models' plans.
An arena is one contiguous buffer its views point into, so it cannot grow in place: each model
gets its own, which is the same as a pool that grows by one segment per model.

The settings cap what the pools on one device may hold together: ``cap_bytes`` (every device,
the CPU's included) and, on a CUDA device, ``fraction_of_total`` of its memory; both given, the
smaller applies; neither, no cap (a CUDA device's own memory still bounds it, and the model's
footprint is admitted against the device's free memory, ``batcher/gpu.py``). A model whose
arena would pass the cap is refused (``ResourceExhausted`` naming the bytes needed and free),
or, with ``strict=False``, served with its buffers outside any pool, each counted as a fallback.
On the CPU an arena is host memory (``torch.empty`` touches no page until it is written), so the
CPU runs the very path a GPU runs.

Metrics (``batcher/metrics.py``) per device: bytes reserved, in use, the largest free block of
any arena, fallbacks; ``refresh`` sets them, after a model is admitted or released and after
each batch, never per request.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable

import structlog
import torch

from batchgate.batcher.errors import ResourceExhausted
from batchgate.batcher.metrics import BatcherMetrics
from batchgate.batcher.pool import DEFAULT_POOL_ALIGNMENT, DevicePool

log = structlog.get_logger(__name__)

MIN_CAP_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class PoolSettings:
    """What the pools on each device may hold (module docstring)."""

    cap_bytes: int | None = None
    """The most the pools on one device hold together, the CPU's included; None: no cap."""
    fraction_of_total: float | None = None
    """On a CUDA device: the most, as a fraction of its total memory (the smaller of the two)."""
    strict: bool = True
    """Refuse what does not fit (RESOURCE_EXHAUSTED); False: allocate outside, counted."""

    def __post_init__(self) -> None:
        if self.cap_bytes is not None and (
                isinstance(self.cap_bytes, bool) or not isinstance(self.cap_bytes, int)
                or self.cap_bytes < MIN_CAP_BYTES):
            raise ValueError(
                f"cap_bytes must be None or an int >= {MIN_CAP_BYTES}, got {self.cap_bytes!r}")
        if self.fraction_of_total is not None and not 0.0 < self.fraction_of_total <= 1.0:
            raise ValueError(
                f"fraction_of_total must lie in (0, 1], got {self.fraction_of_total!r}")


def arena_bytes(sizes: Iterable[int], alignment: int = DEFAULT_POOL_ALIGNMENT) -> int:
    """The arena that holds allocations of ``sizes`` bytes: each rounded up to ``alignment``
    (as the allocator does), plus one ``alignment`` for the buffer's skip to an aligned start."""
    return sum(max(-(-n // alignment), 1) * alignment for n in sizes) + alignment


class DevicePools:
    """Each device's model arenas, reserved per model at admission (module docstring)."""

    def __init__(self, settings: PoolSettings | None = None,
                 metrics: BatcherMetrics | None = None) -> None:
        self.settings = settings if settings is not None else PoolSettings()
        self._metrics = metrics
        self._arenas: dict[str, dict[str, DevicePool]] = {}  # device -> owner -> arena
        self._caps: dict[str, int | None] = {}
        self._outside_fallbacks: dict[str, int] = {}
        self._fallbacks_seen: dict[str, int] = {}
        self._published: dict[str, tuple[int, int, int]] = {}  # device -> the gauges written
        self._lock = threading.Lock()

    # --- accounting --------------------------------------------------------------------------

    def cap(self, device: str) -> int | None:
        """The most ``device``'s pools may hold together; None when uncapped."""
        key = str(torch.device(device))
        with self._lock:
            if key not in self._caps:
                self._caps[key] = self._cap_of(key)
            return self._caps[key]

    def _cap_of(self, device: str) -> int | None:
        s = self.settings
        caps = [] if s.cap_bytes is None else [s.cap_bytes]
        if s.fraction_of_total is not None and device.startswith("cuda"):
            _free, total = torch.cuda.mem_get_info(torch.device(device))
            caps.append(int(total * s.fraction_of_total))
        return min(caps) if caps else None

    def bytes_reserved(self, device: str) -> int:
        """What ``device``'s pools hold now: its models' arenas together."""
        key = str(torch.device(device))
        with self._lock:
            return sum(a.bytes_reserved for a in self._arenas.get(key, {}).values())

    def arenas(self, device: str) -> dict[str, DevicePool]:
        """``device``'s arenas by owner."""
        with self._lock:
            return dict(self._arenas.get(str(torch.device(device)), {}))

    def pools(self) -> list[DevicePool]:
        with self._lock:
            return [a for arenas in self._arenas.values() for a in arenas.values()]

    # --- models ------------------------------------------------------------------------------

    def reserve(self, device: str, owner: str, sizes: Iterable[int], what: str) -> DevicePool:
        """Reserve ``owner``'s arena on ``device``, sized for allocations of ``sizes`` bytes
        (``what``: the plan, for the refusal). Over the cap, or when the device is out of
        memory: ``ResourceExhausted`` naming the bytes needed and free (``strict``), or a
        permissive pool with no room (``strict=False``: everything it is asked for goes outside,
        counted). Nothing is reserved when it raises."""
        key = str(torch.device(device))
        nbytes = arena_bytes(sizes)
        cap = self.cap(key)
        strict = self.settings.strict
        with self._lock:
            arenas = self._arenas.setdefault(key, {})
            if owner in arenas:
                raise ValueError(f"{owner!r} already holds an arena on {key}; release it first")
            held = sum(a.bytes_reserved for a in arenas.values())
            over = cap is not None and held + nbytes > cap
            if over and strict:
                raise ResourceExhausted(
                    f"model {owner!r} needs {nbytes} bytes of device memory (plan: {what}); "
                    f"{max(0, cap - held)} bytes are free in the pools of {key}, capped at "
                    f"{cap} bytes (--device-pool-bytes / --device-pool-fraction)")
            size = 2 * DEFAULT_POOL_ALIGNMENT if over else nbytes
            try:
                arena = DevicePool(key, size, strict=strict)
            except torch.OutOfMemoryError as exc:
                free = torch.cuda.mem_get_info(torch.device(key))[0] if key.startswith(
                    "cuda") else 0
                raise ResourceExhausted(
                    f"model {owner!r} needs {nbytes} bytes of device memory (plan: {what}); "
                    f"{free} bytes are free on {key}") from exc
            arenas[owner] = arena
        log.info("device_pool_reserved", device=key, model=owner, bytes=arena.bytes_reserved,
                 device_bytes=held + arena.bytes_reserved, cap=cap, outside=over)
        self.refresh(arena)
        return arena

    def release(self, owner: str, arena: DevicePool) -> None:
        """Give ``owner``'s arena back (its buffers must no longer be used, nor viewed)."""
        key = str(arena.device)
        with self._lock:
            arenas = self._arenas.get(key, {})
            if arenas.get(owner) is not arena:
                raise ValueError(f"{owner!r} holds no arena on {key}")
            del arenas[owner]
            # Its fallbacks stay counted after the arena goes.
            self._outside_fallbacks[key] = self._outside_fallbacks.get(key, 0) + arena.fallbacks
        log.info("device_pool_released", device=key, model=owner, bytes=arena.bytes_reserved)
        self.refresh(arena)
        # Its segment goes back to the device once no view of it is left and the cache is
        # emptied with no thread inside a pool: the model's ModelMemory.close does both.

    def refresh(self, pool: DevicePool) -> None:
        """Set the gauges of ``pool``'s device (and count its new fallbacks)."""
        metrics = self._metrics
        if metrics is None:
            return
        device = str(pool.device)
        with self._lock:
            arenas = list(self._arenas.get(device, {}).values())
            fallbacks = self._outside_fallbacks.get(device, 0) + sum(a.fallbacks for a in arenas)
            new = fallbacks - self._fallbacks_seen.get(device, 0)
            self._fallbacks_seen[device] = fallbacks
            gauges = (sum(a.bytes_reserved for a in arenas), sum(a.bytes_in_use for a in arenas),
                      max((a.largest_free_block for a in arenas), default=0))
            # Called after every batch, when they mostly have not moved: written on a change.
            # Under the lock, so that two threads' writes cannot land in the wrong order.
            if self._published.get(device) != gauges:
                self._published[device] = gauges
                reserved, in_use, largest = gauges
                metrics.pool_bytes_reserved.labels(device).set(reserved)
                metrics.pool_bytes_in_use.labels(device).set(in_use)
                metrics.pool_largest_free_block.labels(device).set(largest)
        if new:
            metrics.pool_fallbacks.labels(device).inc(new)
