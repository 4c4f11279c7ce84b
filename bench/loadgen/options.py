"""``batchgate bench``'s command line: its flags, and the run's ``Options`` parsed from them
(``batchgate.bench.loadgen.cli`` runs them)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from batchgate.bench.loadgen import plan
from batchgate.bench.loadgen.arrivals import ARRIVALS, Arrival
from batchgate.bench.loadgen.workload import DataOptions, DeadlineChoice, ModelChoice, PriorityChoice

ENFORCE = ("none", "grpc", "parameter", "both")
DESCRIPTION = ("Load-test a KServe v2 gRPC server, closed or open loop, with latency measured "
               "from each request's intended send time and goodput within a deadline.")


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
