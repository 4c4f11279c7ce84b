"""A Python front-end process: the gRPC server, decoding and validating requests, over the executor.

It serves the same ``InferenceService`` as single-process mode, on a ``RemoteRepository`` that
hands each request to the executor process through the shared arena (``protos/wire.proto``).
Several front ends share one port (SO_REUSEPORT), so gRPC's per-request work runs on several
cores; the native front end (``server/native/``) does the same work in one C++ process.

    python -m batchgate.server.frontend < handover.json

The supervisor writes the handover (``server/supervisor.py``): the arena slot, the sockets, the
reserved port, and the settings a front end acts on (request limits, TLS, bearer tokens...).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import structlog

from batchgate.batcher.arena import SharedArena
from batchgate.server.app import Gateway
from batchgate.server.logs import announce, configure_logging, runtime_facts
from batchgate.server.multiproc_metrics import read_pid_once
from batchgate.server.posix import schedule_request_path
from batchgate.server.remote import RemoteRepository
from batchgate.server.settings import Settings, read_handover

log = structlog.get_logger(__name__)


async def run(handover: dict) -> None:
    settings = Settings.handed_over(handover["settings"])
    settings.grpc_port = handover["grpc_port"]  # the port the supervisor reserved
    settings.metrics_port = None  # the supervisor serves /metrics for every process
    arena = SharedArena.attach(handover["arena_fd"], handover["arena_bytes"])
    slot = handover["slot"]
    repository = RemoteRepository(arena, tuple(handover["input_region"]), slot,
                                  handover["executor_socket"])
    gateway = Gateway(settings, repository=repository, reuse_port=True,
                      extensions=tuple(handover["extensions"]))
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await gateway.start()
    announce("frontend_ready", slot=slot, grpc_port=gateway.grpc_port, pid=os.getpid(),
             **runtime_facts())
    await stopping.wait()
    await gateway.stop()


def main() -> int:
    read_pid_once()
    handover = read_handover()
    configure_logging(handover["settings"]["log_level"], "json")
    schedule_request_path(handover["settings"]["request_scheduling"],  # before any thread
                          handover["settings"]["model_cpus"])
    # Every line says which process wrote it: the supervisor forwards all children's lines.
    structlog.contextvars.bind_contextvars(role="frontend", slot=handover["slot"])
    asyncio.run(run(handover))
    return 0


if __name__ == "__main__":
    sys.exit(main())
