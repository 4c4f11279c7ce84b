"""What the supervisor hands each child on its standard input, built in one place.

The native front end gets a ``FrontendHandover`` (``protos/handover.proto``, which
``server/native/src/handover.cc`` reads with protoc's class); the executor, a Python process,
one JSON object. Each carries the child's place (its arena, sockets, the reserved port; the
executor, the pid of the front end alive) and the settings its role acts on
(``Settings.handover``), resolved by the supervisor once. Bearer tokens are among the front
end's settings, so they never appear on a command line or in an environment.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING

from batchgate.batcher.metrics import SECONDS_BUCKETS
from batchgate.protos import handover_pb2
from batchgate.server import __version__
from batchgate.server.config.settings import EXECUTOR
from batchgate.server.metrics import UNKNOWN_MODEL_LABEL
from batchgate.server.rules import connections, request_limits

if TYPE_CHECKING:
    from batchgate.server.config.settings import Settings


def frontend_handover(settings: Settings, values: dict, *, slot: int, arena_fd: int,
                      arena_bytes: int, input_region: tuple[int, int],
                      executor_socket: str, metrics_socket: str, grpc_port: int,
                      extensions: Iterable[str]) -> handover_pb2.FrontendHandover:
    """What a native front end is handed (``protos/handover.proto``, which
    ``server/native/src/handover.cc`` reads): ``values``, the settings it acts on
    (``Settings.handover``), and what it is to serve with. The one place it is built, for the
    supervisor and the tests' own front ends."""
    offset, size = input_region
    handover = handover_pb2.FrontendHandover(
        slot=slot, arena_fd=arena_fd, arena_bytes=arena_bytes, input_region_offset=offset,
        input_region_bytes=size, executor_socket=executor_socket, metrics_socket=metrics_socket,
        grpc_port=grpc_port, version=__version__, extensions=list(extensions),
        seconds_buckets=list(SECONDS_BUCKETS), wire_limits=request_limits.bounds_of(settings),
        grpc_arguments=[handover_pb2.GrpcArgument(name=name, value=value)
                        for name, value in connections.server_arguments(settings)],
        unknown_model_label=UNKNOWN_MODEL_LABEL,
        max_stream_backlog_messages=connections.STREAM_BACKLOG_MESSAGES)
    # By name: every field of FrontendSettings is a setting of the front end's role.
    for field in handover.settings.DESCRIPTOR.fields:
        value = values[field.name]
        if value is None:
            continue
        if field.is_repeated:
            getattr(handover.settings, field.name).extend(value)
        else:
            setattr(handover.settings, field.name, value)
    return handover


def executor_handover(*, arena_fd: int, arena_bytes: int, socket: str,
                      frontend_pids: dict[str, int], settings: dict) -> bytes:
    """What the executor process is handed (``server/executor/process.py`` reads it):
    ``frontend_pids``, the front end alive by slot, whose reads of the arena the executor lets
    end before it welcomes it again; ``settings``, those it acts on (``Settings.handover``)."""
    return json.dumps({"role": EXECUTOR, "arena_fd": arena_fd, "arena_bytes": arena_bytes,
                       "slots": 1, "socket": socket, "frontend_pids": frontend_pids,
                       "settings": settings}).encode()
