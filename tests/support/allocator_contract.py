"""A double of the CUDA caching allocator's pool contract, for the CPU suite.

``ContractAllocator`` stands in for ``batcher.allocator.CudaAllocator`` (``allocator.install``)
so that, on the CPU, every model gets pools, graphs are "captured" and "replayed", and the
executor's threads enter pools exactly as they do on a GPU. It enforces what the real allocator
enforces (``batcher/allocator.py`` lists the rules) and fails the caller, like the real one,
whenever code breaks a rule:

- a thread entering a pool some thread is recording into: RuntimeError "already recording to
  mempool_id", after bumping the pool's use count (as the real one leaks it);
- a pool dropped, or the cache emptied, while any thread is inside any pool (the real
  destructor's assertion aborts the process; the real ``empty_cache`` skips the shared cache);
- a pool dropped twice, or entered after its drop;
- any of that outside the process's pool gate (shared to enter, exclusive to drop or empty);
- a thread's library workspaces made while it is inside a pool;
- two graphs of one pool replayed at the same time by different threads.

Each violation is also kept in ``violations``, which the ``contract`` fixture asserts empty at
the end of the test, so one swallowed by a batch's error handling still fails the test.

Model code can make the double's pools hold bytes (``allocate``/``free``), attributed to the
pool the calling thread is recording into, so footprints are measured from pools as on a GPU.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from batchgate.batcher import allocator


class ContractViolation(RuntimeError):
    """What the real allocator would raise (or abort on)."""


class FakePool:
    def __init__(self, pool_id: tuple[int, int], device: torch.device) -> None:
        self.id = pool_id
        self.device = device
        self.use_count = 1
        self.dropped = False
        self.reserved = 0
        self.allocated = 0


class FakeGraph:
    def __init__(self, contract: ContractAllocator) -> None:
        self._contract = contract
        self.pool_id: tuple[int, int] | None = None
        self.body: Callable[[], None] | None = None

    def __del__(self) -> None:
        if self.pool_id is not None:
            self._contract._graph_died(self.pool_id)


class ContractAllocator(allocator.Allocator):
    """The rules of ``batcher/allocator.py``'s docstring, enforced on the CPU."""

    supports_graphs = True

    def __init__(self, *, total_bytes: int = 80 << 30, free_bytes: int | None = None) -> None:
        """``free_bytes``: what the device reports free (default: total less the pools')."""
        self.total_bytes = total_bytes
        self.free_bytes = free_bytes
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self.pools: dict[tuple[int, int], FakePool] = {}
        self.recording: dict[tuple[int, int], int] = {}  # pool id -> thread inside it
        self._thread_pool: dict[int, tuple[int, int]] = {}
        self._replaying: dict[tuple[int, int], int] = {}  # pool id -> thread replaying
        self.violations: list[str] = []
        self.entries: list[tuple[str, tuple[int, int]]] = []  # (thread name, pool id)
        self.prepared: set[tuple[int, str]] = set()
        self.emptied = 0
        self.dropped = 0
        self.captures = 0
        self.captured: dict[tuple[int, int], set[str]] = {}  # pool id -> capturing threads

    # -- rules ----------------------------------------------------------------------------------

    def _violate(self, text: str) -> None:
        self.violations.append(text)
        raise ContractViolation(text)

    def assert_clean(self) -> None:
        assert not self.violations, "the allocator's contract was broken:\n" + "\n".join(
            self.violations)

    # -- pools ----------------------------------------------------------------------------------

    def new_pool(self, device: torch.device) -> FakePool:
        with self._lock:
            pool = FakePool((0, next(self._ids)), torch.device(device))
            self.pools[pool.id] = pool
            return pool

    def pool_id(self, pool: FakePool) -> tuple[int, int]:
        return pool.id

    @contextlib.contextmanager
    def using(self, pool_id: tuple[int, int], device: torch.device) -> Iterator[None]:
        self._begin(pool_id, "enter")
        try:
            yield
        finally:
            self._end(pool_id)

    def _begin(self, pool_id: tuple[int, int], what: str) -> None:
        me = threading.get_ident()
        with self._lock:
            pool = self.pools.get(pool_id)
            if pool is None or pool.dropped:
                self._violate(f"{what}: pool {pool_id} was dropped or never made")
            pool.use_count += 1  # bumped before the check, as the real one does
            if not allocator.GATE.held_shared:
                self._violate(f"{what} pool {pool_id} outside the pool gate")
            if pool_id in self.recording:
                self._violate("beginAllocateToPool: already recording to mempool_id "
                              f"{pool_id} (by another thread)")
            if me in self._thread_pool:
                self._violate(f"{what} pool {pool_id} by a thread already inside pool "
                              f"{self._thread_pool[me]}")
            self.recording[pool_id] = me
            self._thread_pool[me] = pool_id
            self.entries.append((threading.current_thread().name, pool_id))

    def _end(self, pool_id: tuple[int, int]) -> None:
        me = threading.get_ident()
        with self._lock:
            if self.recording.get(pool_id) == me:
                del self.recording[pool_id]
                self._thread_pool.pop(me, None)
                self.pools[pool_id].use_count -= 1

    def drop(self, pool: FakePool) -> None:
        with self._lock:
            if not allocator.GATE.held_exclusive:
                self._violate(f"pool {pool.id} dropped outside the pool gate")
            if self.recording:
                self._violate(f"pool {pool.id} dropped while threads are inside pools "
                              f"{sorted(self.recording)}: the allocator asserts (abort)")
            if pool.dropped:
                self._violate(f"pool {pool.id} released twice")
            pool.dropped = True
            pool.use_count -= 1
            self.dropped += 1

    def empty_cache(self, device: torch.device) -> None:
        with self._lock:
            if not allocator.GATE.held_exclusive:
                self._violate("empty_cache outside the pool gate")
            if self.recording:
                self._violate("empty_cache while threads are inside pools "
                              f"{sorted(self.recording)}: the shared cache would be skipped")
            self.emptied += 1
            for pool in self.pools.values():
                if pool.dropped and pool.use_count <= 0:
                    pool.reserved = pool.allocated = 0

    # -- measuring ------------------------------------------------------------------------------

    def allocate(self, nbytes: int) -> tuple[tuple[int, int], int] | None:
        """Bytes allocated by the calling thread, into the pool it is inside (None: none)."""
        with self._lock:
            pool_id = self._thread_pool.get(threading.get_ident())
            if pool_id is None:
                return None
            pool = self.pools[pool_id]
            pool.allocated += nbytes
            pool.reserved = max(pool.reserved, pool.allocated)  # cached segments stay
            return pool_id, nbytes

    def free(self, token: tuple[tuple[int, int], int] | None) -> None:
        if token is not None:
            with self._lock:
                self.pools[token[0]].allocated -= token[1]

    def pool_stats(self, pool: FakePool) -> tuple[int, int]:
        return pool.reserved, pool.allocated

    def device_stats(self, device: torch.device) -> tuple[int, int]:
        with self._lock:
            live = [p for p in self.pools.values() if p.reserved]
            return sum(p.reserved for p in live), sum(p.allocated for p in live)

    def free_and_total(self, device: torch.device) -> tuple[int, int]:
        if self.free_bytes is not None:
            return self.free_bytes, self.total_bytes
        return self.total_bytes - self.device_stats(device)[0], self.total_bytes

    def prepare_thread(self, device: torch.device) -> None:
        me = threading.get_ident()
        with self._lock:
            if me in self._thread_pool:
                self._violate("library workspaces made by a thread inside pool "
                              f"{self._thread_pool[me]}: they would stay in it for good")
            self.prepared.add((me, str(device)))

    # -- graphs ---------------------------------------------------------------------------------

    def new_graph(self) -> FakeGraph:
        return FakeGraph(self)

    def capture(self, graph: FakeGraph, pool_id: tuple[int, int], stream: Any,
                body: Callable[[], None]) -> None:
        self._begin(pool_id, "capture into")
        try:
            body()
            with self._lock:
                self.pools[pool_id].use_count += 1  # the graph holds the pool
                graph.pool_id, graph.body = pool_id, body
                self.captures += 1
                self.captured.setdefault(pool_id, set()).add(threading.current_thread().name)
        finally:
            self._end(pool_id)

    def replay(self, graph: FakeGraph) -> None:
        me = threading.get_ident()
        with self._lock:
            other = self._replaying.get(graph.pool_id)
            if other is not None and other != me:
                self._violate(f"two graphs of pool {graph.pool_id} replayed at once on "
                              "different threads: they share intermediate buffers")
            self._replaying[graph.pool_id] = me
        try:
            graph.body()
        finally:
            with self._lock:
                if self._replaying.get(graph.pool_id) == me:
                    del self._replaying[graph.pool_id]

    def _graph_died(self, pool_id: tuple[int, int]) -> None:
        with self._lock:
            pool = self.pools.get(pool_id)
            if pool is not None:
                pool.use_count -= 1

    # -- for the tests --------------------------------------------------------------------------

    def live_pools(self) -> list[FakePool]:
        with self._lock:
            return [p for p in self.pools.values() if not p.dropped]

    def threads_in(self, pool_id: tuple[int, int]) -> set[str]:
        with self._lock:
            return {name for name, entered in self.entries if entered == pool_id}


@contextlib.contextmanager
def contract_installed(**kwargs: Any) -> Iterator[ContractAllocator]:
    """The double in place of every device's allocator, checked clean at the end."""
    contract = ContractAllocator(**kwargs)
    with allocator.install(contract):
        yield contract
    contract.assert_clean()
