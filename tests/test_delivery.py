"""The batcher's declared interfaces with its host: answers go through the ``Delivery`` passed to
``ServedModel`` at construction (``batcher/delivery.py``), a batch's in one call; the executor
process's control calls are answered by their request message's type (``server/executor/
calls.py``), every Call the wire can carry has an answer, and every answer a Reply field."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from batchgate.server.ipc.arena import ArenaLayout, SharedArena
from batchgate.batcher.delivery import Delivery, FutureDelivery
from batchgate.batcher.errors import RequestCancelled
from batchgate.batcher.metrics import BatcherMetrics
from batchgate.batcher.model import ServedModel
from batchgate.protos import inference_pb2 as pb
from batchgate.protos import wire_pb2
from batchgate.server.executor.control import ControlPlane
from batchgate.server.executor.calls import ControlCalls
from batchgate.server.executor.fronts import FrontEnd
from batchgate.server.executor.server import ExecutorServer
from batchgate.server.executor.shared_memory import SharedMemoryRegistry
from batchgate.server.rules.status import Code
from tests.support.batching import RecordingModel, make_spec, request
from tests.support.polling import apoll


class _Recorder:
    """A host's delivery that records every call."""

    def __init__(self, per_request_views: bool) -> None:
        self.per_request_views = per_request_views
        self.results_calls: list[tuple[list, list[int], list[np.ndarray], list | None]] = []
        self.failed_calls: list[tuple[list, BaseException]] = []

    def results(self, requests, first_rows, outputs, per_request) -> None:
        self.results_calls.append((list(requests), list(first_rows), outputs,
                                   None if per_request is None else list(per_request)))

    def failed(self, requests, error) -> None:
        self.failed_calls.append((list(requests), error))

    def inline(self, delivery) -> bool:
        return False


def test_both_deliveries_have_the_declared_interface():
    arena = SharedArena.create(1 << 20)
    try:
        answers = ExecutorServer(arena, ArenaLayout(1 << 20, 1)).answers
        for delivery in (answers, FutureDelivery(), _Recorder(False)):
            assert isinstance(delivery, Delivery)
        assert answers.per_request_views is False  # the executor reads the whole outputs
    finally:
        arena.close()


@pytest.mark.parametrize("views", [False, True], ids=["whole-outputs", "per-request-views"])
async def test_a_batchs_answers_go_to_the_delivery_passed_at_construction_in_one_call(views):
    """Three requests of 1, 2 and 1 rows in one batch: one ``results`` call with all three, the
    first row of each in the batch's outputs, and per-request views only when asked for; a
    request cancelled while queued goes to ``failed`` alone and never runs."""
    recorder = _Recorder(views)
    fake = RecordingModel()
    model = ServedModel(make_spec(max_inflight_batches=1), fake,
                        metrics=BatcherMetrics(CollectorRegistry()), delivery=recorder)
    model.start()
    try:
        with pytest.raises(TypeError, match="submit instead"):
            await model.infer(request(0.0))  # no future would ever be resolved
        fake.gate = threading.Event()
        model.submit(blocker := request(-1.0))
        await asyncio.get_running_loop().run_in_executor(None, fake.entered.wait, 10)
        batch = [request(1.0), request(2.0, rows=2), request(3.0)]
        cancelled = request(9.0)
        for r in (*batch[:2], cancelled, batch[2]):
            model.submit(r)
        model.cancel(cancelled)
        (failed, error), = recorder.failed_calls
        assert failed == [cancelled] and isinstance(error, RequestCancelled)
        fake.gate.set()
        await apoll(lambda: len(recorder.results_calls) == 2)
        assert recorder.results_calls[0][0] == [blocker]
        requests, first_rows, outputs, per_request = recorder.results_calls[1]
        assert requests == batch and first_rows == [0, 1, 3]
        (y,) = outputs
        assert y[:, 0].tolist() == [2.0, 4.0, 4.0, 6.0]  # y = 2x, the whole batch's rows
        if views:
            assert [v["y"][:, 0].tolist() for v in per_request] == [[2.0], [4.0, 4.0], [6.0]]
        else:
            assert per_request is None
        assert fake.batches[1] == [1.0, 2.0, 2.0, 3.0]  # the cancelled one never ran
        assert all(r.answered for r in (*batch, cancelled))
        assert len(recorder.failed_calls) == 1
    finally:
        fake.gate.set()
        model.stop(drain_timeout_s=5)


class _FrameSink:
    def __init__(self) -> None:
        self.out = wire_pb2.ToFrontend()

    def room(self, nbytes: int) -> wire_pb2.ToFrontend:
        return self.out


def _request_types(message) -> set[type]:
    """The message types of ``message``'s ``method``/``outcome`` oneof's fields."""
    (oneof,) = message.DESCRIPTOR.oneofs
    return {field.message_type._concrete_class for field in oneof.fields}


def test_every_call_the_wire_carries_has_an_answer_and_every_answer_a_reply_field():
    """The tables ``ControlCalls`` dispatches on cover wire.Call's methods exactly: a method
    added to the wire without an answer, or an answer without its Reply field, fails here."""
    plane = ControlPlane(repository=None)
    registry = SharedMemoryRegistry(False)
    handlers = {**plane.handlers(), **registry.handlers()}
    assert set(handlers) == _request_types(wire_pb2.Call)
    reply_types = _request_types(wire_pb2.Reply) - {wire_pb2.Status}
    for request_type, handler in handlers.items():
        response_type = getattr(pb, request_type.__name__.replace("Request", "Response"))
        assert response_type in reply_types, request_type.__name__
        assert handler.__self__ in (plane, registry)


async def test_a_call_is_answered_by_its_message_type_in_the_reply_field_of_its_answer():
    registry = SharedMemoryRegistry(True)
    calls = ControlCalls(registry.handlers())
    front = FrontEnd(_FrameSink())
    calls.start(front, wire_pb2.Call(cid=7, system_status=pb.SystemSharedMemoryStatusRequest()))
    # A plane this process does not have answers nothing: the call is refused, not dropped.
    calls.start(front, wire_pb2.Call(cid=8, index=pb.RepositoryIndexRequest()))
    calls.start(front, wire_pb2.Call(cid=9))  # no method at all
    await apoll(lambda: len(front.link.out.replies) == 3)
    registry.close()
    replies = {reply.cid: reply for reply in front.link.out.replies}
    assert replies[7].WhichOneof("outcome") == "system_status"
    assert replies[7].system_status == pb.SystemSharedMemoryStatusResponse()
    for cid in (8, 9):
        assert replies[cid].WhichOneof("outcome") == "error"
        assert replies[cid].error.code == Code.UNIMPLEMENTED
