"""A served model's outcomes: a batch's results or failure taken back to the event loop and
delivered to the requests' callers once each, and every request that gets no result counted
under its reason.

``ServedModel`` (``batcher/model.py``) takes these methods from ``ModelOutcomes``; executor
threads post, the event loop delivers.
"""

from __future__ import annotations

import functools
import time

import structlog

from batchgate.batcher.errors import (
    DeadlineInfeasible,
    ModelUnavailable,
)
from batchgate.batcher.batch import Outcome
from batchgate.batcher.request import DONE, InferenceRequest

log = structlog.get_logger(__name__)


class ModelOutcomes:
    """How ``ServedModel`` answers."""

    def _post(self, outcome: Outcome) -> None:
        """On the executor's thread: the outcome to the loop, or delivered here while the loop
        waits for events (``Delivery.inline``)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            outcome.account()
            return
        if not self._queue.depth and self._delivery.inline(
                functools.partial(self._deliver, outcome)):
            return
        try:
            loop.call_soon_threadsafe(self._deliver, outcome)
        except RuntimeError:  # the loop closed meanwhile: nobody is waiting any more
            outcome.account()

    def _deliver(self, outcome: Outcome) -> None:
        """The batch's answers (or its error) to its requests; then its accounting, off the
        answers' path but before the loop takes its next message, so that a statistics call
        after an answer counts its batch (and the model's thread is free for the next one)."""
        try:
            self._answer(outcome)
        finally:
            outcome.account()

    def _answer(self, outcome: Outcome) -> None:
        requests = outcome.batch.requests
        if not outcome.inputs_in_use:
            for request in requests:
                request.state = DONE
                if request.on_release is not None:
                    request.on_release()
            if outcome.release_only:
                return
        delivery = self._delivery
        if outcome.error is not None:
            pending = [r for r in requests if not r.answered]
            self._count_failure("model_error", pending)
            for request in pending:
                request.answered = True
            delivery.failed(pending, outcome.error)
            return
        # Expired or cancelled while the batch ran (answered and counted then) are left out.
        live, first_rows, views = [], [], []
        results = outcome.results
        row = 0
        for index, request in enumerate(requests):
            if not request.answered:
                request.answered = True
                if request.input_error is not None:  # its inputs could not be read: it fails
                    delivery.failed([request], request.input_error)
                else:
                    live.append(request)
                    first_rows.append(row)
                    if results is not None:
                        views.append(results[index])
            row += request.batch_size
        now = time.monotonic()
        if outcome.batch.finished_at is not None:
            self._accounting.delivered(now - outcome.batch.finished_at)
        if live:
            delivery.results(live, first_rows, outcome.outputs,
                             views if results is not None else None)
        self._accounting.answered(live, now)

    def _instance_died(self, reason: str) -> None:
        """An executor stopped for good (executor thread): the model stops serving.

        Queued requests get UNAVAILABLE at once rather than waiting for their deadlines; the
        repository is told, so health reports NOT_SERVING and a load RPC brings the model back.
        """
        with self._failed_lock:
            if self._failed:
                return
            self._failed = True
        self._accepting = False
        self._queue.close()
        error = ModelUnavailable(
            f"model '{self._spec.name}' stopped serving ({reason}); retry after it is loaded again"
        )
        left = self._queue.drain_remaining()
        for request in left:
            self._removed(request)
        self._fail_threadsafe(left, error, "unavailable")
        if self._on_failed is not None:
            self._on_failed(reason)

    def _fail_threadsafe(self, requests: list[InferenceRequest], error: Exception,
                         reason: str) -> None:
        """From a thread: answer ``requests`` with ``error`` on the loop, counted under ``reason``
        (there, so that a request whose deadline fired meanwhile is counted once)."""
        loop = self._loop
        if not requests or loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._fail, requests, error, reason)
        except RuntimeError:
            pass

    def _fail(self, requests: list[InferenceRequest], error: Exception, reason: str) -> None:
        pending = [r for r in requests if not r.answered]
        self._count_failure(reason, pending)
        for request in pending:
            request.answered = True
        if pending:
            self._delivery.failed(pending, error)

    def _infeasible_threadsafe(self, requests: list[InferenceRequest]) -> None:
        """The queue dropped ``requests``: their deadlines cannot be met. Called under the
        queue's lock, so it only hands them on to the loop."""
        error = DeadlineInfeasible(
            f"model '{self._spec.name}' could not have finished this request before its "
            "deadline, so it was dropped before running"
        )
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._drop_infeasible, requests, error)
        except RuntimeError:
            pass

    def _drop_infeasible(self, requests: list[InferenceRequest], error: Exception) -> None:
        for request in requests:
            self._removed(request)
        self._fail(requests, error, "infeasible")

    def _backlog(self) -> bool:
        """Work this model has right now: queued requests, or batches formed and not finished."""
        return self._queue.depth > 0 or self._accounting.has_inflight()

    def _count_failure(self, reason: str, requests: list[InferenceRequest]) -> None:
        self._accounting.failed(reason, requests)
