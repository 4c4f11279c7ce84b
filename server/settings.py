"""Server settings: a plain dataclass, importable without torch or grpc (the supervisor uses it)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

DEFAULT_REPOSITORY = Path(__file__).resolve().parent.parent / "models"
DEFAULT_DEVICE_POOL_BYTES = 1 << 30  # batcher.memory.DEFAULT_POOL_BYTES (no torch here)


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
    drain_timeout_s: float = 30.0
    switch_interval_s: float = 0.0005
    gc_freeze: bool = True
    reflection: bool = True
    reuse_port: bool = False  # several front-end processes share the gRPC port

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
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.switch_interval_s <= 0:
            raise ValueError(f"switch_interval_s must be > 0, got {self.switch_interval_s}")
        if not self.model_repository.is_dir():
            raise ValueError(f"model_repository must be a folder, got {str(self.model_repository)!r}")
        self._check_device_pool()

    def _check_device_pool(self) -> None:
        if self.device_pool_bytes < 4096:
            raise ValueError(f"device_pool_bytes must be >= 4096, got {self.device_pool_bytes}")
        fraction = self.device_pool_fraction
        if fraction is not None and not 0.0 < fraction <= 1.0:
            raise ValueError(f"device_pool_fraction must lie in (0, 1], got {fraction}")



def device_pool_args(settings: Settings) -> list[str]:
    """The device-pool flags that reproduce ``settings`` (for the executor process)."""
    args = ["--device-pool-bytes", str(settings.device_pool_bytes)]
    if settings.device_pool_fraction is not None:
        args += ["--device-pool-fraction", str(settings.device_pool_fraction)]
    if not settings.device_pool_strict:
        args.append("--device-pool-permissive")
    return args
