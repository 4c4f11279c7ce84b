"""The executor process: owns the models, their queues and executors; serves front ends over IPC.

Front ends write each request's tensors into their region of the shared arena and send a
descriptor (``server/ipc.py``); the request's arrays here are views of that memory, so the
batcher reads them without another copy. Outputs are written into the executor's region of
the arena and described back; the front end copies them into its gRPC reply and frees them.

A front end's connection closing (it crashed or stopped) takes its queued requests out of
their queues and frees its outstanding output blocks: nothing else is disturbed.

    python -m server.executor_process --arena-fd FD --arena-bytes N --slots S --socket NAME \\
        --model-repository DIR
"""

from __future__ import annotations

import argparse
import asyncio
import os
import gc
import signal
import sys
from pathlib import Path

import numpy as np
import structlog

from batcher.arena import ArenaAllocator, ArenaLayout, SharedArena
from batcher.errors import (
    BatchgateError,
    InvalidRequest,
    ModelExecutionError,
    RequestCancelled,
    ResourceExhausted,
)
from batcher.memory import DevicePools, PoolSettings
from batcher.metrics import BatcherMetrics
from batcher.request import InferenceRequest
from batcher.spec import NUMPY_DTYPES
from server import ipc
from server.cli import add_device_pool_flags
from server.logs import announce, configure_logging
from server.repository import ModelRepository

log = structlog.get_logger(__name__)


class _Connection:
    def __init__(self, channel: ipc.Channel) -> None:
        self.channel = channel
        self.slot = -1
        self.requests: dict[int, tuple[InferenceRequest, object]] = {}  # rid -> (request, model)
        self.outputs: set[int] = set()  # output blocks not yet freed by the front end
        self.closed = False

    def send(self, message: tuple) -> None:
        try:
            self.channel.send(message)
        except ConnectionError:
            pass  # the front end is gone; its requests are being cleaned up


class ExecutorServer:
    def __init__(self, arena: SharedArena, layout: ArenaLayout,
                 metrics: BatcherMetrics | None = None) -> None:
        self._arena = arena
        base, size = layout.output_region()
        self._outputs = ArenaAllocator(base, size)
        metrics = metrics if metrics is not None else BatcherMetrics()
        self._in_use = metrics.arena_bytes_in_use.labels("output")
        self._connections: set[_Connection] = set()
        self._calls: set[asyncio.Task] = set()
        self.repository: ModelRepository | None = None

    # -- model states --------------------------------------------------------------------------

    def model_info(self, name: str) -> tuple:
        repository = self.repository
        entry = next((e for e in repository.index() if e.name == name), None)
        state = entry.state if entry else "UNAVAILABLE"
        reason = entry.reason if entry else "unknown"
        spec = config = None
        if state == "READY":
            try:
                spec = repository.spec(name)
                config = repository.config(name).SerializeToString()
            except BatchgateError:
                state, spec, config = "UNAVAILABLE", None, None
        return (name, state, reason, spec, config)

    def on_state_change(self, name: str, state: str) -> None:
        if self.repository is None:
            return
        message = ("model", self.model_info(name))
        for connection in list(self._connections):
            connection.send(message)

    # -- one front end -------------------------------------------------------------------------

    async def handle(self, channel: ipc.Channel) -> None:
        connection = _Connection(channel)
        self._connections.add(connection)
        try:
            while True:
                message = await channel.receive()
                kind = message[0]
                if kind == "infer":
                    self._infer(connection, message)
                elif kind == "cancel":
                    self._cancel(connection, message[1])
                elif kind == "free":
                    self._free(connection, message[1])
                elif kind == "call":
                    # A strong reference until it ends: the loop keeps only weak ones.
                    task = asyncio.create_task(self._call(connection, *message[1:]))
                    self._calls.add(task)
                    task.add_done_callback(self._calls.discard)
                elif kind == "hello":
                    connection.slot = message[1]
                    names = [e.name for e in self.repository.index()]
                    connection.send(("models", [self.model_info(n) for n in names]))
                    log.info("frontend_connected", slot=connection.slot)
        except ConnectionError:
            pass
        finally:
            self._connections.discard(connection)
            self._disconnect(connection)

    def _disconnect(self, connection: _Connection) -> None:
        connection.closed = True
        for request, model in list(connection.requests.values()):
            model.cancel(request)
        for offset in connection.outputs:
            self._outputs.free(offset)
        connection.outputs.clear()
        self._in_use.set(self._outputs.bytes_in_use)
        connection.channel.close()
        log.info("frontend_disconnected", slot=connection.slot,
                 abandoned=len(connection.requests))

    def _infer(self, connection: _Connection, message: tuple) -> None:
        (_, rid, model_name, version, inputs, batch_size, priority, deadline, timeout_us,
         request_id, requested) = message
        try:
            model = self.repository.get(model_name, version)
            batching = model.spec.batching.max_batch_size > 0
            arrays = [
                descriptor[1] if descriptor[0] == "inline"
                else self._arena.array(descriptor[0], NUMPY_DTYPES[descriptor[1]], descriptor[2])
                for descriptor in inputs
            ]
        except (BatchgateError, ValueError) as exc:
            if isinstance(exc, ValueError):
                exc = InvalidRequest(f"bad tensor descriptor: {exc}")
            connection.send(("error", rid, True, type(exc).__name__, str(exc)))
            return
        request = InferenceRequest(
            arrays, batch_size=batch_size, request_id=request_id, priority=priority,
            deadline=deadline, timeout_us=timeout_us, requested_outputs=requested,
            shape_key=tuple(a.shape[1:] if batching else a.shape for a in arrays),
        )
        try:
            future = model.submit(request)
        except BatchgateError as exc:
            connection.send(("error", rid, True, type(exc).__name__, str(exc)))
            return
        connection.requests[rid] = (request, model)
        # A callback, not a task per request: the executor's loop is on the hot path.
        future.add_done_callback(
            lambda done: self._answer(connection, rid, model, request, done))

    def _answer(self, connection: _Connection, rid: int, model, request: InferenceRequest,
                future: asyncio.Future) -> None:
        try:
            if future.cancelled():
                self._answer_error(connection, rid, request,
                                   RequestCancelled("the request was cancelled"))
                return
            error = future.exception()
            if isinstance(error, BatchgateError):
                self._answer_error(connection, rid, request, error)
                return
            if error is not None:  # a bug of ours: logged, answered INTERNAL
                log.error("executor_request_failed", model=model.spec.name, request=request.id,
                          exc_info=error)
                self._answer_error(connection, rid, request, ModelExecutionError(
                    "internal error in the executor; its log has the details"))
                return
            if connection.closed:
                return  # its front end is gone: writing outputs for it would leak the blocks
            outputs = future.result()
            names = request.requested_outputs or [o.name for o in model.spec.outputs]
            described = []
            try:
                for name in names:
                    described.append(self._write_output(connection, model, name, outputs[name]))
            except ResourceExhausted as exc:
                for item in described:
                    if item[1] != "inline":
                        connection.outputs.discard(item[1])
                        self._outputs.free(item[1])
                self._answer_error(connection, rid, request, exc)
                return
            connection.send(("result", rid, True, tuple(described)))
        finally:
            connection.requests.pop(rid, None)

    def _write_output(self, connection: _Connection, model, name: str, array: np.ndarray) -> tuple:
        datatype = model.spec.output(name).datatype
        if datatype == "BYTES":
            return (name, "inline", datatype, array)
        offset = self._outputs.alloc(array.nbytes)
        if offset is None:
            raise ResourceExhausted(
                f"the executor's shared-memory output region is full "
                f"({self._outputs.bytes_in_use} bytes in use); retry later"
            )
        connection.outputs.add(offset)
        self._in_use.set(self._outputs.bytes_in_use)
        np.copyto(self._arena.array(offset, array.dtype, array.shape), array)
        return (name, offset, datatype, array.shape)

    def _answer_error(self, connection: _Connection, rid: int, request: InferenceRequest,
                      exc: BatchgateError) -> None:
        released = not request.holds_inputs
        if not released:
            # Expired while its batch runs: the batch may still read the inputs.
            request.on_release = lambda: connection.send(("release", rid))
        connection.send(("error", rid, released, type(exc).__name__, str(exc)))

    def _cancel(self, connection: _Connection, rid: int) -> None:
        entry = connection.requests.get(rid)
        if entry is not None:
            request, model = entry
            model.cancel(request)

    def _free(self, connection: _Connection, offsets) -> None:
        for offset in offsets:
            if offset in connection.outputs:
                connection.outputs.discard(offset)
                self._outputs.free(offset)
        self._in_use.set(self._outputs.bytes_in_use)

    async def _call(self, connection: _Connection, cid: int, method: str, args: tuple) -> None:
        repository = self.repository
        try:
            if method == "statistics":
                value = await repository.statistics(*args)
            elif method == "index":
                value = repository.index()
            elif method == "load":
                await repository.load(*args)
                value = None
            elif method == "unload":
                await repository.unload(*args)
                value = None
            else:
                raise InvalidRequest(f"unknown executor call {method!r}")
        except BatchgateError as exc:
            connection.send(("raise", cid, type(exc).__name__, str(exc)))
            return
        except Exception:
            log.exception("executor_call_failed", method=method)
            connection.send(("raise", cid, "ModelExecutionError", f"executor call {method} failed"))
            return
        connection.send(("return", cid, value))


async def run(args: argparse.Namespace) -> None:
    arena = SharedArena.attach(args.arena_fd, args.arena_bytes)
    # On a GPU the arena is the pinned staging area: host-to-device copies start from it.
    if arena.pin():
        log.info("arena_pinned", bytes=args.arena_bytes)
    layout = ArenaLayout(args.arena_bytes, args.slots)
    metrics = BatcherMetrics()
    server = ExecutorServer(arena, layout, metrics)
    pools = DevicePools(PoolSettings(args.device_pool_bytes, args.device_pool_fraction,
                                     not args.device_pool_permissive), metrics)
    repository = ModelRepository(
        args.model_repository, metrics=metrics, on_state_change=server.on_state_change,
        pools=pools,
    )
    server.repository = repository
    sys.setswitchinterval(args.switch_interval_s)
    listener = await ipc.serve(args.socket, server.handle)
    await repository.load_all()
    gc.collect()
    gc.freeze()
    ready = [e.name for e in repository.index() if e.state == "READY"]
    announce("executor_ready", models=ready, socket=args.socket, pid=os.getpid())

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    log.info("executor_draining", drain_timeout_s=args.drain_timeout_s)
    await repository.close(args.drain_timeout_s)
    listener.close()
    log.info("executor_stopped")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m server.executor_process")
    parser.add_argument("--arena-fd", type=int, required=True)
    parser.add_argument("--arena-bytes", type=int, required=True)
    parser.add_argument("--slots", type=int, required=True)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--model-repository", type=Path, required=True)
    parser.add_argument("--drain-timeout-s", type=float, default=30.0)
    parser.add_argument("--switch-interval-s", type=float, default=0.0005)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--log-format", default="json")
    add_device_pool_flags(parser)
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    structlog.contextvars.bind_contextvars(role="executor")
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
