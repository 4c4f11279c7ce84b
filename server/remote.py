"""The Python front end's view of the executor process: a repository whose models run elsewhere.

``RemoteRepository`` offers what ``InferenceService`` uses of a repository (``get``,
``config``) and of the control plane (statistics, index, load, unload: forwarded to the
executor as the client sent them), so the same service code serves in both modes. It speaks
the wire of ``protos/wire.proto`` (``server/wire.py``), as the native front end does. A
request's decoded arrays are copied once, into this front end's region of the shared arena;
the executor reads them in place. Outputs come back as descriptors into the executor's region
and are copied once, into the bytes of the gRPC reply.

When the executor goes away every request in flight gets UNAVAILABLE (retryable), health turns
NOT_SERVING, and the front end reconnects as soon as a new executor listens. Outputs are copied
while their frame is handled, so none is read once its connection is lost, before the next
Hello (wire.proto's ownership after a loss); the input blocks of requests left in flight are
kept until the next welcome says which the executor still reads. A connection lost soon after
it was made is tried again after a delay that doubles, as the native front end does.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable

import numpy as np
import structlog

from batchgate.batcher.arena import SharedArena
from batchgate.batcher.arena_allocator import ArenaAllocator
from batchgate.batcher.errors import ModelNotFound, ModelUnavailable, ResourceExhausted, quoted
from batchgate.batcher.metrics import BatcherMetrics
from batchgate.batcher.request import InferenceRequest
from batchgate.batcher.spec import NUMPY_DTYPES, BatchingConfig, ModelSpec, TensorSpec
from batchgate.protos import inference_pb2 as pb
from batchgate.protos import model_config_pb2, wire_pb2
from batchgate.server import wire
from batchgate.server.codec import EncodedBytes, bytes_encoding
from batchgate.server.shared_memory import Placed
from batchgate.server.status import StatusError

log = structlog.get_logger(__name__)

RECONNECT_INTERVAL_S = 0.05
# The native front end's (executor_link.cc): a connection lost sooner than STABLE_SESSION_S
# after it was made is tried again after a delay doubling up to MAX_RECONNECT_DELAY_S, and
# the warning is logged at most once per LOST_LOG_INTERVAL_S.
STABLE_SESSION_S = 1.0
MAX_RECONNECT_DELAY_S = 2.0
LOST_LOG_INTERVAL_S = 10.0
# A Call's bytes in a frame beyond its request's (its cid, the tags): the native front end's margin.
CALL_OVERHEAD_BYTES = 64
EXECUTOR_LOST_MESSAGE = "the executor process restarted; retry the request"


class _Pending:
    __slots__ = ("future", "inputs", "names", "datatypes")

    def __init__(self, future: asyncio.Future, inputs: list[int], names: list[str],
                 datatypes: list[str]) -> None:
        self.future = future
        self.inputs = inputs  # this front end's input blocks, freed on release
        self.names = names  # the outputs asked for, in order, and their datatypes
        self.datatypes = datatypes


class RemoteModel:
    """One READY model of the executor, as the service sees it."""

    def __init__(self, repository: RemoteRepository, handle: int, spec: ModelSpec) -> None:
        self._repository = repository
        self.handle = handle
        self.spec = spec
        self.output_index = {t.name: i for i, t in enumerate(spec.outputs)}

    @property
    def ready(self) -> bool:
        return self._repository.connected

    async def infer(self, request: InferenceRequest) -> dict[str, np.ndarray | EncodedBytes]:
        """Each output as an array, or a BYTES one as its wire encoding (``EncodedBytes``)."""
        return await self._repository.infer(self, request)


class RemoteRepository:
    def __init__(self, arena: SharedArena, input_region: tuple[int, int], slot: int,
                 socket_name: str) -> None:
        self._arena = arena
        self._inputs = ArenaAllocator(*input_region)
        self._slot = slot
        self._socket = socket_name
        self._on_state_change: Callable[[str, str], None] | None = None
        self._on_connection_change: Callable[[bool], None] | None = None
        self._link: wire.ExecutorLink | None = None
        self._states: dict[str, wire_pb2.ModelState] = {}
        self._models: dict[str, RemoteModel] = {}
        self._configs: dict[str, model_config_pb2.ModelConfig] = {}
        self._pending: dict[int, _Pending] = {}
        self._awaiting_release: dict[int, list[int]] = {}
        # Input blocks of requests a lost connection left in flight, until a welcome says which
        # the executor still reads.
        self._kept_inputs: set[int] = set()
        self._reconnect_delay_s = 0.0
        self._losses_unlogged = 0
        self._last_lost_log: float | None = None
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
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
        return self._link is not None and not self._link.closed

    # -- connection ----------------------------------------------------------------------------

    async def load_all(self) -> None:
        """Connect to the executor and learn its models (the start-up of a front end)."""
        self._reader = asyncio.create_task(self._run())
        await self._connected.wait()

    async def _run(self) -> None:
        while not self._closing:
            try:
                link = await wire.connect_to_executor(self._socket)
            except OSError:
                await asyncio.sleep(RECONNECT_INTERVAL_S)
                continue
            started = time.monotonic()
            self._link = link
            link.out.hello.slot = self._slot
            try:
                while True:
                    self._handle(await link.receive())
            except ConnectionError:
                pass
            finally:
                self._lost(link)
            if not self._closing:
                await asyncio.sleep(self._note_loss(time.monotonic() - started))

    def _note_loss(self, session_s: float) -> float:
        """The delay before connecting again after a connection that lasted ``session_s``, and
        the warning (rate-limited)."""
        now = time.monotonic()
        lasted = session_s >= STABLE_SESSION_S
        self._reconnect_delay_s = 0.0 if lasted else min(
            MAX_RECONNECT_DELAY_S, max(RECONNECT_INTERVAL_S, 2 * self._reconnect_delay_s))
        self._losses_unlogged += 1
        if lasted or self._last_lost_log is None or \
                now - self._last_lost_log >= LOST_LOG_INTERVAL_S:
            log.warning("executor_lost", slot=self._slot, losses=self._losses_unlogged,
                        reconnect_in_ms=round(self._reconnect_delay_s * 1000))
            self._losses_unlogged = 0
            self._last_lost_log = now
        return self._reconnect_delay_s

    def _handle(self, frame: wire_pb2.ToFrontend) -> None:
        if frame.welcome:  # before any model is served: no request gets a held block
            self._settle_kept_inputs(frame.held)
        for offset in frame.released_inputs:
            if offset in self._kept_inputs:
                self._kept_inputs.discard(offset)
                self._free_inputs((offset,))
        for state in frame.models:
            self._set_state(state)
        for result in frame.results:
            self._result(result)
        for batch in frame.batches:
            for result in wire.batch_results(batch):
                self._result(result)
        for failure in frame.failures:
            pending = self._settle(failure.rid, failure.released)
            if pending is not None and not pending.future.done():
                pending.future.set_exception(StatusError(failure.code, failure.message))
        for rid in frame.released:
            self._free_inputs(self._awaiting_release.pop(rid, ()))
        for reply in frame.replies:
            self._reply(reply)
        if frame.welcome:
            log.info("executor_connected", slot=self._slot, models=len(frame.models))
            self._connected.set()
            if self._on_connection_change is not None:
                self._on_connection_change(True)

    def _lost(self, link: wire.ExecutorLink) -> None:
        link.close()
        if self._link is link:
            self._link = None
        self._connected.clear()
        error = ModelUnavailable(EXECUTOR_LOST_MESSAGE)
        # The executor may live on, a batch of it still reading them: kept until the next
        # welcome says which it does.
        for pending in self._pending.values():
            self._kept_inputs.update(pending.inputs)
            if not pending.future.done():
                pending.future.set_exception(error)
        self._pending.clear()
        for blocks in self._awaiting_release.values():
            self._kept_inputs.update(blocks)
        self._awaiting_release.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()
        for name in list(self._states):
            self._set_state(wire_pb2.ModelState(name=name, state="UNAVAILABLE",
                                                reason="the executor is restarting"))
        if not self._closing and self._on_connection_change is not None:
            self._on_connection_change(False)  # _run logs it (_note_loss)

    def _settle_kept_inputs(self, held) -> None:
        """The welcome's held input blocks stay taken (taken now if this process does not hold
        them: it restarted); every other kept block is free again."""
        still = set()
        for block in held:
            if block.offset not in self._kept_inputs and \
                    not self._inputs.reserve(block.offset, block.nbytes):
                log.error("input_block_unknown", offset=block.offset)
                continue
            still.add(block.offset)
        self._free_inputs([offset for offset in self._kept_inputs if offset not in still])
        self._kept_inputs = still

    async def close(self, drain_timeout_s: float = 30.0) -> None:
        """Let requests in flight finish (bounded), then disconnect."""
        try:
            await asyncio.wait_for(self._quiet(), drain_timeout_s)
        except asyncio.TimeoutError:
            log.warning("frontend_drain_timed_out", slot=self._slot, left=len(self._pending))
        self._closing = True
        if self._link is not None:
            self._link.close()
        if self._reader is not None:
            self._reader.cancel()

    async def _quiet(self) -> None:
        while self._pending:
            await asyncio.sleep(0.005)

    # -- models --------------------------------------------------------------------------------

    def _set_state(self, state: wire_pb2.ModelState) -> None:
        name = state.name
        old = self._states.get(name)
        self._states[name] = state
        if state.state == "READY":
            self._models[name] = RemoteModel(self, state.handle, _spec_of(state.spec))
            self._configs[name] = state.config
        else:
            self._models.pop(name, None)
            self._configs.pop(name, None)
        if self._on_state_change is not None and (old is None or old.state != state.state):
            self._on_state_change(name, state.state)

    def knows(self, name: str) -> bool:
        """Whether the executor told of a model ``name``, in any state."""
        return name in self._states

    def get(self, name: str, version: str = "") -> RemoteModel:
        model = self._models.get(name)
        if model is None:
            known = self._states.get(name)
            if known is None:
                if not self.connected:
                    raise ModelUnavailable("the executor process is not connected; retry")
                raise ModelNotFound(f"unknown model {quoted(name)}")
            raise ModelUnavailable(
                f"model {quoted(name)} is not available: {known.reason or known.state}")
        if version and version != model.spec.version:
            raise ModelNotFound(
                f"model {quoted(name)} has no version {quoted(version)} being served "
                f"(serving version {model.spec.version})"
            )
        return model

    def config(self, name: str, version: str = "") -> model_config_pb2.ModelConfig:
        self.get(name, version)
        return self._configs[name]

    def ready_models(self) -> list[str]:
        return sorted(self._models)

    # -- the control plane: forwarded ----------------------------------------------------------

    async def statistics(self, request: pb.ModelStatisticsRequest) -> pb.ModelStatisticsResponse:
        return await self._call("statistics", request)

    async def index(self, request: pb.RepositoryIndexRequest) -> pb.RepositoryIndexResponse:
        return await self._call("index", request)

    async def load(self, request: pb.RepositoryModelLoadRequest) -> pb.RepositoryModelLoadResponse:
        return await self._call("load", request)

    async def unload(self, request: pb.RepositoryModelUnloadRequest
                     ) -> pb.RepositoryModelUnloadResponse:
        return await self._call("unload", request)

    # Shared-memory registrations live in the executor, with the models that read them.

    async def system_status(self, request):
        return await self._call("system_status", request)

    async def system_register(self, request):
        return await self._call("system_register", request)

    async def system_unregister(self, request):
        return await self._call("system_unregister", request)

    async def cuda_status(self, request):
        return await self._call("cuda_status", request)

    async def cuda_register(self, request):
        return await self._call("cuda_register", request)

    async def cuda_unregister(self, request):
        return await self._call("cuda_unregister", request)

    async def _call(self, method: str, request):
        link = self._link
        if link is None:
            raise ModelUnavailable("the executor process is not connected; retry")
        # The executor drops a link whose frame passes MAX_FRAME_BYTES, and every request on it
        # with the link: a call that large is refused (as the native front end refuses it),
        # and one that would make the frame being filled too large goes in the next frame.
        out = _room(link, request.ByteSize() + CALL_OVERHEAD_BYTES)
        cid = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[cid] = future
        getattr(out.call.add(cid=cid), method).CopyFrom(request)
        return await future

    def _reply(self, reply: wire_pb2.Reply) -> None:
        future = self._calls.pop(reply.cid, None)
        if future is None or future.done():
            return
        outcome = reply.WhichOneof("outcome")
        if outcome == "error":
            future.set_exception(StatusError(reply.error.code, reply.error.message))
        else:
            future.set_result(getattr(reply, outcome))

    # -- inference -----------------------------------------------------------------------------

    async def infer(self, model: RemoteModel, request: InferenceRequest
                    ) -> dict[str, np.ndarray | EncodedBytes]:
        link = self._link
        if link is None:
            raise ModelUnavailable("the executor process is not connected; retry")
        spec = model.spec
        blocks: list[int] = []
        message = wire_pb2.Infer(
            model=model.handle, batch_size=request.batch_size, priority=request.priority,
            deadline_ns=wire.deadline_ns(request.deadline),
            timeout_us=request.timeout_us, id=request.id)
        placements = getattr(request, "input_placements", None)
        try:
            for index, (array, tensor) in enumerate(zip(request.inputs, spec.inputs)):
                placement = placements[index] if placements else None
                if placement is not None:  # the executor reads it from the client's region
                    message.inputs.add(shape=placement.shape, placement=wire_pb2.Placement(
                        region=placement.region, offset=placement.offset,
                        nbytes=placement.nbytes))
                    continue
                data = bytes_encoding(array) if tensor.datatype == "BYTES" else array
                nbytes = len(data) if tensor.datatype == "BYTES" else array.nbytes
                offset = self._inputs.alloc(nbytes)
                if offset is None:
                    raise ResourceExhausted(
                        f"this front end's shared-memory region is full "
                        f"({self._inputs.bytes_in_use} bytes in flight); retry later"
                    )
                blocks.append(offset)
                self._arena.write(offset, data)
                message.inputs.add(offset=offset, nbytes=nbytes, shape=array.shape)
        except BaseException:
            self._free_inputs(blocks)
            raise
        if self._in_use is not None:
            self._in_use.set(self._inputs.bytes_in_use)
        names = list(request.requested_outputs or [t.name for t in spec.outputs])
        if request.requested_outputs:
            message.outputs.extend(model.output_index[name] for name in names)
            placed = getattr(request, "output_placements", None)
            if placed and any(placed):
                for placement in placed:
                    if placement is None:
                        message.placements.add()
                    else:
                        message.placements.add(region=placement.region,
                                               offset=placement.offset,
                                               nbytes=placement.nbytes)
        rid = message.rid = next(self._ids)
        try:
            out = _room(link, wire.ENTRY_BYTES + message.ByteSize())
        except ResourceExhausted:
            self._free_inputs(blocks)
            raise
        future = asyncio.get_running_loop().create_future()
        self._pending[rid] = _Pending(future, blocks, names,
                                      [spec.output(name).datatype for name in names])
        out.infer.append(message)
        try:
            return await future
        except asyncio.CancelledError:
            if rid in self._pending and self._link is link and not link.closed:
                link.room(wire.NUMBER_BYTES).cancel.append(rid)
            raise

    def _result(self, result: wire_pb2.Result) -> None:
        pending = self._settle(result.rid, result.released)
        arrays = {}
        frees = []
        for output, name, datatype in zip(result.outputs, pending.names if pending else (),
                                          pending.datatypes if pending else ()):
            shape = tuple(output.shape)
            if output.placed:  # in the client's region already
                arrays[name] = Placed(shape)
                continue
            # One copy, into bytes the reply will carry as they are (codec.encode_outputs).
            data = bytes(self._arena.read(output.offset, output.nbytes))
            if datatype == "BYTES":  # already the reply's encoding: not decoded to re-encode
                arrays[name] = EncodedBytes(data, shape)
            else:
                arrays[name] = np.frombuffer(data, dtype=NUMPY_DTYPES[datatype]).reshape(shape)
        frees = [output.block for output in result.outputs if not output.placed]
        if frees and self._link is not None and not self._link.closed:
            self._link.room(len(frees) * wire.NUMBER_BYTES).free.extend(frees)
        if pending is not None and not pending.future.done():
            pending.future.set_result(arrays)

    def _settle(self, rid: int, released: bool) -> _Pending | None:
        pending = self._pending.pop(rid, None)
        if pending is not None:
            if released:
                self._free_inputs(pending.inputs)
            else:
                self._awaiting_release[rid] = pending.inputs
        return pending

    def _free_inputs(self, blocks) -> None:
        for offset in blocks:
            self._inputs.free(offset)
        if blocks and self._in_use is not None:
            self._in_use.set(self._inputs.bytes_in_use)


def _room(link: wire.ExecutorLink, nbytes: int) -> wire_pb2.ToExecutor:
    """The frame being filled with room for an entry of ``nbytes``; RESOURCE_EXHAUSTED for an
    entry no frame holds."""
    try:
        return link.room(nbytes)
    except wire.FrameFull:
        raise ResourceExhausted(
            f"the request is larger than the {wire.MAX_FRAME_BYTES} bytes a front end "
            "forwards to the executor process") from None


def _spec_of(message: wire_pb2.ModelSpec) -> ModelSpec:
    """The batcher's view of a model the executor described: what decoding needs."""
    def tensors(specs) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(t.name, t.datatype, tuple(t.dims)) for t in specs)

    return ModelSpec(message.name, message.version, message.platform, tensors(message.inputs),
                     tensors(message.outputs),
                     batching=BatchingConfig(max_batch_size=message.max_batch_size))
