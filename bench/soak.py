"""The soak: hours of traffic compressed into minutes, looking for leaks and lost requests.

One run (at most 10 minutes of load) against ``batchgate serve`` as a subprocess, in single- or
multi-process mode, with three kinds of traffic interleaved on the same connections:

- **valid** requests to the example models at random batch sizes, each answer compared with
  the model run in this process (fp32, same weights);
- **invalid** requests: wrong shape, wrong datatype, an unknown input, an unknown model; each
  must get its own status code (INVALID_ARGUMENT / NOT_FOUND), never INTERNAL;
- **cancelled** requests: sent, then cancelled by the client after a random short wait.

What it checks, and prints:

- **exactly one answer per request**: every call ends (each has a deadline far above the
  expected latency, so a hang shows as DEADLINE_EXCEEDED, counted as lost), and the server's
  own ``batchgate_requests_total`` grew by exactly the client's count for every status except
  the cancelled traffic, whose calls may end either way;
- **memory**: the resident set size of the server's processes (the supervisor and its children
  in multi-process mode), sampled every second; growth from the end of warm-up to the end of
  the run must stay under 5 %.

    python -m batchgate.bench.soak [--seconds 600] [--warmup-s 60] [--mode single] [--concurrency 16]
                         [--json FILE]

Exit status 0 when both checks pass, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import random
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
from prometheus_client.parser import text_string_to_metric_families

from batchgate.bench.inprocess import load as load_inprocess
from batchgate.bench.steps import ROOT, start_server
from batchgate.clients import AsyncClient, BatchgateError, RetryPolicy
from batchgate.server.metrics import UNKNOWN_MODEL_LABEL

MAX_SECONDS = 600.0  # a soak runs 10 minutes at most
RSS_GROWTH_LIMIT = 0.05
CALL_TIMEOUT_S = 30.0  # far above any latency here: reaching it means a request was lost
UNKNOWN_MODEL = "no_such_model"  # what the invalid traffic names that the repository lacks
MODELS = ("mlp", "cnn", "encoder")
INVALID_KINDS = ("shape", "datatype", "input_name", "model")
INVALID_CODES = {
    "shape": "INVALID_ARGUMENT",
    "datatype": "INVALID_ARGUMENT",
    "input_name": "INVALID_ARGUMENT",
    "model": "NOT_FOUND",
}


@dataclasses.dataclass
class Reference:
    """Known inputs and the model's own answers to them, per model and batch size."""

    input_name: str
    output_name: str
    cases: list[tuple[np.ndarray, np.ndarray]]


def references(repository: Path, seed: int = 0) -> dict[str, Reference]:
    """A handful of (input, expected output) pairs per model, computed in this process."""
    torch.set_num_threads(1)
    rng = np.random.default_rng(seed)
    refs: dict[str, Reference] = {}
    for name in MODELS:
        loaded = load_inprocess(repository / name)
        spec = loaded.spec
        (tensor,) = spec.inputs
        cases = []
        for rows in (1, 2, 3, 5, 8):
            dims = tuple(d if d >= 0 else 16 for d in tensor.dims)
            if tensor.datatype == "INT64":
                x = rng.integers(0, 100, size=(rows, *dims), dtype=np.int64)
            else:
                x = rng.random((rows, *dims), dtype=np.float32)
            with torch.inference_mode():
                y = loaded.module(torch.from_numpy(x))
            y = y[0] if isinstance(y, (tuple, list)) else y
            cases.append((x, y.numpy()))
        refs[name] = Reference(tensor.name, spec.outputs[0].name, cases)
    return refs


class Tally:
    """Client-side outcomes: kind -> model -> status name -> count."""

    def __init__(self) -> None:
        self.counts: dict[str, dict[str, collections.Counter]] = collections.defaultdict(
            lambda: collections.defaultdict(collections.Counter))
        self.wrong_answers = 0
        self.wrong_codes: collections.Counter = collections.Counter()
        self.lost = 0

    def add(self, kind: str, model: str, status: str) -> None:
        self.counts[kind][model][status] += 1

    def total(self) -> int:
        return sum(sum(c.values()) for per_model in self.counts.values() for c in per_model.values())

    def as_dict(self) -> dict[str, Any]:
        return {kind: {m: dict(c) for m, c in per_model.items()}
                for kind, per_model in self.counts.items()}


async def one_valid(client: AsyncClient, rng: random.Random, refs: dict[str, Reference],
                    tally: Tally) -> None:
    model = rng.choice(MODELS)
    ref = refs[model]
    x, expected = rng.choice(ref.cases)
    try:
        out = await client.infer(model, {ref.input_name: x}, timeout_s=CALL_TIMEOUT_S)
    except BatchgateError as e:
        tally.add("valid", model, e.code.name)
        if e.code is grpc.StatusCode.DEADLINE_EXCEEDED:
            tally.lost += 1
        return
    tally.add("valid", model, "OK")
    if not np.allclose(out[ref.output_name], expected, rtol=1e-3, atol=1e-4):
        tally.wrong_answers += 1


def invalid_request(kind: str, rng: random.Random, refs: dict[str, Reference]
                    ) -> tuple[str, dict[str, np.ndarray]]:
    model = rng.choice(MODELS)
    ref = refs[model]
    x, _ = ref.cases[0]
    if kind == "shape":
        return model, {ref.input_name: np.zeros((1, 7), x.dtype)}
    if kind == "datatype":
        return model, {ref.input_name: x.astype(np.float64 if x.dtype != np.float64 else np.int8)}
    if kind == "input_name":
        return model, {"NO_SUCH_INPUT": x}
    return UNKNOWN_MODEL, {ref.input_name: x}


async def one_invalid(client: AsyncClient, rng: random.Random, refs: dict[str, Reference],
                      tally: Tally) -> None:
    kind = rng.choice(INVALID_KINDS)
    model, inputs = invalid_request(kind, rng, refs)
    try:
        await client.infer(model, inputs, timeout_s=CALL_TIMEOUT_S)
    except BatchgateError as e:
        tally.add("invalid", model, e.code.name)
        if e.code.name != INVALID_CODES[kind]:
            tally.wrong_codes[f"{kind}:{e.code.name}"] += 1
        if e.code is grpc.StatusCode.DEADLINE_EXCEEDED:
            tally.lost += 1
        return
    tally.add("invalid", model, "OK")
    tally.wrong_codes[f"{kind}:OK"] += 1


async def one_cancelled(client: AsyncClient, rng: random.Random, refs: dict[str, Reference],
                        tally: Tally) -> None:
    model = rng.choice(MODELS)
    ref = refs[model]
    x, _ = rng.choice(ref.cases)
    task = asyncio.ensure_future(client.infer(model, {ref.input_name: x}, timeout_s=CALL_TIMEOUT_S))
    await asyncio.sleep(rng.uniform(0.0, 0.003))  # a client that gives up after a few ms
    task.cancel()
    try:
        await task
        tally.add("cancelled", model, "OK")  # answered before the cancel
    except asyncio.CancelledError:
        tally.add("cancelled", model, "CANCELLED")
    except BatchgateError as e:
        tally.add("cancelled", model, e.code.name)


async def drive(address: str, refs: dict[str, Reference], seconds: float, concurrency: int,
                weights: tuple[int, int, int], seed: int, on_tick) -> Tally:
    """``concurrency`` closed-loop workers for ``seconds``, each picking a kind by weight."""
    tally = Tally()
    kinds = (one_valid, one_invalid, one_cancelled)
    stop_at = time.monotonic() + seconds

    async def worker(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        # Its own client each: no retries (a retry would hide a lost request), one connection.
        async with AsyncClient(address, retry=RetryPolicy(max_attempts=1)) as client:
            while time.monotonic() < stop_at:
                kind = rng.choices(kinds, weights)[0]
                await kind(client, rng, refs, tally)

    async def ticker() -> None:
        while time.monotonic() < stop_at:
            await asyncio.sleep(1.0)
            on_tick(tally)

    await asyncio.gather(ticker(), *(worker(i) for i in range(concurrency)))
    return tally


def server_pids(root: int) -> list[int]:
    """``root`` and its descendants (the supervisor's children in multi-process mode)."""
    pids, frontier = [root], [root]
    while frontier:
        pid = frontier.pop()
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    children = [int(c) for c in f.read().split()]
                pids.extend(children)
                frontier.extend(children)
    return pids


def rss_bytes(root: int) -> int:
    total = 0
    for pid in server_pids(root):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


def request_counts(metrics_port: int) -> dict[tuple[str, str], float]:
    """``batchgate_requests_total`` by (model, status), parsed from ``/metrics``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    counts: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "batchgate_requests_total":
                counts[(sample.labels["model"], sample.labels["status"])] = sample.value
    return counts


def compare_counts(tally: Tally, before: dict, after: dict) -> list[str]:
    """Where the server's count of answers differs from the client's, for exact traffic."""
    client: collections.Counter = collections.Counter()
    for kind in ("valid", "invalid"):
        for model, statuses in tally.counts[kind].items():
            # The server labels a model its repository does not know with one label.
            label = UNKNOWN_MODEL_LABEL if model == UNKNOWN_MODEL else model
            for status, n in statuses.items():
                client[(label, status)] += n
    cancelled: collections.Counter = collections.Counter()
    for model, statuses in tally.counts["cancelled"].items():
        cancelled[model] += sum(statuses.values())
    problems = []
    keys = set(client) | {k for k in after if after.get(k, 0) != before.get(k, 0)}
    for key in sorted(keys):
        model, status = key
        server = after.get(key, 0) - before.get(key, 0)
        want = client.get(key, 0)
        # Cancelled calls may be answered (OK) or cancelled on the server: they widen the window.
        slack = cancelled.get(model, 0) if status in ("OK", "CANCELLED") else 0
        if not want <= server <= want + slack:
            problems.append(f"{model} {status}: server counted {server:g}, client {want}"
                            + (f" (+ up to {slack} cancelled)" if slack else ""))
    return problems


def run(args: argparse.Namespace) -> dict[str, Any]:
    repository = Path(args.model_repository)
    refs = references(repository)
    server = start_server(repository, args.mode, "mlp", ["--drain-timeout-s", "10"])
    try:
        address = server.address
        rss: list[tuple[float, int]] = []
        started = time.monotonic()
        warm_rss: list[int] = []

        def on_tick(tally: Tally) -> None:
            now = time.monotonic() - started
            rss.append((now, rss_bytes(server.pid)))
            if not warm_rss and now >= args.warmup_s:
                warm_rss.append(rss[-1][1])
            if not args.quiet:
                print(f"\r{now:6.0f} s  {tally.total():9d} requests  "
                      f"rss {rss[-1][1] / 2**20:7.1f} MiB", end="", file=sys.stderr, flush=True)

        # Warm-up traffic is the same mix; counting starts from the server's counters now.
        before = request_counts(server.metrics_port)
        tally = asyncio.run(drive(address, refs, args.seconds, args.concurrency,
                                  tuple(args.mix), args.seed, on_tick))
        if not args.quiet:
            print(file=sys.stderr)
        after = request_counts(server.metrics_port)
        final_rss = rss_bytes(server.pid)
        exit_code = server.stop()
    finally:
        server.stop()  # at once if the run failed; else it has already stopped
    base = warm_rss[0] if warm_rss else (rss[0][1] if rss else final_rss)
    growth = (final_rss - base) / base if base else 0.0
    count_problems = compare_counts(tally, before, after)
    report = {
        "seconds": args.seconds,
        "warmup_s": args.warmup_s,
        "mode": args.mode,
        "concurrency": args.concurrency,
        "mix_valid_invalid_cancelled": list(args.mix),
        "requests": tally.total(),
        "outcomes": tally.as_dict(),
        "lost": tally.lost,
        "wrong_answers": tally.wrong_answers,
        "wrong_codes": dict(tally.wrong_codes),
        "count_mismatches": count_problems,
        "rss_after_warmup_bytes": base,
        "rss_final_bytes": final_rss,
        "rss_growth": growth,
        "rss_samples": rss,
        "server_exit_code": exit_code,
    }
    report["passed"] = (
        tally.lost == 0 and tally.wrong_answers == 0 and not tally.wrong_codes
        and not count_problems and growth < RSS_GROWTH_LIMIT and exit_code == 0
    )
    return report


def render(report: dict[str, Any]) -> str:
    lines = [
        (f"soak: {report['seconds']:g} s ({report['warmup_s']:g} s warm-up), "
        f"mode={report['mode']}, concurrency={report['concurrency']}, "
        f"mix valid:invalid:cancelled = {':'.join(map(str, report['mix_valid_invalid_cancelled']))}"),
        f"requests                {report['requests']}",
    ]
    for kind, per_model in report["outcomes"].items():
        merged: collections.Counter = collections.Counter()
        for statuses in per_model.values():
            merged.update(statuses)
        lines.append(f"  {kind:<10}            " + ", ".join(f"{k} {v}" for k, v in sorted(merged.items())))
    lines += [
        f"lost (no answer)        {report['lost']}",
        f"wrong answers           {report['wrong_answers']}",
        f"wrong status codes      {report['wrong_codes'] or 0}",
        f"server/client count     {'match' if not report['count_mismatches'] else report['count_mismatches']}",
        f"RSS after warm-up       {report['rss_after_warmup_bytes'] / 2**20:.1f} MiB",
        f"RSS at the end          {report['rss_final_bytes'] / 2**20:.1f} MiB",
        f"RSS growth              {report['rss_growth'] * 100:+.2f} % (limit {RSS_GROWTH_LIMIT * 100:.0f} %)",
        f"server exit status      {report['server_exit_code']}",
        f"result                  {'PASS' if report['passed'] else 'FAIL'}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchgate.bench.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=MAX_SECONDS,
                        help=f"length of the load, warm-up included, at most {MAX_SECONDS:g}")
    parser.add_argument("--warmup-s", type=float, default=60.0,
                        help="RSS growth is measured from this point on (default: %(default)s)")
    parser.add_argument("--mode", choices=("single", "native"), default="single",
                        help="single: one process; native: the multi-process server (default: "
                             "%(default)s)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--mix", type=int, nargs=3, default=(8, 1, 1),
                        metavar=("VALID", "INVALID", "CANCELLED"), help="weights of the traffic kinds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-repository", default=str(ROOT / "models"))
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    args = parser.parse_args(argv)
    if not 0 < args.seconds <= MAX_SECONDS:
        parser.error(f"--seconds must lie in (0, {MAX_SECONDS:g}]")
    if not 0 <= args.warmup_s < args.seconds:
        parser.error("--warmup-s must be shorter than --seconds")
    report = run(args)
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
