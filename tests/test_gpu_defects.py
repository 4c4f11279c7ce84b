"""The GPU path's failure handling, on the CPU: out-of-memory splits, time limits that cover
the device's work, CUDA errors that break the device, the gather, the stager, pinning, and the
precision bound. Where CUDA itself is needed a stand-in plays its part (an event that never
completes, the messages torch raises); what only a GPU can show is marked ``cuda``.
"""

from __future__ import annotations

import threading
import types
import weakref

import numpy as np
import pytest
import structlog
import torch
from prometheus_client import CollectorRegistry

from batchgate.batcher import gpu, precision
from batchgate.batcher.errors import LoadError, ModelExecutionError, ModelUnavailable
from batchgate.batcher.batch import Batch, ExecutorPlan, Slot
from batchgate.batcher.executor import Executor
from batchgate.batcher.buckets import BatchBuckets
from batchgate.batcher.memory import DevicePools, PoolSettings
from batchgate.batcher.metrics import BatcherMetrics
from batchgate.batcher.model import ServedModel
from batchgate.batcher.request import QUEUED, TAKEN, InferenceRequest
from batchgate.batcher.spec import BatchingConfig, ModelSpec, TensorSpec
from batchgate.batcher.staging import Block, InputStager
from tests.support.batching import infer_x, unit_spec
from batchgate.server.executor.process import pin_arena

CUDA = torch.cuda.is_available()
ILLEGAL_ADDRESS = ("CUDA error: an illegal memory access was encountered\n"
                   "CUDA kernel errors might be asynchronously reported at some other API call")
CUBLAS_ALLOC = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"


# -- out of memory -----------------------------------------------------------------------------


async def test_the_out_of_memory_split_runs_after_the_failed_forward_is_released():
    class Activations:  # what the failed forward held when it ran out of memory
        pass

    held: list[weakref.ref] = []
    alive_while_halves_ran: list[bool] = []

    def forward(x):
        if x.shape[0] > 2 and bool(x.abs().sum() > 0):
            activations = Activations()
            held.append(weakref.ref(activations))
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        if held:
            alive_while_halves_ran.append(held[-1]() is not None)
        return x * 2

    model = ServedModel(unit_spec(buckets=(1, 2, 4, 8)), forward,
                        pools=DevicePools(PoolSettings(1 << 20)))
    model.start()
    try:
        x = np.arange(8, dtype=np.float32).reshape(4, 2) + 1
        np.testing.assert_array_equal(await infer_x(model, x), x * 2)
    finally:
        model.stop(5)
    # Both halves ran, and neither while the failed call's frame (its activations) was alive.
    assert alive_while_halves_ran == [False, False]


async def test_a_cublas_allocation_failure_is_split_like_out_of_memory():
    registry = CollectorRegistry()

    def forward(x):
        if x.shape[0] > 2 and bool(x.abs().sum() > 0):
            raise RuntimeError(CUBLAS_ALLOC)
        return x + 1

    model = ServedModel(unit_spec(buckets=(1, 2, 4, 8)), forward, metrics=BatcherMetrics(registry))
    model.start()
    try:
        x = np.ones((4, 2), np.float32)
        np.testing.assert_array_equal(await infer_x(model, x), x + 1)
    finally:
        model.stop(5)
    assert registry.get_sample_value("batchgate_oom_events_total", {"model": "unit"}) == 1


@pytest.mark.parametrize(("error", "kind"), [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "oom"),
    (RuntimeError(CUBLAS_ALLOC), "oom"),
    (RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), "oom"),
    (RuntimeError(ILLEGAL_ADDRESS), "sticky"),
    (RuntimeError("CUDA error: device-side assert triggered"), "sticky"),
    (RuntimeError("CUDA error: unspecified launch failure"), "sticky"),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x2 and 3x3)"), None),
    (ValueError("an illegal memory access, says a model's own message"), None),
])
def test_errors_are_classified(error, kind):
    assert gpu.classify(error) == kind


# -- CUDA errors that break the device ---------------------------------------------------------


async def test_a_sticky_cuda_error_stops_the_instance_and_tells_the_process(monkeypatch):
    lost: list[str] = []
    monkeypatch.setattr(gpu, "on_device_lost", lost.append)
    failed: list[str] = []

    def forward(x):
        if bool((x == 13).any()):
            raise RuntimeError(ILLEGAL_ADDRESS)
        return x

    model = ServedModel(unit_spec(warmup=False), forward, on_failed=failed.append)
    model.start()
    try:
        with pytest.raises(ModelExecutionError, match="unusable"):
            await infer_x(model, np.full((1, 2), 13.0, np.float32))
        assert lost and "illegal memory access" in lost[0]
        assert not model.ready and failed
        with pytest.raises(ModelUnavailable):
            await infer_x(model, np.ones((1, 2), np.float32))
    finally:
        model.stop(5)


class FailsOnDevice:
    """A CUDA event whose work hit an illegal address: CUDA reports it when asked."""

    def query(self) -> bool:
        raise RuntimeError(ILLEGAL_ADDRESS)

    synchronize = query


async def test_a_sticky_error_reported_by_the_device_late_stops_the_instance(monkeypatch):
    lost: list[str] = []
    monkeypatch.setattr(gpu, "on_device_lost", lost.append)
    launch = Executor._launch

    def launch_that_fails_on_the_device(self, batch):
        outputs = launch(self, batch)
        if bool((batch.tensors[0] == 13).any()):
            batch.done = FailsOnDevice()  # the launch returned; the kernel failed later
        return outputs

    monkeypatch.setattr(Executor, "_launch", launch_that_fails_on_the_device)
    model = ServedModel(unit_spec(warmup=False), lambda x: x)
    model.start()
    try:
        with pytest.raises(ModelExecutionError, match="unusable"):
            await infer_x(model, np.full((1, 2), 13.0, np.float32))
        assert lost and not model.ready
    finally:
        model.stop(5)


# -- the time limit covers the device's work ---------------------------------------------------


class NeverDone:
    """A CUDA event whose work does not end until ``finish()`` (a hung kernel)."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()

    def finish(self) -> None:
        self._done.set()


async def test_execution_timeout_covers_the_wait_for_the_device(monkeypatch):
    hung = NeverDone()
    launch = Executor._launch

    def launch_with_device_work(self, batch):
        outputs = launch(self, batch)
        if bool((batch.tensors[0] == 13).any()):
            batch.done = hung  # the kernels were launched; the device has not finished them
        return outputs

    monkeypatch.setattr(Executor, "_launch", launch_with_device_work)
    model = ServedModel(unit_spec(warmup=False, execution_timeout_ms=200), lambda x: x * 2,
                        pools=DevicePools(PoolSettings(1 << 20)))
    model.start()
    try:
        with pytest.raises(ModelExecutionError, match="execution_timeout_ms=200.*still running"):
            await infer_x(model, np.full((2, 2), 13.0, np.float32))
        np.testing.assert_array_equal(await infer_x(model, np.ones((2, 2), np.float32)),
                                      np.full((2, 2), 2.0, np.float32))
        hung.finish()  # the late work ends: its inputs go back with the next batch
        for value in (3.0, 4.0):
            np.testing.assert_array_equal(
                await infer_x(model, np.full((2, 2), value, np.float32)),
                np.full((2, 2), 2 * value, np.float32))
        assert model.ready
    finally:
        hung.finish()
        model.stop(5)


def test_wait_event_gives_up_at_its_deadline_and_returns_when_done():
    event = NeverDone()
    assert gpu.wait_event(event, 0.05) is False
    event.finish()
    assert gpu.wait_event(event, 0.05) is True
    assert gpu.wait_event(event, None) is True


# -- the gather --------------------------------------------------------------------------------


def test_a_batch_is_gathered_with_one_operation_per_input(monkeypatch):
    spec = ModelSpec(name="two", version="1", platform="test",
                     inputs=(TensorSpec("a", "FP32", (3,)), TensorSpec("b", "INT64", (1,))),
                     outputs=(TensorSpec("y", "FP32", (3,)),),
                     batching=BatchingConfig(max_batch_size=16))
    slot = Slot(0, [torch.zeros(16, 3), torch.zeros(16, 1, dtype=torch.int64)])
    plan = ExecutorPlan([slot], BatchBuckets((16,), 16))
    executor = Executor(spec, lambda a, b: a, index=0, next_batch=lambda *_: None,
                        wake=lambda: None, deliver=lambda _: None, batch_ids=lambda: 1,
                        plan=plan)
    rng = np.random.default_rng(0)
    requests = [InferenceRequest([rng.standard_normal((n, 3), dtype=np.float32),
                                  rng.integers(0, 9, (n, 1))], batch_size=n)
                for n in (1, 3, 2, 1, 4)]
    calls = []
    concatenate = np.concatenate
    monkeypatch.setattr(np, "concatenate",
                        lambda arrays, **kw: calls.append(len(arrays)) or concatenate(arrays, **kw))
    batch = Batch(1, requests, "full")
    batch.slot = slot
    executor._assemble(batch)
    assert calls == [5, 5]  # one per input, each over the five requests
    np.testing.assert_array_equal(slot.inputs[0][:11].numpy(),
                                  concatenate([r.inputs[0] for r in requests]))
    np.testing.assert_array_equal(slot.inputs[1][:11].numpy(),
                                  concatenate([r.inputs[1] for r in requests]))
    assert not slot.inputs[0][11:].any()  # padding up to the bucket is zero


# -- the stager --------------------------------------------------------------------------------


def test_the_stager_copies_outside_its_lock_and_drops_a_request_taken_meanwhile():
    stager_box: list[InputStager] = []
    released: list[int] = []
    request = InferenceRequest([np.ones((2, 2), np.float32)], batch_size=2)
    request.state = QUEUED

    def allocate(shape, dtype):
        lock = stager_box[0]._lock
        assert lock.acquire(blocking=False), "the stager held its lock while staging"
        lock.release()
        request.state = TAKEN  # its batch took it while the stager was at work
        tensor = torch.empty(shape, dtype=dtype)
        return Block(tensor, lambda: released.append(tensor.nbytes), tensor.nbytes, True)

    stager = InputStager("unit", torch.device("cpu"), to_tensor=lambda a, i: torch.from_numpy(a),
                         dtypes=[torch.float32], allocate=allocate, cap_bytes=1 << 20)
    stager_box.append(stager)
    stager._stage(request)
    assert stager.claim(request) is None  # never recorded: the batch copied it itself
    assert released == [16] and stager._bytes == 0


# -- pinning the arena -------------------------------------------------------------------------


@pytest.mark.parametrize(("pin", "pinned"), [
    (lambda: True, 1.0), (lambda: False, 0.0),
    (lambda: (_ for _ in ()).throw(RuntimeError("CUDA error: out of memory")), 0.0),
])
def test_pinning_the_arena_falls_back_to_unpinned_with_one_warning(pin, pinned):
    registry = CollectorRegistry()
    arena = types.SimpleNamespace(pin=pin, size=1 << 20)
    with structlog.testing.capture_logs() as logs:
        assert pin_arena(arena, BatcherMetrics(registry)) is bool(pinned)
    assert registry.get_sample_value("batchgate_arena_pinned") == pinned
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == (1 if "throw" in pin.__code__.co_names else 0)


# -- the precision bound -----------------------------------------------------------------------


def _precision_spec(mode: str) -> ModelSpec:
    return ModelSpec(name="p", version="1", platform="test",
                     inputs=(TensorSpec("x", "FP32", (4,)),),
                     outputs=(TensorSpec("y", "FP32", (4,)),),
                     batching=BatchingConfig(max_batch_size=4), precision=mode)


def _run(module, arrays, mode):
    with precision.autocast(mode, "cpu"):
        return [module(torch.from_numpy(arrays[0]))]


def test_a_precision_beyond_its_bound_fails_the_load():
    def drifts(x):  # 10 % off whenever it runs reduced
        return x * 1.1 if torch.is_autocast_enabled("cpu") else x

    spec = _precision_spec("amp-bf16")
    with pytest.raises(LoadError, match="above its bound of 5e-02"):
        precision.check(spec, drifts, precision.seeded_inputs(spec), _run)
    module, report = precision.check(spec, lambda x: x, precision.seeded_inputs(spec), _run)
    assert report.max_relative_error == 0.0


def test_the_fp32_reference_runs_without_tf32():
    seen: dict[str, bool] = {}

    def run(module, arrays, mode):
        seen[mode] = torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32
        return _run(module, arrays, mode)

    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        spec = _precision_spec("amp-bf16")
        precision.check(spec, lambda x: x, precision.seeded_inputs(spec), run)
        assert seen == {"fp32": False, "amp-bf16": True}  # off for the reference only
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
