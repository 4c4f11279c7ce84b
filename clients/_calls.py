"""What each client method sends and how its answer is unwrapped, and the settings the two
clients take (`ClientBase`), shared by Client and AsyncClient.

The two clients differ only in how they wait (blocking or `await`); everything about a call that
does not depend on that lives here, so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import grpc

from batchgate.clients._endpoints import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_RESOLVE_INTERVAL_S,
    DEFAULT_UNHEALTHY_FOR_S,
    AddressSource,
    EndpointPool,
    Resolver,
    channel_options,
    check_timeout_s,
)
from batchgate.clients._security import PEM, Metadata, auth_metadata, channel_credentials
from batchgate.clients.errors import BatchgateError
from batchgate.clients.infer import InferRequest, InferResult
from batchgate.clients.retry import RetryPolicy
from batchgate.protos import inference_pb2, inference_pb2_grpc

pb = inference_pb2


class Endpoint:
    """One server address: its channel, the stubs on it, and the metadata every call sends."""

    def __init__(self, address: str, channel: grpc.Channel | grpc.aio.Channel,
                 metadata: Metadata = ()) -> None:
        self.address = address
        self.channel = channel
        self.inference = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
        self.metadata = metadata or None  # None: gRPC's own default

    @cached_property
    def health(self):
        # Imported here so that `import clients` does not need grpcio-health-checking.
        from grpc_health.v1 import health_pb2_grpc

        return health_pb2_grpc.HealthStub(self.channel)


def open_endpoint(
    address: str,
    *,
    credentials: grpc.ChannelCredentials | None,
    options: list[tuple[str, Any]],
    aio: bool,
    metadata: Metadata = (),
) -> Endpoint:
    grpc_module = grpc.aio if aio else grpc
    if credentials is None:
        channel = grpc_module.insecure_channel(address, options=options)
    else:
        channel = grpc_module.secure_channel(address, credentials, options=options)
    return Endpoint(address, channel, metadata)


class ClientBase:
    """The settings of `Client` and `AsyncClient` (their docstrings say what each means) and
    the endpoint pool they make; a subclass says whether its channels are grpc.aio ones."""

    _aio: bool

    def __init__(
        self,
        address: str | Sequence[str],
        *,
        timeout_s: float | None = None,
        retry: RetryPolicy | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        tls: bool = False,
        root_certificates: PEM | None = None,
        certificate_chain: PEM | None = None,
        private_key: PEM | None = None,
        token: str | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        options: Sequence[tuple[str, Any]] = (),
        resolve: bool = False,
        resolve_interval_s: float = DEFAULT_RESOLVE_INTERVAL_S,
        unhealthy_for_s: float = DEFAULT_UNHEALTHY_FOR_S,
        resolver: Resolver | None = None,
    ) -> None:
        self._source = AddressSource(
            address, resolve=resolve, resolve_interval_s=resolve_interval_s, resolver=resolver
        )
        channel_args = channel_options(max_message_bytes, options)
        self._timeout_s = check_timeout_s(timeout_s)
        self._retry = check_retry(retry)
        credentials = channel_credentials(
            credentials, tls=tls, root_certificates=root_certificates,
            certificate_chain=certificate_chain, private_key=private_key,
        )
        metadata = auth_metadata(token)
        aio = self._aio
        self._pool = EndpointPool(
            lambda a: open_endpoint(
                a, credentials=credentials, options=channel_args, aio=aio, metadata=metadata
            ),
            unhealthy_for_s=unhealthy_for_s,
        )
        # A blocking client opens the channels of fixed addresses now; an aio client on its
        # first call, because a grpc.aio channel belongs to the loop that first uses it.
        if not aio and not self._source.dynamic:
            self._pool.update(self._source.resolve())


@dataclass(frozen=True)
class Call:
    """One unary RPC: which stub and method, the request, and how to unwrap the response."""

    service: str  # "inference" or "health": the Endpoint attribute holding the stub
    method: str
    request: Any
    unwrap: Callable[[Any], Any]
    idempotent: bool = True

    def invoke(self, endpoint: Endpoint, timeout_s: float | None):
        """Start the RPC: the response (sync channel) or an awaitable of it (aio channel)."""
        method = getattr(getattr(endpoint, self.service), self.method)
        return method(self.request, timeout=timeout_s, metadata=endpoint.metadata)


def _none(_response: Any) -> None:
    return None


def server_live() -> Call:
    return Call("inference", "ServerLive", pb.ServerLiveRequest(), lambda r: r.live)


def server_ready() -> Call:
    return Call("inference", "ServerReady", pb.ServerReadyRequest(), lambda r: r.ready)


def model_ready(model: str, version: str) -> Call:
    request = pb.ModelReadyRequest(name=model, version=version)
    return Call("inference", "ModelReady", request, lambda r: r.ready)


def server_metadata() -> Call:
    return Call("inference", "ServerMetadata", pb.ServerMetadataRequest(), lambda r: r)


def model_metadata(model: str, version: str) -> Call:
    request = pb.ModelMetadataRequest(name=model, version=version)
    return Call("inference", "ModelMetadata", request, lambda r: r)


def model_config(model: str, version: str) -> Call:
    request = pb.ModelConfigRequest(name=model, version=version)
    return Call("inference", "ModelConfig", request, lambda r: r.config)


def model_statistics(model: str, version: str) -> Call:
    request = pb.ModelStatisticsRequest(name=model, version=version)
    return Call("inference", "ModelStatistics", request, lambda r: list(r.model_stats))


def repository_index(ready: bool) -> Call:
    request = pb.RepositoryIndexRequest(ready=ready)
    return Call("inference", "RepositoryIndex", request, lambda r: list(r.models))


def load_model(name: str, config: str | None, files: Mapping[str, bytes] | None) -> Call:
    request = pb.RepositoryModelLoadRequest(model_name=name)
    # Triton's load parameters: "config" (JSON model configuration), "file:<path>" (file bytes).
    if config is not None:
        request.parameters["config"].string_param = config
    for path, content in (files or {}).items():
        request.parameters[f"file:{path}"].bytes_param = content
    # Not idempotent: a load that reached the server may be running when the error comes back.
    return Call("inference", "RepositoryModelLoad", request, _none, idempotent=False)


def unload_model(name: str) -> Call:
    request = pb.RepositoryModelUnloadRequest(model_name=name)
    return Call("inference", "RepositoryModelUnload", request, _none, idempotent=False)


def health(service: str) -> Call:
    from grpc_health.v1 import health_pb2

    def status_name(response) -> str:
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    return Call("health", "Check", health_pb2.HealthCheckRequest(service=service), status_name)


def infer(request: InferRequest, *, idempotent: bool) -> Call:
    return Call("inference", "ModelInfer", request.to_proto(), InferResult.from_proto, idempotent)


def stream_result(message: inference_pb2.ModelStreamInferResponse) -> InferResult:
    """One ModelStreamInfer message as a result, or its in-band error as BatchgateError."""
    if message.error_message:
        # The stream carries errors as text only; the status code is not on the wire.
        raise BatchgateError(grpc.StatusCode.UNKNOWN, message.error_message)
    return InferResult.from_proto(message.infer_response)


def request_protos(
    requests: Iterable[InferRequest] | AsyncIterable[InferRequest],
) -> Iterator[inference_pb2.ModelInferRequest] | AsyncIterator[inference_pb2.ModelInferRequest]:
    """The ModelInferRequest messages of a stream's requests."""
    if isinstance(requests, AsyncIterable):
        return _async_request_protos(requests)
    # A sequence is encoded at once, so that a bad request raises here, in the caller's thread;
    # a lazy iterable is encoded as gRPC's sending thread pulls from it.
    if isinstance(requests, Sequence):
        return iter([_as_request(r).to_proto() for r in requests])
    return (_as_request(r).to_proto() for r in requests)


def _as_request(request: object) -> InferRequest:
    if not isinstance(request, InferRequest):
        raise TypeError(f"stream_infer takes InferRequest objects, got {request!r}")
    return request


def check_retry(retry: RetryPolicy | None) -> RetryPolicy:
    if retry is None:
        return RetryPolicy()
    if not isinstance(retry, RetryPolicy):
        raise TypeError(f"retry must be a RetryPolicy or None, got {retry!r}")
    return retry


async def _async_request_protos(requests: AsyncIterable[InferRequest]):
    async for request in requests:
        yield _as_request(request).to_proto()
