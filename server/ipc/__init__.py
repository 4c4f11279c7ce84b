"""Between the native front end and the executor process: the wire (framed protobuf over a Unix socket) and the shared-memory arena (its allocator is the engine's, batcher/arena_allocator.py)."""
