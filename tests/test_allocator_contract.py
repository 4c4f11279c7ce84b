"""The executor's threads held to the CUDA caching allocator's pool contract, on the CPU.

Every test here runs its models with ``tests.support.allocator_contract``'s double in place of
the allocator, so models get pools, CUDA-graph captures and replays as on a GPU, and any thread
that breaks a rule of the contract (``batcher/allocator.py``: one thread inside a pool at a
time; nothing inside any pool when a pool is dropped or the cache emptied; library workspaces
made outside pools; graphs of one pool never replayed at once) fails the test. What they stress
is what a GPU's first load test would: two batches in flight, two instances, unload and load
while others serve, out of memory, graph capture while serving, a hung call.
"""

from __future__ import annotations

import asyncio
import gc
import threading

import numpy as np
import pytest
import torch

from batchgate.batcher import allocator, gpu
from batchgate.batcher.errors import ModelExecutionError
from batchgate.batcher.memory import DevicePools, PoolSettings
from batchgate.batcher.model import ServedModel
from batchgate.batcher.request import InferenceRequest
from batchgate.batcher.spec import BatchingConfig, ModelSpec, TensorSpec
from tests.support.allocator_contract import ContractAllocator, contract_installed
from tests.support.polling import poll

WIDTH = 128
MIB = 1 << 20


class Scale(torch.nn.Module):
    """y = factor * x through a matmul (which releases the GIL, so threads overlap), holding
    ``activation`` bytes per row of the contract's pool while it runs."""

    def __init__(self, contract: ContractAllocator, factor: float, *,
                 activation: int = 4096) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.eye(WIDTH) * factor, requires_grad=False)
        self._contract = contract
        self._activation = activation
        self.oom_rows: int | None = None  # a batch of more rows raises CUDA's out-of-memory
        self.oom_times = 0
        self.hang: threading.Event | None = None  # set: the next forward waits on it
        self.hanging = threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        token = self._contract.allocate(self._activation * x.shape[0])
        try:
            if self.oom_rows is not None and x.shape[0] > self.oom_rows and self.oom_times:
                self.oom_times -= 1
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            gate, self.hang = self.hang, None
            if gate is not None:
                self.hanging.set()
                gate.wait(30)
            return torch.nn.functional.linear(x, self.weight)
        finally:
            self._contract.free(token)


def _spec(name: str, *, instances: int = 2, inflight: int = 2, graphs: bool = False,
          staging: str = "queue", timeout_ms: int = 0) -> ModelSpec:
    return ModelSpec(
        name=name, version="1", platform="test",
        inputs=(TensorSpec("x", "FP32", (WIDTH,)),), outputs=(TensorSpec("y", "FP32", (WIDTH,)),),
        batching=BatchingConfig(max_batch_size=8, max_inflight_batches=inflight),
        instance_count=instances, buckets=(1, 2, 4, 8), cuda_graphs=graphs,
        input_staging=staging, execution_timeout_ms=timeout_ms)


def _served(name: str, contract: ContractAllocator, pools: DevicePools, factor: float,
            **fields) -> tuple[ServedModel, Scale]:
    memory = gpu.ModelMemory("cpu", name)
    with memory.use():  # the load: its weights come from its weights pool
        module = Scale(contract, factor)
        weights = contract.allocate(WIDTH * WIDTH * 4)
    assert weights is not None
    return ServedModel(_spec(name, **fields), module, pools=pools, memory=memory), module


async def _check(model: ServedModel, factor: float, rows: int, seed: int) -> None:
    x = np.random.default_rng(seed).standard_normal((rows, WIDTH), dtype=np.float32)
    out = await model.infer(InferenceRequest([x], batch_size=rows))
    np.testing.assert_allclose(out["y"], x * factor, rtol=1e-6)


async def _traffic(model: ServedModel, factor: float, rounds: int) -> None:
    for i in range(rounds):
        await asyncio.gather(*(_check(model, factor, rows, 100 * i + rows)
                               for rows in (1, 3, 8, 2, 5, 1, 7)))


async def _traffic_until(model: ServedModel, factor: float, stop: asyncio.Event) -> int:
    rounds = 0
    while not stop.is_set():
        await _traffic(model, factor, 1)
        rounds += 1
    return rounds


def _threads_per_pool(contract: ContractAllocator) -> dict[tuple[int, int], set[str]]:
    return {pool_id: contract.threads_in(pool_id) for pool_id in contract.pools}


async def test_two_batches_in_flight_on_two_instances_keep_one_thread_in_each_pool():
    with contract_installed() as contract:
        model, _ = _served("m", contract, DevicePools(PoolSettings()), 3.0)
        model.start()
        try:
            await _traffic(model, 3.0, 20)
        finally:
            model.stop(5)
        # Each pool had one thread in it, ever: the weights' the loader, each instance's
        # compute pool its model thread (which also warmed it up).
        entered = {pool: names for pool, names in _threads_per_pool(contract).items() if names}
        assert all(len(names) == 1 for names in entered.values()), entered
        assert {"m-0-compute", "m-1-compute"} <= set().union(*entered.values())
        # Library workspaces were made outside the pools by every thread that runs the model.
        assert len(contract.prepared) >= 3
        assert not contract.live_pools() and contract.emptied >= 1


async def test_unloading_and_loading_while_another_model_serves_keeps_the_contract():
    with contract_installed() as contract:
        pools = DevicePools(PoolSettings())
        serving, _ = _served("serving", contract, pools, 2.0)
        leaving, _ = _served("leaving", contract, pools, 5.0)
        serving.start()
        leaving.start()
        try:
            stop = asyncio.Event()
            traffic = asyncio.ensure_future(_traffic_until(serving, 2.0, stop))
            await _traffic(leaving, 5.0, 3)
            live = len(contract.live_pools())
            emptied = contract.emptied
            await asyncio.to_thread(leaving.stop, 5)  # its pools go while "serving" serves
            assert len(contract.live_pools()) < live and contract.emptied > emptied
            assert leaving.memory.closed and leaving.memory.stats() is None
            arriving, _ = _served("arriving", contract, pools, 7.0)
            await asyncio.to_thread(arriving.start)  # loads while "serving" serves
            try:
                await _traffic(arriving, 7.0, 3)
            finally:
                await asyncio.to_thread(arriving.stop, 5)
            stop.set()
            assert await traffic > 0
        finally:
            serving.stop(5)
        assert not contract.live_pools()


async def test_unload_drops_every_view_of_the_arena_so_its_memory_is_freed():
    with contract_installed() as contract:
        model, _ = _served("m", contract, DevicePools(PoolSettings()), 3.0)
        model.start()
        await _traffic(model, 3.0, 3)
        storage = model._arena[1]._raw.untyped_storage()
        handle = storage._weak_ref()
        del storage
        try:
            model.stop(5)
            gc.collect()
            assert torch.UntypedStorage._expired(handle), "a view of the arena outlived unload"
        finally:
            torch.UntypedStorage._free_weak_ref(handle)


async def test_out_of_memory_leaves_the_pool_gives_the_cache_back_and_retries_first():
    with contract_installed() as contract:
        pools = DevicePools(PoolSettings())
        other, _ = _served("other", contract, pools, 2.0)
        model, module = _served("m", contract, pools, 3.0, instances=1)
        other.start()
        model.start()
        try:
            stop = asyncio.Event()
            traffic = asyncio.ensure_future(_traffic_until(other, 2.0, stop))
            module.oom_rows, module.oom_times = 4, 1  # the next batch over 4 rows fails once
            emptied = contract.emptied
            await _check(model, 3.0, 8, 1)
            # The retry ran after the cache was emptied (with nobody inside a pool: the gate
            # waited for "other"'s batches), and was not split: the bucket stays whole.
            assert contract.emptied == emptied + 1
            assert model._buckets.largest == 8
            module.oom_rows, module.oom_times = 4, 2  # fails, and fails again after reclaim
            await _check(model, 3.0, 8, 2)
            assert model._buckets.largest == 4  # split, and lowered for a while
            stop.set()
            await traffic
        finally:
            model.stop(5)
            other.stop(5)


async def test_graphs_are_captured_per_instance_while_another_model_serves():
    with contract_installed() as contract:
        pools = DevicePools(PoolSettings())
        serving, _ = _served("serving", contract, pools, 2.0, graphs=True)
        serving.start()
        try:
            assert serving.load_report["cuda_graphs_status"].startswith("captured"), \
                serving.load_report
            stop = asyncio.Event()
            traffic = asyncio.ensure_future(_traffic_until(serving, 2.0, stop))
            late, _ = _served("late", contract, pools, 4.0, graphs=True)
            await asyncio.to_thread(late.start)  # captures while "serving" replays
            try:
                assert late.load_report["cuda_graphs_status"].startswith("captured")
                await _traffic(late, 4.0, 5)
            finally:
                await asyncio.to_thread(late.stop, 5)
            stop.set()
            await traffic
        finally:
            serving.stop(5)
        # Four graph pools (two models, two instances each), each captured into by its own
        # instance's model thread only.
        assert contract.captures == 2 * 2 * 4  # models x instances x buckets
        assert len(contract.captured) == 4
        assert all(len(names) == 1 and next(iter(names)).endswith("-compute")
                   for names in contract.captured.values()), contract.captured


async def test_a_hung_call_keeps_its_pool_and_the_next_batch_gets_a_fresh_one():
    with contract_installed() as contract:
        model, module = _served("m", contract, DevicePools(PoolSettings()), 3.0, instances=1,
                                inflight=1, timeout_ms=200)
        model.start()
        release = threading.Event()
        try:
            module.hang = release
            with pytest.raises(ModelExecutionError, match="execution_timeout_ms"):
                await _check(model, 3.0, 2, 1)
            assert module.hanging.is_set()
            # The abandoned runner is still inside its compute pool: the next batch runs on a
            # fresh runner, in a fresh pool.
            await _check(model, 3.0, 3, 2)
            release.set()
            await asyncio.to_thread(poll, lambda: model._executors[0].hung_calls == 0, 10,
                                    "the hung call returned")
        finally:
            release.set()
            model.stop(5)
        assert not contract.live_pools()  # the hung call's pool too, once it came back


def test_the_gate_keeps_a_drop_waiting_until_no_thread_is_inside_a_pool():
    with contract_installed() as contract:
        memory = gpu.ModelMemory("cpu", "m")
        inside, leave, closed = threading.Event(), threading.Event(), threading.Event()

        def batch() -> None:
            with memory.use(gpu.role("compute", 0)):
                inside.set()
                leave.wait(10)

        def unload() -> None:
            memory.close()
            closed.set()

        runner = threading.Thread(target=batch)
        runner.start()
        assert inside.wait(10)
        closer = threading.Thread(target=unload)
        closer.start()
        poll(lambda: allocator.GATE._waiting_exclusive == 1, 10, "the unload waits at the gate")
        assert not closed.is_set() and contract.dropped == 0  # held back by the batch
        leave.set()
        runner.join(10)
        closer.join(10)
        assert closed.is_set() and contract.dropped == 1 and contract.emptied == 1


def test_two_threads_in_one_role_are_refused_before_the_allocator_sees_them():
    with contract_installed() as contract:
        memory = gpu.ModelMemory("cpu", "m")
        inside, leave = threading.Event(), threading.Event()

        def hold() -> None:
            with memory.use("compute0"):
                inside.set()
                leave.wait(10)

        holder = threading.Thread(target=hold)
        holder.start()
        assert inside.wait(10)
        try:
            with pytest.raises(RuntimeError, match="two threads in its 'compute0' memory pool"):
                with memory.use("compute0"):
                    pass
            with memory.use("compute1"):  # another role: a pool of its own
                pass
        finally:
            leave.set()
            holder.join(10)
        memory.close()
    assert not contract.violations
