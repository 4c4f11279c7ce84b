"""batchgate server: gRPC services, codec, model repository, CLI, metrics and logging set-up."""

__version__ = "0.1.0"
