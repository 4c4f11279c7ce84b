"""Fuzzing the live server with hypothesis-generated requests, in both modes.

Each example starts from a valid request for one of the example or test models and applies up
to a few mutations: inputs dropped, duplicated, renamed (unicode, NUL, 10 KB names); datatypes
wrong or made up; shapes negative, huge (2**62), zero-sized, of the wrong rank or with thousands
of dimensions; raw buffers too short, too long or missing; raw and typed contents mixed; typed
contents in the wrong field; NaN and Inf; request parameters of every type; shared-memory
parameters; unknown outputs; unknown models, versions and names that would leave the
repository; empty requests. The server must answer every one within its deadline, with a
status a client's mistake deserves (never INTERNAL or UNKNOWN); an unmutated request must be
answered correctly (the echo model returns its inputs bit for bit). Meanwhile clients on other
threads send valid requests to ``mlp`` and check every answer against the model run here.

The targets are models whose answer depends only on the request's structure: ``encoder``
(token ids index an embedding: an id out of range makes the *model* raise) and the test models
that fail on purpose are left out. Examples are derandomized so CI runs the same ones;
BATCHGATE_FUZZ_EXAMPLES sets how many (default 100 per test and mode), and
BATCHGATE_FUZZ_RANDOM=1 draws new ones on each run, to look for more.
"""

from __future__ import annotations

import os
import struct

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from grpc_health.v1 import health_pb2

from batchgate.protos import inference_pb2 as pb
from batchgate.protos import inference_pb2_grpc
from batchgate.batcher.errors import quoted
from batchgate.server.frontend.errors import INTERNAL_MESSAGE
from batchgate.server.metrics import UNKNOWN_MODEL_LABEL
from tests.support.load import Load
from tests.support.models import NUMERIC_TYPES

EXAMPLES = int(os.environ.get("BATCHGATE_FUZZ_EXAMPLES", "100"))
RANDOM = os.environ.get("BATCHGATE_FUZZ_RANDOM") == "1"
CALL_TIMEOUT_S = 30
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not RANDOM, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# name -> (max_batch_size, inputs as (name, datatype, dims), output names)
MODELS = {
    "mlp": (64, [("INPUT__0", "FP32", (512,))], ["OUTPUT__0"]),
    "cnn": (32, [("INPUT__0", "FP32", (3, 32, 32))], ["OUTPUT__0"]),
    "echo": (4, [(f"IN_{t}", t, (3,)) for t in NUMERIC_TYPES], [f"OUT_{t}" for t in NUMERIC_TYPES]),
    "strlen": (8, [("TEXT", "BYTES", (1,))], ["LENGTH"]),
}
NUMPY = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32,
         "UINT64": np.uint64, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
         "INT64": np.int64, "FP16": np.float16, "FP32": np.float32, "FP64": np.float64,
         "BF16": np.uint16}
TYPED_FIELDS = ["bool_contents", "int_contents", "int64_contents", "uint_contents",
                "uint64_contents", "fp32_contents", "fp64_contents", "bytes_contents"]
DATATYPES = [*NUMERIC_TYPES, "BYTES", "STRING", "fp32", "", "TYPE_FP32", "FP8", "\x00"]
# Client mistakes get these; DEADLINE_EXCEEDED only when the request set a 'timeout'.
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED}
KNOWN_NAMES = {*MODELS, "encoder", "gated", "failing", "spare", "wrongbatch"}

texts = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["../mlp", "/etc/passwd", "mlp/../mlp", "a\\b", "m\x00", ".", "..",
                     "é" * 300, "x" * 20_000, "💥", " mlp", "MLP"]),
)
huge = st.sampled_from([2**31, 2**32 + 1, 2**40, 2**62, 2**63 - 1])
dims = st.one_of(st.integers(0, 4), st.integers(-(2**63), -1), huge, st.integers(0, 600))
shapes = st.one_of(st.lists(dims, max_size=5), st.just([1] * 5000))
specials = st.sampled_from(["normal", "nan", "inf", "-inf", "zeros", "bits"])
parameter_values = st.one_of(
    st.builds(lambda v: pb.InferParameter(bool_param=v), st.booleans()),
    st.builds(lambda v: pb.InferParameter(int64_param=v), st.integers(-(2**63), 2**63 - 1)),
    st.builds(lambda v: pb.InferParameter(uint64_param=v), st.integers(0, 2**64 - 1)),
    st.builds(lambda v: pb.InferParameter(double_param=v), st.floats()),
    st.builds(lambda v: pb.InferParameter(string_param=v), st.text(max_size=8)),
)


def tensor_bytes(datatype: str, shape: tuple, special: str, seed: int) -> bytes:
    """Valid raw contents for ``shape``: random values, or NaN/Inf/zeros, or random bits."""
    rng = np.random.default_rng(seed)
    count = int(np.prod(shape))
    if datatype == "BYTES":
        items = [rng.bytes(int(rng.integers(0, 6))) for _ in range(count)]
        return b"".join(struct.pack("<I", len(i)) + i for i in items)
    dtype = np.dtype(NUMPY[datatype])
    if datatype == "BOOL":  # bytes other than 0 and 1 are not bools (mutation bad_bools)
        data = rng.integers(0, 2, count).astype(dtype)
    elif special == "bits":
        data = np.frombuffer(rng.bytes(count * dtype.itemsize), dtype)
    elif special in ("nan", "inf", "-inf") and dtype.kind == "f":
        data = rng.standard_normal(count).astype(dtype)
        data[rng.integers(0, count, max(1, count // 7))] = float(special)
    elif special == "zeros":
        data = np.zeros(count, dtype)
    else:
        data = rng.integers(0, 100, count).astype(dtype)
    return data.tobytes()


@st.composite
def requests(draw) -> tuple[pb.ModelInferRequest, int]:
    """A valid request for a target model, then 0 to 3 mutations; with the mutation count."""
    model = draw(st.sampled_from(sorted(MODELS)))
    max_batch, inputs, outputs = MODELS[model]
    batch = draw(st.integers(1, min(max_batch, 4)))
    special, seed = draw(specials), draw(st.integers(0, 2**32 - 1))
    request = pb.ModelInferRequest(model_name=model, id=draw(st.text(max_size=8)))
    for name, datatype, tensor_dims in inputs:
        shape = (batch, *tensor_dims)
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        request.raw_input_contents.append(tensor_bytes(datatype, shape, special, seed))
    if draw(st.booleans()):
        for name in draw(st.lists(st.sampled_from(outputs), max_size=3, unique=True)):
            request.outputs.add(name=name)
    mutations = draw(st.lists(st.sampled_from(sorted(MUTATIONS)), max_size=3))
    for mutation in mutations:
        MUTATIONS[mutation](draw, request)
    return request, len(mutations)


def _pick(draw, request) -> int | None:
    if not request.inputs:
        return None
    return draw(st.integers(0, len(request.inputs) - 1))


def drop_input(draw, request):
    i = _pick(draw, request)
    if i is not None:
        del request.inputs[i]
        if len(request.raw_input_contents) > i:
            del request.raw_input_contents[i]


def duplicate_input(draw, request):
    i = _pick(draw, request)
    if i is not None:
        request.inputs.add().CopyFrom(request.inputs[i])
        if len(request.raw_input_contents) > i:
            request.raw_input_contents.append(request.raw_input_contents[i])


def rename_input(draw, request):
    i = _pick(draw, request)
    if i is not None:
        request.inputs[i].name = draw(st.one_of(texts, st.sampled_from(["INPUT__0", "IN_FP32"])))


def change_datatype(draw, request):
    i = _pick(draw, request)
    if i is not None:
        request.inputs[i].datatype = draw(st.one_of(st.sampled_from(DATATYPES), texts))


def change_shape(draw, request):
    i = _pick(draw, request)
    if i is not None:
        request.inputs[i].shape[:] = draw(shapes)


def resize_raw(draw, request):
    if request.raw_input_contents:
        i = draw(st.integers(0, len(request.raw_input_contents) - 1))
        raw = request.raw_input_contents[i]
        request.raw_input_contents[i] = draw(st.sampled_from(
            [b"", raw[:-1], raw + b"\x00", raw * 2, raw[: len(raw) // 2]]))


def drop_raw(draw, request):
    if request.raw_input_contents:
        del request.raw_input_contents[-1]


def mix_typed(draw, request):
    i = _pick(draw, request)
    if i is not None:
        getattr(request.inputs[i].contents, "fp32_contents").extend([1.0, float("nan")])


def typed_instead(draw, request):
    """All raw buffers become typed contents: in the datatype's field or in any field."""
    raws = list(request.raw_input_contents)
    del request.raw_input_contents[:]
    for tensor, raw in zip(request.inputs, raws):
        field = draw(st.sampled_from(TYPED_FIELDS))
        values = getattr(tensor.contents, field)
        if tensor.datatype in NUMPY and tensor.datatype not in ("FP16", "BF16"):
            n = len(raw) // np.dtype(NUMPY[tensor.datatype]).itemsize
            n += draw(st.sampled_from([0, 0, 0, -1, 1]))
            fill = {"bool_contents": [True], "bytes_contents": [b"x"],
                    "fp32_contents": [float("inf")], "fp64_contents": [float("nan")]}
            values.extend((fill.get(field) or [draw(st.integers(0, 2**31 - 1))]) * max(n, 0))
        elif field == "bytes_contents":
            values.extend([b"abc", "é".encode()])


def add_parameters(draw, request):
    for key in draw(st.lists(st.sampled_from(["priority", "timeout", "sequence_id", "x", ""]),
                             max_size=3, unique=True)):
        request.parameters[key].CopyFrom(draw(parameter_values))


def shared_memory(draw, request):
    i = _pick(draw, request)
    if i is not None:
        request.inputs[i].parameters["shared_memory_region"].string_param = "r"


def request_output(draw, request):
    request.outputs.add(name=draw(st.one_of(texts, st.sampled_from(["OUTPUT__0", "LENGTH"]))))


def change_model(draw, request):
    request.model_name = draw(st.one_of(texts, st.sampled_from(sorted(KNOWN_NAMES))))


def change_version(draw, request):
    request.model_version = draw(st.one_of(texts, st.sampled_from(["1", "2", "0", "-1"])))


def bad_bools(draw, request):
    for i, tensor in enumerate(request.inputs):
        if tensor.datatype == "BOOL" and i < len(request.raw_input_contents):
            raw = request.raw_input_contents[i]
            request.raw_input_contents[i] = bytes([draw(st.integers(2, 255))]) + raw[1:]


def empty(draw, request):
    keep = request.model_name if draw(st.booleans()) else ""
    request.Clear()
    request.model_name = keep


# Around the wire limits (server/rules/request_limits.py, at their defaults): counts just under and
# just over each bound.
def many_outputs(draw, request):
    name = draw(st.sampled_from(["OUTPUT__0", "LENGTH", "OUT_FP32", "x"]))
    for _ in range(draw(st.sampled_from([2, 1023, 1024, 1025, 1100]))):
        request.outputs.add(name=name)


def many_parameters(draw, request):
    parameters = request.parameters
    i = _pick(draw, request)
    if i is not None and draw(st.booleans()):
        parameters = request.inputs[i].parameters
    for n in range(draw(st.sampled_from([63, 64, 65, 200]))):
        parameters[f"p{n}"].int64_param = n


def many_dimensions(draw, request):
    i = _pick(draw, request)
    if i is not None:
        request.inputs[i].shape[:] = [1] * draw(st.sampled_from([31, 32, 33, 1000]))


def long_name(draw, request):
    text = "é" * draw(st.sampled_from([511, 512, 513])) + draw(st.sampled_from(["", "x"]))
    where = draw(st.sampled_from(["model_name", "model_version", "id", "input", "datatype",
                                  "output", "key", "value"]))
    i = _pick(draw, request)
    if where in ("model_name", "model_version", "id"):
        setattr(request, where, text)
    elif where == "output":
        request.outputs.add(name=text)
    elif where == "value":
        request.parameters["x"].string_param = text
    elif where == "key":
        request.parameters[text].bool_param = True
    elif i is not None:
        setattr(request.inputs[i], "name" if where == "input" else "datatype", text)


def many_strings(draw, request):
    i = _pick(draw, request)
    if i is not None:
        count = draw(st.sampled_from([65535, 65536, 65537]))
        request.inputs[i].contents.bytes_contents.extend([b"s"] * count)


MUTATIONS = {f.__name__: f for f in (
    drop_input, duplicate_input, rename_input, change_datatype, change_shape, resize_raw,
    drop_raw, mix_typed, typed_instead, add_parameters, shared_memory, request_output,
    change_model, change_version, bad_bools, empty, many_outputs, many_parameters,
    many_dimensions, long_name, many_strings)}


def check_answer(request: pb.ModelInferRequest, mutations: int, call) -> None:
    """The status of one call fits the request; an unmutated request is answered correctly."""
    try:
        response = call()
    except grpc.RpcError as err:
        code = err.code()
        allowed = ALLOWED | ({grpc.StatusCode.DEADLINE_EXCEEDED}
                             if "timeout" in request.parameters else set())
        assert mutations and code in allowed, (
            f"{code.name}: {err.details()!r} for a request with {mutations} mutations")
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED:  # a limit, which the message names
            assert "--max-" in err.details(), err.details()
        return
    if request.model_name == "echo" and request.raw_input_contents:
        sent = {t.name[3:]: raw for t, raw in zip(request.inputs, request.raw_input_contents)}
        for tensor, raw in zip(response.outputs, response.raw_output_contents):
            assert raw == sent[tensor.name[4:]], f"echo changed {tensor.name}"


@pytest.fixture(scope="module")
def fuzz_target(server):
    """The server, a channel to it, and valid traffic from other threads the whole time."""
    restarts = server.metric("batchgate_child_restarts_total") if server.multiprocess else 0
    with grpc.insecure_channel(server.address) as channel, \
            Load(server.address, clients=2, max_s=1800) as load:
        yield inference_pb2_grpc.GRPCInferenceServiceStub(channel)
        load.progress(5, 60, "valid traffic after the fuzzing")
    assert load.wrong == 0 and not load.failures, (load.failures, load.failure_details[:3])
    assert load.ok > 0
    # Of all the model names the examples made up, none became a metric label.
    with grpc.insecure_channel(server.address) as channel:
        index = inference_pb2_grpc.GRPCInferenceServiceStub(channel).RepositoryIndex(
            pb.RepositoryIndexRequest(), timeout=CALL_TIMEOUT_S)
    labels = {labels["model"] for (name, pairs) in server.samples()
              for labels in [dict(pairs)] if name == "batchgate_requests_total"}
    assert labels <= {m.name for m in index.models} | {UNKNOWN_MODEL_LABEL}, labels
    if server.multiprocess:  # no process died and was started again
        assert server.metric("batchgate_child_restarts_total") == restarts


@FUZZ
@given(example=requests())
def test_model_infer(fuzz_target, example):
    request, mutations = example
    check_answer(request, mutations,
                 lambda: fuzz_target.ModelInfer(request, timeout=CALL_TIMEOUT_S))


PARSE_ERROR = ("Unexpected <class 'google.protobuf.message.DecodeError'>: Error parsing "
               "message with type 'inference.ModelInferRequest'")
WIRE_EXTRAS = [b"\x7a\x00", b"\x78\x81\x00", b"\x7b\x08\x01\x7c", b"\x7b" * 70 + b"\x7c" * 70,
               b"\x44", b"\x0a\x80\x80\x80\x80\x80\x00", b"\xb2\x00\x00", b"\x32\x00" * 1025,
               b"\x3a\x00" * 1025, b"\x7a\x00" * 65]


@st.composite
def request_bytes(draw) -> tuple[bytes, int]:
    """A request from ``requests()``, serialized, then its bytes mutated: changed, dropped,
    inserted, cut, or fields appended that no message of it has (unknown, groups, malformed,
    past a wire limit)."""
    request, mutations = draw(requests())
    data = bytearray(request.SerializeToString())
    changes = draw(st.integers(0, 3))
    for _ in range(changes):
        at = draw(st.integers(0, len(data)))
        kind = draw(st.sampled_from(["change", "drop", "insert", "cut", "append"]))
        if kind == "change" and data:
            data[min(at, len(data) - 1)] = draw(st.integers(0, 255))
        elif kind == "drop":
            del data[at:at + 1]
        elif kind == "insert":
            data.insert(at, draw(st.integers(0, 255)))
        elif kind == "cut":
            del data[at:]
        else:
            data += draw(st.sampled_from(WIRE_EXTRAS))
    return bytes(data), mutations + changes


@pytest.fixture(scope="module")
def raw_infer(server, fuzz_target):
    with grpc.insecure_channel(server.address) as channel:
        yield channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")


@FUZZ
@given(example=request_bytes())
def test_model_infer_bytes(raw_infer, example):
    """Any bytes get a status a client's mistake deserves, or the parser's own error; the
    server keeps serving (the valid traffic of ``fuzz_target`` checks every answer)."""
    data, mutations = example
    try:
        raw_infer(data, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as err:
        code = err.code()
        assert mutations, (code, err.details())
        if code is grpc.StatusCode.UNKNOWN:
            assert err.details() == PARSE_ERROR, err.details()
            return
        assert code in ALLOWED | {grpc.StatusCode.DEADLINE_EXCEEDED}, (code, err.details())
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            assert "--max-" in err.details(), err.details()


@FUZZ
@given(examples=st.lists(requests(), min_size=1, max_size=4))
def test_model_stream_infer(fuzz_target, examples):
    """On a stream every request gets exactly one answer, errors in-band, never INTERNAL."""
    sent = [request for request, _ in examples]
    answers = list(fuzz_target.ModelStreamInfer(iter(sent), timeout=CALL_TIMEOUT_S))
    assert len(answers) == len(sent)
    for answer in answers:
        assert answer.error_message != INTERNAL_MESSAGE
    unmutated = sum(1 for _, mutations in examples if mutations == 0)
    assert sum(1 for a in answers if not a.error_message) >= unmutated


@FUZZ
@given(name=texts, rpc=st.sampled_from(["ModelMetadata", "ModelConfig", "ModelReady",
                                        "ModelStatistics", "RepositoryModelLoad",
                                        "RepositoryModelUnload"]),
       version=st.one_of(st.just(""), texts))
def test_model_names(fuzz_target, name, rpc, version):
    if name in KNOWN_NAMES:
        return  # unloading a served model is not a mistake
    if rpc.startswith("Repository"):
        message = getattr(pb, f"{rpc}Request")(model_name=name)
    else:
        message = getattr(pb, f"{rpc}Request")(name=name, version=version)
    try:
        getattr(fuzz_target, rpc)(message, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as err:
        assert err.code() in {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT}, (
            err.code(), err.details())
        # The message says which name, quoted as every front end quotes it.
        assert quoted(name[:20])[1:-1] in err.details()


@pytest.fixture(scope="module")
def health_calls(server):
    """Health's Check and Watch, taking and giving raw bytes."""
    with grpc.insecure_channel(server.address) as channel:
        yield (channel.unary_unary("/grpc.health.v1.Health/Check"),
               channel.unary_stream("/grpc.health.v1.Health/Watch"))


health_requests = st.one_of(
    texts.map(lambda name: health_pb2.HealthCheckRequest(service=name).SerializeToString()),
    st.binary(max_size=64),
)


@FUZZ
@given(request=health_requests)
def test_health(fuzz_target, health_calls, request):
    """Any bytes: a status, NOT_FOUND for a name nobody has, or UNKNOWN for bytes that do not
    parse; and a Watch of them answers in the same terms as the Check."""
    check, watch = health_calls
    statuses = health_pb2.HealthCheckResponse
    try:
        known = statuses.FromString(check(request, timeout=CALL_TIMEOUT_S)).status
        assert known in (statuses.SERVING, statuses.NOT_SERVING)
    except grpc.RpcError as err:
        assert err.code() in {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNKNOWN}, (
            err.code(), err.details())
        known = statuses.SERVICE_UNKNOWN if err.code() is grpc.StatusCode.NOT_FOUND else None
    stream = watch(request, timeout=CALL_TIMEOUT_S)
    try:
        assert statuses.FromString(next(stream)).status == known
    except grpc.RpcError as err:
        assert known is None and err.code() is grpc.StatusCode.UNKNOWN, (err.code(), err.details())
    finally:
        stream.cancel()


# -- what the fuzzer found, one regression test each ------------------------------------------


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield inference_pb2_grpc.GRPCInferenceServiceStub(channel)


def status(call) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as err:
        return err.code(), err.details()
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize("name", ["x" * 256, "é" * 300, "x" * 20_000])
def test_model_names_longer_than_a_file_name(stub, name):
    """Were: OSError (ENAMETOOLONG) from the repository's file lookups: INTERNAL from
    ModelInfer, UNKNOWN with the server's repository path from the other RPCs. (ModelInfer
    refuses a name over --max-request-name-bytes before it reads it.)"""
    code, details = status(lambda: stub.ModelInfer(pb.ModelInferRequest(model_name=name),
                                                   timeout=30))
    if len(name.encode()) > 1024:
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert details.endswith("(--max-request-name-bytes 1024)"), details
    else:
        assert code is grpc.StatusCode.NOT_FOUND
    assert stub.ModelReady(pb.ModelReadyRequest(name=name), timeout=30).ready is False
    for rpc, request in (("ModelMetadata", pb.ModelMetadataRequest(name=name)),
                         ("ModelConfig", pb.ModelConfigRequest(name=name)),
                         ("ModelStatistics", pb.ModelStatisticsRequest(name=name))):
        assert status(lambda: getattr(stub, rpc)(request, timeout=30))[0] is (
            grpc.StatusCode.NOT_FOUND), rpc
    for rpc, request in (("RepositoryModelLoad", pb.RepositoryModelLoadRequest(model_name=name)),
                         ("RepositoryModelUnload",
                          pb.RepositoryModelUnloadRequest(model_name=name))):
        code, details = status(lambda: getattr(stub, rpc)(request, timeout=30))
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "at most 255 bytes" in details, rpc


def long_strings() -> list[pb.ModelInferRequest]:
    def mlp(**tensor) -> pb.ModelInferRequest:
        request = pb.ModelInferRequest(model_name="mlp")
        request.inputs.add(**{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 512],
                              **tensor})
        request.raw_input_contents.append(bytes(2048))
        return request

    # Within --max-request-name-bytes (1024), but quoted as \x01 each: 4 KB.
    text = "\x01" * 1000
    with_output = mlp()
    with_output.outputs.add(name=text)
    with_version = mlp()
    with_version.model_version = text
    return [mlp(name=text), mlp(datatype=text), mlp(shape=[1] * 30), with_output, with_version]


@pytest.mark.parametrize("request_", long_strings(),
                         ids=["input", "datatype", "shape", "output", "version"])
def test_messages_quoting_long_client_strings_still_reach_the_client(stub, request_):
    """Were: the status message quoted all of it; clients refuse a trailer over 16 KiB, so
    the caller saw RESOURCE_EXHAUSTED 'Stream removed' instead of its error. (Strings past
    --max-request-name-bytes are refused before they are read.)"""
    code, details = status(lambda: stub.ModelInfer(request_, timeout=30))
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), details
    assert "model 'mlp'" in details and len(details.encode()) <= 1024


def test_bool_bytes_other_than_0_and_1_are_refused(stub):
    """Were: passed to the model as torch bools holding 0x5f (undefined: in multi-process mode
    the echo model returned them changed)."""
    request = pb.ModelInferRequest(model_name="echo")
    for t in NUMERIC_TYPES:
        request.inputs.add(name=f"IN_{t}", datatype=t, shape=[1, 3])
        request.raw_input_contents.append(
            bytes([1, 0x5F, 0]) if t == "BOOL" else bytes(3 * np.dtype(NUMPY[t]).itemsize))
    code, details = status(lambda: stub.ModelInfer(request, timeout=30))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "bytes 0 and 1 only" in details
    request.raw_input_contents[0] = bytes([1, 1, 0])
    response = stub.ModelInfer(request, timeout=30)
    assert response.raw_output_contents[0] == bytes([1, 1, 0])
