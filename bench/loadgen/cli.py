"""``batchgate bench`` (also ``python -m batchgate.bench.loadgen``): the command line and the run.

    batchgate bench -m mlp --concurrency 1,8,64
    batchgate bench -m mlp --rate 200,400 --arrival bursty --deadline-ms 50 --json out.json
    batchgate bench -m mlp --concurrency 64 --compare 127.0.0.1:9001 --metrics-url URL

Exit status: 0 after a run (whatever the server answered: errors are figures), 1 when the run
could not be made (no connection, an unknown model, a bad ``.npz``), 2 for a bad command line.
"""

from __future__ import annotations

import argparse
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
from batchgate.bench.loadgen.arrivals import ARRIVALS, Arrival
from batchgate.bench.loadgen.driver import (
    STEP_LEAD_S,
    DriverConfig,
    DriverError,
    StepRecords,
    Workers,
)
from batchgate.bench.loadgen.report import SCHEMA_VERSION, comparison, render, write_json
from batchgate.bench.loadgen.workload import (
    DataOptions,
    DeadlineChoice,
    ModelChoice,
    ModelInputs,
    PriorityChoice,
    WorkloadError,
    build_variants,
    describe_models,
)
from batchgate.protos import inference_pb2 as pb
from batchgate.protos import inference_pb2_grpc

ENFORCE = ("none", "grpc", "parameter", "both")
DESCRIPTION = ("Load-test a KServe v2 gRPC server, closed or open loop, with latency measured "
               "from each request's intended send time and goodput within a deadline.")
TABLE_WIDTH = 150  # for a log or a pipe; a terminal's own width otherwise
CONNECT_TIMEOUT_S = 10.0


class BenchError(RuntimeError):
    """The run cannot be made; the message says why."""


# -- the command line ----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("server")
    target.add_argument("-u", "--url", default="127.0.0.1:8001",
                        help="gRPC address of the KServe v2 server (default: %(default)s)")
    target.add_argument("--compare", metavar="URL",
                        help="a second server: the same load alternates between the two in "
                             "slices, and the table gives compare ÷ base ratios")
    target.add_argument("--metrics-url", metavar="URL",
                        help="the server's Prometheus endpoint (e.g. http://127.0.0.1:8002/metrics): "
                             "batch sizes, queue time, dispatch reasons, GPU busy per step")
    target.add_argument("--compare-metrics-url", metavar="URL",
                        help="the --compare server's Prometheus endpoint")
    target.add_argument("--metrics-interval-s", type=float, default=1.0,
                        help="how often gauges (GPU utilisation, queue depth) are read during a "
                             "step (default: %(default)s)")

    work = parser.add_argument_group("requests")
    work.add_argument("-m", "--model", action="append", required=True, metavar="NAME[:WEIGHT]",
                      help="model to infer, repeatable: a mix by weight (default weight 1)")
    work.add_argument("--batch", type=int, default=1,
                      help="batch dimension of each request, for models that batch (default: 1)")
    work.add_argument("--shape", action="append", default=[], metavar="[MODEL/]INPUT:D1,D2",
                      help="dims of an input with variable dims (batch dimension left out)")
    work.add_argument("--input-data", action="append", default=[], metavar="[MODEL=]FILE.npz",
                      help="send these arrays (keyed by input name, batch dimension included) "
                           "instead of random data; MODEL= for one model of a mix")
    work.add_argument("--int-range", default="0:100", metavar="LOW:HIGH",
                      help="random integer inputs are drawn from [LOW, HIGH) (default: %(default)s)")
    work.add_argument("--priority", action="append", default=[], metavar="LEVEL:WEIGHT",
                      help="send the request parameter priority=LEVEL, repeatable: a mix by "
                           "weight (level 0: no priority parameter)")

    load = parser.add_argument_group("load")
    load.add_argument("--concurrency", metavar="N[,N...]",
                      help="closed loop: N requests always in flight; a list is a sweep "
                           "(default: 1 unless --rate is given)")
    load.add_argument("--rate", metavar="R[,R...]",
                      help="open loop: R requests per second, sent on schedule whatever the "
                           "server does; a list is a sweep")
    load.add_argument("--arrival", choices=ARRIVALS, default="poisson",
                      help="open-loop arrivals: constant gaps, Poisson, or bursty (Poisson at "
                           "--rate during on-periods, nothing in between) (default: %(default)s)")
    load.add_argument("--burst-on-s", type=float, default=1.0,
                      help="bursty: length of each on-period (default: %(default)s)")
    load.add_argument("--burst-off-s", type=float, default=1.0,
                      help="bursty: length of each off-period (default: %(default)s)")
    load.add_argument("--burst-off-rate", type=float, default=0.0, metavar="R",
                      help="bursty: Poisson arrivals per second during off-periods; --rate is "
                           "the on-period rate (default: %(default)s, nothing between bursts)")
    load.add_argument("--max-outstanding", type=int, default=None, metavar="N",
                      help="open loop: at most N requests in flight (split over workers); a "
                           "request due while all are busy is sent late and its latency still "
                           "counts from its intended time (default: no limit)")
    load.add_argument("--warmup-s", type=float, default=1.0,
                      help="load before each step's measurement, not counted (default: %(default)s)")
    length = load.add_mutually_exclusive_group()
    length.add_argument("--duration-s", type=float, default=None,
                        help="measured seconds per step (default: 5)")
    length.add_argument("--requests", type=int, default=None,
                        help="measure this many requests per step instead of a duration")
    load.add_argument("--slice-s", type=float, default=2.0,
                      help="--compare: length of each alternating slice (default: %(default)s)")
    load.add_argument("--deadline-ms", action="append", default=[], metavar="MS[:WEIGHT]",
                      help="per-request deadline from the intended send time: goodput and SLO "
                           "attainment count OK answers within it; repeatable: a mix by weight")
    load.add_argument("--enforce-deadline", choices=ENFORCE, default="none",
                      help="also send the deadline: as the gRPC deadline (grpc), as the "
                           "request's timeout parameter (parameter), or both (default: %(default)s)")
    load.add_argument("--call-timeout-s", type=float, default=60.0,
                      help="gRPC deadline of each call when no deadline is enforced "
                           "(default: %(default)s)")
    load.add_argument("--drain-timeout-s", type=float, default=60.0,
                      help="at a step's end, how long answers are awaited before the calls "
                           "left are cancelled and counted CANCELLED (default: %(default)s)")
    load.add_argument("--workers", type=int, default=1,
                      help="sender processes (spawned), each with its own connection; 1 sends "
                           "from this process (default: %(default)s)")
    load.add_argument("--seed", type=int, default=0,
                      help="seed of the random inputs, arrivals and mixes (default: %(default)s)")

    out = parser.add_argument_group("output")
    out.add_argument("--json", type=Path, metavar="FILE",
                     help="write every figure as JSON (layout: docs/benchmarks.md)")
    out.add_argument("--plot", type=Path, metavar="DIR",
                     help="write latency_cdf.png and load_curve.png here (needs matplotlib: "
                          "the 'plots' extra)")
    out.add_argument("-q", "--quiet", action="store_true",
                     help="no progress bar (it is off anyway when stderr is not a terminal)")


def build_parser(prog: str = "batchgate bench") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_arguments(parser)
    return parser


@dataclasses.dataclass(frozen=True)
class Options:
    """The command line, checked and parsed into the run's terms."""

    args: argparse.Namespace
    models: tuple[ModelChoice, ...]
    priorities: tuple[PriorityChoice, ...]
    deadlines: tuple[DeadlineChoice, ...]
    levels: tuple[plan.LoadLevel, ...]
    data: DataOptions
    duration_s: float | None
    command: tuple[str, ...] = ()


def parse_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Options:
    try:
        return _options(args)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # parser.error exits


def _options(args: argparse.Namespace) -> Options:
    models = tuple(_weighted(item, "--model", lambda n, w: ModelChoice(n, w)) for item in args.model)
    priorities = tuple(_weighted(item, "--priority", lambda n, w: PriorityChoice(int(n), w))
                       for item in args.priority)
    if any(p.level < 0 for p in priorities):
        raise ValueError("--priority levels must be >= 0")
    deadlines = tuple(_weighted(item, "--deadline-ms", lambda n, w: DeadlineChoice(float(n), w))
                      for item in args.deadline_ms)
    if any(not d.ms > 0 for d in deadlines):
        raise ValueError(f"--deadline-ms must be > 0, got {args.deadline_ms}")
    if len({d.ms for d in deadlines}) < len(deadlines):
        raise ValueError(f"--deadline-ms values must differ (give one a weight), got {args.deadline_ms}")
    if args.concurrency and args.rate:
        raise ValueError("give --concurrency (closed loop) or --rate (open loop), not both")
    if args.rate:
        off_rate = args.burst_off_rate if args.arrival == "bursty" else 0.0
        if args.burst_off_rate and args.arrival != "bursty":
            raise ValueError("--burst-off-rate is for --arrival bursty")
        levels = tuple(plan.LoadLevel(arrival=Arrival(args.arrival, rate, args.burst_on_s,
                                                      args.burst_off_s, off_rate))
                       for rate in _numbers(args.rate, "--rate", float))
    else:
        levels = tuple(plan.LoadLevel(concurrency=c)
                       for c in _numbers(args.concurrency or "1", "--concurrency", int))
        if any(level.concurrency < 1 for level in levels):
            raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
        if args.max_outstanding is not None:
            raise ValueError("--max-outstanding is for the open loop (--rate)")
    duration_s = args.duration_s if args.duration_s is not None else (
        None if args.requests is not None else 5.0)
    checks = [
        (args.batch >= 1, f"--batch must be >= 1, got {args.batch}"),
        (args.workers >= 1, f"--workers must be >= 1, got {args.workers}"),
        (args.warmup_s >= 0, f"--warmup-s must be >= 0, got {args.warmup_s}"),
        (duration_s is None or duration_s > 0, f"--duration-s must be > 0, got {duration_s}"),
        (args.requests is None or args.requests >= 1, f"--requests must be >= 1, got {args.requests}"),
        (args.slice_s > 0, f"--slice-s must be > 0, got {args.slice_s}"),
        (args.enforce_deadline == "none" or bool(deadlines),
         "--enforce-deadline needs --deadline-ms"),
        (args.max_outstanding is None or args.max_outstanding >= args.workers,
         "--max-outstanding must be at least --workers (each worker needs a slot)"),
        (args.compare is None or args.requests is None,
         "--compare alternates time slices: use --duration-s, not --requests"),
        (args.compare_metrics_url is None or args.compare is not None,
         "--compare-metrics-url needs --compare"),
        (args.metrics_interval_s > 0, "--metrics-interval-s must be > 0"),
        (args.call_timeout_s > 0 and args.drain_timeout_s >= 0, "timeouts must be positive"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    low, high = _numbers(args.int_range.replace(":", ","), "--int-range", int)
    if low >= high:
        raise ValueError(f"--int-range needs LOW < HIGH, got {args.int_range}")
    data = DataOptions(batch=args.batch, shapes=dict(_shape(s) for s in args.shape),
                       npz=dict(_npz(item) for item in args.input_data),
                       int_range=(low, high), seed=args.seed)
    return Options(args, models, priorities, deadlines, levels, data, duration_s)


def _weighted(item: str, flag: str, make):
    name, _, weight = item.partition(":")
    try:
        value = float(weight) if weight else 1.0
        choice = make(name, value)
    except ValueError:
        raise ValueError(f"{flag} takes NAME[:WEIGHT], got {item!r}") from None
    if not name or value <= 0:
        raise ValueError(f"{flag} needs a name and a weight > 0, got {item!r}")
    return choice


def _numbers(text: str, flag: str, kind) -> list:
    try:
        return [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes a comma-separated list of numbers, got {text!r}") from None


def _shape(text: str) -> tuple[tuple[str | None, str], tuple[int, ...]]:
    name, _, dims = text.rpartition(":")
    model, _, tensor = name.rpartition("/")
    if not tensor:
        raise ValueError(f"--shape takes [MODEL/]INPUT:D1,D2,..., got {text!r}")
    return (model or None, tensor), tuple(_numbers(dims, "--shape", int))


def _npz(text: str) -> tuple[str | None, Path]:
    model, sep, path = text.partition("=")
    return (model, Path(path)) if sep else (None, Path(text))


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
