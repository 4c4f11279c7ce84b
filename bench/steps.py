"""What the serving benchmarks share: the server of one model as a subprocess, its
``/metrics``, and one closed-loop step under load (``batchgate bench`` or Triton's
perf_analyzer) with the server's CPU time read around it."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
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

from batchgate.bench._perf_analyzer import PerfAnalyzerError, PerfRow, PerfRun, run_perf_analyzer
from batchgate.bench.harness.repository import copy_model
from batchgate.bench.harness.server import RunningServer, ServerError, start_process
from batchgate.bench.machine import machine_busy_s, process_cpu_s, process_tree, thread_cpu_s
from batchgate.protos import inference_pb2, inference_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_REPOSITORY = ROOT / "models"
SERVER_START_TIMEOUT_S = 120.0


class BenchError(RuntimeError):
    pass


# What a benchmark's main reports as a failed run rather than a traceback.
RUN_ERRORS = (BenchError, ServerError, PerfAnalyzerError)


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
