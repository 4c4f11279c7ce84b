"""The serving path's errors as gRPC statuses, for the one-process server's grpcio edge (``server/rules/status.py``
holds the one table; this turns its numbers into ``grpc.StatusCode``)."""

from __future__ import annotations

import grpc

from batchgate.server.rules import status
from batchgate.server.rules.status import INTERNAL_MESSAGE, MAX_MESSAGE_BYTES, bounded  # noqa: F401 (re-exported)

GRPC_CODES: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and client-facing message for ``exc``."""
    code, message = status.status_of(exc)
    return GRPC_CODES[code], message


def grpc_code(number: int) -> grpc.StatusCode:
    """The ``grpc.StatusCode`` of a status number (as the wire carries it); UNKNOWN for a
    number gRPC does not define."""
    return GRPC_CODES.get(number, grpc.StatusCode.UNKNOWN)
