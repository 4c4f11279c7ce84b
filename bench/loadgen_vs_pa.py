"""How hard ``batchgate bench`` drives a server, against Triton's ``perf_analyzer``, in one run.

The bar: one ``batchgate bench`` process drives at least 70 % of the rate
``perf_analyzer`` drives against the same server at concurrency 64. Both are closed loops of 64
requests in flight, against one server (started here, serving only the model), in rounds that
alternate which of the two goes first, so the drift of a shared machine touches both alike.
Each round's ratio is bench ÷ perf_analyzer; the median, min and max are reported (the spread
is the noise), with the cores used meanwhile by the load generator (its whole process, start-up
included), by the server, and by everything else on the machine (other work on a shared machine
is what makes a round an outlier). perf_analyzer's stability criterion is loosened (20 %, then
50 %, then 100 %) when the machine will not let it settle: only its rate is wanted.

    python -m batchgate.bench.loadgen_vs_pa [--model mlp] [--rounds 3] [--seconds 5] [--workers 1]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from batchgate.bench.output import emit, progress
from batchgate.bench._perf_analyzer import (
    DEFAULT_PERF_ANALYZER,
    run_perf_analyzer,
)
from batchgate.bench.machine import machine, machine_busy_s, process_cpu_s
from batchgate.bench.steps import (
    DEFAULT_REPOSITORY,
    RUN_ERRORS,
    BenchError,
    single_model_repository,
    start_server,
)

CONCURRENCY = 64
TARGET_RATIO = 0.7
PA_STABILITY = (20.0, 50.0, 100.0)


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class _Window:
    """CPU use while one load generator runs: the server's, the generator's (a child of this
    process) and everything else on the machine, in cores."""

    def __init__(self, server_pid: int) -> None:
        self.pid = server_pid

    def __enter__(self) -> _Window:
        self.t0, self.busy0 = time.monotonic(), machine_busy_s()
        self.server0, self.child0 = process_cpu_s(self.pid), _children_cpu_s()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.monotonic() - self.t0
        self.server_cores = (process_cpu_s(self.pid) - self.server0) / wall
        self.generator_cores = (_children_cpu_s() - self.child0) / wall
        busy = (machine_busy_s() - self.busy0) / wall
        self.other_cores = max(0.0, busy - self.server_cores - self.generator_cores)

    def figures(self) -> dict[str, float]:
        return {"server_cores": self.server_cores, "generator_cores": self.generator_cores,
                "other_cores": self.other_cores}


def run_bench(url: str, model: str, seconds: float, workers: int) -> dict[str, Any]:
    """``batchgate bench`` at concurrency 64 as its own process, as perf_analyzer is."""
    with tempfile.TemporaryDirectory(prefix="loadgen-vs-pa-") as scratch:
        out = Path(scratch) / "bench.json"
        command = [sys.executable, "-m", "batchgate.bench.loadgen", "-u", url, "-m", model,
                   "--concurrency", str(CONCURRENCY), "--duration-s", f"{seconds:g}",
                   "--warmup-s", "1", "--workers", str(workers), "--quiet", "--json", str(out)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 120,
                              check=False)
        if done.returncode != 0:
            raise BenchError(f"batchgate bench exited {done.returncode}: {done.stderr[-2000:]}")
        (step,) = json.loads(out.read_text())["steps"]
    return {"throughput_per_s": step["throughput_per_s"], "p99_ms": step["latency_ms"]["p99"],
            "errors": step["errors"], "step_cores": step["client_cpu_cores"], "command": command}


def run_pa(url: str, model: str, seconds: float, perf_analyzer: Path) -> dict[str, Any]:
    # Only its rate matters here, and a shared machine rarely lets it settle within 20 %.
    perf = run_perf_analyzer(url=url, model=model, concurrency=CONCURRENCY,
                             measurement_interval_ms=int(seconds * 1000), perf_analyzer=perf_analyzer,
                             stability_percentages=PA_STABILITY)
    return {"throughput_per_s": perf.row.throughput_per_s, "p99_ms": perf.row.p99_ms,
            "stability_percentage": perf.stability_percentage, "command": perf.command}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    rounds = []
    with single_model_repository(args.model_repository.resolve(), args.model) as repository:
        server = start_server(repository, "auto", args.model, args.server_arg)
        try:
            url = server.address
            for index in range(args.rounds):
                pa_first = index % 2 == 0
                results = {}
                for tool in (("pa", "bench") if pa_first else ("bench", "pa")):
                    _say(f"round {index + 1}/{args.rounds}: {tool} at concurrency {CONCURRENCY}")
                    with _Window(server.pid) as window:
                        results[tool] = (run_pa(url, args.model, args.seconds, args.perf_analyzer)
                                         if tool == "pa" else
                                         run_bench(url, args.model, args.seconds, args.workers))
                    results[tool].update(window.figures())
                ratio = results["bench"]["throughput_per_s"] / results["pa"]["throughput_per_s"]
                rounds.append({"first": "perf_analyzer" if pa_first else "bench", "ratio": ratio,
                               **results})
        finally:
            exit_code = server.stop()
    ratios = [r["ratio"] for r in rounds]
    return {
        "machine": machine(),
        "model": args.model,
        "concurrency": CONCURRENCY,
        "seconds": args.seconds,
        "workers": args.workers,
        "server_args": args.server_arg,
        "rounds": rounds,
        "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                  "target": TARGET_RATIO, "pass": statistics.median(ratios) >= TARGET_RATIO},
        "server_exit_code": exit_code,
    }


def render(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        f"machine: {m['usable_cores']} usable cores of {m['cores']}, {m['cpu_model']}, "
        f"Python {m['python']}, grpcio {m['grpcio']}",
        f"model {report['model']}, concurrency {report['concurrency']}, {report['seconds']:g} s "
        f"windows, batchgate bench with {report['workers']} worker(s)",
        "",
        f"{'round':<6} {'first':<14} {'perf_analyzer /s':>17} {'bench /s':>9} {'ratio':>6} "
        f"{'p99 ms PA/bench':>16} {'generator cores PA/bench':>25} {'server cores':>13} "
        f"{'other cores':>12} {'PA stability':>13}",
    ]
    for i, r in enumerate(report["rounds"], 1):
        pa, bench = r["pa"], r["bench"]
        lines.append(
            f"{i:<6} {r['first']:<14} {pa['throughput_per_s']:>17,.0f} "
            f"{bench['throughput_per_s']:>9,.0f} {r['ratio']:>6.2f} "
            f"{pa['p99_ms']:>7.1f} / {bench['p99_ms']:<6.1f} "
            f"{pa['generator_cores']:>14.2f} / {bench['generator_cores']:<8.2f} "
            f"{pa['server_cores']:>5.2f}/{bench['server_cores']:<5.2f} "
            f"{pa['other_cores']:>5.2f}/{bench['other_cores']:<5.2f} "
            f"{pa['stability_percentage']:>12g}%")
    ratio = report["ratio"]
    lines.append(f"\nratio bench ÷ perf_analyzer: median {ratio['median']:.2f} (min {ratio['min']:.2f}, "
                 f"max {ratio['max']:.2f}); target ≥ {ratio['target']:.2f}: "
                 f"{'pass' if ratio['pass'] else 'short'}")
    return "\n".join(lines)


_say = progress("batchgate.bench.loadgen_vs_pa")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchgate.bench.loadgen_vs_pa",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", help="model to serve (default: %(default)s)")
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_REPOSITORY,
                        help="repository holding the model (default: the example models)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating rounds of both load generators (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=5.0,
                        help="measurement window of each (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=1,
                        help="batchgate bench --workers (default: %(default)s)")
    parser.add_argument("--perf-analyzer", type=Path, default=DEFAULT_PERF_ANALYZER,
                        help="perf_analyzer executable (default: scripts/perf_analyzer)")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="extra flag for the server, repeatable")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.seconds <= 0:
        parser.error("--rounds must be >= 1 and --seconds > 0")
    try:
        report = measure(args)
    except RUN_ERRORS as exc:
        print(f"batchgate.bench.loadgen_vs_pa: {exc}", file=sys.stderr)
        return 1
    return emit(report, render, args.json)


if __name__ == "__main__":
    sys.exit(main())
