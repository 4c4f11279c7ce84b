"""The executor process: owns the models, their queues and executors; serves front ends
(``server/executor/server.py``).

    python -m batchgate.server.executor.process < handover.json

The supervisor writes the handover (``server/supervisor/supervisor.py``): the arena, the socket's name,
and the settings this process acts on.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys

import structlog

from batchgate.batcher import gpu, gpu_env
from batchgate.server.ipc.arena import ArenaLayout, SharedArena
from batchgate.batcher.memory import DevicePools, PoolSettings
from batchgate.batcher.metrics import BatcherMetrics
from batchgate.server.ipc import wire
from batchgate.server.executor.control import ControlPlane
from batchgate.server.executor.server import ExecutorServer
from batchgate.server.logs import announce, configure_logging, runtime_facts
from batchgate.server.supervisor.multiproc_metrics import read_pid_once
from batchgate.server.supervisor.posix import schedule_request_path
from batchgate.server.executor.repository import READY, ModelRepository
from batchgate.server.config.settings import Settings, check_devices, read_handover
from batchgate.server.executor.shared_memory import SharedMemoryRegistry

log = structlog.get_logger(__name__)

EXIT_DEVICE_LOST = 75  # the supervisor restarts the executor whatever its exit status


def pin_arena(arena: SharedArena, metrics: BatcherMetrics) -> bool:
    """On a GPU the arena is the pinned staging area: host-to-device copies start from it.

    Pinning (``cudaHostRegister``) locks the whole arena in RAM at once: its pages are no
    longer allocated only when touched. When it fails (a locked-memory limit, a driver that
    refuses), the server goes on unpinned, with one warning and ``batchgate_arena_pinned`` 0:
    copies from the arena then run at pageable speed and hold their thread until done.
    """
    try:
        pinned = arena.pin()
    except Exception as exc:  # RuntimeError from torch.cuda.check_error, among others
        log.warning("arena_not_pinned", bytes=arena.size, error=str(exc).split("\n")[0],
                    effect="host-to-device copies run from pageable memory")
        pinned = False
    else:
        if pinned:
            log.info("arena_pinned", bytes=arena.size)
    metrics.arena_pinned.set(1 if pinned else 0)
    return pinned


def _exit_on_device_lost(reason: str) -> None:
    """A sticky CUDA error broke this process's context: every model on it fails from now on.
    Exit, so that the supervisor starts a fresh executor (front ends answer UNAVAILABLE)."""
    log.error("executor_exiting", reason=reason)
    logging.shutdown()
    os._exit(EXIT_DEVICE_LOST)


async def run(handover: dict) -> int:
    settings = Settings.handed_over(handover["settings"])
    try:
        check_devices(settings)
    except ValueError as exc:
        log.error("settings_refused", error=str(exc))
        return 2
    arena = SharedArena.attach(handover["arena_fd"], handover["arena_bytes"])
    layout = ArenaLayout(handover["arena_bytes"], handover["slots"])
    metrics = BatcherMetrics()
    pin_arena(arena, metrics)
    gpu.on_device_lost = _exit_on_device_lost
    server = ExecutorServer(arena, layout, metrics, SharedMemoryRegistry(settings.shared_memory))
    server.fronts.await_predecessors({int(slot): pid for slot, pid
                                      in handover.get("frontend_pids", {}).items()})
    pools = DevicePools(PoolSettings(settings.device_pool_bytes, settings.device_pool_fraction,
                                     settings.device_pool_strict), metrics)
    repository = ModelRepository(settings.model_repository, metrics=metrics,
                                 on_state_change=server.on_state_change, pools=pools,
                                 delivery=server.answers)
    server.serve(repository, ControlPlane(repository,
                                          max_load_files_bytes=settings.max_load_files_bytes))
    sys.setswitchinterval(settings.switch_interval_s)
    listener = await wire.serve_frontends(handover["socket"], server.accept)
    await repository.load_all()
    if settings.gc_freeze:
        gc.collect()
        gc.freeze()
    ready = [e.name for e in repository.index() if e.state == READY]
    # Whether CUDA regions can be registered here: ServerMetadata's cuda_shared_memory.
    announce("executor_ready", models=ready, socket=handover["socket"], pid=os.getpid(),
             cuda_shared_memory=server.shared_memory.cuda_available(), **runtime_facts())

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    server.loop_hold.hold(loop)
    try:
        await stopping.wait()
        log.info("executor_draining", drain_timeout_s=settings.drain_timeout_s)
        await repository.close(settings.drain_timeout_s)
    finally:
        server.loop_hold.release()
    listener.close()
    server.shared_memory.close()
    log.info("executor_stopped")
    return 0


def main() -> int:
    gpu_env.configure()  # before CUDA initialises
    read_pid_once()
    handover = read_handover()
    configure_logging(handover["settings"]["log_level"], "json")
    # Before any thread starts: they inherit it, and model threads take the process's back.
    schedule_request_path(handover["settings"]["request_scheduling"],
                          handover["settings"]["model_cpus"])
    structlog.contextvars.bind_contextvars(role="executor")
    return asyncio.run(run(handover))


if __name__ == "__main__":
    sys.exit(main())
