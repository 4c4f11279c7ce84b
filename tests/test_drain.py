"""Graceful drain: health goes NOT_SERVING, new requests get UNAVAILABLE, queued ones finish."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import inference_pb2_grpc
from tests.conftest import SERVER_MODES, poll, start_in_mode
from tests.test_server import infer_request


@pytest.mark.parametrize("mode", SERVER_MODES)
def test_stop_answers_queued_requests_and_refuses_new_ones(model_repository, gate, mode):
    server = start_in_mode(mode, model_repository, gate)
    stopping = None
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            gate.close()
            x = lambda v: infer_request("gated", {"INPUT__0": np.full((1, 2), v, np.float32)})
            running = stub.ModelInfer.future(x(1))
            gate.wait_entered()
            queued = stub.ModelInfer.future(x(2))
            poll(lambda: server.queue_depth("gated") == 1, what="request queued")

            stopping = threading.Thread(target=server.stop)
            stopping.start()
            poll(lambda: health.Check(health_pb2.HealthCheckRequest(service="")).status
                 == health_pb2.HealthCheckResponse.NOT_SERVING, what="NOT_SERVING")
            with pytest.raises(grpc.RpcError) as err:
                stub.ModelInfer(x(3), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            gate.open()
            out = [np.frombuffer(f.result(10).raw_output_contents[0], np.float32)
                   for f in (running, queued)]
            assert [o[0] for o in out] == [2.0, 4.0]
            stopping.join(60)
            assert not stopping.is_alive()
    finally:
        gate.open()
        if stopping is None:
            server.stop()
