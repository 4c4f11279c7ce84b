"""Graceful drain: health goes NOT_SERVING, new requests get UNAVAILABLE, queued ones finish."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import inference_pb2 as pb
from protos import inference_pb2_grpc
from tests.conftest import start_server
from tests.test_server import infer_request


def test_stop_answers_queued_requests_and_refuses_new_ones(model_repository):
    server = start_server(model_repository)
    try:
        module = server.module("gated")
        model = server.gateway.repository.get("gated")
        with grpc.insecure_channel(server.address) as channel:
            stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            module.gate.clear()
            x = lambda v: infer_request("gated", {"INPUT__0": np.full((1, 2), v, np.float32)})
            running = stub.ModelInfer.future(x(1))
            assert module.entered.wait(10)
            queued = stub.ModelInfer.future(x(2))
            deadline = time.monotonic() + 10
            while model.queue_depth != 1:
                assert time.monotonic() < deadline
                time.sleep(0.002)

            stopping = threading.Thread(target=server.call, args=(server.gateway.stop(10),))
            stopping.start()
            deadline = time.monotonic() + 10
            while health.Check(health_pb2.HealthCheckRequest(service="")).status != \
                    health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.monotonic() < deadline
                time.sleep(0.002)
            assert not stub.ServerReady(pb.ServerReadyRequest()).ready
            try:
                stub.ModelInfer(x(3))
                raise AssertionError("a request sent during the drain was accepted")
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE
                assert "shutting down" in err.details()
            module.gate.set()
            out = [np.frombuffer(f.result(10).raw_output_contents[0], np.float32) for f in (running, queued)]
            assert [o[0] for o in out] == [2.0, 4.0]
            stopping.join(30)
            assert not stopping.is_alive()
    finally:
        module.gate.set()
        server.loop.call_soon_threadsafe(server.loop.stop)
        server.thread.join(30)
