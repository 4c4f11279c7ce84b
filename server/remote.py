"""The front end's view of the executor process: a repository whose models run elsewhere.

``RemoteRepository`` offers what ``InferenceService`` uses of ``ModelRepository`` (get, config,
index, statistics, load, unload), so the same service code serves in both modes. A request's
decoded arrays are copied once, into this front end's region of the shared arena; the executor
reads them in place. Outputs come back as descriptors into the executor's region and are copied
once, into the bytes of the gRPC reply.

When the executor goes away every request in flight gets UNAVAILABLE (retryable), health turns
NOT_SERVING, and the front end reconnects as soon as a new executor listens.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

import numpy as np
import structlog

from batcher.arena import ArenaAllocator, ArenaLayout, SharedArena
from batcher.errors import (
    ModelNotFound,
    ModelUnavailable,
    ResourceExhausted,
    quoted,
)
from batcher.metrics import BatcherMetrics
from batcher.request import InferenceRequest
from batcher.spec import NUMPY_DTYPES, ModelSpec
from protos import model_config_pb2
from server import ipc
from server.repository import ModelIndexEntry

log = structlog.get_logger(__name__)

RECONNECT_INTERVAL_S = 0.05


class _Pending:
    __slots__ = ("future", "inputs")

    def __init__(self, future: asyncio.Future, inputs: list[int]) -> None:
        self.future = future
        self.inputs = inputs  # this front end's input blocks, freed on release


class RemoteModel:
    """One READY model of the executor, as the service sees it."""

    def __init__(self, repository: RemoteRepository, spec: ModelSpec) -> None:
        self._repository = repository
        self.spec = spec

    @property
    def ready(self) -> bool:
        return self._repository.connected

    async def infer(self, request: InferenceRequest) -> dict[str, np.ndarray]:
        return await self._repository.infer(self.spec, request)


class RemoteRepository:
    def __init__(
        self,
        arena: SharedArena,
        layout: ArenaLayout,
        slot: int,
        socket_name: str,
        *,
        on_state_change: Callable[[str, str], None] | None = None,
        on_connection_change: Callable[[bool], None] | None = None,
    ) -> None:
        self._arena = arena
        base, size = layout.input_region(slot)
        self._inputs = ArenaAllocator(base, size)
        self._slot = slot
        self._socket = socket_name
        self._on_state_change = on_state_change
        self._on_connection_change = on_connection_change
        self._channel: ipc.Channel | None = None
        self._models: dict[str, tuple] = {}  # name -> (state, reason, spec, config bytes)
        self._remote: dict[str, RemoteModel] = {}
        self._configs: dict[str, model_config_pb2.ModelConfig] = {}
        self._pending: dict[int, _Pending] = {}
        self._awaiting_release: dict[int, list[int]] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._to_free: list[int] = []
        self._connected = asyncio.Event()
        self._closing = False
        self._reader: asyncio.Task | None = None
        self._in_use = None  # gauge child, once bound

    def bind(self, *, metrics: BatcherMetrics, on_state_change: Callable[[str, str], None],
             on_connection_change: Callable[[bool], None]) -> None:
        """Set the metrics and callbacks (the Gateway that serves this repository does)."""
        self._in_use = metrics.arena_bytes_in_use.labels(f"input-{self._slot}")
        self._on_state_change = on_state_change
        self._on_connection_change = on_connection_change

    @property
    def connected(self) -> bool:
        return self._channel is not None and not self._channel.closed

    # -- connection ----------------------------------------------------------------------------

    async def load_all(self) -> None:
        """Connect to the executor and learn its models (the start-up of a front end)."""
        self._reader = asyncio.create_task(self._run())
        await self._connected.wait()

    async def _run(self) -> None:
        while not self._closing:
            try:
                channel = await ipc.Channel.connect(self._socket)
            except OSError:
                await asyncio.sleep(RECONNECT_INTERVAL_S)
                continue
            self._channel = channel
            channel.send(("hello", self._slot))
            try:
                await self._read(channel)
            except ConnectionError:
                pass
            finally:
                self._lost(channel)

    async def _read(self, channel: ipc.Channel) -> None:
        while True:
            message = await channel.receive()
            kind = message[0]
            if kind == "result":
                self._result(message)
            elif kind == "error":
                self._error(message)
            elif kind == "release":
                self._release(message[1])
            elif kind == "model":
                self._model(message[1])
            elif kind == "models":
                for info in message[1]:
                    self._model(info)
                log.info("executor_connected", slot=self._slot, models=len(message[1]))
                self._connected.set()
                if self._on_connection_change is not None:
                    self._on_connection_change(True)
            elif kind == "return":
                future = self._calls.pop(message[1], None)
                if future is not None and not future.done():
                    future.set_result(message[2])
            elif kind == "raise":
                future = self._calls.pop(message[1], None)
                if future is not None and not future.done():
                    future.set_exception(ipc.error_from(message[2], message[3]))

    def _lost(self, channel: ipc.Channel) -> None:
        channel.close()
        if self._channel is channel:
            self._channel = None
        self._connected.clear()
        error = ModelUnavailable("the executor process restarted; retry the request")
        # Nothing reads this front end's input blocks any more: free them all.
        for pending in self._pending.values():
            self._free_inputs(pending.inputs)
            if not pending.future.done():
                pending.future.set_exception(error)
        self._pending.clear()
        for blocks in self._awaiting_release.values():
            self._free_inputs(blocks)
        self._awaiting_release.clear()
        self._to_free.clear()  # the executor's output region starts afresh
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()
        for name in list(self._models):
            self._set_state(name, ("UNAVAILABLE", "the executor is restarting", None, None))
        if not self._closing:
            log.warning("executor_lost", slot=self._slot)
            if self._on_connection_change is not None:
                self._on_connection_change(False)

    async def close(self, drain_timeout_s: float = 30.0) -> None:
        """Let requests in flight finish (bounded), then disconnect."""
        try:
            await asyncio.wait_for(self._quiet(), drain_timeout_s)
        except asyncio.TimeoutError:
            log.warning("frontend_drain_timed_out", slot=self._slot, left=len(self._pending))
        self._closing = True
        if self._channel is not None:
            self._channel.close()
        if self._reader is not None:
            self._reader.cancel()

    async def _quiet(self) -> None:
        while self._pending:
            await asyncio.sleep(0.005)

    # -- models --------------------------------------------------------------------------------

    def _model(self, info: tuple) -> None:
        name, state, reason, spec, config = info
        self._set_state(name, (state, reason, spec, config))

    def _set_state(self, name: str, value: tuple) -> None:
        old = self._models.get(name)
        self._models[name] = value
        state, _reason, spec, config = value
        if state == "READY" and spec is not None:
            self._remote[name] = RemoteModel(self, spec)
            parsed = model_config_pb2.ModelConfig()
            parsed.ParseFromString(config)
            self._configs[name] = parsed
        else:
            self._remote.pop(name, None)
            self._configs.pop(name, None)
        if self._on_state_change is not None and (old is None or old[0] != state):
            self._on_state_change(name, state)

    def get(self, name: str, version: str = "") -> RemoteModel:
        model = self._remote.get(name)
        if model is None:
            known = self._models.get(name)
            if known is None:
                if not self.connected:
                    raise ModelUnavailable("the executor process is not connected; retry")
                raise ModelNotFound(f"unknown model {quoted(name)}")
            raise ModelUnavailable(f"model {quoted(name)} is not available: {known[1] or known[0]}")
        if version and version != model.spec.version:
            raise ModelNotFound(
                f"model {quoted(name)} has no version {quoted(version)} being served "
                f"(serving version {model.spec.version})"
            )
        return model

    def config(self, name: str, version: str = "") -> model_config_pb2.ModelConfig:
        self.get(name, version)
        return self._configs[name]

    def index(self) -> list[ModelIndexEntry]:
        return [
            ModelIndexEntry(name, spec.version if spec else "", state, reason)
            for name, (state, reason, spec, _config) in sorted(self._models.items())
        ]

    async def statistics(self, name: str = "", version: str = "") -> list[tuple]:
        if name:
            self.get(name, version)
        return await self._call("statistics", name, version)

    async def load(self, name: str) -> None:
        await self._call("load", name)

    async def unload(self, name: str, drain_timeout_s: float = 30.0) -> None:
        await self._call("unload", name, drain_timeout_s)

    async def _call(self, method: str, *args):
        channel = self._channel
        if channel is None:
            raise ModelUnavailable("the executor process is not connected; retry")
        cid = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[cid] = future
        channel.send(("call", cid, method, args))
        return await future

    # -- inference -----------------------------------------------------------------------------

    async def infer(self, spec: ModelSpec, request: InferenceRequest) -> dict[str, np.ndarray]:
        channel = self._channel
        if channel is None:
            raise ModelUnavailable("the executor process is not connected; retry")
        blocks: list[int] = []
        descriptors = []
        try:
            for array, tensor in zip(request.inputs, spec.inputs):
                if tensor.datatype == "BYTES":
                    descriptors.append(("inline", array))
                    continue
                offset = self._inputs.alloc(array.nbytes)
                if offset is None:
                    raise ResourceExhausted(
                        f"this front end's shared-memory region is full "
                        f"({self._inputs.bytes_in_use} bytes in flight); retry later"
                    )
                blocks.append(offset)
                np.copyto(self._arena.array(offset, array.dtype, array.shape), array)
                descriptors.append((offset, tensor.datatype, array.shape))
        except BaseException:
            self._free_inputs(blocks)
            raise
        if self._in_use is not None:
            self._in_use.set(self._inputs.bytes_in_use)
        rid = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[rid] = _Pending(future, blocks)
        channel.send((
            "infer", rid, spec.name, spec.version, tuple(descriptors), request.batch_size,
            request.priority, request.deadline, request.timeout_us, request.id,
            request.requested_outputs,
        ))
        try:
            return await future
        except asyncio.CancelledError:
            if rid in self._pending and self._channel is channel and not channel.closed:
                channel.send(("cancel", rid))
            raise

    def _result(self, message: tuple) -> None:
        _, rid, released, outputs = message
        pending = self._settle(rid, released)
        result = {}
        for name, offset, datatype, shape in outputs:
            if offset == "inline":  # BYTES: the array itself travelled in the message
                result[name] = shape
                continue
            dtype = NUMPY_DTYPES[datatype]
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            # One copy, into bytes the reply will carry as they are (codec.encode_outputs).
            data = bytes(self._arena.read(offset, nbytes))
            result[name] = np.frombuffer(data, dtype=dtype).reshape(shape)
            self._free_output(offset)
        if pending is not None and not pending.future.done():
            pending.future.set_result(result)

    def _error(self, message: tuple) -> None:
        _, rid, released, error_class, text = message
        pending = self._settle(rid, released)
        if pending is not None and not pending.future.done():
            pending.future.set_exception(ipc.error_from(error_class, text))

    def _settle(self, rid: int, released: bool) -> _Pending | None:
        pending = self._pending.pop(rid, None)
        if pending is not None:
            if released:
                self._free_inputs(pending.inputs)
            else:
                self._awaiting_release[rid] = pending.inputs
        return pending

    def _release(self, rid: int) -> None:
        self._free_inputs(self._awaiting_release.pop(rid, ()))

    def _free_inputs(self, blocks) -> None:
        for offset in blocks:
            self._inputs.free(offset)
        if blocks and self._in_use is not None:
            self._in_use.set(self._inputs.bytes_in_use)

    def _free_output(self, offset: int) -> None:
        # Batched: one "free" message per loop iteration, not one per output.
        if not self._to_free:
            asyncio.get_running_loop().call_soon(self._flush_frees)
        self._to_free.append(offset)

    def _flush_frees(self) -> None:
        if self._to_free and self._channel is not None and not self._channel.closed:
            self._channel.send(("free", tuple(self._to_free)))
        self._to_free.clear()

