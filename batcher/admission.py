"""Admission control: refuse at once a request whose deadline its queue wait already exceeds.

A request that will expire in the queue costs the client its whole deadline to learn so, and
under overload it is the queue that makes it expire. Estimating the wait at the door and
answering at once lets the client retry elsewhere (RESOURCE_EXHAUSTED) while it still has time,
and keeps the queue short for the requests that can still be served.

The estimate, from the model's latency profile (``batcher/profile.py``):

    wait = full batches ahead x expected full-batch time / instances

The samples that run before the request, followed by the request itself, are cut into batches
of ``max_batch_size``; the request rides in the last one, so the batches before it are the wait
(each taking the profile's mean time for a full batch) and the last one's own time completes
it. Under FIFO the samples ahead are those queued at its priority level or above; under the
deadline policy, those at higher levels and, at its own, those due no later than it
(``ModelQueue.samples_ahead``): a request with a tight deadline overtakes the loose ones queued
before it, and counting them refused it although it would have made it (simulated, deadlines
of 100 and 300 ms mixed: 89 % attainment with them counted, 99 % without, at 0.3 × capacity).

The completion is held against the time left before the deadline, under every policy: a
request whose batch would end after its deadline is answered DEADLINE_EXCEEDED anyway, after
spending its whole deadline and a share of a batch (measured: with the start held against the
deadline instead, a 5x overload admitted requests that all expired in their batch). Under
``fifo`` only the queue is judged: a request whose deadline is shorter than its own batch even
on an empty queue is let in (the profile may be stale; it will expire if it is not).

Batches already taken from the queue (assembling, waiting for the device, or running) are ahead
of every queued request; the caller passes the work they have left (``in_flight_s``, see
``ServedModel._inflight_work_s``): under the deadline policy each one's mean time for its own
size, less what a running one has already run; under fifo a whole full batch each. Counted as
whole full batches under the deadline policy, they refused requests that would have made it
whenever batches were small; under fifo the exact figure let in, under bursts, requests that
then expired (both measured through the server). Behind a queue the request's own batch is
counted full, since later arrivals fill it. The completion is held to the deadline less the
profile's response margin (``LatencyProfile.margin``): the answer still has to reach its client.

Under ``deadline`` a request that cannot finish in time even on an empty queue is also refused
as *infeasible*: DEADLINE_EXCEEDED, not RESOURCE_EXHAUSTED, since retrying elsewhere will not
help it. That last test uses the profile's optimistic time (a refusal is final); the estimates
use the mean.

With no measurement yet (no warm-up, no batch run) there is no estimate and everything is
admitted. Requests without a deadline are always admitted.
"""

from __future__ import annotations

import math

from batcher.errors import AdmissionRefused, DeadlineInfeasible
from batcher.profile import LatencyProfile


class Admission:
    """The admission decision of one model; the caller passes the queue's state and the time."""

    def __init__(self, model: str, profile: LatencyProfile, *, max_batch: int, instances: int,
                 include_own: bool) -> None:
        self._model = model
        self._profile = profile
        self._max_batch = max(max_batch, 1)
        self._instances = max(instances, 1)
        self._include_own = include_own

    def estimate_s(self, samples_ahead: int, batch_size: int = 1, in_flight_s: float = 0.0
                   ) -> tuple[float, float] | None:
        """(wait, completion): seconds until the batch that holds a request of ``batch_size``
        starts, behind ``samples_ahead`` queued samples and ``in_flight_s`` seconds of work left
        in batches already taken, and until it ends (None: unknown)."""
        full_s = self._profile.mean(self._max_batch)
        if full_s is None:
            return None
        samples = samples_ahead + batch_size
        batches = math.ceil(samples / self._max_batch)
        last = samples - (batches - 1) * self._max_batch
        wait_s = (in_flight_s + (batches - 1) * full_s) / self._instances
        # Behind a queue, the request's batch fills up with later arrivals before it runs.
        own_s = full_s if batches > 1 else (self._profile.mean(last) or 0.0)
        return wait_s, wait_s + own_s / self._instances

    def check(self, *, batch_size: int, deadline: float | None, now: float,
              samples_ahead: int, in_flight_s: float = 0.0) -> None:
        """Raise AdmissionRefused or DeadlineInfeasible if the request cannot be served in time."""
        if deadline is None:
            return
        left_s = deadline - now
        if left_s <= 0:
            return  # already expired: its timer answers DEADLINE_EXCEEDED
        estimate = self.estimate_s(samples_ahead, batch_size, in_flight_s)
        if estimate is None:
            return
        wait_s, done_s = estimate
        # The answer still has to reach the client after its batch (``LatencyProfile.margin``).
        margin_s = self._profile.margin()
        budget_s = left_s - margin_s
        if self._include_own:
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
