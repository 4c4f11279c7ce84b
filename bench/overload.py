"""Overload: goodput at several times the server's capacity, with and without admission control.

One run, one machine, with ``batchgate bench`` as the load (a subprocess, ``--json``):

1. the server (``batchgate serve``, one model) is started;
2. **capacity**: ``batchgate bench`` in closed loop at concurrency 64: the answers/s the server
   sustains when it is never offered more than it takes;
3. **overload**: open loop, Poisson arrivals at ``--factor`` × capacity (5 by default), every
   request with a deadline (``--deadline-ms``) that the server is told (the gRPC deadline and the
   ``timeout`` parameter), goodput = OK answers within the deadline per second;
4. the same overload against the same model with ``admission: false`` (a second server, started
   after the first has stopped), so the run shows what admission control buys.

The figure: goodput at overload ÷ capacity (the bar: ≥ 0.9 at 5×), and the errors by
status code: what the server refused at once (RESOURCE_EXHAUSTED) rather than let expire.
Capacity counts the answers within the measured window (``batchgate.bench.serving.closed_loop_capacity``),
the overload rates the answers to the requests sent in it; both per second of the window.

    python -m batchgate.bench.overload [--model cnn] [--factor 5] [--deadline-ms 200] [--seconds 10]
    python -m batchgate.bench.overload --synthetic-ms 20,1.5     # a model whose batches take 20 + 1.5 n ms

``--synthetic-ms`` serves bench/deadline.py's synthetic model (it sleeps, as a GPU kernel would
keep the host idle), so that the model, not the gRPC front end, sets capacity: the case
admission control is for. With a fast model on a small machine the front end saturates first,
and refusing a request costs it about as much as answering it.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

from batchgate.bench.output import emit, progress
from batchgate.bench.machine import machine
from batchgate.bench.steps import (
    CAPACITY_CONCURRENCY,
    DEFAULT_REPOSITORY,
    RUN_ERRORS,
    BenchError,
    bench_step,
    closed_loop_capacity,
    single_model_repository,
    start_server,
    window_goodput,
)

TARGET = 0.9


def bench(url: str, model: str, args: list[str], metrics_url: str) -> dict[str, Any]:
    """One ``batchgate bench`` step; its JSON step, with the command that made it."""
    step, command, _, _ = bench_step(url, model, args, metrics_url)
    step["command"] = command
    return step


def measure(repository: Path, model: str, parameters: dict[str, str] | None,
            options: argparse.Namespace, capacity: float | None) -> dict[str, Any]:
    """Capacity (unless given) and the overload step against one server."""
    with single_model_repository(repository, model, parameters) as serving:
        server = start_server(serving, "auto", model)
        try:
            url, metrics_url = server.address, server.metrics_url
            seconds = ["--warmup-s", "2", "--duration-s", f"{options.seconds:g}"]
            result: dict[str, Any] = {}
            if capacity is None:
                _say("capacity: closed loop, concurrency 64 ...")
                closed = bench(url, model, ["--concurrency", str(CAPACITY_CONCURRENCY), *seconds], metrics_url)
                capacity = closed_loop_capacity(closed, CAPACITY_CONCURRENCY, options.seconds)
                result["capacity_step"] = closed
            rate = options.factor * capacity
            _say(f"overload: Poisson {rate:,.0f}/s ({options.factor:g} x {capacity:,.0f}/s), "
                 f"deadline {options.deadline_ms:g} ms ...")
            result["overload_step"] = bench(url, model, [
                "--rate", f"{rate:.0f}", "--arrival", "poisson",
                "--deadline-ms", f"{options.deadline_ms:g}", "--enforce-deadline", "both",
                "--drain-timeout-s", "30", *seconds,
            ], metrics_url)
        finally:
            exit_code = server.stop()
    if exit_code != 0:
        raise BenchError(f"the server exited {exit_code}:\n{server.log_tail()}")
    result["capacity_per_s"] = capacity
    result["offered_per_s"] = rate
    # The goodput over the measured window (see window_goodput); open loop, it has no tail of
    # closed-loop clients' answers to discount.
    result["goodput_per_s"] = window_goodput(result["overload_step"], options.seconds)
    result["goodput_ratio"] = result["goodput_per_s"] / capacity
    return result


def render(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        f"machine: {m['usable_cores']} usable cores, {m['cpu_model']}, Python {m['python']}",
        f"model {report['model']}; overload {report['factor']:g} x capacity, Poisson, deadline "
        f"{report['deadline_ms']:g} ms (sent as gRPC deadline and timeout parameter), "
        f"{report['seconds']:g} s measured per step",
        "",
        f"capacity (closed loop c=64)            {report['capacity_per_s']:,.0f} answers/s",
        "(capacity: answers within the measured window; overload: answers to the requests sent "
        "in it; per second of the window)",
    ]
    for key, label in (("admission", "admission control on (default)"),
                       ("no_admission", "admission: false")):
        r = report[key]
        step = r["overload_step"]
        errors = ", ".join(f"{k} {v:,}" for k, v in sorted(step["errors"].items())) or "none"
        lines += [
            "",
            f"{label}:",
            f"  offered                              {step['offered_per_s']:,.0f} /s",
            f"  answered OK                          {step['ok'] / report['seconds']:,.0f} /s",
            f"  goodput (OK within the deadline)     {r['goodput_per_s']:,.0f} /s",
            f"  goodput / capacity                   {r['goodput_ratio']:.2f}"
            + (f"   (target >= {TARGET:.1f})" if key == "admission" else ""),
            f"  p50 / p99 of OK answers              {_ms(step['latency_ms']['p50'])} / "
            f"{_ms(step['latency_ms']['p99'])} ms",
            f"  errors                               {errors}",
        ]
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


_say = progress("batchgate.bench.overload")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchgate.bench.overload",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn", help="model to overload (default: %(default)s)")
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_REPOSITORY)
    parser.add_argument("--factor", type=float, default=5.0,
                        help="offered load as a multiple of capacity (default: %(default)s)")
    parser.add_argument("--deadline-ms", type=float, default=200.0,
                        help="per-request deadline (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="measured seconds per step (default: %(default)s)")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    parser.add_argument("--synthetic-ms", default=None, metavar="FIXED,PER_SAMPLE",
                        help="serve a synthetic model whose batch of n takes FIXED + PER_SAMPLE "
                             "x n ms instead of --model")
    options = parser.parse_args(argv)
    try:
        with contextlib.ExitStack() as stack:
            if options.synthetic_ms:
                from batchgate.bench.deadline import synthetic_repository

                fixed, per_sample = (float(v) for v in options.synthetic_ms.split(","))
                options.model_repository = stack.enter_context(
                    synthetic_repository(fixed, per_sample))
                options.model = "synthetic"
            with_admission = measure(options.model_repository, options.model, None, options, None)
            without = measure(options.model_repository, options.model, {"admission": "false"},
                              options, with_admission["capacity_per_s"])
    except RUN_ERRORS as exc:
        print(f"batchgate.bench.overload: {exc}", file=sys.stderr)
        return 1
    report = {
        "machine": machine(), "model": options.model, "factor": options.factor,
        "deadline_ms": options.deadline_ms, "seconds": options.seconds,
        "capacity_per_s": with_admission["capacity_per_s"],
        "admission": with_admission, "no_admission": without,
        "target": TARGET, "pass": with_admission["goodput_ratio"] >= TARGET,
    }
    return emit(report, render, options.json)


if __name__ == "__main__":
    sys.exit(main())
