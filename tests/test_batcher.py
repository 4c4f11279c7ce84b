"""The batch loop with fake models: formation, priorities, deadlines, cancellation, failures.

Models here are plain callables that record what they ran and can be held by a gate
(``threading.Event``), so every scenario is deterministic: no sleeps, no timing assertions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from batchgate.batcher.errors import (
    DeadlineExceeded,
    InvalidRequest,
    LoadError,
    ModelExecutionError,
    ModelUnavailable,
    QueueFull,
)
from batchgate.batcher.forward import unpack_outputs
from batchgate.batcher.metrics import BatcherMetrics
from batchgate.batcher.model import ServedModel
from batchgate.batcher.queue import ModelQueue
from batchgate.batcher.spec import BatchingConfig, ModelSpec, QueuePolicy, TensorSpec
from tests.support.batching import RecordingModel, hold_executor, make_spec, request
from tests.support.polling import apoll


@pytest.fixture
def registry():
    return CollectorRegistry()


@pytest.fixture
def served(registry):
    models = []

    def build(spec: ModelSpec, module) -> ServedModel:
        model = ServedModel(spec, module, metrics=BatcherMetrics(registry))
        model.start()
        models.append(model)
        return model

    yield build
    for model in models:
        if model.spec.name:
            # release any gate a test left closed, then drain
            gate = getattr(model, "_test_gate", None)
            if gate is not None:
                gate.set()
        model.stop(drain_timeout_s=5)


async def test_outputs_match_each_request(served):
    fake = RecordingModel()
    model = served(make_spec(max_queue_delay_us=20_000), fake)
    values = [float(i) for i in range(20)]
    results = await asyncio.gather(*(model.infer(request(v)) for v in values))
    for v, result in zip(values, results):
        np.testing.assert_array_equal(result["y"], np.full((1, 2), 2 * v, dtype=np.float32))
    assert sum(len(b) for b in fake.batches) == 20
    assert max(len(b) for b in fake.batches) > 1, "requests were never batched"


async def test_priority_levels_run_high_first(served):
    fake = RecordingModel()
    model = served(make_spec(max_batch_size=1, priority_levels=2, default_priority_level=2,
                             max_inflight_batches=1), fake)
    blocker = await hold_executor(model, fake)
    low = [asyncio.ensure_future(model.infer(request(10.0 + i, priority=2))) for i in range(3)]
    await apoll(lambda: model.queue_depth == 3)
    high = [asyncio.ensure_future(model.infer(request(20.0 + i, priority=1))) for i in range(3)]
    await apoll(lambda: model.queue_depth == 6)
    fake.gate.set()
    await asyncio.gather(blocker, *low, *high)
    order = [b[0] for b in fake.batches[1:]]
    assert order == [20.0, 21.0, 22.0, 10.0, 11.0, 12.0]


async def test_priority_out_of_range_is_invalid(served):
    model = served(make_spec(priority_levels=2), RecordingModel())
    with pytest.raises(InvalidRequest, match="priority must lie in 1..2"):
        await model.infer(request(1.0, priority=3))


async def test_queue_full_is_refused_at_once(served, registry):
    fake = RecordingModel()
    spec = make_spec(max_batch_size=1, max_inflight_batches=1,
                     default_queue_policy=QueuePolicy(max_queue_size=2))
    model = served(spec, fake)
    blocker = await hold_executor(model, fake)
    queued = [asyncio.ensure_future(model.infer(request(float(i)))) for i in range(2)]
    await apoll(lambda: model.queue_depth == 2)
    with pytest.raises(QueueFull, match="max_queue_size 2"):
        await model.infer(request(9.0))
    assert registry.get_sample_value(
        "batchgate_request_failures_total", {"model": "fake", "reason": "rejected"}) == 1
    fake.gate.set()
    await asyncio.gather(blocker, *queued)


async def test_timeout_expires_without_waiting_for_the_running_batch(served, registry):
    fake = RecordingModel()
    model = served(make_spec(max_batch_size=1, max_inflight_batches=1), fake)
    blocker = await hold_executor(model, fake)
    with pytest.raises(DeadlineExceeded):
        # 20 ms timeout while the executor is held (the gate is never opened before this
        # returns): the answer cannot have come from the model.
        await model.infer(request(5.0, timeout_us=20_000))
    assert model.queue_depth == 0
    assert not blocker.done()
    fake.gate.set()
    await blocker
    assert [b[0] for b in fake.batches] == [-1.0], "the expired request still ran"
    assert registry.get_sample_value(
        "batchgate_request_failures_total", {"model": "fake", "reason": "expired"}) == 1


async def test_deadline_expires_a_request_in_a_running_batch(served):
    fake = RecordingModel()
    model = served(make_spec(max_batch_size=1), fake)
    fake.gate = threading.Event()
    model._test_gate = fake.gate
    with pytest.raises(DeadlineExceeded):
        await model.infer(request(3.0, deadline=time.monotonic() + 0.02))
    assert fake.entered.is_set(), "the request should have been running when it expired"
    fake.gate.set()


async def test_queue_default_timeout_applies(served):
    fake = RecordingModel()
    spec = make_spec(max_batch_size=1, max_inflight_batches=1,
                     default_queue_policy=QueuePolicy(default_timeout_us=10_000))
    model = served(spec, fake)
    blocker = await hold_executor(model, fake, timeout_us=60_000_000)  # overrides the default
    with pytest.raises(DeadlineExceeded):
        await model.infer(request(1.0))
    assert model.queue_depth == 0
    fake.gate.set()
    await blocker


async def test_cancellation_leaves_the_queue(served, registry):
    fake = RecordingModel()
    model = served(make_spec(max_batch_size=1, max_inflight_batches=1), fake)
    blocker = await hold_executor(model, fake)
    waiting = asyncio.ensure_future(model.infer(request(7.0)))
    await apoll(lambda: model.queue_depth == 1)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert model.queue_depth == 0
    fake.gate.set()
    await blocker
    assert 7.0 not in [v for b in fake.batches for v in b]
    assert registry.get_sample_value(
        "batchgate_request_failures_total", {"model": "fake", "reason": "cancelled"}) == 1


async def test_model_exception_fails_only_its_batch(served):
    fake = RecordingModel()
    fake.fail_on = 13.0
    model = served(make_spec(max_batch_size=1), fake)
    results = await asyncio.gather(
        *(model.infer(request(v)) for v in (1.0, 13.0, 2.0)), return_exceptions=True)
    assert isinstance(results[1], ModelExecutionError)
    assert "model 'fake' raised RuntimeError" in str(results[1])
    assert "poisoned" not in str(results[1]), "the model's own message must not reach clients"
    np.testing.assert_array_equal(results[0]["y"], np.full((1, 2), 2.0, np.float32))
    np.testing.assert_array_equal(results[2]["y"], np.full((1, 2), 4.0, np.float32))


async def test_wrong_batch_dimension_is_reported(served):
    model = served(make_spec(), lambda x: x[:1])
    with pytest.raises(ModelExecutionError, match=r"shape \(1, 2\) for a batch of 3"):
        await model.infer(request(1.0, rows=3))


async def test_only_equal_shapes_share_a_batch(served):
    shapes: list[tuple] = []

    def model_fn(x):
        shapes.append(tuple(x.shape))
        return x

    model = served(make_spec(dims=(-1,), max_queue_delay_us=50_000, max_batch_size=8), model_fn)
    reqs = [request(1.0, width=2) for _ in range(3)] + [request(1.0, width=3) for _ in range(3)]
    results = await asyncio.gather(*(model.infer(r) for r in reqs))
    assert {r["y"].shape for r in results} == {(1, 2), (1, 3)}
    assert all(s[1] in (2, 3) for s in shapes)
    assert sum(s[0] for s in shapes) == 6


async def test_two_batches_in_flight_per_instance(served):
    fake = RecordingModel()
    model = served(make_spec(max_batch_size=1, max_inflight_batches=2), fake)
    blocker = await hold_executor(model, fake)
    second = asyncio.ensure_future(model.infer(request(2.0)))
    # The assembler takes the second batch while the first still computes.
    await apoll(lambda: model.queue_depth == 0 and model.stats.snapshot().execution_count == 0)
    third = asyncio.ensure_future(model.infer(request(3.0)))
    await apoll(lambda: model.queue_depth == 1)
    fake.gate.set()
    await asyncio.gather(blocker, second, third)


async def test_stop_drains_queued_requests_and_refuses_new_ones(served):
    fake = RecordingModel()
    model = ServedModel(make_spec(max_batch_size=1, max_inflight_batches=1), fake)
    model.start()
    blocker = await hold_executor(model, fake)
    queued = asyncio.ensure_future(model.infer(request(4.0)))
    await apoll(lambda: model.queue_depth == 1)
    loop = asyncio.get_running_loop()
    stopping = loop.run_in_executor(None, model.stop, 10)
    await apoll(lambda: not model._accepting)
    with pytest.raises(ModelUnavailable):
        await model.infer(request(5.0))
    fake.gate.set()
    await stopping
    assert (await queued)["y"][0, 0] == 8.0
    await blocker


def test_policy_reasons():
    q = ModelQueue(BatchingConfig(max_batch_size=4, max_queue_delay_us=0))
    for i in range(5):
        r = request(float(i)); r.level = 1; q.put(r)
    batch, reason = q.next_batch()
    assert (len(batch), reason) == (4, "full")
    batch, reason = q.next_batch()
    assert (len(batch), reason) == (1, "idle")

    q = ModelQueue(BatchingConfig(max_batch_size=8, preferred_batch_sizes=(2, 4),
                                  max_queue_delay_us=10_000_000))
    for i in range(5):
        r = request(float(i)); r.level = 1; q.put(r)
    batch, reason = q.next_batch()
    assert (len(batch), reason) == (4, "preferred")

    q = ModelQueue(BatchingConfig(max_batch_size=8, max_queue_delay_us=1000))
    r = request(1.0); r.level = 1; q.put(r)
    batch, reason = q.next_batch()
    assert (len(batch), reason) == (1, "delay")

    # MIN_BATCH: dispatch as soon as 3 samples wait, long before the delay.
    q = ModelQueue(BatchingConfig(max_batch_size=8, min_batch_size=3, max_queue_delay_us=60_000_000))
    for i in range(3):
        r = request(float(i)); r.level = 1; q.put(r)
    batch, reason = q.next_batch()
    assert (len(batch), reason) == (3, "preferred")


def test_fifo_when_a_large_request_does_not_fit():
    q = ModelQueue(BatchingConfig(max_batch_size=4))
    sizes = [3, 2, 1]
    for i, rows in enumerate(sizes):
        r = request(float(i), rows=rows); r.level = 1; q.put(r)
    batch, _ = q.next_batch()
    assert [r.batch_size for r in batch] == [3]
    batch, _ = q.next_batch()
    assert [r.batch_size for r in batch] == [2, 1]


def test_without_dynamic_batching_each_request_runs_alone():
    q = ModelQueue(BatchingConfig(max_batch_size=8, dynamic_batching=False))
    for i in range(3):
        r = request(float(i), rows=2); r.level = 1; q.put(r)
    for _ in range(3):
        batch, _ = q.next_batch()
        assert [r.batch_size for r in batch] == [2]


async def test_busy_executor_forms_only_full_batches_early(served):
    fake = RecordingModel()
    model = served(make_spec(max_batch_size=8, max_inflight_batches=2), fake)
    blocker = await hold_executor(model, fake)
    first = [asyncio.ensure_future(model.infer(request(10.0 + i))) for i in range(3)]
    await apoll(lambda: model.queue_depth == 3)
    rest = [asyncio.ensure_future(model.infer(request(20.0 + i))) for i in range(5)]
    # Eight samples make a full batch: it is assembled while the first batch still runs.
    await apoll(lambda: model.queue_depth == 0)
    assert len(fake.batches) == 1
    fake.gate.set()
    await asyncio.gather(blocker, *first, *rest)
    assert fake.batches[1] == [10.0, 11.0, 12.0, 20.0, 21.0, 22.0, 23.0, 24.0]


async def test_partial_batch_waits_for_the_running_one_and_takes_all(served):
    fake = RecordingModel()
    model = served(make_spec(max_batch_size=8, max_inflight_batches=2), fake)
    blocker = await hold_executor(model, fake)
    queued = [asyncio.ensure_future(model.infer(request(10.0 + i))) for i in range(5)]
    await apoll(lambda: model.queue_depth == 5)
    fake.gate.set()
    await asyncio.gather(blocker, *queued)
    assert fake.batches[1:] == [[10.0, 11.0, 12.0, 13.0, 14.0]]


# -- what a model may return (batchgate.batcher.forward.unpack_outputs) -----------------------------------

_OUTS = (TensorSpec("a", "FP32", (2,)), TensorSpec("b", "INT64", (1,)))


def test_unpack_outputs_takes_a_tensor_a_sequence_or_a_dict_by_name():
    a, b = torch.zeros(3, 2), torch.ones(3, 1, dtype=torch.int64)
    assert unpack_outputs(a, _OUTS[:1], "m") == [a]
    assert unpack_outputs(np.zeros(3), _OUTS[:1], "m")[0].shape == (3,)
    for returned in ((a, b), [a, b], (a, b, torch.zeros(1))):  # extra trailing values dropped
        got = unpack_outputs(returned, _OUTS, "m")
        assert len(got) == 2 and got[0] is a and got[1] is b
    got = unpack_outputs({"b": b, "a": a, "extra": a}, _OUTS, "m")  # by name, not dict order
    assert got[0] is a and got[1] is b


@pytest.mark.parametrize("returned, message", [
    ({"a": torch.zeros(1)}, "model 'm' returned a dict without outputs ['b']"),
    ((torch.zeros(1),), "model 'm' returned 1 outputs, its configuration declares 2"),
    ("text", "model 'm' returned str, expected a tensor, a tuple of tensors or a dict of tensors"),
])
def test_unpack_outputs_refuses_what_does_not_fit_the_config(returned, message):
    with pytest.raises(ModelExecutionError) as caught:
        unpack_outputs(returned, _OUTS, "m")
    assert str(caught.value) == message


def test_the_precision_check_reads_outputs_by_the_serving_rule(served):
    # The check runs the model before it serves: a dict without a declared output is refused
    # there with serving's message, not with whatever the lookup raised.
    spec = dataclasses.replace(make_spec(), warmup=True, precision="amp-bf16")
    with pytest.raises(LoadError) as caught:
        served(spec, lambda x: {"z": x * 2})
    assert "returned a dict without outputs ['y']" in str(caught.value)
