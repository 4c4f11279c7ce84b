"""A served model's accounting of its batches and requests: statistics, failures, the SLO, the
latency profile and the batches in flight, in one object.

The executors report to it through ``BatchAccounting`` (``batcher/batch.py``) from their
threads, except a finished batch's ``ran`` and ``after_batch``, which run right after its
answers on the thread that delivered them (``Outcome.accounting``); ``ServedModel`` reports
answered and failed requests from the event loop, and asks it what is in flight (admission
control, the device's turns). Nothing here touches a queue, a future or a device.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence

from batchgate.batcher.batch import Batch, BatchAccounting
from batchgate.batcher.metrics import ModelMetrics, observe_all
from batchgate.batcher.profile import LatencyProfile
from batchgate.batcher.queue_policies import scheduling_deadline
from batchgate.batcher.request import InferenceRequest
from batchgate.batcher.stats import ModelStats


class ModelAccounting(BatchAccounting):
    """One model's figures (``stats``, its metrics when it has them, its latency profile)."""

    def __init__(self, *, stats: ModelStats, profile: LatencyProfile,
                 metrics: ModelMetrics | None, slo_s: float | None,
                 after_batch: Callable[[], None] | None = None) -> None:
        self.stats = stats
        self.profile = profile
        self._metrics = metrics
        self._slo_s = slo_s
        self._after_batch = after_batch
        self._inflight: dict[int, Batch] = {}  # batch id -> batch, taken and not finished
        self._lock = threading.Lock()

    # -- from the executors --------------------------------------------------------------------

    def taken(self, batch: Batch) -> None:
        with self._lock:
            self._inflight[batch.id] = batch
        if self._metrics is not None:
            self._metrics.inflight_batches.inc()

    def ended(self, batch: Batch) -> None:
        with self._lock:
            self._inflight.pop(batch.id, None)
        if self._metrics is not None:
            self._metrics.inflight_batches.dec()

    def ran(self, batch: Batch, infer_ns: int, output_ns: int) -> None:
        metrics = self._metrics
        taken_at = batch.taken_at
        waits = [taken_at - request.enqueued for request in batch.requests]
        queue_ns = sum([int(waited * 1e9) for waited in waits])
        if metrics is not None:
            observe_all(metrics.queue_seconds, waits)
        self.stats.record_batch(
            requests=len(batch.requests), samples=batch.samples, queue_ns=queue_ns,
            input_ns=batch.input_ns, infer_ns=infer_ns, output_ns=output_ns,
        )
        compute_s = (batch.input_ns + infer_ns + output_ns) / 1e9
        self.publish_profile(self.profile.record(batch.samples, compute_s))
        if metrics is not None:
            metrics.model_cpu_seconds.inc(batch.model_cpu_ns / 1e9)
            metrics.batch_size.observe(batch.samples)
            metrics.batches[batch.reason].inc()
            metrics.compute_seconds.observe(compute_s)

    def out_of_memory(self, rows: int, largest: int) -> None:
        if self._metrics is not None:
            self._metrics.oom_events.inc()

    def copies(self, queued: int, at_batch: int) -> None:
        if self._metrics is None:
            return
        copies = self._metrics.input_copies
        if queued:
            copies["queued"].inc(queued)
        if at_batch:
            copies["batch"].inc(at_batch)

    def after_batch(self) -> None:
        if self._after_batch is not None:
            self._after_batch()

    # -- from the model ------------------------------------------------------------------------

    def has_inflight(self) -> bool:
        return bool(self._inflight)

    def inflight_count(self) -> int:
        """How many batches are taken and not finished (read without the lock)."""
        return len(self._inflight)

    def inflight(self) -> list[Batch]:
        """The batches taken and not finished."""
        with self._lock:
            return list(self._inflight.values())

    def inflight_work_s(self, now: float) -> tuple[float, float]:
        """Admission control's view of the batches taken and not finished: the seconds of work
        they have left (each one's mean time for its own size, less what a running one has
        run) and the sum of their squared deviations (fifo holds the completion at its p99)."""
        left = variance = 0.0
        for batch in self.inflight():
            mean_s = self.profile.mean(batch.samples) or 0.0
            started = batch.started_at
            left += mean_s if started is None else max(0.0, mean_s - (now - started))
            variance += (self.profile.deviation(batch.samples) or 0.0) ** 2
        return left, variance

    def publish_profile(self, size_class: int | None) -> None:
        """Show the latency profile's estimate for ``size_class`` (just updated) as metrics."""
        if self._metrics is None or size_class is None:
            return
        estimate = self.profile.measured_class(size_class)
        if estimate is not None:
            self._metrics.profile_class(size_class, *estimate)

    def delivered(self, seconds: float) -> None:
        """A batch's answers reached the loop ``seconds`` after the executor handed them on."""
        self.profile.record_delivery(seconds)
        if self._metrics is not None:
            self._metrics.response_margin_seconds.set(self.profile.margin())

    def answered(self, requests: Sequence[InferenceRequest], now: float) -> None:
        """``requests`` got their results at ``now``: successes, and the SLO met or missed."""
        success_ns = sum([int((now - request.arrival) * 1e9) for request in requests])
        met = missed = 0
        if self._metrics is not None:
            slo_s = self._slo_s
            slacks = [target - now for target in
                      [scheduling_deadline(request, slo_s) for request in requests]
                      if target != math.inf]
            if slacks:
                observe_all(self._metrics.deadline_slack_seconds, slacks)
                met = sum(1 for slack in slacks if slack >= 0)
                missed = len(slacks) - met
        self.stats.record_success(len(requests), success_ns)
        if met:
            self._metrics.slo_met.inc(met)
        if missed:
            self._metrics.slo_missed.inc(missed)

    def failed(self, reason: str, requests: Sequence[InferenceRequest]) -> None:
        """``requests`` got no result, for ``reason`` (a ``FAILURE_REASONS`` entry)."""
        now = time.monotonic()
        missed = 0
        for request in requests:
            self.stats.record_failure(int((now - request.arrival) * 1e9))
            if reason != "cancelled" and scheduling_deadline(request, self._slo_s) != math.inf:
                missed += 1
        if self._metrics is not None and requests:
            self._metrics.failures[reason].inc(len(requests))
            if missed:
                self._metrics.slo_missed.inc(missed)
