"""The serving benchmark: the gateway in each of its modes against the same model in a tight
in-process loop, in one run.

One run, one machine, the model on one intra-op thread everywhere:

1. the in-process ceiling (``batchgate.bench.inprocess``, in a subprocess): samples/s at batch 64 and the
   per-call p50 at batch 1;
2. per mode (``--modes``: the native front end, one process), the
   server as a subprocess on loopback, serving only the measured model; then the floor
   (``batchgate.bench.floor``): the same model behind an all-C++ gRPC server with no Python,
   the yardstick for what this machine allows at all;
3. per load generator (``--load-generators``: ``batchgate bench`` and Triton's
   ``perf_analyzer``, gRPC, synchronous), closed loop at concurrency 1 and 64, with the server's
   ``/metrics`` and the CPU time of each of its processes and threads (``/proc``) read around
   each step;
4. SIGTERM, checking the server exits 0; at the end the in-process figures again: the machine
   is shared, so the ceiling is the mean of before and after and both are shown.

Figures (ratios within one run):

- ratio: throughput at c=64 ÷ in-process samples/s at batch 64; split in two by the same
  throughput ÷ the in-process samples/s at the step's mean batch size (measured after the
  servers ran): how close the server came to the model at the batches it formed, the rest being
  the batch size itself;
- p99 at c=64;
- added p50: p50 at c=1 minus the in-process batch-1 time; and minus the model's batch-1 time
  when called from idle (``inprocess --idle-ms``, the idle being the fastest c=1 step's p50
  less the batch-1 time, as a model thread waits between requests at c=1): what the server
  adds, less the part of a c=1 request's time the model itself takes longer than in the loop;
- CPU per request outside the model at c=64: the server's processes' CPU time less the time the
  executor threads spent inside the model's forward (``batchgate_model_cpu_seconds_total``),
  per request answered; the executor's share alone, and the front end's;
- the front end's threads: how one client channel's load spreads over them;
- against the floor: each mode's c=64 throughput ÷ the floor's, and its c=1 p50 less the
  floor's, under the same load generator.

    python -m batchgate.bench.serving [--modes native,python,single,floor] [--seconds-per-step 4] [--json FILE]
        [--server-arg=--model-cpus=1 --load-cpus 0]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from batchgate.bench import floor
from batchgate.bench.output import emit, progress
from batchgate.bench._perf_analyzer import (
    DEFAULT_PERF_ANALYZER,
    PerfAnalyzerError,
    PerfRow,
    PerfRun,
    parse_perf_analyzer_csv,
    run_perf_analyzer,
)
from batchgate.protos import inference_pb2, inference_pb2_grpc
from batchgate.server import native
from batchgate.server.settings import cpu_list, cpus_text, usable_cpus
from batchgate.bench.harness.server import MODES, RunningServer, ServerError, start_process
from batchgate.bench.harness.repository import copy_model

__all__ = ["PerfRow", "main", "parse_metrics", "parse_perf_analyzer_csv"]

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_REPOSITORY = ROOT / "models"
HIGH_CONCURRENCY = 64
CEILING_BATCH = 64
THREADS = 1

LOAD_GENERATORS = ("bench", "perf_analyzer")
# The server's modes, and the all-C++ yardstick (batchgate.bench.floor), measured last.
SERVING_MODES = (*MODES, "floor")


@dataclasses.dataclass(frozen=True)
class Targets:
    """What a mode is held to on a 2-core machine."""

    ratio: float
    p99_ms: float
    added_p50_ms: float
    outside_model_us: float | None = None  # server CPU per request outside the model
    executor_us: float | None = None  # the executor's part of it


TARGETS = {
    "native": Targets(0.7, 35.0, 0.5, outside_model_us=100.0, executor_us=40.0),
    "single": Targets(0.45, 50.0, 1.0),
}

SERVER_START_TIMEOUT_S = 120.0
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class BenchError(RuntimeError):
    pass


# What a benchmark's main reports as a failed run rather than a traceback.
RUN_ERRORS = (BenchError, ServerError, PerfAnalyzerError)


# -- the machine -------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    cpu_model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    return {
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "cpu_model": cpu_model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
    }


def _stat_fields(pid: int, task: Path | None = None) -> list[str]:
    text = ((task or Path(f"/proc/{pid}")) / "stat").read_text()
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    return text[text.rindex(")") + 2:].split()


def process_tree(pid: int) -> dict[int, str]:
    """``pid`` and its live descendants, each with its role: supervisor / executor / frontend
    (the server of one process: "server")."""
    children = _children()
    roles, todo = {}, [pid]
    while todo:
        current = todo.pop()
        try:
            command = Path(f"/proc/{current}/cmdline").read_bytes()
        except OSError:
            continue
        if b"batchgate.server.executor.process" in command:
            roles[current] = "executor"
        elif b"batchgate-frontend" in command:
            roles[current] = "frontend"
        else:
            roles[current] = "supervisor"
        todo.extend(children.get(current, ()))
    if len(roles) == 1:
        roles[pid] = "server"
    return roles


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of ``pid``, by ``name:tid``."""
    threads = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = _stat_fields(int(task.name), task)
            name = (task / "comm").read_text().strip()
        except (OSError, ValueError):
            continue
        threads[f"{name}:{task.name}"] = (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    return threads


def _children() -> dict[int, list[int]]:
    """Every process's children, from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                children.setdefault(int(_stat_fields(int(entry.name))[1]), []).append(int(entry.name))
            except (OSError, ValueError):
                continue
    return children


def process_cpu_s(pid: int, descendants: bool = True) -> float:
    """User + system CPU seconds of ``pid`` (and of its live descendants: the multi-process
    server's executor and front ends), all threads, from ``/proc/PID/stat``."""
    children = _children() if descendants else {}
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            fields = _stat_fields(current)
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # proc(5) fields 14, 15
        todo.extend(children.get(current, ()))
    return total


def machine_busy_s() -> float:
    """CPU seconds all processes have used since boot (``/proc/stat``), idle and iowait left out."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice, already inside user/nice]
    return (sum(fields[:8]) - fields[3] - fields[4]) / _CLOCK_TICKS


# -- the in-process ceiling --------------------------------------------------------------------


def measure_inprocess(repository: Path, model: str, seconds: float,
                      also: tuple[int, ...] = ()) -> dict[int, dict[str, Any]]:
    """Batch 64, batch 1 and the batch sizes ``also`` in a fresh interpreter, so this process
    never loads torch."""
    sizes = [CEILING_BATCH, 1, *(b for b in dict.fromkeys(also) if b not in (CEILING_BATCH, 1))]
    return _inprocess(repository, model, seconds, sizes)


def measure_from_idle(repository: Path, model: str, seconds: float, idle_ms: float
                      ) -> dict[str, Any]:
    """Batch 1 with the model thread sleeping ``idle_ms`` before each call."""
    return _inprocess(repository, model, seconds, [1], idle_ms)[1]


def c1_idle_ms(modes: dict[str, dict[str, Any]], batch1_ms: float) -> float | None:
    """How long a model thread waits between requests at c=1 in the fastest c=1 step of the
    servers (the floor's shorter round trip left out): its p50 less the model's batch-1 time
    (at least 0.1 ms); None without a c=1 step."""
    p50s = [low.perf.row.p50_ms for mode, measured in modes.items() if mode != "floor"
            for low, _high in measured.get("steps", {}).values()]
    return max(0.1, min(p50s) - batch1_ms) if p50s else None


def _inprocess(repository: Path, model: str, seconds: float, sizes: list[int],
               idle_ms: float = 0.0) -> dict[int, dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="bench-inprocess-") as scratch:
        out = Path(scratch) / "inprocess.json"
        command = [
            sys.executable, "-m", "batchgate.bench.inprocess", "--model-repository", str(repository),
            "--model", model, "--batch", *map(str, sizes), "--seconds", f"{seconds:g}",
            "--threads", str(THREADS), "--idle-ms", f"{idle_ms:g}", "--json", str(out),
        ]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise BenchError(f"batchgate.bench.inprocess failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
        report = json.loads(out.read_text(encoding="utf-8"))
    return {r["batch_size"]: r | {"torch": report["torch"]} for r in report["results"]}


# -- the server --------------------------------------------------------------------------------


def model_config(server: RunningServer, model: str) -> Any:
    """``model``'s configuration as the server reports it."""
    with grpc.insecure_channel(server.address) as channel:
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
        reply = stub.ModelConfig(inference_pb2.ModelConfigRequest(name=model), timeout=10)
    return reply.config


def scrape(server: RunningServer, model: str) -> dict[str, float]:
    """``model``'s ``batchgate_*`` samples from the server's ``/metrics``: name -> value."""
    return parse_metrics(server.metrics_text(), model)


def start_server(repository: Path, mode: str, model: str,
                 extra_args: list[str] | tuple[str, ...] = ()) -> RunningServer:
    """The server of ``repository`` in ``mode`` as its own process, serving ``model``; its exit
    status is the caller's to check."""
    return start_process(repository, mode, extra_args=extra_args, models=[model],
                         timeout_s=SERVER_START_TIMEOUT_S, check_exit=False)


_SAMPLE = re.compile(r'^(batchgate_\w+)\{([^}]*)\}\s+(\S+)$')


def start_floor(model_dir: Path) -> floor.FloorServer:
    """``batchgate-floor`` serving the model of ``model_dir`` (built first if need be), with a
    worker per usable CPU as the native front end's default."""
    _say("floor: building batchgate-floor (once) and exporting the model ...")
    binary = floor.build()
    exported = floor.export(model_dir, floor.BUILD_DIR / "models" / f"{model_dir.name}.pt")
    return floor.FloorServer(binary, exported, workers=len(os.sched_getaffinity(0)))


def parse_metrics(text: str, model: str) -> dict[str, float]:
    """Samples of ``model`` (label ``model="..."``); other labels join the name, sorted."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match:
            continue
        name, labels, value = match.groups()
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if pairs.pop("model", None) != model:
            continue
        key = name + "".join(f"{{{k}={v}}}" for k, v in sorted(pairs.items()))
        samples[key] = float(value)
    return samples


@contextlib.contextmanager
def single_model_repository(repository: Path, model: str,
                            parameters: dict[str, str] | None = None) -> Iterator[Path]:
    """A repository holding only ``model``, so the server loads nothing else.

    ``parameters`` are added to (or override) the model's config ``parameters``; without them
    the model folder is linked, not copied.
    """
    source = (repository / model).resolve()
    if not (source / "config.pbtxt").is_file():
        raise BenchError(f"{source}: no config.pbtxt; is {model!r} a model of {repository}?")
    with tempfile.TemporaryDirectory(prefix="bench-repository-") as scratch:
        target = Path(scratch) / model
        if parameters:
            copy_model(source, Path(scratch), model, parameters)
        else:
            target.symlink_to(source, target_is_directory=True)
        yield Path(scratch)


# -- one step under load -----------------------------------------------------------------------


@dataclasses.dataclass
class Step:
    concurrency: int
    perf: PerfRun  # from either load generator; perf.cpu_s is the load generator's CPU
    batches: float
    samples: float
    answered: float  # requests the server answered OK during the step
    compute_s: float
    model_cpu_s: float  # the executor threads' CPU inside the model's forward
    queue_waits: float
    queue_s: float
    reasons: dict[str, float]
    cpu_s: dict[str, float]  # per role: supervisor, executor, frontend (one process: server)
    frontend_threads_s: dict[str, float]  # the front end's threads (one front end, or none)
    machine_busy_s: float

    @property
    def mean_batch(self) -> float | None:
        return self.samples / self.batches if self.batches else None

    @property
    def batch_size(self) -> int | None:
        """The mean batch, rounded: the size the model alone is measured at to compare."""
        return max(1, round(self.mean_batch)) if self.mean_batch else None

    @property
    def mean_compute_ms(self) -> float | None:
        return self.compute_s * 1e3 / self.batches if self.batches else None

    @property
    def mean_queue_ms(self) -> float | None:
        return self.queue_s * 1e3 / self.queue_waits if self.queue_waits else None

    @property
    def server_cpu_s(self) -> float:
        return sum(self.cpu_s.values())

    @property
    def server_cores(self) -> float:
        return self.server_cpu_s / self.perf.wall_s

    @property
    def perf_analyzer_cores(self) -> float:
        return self.perf.cpu_s / self.perf.wall_s

    @property
    def other_cores(self) -> float:
        """Cores busy with anything but the server and perf_analyzer: the shared machine's noise."""
        return max(0.0, self.machine_busy_s / self.perf.wall_s - self.server_cores - self.perf_analyzer_cores)

    def per_request_us(self, seconds: float) -> float | None:
        return seconds / self.answered * 1e6 if self.answered else None

    @property
    def outside_model_us(self) -> float | None:
        """The server's CPU per request answered, less the model's forward."""
        return self.per_request_us(self.server_cpu_s - self.model_cpu_s)

    @property
    def executor_us(self) -> float | None:
        """The executor process's CPU per request outside the model (multi-process modes)."""
        if "executor" not in self.cpu_s:
            return None
        return self.per_request_us(self.cpu_s["executor"] - self.model_cpu_s)

    @property
    def frontend_us(self) -> float | None:
        if "frontend" not in self.cpu_s:
            return None
        return self.per_request_us(self.cpu_s["frontend"])

    def thread_spread(self) -> dict[str, Any] | None:
        """How the front end's CPU spread over its threads: the busy ones (over 5 % of it) and
        the largest share."""
        total = sum(self.frontend_threads_s.values())
        if not total:
            return None
        shares = sorted(((v / total, k) for k, v in self.frontend_threads_s.items()), reverse=True)
        return {"busy_threads": sum(1 for share, _ in shares if share > 0.05),
                "largest_share": shares[0][0],
                "shares": {name: round(share, 3) for share, name in shares if share > 0.01}}

    def as_dict(self) -> dict[str, Any]:
        return {
            "concurrency": self.concurrency,
            "load": dataclasses.asdict(self.perf.row),
            "stability_percentage": self.perf.stability_percentage,
            "wall_s": self.perf.wall_s,
            "load_command": self.perf.command,
            "batches": self.batches,
            "answered": self.answered,
            "mean_batch_size": self.mean_batch,
            "mean_compute_ms": self.mean_compute_ms,
            "mean_queue_ms": self.mean_queue_ms,
            "dispatch_reasons": self.reasons,
            "cpu_s": self.cpu_s,
            "model_cpu_s": self.model_cpu_s,
            "server_cores": self.server_cores,
            "load_generator_cores": self.perf_analyzer_cores,
            "other_cores": self.other_cores,
            "outside_model_us_per_request": self.outside_model_us,
            "executor_us_per_request": self.executor_us,
            "frontend_us_per_request": self.frontend_us,
            "frontend_threads": self.thread_spread(),
        }


_REASON_PREFIX = "batchgate_batches_total{reason="


def bench_step(url: str, model: str, args: list[str], metrics_url: str | None
               ) -> tuple[dict[str, Any], list[str], float, float]:
    """One ``batchgate bench`` step (``args`` say which) as a subprocess: its JSON step, the
    command, wall seconds and the bench's own CPU seconds (it shares the cores).
    ``metrics_url``: the server's ``/metrics``, if it has one."""
    with tempfile.TemporaryDirectory(prefix="bench-step-") as scratch:
        report_path = Path(scratch) / "bench.json"
        command = [
            sys.executable, "-m", "batchgate.bench.loadgen", "--url", url, "--model", model,
            *(["--metrics-url", metrics_url] if metrics_url else []),
            "--quiet", "--json", str(report_path), *args,
        ]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.monotonic()
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)
        _, stderr = process.communicate()
        wall_s = time.monotonic() - started
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        if process.returncode != 0 or not report_path.exists():
            raise BenchError(f"batchgate bench exited {process.returncode}:\n{stderr[-2000:]}")
        (step,) = json.loads(report_path.read_text())["steps"]
    # RUSAGE_CHILDREN accumulates over every child waited for: the difference is this one's.
    cpu_s = (usage.ru_utime + usage.ru_stime) - (before.ru_utime + before.ru_stime)
    return step, command, wall_s, cpu_s


def window_goodput(step: dict[str, Any], seconds: float) -> float:
    """A bench step's goodput over its measured window of ``seconds``: the in-deadline answers
    to the requests sent in it, however late they came (bench's own ``goodput_per_s`` divides
    by the window stretched to the last answer, which understates a server that kept up)."""
    return (step["goodput_per_s"] or 0.0) * step["measured_s"] / seconds


# Closed-loop clients that measure a server's capacity (bench/deadline.py, bench/overload.py).
CAPACITY_CONCURRENCY = 64


def closed_loop_capacity(step: dict[str, Any], concurrency: int, seconds: float) -> float:
    """Answers/s of a closed-loop bench step: ``concurrency`` clients for ``seconds``.

    The step counts every call started in its window, and each client's last one ends after
    the window: the answers within the window are the calls less one per client. Not ``ok``
    over the window (it counts those last calls with none of their time), nor bench's
    ``throughput_per_s`` (its window runs on to the last answer, a tail in which no client
    sends, and so understates what the server carries)."""
    return max(step["ok"] - concurrency, 0) / seconds


def run_bench_cli(url: str, model: str, concurrency: int, seconds: float,
                  metrics_url: str | None) -> PerfRun:
    """``batchgate bench`` in closed loop at ``concurrency``: its figures as a PerfRun."""
    step, command, wall_s, cpu_s = bench_step(url, model, [
        "--concurrency", str(concurrency), "--warmup-s", "1", "--duration-s", f"{seconds:g}",
    ], metrics_url)
    errors = sum(step["errors"].values())
    if errors:
        raise BenchError(f"batchgate bench counted {errors} errors at c={concurrency}: {step['errors']}")
    latency = step["latency_ms"]
    server = step.get("server_metrics") or {}
    row = PerfRow(
        concurrency=concurrency, throughput_per_s=step["throughput_per_s"],
        p50_ms=latency["p50"], p99_ms=latency["p99"], p90_ms=latency["p90"],
        server_queue_ms=server.get("mean_queue_ms"),
    )
    return PerfRun(row=row, stability_percentage=0.0, wall_s=wall_s, cpu_s=cpu_s, command=command)


@contextlib.contextmanager
def confined(cpus: tuple[int, ...] | None) -> Iterator[None]:
    """The processes started inside run on ``cpus`` (None: wherever they may): the calling
    thread's CPUs are set for the while, and children inherit them. The servers, started
    before, keep theirs."""
    if cpus is None:
        yield
        return
    kept = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, kept)


def load_step(server: RunningServer, name: str, load_generator: str, concurrency: int,
              seconds: float, args: argparse.Namespace, perf_args: tuple[str, ...] = ()) -> Step:
    """One closed-loop step on model ``name``; ``perf_args``: further perf_analyzer flags."""
    url = server.address

    def cpu() -> tuple[dict[str, float], dict[str, float]]:
        roles = process_tree(server.pid)
        by_role: dict[str, float] = {}
        for pid, role in roles.items():
            by_role[role] = by_role.get(role, 0.0) + process_cpu_s(pid, descendants=False)
        frontends = [pid for pid, role in roles.items() if role == "frontend"]
        threads = thread_cpu_s(frontends[0]) if len(frontends) == 1 else {}
        return by_role, threads

    before, (cpu_before, threads_before), busy_before = scrape(server, name), cpu(), machine_busy_s()
    with confined(getattr(args, "load_cpus", None)):
        if load_generator == "perf_analyzer":
            perf = run_perf_analyzer(
                url=url, model=name, concurrency=concurrency,
                measurement_interval_ms=int(seconds * 1000), perf_analyzer=args.perf_analyzer,
                extra_args=perf_args,
            )
        else:
            perf = run_bench_cli(url, name, concurrency, seconds, server.metrics_url)
    after, (cpu_after, threads_after), busy_after = scrape(server, name), cpu(), machine_busy_s()

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    # Counted over the load generator's whole run (warm-up and unstable windows included),
    # the same span as the CPU times.
    return Step(
        concurrency=concurrency,
        perf=perf,
        batches=delta("batchgate_batch_size_count"),
        samples=delta("batchgate_batch_size_sum"),
        answered=delta("batchgate_requests_total{status=OK}"),
        compute_s=delta("batchgate_compute_seconds_sum"),
        model_cpu_s=delta("batchgate_model_cpu_seconds_total"),
        queue_waits=delta("batchgate_queue_seconds_count"),
        queue_s=delta("batchgate_queue_seconds_sum"),
        reasons={
            key[len(_REASON_PREFIX):-1]: delta(key)
            for key in sorted(set(before) | set(after))
            if key.startswith(_REASON_PREFIX) and delta(key)
        },
        cpu_s={role: cpu_after.get(role, 0.0) - cpu_before.get(role, 0.0) for role in cpu_after},
        frontend_threads_s={k: v - threads_before.get(k, 0.0) for k, v in threads_after.items()},
        machine_busy_s=busy_after - busy_before,
    )


# -- the run -----------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    repository: Path = args.model_repository.resolve()
    seconds = args.seconds_per_step
    started = time.monotonic()
    _say(f"in-process ceiling (before), {seconds:g} s per batch size ...")
    before = measure_inprocess(repository, args.model, seconds)

    modes: dict[str, dict[str, Any]] = {}
    config = None
    with single_model_repository(repository, args.model, args.parameter) as serving_repository:
        for mode in args.modes:
            if mode == "native" and native.unavailable_reason() is not None:
                modes[mode] = {"skipped": native.unavailable_reason()}
                _say(f"{mode}: skipped: {modes[mode]['skipped']}")
                continue
            if mode == "floor":
                if args.server_arg:
                    _say(f"floor: runs without {' '.join(args.server_arg)} (batchgate's flags)")
                try:
                    server = start_floor(serving_repository / args.model)
                except floor.FloorUnavailable as exc:
                    modes[mode] = {"skipped": str(exc)}
                    _say(f"{mode}: skipped: {exc}")
                    continue
            else:
                _say(f"{mode}: starting the server ...")
                server = start_server(serving_repository, mode, args.model, args.server_arg)
            steps: dict[str, list[Step]] = {}
            try:
                if mode != "floor":
                    config = model_config(server, args.model)
                for generator in args.load_generators:
                    steps[generator] = []
                    for concurrency in (1, HIGH_CONCURRENCY):
                        _say(f"{mode}: {generator} at concurrency {concurrency}, {seconds:g} s ...")
                        steps[generator].append(load_step(server, args.model, generator,
                                                          concurrency, seconds, args))
            except BaseException:
                server.stop()
                raise
            exit_code = server.stop()
            if exit_code != 0:
                raise BenchError(f"the {mode} server exited {exit_code} after SIGTERM:\n"
                                 f"{server.log_tail()}")
            modes[mode] = {"steps": steps, "server_command": server.command,
                           "exit_code": exit_code}

    served = served_batch_sizes(modes)
    _say(f"in-process ceiling (after), and at the served batch sizes {list(served)} ...")
    after = measure_inprocess(repository, args.model, seconds, served)
    from_idle = None
    idle_ms = c1_idle_ms(modes, after[1]["batch_p50_ms"])
    if idle_ms is not None:
        _say(f"in-process batch 1 called after {idle_ms:.2f} ms idle (the c=1 cadence) ...")
        from_idle = measure_from_idle(repository, args.model, seconds, idle_ms)
    return summarize(args, before, after, modes, config, time.monotonic() - started,
                     from_idle)


def served_batch_sizes(modes: dict[str, dict[str, Any]]) -> tuple[int, ...]:
    """The mean batch sizes of the c=64 steps, rounded, in the order met: the in-process rate at
    each is measured after the servers ran, to split a ratio into how large the server's batches
    were and how close it came to the model at those sizes."""
    sizes = []
    for measured in modes.values():
        for _low, high in measured.get("steps", {}).values():
            if high.batch_size:
                sizes.append(high.batch_size)
    return tuple(dict.fromkeys(sizes))


def summarize(
    args: argparse.Namespace,
    before: dict[int, dict[str, Any]],
    after: dict[int, dict[str, Any]],
    modes: dict[str, dict[str, Any]],
    config: Any,
    wall_s: float,
    from_idle: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Every figure of the run; ``config`` is the model's ModelConfig as the server reports it;
    ``from_idle``: the model at batch 1 called from idle (``measure_from_idle``), if measured."""
    ceiling = _mean(before[CEILING_BATCH]["samples_per_s"], after[CEILING_BATCH]["samples_per_s"])
    batch1_ms = _mean(before[1]["batch_p50_ms"], after[1]["batch_p50_ms"])
    params = {key: value.string_value for key, value in config.parameters.items()} if config else {}
    dynamic = config.dynamic_batching if config is not None and config.HasField("dynamic_batching") else None
    results: dict[str, Any] = {}
    for mode, measured in modes.items():
        if "skipped" in measured:
            results[mode] = measured
            continue
        target = TARGETS.get(mode)  # the floor is a yardstick: no targets
        yardstick = modes.get("floor", {}).get("steps", {})
        by_generator = {}
        for generator, (low, high) in measured["steps"].items():
            ratio = high.perf.row.throughput_per_s / ceiling
            # The same throughput against the model alone at the batch size the server formed.
            at_batch = after.get(high.batch_size) if high.batch_size else None
            at_batch_per_s = at_batch["samples_per_s"] if at_batch else None
            added_p50 = low.perf.row.p50_ms - batch1_ms
            checks = {}
            if target is not None:
                checks = {
                    "ratio": (ratio, target.ratio, ratio >= target.ratio),
                    "c64_p99_ms": (high.perf.row.p99_ms, target.p99_ms,
                                   high.perf.row.p99_ms <= target.p99_ms),
                    "added_p50_ms": (added_p50, target.added_p50_ms,
                                     added_p50 <= target.added_p50_ms),
                }
                for key, value, limit in (("outside_model_us", high.outside_model_us,
                                           target.outside_model_us),
                                          ("executor_us", high.executor_us, target.executor_us)):
                    if limit is not None and value is not None:
                        checks[key] = (value, limit, value <= limit)
            # The same load generator against the floor, in this run.
            floor_low, floor_high = yardstick.get(generator, (None, None))
            by_generator[generator] = {
                "steps": [low.as_dict(), high.as_dict()],
                "figures": {
                    "c64_throughput_per_s": high.perf.row.throughput_per_s,
                    "ratio": ratio,
                    "inprocess_at_batch_per_s": at_batch_per_s,
                    "vs_inprocess_at_batch": (high.perf.row.throughput_per_s / at_batch_per_s
                                              if at_batch_per_s else None),
                    "c64_p99_ms": high.perf.row.p99_ms,
                    "c1_p50_ms": low.perf.row.p50_ms,
                    "added_p50_ms": added_p50,
                    "added_p50_from_idle_ms": (low.perf.row.p50_ms - from_idle["batch_p50_ms"]
                                               if from_idle else None),
                    "outside_model_us": high.outside_model_us,
                    "executor_us": high.executor_us,
                    "frontend_us": high.frontend_us,
                    "vs_floor": (high.perf.row.throughput_per_s
                                 / floor_high.perf.row.throughput_per_s
                                 if floor_high and mode != "floor" else None),
                    "p50_over_floor_ms": (low.perf.row.p50_ms - floor_low.perf.row.p50_ms
                                          if floor_low and mode != "floor" else None),
                },
                "targets": {key: {"value": v, "target": t, "pass": ok}
                            for key, (v, t, ok) in checks.items()},
            }
        results[mode] = {"load_generators": by_generator,
                         "server_command": measured["server_command"],
                         "server_exit_code": measured["exit_code"]}
    return {
        "machine": machine(),
        "model": args.model,
        "settings": {
            "version": before[CEILING_BATCH]["version"],
            "device": before[CEILING_BATCH]["device"],
            "torch": before[CEILING_BATCH]["torch"],
            "inprocess_threads": THREADS,
            "server_intra_op_threads": params.get("INTRA_OP_THREAD_COUNT"),
            "max_batch_size": config.max_batch_size if config else None,
            "preferred_batch_sizes": list(dynamic.preferred_batch_size) if dynamic else None,
            "max_queue_delay_us": dynamic.max_queue_delay_microseconds if dynamic else None,
            "max_inflight_batches": params.get("max_inflight_batches"),
            "server_args": args.server_arg,
            "load_cpus": list(getattr(args, "load_cpus", None) or []) or None,
            "seconds_per_step": args.seconds_per_step,
        },
        "inprocess": {"before": before, "after": after},
        "ceiling_samples_per_s": ceiling,
        "inprocess_batch1_ms": batch1_ms,
        "inprocess_batch1_from_idle": from_idle,
        "modes": results,
        "wall_s": wall_s,
    }


def render(report: dict[str, Any]) -> str:
    m, s = report["machine"], report["settings"]
    before, after = report["inprocess"]["before"], report["inprocess"]["after"]
    b64, a64 = before[str(CEILING_BATCH)], after[str(CEILING_BATCH)]
    b1, a1 = before["1"], after["1"]

    def opt(value: float | None, fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)

    delay = s["max_queue_delay_us"]
    batching = (
        f"preferred {s['preferred_batch_sizes']}, max queue delay {delay} µs"
        if delay is not None else "no dynamic batching"
    )
    lines = [
        f"machine:  {m['usable_cores']} usable cores of {m['cores']}, {m['cpu_model']}, "
        f"Linux {m['kernel']}, Python {m['python']}, torch {s['torch']}, grpcio {m['grpcio']}",
        f"model:    {report['model']} v{s['version']} on {s['device']}, max_batch_size "
        f"{s['max_batch_size']}, {batching}",
        f"settings: {s['inprocess_threads']} intra-op thread in-process, server "
        f"INTRA_OP_THREAD_COUNT={s['server_intra_op_threads']}, max_inflight_batches="
        f"{s['max_inflight_batches']}; closed loop on loopback, {s['seconds_per_step']:g} s "
        f"windows; extra server flags: {' '.join(s['server_args']) or 'none'}; load generators "
        f"on {'CPU ' + cpus_text(s['load_cpus']) if s.get('load_cpus') else 'every CPU'}",
        f"ceiling:  in-process batch 64 {report['ceiling_samples_per_s']:,.0f} samples/s (before "
        f"{b64['samples_per_s']:,.0f}, after {a64['samples_per_s']:,.0f}); batch 1 p50 "
        f"{report['inprocess_batch1_ms']:.2f} ms (before {b1['batch_p50_ms']:.2f}, after "
        f"{a1['batch_p50_ms']:.2f})",
        *([f"from idle: in-process batch 1 p50 {idle['batch_p50_ms']:.2f} ms with the thread "
           f"asleep {idle['idle_ms']:.2f} ms before each call (the fastest c=1 step's p50 less "
           "the batch-1 time)"] if (idle := report.get("inprocess_batch1_from_idle")) else []),
        "at the served batch sizes (after): " + (", ".join(
            f"batch {size} {result['samples_per_s']:,.0f} samples/s"
            for size, result in after.items() if size not in (str(CEILING_BATCH), "1")) or "none"),
        "",
    ]
    header = ("mode", "load", "c=64 /s", "ratio", "c=64 batch", "vs in-process at that batch",
              "c=64 p99 ms", "added p50 ms", "added p50 vs model from idle ms",
              "outside model µs/req", "executor µs/req", "front end µs/req",
              "front-end threads busy (largest share)")
    rows = [header]
    verdicts = []
    for mode, result in report["modes"].items():
        if "skipped" in result:
            rows.append((mode, "skipped", result["skipped"], *[""] * (len(header) - 3)))
            continue
        for generator, r in result["load_generators"].items():
            f, t = r["figures"], r["targets"]
            high = r["steps"][1]
            spread = high["frontend_threads"]

            def mark(key: str, text: str) -> str:
                return text if key not in t else f"{text} {'✓' if t[key]['pass'] else '✗'}"

            rows.append((
                mode, generator, f"{f['c64_throughput_per_s']:,.0f}",
                mark("ratio", f"{f['ratio']:.2f}"), opt(high["mean_batch_size"], ".1f"),
                opt(f.get("vs_inprocess_at_batch"), ".2f"),
                mark("c64_p99_ms", f"{f['c64_p99_ms']:.1f}"),
                mark("added_p50_ms", f"{f['added_p50_ms']:+.2f}"),
                opt(f.get("added_p50_from_idle_ms"), "+.2f"),
                mark("outside_model_us", opt(f["outside_model_us"], ".0f")),
                mark("executor_us", opt(f["executor_us"], ".0f")),
                opt(f["frontend_us"], ".0f"),
                "n/a" if spread is None else
                f"{spread['busy_threads']} ({spread['largest_share']:.0%})",
            ))
            for key, check in t.items():
                verdicts.append(f"{mode}/{generator} {key}: {check['value']:.3g} vs "
                                f"{check['target']:g}: {'pass' if check['pass'] else 'short'}")
        if result["server_exit_code"] != 0:
            verdicts.append(f"{mode}: exit {result['server_exit_code']} after SIGTERM")
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header))]
    for r in rows:
        lines.append("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip())
    lines.append("")
    against = [
        f"  {mode}/{generator}: c=64 {f['vs_floor']:.2f} of the floor's throughput, c=1 p50 "
        f"{f['p50_over_floor_ms']:+.2f} ms over the floor's"
        for mode, result in report["modes"].items() if "load_generators" in result
        for generator, r in result["load_generators"].items()
        if (f := r["figures"]).get("vs_floor") is not None]
    if against:
        lines.append("against the floor (batchgate-floor: the same model, no Python; same run):")
        lines.extend(against)
        lines.append("")
    lines.append("targets (2-core machine): " + "; ".join(
        f"{mode} ratio ≥ {t.ratio}, p99 ≤ {t.p99_ms:g} ms, added p50 ≤ {t.added_p50_ms} ms"
        + (f", outside the model ≤ {t.outside_model_us:g} µs (executor ≤ {t.executor_us:g})"
           if t.outside_model_us else "")
        for mode, t in TARGETS.items() if mode in report["modes"]))
    lines.extend(f"  {v}" for v in verdicts)
    lines.append(f"\nwhole run: {report['wall_s']:.0f} s")
    return "\n".join(lines)


def _mean(a: float, b: float) -> float:
    return (a + b) / 2


_say = progress("batchgate.bench.serving")


def _choices(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        chosen = [item for item in text.split(",") if item]
        unknown = [item for item in chosen if item not in allowed]
        if unknown or not chosen:
            raise argparse.ArgumentTypeError(
                f"a comma-separated list of {', '.join(allowed)}, got {text!r}")
        return chosen
    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchgate.bench.serving", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", help="model to measure (default: %(default)s)")
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_REPOSITORY,
                        help="repository holding the model (default: the example models)")
    parser.add_argument("--modes", type=_choices(SERVING_MODES), default=list(SERVING_MODES),
                        help="server modes to measure, in order (default: "
                             "native,single,floor; native is skipped, saying why, where "
                             "it is not built). floor: batchgate-floor, the all-C++ yardstick "
                             "(batchgate.bench.floor), built on first use, skipped, saying why, "
                             "where it cannot be")
    parser.add_argument("--load-generators", type=_choices(LOAD_GENERATORS),
                        default=list(LOAD_GENERATORS),
                        help="closed-loop load: batchgate bench and/or Triton's perf_analyzer "
                             "(default: both)")
    parser.add_argument("--seconds-per-step", type=float, default=4.0,
                        help="in-process seconds per batch size, and each load step's "
                             "measurement window (default: %(default)s)")
    parser.add_argument("--json", type=Path, default=None, help="also write the full report here")
    parser.add_argument("--perf-analyzer", type=Path, default=DEFAULT_PERF_ANALYZER,
                        help="perf_analyzer executable (default: scripts/perf_analyzer)")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="extra flag for every server, repeatable "
                             "(e.g. --server-arg=--switch-interval-s=0.005)")
    parser.add_argument("--parameter", action="append", default=[], metavar="KEY=VALUE",
                        help="set a config parameter of the served model, repeatable "
                             "(e.g. --parameter max_inflight_batches=1)")
    parser.add_argument("--load-cpus", default=None, metavar="LIST",
                        help="CPUs the load generators run on, as taskset -c writes them "
                             "(default: every CPU); with --server-arg=--model-cpus=LIST, the "
                             "other CPUs keep the clients off the model's, as remote clients "
                             "would be")
    args = parser.parse_args(argv)
    if args.load_cpus is not None:
        try:
            args.load_cpus = cpu_list(args.load_cpus)
        except ValueError:
            parser.error(f"--load-cpus must be a CPU list such as 0 or 0-3,6, got "
                         f"{args.load_cpus!r}")
        usable = usable_cpus()
        if usable is not None and not set(args.load_cpus) <= usable:
            parser.error(f"--load-cpus {cpus_text(args.load_cpus)}: this process may run "
                         f"only on CPUs {cpus_text(usable)}")
    try:
        args.parameter = dict(item.split("=", 1) for item in args.parameter)
    except ValueError:
        parser.error(f"--parameter takes KEY=VALUE, got {args.parameter}")
    if args.seconds_per_step <= 0:
        parser.error(f"--seconds-per-step must be > 0, got {args.seconds_per_step}")
    try:
        report = run(args)
    except RUN_ERRORS as exc:
        print(f"batchgate.bench.serving: {exc}", file=sys.stderr)
        return 1
    # JSON keys are strings: render reads the report as it is written.
    return emit(json.loads(json.dumps(report)), render, args.json)


if __name__ == "__main__":
    sys.exit(main())
