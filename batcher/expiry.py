"""Deadlines of one model's requests, watched by one event-loop timer instead of one each.

A request with a deadline must be answered DEADLINE_EXCEEDED when it passes, whether it is
still queued or its batch is running. One ``loop.call_at`` per request costs a timer handle, a
done callback to cancel it and the loop's bookkeeping of cancelled timers, for every request,
while nearly all of them are answered long before their deadline. Here a request costs a heap
entry: ``(deadline, sequence, weak reference)``. The one timer is set for the earliest deadline
in the heap; when it fires, every entry due is taken and its request, if it is still alive and
unanswered, expires.

The heap holds no request alive: an answered request goes as soon as its batch and its caller
let go of it (its arrays may be views of a client's shared memory). Entries whose request is
gone or answered are dropped when they come due, and all at once whenever the heap has grown to
twice what was left after the last such sweep (at least ``SWEEP_AT``), so the heap stays about
as large as the requests in flight and sweeping costs O(1) per request on average. A sweep also
runs when the timer finds its first entry dead, so the timer does not fire once per request
that came and went (it next fires for the oldest request still waiting).

Event loop only: nothing here is thread-safe.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import weakref
from collections.abc import Callable

from batchgate.batcher.request import InferenceRequest

SWEEP_AT = 4096


def _live(ref: weakref.ref) -> InferenceRequest | None:
    """The entry's request while it still waits for an answer, else None."""
    request = ref()
    if request is None or request.answered:
        return None
    return request


class Expiry:
    """Calls ``expire(request)`` at each watched request's deadline, unless it was answered."""

    def __init__(self, expire: Callable[[InferenceRequest], None]) -> None:
        self._expire = expire
        self._heap: list[tuple[float, int, weakref.ref]] = []
        self._sequence = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._sweep_at = SWEEP_AT

    def __len__(self) -> int:
        """Entries in the heap, the dead ones not swept yet included."""
        return len(self._heap)

    def watch(self, request: InferenceRequest, loop: asyncio.AbstractEventLoop) -> None:
        """Expire ``request`` at ``request.deadline`` (on the ``time.monotonic()`` clock, which
        is the loop's) unless it was answered by then."""
        deadline = request.deadline
        heap = self._heap
        heapq.heappush(heap, (deadline, next(self._sequence), weakref.ref(request)))
        if len(heap) >= self._sweep_at:
            self._sweep()
        if self._timer is None or deadline < self._timer_at:
            self._arm(loop, deadline)

    def close(self) -> None:
        """Stop watching (the model is gone): nothing expires after this."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._heap.clear()

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._loop = loop
        self._timer_at = when
        self._timer = loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._timer = None
        heap = self._heap
        loop = self._loop
        now = loop.time()
        if heap and heap[0][0] <= now and _live(heap[0][2]) is None:
            self._sweep()  # the first one due came and went: so, mostly, did those after it
        due = []
        while heap and heap[0][0] <= now:
            request = _live(heapq.heappop(heap)[2])
            if request is not None:
                due.append(request)
        if heap:
            self._arm(loop, heap[0][0])
        for request in due:
            self._expire(request)

    def _sweep(self) -> None:
        """Drop every entry whose request is gone or answered."""
        heap = self._heap
        heap[:] = [entry for entry in heap if _live(entry[2]) is not None]
        heapq.heapify(heap)
        self._sweep_at = max(SWEEP_AT, 2 * len(heap))
