"""A request is bounded before it is materialised, a reply before it is built: the hostile
requests of docs/operations.md's "Bounded requests", sent as raw gRPC bytes to a server of each
front end (the native one; one Python process), each in a process of its own so that its peak
resident memory (``/proc/<pid>/status`` VmHWM) is the server's alone.

For each: the status and the message naming the limit, the server's peak memory during the call
under a bound set by the request's size on the wire, and a valid request answered right after.
Before the wire scan, the first of them (3,000,000 empty ``outputs`` entries, 6 MB) took the
native front end ~500 MB and one process ~165 MB, and the same output named 2,000,000 times
built a 4 GB reply. Sizes are kept to a few megabytes: enough that a parse would show, small
enough to be quick.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from batchgate.protos import inference_pb2 as pb
from batchgate.server.rules.request_limits import wire_limits
from batchgate.server.config.settings import Settings
from batchgate.bench.harness.server import start_process
from batchgate.bench.harness.memory import PeakGrowth
from batchgate.bench.harness.repository import model_config, tensor, write_model
from tests.support.servers import start_multiprocess_server

MODES = ("native", "single")
MIB = 1 << 20
# What a server may take beyond a few times the request's wire size: gRPC's buffers, the
# answer, the allocator's rounding. A parse of any of these requests takes hundreds of MiB.
SLACK_BYTES = 32 * MIB
MAX_MESSAGE_BYTES = 64 * MIB  # the default
GROW_FACTOR = 16

# Y = X repeated 16 times, Z = X: a reply far larger than its request.
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


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def grow_request(values: int = 4) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="grow", id="valid")
    request.inputs.add(name="X", datatype="FP32", shape=[1, values])
    request.raw_input_contents.append(np.arange(values, dtype=np.float32).tobytes())
    return request


GROW = field(1, b"grow")
VALID = grow_request().SerializeToString()
# (what, the request's bytes, the rule it passes)
ATTACKS = [
    ("3,000,000 empty outputs", GROW + b"\x32\x00" * 3_000_000, "outputs"),
    ("one output named 2,000,000 times", VALID + field(6, field(1, b"Y")) * 2_000_000, "outputs"),
    ("2,000,000 request parameters",
     GROW + b"".join(field(4, field(1, b"%06x" % i)) for i in range(2_000_000)), "parameters"),
    ("a model name of 8 MB", field(1, b"m" * (8 * MIB)), "name_bytes"),
    ("3,000,000 empty inputs", GROW + b"\x2a\x00" * 3_000_000, "inputs"),
    ("3,000,000 raw_input_contents", GROW + b"\x3a\x00" * 3_000_000, "raw_input_contents"),
    ("3,000,000 bytes_contents",
     field(1, b"texts") + field(5, field(1, b"A") + field(2, b"BYTES") + field(3, b"\x01\x01")
                                + field(5, b"\x42\x00" * 3_000_000)),
     "bytes_contents"),
    ("3,000,000 unknown fields", GROW + b"\x7a\x00" * 3_000_000, "unknown_fields"),
    ("8,388,609 int64 contents of a byte each",
     GROW + field(5, field(1, b"X") + field(2, b"FP32") + field(5, field(3, bytes(8 * MIB + 1)))),
     "contents_bytes"),
    ("a shape of 10,000,000 dimensions",
     GROW + field(5, field(1, b"X") + field(2, b"FP32") + field(3, b"\x01" * 10_000_000)),
     "dimensions"),
]
# Each rule's refusal at the default settings: "... (--max-request-outputs 1024)".
REFUSALS = {key: refusal for key, (_, refusal) in wire_limits(Settings()).items()}


@pytest.fixture(scope="module", params=MODES)
def server(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"bounds-{request.param}")
    write_model(root, GROW_CONFIG, GROW_MODEL)
    write_model(root, TEXTS_CONFIG, TEXTS_MODEL)
    if request.param == "native":
        running = start_multiprocess_server(root, extra_args=("--shared-memory",))
        running.serving_pid = running.supervisor.pids("frontend")[0]
    else:
        running = start_process(root, "single", extra_args=(
            "--shared-memory", "--no-gc-freeze", "--drain-timeout-s", "10"))
        running.serving_pid = running.pid
    yield running
    running.stop()


@pytest.fixture(scope="module")
def channel(server):
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(server.address, options=options) as ch:
        yield ch


def infer(channel, data: bytes) -> tuple[str, str]:
    """``(code name, message)`` of a ModelInfer call with these bytes; ("OK", "") answered."""
    try:
        channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(data, timeout=120)
    except grpc.RpcError as err:
        return err.code().name, err.details() or ""
    return "OK", ""


def answered_correctly(channel) -> None:
    reply = pb.ModelInferResponse.FromString(
        channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(VALID, timeout=60))
    y, z = (np.frombuffer(raw, np.float32) for raw in reply.raw_output_contents)
    np.testing.assert_array_equal(z, np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(y, np.tile(z, GROW_FACTOR))


@pytest.mark.parametrize("what, data, rule", ATTACKS, ids=[a[0] for a in ATTACKS])
def test_a_request_past_a_wire_limit_is_refused_before_it_is_parsed(server, channel, what,
                                                                     data, rule):
    answered_correctly(channel)  # warm: what the first call allocates is not the attack's
    with PeakGrowth(server.serving_pid) as peak:
        code, message = infer(channel, data)
    bound = 4 * len(data) + SLACK_BYTES
    assert peak.bytes <= bound, (
        f"{what}: the {server.mode} server's memory rose {peak.bytes / MIB:.1f} MiB for a "
        f"request of {len(data) / MIB:.1f} MiB (bound {bound / MIB:.1f} MiB), answered "
        f"{code} {message!r}")
    assert (code, message) == ("RESOURCE_EXHAUSTED", REFUSALS[rule])
    answered_correctly(channel)


def test_a_stream_answers_each_refusal_in_band_and_goes_on(server, channel):
    stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
    sent = [ATTACKS[0][1], VALID, ATTACKS[3][1], VALID]
    with PeakGrowth(server.serving_pid) as peak:
        answers = [pb.ModelStreamInferResponse.FromString(m)
                   for m in stream(iter(sent), timeout=120)]
    errors = sorted(a.error_message for a in answers if a.error_message)
    assert len(answers) == 4
    assert errors == sorted([REFUSALS["outputs"], REFUSALS["name_bytes"]])
    assert all(a.infer_response.id == "valid" for a in answers if not a.error_message)
    assert peak.bytes <= 4 * sum(map(len, sent)) + SLACK_BYTES


def test_bytes_that_do_not_parse_get_the_parsers_error(channel):
    parse_error = ("Unexpected <class 'google.protobuf.message.DecodeError'>: Error parsing "
                   "message with type 'inference.ModelInferRequest'")
    for data in (b"\xff\xff", VALID[:-1], VALID + b"\x0a\x80\x80\x80\x80\x80\x00",
                 GROW + b"\x32\x00" * 100 + b"\x43"):
        assert infer(channel, data) == ("UNKNOWN", parse_error), data[-8:]
    answered_correctly(channel)


def test_an_output_asked_for_twice_is_refused(channel):
    request = grow_request()
    request.outputs.add(name="Y")
    request.outputs.add(name="Z")
    assert infer(channel, request.SerializeToString()) == ("OK", "")
    request.outputs.add(name="Y")
    assert infer(channel, request.SerializeToString()) == (
        "INVALID_ARGUMENT", "model 'grow': output 'Y' is requested twice")


def reply_bytes(request: pb.ModelInferRequest, values: int, stream: bool) -> int:
    """What the reply to a grow request of ``values`` values takes serialized."""
    header = pb.ModelInferResponse(model_name="grow", model_version="1", id=request.id)
    sizes = [4 * values * GROW_FACTOR, 4 * values]
    for name, size in zip("YZ", sizes):
        header.outputs.add(name=name, datatype="FP32", shape=[1, size // 4])
    inner = header.ByteSize() + sum(1 + len(varint(n)) + n for n in sizes)
    return 1 + len(varint(inner)) + inner if stream else inner


def test_a_reply_past_the_message_limit_fails_that_request_alone(server, channel):
    values = MAX_MESSAGE_BYTES // (4 * GROW_FACTOR) + 1024  # a 4 MiB request, a 64+ MiB reply
    request = grow_request(values)
    data = request.SerializeToString()
    output_bytes = 4 * values * (GROW_FACTOR + 1)
    with PeakGrowth(server.serving_pid) as peak:
        code, message = infer(channel, data)
    # The native front end reads the outputs from the executor's memory; one process holds
    # them itself, from the model: either way no reply of their size is built besides.
    held = output_bytes if server.mode == "single" else 0
    assert peak.bytes <= 1.5 * held + 4 * len(data) + SLACK_BYTES, (
        f"the {server.mode} server's memory rose {peak.bytes / MIB:.1f} MiB for outputs of "
        f"{output_bytes / MIB:.1f} MiB, answered {code} {message!r}")
    assert (code, message) == ("RESOURCE_EXHAUSTED", (
        f"model 'grow': the reply would take {reply_bytes(request, values, False)} bytes, more "
        f"than this server sends (--max-message-bytes {MAX_MESSAGE_BYTES})"))
    answered_correctly(channel)
    stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
    answers = [pb.ModelStreamInferResponse.FromString(m)
               for m in stream(iter([data, VALID]), timeout=120)]
    assert sorted(a.error_message for a in answers) == ["", (
        f"model 'grow': the reply would take {reply_bytes(request, values, True)} bytes, more "
        f"than this server sends (--max-message-bytes {MAX_MESSAGE_BYTES})")]


def test_a_shared_memory_byte_size_cannot_wrap_the_request_bytes(channel):
    """BYTES inputs in shared memory count their client-given byte size against
    --max-request-bytes: two whose sizes add up past 2**64 are refused, not wrapped round to
    a small total (the native front end did that). The regions need not exist: the front end
    refuses before anything looks for them."""
    request = pb.ModelInferRequest(model_name="texts")
    for name, size in (("A", 1000), ("B", 2**64 - 900)):
        parameters = request.inputs.add(name=name, datatype="BYTES", shape=[1, 1]).parameters
        parameters["shared_memory_region"].string_param = "nowhere"
        parameters["shared_memory_byte_size"].uint64_param = size
    assert infer(channel, request.SerializeToString()) == ("RESOURCE_EXHAUSTED", (
        "model 'texts': the request's inputs take more bytes than this server allows "
        f"(--max-request-bytes {MAX_MESSAGE_BYTES})"))
