"""LatencyProfile: how long one model takes to run a batch, per batch-size bucket.

The deadline batch policy and admission control both need a prediction of "a batch of n
samples takes t seconds" before they run it. The profile keeps, per bucket of the batch sizes
(``batcher/pool.py``'s buckets: 1, 2, 4, ... up to the model's max batch), an exponentially
weighted mean of the measured batch time and of its absolute deviation. It is seeded at
warm-up and then updated with every batch the executors run, so it follows the machine as it
is now (a shared CPU, a GPU with neighbours), not as it was at load.

Three estimates come out of it, used for different decisions:

- ``p99(n)``: mean + 3 mean absolute deviations, about the 99th percentile for a normal-ish
  spread (p99 is mean + 2.33 sigma and the mean absolute deviation is about 0.8 sigma). Batches
  are sized against it, so that a batch which fits still fits when it runs a little slow.
- ``mean(n)``: the expected time, for estimated waits (admission control).
- ``optimistic(n)``: mean - 1 deviation, a quick but common run. Dropping or refusing a request
  as infeasible is final, so it is done only when even this misses the deadline; and a request
  that this still meets may fill a batch's spare room although the p99 says it will be late.
  Under heavy tails (a stall now and then lifts the mean and the deviation) the p99 is very
  pessimistic, and judging by it alone would give up on requests that usually make it.

A bucket never measured borrows from its neighbours: the next larger measured bucket's time (a
bigger batch takes no less time) or, failing that, the largest smaller one scaled linearly with
the batch size (no better than linear: an upper bound). With nothing measured there is no
prediction (None), and callers then decide as if the batch were free.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from batcher.buckets import bucket_for, default_buckets

# Weight of the newest measurement: about the last 10 batches of a bucket carry the estimate.
DEFAULT_ALPHA = 0.1
# p99 ~ mean + 2.33 sigma, and the mean absolute deviation ~ 0.8 sigma.
P99_DEVIATIONS = 3.0


class _Bucket:
    __slots__ = ("count", "deviation", "mean")

    def __init__(self, seconds: float) -> None:
        self.mean = seconds
        self.deviation = 0.0
        self.count = 1


class LatencyProfile:
    """Per-bucket batch times of one model; thread-safe (executors record, the queue reads)."""

    def __init__(self, max_batch: int, *, buckets: Sequence[int] | None = None,
                 alpha: float = DEFAULT_ALPHA) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must lie in (0, 1], got {alpha}")
        self.buckets = tuple(buckets) if buckets is not None else default_buckets(max(max_batch, 1))
        self._alpha = alpha
        self._measured: dict[int, _Bucket] = {}
        self._lock = threading.Lock()

    def record(self, batch_size: int, seconds: float) -> None:
        """One batch of ``batch_size`` samples took ``seconds``."""
        if seconds < 0:
            return
        bucket = bucket_for(min(batch_size, self.buckets[-1]), self.buckets)
        with self._lock:
            state = self._measured.get(bucket)
            if state is None:
                self._measured[bucket] = _Bucket(seconds)
                return
            error = seconds - state.mean
            state.mean += self._alpha * error
            state.deviation += self._alpha * (abs(error) - state.deviation)
            state.count += 1

    def mean(self, batch_size: int) -> float | None:
        """Expected seconds for a batch of ``batch_size`` (None: nothing measured yet)."""
        return self._estimate(batch_size, 0.0)

    def p99(self, batch_size: int) -> float | None:
        """About the 99th percentile of the seconds for a batch of ``batch_size``."""
        return self._estimate(batch_size, P99_DEVIATIONS)

    def optimistic(self, batch_size: int) -> float | None:
        """A quick but common time for a batch of ``batch_size``: mean - 1 deviation."""
        estimate = self._estimate(batch_size, -1.0)
        return None if estimate is None else max(estimate, 0.0)

    @property
    def measured(self) -> bool:
        return bool(self._measured)

    def snapshot(self) -> dict[int, tuple[float, float, int]]:
        """bucket -> (mean seconds, p99 seconds, batches measured), for logs and tests."""
        with self._lock:
            return {
                b: (s.mean, s.mean + P99_DEVIATIONS * s.deviation, s.count)
                for b, s in sorted(self._measured.items())
            }

    def _estimate(self, batch_size: int, deviations: float) -> float | None:
        if not self._measured:
            return None
        bucket = bucket_for(max(1, min(batch_size, self.buckets[-1])), self.buckets)
        with self._lock:
            return self._estimate_locked(bucket, deviations)

    def _estimate_locked(self, bucket: int, deviations: float) -> float:
        measured = self._measured
        state = measured.get(bucket)
        if state is not None:
            return state.mean + deviations * state.deviation
        larger = [b for b in measured if b > bucket]
        if larger:
            state = measured[min(larger)]
            return state.mean + deviations * state.deviation
        below = max(b for b in measured if b < bucket)
        state = measured[below]
        return (state.mean + deviations * state.deviation) * bucket / below
