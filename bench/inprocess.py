"""The in-process ceiling: one model in a tight loop, no server, no batching, no copies.

The model is loaded exactly as the server loads it (``read_model_config`` →
``model_spec_from_config`` → ``load_module`` on the latest version folder) and called on fixed
inputs of ``batch_size`` rows under ``torch.inference_mode()``, on a thread of its own that sets
``torch.set_num_threads(threads)`` itself: OpenMP's thread count is per calling thread, so setting
it on the main thread would leave the loop on torch's default.

    python -m batchgate.bench.inprocess --model mlp --batch 64 --seconds 5
    python -m batchgate.bench.inprocess --model mlp --batch 64 1 --seconds 3 --json out.json
    python -m batchgate.bench.inprocess --model mlp --batch 1 --idle-ms 1.5 --seconds 3
    python -m batchgate.bench.inprocess --model mlp --buckets --seconds 0.5

``--idle-ms``: the thread sleeps that long before each call, as a server's model thread waits
for the next request at low load, and the call is timed from its wake-up. A model called from
idle is slower than in the tight loop (the core wakes from idle, its caches lost their
contents): this is the model's own share of a server's latency at concurrency 1.

``--buckets``: every batch size from 1 to ``max_batch_size`` is timed, and the sizes worth
padding up to are printed as the model's ``buckets`` parameter (``suggest_buckets``): matrix
kernels run some row counts faster than fewer rows (on the CPU, often multiples of 4).

This module is the one place in ``bench/`` that imports torch and the server's loading code;
``batchgate.bench.serving`` runs it in a subprocess, so the load generator's process stays torch-free.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from batchgate.batcher import precision as precisions
from batchgate.batcher.loading import cuda_available, latest_version, load_module
from batchgate.batcher.spec import NUMPY_DTYPES, ModelSpec
from batchgate.server.logs import configure_logging
from batchgate.server.config.model_config import read_model_config
from batchgate.server.config.model_spec import model_spec_from_config

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_REPOSITORY = ROOT / "models"
# Calls before timing starts: a traced module's profiling executor specialises on its first runs.
_WARMUP_CALLS = 5


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    spec: ModelSpec
    module: torch.nn.Module
    version_dir: Path


def load(model_dir: Path | str) -> LoadedModel:
    """Load ``model_dir`` (``<repository>/<model>``) the way the server's repository does."""
    model_dir = Path(model_dir)
    config, _unsupported = read_model_config(model_dir)
    filename = config.default_model_filename or None
    version_dir = latest_version(model_dir, filename)
    spec = model_spec_from_config(config, version_dir.name, cuda_available=cuda_available())
    parameters = {key: value.string_value for key, value in config.parameters.items()}
    module = load_module(version_dir, filename=filename, parameters=parameters, device=spec.device)
    # The precision as the executor applies it (fp16 weights: the module converted).
    return LoadedModel(spec, precisions.convert(module, spec.precision), version_dir)


def sample_inputs(spec: ModelSpec, batch_size: int, seed: int = 0) -> list[torch.Tensor]:
    """Inputs of ``batch_size`` rows: uniform floats, 0/1 integers (valid as token ids)."""
    rng = np.random.default_rng(seed)
    tensors = []
    for tensor in spec.inputs:
        if tensor.datatype in ("BYTES", "BF16"):
            raise ValueError(f"input {tensor.name!r}: {tensor.datatype} inputs are not supported here")
        # A variable dimension (-1) gets one element: the smallest valid shape.
        dims = tuple(d if d >= 0 else 1 for d in tensor.dims)
        shape = (batch_size, *dims) if spec.max_batch_size else dims
        dtype = NUMPY_DTYPES[tensor.datatype]
        if np.issubdtype(dtype, np.floating):
            array = rng.random(shape, dtype=np.float32).astype(dtype)
        else:
            array = rng.integers(0, 2, shape).astype(dtype)
        tensors.append(torch.from_numpy(array).to(spec.device))
    return tensors


def run(model: LoadedModel, batch_size: int, seconds: float, threads: int = 1,
        idle_ms: float = 0.0) -> dict[str, Any]:
    """Call ``model`` on ``batch_size`` rows for ``seconds`` on a fresh thread, sleeping
    ``idle_ms`` before each call (not timed); the figures."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if model.spec.max_batch_size and batch_size > model.spec.max_batch_size:
        raise ValueError(
            f"batch_size must be <= max_batch_size ({model.spec.max_batch_size}), got {batch_size}"
        )
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if idle_ms < 0:
        raise ValueError(f"idle_ms must be >= 0, got {idle_ms}")
    inputs = sample_inputs(model.spec, batch_size)
    outcome: dict[str, Any] = {}

    def loop() -> None:
        try:
            outcome["times_ns"] = _timed_calls(model, inputs, seconds, threads, idle_ms / 1e3)
        except BaseException as exc:  # handed to the caller's thread
            outcome["error"] = exc

    worker = threading.Thread(target=loop, name="inprocess-model", daemon=True)
    worker.start()
    worker.join()
    if "error" in outcome:
        raise outcome["error"]
    times_ns: list[int] = outcome["times_ns"]
    total_s = sum(times_ns) / 1e9
    ordered = sorted(times_ns)
    return {
        "model": model.spec.name,
        "version": model.spec.version,
        "device": model.spec.device,
        "batch_size": batch_size,
        "threads": threads,
        "idle_ms": idle_ms,
        "calls": len(times_ns),
        "seconds": total_s,
        "samples_per_s": len(times_ns) * batch_size / total_s,
        "batch_p50_ms": statistics.median(times_ns) / 1e6,
        "batch_p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] / 1e6,
        "batch_mean_ms": total_s * 1e3 / len(times_ns),
    }


def _timed_calls(model: LoadedModel, inputs: list[torch.Tensor], seconds: float, threads: int,
                 idle_s: float) -> list[int]:
    torch.set_num_threads(threads)
    module = model.module
    device_type = torch.device(model.spec.device).type
    cuda = device_type == "cuda"
    autocast = precisions.autocast(model.spec.precision, device_type)
    inputs = precisions.cast_inputs(inputs, model.spec.precision)
    times_ns: list[int] = []
    with torch.inference_mode(), autocast:
        for _ in range(_WARMUP_CALLS):
            module(*inputs)
        if cuda:
            torch.cuda.synchronize()
        clock = time.perf_counter_ns
        deadline = clock() + int(seconds * 1e9)
        while True:
            if idle_s:
                time.sleep(idle_s)
            started = clock()
            module(*inputs)
            if cuda:
                torch.cuda.synchronize()
            ended = clock()
            times_ns.append(ended - started)
            if ended >= deadline:
                break
    return times_ns


def suggest_buckets(p50_ms: dict[int, float], margin: float) -> list[int]:
    """Batch buckets from measured batch times: going down from the largest size (always a
    bucket), a size is padded up to the smallest bucket above it only where that bucket ran
    faster by more than ``margin`` (a fraction); otherwise it is a bucket itself. So padding is
    chosen only where it was measured to save time, and noise within the margin adds buckets
    (each one more warm-up at load), never padding."""
    if not p50_ms:
        raise ValueError("no batch times to choose buckets from")
    if not 0 <= margin < 1:
        raise ValueError(f"margin must lie in [0, 1), got {margin}")
    sizes = sorted(p50_ms)
    buckets = [sizes[-1]]
    for size in reversed(sizes[:-1]):
        if not p50_ms[buckets[-1]] < p50_ms[size] * (1 - margin):
            buckets.append(size)
    return sorted(buckets)


def sweep(model: LoadedModel, seconds: float, threads: int = 1) -> dict[int, float]:
    """Batch p50 in ms of every size from 1 to the model's max_batch_size: measured twice,
    smallest first then largest first (``seconds`` split between the two), and averaged, so
    the host's drift during the sweep does not favour either end."""
    largest = model.spec.max_batch_size
    if largest < 1:
        raise ValueError(f"model '{model.spec.name}' does not batch (max_batch_size 0): "
                         "it has no buckets")
    sizes = list(range(1, largest + 1))
    times: dict[int, list[float]] = {size: [] for size in sizes}
    for order in (sizes, sizes[::-1]):
        for size in order:
            times[size].append(run(model, size, seconds / 2, threads)["batch_p50_ms"])
    return {size: sum(p50s) / len(p50s) for size, p50s in times.items()}


def measure(model_dir: Path | str, batch_size: int, seconds: float, threads: int = 1) -> dict[str, Any]:
    """Load ``model_dir`` as the server does and run it in a tight loop; samples/s and p50."""
    return run(load(model_dir), batch_size, seconds, threads)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchgate.bench.inprocess", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", help="model folder name (default: %(default)s)")
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_REPOSITORY,
                        help="model repository folder (default: the example models)")
    parser.add_argument("--batch", type=int, nargs="+", default=None,
                        help="batch size(s), measured in the order given (default: 64)")
    parser.add_argument("--seconds", type=float, default=5.0,
                        help="timed seconds per batch size (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads of the model thread (default: %(default)s)")
    parser.add_argument("--idle-ms", type=float, default=0.0,
                        help="sleep this long before each call, as a model thread waiting for "
                             "requests at low load (default: 0, a tight loop)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--buckets", action="store_true",
                        help="time every batch size from 1 to max_batch_size (--seconds each) "
                             "and print the buckets where padding a batch up saves time, as a "
                             "config.pbtxt parameter (not with --batch or --idle-ms)")
    parser.add_argument("--bucket-margin", type=float, default=0.03,
                        help="with --buckets: pad a size up only where the bucket above ran "
                             "faster by more than this fraction (default: %(default)s)")
    args = parser.parse_args(argv)
    if not 0 <= args.bucket_margin < 1:
        parser.error(f"--bucket-margin must lie in [0, 1), got {args.bucket_margin}")
    if args.buckets and (args.batch is not None or args.idle_ms):
        parser.error("--buckets times every batch size in a tight loop: it takes neither "
                     "--batch nor --idle-ms")
    if args.batch is None:
        args.batch = [64]
    configure_logging("warning", "console")  # the loader's debug lines would mix into stdout

    model = load(args.model_repository / args.model)
    if args.buckets:
        return _print_buckets(model, args)
    results = [run(model, batch, args.seconds, args.threads, args.idle_ms)
               for batch in args.batch]
    for r in results:
        idle = f", {r['idle_ms']:g} ms idle before each call" if r["idle_ms"] else ""
        print(f"{r['model']} batch {r['batch_size']:>3}, {r['threads']} thread(s){idle}: "
              f"{r['samples_per_s']:9.1f} samples/s, batch p50 {r['batch_p50_ms']:.3f} ms, "
              f"p99 {r['batch_p99_ms']:.3f} ms ({r['calls']} calls in {r['seconds']:.1f} s)")
    if args.json is not None:
        report = {"torch": torch.__version__, "python": platform.python_version(), "results": results}
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


def _print_buckets(model: LoadedModel, args: argparse.Namespace) -> int:
    try:
        p50_ms = sweep(model, args.seconds, args.threads)
    except ValueError as exc:
        print(f"batchgate.bench.inprocess: {exc}", file=sys.stderr)
        return 1
    buckets = suggest_buckets(p50_ms, args.bucket_margin)
    print(f"{model.spec.name}: batch p50 ms by size, {args.threads} thread(s) "
          f"(mean of a pass up and a pass down); * = bucket, else padded up to the next one")
    for size, p50 in p50_ms.items():
        print(f"{size:>5} {p50:9.3f}{' *' if size in buckets else ''}")
    listed = ",".join(map(str, buckets))
    print(f'parameters: {{ key: "buckets" value: {{ string_value: "{listed}" }} }}')
    if args.json is not None:
        report = {"torch": torch.__version__, "python": platform.python_version(),
                  "model": model.spec.name, "threads": args.threads,
                  "margin": args.bucket_margin, "batch_p50_ms": p50_ms, "buckets": buckets}
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
