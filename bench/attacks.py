"""Hostile clients against a live server: issue 43's attacks, alone and beside valid load.

For each front end (the native one; one Python process), one server is started (its own
process, the default settings) with a model whose reply is 17 × its request (``grow``) and one
of BYTES inputs (``texts``); then:

1. **valid load alone**: ``--clients`` closed-loop clients, each on its own connection, send
   ``grow`` requests whose values are theirs alone for ``--seconds``; every answer is checked
   against what that client sent (a wrong or another client's answer is counted);
2. **each attack alone**: its status, and the peak resident memory of every server process
   while it is answered (VmHWM from /proc, reset first) against its size on the wire;
3. **each attack beside the valid load**: the attack sent again and again for ``--seconds``
   while the clients run: their goodput (checked answers/s) against step 1's, in the same run.

The attacks: the rows of tests/test_request_bounds.py (each wire limit passed by a few MB of
bytes), an output asked twice, a flood of ModelInfer calls to made-up models (60 kB names,
then names under --max-request-name-bytes; /metrics measured after), and a ModelStreamInfer
client that never reads its replies. Targets beside the figures: peak growth ≤ 4 × wire size +
tensor bytes; /metrics < 1 MB; goodput during an attack ≥ 0.8 × without; no wrong answer.

The yardstick: an attacker that sends megabytes back to back takes cores of its own, and on a
small machine those are the valid clients' and the server's. So each request attack of N bytes
is also read against the same N bytes sent the same way as one well-formed request that any
server must receive and parse before it can refuse it (one raw buffer far larger than its
shape says, INVALID_ARGUMENT): "× honest" is the attack's goodput over that one's, what the
attack costs beyond the bytes it sends.

    python -m batchgate.bench.attacks [--modes native,single] [--seconds 5] [--clients 4]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from batchgate.bench.output import emit, progress
from batchgate.bench.machine import machine
from batchgate.bench.steps import RUN_ERRORS
from batchgate.protos import inference_pb2 as pb
from batchgate.bench.harness.server import RunningServer, start_process
from batchgate.bench.harness.memory import PeakGrowth
from batchgate.bench.harness.repository import model_config, tensor, write_model

MIB = 1 << 20
GROW_FACTOR = 16
VALUES = 256  # a valid request's values: 1 KiB in, 17 KiB out
GOODPUT_TARGET = 0.8
GROWTH_FACTOR = 4
METRICS_BOUND = 1_000_000
INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
UNLIMITED = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
say = progress("attacks")

GROW_CONFIG = model_config(
    "grow", max_batch_size=4, input=[tensor("X", "FP32", [-1])],
    output=[tensor("Y", "FP32", [-1]), tensor("Z", "FP32", [-1])],
    dynamic_batching={"max_queue_delay_microseconds": 0}, parameters={"warmup": "false"})
GROW_MODEL = f"""
import torch


class Grow(torch.nn.Module):
    def forward(self, x):
        return x.repeat(1, {GROW_FACTOR}), x.clone()


def build_model(parameters):
    return Grow()
"""
TEXTS_CONFIG = model_config(
    "texts", max_batch_size=4, input=[tensor("A", "BYTES", [1]), tensor("B", "BYTES", [1])],
    output=[tensor("N", "INT64", [1])], parameters={"warmup": "false"})
TEXTS_MODEL = """
import numpy as np
import torch


class Lengths(torch.nn.Module):
    def forward(self, a, b):
        count = np.vectorize(len, otypes=[np.int64])
        return torch.from_numpy(count(a) + count(b))


def build_model(parameters):
    return Lengths()
"""


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def grow_request(values: np.ndarray, id: str = "") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="grow", id=id)
    request.inputs.add(name="X", datatype="FP32", shape=[1, values.size])
    request.raw_input_contents.append(values.astype(np.float32).tobytes())
    return request


# -- the attacks -------------------------------------------------------------------------------


@dataclass
class Attack:
    name: str
    run: Callable[[grpc.Channel], tuple[str, str]]  # one go: (status, message)
    wire_bytes: int  # what one go sends
    tensor_bytes: int = 0  # the tensor bytes its requests declare
    honest: bytes | None = None  # the yardstick: as many bytes in one well-formed request


def _honest(wire_bytes: int) -> bytes:
    """A well-formed ``grow`` request of ``wire_bytes`` on the wire whose one raw buffer holds
    far more bytes than its shape [1, 4] needs (refused with INVALID_ARGUMENT once parsed)."""
    head = grow_request(np.arange(4, dtype=np.float32))
    del head.raw_input_contents[:]
    prefix = head.SerializeToString()
    size = wire_bytes - len(prefix) - 1
    while len(_varint(size)) + size > wire_bytes - len(prefix) - 1:
        size -= 1
    return prefix + _field(7, bytes(size))


def _unary(data: bytes) -> Callable[[grpc.Channel], tuple[str, str]]:
    def run(channel: grpc.Channel) -> tuple[str, str]:
        try:
            channel.unary_unary(INFER)(data, timeout=120)
        except grpc.RpcError as err:
            return err.code().name, err.details() or ""
        return "OK", ""
    return run


def _flood(length: int, count: int = 3000) -> Callable[[grpc.Channel], tuple[str, str]]:
    """``count`` ModelInfer calls, 8 at a time, to made-up models of ``length``-byte names."""
    counter = iter(range(1 << 62))
    lock = threading.Lock()

    def run(channel: grpc.Channel) -> tuple[str, str]:
        with lock:
            base = next(counter) * count
        call = channel.unary_unary(INFER)

        def one(i: int) -> tuple[str, str]:
            request = pb.ModelInferRequest(model_name=(b"%012d" % (base + i)).decode()
                                           + "m" * (length - 12))
            request.inputs.add(name="X", datatype="FP32", shape=[1, 1])
            request.raw_input_contents.append(bytes(4))
            try:
                call(request.SerializeToString(), timeout=60)
            except grpc.RpcError as err:
                return err.code().name, err.details() or ""
            return "OK", ""

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(one, range(count)))
        codes = sorted({code for code, _ in answers})
        return "/".join(codes), f"{count} calls; {answers[0][1][:60]}"
    return run


def _non_reading_stream(count: int = 300, values: int = 16384) -> Attack:
    """A stream of ``count`` requests whose replies (~1.06 MiB each) its client never reads;
    held open for the go, then cancelled."""
    data = [grow_request(np.arange(values, dtype=np.float32), id=f"s{i}").SerializeToString()
            for i in range(count)]

    def run(channel: grpc.Channel) -> tuple[str, str]:
        answers = channel.stream_stream(STREAM)(iter(data), timeout=600)
        time.sleep(2.0)  # the server fills the stream's backlog, then stops reading it
        answers.cancel()
        return "paused", f"{count} requests, replies never read"
    return Attack("a stream whose client never reads (300 × 1 MiB replies)", run,
                  sum(map(len, data)), count * values * 4)


def attacks() -> list[Attack]:
    grow = _field(1, b"grow")
    valid = grow_request(np.arange(4, dtype=np.float32)).SerializeToString()
    tensor_header = _field(1, b"X") + _field(2, b"FP32")
    rows = [
        ("3,000,000 empty outputs", grow + b"\x32\x00" * 3_000_000),
        ("one output named 2,000,000 times", valid + _field(6, _field(1, b"Y")) * 2_000_000),
        ("2,000,000 request parameters",
         grow + b"".join(_field(4, _field(1, b"%06x" % i)) for i in range(2_000_000))),
        ("a model name of 8 MB", _field(1, b"m" * (8 * MIB))),
        ("3,000,000 empty inputs", grow + b"\x2a\x00" * 3_000_000),
        ("3,000,000 raw_input_contents", grow + b"\x3a\x00" * 3_000_000),
        ("3,000,000 bytes_contents",
         _field(1, b"texts") + _field(5, _field(1, b"A") + _field(2, b"BYTES")
                                      + _field(3, b"\x01\x01")
                                      + _field(5, b"\x42\x00" * 3_000_000))),
        ("3,000,000 unknown fields", grow + b"\x7a\x00" * 3_000_000),
        ("a shape of 10,000,000 dimensions", grow + _field(5, tensor_header
                                                           + _field(3, b"\x01" * 10_000_000))),
        ("8,388,609 int64 contents of a byte each",
         grow + _field(5, tensor_header + _field(5, _field(3, bytes(8 * MIB + 1))))),
    ]
    found = [Attack(name, _unary(data), len(data), honest=_honest(len(data)))
             for name, data in rows]
    twice = grow_request(np.arange(4, dtype=np.float32))
    twice.outputs.add(name="Y")
    twice.outputs.add(name="Y")
    found.append(Attack("an output asked for twice", _unary(twice.SerializeToString()),
                        twice.ByteSize(), 16))
    found.append(Attack("3,000 calls to made-up models, 60 kB names", _flood(60_000),
                        3000 * 60_020))
    found.append(Attack("3,000 calls to made-up models, 1,000-byte names", _flood(1000),
                        3000 * 1020))
    found.append(_non_reading_stream())
    return found


# -- valid load --------------------------------------------------------------------------------


class ValidLoad:
    """Closed-loop clients, each on its own connection with values of its own; every answer
    checked against its request."""

    def __init__(self, address: str, clients: int) -> None:
        self.address, self.clients = address, clients
        self.ok = self.wrong = self.failed = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _client(self, index: int) -> None:
        with grpc.insecure_channel(self.address, options=UNLIMITED) as channel:
            call = channel.unary_unary(INFER)
            sequence = 0
            while not self._stop.is_set():
                sequence += 1
                x = np.arange(VALUES, dtype=np.float32) + index * 1e6 + sequence
                request = grow_request(x, id=f"{index}-{sequence}")
                try:
                    reply = pb.ModelInferResponse.FromString(
                        call(request.SerializeToString(), timeout=60))
                except grpc.RpcError:
                    with self._lock:
                        self.failed += 1
                    continue
                y, z = (np.frombuffer(raw, np.float32) for raw in reply.raw_output_contents)
                right = (reply.id == request.id and np.array_equal(z, x)
                         and np.array_equal(y, np.tile(x, GROW_FACTOR)))
                with self._lock:
                    if right:
                        self.ok += 1
                    else:
                        self.wrong += 1

    def __enter__(self) -> ValidLoad:
        for i in range(self.clients):
            thread = threading.Thread(target=self._client, args=(i,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)

    def counts(self) -> tuple[int, int, int]:
        with self._lock:
            return self.ok, self.wrong, self.failed


def goodput(load: ValidLoad, seconds: float, during: Callable[[], None] | None = None
            ) -> tuple[float, int, int]:
    """(checked answers/s, wrong, failed) over ``seconds``, with ``during`` run meanwhile."""
    ok0, wrong0, failed0 = load.counts()
    started = time.monotonic()
    if during is None:
        time.sleep(seconds)
    else:
        during()
    elapsed = time.monotonic() - started
    ok, wrong, failed = load.counts()
    return (ok - ok0) / elapsed, wrong - wrong0, failed - failed0


# -- one server --------------------------------------------------------------------------------


def serving_pids(server: RunningServer) -> dict[str, int]:
    if server.mode == "native":
        return {"frontend": server.supervisor.pids("frontend")[0],
                "executor": server.supervisor.pids("executor")[None]}
    return {"server": server.pid}


def measure(mode: str, repository: Path, seconds: float, clients: int,
            chosen: list[Attack]) -> dict[str, Any]:
    say(f"{mode}: starting the server")
    server = start_process(repository, mode, models=["grow"], check_exit=False, extra_args=(
        [] if mode == "native" else ["--no-gc-freeze"]))
    try:
        pids = serving_pids(server)
        with grpc.insecure_channel(server.address, options=UNLIMITED) as channel:
            _unary(grow_request(np.arange(4, dtype=np.float32)).SerializeToString())(channel)
            with ValidLoad(server.address, clients) as load:
                time.sleep(1.0)  # connected and warm
                base, wrong, failed = goodput(load, seconds)
                say(f"{mode}: valid load alone {base:.0f}/s")
                rows = []
                for attack in chosen:
                    rows.append(_attack_row(attack, channel, load, pids, base, seconds))
                    say(f"{mode}: {attack.name}: {rows[-1]['status']} "
                        f"goodput {rows[-1]['goodput_ratio']:.2f}")
            metrics_bytes = len(server.metrics_text().encode())
        return {"mode": mode, "goodput_alone": base, "wrong_alone": wrong,
                "failed_alone": failed, "rows": rows,
                "metrics_bytes": metrics_bytes}
    finally:
        server.stop()


def _attack_row(attack: Attack, channel: grpc.Channel, load: ValidLoad, pids: dict[str, int],
                base: float, seconds: float) -> dict[str, Any]:
    # Alone (the valid load paused is not needed: its own memory is small and steady).
    peaks = {role: PeakGrowth(pid) for role, pid in pids.items()}
    for peak in peaks.values():
        peak.__enter__()
    status, message = attack.run(channel)
    for peak in peaks.values():
        peak.__exit__(None, None, None)

    def again() -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            attack.run(channel)

    rate, wrong, failed = goodput(load, seconds, again)
    honest = None
    if attack.honest is not None:
        send = _unary(attack.honest)

        def honestly() -> None:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                send(channel)

        honest, honest_wrong, _ = goodput(load, seconds, honestly)
        wrong += honest_wrong
    bound = GROWTH_FACTOR * attack.wire_bytes + attack.tensor_bytes
    return {"attack": attack.name, "status": status, "message": message,
            "wire_bytes": attack.wire_bytes, "bound_bytes": bound,
            "peak_growth_bytes": {role: p.bytes for role, p in peaks.items()},
            "goodput": rate, "goodput_ratio": rate / base if base else 0.0,
            "honest_goodput": honest,
            "honest_ratio": rate / honest if honest else None,
            "wrong": wrong, "failed": failed}


# -- the report --------------------------------------------------------------------------------


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _size(nbytes: float) -> str:
    return f"{nbytes / MIB:.1f} MiB" if nbytes >= MIB / 10 else f"{nbytes / 1024:.1f} KiB"


def render(report: dict[str, Any]) -> str:
    lines = [f"attacks, {report['date']}, {report['machine']['cpu_model']} "
             f"({report['machine']['usable_cores']} usable cores), --seconds "
             f"{report['seconds']}, --clients {report['clients']}",
             f"targets: peak growth <= {GROWTH_FACTOR} x wire + tensor bytes; /metrics < 1 MB; "
             f"goodput during >= {GOODPUT_TARGET} x alone; 0 wrong answers", ""]
    for result in report["results"]:
        lines.append(f"{result['mode']}: valid goodput alone {result['goodput_alone']:.0f}/s "
                     f"({result['wrong_alone']} wrong); "
                     f"/metrics {result['metrics_bytes'] / 1000:.0f} kB "
                     f"({'MET' if result['metrics_bytes'] < METRICS_BOUND else 'NOT MET'})")
        lines.append("| attack | status | wire | peak growth (bound) | goodput during / alone "
                     "| × honest | wrong |")
        lines.append("|---|---|---|---|---|---|---|")
        for row in result["rows"]:
            growth = ", ".join(f"{role} {_size(b)}"
                               for role, b in row["peak_growth_bytes"].items())
            met = all(b <= row["bound_bytes"] for b in row["peak_growth_bytes"].values())
            lines.append(
                f"| {row['attack']} | {row['status']} | {_size(row['wire_bytes'])} | "
                f"{growth} (≤ {_size(row['bound_bytes'])}: {'MET' if met else 'NOT MET'}) | "
                f"{row['goodput_ratio']:.2f} "
                f"({'MET' if row['goodput_ratio'] >= GOODPUT_TARGET else 'NOT MET'}) | "
                f"{_ratio(row.get('honest_ratio'))} | "
                f"{row['wrong']} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchgate.bench.attacks",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="native,single",
                        help="front ends, comma-separated: native, single")
    parser.add_argument("--seconds", type=float, default=5.0,
                        help="each goodput window: valid load alone, and beside each attack")
    parser.add_argument("--clients", type=int, default=4, help="closed-loop valid clients")
    parser.add_argument("--only", default="",
                        help="run the attacks whose name contains this text (default: all)")
    parser.add_argument("--json", type=Path, help="write the report here too")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not set(modes) <= {"native", "single"} or args.seconds <= 0 or args.clients < 1:
        parser.error(f"--modes must be native and/or single, --seconds > 0, --clients >= 1; "
                     f"got {args.modes!r}, {args.seconds}, {args.clients}")
    chosen = [a for a in attacks() if args.only in a.name]
    if not chosen:
        parser.error(f"no attack's name contains {args.only!r}")
    with tempfile.TemporaryDirectory(prefix="attacks-") as folder:
        repository = Path(folder)
        write_model(repository, GROW_CONFIG, GROW_MODEL)
        write_model(repository, TEXTS_CONFIG, TEXTS_MODEL)
        try:
            results = [measure(mode, repository, args.seconds, args.clients, chosen)
                       for mode in modes]
        except RUN_ERRORS as exc:
            print(f"attacks: {exc}", file=sys.stderr)
            return 1
    report = {"date": datetime.date.today().isoformat(), "machine": machine(),
              "seconds": args.seconds, "clients": args.clients,
              "command": "python -m batchgate.bench.attacks " + " ".join(argv or sys.argv[1:]),
              "results": results}
    return emit(report, render, args.json)


if __name__ == "__main__":
    sys.exit(main())
