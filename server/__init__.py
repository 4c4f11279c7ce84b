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
# Listed when the server serves shared-memory tensors (--shared-memory); CUDA's only where the
# process that holds the models has a CUDA device (its registrations need one).
SHARED_MEMORY_EXTENSIONS = ("system_shared_memory",)
CUDA_SHARED_MEMORY_EXTENSION = "cuda_shared_memory"


def server_extensions(shared_memory: bool, cuda: bool = False) -> tuple[str, ...]:
    """What ServerMetadata lists, with the settings ``shared_memory`` on or off, on a server
    whose models run where there is a CUDA device (``cuda``) or not."""
    if not shared_memory:
        return SERVER_EXTENSIONS
    return (SERVER_EXTENSIONS + SHARED_MEMORY_EXTENSIONS
            + ((CUDA_SHARED_MEMORY_EXTENSION,) if cuda else ()))
