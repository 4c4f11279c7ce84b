"""The executor process: owns the models, their queues and executors; serves front ends.

The native front end decodes and checks each request, writes its tensors into its region
of the shared arena and sends a descriptor over the wire (``protos/wire.proto``,
``server/ipc/wire.py``). A read's descriptors are taken in one pass: each becomes a request whose
arrays are views of the arena, so the batcher reads them without another copy, and each model's
requests of the read join its queue together (one admission bound, one taking of the queue's
lock, one wake-up of its executors). A finished
batch's outputs are written into the executor's region of the arena once, whole (``on_results``),
and every request of the batch gets a descriptor of its rows: one frame per front end answers
the whole batch, and the front end copies each request's bytes into its reply.

A front end's connection closing (it crashed or stopped, or dropped the connection) takes its
queued requests out of their queues; nothing else is disturbed. What it was reading or what it
wrote is not reused while it may still be in use, or one client could get another's bytes
(wire.proto: "A lost connection does not end that ownership"):

- Output blocks. An answer, once in a front end's hands, sits in a worker's mailbox and is then
  copied into its reply; the executor cannot see those copies end. So a lost connection's
  references to output blocks are kept, by front-end process, until that process says Hello
  again (a front end says Hello only once it reads no answer of its lost connection: the native
  one stops reading them and waits for the copies under way, the Python one copies while it
  handles a frame) or exits (watched through a pidfd of the peer the socket's credentials
  name). The process, not the slot: a front end that restarted is a new process, and the old
  one's copies end with its exit.
- Input blocks. A batch that runs keeps reading its requests' inputs after their connection is
  gone. They are recorded per slot (offset and size, from the arrays' addresses in the arena)
  when their requests are answered while still held; the slot's next welcome lists them
  (``held``), so its front end keeps them, or takes them anew if it restarted, and
  ``released_inputs`` names each once the batch lets go.
- Restarts. A new executor process has no record of what its predecessor handed out, and its
  output region is the same bytes: the supervisor hands it the pids of the front ends alive,
  and it welcomes nobody until each has said Hello (done reading) or exited. Front ends only
  send requests once welcomed, so no output is written before then.

    python -m batchgate.server.executor_process < handover.json

The supervisor writes the handover (``server/supervisor/supervisor.py``): the arena, the socket's name,
and the settings this process acts on.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import gc
import itertools
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Callable

import numpy as np
import structlog

from batchgate.batcher import gpu, gpu_env
from batchgate.server.ipc.arena import ArenaLayout, SharedArena
from batchgate.server.ipc.arena_allocator import ArenaAllocator
from batchgate.batcher.errors import BatchgateError, ModelExecutionError
from batchgate.batcher.memory import DevicePools, PoolSettings
from batchgate.batcher.metrics import BatcherMetrics
from batchgate.batcher.model import ServedModel
from batchgate.batcher.request import InferenceRequest
from batchgate.batcher.spec import NUMPY_DTYPES, ModelSpec
from batchgate.protos import wire_pb2
from batchgate.server.ipc import wire
from batchgate.server.frontend.codec import bytes_array, bytes_encoding, bytes_row_offsets
from batchgate.server.executor.control import ControlPlane
from batchgate.server.logs import announce, configure_logging, runtime_facts
from batchgate.server.supervisor.multiproc_metrics import read_pid_once
from batchgate.server.supervisor.posix import schedule_request_path
from batchgate.server.executor.repository import READY, ModelIndexEntry, ModelRepository
from batchgate.server.config.settings import Settings, check_devices, read_handover
from batchgate.server.executor.shared_memory import Placement, SharedMemoryRegistry
from batchgate.server.rules.status import INTERNAL_MESSAGE, Code, status_of

log = structlog.get_logger(__name__)

EXIT_DEVICE_LOST = 75  # the supervisor restarts the executor whatever its exit status

# ToExecutor's fields, by number (``ExecutorServer.frame``).
_FIELDS = wire_pb2.ToExecutor.DESCRIPTOR.fields_by_name
_HELLO, _INFER, _CANCEL, _FREE, _CALL, _GROUPS = (
    _FIELDS[name].number for name in ("hello", "infer", "cancel", "free", "call", "groups"))
# frame() takes them in this order, groups moved to follow infer.
assert _HELLO < _INFER < _CANCEL < _FREE < _CALL < _GROUPS

_BAD_TENSORS_MESSAGE = "internal error: the front end described the request's tensors wrongly"
# Bounds on the encoded size of the answers' entries (wire.Link.room): a number field is
# wire.NUMBER_BYTES at most, a bool 2, an entry's own tag and length wire.ENTRY_BYTES.
_N, _E = wire.NUMBER_BYTES, wire.ENTRY_BYTES
_RESULT_BYTES = _E + _N + 2  # rid, released; its outputs come on top
_FAILURE_BYTES = _E + _N + 2 + 6  # rid, released, code; its message on top
_REPLY_BYTES = _E + _N + _E  # cid, the outcome's tag and length; the outcome on top
_BATCH_BYTES = _E + 3 * _E + 2  # rids, first_rows and rows (packed), released
_BATCH_MEMBER_BYTES = 3 * (_N - 1)  # a request's rid, first row and rows
TOO_MANY_OUTPUTS_MESSAGE = (
    "the answer describes {outputs} outputs, more than one frame from the executor process to "
    "the front end holds ({limit} bytes); ask for fewer outputs")
STALE_HANDLE_MESSAGE = (
    "the model was reloaded or unloaded while this request was on its way; retry the request"
)


class _FrontEnd:
    """One connected front end: its requests in flight and the output blocks it holds."""

    __slots__ = ("link", "server", "pid", "slot", "region", "requests", "blocks", "unreleased",
                 "welcomed", "closed")

    def __init__(self, link: wire.FrontendLink, server: ExecutorServer | None = None) -> None:
        self.link = link
        self.server = server
        self.pid: int | None = getattr(link, "peer_pid", None)  # the front-end process
        self.slot = -1
        self.region = (0, 0)  # its input region: [start, end) of the arena
        self.requests: dict[int, _Remote] = {}
        self.blocks: collections.Counter[int] = collections.Counter()  # block -> references
        # Requests answered while a batch still reads their inputs: rid -> those input blocks
        # (offset -> bytes), until the batch lets go of them.
        self.unreleased: dict[int, dict[int, int]] = {}
        self.welcomed = False
        self.closed = False

    def out(self, nbytes: int = 0) -> wire_pb2.ToFrontend | None:
        """The frame being filled for this front end, with room for an entry of ``nbytes``
        (``wire.Link.room``: the frame so far goes first when it lacks it); None once the front
        end has gone. FrameFull when ``nbytes`` would not fit even an empty frame."""
        if self.closed:
            return None
        try:
            return self.link.room(nbytes)
        except ConnectionError:
            return None

    def fail(self, rid: int, released: bool, code: int, text: str) -> None:
        nbytes = _FAILURE_BYTES + wire.string_bytes(text)
        if nbytes > wire.capacity_bytes():  # cut to fit: a status message is for a person
            text = text[:(wire.capacity_bytes() - _FAILURE_BYTES) // 4 - wire.ENTRY_BYTES]
            nbytes = _FAILURE_BYTES + wire.string_bytes(text)
        out = self.out(nbytes)
        if out is not None:
            out.failures.add(rid=rid, released=released, code=code, message=text)

    def flush(self) -> None:
        """Send the frame being filled now (a batch's answers), not at the loop turn's end."""
        if not self.closed:
            self.link.flush()

    def hold(self, rid: int, request: InferenceRequest) -> None:
        """``request`` was answered while its batch may still read its inputs: the front end
        reuses them once told (``release``), on this connection or, lost, on its next one."""
        self.unreleased[rid] = (self.server.input_blocks(self, request)
                                if self.server is not None else {})
        request.on_release = lambda: self.release(rid)

    def release(self, rid: int) -> None:
        """The request's inputs are no longer read (it was answered before its batch ended)."""
        blocks = self.unreleased.pop(rid, None)
        if self.closed:
            if blocks and self.server is not None:
                self.server.released_after_loss(self.slot, blocks)
            return
        out = self.out(wire.NUMBER_BYTES)
        if out is not None:
            out.released.append(rid)


class _Remote:
    """One request of a front end in flight here, and the future the batcher resolves for it.

    Resolving it is answering it, on the spot: a result was described by ``_on_results``
    just before (the batch's outputs are written once for all its requests); an error goes
    into the front end's frame as a Failure. No asyncio future, and no loop callback, per
    request.
    """

    __slots__ = ("front", "rid", "model", "request", "outputs", "placements", "answered",
                 "_done", "_callbacks")

    def __init__(self, front: _FrontEnd, rid: int, model: ServedModel,
                 request: InferenceRequest, outputs: tuple[int, ...],
                 placements: tuple[Placement | None, ...] | None = None) -> None:
        self.front = front
        self.rid = rid
        self.model = model
        self.request = request
        self.outputs = outputs  # indexes into the model's outputs
        # Per entry of ``outputs``: the client's region to write it into (None: the reply).
        self.placements = placements
        self.answered = False
        self._done = False
        self._callbacks: list | None = None

    # -- what the batcher calls (the part of asyncio.Future's interface it uses) ---------------

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return False

    def add_done_callback(self, callback) -> None:
        if self._done:
            callback(self)
        elif self._callbacks is None:
            self._callbacks = [callback]
        else:
            self._callbacks.append(callback)

    def set_result(self, _outputs) -> None:
        if not self.answered:  # results go through _on_results: this is a bug of ours
            log.error("result_without_batch", request=self.request.id)
            self.set_exception(ModelExecutionError(INTERNAL_MESSAGE))
            return
        self._finish()

    def set_exception(self, error: BaseException) -> None:
        if not self.answered:
            self.answered = True
            if not isinstance(error, BatchgateError):
                log.error("executor_request_failed", request=self.request.id, exc_info=error)
                error = ModelExecutionError(INTERNAL_MESSAGE)
            code, text = status_of(error)
            request = self.request
            released = not request.holds_inputs
            if not released:
                # Expired or cancelled while its batch runs: the batch may still read the
                # inputs; the front end reuses them once told.
                self.front.hold(self.rid, request)
            self.front.fail(self.rid, released, code, text)
        self._finish()

    def _finish(self) -> None:
        self._done = True
        self.front.requests.pop(self.rid, None)
        # The request refers to this future: without the cycle it goes (with its views of a
        # client's shared memory) as soon as its batch lets go of it, not at the next collection.
        self.request = None
        callbacks, self._callbacks = self._callbacks, None
        for callback in callbacks or ():
            callback(self)


class _Connection:
    """One front end's connection, as ``wire.FrameReader`` hands it frames."""

    __slots__ = ("frame", "read", "_server", "_front")

    def __init__(self, server: ExecutorServer, front: _FrontEnd) -> None:
        self._server, self._front = server, front
        self.frame = functools.partial(server.frame, front)  # one call per frame, no lookup
        self.read = server.read

    def lost(self, _reason: ConnectionError) -> None:
        self._server.lost(self._front)


class ExecutorServer:
    def __init__(self, arena: SharedArena, layout: ArenaLayout,
                 metrics: BatcherMetrics | None = None,
                 shared_memory: SharedMemoryRegistry | None = None) -> None:
        self._arena = arena
        # The clients' registered regions (off unless the server was started with them on).
        self.shared_memory = shared_memory or SharedMemoryRegistry(False)
        self._buffer = arena.buffer
        self._layout = layout
        self._outputs = ArenaAllocator(*layout.output_region())
        self._references: dict[int, int] = {}  # output block -> references held by front ends
        metrics = metrics if metrics is not None else BatcherMetrics()
        self._in_use = metrics.arena_bytes_in_use.labels("output")
        self._in_use_shown = -1  # what the gauge holds: it is written only when that changes
        self._fronts: set[_FrontEnd] = set()
        self._calls: set[asyncio.Task] = set()
        # After a connection is lost (wire.proto: "A lost connection does not end that
        # ownership"): per front-end process, the output blocks its lost connections held,
        # reused once it says Hello again or exits; per slot, the input blocks written over a
        # lost connection that a batch still reads (offset -> bytes).
        self._quarantined: dict[int, collections.Counter[int]] = {}
        self._held_inputs: dict[int, dict[int, int]] = {}
        # A restart: the front ends of the executor before this one (pid -> slot), which may
        # still read its output region; no front end is welcomed before each of them has said
        # Hello or exited. The front ends that said Hello meanwhile wait here.
        self._predecessors: dict[int, int] = {}
        self._unwelcomed: list[_FrontEnd] = []
        self._watched: dict[int, Callable[[], None]] = {}  # pid -> what to stop watching it
        self._arena_address = arena.address
        # The requests of the read being handled, per model, with their futures: queued when
        # its frames are all in (``read``).
        self._intake: dict[ServedModel, tuple[list[InferenceRequest], list[_Remote]]] = {}
        self._intake_cancelled = False  # a request of the read was cancelled before it queued
        # READY handle -> its model, its inputs' dtypes, whether it batches, and every output's
        # index (what a request that names none asks for): looked up once per request
        self._handles: dict[int, tuple[ServedModel, tuple, bool, tuple[int, ...]]] = {}
        self._handle_of: dict[str, tuple[int, ServedModel]] = {}  # name -> current handle
        self._next_handle = itertools.count(1)
        self.repository: ModelRepository | None = None
        self.control: ControlPlane | None = None
        # Held by the loop's thread except while it waits for events (``hold_loop``): whoever
        # holds it may touch what the loop owns.
        self._loop_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._selector = None

    # -- answering off the loop ----------------------------------------------------------------

    def hold_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """On ``loop``'s thread, before requests come: from now on that thread holds the loop
        lock except while its selector waits for events (``deliver_inline``)."""
        # The selector event loop's own selector: asyncio has no hook around its wait. Another
        # loop (none is used here) would answer every batch itself, as without this.
        selector = getattr(loop, "_selector", None)
        if selector is None or not hasattr(loop, "_ready"):
            return
        lock = self._loop_lock
        lock.acquire()
        self._loop, self._selector = loop, selector
        select = selector.select

        def waiting(timeout: float | None = None):
            lock.release()
            try:
                return select(timeout)
            finally:
                lock.acquire()

        selector.select = waiting

    def release_loop(self) -> None:
        """On the loop's thread, once it is done serving: ``hold_loop`` undone, deliveries go
        back to the loop."""
        if self._loop is None:
            return
        del self._selector.select  # the class's own again
        self._loop = self._selector = None
        self._loop_lock.release()

    def deliver_inline(self, delivery: Callable[[], None]) -> bool:
        """Run a finished batch's ``delivery`` on the calling (executor) thread if the loop
        waits for events with nothing pending: its answers go out at once, without waking the
        loop's thread (at c=1 that halved the loop's CPU per request). False when the loop is
        busy or has callbacks queued (a batch's answers must not pass an earlier one's)."""
        lock = self._loop_lock
        if not lock.acquire(blocking=False):
            return False
        try:
            loop = self._loop
            if loop is None or loop._ready:  # asyncio's queue of callbacks to run
                return False
            try:
                with wire.flushed_here():
                    delivery()
            except Exception:
                log.exception("inline_delivery_failed")
            if loop._ready:  # the delivery left callbacks (a timer's, say): wake the loop
                loop.call_soon_threadsafe(_nothing)
            return True
        finally:
            lock.release()

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
            self._handles[current[0]] = (model, _input_dtypes(model.spec),
                                         model.spec.batching.max_batch_size > 0,
                                         tuple(range(len(model.spec.outputs))))
            model.on_results = self._on_results
            model.deliver_inline = self.deliver_inline
        state.handle = current[0]
        _describe(model.spec, state.spec)
        state.config.CopyFrom(config)
        return state

    def on_state_change(self, name: str, state: str) -> None:
        if self.repository is None:
            return
        message, nbytes = _state_entry(self.model_state(name))
        for front in list(self._fronts):
            if not front.welcomed:  # its welcome will list every model
                continue
            out = front.out(nbytes)
            if out is not None:
                out.models.append(message)

    # -- one front end -------------------------------------------------------------------------

    def accept(self, link: wire.FrontendLink) -> _Connection:
        """A front end connected: what handles its frames (``wire.serve_frontends``)."""
        front = _FrontEnd(link, self)
        self._fronts.add(front)
        return _Connection(self, front)

    def await_predecessors(self, frontend_pids: dict[int, int]) -> None:
        """This executor replaces one whose front ends (slot -> pid) live: none is welcomed
        before each of them has said Hello again (it reads no output block of its last
        connection any more) or exited (wire.proto's Restarts)."""
        for slot, pid in frontend_pids.items():
            self._predecessors[pid] = slot
            self._watch(pid)
        if self._predecessors:
            log.info("awaiting_frontends", slots=sorted(self._predecessors.values()))

    def frame(self, front: _FrontEnd, frame: wire_pb2.ToExecutor) -> None:
        """One frame of ``front``'s, in wire.proto's order: hello, infer, groups, cancel, free,
        call.

        ``ListFields`` hands over the fields present, in field-number order, in one call:
        reading each field by name would make a container object per field. That order is the
        wire's but for groups, the last field, which is moved to follow infer."""
        fields = frame.ListFields()
        if len(fields) > 1 and fields[-1][0].number == _GROUPS:
            groups = fields.pop()
            at = 0
            while at < len(fields) and fields[at][0].number <= _INFER:
                at += 1
            fields.insert(at, groups)
        for field, value in fields:
            number = field.number
            if number == _GROUPS:
                for group in value[:]:
                    self._infer_group(front, group)
            elif number == _INFER:
                if len(value) == 1:
                    self._infer(front, value[0])
                else:
                    for infer in value[:]:  # a slice first: iterating upb's container is slower
                        self._infer(front, infer)
            elif number == _HELLO:
                self._hello(front, value)
            elif number == _CANCEL:
                for rid in value[:]:
                    self._cancel(front, rid)
            elif number == _FREE:
                self._free(front, value[:])
            elif number == _CALL:
                for call in value[:]:
                    # A strong reference until it ends: the loop keeps only weak ones.
                    task = asyncio.create_task(self._call(front, call))
                    self._calls.add(task)
                    task.add_done_callback(self._calls.discard)

    def read(self) -> None:
        """The frames of one read are in: each model's requests of the read are queued in one
        pass (``ServedModel.submit_all``), and its queue-depth gauge written once."""
        intake = self._intake
        if not intake:
            return
        self._intake = {}
        cancelled, self._intake_cancelled = self._intake_cancelled, False
        for model, (requests, remotes) in intake.items():
            if cancelled:  # answered already: they do not queue
                kept = [i for i, remote in enumerate(remotes) if not remote.done()]
                requests = [requests[i] for i in kept]
                remotes = [remotes[i] for i in kept]
                if not requests:
                    continue
            for index, exc in model.submit_all(requests, remotes):
                self._refused(remotes[index], exc)
            model.publish_depth()

    @staticmethod
    def _refused(remote: _Remote, error: BatchgateError) -> None:
        front = remote.front
        front.requests.pop(remote.rid, None)
        front.fail(remote.rid, True, *status_of(error))

    def lost(self, front: _FrontEnd) -> None:
        self._disconnect(front)

    def _hello(self, front: _FrontEnd, hello: wire_pb2.Hello) -> None:
        if not 0 <= hello.slot < self._layout.slots:
            log.error("frontend_refused", slot=hello.slot, slots=self._layout.slots)
            raise ConnectionError(f"slot {hello.slot} is not one of this arena's")
        front.slot = hello.slot
        start, size = self._layout.input_region(hello.slot)
        front.region = (start, start + size)
        for other in list(self._fronts):
            # The slot's earlier connection, whose end this loop has not seen yet: a front end
            # says Hello on a new one only once done with the old.
            if other is not front and other.slot == front.slot and other.pid == front.pid:
                self._disconnect(other)
        # Done with the output blocks of its lost connections (and of the executor before this
        # one): they may be reused.
        self._predecessors.pop(front.pid, None)
        self._end_quarantine(front.pid)
        self._unwelcomed.append(front)
        if not self._predecessors:
            self._welcome_waiting()

    def _welcome_waiting(self) -> None:
        waiting, self._unwelcomed = self._unwelcomed, []
        for front in waiting:
            if not front.closed:
                self._welcome(front)

    def _welcome(self, front: _FrontEnd) -> None:
        held = self._held_inputs.get(front.slot)
        out = front.out(len(held or ()) * (wire.ENTRY_BYTES + 2 * wire.NUMBER_BYTES))
        if out is None:  # gone meanwhile
            return
        out.welcome = True
        if held:
            out.held.extend([wire_pb2.InputBlock(offset=offset, nbytes=nbytes)
                             for offset, nbytes in held.items()])
        front.welcomed = True
        states = [self.model_state(entry.name, entry) for entry in self.repository.index()]
        for state in states:  # those that do not fit the welcome's frame follow it
            message, nbytes = _state_entry(state)
            out = front.out(nbytes)
            if out is None:
                return
            out.models.append(message)
        log.info("frontend_connected", slot=front.slot, models=len(states),
                 held_inputs=len(held or ()))

    def _disconnect(self, front: _FrontEnd) -> None:
        if front.closed:
            return
        front.closed = True
        self._fronts.discard(front)
        if not front.welcomed and front in self._unwelcomed:
            self._unwelcomed.remove(front)
        abandoned = len(front.requests)
        if self._intake:
            self._intake_cancelled = True
        for remote in list(front.requests.values()):
            remote.model.cancel(remote.request)  # those a batch still reads: held (hold())
        if front.unreleased and front.slot >= 0:
            held = self._held_inputs.setdefault(front.slot, {})
            for blocks in front.unreleased.values():
                held.update(blocks)
        if front.blocks:
            if front.pid is None:  # not a socket's peer (a test's link): nobody reads them
                for block, count in front.blocks.items():
                    self._drop_references(block, count)
            else:
                # Its answers may still be in its workers' hands: the blocks wait for its next
                # Hello or its exit (wire.proto).
                self._quarantined.setdefault(front.pid, collections.Counter()).update(
                    front.blocks)
                self._watch(front.pid)
            front.blocks.clear()
            self._show_in_use()
        front.link.close()
        log.info("frontend_disconnected", slot=front.slot, abandoned=abandoned,
                 held_inputs=len(front.unreleased))

    def input_blocks(self, front: _FrontEnd, request: InferenceRequest) -> dict[int, int]:
        """The blocks of ``front``'s input region that ``request``'s arrays are views of
        (offset -> bytes): those a batch reads. BYTES inputs were decoded out of the arena,
        a client's shared memory never was in it."""
        start, end = front.region
        base = self._arena_address
        blocks = {}
        for array in request.inputs:
            if isinstance(array, np.ndarray) and not array.dtype.hasobject:
                offset = array.__array_interface__["data"][0] - base
                if start <= offset < end:
                    blocks[offset] = array.nbytes
        return blocks

    def released_after_loss(self, slot: int, blocks: dict[int, int]) -> None:
        """Input blocks of a lost connection of ``slot`` are no longer read: its front end's
        current connection is told, or the next one's welcome leaves them out."""
        held = self._held_inputs.get(slot)
        if held is None:
            return
        for offset in blocks:
            held.pop(offset, None)
        if not held:
            del self._held_inputs[slot]
        for front in self._fronts:
            if front.slot == slot and front.welcomed:
                out = front.out(len(blocks) * wire.NUMBER_BYTES)
                if out is not None:
                    out.released_inputs.extend(blocks)

    def _end_quarantine(self, pid: int | None) -> None:
        blocks = self._quarantined.pop(pid, None)
        if blocks:
            for block, count in blocks.items():
                self._drop_references(block, count)
            self._show_in_use()
            log.info("frontend_outputs_reused", pid=pid, blocks=len(blocks))
        if pid not in self._predecessors:
            self._unwatch(pid)

    def _watch(self, pid: int | None) -> None:
        """Call ``_exited(pid)`` when the process ``pid`` exits (a pidfd on the loop; a poll
        once a second where pidfds are refused)."""
        if pid is None or pid in self._watched:
            return
        loop = asyncio.get_running_loop()
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._watched[pid] = _nothing
            loop.call_soon(self._exited, pid)
            return
        except OSError as exc:
            log.warning("pidfd_refused", pid=pid, error=str(exc), effect="polled every second")

            def poll() -> None:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    self._exited(pid)
                    return
                except PermissionError:
                    pass
                self._watched[pid] = loop.call_later(1.0, poll).cancel

            self._watched[pid] = loop.call_later(1.0, poll).cancel
            return

        def stop() -> None:
            loop.remove_reader(fd)
            os.close(fd)

        loop.add_reader(fd, self._exited, pid)
        self._watched[pid] = stop

    def _unwatch(self, pid: int | None) -> None:
        stop = self._watched.pop(pid, None)
        if stop is not None:
            stop()

    def _exited(self, pid: int) -> None:
        """The front-end process ``pid`` exited: nothing of it reads the arena any more."""
        self._unwatch(pid)
        self._end_quarantine(pid)
        if self._predecessors.pop(pid, None) is not None and not self._predecessors:
            self._welcome_waiting()

    # -- requests ------------------------------------------------------------------------------

    def _infer(self, front: _FrontEnd, message: wire_pb2.Infer) -> None:
        """Submit one request."""
        rid = message.rid
        served = self._handles.get(message.model)
        if served is None:
            front.fail(rid, True, Code.UNAVAILABLE, STALE_HANDLE_MESSAGE)
            return
        model, dtypes, batching, every_output = served
        spec = model.spec
        placed: list[tuple[int, str, Placement]] = []
        try:
            arrays, shape_key = self._arrays(front, dtypes, message.inputs[:], placed, batching)
        except ValueError as exc:  # a front end's bug: its descriptors do not fit the model
            log.error("bad_descriptor", slot=front.slot, model=spec.name, error=str(exc))
            front.fail(rid, True, Code.INTERNAL, _BAD_TENSORS_MESSAGE)
            return
        except BatchgateError as exc:  # a shared-memory input that cannot be read
            front.fail(rid, True, *status_of(exc))
            return
        outputs = tuple(message.outputs[:])  # a slice first: tuple() of upb's container is 2x
        placements = None
        wire_placements = message.placements
        if wire_placements:
            if len(wire_placements) != len(outputs):
                log.error("bad_descriptor", slot=front.slot, model=spec.name,
                          error=f"{len(wire_placements)} placements for "
                                f"{len(outputs)} outputs")
                front.fail(rid, True, Code.INTERNAL,
                           "internal error: the front end described the request's outputs "
                           "wrongly")
                return
            placements = tuple(Placement(p.region, p.offset, p.nbytes) if p.region else None
                               for p in wire_placements)
        deadline_ns = message.deadline_ns
        request = InferenceRequest(
            arrays, batch_size=message.batch_size if batching else 1, request_id=message.id,
            priority=message.priority,
            deadline=deadline_ns / 1e9 if deadline_ns else None,
            timeout_us=message.timeout_us,
            requested_outputs=[spec.outputs[i].name for i in outputs] if outputs else None,
            shape_key=shape_key,
        )
        if placed:
            request.check_inputs = self.shared_memory.checker(placed)
        remote = _Remote(front, rid, model, request, outputs or every_output, placements)
        # A cancel later in the read finds it, and answers it (it then does not queue).
        request.future = remote
        front.requests[rid] = remote
        pending = self._intake.get(model)
        if pending is None:
            self._intake[model] = ([request], [remote])
        else:
            pending[0].append(request)
            pending[1].append(remote)

    def _infer_group(self, front: _FrontEnd, group: wire_pb2.InferGroup) -> None:
        """Submit a group's requests (wire.proto's InferGroup), as ``_infer`` would each: the
        columns are read once, and a request costs its views, its InferenceRequest and its
        future."""
        rids = group.rids[:]
        served = self._handles.get(group.model)
        if served is None:
            for rid in rids:
                front.fail(rid, True, Code.UNAVAILABLE, STALE_HANDLE_MESSAGE)
            return
        model, dtypes, batching, every_output = served
        count = len(rids)
        sizes, priorities = group.batch_sizes[:], group.priorities[:]
        deadlines, timeouts, ids = group.deadlines_ns[:], group.timeouts_us[:], group.ids[:]
        inputs = group.inputs[:]
        columns = []  # per input: its dtype, its shape past the rows, its row's bytes
        offsets = []  # per input: its offset column
        try:
            if not batching:
                raise ValueError("a group of requests for a model that does not batch")
            if len(inputs) != len(dtypes) or not inputs:
                raise ValueError(f"{len(inputs)} tensors for {len(dtypes)} inputs")
            if not (len(sizes) == len(priorities) == len(deadlines) == len(timeouts)
                    == len(ids) == count):
                raise ValueError("the group's columns are not all one entry per request")
            for entry, (dtype, datatype, _name) in zip(inputs, dtypes):
                tail, column = tuple(entry.tail[:]), entry.offsets[:]
                if dtype is None:
                    raise ValueError(f"a group holds a {datatype} input")
                if len(column) != count or min(tail, default=0) < 0:
                    raise ValueError(f"input shape (rows, {tail}) with {len(column)} offsets "
                                     f"for {count} requests")
                columns.append((dtype, tail, math.prod(tail) * dtype.itemsize))
                offsets.append(column)
        except ValueError as exc:  # a front end's bug
            log.error("bad_descriptor", slot=front.slot, model=model.spec.name, error=str(exc))
            for rid in rids:
                front.fail(rid, True, Code.INTERNAL, _BAD_TENSORS_MESSAGE)
            return
        key = tuple(tail for _, tail, _ in columns)
        start, end = front.region
        buffer = self._buffer
        in_flight = front.requests
        pending = self._intake.get(model)
        if pending is None:
            pending = self._intake[model] = ([], [])
        requests, remotes = pending
        for rid, rows, where, priority, deadline_ns, timeout_us, request_id in zip(
                rids, sizes, zip(*offsets), priorities, deadlines, timeouts, ids):
            arrays = []
            for (dtype, tail, row_bytes), offset in zip(columns, where):
                if offset < start or offset + rows * row_bytes > end:
                    break
                arrays.append(np.ndarray((rows, *tail), dtype, buffer, offset))
            else:
                request = InferenceRequest(
                    arrays, batch_size=rows, request_id=request_id, priority=priority,
                    deadline=deadline_ns / 1e9 if deadline_ns else None,
                    timeout_us=timeout_us, shape_key=key)
                remote = _Remote(front, rid, model, request, every_output)
                request.future = remote  # as in _infer
                in_flight[rid] = remote
                requests.append(request)
                remotes.append(remote)
                continue
            log.error("bad_descriptor", slot=front.slot, model=model.spec.name,
                      error=f"{rows * row_bytes} bytes at {offset} lie outside the front "
                            f"end's region [{start}, {end})")
            front.fail(rid, True, Code.INTERNAL, _BAD_TENSORS_MESSAGE)
        if not requests:
            del self._intake[model]

    def _arrays(self, front: _FrontEnd, dtypes, tensors, placed: list, batching: bool
                ) -> tuple[list[np.ndarray], tuple]:
        """Views of the request's tensors in the front end's region (BYTES decoded), or in
        the client's shared-memory region, and the request's ``batch_shape_key``; the placed
        ones' (index, name, Placement) into ``placed``. ``dtypes``: per input (dtype, datatype,
        name)."""
        if len(tensors) != len(dtypes):
            raise ValueError(f"{len(tensors)} tensors for {len(dtypes)} inputs")
        start, end = front.region
        arrays = []
        key = []  # the shapes, less the batch dimension when batching
        for tensor, (dtype, datatype, name) in zip(tensors, dtypes):
            shape = tuple(tensor.shape[:])
            key.append(shape[1:] if batching else shape)
            if tensor.HasField("placement"):
                p = tensor.placement
                placement = Placement(p.region, p.offset, p.nbytes, shape)
                if dtype is not None and (math.prod(shape) * dtype.itemsize
                                          != placement.nbytes):
                    raise ValueError(f"shape {list(shape)} of {datatype} is not "
                                     f"{placement.nbytes} bytes")
                placed.append((len(arrays), name, placement))
                arrays.append(self.shared_memory.input_array(placement, name, datatype))
                continue
            offset, nbytes = tensor.offset, tensor.nbytes
            if offset < start or offset + nbytes > end:
                raise ValueError(f"{nbytes} bytes at {offset} lie outside the front end's "
                                 f"region [{start}, {end})")
            if dtype is None:  # BYTES: decoded here, into the numpy object array models take
                arrays.append(bytes_array(self._arena.read(offset, nbytes), shape))
                continue
            if math.prod(shape) * dtype.itemsize != nbytes or min(shape, default=0) < 0:
                raise ValueError(f"shape {list(shape)} of {datatype} is not {nbytes} bytes")
            # The arena's checks, done above once for the whole request.
            arrays.append(np.ndarray(shape, dtype, self._buffer, offset))
        return arrays, tuple(key)


    def _cancel(self, front: _FrontEnd, rid: int) -> None:
        remote = front.requests.get(rid)
        if remote is not None:
            if self._intake:
                self._intake_cancelled = True
            remote.model.cancel(remote.request)

    # -- a batch's results ---------------------------------------------------------------------

    def _on_results(self, requests: list[InferenceRequest], outputs: list[np.ndarray]) -> None:
        """Write the batch's outputs into the arena once and describe each request's rows: in one
        Batch per front end where every request takes every output in fixed-size rows."""
        live = [(index, request.future) for index, request in enumerate(requests)
                if isinstance(request.future, _Remote) and not request.future.done()
                and not request.future.front.closed]
        if not live:
            return
        spec = live[0][1].model.spec
        wanted = set()  # what goes into the arena: the outputs not in a client's region
        for _, remote in live:
            if remote.placements is None:
                wanted.update(remote.outputs)
            else:
                wanted.update(k for k, p in zip(remote.outputs, remote.placements) if p is None)
        # A request's rows of an output: requests lie in the batch in order, each its rows.
        split = spec.batching.max_batch_size > 0 and len(requests) > 1
        blocks: dict[int, tuple[int, int]] = {}  # output index -> (block, bytes) of the batch's
        # Per output, the byte offset in its block of each row, and of the end (rows + 1 values).
        row_offsets: dict[int, np.ndarray | int] = {}
        try:
            for k in sorted(wanted):
                if spec.outputs[k].datatype == "BYTES":
                    blocks[k], row_offsets[k] = self._write_bytes(outputs[k], split)
                else:
                    blocks[k] = (self._write(outputs[k]), outputs[k].nbytes)
                    row_offsets[k] = outputs[k].nbytes // max(len(outputs[k]), 1)
        except _OutputRegionFull as full:
            for block, _ in blocks.values():
                self._outputs.free(block)
            self._fail_all(live, full.error)
            return
        starts = list(itertools.accumulate((r.batch_size for r in requests), initial=0))
        # Per output in the arena: its block, its bytes, its row offsets, its shape past rows.
        layout = {k: (block, nbytes, row_offsets[k], outputs[k].shape[1:])
                  for k, (block, nbytes) in blocks.items()}
        held: dict[tuple[_FrontEnd, int], int] = {}  # (front end, block) -> references
        every = tuple(range(len(spec.outputs)))
        if (split and len(layout) == len(every)
                and all(entry[2].__class__ is int for entry in layout.values())
                and all(r.placements is None and r.outputs == every for _, r in live)):
            self._describe_batch(live, spec, outputs, starts, layout, held)
        else:
            self._describe_each(live, spec, outputs, starts, split, layout, held)
        referenced = set()
        for (front, block), count in held.items():
            front.blocks[block] += count
            self._references[block] = self._references.get(block, 0) + count
            referenced.add(block)
        for block, _ in blocks.values():
            if block not in referenced:
                self._outputs.free(block)
        self._show_in_use()
        # The answers go out before the batch's accounting (ServedModel._deliver) runs: every
        # front end's frame (one or two), not a set of the batch's requests' front ends.
        for front in self._fronts:
            front.flush()

    def _describe_each(self, live: list[tuple[int, _Remote]], spec: ModelSpec,
                       outputs: list[np.ndarray], starts: list[int], split: bool,
                       layout: dict, held: dict) -> None:
        """One Result per request: its rows of each output it asked for (or its placements).
        A Result that would not fit a frame alone fails its request alone."""
        per_output = [_output_bytes(array.ndim) for array in outputs]
        sizes: dict[tuple[int, ...], int] = {}  # the outputs asked for -> their Result's bound
        capacity = wire.capacity_bytes()
        for index, remote in live:
            front = remote.front
            if front.closed:
                continue
            request = remote.request
            nbytes = sizes.get(remote.outputs)
            if nbytes is None:
                nbytes = sizes[remote.outputs] = _RESULT_BYTES + sum(
                    [per_output[k] for k in remote.outputs])
            if nbytes > capacity:
                remote.answered = True
                front.fail(remote.rid, not request.holds_inputs, Code.RESOURCE_EXHAUSTED,
                           TOO_MANY_OUTPUTS_MESSAGE.format(outputs=len(remote.outputs),
                                                           limit=wire.MAX_FRAME_BYTES))
                continue
            placed = None
            if remote.placements is not None:
                try:
                    placed = self._place(remote, index, spec, outputs, starts if split else None)
                except BatchgateError as exc:  # an output that does not fit the client's region
                    remote.answered = True
                    front.fail(remote.rid, not request.holds_inputs, *status_of(exc))
                    continue
            out = front.out(nbytes)
            if out is None:
                continue
            add = out.results.add(rid=remote.rid, released=not request.holds_inputs).outputs.add
            rows, first = request.batch_size, starts[index]
            for k in remote.outputs:
                if placed is not None and k in placed:
                    nbytes, shape = placed[k]
                    add(placed=True, nbytes=nbytes, shape=shape)  # no block to free
                    continue
                block, nbytes, per_row, tail = layout[k]
                if not split:
                    add(block=block, offset=block, nbytes=nbytes, shape=outputs[k].shape)
                elif per_row.__class__ is int:  # fixed-size rows; else BYTES' row offsets
                    add(block=block, offset=block + first * per_row, nbytes=rows * per_row,
                        shape=(rows, *tail))
                else:
                    offset, nbytes = _rows_of(per_row, first, rows)
                    add(block=block, offset=block + offset, nbytes=nbytes, shape=(rows, *tail))
                key = (front, block)
                held[key] = held.get(key, 0) + 1
            remote.answered = True

    def _describe_batch(self, live: list[tuple[int, _Remote]], spec: ModelSpec,
                        outputs: list[np.ndarray], starts: list[int], layout: dict,
                        held: dict) -> None:
        """Every request takes every output, whose rows have a fixed size: one Batch per front
        end (wire.proto) in place of a Result each, or several where one would not fit a
        frame."""
        groups: dict[_FrontEnd, list[tuple[int, _Remote]]] = {}
        for entry in live:
            front = entry[1].front
            group = groups.get(front)
            if group is None:
                groups[front] = [entry]
            else:
                group.append(entry)
        described = [layout[k] for k in sorted(layout)]
        fixed = _BATCH_BYTES + sum([_batch_output_bytes(outputs[k].ndim) for k in layout])
        most = max(1, (wire.capacity_bytes() - fixed) // _BATCH_MEMBER_BYTES)
        for front, members in groups.items():
            if front.closed:
                continue
            released = not members[0][1].request.holds_inputs
            if any(remote.request.holds_inputs is released for _, remote in members):
                # A batch's requests are released together (ServedModel._deliver); were they
                # not, each says so in its own Result.
                self._describe_each(members, spec, outputs, starts, True, layout, held)
                continue
            for at in range(0, len(members), most):
                part = members[at:at + most]
                out = front.out(fixed + len(part) * _BATCH_MEMBER_BYTES)
                if out is None:
                    break
                batch = out.batches.add(released=released)
                batch.rids.extend([remote.rid for _, remote in part])
                batch.first_rows.extend([starts[index] for index, _ in part])
                batch.rows.extend([remote.request.batch_size for _, remote in part])
                for block, _, row_bytes, tail in described:
                    batch.outputs.add(block=block, row_bytes=row_bytes, tail=tail)
                    held[(front, block)] = held.get((front, block), 0) + len(part)
                for _, remote in part:
                    remote.answered = True

    def _place(self, remote: _Remote, index: int, spec: ModelSpec, outputs: list[np.ndarray],
               starts: list[int] | None) -> dict[int, tuple[int, tuple]]:
        """Write the request's placed outputs (its rows of the batch's) into the client's
        regions: output index -> (bytes written, shape)."""
        placed = {}
        for k, placement in zip(remote.outputs, remote.placements):
            if placement is None:
                continue
            array = outputs[k]
            if starts is not None:
                array = array[starts[index]:starts[index] + remote.request.batch_size]
            tspec = spec.outputs[k]
            written = self.shared_memory.write_output(placement, tspec.name, tspec.datatype,
                                                      array)
            placed[k] = (written.nbytes, written.shape)
        return placed

    def _write(self, array: np.ndarray) -> int:
        block = self._outputs.alloc(array.nbytes)
        if block is None:
            raise _OutputRegionFull(self._outputs.bytes_in_use)
        np.copyto(self._arena.array(block, array.dtype, array.shape), array)
        return block

    def _write_bytes(self, array: np.ndarray, rows: bool) -> tuple[tuple[int, int], np.ndarray]:
        """The batch's encoding of a BYTES output in a block of its own: ``((block, bytes),
        row offsets)``, the offsets only when ``rows`` (the batch is split per request)."""
        data = bytes_encoding(array)
        block = self._outputs.alloc(len(data))
        if block is None:
            raise _OutputRegionFull(self._outputs.bytes_in_use)
        self._arena.write(block, data)
        return (block, len(data)), (bytes_row_offsets(array) if rows else None)

    def _fail_all(self, live: list[tuple[int, _Remote]], error: BatchgateError) -> None:
        code, text = status_of(error)
        for _, remote in live:
            remote.answered = True
            remote.front.fail(remote.rid, not remote.request.holds_inputs, code, text)

    def _free(self, front: _FrontEnd, blocks) -> None:
        # A batch's requests share a block and are usually freed in one frame: one update each.
        if len(blocks) == 1:
            counts = ((blocks[0], 1),)
        else:
            tally: dict[int, int] = {}
            for block in blocks:
                tally[block] = tally.get(block, 0) + 1
            counts = tally.items()
        for block, count in counts:
            holding = front.blocks.get(block, 0)
            if holding < count:
                log.error("bad_free", slot=front.slot, block=block)
                count = holding
                if not count:
                    continue
            if holding == count:
                del front.blocks[block]
            else:
                front.blocks[block] = holding - count
            self._drop_references(block, count)
        self._show_in_use()

    def _show_in_use(self) -> None:
        # Most frees drop one of a batch's references to a block and free nothing.
        in_use = self._outputs.bytes_in_use
        if in_use != self._in_use_shown:
            self._in_use_shown = in_use
            self._in_use.set(in_use)

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
        # The shared-memory registrations are this process's, answered by its registry.
        handler = (self.shared_memory if method.startswith(("system_", "cuda_"))
                   else self.control)
        try:
            response = await getattr(handler, method)(getattr(call, method))
        except Exception as exc:
            self._reply_error(front, call.cid, *status_of(exc))
            return
        nbytes = _REPLY_BYTES + response.ByteSize()
        if nbytes > wire.capacity_bytes():
            self._reply_error(front, call.cid, Code.RESOURCE_EXHAUSTED, (
                f"the reply is {nbytes} bytes, more than one frame from the executor process "
                f"to the front end holds ({wire.MAX_FRAME_BYTES} bytes)"))
            return
        out = front.out(nbytes)
        if out is not None:
            getattr(out.replies.add(cid=call.cid), method).CopyFrom(response)

    @staticmethod
    def _reply_error(front: _FrontEnd, cid: int, code: int, text: str) -> None:
        error = wire_pb2.Status(code=code, message=text)
        out = front.out(_REPLY_BYTES + error.ByteSize())
        if out is not None:
            out.replies.add(cid=cid, error=error)


class _OutputRegionFull(Exception):
    def __init__(self, in_use: int) -> None:
        from batchgate.batcher.errors import ResourceExhausted

        super().__init__()
        self.error = ResourceExhausted(
            f"the executor's shared-memory output region is full ({in_use} bytes in use); "
            "retry later")
        self.status = status_of(self.error)


def _nothing() -> None:
    pass


def _state_entry(state: wire_pb2.ModelState) -> tuple[wire_pb2.ModelState, int]:
    """``state`` and its entry's size, or, for a model whose description alone would not fit a
    frame (a config of that size), the model as UNAVAILABLE saying why."""
    nbytes = wire.ENTRY_BYTES + state.ByteSize()
    if nbytes <= wire.capacity_bytes():
        return state, nbytes
    state = wire_pb2.ModelState(
        name=state.name, state="UNAVAILABLE",
        reason=f"its description ({nbytes} bytes) is larger than a frame from the executor "
               f"process to the front end ({wire.MAX_FRAME_BYTES} bytes)")
    return state, wire.ENTRY_BYTES + state.ByteSize()


def _output_bytes(ndim: int) -> int:
    """A bound on one Output entry's size (a Result's) for an output of ``ndim`` dimensions:
    block, offset, nbytes, placed, and the packed shape."""
    return wire.ENTRY_BYTES + 3 * wire.NUMBER_BYTES + 2 + wire.ENTRY_BYTES + 10 * ndim


def _batch_output_bytes(ndim: int) -> int:
    """The same for a BatchOutput: block, row_bytes and the shape past the rows."""
    return wire.ENTRY_BYTES + 2 * wire.NUMBER_BYTES + wire.ENTRY_BYTES + 10 * max(ndim - 1, 0)


def _rows_of(row_offsets: np.ndarray, first: int, rows: int) -> tuple[int, int]:
    """``(offset, nbytes)`` of rows ``first .. first + rows`` in a BYTES output's block, from the
    offsets of every row (fixed-size rows are ``first * row_bytes``, ``rows * row_bytes``)."""
    begin = int(row_offsets[first])
    return begin, int(row_offsets[first + rows]) - begin


def _input_dtypes(spec: ModelSpec) -> tuple[tuple[np.dtype | None, str, str], ...]:
    """Per input, its numpy dtype (None for BYTES), datatype and name."""
    return tuple((None if t.datatype == "BYTES" else NUMPY_DTYPES[t.datatype], t.datatype,
                  t.name) for t in spec.inputs)


def _describe(spec: ModelSpec, into: wire_pb2.ModelSpec) -> None:
    into.name = spec.name
    into.version = spec.version
    into.platform = spec.platform
    into.max_batch_size = spec.batching.max_batch_size
    for tensors, target in ((spec.inputs, into.inputs), (spec.outputs, into.outputs)):
        for tensor in tensors:
            target.add(name=tensor.name, datatype=tensor.datatype, dims=tensor.dims)


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
    server.await_predecessors({int(slot): pid for slot, pid
                               in handover.get("frontend_pids", {}).items()})
    pools = DevicePools(PoolSettings(settings.device_pool_bytes, settings.device_pool_fraction,
                                     settings.device_pool_strict), metrics)
    repository = ModelRepository(settings.model_repository, metrics=metrics,
                                 on_state_change=server.on_state_change, pools=pools)
    server.repository = repository
    server.control = ControlPlane(repository,
                                  max_load_files_bytes=settings.max_load_files_bytes)
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
    server.hold_loop(loop)
    try:
        await stopping.wait()
        log.info("executor_draining", drain_timeout_s=settings.drain_timeout_s)
        await repository.close(settings.drain_timeout_s)
    finally:
        server.release_loop()
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
