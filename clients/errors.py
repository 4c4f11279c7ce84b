"""The one exception type the SDK raises for a failed call."""

from __future__ import annotations

import grpc


class BatchgateError(Exception):
    """A call failed: `code` is the `grpc.StatusCode`, `details` the server's (or SDK's) message.

    Every gRPC error is converted to this type, so it is the only exception callers catch for
    a failed call. Bad arguments (an unsupported dtype, a negative priority) raise `ValueError`
    or `TypeError` before anything is sent: they are bugs to fix, not failures to handle.
    """

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, details)
        self.code = code
        self.details = details

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}"

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> BatchgateError:
        # A bare grpc.RpcError (no Call behind it) carries neither code nor details.
        code_fn = getattr(error, "code", None)
        details_fn = getattr(error, "details", None)
        code = code_fn() if callable(code_fn) else None
        details = details_fn() if callable(details_fn) else None
        return cls(code or grpc.StatusCode.UNKNOWN, details or str(error) or "no details")
