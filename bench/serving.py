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
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from batchgate.bench import floor
from batchgate.bench._perf_analyzer import DEFAULT_PERF_ANALYZER
from batchgate.bench.harness.server import MODES
from batchgate.bench.output import emit, progress
from batchgate.bench.serving_report import CEILING_BATCH, THREADS, render, summarize
from batchgate.bench.steps import (
    DEFAULT_REPOSITORY,
    ROOT,
    RUN_ERRORS,
    BenchError,
    Step,
    load_step,
    model_config,
    single_model_repository,
    start_server,
)
from batchgate.server.supervisor import native_binary as native
from batchgate.server.config.settings import cpu_list, cpus_text, usable_cpus

__all__ = ["main", "run"]

HIGH_CONCURRENCY = 64

LOAD_GENERATORS = ("bench", "perf_analyzer")
# The server's modes, and the all-C++ yardstick (batchgate.bench.floor), measured last.
SERVING_MODES = (*MODES, "floor")


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


def start_floor(model_dir: Path) -> floor.FloorServer:
    """``batchgate-floor`` serving the model of ``model_dir`` (built first if need be), with a
    worker per usable CPU as the native front end's default."""
    _say("floor: building batchgate-floor (once) and exporting the model ...")
    binary = floor.build()
    exported = floor.export(model_dir, floor.BUILD_DIR / "models" / f"{model_dir.name}.pt")
    return floor.FloorServer(binary, exported, workers=len(os.sched_getaffinity(0)))


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
