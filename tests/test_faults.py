"""Faults inside a model: a hang, and a model that kills its own thread.

A model that raises, returns the wrong batch dimension, or is unloaded with requests queued is
covered in tests/test_server.py and tests/test_repository.py. Here, over real gRPC in both
modes: a batch that outlives ``execution_timeout_ms`` fails with a status naming the limit while
the instance goes on serving; a model that raises SystemExit takes its instance down, the model
reports NOT_SERVING, later requests get UNAVAILABLE at once, and a load RPC brings
it back. The runner that enforces the limit is also tested on its own.
"""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batchgate.batcher.watchdog import ExecutionTimeout, TimedRunner, TooManyHungCalls
from batchgate.protos import inference_pb2 as pb
from tests.support.polling import poll

WAIT_S = 60


# -- the runner on its own ------------------------------------------------------------------


def test_runner_returns_results_and_raises_the_calls_errors():
    runner = TimedRunner("t", timeout_s=WAIT_S)
    try:
        assert runner.run(lambda a, b: a + b, 2, 3) == 5
        with pytest.raises(KeyError, match="boom"):
            runner.run(lambda: {}["boom"])
        assert runner.run(lambda: threading.current_thread().name) == "t-runner-1"
    finally:
        runner.close()


def test_a_hung_call_is_abandoned_and_a_fresh_runner_serves_the_next():
    release = threading.Event()
    late = threading.Event()
    runner = TimedRunner("t", timeout_s=0.05)
    try:
        with pytest.raises(ExecutionTimeout, match="50 ms"):
            runner.run(release.wait, on_late=late.set)
        assert runner.hung == 1
        assert runner.run(lambda: threading.current_thread().name) == "t-runner-2"
        assert not late.is_set()
        release.set()  # the hung call returns: its late callback runs, it is no longer hung
        assert late.wait(WAIT_S)
        poll(lambda: runner.hung == 0, WAIT_S, "the abandoned call to be counted as returned")
    finally:
        release.set()
        runner.close()


def test_too_many_hung_calls_stop_the_runner():
    release = threading.Event()
    runner = TimedRunner("t", timeout_s=0.02, max_abandoned=2)
    try:
        for _ in range(2):
            with pytest.raises(ExecutionTimeout):
                runner.run(release.wait)
        with pytest.raises(TooManyHungCalls, match="3 calls are still hung"):
            runner.run(release.wait)
    finally:
        release.set()
        runner.close()


# -- through the server ---------------------------------------------------------------------


def request_for(model: str, x: np.ndarray) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=model)
    req.inputs.add(name="INPUT__0", datatype="FP32", shape=x.shape)
    req.raw_input_contents.append(x.astype(np.float32).tobytes())
    return req


def answer(reply: pb.ModelInferResponse) -> np.ndarray:
    return np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(
        tuple(reply.outputs[0].shape))


def test_a_hung_batch_fails_with_the_limit_named_and_the_instance_keeps_serving(server, stub):
    unhang = server.gate.dir / "unhang"
    unhang.unlink(missing_ok=True)
    try:
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request_for("hanging", np.full((1, 2), 7.0)), timeout=WAIT_S)
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert "execution_timeout_ms=1000" in info.value.details()

        # The next batches run on a fresh thread while the hung one is still stuck.
        for value in (1.0, 2.0, 3.0):
            reply = stub.ModelInfer(request_for("hanging", np.full((1, 2), value)), timeout=WAIT_S)
            np.testing.assert_array_equal(answer(reply), np.full((1, 2), value + 1))
    finally:
        unhang.touch()
    if server.multiprocess:
        # The hung batch's inputs live in the shared arena: freed once its call returned.
        poll(lambda: server.metric("batchgate_arena_bytes_in_use") == 0, WAIT_S,
             "the abandoned batch's arena blocks to be released")
    ready = stub.ModelReady(pb.ModelReadyRequest(name="hanging"), timeout=WAIT_S)
    assert ready.ready


def test_a_model_that_kills_its_thread_goes_not_serving_and_loads_again(server, stub, channel):
    health = health_pb2_grpc.HealthStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request_for("fatal", np.full((1, 2), 13.0)), timeout=WAIT_S)
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "SystemExit" in info.value.details() and "stopped serving" in info.value.details()

    def not_ready() -> bool:
        return not stub.ModelReady(pb.ModelReadyRequest(name="fatal"), timeout=WAIT_S).ready

    poll(not_ready, WAIT_S, "the model to report not ready")
    status = health.Check(health_pb2.HealthCheckRequest(service="fatal"), timeout=WAIT_S).status
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    index = stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=WAIT_S)
    [entry] = [m for m in index.models if m.name == "fatal"]
    assert entry.state == "UNAVAILABLE" and "SystemExit" in entry.reason
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request_for("fatal", np.ones((1, 2))), timeout=WAIT_S)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # The rest of the server is untouched.
    reply = stub.ModelInfer(request_for("failing", np.ones((1, 2))), timeout=WAIT_S)
    np.testing.assert_array_equal(answer(reply), np.full((1, 2), 2.0))

    stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="fatal"), timeout=WAIT_S)
    reply = stub.ModelInfer(request_for("fatal", np.ones((1, 2))), timeout=WAIT_S)
    np.testing.assert_array_equal(answer(reply), np.full((1, 2), 2.0))
    status = health.Check(health_pb2.HealthCheckRequest(service="fatal"), timeout=WAIT_S).status
    assert status == health_pb2.HealthCheckResponse.SERVING
