"""batchgate: a KServe v2 / Open Inference Protocol gRPC gateway for PyTorch models, and its SDK.

The SDK's names are here, imported on first use, so that `import batchgate` costs nothing and
never imports torch or the server:

    from batchgate import Client
    with Client("localhost:8001", timeout_s=5) as client:
        outputs = client.infer("resnet", {"input": batch})

The rest lives in sub-packages: `batchgate.clients` (the SDK), `batchgate.server` and
`batchgate.batcher` (the server; the `server` extra), `batchgate.bench` (load generator and
benchmarks; the `server` extra) and `batchgate.protos` (the generated protocol modules).
"""

from __future__ import annotations

from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchgate import _checkout

__version__ = "0.1.0"

# Run from a checkout that is not installed, batchgate.<folder> is the checkout's folder.
_checkout.install(Path(__file__).resolve().parent)

# The SDK's public names, re-exported from batchgate.clients (its __all__).
_SDK_NAMES = (
    "AsyncClient",
    "AsyncInferStream",
    "BatchgateError",
    "Client",
    "InferRequest",
    "InferResult",
    "InferStream",
    "RetryPolicy",
)

__all__ = [*_SDK_NAMES, "__version__"]

if TYPE_CHECKING:
    from batchgate.clients import (  # noqa: F401
        AsyncClient,
        AsyncInferStream,
        BatchgateError,
        Client,
        InferRequest,
        InferResult,
        InferStream,
        RetryPolicy,
    )


def __getattr__(name: str) -> Any:
    if name in _SDK_NAMES:
        value = getattr(import_module("batchgate.clients"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'batchgate' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
