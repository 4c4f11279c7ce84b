"""The gRPC server end to end, over real gRPC on loopback, with our own generated stubs.

Every status code of docs/operations.md's status-code table is produced by a request that sends
the bad thing; a bad request sent beside good ones leaves the good ones answered correctly.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from batchgate.protos import inference_pb2 as pb
from batchgate.protos import inference_pb2_grpc
from batchgate.bench.harness.metrics import scrape as scrape_url
from tests.support.messages import infer_request, output
from tests.support.models import NUMERIC_TYPES, reference
from tests.support.polling import poll

BF16 = "BF16"


def mlp_reference(server, x: np.ndarray) -> np.ndarray:
    return reference("mlp", x)


def scrape(server) -> dict:
    return scrape_url(server.metrics_url)


def metric(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


# -- health, metadata, configuration ---------------------------------------------------------

def test_live_ready_and_metadata(stub):
    assert stub.ServerLive(pb.ServerLiveRequest()).live
    assert stub.ServerReady(pb.ServerReadyRequest()).ready
    meta = stub.ServerMetadata(pb.ServerMetadataRequest())
    assert meta.name == "batchgate" and "model_repository" in meta.extensions
    assert stub.ModelReady(pb.ModelReadyRequest(name="mlp")).ready
    assert not stub.ModelReady(pb.ModelReadyRequest(name="nope")).ready
    mm = stub.ModelMetadata(pb.ModelMetadataRequest(name="mlp"))
    assert mm.versions == ["1"]
    assert [(t.name, t.datatype, list(t.shape)) for t in mm.inputs] == [("INPUT__0", "FP32", [-1, 512])]


def test_model_config_reports_batching(stub):
    config = stub.ModelConfig(pb.ModelConfigRequest(name="mlp")).config
    assert config.name == "mlp" and config.max_batch_size == 64
    assert config.input[0].name == "INPUT__0" and list(config.input[0].dims) == [512]
    assert config.HasField("dynamic_batching")


def test_health_service_per_model_and_reflection(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "inference.GRPCInferenceService", "mlp", "cnn", "encoder"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
        assert status == health_pb2.HealthCheckResponse.SERVING, service
    with pytest.raises(grpc.RpcError) as err:
        health.Check(health_pb2.HealthCheckRequest(service="no-such-model"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    watch = health.Watch(health_pb2.HealthCheckRequest(service="mlp"), timeout=10)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()

    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for s in next(answers).list_services_response.service}
    assert {"inference.GRPCInferenceService", "grpc.health.v1.Health"} <= names


def test_repository_index(stub):
    index = stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=True))
    names = {m.name for m in index.models}
    assert {"mlp", "cnn", "encoder"} <= names
    assert all(m.state == "READY" for m in index.models)


# -- inference ---------------------------------------------------------------------------------

def test_mlp_raw_and_typed_contents_agree(server, stub):
    x = np.random.default_rng(0).standard_normal((2, 512), dtype=np.float32)
    raw = stub.ModelInfer(infer_request("mlp", {"INPUT__0": x}, id="req-7"))
    assert raw.id == "req-7" and raw.model_name == "mlp" and raw.model_version == "1"
    typed_req = pb.ModelInferRequest(model_name="mlp")
    tensor = typed_req.inputs.add(name="INPUT__0", datatype="FP32", shape=[2, 512])
    tensor.contents.fp32_contents.extend(x.reshape(-1).tolist())
    typed = stub.ModelInfer(typed_req)
    expected = mlp_reference(server, x)
    np.testing.assert_allclose(output(raw, "OUTPUT__0"), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(output(raw, "OUTPUT__0"), output(typed, "OUTPUT__0"))


def test_every_numeric_datatype_round_trips(stub):
    rng = np.random.default_rng(1)
    req = pb.ModelInferRequest(model_name="echo")
    sent = {}
    for dt in NUMERIC_TYPES:
        if dt == "BOOL":
            a = rng.integers(0, 2, (2, 3)).astype(np.bool_)
        elif dt == BF16:
            a = torch.randn(2, 3).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        elif dt.startswith("FP"):
            a = rng.standard_normal((2, 3)).astype({"FP16": np.float16, "FP32": np.float32, "FP64": np.float64}[dt])
        else:
            info = np.iinfo(np.dtype(dt.lower()))
            a = rng.integers(info.min, info.max, (2, 3), dtype=np.dtype(dt.lower()), endpoint=True)
        sent[dt] = a
        req.inputs.add(name=f"IN_{dt}", datatype=dt, shape=a.shape)
        req.raw_input_contents.append(a.tobytes())
    response = stub.ModelInfer(req)
    for tensor, raw in zip(response.outputs, response.raw_output_contents):
        dt = tensor.datatype
        assert tensor.name == f"OUT_{dt}"
        assert raw == sent[dt].tobytes(), dt


def test_requested_subset_of_outputs(stub):
    req = pb.ModelInferRequest(model_name="echo")
    for dt in NUMERIC_TYPES:
        a = np.ones((1, 3), dtype=np.uint16 if dt == BF16 else np.dtype(
            {"BOOL": "bool", "FP16": "float16", "FP32": "float32", "FP64": "float64"}.get(dt, dt.lower())))
        req.inputs.add(name=f"IN_{dt}", datatype=dt, shape=a.shape)
        req.raw_input_contents.append(a.tobytes())
    req.outputs.add(name="OUT_INT8")
    req.outputs.add(name="OUT_FP16")
    response = stub.ModelInfer(req)
    assert [t.name for t in response.outputs] == ["OUT_INT8", "OUT_FP16"]
    assert len(response.raw_output_contents) == 2


def test_stream_answers_each_request_and_keeps_going_after_an_error(server, stub):
    x = np.random.default_rng(2).standard_normal((1, 512), dtype=np.float32)
    requests = [
        infer_request("mlp", {"INPUT__0": x}, id="a"),
        infer_request("mlp", {"WRONG": x}, id="b"),
        infer_request("mlp", {"INPUT__0": x}, id="c"),
    ]
    answers = list(stub.ModelStreamInfer(iter(requests), timeout=30))
    assert len(answers) == 3
    errors = [a.error_message for a in answers if a.error_message]
    ok = {a.infer_response.id: a.infer_response for a in answers if not a.error_message}
    assert len(errors) == 1 and "has no input 'WRONG'" in errors[0]
    assert set(ok) == {"a", "c"}
    np.testing.assert_allclose(output(ok["c"], "OUTPUT__0"), mlp_reference(server, x), rtol=1e-5, atol=1e-5)


async def test_concurrent_clients_are_batched_and_answers_match(server):
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal((1, 512), dtype=np.float32) for _ in range(32 * 6)]
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)

        async def stats():
            response = await stub.ModelStatistics(pb.ModelStatisticsRequest(name="mlp"))
            return response.model_stats[0]

        before = await stats()
        results: list = [None] * len(inputs)

        async def client(k: int) -> None:
            for i in range(k, len(inputs), 32):
                results[i] = await stub.ModelInfer(infer_request("mlp", {"INPUT__0": inputs[i]}))

        await asyncio.gather(*(client(k) for k in range(32)))
        after = await stats()
    samples = after.inference_count - before.inference_count
    batches = after.execution_count - before.execution_count
    assert samples == len(inputs)
    # Batching happened (a loaded machine lowers the mean; one request per batch would be 1).
    assert samples / batches > 2, f"mean batch size {samples / batches:.2f}"
    # Each answer equals the model's own output on that request alone.
    for x, response in zip(inputs, results):
        np.testing.assert_allclose(output(response, "OUTPUT__0"), mlp_reference(server, x),
                                   rtol=1e-4, atol=1e-5)


# -- status codes ------------------------------------------------------------------------------

def expect(stub_call, code: grpc.StatusCode, text: str):
    with pytest.raises(grpc.RpcError) as err:
        stub_call()
    assert err.value.code() == code, err.value.details()
    assert text in err.value.details(), err.value.details()
    return err.value


def test_not_found(stub):
    x = np.zeros((1, 512), np.float32)
    expect(lambda: stub.ModelInfer(infer_request("nope", {"INPUT__0": x})),
           grpc.StatusCode.NOT_FOUND, "nope")
    expect(lambda: stub.ModelInfer(infer_request("mlp", {"INPUT__0": x}, model_version="7")),
           grpc.StatusCode.NOT_FOUND, "7")
    expect(lambda: stub.ModelMetadata(pb.ModelMetadataRequest(name="nope")),
           grpc.StatusCode.NOT_FOUND, "nope")


@pytest.mark.parametrize("mutate, text", [
    (lambda r: setattr(r.inputs[0], "name", "WRONG"), "has no input 'WRONG'"),
    (lambda r: setattr(r.inputs[0], "datatype", "FP64"), "must be FP32, got 'FP64'"),
    (lambda r: setattr(r.inputs[0], "datatype", "BYTES"), "BYTES tensors are accepted only"),
    (lambda r: r.inputs[0].shape.__setitem__(1, 511), "must have shape [batch, 512]"),
    (lambda r: r.inputs[0].shape.__setitem__(0, -2), "negative dimension"),
    (lambda r: r.raw_input_contents.__setitem__(0, b"\0" * 10), "needs 2048 bytes, got 10"),
    (lambda r: r.inputs.add().CopyFrom(r.inputs[0]), "raw_input_contents for 2 inputs"),
    (lambda r: r.outputs.add(name="NOPE"), "has no output 'NOPE'"),
    (lambda r: r.parameters["priority"].CopyFrom(pb.InferParameter(string_param="high")),
     "'priority' must be an integer"),
])
def test_invalid_argument(stub, mutate, text):
    req = infer_request("mlp", {"INPUT__0": np.zeros((1, 512), np.float32)})
    mutate(req)
    expect(lambda: stub.ModelInfer(req), grpc.StatusCode.INVALID_ARGUMENT, text)


def test_batch_over_max_is_invalid(stub):
    x = np.zeros((65, 512), np.float32)
    expect(lambda: stub.ModelInfer(infer_request("mlp", {"INPUT__0": x})),
           grpc.StatusCode.INVALID_ARGUMENT, "batch size must lie in 1..64")


def test_missing_input_is_invalid(stub):
    expect(lambda: stub.ModelInfer(pb.ModelInferRequest(model_name="mlp")),
           grpc.StatusCode.INVALID_ARGUMENT, "missing inputs ['INPUT__0']")


def test_model_error_is_internal_without_details(stub):
    x = np.full((1, 2), 13, np.float32)
    err = expect(lambda: stub.ModelInfer(infer_request("failing", {"INPUT__0": x})),
                 grpc.StatusCode.INTERNAL, "model 'failing' raised ValueError")
    assert "secret" not in err.details()


def test_wrong_batch_dimension_is_internal(stub):
    x = np.zeros((3, 2), np.float32)
    expect(lambda: stub.ModelInfer(infer_request("wrongbatch", {"INPUT__0": x})),
           grpc.StatusCode.INTERNAL, "the batch dimension must be kept")


def test_shared_memory_rpcs_are_unimplemented(stub):
    expect(lambda: stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest()),
           grpc.StatusCode.UNIMPLEMENTED, "shared-memory")
    expect(lambda: stub.CudaSharedMemoryRegister(pb.CudaSharedMemoryRegisterRequest(name="x")),
           grpc.StatusCode.UNIMPLEMENTED, "shared-memory")


def test_message_too_large_is_resource_exhausted(server):
    big = np.zeros((64, 512), np.float32)
    with grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", -1)]) as ch:
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(ch)
        req = infer_request("mlp", {"INPUT__0": big})
        req.parameters["padding"].string_param = "x" * (64 * 1024 * 1024 + 1)  # the default limit
        expect(lambda: stub.ModelInfer(req), grpc.StatusCode.RESOURCE_EXHAUSTED, "")


def test_bad_requests_beside_good_ones_leave_them_correct(server):
    rng = np.random.default_rng(4)
    good = [rng.standard_normal((1, 512), dtype=np.float32) for _ in range(24)]

    async def run():
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
            calls = []
            for i, x in enumerate(good):
                calls.append(stub.ModelInfer(infer_request("mlp", {"INPUT__0": x})))
                bad = infer_request("mlp", {"INPUT__0": x[:, :100]})
                calls.append(stub.ModelInfer(bad))
            return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(run())
    for i, x in enumerate(good):
        ok, bad = results[2 * i], results[2 * i + 1]
        assert isinstance(bad, grpc.aio.AioRpcError) and bad.code() == grpc.StatusCode.INVALID_ARGUMENT
        np.testing.assert_allclose(output(ok, "OUTPUT__0"), mlp_reference(server, x), rtol=1e-4, atol=1e-5)


# -- queueing through the server: priority, timeout, deadline, cancellation, queue full ---------

class Held:
    """Holds the gated model's executor so requests pile up in its queue."""

    def __init__(self, server, stub):
        self.server, self.stub, self.gate = server, stub, server.gate

    def __enter__(self):
        self.gate.close()
        self.blocker = self.stub.ModelInfer.future(
            infer_request("gated", {"INPUT__0": np.full((1, 2), -1, np.float32)},
                          parameters={"priority": pb.InferParameter(uint64_param=1)}))
        self.gate.wait_entered()
        return self

    def wait_depth(self, depth: int, timeout_s: float = 30) -> None:
        poll(lambda: self.server.queue_depth("gated") == depth, timeout_s,
             f"queue depth of gated never became {depth}")

    def seen(self) -> list[float]:
        return self.gate.seen()

    def __exit__(self, *exc):
        self.gate.open()
        self.blocker.result(30)


def gated(value: float, **params) -> pb.ModelInferRequest:
    parameters = {k: pb.InferParameter(uint64_param=v) for k, v in params.items()}
    return infer_request("gated", {"INPUT__0": np.full((1, 2), value, np.float32)}, parameters=parameters)


def test_priority_high_runs_before_earlier_low(server, stub):
    with Held(server, stub) as held:
        # One at a time: concurrent calls may reach the queue in either order.
        low, high = [], []
        for i in range(3):
            low.append(stub.ModelInfer.future(gated(10 + i, priority=2)))
            held.wait_depth(i + 1)
        for i in range(3):
            high.append(stub.ModelInfer.future(gated(20 + i, priority=1)))
            held.wait_depth(4 + i)
    for f in low + high:
        f.result(10)
    # After the blocker, the high-priority rows run first, each level in arrival order.
    seen = held.seen()[1:]
    assert seen.index(20.0) < seen.index(10.0)
    assert [v for v in seen if v >= 20] == [20.0, 21.0, 22.0]
    assert [v for v in seen if 10 <= v < 20] == [10.0, 11.0, 12.0]


def test_timeout_parameter_expires_request_in_queue(server, stub):
    with Held(server, stub) as held:
        expect(lambda: stub.ModelInfer(gated(5, timeout=20_000)),
                     grpc.StatusCode.DEADLINE_EXCEEDED, "expired")
        held.wait_depth(0)
    assert 5.0 not in held.seen()


def test_grpc_deadline_expires_request_in_queue(server, stub):
    with Held(server, stub) as held:
        expect(lambda: stub.ModelInfer(gated(6), timeout=0.05),
               grpc.StatusCode.DEADLINE_EXCEEDED, "")
        held.wait_depth(0)
    assert 6.0 not in held.seen()


def test_cancellation_removes_request_from_queue(server, stub):
    with Held(server, stub) as held:
        future = stub.ModelInfer.future(gated(7))
        held.wait_depth(1)
        future.cancel()
        held.wait_depth(0)
    assert 7.0 not in held.seen()
    samples = scrape(server)
    assert metric(samples, "batchgate_queue_depth", model="gated") == 0
    assert metric(samples, "batchgate_request_failures_total", model="gated", reason="cancelled") >= 1


def test_queue_full_is_resource_exhausted(server, stub):
    with Held(server, stub) as held:
        queued = [stub.ModelInfer.future(gated(30)) for _ in range(16)]
        held.wait_depth(16)
        expect(lambda: stub.ModelInfer(gated(31)), grpc.StatusCode.RESOURCE_EXHAUSTED,
               "max_queue_size 16")
        samples = scrape(server)
        assert metric(samples, "batchgate_queue_depth", model="gated") == 16
        assert metric(samples, "batchgate_inflight_batches", model="gated") == 1
        assert metric(samples, "batchgate_requests_total", model="gated",
                      status="RESOURCE_EXHAUSTED") >= 1
    for f in queued:
        f.result(10)
    samples = scrape(server)
    assert metric(samples, "batchgate_queue_depth", model="gated") == 0
    assert metric(samples, "batchgate_inflight_batches", model="gated") == 0


def test_priority_out_of_range_is_invalid(stub):
    expect(lambda: stub.ModelInfer(gated(1, priority=3)), grpc.StatusCode.INVALID_ARGUMENT,
           "priority must lie in 1..2")


# -- statistics and metrics ------------------------------------------------------------------

def test_statistics_and_metrics_count_real_work(server, stub):
    x = np.zeros((3, 512), np.float32)
    before = stub.ModelStatistics(pb.ModelStatisticsRequest(name="mlp")).model_stats[0]
    for _ in range(4):
        stub.ModelInfer(infer_request("mlp", {"INPUT__0": x}))
    stats = stub.ModelStatistics(pb.ModelStatisticsRequest(name="mlp")).model_stats[0]
    assert stats.inference_count - before.inference_count == 12
    assert stats.inference_stats.success.count - before.inference_stats.success.count == 4
    assert stats.inference_stats.compute_infer.ns > before.inference_stats.compute_infer.ns
    assert stats.last_inference > 0
    assert any(b.batch_size == 3 for b in stats.batch_stats)

    samples = scrape(server)
    assert metric(samples, "batchgate_requests_total", model="mlp", status="OK") >= 4
    assert metric(samples, "batchgate_batch_size_count", model="mlp") >= 4
    assert metric(samples, "batchgate_queue_seconds_count", model="mlp") >= 4
    assert metric(samples, "batchgate_request_seconds_count", model="mlp") >= 4
    reasons = sum(metric(samples, "batchgate_batches_total", model="mlp", reason=r)
                  for r in ("full", "preferred", "delay", "idle"))
    assert reasons == metric(samples, "batchgate_batch_size_count", model="mlp")
    assert metric(samples, "batchgate_requests_total", model="nope", status="NOT_FOUND") >= 0


def test_bytes_input_reaches_a_model_that_declares_it(stub):
    import struct

    words = [b"a", "héllo".encode(), b""]
    req = pb.ModelInferRequest(model_name="strlen")
    req.inputs.add(name="TEXT", datatype="BYTES", shape=[3, 1])
    req.raw_input_contents.append(b"".join(struct.pack("<I", len(w)) + w for w in words))
    raw = stub.ModelInfer(req)
    np.testing.assert_array_equal(output(raw, "LENGTH", np.int64).ravel(), [1, 6, 0])

    typed = pb.ModelInferRequest(model_name="strlen")
    tensor = typed.inputs.add(name="TEXT", datatype="BYTES", shape=[3, 1])
    tensor.contents.bytes_contents.extend(words)
    np.testing.assert_array_equal(output(stub.ModelInfer(typed), "LENGTH", np.int64).ravel(), [1, 6, 0])

    bad = pb.ModelInferRequest(model_name="strlen")
    bad.inputs.add(name="TEXT", datatype="BYTES", shape=[2, 1])
    bad.raw_input_contents.append(struct.pack("<I", 10) + b"abc")
    expect(lambda: stub.ModelInfer(bad), grpc.StatusCode.INVALID_ARGUMENT, "must hold 2 elements")


def test_known_model_names_share_the_unknown_label_past_the_bound(server, stub, monkeypatch):
    if server.mode != "single":
        pytest.skip("the bound is patched in this process: only the single-process server runs here")
    import batchgate.server.frontend.service as service_module
    from batchgate.server.metrics import UNKNOWN_MODEL_LABEL

    counters = server.gateway.service._status_counters
    monkeypatch.setattr(service_module, "MAX_LABELLED_COUNTERS", len(counters))
    # A model the repository serves whose NOT_FOUND pair no earlier test made (a model an earlier
    # test unloaded answers UNAVAILABLE, not NOT_FOUND).
    names = server.gateway.repository.ready_models()
    name = next(n for n in names if (n, grpc.StatusCode.NOT_FOUND) not in counters)
    unknown_before = server.metric("batchgate_requests_total", model=UNKNOWN_MODEL_LABEL,
                                   status="NOT_FOUND") or 0
    # A version it does not serve: NOT_FOUND for a model the repository knows, a new pair.
    request = pb.ModelInferRequest(model_name=name, model_version="999")
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert (name, grpc.StatusCode.NOT_FOUND) not in counters
    assert server.metric("batchgate_requests_total", model=UNKNOWN_MODEL_LABEL,
                         status="NOT_FOUND") == unknown_before + 1
    assert not server.metric("batchgate_requests_total", model=name, status="NOT_FOUND")
