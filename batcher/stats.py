"""Per-model counts and durations, the content of Triton's ModelStatistics.

Durations are cumulative nanoseconds with a count, as the protocol reports them; per-request
figures (queue, compute phases) are charged to every request of a batch, per-batch figures to
the batch size. Updated once per batch under one lock; read as a snapshot.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time


@dataclasses.dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, count: int, ns: int) -> None:
        self.count += count
        self.ns += ns


@dataclasses.dataclass
class BatchDurations:
    compute_input: Duration = dataclasses.field(default_factory=Duration)
    compute_infer: Duration = dataclasses.field(default_factory=Duration)
    compute_output: Duration = dataclasses.field(default_factory=Duration)


@dataclasses.dataclass
class StatsSnapshot:
    """A model's statistics: ``ModelStats`` keeps one up to date, ``snapshot`` copies it."""

    last_inference_ms: int = 0
    inference_count: int = 0
    execution_count: int = 0
    success: Duration = dataclasses.field(default_factory=Duration)
    fail: Duration = dataclasses.field(default_factory=Duration)
    queue: Duration = dataclasses.field(default_factory=Duration)
    compute_input: Duration = dataclasses.field(default_factory=Duration)
    compute_infer: Duration = dataclasses.field(default_factory=Duration)
    compute_output: Duration = dataclasses.field(default_factory=Duration)
    batches: dict[int, BatchDurations] = dataclasses.field(default_factory=dict)


# The durations of the protocol's InferStatistics and InferBatchStatistics, by field name.
INFER_DURATIONS = tuple(f.name for f in dataclasses.fields(StatsSnapshot)
                        if f.default_factory is Duration)
BATCH_DURATIONS = tuple(f.name for f in dataclasses.fields(BatchDurations))


class ModelStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = StatsSnapshot()

    def record_batch(
        self,
        *,
        requests: int,
        samples: int,
        queue_ns: int,
        input_ns: int,
        infer_ns: int,
        output_ns: int,
    ) -> None:
        with self._lock:
            stats = self._stats
            stats.last_inference_ms = time.time_ns() // 1_000_000
            stats.inference_count += samples
            stats.execution_count += 1
            stats.queue.add(requests, queue_ns)
            stats.compute_input.add(requests, input_ns * requests)
            stats.compute_infer.add(requests, infer_ns * requests)
            stats.compute_output.add(requests, output_ns * requests)
            durations = stats.batches.get(samples)
            if durations is None:
                durations = stats.batches[samples] = BatchDurations()
            durations.compute_input.add(1, input_ns)
            durations.compute_infer.add(1, infer_ns)
            durations.compute_output.add(1, output_ns)

    def record_success(self, count: int, ns: int) -> None:
        with self._lock:
            self._stats.success.add(count, ns)

    def record_failure(self, ns: int) -> None:
        with self._lock:
            self._stats.fail.add(1, ns)

    def snapshot(self) -> StatsSnapshot:
        """A copy of the statistics, batch sizes in increasing order."""
        with self._lock:
            snap = copy.deepcopy(self._stats)
        snap.batches = dict(sorted(snap.batches.items()))
        return snap
