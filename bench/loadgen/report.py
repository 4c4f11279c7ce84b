"""The run's report: a JSON document of a stable, documented layout, and the tables people read.

``LAYOUT`` is the layout of ``schema_version`` 2 (2 added ``burst_off_rate_per_s``, the
deadline mix ``deadlines`` and ``by_deadline``): every key the JSON has, nested as it is
(a key ending in ``[]`` is a list of such objects; ``{"*": ...}`` a mapping whose keys are
data, such as model names). docs/benchmarks.md documents each key, and a test holds the
output, the layout and the doc together. Add keys only with a new ``schema_version``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

SCHEMA_VERSION = 2
_COUNTS = {"sent": None, "ok": None, "errors": {"*": None}}
_PERCENTILES = {"mean": None, "p50": None, "p90": None, "p99": None, "p99.9": None, "max": None}
_SUBSET = {**_COUNTS, "p50_ms": None, "p99_ms": None}
LAYOUT: dict[str, Any] = {
    "schema_version": None,
    "tool": None,
    "created": None,
    "command": None,
    "machine": {"cores": None, "usable_cores": None, "cpu_model": None, "python": None,
                "grpcio": None},
    "settings": {
        "mode": None, "concurrency": None, "rate_per_s": None, "arrival": None,
        "burst_on_s": None, "burst_off_s": None, "burst_off_rate_per_s": None,
        "warmup_s": None, "duration_s": None,
        "requests": None, "slice_s": None, "deadline_ms": None, "deadlines[]": {"ms": None, "weight": None},
        "enforce_deadline": None,
        "max_outstanding": None, "workers": None, "seed": None, "batch": None,
        "models[]": {"name": None, "weight": None, "max_batch_size": None,
                     "inputs[]": {"name": None, "datatype": None, "shape": None}},
        "priorities[]": {"level": None, "weight": None},
    },
    "targets[]": {"name": None, "url": None, "metrics_url": None,
                  "server": {"name": None, "version": None}},
    "steps[]": {
        "step": None, "label": None, "offered": {"*": None}, "target": None,
        **_COUNTS,
        "measured_s": None, "offered_per_s": None, "throughput_per_s": None,
        "samples_per_s": None, "goodput_per_s": None, "slo_attainment": None,
        "latency_ms": _PERCENTILES,
        "send_lag_ms": {"p50": None, "p99": None, "max": None},
        "by_model": {"*": _SUBSET},
        "by_priority": {"*": _SUBSET},
        "by_deadline": {"*": {**_SUBSET, "goodput_per_s": None, "slo_attainment": None}},
        "client_cpu_cores": None,
        "server_metrics": {
            "requests": {"*": None}, "batches": None, "mean_batch_size": None,
            "batch_size_histogram": {"*": None}, "mean_queue_ms": None, "queue_p99_ms": None,
            "mean_compute_ms": None, "dispatch_reasons": {"*": None},
            "mean_queue_depth": None, "gpu_utilization": {"*": None},
        },
    },
    "comparison[]": {
        "step": None, "label": None, "offered": {"*": None},
        "throughput_ratio": None, "goodput_ratio": None, "p50_ratio": None, "p99_ratio": None,
        "slo_attainment": {"base": None, "compare": None},
    },
}


def layout_problems(report: Any, layout: Any = LAYOUT, where: str = "") -> list[str]:
    """Where ``report`` departs from ``layout`` (``LAYOUT`` by default): missing or extra keys,
    or a mapping or list where the layout has none. ``null`` may stand for any object."""
    if layout is None or report is None:
        return []
    if not isinstance(report, Mapping):
        return [f"{where or 'report'}: expected an object, got {type(report).__name__}"]
    if set(layout) == {"*"}:
        return [p for key, value in report.items()
                for p in layout_problems(value, layout["*"], f"{where}.{key}")]
    problems = []
    names = {key.removesuffix("[]"): key for key in layout}
    for key in report.keys() - names.keys():
        problems.append(f"{where}.{key}: not in the layout")
    for name, key in names.items():
        if name not in report:
            problems.append(f"{where}.{name}: missing")
        elif key.endswith("[]"):
            items = report[name]
            if not isinstance(items, list):
                problems.append(f"{where}.{name}: expected a list")
                continue
            for i, item in enumerate(items):
                problems += layout_problems(item, layout[key], f"{where}.{name}[{i}]")
        else:
            problems += layout_problems(report[name], layout[key], f"{where}.{name}")
    return problems


def comparison(steps: Sequence[dict]) -> list[dict]:
    """compare ÷ base, per step, for the steps that ran on both targets."""
    rows = []
    by_step: dict[int, dict[str, dict]] = {}
    for entry in steps:
        by_step.setdefault(entry["step"], {})[entry["target"]] = entry
    for index, pair in sorted(by_step.items()):
        if set(pair) != {"base", "compare"}:
            continue
        base, other = pair["base"], pair["compare"]
        rows.append({
            "step": index,
            "label": base["label"],
            "offered": base["offered"],
            "throughput_ratio": _ratio(other["throughput_per_s"], base["throughput_per_s"]),
            "goodput_ratio": _ratio(other["goodput_per_s"], base["goodput_per_s"]),
            "p50_ratio": _ratio(other["latency_ms"]["p50"], base["latency_ms"]["p50"]),
            "p99_ratio": _ratio(other["latency_ms"]["p99"], base["latency_ms"]["p99"]),
            "slo_attainment": {"base": base["slo_attainment"],
                               "compare": other["slo_attainment"]},
        })
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def write_json(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n", encoding="utf-8")


# -- tables --------------------------------------------------------------------------------------


def render(report: dict, console: Console) -> None:
    steps = report["steps"]
    compared = len(report["targets"]) > 1
    console.print(_main_table(steps, compared, report["settings"]))
    models = [m["name"] for m in report["settings"]["models"]]
    if len(models) > 1 or any(s["by_priority"] or s["by_deadline"] for s in steps):
        console.print(_mix_table(steps, compared))
    if any(s["server_metrics"] for s in steps):
        console.print(_server_table(steps, compared))
    if report["comparison"]:
        console.print(_comparison_table(report["comparison"]))


def _main_table(steps: Sequence[dict], compared: bool, settings: dict) -> Table:
    deadlines = settings["deadlines"]
    deadline = deadlines or None
    title = "batchgate bench: latency from the intended send time"
    if deadlines:
        title += "; goodput and SLO within " + (
            f"{deadlines[0]['ms']:g} ms" if len(deadlines) == 1 else "each request's deadline")
    table = Table(title=title)
    columns = ["load", *(["target"] if compared else []), "sent", "answers/s"]
    if deadline is not None:
        columns += ["goodput/s", "SLO"]
    columns += ["p50 ms", "p90 ms", "p99 ms", "p99.9 ms"]
    if settings["mode"] == "open":
        columns.append("send lag p99 ms")
    columns.append("errors")
    for name in columns:
        table.add_column(name, justify="left" if name in ("load", "target", "errors") else "right")
    for s in steps:
        lat = s["latency_ms"]
        row = [s["label"], *([s["target"]] if compared else []), f"{s['sent']:,}",
               _num(s["throughput_per_s"], ",.1f")]
        if deadline is not None:
            row += [_num(s["goodput_per_s"], ",.1f"), _pct(s["slo_attainment"])]
        row += [_num(lat[k], ".2f") for k in ("p50", "p90", "p99", "p99.9")]
        if settings["mode"] == "open":
            row.append(_num(s["send_lag_ms"]["p99"], ".2f"))
        row.append(_errors(s["errors"]))
        table.add_row(*row)
    return table


def _mix_table(steps: Sequence[dict], compared: bool) -> Table:
    table = Table(title="by model, priority and deadline")
    for name in ("load", *(["target"] if compared else []), "model / priority / deadline",
                 "sent", "ok", "SLO", "p50 ms", "p99 ms", "errors"):
        table.add_column(name)
    for s in steps:
        groups = [(f"model {k}", v) for k, v in s["by_model"].items()]
        groups += [(f"priority {k}", v) for k, v in s["by_priority"].items()]
        groups += [(f"deadline {k} ms", v) for k, v in s["by_deadline"].items()]
        for name, g in groups:
            table.add_row(s["label"], *([s["target"]] if compared else []), name,
                          f"{g['sent']:,}", f"{g['ok']:,}", _pct(g.get("slo_attainment")),
                          _num(g["p50_ms"], ".2f"), _num(g["p99_ms"], ".2f"),
                          _errors(g["errors"]))
    return table


def _server_table(steps: Sequence[dict], compared: bool) -> Table:
    table = Table(title="server side (/metrics, over the measured time)")
    for name in ("load", *(["target"] if compared else []), "mean batch", "batch sizes (≤ bound: n)",
                 "queue mean / p99 ms", "compute ms", "dispatch", "GPU busy"):
        table.add_column(name)
    for s in steps:
        m = s["server_metrics"]
        if not m:
            continue
        histogram = " ".join(f"{k}:{v:,.0f}" for k, v in m["batch_size_histogram"].items())
        reasons = " ".join(f"{k} {v:,.0f}" for k, v in m["dispatch_reasons"].items())
        gpu = m["gpu_utilization"]
        table.add_row(
            s["label"], *([s["target"]] if compared else []), _num(m["mean_batch_size"], ".1f"),
            histogram or "-",
            f"{_num(m['mean_queue_ms'], '.2f')} / {_num(m['queue_p99_ms'], '.1f')}",
            _num(m["mean_compute_ms"], ".2f"), reasons or "-",
            " ".join(f"{g}: {_pct(v)}" for g, v in gpu.items()) if gpu else "n/a")
    return table


def _comparison_table(rows: Sequence[dict]) -> Table:
    deadline = any(r["slo_attainment"]["base"] is not None for r in rows)
    table = Table(title="compare ÷ base (same load, alternating slices)")
    columns = ["load", "answers/s ×", *(["goodput ×"] if deadline else []), "p50 ×", "p99 ×",
               *(["SLO base → compare"] if deadline else [])]
    for name in columns:
        table.add_column(name, justify="left" if name == "load" else "right")
    for r in rows:
        slo = r["slo_attainment"]
        cells = [r["label"], _num(r["throughput_ratio"], ".2f")]
        if deadline:
            cells.append(_num(r["goodput_ratio"], ".2f"))
        cells += [_num(r["p50_ratio"], ".2f"), _num(r["p99_ratio"], ".2f")]
        if deadline:
            cells.append(f"{_pct(slo['base'])} → {_pct(slo['compare'])}")
        table.add_row(*cells)
    return table


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _errors(errors: Mapping[str, int]) -> str:
    return ", ".join(f"{name} {count:,}" for name, count in errors.items()) or "0"
