"""The executor process's front ends: one ``FrontEnd`` per connection, and what outlives a
connection (``FrontEnds``: wire.proto's "A lost connection does not end that ownership").

A front end's connection closing (it crashed or stopped, or dropped the connection) takes its
queued requests out of their queues; nothing else is disturbed. What it was reading or what it
wrote is not reused while it may still be in use, or one client could get another's bytes:

- Output blocks. An answer, once in a front end's hands, sits in a worker's mailbox and is then
  copied into its reply; the executor cannot see those copies end. So a lost connection's
  references to output blocks are kept, by front-end process, until that process says Hello
  again (a front end says Hello only once it reads no answer of its lost connection: it stops
  reading them and waits for the copies under way) or exits (watched through a pidfd of the
  peer the socket's credentials name). The process, not the slot: a front end that restarted
  is a new process, and the old one's copies end with its exit.
- Input blocks. A batch that runs keeps reading its requests' inputs after their connection is
  gone. They are recorded per slot (offset and size, from the arrays' addresses in the arena)
  when their requests are answered while still held; the slot's next welcome lists them
  (``held``), so its front end keeps them, or takes them anew if it restarted, and
  ``released_inputs`` names each once the batch lets go.
- Restarts. A new executor process has no record of what its predecessor handed out, and its
  output region is the same bytes: the supervisor hands it the pids of the front ends alive,
  and it welcomes nobody until each has said Hello (done reading) or exited. Front ends only
  send requests once welcomed, so no output is written before then.
"""

from __future__ import annotations

import asyncio
import collections
import os
from collections.abc import Callable

import numpy as np
import structlog

from batchgate.server.ipc.arena import ArenaLayout
from batchgate.batcher.model import ServedModel
from batchgate.batcher.request import InferenceRequest
from batchgate.protos import wire_pb2
from batchgate.server.ipc import wire
from batchgate.server.executor.models import ModelHandles, state_entry
from batchgate.server.executor.shared_memory import Placement

log = structlog.get_logger(__name__)

# Bounds on the encoded size of a Failure (wire.Link.room): rid, released, code; its message
# on top.
_FAILURE_BYTES = wire.ENTRY_BYTES + wire.NUMBER_BYTES + 2 + 6


class Caller:
    """Who a request answers to, and what it asked for: a request's ``caller``. One is shared
    by every request of an InferGroup (they all take every output, in the reply)."""

    __slots__ = ("front", "model", "outputs", "placements", "whole")

    def __init__(self, front: FrontEnd, model: ServedModel, outputs: tuple[int, ...],
                 placements: tuple[Placement | None, ...] | None = None,
                 whole: bool = False) -> None:
        self.front = front
        self.model = model
        self.outputs = outputs  # indexes into the model's outputs
        # Per entry of ``outputs``: the client's region to write it into (None: the reply).
        self.placements = placements
        # Every output, in the model's order, in the reply: what a Batch message describes.
        self.whole = whole


class FrontEnd:
    """One connected front end: its requests in flight and the output blocks it holds."""

    __slots__ = ("link", "owner", "pid", "slot", "region", "requests", "blocks", "unreleased",
                 "welcomed", "closed", "_group_callers")

    def __init__(self, link: wire.FrontendLink, owner: FrontEnds | None = None) -> None:
        self.link = link
        self.owner = owner
        self.pid: int | None = getattr(link, "peer_pid", None)  # the front-end process
        self.slot = -1
        self.region = (0, 0)  # its input region: [start, end) of the arena
        self.requests: dict[int, InferenceRequest] = {}  # rid -> request in flight
        self.blocks: collections.Counter[int] = collections.Counter()  # block -> references
        # Requests answered while a batch still reads their inputs: rid -> those input blocks
        # (offset -> bytes), until the batch lets go of them.
        self.unreleased: dict[int, dict[int, int]] = {}
        self.welcomed = False
        self.closed = False
        self._group_callers: dict[ServedModel, Caller] = {}

    def group_caller(self, model: ServedModel, every_output: tuple[int, ...]) -> Caller:
        """The ``Caller`` of this front end's group requests for ``model``."""
        caller = self._group_callers.get(model)
        if caller is None:
            caller = self._group_callers[model] = Caller(self, model, every_output, None, True)
        return caller

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
        self.unreleased[rid] = (self.owner.input_blocks(self, request)
                                if self.owner is not None else {})
        request.on_release = lambda: self.release(rid)

    def release(self, rid: int) -> None:
        """The request's inputs are no longer read (it was answered before its batch ended)."""
        blocks = self.unreleased.pop(rid, None)
        if self.closed:
            if blocks and self.owner is not None:
                self.owner.released_after_loss(self.slot, blocks)
            return
        out = self.out(wire.NUMBER_BYTES)
        if out is not None:
            out.released.append(rid)


class FrontEnds:
    """Every connected front end, and what their lost connections still own."""

    def __init__(self, layout: ArenaLayout, arena_address: int, handles: ModelHandles,
                 drop_references: Callable[[int, int], None],
                 show_in_use: Callable[[], None],
                 disconnected: Callable[[FrontEnd], None]) -> None:
        """``drop_references(block, count)``: output block references given back;
        ``show_in_use()``: the output region's gauge written after a change;
        ``disconnected(front)``: a connection ended, before its requests are cancelled."""
        self._layout = layout
        self._arena_address = arena_address
        self._handles = handles
        self._drop_references = drop_references
        self._show_in_use = show_in_use
        self.connected: set[FrontEnd] = set()
        # Per front-end process, the output blocks its lost connections held, reused once it
        # says Hello again or exits; per slot, the input blocks written over a lost connection
        # that a batch still reads (offset -> bytes).
        self._quarantined: dict[int, collections.Counter[int]] = {}
        self._held_inputs: dict[int, dict[int, int]] = {}
        # A restart: the front ends of the executor before this one (pid -> slot), which may
        # still read its output region; no front end is welcomed before each of them has said
        # Hello or exited. The front ends that said Hello meanwhile wait here.
        self._predecessors: dict[int, int] = {}
        self._unwelcomed: list[FrontEnd] = []
        self._watched: dict[int, Callable[[], None]] = {}  # pid -> what to stop watching it
        self._disconnected = disconnected

    def accept(self, link: wire.FrontendLink) -> FrontEnd:
        front = FrontEnd(link, self)
        self.connected.add(front)
        return front

    def await_predecessors(self, frontend_pids: dict[int, int]) -> None:
        """This executor replaces one whose front ends (slot -> pid) live: none is welcomed
        before each of them has said Hello again (it reads no output block of its last
        connection any more) or exited (wire.proto's Restarts)."""
        for slot, pid in frontend_pids.items():
            self._predecessors[pid] = slot
            self._watch(pid)
        if self._predecessors:
            log.info("awaiting_frontends", slots=sorted(self._predecessors.values()))

    def on_state_change(self, name: str) -> None:
        """``name``'s state changed: every welcomed front end is told."""
        message, nbytes = state_entry(self._handles.state(name))
        for front in list(self.connected):
            if not front.welcomed:  # its welcome will list every model
                continue
            out = front.out(nbytes)
            if out is not None:
                out.models.append(message)

    def hello(self, front: FrontEnd, hello: wire_pb2.Hello) -> None:
        if not 0 <= hello.slot < self._layout.slots:
            log.error("frontend_refused", slot=hello.slot, slots=self._layout.slots)
            raise ConnectionError(f"slot {hello.slot} is not one of this arena's")
        front.slot = hello.slot
        start, size = self._layout.input_region(hello.slot)
        front.region = (start, start + size)
        for other in list(self.connected):
            # The slot's earlier connection, whose end this loop has not seen yet: a front end
            # says Hello on a new one only once done with the old.
            if other is not front and other.slot == front.slot and other.pid == front.pid:
                self.disconnect(other)
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

    def _welcome(self, front: FrontEnd) -> None:
        held = self._held_inputs.get(front.slot)
        out = front.out(len(held or ()) * (wire.ENTRY_BYTES + 2 * wire.NUMBER_BYTES))
        if out is None:  # gone meanwhile
            return
        out.welcome = True
        if held:
            out.held.extend([wire_pb2.InputBlock(offset=offset, nbytes=nbytes)
                             for offset, nbytes in held.items()])
        front.welcomed = True
        states = self._handles.every_state()
        for state in states:  # those that do not fit the welcome's frame follow it
            message, nbytes = state_entry(state)
            out = front.out(nbytes)
            if out is None:
                return
            out.models.append(message)
        log.info("frontend_connected", slot=front.slot, models=len(states),
                 held_inputs=len(held or ()))

    def disconnect(self, front: FrontEnd) -> None:
        if front.closed:
            return
        front.closed = True
        self.connected.discard(front)
        if not front.welcomed and front in self._unwelcomed:
            self._unwelcomed.remove(front)
        abandoned = len(front.requests)
        self._disconnected(front)
        for request in list(front.requests.values()):
            request.caller.model.cancel(request)  # those a batch still reads: held (hold())
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

    def input_blocks(self, front: FrontEnd, request: InferenceRequest) -> dict[int, int]:
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
        for front in self.connected:
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


def _nothing() -> None:
    pass
