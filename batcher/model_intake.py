"""A served model's intake: requests submitted alone or as a frame's group, admitted against
the latency profile, queued, expired at their deadlines, cancelled when their callers go.

``ServedModel`` (``batcher/model.py``) takes these methods from ``ModelIntake``; they run on
the event loop and read its queue, admission and accounting.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from batchgate.batcher.errors import (
    AdmissionRefused,
    BatchgateError,
    DeadlineExceeded,
    DeadlineInfeasible,
    InvalidRequest,
    ModelUnavailable,
    QueueFull,
    RequestCancelled,
)
from batchgate.batcher.request import InferenceRequest

log = structlog.get_logger(__name__)


class ModelIntake:
    """The intake half of ``ServedModel``."""

    def submit(self, request: InferenceRequest, *, publish_depth: bool = True) -> None:
        """Queue ``request``; its answer goes to the model's delivery (on the running loop).

        Refusals (unavailable, bad priority, queue full, admission control) raise at once. A
        caller that gives up on the request calls ``cancel(request)`` (``infer`` does).
        ``publish_depth`` False: the queue-depth gauge is left for the caller's
        ``publish_depth`` after the run of requests it submits in one go.
        """
        if not self._accepting:
            raise ModelUnavailable(self._not_serving())
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        self._resolve(request)
        if self._admission is not None and request.deadline is not None:
            self._admit(request)
        try:
            self._queue.put(request, publish_depth)
        except QueueFull:
            self._count_failure("rejected", [request])
            raise
        self._queued(request, loop)

    def submit_group(self, requests: list[InferenceRequest]
                     ) -> list[tuple[int, BatchgateError]]:
        """``submit(request, publish_depth=False)`` for each of ``requests``, in order (the
        executor process's requests of one read): the ones refused, as (index, error); the
        others are queued. Admission control's quick bound is asked once for them all, and the
        queue's lock taken once; where the bound cannot tell, each is submitted in turn, seeing
        the ones before it queued."""
        if len(requests) > 1 and self._accepting:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            refused: list[tuple[int, BatchgateError]] = []
            resolved: list[int] = []  # indexes of the requests whose level and deadline are set
            for index, request in enumerate(requests):
                try:
                    self._resolve(request)
                except BatchgateError as exc:
                    refused.append((index, exc))
                    continue
                resolved.append(index)
            chosen = [requests[i] for i in resolved]
            if chosen and self._surely_admitted(chosen):
                turned_away = self._queue.put_all(chosen)
                full = [chosen[i] for i, error in turned_away if isinstance(error, QueueFull)]
                if full:
                    self._count_failure("rejected", full)
                away = {i for i, _ in turned_away}
                for i, request in enumerate(chosen):
                    if i not in away:
                        self._queued(request, self._loop)
                refused.extend((resolved[i], error) for i, error in turned_away)
                return refused
            requests = chosen  # the bound cannot tell: each in turn, as below
        else:
            refused, resolved = [], list(range(len(requests)))
        for index, request in zip(resolved, requests):
            try:
                self.submit(request, publish_depth=False)
            except BatchgateError as exc:
                refused.append((index, exc))
        return refused

    def _not_serving(self) -> str:
        return f"model '{self._spec.name}' is not serving; retry later"

    def _resolve(self, request: InferenceRequest) -> None:
        """The request's priority level and its deadline (its own, or its timeout's under the
        level's queue policy); raises InvalidRequest for a priority out of range."""
        level = request.priority or self._default_level
        if not 0 < level <= self._levels:
            raise InvalidRequest(
                f"priority must lie in 1..{self._levels} for model '{self._spec.name}' "
                f"(0 = default), got {request.priority}"
            )
        request.level = level
        timeout_us, may_override, delays = self._policies[level]
        if request.timeout_us and (may_override or not timeout_us):
            timeout_us = request.timeout_us
        deadline = request.deadline
        if timeout_us and not delays:
            by_timeout = request.arrival + timeout_us / 1e6
            deadline = by_timeout if deadline is None else min(deadline, by_timeout)
        request.deadline = deadline  # the queue's deadline policy reads it

    def _surely_admitted(self, requests: list[InferenceRequest]) -> bool:
        """True when admission control would admit every one of ``requests`` queued one after
        another: its quick bound holds for them all at once (their samples all queued ahead of
        each, the earliest deadline for each), or none has a deadline to check."""
        if self._admission is None:
            return True
        deadline = min([r.deadline for r in requests if r.deadline is not None], default=None)
        if deadline is None:
            return True
        queue = self._queue
        return self._admission.surely_in_time(
            batch_size=sum([r.batch_size for r in requests]), deadline=deadline,
            now=time.monotonic(),
            samples_queued=queue.samples_ahead(max([r.level for r in requests])),
            batches_in_flight=self._accounting.inflight_count())

    def _queued(self, request: InferenceRequest, loop: asyncio.AbstractEventLoop) -> None:
        """What follows a request's joining the queue: fifo admission's arrivals, its inputs'
        staging, and its deadline's watch."""
        if self._admission is not None:
            self._admission.queued(request.batch_size, request.arrival)
        if self._stager is not None:
            self._stager.put(request)
        if request.deadline is not None:
            self._expiry.watch(request, loop)

    def publish_depth(self) -> None:
        """The queue-depth gauge gets the queue's depth (after ``submit(publish_depth=False)``)."""
        self._queue.publish_depth()

    def _admit(self, request: InferenceRequest) -> None:
        """Admission control (``batcher/admission.py``): raise, counted, if it cannot be in time."""
        now = time.monotonic()
        admission, queue = self._admission, self._queue
        if admission.surely_in_time(batch_size=request.batch_size, deadline=request.deadline,
                                    now=now, samples_queued=queue.samples_ahead(request.level),
                                    batches_in_flight=self._accounting.inflight_count()):
            return
        in_flight_s, in_flight_var = self._accounting.inflight_work_s(now)
        try:
            admission.check(batch_size=request.batch_size, deadline=request.deadline, now=now,
                            samples_ahead=queue.samples_ahead(request.level, request),
                            in_flight_s=in_flight_s, in_flight_var=in_flight_var)
        except AdmissionRefused:
            self._count_failure("rejected", [request])
            raise
        except DeadlineInfeasible:
            self._count_failure("infeasible", [request])
            raise

    def _expire(self, request: InferenceRequest) -> None:
        # A running batch still finishes; its answer is dropped.
        if self._queue.remove(request):
            self._removed(request)
        if not request.answered:
            request.answered = True
            self._count_failure("expired", [request])
            self._delivery.failed([request], DeadlineExceeded(
                f"request expired after waiting "
                f"{(time.monotonic() - request.arrival) * 1e3:.1f} ms "
                f"for model '{self._spec.name}'"))

    def cancel(self, request: InferenceRequest) -> None:
        """Answer a request CANCELLED on its caller's behalf (stream cancellation, a front end
        that went away): a queued one leaves the queue; a running one's answer is dropped."""
        if self._queue.remove(request):
            self._removed(request)
        if not request.answered:
            request.answered = True
            self._count_failure("cancelled", [request])
            self._delivery.failed([request], RequestCancelled("the request was cancelled"))

    def _removed(self, request: InferenceRequest) -> None:
        """``request`` left the queue without running: its staged inputs go back."""
        if self._stager is not None:
            self._stager.drop(request)
