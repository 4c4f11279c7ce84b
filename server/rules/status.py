"""The one table from the serving path's errors to status codes, and the messages' bound.

Status codes are gRPC's numbers (google.rpc.Code), which the wire between processes carries as
they are: the executor, which knows nothing of gRPC, answers a request's error with the number
and message from here, and the native front end sends them on unchanged.
``server/frontend/errors.py`` turns them into ``grpc.StatusCode`` for the one-process server.

A client sees the status code and the error's own message, which is written for it. Anything
else that escapes a handler is a bug of ours: it is logged with its traceback and the client
gets INTERNAL with a fixed text, never the exception's repr.

Messages quote what the client sent (names, shapes), and the status message travels in a
trailer that clients refuse past a few KiB (gRPC's default metadata limit): a request with a
100 KB tensor name would then fail with a confusing transport error instead of its
INVALID_ARGUMENT. So every message is cut to ``MAX_MESSAGE_BYTES`` of UTF-8 here.
"""

from __future__ import annotations

import enum

import structlog

from batchgate.batcher import errors
from batchgate.server.rules import messages

log = structlog.get_logger(__name__)


class Code(enum.IntEnum):
    """gRPC status codes (the numbers of google.rpc.Code)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


STATUS_CODES: dict[type[errors.BatchgateError], Code] = {
    errors.ModelNotFound: Code.NOT_FOUND,
    errors.InvalidRequest: Code.INVALID_ARGUMENT,
    errors.ModelUnavailable: Code.UNAVAILABLE,
    errors.QueueFull: Code.RESOURCE_EXHAUSTED,
    errors.ResourceExhausted: Code.RESOURCE_EXHAUSTED,
    errors.DeadlineExceeded: Code.DEADLINE_EXCEEDED,
    errors.RequestCancelled: Code.CANCELLED,
    errors.ModelExecutionError: Code.INTERNAL,
    errors.NotSupported: Code.UNIMPLEMENTED,
    errors.LoadError: Code.INVALID_ARGUMENT,
}

INTERNAL_MESSAGE = messages.INTERNAL.text


class StatusError(errors.BatchgateError):
    """An error whose status was decided elsewhere: the executor's answer, across the wire."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
MAX_MESSAGE_BYTES = messages.MAX_MESSAGE_BYTES
_CUT = messages.MESSAGE_CUT.text


def status_of(exc: BaseException) -> tuple[Code, str]:
    """The status code and client-facing message for ``exc``."""
    if isinstance(exc, StatusError):
        try:
            return Code(exc.code), bounded(str(exc))
        except ValueError:
            return Code.UNKNOWN, bounded(str(exc))
    if isinstance(exc, errors.BatchgateError):
        for cls in type(exc).__mro__:
            code = STATUS_CODES.get(cls)
            if code is not None:
                return code, bounded(str(exc))
    log.error("unexpected_error", exc_info=exc)
    return Code.INTERNAL, INTERNAL_MESSAGE


def bounded(message: str) -> str:
    """``message``, cut to at most ``MAX_MESSAGE_BYTES`` bytes of UTF-8."""
    if len(message) * 4 <= MAX_MESSAGE_BYTES:  # the common case, without encoding
        return message
    data = message.encode("utf-8", "surrogatepass")
    if len(data) <= MAX_MESSAGE_BYTES:
        return message
    keep = data[:MAX_MESSAGE_BYTES - len(_CUT)]
    return keep.decode("utf-8", "ignore") + _CUT
