"""The executor process: owns the models, their queues and executors; serves front ends.

Front ends (native or Python) decode and check each request, write its tensors into their region
of the shared arena and send a descriptor over the wire (``protos/wire.proto``,
``server/wire.py``). A frame's descriptors are taken in one pass: each becomes a request whose
arrays are views of the arena, so the batcher reads them without another copy. A finished
batch's outputs are written into the executor's region of the arena once, whole (``on_results``),
and every request of the batch gets a descriptor of its rows: one frame per front end answers
the whole batch, and the front end copies each request's bytes into its reply.

A front end's connection closing (it crashed or stopped) takes its queued requests out of their
queues and drops its references to output blocks: nothing else is disturbed.

    python -m server.executor_process < handover.json

The supervisor writes the handover (``server/supervisor.py``): the arena, the socket's name,
and the settings this process acts on.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import gc
import itertools
import math
import os
import signal
import sys

import numpy as np
import structlog

from batcher.arena import ArenaAllocator, ArenaLayout, SharedArena
from batcher.errors import BatchgateError, ModelExecutionError, RequestCancelled
from batcher.memory import DevicePools, PoolSettings
from batcher.metrics import BatcherMetrics
from batcher.model import ServedModel
from batcher.request import InferenceRequest
from batcher.spec import ELEMENT_SIZES, NUMPY_DTYPES, ModelSpec
from protos import wire_pb2
from server import wire
from server.codec import bytes_array, bytes_encoding
from server.control import ControlPlane
from server.logs import announce, configure_logging
from server.repository import READY, ModelIndexEntry, ModelRepository
from server.settings import Settings, read_handover
from server.status import Code, status_of

log = structlog.get_logger(__name__)

STALE_HANDLE_MESSAGE = (
    "the model was reloaded or unloaded while this request was on its way; retry the request"
)


class _FrontEnd:
    """One connected front end: its requests in flight and the output blocks it holds."""

    __slots__ = ("link", "slot", "region", "requests", "blocks", "closed")

    def __init__(self, link: wire.FrontendLink) -> None:
        self.link = link
        self.slot = -1
        self.region = (0, 0)  # its input region: [start, end) of the arena
        self.requests: dict[int, _Remote] = {}
        self.blocks: collections.Counter[int] = collections.Counter()  # block -> references
        self.closed = False

    def out(self) -> wire_pb2.ToFrontend | None:
        """The frame being filled for this front end; None once it has gone."""
        if self.closed:
            return None
        try:
            return self.link.out
        except ConnectionError:
            return None


class _Remote:
    """One request of a front end, in flight here."""

    __slots__ = ("front", "rid", "model", "request", "outputs", "answered")

    def __init__(self, front: _FrontEnd, rid: int, model: ServedModel,
                 request: InferenceRequest, outputs: tuple[int, ...]) -> None:
        self.front = front
        self.rid = rid
        self.model = model
        self.request = request
        self.outputs = outputs  # indexes into the model's outputs
        self.answered = False


class ExecutorServer:
    def __init__(self, arena: SharedArena, layout: ArenaLayout,
                 metrics: BatcherMetrics | None = None) -> None:
        self._arena = arena
        self._layout = layout
        self._outputs = ArenaAllocator(*layout.output_region())
        self._references: dict[int, int] = {}  # output block -> references held by front ends
        metrics = metrics if metrics is not None else BatcherMetrics()
        self._in_use = metrics.arena_bytes_in_use.labels("output")
        self._fronts: set[_FrontEnd] = set()
        self._calls: set[asyncio.Task] = set()
        self._handles: dict[int, ServedModel] = {}  # READY handle -> its model
        self._handle_of: dict[str, tuple[int, ServedModel]] = {}  # name -> current handle
        self._next_handle = itertools.count(1)
        self.repository: ModelRepository | None = None
        self.control: ControlPlane | None = None

    # -- model states --------------------------------------------------------------------------

    def model_state(self, name: str, entry: ModelIndexEntry | None = None
                    ) -> wire_pb2.ModelState:
        """``name``'s state as front ends see it; a READY model gets a handle per load."""
        repository = self.repository
        if entry is None:
            entry = next((e for e in repository.index() if e.name == name), None)
        state = wire_pb2.ModelState(name=name, state=entry.state if entry else "UNAVAILABLE",
                                    reason=entry.reason if entry else "unknown")
        current = self._handle_of.get(name)
        model = None
        if state.state == READY:
            try:
                model = repository.get(name)
                config = repository.config(name)
            except BatchgateError:
                state.state, model = "UNAVAILABLE", None
        if model is None:
            if current is not None:
                del self._handle_of[name]
                self._handles.pop(current[0], None)
            return state
        if current is None or current[1] is not model:
            if current is not None:
                self._handles.pop(current[0], None)
            current = (next(self._next_handle), model)
            self._handle_of[name] = current
            self._handles[current[0]] = model
            model.on_results = self._on_results
        state.handle = current[0]
        _describe(model.spec, state.spec)
        state.config.CopyFrom(config)
        return state

    def on_state_change(self, name: str, state: str) -> None:
        if self.repository is None:
            return
        message = self.model_state(name)
        for front in list(self._fronts):
            out = front.out()
            if out is not None:
                out.models.append(message)

    # -- one front end -------------------------------------------------------------------------

    async def handle(self, link: wire.FrontendLink) -> None:
        front = _FrontEnd(link)
        self._fronts.add(front)
        try:
            while True:
                frame = await link.receive()
                if frame.HasField("hello"):
                    self._hello(front, frame.hello)
                for infer in frame.infer:
                    self._infer(front, infer)
                for rid in frame.cancel:
                    self._cancel(front, rid)
                if frame.free:
                    self._free(front, frame.free)
                for call in frame.call:
                    # A strong reference until it ends: the loop keeps only weak ones.
                    task = asyncio.create_task(self._call(front, call))
                    self._calls.add(task)
                    task.add_done_callback(self._calls.discard)
        except ConnectionError:
            pass
        finally:
            self._fronts.discard(front)
            self._disconnect(front)

    def _hello(self, front: _FrontEnd, hello: wire_pb2.Hello) -> None:
        if not 0 <= hello.slot < self._layout.slots:
            log.error("frontend_refused", slot=hello.slot, slots=self._layout.slots)
            raise ConnectionError(f"slot {hello.slot} is not one of this arena's")
        front.slot = hello.slot
        start, size = self._layout.input_region(hello.slot)
        front.region = (start, start + size)
        out = front.out()
        out.welcome = True
        states = [self.model_state(entry.name, entry) for entry in self.repository.index()]
        out.models.extend(states)
        log.info("frontend_connected", slot=front.slot, models=len(states))

    def _disconnect(self, front: _FrontEnd) -> None:
        front.closed = True
        abandoned = len(front.requests)
        for remote in list(front.requests.values()):
            remote.model.cancel(remote.request)
        for block, count in front.blocks.items():
            self._drop_references(block, count)
        front.blocks.clear()
        self._in_use.set(self._outputs.bytes_in_use)
        front.link.close()
        log.info("frontend_disconnected", slot=front.slot, abandoned=abandoned)

    # -- requests ------------------------------------------------------------------------------

    def _infer(self, front: _FrontEnd, message: wire_pb2.Infer) -> None:
        rid = message.rid
        model = self._handles.get(message.model)
        if model is None:
            self._fail(front, rid, True, Code.UNAVAILABLE, STALE_HANDLE_MESSAGE)
            return
        spec = model.spec
        try:
            arrays = self._arrays(front, spec, message.inputs)
        except ValueError as exc:  # a front end's bug: its descriptors do not fit the model
            log.error("bad_descriptor", slot=front.slot, model=spec.name, error=str(exc))
            self._fail(front, rid, True, Code.INTERNAL,
                       "internal error: the front end described the request's tensors wrongly")
            return
        batching = spec.batching.max_batch_size > 0
        outputs = tuple(message.outputs)
        request = InferenceRequest(
            arrays, batch_size=message.batch_size if batching else 1, request_id=message.id,
            priority=message.priority,
            deadline=message.deadline_ns / 1e9 if message.deadline_ns else None,
            timeout_us=message.timeout_us,
            requested_outputs=[spec.outputs[i].name for i in outputs] if outputs else None,
            shape_key=tuple(a.shape[1:] if batching else a.shape for a in arrays),
        )
        remote = _Remote(front, rid, model, request,
                         outputs or tuple(range(len(spec.outputs))))
        request.reply = remote
        try:
            future = model.submit(request)
        except BatchgateError as exc:
            code, text = status_of(exc)
            self._fail(front, rid, True, code, text)
            return
        front.requests[rid] = remote
        # A callback, not a task per request: this loop is on the hot path.
        future.add_done_callback(functools.partial(self._settled, remote))

    def _arrays(self, front: _FrontEnd, spec: ModelSpec, tensors) -> list[np.ndarray]:
        if len(tensors) != len(spec.inputs):
            raise ValueError(f"{len(tensors)} tensors for {len(spec.inputs)} inputs")
        start, end = front.region
        arrays = []
        for tensor, tspec in zip(tensors, spec.inputs):
            offset, nbytes, shape = tensor.offset, tensor.nbytes, tuple(tensor.shape)
            if offset < start or offset + nbytes > end:
                raise ValueError(f"{nbytes} bytes at {offset} lie outside the front end's "
                                 f"region [{start}, {end})")
            size = ELEMENT_SIZES.get(tspec.datatype)
            if size is None:  # BYTES: decoded here, into the numpy object array models take
                arrays.append(bytes_array(self._arena.read(offset, nbytes), shape))
                continue
            if math.prod(shape) * size != nbytes:
                raise ValueError(f"shape {list(shape)} of {tspec.datatype} is not {nbytes} bytes")
            arrays.append(self._arena.array(offset, NUMPY_DTYPES[tspec.datatype], shape))
        return arrays

    def _cancel(self, front: _FrontEnd, rid: int) -> None:
        remote = front.requests.get(rid)
        if remote is not None:
            remote.model.cancel(remote.request)

    def _settled(self, remote: _Remote, future: asyncio.Future) -> None:
        """A request's future is done: answer it, unless its batch's results already did."""
        front = remote.front
        front.requests.pop(remote.rid, None)
        if remote.answered or front.closed:
            return
        remote.answered = True
        if future.cancelled():
            error: BaseException = RequestCancelled("the request was cancelled")
        else:
            error = future.exception()
            if error is None:  # results go through _on_results: this is a bug of ours
                log.error("result_without_batch", request=remote.request.id)
                error = ModelExecutionError("internal error in the executor; its log has the "
                                            "details")
            elif not isinstance(error, BatchgateError):
                log.error("executor_request_failed", request=remote.request.id, exc_info=error)
                error = ModelExecutionError("internal error in the executor; its log has the "
                                            "details")
        code, text = status_of(error)
        request = remote.request
        released = not request.holds_inputs
        if not released:
            # Expired or cancelled while its batch runs: the batch may still read the inputs.
            rid = remote.rid
            request.on_release = lambda: self._released(front, rid)
        self._fail(front, remote.rid, released, code, text)

    def _released(self, front: _FrontEnd, rid: int) -> None:
        out = front.out()
        if out is not None:
            out.released.append(rid)

    def _fail(self, front: _FrontEnd, rid: int, released: bool, code: int, text: str) -> None:
        out = front.out()
        if out is not None:
            out.failures.add(rid=rid, released=released, code=code, message=text)

    # -- a batch's results ---------------------------------------------------------------------

    def _on_results(self, requests: list[InferenceRequest], outputs: list[np.ndarray],
                    results: list[dict[str, np.ndarray]]) -> None:
        """Write the batch's outputs into the arena once and describe each request's rows."""
        live = [(index, request.reply) for index, request in enumerate(requests)
                if not request.future.done() and isinstance(request.reply, _Remote)
                and not request.reply.front.closed]
        if not live:
            return
        spec = live[0][1].model.spec
        wanted = sorted({k for _, remote in live for k in remote.outputs})
        blocks: dict[int, int] = {}
        try:
            for k in wanted:
                if spec.outputs[k].datatype != "BYTES":
                    blocks[k] = self._write(outputs[k])
        except _OutputRegionFull as full:
            for block in blocks.values():
                self._outputs.free(block)
            self._fail_all(live, full.error)
            return
        # Where each request's rows start: requests lie in the batch in order.
        starts = list(itertools.accumulate((r.batch_size for r in requests), initial=0))
        batching = spec.batching.max_batch_size > 0
        references = collections.Counter()
        for index, remote in live:
            out = remote.front.out()
            if out is None:
                continue
            result = out.results.add(rid=remote.rid, released=not remote.request.holds_inputs)
            for k in remote.outputs:
                array = outputs[k]
                if k not in blocks:  # BYTES: each request's own encoding, in its own block
                    try:
                        block, nbytes = self._write_bytes(
                            results[index][spec.outputs[k].name])
                    except _OutputRegionFull as full:
                        del out.results[-1]
                        self._fail(remote.front, remote.rid, True, *full.status)
                        break
                    offset, shape = block, results[index][spec.outputs[k].name].shape
                else:
                    block = blocks[k]
                    if batching and len(requests) > 1:
                        row_bytes = array.nbytes // max(len(array), 1)
                        rows = remote.request.batch_size
                        offset = block + starts[index] * row_bytes
                        nbytes, shape = rows * row_bytes, (rows, *array.shape[1:])
                    else:
                        offset, nbytes, shape = block, array.nbytes, array.shape
                result.outputs.add(block=block, offset=offset, nbytes=nbytes, shape=shape)
                references[block] += 1
                remote.front.blocks[block] += 1
            remote.answered = True
        for block in blocks.values():
            if not references[block]:
                self._outputs.free(block)
        for block, count in references.items():
            self._references[block] = self._references.get(block, 0) + count
        self._in_use.set(self._outputs.bytes_in_use)

    def _write(self, array: np.ndarray) -> int:
        block = self._outputs.alloc(array.nbytes)
        if block is None:
            raise _OutputRegionFull(self._outputs.bytes_in_use)
        np.copyto(self._arena.array(block, array.dtype, array.shape), array)
        return block

    def _write_bytes(self, array: np.ndarray) -> tuple[int, int]:
        data = bytes_encoding(array)
        block = self._outputs.alloc(len(data))
        if block is None:
            raise _OutputRegionFull(self._outputs.bytes_in_use)
        self._arena.write(block, data)
        return block, len(data)

    def _fail_all(self, live: list[tuple[int, _Remote]], error: BatchgateError) -> None:
        code, text = status_of(error)
        for _, remote in live:
            remote.answered = True
            self._fail(remote.front, remote.rid, not remote.request.holds_inputs, code, text)

    def _free(self, front: _FrontEnd, blocks) -> None:
        for block in blocks:
            if front.blocks[block] <= 0:
                log.error("bad_free", slot=front.slot, block=block)
                continue
            front.blocks[block] -= 1
            if not front.blocks[block]:
                del front.blocks[block]
            self._drop_references(block, 1)
        self._in_use.set(self._outputs.bytes_in_use)

    def _drop_references(self, block: int, count: int) -> None:
        left = self._references[block] - count
        if left:
            self._references[block] = left
        else:
            del self._references[block]
            self._outputs.free(block)

    # -- the control plane ---------------------------------------------------------------------

    async def _call(self, front: _FrontEnd, call: wire_pb2.Call) -> None:
        method = call.WhichOneof("method")
        try:
            response = await getattr(self.control, method)(getattr(call, method))
        except Exception as exc:
            code, text = status_of(exc)
            out = front.out()
            if out is not None:
                out.replies.add(cid=call.cid, error=wire_pb2.Status(code=code, message=text))
            return
        out = front.out()
        if out is not None:
            getattr(out.replies.add(cid=call.cid), method).CopyFrom(response)


class _OutputRegionFull(Exception):
    def __init__(self, in_use: int) -> None:
        from batcher.errors import ResourceExhausted

        super().__init__()
        self.error = ResourceExhausted(
            f"the executor's shared-memory output region is full ({in_use} bytes in use); "
            "retry later")
        self.status = status_of(self.error)


def _describe(spec: ModelSpec, into: wire_pb2.ModelSpec) -> None:
    into.name = spec.name
    into.version = spec.version
    into.platform = spec.platform
    into.max_batch_size = spec.batching.max_batch_size
    for tensors, target in ((spec.inputs, into.inputs), (spec.outputs, into.outputs)):
        for tensor in tensors:
            target.add(name=tensor.name, datatype=tensor.datatype, dims=tensor.dims)


async def run(handover: dict) -> None:
    settings = Settings.handed_over(handover["settings"])
    arena = SharedArena.attach(handover["arena_fd"], handover["arena_bytes"])
    # On a GPU the arena is the pinned staging area: host-to-device copies start from it.
    if arena.pin():
        log.info("arena_pinned", bytes=arena.size)
    layout = ArenaLayout(handover["arena_bytes"], handover["slots"])
    metrics = BatcherMetrics()
    server = ExecutorServer(arena, layout, metrics)
    pools = DevicePools(PoolSettings(settings.device_pool_bytes, settings.device_pool_fraction,
                                     settings.device_pool_strict), metrics)
    repository = ModelRepository(settings.model_repository, metrics=metrics,
                                 on_state_change=server.on_state_change, pools=pools)
    server.repository = repository
    server.control = ControlPlane(repository)
    sys.setswitchinterval(settings.switch_interval_s)
    listener = await wire.serve_frontends(handover["socket"], server.handle)
    await repository.load_all()
    if settings.gc_freeze:
        gc.collect()
        gc.freeze()
    ready = [e.name for e in repository.index() if e.state == READY]
    announce("executor_ready", models=ready, socket=handover["socket"], pid=os.getpid())

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    log.info("executor_draining", drain_timeout_s=settings.drain_timeout_s)
    await repository.close(settings.drain_timeout_s)
    listener.close()
    log.info("executor_stopped")


def main() -> int:
    handover = read_handover()
    configure_logging(handover["settings"]["log_level"], "json")
    structlog.contextvars.bind_contextvars(role="executor")
    asyncio.run(run(handover))
    return 0


if __name__ == "__main__":
    sys.exit(main())
