"""Batch buckets: the few batch sizes a model runs at, so each can be warmed up (and captured
as a CUDA graph) before the model reports READY.

A batch of ``n`` samples is padded with zero rows up to the smallest bucket that holds it, and
the padding rows are dropped from the answers. Buckets ``1, 2, 4, ...`` bound the padding at
under half a batch while keeping the number of shapes (warm-ups, graphs, cuDNN plans)
logarithmic in ``max_batch_size``.

``BatchBuckets`` is a model's live view of its buckets: after a batch runs out of device memory
(even after the cache was given back, ``batcher/forward.py``) its largest usable bucket is
lowered (``lower``), and larger batches then run in chunks no larger than that, for a while:
memory that another model, a burst or a long queue's staged inputs held comes back. After
``recover_after_s`` the whole batch is tried again; if it fails again the bucket is lowered for
twice as long (up to ``MAX_RECOVER_AFTER_S``), and a whole batch that runs resets the wait.
torch-free, so the config reader can use it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

# How long a lowered bucket stays lowered after its first out-of-memory, and at most.
RECOVER_AFTER_S = 10.0
MAX_RECOVER_AFTER_S = 600.0


def default_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch buckets ``1, 2, 4, ...`` below ``max_batch``, then ``max_batch`` itself."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
    buckets = []
    bucket = 1
    while bucket < max_batch:
        buckets.append(bucket)
        bucket *= 2
    buckets.append(max_batch)
    return tuple(buckets)


def bucket_for(batch: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``batch`` samples; ValueError when none does."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    if not buckets:
        raise ValueError("buckets must not be empty")
    fitting = [bucket for bucket in buckets if bucket >= batch]
    if not fitting:
        raise ValueError(
            f"batch must be at most the largest bucket {max(buckets)}, got {batch}"
        )
    return min(fitting)


class BatchBuckets:
    """The buckets of one model, and the largest batch it runs in one piece.

    ``buckets`` empty means no padding: a batch runs at its own size. ``largest`` starts at
    ``max_batch`` (``top``); ``lower`` brings it down for a while (module docstring). Shared by
    the model's executors.
    """

    def __init__(self, buckets: Sequence[int], max_batch: int, *,
                 recover_after_s: float = RECOVER_AFTER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.buckets = tuple(buckets)
        if self.buckets and self.buckets[-1] != max_batch:
            raise ValueError(f"the largest bucket must be {max_batch}, got {self.buckets}")
        if recover_after_s <= 0:
            raise ValueError(f"recover_after_s must be > 0, got {recover_after_s}")
        self.top = max(max_batch, 1)
        self._limit = self.top
        self._first_wait_s = recover_after_s
        self._wait_s = recover_after_s
        self._until: float | None = None  # while lowered: when the whole batch is tried again
        self._clock = clock
        self._lock = threading.Lock()

    @property
    def largest(self) -> int:
        until = self._until
        if until is not None and self._clock() >= until:
            with self._lock:
                if self._until is not None and self._clock() >= self._until:
                    self._limit, self._until = self.top, None
        return self._limit

    @property
    def lowered(self) -> bool:
        """Whether an out-of-memory keeps ``largest`` below ``top`` now."""
        return self.largest < self.top

    def pad(self, rows: int) -> int:
        """Rows to run a batch of ``rows`` at: its bucket, or ``rows`` itself when there are no
        buckets or it is larger than ``largest`` (it then runs in chunks)."""
        if not self.buckets or rows > self.largest:
            return rows
        return bucket_for(rows, self.buckets)

    def lower(self, failed_rows: int) -> int:
        """A batch of ``failed_rows`` ran out of memory: ``largest`` drops below it (to the
        largest bucket under it, or half of it without buckets) until the wait passes; the
        next failure before a whole batch runs waits twice as long. Returns the new
        ``largest``."""
        with self._lock:
            below = [b for b in self.buckets if b < failed_rows]
            limit = below[-1] if below else max(1, failed_rows // 2)
            self._limit = min(self._limit, limit)
            self._until = self._clock() + self._wait_s
            self._wait_s = min(self._wait_s * 2, MAX_RECOVER_AFTER_S)
            return self._limit

    def recovered(self) -> None:
        """A whole batch (``top`` rows) ran: the next out-of-memory waits the shortest again."""
        if self._wait_s == self._first_wait_s:
            return
        with self._lock:
            if self._until is None:
                self._wait_s = self._first_wait_s
