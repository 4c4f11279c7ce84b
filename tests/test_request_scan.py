"""The wire scan of a ModelInferRequest (``server/frontend/request_scan.py``) on its own: each rule
counted exactly and refused one past its bound, in wire order; and what it calls malformed is
what protobuf's parser refuses, checked against the parser over hand-written cases, over every
cut of a valid request, and over byte strings hypothesis builds from the wire grammar (unknown
fields of every type, groups, unpacked values, non-minimal varints, mutations).

The native front end's scan (``server/native/src/wire_scan.cc``) has the same cases in its unit
tests; tests/test_native_parity.py holds the two to the same answers through live servers.
"""

from __future__ import annotations

import os

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchgate.batcher.errors import ResourceExhausted
from batchgate.protos import inference_pb2 as pb
from batchgate.server.rules import request_limits
from batchgate.server.rules.request_limits import RULE_KEYS, RULES
from batchgate.server.frontend.request_scan import (
    DEFAULT_WIRE_LIMITS,
    MalformedRequest,
    WireLimits,
    scan_infer_request,
)
from batchgate.server.config.settings import Settings

EXAMPLES = int(os.environ.get("BATCHGATE_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
UNLIMITED = {key: 2**62 for key in RULE_KEYS}


def limits(**bounds: int) -> WireLimits:
    return WireLimits({**UNLIMITED, **bounds})


def outcome(data: bytes, wire_limits: WireLimits = WireLimits(UNLIMITED)) -> str:
    """"within", "malformed" or "over <rule>"."""
    try:
        scan_infer_request(data, wire_limits)
    except MalformedRequest:
        return "malformed"
    except ResourceExhausted as exc:
        [rule] = [r.key for r in RULES if str(exc) == r.refusal(getattr(wire_limits, r.key))]
        return f"over {rule}"
    return "within"


def parses(data: bytes) -> bool:
    try:
        pb.ModelInferRequest.FromString(data)
    except DecodeError:
        return False
    return True


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


def every_kind() -> pb.ModelInferRequest:
    """A request with something of every kind a rule counts (as the C++ unit tests' own)."""
    r = pb.ModelInferRequest(model_name="model", model_version="1", id="id")
    r.parameters["priority"].uint64_param = 1
    r.parameters["key"].string_param = "value"
    for i in range(2):
        t = r.inputs.add(name=f"IN{i}", datatype="BYTES", shape=[1, 2**40])
        t.parameters["p"].double_param = 1.5
        t.contents.bytes_contents.append(b"a")
        t.contents.int64_contents.append(-1)
        t.contents.fp32_contents.append(1)
        t.contents.fp64_contents.append(2)
        r.raw_input_contents.append(b"raw")
    out = r.outputs.add(name="OUT")
    out.parameters["shared_memory_region"].string_param = "r"
    out.parameters["shared_memory_byte_size"].int64_param = 8
    return r


# -- the rules --------------------------------------------------------------------------------


def test_the_rules_are_the_settings_with_their_flags():
    fields = {f for f in Settings.__dataclass_fields__}
    assert all(rule.setting in fields for rule in RULES)
    assert len(set(RULE_KEYS)) == len(RULES)
    assert RULES[0].refusal(1024) == (
        "the request has more inputs than this server allows (--max-request-inputs 1024)")
    handed = request_limits.wire_limits(Settings())
    assert list(handed) == list(RULE_KEYS)
    assert handed["outputs"] == [1024, "the request asks for more outputs than this server "
                                       "allows (--max-request-outputs 1024)"]
    assert DEFAULT_WIRE_LIMITS.dimensions == Settings().max_tensor_dimensions


@pytest.mark.parametrize("rule, has", [
    ("inputs", 2), ("raw_input_contents", 2), ("outputs", 1), ("parameters", 2),
    ("dimensions", 2), ("bytes_contents", 2), ("name_bytes", 23), ("unknown_fields", 0),
    ("contents_bytes", 40)])
def test_each_rule_counts_exactly(rule, has):
    data = every_kind().SerializeToString()
    assert outcome(data, limits(**{rule: has})) == "within"
    if has:
        assert outcome(data, limits(**{rule: has - 1})) == f"over {rule}"


@pytest.mark.parametrize("where", ["model_version", "id", "input name", "datatype",
                                   "parameter key", "string value", "output name"])
def test_every_kind_of_name_is_bounded(where):
    r = pb.ModelInferRequest()
    t = r.inputs.add()
    name = "12345"
    if where == "model_version":
        r.model_version = name
    elif where == "id":
        r.id = name
    elif where == "input name":
        t.name = name
    elif where == "datatype":
        t.datatype = name
    elif where == "parameter key":
        t.parameters[name].bool_param = True
    elif where == "string value":
        r.parameters["k"].string_param = name
    else:
        r.outputs.add(name=name)
    assert outcome(r.SerializeToString(), limits(name_bytes=4)) == "over name_bytes"
    assert outcome(r.SerializeToString(), limits(name_bytes=5)) == "within"


def test_each_map_counts_apart_and_shapes_add_up():
    r = pb.ModelInferRequest()
    for _ in range(3):
        t = r.inputs.add()
        t.parameters["a"].bool_param = t.parameters["b"].bool_param = True
    assert outcome(r.SerializeToString(), limits(parameters=2)) == "within"
    r.inputs[1].parameters["c"].bool_param = True
    assert outcome(r.SerializeToString(), limits(parameters=2)) == "over parameters"
    two = limits(dimensions=3)
    packed, unpacked = field(3, b"\x01\x05"), b"\x18\x07"
    assert outcome(field(5, packed + unpacked), two) == "within"
    assert outcome(field(5, packed + unpacked + field(3, b"\x80\x01")), two) == "over dimensions"
    assert outcome(field(5, b"\x18\x07\x18\x80"), two) == "malformed"  # a dimension cut short


def test_a_count_stops_the_scan_at_the_first_past_its_bound():
    empty_outputs = b"\x32\x00" * 2000
    assert outcome(empty_outputs + b"\xff", limits(outputs=1024)) == "over outputs"
    assert outcome(empty_outputs[:2048] + b"\xff", limits(outputs=1024)) == "malformed"
    # A packed shape far past the bound is given up on within its first window.
    wide = field(5, field(3, b"\x01" * 10_000_000))
    assert outcome(wide, limits(dimensions=32)) == "over dimensions"


def test_unpacked_values_are_skipped_in_runs_and_checked():
    values = (b"\x08\x01" + b"\x10\xff\x01" + b"\x35abcd" + b"\x39" + b"x" * 8) * 1000
    contents = values + field(8, b"s") * 3
    assert outcome(field(5, field(5, contents)), limits(bytes_contents=3)) == "within"
    assert outcome(field(5, field(5, contents)), limits(bytes_contents=2)) == "over bytes_contents"
    assert parses(field(5, field(5, contents)))
    for cut in (b"\x10\xff", b"\x35abc", b"\x39abcdefg", b"\x08" + b"\x80" * 10 + b"\x01"):
        data = field(5, field(5, values + cut))
        assert outcome(data) == "malformed" and not parses(data)


def test_typed_contents_count_as_parsed_before_the_parse():
    """A value takes its type's width parsed however few bytes it took sent: 1-byte int64
    values cost 8 each. Packed or not, one field's values are counted exactly; a run of
    unpacked values mixing fields counts 4 bytes per byte sent."""
    million = pb.InferTensorContents(int64_contents=[0] * 1_000_000).SerializeToString()
    data = field(5, field(5, million))
    assert len(data) < 1_000_020  # ~1 byte a value on the wire
    assert outcome(data, limits(contents_bytes=8_000_000)) == "within"
    assert outcome(data, limits(contents_bytes=7_999_999)) == "over contents_bytes"
    # Each field packed: bool 1, int 4, int64 8, uint 4, uint64 8, fp32 4, fp64 8 a value.
    for name, width in (("bool_contents", 1), ("int_contents", 4), ("int64_contents", 8),
                        ("uint_contents", 4), ("uint64_contents", 8), ("fp32_contents", 4),
                        ("fp64_contents", 8)):
        contents = pb.InferTensorContents(**{name: [1] * 3}).SerializeToString()
        data = field(5, field(5, contents))
        assert outcome(data, limits(contents_bytes=3 * width)) == "within", name
        assert outcome(data, limits(contents_bytes=3 * width - 1)) == "over contents_bytes", name
    # Unpacked, one field: exact; and across inputs the bytes add up.
    unpacked = b"\x18\x01" * 5 + b"\x18\xff\x01" * 2  # 7 int64 values
    two_inputs = field(5, field(5, unpacked)) * 2
    assert outcome(two_inputs, limits(contents_bytes=112)) == "within"
    assert outcome(two_inputs, limits(contents_bytes=111)) == "over contents_bytes"
    fixed = b"\x35abcd" * 3 + b"\x39" + b"x" * 8  # 3 fp32 then 1 fp64: a mixed run of 24 bytes
    assert outcome(field(5, field(5, b"\x35abcd" * 3)), limits(contents_bytes=12)) == "within"
    assert outcome(field(5, field(5, fixed)), limits(contents_bytes=96)) == "within"
    assert outcome(field(5, field(5, fixed)), limits(contents_bytes=95)) == "over contents_bytes"
    # A run cut short is counted up to its last whole value first: the refusal stands.
    assert outcome(field(5, field(5, unpacked + b"\x18")), limits(contents_bytes=55)) == (
        "over contents_bytes")
    assert outcome(field(5, field(5, unpacked + b"\x18")), limits(contents_bytes=56)) == (
        "malformed")
    # A value whose tag takes two bytes stands alone, counted at its width.
    assert outcome(field(5, field(5, b"\x98\x00\x01")), limits(contents_bytes=7)) == (
        "over contents_bytes")


# -- malformed is what the parser refuses -------------------------------------------------------

TEN_BYTE_VARINT = b"\x80" * 9 + b"\x01"
FINE = [
    b"\x40\x01",                          # field 8 varint: unknown
    b"\x41" + bytes(8),                   # fixed64
    b"\x45" + bytes(4),                   # fixed32
    b"\x42\x02xy",                        # length-delimited
    b"\x43\x0b\x08\x01\x0c\x44",          # group 8 { group 1 { 1: 1 } }
    b"\x40" + TEN_BYTE_VARINT,
    b"\x08\x01",                          # model_name as a varint: unknown
    b"\x2a\x04\x1b\x08\x01\x1c",          # inputs { group 3 { 1: 1 } }
    b"\x22\x07\x12\x05\x2d\x00\x00\x00\x00",  # parameters { value { 5: fixed32 } }
    b"\xaa\x00\x00",                      # inputs, its tag in two bytes
]
BAD = [
    b"\x28",                              # a tag and no value
    b"\x28\x80",                          # a varint cut short
    b"\x28" + b"\x80" * 10 + b"\x01",     # eleven bytes
    b"\x0a\x05abc",                       # a length past the end
    b"\x2a\x03\x0a\x05a",                 # ... past its message's end
    b"\x02\x00",                          # field number 0
    b"\x00",
    b"\x46\x00",                          # wire type 6
    b"\x47\x00",                          # wire type 7
    b"\x44",                              # a group's end, none began
    b"\x43\x4c",                          # group 8 ended as 9
    b"\x43\x08\x01",                      # group 8 never ended
    b"\x2a\x02\x43\x44\x44",              # its end outside its message
    b"\x80\x80\x80\x80\x80\x08",          # a tag in six bytes
    b"\x8a\x80\x80\x80\x10\x00",          # a tag past 32 bits
]


@pytest.mark.parametrize("data", FINE, ids=[d.hex() for d in FINE])
def test_what_parses_is_within(data):
    assert outcome(data) == "within" and parses(data)


@pytest.mark.parametrize("data", BAD, ids=[d.hex() for d in BAD])
def test_what_does_not_parse_is_malformed(data):
    assert outcome(data) == "malformed" and not parses(data)


def test_where_the_parsers_differ_the_scan_takes_the_stricter():
    # A length in six bytes: upb takes it, the C++ parser does not.
    long_length = b"\x0a\x80\x80\x80\x80\x80\x00"
    assert parses(long_length) and outcome(long_length) == "malformed"


def test_groups_nest_as_deep_as_protobuf_allows():
    def nested(depth: int) -> bytes:
        return b"\x43" * depth + b"\x44" * depth

    assert outcome(nested(99)) == "within" and parses(nested(99))
    assert outcome(nested(101)) == "malformed" and not parses(nested(101))


def test_every_cut_of_a_request_the_parser_refuses_is_malformed_or_left_to_it():
    whole = every_kind().SerializeToString()
    for size in range(len(whole)):
        cut = whole[:size]
        if outcome(cut) == "malformed":
            assert not parses(cut), size


# -- hypothesis: the wire grammar -------------------------------------------------------------

def _tag(number: int, wire_type: int, padding: int) -> bytes:
    """A tag, in ``padding`` more bytes than it needs (parsers take non-minimal varints)."""
    encoded = bytearray(varint(number << 3 | wire_type))
    if padding:
        encoded[-1] |= 0x80
        encoded += b"\x80" * (padding - 1) + b"\x00"
    return bytes(encoded)


@st.composite
def wire_fields(draw, numbers: list[int], depth: int = 0) -> bytes:
    """Fields of the given numbers (known ones among them), of any wire type."""
    out = b""
    for _ in range(draw(st.integers(0, 4))):
        number = draw(st.sampled_from(numbers))
        wire_type = draw(st.sampled_from([0, 1, 2, 2, 2, 3, 5]))
        tag = _tag(number, wire_type, draw(st.sampled_from([0, 0, 0, 1])))
        if wire_type == 0:
            out += tag + varint(draw(st.integers(0, 2**64 - 1)))
        elif wire_type == 1:
            out += tag + draw(st.binary(min_size=8, max_size=8))
        elif wire_type == 5:
            out += tag + draw(st.binary(min_size=4, max_size=4))
        elif wire_type == 3:
            inner = draw(wire_fields([1, 2, 9], depth + 1)) if depth < 3 else b""
            out += tag + inner + _tag(number, 4, 0)
        else:
            if depth < 3 and draw(st.booleans()):
                payload = draw(wire_fields([1, 2, 3, 4, 5, 6, 7, 8, 15], depth + 1))
            else:
                payload = draw(st.binary(max_size=6))
            out += tag + varint(len(payload)) + payload
    return out


@st.composite
def wire_requests(draw) -> bytes:
    data = draw(wire_fields([1, 2, 3, 4, 5, 6, 7, 16]))
    for _ in range(draw(st.integers(0, 3))):  # mutations
        if not data:
            break
        at = draw(st.integers(0, len(data) - 1))
        kind = draw(st.sampled_from(["flip", "cut", "insert", "drop"]))
        if kind == "flip":
            data = data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1:]
        elif kind == "cut":
            data = data[:at]
        elif kind == "insert":
            data = data[:at] + bytes([draw(st.integers(0, 255))]) + data[at:]
        else:
            data = data[:at] + data[at + 1:]
    return data


def _long_lengths(data: bytes) -> bool:
    """Whether ``data`` might hold a length in more than five bytes (which upb takes)."""
    return b"\x80\x80\x80\x80" in data


@FUZZ
@given(data=wire_requests())
def test_the_scan_never_refuses_what_the_parser_takes(data):
    if outcome(data) == "malformed" and parses(data):
        assert _long_lengths(data), data.hex()


def true_counts(r: pb.ModelInferRequest) -> dict[str, int]:
    """What each rule counts in a parsed request built without repeated map keys or unknown
    fields (so that its wire holds exactly this)."""
    maps = [r.parameters, *(t.parameters for t in r.inputs), *(o.parameters for o in r.outputs)]
    names = [r.model_name, r.model_version, r.id, *(t.name for t in r.inputs),
             *(t.datatype for t in r.inputs), *(o.name for o in r.outputs),
             *(k for m in maps for k in m),
             *(v.string_param for m in maps for v in m.values())]
    return {"inputs": len(r.inputs), "raw_input_contents": len(r.raw_input_contents),
            "outputs": len(r.outputs), "parameters": max(len(m) for m in maps),
            "dimensions": max((len(t.shape) for t in r.inputs), default=0),
            "bytes_contents": sum(len(t.contents.bytes_contents) for t in r.inputs),
            "name_bytes": max(len(n.encode()) for n in names), "unknown_fields": 0,
            "contents_bytes": sum(8 * len(t.contents.int64_contents)
                                  + len(t.contents.bool_contents)
                                  + 4 * len(t.contents.fp32_contents) for t in r.inputs)}


texts = st.text(max_size=6)


@st.composite
def requests(draw) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name=draw(texts), model_version=draw(texts), id=draw(texts))
    for key in draw(st.lists(texts, max_size=3, unique=True)):
        r.parameters[key].string_param = draw(texts)
    for _ in range(draw(st.integers(0, 4))):
        t = r.inputs.add(name=draw(texts), datatype=draw(texts),
                         shape=draw(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=6)))
        for key in draw(st.lists(texts, max_size=3, unique=True)):
            t.parameters[key].int64_param = draw(st.integers(-(2**63), 2**63 - 1))
        t.contents.bytes_contents.extend(draw(st.lists(st.binary(max_size=3), max_size=4)))
        t.contents.int64_contents.extend(draw(st.lists(st.integers(-(2**63), 2**63 - 1),
                                                       max_size=3)))
        t.contents.bool_contents.extend(draw(st.lists(st.booleans(), max_size=3)))
        t.contents.fp32_contents.extend(draw(st.lists(st.floats(width=32), max_size=3)))
        if draw(st.booleans()):
            r.raw_input_contents.append(draw(st.binary(max_size=8)))
    for _ in range(draw(st.integers(0, 3))):
        o = r.outputs.add(name=draw(texts))
        for key in draw(st.lists(texts, max_size=2, unique=True)):
            o.parameters[key].bool_param = True
    return r


@FUZZ
@given(request=requests(), rule=st.sampled_from(RULE_KEYS))
def test_each_count_is_exact(request, rule):
    data = request.SerializeToString()
    has = true_counts(request)[rule]
    assert outcome(data, limits(**{rule: has})) == "within"
    if has:
        assert outcome(data, limits(**{rule: has - 1})) == f"over {rule}"
