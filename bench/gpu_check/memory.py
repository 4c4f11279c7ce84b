"""(b) memory: our pool and PyTorch's caching allocator on the same synthetic traces, then what
the server itself allocates, each allocator setting in a process of its own."""

from __future__ import annotations

import os
import subprocess
from typing import Any

from batchgate.bench.gpu_check.children import gpu_check_command, marked_json, run_child
from batchgate.bench.gpu_check.pool_trace import POOL_TRACE_SEEDS, pool_trace_figure
from batchgate.bench.gpu_check.report import ERROR, FAIL, INFO, PASS, SKIP, Budget, Report
from batchgate.bench.gpu_check.server_trace import SERVER_TRACE_MODES

ALLOC_CONFS = ("", "expandable_segments:True")
SUBPROCESS_TIMEOUT_S = 40.0


def section_memory(report: Report, budget: Budget, device: str) -> None:
    """Our pool on the allocation trace; on a GPU, the caching allocator on the same trace and
    on real forwards of several models, each allocator setting in its own process."""
    mib = 2**20
    per_seed = [pool_trace_figure(device, seed) for seed in POOL_TRACE_SEEDS]
    ours = {"ratio": sum(r["peak_in_use_fraction"] for r in per_seed) / len(per_seed),
            "min_ratio": min(r["peak_in_use_fraction"] for r in per_seed), "seeds": per_seed}
    report.add(
        "b", f"batchgate pool, mixed traces, on {device}",
        f"peak in use / reserved {ours['ratio']:.1%} on average, {ours['min_ratio']:.1%} at "
        f"worst, over {len(per_seed)} seeded traces (each in the smallest arena that serves it; "
        f"peak live {min(r['peak_live_bytes'] for r in per_seed) / mib:.1f}-"
        f"{max(r['peak_live_bytes'] for r in per_seed) / mib:.1f} MiB; "
        f"{sum(r['refused'] for r in per_seed)} refused)", INFO, **ours)
    if not device.startswith("cuda"):
        report.add("b", "caching allocator, same trace", "needs a CUDA device", SKIP)
        server_trace_rows(report, budget, device)
        return
    theirs = {}
    for conf in ALLOC_CONFS:
        result = alloc_child(report, budget, conf, "--_alloc-replay", "ALLOC_REPLAY ",
                             f"caching allocator, {conf or 'default'}, same trace")
        if result is None:
            continue
        theirs[conf or "default"] = result["ratio"]
        report.add(
            "b", f"caching allocator, {conf or 'default'}, same traces",
            f"peak in use / peak reserved {result['ratio']:.1%} on average, "
            f"{result['min_ratio']:.1%} at worst", INFO, **result)
    if theirs:
        met = ours["ratio"] >= 0.9 and all(ours["ratio"] > r for r in theirs.values())
        report.add("b", "pool vs caching allocator (target >= 90 % and above)",
                   f"ours {ours['ratio']:.1%} vs "
                   + ", ".join(f"{k} {v:.1%}" for k, v in theirs.items())
                   + (": met" if met else ": not met"), INFO, met=met)
    server_trace_rows(report, budget, device)


def server_trace_rows(report: Report, budget: Budget, device: str) -> None:
    """The server's real footprint: ``server_trace_main`` once per SERVER_TRACE_MODES entry,
    each in a process of its own (the allocator setting is read when CUDA starts)."""
    ratios: dict[str, float] = {}
    cuda = device.startswith("cuda")
    for index, (label, conf, pooled) in enumerate(SERVER_TRACE_MODES):
        if not cuda and index:  # on the CPU nothing is measured: one run tests the harness
            break
        check = f"server trace, {label}" + ("" if cuda else " (harness only, on cpu)")
        result = alloc_child(report, budget, conf, f"--_server-trace={device},{index}",
                             "SERVER_TRACE ", check)
        if result is None:
            continue
        served = (f"{result['requests']} requests over {len(result['models'])} models at "
                  f"mixed batch sizes, '{result['unloaded']}' unloaded and "
                  f"'{result['loaded']}' loaded while the rest served, all answers "
                  f"{'correct' if result['correct'] else 'NOT correct'}")
        status = INFO if result["correct"] else FAIL
        if result.get("ratio_end") is None:
            report.add("b", check, f"{served}; device figures unmeasured on the CPU", status,
                       **result)
            continue
        ratios[label] = result["ratio_mean"]
        report.add(
            "b", check,
            f"device in use / reserved {result['ratio_mean']:.1%} on average over the trace, "
            f"{result['ratio_min']:.1%} at worst, {result['ratio_end']:.1%} at its end "
            f"(peak reserved {result['peak_reserved'] / 2**20:.0f} MiB); {served}", status,
            **result)
        graph = result.get("graph_model")
        if graph is not None:
            report.add("b", "graph model loaded while another serves",
                       f"{graph['status']}; max relative error {graph['error']:.2e}",
                       PASS if graph["ok"] else FAIL, **graph)
    ours = ratios.get(SERVER_TRACE_MODES[0][0])
    if ours is not None and len(ratios) > 1:
        others = {k: v for k, v in ratios.items() if k != SERVER_TRACE_MODES[0][0]}
        met = ours >= 0.9 and all(ours > v for v in others.values())
        report.add("b", "per-model pools vs PyTorch (target >= 90 % and above)",
                   f"pools {ours:.1%} vs " + ", ".join(f"{k} {v:.1%}" for k, v in others.items())
                   + (": met" if met else ": not met"), INFO, met=met)


def alloc_child(report: Report, budget: Budget, conf: str, flag: str, marker: str,
                label: str) -> dict[str, Any] | None:
    """Run gpu_check's ``flag`` child under ``PYTORCH_CUDA_ALLOC_CONF=conf`` (read when CUDA
    starts, hence a process each); its marked JSON line, or None with an ERROR/SKIP row."""
    timeout = min(SUBPROCESS_TIMEOUT_S, budget.left())
    if timeout < 10:
        report.add("b", label, "not run: over the section's budget", SKIP)
        return None
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("PYTORCH_ALLOC_CONF", None)
    if conf:
        env["PYTORCH_ALLOC_CONF"] = conf
    try:
        out = run_child(gpu_check_command(flag), env=env, timeout_s=timeout)
    except subprocess.TimeoutExpired:
        report.add("b", label, f"the subprocess ran past {timeout:.0f} s", ERROR)
        return None
    result = marked_json(out.stdout, marker)
    if out.returncode != 0 or result is None:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        report.add("b", label, f"subprocess exit {out.returncode}: {tail}", ERROR)
        return None
    return result
