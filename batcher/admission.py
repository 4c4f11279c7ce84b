"""Admission control: refuse at once a request whose deadline its queue wait already exceeds.

A request that will expire in the queue costs the client its whole deadline to learn so, and
under overload it is the queue that makes it expire. Estimating the wait at the door and
answering at once lets the client retry elsewhere (RESOURCE_EXHAUSTED) while it still has time,
and keeps the queue short for the requests that can still be served.

The estimate, from the model's latency profile (``batcher/profile.py``):

    wait = (work left in batches taken + full batches ahead x mean full-batch time) / instances

The samples that run before the request, followed by the request itself, are cut into batches
of ``max_batch_size``; the request rides in the last one, so the batches before it are the wait
(each taking the profile's mean time for a full batch) and the last one's own time completes
it. Under FIFO the samples ahead are those queued at its priority level or above; under the
deadline policy, those at higher levels and, at its own, those due no later than it
(``ModelQueue.samples_ahead``): a request with a tight deadline overtakes the loose ones queued
before it, and counting them would refuse it although it would make it.

Batches already taken from the queue (assembling, waiting for the device, or running) are ahead
of every queued request; the caller passes the work they have left (``in_flight_s``, see
``ServedModel._inflight_work_s``): each one's mean time for its own size, less what a running
one has already run.

The completion is held against the time left before the deadline less the profile's response
margin (``LatencyProfile.margin``: the answer still has to reach its client), under every
policy: a request whose batch would end after its deadline is answered DEADLINE_EXCEEDED anyway,
after spending its whole deadline and a share of a batch (holding only the batch's start against
the deadline lets in, under overload, requests that then expire in their batch).

- Under ``fifo`` a batch takes everything queued when it starts, so the request's own batch
  is what is queued ahead of it in that batch, itself, and the samples expected to arrive
  before the batch starts: as many as arrived in as long a time before (``RecentArrivals``),
  at most a full batch (behind a queue it is full). And the completion is held at its p99,
  not its mean: the means plus 3 deviations of their sum (``in_flight_var``: the squared
  deviations of the batches taken; deviations of independent batch times add in squares).
  Without either, fifo admission lets in under bursts requests that then expire; counting
  every batch taken as a whole full batch instead refuses many that would have made it
  (docs/decisions/0003-fifo-admission-at-the-p99.md has the figures).
- Under ``deadline`` the completion is the means (its own batch at its own size: under EDF a
  later arrival with a later deadline does not join ahead of it), and a request that cannot
  finish in time even on an empty queue is refused as *infeasible*: DEADLINE_EXCEEDED, not
  RESOURCE_EXHAUSTED, since retrying elsewhere will not help it (by the profile's optimistic
  time: a refusal is final). Under ``fifo`` only the queue is judged: a request whose deadline
  is shorter than its own batch even on an empty queue is let in (the profile may be stale; it
  will expire if it is not).

With no measurement yet (no warm-up, no batch run) there is no estimate and everything is
admitted. Requests without a deadline are always admitted.
"""

from __future__ import annotations

import bisect
import collections
import math

from batchgate.batcher.errors import AdmissionRefused, DeadlineInfeasible
from batchgate.batcher.profile import P99_DEVIATIONS, LatencyProfile


class Admission:
    """The admission decision of one model; the caller passes the queue's state and the time."""

    def __init__(self, model: str, profile: LatencyProfile, *, max_batch: int, instances: int,
                 include_own: bool) -> None:
        self._model = model
        self._profile = profile
        self._max_batch = max(max_batch, 1)
        self._instances = max(instances, 1)
        # include_own: the deadline policy's admission (it also refuses the infeasible);
        # without it, fifo's (its own batch fills with arrivals; completion held at its p99).
        self._fifo = not include_own
        self._arrivals = RecentArrivals(self._max_batch)

    def queued(self, samples: int, now: float) -> None:
        """A request of ``samples`` joined the queue at ``now`` (admitted, or without a
        deadline): fifo's estimate expects as many to join in the time to come."""
        if self._fifo:
            self._arrivals.add(samples, now)

    def estimate_s(self, samples_ahead: int, batch_size: int = 1, in_flight_s: float = 0.0,
                   *, in_flight_var: float = 0.0, now: float = 0.0
                   ) -> tuple[float, float] | None:
        """(wait, completion): seconds until the batch that holds a request of ``batch_size``
        starts, behind ``samples_ahead`` queued samples and ``in_flight_s`` seconds of work left
        in batches already taken (``in_flight_var``: the sum of their squared deviations), and
        until it ends (under fifo its p99, with as many samples joining its batch meanwhile as
        ``queued`` saw arrive in as long before ``now``; None: unknown)."""
        profile = self._profile
        full_s = profile.mean(self._max_batch)
        if full_s is None:
            return None
        samples = samples_ahead + batch_size
        batches = math.ceil(samples / self._max_batch)
        wait_s = (in_flight_s + (batches - 1) * full_s) / self._instances
        if batches > 1:  # behind a queue, its batch fills up before it runs
            own = self._max_batch
        else:
            own = samples
            if self._fifo:  # a fifo batch takes what arrived meanwhile too
                own = min(self._max_batch, samples + self._arrivals.within(wait_s, now))
        done_s = wait_s + (profile.mean(own) or 0.0) / self._instances
        if self._fifo:
            full_dev = profile.deviation(self._max_batch) or 0.0
            own_dev = profile.deviation(own) or 0.0
            spread = math.sqrt(in_flight_var + (batches - 1) * full_dev ** 2 + own_dev ** 2)
            done_s += P99_DEVIATIONS * spread / self._instances
        return wait_s, done_s

    def surely_in_time(self, *, batch_size: int, deadline: float, now: float,
                       samples_queued: int, batches_in_flight: int) -> bool:
        """True when ``check`` would admit the request even if every batch ahead of it and its
        own took the profile's ceiling (its largest mean and deviation): most deadlines are
        far longer than the queue, and this answers them without the full estimate.
        ``samples_queued``: no fewer than ``check``'s ``samples_ahead``."""
        ceiling = self._profile.ceiling()
        if ceiling is None:
            return True  # nothing measured: ``check`` admits everything
        mean_s, deviation_s = ceiling
        batches = batches_in_flight + -(-(samples_queued + batch_size) // self._max_batch)
        # Every term of ``estimate_s`` at its largest; the deviations add in squares.
        bound_s = (batches * mean_s + P99_DEVIATIONS * deviation_s * math.sqrt(batches))
        # The deadline policy also refuses a request whose own batch, on one instance, is too
        # long: that is at most the ceiling's mean.
        bound_s = max(bound_s / self._instances, mean_s)
        return deadline - now - self._profile.margin() > bound_s

    def check(self, *, batch_size: int, deadline: float | None, now: float,
              samples_ahead: int, in_flight_s: float = 0.0, in_flight_var: float = 0.0
              ) -> None:
        """Raise AdmissionRefused or DeadlineInfeasible if the request cannot be served in time."""
        if deadline is None:
            return
        left_s = deadline - now
        if left_s <= 0:
            return  # already expired: its timer answers DEADLINE_EXCEEDED
        estimate = self.estimate_s(samples_ahead, batch_size, in_flight_s,
                                   in_flight_var=in_flight_var, now=now)
        if estimate is None:
            return
        wait_s, done_s = estimate
        # The answer still has to reach the client after its batch (``LatencyProfile.margin``).
        margin_s = self._profile.margin()
        budget_s = left_s - margin_s
        if not self._fifo:
            own_s = self._profile.optimistic(batch_size) or 0.0
            if own_s > budget_s:
                raise DeadlineInfeasible(
                    f"model '{self._model}' takes about {own_s * 1e3:.1f} ms to run a batch of "
                    f"{batch_size}, more than {_left(left_s, margin_s)}: it cannot be served in time"
                )
            refuse = done_s > budget_s
        else:
            # fifo judges only the queue: a request too short even for an empty queue is let
            # in (the profile may be stale); the deadline policy refuses it as infeasible.
            refuse = done_s > budget_s and (self._profile.mean(batch_size) or 0.0) <= budget_s
        if refuse:
            raise AdmissionRefused(
                f"model '{self._model}': estimated wait {wait_s * 1e3:.1f} ms, done in "
                f"{done_s * 1e3:.1f} ms ({samples_ahead} samples queued ahead), after "
                f"{_left(left_s, margin_s)}; retry later or with a longer deadline"
            )


def _left(left_s: float, margin_s: float) -> str:
    """The time a refusal message says the request had."""
    return (f"the {left_s * 1e3:.1f} ms left before the request's deadline (less "
            f"{margin_s * 1e3:.1f} ms for the answer to reach its client)")



class RecentArrivals:
    """The samples queued lately, to tell how many arrived within the last so many seconds.

    Fifo admission predicts the samples that will join a request's batch before it starts, in
    the next ``wait`` seconds, by those that arrived in the last ``wait`` seconds: no rate
    window to tune, and a burst shows as soon as it has lasted as long as the wait. Only the
    last ``keep`` arrivals are kept (``max_batch_size``: more can never join one batch), so a
    query is a bisect over at most that many. Not thread-safe (the event loop owns it)."""

    __slots__ = ("_before", "_times", "_total")

    def __init__(self, keep: int) -> None:
        keep = max(keep, 1)
        self._times: collections.deque[float] = collections.deque(maxlen=keep)
        self._before: collections.deque[int] = collections.deque(maxlen=keep)  # samples before it
        self._total = 0

    def add(self, samples: int, now: float) -> None:
        if self._times and now < self._times[-1]:
            now = self._times[-1]  # arrival stamps may come slightly out of order
        self._times.append(now)
        self._before.append(self._total)
        self._total += samples

    def within(self, seconds: float, now: float) -> int:
        """Samples that arrived in the last ``seconds`` (counting only the kept arrivals)."""
        first = bisect.bisect_left(self._times, now - seconds)
        if first == len(self._times):
            return 0
        return self._total - self._before[first]
