"""Deadline-driven batching against the fixed-delay batcher: SLO attainment and goodput.

Bursty on/off open-loop load around the server's capacity, every request with the same
deadline (a gRPC deadline counted from its *intended* send time), against two servers started
one after the other on the same model:

1. **fixed delay**: ``batch_policy: fifo`` at its best settings, chosen by a short sweep over
   ``max_queue_delay_microseconds`` and admission control on or off at ``--sweep-load``;
2. **deadline**: ``batch_policy: deadline`` (earliest deadline first, batches sized from the
   latency profile, infeasible requests dropped, admission control).

Then both run at each load of ``--loads`` (× the capacity measured on the first server), and
the table gives, per policy and load: attainment (requests answered OK within their deadline ÷
requests sent), goodput (those per second), latency of the answered ones, and how the rest
failed. The issue's target: at the load where the fixed delay attains 90 %, the deadline policy
attains ≥ 99 % with a goodput at least the fixed delay's.

    python -m bench.deadline [--model mlp] [--deadline-ms 50] [--loads 0.8,1.0,1.2] [--json F]

The load comes from one function, ``DRIVER`` (a ``LoadSpec`` in, one ``Record`` per request
out). ``drive_open_loop`` below is a minimal stand-in on the SDK's ``AsyncClient`` in this
process; the load-test CLI (``bench/loadgen``) replaces it — a swap of that one name — since a
single asyncio process cannot drive a fast model at capacity on a small machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from bench.serving import DEFAULT_REPOSITORY, BenchError, ServerProcess, machine
from clients import AsyncClient, BatchgateError, RetryPolicy
from protos import model_config_pb2

NUMPY_TYPES = {
    "TYPE_BOOL": np.bool_, "TYPE_UINT8": np.uint8, "TYPE_INT8": np.int8, "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32, "TYPE_INT64": np.int64, "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32, "TYPE_FP64": np.float64,
}
TARGET_FIXED_ATTAINMENT = 0.90
TARGET_DEADLINE_ATTAINMENT = 0.99

# --synthetic: a model whose batch of n takes FIXED + PER_SAMPLE * n ms (sleeping, like a
# GPU's kernel time: the GIL is free), so that batching, not the front end, sets capacity.
SYNTHETIC_CONFIG = """
name: "synthetic"
backend: "pytorch"
max_batch_size: 32
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 16 ] } ]
dynamic_batching { max_queue_delay_microseconds: 0 }
instance_group [ { count: 1 kind: KIND_CPU } ]
parameters { key: "fixed_ms" value: { string_value: "FIXED" } }
parameters { key: "per_sample_ms" value: { string_value: "PER_SAMPLE" } }
"""
SYNTHETIC_MODEL = """
import time

import torch


class Synthetic(torch.nn.Module):
    def __init__(self, fixed_s, per_sample_s):
        super().__init__()
        self.fixed_s, self.per_sample_s = fixed_s, per_sample_s

    def forward(self, x):
        time.sleep(self.fixed_s + self.per_sample_s * x.shape[0])
        return x * 2


def build_model(parameters):
    return Synthetic(float(parameters["fixed_ms"]) / 1e3, float(parameters["per_sample_ms"]) / 1e3)
"""


@contextlib.contextmanager
def synthetic_repository(fixed_ms: float, per_sample_ms: float) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="bench-synthetic-") as scratch:
        folder = Path(scratch) / "synthetic"
        (folder / "1").mkdir(parents=True)
        (folder / "config.pbtxt").write_text(
            SYNTHETIC_CONFIG.replace("PER_SAMPLE", str(per_sample_ms)).replace("FIXED", str(fixed_ms)))
        (folder / "1" / "model.py").write_text(SYNTHETIC_MODEL)
        yield Path(scratch)


# -- the load: what is sent, and what came back --------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LoadSpec:
    """One open-loop run: ``offsets_s[i]`` is request i's intended send time after the start."""

    address: str
    model: str
    inputs: dict[str, np.ndarray]
    offsets_s: np.ndarray
    deadline_s: float


@dataclasses.dataclass(frozen=True)
class Record:
    offset_s: float  # intended send time, from the start
    latency_s: float  # from the intended send time to the answer
    code: str  # "OK" or the gRPC status code's name


def drive_open_loop(spec: LoadSpec) -> list[Record]:
    """Send each request at its intended time whatever the answers; the stand-in driver."""
    return asyncio.run(_drive(spec))


async def _drive(spec: LoadSpec) -> list[Record]:
    records: list[Record] = []
    async with AsyncClient(spec.address, retry=RetryPolicy(max_attempts=1)) as client:
        await client.infer(spec.model, spec.inputs, timeout_s=30)  # opens the channel
        start = time.monotonic() + 0.05

        async def one(offset: float) -> None:
            intended = start + offset
            left = intended + spec.deadline_s - time.monotonic()
            code = "DEADLINE_EXCEEDED"
            if left > 0:
                try:
                    await client.infer(spec.model, spec.inputs, timeout_s=left)
                    code = "OK"
                except BatchgateError as exc:
                    code = exc.code.name
            records.append(Record(offset, time.monotonic() - intended, code))

        tasks = []
        for offset in spec.offsets_s:
            delay = start + offset - time.monotonic()
            if delay > 0.0005:  # send what is due together rather than sleep a few µs each
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(float(offset))))
        await asyncio.gather(*tasks)
    return records


# The one name to swap for the load-test CLI's driver (same LoadSpec in, Records out).
DRIVER: Callable[[LoadSpec], list[Record]] = drive_open_loop


async def _closed_loop(address: str, model: str, inputs: dict[str, np.ndarray],
                       seconds: float, concurrency: int) -> int:
    answered = 0
    async with AsyncClient(address, retry=RetryPolicy(max_attempts=1), timeout_s=30) as client:
        await client.infer(model, inputs)
        end = time.monotonic() + seconds

        async def loop() -> None:
            nonlocal answered
            while time.monotonic() < end:
                with contextlib.suppress(BatchgateError):
                    await client.infer(model, inputs)
                    answered += 1

        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return answered


def measure_capacity(address: str, model: str, inputs: dict[str, np.ndarray],
                     seconds: float = 5.0, concurrency: int = 64) -> float:
    """Requests/s the server answers to ``concurrency`` closed-loop clients."""
    return asyncio.run(_closed_loop(address, model, inputs, seconds, concurrency)) / seconds


def bursty_offsets(mean_rate: float, seconds: float, *, on_s: float, off_s: float,
                   peak: float, seed: int = 0) -> np.ndarray:
    """Poisson arrivals at ``peak`` × ``mean_rate`` for ``on_s``, then a lower rate for
    ``off_s`` (so the mean over a cycle is ``mean_rate``), repeated for ``seconds``."""
    cycle = on_s + off_s
    on_rate = peak * mean_rate
    off_rate = (mean_rate * cycle - on_rate * on_s) / off_s
    if off_rate < 0:
        raise ValueError(f"peak {peak} × on {on_s} s exceeds a whole cycle's arrivals at the mean")
    rng = np.random.default_rng(seed)
    offsets: list[np.ndarray] = []
    for begin in np.arange(0.0, seconds, cycle):
        for phase_start, phase_s, rate in ((begin, on_s, on_rate), (begin + on_s, off_s, off_rate)):
            count = rng.poisson(rate * phase_s)
            offsets.append(phase_start + np.sort(rng.uniform(0.0, phase_s, count)))
    every = np.concatenate(offsets)
    return every[every < seconds]


# -- one server, one configuration ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Policy:
    name: str
    delay_us: int
    parameters: dict[str, str]

    def label(self) -> str:
        settings = [f"delay {self.delay_us} µs", *(f"{k}={v}" for k, v in self.parameters.items())]
        return f"{self.name} ({', '.join(settings)})"


@contextlib.contextmanager
def policy_repository(repository: Path, model: str, policy: Policy) -> Iterator[Path]:
    """A repository holding only ``model``, its config set to ``policy``."""
    source = repository / model
    with tempfile.TemporaryDirectory(prefix="bench-deadline-") as scratch:
        target = Path(scratch) / model
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        config = (target / "config.pbtxt").read_text()
        config, found = re.subn(r"max_queue_delay_microseconds:\s*\d+",
                                f"max_queue_delay_microseconds: {policy.delay_us}", config)
        if not found:
            raise BenchError(f"{source}/config.pbtxt: no max_queue_delay_microseconds to set")
        config += "".join(
            f'\nparameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'
            for key, value in policy.parameters.items())
        (target / "config.pbtxt").write_text(config)
        yield Path(scratch)


@contextlib.contextmanager
def serving(repository: Path, model: str, policy: Policy, server_args: list[str]
            ) -> Iterator[ServerProcess]:
    with policy_repository(repository, model, policy) as scratch:
        server = ServerProcess(scratch, model, server_args)
        try:
            server.wait_serving()
            yield server
        finally:
            code = server.stop()
            if code != 0:
                print(f"warning: the server exited {code}:\n{server.log_tail()}", file=sys.stderr)


def model_inputs(server: ServerProcess) -> dict[str, np.ndarray]:
    """One sample per input, shaped and typed from the served config (zeros are valid ids)."""
    config = server.model_config()
    inputs = {}
    for tensor in config.input:
        kind = model_config_pb2.DataType.Name(tensor.data_type)
        if kind not in NUMPY_TYPES or any(d < 0 for d in tensor.dims):
            raise BenchError(f"input {tensor.name}: {kind} {list(tensor.dims)} is not supported here")
        rng = np.random.default_rng(0)
        sample = rng.random((1, *tensor.dims)) if kind.startswith("TYPE_FP") else np.zeros((1, *tensor.dims))
        inputs[tensor.name] = sample.astype(NUMPY_TYPES[kind])
    return inputs


@dataclasses.dataclass
class Result:
    policy: str
    load: float
    rate: float
    sent: int
    attained: int
    seconds: float
    latencies_ms: list[float]
    codes: dict[str, int]
    server: dict[str, float]

    @property
    def attainment(self) -> float:
        return self.attained / self.sent if self.sent else 0.0

    @property
    def goodput(self) -> float:
        return self.attained / self.seconds

    def row(self) -> dict[str, Any]:
        ok = np.array(self.latencies_ms) if self.latencies_ms else np.array([np.nan])
        return {
            "policy": self.policy, "load": self.load, "rate_per_s": round(self.rate, 1),
            "sent": self.sent, "attainment": round(self.attainment, 4),
            "goodput_per_s": round(self.goodput, 1),
            "ok_p50_ms": round(float(np.percentile(ok, 50)), 2),
            "ok_p99_ms": round(float(np.percentile(ok, 99)), 2),
            "codes": self.codes, "server": self.server,
        }


def summarize(records: list[Record], *, deadline_s: float, warmup_s: float, seconds: float,
              policy: str, load: float, rate: float, server: dict[str, float]) -> Result:
    """Attainment and goodput over the requests meant to be sent after the warm-up."""
    measured = [r for r in records if r.offset_s >= warmup_s]
    attained = [r for r in measured if r.code == "OK" and r.latency_s <= deadline_s]
    return Result(
        policy=policy, load=load, rate=rate, sent=len(measured), attained=len(attained),
        seconds=seconds - warmup_s,
        latencies_ms=[r.latency_s * 1e3 for r in measured if r.code == "OK"],
        codes=dict(Counter(r.code for r in measured)), server=server,
    )


def server_counts(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the server counted during the run: failures by reason, SLO, batches."""
    keep = ("batchgate_request_failures_total", "batchgate_slo_requests_total",
            "batchgate_batches_total", "batchgate_batch_size_sum", "batchgate_batch_size_count")
    return {k: after[k] - before.get(k, 0.0) for k in after
            if k.startswith(keep) and after[k] - before.get(k, 0.0)}


def run_load(args: argparse.Namespace, policy: Policy, load: float, capacity: float,
             seconds: float) -> Result:
    rate = load * capacity
    offsets = bursty_offsets(rate, seconds, on_s=args.on_s, off_s=args.off_s, peak=args.peak,
                             seed=args.seed)
    with serving(args.model_repository, args.model, policy, args.server_arg) as server:
        spec = LoadSpec(f"127.0.0.1:{server.grpc_port}", args.model, model_inputs(server),
                        offsets, args.deadline_ms / 1e3)
        before = server.scrape()
        records = DRIVER(spec)
        after = server.scrape()
    result = summarize(records, deadline_s=spec.deadline_s, warmup_s=args.warmup_s,
                       seconds=seconds, policy=policy.label(), load=load, rate=rate,
                       server=server_counts(before, after))
    _say(f"{policy.label()} at {load:g} × capacity: attainment {result.attainment:.1%}, "
         f"goodput {result.goodput:.0f}/s, codes {result.codes}")
    return result


def best_fixed(args: argparse.Namespace, capacity: float) -> tuple[Policy, list[Result]]:
    """The fixed-delay settings with the best attainment (then goodput) at ``--sweep-load``."""
    trials = []
    for delay in args.sweep_delays_us:
        for admission in ("false", "true"):
            policy = Policy("fixed delay", delay, {"batch_policy": "fifo", "admission": admission})
            trials.append((policy, run_load(args, policy, args.sweep_load, capacity,
                                            args.sweep_seconds)))
    best = max(trials, key=lambda t: (t[1].attainment, t[1].goodput))
    return best[0], [result for _, result in trials]


def run(args: argparse.Namespace) -> dict[str, Any]:
    baseline = Policy("fixed delay", 0, {"batch_policy": "fifo", "admission": "false"})
    with serving(args.model_repository, args.model, baseline, args.server_arg) as server:
        inputs = model_inputs(server)
        capacity = args.capacity or measure_capacity(
            f"127.0.0.1:{server.grpc_port}", args.model, inputs, args.capacity_seconds)
    _say(f"capacity: {capacity:.0f} requests/s (closed loop, 64 clients)")
    fixed, sweep = best_fixed(args, capacity)
    _say(f"best fixed-delay settings: {fixed.label()}")
    deadline = Policy("deadline", args.deadline_delay_us, {"batch_policy": "deadline"})
    results = []
    for load in args.loads:
        results.append(run_load(args, fixed, load, capacity, args.seconds))
        results.append(run_load(args, deadline, load, capacity, args.seconds))
    return {
        "machine": machine(), "model": args.model, "deadline_ms": args.deadline_ms,
        "burst": {"on_s": args.on_s, "off_s": args.off_s, "peak": args.peak},
        "capacity_per_s": capacity, "fixed_best": fixed.label(),
        "sweep": [r.row() for r in sweep], "results": [r.row() for r in results],
        "verdict": verdict(results),
    }


def verdict(results: list[Result]) -> dict[str, Any]:
    """At the load where the fixed delay attains closest to 90 %: is the target met?"""
    pairs = list(zip(results[::2], results[1::2]))
    fixed, deadline = min(pairs, key=lambda p: abs(p[0].attainment - TARGET_FIXED_ATTAINMENT))
    return {
        "load": fixed.load, "fixed_attainment": fixed.attainment,
        "deadline_attainment": deadline.attainment, "fixed_goodput": fixed.goodput,
        "deadline_goodput": deadline.goodput,
        "met": deadline.attainment >= TARGET_DEADLINE_ATTAINMENT
        and deadline.goodput >= fixed.goodput,
    }


def render(report: dict[str, Any]) -> str:
    lines = [
        (f"model {report['model']}, deadline {report['deadline_ms']} ms, capacity "
         f"{report['capacity_per_s']:.0f}/s, bursts {report['burst']}"),
        f"fixed delay at its best: {report['fixed_best']}",
        "",
        ("| policy | load × capacity | rate/s | sent | attainment | goodput/s | OK p50 ms | "
         "OK p99 ms | answers |"),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["results"]:
        lines.append(
            f"| {row['policy']} | {row['load']:g} | {row['rate_per_s']} | {row['sent']} | "
            f"{row['attainment']:.1%} | {row['goodput_per_s']} | {row['ok_p50_ms']} | "
            f"{row['ok_p99_ms']} | {row['codes']} |")
    v = report["verdict"]
    lines += [
        "",
        (f"at {v['load']:g} × capacity the fixed delay attains {v['fixed_attainment']:.1%} "
         f"(target: the load where it attains {TARGET_FIXED_ATTAINMENT:.0%}); the deadline "
         f"policy {v['deadline_attainment']:.1%} (target ≥ {TARGET_DEADLINE_ATTAINMENT:.0%}), "
         f"goodput {v['deadline_goodput']:.0f}/s vs {v['fixed_goodput']:.0f}/s: "
         f"{'met' if v['met'] else 'NOT met'}"),
    ]
    return "\n".join(lines)


def _numbers(text: str, kind: Callable[[str], Any]) -> list:
    return [kind(item) for item in text.split(",") if item.strip()]


def _say(message: str) -> None:
    print(f"[bench.deadline] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.deadline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_REPOSITORY)
    parser.add_argument("--deadline-ms", type=float, default=50.0,
                        help="every request's deadline, from its intended send time")
    parser.add_argument("--loads", type=lambda t: _numbers(t, float), default=[0.8, 1.0, 1.2],
                        help="mean offered loads, × the measured capacity")
    parser.add_argument("--seconds", type=float, default=20.0, help="each measured run")
    parser.add_argument("--warmup-s", type=float, default=2.0,
                        help="the first seconds of each run, left out of the figures")
    parser.add_argument("--on-s", type=float, default=0.5, help="burst length")
    parser.add_argument("--off-s", type=float, default=1.5, help="quiet length between bursts")
    parser.add_argument("--peak", type=float, default=2.5,
                        help="arrival rate in a burst, × the mean rate")
    parser.add_argument("--sweep-delays-us", type=lambda t: _numbers(t, int),
                        default=[0, 1000, 5000, 20000],
                        help="max_queue_delay_microseconds values tried for the fixed delay")
    parser.add_argument("--sweep-load", type=float, default=1.0)
    parser.add_argument("--sweep-seconds", type=float, default=8.0)
    parser.add_argument("--deadline-delay-us", type=int, default=0,
                        help="max_queue_delay_microseconds of the deadline policy (it waits "
                             "for MIN_BATCH no longer than the earliest deadline allows)")
    parser.add_argument("--capacity", type=float, default=0.0,
                        help="requests/s to take as capacity instead of measuring it")
    parser.add_argument("--capacity-seconds", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-arg", action="append", default=[],
                        help="a flag for the server (repeatable), e.g. --server-arg=--frontends=2")
    parser.add_argument("--synthetic-ms", type=lambda t: _numbers(t, float), metavar="FIXED,PER",
                        help="serve a generated model whose batch of n sleeps FIXED + PER × n ms "
                             "instead of --model (batching, not the front end, then sets capacity)")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args(argv)
    try:
        if args.synthetic_ms:
            fixed_ms, per_sample_ms = args.synthetic_ms
            with synthetic_repository(fixed_ms, per_sample_ms) as repository:
                args.model, args.model_repository = "synthetic", repository
                report = run(args)
        else:
            report = run(args)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
