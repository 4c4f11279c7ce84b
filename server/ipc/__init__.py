"""Between the native front end and the executor process: the wire (framed protobuf over a Unix socket) and the shared-memory arena with its allocator."""
