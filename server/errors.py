"""The one table from the serving path's errors to gRPC status codes, applied in one place.

A client sees the status code and the error's own message, which is written for it. Anything
else that escapes a handler is a bug of ours: it is logged with its traceback and the client
gets INTERNAL with a fixed text, never the exception's repr.
"""

from __future__ import annotations

import grpc
import structlog

from batcher import errors

log = structlog.get_logger(__name__)

STATUS_CODES: dict[type[errors.BatchgateError], grpc.StatusCode] = {
    errors.ModelNotFound: grpc.StatusCode.NOT_FOUND,
    errors.InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    errors.ModelUnavailable: grpc.StatusCode.UNAVAILABLE,
    errors.QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.RequestCancelled: grpc.StatusCode.CANCELLED,
    errors.ModelExecutionError: grpc.StatusCode.INTERNAL,
    errors.NotSupported: grpc.StatusCode.UNIMPLEMENTED,
    errors.LoadError: grpc.StatusCode.INVALID_ARGUMENT,
}

INTERNAL_MESSAGE = "internal server error; the server log has the details"


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and client-facing message for ``exc``."""
    if isinstance(exc, errors.BatchgateError):
        for cls in type(exc).__mro__:
            code = STATUS_CODES.get(cls)
            if code is not None:
                return code, str(exc)
    log.error("unexpected_error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE
