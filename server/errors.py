"""The one table from the serving path's errors to gRPC status codes, applied in one place.

A client sees the status code and the error's own message, which is written for it. Anything
else that escapes a handler is a bug of ours: it is logged with its traceback and the client
gets INTERNAL with a fixed text, never the exception's repr.

Messages quote what the client sent (names, shapes), and the status message travels in a
trailer that clients refuse past a few KiB (gRPC's default metadata limit): a request with a
100 KB tensor name would then fail with a confusing transport error instead of its
INVALID_ARGUMENT. So every message is cut to ``MAX_MESSAGE_BYTES`` of UTF-8 here.
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
# Percent-encoded on the wire (up to 3 bytes per byte): well under the 8 KiB clients accept.
MAX_MESSAGE_BYTES = 1024
_CUT = " ... (message cut)"


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and client-facing message for ``exc``."""
    if isinstance(exc, errors.BatchgateError):
        for cls in type(exc).__mro__:
            code = STATUS_CODES.get(cls)
            if code is not None:
                return code, bounded(str(exc))
    log.error("unexpected_error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE


def bounded(message: str) -> str:
    """``message``, cut to at most ``MAX_MESSAGE_BYTES`` bytes of UTF-8."""
    if len(message) * 4 <= MAX_MESSAGE_BYTES:  # the common case, without encoding
        return message
    data = message.encode("utf-8", "surrogatepass")
    if len(data) <= MAX_MESSAGE_BYTES:
        return message
    keep = data[:MAX_MESSAGE_BYTES - len(_CUT)]
    return keep.decode("utf-8", "ignore") + _CUT
