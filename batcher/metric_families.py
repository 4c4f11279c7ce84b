"""The metric families that more than one process writes, each declared once: its name, help
text, type and labels. ``server/metrics.py`` and ``batcher/metrics.py`` register them with
prometheus_client; the native build generates the native front end's exposition of them from
here (``server/native/generate_rules.py``), so one scrape shows one family, not two that differ
in a word of their help.
"""

from __future__ import annotations

import dataclasses

COUNTER = "counter"
GAUGE = "gauge"
HISTOGRAM = "histogram"


@dataclasses.dataclass(frozen=True, slots=True)
class Family:
    name: str
    """As prometheus_client is given it: a counter's samples add ``_total``."""
    help: str
    kind: str
    labels: tuple[str, ...] = ()

    @property
    def exposed_name(self) -> str:
        """The family's name in the text exposition format."""
        return self.name + "_total" if self.kind == COUNTER else self.name


REQUESTS = Family("batchgate_requests", "Inference requests answered, by model and gRPC status.",
                  COUNTER, ("model", "status"))
REQUEST_SECONDS = Family(
    "batchgate_request_seconds",
    "End-to-end time of an inference request inside the server, decode to encode.",
    HISTOGRAM, ("model",))
ARENA_BYTES_IN_USE = Family(
    "batchgate_arena_bytes_in_use",
    "Bytes allocated in the shared-memory arena (multi-process mode), by region.",
    GAUGE, ("region",))
STREAM_BACKLOG_BYTES = Family(
    "batchgate_stream_backlog_bytes",
    "Reply bytes held for ModelStreamInfer clients, not yet written to them.", GAUGE)
STREAM_PAUSES = Family(
    "batchgate_stream_pauses",
    "Times a ModelStreamInfer stream stopped reading requests until its replies drained "
    "(--max-stream-backlog-bytes).", COUNTER)

# What the native front end exposes, in its order.
NATIVE_FAMILIES = (REQUESTS, REQUEST_SECONDS, ARENA_BYTES_IN_USE, STREAM_BACKLOG_BYTES,
                   STREAM_PAUSES)
