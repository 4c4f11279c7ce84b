"""Per-model counts and durations, the content of Triton's ModelStatistics.

Durations are cumulative nanoseconds with a count, as the protocol reports them; per-request
figures (queue, compute phases) are charged to every request of a batch, per-batch figures to
the batch size. Updated once per batch under one lock; read as a snapshot.
"""

from __future__ import annotations

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
    last_inference_ms: int
    inference_count: int
    execution_count: int
    success: Duration
    fail: Duration
    queue: Duration
    compute_input: Duration
    compute_infer: Duration
    compute_output: Duration
    batches: dict[int, BatchDurations]


class ModelStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_inference_ms = 0
        self._inference_count = 0
        self._execution_count = 0
        self._success = Duration()
        self._fail = Duration()
        self._queue = Duration()
        self._compute_input = Duration()
        self._compute_infer = Duration()
        self._compute_output = Duration()
        self._batches: dict[int, BatchDurations] = {}

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
            self._last_inference_ms = time.time_ns() // 1_000_000
            self._inference_count += samples
            self._execution_count += 1
            self._queue.add(requests, queue_ns)
            self._compute_input.add(requests, input_ns * requests)
            self._compute_infer.add(requests, infer_ns * requests)
            self._compute_output.add(requests, output_ns * requests)
            durations = self._batches.get(samples)
            if durations is None:
                durations = self._batches[samples] = BatchDurations()
            durations.compute_input.add(1, input_ns)
            durations.compute_infer.add(1, infer_ns)
            durations.compute_output.add(1, output_ns)

    def record_success(self, count: int, ns: int) -> None:
        with self._lock:
            self._success.add(count, ns)

    def record_failure(self, ns: int) -> None:
        with self._lock:
            self._fail.add(1, ns)

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            copy = dataclasses.replace
            return StatsSnapshot(
                last_inference_ms=self._last_inference_ms,
                inference_count=self._inference_count,
                execution_count=self._execution_count,
                success=copy(self._success),
                fail=copy(self._fail),
                queue=copy(self._queue),
                compute_input=copy(self._compute_input),
                compute_infer=copy(self._compute_infer),
                compute_output=copy(self._compute_output),
                batches={
                    size: BatchDurations(
                        copy(d.compute_input), copy(d.compute_infer), copy(d.compute_output)
                    )
                    for size, d in sorted(self._batches.items())
                },
            )
