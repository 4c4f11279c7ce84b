"""ModelQueue: one model's pending requests, and the policy that turns them into batches.

The queue is shared by two sides. The event loop puts requests in and takes them out again when
their caller goes away or their deadline passes; executor threads take batches. One lock guards
it, and every critical section is a handful of deque operations, so neither side waits long.

Requests are ordered by priority level (1 = highest), FIFO within a level. A removed request
stays in its deque, marked, until it reaches the head (removing from the middle of a deque is
O(n)); live counts are kept separately, so limits and policy decisions never count the dead.

Batch formation (``next_batch``), for the requests sharing the head request's non-batch shapes:

- ``full``: they fill ``max_batch_size``;
- ``idle``: no queue delay is configured, so an idle executor takes what is there at once;
- ``preferred``: at least ``min_batch_size`` samples wait (MIN_BATCH; by default the largest
  preferred batch size, else ``max_batch_size``);
- ``delay``: the oldest queued request has waited ``max_queue_delay_us``.

The batch then takes up to the largest preferred size not above what is queued when dispatching
for ``preferred``, and up to ``max_batch_size`` otherwise.

An executor that still has a batch running asks with ``busy`` true: it then gets only a *full*
batch (worth assembling early, so it is ready the moment the running one ends) and otherwise
waits until its running batch finishes (``wake``) and takes everything queued by then. Forming
a partial batch early would freeze it small while later arrivals wait a whole batch time. Under
the deadline policy a busy executor takes nothing, full or not: a batch taken early fixes who
is in it a whole batch time before it runs, and a request with a tight deadline arriving
meanwhile would wait behind two batches instead of overtaking into the next (measured through
the server, deadlines of 100 and 300 ms mixed, bursty at 0.4 x capacity: 31 % of the 100 ms
requests expired in the queue).

The ``deadline`` policy (opt-in per model) keeps those rules and changes three things, using the
model's latency profile (``batcher/profile.py``):

- order: earliest deadline first within a priority level (a sorted list per level). A request's
  scheduling deadline is the earlier of its own deadline and its arrival plus the model's
  ``slo_ms``; requests with neither come last, in arrival order;
- size: for each batch size the profile knows (its buckets or size classes), the batch is the
  earliest-deadline requests that its p99 completion time meets, and the size chosen is the
  one after which the most requests meet their deadlines, counting those that back-to-back
  full batches after it would serve (``_best_batch``): the largest batch that meets its
  earliest deadline, unless serving a tight head would cost more requests behind it than it
  saves;
- drops: a request whose hard deadline (its own, not the SLO) even the profile's optimistic
  time for it alone cannot meet is taken out before it uses the device, and handed to
  ``on_infeasible``.

With a queue delay, a deadline-policy batch waits for MIN_BATCH no longer than its earliest
deadline allows: it is dispatched (reason ``deadline``) once waiting longer would make the
MIN_BATCH-sized batch finish late.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
import operator
import threading
import time
from collections.abc import Callable, Iterator

from batcher.errors import ModelUnavailable, QueueFull
from batcher.profile import LatencyProfile
from batcher.request import QUEUED, REMOVED, TAKEN, InferenceRequest
from batcher.spec import BatchingConfig


def scheduling_deadline(request: InferenceRequest, slo_s: float | None) -> float:
    """The earlier of the request's deadline and its arrival + the SLO; inf when neither is set."""
    deadline = math.inf if request.deadline is None else request.deadline
    if slo_s is not None:
        deadline = min(deadline, request.arrival + slo_s)
    return deadline


class _DeadlineLevel:
    """One priority level under the deadline policy: its live requests, earliest deadline first.

    It offers what ``ModelQueue`` uses of a deque (``append``, ``[0]``, ``popleft``, iteration
    in order, ``clear``, ``compact``), so the FIFO code paths serve both. It is one list kept
    sorted by (scheduling deadline, arrival sequence), holding only live requests: a request
    taken or removed leaves it at once (``discard``), so there is nothing dead to skip or
    compact. Reading it in order costs nothing beyond the entries read (a heap had to be
    sorted whole for every batch: at 0.9 x capacity with 256-sample batches that sort was most
    of a decision's time), and admission control can ask how many queued requests run before
    a new one (``due_before``) with a bisect: under EDF that is not the whole level. Inserting
    and removing move the list's tail (a memmove), cheap at queue lengths a server keeps.
    """

    __slots__ = ("_live", "_seq", "_seqs", "_slo_s")

    def __init__(self, slo_s: float | None) -> None:
        self._live: list[tuple[float, int, InferenceRequest]] = []  # (deadline, seq, request)
        self._seqs: dict[int, int] = {}  # id(request) -> its arrival sequence
        self._seq = itertools.count()
        self._slo_s = slo_s

    def key(self, request: InferenceRequest) -> float:
        return scheduling_deadline(request, self._slo_s)

    def append(self, request: InferenceRequest) -> None:
        seq = next(self._seq)
        self._seqs[id(request)] = seq
        # (deadline, sequence) pairs are unique: requests themselves are never compared.
        bisect.insort(self._live, (self.key(request), seq, request))

    def discard(self, request: InferenceRequest) -> None:
        """``request`` left the queue (taken or removed): it no longer runs before anyone."""
        seq = self._seqs.pop(id(request), None)
        if seq is None:
            return
        index = bisect.bisect_left(self._live, (self.key(request), seq))
        if index < len(self._live) and self._live[index][1] == seq:
            del self._live[index]

    def discard_many(self, requests: list[InferenceRequest]) -> None:
        """``discard`` for a whole batch at once. A batch is mostly the front of the level
        (earliest deadlines first): then one slice goes; otherwise one pass keeps the rest."""
        seqs = self._seqs
        gone = {seqs.pop(id(r)) for r in requests if id(r) in seqs}
        if not gone:
            return
        live = self._live
        count = len(gone)
        if all(entry[1] in gone for entry in live[:count]):
            del live[:count]
        else:
            self._live = [entry for entry in live if entry[1] not in gone]

    def entries(self) -> list[tuple[float, int, InferenceRequest]]:
        """The live (scheduling deadline, arrival sequence, request) entries, in order: the
        list itself, to be read and not changed."""
        return self._live

    def due_before(self, key: float) -> int:
        """Live requests whose scheduling deadline is not later than ``key``."""
        return bisect.bisect_right(self._live, (key, math.inf))

    def __len__(self) -> int:
        return len(self._live)

    def __getitem__(self, index: int) -> InferenceRequest:
        if index != 0:
            raise IndexError("only the head of a deadline-ordered level can be read")
        return self._live[0][2]

    def popleft(self) -> InferenceRequest:
        request = self._live.pop(0)[2]
        self._seqs.pop(id(request), None)
        return request

    def __iter__(self) -> Iterator[InferenceRequest]:
        # Over a copy: a reader may take or remove requests as it goes.
        return map(operator.itemgetter(2), self._live.copy())

    def clear(self) -> None:
        self._live.clear()
        self._seqs.clear()

    def compact(self, live: int) -> None:
        """Nothing to do: removed requests leave the level at once."""


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
        self._slo_s = config.slo_s
        self._profile = profile
        self._on_infeasible = on_infeasible
        self._levels = [
            _DeadlineLevel(self._slo_s) if self._deadline_policy else collections.deque()
            for _ in range(config.levels)
        ]
        self._level_counts = [0] * config.levels
        self._level_samples = [0] * config.levels
        self._limits = [config.queue_policy(level + 1).max_queue_size for level in range(config.levels)]
        self._samples_by_shape: dict[tuple, int] = collections.Counter()
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

    # -- the event loop's side ------------------------------------------------------------

    def put(self, request: InferenceRequest) -> None:
        """Queue ``request`` at its level; raises QueueFull or ModelUnavailable at once."""
        index = request.level - 1
        with self._cond:
            if self._closed:
                raise ModelUnavailable("the model is shutting down and takes no new requests")
            limit = self._limits[index]
            if limit and self._level_counts[index] >= limit:
                raise QueueFull(
                    f"the queue of priority level {request.level} is full "
                    f"(max_queue_size {limit}); retry later"
                )
            request.state = QUEUED
            request.enqueued = self._clock()
            self._levels[index].append(request)
            self._level_counts[index] += 1
            self._level_samples[index] += request.batch_size
            waiting = self._samples_by_shape[request.shape_key] + request.batch_size
            self._samples_by_shape[request.shape_key] = waiting
            self._live += 1
            depth = self._live
            if self._eager_waiters or waiting >= self._max_batch:
                self._cond.notify_all()
        if self._on_depth_change is not None:
            self._on_depth_change(depth)

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
                waiting = self._samples_by_shape[head.shape_key]
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
                        latest = self._latest_start(head)
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

    def _forget_taken(self, batch: list[InferenceRequest]) -> None:
        """``_forget(request, TAKEN)`` for every request of a deadline-policy batch, each
        level's list updated once (``_DeadlineLevel.discard_many``)."""
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
        batch: list[InferenceRequest] = []
        room = limit
        for level in self._levels:
            for request in level:
                if request.state != QUEUED or request.shape_key != shape_key:
                    continue
                if request.batch_size > room:
                    # Stay FIFO: a later, smaller request does not overtake this one.
                    room = 0
                    break
                batch.append(request)
                room -= request.batch_size
                if room == 0:
                    break
            if room == 0:
                break
        for request in batch:
            self._forget(request, TAKEN)
        # Taken requests at the heads go now; the rest are skipped when they reach a head.
        for level in self._levels:
            while level and level[0].state != QUEUED:
                level.popleft()
        return batch

    # -- the deadline policy (lock held) ---------------------------------------------------------

    def _infeasible(self, request: InferenceRequest, now: float,
                    alone: dict[int, float] | None = None) -> bool:
        """True when even alone, and quick, the request would be done (and answered) after its
        hard deadline. ``alone`` keeps that earliest time per batch size within one decision."""
        if request.deadline is None or self._profile is None:
            return False
        done = alone.get(request.batch_size) if alone is not None else None
        if done is None:
            quick = self._profile.optimistic(request.batch_size)
            done = -math.inf if quick is None else now + quick + self._margin()
            if alone is not None:
                alone[request.batch_size] = done
        return done > request.deadline

    def _feasible_head(self, now: float) -> InferenceRequest | None:
        """The head, after dropping heads that cannot meet their deadline."""
        dropped: list[InferenceRequest] = []
        while (head := self._head()) is not None and self._infeasible(head, now):
            self._forget(head, REMOVED)
            dropped.append(head)
        if dropped:
            self._drop(dropped)
        return head

    def _latest_start(self, head: InferenceRequest) -> float:
        """When a MIN_BATCH-sized batch must start for the head to meet its deadline."""
        deadline = scheduling_deadline(head, self._slo_s)
        batch_s = self._profile.p99(self._min_batch) if self._profile is not None else None
        if batch_s is None or math.isinf(deadline):
            return math.inf
        return deadline - batch_s - self._margin()

    def _gather_by_deadline(self, head: InferenceRequest, limit: int, now: float
                            ) -> list[InferenceRequest]:
        """The batch that lets the most requests meet their deadlines (see ``_best_batch``)."""
        candidates, dropped = self._candidates(head.shape_key, 2 * limit, now)
        batch = self._best_batch(candidates, limit, now) or [head]
        self._forget_taken(batch)
        for index, level in enumerate(self._levels):
            while level and level[0].state != QUEUED:
                level.popleft()
            level.compact(self._level_counts[index])
        if dropped:
            self._drop(dropped)
        return batch

    def _candidates(self, shape_key: tuple, samples: int, now: float
                    ) -> tuple[list[tuple[float, InferenceRequest]], list[InferenceRequest]]:
        """Up to ``samples`` samples of requests that could share the head's batch, levels in
        order, earliest deadline first, as (scheduling deadline, request); and the infeasible
        ones met on the way, taken out of the queue."""
        candidates: list[tuple[float, InferenceRequest]] = []
        dropped: list[InferenceRequest] = []
        margin = self._margin()
        alone: dict[int, float] = {}  # batch size -> the earliest a request of it can be done
        one_shape = len(self._samples_by_shape) == 1  # then every request shares the head's
        for level in self._levels:
            # The level's own entries, read in order (it holds only live requests, each with
            # its scheduling deadline): no copy, no state checks. Drops wait for the end.
            for key, _, request in level.entries():
                if not one_shape and request.shape_key != shape_key:
                    continue
                if request.deadline is not None and self._infeasible(request, now, alone):
                    dropped.append(request)
                    continue
                candidates.append((key - margin, request))
                samples -= request.batch_size
                if samples <= 0:
                    break
            if samples <= 0:
                break
        for request in dropped:
            self._forget(request, REMOVED)
        return candidates, dropped

    def _best_batch(self, candidates: list[tuple[float, InferenceRequest]], limit: int,
                    now: float) -> list[InferenceRequest]:
        """Of the batches one per profile size up to ``limit``, the one after which the most
        requests meet their deadline: those in it plus those that back-to-back full batches
        after it would serve.

        The batch of size m holds the earliest-deadline candidates that its p99 completion
        time meets; what room is left takes those it would make late but that a quick run
        (the profile's optimistic time) still serves, and those that only missed their SLO.
        A request certain to be late stays queued (a smaller batch may yet serve it, or it is
        dropped as infeasible): no device time for nothing.

        Without the look at the batches after it, a tight head would keep every batch small
        under load and throughput would collapse exactly when it is needed; with it, a small
        batch wins only when it serves the head without losing more behind. The look goes
        past the next batch: judged over two batches, a full batch of loose requests (which
        would make it later anyway) beat a smaller one that also served a tight head, which
        was then lost. Simulated (``bench/deadline_sim.py``, seeds 1-3): with 100/300 ms
        mixed at 0.4 x capacity, 97.4 % on time judged over two batches, 98.3 % over all the
        candidates; 50/200/800 ms at 0.3 x, 89.8 % and 90.8 %; one deadline of 150 ms at 0.45
        and 0.6 x, within 0.2 points. Ties go to the batch that takes more samples now.
        """
        if not candidates:
            return []
        keys = [key for key, _ in candidates]
        margin = self._margin()
        if all(a <= b for a, b in itertools.pairwise(keys)):
            size = self._best_size_sorted(candidates, keys, limit, now)
            return _compose(candidates, size, now + self._p99(size),
                            now + self._optimistic(size) + margin)[0]
        return self._best_batch_composed(candidates, limit, now)

    def _sizes(self, candidates: list[tuple[float, InferenceRequest]], limit: int) -> list[int]:
        """The batch sizes to weigh: the profile's up to ``limit``, but none beyond the first
        that holds every candidate (it would only finish later)."""
        total = sum(r.batch_size for _, r in candidates)
        buckets = sorted({min(b, limit) for b in self._profile_buckets()} | {limit})
        whole = min(total, limit)
        return [b for b in buckets if b < whole] + [next(b for b in buckets if b >= whole)]

    def _best_batch_composed(self, candidates: list[tuple[float, InferenceRequest]],
                             limit: int, now: float) -> list[InferenceRequest]:
        """``_best_batch`` for candidates in any order: every batch composed and weighed."""
        margin = self._margin()
        best: tuple[tuple[int, int], list[InferenceRequest]] | None = None
        for size in self._sizes(candidates, limit):
            finish = now + self._p99(size)
            batch, on_time = _compose(candidates, size, finish,
                                      now + self._optimistic(size) + margin)
            taken = {id(r) for r in batch}
            rest = [(key, r) for key, r in candidates if id(r) not in taken]
            rank = (on_time + self._served_after(rest, limit, finish),
                    sum(r.batch_size for r in batch))
            if best is None or rank > best[0]:
                best = (rank, batch)
        return best[1]

    def _best_size_sorted(self, candidates: list[tuple[float, InferenceRequest]],
                          keys: list[float], limit: int, now: float) -> int:
        """``_best_batch``'s choice when the candidates' deadlines are in order (one priority
        level, the common case), found by bisecting instead of composing every batch: those
        a batch of m makes late are a prefix, it serves the next ones that fit, and so on for
        the batches after it. Only the late prefix is walked (for the spare room), and it is
        short: its requests are about to be dropped."""
        count = len(keys)
        cum = list(itertools.accumulate((r.batch_size for _, r in candidates), initial=0))
        margin = self._margin()
        best: tuple[tuple[int, int], int] | None = None
        for size in self._sizes(candidates, limit):
            finish = now + self._p99(size)
            late = bisect.bisect_left(keys, finish)
            end = late if late == count else max(
                late + 1, bisect.bisect_right(cum, cum[late] + size, late) - 1)
            taken = cum[end] - cum[late]
            hopeful = now + self._optimistic(size) + margin
            for _, request in candidates[:late]:  # spare room: as ``_compose`` fills it
                if request.batch_size <= size - taken and (
                        request.deadline is None or request.deadline >= hopeful):
                    taken += request.batch_size
            rank = (end - late + self._served_after_sorted(keys, cum, end, limit, finish), taken)
            if best is None or rank > best[0]:
                best = (rank, size)
        return best[1]

    def _served_after(self, rest: list[tuple[float, InferenceRequest]], limit: int,
                      start: float) -> int:
        """How many of ``rest`` (in deadline order) meet their deadlines in back-to-back full
        batches from ``start``, each finishing at its p99 time. Those already late take no
        part: they are dropped before they run."""
        on_time = 0
        while rest:
            rest = [(key, r) for key, r in rest if key >= start]
            size = min(limit, sum(r.batch_size for _, r in rest))
            if not size:
                break
            start += self._p99(size)
            batch, served = _compose(rest, size, start, math.inf)
            if not batch:
                break
            on_time += served
            taken = {id(r) for r in batch}
            rest = [(key, r) for key, r in rest if id(r) not in taken]
        return on_time

    def _served_after_sorted(self, keys: list[float], cum: list[int], first: int, limit: int,
                             start: float) -> int:
        """``_served_after`` for the candidates from ``first`` on, when ``keys`` (their
        deadlines) are in order and ``cum`` holds the running sum of their samples."""
        on_time = 0
        count = len(keys)
        while first < count:
            size = min(limit, cum[count] - cum[first])
            start += self._p99(size)
            first = max(first, bisect.bisect_left(keys, start, first))
            if first >= count:
                break
            end = max(first + 1, bisect.bisect_right(cum, cum[first] + size, first) - 1)
            on_time += end - first
            first = end
        return on_time

    def _margin(self) -> float:
        """Seconds kept free before every deadline for the answer to reach its client."""
        return self._profile.margin() if self._profile is not None else 0.0

    def _p99(self, samples: int) -> float:
        """The profile's p99 seconds for ``samples`` (0 when unknown: decide as if free)."""
        if self._profile is None or samples < 1:
            return 0.0
        return self._profile.p99(samples) or 0.0

    def _optimistic(self, samples: int) -> float:
        if self._profile is None or samples < 1:
            return 0.0
        return self._profile.optimistic(samples) or 0.0

    def _profile_buckets(self) -> tuple[int, ...]:
        return self._profile.buckets if self._profile is not None else ()

    def _drop(self, requests: list[InferenceRequest]) -> None:
        if self._on_infeasible is not None:
            self._on_infeasible(requests)
        self._cond.notify_all()
        if self._on_depth_change is not None:
            self._on_depth_change(self._live)


def _compose(candidates: list[tuple[float, InferenceRequest]], size: int, finish: float,
             hopeful: float) -> tuple[list[InferenceRequest], int]:
    """Up to ``size`` samples: first the candidates whose deadline ``finish`` meets (in order),
    then, in the room left, those it misses but that ``hopeful`` (a quick run) still meets or
    that have no hard deadline; and how many are on time by ``finish``."""
    batch: list[InferenceRequest] = []
    room = size
    late: list[InferenceRequest] = []
    for key, request in candidates:
        if request.batch_size > room:
            continue
        if key < finish:
            if request.deadline is None or request.deadline >= hopeful:
                late.append(request)
            continue
        batch.append(request)
        room -= request.batch_size
        if room == 0:
            break
    on_time = len(batch)
    for request in late:
        if request.batch_size <= room:
            batch.append(request)
            room -= request.batch_size
    return batch, on_time
