"""Server settings: a plain dataclass, importable without torch or grpc (the supervisor uses it).

Tokens are values here, never paths or flags: the CLI reads them from a file or the environment
so that they do not show in ``ps``, and ``repr`` leaves them out so that they never reach a log.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

DEFAULT_REPOSITORY = Path(__file__).resolve().parent.parent / "models"
DEFAULT_DEVICE_POOL_BYTES = 1 << 30  # batcher.memory.DEFAULT_POOL_BYTES (no torch here)
MIN_TOKEN_CHARS = 16
# Where the CLI and the front-end processes read each bearer token from (besides a file).
TOKEN_ENV = {"admin": "BATCHGATE_ADMIN_TOKEN", "infer": "BATCHGATE_INFER_TOKEN"}
# What each TLS file must hold. gRPC reports a file it cannot use only as "failed to bind".
PEM_MARKERS = {
    "tls_cert": b"-----BEGIN CERTIFICATE-----",
    "tls_key": b"PRIVATE KEY-----",
    "tls_client_ca": b"-----BEGIN CERTIFICATE-----",
}


@dataclasses.dataclass
class Settings:
    """Server settings; every one is also a command-line flag (``batchgate serve --help``)."""

    host: str = "0.0.0.0"
    # The environment can set the port, so that the image's health check and the server agree.
    grpc_port: int = dataclasses.field(
        default_factory=lambda: int(os.environ.get("BATCHGATE_GRPC_PORT", "8001"))
    )
    metrics_port: int | None = 8002  # None: no metrics endpoint
    model_repository: Path = dataclasses.field(
        default_factory=lambda: Path(os.environ.get("BATCHGATE_MODEL_REPOSITORY", DEFAULT_REPOSITORY))
    )
    max_message_bytes: int = 64 * 1024 * 1024
    max_request_bytes: int | None = None
    """Sum of one request's input tensor bytes; None: ``max_message_bytes``."""
    max_tensor_elements: int = 1 << 26
    """Elements of one input tensor, from its shape (a zero dimension counts as one)."""
    drain_timeout_s: float = 30.0
    switch_interval_s: float = 0.0005
    gc_freeze: bool = True
    reflection: bool = True
    reuse_port: bool = False  # several front-end processes share the gRPC port
    tls_cert: Path | None = None
    """PEM certificate chain of the gRPC port; with ``tls_key``, the port speaks only TLS."""
    tls_key: Path | None = None
    """PEM private key of ``tls_cert``."""
    tls_client_ca: Path | None = None
    """PEM CA certificates: clients must present a certificate they signed (mutual TLS)."""
    admin_token: str | None = dataclasses.field(default=None, repr=False)
    """Bearer token the repository RPCs (load, unload, index) require; None: they are open."""
    infer_token: str | None = dataclasses.field(default=None, repr=False)
    """Bearer token every other inference-service RPC requires; None: they are open."""

    # -- device memory pool (batcher/memory.py) ------------------------------------------------
    device_pool_bytes: int = DEFAULT_DEVICE_POOL_BYTES
    """Bytes of the memory pool reserved on each device the models use (the CPU's included)."""
    device_pool_fraction: float | None = None
    """On a CUDA device: reserve this fraction of its free memory instead of device_pool_bytes."""
    device_pool_strict: bool = True
    """False: what does not fit the pool is allocated outside it, counted in a metric."""

    def __post_init__(self) -> None:
        self.model_repository = Path(self.model_repository)
        if not 0 <= self.grpc_port <= 65535:
            raise ValueError(f"grpc_port must lie in 0..65535, got {self.grpc_port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must lie in 0..65535, got {self.metrics_port}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if self.max_request_bytes is not None and self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if self.max_tensor_elements < 1:
            raise ValueError(f"max_tensor_elements must be >= 1, got {self.max_tensor_elements}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.switch_interval_s <= 0:
            raise ValueError(f"switch_interval_s must be > 0, got {self.switch_interval_s}")
        if not self.model_repository.is_dir():
            raise ValueError(f"model_repository must be a folder, got {str(self.model_repository)!r}")
        self._check_device_pool()
        self._check_tls()
        for name in ("admin_token", "infer_token"):
            _check_token(name, getattr(self, name))
        if self.admin_token is not None and self.admin_token == self.infer_token:
            raise ValueError("admin_token and infer_token must differ, got the same token twice")

    def _check_device_pool(self) -> None:
        if self.device_pool_bytes < 4096:
            raise ValueError(f"device_pool_bytes must be >= 4096, got {self.device_pool_bytes}")
        fraction = self.device_pool_fraction
        if fraction is not None and not 0.0 < fraction <= 1.0:
            raise ValueError(f"device_pool_fraction must lie in (0, 1], got {fraction}")

    @property
    def request_bytes_limit(self) -> int:
        """``max_request_bytes``, or ``max_message_bytes`` when it is not set."""
        return self.max_message_bytes if self.max_request_bytes is None else self.max_request_bytes

    def security(self) -> dict[str, object]:
        """What the ``listening`` log line says of TLS and tokens (whether set, never what)."""
        tls = "mutual" if self.tls_client_ca else "on" if self.tls_cert else "off"
        return {"tls": tls, "admin_token": self.admin_token is not None,
                "infer_token": self.infer_token is not None}

    def _check_tls(self) -> None:
        for name in ("tls_cert", "tls_key", "tls_client_ca"):
            path = getattr(self, name)
            if path is None:
                continue
            path = Path(path)
            setattr(self, name, path)
            try:
                data = path.read_bytes()
            except OSError as exc:
                raise ValueError(
                    f"{name} must be a readable file, got {str(path)!r} ({exc.strerror})"
                ) from None
            if PEM_MARKERS[name] not in data:
                raise ValueError(
                    f"{name} must be a PEM file ({PEM_MARKERS[name].decode()}), "
                    f"got {str(path)!r}"
                )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(
                "tls_cert and tls_key go together, got only "
                + ("tls_cert" if self.tls_key is None else "tls_key")
            )
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca needs tls_cert and tls_key, got neither")


def device_pool_args(settings: Settings) -> list[str]:
    """The device-pool flags that reproduce ``settings`` (for the executor process)."""
    args = ["--device-pool-bytes", str(settings.device_pool_bytes)]
    if settings.device_pool_fraction is not None:
        args += ["--device-pool-fraction", str(settings.device_pool_fraction)]
    if not settings.device_pool_strict:
        args.append("--device-pool-permissive")
    return args


def _check_token(name: str, token: str | None) -> None:
    """A bearer token travels in a header: visible ASCII, no spaces (RFC 6750). The message
    says what is wrong with it, never the token itself."""
    if token is None:
        return
    if not isinstance(token, str):
        raise ValueError(f"{name} must be a string, got {type(token).__name__}")
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"{name} must have at least {MIN_TOKEN_CHARS} characters (e.g. the output of "
            f"'openssl rand -hex 32'), got {len(token)}"
        )
    if not all("!" <= c <= "~" for c in token):
        raise ValueError(
            f"{name} must be visible ASCII characters without spaces, got {len(token)} "
            "characters that are not all such"
        )
