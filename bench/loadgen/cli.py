"""``batchgate bench`` (also ``python -m batchgate.bench.loadgen``): the run, from the
``Options`` its command line gives (``batchgate.bench.loadgen.options``).

    batchgate bench -m mlp --concurrency 1,8,64
    batchgate bench -m mlp --rate 200,400 --arrival bursty --deadline-ms 50 --json out.json
    batchgate bench -m mlp --concurrency 64 --compare 127.0.0.1:9001 --metrics-url URL

Exit status: 0 after a run (whatever the server answered: errors are figures), 1 when the run
could not be made (no connection, an unknown model, a bad ``.npz``), 2 for a bad command line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import platform
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
import numpy as np

from batchgate.bench.loadgen import plan, scrape, stats
from batchgate.bench.loadgen.driver import (
    STEP_LEAD_S,
    DriverConfig,
    DriverError,
    StepRecords,
    Workers,
)
from batchgate.bench.loadgen.options import Options, build_parser, parse_options
from batchgate.bench.loadgen.report import SCHEMA_VERSION, comparison, render, write_json
from batchgate.bench.loadgen.workload import (
    DeadlineChoice,
    ModelInputs,
    PriorityChoice,
    WorkloadError,
    build_variants,
    describe_models,
)
from batchgate.protos import inference_pb2 as pb
from batchgate.protos import inference_pb2_grpc

TABLE_WIDTH = 150  # for a log or a pipe; a terminal's own width otherwise
CONNECT_TIMEOUT_S = 10.0


class BenchError(RuntimeError):
    """The run cannot be made; the message says why."""


# -- the run --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Target:
    name: str
    url: str
    metrics_url: str | None
    server: dict


@dataclasses.dataclass
class RunResult:
    report: dict
    latencies_s: dict[tuple[int, str], np.ndarray]  # OK latencies per (step, target name)
    x: dict[int, float]  # offered load per step, for plots
    x_label: str


def run(options: Options, console) -> RunResult:
    """Describe the models, plan the steps, run them, and gather every figure."""
    args = options.args
    targets = [Target("base", args.url, args.metrics_url, {})]
    if args.compare:
        targets.append(Target("compare", args.compare, args.compare_metrics_url, {}))
    models = _describe(targets, options)
    variants = build_variants(models, options.priorities, options.data, deadlines=options.deadlines,
                              timeout_parameter=args.enforce_deadline in ("parameter", "both"))
    steps = plan.build_steps(plan.RunShape(
        options.levels, len(targets), args.warmup_s, options.duration_s, args.requests,
        args.slice_s, _variant_weights(variants, options), args.seed))
    for target in targets:
        if target.metrics_url:
            scrape.scrape(target.metrics_url)  # fail now, not after the run
    figures = _Figures(options, models, variants)
    with Workers(_driver_config(options, targets, variants), args.workers) as workers, \
            _progress(console, args.quiet) as progress:
        for index, step in enumerate(steps):
            records, server = _run_step(workers, index, step, targets, progress, options,
                                        [m.name for m in models], len(steps))
            for t, target in enumerate(targets):
                figures.add(index, step, target.name, stats.merge(records, t), server.get(t))
    closed = options.levels[0].closed
    return RunResult(_report(options, targets, models, figures.entries), figures.latencies_s,
                     {i: s.level.x for i, s in enumerate(steps)},
                     "concurrency" if closed else "offered rate (requests/s)")


def _driver_config(options: Options, targets: Sequence[Target], variants) -> DriverConfig:
    args = options.args
    return DriverConfig(
        urls=tuple(t.url for t in targets), payloads=tuple(v.payload for v in variants),
        call_timeout_s=args.call_timeout_s,
        deadlines_s=(tuple(options.deadlines[v.deadline].ms / 1e3 for v in variants)
                     if args.enforce_deadline in ("grpc", "both") else ()),
        max_outstanding=args.max_outstanding // args.workers if args.max_outstanding else None,
        drain_timeout_s=args.drain_timeout_s)


class _Figures:
    """The ``steps`` entries of the report, and the latencies the plots need."""

    def __init__(self, options: Options, models: Sequence[ModelInputs], variants) -> None:
        self.deadlines_ms = [d.ms for d in options.deadlines]
        self.variant_deadline = np.array([v.deadline for v in variants])
        self.deadline_s = (np.array([self.deadlines_ms[v.deadline] / 1e3 for v in variants])
                           if options.deadlines else None)
        self.models = [m.name for m in models]
        self.levels = [p.level for p in options.priorities] or [0]
        self.samples = np.array([v.samples for v in variants])
        self.variant_model = np.array([v.model for v in variants])
        self.variant_priority = np.array([v.priority for v in variants])
        self.entries: list[dict] = []
        self.latencies_s: dict[tuple[int, str], np.ndarray] = {}

    def add(self, index: int, step: plan.Step, target: str, outcome: stats.Outcome,
            server: dict | None) -> None:
        summary = stats.summarize(
            outcome, deadline_s=self.deadline_s, samples=self.samples, models=self.models,
            variant_model=self.variant_model, priorities=self.levels,
            variant_priority=self.variant_priority, deadlines_ms=self.deadlines_ms,
            variant_deadline=self.variant_deadline)
        self.entries.append({"step": index, "label": step.level.label,
                             "offered": step.level.offered, "target": target, **summary,
                             "server_metrics": server})
        self.latencies_s[(index, target)] = outcome.latency_s[outcome.ok]


def _describe(targets: Sequence[Target], options: Options) -> list[ModelInputs]:
    described = []
    for target in targets:
        with grpc.insecure_channel(target.url) as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=CONNECT_TIMEOUT_S)
            except grpc.FutureTimeoutError:
                raise BenchError(f"cannot connect to {target.url} within {CONNECT_TIMEOUT_S:g} s") from None
            target.server.update(_server_metadata(channel))
            described.append(describe_models(channel, [m.name for m in options.models], options.data))
    if len(described) > 1 and [m.inputs for m in described[0]] != [m.inputs for m in described[1]]:
        raise BenchError(f"{targets[0].url} and {targets[1].url} describe the models' inputs "
                         "differently; --compare needs the same requests to make sense to both")
    return described[0]


def _server_metadata(channel) -> dict:
    stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
    try:
        reply = stub.ServerMetadata(pb.ServerMetadataRequest(), timeout=10)
    except grpc.RpcError:
        return {"name": None, "version": None}
    return {"name": reply.name, "version": reply.version}


def _variant_weights(variants, options: Options) -> np.ndarray:
    """Probability of each variant: model × priority × deadline weight, shared by its model's
    data variants."""
    def shares(choices) -> np.ndarray:
        weights = np.array([c.weight for c in choices])
        return weights / weights.sum()

    model_w = shares(options.models)
    prio_w = shares(options.priorities or (PriorityChoice(0),))
    deadline_w = shares(options.deadlines or (DeadlineChoice(0.0),))
    per_model = (np.bincount([v.model for v in variants], minlength=len(model_w))
                 / (len(prio_w) * len(deadline_w)))
    weights = np.array([model_w[v.model] * prio_w[v.priority] * deadline_w[v.deadline]
                        / per_model[v.model] for v in variants])
    return weights / weights.sum()


def _run_step(workers: Workers, index: int, step: plan.Step, targets: Sequence[Target], progress,
              options: Options, models: list[str], total_steps: int) -> tuple[list[StepRecords], dict]:
    """One step under load, with each target's /metrics read around its measured time."""
    warmup_s = sum(s.duration_s or 0.0 for s in step.segments if not s.measured)
    timed = options.duration_s is not None
    task = progress.add(f"step {index + 1}/{total_steps} {step.level.label}",
                        sum(s.duration_s for s in step.segments) if timed else None,
                        workers.answered())
    watch = _ServerWatch(targets, options.args.metrics_interval_s, models)
    origin = time.monotonic() + STEP_LEAD_S

    def tick(answers: int, errors: int) -> None:
        progress.update(task, max(0.0, time.monotonic() - origin), answers, errors)

    # The first read lands as the warm-up ends (on a timer thread) or before anything is sent.
    timer = threading.Timer(max(0.0, origin + warmup_s - time.monotonic()), watch.start)
    try:
        if warmup_s > 0:
            timer.start()
        else:
            watch.start()
        records = workers.run_step(step, origin, tick)
    finally:
        if warmup_s > 0:
            timer.cancel()
            timer.join()
        server = watch.stop()
    progress.finish(task)
    return records, server


class _ServerWatch:
    """Each target's /metrics: read when a step's warm-up ends, gauges sampled while it is
    measured, read again at its end. A failed read leaves that step without server figures."""

    def __init__(self, targets: Sequence[Target], interval_s: float, models: list[str]) -> None:
        self.urls = {t: target.metrics_url for t, target in enumerate(targets) if target.metrics_url}
        self.interval_s = interval_s
        self.models = models
        self.before: dict[int, scrape.Samples | None] = {}
        self.samplers: dict[int, scrape.GaugeSampler] = {}

    def start(self) -> None:
        for t, url in self.urls.items():
            self.before[t] = _scrape_or_none(url)
            self.samplers[t] = scrape.GaugeSampler(url, self.interval_s).__enter__()

    def stop(self) -> dict[int, dict]:
        server = {}
        for t, sampler in self.samplers.items():
            sampler.__exit__(None, None, None)
            after = _scrape_or_none(self.urls[t])
            if self.before[t] is not None and after is not None:
                server[t] = scrape.server_side(self.before[t], after, sampler.readings, self.models)
        return server


def _scrape_or_none(url: str) -> scrape.Samples | None:
    try:
        return scrape.scrape(url)
    except scrape.ScrapeError:
        return None


def _report(options: Options, targets: Sequence[Target], models: Sequence[ModelInputs],
            entries: list[dict]) -> dict:
    args = options.args
    closed = options.levels[0].closed
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "batchgate bench",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": list(options.command),
        "machine": machine(),
        "settings": {
            "mode": "closed" if closed else "open",
            "concurrency": [lv.concurrency for lv in options.levels] if closed else None,
            "rate_per_s": None if closed else [lv.arrival.rate_per_s for lv in options.levels],
            "arrival": None if closed else args.arrival,
            "burst_on_s": args.burst_on_s if args.arrival == "bursty" and not closed else None,
            "burst_off_s": args.burst_off_s if args.arrival == "bursty" and not closed else None,
            "burst_off_rate_per_s": (args.burst_off_rate if args.arrival == "bursty" and not closed
                                     else None),
            "warmup_s": args.warmup_s,
            "duration_s": options.duration_s,
            "requests": args.requests,
            "slice_s": args.slice_s if len(targets) > 1 else None,
            "deadline_ms": options.deadlines[0].ms if len(options.deadlines) == 1 else None,
            "deadlines": [{"ms": d.ms, "weight": d.weight} for d in options.deadlines],
            "enforce_deadline": args.enforce_deadline,
            "max_outstanding": args.max_outstanding,
            "workers": args.workers,
            "seed": args.seed,
            "batch": args.batch,
            "models": [{"name": m.name, "weight": c.weight, "max_batch_size": m.max_batch_size,
                        "inputs": [{"name": i.name, "datatype": i.datatype, "shape": list(i.shape)}
                                   for i in m.inputs]}
                       for m, c in zip(models, options.models)],
            "priorities": [{"level": p.level, "weight": p.weight} for p in options.priorities],
        },
        "targets": [{"name": t.name, "url": t.url, "metrics_url": t.metrics_url,
                     "server": t.server} for t in targets],
        "steps": entries,
        "comparison": comparison(entries),
    }


def machine() -> dict:
    cpu_model = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    return {"cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "cpu_model": cpu_model, "python": platform.python_version(),
            "grpcio": grpc.__version__}


# -- progress ---------------------------------------------------------------------------------------


class _Progress:
    """A rich progress bar per step, or nothing when quiet or not on a terminal."""

    def __init__(self, console, enabled: bool) -> None:
        self.bar = None
        self._base = (0, 0)
        self._started = 0.0
        self._total: float | None = None
        if enabled:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                TextColumn("{task.fields[answers]:,} answers · {task.fields[errors]:,} errors · "
                           "{task.fields[rate]}/s"),
                console=console)

    def __enter__(self) -> _Progress:
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def add(self, description: str, total_s: float | None, base: tuple[int, int]):
        """A bar for one step: over its seconds, or open-ended for a count of requests."""
        self._base, self._started, self._total = base, time.monotonic(), total_s
        if self.bar is None:
            return None
        return self.bar.add_task(description, total=total_s, answers=0, errors=0, rate="-")

    def update(self, task, elapsed_s: float, answers: int, errors: int) -> None:
        if self.bar is None:
            return
        done = answers - self._base[0]
        spent = time.monotonic() - self._started
        self.bar.update(task, completed=elapsed_s, answers=done, errors=errors - self._base[1],
                        rate=f"{done / spent:,.0f}" if spent > 0.5 else "-")

    def finish(self, task) -> None:
        if self.bar is not None and self._total is not None:
            self.bar.update(task, completed=self._total)


def _progress(console, quiet: bool) -> _Progress:
    return _Progress(console, enabled=not quiet and console.is_terminal)


# -- main -------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None, prog: str = "batchgate bench") -> int:
    from rich.console import Console

    parser = build_parser(prog)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    options = dataclasses.replace(parse_options(parser, args), command=(*prog.split(), *argv))
    err = Console(stderr=True)
    out = Console() if sys.stdout.isatty() else Console(width=TABLE_WIDTH)
    try:
        result = run(options, err)
    except (BenchError, WorkloadError, DriverError, scrape.ScrapeError, ValueError) as exc:
        err.print(f"[bold red]{prog}:[/] {exc}", highlight=False)
        return 1
    render(result.report, out)
    if args.json is not None:
        write_json(result.report, args.json)
        err.print(f"wrote {args.json}")
    if args.plot is not None:
        from batchgate.bench.loadgen.plots import PlotError, write_plots

        try:
            paths = write_plots(args.plot, result.report["steps"], result.latencies_s,
                                result.x_label, result.x)
        except PlotError as exc:
            err.print(f"[bold red]{prog}:[/] {exc}", highlight=False)
            return 1
        err.print("wrote " + ", ".join(str(p) for p in paths))
    return 0
