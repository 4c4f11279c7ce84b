"""DevicePool: views into one reserved buffer, model admission, buckets, trace replay (CPU)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgate.batcher.errors import ResourceExhausted
from batchgate.batcher.allocation_trace import mixed_trace, peak_live_bytes, replay_trace
from batchgate.batcher.memory_plan import MemoryPlan, model_plan, plan_for
from batchgate.batcher.pool import DevicePool, bucket_for, default_buckets, unpooled_reservation

CUDA = torch.cuda.is_available()
MIB = 1 << 20


def _spans(handles):
    base = handles[0]._pool._buffer.data_ptr()
    return sorted((h.tensor.data_ptr() - base, h.tensor.data_ptr() - base + h.nbytes)
                  for h in handles)


def _check_views(device: str) -> None:
    pool = DevicePool(device, 4 * MIB)
    storage = pool._buffer.untyped_storage().data_ptr()
    requests = [((3, 5), torch.float32), ((7,), torch.int64), ((2, 3, 4), torch.float16),
                ((1000,), torch.uint8), ((0, 4), torch.float32), ((9,), torch.bool)]
    handles = [pool.allocate(shape, dtype) for shape, dtype in requests]
    for handle, (shape, dtype) in zip(handles, requests):
        assert handle is not None and handle.in_pool
        assert handle.tensor.shape == shape and handle.tensor.dtype == dtype
        assert handle.tensor.device == pool.device
        assert handle.tensor.untyped_storage().data_ptr() == storage
        assert handle.tensor.data_ptr() % pool.alignment == 0
    spans = _spans(handles)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start, f"allocations overlap: {spans}"
    for i, handle in enumerate(handles):
        if handle.tensor.dtype != torch.bool:
            handle.tensor.fill_(i + 1)
    for i, handle in enumerate(handles):
        if handle.tensor.numel() and handle.tensor.dtype != torch.bool:
            assert bool((handle.tensor == i + 1).all()), f"tensor {i} was overwritten"
    assert pool.bytes_in_use > 0
    pool._allocator.check_invariants()
    for handle in handles:
        handle.release()
    assert pool.bytes_in_use == 0
    assert pool.largest_free_block == pool.capacity
    pool._allocator.check_invariants()


def test_tensors_are_aligned_disjoint_views_of_one_buffer():
    _check_views("cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_tensors_are_views_of_one_buffer_on_cuda():
    _check_views("cuda:0")
    pool = DevicePool("cuda:0", fraction_of_free=0.01)
    assert pool.bytes_reserved > 0 and pool.device == torch.device("cuda", 0)
    torch.cuda.synchronize()


def test_size_arguments_are_checked():
    with pytest.raises(ValueError, match="exactly one"):
        DevicePool("cpu")
    with pytest.raises(ValueError, match="exactly one"):
        DevicePool("cpu", MIB, fraction_of_free=0.5)
    with pytest.raises(ValueError, match="fraction_of_free needs a CUDA device"):
        DevicePool("cpu", fraction_of_free=0.5)
    with pytest.raises(ValueError, match="size_bytes"):
        DevicePool("cpu", 100)
    with pytest.raises(ValueError, match="power of two"):
        DevicePool("cpu", MIB, alignment=300)


def test_bytes_reserved_is_what_was_asked_for():
    pool = DevicePool("cpu", 10_000, alignment=512)
    assert pool.bytes_reserved == 10_000
    assert pool.capacity % 512 == 0 and 10_000 - 1024 < pool.capacity <= 10_000


def test_release_twice_is_refused():
    pool = DevicePool("cpu", MIB)
    handle = pool.allocate((4,), torch.float32)
    pool.free(handle)
    with pytest.raises(ValueError, match="already released"):
        handle.release()
    assert pool.bytes_in_use == 0
    with pytest.raises(ValueError, match="another pool"):
        DevicePool("cpu", MIB).free(pool.allocate((4,), torch.float32))


def test_strict_pool_refuses_without_changing_anything():
    pool = DevicePool("cpu", 8192, alignment=512)
    held = pool.allocate((pool.capacity - 1024,), torch.uint8)
    in_use, blocks = pool.bytes_in_use, pool._allocator.free_blocks()
    assert pool.allocate((2048,), torch.uint8) is None
    assert (pool.bytes_in_use, pool._allocator.free_blocks()) == (in_use, blocks)
    assert pool.fallbacks == 0
    held.release()


def test_permissive_pool_falls_back_and_counts():
    pool = DevicePool("cpu", 8192, alignment=512, strict=False)
    held = pool.allocate((pool.capacity,), torch.uint8)
    assert held.in_pool
    extra = [pool.allocate((16, 16), torch.float32) for _ in range(3)]
    assert pool.fallbacks == 3
    for handle in extra:
        assert not handle.in_pool and handle.offset is None
        assert handle.tensor.shape == (16, 16)
        assert handle.tensor.untyped_storage().data_ptr() != \
            pool._buffer.untyped_storage().data_ptr()
        handle.release()
    assert pool.bytes_in_use == pool.capacity
    held.release()
    assert pool.bytes_in_use == 0 and pool.fallbacks == 3


def _plan(activation_bytes=64 * 1024, max_batch=8):
    return plan_for([((3, 32, 32), torch.float32), ((10,), torch.int64)],
                    [((1000,), torch.float16)], default_buckets(max_batch), activation_bytes)


def test_plan_for_counts_bytes_per_bucket():
    plan = _plan()
    assert plan.buckets == (1, 2, 4, 8)
    per_sample = 3 * 32 * 32 * 4 + 10 * 8 + 1000 * 2
    assert plan.nbytes == per_sample * (1 + 2 + 4 + 8) + 64 * 1024
    assert len(plan.buffers) == 3 * 4


def test_admit_gives_typed_buffers_per_bucket_and_release_frees_them():
    pool = DevicePool("cpu", 4 * MIB)
    reservation = pool.admit("resnet", _plan())
    assert pool.bytes_in_use == reservation.nbytes >= _plan().nbytes
    storage = pool._buffer.untyped_storage().data_ptr()
    for bucket in (1, 2, 4, 8):
        image, ids = reservation.inputs[bucket]
        (logits,) = reservation.outputs[bucket]
        assert image.shape == (bucket, 3, 32, 32) and image.dtype == torch.float32
        assert ids.shape == (bucket, 10) and ids.dtype == torch.int64
        assert logits.shape == (bucket, 1000) and logits.dtype == torch.float16
        for tensor in (image, ids, logits):
            assert tensor.untyped_storage().data_ptr() == storage
    assert reservation.activations.numel() == 64 * 1024
    assert reservation.bucket_for(3) == 4
    pool._allocator.check_invariants()
    with pytest.raises(ValueError, match="already holds"):
        pool.admit("resnet", _plan())
    pool.release("resnet")
    assert pool.bytes_in_use == 0 and pool.largest_free_block == pool.capacity
    pool._allocator.check_invariants()
    with pytest.raises(ValueError, match="holds no reservation"):
        pool.release("resnet")


def test_admit_is_all_or_nothing_and_says_why():
    pool = DevicePool("cpu", 1 * MIB)
    small = pool.admit("small", _plan(activation_bytes=4096, max_batch=2))
    in_use, blocks = pool.bytes_in_use, pool._allocator.free_blocks()
    big = _plan(activation_bytes=900 * 1024)
    with pytest.raises(ResourceExhausted) as refused:
        pool.admit("big-model", big)
    message = str(refused.value)
    assert "'big-model'" in message
    needed = sum(pool._allocator.aligned_size(b.nbytes) for b in big.buffers) + \
        pool._allocator.aligned_size(900 * 1024)
    assert f"needs {needed} bytes" in message
    assert f"{pool.bytes_free} bytes are free" in message
    assert f"pool of {pool.capacity} bytes" in message
    assert (pool.bytes_in_use, pool._allocator.free_blocks()) == (in_use, blocks)
    assert "big-model" not in pool.reservations
    pool._allocator.check_invariants()
    assert small.nbytes == in_use


def test_admit_refuses_when_free_bytes_are_fragmented():
    pool = DevicePool("cpu", 16 * 1024, alignment=512)
    handles = []
    while (handle := pool.allocate((1024,), torch.uint8)) is not None:
        handles.append(handle)
    filler = pool.allocate((pool.largest_free_block,), torch.uint8) \
        if pool.largest_free_block else None
    assert pool.bytes_free == 0
    for handle in handles[::2]:
        handle.release()  # free: every other 1 KiB block, none adjacent
    in_use = pool.bytes_in_use
    plan = MemoryPlan(buffers=(), activation_bytes=2048)
    with pytest.raises(ResourceExhausted, match="largest free block 1024 bytes"):
        pool.admit("m", plan)
    assert pool.bytes_in_use == in_use
    pool._allocator.check_invariants()
    del filler


def test_default_buckets():
    assert default_buckets(1) == (1,)
    assert default_buckets(2) == (1, 2)
    assert default_buckets(8) == (1, 2, 4, 8)
    assert default_buckets(6) == (1, 2, 4, 6)
    assert default_buckets(33) == (1, 2, 4, 8, 16, 32, 33)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="max_batch"):
            default_buckets(bad)


def test_bucket_for():
    buckets = default_buckets(6)
    assert [bucket_for(b, buckets) for b in range(1, 7)] == [1, 2, 4, 4, 6, 6]
    assert bucket_for(3, (8, 2, 4)) == 4
    with pytest.raises(ValueError, match="got 7"):
        bucket_for(7, buckets)
    with pytest.raises(ValueError, match="got 0"):
        bucket_for(0, buckets)
    with pytest.raises(ValueError, match="empty"):
        bucket_for(1, ())


def test_mixed_trace_is_deterministic_and_balanced():
    trace = mixed_trace(3, models=4, steps=200)
    assert trace == mixed_trace(3, models=4, steps=200)
    allocs = [e for e in trace if e[0] == "alloc"]
    frees = [e for e in trace if e[0] == "free"]
    assert len(allocs) == 400 and sorted(e[1] for e in frees) == sorted(e[1] for e in allocs)
    assert len({e[1].split(".")[0] for e in allocs}) == 4
    assert len({e[2] for e in allocs}) > 50  # mixed sizes
    # inputs are freed after compute, outputs after the response: short- and long-lived
    assert {(e[1].rsplit(".", 1)[1], e[3]) for e in allocs} == {("in", "short"),
                                                                ("out", "long")}


def test_replay_passes_each_allocation_its_lifetime():
    trace = [("alloc", "a", 1000, "long"), ("alloc", "b", 1000, "short")]
    placed = {}
    created = DevicePool("cpu", 64 * 1024, alignment=512)

    def pool() -> DevicePool:
        allocate = created.allocate

        def recording(shape, dtype, *, lifetime="short"):
            handle = allocate(shape, dtype, lifetime=lifetime)
            placed[lifetime] = handle.offset
            return handle

        created.allocate = recording
        return created

    replay_trace(pool, trace)
    assert placed == {"long": created.capacity - 1024, "short": 0}


@pytest.mark.parametrize("seed", range(5))
def test_replay_without_refusals_when_the_pool_is_big_enough(seed):
    trace = mixed_trace(seed)
    peak_live = peak_live_bytes(trace)
    result = replay_trace(lambda: DevicePool("cpu", int(peak_live * 1.5)), trace)
    assert result["refused"] == 0 and result["fallbacks"] == 0
    assert result["allocations"] == 2000 * 2
    assert result["peak_live_bytes"] == peak_live
    assert peak_live <= result["peak_bytes_in_use"] <= peak_live * 1.02
    assert 0 < result["peak_in_use_fraction"] <= 1
    assert result["peak_in_use_fraction"] == result["peak_bytes_in_use"] / result["bytes_reserved"]
    assert result["bytes_in_use_after"] == 0


def test_replay_counts_refusals_in_a_small_pool():
    trace = mixed_trace(0, steps=300)
    result = replay_trace(lambda: DevicePool("cpu", peak_live_bytes(trace) // 4), trace)
    assert result["refused"] > 0
    assert 0 < result["peak_in_use_fraction"] <= 1
    assert result["bytes_in_use_after"] == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6000), st.integers(0, 1000),
                          st.sampled_from(["short", "long"])),
                max_size=60))
def test_random_alloc_free_keeps_the_allocator_consistent(operations):
    pool = DevicePool("cpu", 64 * 1024, alignment=256)
    live = []
    for is_alloc, nbytes, pick, lifetime in operations:
        if is_alloc or not live:
            before = pool._allocator.free_blocks()
            handle = pool.allocate((nbytes,), torch.uint8, lifetime=lifetime)
            if handle is None:
                assert pool._allocator.free_blocks() == before
                assert pool.largest_free_block < pool._allocator.aligned_size(nbytes)
            else:
                value = pick % 251
                handle.tensor.fill_(value)
                live.append((handle, value))
        else:
            live.pop(pick % len(live))[0].release()
        pool._allocator.check_invariants()
        assert pool.bytes_in_use == sum(pool._allocator.aligned_size(h.nbytes) for h, _ in live)
    for handle, value in live:
        assert bool((handle.tensor == value).all()), "a live tensor was overwritten"
    for handle, _ in live:
        handle.release()
    assert pool.bytes_in_use == 0
    assert pool._allocator.free_blocks() == [(0, pool.capacity)]  # coalesced into one block
    pool._allocator.check_invariants()


def test_model_buffers_sit_above_request_buffers():
    pool = DevicePool("cpu", 4 * MIB)
    reservation = pool.admit("resnet", _plan())
    model_lowest = min(reservation._offsets)
    staged = pool.allocate((64 * 1024,), torch.uint8)  # a request's inputs: short-lived

    # admit placed the model's buffers at the top, so requests churn below them
    assert staged.offset == 0 and staged.offset + staged.nbytes <= model_lowest
    assert max(offset + size for offset, size in pool._allocator._allocated.items()
               if offset in reservation._offsets) == pool.capacity
    held = pool.allocate((64 * 1024,), torch.uint8, lifetime="long")
    assert staged.offset + staged.nbytes <= held.offset < model_lowest
    for handle in staged, held:
        handle.release()
    pool.release("resnet")
    assert pool._allocator.free_blocks() == [(0, pool.capacity)]


def test_model_plan_has_a_batch_buffer_per_slot_and_graph_buffers_per_bucket():
    plan = model_plan([((3, 4), torch.float32), ((2,), torch.int64)], [((5,), torch.float16)],
                      max_rows=8, slots=2, graph_buckets=(1, 8))
    batch = [b for b in plan.buffers if b.kind == "batch"]
    assert plan.slots == 2 and plan.buckets == (1, 8)
    assert sorted((b.slot, b.index, b.shape) for b in batch) == [
        (0, 0, (8, 3, 4)), (0, 1, (8, 2)), (1, 0, (8, 3, 4)), (1, 1, (8, 2))]
    assert plan.nbytes == 2 * 8 * (12 * 4 + 2 * 8) + (1 + 8) * (12 * 4 + 2 * 8 + 5 * 2)
    assert "for 2 batches in flight" in plan.describe()
    pool = DevicePool("cpu", MIB)
    reservation = pool.admit("m", plan)
    assert [t.shape for t in reservation.batch[1]] == [(8, 3, 4), (8, 2)]
    assert [t.shape for t in reservation.outputs[8]] == [(8, 5)]
    # A model without batching: one sample per buffer, no batch dimension.
    single = model_plan([((3,), torch.float32)], [], max_rows=None, slots=1)
    assert [b.shape for b in single.buffers] == [(3,)]


def test_a_permissive_pool_admits_what_does_not_fit_outside_and_counts_it():
    pool = DevicePool("cpu", 8192, alignment=512, strict=False)
    plan = model_plan([((1024,), torch.float32)], [], max_rows=4, slots=2)
    reservation = pool.admit("big", plan)
    assert reservation.fallbacks == pool.fallbacks == len(plan.buffers) + 1
    assert reservation.nbytes == 0 and pool.bytes_in_use == 0
    for tensor in reservation.batch[0] + reservation.batch[1]:
        assert tensor.shape == (4, 1024)
        assert tensor.untyped_storage().data_ptr() != pool._buffer.untyped_storage().data_ptr()
    pool.release("big")
    assert pool.bytes_in_use == 0
    strict = DevicePool("cpu", 8192, alignment=512)
    with pytest.raises(ResourceExhausted, match="needs 33280 bytes"):
        strict.admit("big", plan)


def test_unpooled_reservation_matches_the_plan():
    plan = model_plan([((2,), torch.bfloat16)], [((2,), torch.float32)], max_rows=4, slots=3,
                      graph_buckets=(2, 4))
    reservation = unpooled_reservation("m", plan, "cpu")
    assert sorted(reservation.batch) == [0, 1, 2]
    assert reservation.batch[2][0].dtype == torch.bfloat16
    assert sorted(reservation.inputs) == sorted(reservation.outputs) == [2, 4]


# --- the server's pools: one arena per model, sized from its plan (batcher/memory.py) -------


def test_no_arena_is_reserved_before_a_model_and_each_is_its_sizes_exactly():
    from batchgate.batcher.memory import DevicePools, PoolSettings, arena_bytes

    pools = DevicePools(PoolSettings())
    assert pools.bytes_reserved("cpu") == 0 and pools.pools() == []
    sizes = [3 * 4096, 100, 0]
    arena = pools.reserve("cpu", "a", sizes, "a plan")
    # Each size rounded to the alignment (0 takes one block, as the allocator does) + one skip.
    assert arena_bytes(sizes) == 3 * 4096 + 512 + 512 + 512
    assert arena.bytes_reserved == pools.bytes_reserved("cpu") == arena_bytes(sizes)
    # What it was sized for fits it to the byte, in any order.
    handles = [arena.allocate((n,), torch.uint8) for n in (100, 3 * 4096, 0)]
    assert all(h is not None and h.in_pool for h in handles)
    # And no more, but for the skip's block when the buffer happened to start aligned.
    assert arena_bytes(sizes) - 512 <= arena.capacity <= arena_bytes(sizes)
    pools.release("a", arena)
    assert pools.bytes_reserved("cpu") == 0 and pools.pools() == []
    with pytest.raises(ValueError, match="holds no arena"):
        pools.release("a", arena)


def test_the_cap_refuses_naming_the_bytes_and_a_release_makes_room():
    from batchgate.batcher.memory import DevicePools, PoolSettings, arena_bytes

    cap = 64 * 1024
    pools = DevicePools(PoolSettings(cap))
    first = pools.reserve("cpu", "a", [40 * 1024], "a's plan")
    needed = arena_bytes([30 * 1024])
    with pytest.raises(ResourceExhausted) as info:
        pools.reserve("cpu", "b", [30 * 1024], "b's plan")
    message = str(info.value)
    free = cap - first.bytes_reserved
    assert f"needs {needed} bytes" in message and f"{free} bytes are free" in message
    assert f"capped at {cap} bytes" in message and "b's plan" in message
    assert pools.bytes_reserved("cpu") == first.bytes_reserved  # the refusal took nothing
    pools.release("a", first)
    second = pools.reserve("cpu", "b", [30 * 1024], "b's plan")
    assert pools.bytes_reserved("cpu") == second.bytes_reserved == needed


def test_a_permissive_pool_over_its_cap_serves_outside_and_counts_it():
    from batchgate.batcher.memory import DevicePools, PoolSettings

    pools = DevicePools(PoolSettings(8192, strict=False))
    arena = pools.reserve("cpu", "big", [MIB], "a plan")
    assert arena.bytes_reserved < 8192  # not the plan: it goes outside
    plan = model_plan([((1024,), torch.float32)], [], max_rows=64, slots=1)
    reservation = arena.admit("big.0", plan)
    assert reservation.fallbacks > 0 and reservation.batch[0][0].shape == (64, 1024)
    assert arena.fallbacks == reservation.fallbacks


def test_pool_settings_are_checked():
    from batchgate.batcher.memory import PoolSettings

    for bad in (100, True, 4095.0):
        with pytest.raises(ValueError, match="cap_bytes"):
            PoolSettings(bad)
    with pytest.raises(ValueError, match="fraction_of_total"):
        PoolSettings(fraction_of_total=1.5)
    assert PoolSettings().cap_bytes is None  # the default: no cap, nothing reserved up front
