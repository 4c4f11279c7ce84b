"""PNG plots of a run, through matplotlib (the ``plots`` extra), imported only when asked for.

- ``latency_cdf.png``: the distribution of OK latencies (from the intended send time) of each
  step and target, on a log scale;
- ``load_curve.png``: answers/s (and goodput/s with a deadline) and p99 latency against the
  offered load (concurrency or mean arrival rate) across the sweep, one line per target.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

CDF_POINTS = 2000  # enough for a smooth curve without drawing every request


class PlotError(RuntimeError):
    pass


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotError("--plot needs matplotlib: pip install 'batchgate[plots]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(directory: Path, steps: Sequence[dict], latencies_s: Mapping[tuple[int, str], np.ndarray],
                x_label: str, x_values: Mapping[int, float]) -> list[Path]:
    """Both PNGs in ``directory``; ``latencies_s`` are the OK latencies per (step, target)."""
    plt = _pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    return [_cdf(plt, directory / "latency_cdf.png", steps, latencies_s),
            _load_curve(plt, directory / "load_curve.png", steps, x_label, x_values)]


def _cdf(plt, path: Path, steps: Sequence[dict], latencies_s) -> Path:
    from matplotlib import ticker  # matplotlib is there: _pyplot imported it

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in steps:
        values = np.sort(latencies_s.get((s["step"], s["target"]), np.empty(0))) * 1e3
        if not values.size:
            continue
        picks = np.unique(np.linspace(0, values.size - 1, min(values.size, CDF_POINTS)).astype(int))
        label = s["label"] + (f" ({s['target']})" if s["target"] != "base" else "")
        ax.step(values[picks], (picks + 1) / values.size, where="post", label=label)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _pos: f"{value:g}"))
    ax.set_xlabel("latency from intended send time (ms)")
    ax.set_ylabel("fraction of OK answers")
    ax.set_ylim(0, 1.01)
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _load_curve(plt, path: Path, steps: Sequence[dict], x_label: str, x_values) -> Path:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True)
    for target in dict.fromkeys(s["target"] for s in steps):
        mine = sorted((s for s in steps if s["target"] == target), key=lambda s: x_values[s["step"]])
        x = [x_values[s["step"]] for s in mine]
        top.plot(x, [_nan(s["throughput_per_s"]) for s in mine], marker="o", label=f"{target} answers/s")
        if any(s["goodput_per_s"] is not None for s in mine):
            top.plot(x, [_nan(s["goodput_per_s"]) for s in mine], marker="x", linestyle="--",
                     label=f"{target} goodput/s")
        bottom.plot(x, [_nan(s["latency_ms"]["p99"]) for s in mine], marker="o", label=f"{target} p99")
    top.set_ylabel("per second")
    bottom.set_ylabel("p99 latency (ms)")
    bottom.set_xlabel(x_label)
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value
