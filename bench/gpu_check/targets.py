"""The GPU targets, each read from the rows that measured it: MET or NOT MET with its figures,
or UNMEASURED with why (never a verdict for a figure nobody measured).

A row measures a target when its data names it (``target=KEY``); a section that finds it
cannot measure one says why (``Report.unmeasured``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from batchgate.bench.gpu_check.report import MET, NOT_MET, UNMEASURED, Report, Row

H2D_TARGET = 0.05  # of a batch's time
MEMORY_TARGET = 0.9  # device bytes in use / reserved, while serving
AMP_TARGET = 1.8  # amp-fp16 over fp32, ResNet-50 in process
GATEWAY_TARGET = 0.9  # gateway amp-fp16 + graphs over the same in process
BUSY_TARGET = 95.0  # NVML utilisation %, under saturating load


@dataclasses.dataclass(frozen=True)
class Target:
    key: str
    title: str
    sections: str  # the sections whose rows measure it
    judge: Callable[[list[Row]], tuple[str, str]]  # its rows -> (status, figures)


def _concurrent(rows: list[Row]) -> tuple[str, str]:
    row = rows[-1].data
    if "died" in row:
        return NOT_MET, rows[-1].result
    ok = row["requests"] > 0 and row["failed"] == 0 and row["wrong"] == 0 and not row["problems"]
    text = (f"{row['requests']} requests, {row['failed']} failed, {row['wrong']} wrong, "
            f"{row['instances']} instances x {row['inflight_batches']} batches in flight each, "
            "per-model pools")
    if row["errors"]:
        text += f"; most: {next(iter(row['errors']))}"
    return (MET if ok else NOT_MET), text


def _correct(rows: list[Row]) -> tuple[str, str]:
    failed = [r.check for r in rows if r.status != "PASS"]
    text = f"{len(rows) - len(failed)} of {len(rows)} paths within their bounds"
    if failed:
        text += "; not: " + ", ".join(failed[:4]) + (" ..." if len(failed) > 4 else "")
    return (NOT_MET if failed else MET), text


def _memory(rows: list[Row]) -> tuple[str, str]:
    data = rows[-1].data
    pools, default = data["pools"], data["default"]
    ok = pools >= MEMORY_TARGET and pools > default
    others = ", ".join(f"{k} {v:.1%}" for k, v in data["others"].items())
    return (MET if ok else NOT_MET), f"pools {pools:.1%} (>= {MEMORY_TARGET:.0%}?) vs {others}"


def _amp(rows: list[Row]) -> tuple[str, str]:
    speedup = rows[-1].data["speedup_vs_fp32"]
    return (MET if speedup >= AMP_TARGET else NOT_MET), f"{speedup:.2f} x fp32"


def _gateway(rows: list[Row]) -> tuple[str, str]:
    ratios = {r.data["model"].removesuffix("_graphs"): r.data["ratio_vs_inprocess"] for r in rows}
    errors = sum(r.data["errors"] for r in rows)
    ok = errors == 0 and all(v >= GATEWAY_TARGET for v in ratios.values())
    text = ", ".join(f"{k} {v:.2f} x" for k, v in ratios.items())
    return (MET if ok else NOT_MET), text + (f"; {errors} errors" if errors else "")


def _h2d(rows: list[Row]) -> tuple[str, str]:
    data = rows[-1].data
    ok = data["share"] <= H2D_TARGET
    return (MET if ok else NOT_MET), (
        f"{data['share']:.1%} of copy + forward on the device ({data['copy_ms']:.3f} of "
        f"{data['copy_ms'] + data['forward_ms']:.2f} ms, staged while queued); "
        f"{data['exposed_share']:.1%} with the compute stream idle")


def _busy(rows: list[Row]) -> tuple[str, str]:
    measured = [r for r in rows if r.data.get("samples")]
    if not measured:
        return UNMEASURED, "NVML gave no samples during the loads"
    best = max(measured, key=lambda r: r.data["mean_pct"])
    text = ", ".join(f"{r.data['model']} {r.data['mean_pct']:.0f} %" for r in measured)
    return (MET if best.data["mean_pct"] >= BUSY_TARGET else NOT_MET), text


TARGETS = (
    Target("concurrent", "no batch fails under concurrent load (2 instances x 2 in flight)",
           "b", _concurrent),
    Target("correct", "answers equal fp32 on the CPU within the precision bounds", "a",
           _correct),
    Target("memory", f"device in use / reserved >= {MEMORY_TARGET:.0%} serving, above "
           "PyTorch's default", "b", _memory),
    Target("amp", f"amp-fp16 >= {AMP_TARGET} x fp32 on ResNet-50", "c", _amp),
    Target("gateway", f"gateway >= {GATEWAY_TARGET} x in-process amp-fp16 + graphs", "c",
           _gateway),
    Target("h2d", f"host-to-device on the critical path <= {H2D_TARGET:.0%} of a batch", "d",
           _h2d),
    Target("busy", f"GPU busy >= {BUSY_TARGET:.0f} % under saturating load (ResNet-50)", "e",
           _busy),
)


def target_rows(report: Report, target: Target) -> list[Row]:
    if target.key == "correct":
        return [r for r in report.rows if r.section == "a"]
    return [r for r in report.rows
            if r.section != "targets" and r.data.get("target") == target.key]


def evaluate(report: Report, device: str, sections: set[str]) -> None:
    """One row per target in section "targets"."""
    for target in TARGETS:
        status, text = UNMEASURED, ""
        if not device.startswith("cuda"):
            text = "needs a CUDA device: this run is on the CPU, its rows test the harness only"
        elif not set(target.sections) & sections:
            text = f"section ({target.sections}) was not part of this run (--sections)"
        else:
            rows = target_rows(report, target)
            if rows:
                status, text = target.judge(rows)
            reasons = report.unmeasured_reasons.get(target.key, [])
            if status == UNMEASURED or not rows:
                status = UNMEASURED
                text = "; ".join(dict.fromkeys(reasons)) or text or \
                    "no row measured it (see the section's rows above)"
            elif reasons:  # judged on what was measured; the rest said so
                text += "; unmeasured: " + "; ".join(dict.fromkeys(reasons))
        report.add("targets", target.title, text, status, target=target.key)


def unmeasured_without_gpu(reason: str) -> dict[str, str]:
    """Every target's title -> ``reason``: the run that had no GPU to measure any of them."""
    return {target.title: reason for target in TARGETS}
