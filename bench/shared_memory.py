"""Image-sized inputs through gRPC and through system shared memory, in one run.

A cheap model (mean over each channel, then a 3 -> 10 linear layer) on 3 x 224 x 224 FP32 inputs
(588 KiB a request), so the transport dominates. Per mode (``--modes``), one server started with
``--shared-memory``, and perf_analyzer at one concurrency twice on it: the tensors in the gRPC
messages, then ``--shared-memory system`` (inputs and outputs in regions perf_analyzer
registers). Reported per row: throughput, p99, and the server's CPU per request (all its
processes, from ``/proc``, over the whole perf_analyzer run); and each shared-memory row's
ratios to its gRPC row.

    python -m batchgate.bench.shared_memory [--modes native,single] [--concurrency 4] [--seconds 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from batchgate.bench.output import emit, progress
from batchgate.bench._perf_analyzer import DEFAULT_PERF_ANALYZER
from batchgate.bench.harness.server import MODES
from batchgate.bench.machine import machine
from batchgate.bench.serving import _choices
from batchgate.bench.steps import Step, load_step, start_server
from batchgate.server.supervisor import native_binary as native
from batchgate.bench.harness.repository import model_config, tensor, write_model

MODEL = "image"
CONFIG = model_config(
    MODEL, max_batch_size=8, input=[tensor("INPUT__0", "FP32", [3, 224, 224])],
    output=[tensor("OUTPUT__0", "FP32", [10])],
    dynamic_batching={"max_queue_delay_microseconds": 0},
    instance_group=[{"kind": "KIND_CPU", "count": 1}], parameters={"INTRA_OP_THREAD_COUNT": "1"})
MODULE = """
import torch


class MeanLinear(torch.nn.Module):
    \"\"\"A channel mean and a 3 -> 10 layer: almost no compute per byte of input.\"\"\"

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(3, 10)

    def forward(self, x):
        return self.linear(x.mean(dim=(2, 3)))


def build_model(parameters):
    return MeanLinear()
"""
OUTPUT_BYTES = 10 * 4
TRANSPORTS = {"grpc": (), "system shared memory": (
    "--shared-memory", "system", "--output-shared-memory-size", str(OUTPUT_BYTES))}


def write_repository(root: Path) -> Path:
    write_model(root, CONFIG, MODULE)
    return root


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    modes: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-shm-") as scratch:
        repository = write_repository(Path(scratch))
        for mode in args.modes:
            if mode == "native" and native.unavailable_reason() is not None:
                modes[mode] = {"skipped": native.unavailable_reason()}
                continue
            _say(f"{mode}: starting the server ...")
            server = start_server(repository, mode, MODEL, ["--shared-memory"])
            rows: dict[str, Step] = {}
            try:
                for transport, perf_args in TRANSPORTS.items():
                    _say(f"{mode}: perf_analyzer, {transport}, concurrency {args.concurrency}, "
                         f"{args.seconds:g} s ...")
                    rows[transport] = load_step(server, MODEL, "perf_analyzer", args.concurrency,
                                                args.seconds, args, perf_args)
            finally:
                exit_code = server.stop()
            modes[mode] = {"exit_code": exit_code, "server_command": server.command,
                           "rows": {t: _row(step) for t, step in rows.items()}}
    return {"machine": machine(), "model": MODEL, "input_bytes": 3 * 224 * 224 * 4,
            "concurrency": args.concurrency, "seconds": args.seconds,
            "command": ["python", "-m", "batchgate.bench.shared_memory", *sys.argv[1:]],
            "modes": modes, "wall_s": time.monotonic() - started}


def _row(step: Step) -> dict[str, Any]:
    return {"throughput_per_s": step.perf.row.throughput_per_s, "p99_ms": step.perf.row.p99_ms,
            "p50_ms": step.perf.row.p50_ms, "answered": step.answered,
            "server_cpu_us_per_request": step.per_request_us(step.server_cpu_s),
            "outside_model_us_per_request": step.outside_model_us,
            "mean_batch_size": step.mean_batch, "load_command": step.perf.command}


def render(report: dict[str, Any]) -> str:
    lines = [
        f"image-sized inputs ({report['input_bytes']:,} bytes a request), perf_analyzer at "
        f"concurrency {report['concurrency']}, {report['seconds']:g} s windows",
        "",
        "| mode | transport | /s | p99 | server CPU / req | outside model / req | batch |"
        " ratio /s | ratio p99 | ratio CPU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, result in report["modes"].items():
        if "skipped" in result:
            lines.append(f"| {mode} | skipped: {result['skipped']} |||||||||")
            continue
        base = result["rows"].get("grpc")
        for transport, row in result["rows"].items():
            ratios = ["", "", ""]
            if base is not None and row is not base:
                ratios = [f"**{row['throughput_per_s'] / base['throughput_per_s']:.2f}**",
                          f"**{row['p99_ms'] / base['p99_ms']:.2f}**",
                          f"**{row['server_cpu_us_per_request'] / base['server_cpu_us_per_request']:.2f}**"]
            batch = row["mean_batch_size"]
            batch_text = f"{batch:.1f}" if batch is not None else "—"
            lines.append(
                f"| {mode} | {transport} | {row['throughput_per_s']:,.0f} | "
                f"{row['p99_ms']:.1f} ms | {row['server_cpu_us_per_request']:,.0f} µs | "
                f"{row['outside_model_us_per_request']:,.0f} µs | {batch_text} | "
                + " | ".join(ratios) + " |")
    return "\n".join(lines)


_say = progress("batchgate.bench.shared_memory")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchgate.bench.shared_memory",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--modes", type=_choices(MODES), default=["native", "single"],
                        help="server modes to measure, in order (default: native,single)")
    parser.add_argument("--concurrency", type=int, default=4,
                        help="perf_analyzer's concurrency (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=3.0,
                        help="perf_analyzer's measurement window (default: %(default)s)")
    parser.add_argument("--perf-analyzer", type=Path, default=DEFAULT_PERF_ANALYZER,
                        help="perf_analyzer executable (default: scripts/perf_analyzer)")
    parser.add_argument("--json", type=Path, default=None, help="also write the full report here")
    args = parser.parse_args(argv)
    report = run(args)
    emit(report, render, args.json)
    failed = [m for m, r in report["modes"].items() if r.get("exit_code", 0) != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
