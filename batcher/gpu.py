"""What the executor needs from CUDA beyond torch's defaults: which errors mean what, host waits
that neither spin nor outlive a deadline, and each model's own memory pools with their footprint.

Errors (``classify``):

- *out of memory*: ``torch.OutOfMemoryError``, and the cuBLAS/cuDNN allocation failures that
  arrive as a plain ``RuntimeError`` (``CUBLAS_STATUS_ALLOC_FAILED``...): the batch is retried
  once the cache is given back, then split (``batcher/forward.py``);
- *sticky*: an illegal address, a device-side assert, a launch failure... leave the process's
  CUDA context broken, so every later call fails too: the executor stops (``InstanceDead``) and
  the process hook (``on_device_lost``) ends an executor process, which the supervisor restarts.

Events the host waits on are made with ``blocking=True`` (``host_event``): the waiting thread
sleeps in the driver instead of spinning a core. ``wait_event`` waits for one with a deadline.

Memory (``ModelMemory``): on a CUDA device each model's memory comes from
``torch.cuda.MemPool`` pools of its own, one per *role*, since the allocator lets one thread at
a time into a pool (``batcher/allocator.py`` has the contract): ``weights`` (its load and its
fp16 conversion, on the loading thread), per instance ``compute<i>`` (its forwards, on its model
thread; the precision check's runs too, before it starts), ``graphs<i>`` (its CUDA graphs'
captures), ``gather<i>`` (a model without fixed buffers: its assembler's copies to the device)
and ``staging`` (staged inputs outside the arena, on the stager's thread). ``use(role)`` routes
the calling thread's allocations there for a block and refuses a second thread in the same
role. One model's batch-size churn then never interleaves with another's segments; a pool's
segments stay cached in it, so what a pool reserved after the warm-up is its peak, read from
the pool itself (``stats``) without synchronizing the device or counting other models'
traffic; and unloading a model (``close``) drops its pools once no thread is inside any pool,
which returns their segments to the device whole. ``reclaim`` gives the device's cached,
unused memory back after an out-of-memory inside a pool. On the CPU, or on a torch without
pools, it is inert: ``use()`` is a null context and ``stats()`` is None, so CPU serving runs
exactly as before (the test suite's double of the allocator gives the CPU pools too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog
import torch

from batchgate.batcher import allocator
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
    activations: int  # its instances' compute pools after warm-up (their peak)
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


WEIGHTS = "weights"
# Pool roles by what allocates into them; an instance's roles carry its index.
ROLE_KINDS = {"weights": "weights", "compute": "activations", "graphs": "graphs",
              "gather": "activations", "staging": "staging"}


# Pools the model's own code runs in (its matmuls make cuBLAS workspaces): the thread's
# workspaces for the stream are made before it enters one. The gather and staging run none.
RUNS_MODEL = ("weights", "activations")


def role(kind: str, instance: int | None = None, generation: int = 0) -> str:
    """The pool role of ``kind`` ("compute", "graphs", "gather"), per instance; a compute role
    gets a new ``generation`` when a hung call may still be inside the old one."""
    if kind not in ROLE_KINDS:
        raise ValueError(f"kind must be one of {sorted(ROLE_KINDS)}, got {kind!r}")
    name = kind if instance is None else f"{kind}{instance}"
    return name if not generation else f"{name}.{generation}"


def role_kind(name: str) -> str:
    """What a role's pool holds, for ``ModelMemory.stats``."""
    head = name.rstrip("0123456789.")
    return ROLE_KINDS.get(head, head)


class ModelMemory:
    """A model's pools on its device, one per role; inert on the CPU (module docstring)."""

    def __init__(self, device: str | torch.device, name: str = "", *,
                 pooled: bool = True) -> None:
        """``pooled=False``: no pools of its own on CUDA either (the caching allocator's shared
        pool, as without this module; ``bench/gpu_check`` compares the two)."""
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None and \
                torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.name = name
        self._allocator = allocator.for_device(self.device) if pooled else None
        self._lock = threading.Lock()
        self._pools: dict[str, Any] = {}  # role -> the allocator's pool
        self._retired: list[Any] = []  # pools a hung call may still be inside, kept to close
        self._inside: dict[str, int] = {}  # role -> the thread inside its pool now
        self.closed = False

    @property
    def measures(self) -> bool:
        """Whether the model has pools of its own, whose footprint is measured and admitted."""
        return self._allocator is not None

    @property
    def supports_graphs(self) -> bool:
        """Whether CUDA graphs can be captured into this model's pools."""
        return self._allocator is not None and self._allocator.supports_graphs

    @property
    def allocator(self) -> allocator.Allocator | None:
        return self._allocator

    def use(self, role: str = WEIGHTS) -> contextlib.AbstractContextManager:
        """Route this thread's allocations on the device to the pool of ``role`` (made on first
        use) while the block runs. One thread at a time per role: a second thread entering a
        pool that another is inside is refused here (RuntimeError), before the allocator would
        refuse it and leak the pool's use count. A thread inside one pool does not enter
        another; entering the one it is inside again is a no-op."""
        if self._allocator is None:
            return contextlib.nullcontext()
        return _PoolEntry(self, role)

    def capture(self, role: str, graph: Any, stream: Any, body: Callable[[], None]) -> None:
        """Capture ``body`` into ``graph``, allocating into the pool of ``role``."""
        with _PoolEntry(self, role, capture=(graph, stream, body)):
            pass

    def retire(self, role: str) -> None:
        """A call may still be inside ``role``'s pool and never come back (a hung forward):
        the next entry gets a fresh pool, and this one is released only at ``close``."""
        with self._lock:
            pool = self._pools.pop(role, None)
            if pool is not None:
                self._retired.append(pool)

    def reserved(self, role: str) -> int:
        """Bytes the pool of ``role`` holds on the device (0 before its first use)."""
        if self._allocator is None:
            return 0
        # Under the lock, so that no reference of ours outlives a concurrent close's drop.
        with self._lock:
            pool = self._pools.get(role)
            return 0 if pool is None else self._allocator.pool_stats(pool)[0]

    def stats(self) -> dict[str, PoolStats] | None:
        """Per kind of pool (``weights``, ``activations``, ``graphs``, ``staging``): bytes
        reserved and allocated; None when inert or closed."""
        if self._allocator is None or self.closed:
            return None
        figures: dict[str, list[int]] = {}
        # Under the lock, so that no reference of ours outlives a concurrent close's drop (the
        # pool would then die here, outside the gate).
        with self._lock:
            if self.closed:
                return None
            pools = list(self._pools.items()) + [("activations", p) for p in self._retired]
            pool = None
            for role, pool in pools:
                reserved, allocated = self._allocator.pool_stats(pool)
                total = figures.setdefault(role_kind(role), [0, 0])
                total[0] += reserved
                total[1] += allocated
            pools = pool = None
        return {kind: PoolStats(*figure) for kind, figure in figures.items()}

    def free_and_total(self) -> tuple[int, int]:
        """The device's free and total memory now."""
        return self._allocator.free_and_total(self.device)

    def device_stats(self) -> PoolStats:
        """What this process's allocator holds on the device, every pool together."""
        return PoolStats(*self._allocator.device_stats(self.device))

    def reclaim(self) -> None:
        """After running out of memory inside a pool (where the allocator frees no other
        cached block first): wait until no thread is inside any pool, then give every cached,
        unused segment outside live pools back to the device. The caller must be in no pool."""
        if self._allocator is None:
            return
        with allocator.GATE.exclusive():
            self._allocator.empty_cache(self.device)

    def close(self, before: Callable[[], None] | None = None) -> None:
        """The model is gone: with no thread inside any pool, run ``before`` (drop what still
        uses the pools: the module, graphs, buffers), then drop every pool and give their
        segments back to the device. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        if self._allocator is None:
            if before is not None:
                before()
            return
        with allocator.GATE.exclusive():
            try:
                if before is not None:
                    before()
            finally:
                with self._lock:
                    pools = list(self._pools.values()) + self._retired
                    self._pools.clear()
                    self._retired = []
                while pools:
                    pool = pools.pop()
                    self._allocator.drop(pool)
                    del pool  # its last reference: the allocator releases it here, gate held
                self._allocator.empty_cache(self.device)

    # -- for _PoolEntry -------------------------------------------------------------------------

    def _enter(self, role: str) -> Any:
        """The pool of ``role`` for this thread, made on first use; refuses a second thread."""
        me = threading.get_ident()
        with self._lock:
            if self.closed:
                raise RuntimeError(f"model '{self.name}': its memory was closed; no pool can "
                                   "be entered any more")
            holder = self._inside.get(role)
            if holder is not None and holder != me:
                raise RuntimeError(
                    f"model '{self.name}': two threads in its {role!r} memory pool at once; "
                    "the allocator refuses that (a defect in batchgate)")
            pool = self._pools.get(role)
            if pool is None:
                pool = self._pools[role] = self._allocator.new_pool(self.device)
            self._inside[role] = me
            return self._allocator.pool_id(pool)

    def _leave(self, role: str) -> None:
        with self._lock:
            self._inside.pop(role, None)


class _PoolEntry:
    """One thread's stay in one of a model's pools (``ModelMemory.use``/``capture``).

    Order on entry: the thread's library workspaces for its current stream (outside any pool),
    the gate shared, the role's pool (one thread at a time), the allocator's routing; undone in
    reverse. Only the pool's id is held here (see ``allocator._CudaPoolEntry``)."""

    __slots__ = ("_memory", "_role", "_capture", "_nested", "_steps")
    _local = threading.local()

    def __init__(self, memory: ModelMemory, role: str,
                 capture: tuple[Any, Any, Callable[[], None]] | None = None) -> None:
        self._memory = memory
        self._role = role
        self._capture = capture
        self._nested = False
        self._steps: contextlib.ExitStack | None = None

    def __enter__(self) -> None:
        memory, role = self._memory, self._role
        current = getattr(self._local, "inside", None)
        if current is not None:
            if current == (id(memory), role) and self._capture is None:
                self._nested = True
                return
            raise RuntimeError(
                f"model '{memory.name}': a thread inside memory pool {current[1]!r} asked for "
                f"pool {role!r}; a thread is in one pool at a time (a defect in batchgate)")
        alloc = memory.allocator
        if self._capture is None and role_kind(role) in RUNS_MODEL:
            alloc.prepare_thread(memory.device)
        steps = contextlib.ExitStack()
        try:
            steps.enter_context(allocator.GATE.shared())
            pool_id = memory._enter(role)
            steps.callback(memory._leave, role)
            self._local.inside = (id(memory), role)
            steps.callback(setattr, self._local, "inside", None)
            if self._capture is None:
                steps.enter_context(alloc.using(pool_id, memory.device))
            else:
                graph, stream, body = self._capture
                alloc.capture(graph, pool_id, stream, body)
        except BaseException:
            steps.close()
            raise
        self._steps = steps

    def __exit__(self, *exc: Any) -> None:
        if self._nested:
            return
        steps, self._steps = self._steps, None
        if steps is not None:
            steps.close()


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
