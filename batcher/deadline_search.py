"""The deadline policy's batch-size search: which batch lets the most requests meet their deadlines.

Given the candidates that could share the head's batch, as (scheduling deadline, request) in
deadline order, and the model's latency profile, ``DeadlineSearch.best_batch`` weighs one batch
per size the profile knows and returns the one after which the most requests meet their
deadlines, counting those that back-to-back full batches after it would serve. It reads no
queue state and changes none: the queue (``batcher/queue.py``) gathers the candidates under its
lock and takes the chosen batch out.
"""

from __future__ import annotations

import bisect
import itertools
import math

from batchgate.batcher.profile import LatencyProfile
from batchgate.batcher.request import InferenceRequest

Candidates = list[tuple[float, InferenceRequest]]


class DeadlineSearch:
    """The search over one model's latency profile (None: every batch is taken as free)."""

    __slots__ = ("_profile",)

    def __init__(self, profile: LatencyProfile | None) -> None:
        self._profile = profile

    def best_batch(self, candidates: Candidates, limit: int, now: float) -> list[InferenceRequest]:
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
        past the next batch: judged over two batches only, a full batch of loose requests
        (which would make it later anyway) beats a smaller one that also serves a tight head,
        which is then lost. Ties go to the batch that takes more samples now.
        """
        if not candidates:
            return []
        keys = [key for key, _ in candidates]
        if all(a <= b for a, b in itertools.pairwise(keys)):
            size = self._best_size_sorted(candidates, keys, limit, now)
            return compose(candidates, size, now + self.p99(size),
                           now + self.optimistic(size) + self.margin())[0]
        return self.best_batch_composed(candidates, limit, now)

    def best_batch_composed(self, candidates: Candidates, limit: int,
                            now: float) -> list[InferenceRequest]:
        """``best_batch`` for candidates in any order: every batch composed and weighed."""
        margin = self.margin()
        best: tuple[tuple[int, int], list[InferenceRequest]] | None = None
        for size in self._sizes(candidates, limit):
            finish = now + self.p99(size)
            batch, on_time = compose(candidates, size, finish,
                                     now + self.optimistic(size) + margin)
            taken = {id(r) for r in batch}
            rest = [(key, r) for key, r in candidates if id(r) not in taken]
            rank = (on_time + self._served_after(rest, limit, finish),
                    sum(r.batch_size for r in batch))
            if best is None or rank > best[0]:
                best = (rank, batch)
        return best[1]

    def margin(self) -> float:
        """Seconds kept free before every deadline for the answer to reach its client."""
        return self._profile.margin() if self._profile is not None else 0.0

    def p99(self, samples: int) -> float:
        """The profile's p99 seconds for ``samples`` (0 when unknown: decide as if free)."""
        if self._profile is None or samples < 1:
            return 0.0
        return self._profile.p99(samples) or 0.0

    def optimistic(self, samples: int) -> float:
        if self._profile is None or samples < 1:
            return 0.0
        return self._profile.optimistic(samples) or 0.0

    def _sizes(self, candidates: Candidates, limit: int) -> list[int]:
        """The batch sizes to weigh: the profile's up to ``limit``, but none beyond the first
        that holds every candidate (it would only finish later)."""
        total = sum(r.batch_size for _, r in candidates)
        profile_buckets = self._profile.buckets if self._profile is not None else ()
        buckets = sorted({min(b, limit) for b in profile_buckets} | {limit})
        whole = min(total, limit)
        return [b for b in buckets if b < whole] + [next(b for b in buckets if b >= whole)]

    def _best_size_sorted(self, candidates: Candidates, keys: list[float], limit: int,
                          now: float) -> int:
        """``best_batch``'s choice when the candidates' deadlines are in order (one priority
        level, the common case), found by bisecting instead of composing every batch: those
        a batch of m makes late are a prefix, it serves the next ones that fit, and so on for
        the batches after it. Only the late prefix is walked (for the spare room), and it is
        short: its requests are about to be dropped."""
        count = len(keys)
        cum = list(itertools.accumulate((r.batch_size for _, r in candidates), initial=0))
        margin = self.margin()
        best: tuple[tuple[int, int], int] | None = None
        for size in self._sizes(candidates, limit):
            finish = now + self.p99(size)
            late = bisect.bisect_left(keys, finish)
            end = late if late == count else max(
                late + 1, bisect.bisect_right(cum, cum[late] + size, late) - 1)
            taken = cum[end] - cum[late]
            hopeful = now + self.optimistic(size) + margin
            for _, request in candidates[:late]:  # spare room: as ``compose`` fills it
                if request.batch_size <= size - taken and (
                        request.deadline is None or request.deadline >= hopeful):
                    taken += request.batch_size
            rank = (end - late + self._served_after_sorted(keys, cum, end, limit, finish), taken)
            if best is None or rank > best[0]:
                best = (rank, size)
        return best[1]

    def _served_after(self, rest: Candidates, limit: int, start: float) -> int:
        """How many of ``rest`` (in deadline order) meet their deadlines in back-to-back full
        batches from ``start``, each finishing at its p99 time. Those already late take no
        part: they are dropped before they run."""
        on_time = 0
        while rest:
            rest = [(key, r) for key, r in rest if key >= start]
            size = min(limit, sum(r.batch_size for _, r in rest))
            if not size:
                break
            start += self.p99(size)
            batch, served = compose(rest, size, start, math.inf)
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
            start += self.p99(size)
            first = max(first, bisect.bisect_left(keys, start, first))
            if first >= count:
                break
            end = max(first + 1, bisect.bisect_right(cum, cum[first] + size, first) - 1)
            on_time += end - first
            first = end
        return on_time


def compose(candidates: Candidates, size: int, finish: float,
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
