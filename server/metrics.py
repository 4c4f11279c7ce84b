"""The server's Prometheus registry: request outcomes, end-to-end latency, and the HTTP endpoint.

The batching path's metrics (``batcher/metrics.py``) live on the same registry, so one scrape of
``/metrics`` shows the whole server.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from batchgate.batcher.metrics import SECONDS_BUCKETS, BatcherMetrics
from batchgate.batcher.telemetry import GpuTelemetry


# The model label of requests for a model the repository does not know: model names come from
# clients, so only the repository's own become labels (the native front end is handed this one).
UNKNOWN_MODEL_LABEL = "<unknown>"


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.batcher = BatcherMetrics(self.registry)
        self.requests = Counter(
            "batchgate_requests", "Inference requests answered, by model and gRPC status.",
            ["model", "status"], registry=self.registry,
        )
        self.request_seconds = Histogram(
            "batchgate_request_seconds",
            "End-to-end time of an inference request inside the server, decode to encode.",
            ["model"], registry=self.registry, buckets=SECONDS_BUCKETS,
        )
        self.stream_backlog_bytes = Gauge(
            "batchgate_stream_backlog_bytes",
            "Reply bytes held for ModelStreamInfer clients, not yet written to them.",
            registry=self.registry, multiprocess_mode="livesum",
        )
        self.stream_pauses = Counter(
            "batchgate_stream_pauses",
            "Times a ModelStreamInfer stream stopped reading requests until its replies "
            "drained (--max-stream-backlog-bytes).",
            registry=self.registry,
        )

    def serve_http(self, host: str, port: int):
        """Start ``/metrics`` on a daemon thread; returns the HTTP server (its port for port 0).
        The process that serves ``/metrics`` is the one that reports the GPUs (NVML)."""
        self.registry.register(GpuTelemetry())
        httpd, _thread = start_http_server(port, addr=host, registry=self.registry)
        return httpd
