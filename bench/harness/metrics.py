"""A server's Prometheus ``/metrics``, read and parsed by prometheus_client."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def metrics_url(port: int) -> str:
    return f"http://127.0.0.1:{port}/metrics"


def read_metrics(url: str, timeout_s: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        return reply.read().decode("utf-8")


def parse_samples(text: str) -> Samples:
    """Every sample: (name, sorted labels) -> value."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            samples[key] = samples.get(key, 0.0) + s.value
    return samples


def scrape(url: str, timeout_s: float = 10) -> Samples:
    """Every sample of the ``/metrics`` at ``url``: (name, sorted labels) -> value."""
    return parse_samples(read_metrics(url, timeout_s))


def sample(samples: Samples, name: str, **labels: str) -> float | None:
    """The sample of ``name`` with exactly ``labels``; None if there is none."""
    return samples.get((name, tuple(sorted(labels.items()))))


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(value for (n, pairs), value in samples.items()
               if n == name and all(dict(pairs).get(k) == v for k, v in labels.items()))
