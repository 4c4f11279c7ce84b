"""The executor process's end of the wire: one ``ExecutorServer`` serves every front end.

Front ends decode and check each request, write its tensors into their region of the shared
arena and send descriptors over the wire (``protos/wire.proto``, ``server/ipc/wire.py``). What the
executor does with them is split by job: a read's requests into the models' queues
(``intake.py``), a finished batch's answers back out (``answers.py``, the
models' delivery), the front ends and what their lost connections still own
(``fronts.py``), the models' handles (``models.py``), control-plane calls
(``calls.py``), and answering from an executor thread while the loop waits
(``loop.py``). This module ties them to the frames of each connection.
"""

from __future__ import annotations

import functools

from batchgate.server.ipc.arena import ArenaLayout, SharedArena
from batchgate.batcher.metrics import BatcherMetrics
from batchgate.protos import wire_pb2
from batchgate.server.ipc import wire
from batchgate.server.executor.control import ControlPlane
from batchgate.server.executor.answers import BatchAnswers, OutputRegion
from batchgate.server.executor.calls import ControlCalls
from batchgate.server.executor.fronts import FrontEnd, FrontEnds
from batchgate.server.executor.intake import Intake
from batchgate.server.executor.loop import LoopHold
from batchgate.server.executor.models import ModelHandles
from batchgate.server.executor.repository import ModelRepository
from batchgate.server.executor.shared_memory import SharedMemoryRegistry

# ToExecutor's fields, by number (``ExecutorServer.frame``).
_FIELDS = wire_pb2.ToExecutor.DESCRIPTOR.fields_by_name
_HELLO, _INFER, _CANCEL, _FREE, _CALL, _GROUPS = (
    _FIELDS[name].number for name in ("hello", "infer", "cancel", "free", "call", "groups"))
# frame() takes them in this order, groups moved to follow infer.
assert _HELLO < _INFER < _CANCEL < _FREE < _CALL < _GROUPS


class _Connection:
    """One front end's connection, as ``wire.FrameReader`` hands it frames."""

    __slots__ = ("frame", "read", "_server", "_front")

    def __init__(self, server: ExecutorServer, front: FrontEnd) -> None:
        self._server, self._front = server, front
        self.frame = functools.partial(server.frame, front)  # one call per frame, no lookup
        self.read = server.read

    def lost(self, _reason: ConnectionError) -> None:
        self._server.fronts.disconnect(self._front)


class ExecutorServer:
    def __init__(self, arena: SharedArena, layout: ArenaLayout,
                 metrics: BatcherMetrics | None = None,
                 shared_memory: SharedMemoryRegistry | None = None) -> None:
        metrics = metrics if metrics is not None else BatcherMetrics()
        # The clients' registered regions (off unless the server was started with them on).
        self.shared_memory = shared_memory or SharedMemoryRegistry(False)
        self.arena = arena
        self.handles = ModelHandles()
        self.outputs = OutputRegion(arena, layout, metrics)
        self.intake = Intake(arena, self.handles, self.shared_memory)
        self.fronts = FrontEnds(layout, arena.address, self.handles,
                                self.outputs.drop_references, self.outputs.show_in_use,
                                self.intake.disconnected)
        self.loop_hold = LoopHold()
        # What the models answer through (passed to their repository at construction).
        self.answers = BatchAnswers(self.outputs, self.fronts, self.shared_memory,
                                    self.loop_hold.inline)
        self._calls = ControlCalls(self.shared_memory.handlers())

    def serve(self, repository: ModelRepository, control: ControlPlane) -> None:
        """The repository whose models front ends are told of, and the plane that answers
        their control calls."""
        self.handles.repository = repository
        self._calls = ControlCalls(control.handlers(), self.shared_memory.handlers())

    def on_state_change(self, name: str, _state: str) -> None:
        if self.handles.repository is not None:
            self.fronts.on_state_change(name)

    def accept(self, link: wire.FrontendLink) -> _Connection:
        """A front end connected: what handles its frames (``wire.serve_frontends``)."""
        return _Connection(self, self.fronts.accept(link))

    def frame(self, front: FrontEnd, frame: wire_pb2.ToExecutor) -> None:
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
        intake = self.intake
        for field, value in fields:
            number = field.number
            if number == _GROUPS:
                for group in value[:]:
                    intake.group(front, group)
            elif number == _INFER:
                if len(value) == 1:
                    intake.infer(front, value[0])
                else:
                    for infer in value[:]:  # a slice first: iterating upb's container is slower
                        intake.infer(front, infer)
            elif number == _HELLO:
                self.fronts.hello(front, value)
            elif number == _CANCEL:
                for rid in value[:]:
                    intake.cancel(front, rid)
            elif number == _FREE:
                self.outputs.free(front, value[:])
            elif number == _CALL:
                for call in value[:]:
                    self._calls.start(front, call)

    def read(self) -> None:
        """The frames of one read are in: their requests join their models' queues."""
        self.intake.queue()
