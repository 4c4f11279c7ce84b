"""The SDK (`clients/`) against real grpc.aio servers that this module runs on port 0.

The fake servers answer by model name (see FakeInference) and record every request they get,
so the tests assert on what went over the wire, not on the SDK's own view of it.
"""

from __future__ import annotations

import pickle
import random
import socket
import subprocess
import sys
import textwrap
import time

import grpc
import numpy as np
import pytest

from batchgate.clients import (
    AsyncClient,
    BatchgateError,
    Client,
    InferRequest,
    InferResult,
    RetryPolicy,
)
from batchgate.protos import model_config_pb2
from tests.support.fake_server import DATATYPES, NUMPY_OF, FakeServer

FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.05, jitter=0)


def sample(dtype) -> np.ndarray:
    """A (2, 3) array holding the dtype's extremes."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return np.array([[True, False, True], [False, False, True]])
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.array([[info.min, info.max, 0], [1, info.max - 1, info.min + 1]], dtype=dtype)
    info = np.finfo(dtype)
    return np.array([[info.min, info.max, info.tiny], [-0.0, np.inf, np.nan]], dtype=dtype)


@pytest.fixture(scope="module")
def servers():
    pair = FakeServer("a"), FakeServer("b")
    yield pair
    for server in pair:
        server.stop()


@pytest.fixture(autouse=True)
def _fresh_servers(servers):
    for server in servers:
        server.servicer.reset()


@pytest.fixture
def server(servers) -> FakeServer:
    return servers[0]


@pytest.fixture
def client(server):
    with Client(server.address, timeout_s=10, retry=FAST_RETRY) as c:
        yield c


@pytest.fixture
async def aclient(server):
    async with AsyncClient(server.address, timeout_s=10, retry=FAST_RETRY) as c:
        yield c


def unused_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


# ---------------------------------------------------------------------------------------------
# Tensors


@pytest.mark.parametrize("dtype", list(DATATYPES), ids=lambda t: DATATYPES[t])
def test_every_numeric_dtype_round_trips_raw(client, server, dtype):
    array = sample(dtype)
    result = client.infer_result("echo", {"x": array})

    sent = server.servicer.requests[0]
    assert sent.inputs[0].datatype == DATATYPES[dtype]
    assert list(sent.inputs[0].shape) == [2, 3]
    assert sent.raw_input_contents[0] == array.astype(NUMPY_OF[DATATYPES[dtype]]).tobytes()
    assert not sent.inputs[0].HasField("contents")
    out = result.outputs["x"]
    assert out.dtype == np.dtype(dtype) and out.shape == (2, 3)
    np.testing.assert_array_equal(out, array)
    assert result.datatypes == {"x": DATATYPES[dtype]}


def test_bf16_travels_as_raw_bits(client, server):
    bits = np.array([[0x3F80, 0xC000], [0x7F80, 0x0001]], dtype=np.uint16)  # 1, -2, inf, tiny
    result = client.infer_result("echo", {"x": bits}, datatypes={"x": "BF16"})

    sent = server.servicer.requests[0]
    assert sent.inputs[0].datatype == "BF16"
    assert sent.raw_input_contents[0] == bits.astype("<u2").tobytes()
    assert result.datatypes["x"] == "BF16"
    assert result.outputs["x"].dtype == np.uint16
    np.testing.assert_array_equal(result.outputs["x"], bits)


def test_bf16_from_ml_dtypes(client, server):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    values = np.array([1.0, -2.5, 3.0e38], dtype=ml_dtypes.bfloat16)
    result = client.infer_result("echo", {"x": values})

    assert server.servicer.requests[0].inputs[0].datatype == "BF16"
    np.testing.assert_array_equal(result.outputs["x"], values.view(np.uint16))
    np.testing.assert_array_equal(result.outputs["x"].view(ml_dtypes.bfloat16), values)


def test_strided_big_endian_scalar_and_empty_arrays(client, server):
    strided = np.arange(12, dtype=">i4").reshape(3, 4).T  # neither contiguous nor little-endian
    inputs = {"t": strided, "s": np.float64(2.5), "e": np.zeros((0, 4), np.float32)}
    outputs = client.infer("echo", inputs)

    sent = server.servicer.requests[0]
    assert sent.raw_input_contents[0] == np.ascontiguousarray(strided, dtype="<i4").tobytes()
    assert [list(t.shape) for t in sent.inputs] == [[4, 3], [], [0, 4]]
    np.testing.assert_array_equal(outputs["t"], strided)
    assert outputs["s"].shape == () and outputs["s"] == 2.5
    assert outputs["e"].shape == (0, 4)


@pytest.mark.parametrize(
    "dtype", [np.bool_, np.int8, np.uint16, np.int32, np.int64, np.uint64, np.float32, np.float64]
)
def test_typed_contents_are_decoded(client, dtype):
    array = sample(dtype)
    outputs = client.infer("echo_typed", {"x": array})
    assert outputs["x"].dtype == np.dtype(dtype)
    np.testing.assert_array_equal(outputs["x"], array)


def test_malformed_response_is_a_batchgate_error(client):
    with pytest.raises(BatchgateError) as caught:
        client.infer("short", {"x": np.ones(4, np.float32)})
    assert caught.value.code is grpc.StatusCode.INTERNAL
    assert "needs 16 bytes, got 15" in caught.value.details


def test_bad_arguments_raise_before_sending(client, server):
    with pytest.raises(ValueError, match="got complex64"):
        client.infer("echo", {"x": np.ones(2, np.complex64)})
    with pytest.raises(ValueError, match="got BF16"):
        client.infer("echo", {"x": np.ones(2, np.float32)}, datatypes={"x": "BF16"})
    with pytest.raises(ValueError, match="got -1"):
        client.infer("echo", {"x": np.ones(2)}, priority=-1)
    with pytest.raises(ValueError, match="priority"):
        client.infer("echo", {"x": np.ones(2)}, parameters={"priority": 1})
    with pytest.raises(ValueError, match="got 0"):
        client.infer("echo", {"x": np.ones(2)}, timeout_s=0)
    # tritonclient's name for the queue timeout is not one of the request's fields.
    with pytest.raises(TypeError, match="'timeout'"):
        client.infer("echo", {"x": np.ones(2)}, timeout=1500)
    with pytest.raises(TypeError, match="'timeout'"):
        client.infer_result("echo", {"x": np.ones(2)}, timeout=1500)
    assert server.servicer.requests == []


# ---------------------------------------------------------------------------------------------
# Request fields


def test_requested_outputs_request_id_and_version(client, server):
    result = client.infer_result(
        "echo",
        {"a": np.ones(2, np.float32), "b": np.arange(3)},
        outputs=["b"],
        request_id="req-7",
        version="3",
    )
    sent = server.servicer.requests[0]
    assert [o.name for o in sent.outputs] == ["b"]
    assert (sent.id, sent.model_version) == ("req-7", "3")
    assert list(result.outputs) == ["b"]
    np.testing.assert_array_equal(result.outputs["b"], np.arange(3))
    assert (result.id, result.model_name, result.model_version) == ("req-7", "echo", "3")
    assert result.parameters == {"served_by": "a"}


def test_priority_timeout_and_parameters_encoding(client, server):
    client.infer(
        "echo",
        {"x": np.ones(1)},
        priority=2,
        timeout_us=1500,
        parameters={"flag": True, "n": -5, "ratio": 0.5, "tag": "t"},
    )
    client.infer("echo", {"x": np.ones(1)}, priority=0)

    params = server.servicer.requests[0].parameters
    kinds = {k: (v.WhichOneof("parameter_choice"), getattr(v, v.WhichOneof("parameter_choice")))
             for k, v in params.items()}
    assert kinds == {
        "priority": ("uint64_param", 2),
        "timeout": ("int64_param", 1500),
        "flag": ("bool_param", True),
        "n": ("int64_param", -5),
        "ratio": ("double_param", 0.5),
        "tag": ("string_param", "t"),
    }
    # Priority 0 means "the model's default": not sent at all, as tritonclient does.
    assert dict(server.servicer.requests[1].parameters) == {}


TRITON_CALLS = """
import sys
import numpy as np
import tritonclient.grpc as triton

client = triton.InferenceServerClient(url=sys.argv[1])
x = triton.InferInput("x", [2, 3], "FP32")
x.set_data_from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))
client.infer("echo", [x], request_id="t-1", priority=3, timeout=1500,
             outputs=[triton.InferRequestedOutput("x")])
client.infer("echo", [x], request_id="t-2")
"""


def test_requests_match_what_tritonclient_sends(client, server):
    # tritonclient's generated protos clash with ours in one process's descriptor pool, so it
    # runs in a subprocess against the same fake server, which records both clients' requests.
    subprocess.run(
        [sys.executable, "-c", textwrap.dedent(TRITON_CALLS), server.address],
        check=True,
        timeout=120,
        capture_output=True,
    )
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    client.infer("echo", {"x": x}, request_id="t-1", priority=3, timeout_us=1500, outputs=["x"])
    client.infer("echo", {"x": x}, request_id="t-2")

    triton_first, triton_second, ours_first, ours_second = server.servicer.requests
    assert ours_first.parameters["priority"].WhichOneof("parameter_choice") == "uint64_param"
    assert ours_first == triton_first
    assert ours_second == triton_second


def test_max_message_bytes_limits_what_is_sent(server):
    with Client(server.address, max_message_bytes=1024) as small:
        with pytest.raises(BatchgateError) as caught:
            small.infer("echo", {"x": np.zeros(4096, np.uint8)})
    assert caught.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED


# ---------------------------------------------------------------------------------------------
# Errors, retries, deadlines


def test_unavailable_is_retried_with_backoff_until_the_server_recovers(client, server):
    server.servicer.unavailable_left["echo"] = 2
    started = time.monotonic()
    outputs = client.infer("echo", {"x": np.ones(1)})
    elapsed = time.monotonic() - started

    assert server.servicer.attempts["echo"] == 3
    np.testing.assert_array_equal(outputs["x"], np.ones(1))
    assert elapsed >= 0.01 + 0.02  # FAST_RETRY's two waits, without jitter


def test_retries_stop_after_max_attempts(client, server):
    server.servicer.unavailable_left["echo"] = 10
    with pytest.raises(BatchgateError) as caught:
        client.infer("echo", {"x": np.ones(1)})
    assert server.servicer.attempts["echo"] == 3
    assert caught.value.code is grpc.StatusCode.UNAVAILABLE
    assert caught.value.details == "model is loading"


def test_invalid_argument_is_not_retried_and_keeps_its_code(client, server):
    with pytest.raises(BatchgateError) as caught:
        client.infer("invalid", {"x": np.ones(1)})
    error = caught.value
    assert server.servicer.attempts["invalid"] == 1
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert str(error) == "INVALID_ARGUMENT: input 'x': expected FP32"
    assert error.__context__ is None  # raised clean, not chained to grpc's RpcError
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.code, copy.details) == (error.code, error.details)


def test_non_idempotent_infer_and_model_loads_are_not_retried(client, server):
    server.servicer.unavailable_left["echo"] = 1
    with pytest.raises(BatchgateError):
        client.infer("echo", {"x": np.ones(1)}, idempotent=False)
    assert server.servicer.attempts["echo"] == 1

    with pytest.raises(BatchgateError) as caught:
        client.load_model("flaky")
    assert caught.value.code is grpc.StatusCode.UNAVAILABLE
    assert len(server.servicer.loads) == 1


def test_deadline_exceeded(client, server):
    started = time.monotonic()
    with pytest.raises(BatchgateError) as caught:
        client.infer("hang", {"x": np.ones(1)}, timeout_s=0.2)
    assert caught.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 5
    assert server.servicer.attempts["hang"] == 1


def test_a_retry_never_outlives_the_deadline(server):
    slow = RetryPolicy(max_attempts=5, initial_backoff_s=5, max_backoff_s=5, jitter=0)
    server.servicer.unavailable_left["echo"] = 10
    with Client(server.address, retry=slow) as c:
        started = time.monotonic()
        with pytest.raises(BatchgateError) as caught:
            c.infer("echo", {"x": np.ones(1)}, timeout_s=0.5)
    assert time.monotonic() - started < 2
    assert caught.value.code is grpc.StatusCode.UNAVAILABLE
    assert server.servicer.attempts["echo"] == 1


def test_calls_round_robin_over_addresses(servers):
    a, b = servers
    with Client([a.address, b.address], retry=FAST_RETRY) as c:
        served_by = [
            c.infer_result("echo", {"x": np.ones(1)}).parameters["served_by"] for _ in range(6)
        ]
        assert c.server_live()
    assert served_by == ["a", "b"] * 3
    assert a.servicer.attempts["echo"] == b.servicer.attempts["echo"] == 3


def test_unavailable_address_fails_over_to_the_next(servers):
    a, _ = servers
    with Client([unused_address(), a.address], timeout_s=10, retry=FAST_RETRY) as c:
        for _ in range(4):
            c.infer("echo", {"x": np.ones(1)})
    assert a.servicer.attempts["echo"] == 4


def test_retry_policy_validates_its_settings():
    for kwargs, message in [
        ({"max_attempts": 0}, "got 0"),
        ({"initial_backoff_s": -1}, "got -1"),
        ({"initial_backoff_s": 2, "max_backoff_s": 1}, "got 1"),
        ({"multiplier": 0.5}, "got 0.5"),
        ({"jitter": 1.5}, "got 1.5"),
        ({"retry_on": (grpc.StatusCode.OK,)}, "got"),
    ]:
        with pytest.raises(ValueError, match=message):
            RetryPolicy(**kwargs)
    with pytest.raises(TypeError, match="got"):
        RetryPolicy(retry_on=grpc.StatusCode.UNAVAILABLE)
    assert RetryPolicy(retry_on=[grpc.StatusCode.UNAVAILABLE]).retry_on == frozenset(
        {grpc.StatusCode.UNAVAILABLE}
    )


def test_backoff_grows_exponentially_within_its_bounds():
    exact = RetryPolicy(initial_backoff_s=0.05, max_backoff_s=1.0, multiplier=2.0, jitter=0)
    assert [exact.backoff_s(n) for n in range(1, 8)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    jittered = RetryPolicy(jitter=0.2)
    rng = random.Random(7)
    waits = [jittered.backoff_s(1, rng) for _ in range(200)]
    assert all(0.04 <= w <= 0.06 for w in waits)
    assert len(set(waits)) > 1


# ---------------------------------------------------------------------------------------------
# Streams


def test_stream_infer_yields_results_and_raises_in_band_errors(client):
    x = np.arange(3, dtype=np.int32)
    requests = [
        InferRequest("echo", {"x": x}, request_id="s1"),
        InferRequest("invalid", {"x": x}, request_id="s2"),
        InferRequest("echo", {"x": x + 1}, request_id="s3"),
    ]
    with client.stream_infer(requests) as stream:
        first = next(stream)
        with pytest.raises(BatchgateError) as caught:
            next(stream)
        rest = list(stream)
    assert first.id == "s1"
    np.testing.assert_array_equal(first.outputs["x"], x)
    assert caught.value.code is grpc.StatusCode.UNKNOWN
    assert caught.value.details == "request s2: bad input"
    assert [r.id for r in rest] == ["s3"]
    np.testing.assert_array_equal(rest[0].outputs["x"], x + 1)


def test_stream_infer_takes_a_generator(client, server):
    def requests():
        for i in range(5):
            yield InferRequest("echo", {"x": np.full(2, i)}, request_id=f"g{i}", priority=1)

    results = list(client.stream_infer(requests()))
    assert [r.id for r in results] == [f"g{i}" for i in range(5)]
    assert [int(r.outputs["x"][0]) for r in results] == list(range(5))
    assert all(r.parameters["priority"].uint64_param == 1 for r in server.servicer.requests)


def test_stream_failure_ends_the_stream(server):
    with Client(unused_address(), retry=FAST_RETRY) as c:
        stream = c.stream_infer([InferRequest("echo", {"x": np.ones(1)})])
        with pytest.raises(BatchgateError) as caught:
            next(stream)
        assert list(stream) == []
    assert caught.value.code is grpc.StatusCode.UNAVAILABLE


# ---------------------------------------------------------------------------------------------
# Health, metadata, repository


def test_health_metadata_and_repository_calls(client, server):
    assert client.health() == "SERVING"
    assert client.health("draining") == "NOT_SERVING"
    with pytest.raises(BatchgateError) as caught:
        client.health("no-such-service")
    assert caught.value.code is grpc.StatusCode.NOT_FOUND

    assert client.server_live() is True
    assert client.server_ready() is True
    assert client.model_ready("echo") is True
    assert client.model_ready("other") is False
    assert client.server_metadata().extensions == ["model_repository"]
    metadata = client.model_metadata("echo")
    assert (metadata.inputs[0].name, list(metadata.inputs[0].shape)) == ("x", [-1, 3])
    with pytest.raises(BatchgateError) as caught:
        client.model_metadata("missing")
    assert caught.value.code is grpc.StatusCode.NOT_FOUND
    config = client.model_config("echo")
    assert isinstance(config, model_config_pb2.ModelConfig) and config.max_batch_size == 8
    assert [s.name for s in client.model_statistics("echo")] == ["echo"]
    assert [m.name for m in client.repository_index()] == ["echo", "idle"]
    assert [m.name for m in client.repository_index(ready=True)] == ["echo"]

    client.load_model("echo", config='{"max_batch_size": 4}', files={"1/model.pt": b"\x00"})
    client.unload_model("echo")
    load = server.servicer.loads[0]
    assert load.model_name == "echo"
    assert load.parameters["config"].string_param == '{"max_batch_size": 4}'
    assert load.parameters["file:1/model.pt"].bytes_param == b"\x00"
    assert server.servicer.unloads == ["echo"]


def test_client_arguments_are_validated():
    with pytest.raises(ValueError, match="got an empty list"):
        Client([])
    with pytest.raises(ValueError, match="got -1"):
        Client("localhost:1", timeout_s=-1)
    with pytest.raises(TypeError, match="got"):
        Client("localhost:1", retry=3)
    with pytest.raises(ValueError, match="got 0"):
        AsyncClient("localhost:1", max_message_bytes=0)


# ---------------------------------------------------------------------------------------------
# AsyncClient: the same core cases


@pytest.mark.parametrize("dtype", [np.bool_, np.uint64, np.int8, np.float16, np.float64])
async def test_async_round_trip(aclient, server, dtype):
    array = sample(dtype)
    result = await aclient.infer_result("echo", {"x": array}, request_id="a1", outputs=["x"])
    assert isinstance(result, InferResult) and result.id == "a1"
    assert result.outputs["x"].dtype == np.dtype(dtype)
    np.testing.assert_array_equal(result.outputs["x"], array)
    assert server.servicer.requests[0].inputs[0].datatype == DATATYPES[dtype]


async def test_async_bf16_priority_and_timeout(aclient, server):
    bits = np.array([0x3F80, 0x4000], dtype=np.uint16)
    outputs = await aclient.infer(
        "echo", {"x": bits}, datatypes={"x": "BF16"}, priority=4, timeout_us=250
    )
    np.testing.assert_array_equal(outputs["x"], bits)
    sent = server.servicer.requests[0]
    assert sent.inputs[0].datatype == "BF16"
    assert sent.parameters["priority"].uint64_param == 4
    assert sent.parameters["timeout"].int64_param == 250


async def test_async_unknown_argument_is_refused(aclient, server):
    with pytest.raises(TypeError, match="'timeout'"):
        await aclient.infer("echo", {"x": np.ones(2)}, timeout=1500)
    assert server.servicer.requests == []


async def test_async_retry_recovers_and_stops(aclient, server):
    server.servicer.unavailable_left["echo"] = 2
    await aclient.infer("echo", {"x": np.ones(1)})
    assert server.servicer.attempts["echo"] == 3

    server.servicer.unavailable_left["echo"] = 10
    with pytest.raises(BatchgateError) as caught:
        await aclient.infer("echo", {"x": np.ones(1)})
    assert caught.value.code is grpc.StatusCode.UNAVAILABLE
    assert server.servicer.attempts["echo"] == 6


async def test_async_invalid_argument_is_not_retried(aclient, server):
    with pytest.raises(BatchgateError) as caught:
        await aclient.infer("invalid", {"x": np.ones(1)})
    assert caught.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert server.servicer.attempts["invalid"] == 1


async def test_async_deadline_exceeded(aclient):
    with pytest.raises(BatchgateError) as caught:
        await aclient.infer("hang", {"x": np.ones(1)}, timeout_s=0.2)
    assert caught.value.code is grpc.StatusCode.DEADLINE_EXCEEDED


async def test_async_round_robin_and_failover(servers):
    a, b = servers
    async with AsyncClient([a.address, b.address], retry=FAST_RETRY) as c:
        for _ in range(4):
            await c.infer("echo", {"x": np.ones(1)})
    assert a.servicer.attempts["echo"] == b.servicer.attempts["echo"] == 2

    async with AsyncClient([unused_address(), a.address], timeout_s=10, retry=FAST_RETRY) as c:
        for _ in range(2):
            await c.infer("echo", {"x": np.ones(1)})
    assert a.servicer.attempts["echo"] == 4


async def test_async_stream_infer(aclient):
    async def requests():
        for i, model in enumerate(["echo", "invalid", "echo"]):
            yield InferRequest(model, {"x": np.full(2, i, np.float32)}, request_id=f"s{i}")

    ids, errors = [], []
    async with aclient.stream_infer(requests()) as stream:
        while True:
            try:
                result = await anext(stream)
            except StopAsyncIteration:
                break
            except BatchgateError as error:
                errors.append(error.details)
            else:
                ids.append(result.id)
    assert ids == ["s0", "s2"]
    assert errors == ["request s1: bad input"]

    listed = [r.id async for r in aclient.stream_infer([InferRequest("echo", {"x": np.ones(1)})])]
    assert listed == [""]


async def test_async_health_and_metadata(aclient):
    assert await aclient.health() == "SERVING"
    assert await aclient.health("draining") == "NOT_SERVING"
    assert await aclient.server_live() and await aclient.server_ready()
    assert await aclient.model_ready("echo")
    assert (await aclient.model_config("echo")).max_batch_size == 8
    assert [m.name for m in await aclient.repository_index(ready=True)] == ["echo"]
    with pytest.raises(BatchgateError) as caught:
        await aclient.load_model("flaky")
    assert caught.value.code is grpc.StatusCode.UNAVAILABLE
