"""LatencyProfile: how long one model takes to run a batch, per batch size.

The deadline batch policy and admission control both need a prediction of "a batch of n
samples takes t seconds" before they run it. The profile keeps, per size class, an
exponentially weighted mean of the measured batch time and of its absolute deviation. It is
seeded at warm-up and then updated with every batch the executors run, so it follows the
machine as it is now (a shared CPU, a GPU with neighbours), not as it was at load.

Size classes follow how the model runs a batch:

- **padded** (a model with batch buckets, ``batcher/buckets.py``): a batch of n runs at its
  bucket's rows, so it takes the bucket's time; the classes are the buckets, and an estimate is
  the time of the bucket that holds n.
- **unpadded** (``padded=False``: a model that runs each batch at its own size): the classes
  are every size up to 16, then sizes about 1/8 apart up to the max (1-16, 18, 21, 24, 27,
  31, 32 for a max of 32; 39 classes for 256). Each class also keeps the mean size of the
  batches it saw, and an estimate interpolates linearly between the two measured classes
  around n. So a warm-up that timed only the smallest and the largest batch already predicts
  every size in between for a model whose time is affine in the batch size (most are), and
  the deadline policy, which weighs the classes as batch sizes, can pick a batch of 21 where
  power-of-two classes offered only 16 or 32; classes finer than these cost more per decision
  for large batches and gain nothing (docs/decisions/0002-deadline-policy-variants-not-kept.md).
  A class that spans several sizes (19-21) takes its deviation from the line through its
  measured neighbours at each batch's own size, so the time between a batch of 19 and one of
  21 is not counted as spread (it would lift that class's p99 above its neighbours').

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

Outside what was measured an estimate is a bound, not a guess: below the smallest measured
class, that class's time (a bigger batch takes no less time); above the largest, its time
scaled linearly with the batch size (no better than linear). With nothing measured there is no
prediction (None), and callers then decide as if the batch were free.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Sequence

from batchgate.batcher.buckets import bucket_for, default_buckets

# Weight of the newest measurement: about the last 10 batches of a bucket carry the estimate.
DEFAULT_ALPHA = 0.1
# p99 ~ mean + 2.33 sigma, and the mean absolute deviation ~ 0.8 sigma.
P99_DEVIATIONS = 3.0
# Unpadded size classes: every size up to this one, then sizes this ratio apart.
EXACT_UP_TO = 16
CLASS_RATIO = 1.125


def size_classes(max_batch: int) -> tuple[int, ...]:
    """The size classes of an unpadded model: 1 ... 8, then about 25 % apart, then max."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
    sizes = list(range(1, min(max_batch, EXACT_UP_TO) + 1))
    while sizes[-1] < max_batch:
        sizes.append(min(max_batch, math.ceil(sizes[-1] * CLASS_RATIO)))
    return tuple(sizes)


class _Bucket:
    __slots__ = ("count", "deviation", "mean", "size")

    def __init__(self, size: float, seconds: float) -> None:
        self.size = size  # mean batch size seen (unpadded classes interpolate between these)
        self.mean = seconds
        self.deviation = 0.0
        self.count = 1

    def update(self, size: float, seconds: float, alpha: float, slope: float = 0.0) -> None:
        """Move the averages ``alpha`` of the way towards one more measurement.

        ``slope`` (seconds per sample) says how the time changes with the size inside this
        class: the deviation is taken from the time expected at ``size`` itself, so a class
        that spans several sizes does not count their difference as spread. (The mean and the
        mean size move together and stay a point of that line.)
        """
        error = seconds - self.mean
        spread = error - slope * (size - self.size)
        self.mean += alpha * error
        self.deviation += alpha * (abs(spread) - self.deviation)
        self.size += alpha * (size - self.size)
        self.count += 1


class LatencyProfile:
    """Per-size-class batch times of one model; thread-safe (executors record, the queue reads).

    ``buckets``: the classes, smallest first; by default the power-of-two buckets of
    ``max_batch``, or ``size_classes(max_batch)`` when ``padded`` is false.
    """

    def __init__(self, max_batch: int, *, buckets: Sequence[int] | None = None,
                 padded: bool = True, alpha: float = DEFAULT_ALPHA,
                 response_margin_s: float = 0.0) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must lie in (0, 1], got {alpha}")
        if not response_margin_s >= 0.0:
            raise ValueError(f"response_margin_s must be >= 0, got {response_margin_s}")
        self.response_margin_s = response_margin_s
        self._delivery: _Bucket | None = None
        if buckets is None:
            max_batch = max(max_batch, 1)
            buckets = default_buckets(max_batch) if padded else size_classes(max_batch)
        self.buckets = tuple(buckets)
        self.padded = padded
        self._alpha = alpha
        self._measured: dict[int, _Bucket] = {}
        self._order: list[int] = []  # measured classes, sorted
        # Beside it, for interpolating: each measured class's state and mean size seen (in
        # class order, so the sizes ascend: each class's sizes lie above the previous one's).
        self._states: list[_Bucket] = []
        self._seen: list[float] = []
        # size -> (mean, deviation) estimated from the measurements as they are; emptied by
        # every record. The queue asks for the same few sizes many times between batches.
        self._cache: dict[int, tuple[float, float]] = {}
        self._ceiling: tuple[float, float] | None = None  # likewise ``ceiling()``
        self._lock = threading.Lock()

    def record(self, batch_size: int, seconds: float) -> int | None:
        """One batch of ``batch_size`` samples took ``seconds``. Returns the size class it
        updated (None: a negative time, ignored)."""
        if seconds < 0:
            return None
        size = max(1, min(batch_size, self.buckets[-1]))
        bucket = bucket_for(size, self.buckets)
        with self._lock:
            self._cache = {}
            self._ceiling = None
            state = self._measured.get(bucket)
            if state is None:
                state = self._measured[bucket] = _Bucket(size, seconds)
                index = bisect.bisect_left(self._order, bucket)
                self._order.insert(index, bucket)
                self._states.insert(index, state)
                self._seen.insert(index, state.size)
                return bucket
            if self.padded:
                state.update(size, seconds, self._alpha)
                return bucket
            index = bisect.bisect_left(self._order, bucket)
            state.update(size, seconds, self._alpha, self._slope(index))
            self._seen[index] = state.size
        return bucket

    def _slope(self, index: int) -> float:
        """Seconds per sample around the measured class at ``index`` (unpadded): from the
        measured classes on either side of it, or itself and its one measured neighbour; 0
        with none. Never negative (a bigger batch takes no less time)."""
        states = self._states
        low = states[index - 1] if index > 0 else states[index]
        high = states[index + 1] if index + 1 < len(states) else states[index]
        if high.size - low.size < 0.5:
            return 0.0
        return max(0.0, (high.mean - low.mean) / (high.size - low.size))

    def measured_class(self, bucket: int) -> tuple[float, float] | None:
        """(mean, p99) seconds measured for the size class ``bucket`` itself (no
        interpolation); None when it has no measurement."""
        state = self._measured.get(bucket)
        if state is None:
            return None
        mean, deviation = state.mean, state.deviation
        return mean, mean + P99_DEVIATIONS * deviation

    def record_delivery(self, seconds: float) -> None:
        """A batch's answers reached the caller ``seconds`` after its compute ended."""
        if seconds < 0:
            return
        with self._lock:
            state = self._delivery
            if state is None:
                self._delivery = _Bucket(1, seconds)
                return
            state.update(1, seconds, self._alpha)

    def margin(self) -> float:
        """Seconds to keep free before a deadline after a batch's predicted end: the p99 of
        the measured delivery inside the server plus ``response_margin_s`` for the rest of
        the way to the client."""
        state = self._delivery
        if state is None:
            return self.response_margin_s
        return self.response_margin_s + state.mean + P99_DEVIATIONS * state.deviation

    def mean(self, batch_size: int) -> float | None:
        """Expected seconds for a batch of ``batch_size`` (None: nothing measured yet)."""
        return self._estimate(batch_size, 0.0)

    def p99(self, batch_size: int) -> float | None:
        """About the 99th percentile of the seconds for a batch of ``batch_size``."""
        return self._estimate(batch_size, P99_DEVIATIONS)

    def deviation(self, batch_size: int) -> float | None:
        """The mean absolute deviation of the seconds for a batch of ``batch_size``: the unit
        of the spread around ``mean`` (p99 = mean + 3 of them)."""
        estimate = self._pair(batch_size)
        return None if estimate is None else estimate[1]

    def optimistic(self, batch_size: int) -> float | None:
        """A quick but common time for a batch of ``batch_size``: mean - 1 deviation."""
        estimate = self._estimate(batch_size, -1.0)
        return None if estimate is None else max(estimate, 0.0)

    def ceiling(self) -> tuple[float, float] | None:
        """(mean, deviation) no less than ``mean`` and ``deviation`` of any batch size, cached
        until the next record (None: nothing measured yet): admission's quick bound."""
        ceiling = self._ceiling
        if ceiling is None:
            with self._lock:
                if not self._measured:
                    return None
                # Between measured classes the estimate lies between theirs; past the last
                # one it grows with the size, so the largest size bounds it.
                size = self.buckets[-1]
                top_mean, top_deviation = (self._padded(size) if self.padded
                                           else self._interpolated(size))
                states = self._measured.values()
                ceiling = self._ceiling = (max(top_mean, *(s.mean for s in states)),
                                           max(top_deviation, *(s.deviation for s in states)))
        return ceiling

    @property
    def measured(self) -> bool:
        return bool(self._measured)

    def snapshot(self) -> dict[int, tuple[float, float, int]]:
        """class -> (mean seconds, p99 seconds, batches measured), for logs and tests."""
        with self._lock:
            return {
                b: (s.mean, s.mean + P99_DEVIATIONS * s.deviation, s.count)
                for b, s in sorted(self._measured.items())
            }

    def _estimate(self, batch_size: int, deviations: float) -> float | None:
        estimate = self._pair(batch_size)
        return None if estimate is None else estimate[0] + deviations * estimate[1]

    def _pair(self, batch_size: int) -> tuple[float, float] | None:
        """(mean, deviation) for ``batch_size``, cached until the next record."""
        estimate = self._cache.get(batch_size)
        if estimate is None:
            size = max(1, min(batch_size, self.buckets[-1]))
            with self._lock:
                if not self._measured:
                    return None
                estimate = (self._padded(size) if self.padded else self._interpolated(size))
                self._cache[batch_size] = estimate
        return estimate

    def _padded(self, size: int) -> tuple[float, float]:
        """A padded batch takes its bucket's time; an unmeasured bucket borrows a bound."""
        bucket = bucket_for(size, self.buckets)
        state = self._measured.get(bucket)
        if state is not None:
            return state.mean, state.deviation
        index = bisect.bisect_right(self._order, bucket)
        if index < len(self._order):  # the next larger measured bucket: no less time
            state = self._measured[self._order[index]]
            return state.mean, state.deviation
        below = self._order[-1]
        state = self._measured[below]
        return state.mean * bucket / below, state.deviation * bucket / below

    def _interpolated(self, size: int) -> tuple[float, float]:
        """Linear between the measured classes around ``size`` (by the sizes they saw)."""
        states = self._states
        above = bisect.bisect_left(self._seen, size)
        if above == len(states):  # beyond what was measured: scaled linearly, an upper bound
            top = states[-1]
            return top.mean * size / top.size, top.deviation * size / top.size
        high = states[above]
        if above == 0 or high.size == size:
            return high.mean, high.deviation
        low = states[above - 1]
        share = (size - low.size) / (high.size - low.size)
        return (low.mean + share * (high.mean - low.mean),
                low.deviation + share * (high.deviation - low.deviation))
