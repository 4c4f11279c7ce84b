"""What the executor needs from CUDA beyond torch's defaults: which errors mean what, host waits
that neither spin nor outlive a deadline, and each model's own memory pools with their footprint.

Errors (``classify``):

- *out of memory*: ``torch.OutOfMemoryError``, and the cuBLAS/cuDNN allocation failures that
  arrive as a plain ``RuntimeError`` (``CUBLAS_STATUS_ALLOC_FAILED``...): the batch is split;
- *sticky*: an illegal address, a device-side assert, a launch failure... leave the process's
  CUDA context broken, so every later call fails too: the executor stops (``InstanceDead``) and
  the process hook (``on_device_lost``) ends an executor process, which the supervisor restarts.

Events the host waits on are made with ``blocking=True`` (``host_event``): the waiting thread
sleeps in the driver instead of spinning a core. ``wait_event`` waits for one with a deadline.

Memory (``ModelMemory``): on a CUDA device each model gets a ``torch.cuda.MemPool`` that its load
(weights), its warm-up and its executor threads allocate from (``use()``, per thread), and, when
it has CUDA graphs, a second pool its captures use (a graph's memory must never be handed to an
eager tensor, so it is not the eager pool). One model's batch-size churn then never interleaves
with another's segments, and unloading a model (``close``) returns its pools' segments to the
device. ``stats()`` reads what each pool reserved and allocated (the allocator's segments). On
the CPU, or on a torch without ``MemPool``, it is inert: ``use()`` is a null context and
``stats()`` is None, so CPU serving runs exactly as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import structlog
import torch

from batchgate.batcher.errors import ResourceExhausted

log = structlog.get_logger(__name__)

# Messages of allocation failures that do not arrive as torch.OutOfMemoryError.
OOM_MARKERS = ("CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED",
               "CUDA error: out of memory", "cudaErrorMemoryAllocation")
# CUDA errors that leave the context unusable (cudaErrorIllegalAddress and kin).
STICKY_MARKERS = ("illegal memory access", "illegal address", "illegal instruction",
                  "misaligned address", "unspecified launch failure", "device-side assert",
                  "uncorrectable ECC error", "hardware stack error", "invalid program counter",
                  "an illegal", "launch timed out")

# Called (from an executor thread) when a sticky error broke the device; the executor process
# sets it to exit so that the supervisor restarts it. Single-process mode leaves it None.
on_device_lost: Callable[[str], None] | None = None

# Device memory a model must leave free beyond its measured footprint, as a fraction of the
# device's total (cuBLAS/cuDNN workspaces, other models' growth, the CUDA context).
DEFAULT_HEADROOM_FRACTION = 0.05


def classify(exc: BaseException) -> str | None:
    """``"oom"``, ``"sticky"`` or None for an exception a forward raised."""
    if isinstance(exc, torch.OutOfMemoryError):
        return "oom"
    if not isinstance(exc, RuntimeError):
        return None
    text = str(exc)
    if any(marker in text for marker in OOM_MARKERS):
        return "oom"
    lowered = text.lower()
    if ("cuda" in lowered or isinstance(exc, getattr(torch, "AcceleratorError", ())))\
            and any(marker.lower() in lowered for marker in STICKY_MARKERS):
        return "sticky"
    return None


def device_lost(reason: str) -> None:
    """A sticky CUDA error: tell the process (its hook decides whether to exit)."""
    log.error("cuda_context_broken", reason=reason)
    hook = on_device_lost
    if hook is not None:
        hook(reason)


def host_event() -> torch.cuda.Event:
    """An event the host will wait on: blocking, so the waiter sleeps instead of spinning."""
    return torch.cuda.Event(blocking=True)


def wait_event(event: Any, timeout_s: float | None, *, first_poll_s: float = 20e-6,
               longest_poll_s: float = 1e-3) -> bool:
    """Wait for ``event`` (``query``/``synchronize``); False when ``timeout_s`` ran out first.

    Without a timeout it is one blocking ``synchronize``. With one, the event is polled with a
    backoff from ``first_poll_s`` to ``longest_poll_s`` (CUDA has no timed wait on an event).
    """
    if timeout_s is None:
        event.synchronize()
        return True
    deadline = time.monotonic() + timeout_s
    delay = first_poll_s
    while not event.query():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(delay, left))
        delay = min(delay * 2, longest_poll_s)
    return True


def mem_pools_supported() -> bool:
    """Whether this torch can route a thread's allocations to a pool of its own."""
    return hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool")


@dataclasses.dataclass(frozen=True)
class PoolStats:
    """Bytes one model's pools hold on its device."""

    reserved: int  # segments the allocator took from the device for them
    allocated: int  # of which live tensors use


FOOTPRINT_PARTS = ("weights", "activations", "graphs", "staging", "plan")


@dataclasses.dataclass(frozen=True)
class Footprint:
    """What a model holds on its device, measured at warm-up (bytes)."""

    weights: int  # allocated after its load, before any batch
    activations: int  # the peak of its largest warm-up batch beyond the weights
    graphs: int  # its CUDA graphs' pool (reserved)
    staging: int  # the most its queued requests' staged inputs may take (the stager's cap)
    plan: int  # its memory plan (batch buffers, graph buffers) in the device pool

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.graphs + self.staging + self.plan

    def parameters(self) -> dict[str, str]:
        """The ModelConfig parameters that report it."""
        return {"footprint_bytes": str(self.total), "weight_bytes": str(self.weights),
                "activation_bytes": str(self.activations),
                "graph_pool_bytes": str(self.graphs), "staging_bytes": str(self.staging)}


def admit(model: str, device: str, footprint: Footprint, *, held: int, free: int,
          total: int, headroom_fraction: float = DEFAULT_HEADROOM_FRACTION) -> None:
    """Refuse ``model`` unless what it still needs fits the device's free memory with headroom.

    ``held``: bytes of the footprint already taken from the device (its pools' segments, its
    plan); ``free``/``total``: the device's, now. Raises ResourceExhausted naming the bytes.
    """
    headroom = int(total * headroom_fraction)
    needed = max(0, footprint.total - held) + headroom
    if needed > free:
        raise ResourceExhausted(
            f"model '{model}' needs {footprint.total} bytes on {device} (weights "
            f"{footprint.weights}, activations {footprint.activations}, graphs "
            f"{footprint.graphs}, staging {footprint.staging}, plan {footprint.plan}); "
            f"{max(0, footprint.total - held)} more bytes plus {headroom} of headroom are needed "
            f"and {free} bytes are free")


class ModelMemory:
    """A model's pools on its device; inert on the CPU (see the module docstring)."""

    def __init__(self, device: str | torch.device, name: str = "", *,
                 pooled: bool = True) -> None:
        """``pooled=False``: no pool of its own on CUDA either (the caching allocator's shared
        pool, as without this module; ``bench/gpu_check`` compares the two)."""
        self.device = torch.device(device)
        self.name = name
        self._lock = threading.Lock()
        self.pool: Any = None
        self.graph_pool: Any = None
        self.closed = False
        if pooled and self.device.type == "cuda" and mem_pools_supported():
            with torch.cuda.device(self.device):
                self.pool = torch.cuda.MemPool()

    @property
    def measures(self) -> bool:
        """Whether footprints are measured and admitted here (CUDA)."""
        return self.pool is not None

    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        """Route this thread's allocations on the device to the model's pool."""
        if self.pool is None:
            yield
            return
        with torch.cuda.use_mem_pool(self.pool, self.device):
            yield

    def graph_pool_id(self) -> Any:
        """The pool handle the model's graph captures use (made on first use)."""
        with self._lock:
            if self.graph_pool is None:
                with torch.cuda.device(self.device):
                    self.graph_pool = (torch.cuda.MemPool() if mem_pools_supported()
                                       else None)
            return self.graph_pool.id if self.graph_pool is not None else \
                torch.cuda.graph_pool_handle()

    def stats(self) -> dict[str, PoolStats] | None:
        """Per pool (``eager``, ``graphs``): bytes reserved and allocated; None when inert."""
        if self.pool is None or self.closed:
            return None
        figures = {"eager": _pool_stats(self.pool)}
        if self.graph_pool is not None:
            figures["graphs"] = _pool_stats(self.graph_pool)
        return figures

    def free_and_total(self) -> tuple[int, int]:
        """The device's free and total memory now."""
        return torch.cuda.mem_get_info(self.device)

    def device_stats(self) -> PoolStats:
        """What this process's allocator holds on the device, every pool together."""
        return PoolStats(torch.cuda.memory_reserved(self.device),
                         torch.cuda.memory_allocated(self.device))

    def start_peak(self) -> int:
        """Begin measuring a peak: the device's allocated bytes now (after a synchronize)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak_since(self, start: int) -> int:
        """The most allocated beyond ``start`` since ``start_peak``."""
        torch.cuda.synchronize(self.device)
        return max(0, torch.cuda.max_memory_allocated(self.device) - start)

    def close(self) -> None:
        """The model is gone: drop its pools and give their cached segments back. A segment
        still holding a live block stays (a cuBLAS workspace torch keeps per handle and stream
        for the process's lifetime is one: a few MiB)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            pools, self.pool, self.graph_pool = (self.pool, self.graph_pool), None, None
        if any(p is not None for p in pools):
            del pools
            with torch.cuda.device(self.device):
                torch.cuda.empty_cache()


def _pool_stats(pool: Any) -> PoolStats:
    reserved = allocated = 0
    if hasattr(pool, "snapshot"):
        segments = pool.snapshot()
    else:  # a torch whose MemPool has no snapshot: the allocator's, filtered by pool
        segments = [s for s in torch.cuda.memory_snapshot()
                    if tuple(s.get("segment_pool_id", ())) == tuple(pool.id)]
    for segment in segments:
        reserved += segment.get("total_size", 0)
        allocated += segment.get("allocated_size", 0)
    return PoolStats(reserved, allocated)


def module_bytes(module: Any, device: torch.device) -> int:
    """Bytes of ``module``'s parameters and buffers on ``device`` (weights not in a pool)."""
    if not isinstance(module, torch.nn.Module):
        return 0
    seen: set[int] = set()
    total = 0
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device != device and not (device.index is None
                                            and tensor.device.type == device.type):
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total
