"""The executor's intake: CPU per request of taking a frame's requests, as ``Infer`` messages or
as one ``InferGroup``.

Each request of a frame becomes views of its inputs in the arena, an ``InferenceRequest`` and
its future; written as ``Infer`` messages that costs a message per request to decode and read,
written as one ``InferGroup`` (``protos/wire.proto``) the columns are read once. This times the
executor's own code (``wire_pb2.ToExecutor.FromString`` and ``ExecutorServer.frame``) on frames
of the ``mlp``'s requests (one FP32 input of 512 per row) in one process, no socket and no
model: the requests are dropped after intake instead of queued, so the figure is intake alone,
without the noise a served run has. Frame sizes and the two forms alternate within each round.

    python -m batchgate.bench.intake [--sizes 1,6,32] [--requests 20000] [--rounds 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from batchgate.server.ipc.arena import ArenaLayout, SharedArena
from batchgate.batcher.metrics import BatcherMetrics
from batchgate.batcher.model import ServedModel
from batchgate.batcher.spec import BatchingConfig, ModelSpec, TensorSpec
from batchgate.bench.loadgen.cli import machine
from batchgate.bench.output import emit, progress
from batchgate.protos import wire_pb2
from batchgate.server.executor.fronts import FrontEnd
from batchgate.server.executor.server import ExecutorServer

say = progress("batchgate.bench.intake")
FORMS = ("Infer", "InferGroup")
WIDTH = 512  # the mlp's input: FP32 [rows, 512]
ROW_BYTES = WIDTH * 4
ARENA_BYTES = 64 << 20


class _Sink:
    """A front end's link as the executor sees it: the frame being filled."""

    def __init__(self) -> None:
        self.out = wire_pb2.ToFrontend()

    def room(self, nbytes: int) -> wire_pb2.ToFrontend:
        """The frame being filled (wire.Link.room: here one frame takes everything)."""
        return self.out


def _frame(form: str, size: int) -> bytes:
    """A serialized frame of ``size`` one-row requests with deadlines, in ``form``."""
    frame = wire_pb2.ToExecutor()
    deadline_ns = time.monotonic_ns() + 3600 * 10**9
    if form == "Infer":
        for rid in range(size):
            infer = frame.infer.add(rid=rid, model=1, batch_size=1, deadline_ns=deadline_ns)
            infer.inputs.add(offset=rid * ROW_BYTES, nbytes=ROW_BYTES, shape=[1, WIDTH])
    else:
        group = frame.groups.add(model=1, rids=range(size), batch_sizes=[1] * size,
                                 priorities=[0] * size, deadlines_ns=[deadline_ns] * size,
                                 timeouts_us=[0] * size, ids=[""] * size)
        group.inputs.add(tail=[WIDTH], offsets=[rid * ROW_BYTES for rid in range(size)])
    return frame.SerializeToString()


class _Executor:
    """The executor process's request intake, with one READY model whose queue is never fed."""

    def __init__(self, arena: SharedArena) -> None:
        spec = ModelSpec(
            name="mlp", version="1", platform="bench",
            inputs=(TensorSpec("INPUT__0", "FP32", (WIDTH,)),),
            outputs=(TensorSpec("OUTPUT__0", "FP32", (WIDTH,)),),
            batching=BatchingConfig(max_batch_size=64), warmup=False)
        self.server = ExecutorServer(arena, ArenaLayout(ARENA_BYTES, 1))
        model = ServedModel(spec, lambda x: x, metrics=BatcherMetrics(CollectorRegistry()),
                            delivery=self.server.answers)
        self.server.handles.add(model)
        self.front = FrontEnd(_Sink())
        self.front.region = (0, ARENA_BYTES // 2)

    def take(self, data: bytes, size: int) -> None:
        """One frame's intake, which must take all its ``size`` requests; they are then
        dropped."""
        self.server.frame(self.front, wire_pb2.ToExecutor.FromString(data))
        if len(self.front.requests) != size:
            raise RuntimeError(f"the executor took {len(self.front.requests)} of a frame's "
                               f"{size} requests")
        self.server.intake.pending = {}
        self.front.requests.clear()


def run(args: argparse.Namespace) -> dict[str, Any]:
    arena = SharedArena.create(ARENA_BYTES)
    try:
        executor = _Executor(arena)
        frames = {(form, size): _frame(form, size) for size in args.sizes for form in FORMS}
        samples: dict[tuple[str, int], list[float]] = {key: [] for key in frames}
        gc.disable()  # a collection landing in one form's turn would be charged to it
        try:
            for (_, size), data in frames.items():  # warm up
                for _ in range(100):
                    executor.take(data, size)
            for round_ in range(args.rounds):
                order = list(frames.items())
                if round_ % 2:
                    order.reverse()
                for key, data in order:
                    repeats = max(1, args.requests // key[1])
                    started = time.process_time_ns()
                    for _ in range(repeats):
                        executor.take(data, key[1])
                    used = time.process_time_ns() - started
                    samples[key].append(used / (repeats * key[1]) / 1e3)
                say(f"round {round_ + 1}/{args.rounds} done")
        finally:
            gc.enable()
    finally:
        arena.close()
    rows = []
    for size in args.sizes:
        infer = statistics.median(samples[("Infer", size)])
        group = statistics.median(samples[("InferGroup", size)])
        rows.append({"requests_per_frame": size, "infer_us": infer, "group_us": group,
                     "ratio": group / infer,
                     "rounds": {form: samples[(form, size)] for form in FORMS}})
    return {"benchmark": "intake", "machine": machine(), "requests": args.requests,
            "rounds": args.rounds, "rows": rows}


def render(report: dict[str, Any]) -> str:
    lines = ["| requests a frame | as Infer (µs a request) | as InferGroup | InferGroup / Infer |",
             "|---|---|---|---|"]
    for row in report["rows"]:
        lines.append(f"| {row['requests_per_frame']} | {row['infer_us']:.2f} | "
                     f"{row['group_us']:.2f} | {row['ratio']:.2f} |")
    lines.append(f"\nmedian of {report['rounds']} rounds of ~{report['requests']} requests each; "
                 "CPU time of the executor's intake alone (decode, views, request objects)")
    return "\n".join(lines)


def _sizes(text: str) -> list[int]:
    sizes = [int(part) for part in text.split(",") if part.strip()]
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("expected positive frame sizes, e.g. 1,6,32")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchgate.bench.intake",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=_sizes, default=[1, 6, 32],
                        help="requests a frame, comma-separated (default 1,6,32)")
    parser.add_argument("--requests", type=int, default=20000,
                        help="requests per form, size and round (default 20000)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    return emit(run(args), render, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
