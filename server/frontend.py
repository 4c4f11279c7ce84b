"""A front-end process: the gRPC server, decoding and validating requests, over the executor.

It serves the same ``InferenceService`` as single-process mode, on a ``RemoteRepository`` that
hands each request to the executor process through the shared arena. Several front ends share
one port (SO_REUSEPORT), so gRPC's per-request work runs on several cores.

    python -m server.frontend --arena-fd FD --arena-bytes N --slots S --slot I --socket NAME \\
        --host HOST --grpc-port PORT

The front end enforces the request limits, TLS and bearer tokens: the supervisor passes the
limits and the certificate paths as flags, and the tokens in the environment
(``$BATCHGATE_ADMIN_TOKEN``, ``$BATCHGATE_INFER_TOKEN``), never on the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

import structlog

from batcher.arena import ArenaLayout, SharedArena
from server.app import Gateway, Settings
from server.settings import TOKEN_ENV
from server.logs import announce, configure_logging
from server.remote import RemoteRepository

log = structlog.get_logger(__name__)


async def run(args: argparse.Namespace) -> None:
    arena = SharedArena.attach(args.arena_fd, args.arena_bytes)
    layout = ArenaLayout(args.arena_bytes, args.slots)
    repository = RemoteRepository(arena, layout, args.slot, args.socket)
    settings = Settings(
        host=args.host, grpc_port=args.grpc_port, metrics_port=None,
        max_message_bytes=args.max_message_bytes, max_request_bytes=args.max_request_bytes,
        max_tensor_elements=args.max_tensor_elements, drain_timeout_s=args.drain_timeout_s,
        switch_interval_s=args.switch_interval_s, reuse_port=True,
        tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
        admin_token=os.environ.get(TOKEN_ENV["admin"]) or None,
        infer_token=os.environ.get(TOKEN_ENV["infer"]) or None,
    )
    gateway = Gateway(settings, repository=repository)
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await gateway.start()
    announce("frontend_ready", slot=args.slot, grpc_port=gateway.grpc_port, pid=os.getpid())
    await stopping.wait()
    await gateway.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m server.frontend")
    parser.add_argument("--arena-fd", type=int, required=True)
    parser.add_argument("--arena-bytes", type=int, required=True)
    parser.add_argument("--slots", type=int, required=True)
    parser.add_argument("--slot", type=int, required=True)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--max-message-bytes", type=int, default=64 * 1024 * 1024)
    parser.add_argument("--max-request-bytes", type=int, default=None)
    parser.add_argument("--max-tensor-elements", type=int, default=1 << 26)
    parser.add_argument("--tls-cert", type=Path, default=None)
    parser.add_argument("--tls-key", type=Path, default=None)
    parser.add_argument("--tls-client-ca", type=Path, default=None)
    parser.add_argument("--drain-timeout-s", type=float, default=30.0)
    parser.add_argument("--switch-interval-s", type=float, default=0.0005)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--log-format", default="json")
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    # Every line says which process wrote it: the supervisor forwards all children's lines.
    structlog.contextvars.bind_contextvars(role="frontend", slot=args.slot)
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
