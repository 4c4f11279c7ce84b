"""The KServe v2 / Triton gRPC service: thin handlers over the model repository and the codec.

Each handler turns protocol messages into calls on the repository's models (the one-process
server's ``ModelRepository``) and back; the control RPCs (statistics, index, load, unload) go to
the control plane as the client sent them (``server/executor/control.py``). Errors go through
``batchgate.server.frontend.errors.status_of`` in one place (``_fail``). Every handler hands
``_fail`` whatever it caught, not only ``BatchgateError``: a bug of ours then reaches the client
as INTERNAL with a fixed text, where gRPC would send UNKNOWN with the exception's text.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import structlog
from google.protobuf.message import DecodeError

from batchgate.batcher.errors import (
    BatchgateError,
    ModelUnavailable,
    NotSupported,
    ResourceExhausted,
)
from batchgate.protos import inference_pb2 as pb
from batchgate.protos import inference_pb2_grpc
from batchgate.server import __version__, server_extensions
from batchgate.server.frontend.codec import (
    DEFAULT_LIMITS,
    PlacedRequest,
    RequestLimits,
    decode_request,
    deadline_from,
    encode_outputs,
)
from batchgate.server.executor.control import ControlPlane
from batchgate.server.frontend.drain import DrainGate
from batchgate.server.frontend.errors import status_of
from batchgate.server.rules import messages
from batchgate.server.rules.connections import STREAM_BACKLOG_MESSAGES
from batchgate.server.metrics import UNKNOWN_MODEL_LABEL, ServerMetrics
from batchgate.server.frontend.request_scan import (
    DEFAULT_WIRE_LIMITS,
    MalformedRequest,
    WireLimits,
    scan_infer_request,
)
from batchgate.server.config.settings import Settings
from batchgate.server.executor.shared_memory import OFF_MESSAGE, SharedMemoryRegistry

log = structlog.get_logger(__name__)

# (model, status) pairs with their own batchgate_requests_total series; the rest count under
# UNKNOWN_MODEL_LABEL, as requests for models the repository does not know do.
MAX_LABELLED_COUNTERS = 4096

_END_OF_STREAM = object()
SHUTTING_DOWN_MESSAGE = messages.SHUTTING_DOWN()
SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
# Their requests reach the handlers as bytes, scanned against the wire limits before parsing.
UNPARSED_REQUESTS = frozenset({"ModelInfer", "ModelStreamInfer"})
# What grpcio answers a request its deserializer cannot parse.
PARSE_ERROR = (f"Unexpected {DecodeError}: Error parsing message with type "
               f"'{pb.ModelInferRequest.DESCRIPTOR.full_name}'")


class InferenceService(inference_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, repository, metrics: ServerMetrics, registry: SharedMemoryRegistry,
                 limits: RequestLimits = DEFAULT_LIMITS, control=None, *,
                 wire_limits: WireLimits = DEFAULT_WIRE_LIMITS,
                 shared_memory: bool = False,
                 drain: DrainGate | None = None,
                 max_stream_backlog_bytes: int = Settings.max_stream_backlog_bytes) -> None:
        """``registry``: the clients' shared-memory regions, mapped in this process.
        ``control``: what answers the control RPCs (default: ``ControlPlane(repository)``).
        ``shared_memory``: whether shared-memory tensors are served (``--shared-memory``).
        ``wire_limits``: what a request's bytes may hold (``server/frontend/request_scan.py``).
        ``drain``: the gate the server's other services share (health's Watch streams end with
        the drain too). ``max_stream_backlog_bytes``: the reply bytes a stream holds for a slow
        reader before it stops reading that stream's requests."""
        self._repository = repository
        self._control = control if control is not None else ControlPlane(repository)
        self._shared_memory = shared_memory
        self._registry = registry
        # What ServerMetadata lists: CUDA's extension by the registry's own device.
        self._extensions = tuple(server_extensions(shared_memory,
                                                   cuda=registry.cuda_available()))
        self._metrics = metrics
        self._limits = limits
        self._wire_limits = wire_limits
        self._max_backlog_bytes = max_stream_backlog_bytes
        self._ready = False
        self.drain = drain if drain is not None else DrainGate()
        self._status_counters: dict[tuple[str, grpc.StatusCode], object] = {}
        self._latency: dict[str, object] = {}

    def set_ready(self, ready: bool) -> None:
        self._ready = ready

    def start_draining(self) -> None:
        self.drain.start()

    @property
    def draining(self) -> bool:
        return self.drain.draining

    # -- health and metadata ---------------------------------------------------------------

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self._ready and not self.drain.draining)

    async def ModelReady(self, request, context):
        try:
            model = self._repository.get(request.name, request.version)
        except BatchgateError:
            return pb.ModelReadyResponse(ready=False)
        except Exception as exc:
            return await _fail(context, exc)
        return pb.ModelReadyResponse(ready=model.ready and not self.drain.draining)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(
            name="batchgate", version=__version__, extensions=self._extensions
        )

    async def ModelMetadata(self, request, context):
        try:
            spec = self._repository.get(request.name, request.version).spec
        except Exception as exc:
            return await _fail(context, exc)
        batch = [-1] if spec.batching.max_batch_size > 0 else []
        return pb.ModelMetadataResponse(
            name=spec.name,
            versions=[spec.version],
            platform=spec.platform,
            inputs=[
                pb.ModelMetadataResponse.TensorMetadata(
                    name=t.name, datatype=t.datatype, shape=batch + list(t.dims))
                for t in spec.inputs
            ],
            outputs=[
                pb.ModelMetadataResponse.TensorMetadata(
                    name=t.name, datatype=t.datatype, shape=batch + list(t.dims))
                for t in spec.outputs
            ],
        )

    async def ModelConfig(self, request, context):
        try:
            config = self._repository.config(request.name, request.version)
        except Exception as exc:
            return await _fail(context, exc)
        return pb.ModelConfigResponse(config=config)

    async def ModelStatistics(self, request, context):
        try:
            return await self._control.statistics(request)
        except Exception as exc:
            return await _fail(context, exc)

    # -- inference ---------------------------------------------------------------------------

    async def ModelInfer(self, request_bytes: bytes, context):
        try:
            request = self._parse(request_bytes)
        except (ResourceExhausted, DecodeError) as exc:
            # As the parser's refusals before a handler runs: not an inference answer (nothing
            # names its model yet), so neither counted nor logged as one.
            code, message = _refusal_of(exc)
            await context.abort(code, message)
        started = time.monotonic()
        model_name = request.model_name
        try:
            response = await self._infer(request, deadline_from(context.time_remaining()))
        except asyncio.CancelledError:
            self._count(model_name, grpc.StatusCode.CANCELLED, started, known=None)
            raise
        except BaseException as exc:
            code, message = status_of(exc)
            self._count(model_name, code, started, known=None)
            log.debug("request_failed", model=model_name, request=request.id, code=code.name,
                      error=message)
            await context.abort(code, message)
        self._count(model_name, grpc.StatusCode.OK, started)
        return response

    def _parse(self, data: bytes) -> pb.ModelInferRequest:
        """The request in ``data``, once its bytes are within the wire limits: ResourceExhausted
        naming the limit passed, or DecodeError when they do not parse."""
        try:
            scan_infer_request(data, self._wire_limits)
        except MalformedRequest:
            raise DecodeError(PARSE_ERROR) from None
        return pb.ModelInferRequest.FromString(data)

    async def _infer(self, request: pb.ModelInferRequest, deadline: float | None, *,
                     stream: bool = False):
        if self.drain.draining:
            await self.drain.refuse()  # parked while the drain parks calls (server/frontend/drain.py)
            raise ModelUnavailable(SHUTTING_DOWN_MESSAGE)
        model = self._repository.get(request.model_name, request.model_version)
        spec = model.spec
        decoded = decode_request(request, spec, deadline=deadline, limits=self._limits,
                                 shared_memory=self._shared_memory)
        if type(decoded) is PlacedRequest:
            self._registry.attach(decoded, spec)
            outputs = self._registry.place_outputs(decoded, spec, await model.infer(decoded))
        else:
            outputs = await model.infer(decoded)
        response = pb.ModelInferResponse(
            model_name=spec.name, model_version=spec.version, id=request.id
        )
        return encode_outputs(response, spec, outputs, decoded.requested_outputs,
                              max_reply_bytes=self._limits.max_reply_bytes, stream=stream)

    async def ModelStreamInfer(self, request_iterator, context) -> AsyncIterator:
        """Answers in completion order; an error answers its own request and keeps the stream.
        The drain ends the stream, once its answers are written, with UNAVAILABLE.

        A client that reads slowly holds its replies here: once they pass
        ``max_stream_backlog_bytes`` (the requests still at the model counted as large as the
        largest reply so far, before the first as large as any may be), or the requests and
        replies pass STREAM_BACKLOG_MESSAGES, the stream stops reading until replies go out,
        and HTTP/2's flow control holds the client back; nothing is dropped
        (``server/native/src/stream_call.cc`` does the same)."""
        drain = self.drain
        if drain.streams_ended:
            await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN_MESSAGE)
        answers: asyncio.Queue = asyncio.Queue()
        pending: set[asyncio.Task] = set()
        deadline = deadline_from(context.time_remaining())
        reading = True
        ended_by_drain = False
        backlog = self._metrics.stream_backlog_bytes
        held = largest = 0  # bytes of the answers queued or being written; the largest one
        room = asyncio.Event()  # set whenever the backlog shrinks

        def queue(answer: pb.ModelStreamInferResponse) -> None:
            nonlocal held, largest
            size = answer.ByteSize()
            held += size
            largest = max(largest, size)
            backlog.inc(size)
            answers.put_nowait((answer, size))

        def over_backlog() -> bool:
            if len(pending) + answers.qsize() >= STREAM_BACKLOG_MESSAGES:
                return True
            if not held and not pending:
                return False  # one request is always taken
            estimate = largest or self._limits.max_reply_bytes or self._max_backlog_bytes
            return held + len(pending) * estimate >= self._max_backlog_bytes

        def settled(task: asyncio.Task) -> None:
            pending.discard(task)
            room.set()

        async def answer(request: pb.ModelInferRequest) -> None:
            started = time.monotonic()
            try:
                response = await self._infer(request, deadline, stream=True)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                code, message = status_of(exc)
                self._count(request.model_name, code, started, known=None)
                queue(pb.ModelStreamInferResponse(error_message=message))
                return
            self._count(request.model_name, grpc.StatusCode.OK, started)
            queue(pb.ModelStreamInferResponse(infer_response=response))

        async def read() -> None:
            nonlocal reading
            try:
                try:
                    async for data in request_iterator:
                        try:
                            request = self._parse(data)
                        except ResourceExhausted as exc:  # that request alone is refused
                            queue(pb.ModelStreamInferResponse(error_message=status_of(exc)[1]))
                        else:
                            # A DecodeError ends the stream as grpcio's deserializer raising
                            # in the request iterator did: with the answers already queued.
                            task = asyncio.create_task(answer(request))
                            pending.add(task)
                            task.add_done_callback(settled)
                        if over_backlog():
                            self._metrics.stream_pauses.inc()
                            while over_backlog():
                                room.clear()
                                await room.wait()
                except asyncio.CancelledError:
                    if not ended_by_drain:
                        raise
                reading = False
                if pending:
                    await asyncio.gather(*pending, return_exceptions=True)
            finally:
                answers.put_nowait((_END_OF_STREAM, 0))

        def end_for_drain() -> None:
            nonlocal ended_by_drain
            if reading:  # a client that half-closed gets its answers and OK
                ended_by_drain = True
                reader.cancel()

        reader = asyncio.create_task(read())
        drain.watch_stream(end_for_drain)
        try:
            while True:
                item, size = await answers.get()
                if item is _END_OF_STREAM:
                    break
                yield item
                held -= size  # written
                backlog.dec(size)
                room.set()
            if ended_by_drain:
                await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN_MESSAGE)
            # While the drain parks calls, a client waits for its stream's end instead of
            # opening the next stream into the shutdown.
            await drain.hold()
        finally:
            drain.forget_stream(end_for_drain)
            # The client went away (or the stream broke): queued requests leave their queues.
            reader.cancel()
            for task in list(pending):
                task.cancel()
            backlog.dec(held)  # what was never written leaves with the stream

    # -- repository --------------------------------------------------------------------------

    async def RepositoryIndex(self, request, context):
        try:
            return await self._control.index(request)
        except Exception as exc:
            return await _fail(context, exc)

    async def RepositoryModelLoad(self, request, context):
        try:
            return await self._control.load(request)
        except Exception as exc:
            return await _fail(context, exc)

    async def RepositoryModelUnload(self, request, context):
        try:
            return await self._control.unload(request)
        except Exception as exc:
            return await _fail(context, exc)

    # -- shared memory: the registrations live where the models run ---------------------------

    async def _regions_call(self, method: str, request, context):
        try:
            if not self._shared_memory:
                raise NotSupported(OFF_MESSAGE)
            return await getattr(self._registry, method)(request)
        except Exception as exc:
            return await _fail(context, exc)

    async def SystemSharedMemoryStatus(self, request, context):
        return await self._regions_call("system_status", request, context)

    async def SystemSharedMemoryRegister(self, request, context):
        return await self._regions_call("system_register", request, context)

    async def SystemSharedMemoryUnregister(self, request, context):
        return await self._regions_call("system_unregister", request, context)

    async def CudaSharedMemoryStatus(self, request, context):
        return await self._regions_call("cuda_status", request, context)

    async def CudaSharedMemoryRegister(self, request, context):
        return await self._regions_call("cuda_register", request, context)

    async def CudaSharedMemoryUnregister(self, request, context):
        return await self._regions_call("cuda_unregister", request, context)

    # -- not provided ------------------------------------------------------------------------

    async def TraceSetting(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, messages.TRACING_UNSUPPORTED())

    async def LogSettings(self, request, context):
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            messages.LOG_SETTINGS_FIXED(),
        )

    # -- helpers -----------------------------------------------------------------------------

    def _count(self, model: str, code: grpc.StatusCode, started: float, *,
               known: bool | None = True) -> None:
        """``known``: whether ``model`` is one the repository knows (None: look it up)."""
        if known is None:
            known = self._repository.knows(model)
        if not known:
            # Model names come from clients: only the repository's own become labels, so no
            # client can grow /metrics or this process's memory by the names it sends.
            model = UNKNOWN_MODEL_LABEL
        counter = self._status_counters.get((model, code))
        if counter is None:
            # Past a bound (models loaded under ever new names), new pairs share that label too.
            if len(self._status_counters) >= MAX_LABELLED_COUNTERS:
                model = UNKNOWN_MODEL_LABEL
                counter = self._status_counters.get((model, code))
            if counter is None:
                counter = self._metrics.requests.labels(model, code.name)
                self._status_counters[(model, code)] = counter
        counter.inc()
        if code is grpc.StatusCode.OK:
            histogram = self._latency.get(model)
            if histogram is None:
                histogram = self._latency[model] = self._metrics.request_seconds.labels(model)
            histogram.observe(time.monotonic() - started)


def _refusal_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, DecodeError):
        return grpc.StatusCode.UNKNOWN, PARSE_ERROR
    return status_of(exc)


def add_to_server(servicer: InferenceService, server) -> None:
    """Serve ``servicer`` on ``server`` as the generated ``add_..._to_server`` does, except
    that ModelInfer's and ModelStreamInfer's requests reach it unparsed (without a
    deserializer gRPC hands a handler the bytes), to be scanned before they are parsed."""
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    handlers = {}
    for method in SERVICE.methods:
        request_type = getattr(pb, method.input_type.name)
        response_type = getattr(pb, method.output_type.name)
        handlers[method.name] = make[(method.client_streaming, method.server_streaming)](
            getattr(servicer, method.name),
            request_deserializer=(None if method.name in UNPARSED_REQUESTS
                                  else request_type.FromString),
            response_serializer=response_type.SerializeToString)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)


async def _fail(context: grpc.aio.ServicerContext, exc: BaseException):
    code, message = status_of(exc)
    await context.abort(code, message)
