"""A finished batch's accounting (statistics, metrics, latency profile, memory gauges) runs after
its answers, on the thread that delivers them: on the loop, or on the model's thread when that
thread answers while the loop waits (``Delivery.inline``). Either way it is done before the
loop takes anything else, so a statistics call that follows an answer counts its batch."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest
from prometheus_client import CollectorRegistry

from batchgate.batcher.metrics import BatcherMetrics
from batchgate.batcher.model import ServedModel
from tests.support.batching import RecordingModel, make_spec, request


class _Answers:
    """A delivery (``batcher/delivery.py``) as the executor process's: it notes each batch's
    answers, resolves each request's own ``concurrent.futures.Future``, and answers inline
    (on the model's thread, under ``lock``) when it has a lock."""

    per_request_views = False

    def __init__(self) -> None:
        self.note = lambda what: None
        self.lock: threading.Lock | None = None
        self.inlined: list[int] = []

    def results(self, requests, first_rows, outputs, per_request) -> None:
        self.note("answers")
        for request in requests:
            request.caller.set_result(None)

    def failed(self, requests, error) -> None:
        for request in requests:
            request.caller.set_exception(error)

    def inline(self, delivery) -> bool:
        if self.lock is None:
            return False
        # As the executor process's LoopHold.inline while its loop waits: the delivery runs
        # here, under the lock the loop's thread takes back before it runs anything the
        # answers woke.
        with self.lock:
            self.inlined.append(threading.get_ident())
            delivery()
        return True


@pytest.fixture
def model():
    registry = CollectorRegistry()
    answers = _Answers()
    served = ServedModel(make_spec(), RecordingModel(), metrics=BatcherMetrics(registry),
                         delivery=answers)
    served.start()
    served.registry = registry
    served.answers = answers
    try:
        yield served
    finally:
        served.stop(drain_timeout_s=5)


def _watch(model: ServedModel) -> list[tuple[str, int, int]]:
    """(what, thread, batches counted then) for the answers and for each accounting step, in
    the order they ran."""
    events: list[tuple[str, int, int]] = []

    def note(what: str) -> None:
        events.append((what, threading.get_ident(), model.stats.snapshot().execution_count))

    accounting = model._accounting
    ran, after_batch = accounting.ran, accounting.after_batch

    def recording_ran(*args) -> None:
        note("ran")
        ran(*args)

    def recording_after_batch() -> None:
        note("after_batch")
        after_batch()

    model.answers.note = note
    accounting.ran = recording_ran
    accounting.after_batch = recording_after_batch
    return events


async def _answer(model: ServedModel, value: float) -> None:
    future: concurrent.futures.Future = concurrent.futures.Future()
    submitted = request(value)
    submitted.caller = future
    model.submit(submitted)
    await asyncio.wrap_future(future)


async def test_accounting_runs_on_the_loop_after_the_answers(model):
    events = _watch(model)
    loop_thread = threading.get_ident()
    await _answer(model, 1.0)
    # Counted by the time the answer is seen: nothing else ran on the loop in between.
    assert model.stats.snapshot().execution_count == 1
    assert [what for what, _, _ in events] == ["answers", "ran", "after_batch"]
    assert events[0][2] == 0  # the answers went out before the batch was counted
    assert {thread for _, thread, _ in events} == {loop_thread}  # not the model's thread
    assert model.registry.get_sample_value("batchgate_batch_size_count", {"model": "fake"}) == 1


async def test_accounting_answered_inline_runs_after_the_answers_on_the_models_thread(model):
    events = _watch(model)
    loop_lock = model.answers.lock = threading.Lock()
    await _answer(model, 2.0)
    with loop_lock:  # as the loop's selector does on waking
        assert model.stats.snapshot().execution_count == 1
    assert [what for what, _, _ in events] == ["answers", "ran", "after_batch"]
    assert events[0][2] == 0
    (model_thread,) = model.answers.inlined
    assert model_thread != threading.get_ident()
    assert {thread for _, thread, _ in events} == {model_thread}


async def test_a_failed_batch_still_updates_the_memory_gauges_after_its_error(model):
    events = _watch(model)
    model.module.fail_on = 3.0
    with pytest.raises(Exception, match="raised RuntimeError"):
        await _answer(model, 3.0)
    # No forward to count; the gauges that follow memory are still refreshed, after the error.
    assert [what for what, _, _ in events] == ["after_batch"]
    assert model.stats.snapshot().execution_count == 0
