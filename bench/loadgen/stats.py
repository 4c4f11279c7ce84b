"""From records to figures: counts by status, percentiles, throughput, goodput, SLO attainment.

Definitions (docs/benchmarks.md repeats them):

- a request belongs to a step's measurement when it was due (open loop: intended; closed loop:
  sent) inside a measured segment; every such request ends in exactly one status, so
  ``sent == ok + sum(errors)``;
- latency is answer time minus intended send time; percentiles are over OK answers, by the
  nearest-rank method (each is a latency some request had);
- the measured time of a segment runs from its start to the later of its end and its last
  answer, so a server that falls behind an open loop is not credited with answers it gave
  after the window; throughput is OK answers per second of measured time, while the offered
  rate is requests sent per second of the segments' own length;
- with a deadline, goodput is OK answers within the deadline per second of measured time, and
  SLO attainment is their share of all requests sent (errors count against it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import grpc
import numpy as np

from batchgate.bench.loadgen.driver import StepRecords

PERCENTILES = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0), ("p99.9", 99.9))
CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


@dataclasses.dataclass
class Outcome:
    """One target's measured requests of one step, from every worker."""

    intended: np.ndarray
    sent: np.ndarray
    done: np.ndarray
    code: np.ndarray
    choice: np.ndarray
    window_s: float  # the measured segments' own length: when requests were due
    measured_s: float  # the same, each segment until its last answer if that came later
    cpu_cores: float  # the load generator's, over the whole step

    @property
    def latency_s(self) -> np.ndarray:
        return self.done - self.intended

    @property
    def ok(self) -> np.ndarray:
        return self.code == 0


def merge(records: Sequence[StepRecords], target: int) -> Outcome:
    """``target``'s measured segments of one step, over all workers' shares."""
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("intended", "sent", "done", "code", "choice")}
    window_s = measured_s = 0.0
    for index, first in enumerate(records[0].segments):
        if not first.measured or first.target != target:
            continue
        shares = [r.segments[index] for r in records]
        start = min(s.start_s for s in shares)
        end = max(s.end_s for s in shares)
        last = max(float(s.done.max(initial=s.end_s)) for s in shares)
        window_s += max(0.0, end - start)
        measured_s += max(0.0, max(end, last) - start)
        for share in shares:
            for key, values in parts.items():
                values.append(getattr(share, key))
    arrays = {k: np.concatenate(v) if v else np.empty(0) for k, v in parts.items()}
    arrays["code"] = arrays["code"].astype(np.int16)
    arrays["choice"] = arrays["choice"].astype(np.int32)
    wall_s = max(r.wall_s for r in records)
    cpu_cores = sum(r.cpu_s for r in records) / wall_s if wall_s > 0 else 0.0
    return Outcome(**arrays, window_s=window_s, measured_s=measured_s, cpu_cores=cpu_cores)


def summarize(outcome: Outcome, *, deadline_s: np.ndarray | None, samples: np.ndarray,
              models: Sequence[str], variant_model: np.ndarray,
              priorities: Sequence[int], variant_priority: np.ndarray,
              deadlines_ms: Sequence[float] = (), variant_deadline: np.ndarray | None = None
              ) -> dict:
    """The figures of one step and target (the ``steps[]`` entries of the JSON, less the
    step's own fields). ``samples``, ``variant_model``, ``variant_priority``, ``deadline_s``
    (seconds, or None for no deadline at all) and ``variant_deadline`` are per variant."""
    span = outcome.measured_s
    ok = outcome.ok
    latency = outcome.latency_s
    within = ok & (latency <= deadline_s[outcome.choice]) if deadline_s is not None else None
    sent = int(outcome.code.size)
    summary = {
        **_counts(outcome.code),
        "measured_s": span,
        "offered_per_s": _rate(sent, outcome.window_s),
        "throughput_per_s": _rate(int(ok.sum()), span),
        "samples_per_s": _rate(int(samples[outcome.choice[ok]].sum()), span),
        "goodput_per_s": None if within is None else _rate(int(within.sum()), span),
        "slo_attainment": _share(within, sent),
        "latency_ms": latency_ms(latency[ok]),
        "send_lag_ms": _lag_ms(outcome.sent - outcome.intended),
        "by_model": {
            name: _subset(outcome, variant_model[outcome.choice] == m)
            for m, name in enumerate(models)
        },
        "by_priority": {
            str(level): _subset(outcome, variant_priority[outcome.choice] == p)
            for p, level in enumerate(priorities)
        } if len(priorities) > 1 or priorities[0] else {},
        "by_deadline": {
            f"{ms:g}": _deadline_subset(outcome, variant_deadline[outcome.choice] == d, within, span)
            for d, ms in enumerate(deadlines_ms)
        } if len(deadlines_ms) > 1 and variant_deadline is not None and within is not None else {},
        "client_cpu_cores": outcome.cpu_cores,
    }
    return summary


def _share(within: np.ndarray | None, sent: int) -> float | None:
    return None if within is None or not sent else float(within.sum()) / sent


def _deadline_subset(outcome: Outcome, mask: np.ndarray, within: np.ndarray, span: float) -> dict:
    """A deadline class's counts and latencies, with its own goodput and SLO attainment."""
    hits = within[mask]
    return {**_subset(outcome, mask), "goodput_per_s": _rate(int(hits.sum()), span),
            "slo_attainment": _share(hits, int(mask.sum()))}


def _counts(code: np.ndarray) -> dict:
    values, counts = np.unique(code, return_counts=True)
    by_name = {CODE_NAMES.get(int(v), f"CODE_{int(v)}"): int(n) for v, n in zip(values, counts)}
    return {
        "sent": int(code.size),
        "ok": by_name.pop("OK", 0),
        "errors": dict(sorted(by_name.items())),
    }


def _subset(outcome: Outcome, mask: np.ndarray) -> dict:
    counts = _counts(outcome.code[mask])
    latency = latency_ms(outcome.latency_s[mask & outcome.ok])
    return {**counts, "p50_ms": latency["p50"], "p99_ms": latency["p99"]}


def latency_ms(latency_s: np.ndarray) -> dict[str, float | None]:
    """Mean, percentiles and max in milliseconds; ``None`` each when there is no latency."""
    keys = ("mean", *(name for name, _ in PERCENTILES), "max")
    if not latency_s.size:
        return dict.fromkeys(keys)
    ms = latency_s * 1e3
    figures = {"mean": float(ms.mean())}
    points = np.percentile(ms, [q for _, q in PERCENTILES], method="inverted_cdf")
    figures.update({name: float(v) for (name, _), v in zip(PERCENTILES, points)})
    figures["max"] = float(ms.max())
    return figures


def _lag_ms(lag_s: np.ndarray) -> dict[str, float | None]:
    if not lag_s.size:
        return {"p50": None, "p99": None, "max": None}
    ms = np.maximum(lag_s, 0.0) * 1e3
    p50, p99 = np.percentile(ms, [50, 99], method="inverted_cdf")
    return {"p50": float(p50), "p99": float(p99), "max": float(ms.max())}


def _rate(count: int, seconds: float) -> float | None:
    return count / seconds if seconds > 0 else None
