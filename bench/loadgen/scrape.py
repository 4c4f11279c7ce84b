"""The server's side of a step, from its Prometheus ``/metrics``: scraped before and after, and
sampled during the step for gauges (GPU utilisation, queue depth).

Counters and histograms are differenced over the step; only the models of the run count. The
names are batchgate's (``batchgate_batch_size``, ``batchgate_queue_seconds``,
``batchgate_batches_total{reason}``, ``batchgate_compute_seconds``,
``batchgate_gpu_utilization_ratio``), with Triton's equivalents where it has them
(``nv_inference_count`` / ``nv_inference_exec_count``, ``nv_inference_queue_duration_us``,
``nv_gpu_utilization``), so ``--metrics-url`` also reads a Triton server.
"""

from __future__ import annotations

import math
import threading
import urllib.request
from collections import defaultdict
from collections.abc import Iterable, Sequence

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

GPU_UTILISATION = ("batchgate_gpu_utilization_ratio", "nv_gpu_utilization")
QUEUE_DEPTH = ("batchgate_queue_depth",)


class ScrapeError(RuntimeError):
    pass


def scrape(url: str, timeout_s: float = 10.0) -> Samples:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            text = reply.read().decode("utf-8")
    except (OSError, ValueError) as exc:
        raise ScrapeError(f"cannot read {url}: {exc}") from exc
    return parse(text)


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


class GaugeSampler:
    """Reads the gauges every ``interval_s`` on a thread until stopped; means per series."""

    def __init__(self, url: str, interval_s: float) -> None:
        self.url = url
        self.interval_s = interval_s
        self.readings: list[Samples] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-metrics", daemon=True)

    def __enter__(self) -> GaugeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                samples = scrape(self.url)
            except ScrapeError:
                continue  # a missed reading only thins the mean
            self.readings.append({key: value for key, value in samples.items()
                                  if key[0] in GPU_UTILISATION + QUEUE_DEPTH})


def server_side(before: Samples, after: Samples, readings: Sequence[Samples],
                models: Iterable[str]) -> dict:
    """The ``server_metrics`` entry of a step (layout in docs/benchmarks.md)."""
    models = set(models)

    def delta(name: str, **match: str) -> float:
        total = 0.0
        for key, value in after.items():
            if key[0] != name:
                continue
            labels = dict(key[1])
            if "model" in labels and labels["model"] not in models:
                continue
            if all(labels.get(k) == v for k, v in match.items()):
                total += value - before.get(key, 0.0)
        return total

    def by_label(name: str, label: str) -> dict[str, float]:
        values = {dict(labels)[label] for metric, labels in after
                  if metric == name and label in dict(labels)}
        counts = {value: delta(name, **{label: value}) for value in sorted(values)}
        return {value: count for value, count in counts.items() if count}

    batches = delta("batchgate_batch_size_count")
    samples = delta("batchgate_batch_size_sum")
    if not batches:  # Triton: executions and inferences
        batches, samples = delta("nv_inference_exec_count"), delta("nv_inference_count")
    queue_waits = delta("batchgate_queue_seconds_count")
    queue_s = delta("batchgate_queue_seconds_sum")
    triton_queue_us = delta("nv_inference_queue_duration_us")
    if not queue_waits and triton_queue_us:
        queue_waits, queue_s = delta("nv_inference_request_success"), triton_queue_us * 1e-6
    buckets = _buckets(lambda le: delta("batchgate_batch_size_bucket", le=le), after,
                       "batchgate_batch_size_bucket")
    return {
        "requests": by_label("batchgate_requests_total", "status"),
        "batches": batches,
        "mean_batch_size": samples / batches if batches else None,
        "batch_size_histogram": _decumulate(buckets),
        "mean_queue_ms": queue_s * 1e3 / queue_waits if queue_waits else None,
        "queue_p99_ms": _quantile_ms(
            _buckets(lambda le: delta("batchgate_queue_seconds_bucket", le=le), after,
                     "batchgate_queue_seconds_bucket"), 0.99),
        "mean_compute_ms": (delta("batchgate_compute_seconds_sum") * 1e3 / batches
                            if delta("batchgate_compute_seconds_count") else None),
        "dispatch_reasons": by_label("batchgate_batches_total", "reason"),
        "mean_queue_depth": _gauge_mean(readings, QUEUE_DEPTH, models),
        "gpu_utilization": _gpu(readings),
    }


def _buckets(delta, after: Samples, name: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) pairs of a histogram's differenced buckets."""
    bounds = sorted({dict(labels)["le"] for metric, labels in after if metric == name},
                    key=float)
    return [(float(le), delta(le)) for le in bounds]


def _decumulate(buckets: list[tuple[float, float]]) -> dict[str, float]:
    """Counts per bucket, keyed by the bucket's upper bound ("+Inf" last); empty ones left out."""
    counts, previous = {}, 0.0
    for bound, cumulative in buckets:
        if cumulative - previous:
            counts["+Inf" if math.isinf(bound) else f"{bound:g}"] = cumulative - previous
        previous = cumulative
    return counts


def _quantile_ms(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Estimated as Prometheus' histogram_quantile does: linear within the bucket."""
    if not buckets or not buckets[-1][1]:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, cumulative in buckets:
        if cumulative >= rank:
            if math.isinf(bound):
                return lower * 1e3
            inside = cumulative - below
            return (lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)) * 1e3
        lower, below = bound, cumulative
    return None


def _gauge_mean(readings: Sequence[Samples], names: Sequence[str], models: set[str]) -> float | None:
    """The mean over readings of the gauge summed over the run's models."""
    sums = []
    for reading in readings:
        values = [v for (name, labels), v in reading.items()
                  if name in names and dict(labels).get("model", "") in models]
        if values:
            sums.append(sum(values))
    return sum(sums) / len(sums) if sums else None


def _gpu(readings: Sequence[Samples]) -> dict[str, float] | None:
    """Mean utilisation (0..1) per GPU over the readings, or None when the server has no GPU."""
    per_gpu: dict[str, list[float]] = defaultdict(list)
    for reading in readings:
        for (name, labels), value in reading.items():
            if name in GPU_UTILISATION:
                label = dict(labels)
                per_gpu[label.get("gpu", label.get("gpu_uuid", "0"))].append(value)
    return {gpu: sum(v) / len(v) for gpu, v in sorted(per_gpu.items())} or None
