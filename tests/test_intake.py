"""A read's requests queued together: ``ModelQueue.put_all``, ``ServedModel.submit_group`` and
the executor process's ``read``. Together they must decide exactly what queueing each request in
turn decides (order, queue limits, priorities, admission control), and a request cancelled in
the read that brought it never queues."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from batchgate.server.ipc.arena import ArenaLayout, SharedArena
from batchgate.batcher.errors import AdmissionRefused, InvalidRequest, ModelUnavailable, QueueFull
from batchgate.batcher.metrics import BatcherMetrics
from batchgate.batcher.model import ServedModel
from batchgate.batcher.profile import LatencyProfile
from batchgate.batcher.queue import ModelQueue
from batchgate.batcher.request import NEW, QUEUED
from batchgate.batcher.spec import BatchingConfig, QueuePolicy
from batchgate.protos import wire_pb2
from batchgate.server.executor.fronts import FrontEnd
from batchgate.server.executor.server import ExecutorServer
from batchgate.server.rules.status import Code
from tests.support.batching import RecordingModel, hold_executor, make_spec, request
from tests.support.polling import apoll

FAILURES = ("rejected", "infeasible", "cancelled")


def test_put_all_queues_in_order_and_refuses_only_past_a_levels_limit():
    limited = QueuePolicy(max_queue_size=2)
    queue = ModelQueue(BatchingConfig(max_batch_size=8, priority_levels=2,
                                      priority_queue_policy={1: limited}))
    requests = [request(float(i)) for i in range(5)]
    for r, level in zip(requests, (1, 2, 1, 1, 2)):
        r.level = level
    refused = queue.put_all(requests)
    assert [(i, type(e)) for i, e in refused] == [(3, QueueFull)]
    assert [r.state for r in requests] == [QUEUED, QUEUED, QUEUED, NEW, QUEUED]
    assert queue.depth == 4
    batch, _ = queue.next_batch()
    assert batch == [requests[0], requests[2], requests[1], requests[4]]  # level 1 first


def test_put_all_on_a_closed_queue_refuses_every_request_and_queues_none():
    queue = ModelQueue(BatchingConfig(max_batch_size=8))
    queue.close()
    requests = [request(1.0), request(2.0)]
    for r in requests:
        r.level = 1
    refused = queue.put_all(requests)
    assert [(i, type(e)) for i, e in refused] == [(0, ModelUnavailable), (1, ModelUnavailable)]
    assert [r.state for r in requests] == [NEW, NEW] and queue.depth == 0


def _profile() -> LatencyProfile:
    profile = LatencyProfile(4)
    for size, seconds in ((1, 0.5), (2, 0.6), (4, 1.0)):
        profile.record(size, seconds)
    return profile


def _model(policy: str) -> tuple[ServedModel, RecordingModel, CollectorRegistry]:
    registry = CollectorRegistry()
    fake = RecordingModel()
    spec = make_spec(max_batch_size=4, max_inflight_batches=1, policy=policy, priority_levels=2,
                     response_margin_ms=0.0,
                     priority_queue_policy={2: QueuePolicy(max_queue_size=3)})
    model = ServedModel(spec, fake, metrics=BatcherMetrics(registry), profile=_profile())
    model.start()
    return model, fake, registry


def _arrivals() -> list:
    """Requests of one read: both levels, a priority out of range, a deadline the queue ahead
    makes too tight (4: behind 5 samples and a running batch, 1.2 s left), level 2 past its
    limit of 3 (7), loose deadlines (timeouts, so that both models see the same ones)."""
    kinds = [dict(priority=1), dict(priority=2, timeout_us=60_000_000), dict(priority=9),
             dict(priority=1, rows=3), dict(priority=2, timeout_us=1_200_000),
             dict(priority=2), dict(priority=2), dict(priority=2),
             dict(priority=1, timeout_us=60_000_000)]
    return [request(float(i), **kind) for i, kind in enumerate(kinds)]


def _counts(registry: CollectorRegistry) -> dict[str, float]:
    return {reason: registry.get_sample_value(
        "batchgate_request_failures_total", {"model": "fake", "reason": reason}) or 0.0
        for reason in FAILURES}


@pytest.mark.parametrize("tight", [True, False], ids=["tight-deadlines", "loose-deadlines"])
@pytest.mark.parametrize("policy", ["fifo", "deadline"])
async def test_submit_group_decides_what_submitting_each_in_turn_decides(policy, tight):
    """Together (one admission bound when it holds, else each in turn) and one by one: the
    same refusals, the same queue, the same counts; loose deadlines take the quick bound."""
    together, fake_t, registry_t = _model(policy)
    alone, fake_a, registry_a = _model(policy)
    blockers = [await hold_executor(together, fake_t), await hold_executor(alone, fake_a)]
    try:
        arrivals_t, arrivals_a = _arrivals(), _arrivals()
        if not tight:  # every deadline loose: the quick bound holds for them all
            for batch in (arrivals_t, arrivals_a):
                for r in batch:
                    r.timeout_us = 60_000_000 if r.timeout_us else 0
        admission, checked = together._admission, []
        full_check = admission.check
        admission.check = lambda **kwargs: (checked.append(kwargs), full_check(**kwargs))[1]
        refused = {i: type(e) for i, e in together.submit_group(arrivals_t)}
        assert bool(checked) is tight  # loose: the quick bound answered for all of them
        expected = {}
        for i, r in enumerate(arrivals_a):
            try:
                alone.submit(r)
            except Exception as exc:  # noqa: BLE001 - what each refusal was is compared
                expected[i] = type(exc)
        assert refused == expected
        assert refused[2] is InvalidRequest
        assert refused[7 if tight else 6] is QueueFull
        assert (refused.get(4) is AdmissionRefused) is tight
        assert [r.state for r in arrivals_t] == [r.state for r in arrivals_a]
        assert together.queue_depth == alone.queue_depth == len(arrivals_t) - len(refused)
        assert _counts(registry_t) == _counts(registry_a)
    finally:
        for fake in (fake_t, fake_a):
            fake.gate.set()
        await asyncio.gather(*blockers)
        together.stop(drain_timeout_s=5)
        alone.stop(drain_timeout_s=5)


class _FrameSink:
    """A front end's link as the executor sees it: ``out`` is the frame being filled."""

    def __init__(self) -> None:
        self.out = wire_pb2.ToFrontend()

    def room(self, nbytes: int) -> wire_pb2.ToFrontend:
        """The frame being filled (wire.Link.room: here one frame takes everything)."""
        return self.out


def _read(server: ExecutorServer, front: FrontEnd, *frames: wire_pb2.ToExecutor) -> None:
    """What the executor does with one read of ``frames``."""
    for frame in frames:
        server.frame(front, frame)
    server.read()


def _infer(frame: wire_pb2.ToExecutor, rid: int, value: float, **fields) -> None:
    """An Infer of one row, ``value`` written into the front end's region at its rid's place."""
    offset = rid * 8
    _infer.arena.write(offset, np.full((1, 2), value, np.float32))
    infer = frame.infer.add(rid=rid, model=1, batch_size=1, **fields)
    infer.inputs.add(offset=offset, nbytes=8, shape=[1, 2])


@pytest.fixture
def executor():
    arena = SharedArena.create(1 << 20)
    _infer.arena = arena
    registry = CollectorRegistry()
    fake = RecordingModel()
    server = ExecutorServer(arena, ArenaLayout(1 << 20, 1))
    model = ServedModel(make_spec(max_batch_size=8, max_inflight_batches=1), fake,
                        metrics=BatcherMetrics(registry), delivery=server.answers)
    model.start()
    assert server.handles.add(model).handle == 1
    front = FrontEnd(_FrameSink())
    front.region = (0, 1 << 16)
    try:
        yield server, front, model, fake, registry
    finally:
        if fake.gate is not None:
            fake.gate.set()
        model.stop(drain_timeout_s=5)
        arena.close()


async def _hold(server: ExecutorServer, model: ServedModel, fake: RecordingModel
                ) -> asyncio.Future:
    """Occupy the model's only executor with a request of another front end's that waits on
    the gate (``hold_executor`` through the wire: the model answers through the executor's
    delivery, not futures); the future ends once that request is answered."""
    fake.gate = threading.Event()
    other = FrontEnd(_FrameSink())
    other.region = (1 << 16, 1 << 17)
    offset = other.region[0]
    _infer.arena.write(offset, np.full((1, 2), -1.0, np.float32))
    frame = wire_pb2.ToExecutor()
    frame.infer.add(rid=1, model=1, batch_size=1).inputs.add(offset=offset, nbytes=8,
                                                            shape=[1, 2])
    _read(server, other, frame)
    await asyncio.get_running_loop().run_in_executor(None, fake.entered.wait, 10)
    return asyncio.ensure_future(apoll(lambda: not other.requests, what="the blocker answered"))


async def test_a_reads_requests_queue_in_order_and_a_refused_one_fails_alone(executor):
    server, front, model, fake, _ = executor
    blocker = await _hold(server, model, fake)
    frames = [wire_pb2.ToExecutor() for _ in range(3)]
    _infer(frames[0], 1, 1.0)
    _infer(frames[1], 2, 2.0, priority=9)  # one level only
    _infer(frames[1], 3, 3.0)
    _infer(frames[2], 4, 4.0)
    _read(server, front, *frames)
    assert model.queue_depth == 3
    assert sorted(front.requests) == [1, 3, 4]
    (failure,) = front.link.out.failures
    assert (failure.rid, failure.code) == (2, Code.INVALID_ARGUMENT)
    assert "priority must lie in 1..1" in failure.message
    fake.gate.set()
    await blocker
    await apoll(lambda: len(fake.batches) == 2)
    assert fake.batches[1] == [1.0, 3.0, 4.0]


async def test_a_request_cancelled_in_the_read_that_brought_it_never_queues(executor):
    server, front, model, fake, registry = executor
    blocker = await _hold(server, model, fake)
    first, second = wire_pb2.ToExecutor(), wire_pb2.ToExecutor(cancel=[2])
    for rid in (1, 2, 3):
        _infer(first, rid, float(rid))
    _read(server, front, first, second)
    assert model.queue_depth == 2
    assert sorted(front.requests) == [1, 3]
    (failure,) = front.link.out.failures
    assert (failure.rid, failure.code, failure.released) == (2, Code.CANCELLED, True)
    assert registry.get_sample_value("batchgate_request_failures_total",
                                     {"model": "fake", "reason": "cancelled"}) == 1
    fake.gate.set()
    await blocker
    await apoll(lambda: len(fake.batches) == 2)
    assert fake.batches[1] == [1.0, 3.0]


# -- InferGroup: requests written column by column (wire.proto) ---------------------------------


def _group(frame: wire_pb2.ToExecutor, rows: dict[int, int], model: int = 1,
           **columns) -> wire_pb2.InferGroup:
    """A group of one request per ``rows`` entry (rid -> rows), each row [rid, rid] in the front
    end's region at rid * 64; ``columns`` replace the group's defaults."""
    group = frame.groups.add(model=model)
    group.inputs.add(tail=[2], offsets=[rid * 64 for rid in rows])
    for rid, count in rows.items():
        _infer.arena.write(rid * 64, np.full((count, 2), float(rid), np.float32))
    group.rids.extend(rows)
    group.batch_sizes.extend(rows.values())
    defaults = dict(priorities=[0] * len(rows), deadlines_ns=[0] * len(rows),
                    timeouts_us=[0] * len(rows), ids=[f"id-{rid}" for rid in rows])
    for name, values in {**defaults, **columns}.items():
        getattr(group, name).extend(values)
    return group


async def test_a_groups_requests_queue_as_their_infers_would_after_the_frames_infers(executor):
    server, front, model, fake, _ = executor
    blocker = await _hold(server, model, fake)
    frame = wire_pb2.ToExecutor()
    deadline_ns = time.monotonic_ns() + 60 * 10**9
    _group(frame, {1: 1, 2: 2, 3: 1}, priorities=[0, 1, 0], deadlines_ns=[0, deadline_ns, 0],
           timeouts_us=[0, 0, 30_000_000])
    _infer(frame, 9, 9.0)
    _read(server, front, frame)
    assert model.queue_depth == 4
    second = front.requests[2]
    assert (second.id, second.batch_size, second.priority) == ("id-2", 2, 1)
    assert second.deadline == pytest.approx(deadline_ns / 1e9)
    assert front.requests[3].timeout_us == 30_000_000
    assert [a.shape for a in second.inputs] == [(2, 2)]
    fake.gate.set()
    await blocker
    await apoll(lambda: len(fake.batches) == 2)
    assert fake.batches[1] == [9.0, 1.0, 2.0, 2.0, 3.0]  # the Infer first, then the group


def test_an_empty_frame_is_no_request(executor):
    server, front, model, _, _ = executor
    _read(server, front, wire_pb2.ToExecutor())
    assert model.queue_depth == 0 and not front.requests and not front.link.out.failures


async def test_a_group_request_cancelled_in_the_frame_that_brought_it_never_queues(executor):
    server, front, model, fake, _ = executor
    blocker = await _hold(server, model, fake)
    frame = wire_pb2.ToExecutor(cancel=[2])
    _group(frame, {1: 1, 2: 1, 3: 1})
    _read(server, front, frame)
    assert model.queue_depth == 2
    (failure,) = front.link.out.failures
    assert (failure.rid, failure.code) == (2, Code.CANCELLED)
    fake.gate.set()
    await blocker
    await apoll(lambda: len(fake.batches) == 2)
    assert fake.batches[1] == [1.0, 3.0]


async def test_a_group_request_outside_the_region_fails_alone(executor, caplog):
    server, front, model, fake, _ = executor
    blocker = await _hold(server, model, fake)
    frame = wire_pb2.ToExecutor()
    group = _group(frame, {1: 1, 2: 1, 3: 1})
    group.inputs[0].offsets[1] = front.region[1] - 4  # its 8 bytes would pass the region's end
    _read(server, front, frame)
    assert model.queue_depth == 2 and sorted(front.requests) == [1, 3]
    (failure,) = front.link.out.failures
    assert (failure.rid, failure.code) == (2, Code.INTERNAL)
    assert failure.message == ("internal error: the front end described the request's "
                               "tensors wrongly")
    fake.gate.set()
    await blocker
    await apoll(lambda: len(fake.batches) == 2)
    assert fake.batches[1] == [1.0, 3.0]


@pytest.mark.parametrize("fault", ["column", "offsets", "inputs", "no inputs", "handle"])
async def test_a_malformed_group_fails_every_request_and_queues_none(executor, fault):
    server, front, model, _, _ = executor
    frame = wire_pb2.ToExecutor()
    group = _group(frame, {1: 1, 2: 1}, model=99 if fault == "handle" else 1)
    if fault == "column":
        del group.ids[1]
    elif fault == "offsets":
        del group.inputs[0].offsets[1]
    elif fault == "inputs":
        group.inputs.add(tail=[2], offsets=[0, 64])
    elif fault == "no inputs":
        del group.inputs[:]
    _read(server, front, frame)
    assert model.queue_depth == 0 and not front.requests
    failures = front.link.out.failures
    assert [f.rid for f in failures] == [1, 2]
    expected = Code.UNAVAILABLE if fault == "handle" else Code.INTERNAL
    assert {f.code for f in failures} == {expected} and all(f.released for f in failures)


_COLUMNS = ("batch_sizes", "priorities", "deadlines_ns", "timeouts_us", "ids")


@st.composite
def _groups(draw):
    """An InferGroup as a buggy front end might write one: at most one fault (a column of the
    wrong length, no input or two, a stale handle) and any tails, row counts and offsets
    (inside the region, across its end, past the arena)."""
    count = draw(st.integers(0, 6))
    fault = draw(st.sampled_from([None] * 6 + ["column", "offsets", "inputs", "handle"]))
    group = wire_pb2.InferGroup(model=7 if fault == "handle" else 1, rids=range(1, count + 1))
    wrong = draw(st.sampled_from(_COLUMNS)) if fault == "column" else None
    for name in _COLUMNS:
        length = count
        if name == wrong:
            length = count - 1 if count and draw(st.booleans()) else count + 1
        if name == "ids":
            getattr(group, name).extend(draw(st.text(max_size=3)) for _ in range(length))
        else:
            getattr(group, name).extend(draw(st.integers(0, 3)) for _ in range(length))
    for _ in range(draw(st.sampled_from([0, 2])) if fault == "inputs" else 1):
        group.inputs.add(
            tail=draw(st.lists(st.integers(-1, 3), max_size=3)),
            offsets=draw(st.lists(st.sampled_from([0, 64, (1 << 16) - 8, 1 << 16, 1 << 30]),
                                  min_size=count + (fault == "offsets"),
                                  max_size=count + (fault == "offsets"))))
    return group


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(group=_groups())
def test_every_request_of_any_group_is_taken_or_failed_once(executor, group):
    server, front, model, _, _ = executor
    front.link.out = wire_pb2.ToFrontend()  # the fixture's state is shared by the examples
    front.requests.clear()
    server.frame(front, wire_pb2.ToExecutor(groups=[group]))
    taken = [request.tag for request in server.intake.pending.get(model, [])]
    server.intake.pending = {}
    failed = [failure.rid for failure in front.link.out.failures]
    assert sorted(taken + failed) == list(group.rids)
    assert sorted(front.requests) == sorted(taken)
    base = server.arena.array(0, np.uint8, (1,)).ctypes.data
    for rid in taken:  # what it took is what the group said, in the front end's region (the
        # shapes are the front end's to check against the model, as for an Infer)
        request = front.requests[rid]
        (array,) = request.inputs
        assert request.batch_size == group.batch_sizes[rid - 1]
        assert array.shape == (request.batch_size, *group.inputs[0].tail)
        offset = group.inputs[0].offsets[rid - 1]
        assert array.ctypes.data - base == offset
        assert offset + array.nbytes <= front.region[1]
