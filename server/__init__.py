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
# Listed when the server serves shared-memory tensors (--shared-memory).
SHARED_MEMORY_EXTENSIONS = ("system_shared_memory",)


def server_extensions(shared_memory: bool) -> tuple[str, ...]:
    """What ServerMetadata lists, with the settings ``shared_memory`` on or off."""
    return SERVER_EXTENSIONS + (SHARED_MEMORY_EXTENSIONS if shared_memory else ())
