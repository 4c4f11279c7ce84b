"""The executor wire's read path: reader CPU per frame, ``FrameReader`` against ``Link.receive``.

Under a closed-loop load a front end writes the executor a frame per request or two, and the
executor's event loop, idle between them, wakes for each: what one frame costs the reader is
then paid per request. This measures it with the server's own code over a real abstract Unix
socket, in one run: a child process writes one-request frames ``--gap-us`` apart, and the
reader is either the executor's end (``wire.serve_frontends``: frames cut and handled in the
transport's ``data_received``) or a front end's end (``wire.connect_to_executor`` and
``await link.receive()``, two ``StreamReader.readexactly`` per frame). The frames are the ones
each end really reads: a ``ToExecutor`` with one Infer of one tensor, a ``ToFrontend`` with one
Result of one output. The rounds alternate the two readers, as the machine's noise drifts.

    python -m batchgate.bench.wire_read [--frames 20000] [--gap-us 100] [--rounds 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from batchgate.bench.loadgen.cli import machine
from batchgate.bench.output import emit, progress
from batchgate.protos import wire_pb2
from batchgate.server.ipc import wire

say = progress("batchgate.bench.wire_read")
READERS = ("FrameReader", "Link.receive")


def _frame(message) -> bytes:
    body = message.SerializeToString()
    return wire.HEADER.pack(len(body)) + body


def _to_executor() -> bytes:
    frame = wire_pb2.ToExecutor()
    infer = frame.infer.add(rid=7, model=1, batch_size=1, deadline_ns=time.monotonic_ns())
    infer.inputs.add(offset=1 << 20, nbytes=2048, shape=[1, 512])
    return _frame(frame)


def _to_frontend() -> bytes:
    frame = wire_pb2.ToFrontend()
    frame.results.add(rid=7, released=True).outputs.add(block=1 << 20, offset=1 << 20,
                                                        nbytes=2048, shape=[1, 512])
    return _frame(frame)


def _write_paced(sock: socket.socket, frame: bytes, frames: int, gap_s: float) -> None:
    """In the child: ``frames`` frames, one every ``gap_s`` (a busy wait: a sleep this short
    would oversleep), then the end of the stream."""
    clock = time.perf_counter
    due = clock()
    for _ in range(frames):
        sock.sendall(frame)
        due += gap_s
        while clock() < due:
            pass
    sock.close()


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _child(target) -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            target()
        finally:
            os._exit(0)
    return pid


async def _frame_reader(name: str, frames: int, gap_s: float) -> tuple[int, float]:
    loop = asyncio.get_running_loop()
    ended = loop.create_future()
    count = [0]

    class Handler:
        def frame(self, _frame) -> None:
            count[0] += 1

        def read(self) -> None:
            pass

        def lost(self, _reason) -> None:
            ended.set_result(None)

    listener = await wire.serve_frontends(name, lambda link: Handler())
    frame = _to_executor()

    def write() -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(wire.socket_address(name))
        _write_paced(sock, frame, frames, gap_s)

    started = _cpu_s()
    pid = _child(write)
    await ended
    used = _cpu_s() - started
    os.waitpid(pid, 0)
    listener.close()
    return count[0], used


async def _link_receive(name: str, frames: int, gap_s: float) -> tuple[int, float]:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(wire.socket_address(name))
    listener.listen(1)
    frame = _to_frontend()

    def write() -> None:
        peer, _ = listener.accept()
        _write_paced(peer, frame, frames, gap_s)

    pid = _child(write)
    listener.close()
    link = await wire.connect_to_executor(name)
    started = _cpu_s()
    count = 0
    try:
        while True:
            await link.receive()
            count += 1
    except ConnectionError:
        pass
    used = _cpu_s() - started
    link.close()
    os.waitpid(pid, 0)
    return count, used


def measure(reader: str, frames: int, gap_us: float) -> float:
    """Reader CPU µs per frame of one run of ``reader``."""
    name = f"batchgate-bench-wire-{os.getpid()}-{os.urandom(4).hex()}"
    run = _frame_reader if reader == "FrameReader" else _link_receive
    count, used = asyncio.run(run(name, frames, gap_us / 1e6))
    if count != frames:
        raise RuntimeError(f"{reader} read {count} of {frames} frames")
    return used / count * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=20000, help="frames per run (default 20000)")
    parser.add_argument("--gap-us", type=float, default=100.0,
                        help="µs between two frames (default 100: the executor's pace at c=64)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="runs of each reader, alternating (default 3)")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    if args.frames < 1 or args.rounds < 1 or args.gap_us < 0:
        parser.error("--frames and --rounds must be positive, --gap-us not negative")
    runs: dict[str, list[float]] = {reader: [] for reader in READERS}
    for round_ in range(args.rounds):
        for reader in READERS:
            say(f"round {round_ + 1}/{args.rounds}: {reader}, {args.frames} frames "
                f"{args.gap_us:g} µs apart ...")
            runs[reader].append(measure(reader, args.frames, args.gap_us))
    medians = {reader: statistics.median(values) for reader, values in runs.items()}
    report: dict[str, Any] = {
        "machine": machine(),
        "settings": {"frames": args.frames, "gap_us": args.gap_us, "rounds": args.rounds},
        "us_per_frame": runs,
        "median_us_per_frame": medians,
        "ratio": medians["FrameReader"] / medians["Link.receive"],
    }
    return emit(report, _render, args.json)


def _render(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [f"{s['frames']} one-request frames {s['gap_us']:g} µs apart, {s['rounds']} rounds; "
             "reader CPU µs per frame (median; every round)", ""]
    for reader in READERS:
        runs = ", ".join(f"{v:.1f}" for v in report["us_per_frame"][reader])
        lines.append(f"{reader:13s} {report['median_us_per_frame'][reader]:6.1f}   ({runs})")
    lines.append("")
    lines.append(f"FrameReader / Link.receive: {report['ratio']:.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
