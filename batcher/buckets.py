"""Batch buckets: the few batch sizes a model runs at, so each can be warmed up (and captured
as a CUDA graph) before the model reports READY.

A batch of ``n`` samples is padded with zero rows up to the smallest bucket that holds it, and
the padding rows are dropped from the answers. Buckets ``1, 2, 4, ...`` bound the padding at
under half a batch while keeping the number of shapes (warm-ups, graphs, cuDNN plans)
logarithmic in ``max_batch_size``.

``BatchBuckets`` is a model's live view of its buckets: after a batch runs out of device memory
its largest usable bucket is lowered (``lower``), and larger batches then run in chunks no
larger than that. torch-free, so the config reader can use it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence


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
    ``max_batch`` and only goes down (``lower``), shared by the model's executors.
    """

    def __init__(self, buckets: Sequence[int], max_batch: int) -> None:
        self.buckets = tuple(buckets)
        if self.buckets and self.buckets[-1] != max_batch:
            raise ValueError(f"the largest bucket must be {max_batch}, got {self.buckets}")
        self._largest = max(max_batch, 1)
        self._lock = threading.Lock()

    @property
    def largest(self) -> int:
        return self._largest

    def pad(self, rows: int) -> int:
        """Rows to run a batch of ``rows`` at: its bucket, or ``rows`` itself when there are no
        buckets or it is larger than ``largest`` (it then runs in chunks)."""
        if not self.buckets or rows > self._largest:
            return rows
        return bucket_for(rows, self.buckets)

    def lower(self, failed_rows: int) -> int:
        """A batch of ``failed_rows`` ran out of memory: ``largest`` drops below it (to the
        largest bucket under it, or half of it without buckets). Returns the new ``largest``."""
        with self._lock:
            below = [b for b in self.buckets if b < failed_rows]
            limit = below[-1] if below else max(1, failed_rows // 2)
            self._largest = min(self._largest, limit)
            return self._largest
