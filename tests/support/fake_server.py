"""A fake KServe v2 server for the SDK's tests: ``FakeInference`` answers by model name and
records what it got; ``FakeServer`` runs it on a real grpc.aio server on loopback, on its own
event loop in a thread, so synchronous clients can block on it."""

from __future__ import annotations

import asyncio
import collections
import threading

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from batchgate.protos import inference_pb2 as pb
from batchgate.protos import inference_pb2_grpc, model_config_pb2

# Independent of batchgate.clients.codec on purpose: the tests must not share the SDK's tables.
DATATYPES = {
    np.bool_: "BOOL",
    np.uint8: "UINT8",
    np.uint16: "UINT16",
    np.uint32: "UINT32",
    np.uint64: "UINT64",
    np.int8: "INT8",
    np.int16: "INT16",
    np.int32: "INT32",
    np.int64: "INT64",
    np.float16: "FP16",
    np.float32: "FP32",
    np.float64: "FP64",
}
NUMPY_OF = {name: np.dtype(t).newbyteorder("<") for t, name in DATATYPES.items()}
NUMPY_OF["BF16"] = np.dtype("<u2")
TYPED_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}


class FakeInference(inference_pb2_grpc.GRPCInferenceServiceServicer):
    """Answers by model name.

    echo: outputs = inputs (raw), only the requested ones when some are; echo_typed: the same in
    typed `contents`; short: a raw buffer one byte short; invalid: INVALID_ARGUMENT; hang: never
    answers. Any model named in `unavailable_left` first fails that many times with UNAVAILABLE.
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self.reset()

    def reset(self) -> None:
        self.requests: list[pb.ModelInferRequest] = []
        self.attempts: collections.Counter[str] = collections.Counter()
        self.unavailable_left: dict[str, int] = {}
        self.loads: list[pb.RepositoryModelLoadRequest] = []
        self.unloads: list[str] = []

    def _echo(self, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
        response = pb.ModelInferResponse(
            model_name=request.model_name, model_version=request.model_version or "1", id=request.id
        )
        response.parameters["served_by"].string_param = self.label
        tensors = {t.name: (t, raw) for t, raw in zip(request.inputs, request.raw_input_contents)}
        for name in [o.name for o in request.outputs] or list(tensors):
            tensor, raw = tensors[name]
            output = response.outputs.add(name=name, datatype=tensor.datatype, shape=tensor.shape)
            if request.model_name == "echo_typed":
                values = np.frombuffer(raw, NUMPY_OF[tensor.datatype]).tolist()
                getattr(output.contents, TYPED_FIELD[tensor.datatype]).extend(values)
            elif request.model_name == "short":
                response.raw_output_contents.append(raw[:-1])
            else:
                response.raw_output_contents.append(raw)
        return response

    async def ModelInfer(self, request, context):
        self.requests.append(request)
        self.attempts[request.model_name] += 1
        if self.unavailable_left.get(request.model_name, 0) > 0:
            self.unavailable_left[request.model_name] -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "model is loading")
        if request.model_name == "invalid":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "input 'x': expected FP32")
        if request.model_name == "hang":
            await asyncio.Event().wait()
        return self._echo(request)

    async def ModelStreamInfer(self, request_iterator, context):
        async for request in request_iterator:
            self.requests.append(request)
            if request.model_name == "invalid":
                yield pb.ModelStreamInferResponse(error_message=f"request {request.id}: bad input")
            else:
                yield pb.ModelStreamInferResponse(infer_response=self._echo(request))

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=True)

    async def ModelReady(self, request, context):
        return pb.ModelReadyResponse(ready=request.name == "echo")

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="fake", version="0", extensions=["model_repository"])

    async def ModelMetadata(self, request, context):
        if request.name != "echo":
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.name!r}")
        tensor = pb.ModelMetadataResponse.TensorMetadata(name="x", datatype="FP32", shape=[-1, 3])
        return pb.ModelMetadataResponse(
            name="echo", versions=["1"], platform="pytorch", inputs=[tensor], outputs=[tensor]
        )

    async def ModelConfig(self, request, context):
        return pb.ModelConfigResponse(
            config=model_config_pb2.ModelConfig(name=request.name, max_batch_size=8)
        )

    async def ModelStatistics(self, request, context):
        stats = pb.ModelStatistics(name="echo", version="1", inference_count=len(self.requests))
        return pb.ModelStatisticsResponse(model_stats=[stats])

    async def RepositoryIndex(self, request, context):
        models = [pb.RepositoryIndexResponse.ModelIndex(name="echo", version="1", state="READY")]
        if not request.ready:
            models.append(pb.RepositoryIndexResponse.ModelIndex(name="idle", state="UNAVAILABLE"))
        return pb.RepositoryIndexResponse(models=models)

    async def RepositoryModelLoad(self, request, context):
        self.loads.append(request)
        if request.model_name == "flaky":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "repository busy")
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, context):
        self.unloads.append(request.model_name)
        return pb.RepositoryModelUnloadResponse()


class FakeServer:
    """``FakeInference`` on a grpc.aio server on ``port`` (0: a free one), on its own event
    loop in a thread. ``health``: also serve gRPC health ("" SERVING, "draining" NOT_SERVING).
    It can be stopped and started again on the same port."""

    def __init__(self, label: str, port: int = 0, health: bool = True) -> None:
        self.servicer = FakeInference(label)
        self._health = health
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"server-{label}")
        self._thread.start()
        self._server, self.port = self._run(self._start(port))
        self.address = f"127.0.0.1:{self.port}"

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    async def _start(self, port: int):
        server = grpc.aio.server()
        inference_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(self.servicer, server)
        if self._health:
            health = health_aio.HealthServicer()
            await health.set("", health_pb2.HealthCheckResponse.SERVING)
            await health.set("draining", health_pb2.HealthCheckResponse.NOT_SERVING)
            health_pb2_grpc.add_HealthServicer_to_server(health, server)
        bound = server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        return server, bound

    @property
    def attempts(self) -> int:
        """How many times ``echo`` was asked for."""
        return self.servicer.attempts["echo"]

    def stop(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self._server.stop(None))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
