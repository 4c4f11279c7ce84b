"""The device allocator's contract, and the one place batchgate talks to it.

Each model's device memory comes from ``torch.cuda.MemPool`` pools of its own
(``batcher/gpu.py``). PyTorch's caching allocator allows that only under rules its own source
enforces, some by raising, some by aborting the process from an assertion:

- entering a pool (``use_mem_pool``, and a CUDA graph's capture) refuses a pool that some
  thread is already recording into ("already recording to mempool_id"), and it has bumped the
  pool's use count before refusing, so the count leaks: two threads must never be inside one
  pool at once;
- a ``MemPool`` that dies releases its pool and empties its cache, and that path asserts that
  no thread is recording into any pool; ``empty_cache()`` while any pool is being recorded into
  skips the shared cache without a word: pools are dropped, and caches emptied, only while no
  thread is inside any pool;
- while a thread allocates into a pool, the allocator frees no other cached block before it
  raises out of memory;
- cuBLAS and cuBLASLt workspaces are allocated on a handle's first use on a stream, wherever
  that thread is allocating then, and are never freed: a thread's workspaces for a stream are
  made before it enters a pool on that stream;
- graphs replayed at once on different streams must not share a graph pool.

Hence two pieces here. ``GATE``, one per process: entering any pool takes it shared, dropping
a pool or emptying the cache takes it exclusive, and a waiting exclusive holder keeps new
entries out, so an unload (or an out-of-memory reclaim) waits at most one batch per pool. And
the ``Allocator`` interface, which everything that creates, enters, drops, measures or captures
into a pool goes through: ``CudaAllocator`` is PyTorch's, and ``for_device`` picks it for a CUDA
device. On the CPU there is none (pools are inert) unless ``install`` put another in place: the
test suite installs a double of the contract (``tests/support/allocator_contract.py``) that
fails a test whenever code breaks one of the rules above, so the executor's threading is held
to the contract on machines without a GPU.

The rules come from the C++ of ``c10/cuda/CUDACachingAllocator.cpp`` (``beginAllocateToPool``,
``releasePool``, ``emptyCache``, ``malloc``'s out-of-memory path), ``MemPool``'s destructor and
``aten/src/ATen/cuda/CublasHandlePool.cpp``, in the torch releases batchgate supports.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import structlog
import torch

log = structlog.get_logger(__name__)


class PoolGate:
    """Shared for the threads inside pools, exclusive for dropping pools and emptying caches.

    Writer-preferring: once an exclusive holder waits, new shared entries wait behind it (an
    unload is not starved by batches that keep coming). A thread may take it shared again
    while it holds it shared (nesting counts); asking for it exclusively while holding it
    shared is a defect (it would wait for itself) and raises.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._shared = 0  # threads holding it shared
        self._exclusive: int | None = None  # the thread holding it exclusively
        self._waiting_exclusive = 0
        self._local = threading.local()

    def _depth(self) -> int:
        return getattr(self._local, "depth", 0)

    @property
    def held_shared(self) -> bool:
        """Whether this thread holds the gate shared (is inside a pool)."""
        return self._depth() > 0

    @property
    def held_exclusive(self) -> bool:
        """Whether this thread holds the gate exclusively."""
        return self._exclusive == threading.get_ident()

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        depth = self._depth()
        if depth == 0 and not self.held_exclusive:
            with self._cond:
                while self._exclusive is not None or self._waiting_exclusive:
                    self._cond.wait()
                self._shared += 1
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth
            if depth == 0 and not self.held_exclusive:
                with self._cond:
                    self._shared -= 1
                    if self._shared == 0:
                        self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        if self._depth():
            raise RuntimeError("the pool gate was asked for exclusively by a thread inside a "
                               "pool: it would wait for itself")
        me = threading.get_ident()
        if self._exclusive == me:  # nested: already ours
            yield
            return
        with self._cond:
            self._waiting_exclusive += 1
            try:
                while self._exclusive is not None or self._shared:
                    self._cond.wait()
            finally:
                self._waiting_exclusive -= 1
            self._exclusive = me
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = None
                self._cond.notify_all()


GATE = PoolGate()


class Allocator:
    """What batchgate asks of a device allocator with pools (module docstring). Pools are the
    allocator's objects; callers hold them only through ``batcher/gpu.py``'s ``ModelMemory``."""

    supports_graphs = False

    def new_pool(self, device: torch.device) -> Any:
        raise NotImplementedError

    def pool_id(self, pool: Any) -> Any:
        """The handle a graph capture names the pool by."""
        raise NotImplementedError

    def using(self, pool_id: Any, device: torch.device) -> contextlib.AbstractContextManager:
        """Route this thread's allocations on ``device`` to the pool (GATE held shared)."""
        raise NotImplementedError

    def drop(self, pool: Any) -> None:
        """The pool is no longer wanted (GATE held exclusively; the caller drops its last
        reference right after)."""

    def empty_cache(self, device: torch.device) -> None:
        """Give cached, unused segments back to the device (GATE held exclusively)."""
        raise NotImplementedError

    def pool_stats(self, pool: Any) -> tuple[int, int]:
        """(bytes reserved, bytes allocated) of the pool's segments."""
        raise NotImplementedError

    def device_stats(self, device: torch.device) -> tuple[int, int]:
        """(bytes reserved, bytes allocated) by this process on ``device``, every pool together."""
        raise NotImplementedError

    def free_and_total(self, device: torch.device) -> tuple[int, int]:
        """The device's free and total memory now."""
        raise NotImplementedError

    def prepare_thread(self, device: torch.device) -> None:
        """Make this thread's library workspaces for the current stream outside any pool."""

    def stream(self, device: torch.device) -> Any:
        """A stream of its own on ``device`` (None where there are no streams)."""
        return None

    def new_graph(self) -> Any:
        raise NotImplementedError

    def capture(self, graph: Any, pool_id: Any, stream: Any, body: Callable[[], None]) -> None:
        """Capture ``body`` into ``graph``, its allocations into the pool (GATE held shared)."""
        raise NotImplementedError

    def replay(self, graph: Any) -> None:
        raise NotImplementedError

    def synchronize(self, stream: Any) -> None:
        """Wait for ``stream``'s work (None: nothing to wait for)."""


class CudaAllocator(Allocator):
    """PyTorch's caching allocator."""

    supports_graphs = True

    def __init__(self) -> None:
        self._prepared = threading.local()
        # A pool that something still referenced when it was dropped: kept referenced here
        # for the process's life, so that it cannot die later at a moment when a thread is
        # inside a pool (its destructor would then abort the process).
        self._kept: list[Any] = []

    def new_pool(self, device: torch.device) -> Any:
        with torch.cuda.device(device):
            return torch.cuda.MemPool()

    def pool_id(self, pool: Any) -> Any:
        return pool.id

    def using(self, pool_id: Any, device: torch.device) -> contextlib.AbstractContextManager:
        return _CudaPoolEntry(pool_id, device.index if device.index is not None
                              else torch.cuda.current_device())

    def drop(self, pool: Any) -> None:
        # The caller's reference, this frame's and getrefcount's own: any more and the pool
        # would outlive the gate.
        if sys.getrefcount(pool) > 3:
            log.error("memory_pool_still_referenced", pool=str(pool.id),
                      effect="kept for the process's life instead of released")
            self._kept.append(pool)

    def empty_cache(self, device: torch.device) -> None:
        with torch.cuda.device(device):
            torch.cuda.empty_cache()

    def pool_stats(self, pool: Any) -> tuple[int, int]:
        try:
            segments = pool.snapshot(include_traces=False)
        except TypeError:  # a torch whose snapshot takes no arguments
            segments = pool.snapshot()
        reserved = sum(s.get("total_size", 0) for s in segments)
        allocated = sum(s.get("allocated_size", 0) for s in segments)
        return reserved, allocated

    def device_stats(self, device: torch.device) -> tuple[int, int]:
        return torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)

    def free_and_total(self, device: torch.device) -> tuple[int, int]:
        return torch.cuda.mem_get_info(device)

    def prepare_thread(self, device: torch.device) -> None:
        stream = torch.cuda.current_stream(device)
        done = getattr(self._prepared, "streams", None)
        if done is None:
            done = self._prepared.streams = set()
        key = (device.index, stream.cuda_stream)
        if key in done:
            return
        warm_library_handles(device)
        done.add(key)

    def stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def new_graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def capture(self, graph: Any, pool_id: Any, stream: Any, body: Callable[[], None]) -> None:
        with torch.cuda.stream(stream):
            graph.capture_begin(pool_id, capture_error_mode="thread_local")
            try:
                body()
            finally:
                try:
                    graph.capture_end()
                except BaseException:
                    # A capture_end that raises leaves the pool recorded into for good (every
                    # later empty_cache would skip the shared cache, and a pool's destructor
                    # would abort): end the recording ourselves.
                    with contextlib.suppress(Exception):
                        torch._C._cuda_endAllocateToPool(stream.device.index, pool_id)
                    raise

    def replay(self, graph: Any) -> None:
        graph.replay()

    def synchronize(self, stream: Any) -> None:
        if stream is not None:
            stream.synchronize()


class _CudaPoolEntry:
    """``use_mem_pool`` by the pool's id: nothing here holds the ``MemPool`` itself, so an
    exception's traceback that keeps this object cannot keep the pool alive past its drop."""

    __slots__ = ("_pool_id", "_device")

    def __init__(self, pool_id: Any, device_index: int) -> None:
        self._pool_id = pool_id
        self._device = device_index

    def __enter__(self) -> None:
        torch._C._cuda_beginAllocateCurrentThreadToPool(self._device, self._pool_id)

    def __exit__(self, *exc: Any) -> None:
        torch._C._cuda_endAllocateToPool(self._device, self._pool_id)
        torch._C._cuda_releasePool(self._device, self._pool_id)


def warm_library_handles(device: torch.device) -> None:
    """Run a tiny matmul of each kind on the current stream, outside any pool, so that this
    thread's cuBLAS and cuBLASLt handles have their workspaces for the stream before the thread
    enters a pool (where they would otherwise land, for good)."""
    with torch.cuda.device(device), torch.inference_mode():
        dtypes = [torch.float32, torch.float16]
        if torch.cuda.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        for dtype in dtypes:
            a = torch.ones(8, 8, dtype=dtype, device=device)
            bias = torch.ones(8, dtype=dtype, device=device)
            torch.mm(a, a)
            torch.addmm(bias, a, a)  # bias epilogues go through cuBLASLt


_installed: Allocator | None = None
_cuda: CudaAllocator | None = None
_lock = threading.Lock()


def pools_supported() -> bool:
    """Whether this torch can route a thread's allocations to a pool of its own."""
    return hasattr(torch.cuda, "MemPool") and hasattr(
        torch._C, "_cuda_beginAllocateCurrentThreadToPool")


def for_device(device: str | torch.device) -> Allocator | None:
    """The allocator that gives ``device``'s models pools of their own, or None (the CPU)."""
    global _cuda
    device = torch.device(device)
    if _installed is not None:
        return _installed
    if device.type != "cuda" or not pools_supported():
        return None
    with _lock:
        if _cuda is None:
            _cuda = CudaAllocator()
        return _cuda


@contextlib.contextmanager
def install(allocator: Allocator) -> Iterator[Allocator]:
    """Use ``allocator`` for every device while the block runs (the test suite's double)."""
    global _installed
    previous, _installed = _installed, allocator
    try:
        yield allocator
    finally:
        _installed = previous
