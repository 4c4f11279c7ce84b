"""Admission control: refuse at once a request whose deadline its queue wait already exceeds.

A request that will expire in the queue costs the client its whole deadline to learn so, and
under overload it is the queue that makes it expire. Estimating the wait at the door and
answering at once lets the client retry elsewhere (RESOURCE_EXHAUSTED) while it still has time,
and keeps the queue short for the requests that can still be served.

The estimate, from the model's latency profile (``batcher/profile.py``):

    wait = batches ahead x expected batch time / instances

where the batches ahead are the samples queued at the request's priority level or above, in
batches of ``max_batch_size``, each taking the profile's mean time for its size. It counts
every such sample as ahead, which is exact for FIFO and for the deadline policy when deadlines
arrive in order (the usual case: one timeout per client); it ignores the batches already
running, so it errs on the side of admitting.

Under the ``deadline`` policy the request's own batch time is added (its predicted completion,
not just its start, must meet the deadline), and a request that cannot finish in time even on an
empty queue is refused as *infeasible*: DEADLINE_EXCEEDED, not RESOURCE_EXHAUSTED, since
retrying elsewhere will not help it.

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

    def estimated_wait_s(self, samples_ahead: int) -> float | None:
        """Seconds until a request behind ``samples_ahead`` queued samples starts (None: unknown)."""
        if samples_ahead <= 0:
            return 0.0 if self._profile.measured else None
        batches = math.ceil(samples_ahead / self._max_batch)
        batch_s = self._profile.mean(min(samples_ahead, self._max_batch))
        if batch_s is None:
            return None
        return batches * batch_s / self._instances

    def check(self, *, batch_size: int, deadline: float | None, now: float,
              samples_ahead: int) -> None:
        """Raise AdmissionRefused or DeadlineInfeasible if the request cannot be served in time."""
        if deadline is None:
            return
        wait_s = self.estimated_wait_s(samples_ahead)
        if wait_s is None:
            return
        left_s = deadline - now
        if left_s <= 0:
            return  # already expired: its timer answers DEADLINE_EXCEEDED
        own_s = 0.0
        if self._include_own:
            own_s = self._profile.mean(batch_size) or 0.0
            if own_s > left_s:
                raise DeadlineInfeasible(
                    f"model '{self._model}' takes about {own_s * 1e3:.1f} ms to run a batch of "
                    f"{batch_size}, more than the {left_s * 1e3:.1f} ms left before "
                    "the request's deadline: it cannot be served in time"
                )
        if wait_s + own_s > left_s:
            run = f" plus {own_s * 1e3:.1f} ms to run" if own_s else ""
            raise AdmissionRefused(
                f"model '{self._model}': estimated wait {wait_s * 1e3:.1f} ms{run} "
                f"({samples_ahead} samples queued ahead) exceeds the {left_s * 1e3:.1f} ms left "
                "before the request's deadline; retry later or with a longer deadline"
            )
