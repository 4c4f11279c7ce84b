"""ModelQueue: one model's pending requests, and the rules that turn them into batches.

The queue is shared by two sides. The event loop puts requests in and takes them out again when
their caller goes away or their deadline passes; executor threads take batches. One lock guards
it, and every critical section is a handful of deque operations, so neither side waits long.
The queue owns the storage and every change of state; which requests a batch takes is read by
``batcher/queue_policies.py`` (FIFO, or the deadline policy).

Requests are ordered by priority level (1 = highest), FIFO within a level (or earliest deadline
first under the deadline policy). A removed request stays in its deque, marked, until it
reaches the head (removing from the middle of a deque is O(n)); live counts are kept
separately, so limits and policy decisions never count the dead.

Batch formation (``next_batch``), for the requests sharing the head request's non-batch shapes:

- ``full``: they fill ``max_batch_size``;
- ``idle``: no queue delay is configured, so an idle executor takes what is there at once;
- ``preferred``: at least ``min_batch_size`` samples wait (MIN_BATCH; by default the largest
  preferred batch size, else ``max_batch_size``);
- ``delay``: the oldest queued request has waited ``max_queue_delay_us``;
- ``deadline`` (deadline policy only): waiting longer for MIN_BATCH would make the
  MIN_BATCH-sized batch finish after the head's deadline.

The batch then takes up to the largest preferred size not above what is queued when dispatching
for ``preferred``, and up to ``max_batch_size`` otherwise.

An executor that still has a batch running asks with ``busy`` true: it then gets only a *full*
batch (worth assembling early, so it is ready the moment the running one ends) and otherwise
waits until its running batch finishes (``wake``) and takes everything queued by then. Forming
a partial batch early would freeze it small while later arrivals wait a whole batch time. Under
the deadline policy a busy executor takes nothing, full or not: a batch taken early fixes who
is in it a whole batch time before it runs, and a request with a tight deadline arriving
meanwhile would wait behind two batches instead of overtaking into the next.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from batchgate.batcher.errors import ModelUnavailable, QueueFull
from batchgate.batcher.profile import LatencyProfile
from batchgate.batcher.queue_policies import DeadlinePolicy, fifo_batch
from batchgate.batcher.request import QUEUED, REMOVED, TAKEN, InferenceRequest
from batchgate.batcher.spec import BatchingConfig

CLOSED_MESSAGE = "the model is shutting down and takes no new requests"


class ModelQueue:
    def __init__(
        self,
        config: BatchingConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_depth_change: Callable[[int], None] | None = None,
        profile: LatencyProfile | None = None,
        on_infeasible: Callable[[list[InferenceRequest]], None] | None = None,
    ) -> None:
        """``profile`` and ``on_infeasible`` serve the deadline policy; ``on_infeasible`` gets
        the requests dropped as unable to meet their deadline, under the queue's lock: it must
        only hand them on (to the event loop), never call back into the queue."""
        self._config = config
        self._clock = clock
        self._deadline_policy = config.policy == "deadline"
        self._deadline = DeadlinePolicy(profile, config.slo_s)
        self._on_infeasible = on_infeasible
        self._levels = [
            self._deadline.new_level() if self._deadline_policy else collections.deque()
            for _ in range(config.levels)
        ]
        self._level_counts = [0] * config.levels
        self._level_samples = [0] * config.levels
        self._limits = [config.queue_policy(level + 1).max_queue_size for level in range(config.levels)]
        self._samples_by_shape: dict[tuple, int] = {}  # shape key -> samples queued (> 0)
        self._live = 0
        self._closed = False
        self._cond = threading.Condition(threading.Lock())
        self._on_depth_change = on_depth_change
        self._max_batch = config.effective_max_batch
        self._min_batch = config.effective_min_batch
        self._delay_s = config.max_queue_delay_us / 1e6
        # Without dynamic batching (Triton's default scheduler) each request runs alone.
        self._batching = config.max_batch_size > 0 and config.dynamic_batching
        self._preferred = sorted(config.preferred_batch_sizes)
        # Executors waiting that would act on any arrival (not just on a full batch). put()
        # wakes a thread only when one of them exists or a batch just became full.
        self._eager_waiters = 0
        # Whether they have been woken since the last of them began to wait: the puts that come
        # before a woken executor takes the lock back wake nobody again.
        self._eager_woken = False

    # -- the event loop's side ------------------------------------------------------------

    def put(self, request: InferenceRequest, publish_depth: bool = True) -> None:
        """Queue ``request`` at its level; raises QueueFull or ModelUnavailable at once.

        ``publish_depth`` False: the depth callback is not called; the caller that queues a
        run of requests calls ``publish_depth`` once after them instead."""
        with self._cond:
            if self._closed:
                raise ModelUnavailable(CLOSED_MESSAGE)
            full = self._append(request, self._clock())
            depth = self._live
            if full:
                self._cond.notify_all()
            elif self._eager_waiters and not self._eager_woken:
                self._eager_woken = True
                self._cond.notify_all()
        if publish_depth and self._on_depth_change is not None:
            self._on_depth_change(depth)

    def put_all(self, requests: list[InferenceRequest]
                ) -> list[tuple[int, QueueFull | ModelUnavailable]]:
        """``put(request, publish_depth=False)`` for each of ``requests`` in order, under one
        taking of the lock and with one wake-up of the executors: the ones refused, as (index,
        error) (the others are queued)."""
        with self._cond:
            if self._closed:
                error = ModelUnavailable(CLOSED_MESSAGE)
                return [(index, error) for index in range(len(requests))]
            refused: list[tuple[int, QueueFull | ModelUnavailable]] = []
            now = self._clock()
            full = False
            for index, request in enumerate(requests):
                try:
                    full = self._append(request, now) or full
                except QueueFull as exc:
                    refused.append((index, exc))
            if len(refused) == len(requests):
                return refused
            if full:
                self._cond.notify_all()
            elif self._eager_waiters and not self._eager_woken:
                self._eager_woken = True
                self._cond.notify_all()
        return refused

    def _append(self, request: InferenceRequest, now: float) -> bool:
        """Queue ``request`` (under the lock) enqueued at ``now``, or raise QueueFull: True when
        its shape's requests now fill a batch."""
        index = request.level - 1
        limit = self._limits[index]
        if limit and self._level_counts[index] >= limit:
            raise QueueFull(
                f"the queue of priority level {request.level} is full "
                f"(max_queue_size {limit}); retry later"
            )
        request.state = QUEUED
        request.enqueued = now
        self._levels[index].append(request)
        self._level_counts[index] += 1
        self._level_samples[index] += request.batch_size
        waiting = self._samples_by_shape.get(request.shape_key, 0) + request.batch_size
        self._samples_by_shape[request.shape_key] = waiting
        self._live += 1
        return waiting >= self._max_batch

    def publish_depth(self) -> None:
        """Hand the depth callback the queue's depth now (after puts that did not).

        Read without the lock, as every caller reads it outside the lock when it publishes:
        a depth that an executor thread changes meanwhile it publishes itself, after."""
        if self._on_depth_change is not None:
            self._on_depth_change(self._live)

    def remove(self, request: InferenceRequest) -> bool:
        """Take ``request`` out if it is still queued. True if it was."""
        with self._cond:
            if request.state != QUEUED:
                return False
            self._forget(request, REMOVED)
            depth = self._live
            # A waiting executor may now see a different head (or an empty queue).
            self._cond.notify_all()
        if self._on_depth_change is not None:
            self._on_depth_change(depth)
        return True

    def wake(self) -> None:
        """An executor's running batch finished: waiting executors re-evaluate the queue."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        """Refuse new requests; executors drain what is queued, then ``next_batch`` returns None."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def drain_remaining(self) -> list[InferenceRequest]:
        """Remove and return every queued request (used when a drain runs out of time)."""
        with self._cond:
            left = [r for level in self._levels for r in level if r.state == QUEUED]
            for request in left:
                self._forget(request, REMOVED)
            for level in self._levels:
                level.clear()
            self._cond.notify_all()
        if self._on_depth_change is not None:
            self._on_depth_change(0)
        return left

    @property
    def depth(self) -> int:
        return self._live

    def samples_ahead(self, level: int, request: InferenceRequest | None = None) -> int:
        """Samples that run before a new request at priority ``level``: all those queued at
        higher levels, and at its own level all of them (FIFO) or, under the deadline policy
        given the ``request``, those due no later than it (counted at the level's mean samples
        per request). Read without the lock: an estimate."""
        above = sum(self._level_samples[:level - 1])
        own = self._level_samples[level - 1]
        if request is None or not self._deadline_policy or not own:
            return above + own
        same_level = self._levels[level - 1]
        ahead = same_level.due_before(same_level.key(request))
        count = self._level_counts[level - 1]
        return above + (own if ahead >= count else round(own * ahead / max(count, 1)))

    # -- the executors' side ----------------------------------------------------------------

    def next_batch(
        self, busy: Callable[[], bool] | None = None
    ) -> tuple[list[InferenceRequest], str] | None:
        """Block until a batch is due; return it with the reason it was dispatched.

        ``busy()`` says whether the asking executor still has a batch running (see the module
        docstring). Returns None once the queue is closed and empty.
        """
        with self._cond:
            while True:
                now = self._clock()
                head = self._head() if not self._deadline_policy else self._feasible_head(now)
                if head is None:
                    if self._closed:
                        return None
                    self._wait(None, eager=True)
                    continue
                if not self._batching:
                    if busy is not None and busy():
                        self._wait(None, eager=False)
                        continue
                    return self._take_one(head), "idle"
                waiting = self._samples_by_shape.get(head.shape_key, 0)
                if waiting >= self._max_batch and not (self._deadline_policy and busy is not None
                                                       and busy()):
                    reason = "full"
                elif busy is not None and busy():
                    self._wait(None, eager=False)
                    continue
                elif self._delay_s == 0.0 or self._closed:
                    reason = "idle"
                elif waiting >= self._min_batch:
                    reason = "preferred"
                else:
                    due, reason = self._oldest_enqueued() + self._delay_s, "delay"
                    if self._deadline_policy:
                        latest = self._deadline.latest_start(head, self._min_batch)
                        if latest < due:
                            due, reason = latest, "deadline"
                    if now < due:
                        self._wait(due - now, eager=True)
                        continue
                limit = self._max_batch
                if reason == "preferred" and self._preferred:
                    limit = max((p for p in self._preferred if p <= waiting), default=waiting)
                # The head always goes, even when it alone is larger than a preferred size.
                limit = max(limit, head.batch_size)
                if self._deadline_policy:
                    batch = self._gather_by_deadline(head, limit, now)
                else:
                    batch = self._gather(head.shape_key, limit)
                depth = self._live
                break
        if self._on_depth_change is not None:
            self._on_depth_change(depth)
        return batch, reason

    # -- internals (lock held) ---------------------------------------------------------------

    def _wait(self, timeout_s: float | None, *, eager: bool) -> None:
        if eager:
            self._eager_waiters += 1
            self._eager_woken = False
            try:
                self._cond.wait(timeout_s)
            finally:
                self._eager_waiters -= 1
        else:
            self._cond.wait(timeout_s)

    def _forget(self, request: InferenceRequest, state: int) -> None:
        if self._deadline_policy:
            self._levels[request.level - 1].discard(request)
        self._account(request, state)

    def _account(self, request: InferenceRequest, state: int) -> None:
        """``request`` left the queue in ``state``: the live counts no longer hold it."""
        request.state = state
        self._level_counts[request.level - 1] -= 1
        self._level_samples[request.level - 1] -= request.batch_size
        key = request.shape_key
        left = self._samples_by_shape[key] - request.batch_size
        if left:
            self._samples_by_shape[key] = left
        else:
            del self._samples_by_shape[key]
        self._live -= 1

    def _account_taken(self, batch: list[InferenceRequest], shape_key: tuple) -> None:
        """``_account(request, TAKEN)`` for every request of a FIFO batch, all shaped
        ``shape_key``: the shape's count is updated once."""
        counts, samples = self._level_counts, self._level_samples
        taken = 0
        for request in batch:
            request.state = TAKEN
            index = request.level - 1
            counts[index] -= 1
            samples[index] -= request.batch_size
            taken += request.batch_size
        if batch:
            left = self._samples_by_shape[shape_key] - taken
            if left:
                self._samples_by_shape[shape_key] = left
            else:
                del self._samples_by_shape[shape_key]
            self._live -= len(batch)

    def _forget_taken(self, batch: list[InferenceRequest]) -> None:
        """``_forget(request, TAKEN)`` for every request of a deadline-policy batch, each
        level's list updated once (``DeadlineLevel.discard_many``)."""
        for request in batch:
            self._account(request, TAKEN)
        for index in {request.level - 1 for request in batch}:
            self._levels[index].discard_many(batch)

    def _head(self) -> InferenceRequest | None:
        for level in self._levels:
            while level and level[0].state != QUEUED:
                level.popleft()
            if level:
                return level[0]
        return None

    def _oldest_enqueued(self) -> float:
        oldest = float("inf")
        for level in self._levels:
            for request in level:
                if request.state == QUEUED:
                    oldest = min(oldest, request.enqueued)
                    break
        return oldest

    def _take_one(self, request: InferenceRequest) -> list[InferenceRequest]:
        self._levels[request.level - 1].popleft()
        self._forget(request, TAKEN)
        return [request]

    def _gather(self, shape_key: tuple, limit: int) -> list[InferenceRequest]:
        batch = fifo_batch(self._levels, shape_key, limit)
        self._account_taken(batch, shape_key)
        # Taken requests at the heads go now; the rest are skipped when they reach a head.
        for level in self._levels:
            while level and level[0].state != QUEUED:
                level.popleft()
        return batch

    # -- the deadline policy (lock held) ---------------------------------------------------------

    def _feasible_head(self, now: float) -> InferenceRequest | None:
        """The head, after dropping heads that cannot meet their deadline."""
        dropped: list[InferenceRequest] = []
        while (head := self._head()) is not None and self._deadline.infeasible(head, now):
            self._forget(head, REMOVED)
            dropped.append(head)
        if dropped:
            self._drop(dropped)
        return head

    def _gather_by_deadline(self, head: InferenceRequest, limit: int, now: float
                            ) -> list[InferenceRequest]:
        """The batch that lets the most requests meet their deadlines, the infeasible
        candidates met on the way taken out (``DeadlinePolicy``)."""
        candidates, dropped = self._deadline.candidates(
            self._levels, head.shape_key, 2 * limit, now, len(self._samples_by_shape) == 1)
        for request in dropped:
            self._forget(request, REMOVED)
        batch = self._deadline.best_batch(candidates, limit, now) or [head]
        self._forget_taken(batch)
        for index, level in enumerate(self._levels):
            while level and level[0].state != QUEUED:
                level.popleft()
            level.compact(self._level_counts[index])
        if dropped:
            self._drop(dropped)
        return batch

    def _drop(self, requests: list[InferenceRequest]) -> None:
        if self._on_infeasible is not None:
            self._on_infeasible(requests)
        self._cond.notify_all()
        if self._on_depth_change is not None:
            self._on_depth_change(self._live)
