"""Assembling the one-process server: settings, the gRPC server with health and reflection,
metrics, drain, and the models in this process (``--frontend single``).

``Gateway.start()`` binds the ports (0 = any free port: tests read ``grpc_port`` and
``metrics_port`` back), loads the model repository, and only then reports SERVING.
``Gateway.stop()`` follows gRPC's own pattern: health goes NOT_SERVING first, new requests get
UNAVAILABLE, queued ones finish within ``drain_timeout_s``, then the server stops; calls that
arrive meanwhile are answered, never cancelled by the shutdown (``server/frontend/drain.py``).
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from batchgate.batcher.memory import DevicePools, PoolSettings
from batchgate.protos import inference_pb2, registry
from batchgate.server.frontend import auth
from batchgate.server.rules import connections
from batchgate.server.frontend import service
from batchgate.server.frontend import tls
from batchgate.server.frontend.codec import RequestLimits
from batchgate.server.executor.control import ControlPlane
from batchgate.server.frontend.drain import GOAWAY_PROPAGATION_S, LAST_ANSWERS_S, DrainGate
from batchgate.server.logs import runtime_facts
from batchgate.server.metrics import ServerMetrics
from batchgate.server.executor.repository import ModelRepository
from batchgate.server.frontend.request_scan import WireLimits
from batchgate.server.frontend.service import SHUTTING_DOWN_MESSAGE, InferenceService
from batchgate.server.executor.shared_memory import SharedMemoryRegistry
from batchgate.server.config.settings import DEFAULT_REPOSITORY, Settings  # noqa: F401 (re-exported)
from batchgate.server.rules import messages

log = structlog.get_logger(__name__)

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name


def _reflection_pool():
    """batchgate's descriptor pool, holding health's and reflection's files too.

    Reflection answers from one pool; ours is not protobuf's default one (see
    ``batchgate.protos.registry``), where grpcio-health-checking and grpcio-reflection register.
    Adding a file that is already there, unchanged, is a no-op, so every Gateway may call this.
    """
    for file in (health_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR):
        registry.POOL.AddSerializedFile(file.serialized_pb)
    return registry.POOL
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class _Health(health.aio.HealthServicer):
    """grpcio-health-checking's servicer, whose open Watch streams the drain ends with
    UNAVAILABLE once their NOT_SERVING is written, as the native front end does: left open, a
    client's Watch (gRPC's client-side health checking keeps one) held the shutdown until its
    grace ran out."""

    def __init__(self, drain: DrainGate) -> None:
        super().__init__()
        self._drain = drain

    async def Watch(self, request, context) -> None:
        if self._drain.streams_ended:
            await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN_MESSAGE)
        watching = asyncio.ensure_future(super().Watch(request, context))
        ended_by_drain = False

        def end_for_drain() -> None:
            nonlocal ended_by_drain
            ended_by_drain = True
            watching.cancel()

        self._drain.watch_stream(end_for_drain)
        try:
            await watching
        except asyncio.CancelledError:
            if not ended_by_drain:
                raise
        finally:
            self._drain.forget_stream(end_for_drain)
            watching.cancel()  # the client went away: so does the watch
        await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN_MESSAGE)


class Gateway:
    def __init__(self, settings: Settings, *, metrics: ServerMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self.drain = DrainGate()
        self.health = _Health(self.drain)
        pools = DevicePools(
            PoolSettings(settings.device_pool_bytes, settings.device_pool_fraction,
                         settings.device_pool_strict),
            self.metrics.batcher)
        self.repository = ModelRepository(
            settings.model_repository,
            metrics=self.metrics.batcher,
            on_state_change=self._on_model_state,
            pools=pools,
        )
        limits = RequestLimits(max_request_bytes=settings.request_bytes_limit,
                               max_tensor_elements=settings.max_tensor_elements,
                               max_reply_bytes=settings.max_message_bytes)
        control = ControlPlane(self.repository,
                               max_load_files_bytes=settings.max_load_files_bytes)
        self.shared_memory = SharedMemoryRegistry(settings.shared_memory)
        self.service = InferenceService(self.repository, self.metrics, self.shared_memory,
                                        limits, control, wire_limits=WireLimits.of(settings),
                                        shared_memory=settings.shared_memory,
                                        drain=self.drain,
                                        max_stream_backlog_bytes=settings.max_stream_backlog_bytes)
        self.grpc_port = 0
        self.metrics_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._httpd = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = asyncio.Event()
        self._background: set[asyncio.Future] = set()

    async def start(self) -> None:
        s = self.settings
        self._loop = asyncio.get_running_loop()
        sys.setswitchinterval(s.switch_interval_s)
        options = [
            ("grpc.max_receive_message_length", s.max_message_bytes),
            ("grpc.max_send_message_length", s.max_message_bytes),
            ("grpc.so_reuseport", 0),
            *connections.server_arguments(s),
        ]
        server = grpc.aio.server(options=options, interceptors=auth.interceptors(s))
        service.add_to_server(self.service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if s.reflection:
            reflection.enable_server_reflection(
                [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME],
                server,
                pool=_reflection_pool(),
            )
        address = f"{s.host}:{s.grpc_port}" if ":" not in s.host else f"[{s.host}]:{s.grpc_port}"
        self.grpc_port = tls.bind(server, address, s)
        if self.grpc_port == 0:
            raise OSError(messages.BIND_FAILED(address=address))
        self._server = server
        await self.health.set("", NOT_SERVING)
        await self.health.set(SERVICE_NAME, NOT_SERVING)
        await server.start()
        if s.metrics_port is not None:
            self._httpd = self.metrics.serve_http(s.host, s.metrics_port)
            self.metrics_port = self._httpd.server_port
        log.info("listening", grpc_port=self.grpc_port, metrics_port=self.metrics_port,
                 models=str(self.repository.root),
                 **s.security())
        await self.repository.load_all()
        if s.gc_freeze:
            # Long-lived objects (torch modules, protobuf descriptors) leave the collector's
            # view: full collections no longer walk them, which was most of the p99.
            gc.collect()
            gc.freeze()
        self.service.set_ready(True)
        await self.health.set("", SERVING)
        await self.health.set(SERVICE_NAME, SERVING)
        log.info("serving", models=self.repository.ready_models(), mode="single",
                 **runtime_facts())

    async def stop(self, drain_timeout_s: float | None = None) -> None:
        """Drain and stop: NOT_SERVING first, then finish what was accepted, then close."""
        grace = self.settings.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        deadline = time.monotonic() + grace
        drain = self.drain
        self.service.start_draining()
        await self.health.enter_graceful_shutdown()
        log.info("draining", drain_timeout_s=grace)
        await self.repository.close(grace)
        if self._server is not None:
            # gRPC's shutdown would cancel calls it holds unhandled and those that reach it
            # before their client heard the GOAWAY: park arrivals until they are quiet, shut
            # down, and answer the parked calls once the GOAWAY had time to reach the clients.
            await drain.park_until_quiet(deadline)
            shutdown = asyncio.ensure_future(self._server.stop(
                max(deadline - time.monotonic(), GOAWAY_PROPAGATION_S + LAST_ANSWERS_S)))
            await asyncio.wait({shutdown}, timeout=GOAWAY_PROPAGATION_S)
            drain.release()
            await shutdown
        else:
            drain.release()
        self.shared_memory.close()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        self._stopped.set()
        log.info("stopped")

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def _on_model_state(self, name: str, state: str) -> None:
        status = SERVING if state == "READY" else NOT_SERVING
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        # Called from the loop or from a loading thread: hop onto the loop either way.
        loop.call_soon_threadsafe(lambda: self._spawn(self.health.set(name, status)))

    def _spawn(self, coroutine) -> None:
        # A strong reference until it ends: the loop keeps only weak ones.
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
