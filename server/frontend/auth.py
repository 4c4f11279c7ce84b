"""Bearer-token authorization of the inference service, as a grpc.aio server interceptor.

Two tokens, each optional. The **admin token** guards the RPCs that change or reveal what is
served: RepositoryModelLoad, RepositoryModelUnload, RepositoryIndex, the six shared-memory
registration RPCs (they open files and device memory on the server's host by name), and
LogSettings, TraceSetting. The **infer token** guards every other RPC of the inference service except
ServerLive and ServerReady, which stay open like grpc.health.v1 and reflection: probes and load
balancers call them without credentials. The admin token is accepted wherever the infer token
is; with only the infer token set, it guards the admin RPCs too.

A call without ``authorization: Bearer <token>`` metadata gets UNAUTHENTICATED; one with a token
that is not accepted gets PERMISSION_DENIED. Tokens are compared with ``hmac.compare_digest``
(time independent of where they differ). Nothing here logs a token or the metadata carrying it.

The interceptor is installed only when a token is set, so a server without tokens runs no
interceptor at all. With one, an RPC costs a dict lookup and a scan of its metadata: the refusal
handlers are built once, at start-up.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence

import grpc
import structlog

from batchgate.protos import inference_pb2
from batchgate.server.rules import messages
from batchgate.server.rules.rpc_access import ADMIN_METHODS, METADATA_KEY, OPEN_METHODS
from batchgate.server.config.settings import Settings

log = structlog.get_logger(__name__)

SERVICE = inference_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]


def accepted_tokens(method: str, *, admin_token: str | None,
                    infer_token: str | None) -> tuple[str, ...]:
    """The tokens that open ``method`` (an inference-service RPC name); () when it is open."""
    if method in OPEN_METHODS:
        return ()
    if method in ADMIN_METHODS:
        chosen = admin_token or infer_token
        return (chosen,) if chosen else ()
    if infer_token:
        return tuple(t for t in (infer_token, admin_token) if t)
    return ()


def bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The token of the ``authorization: Bearer <token>`` entry; "" when the entry is there but
    holds no bearer token; None when there is no such entry."""
    for key, value in metadata or ():
        if key == METADATA_KEY:
            if not isinstance(value, str):
                return ""
            scheme, _, token = value.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


class _Rule:
    """What one guarded RPC accepts, and its two refusals, built once."""

    __slots__ = ("_accepted", "missing", "wrong")

    def __init__(self, accepted: tuple[str, ...], missing: grpc.RpcMethodHandler,
                 wrong: grpc.RpcMethodHandler) -> None:
        self._accepted = accepted
        self.missing = missing
        self.wrong = wrong

    def accepts(self, token: str) -> bool:
        if not token.isascii():  # compare_digest takes ASCII str only; no token of ours is not
            return False
        ok = False
        for expected in self._accepted:  # no early exit: every token is compared
            ok |= hmac.compare_digest(token, expected)
        return ok


class TokenAuth(grpc.aio.ServerInterceptor):
    def __init__(self, *, admin_token: str | None, infer_token: str | None) -> None:
        self._rules: dict[str, _Rule] = {}
        for method in SERVICE.methods:
            accepted = accepted_tokens(method.name, admin_token=admin_token,
                                       infer_token=infer_token)
            if not accepted:
                continue
            admin = method.name in ADMIN_METHODS and admin_token is not None
            kind = (method.client_streaming, method.server_streaming)
            which = (messages.TOKEN_MISSING_WHICH_ADMIN if admin
                     else messages.TOKEN_MISSING_WHICH).text
            missing = _refusal(kind, grpc.StatusCode.UNAUTHENTICATED,
                               messages.TOKEN_MISSING(method=method.name, which=which))
            wrong = _refusal(kind, grpc.StatusCode.PERMISSION_DENIED, messages.TOKEN_WRONG(
                method=method.name, admin=messages.TOKEN_WRONG_ADMIN.text if admin else ""))
            self._rules[f"/{SERVICE.full_name}/{method.name}"] = _Rule(accepted, missing, wrong)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        rule = self._rules.get(handler_call_details.method)
        if rule is not None:
            token = bearer_token(handler_call_details.invocation_metadata)
            if not token:
                log.debug("rpc_refused", method=handler_call_details.method,
                          code="UNAUTHENTICATED")
                return rule.missing
            if not rule.accepts(token):
                log.debug("rpc_refused", method=handler_call_details.method,
                          code="PERMISSION_DENIED")
                return rule.wrong
        return await continuation(handler_call_details)


def interceptors(settings: Settings) -> list[grpc.aio.ServerInterceptor]:
    """The server's interceptors: the token check when a token is set, else none."""
    if settings.admin_token is None and settings.infer_token is None:
        return []
    return [TokenAuth(admin_token=settings.admin_token, infer_token=settings.infer_token)]


def _refusal(kind: tuple[bool, bool], code: grpc.StatusCode,
             message: str) -> grpc.RpcMethodHandler:
    """A handler of the RPC's own kind that ends the call with ``code``. It never reads the
    request: without a deserializer gRPC hands it the bytes, unparsed."""
    async def refuse(request_or_iterator, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[kind]
    return make(refuse)
