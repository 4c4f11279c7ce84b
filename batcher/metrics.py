"""Prometheus metrics of the batching path, named by Prometheus conventions.

One ``BatcherMetrics`` per server, on an injectable registry (tests read values with
``registry.get_sample_value``). Each model gets its labelled children once, in ``for_model``,
so the batch loop never resolves labels.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from batchgate.batcher.metric_families import ARENA_BYTES_IN_USE
from batchgate.batcher.spec import DISPATCH_REASONS

# Batch sizes are small integers; powers of two bound the buckets people configure.
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# Queue waits and compute times span tens of microseconds to seconds.
SECONDS_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
)
# rejected: refused at the door (queue full, admission control's estimated wait); expired: the
# deadline passed in the queue or while its batch ran; infeasible: the latency profile said it
# could not finish in time even alone, so it never used the device (deadline policy);
# cancelled: the client went away; model_error: the model raised or returned a bad batch;
# unavailable: the model was unloaded before the request ran.
FAILURE_REASONS = (
    "rejected", "expired", "infeasible", "cancelled", "model_error", "unavailable",
)
# Time left before a request's deadline (or SLO) when it was answered; negative: late.
SLACK_BUCKETS = (
    -1.0, -0.1, -0.025, -0.005, 0.0, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5, 5.0, 10.0,
)
# When a request's inputs were copied into its model's pooled buffers (spec.INPUT_STAGING).
INPUT_COPY_TIMES = ("queued", "batch")


def observe_all(histogram, amounts: Sequence[float]) -> None:
    """``histogram.observe(a)`` for each of ``amounts``, as one update per bucket touched.

    A labelled Histogram child's ``observe`` writes two values (the sum and a bucket), each a
    locked write into the multiprocess mmap: a batch's queue waits, one per request, become
    one write of the sum and one per bucket the batch's waits fall in. The buckets are
    Histogram.observe's own (the first whose bound is not below the amount). Sorted, the
    amounts of one bucket are a run: two bisects per bucket touched, not work per amount."""
    if len(amounts) <= 2:
        for amount in amounts:
            histogram.observe(amount)
        return
    bounds = histogram._upper_bounds  # ends with +Inf: every amount has a bucket
    ordered = sorted(amounts)
    histogram._raise_if_not_observable()
    histogram._sum.inc(float(sum(amounts)))
    buckets = histogram._buckets
    start, count = 0, len(ordered)
    while start < count:
        index = bisect.bisect_left(bounds, ordered[start])
        end = bisect.bisect_right(ordered, bounds[index], start)
        buckets[index].inc(end - start)
        start = end


class BatcherMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.queue_seconds = Histogram(
            "batchgate_queue_seconds", "Time a request waited in its model's queue.",
            ["model"], registry=r, buckets=SECONDS_BUCKETS,
        )
        self.compute_seconds = Histogram(
            "batchgate_compute_seconds", "Time to run one batch: inputs, model, outputs.",
            ["model"], registry=r, buckets=SECONDS_BUCKETS,
        )
        self.model_cpu_seconds = Counter(
            "batchgate_model_cpu_seconds",
            "CPU time of the executor threads inside the model's forward (on a GPU: the launch "
            "work); with the process's CPU time, what the server spends outside the model.",
            ["model"], registry=r,
        )
        self.batch_size = Histogram(
            "batchgate_batch_size", "Samples per executed batch.",
            ["model"], registry=r, buckets=BATCH_SIZE_BUCKETS,
        )
        self.batches = Counter(
            "batchgate_batches", "Batches dispatched, by the reason they were dispatched.",
            ["model", "reason"], registry=r,
        )
        # With several processes (server/supervisor/multiproc_metrics.py) a gauge is summed over the live
        # ones: a dead process's queue is gone. One process ignores multiprocess_mode.
        self.queue_depth = Gauge(
            "batchgate_queue_depth", "Requests waiting in the model's queue.",
            ["model"], registry=r, multiprocess_mode="livesum",
        )
        self.inflight_batches = Gauge(
            "batchgate_inflight_batches", "Batches being assembled or computed.",
            ["model"], registry=r, multiprocess_mode="livesum",
        )
        self.arena_bytes_in_use = Gauge(
            ARENA_BYTES_IN_USE.name, ARENA_BYTES_IN_USE.help, ARENA_BYTES_IN_USE.labels,
            registry=r, multiprocess_mode="livesum",
        )
        self.failures = Counter(
            "batchgate_request_failures", "Requests that got no result, by reason.",
            ["model", "reason"], registry=r,
        )
        self._gpu_path_metrics(r)
        self._deadline_metrics(r)

    def _deadline_metrics(self, r: CollectorRegistry) -> None:
        # Deadlines and SLOs (batcher/queue_policies.py's deadline policy,
        # batcher/admission.py) and the devices' weighted turns (batcher/device_share.py).
        self.slo_requests = Counter(
            "batchgate_slo_requests",
            "Requests with a deadline or SLO, by whether they were answered OK in time.",
            ["model", "result"], registry=r,
        )
        self.deadline_slack_seconds = Histogram(
            "batchgate_deadline_slack_seconds",
            "Time left before the deadline (or SLO) when a request was answered; < 0: late.",
            ["model"], registry=r, buckets=SLACK_BUCKETS,
        )
        # The latency profile (batcher/profile.py) that the deadline policy and admission
        # control plan with: an estimate, so the most recent value of a live process.
        self.profile_seconds = Gauge(
            "batchgate_latency_profile_seconds",
            "The latency profile's time for one batch of a size class: its mean and p99.",
            ["model", "batch_size", "estimate"], registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.response_margin_seconds = Gauge(
            "batchgate_response_margin_seconds",
            "Time kept free before every deadline for the answer to reach its client.",
            ["model"], registry=r, multiprocess_mode="livemostrecent",
        )
        self.device_share_seconds = Counter(
            "batchgate_device_share_seconds",
            "Device time used in weighted turns (models with device_share_weight).",
            ["model", "device"], registry=r,
        )

    def _gpu_path_metrics(self, r: CollectorRegistry) -> None:
        # The device memory pools (batcher/memory.py): one per device, set by the executor
        # process alone, so "livesum" is that process's value.
        self.pool_bytes_reserved = Gauge(
            "batchgate_pool_bytes_reserved", "Bytes the device memory pool reserved, by device.",
            ["device"], registry=r, multiprocess_mode="livesum",
        )
        self.pool_bytes_in_use = Gauge(
            "batchgate_pool_bytes_in_use", "Bytes allocated in the device memory pool.",
            ["device"], registry=r, multiprocess_mode="livesum",
        )
        self.pool_largest_free_block = Gauge(
            "batchgate_pool_largest_free_block_bytes",
            "The largest allocation the device memory pool can satisfy now.",
            ["device"], registry=r, multiprocess_mode="livesum",
        )
        self.pool_fallbacks = Counter(
            "batchgate_pool_fallbacks",
            "Allocations a permissive pool served outside its arena, by device.",
            ["device"], registry=r,
        )
        self.model_pool_bytes_reserved = Gauge(
            "batchgate_model_pool_bytes_reserved",
            "Bytes of the device memory pool reserved for a model: its plan and staging room.",
            ["model"], registry=r, multiprocess_mode="livesum",
        )
        self.model_pool_bytes_in_use = Gauge(
            "batchgate_model_pool_bytes_in_use",
            "Bytes of the device memory pool a model holds: its plan plus staged inputs.",
            ["model"], registry=r, multiprocess_mode="livesum",
        )
        self.model_pool_fallbacks = Counter(
            "batchgate_model_pool_fallbacks",
            "A model's allocations served outside the pool's arena (permissive pool).",
            ["model"], registry=r,
        )
        # Each model's own allocator pools (batcher/gpu.py), and the device as a whole.
        self.model_device_bytes_reserved = Gauge(
            "batchgate_model_device_bytes_reserved",
            "Bytes a model's own allocator pools (eager and CUDA graphs) reserved on its device.",
            ["model", "device"], registry=r, multiprocess_mode="livesum",
        )
        self.model_device_bytes_allocated = Gauge(
            "batchgate_model_device_bytes_allocated",
            "Bytes of a model's own allocator pools that live tensors use.",
            ["model", "device"], registry=r, multiprocess_mode="livesum",
        )
        self.model_footprint_bytes = Gauge(
            "batchgate_model_footprint_bytes",
            "A model's footprint measured at warm-up, by part (weights, activations, graphs, "
            "staging, plan), as admitted against the device's free memory.",
            ["model", "device", "part"], registry=r, multiprocess_mode="livesum",
        )
        self.device_bytes_reserved = Gauge(
            "batchgate_device_bytes_reserved",
            "Bytes the serving process's allocator reserved on the device.",
            ["device"], registry=r, multiprocess_mode="livesum",
        )
        self.device_bytes_allocated = Gauge(
            "batchgate_device_bytes_allocated",
            "Bytes of the device's reserved memory that live tensors use.",
            ["device"], registry=r, multiprocess_mode="livesum",
        )
        self.device_fragmentation_bytes = Gauge(
            "batchgate_device_fragmentation_bytes",
            "Reserved minus allocated device memory: held by the allocator, used by no tensor.",
            ["device"], registry=r, multiprocess_mode="livesum",
        )
        self.arena_pinned = Gauge(
            "batchgate_arena_pinned",
            "1 when the shared-memory arena is registered as pinned memory with CUDA, 0 when "
            "pinning failed and copies run from pageable memory.",
            registry=r, multiprocess_mode="livesum",
        )
        self.oom_events = Counter(
            "batchgate_oom_events",
            "Batches that ran out of device memory and were split and run again.",
            ["model"], registry=r,
        )
        self.largest_bucket = Gauge(
            "batchgate_model_largest_bucket",
            "The largest batch a model runs in one piece (lowered after out-of-memory).",
            ["model"], registry=r, multiprocess_mode="livesum",
        )
        self.input_copies = Counter(
            "batchgate_input_copies",
            "Requests whose inputs were copied into pooled buffers, by when: as soon as queued "
            "or when their batch was assembled.",
            ["model", "when"], registry=r,
        )

    def for_model(self, model: str) -> ModelMetrics:
        return ModelMetrics(self, model)


class ModelMetrics:
    """The children of one model, resolved once."""

    def __init__(self, metrics: BatcherMetrics, model: str) -> None:
        self.queue_seconds = metrics.queue_seconds.labels(model)
        self.compute_seconds = metrics.compute_seconds.labels(model)
        self.model_cpu_seconds = metrics.model_cpu_seconds.labels(model)
        self.batch_size = metrics.batch_size.labels(model)
        self.batches = {reason: metrics.batches.labels(model, reason) for reason in DISPATCH_REASONS}
        self.queue_depth = metrics.queue_depth.labels(model)
        self.inflight_batches = metrics.inflight_batches.labels(model)
        self.failures = {reason: metrics.failures.labels(model, reason) for reason in FAILURE_REASONS}
        self.slo_met = metrics.slo_requests.labels(model, "met")
        self.slo_missed = metrics.slo_requests.labels(model, "missed")
        self.deadline_slack_seconds = metrics.deadline_slack_seconds.labels(model)
        self.response_margin_seconds = metrics.response_margin_seconds.labels(model)
        self._profile_seconds = metrics.profile_seconds
        self._profile_children: dict[int, tuple[Gauge, Gauge]] = {}
        self._device_share_seconds = metrics.device_share_seconds
        self._metrics = metrics
        self._model = model
        self.pool_bytes_reserved = metrics.model_pool_bytes_reserved.labels(model)
        self.pool_bytes_in_use = metrics.model_pool_bytes_in_use.labels(model)
        self.pool_fallbacks = metrics.model_pool_fallbacks.labels(model)
        self.oom_events = metrics.oom_events.labels(model)
        self.largest_bucket = metrics.largest_bucket.labels(model)
        self.input_copies = {when: metrics.input_copies.labels(model, when)
                             for when in INPUT_COPY_TIMES}

    def profile_class(self, batch_size: int, mean_s: float, p99_s: float) -> None:
        """The latency profile's class ``batch_size`` now estimates ``mean_s`` and ``p99_s``."""
        children = self._profile_children.get(batch_size)
        if children is None:
            family, size = self._profile_seconds, str(batch_size)
            children = self._profile_children[batch_size] = (
                family.labels(self._model, size, "mean"), family.labels(self._model, size, "p99"))
        children[0].set(mean_s)
        children[1].set(p99_s)

    def device_share_seconds(self, device: str):
        return self._device_share_seconds.labels(self._model, device)

    def model_device_bytes_reserved(self, device: str):
        return self._metrics.model_device_bytes_reserved.labels(self._model, device)

    def model_device_bytes_allocated(self, device: str):
        return self._metrics.model_device_bytes_allocated.labels(self._model, device)

    def footprint_bytes(self, device: str, part: str):
        return self._metrics.model_footprint_bytes.labels(self._model, device, part)

    def device(self, device: str, reserved: int, allocated: int) -> None:
        """The device's figures, every model's pools together."""
        metrics = self._metrics
        metrics.device_bytes_reserved.labels(device).set(reserved)
        metrics.device_bytes_allocated.labels(device).set(allocated)
        metrics.device_fragmentation_bytes.labels(device).set(reserved - allocated)
