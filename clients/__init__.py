"""The batchgate Python SDK: a KServe v2 / Open Inference Protocol gRPC client.

Depends only on grpcio, protobuf, numpy and `protos` (grpcio-health-checking for `health()`);
never on torch. See `clients/README.md`.

    from clients import Client
    with Client("localhost:8001", timeout_s=5) as client:
        outputs = client.infer("resnet", {"input": batch})
"""

from clients.async_client import AsyncClient, AsyncInferStream
from clients.errors import BatchgateError
from clients.infer import InferRequest, InferResult
from clients.retry import RetryPolicy
from clients.sync_client import Client, InferStream

__all__ = [
    "AsyncClient",
    "AsyncInferStream",
    "BatchgateError",
    "Client",
    "InferRequest",
    "InferResult",
    "InferStream",
    "RetryPolicy",
]
