"""The server's Prometheus registry: request outcomes, end-to-end latency, and the HTTP endpoint.

The batching path's metrics (``batcher/metrics.py``) live on the same registry, so one scrape of
``/metrics`` shows the whole server.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from batchgate.batcher.metric_families import (
    REQUEST_SECONDS,
    REQUESTS,
    STREAM_BACKLOG_BYTES,
    STREAM_PAUSES,
)
from batchgate.batcher.metrics import SECONDS_BUCKETS, BatcherMetrics
from batchgate.batcher.telemetry import GpuTelemetry


# The model label of requests for a model the repository does not know: model names come from
# clients, so only the repository's own become labels (the native front end is handed this one).
UNKNOWN_MODEL_LABEL = "<unknown>"


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.batcher = BatcherMetrics(self.registry)
        self.requests = Counter(REQUESTS.name, REQUESTS.help, REQUESTS.labels,
                                registry=self.registry)
        self.request_seconds = Histogram(
            REQUEST_SECONDS.name, REQUEST_SECONDS.help, REQUEST_SECONDS.labels,
            registry=self.registry, buckets=SECONDS_BUCKETS,
        )
        self.stream_backlog_bytes = Gauge(
            STREAM_BACKLOG_BYTES.name, STREAM_BACKLOG_BYTES.help, registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.stream_pauses = Counter(STREAM_PAUSES.name, STREAM_PAUSES.help,
                                     registry=self.registry)

    def serve_http(self, host: str, port: int):
        """Start ``/metrics`` on a daemon thread; returns the HTTP server (its port for port 0).
        The process that serves ``/metrics`` is the one that reports the GPUs (NVML)."""
        self.registry.register(GpuTelemetry())
        httpd, _thread = start_http_server(port, addr=host, registry=self.registry)
        return httpd
