"""The run: the flags, the sections in order within their budgets, the table, the watchdog."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from batchgate.bench.gpu_check.children import kill_children
from batchgate.bench.gpu_check.correctness import (CPU_VARIANTS, EXAMPLE_MODELS, GPU_VARIANTS,
                                         section_correctness)
from batchgate.bench.gpu_check.cuda_tests import section_pytest
from batchgate.bench.gpu_check.gather import section_gather
from batchgate.bench.gpu_check.h2d import section_h2d
from batchgate.bench.gpu_check.machine import (allocator_in_force, allocator_settings,
                                               ensure_structlog, machine_facts, print_machine,
                                               project_imports)
from batchgate.bench.gpu_check.memory import section_memory
from batchgate.bench.gpu_check.pool_trace import alloc_replay_main
from batchgate.bench.gpu_check.server_trace import server_trace_main
from batchgate.bench.gpu_check.throughput import section_throughput
from batchgate.bench.gpu_check.workloads import CPU_THROUGHPUT, GPU_THROUGHPUT
from batchgate.bench.gpu_check.report import ERROR, HARD_LIMIT_S, SKIP, Report, run_section, say
from batchgate.bench.gpu_check.targets import evaluate, unmeasured_without_gpu

# Time budgets (seconds): the whole run must stay well under 8 minutes.
A_BUDGET_S = 65.0
D_BUDGET_S = 35.0
B_BUDGET_S = 140.0  # the synthetic traces, and five child processes: two replays, three traces
C_BUDGET_S = 100.0
T_BUDGET_S = 85.0  # pytest -m cuda


def finish(report: Report, json_path: Path | None, exit_code: int) -> int:
    if not any(row.section == "targets" for row in report.rows):
        evaluate(report, report.machine.get("device", "cpu"),
                 set(report.machine.get("sections", ())))
    say("")
    print_machine(report)
    say(report.table())
    say(f"gpu_check: {report.elapsed():.0f} s, exit {exit_code}"
        + (" (a correctness check failed or did not run)" if exit_code == 1 else ""))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report.to_json(exit_code), indent=2, default=str))
    return exit_code


def start_watchdog(report: Report, json_path: Path | None) -> None:
    """At HARD_LIMIT_S: stacks to stderr, then the table so far, then exit 3 (children too)."""

    def fire() -> None:
        time.sleep(max(0.0, HARD_LIMIT_S - report.elapsed()))
        sys.stderr.write(f"gpu_check: watchdog: {HARD_LIMIT_S:.0f} s passed; stacks:\n")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        kill_children()
        report.add("run", "watchdog", f"the run passed {HARD_LIMIT_S:.0f} s and was stopped", ERROR)
        with contextlib.suppress(Exception):
            finish(report, json_path, 3)
        sys.stdout.flush()
        os._exit(3)

    threading.Thread(target=fire, name="watchdog", daemon=True).start()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m batchgate.bench.gpu_check",
        description="Check and measure batchgate's GPU paths (see the package docstring).")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write every figure here")
    parser.add_argument("--cpu", action="store_true",
                        help="run section (a) on the CPU (fp32, amp-bf16, staging) to test the "
                             "harness, and (b)'s trace through our pool")
    parser.add_argument("--sections", default=None,
                        help="comma-separated subset of a,b,c,d,e (default: all; with --cpu: "
                             "a,b)")
    parser.add_argument("--models", default=",".join(EXAMPLE_MODELS),
                        help="example models for section (a)")
    parser.add_argument("--_alloc-replay", dest="alloc_replay", action="store_true",
                        help=argparse.SUPPRESS)
    parser.add_argument("--_server-trace", dest="server_trace", default=None,
                        help=argparse.SUPPRESS)
    parser.add_argument("--pytest", action=argparse.BooleanOptionalAction, default=None,
                        help="run `pytest -m cuda` at the end (default: on a GPU, not with "
                             "--cpu, where the cuda tests skip and say why)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # First, in every process of the check: the allocator reads its settings once, when CUDA
    # starts, and the gateway serves with what configure() sets in production (children get
    # their setting in the environment, which configure() then leaves as it is).
    from batchgate.batcher.gpu_env import configure

    configured = configure()
    if args.alloc_replay:
        return alloc_replay_main({**allocator_settings(configured),
                                  **allocator_in_force("cuda:0")})
    if args.server_trace is not None:
        ensure_structlog()
        device = args.server_trace.split(",")[0]
        allocator = allocator_settings(configured)
        if device.startswith("cuda"):
            allocator.update(allocator_in_force(device))
        return server_trace_main(args.server_trace, allocator)

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu:
        reason = (f"no GPU present (torch {torch.__version__}: torch.cuda.is_available() is "
                  "False)")
        say(f"gpu_check: {reason}; every GPU figure is unmeasured. `--cpu` tests the harness "
            "on the CPU.")
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"cuda": False, "torch": torch.__version__,
                                             "unmeasured": unmeasured_without_gpu(reason)}))
        return 0

    device = "cpu" if args.cpu else "cuda:0"
    sections = set((args.sections or ("a,b" if args.cpu else "a,b,c,d,e")).split(","))
    unknown = sections - set("abcde")
    if unknown:
        raise SystemExit(f"--sections takes letters among a,b,c,d,e, got {sorted(unknown)}")
    models = [m for m in args.models.split(",") if m]

    report = Report()
    start_watchdog(report, args.json)
    report.machine = machine_facts(device)
    report.machine["structlog_note"] = ensure_structlog()
    report.machine["imports"] = project_imports()
    report.machine["device"] = device
    report.machine["sections"] = sorted(sections)
    report.machine["allocator"] = allocator_settings(configured)
    if cuda and not args.cpu:
        report.machine["allocator"].update(allocator_in_force(device))
    print_machine(report)

    variants = CPU_VARIANTS if args.cpu else GPU_VARIANTS
    if "a" in sections:
        run_section(report, "a", A_BUDGET_S,
                    lambda r, b: section_correctness(r, b, device, variants, models))
    if "d" in sections:
        if args.cpu:
            report.add("d", "section", "needs a CUDA device", SKIP)
        else:
            run_section(report, "d", D_BUDGET_S,
                        lambda r, b: (section_h2d(r, b), section_gather(r, b)))
    if "b" in sections:
        run_section(report, "b", B_BUDGET_S, lambda r, b: section_memory(r, b, device))
    if sections & {"c", "e"}:
        settings = CPU_THROUGHPUT if args.cpu else GPU_THROUGHPUT
        run_section(report, "c", C_BUDGET_S, lambda r, b: section_throughput(r, b, settings))
    if args.pytest if args.pytest is not None else cuda and not args.cpu:
        run_section(report, "t", T_BUDGET_S, section_pytest)
    return finish(report, args.json, 1 if report.correctness_failed() else 0)

