"""The batchgate Python SDK: a KServe v2 / Open Inference Protocol gRPC client.

Depends only on grpcio, protobuf, numpy and `protos` (grpcio-health-checking for `health()`);
never on torch. See `clients/README.md`.

    from batchgate.clients import Client
    with Client("localhost:8001", timeout_s=5) as client:
        outputs = client.infer("resnet", {"input": batch})
"""

from batchgate.clients.async_client import AsyncClient, AsyncInferStream
from batchgate.clients.errors import BatchgateError
from batchgate.clients.infer import InferRequest, InferResult
from batchgate.clients.retry import RetryPolicy
from batchgate.clients.sync_client import Client, InferStream

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
