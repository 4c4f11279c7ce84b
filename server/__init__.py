"""batchgate server: gRPC services, codec, model repository, CLI, metrics and logging set-up."""

__version__ = "0.1.0"

# The protocol extensions ServerMetadata lists: what every front end, Python or native, serves.
SERVER_EXTENSIONS = (
    "model_repository",
    "model_configuration",
    "statistics",
    "binary_tensor_data",
    "schedule_policy",
    "health",
)
