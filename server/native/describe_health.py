"""Writes grpc.health.v1's file descriptor, as grpcio-health-checking ships it, for protoc.

The native front end's health service is gRPC C++'s own, which carries no protobuf descriptor;
server reflection can describe it once the generated code of this descriptor is linked in.
The protocol is not copied into this repository: protoc reads it from here at build time
(``--descriptor_set_in``).

    python describe_health.py OUT.binpb
"""

import sys


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    try:
        from google.protobuf import descriptor_pb2
        from grpc_health.v1 import health_pb2
    except ImportError as exc:
        print(f"describe_health.py: {sys.executable} cannot import grpcio-health-checking "
              f"({exc}); run `make install` first, or configure with "
              "-DBATCHGATE_HEALTH_DESCRIPTOR=FILE", file=sys.stderr)
        return 1
    files = descriptor_pb2.FileDescriptorSet()
    health_pb2.DESCRIPTOR.CopyToProto(files.file.add())
    with open(sys.argv[1], "wb") as out:
        out.write(files.SerializeToString())
    return 0


if __name__ == "__main__":
    sys.exit(main())
