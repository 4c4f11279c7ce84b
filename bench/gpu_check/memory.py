"""(b) memory: our pool and PyTorch's caching allocator on the same synthetic traces, then what
the server itself allocates, each allocator setting in a process of its own."""

from __future__ import annotations

import os
import subprocess
from typing import Any

from batchgate.bench.gpu_check.children import gpu_check_command, marked_json, run_child
from batchgate.bench.gpu_check.machine import describe_allocator
from batchgate.bench.gpu_check.pool_trace import (LIVE_INPUTS, LIVE_OUTPUTS, POOL_TRACE_SEEDS,
                                                  pool_trace_figure)
from batchgate.bench.gpu_check.report import ERROR, FAIL, INFO, PASS, SKIP, Budget, Report
from batchgate.bench.gpu_check.server_trace import SERVER_TRACE_MODES

# The caching allocator's settings the synthetic trace is replayed under (PYTORCH_ALLOC_CONF):
# each given explicitly, as gpu_env.configure() would otherwise turn expandable segments on.
ALLOC_CONFS = (("default", "expandable_segments:False"),
               ("expandable_segments", "expandable_segments:True"))
SUBPROCESS_TIMEOUT_S = 45.0
MEMORY_TARGET = 0.9  # device bytes in use / reserved on the server trace, with pools


def section_memory(report: Report, budget: Budget, device: str) -> None:
    """Our arenas on the synthetic trace, sized as the server sizes them; on a GPU the caching
    allocator on the same trace, then what the server allocates while it serves, each
    allocator setting in its own process."""
    mib = 2**20
    per_seed = [pool_trace_figure(device, seed) for seed in POOL_TRACE_SEEDS]
    ours = {"ratio": sum(r["peak_in_use_fraction"] for r in per_seed) / len(per_seed),
            "min_ratio": min(r["peak_in_use_fraction"] for r in per_seed),
            "refused": sum(r["refused"] for r in per_seed), "seeds": per_seed}
    report.add(
        "b", f"batchgate arenas, mixed traces, on {device}",
        f"peak in use / reserved {ours['ratio']:.1%} on average, {ours['min_ratio']:.1%} at "
        f"worst, over {len(per_seed)} seeded traces, each model's arena reserved up front for "
        f"its limits (its {LIVE_INPUTS} largest inputs and {LIVE_OUTPUTS} largest outputs, as "
        f"a plan is sized: not from the trace's peak); "
        f"{min(r['bytes_reserved'] for r in per_seed) / mib:.1f}-"
        f"{max(r['bytes_reserved'] for r in per_seed) / mib:.1f} MiB reserved; "
        f"{ours['refused']} of {sum(r['allocations'] for r in per_seed)} allocations refused "
        "within their plan (fragmentation inside an arena)", INFO, **ours)
    if not device.startswith("cuda"):
        report.add("b", "caching allocator, same traces", "needs a CUDA device", SKIP)
        server_trace_rows(report, budget, device)
        return
    theirs = {}
    for label, conf in ALLOC_CONFS:
        check = f"caching allocator, {label}, same traces"
        result = alloc_child(report, budget, conf, "--_alloc-replay", "ALLOC_REPLAY ", check)
        if result is None:
            continue
        theirs[label] = result["ratio"]
        report.add(
            "b", check, f"peak allocated / peak reserved {result['ratio']:.1%} on average, "
            f"{result['min_ratio']:.1%} at worst; {describe_allocator(result['allocator'])}",
            INFO, **result)
    if theirs:
        report.add(
            "b", "arenas vs caching allocator, same traces",
            f"arenas {ours['ratio']:.1%} vs " + ", ".join(f"{k} {v:.1%}"
                                                         for k, v in theirs.items())
            + ": not a fragmentation comparison. An arena reserved up front holds its model's "
            "worst case for as long as the model is loaded, where the caching allocator "
            "reserves on demand; what the arenas show is whether their plan ever refuses. The "
            "memory target is read on the server trace below.", INFO, arenas=ours["ratio"],
            caching_allocator=theirs)
    server_trace_rows(report, budget, device)


def server_trace_rows(report: Report, budget: Budget, device: str) -> None:
    """What the server allocates while it serves: ``server_trace_main`` once per
    SERVER_TRACE_MODES entry, each in a process of its own (the allocator setting is read
    when CUDA starts)."""
    ratios: dict[str, float] = {}
    cuda = device.startswith("cuda")
    for index, (label, conf, pooled) in enumerate(SERVER_TRACE_MODES):
        if not cuda and index:  # on the CPU nothing is measured: one run tests the harness
            break
        check = f"server trace, {label}" + ("" if cuda else " (harness only, on cpu)")
        result = alloc_child(report, budget, conf, f"--_server-trace={device},{index}",
                             "SERVER_TRACE ", check)
        if result is None:
            failed = report.rows[-1]
            if pooled and failed.data.get("returncode", 0) < 0:
                # Killed by a signal while it served (an abort in the allocator is one): the
                # concurrent load did fail, whatever else is unknown.
                report.add("b", f"concurrent load, {label}",
                           f"the process died of signal {-failed.data['returncode']} while "
                           f"serving: {failed.result}", FAIL, target="concurrent",
                           died=failed.data["returncode"], device=device)
            elif pooled:
                report.unmeasured("concurrent", f"the server trace with pools did not run: "
                                  f"{failed.result}")
            continue
        served = (f"{result['requests']} requests from {result['clients']} clients over "
                  f"{len(result['models'])} models ({result['instances']} instances x "
                  f"{result['inflight_batches']} batches in flight each) at mixed batch sizes, "
                  f"'{result['unloaded']}' unloaded and '{result['loaded']}' loaded while the "
                  f"rest served; {result['failed']} failed, {result['wrong']} wrong"
                  + (f" (most: {next(iter(result['errors']))})" if result["errors"] else "")
                  + ("; " + "; ".join(result["problems"]) if result["problems"] else ""))
        status = INFO if result["correct"] else FAIL
        allocator = describe_allocator(result["allocator"])
        if pooled:
            report.add("b", f"concurrent load, {label}" + ("" if cuda else " (on cpu)"), served,
                       PASS if result["correct"] else FAIL, target="concurrent",
                       **{k: result[k] for k in ("requests", "failed", "wrong", "errors",
                                                 "problems", "instances", "inflight_batches",
                                                 "device")})
        if result.get("ratio_mean") is None:
            report.add("b", check, f"device figures unmeasured on the CPU; {served}", status,
                       **result)
            continue
        ratios[label] = result["ratio_mean"]
        report.add(
            "b", check,
            f"device in use / reserved {result['ratio_mean']:.1%} on average over "
            f"{result['samples']} samples taken while serving, {result['ratio_p10']:.1%} at "
            f"the 10th percentile, {result['ratio_at_peak_reserved']:.1%} at the peak reserved "
            f"({result['peak_reserved'] / 2**20:.0f} MiB); {allocator}", status, **result)
        graph = result.get("graph_model")
        if graph is not None:
            report.add("b", "graph model loaded while others serve",
                       f"{graph['status']}; {graph['failed']} failed, {graph['wrong']} wrong",
                       PASS if graph["ok"] else FAIL, **graph)
    pools = ratios.get(SERVER_TRACE_MODES[0][0])
    default = ratios.get(SERVER_TRACE_MODES[1][0])
    if pools is None or default is None:
        if cuda:
            report.unmeasured("memory", "the server trace did not give "
                              + " and ".join(label for label in
                                             (SERVER_TRACE_MODES[0][0], SERVER_TRACE_MODES[1][0])
                                             if label not in ratios) + "'s figure")
        return
    report.add("b", "per-model pools vs PyTorch, while serving",
               f"pools {pools:.1%} vs " + ", ".join(f"{k} {v:.1%}" for k, v in ratios.items()
                                                    if k != SERVER_TRACE_MODES[0][0]),
               INFO, target="memory", pools=pools, default=default,
               others={k: v for k, v in ratios.items() if k != SERVER_TRACE_MODES[0][0]})


def alloc_child(report: Report, budget: Budget, conf: str, flag: str, marker: str,
                label: str) -> dict[str, Any] | None:
    """Run gpu_check's ``flag`` child under ``PYTORCH_ALLOC_CONF=conf`` alone (read when CUDA
    starts, hence a process each); its marked JSON line, or None with an ERROR/SKIP row."""
    timeout = min(SUBPROCESS_TIMEOUT_S, budget.left())
    if timeout < 10:
        report.add("b", label, "not run: over the section's budget", SKIP)
        return None
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env["PYTORCH_ALLOC_CONF"] = conf
    try:
        out = run_child(gpu_check_command(flag), env=env, timeout_s=timeout)
    except subprocess.TimeoutExpired:
        report.add("b", label, f"the subprocess ran past {timeout:.0f} s", ERROR)
        return None
    result = marked_json(out.stdout, marker)
    if out.returncode != 0 or result is None:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        report.add("b", label, f"subprocess exit {out.returncode}: {tail}", ERROR,
                   returncode=out.returncode, stderr_tail=out.stderr.strip().splitlines()[-20:])
        return None
    return result
