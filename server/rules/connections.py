"""What the gRPC edge allows its clients' connections, as gRPC server arguments.

``server_arguments(settings)`` is the one list: the one-process server passes it to
``grpc.aio.server``, and the supervisor hands the same list to the native front end, which adds
each to its ``grpc::ServerBuilder`` as it is (``server/native/src/frontend.cc``). Besides the
settings' own (``-- connections`` in ``server/config/settings.py``), two arguments are fixed here:

- clients may ping a connection with no call open (at most once per
  ``--grpc-min-ping-interval-s``): a client keeping an idle channel alive is not a misbehaving
  one, and without it each such ping would be a strike;
- the server's own keepalive pings go on while no data flows (gRPC stops after two by default),
  so that a client that vanished with a stream open is found even when nothing is written.

The ResourceQuota (``--grpc-memory-bytes``, ``--grpc-max-threads``) is no argument that grpcio
can pass (it is an object of gRPC C++), so only the native front end applies it.
"""

from __future__ import annotations

from typing import Any

# Requests at the model plus replies not yet written past which a ModelStreamInfer stream stops
# reading, whatever their bytes (--max-stream-backlog-bytes bounds those).
STREAM_BACKLOG_MESSAGES = 256


def _milliseconds(seconds: float) -> int:
    return int(round(seconds * 1000))


def server_arguments(settings: Any) -> list[tuple[str, int]]:
    """gRPC server arguments (name, integer) for ``settings`` (anything with its fields)."""
    arguments = [
        ("grpc.max_concurrent_streams", settings.max_concurrent_streams),
        ("grpc.keepalive_time_ms", _milliseconds(settings.grpc_keepalive_time_s)),
        ("grpc.keepalive_timeout_ms", _milliseconds(settings.grpc_keepalive_timeout_s)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_ping_interval_without_data_ms",
         _milliseconds(settings.grpc_min_ping_interval_s)),
        ("grpc.http2.max_ping_strikes", settings.grpc_max_ping_strikes),
    ]
    # gRPC's own default for each of these is "never": an argument left out keeps it.
    for name, seconds in (("grpc.max_connection_idle_ms", settings.grpc_max_connection_idle_s),
                          ("grpc.max_connection_age_ms", settings.grpc_max_connection_age_s),
                          ("grpc.max_connection_age_grace_ms",
                           settings.grpc_max_connection_age_grace_s)):
        if seconds is not None:
            arguments.append((name, _milliseconds(seconds)))
    return arguments
