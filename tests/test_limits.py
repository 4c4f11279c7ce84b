"""Request limits: message size, request bytes, elements per tensor, batch size, and shapes
that would overflow, each refused with a status whose message names the limit.

The codec is tested directly (a shape of ``[2**40, 2**40]`` must be refused without allocating
anything: tracemalloc sees every numpy allocation), then a server with small limits in both
modes, where in multi-process mode the front end is the one that refuses.
"""

from __future__ import annotations

import subprocess
import sys
import tracemalloc
from pathlib import Path

import grpc
import numpy as np
import pytest

from batchgate.batcher.errors import InvalidRequest, ResourceExhausted
from batchgate.batcher.spec import BatchingConfig, ModelSpec, TensorSpec
from batchgate.protos import inference_pb2 as pb
from batchgate.protos import inference_pb2_grpc
from batchgate.server.frontend.codec import RequestLimits, decode_request, encode_outputs
from batchgate.server.frontend.errors import MAX_MESSAGE_BYTES, status_of
from batchgate.bench.harness.repository import model_config, tensor, write_model
from tests.support.servers import SERVER_MODES, start_multiprocess_server, start_server

ROOT = Path(__file__).resolve().parent.parent
MAX_ELEMENTS = 1000
MAX_REQUEST_BYTES = 6000
MAX_MESSAGE = 64 * 1024

PAIR_CONFIG = model_config(
    "pair", max_batch_size=4, input=[tensor("A", "FP32", [-1]), tensor("B", "FP32", [-1])],
    output=[tensor("A2", "FP32", [-1]), tensor("B2", "FP32", [-1])],
    dynamic_batching={"max_queue_delay_microseconds": 0}, parameters={"warmup": "false"})
PAIR_MODEL = """
import torch


class Pair(torch.nn.Module):
    def forward(self, a, b):
        return a * 2, b * 2


def build_model(parameters):
    return Pair()
"""
PAIR_SPEC = ModelSpec(
    name="pair", version="1", platform="pytorch_libtorch",
    inputs=(TensorSpec("A", "FP32", (-1,)), TensorSpec("B", "FP32", (-1,))),
    outputs=(TensorSpec("A2", "FP32", (-1,)), TensorSpec("B2", "FP32", (-1,))),
    batching=BatchingConfig(max_batch_size=4),
)
LIMITS = RequestLimits(max_request_bytes=MAX_REQUEST_BYTES, max_tensor_elements=MAX_ELEMENTS)


def pair_request(a_shape, b_shape=(1, 1), *, a=None, b=None) -> pb.ModelInferRequest:
    """A request to ``pair``; raw contents of the size the shape says unless given."""
    request = pb.ModelInferRequest(model_name="pair")
    for name, shape, data in (("A", a_shape, a), ("B", b_shape, b)):
        request.inputs.add(name=name, datatype="FP32", shape=shape)
        if data is None:
            data = np.ones(shape, np.float32).tobytes()
        request.raw_input_contents.append(data)
    return request


# -- the codec -------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [[2**40, 2**40], [1, 2**62], [1, 2**63 - 1], [4, 2**40]])
def test_huge_dimensions_are_refused_before_anything_is_allocated(shape):
    request = pair_request(shape, a=b"")
    tracemalloc.start()
    try:
        with pytest.raises(ResourceExhausted, match=f"--max-tensor-elements {MAX_ELEMENTS}"):
            decode_request(request, PAIR_SPEC, limits=LIMITS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"decoding a refused shape allocated {peak} bytes"


def test_a_zero_dimension_does_not_hide_a_huge_one():
    # numpy refuses such a shape (ValueError: INTERNAL) even with no elements in it.
    with pytest.raises(ResourceExhausted, match="--max-tensor-elements"):
        decode_request(pair_request([1, 2**62], a=b""), PAIR_SPEC, limits=LIMITS)
    spec = ModelSpec(name="m", version="1", platform="p",
                     inputs=(TensorSpec("A", "FP32", (-1, -1)),),
                     outputs=(TensorSpec("A2", "FP32", (-1,)),),
                     batching=BatchingConfig(max_batch_size=4))
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="A", datatype="FP32", shape=[1, 2**62, 0])
    request.raw_input_contents.append(b"")
    with pytest.raises(ResourceExhausted, match="--max-tensor-elements"):
        decode_request(request, spec, limits=LIMITS)
    request.inputs[0].shape[:] = [1, 5, 0]
    assert decode_request(request, spec, limits=LIMITS).inputs[0].shape == (1, 5, 0)


def test_the_limits_are_inclusive():
    decoded = decode_request(
        pair_request([1, MAX_ELEMENTS], [1, MAX_REQUEST_BYTES // 4 - MAX_ELEMENTS]),
        PAIR_SPEC, limits=LIMITS)
    assert [a.shape for a in decoded.inputs] == [(1, 1000), (1, 500)]
    with pytest.raises(ResourceExhausted, match=f"--max-request-bytes {MAX_REQUEST_BYTES}"):
        decode_request(pair_request([1, MAX_ELEMENTS], [1, 501]), PAIR_SPEC, limits=LIMITS)
    with pytest.raises(ResourceExhausted, match=f"--max-tensor-elements {MAX_ELEMENTS}"):
        decode_request(pair_request([1, MAX_ELEMENTS + 1]), PAIR_SPEC, limits=LIMITS)


def test_typed_contents_count_against_the_limits():
    request = pb.ModelInferRequest(model_name="pair")
    for name, n in (("A", 1000), ("B", 600)):
        tensor = request.inputs.add(name=name, datatype="FP32", shape=[1, n])
        tensor.contents.fp32_contents.extend([1.0] * n)
    with pytest.raises(ResourceExhausted, match="--max-request-bytes"):
        decode_request(request, PAIR_SPEC, limits=LIMITS)


def test_a_shape_of_many_dimensions_costs_nothing_and_is_quoted_short():
    request = pair_request([1] * 100_000, a=b"")
    with pytest.raises(InvalidRequest) as err:
        decode_request(request, PAIR_SPEC, limits=LIMITS)
    message = str(err.value)
    assert "must have shape [batch, -1]" in message and "(100000 dimensions)" in message
    assert len(message) < 300


def test_negative_dimensions_and_batch_over_the_model_maximum():
    with pytest.raises(InvalidRequest, match="negative dimension"):
        decode_request(pair_request([1, -(2**63)], a=b""), PAIR_SPEC, limits=LIMITS)
    with pytest.raises(InvalidRequest, match=r"1\.\.4 \(the model's max_batch_size\), got 5"):
        decode_request(pair_request([5, 1], [5, 1]), PAIR_SPEC, limits=LIMITS)


def test_an_output_asked_for_twice_is_refused():
    request = pair_request([1, 2])
    for name in ("A2", "B2", "A2"):
        request.outputs.add(name=name)
    with pytest.raises(InvalidRequest, match="^model 'pair': output 'A2' is requested twice$"):
        decode_request(request, PAIR_SPEC, limits=LIMITS)
    del request.outputs[2]
    assert decode_request(request, PAIR_SPEC, limits=LIMITS).requested_outputs == ("A2", "B2")


def test_a_reply_is_sized_before_its_bytes_are_copied():
    outputs = {"A2": np.ones((1, 1 << 18), np.float32), "B2": np.ones((1, 10), np.float32)}
    whole = encode_outputs(pb.ModelInferResponse(model_name="pair", id="x"), PAIR_SPEC, outputs,
                           None)
    size = whole.ByteSize()
    streamed = pb.ModelStreamInferResponse(infer_response=whole).ByteSize()
    assert encode_outputs(pb.ModelInferResponse(model_name="pair", id="x"), PAIR_SPEC, outputs,
                          None, max_reply_bytes=size) == whole
    tracemalloc.start()
    try:
        with pytest.raises(ResourceExhausted) as refused:
            encode_outputs(pb.ModelInferResponse(model_name="pair", id="x"), PAIR_SPEC,
                           outputs, None, max_reply_bytes=size - 1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert str(refused.value) == (f"model 'pair': the reply would take {size} bytes, more than "
                                  f"this server sends (--max-message-bytes {size - 1})")
    assert peak < 1 << 16, f"a refused reply of 1 MiB allocated {peak} bytes"
    with pytest.raises(ResourceExhausted, match=f"would take {streamed} bytes"):
        encode_outputs(pb.ModelInferResponse(model_name="pair", id="x"), PAIR_SPEC, outputs,
                       None, max_reply_bytes=size, stream=True)


def test_status_messages_are_cut_to_what_clients_accept():
    code, message = status_of(InvalidRequest("unknown model '" + "é" * 100_000 + "'"))
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert len(message.encode()) <= MAX_MESSAGE_BYTES and message.endswith("(message cut)")
    assert status_of(InvalidRequest("short"))[1] == "short"


def test_limit_settings_are_checked():
    for flag in ("--max-tensor-elements", "--max-request-bytes"):
        done = subprocess.run([sys.executable, "-m", "batchgate.server.cli", "serve", flag, "0"],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "got 0" in done.stderr, done.stderr


# -- a server with small limits, in every mode ------------------------------------------------


@pytest.fixture(scope="module", params=SERVER_MODES)
def limited(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("limited")
    write_model(root, PAIR_CONFIG, PAIR_MODEL)
    if request.param == "single":
        running = start_server(root, max_tensor_elements=MAX_ELEMENTS,
                               max_request_bytes=MAX_REQUEST_BYTES, max_message_bytes=MAX_MESSAGE)
    else:
        running = start_multiprocess_server(root, extra_args=(
            "--max-tensor-elements", str(MAX_ELEMENTS),
            "--max-request-bytes", str(MAX_REQUEST_BYTES),
            "--max-message-bytes", str(MAX_MESSAGE)))
    yield running
    running.stop()


@pytest.fixture
def stub(limited):
    with grpc.insecure_channel(limited.address) as channel:
        yield inference_pb2_grpc.GRPCInferenceServiceStub(channel)


def refused(stub, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(request, timeout=30)
    return err.value


def answered_correctly(stub) -> None:
    a = np.arange(MAX_ELEMENTS, dtype=np.float32).reshape(1, -1)
    response = stub.ModelInfer(pair_request(a.shape, (1, 1), a=a.tobytes()), timeout=30)
    out = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(a.shape)
    np.testing.assert_array_equal(out, a * 2)


def test_requests_within_the_limits_are_answered(stub):
    answered_correctly(stub)
    response = stub.ModelInfer(pair_request([2, 0], [2, 3]), timeout=30)
    assert [list(t.shape) for t in response.outputs] == [[2, 0], [2, 3]]


@pytest.mark.parametrize("request_, code, names", [
    (pair_request([1, MAX_ELEMENTS + 1]), "RESOURCE_EXHAUSTED", "--max-tensor-elements 1000"),
    (pair_request([1, 1000], [1, 600]), "RESOURCE_EXHAUSTED", "--max-request-bytes 6000"),
    (pair_request([2**40, 2**40], a=b""), "RESOURCE_EXHAUSTED", "--max-tensor-elements 1000"),
    (pair_request([1, 2**62], a=b""), "RESOURCE_EXHAUSTED", "--max-tensor-elements 1000"),
    (pair_request([1, -1], a=b""), "INVALID_ARGUMENT", "negative dimension"),
    (pair_request([5, 1], [5, 1]), "INVALID_ARGUMENT", "max_batch_size"),
    (pair_request([1] * 30, a=b""), "INVALID_ARGUMENT", "must have shape [batch, -1]"),
    (pair_request([1] * 30_000, a=b""), "RESOURCE_EXHAUSTED", "--max-tensor-dimensions 32"),
], ids=["elements", "request-bytes", "2**40x2**40", "2**62", "negative", "batch", "rank",
        "dimensions"])
def test_each_limit_is_refused_by_name(stub, request_, code, names):
    error = refused(stub, request_)
    assert error.code().name == code
    assert names in error.details()
    answered_correctly(stub)


def test_message_over_max_message_bytes(stub):
    big = np.ones((1, MAX_MESSAGE // 4 + 1), np.float32)
    error = refused(stub, pair_request(big.shape, a=big.tobytes()))
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(MAX_MESSAGE) in error.details()
    answered_correctly(stub)


def test_a_refusal_in_a_stream_keeps_the_stream(stub):
    good = pair_request([1, 3])
    responses = list(stub.ModelStreamInfer(
        iter([pair_request([1, MAX_ELEMENTS + 1]), good]), timeout=30))
    errors = [r.error_message for r in responses if r.error_message]
    assert len(responses) == 2 and len(errors) == 1
    assert "--max-tensor-elements 1000" in errors[0]
