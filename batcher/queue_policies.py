"""The queue's two orders and what each reads to choose a batch: FIFO and the deadline policy.

``ModelQueue`` (``batcher/queue.py``) owns the storage, the lock and every change of state;
this module only reads a queue's levels and says which requests a batch takes. Under FIFO a
level is a deque in arrival order; under the deadline policy it is a ``DeadlineLevel``.

The ``deadline`` policy (opt-in per model) keeps the queue's dispatch rules and changes three
things, using the model's latency profile (``batcher/profile.py``):

- order: earliest deadline first within a priority level (a sorted list per level). A request's
  scheduling deadline is the earlier of its own deadline and its arrival plus the model's
  ``slo_ms``; requests with neither come last, in arrival order;
- size: for each batch size the profile knows (its buckets or size classes), the batch is the
  earliest-deadline requests that its p99 completion time meets, and the size chosen is the
  one after which the most requests meet their deadlines, counting those that back-to-back
  full batches after it would serve (``batcher/deadline_search.py``): the largest batch that
  meets its earliest deadline, unless serving a tight head would cost more requests behind it
  than it saves;
- drops: a request whose hard deadline (its own, not the SLO) even the profile's optimistic
  time for it alone cannot meet is taken out before it uses the device, and handed to the
  queue's ``on_infeasible``.

With a queue delay, a deadline-policy batch waits for MIN_BATCH no longer than its earliest
deadline allows (``DeadlinePolicy.latest_start``).
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections.abc import Iterable, Iterator

from batchgate.batcher.deadline_search import Candidates, DeadlineSearch
from batchgate.batcher.profile import LatencyProfile
from batchgate.batcher.request import QUEUED, InferenceRequest


def fifo_batch(levels: Iterable[Iterable[InferenceRequest]], shape_key: tuple,
               limit: int) -> list[InferenceRequest]:
    """Up to ``limit`` samples of the queued requests shaped ``shape_key``, levels in order,
    arrival order within a level. A request too large for the room left ends the batch: a
    later, smaller one does not overtake it."""
    batch: list[InferenceRequest] = []
    room = limit
    for level in levels:
        for request in level:
            if request.state != QUEUED or request.shape_key != shape_key:
                continue
            if request.batch_size > room:
                return batch
            batch.append(request)
            room -= request.batch_size
            if room == 0:
                return batch
    return batch


def scheduling_deadline(request: InferenceRequest, slo_s: float | None) -> float:
    """The earlier of the request's deadline and its arrival + the SLO; inf when neither is set."""
    deadline = math.inf if request.deadline is None else request.deadline
    if slo_s is not None:
        deadline = min(deadline, request.arrival + slo_s)
    return deadline


class DeadlineLevel:
    """One priority level under the deadline policy: its live requests, earliest deadline first.

    It offers what ``ModelQueue`` uses of a deque (``append``, ``[0]``, ``popleft``, iteration
    in order, ``clear``, ``compact``), so the FIFO code paths serve both. It is one list kept
    sorted by (scheduling deadline, arrival sequence), holding only live requests: a request
    taken or removed leaves it at once (``discard``), so there is nothing dead to skip or
    compact. Reading it in order costs nothing beyond the entries read (a heap would have to
    be sorted whole for every batch, which at large batches under load is most of a
    decision's time), and admission control can ask how many queued requests run before a
    new one (``due_before``) with a bisect: under EDF that is not the whole level. Inserting
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


class DeadlinePolicy:
    """What the deadline policy reads to decide: feasibility, the latest start, the candidates
    for a batch and the best batch among them. It changes no queue state."""

    __slots__ = ("_profile", "_search", "_slo_s")

    def __init__(self, profile: LatencyProfile | None, slo_s: float | None) -> None:
        self._profile = profile
        self._slo_s = slo_s
        self._search = DeadlineSearch(profile)

    def new_level(self) -> DeadlineLevel:
        return DeadlineLevel(self._slo_s)

    def infeasible(self, request: InferenceRequest, now: float,
                   alone: dict[int, float] | None = None) -> bool:
        """True when even alone, and quick, the request would be done (and answered) after its
        hard deadline. ``alone`` keeps that earliest time per batch size within one decision."""
        if request.deadline is None or self._profile is None:
            return False
        done = alone.get(request.batch_size) if alone is not None else None
        if done is None:
            quick = self._profile.optimistic(request.batch_size)
            done = -math.inf if quick is None else now + quick + self._search.margin()
            if alone is not None:
                alone[request.batch_size] = done
        return done > request.deadline

    def latest_start(self, head: InferenceRequest, min_batch: int) -> float:
        """When a ``min_batch``-sized batch must start for the head to meet its deadline."""
        deadline = scheduling_deadline(head, self._slo_s)
        batch_s = self._profile.p99(min_batch) if self._profile is not None else None
        if batch_s is None or math.isinf(deadline):
            return math.inf
        return deadline - batch_s - self._search.margin()

    def candidates(self, levels: Iterable[DeadlineLevel], shape_key: tuple, samples: int,
                   now: float, one_shape: bool) -> tuple[Candidates, list[InferenceRequest]]:
        """Up to ``samples`` samples of requests that could share the head's batch, levels in
        order, earliest deadline first, as (scheduling deadline less the margin, request); and
        the infeasible ones met on the way, for the queue to take out. ``one_shape``: every
        queued request shares the head's shape (no shape checks)."""
        candidates: Candidates = []
        dropped: list[InferenceRequest] = []
        margin = self._search.margin()
        alone: dict[int, float] = {}  # batch size -> the earliest a request of it can be done
        for level in levels:
            # The level's own entries, read in order (it holds only live requests, each with
            # its scheduling deadline): no copy, no state checks.
            for key, _, request in level.entries():
                if not one_shape and request.shape_key != shape_key:
                    continue
                if request.deadline is not None and self.infeasible(request, now, alone):
                    dropped.append(request)
                    continue
                candidates.append((key - margin, request))
                samples -= request.batch_size
                if samples <= 0:
                    return candidates, dropped
        return candidates, dropped

    def best_batch(self, candidates: Candidates, limit: int, now: float
                   ) -> list[InferenceRequest]:
        """See ``DeadlineSearch.best_batch``."""
        return self._search.best_batch(candidates, limit, now)
