"""The descriptor pool that batchgate's protocol modules register into, instead of protobuf's default.

tritonclient's generated modules register the same `inference.*` messages in the default pool, so
a process that imported both would fail on the second import. batchgate's modules (inference,
model_config, wire: one pool, since they import each other) add their files here instead;
`python -m batchgate.protos.generate` writes them that way. Server reflection serves this pool.
"""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
