"""Server settings: a plain dataclass, importable without torch or grpc (the supervisor uses it)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

DEFAULT_REPOSITORY = Path(__file__).resolve().parent.parent / "models"


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
