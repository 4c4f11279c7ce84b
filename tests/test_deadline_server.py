"""Admission control and the deadline policy through a real server, in both modes.

Two slow test models (each batch takes at least BATCH_S, and waits while its gate is closed)
are written into the session's repository and loaded at run time: ``slow_fifo`` (the default
policy) and ``slow_deadline`` (``batch_policy: deadline``). Their warm-up measures BATCH_S into
the latency profile, so the refusals below follow from the configuration, not from timing:

- a request whose deadline is shorter than one batch cannot be served: DEADLINE_EXCEEDED at
  once (infeasible), and the model never sees it;
- a request queued behind more batches than its deadline can wait for: RESOURCE_EXHAUSTED at
  once (admission), and the queued requests are still answered correctly.

Each refusal is counted under its reason in ``/metrics`` (parsed with prometheus_client).
"""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest

from batchgate.clients import BatchgateError, Client, RetryPolicy
from batchgate.protos import inference_pb2 as pb
from batchgate.protos import inference_pb2_grpc
from batchgate.protos.model_config_pb2 import ModelConfig
from batchgate.bench.harness.repository import write_model
from tests.support.messages import infer_request, output
from tests.support.models import Gate, xy_config
from tests.support.polling import poll

BATCH_S = 0.1



def slow_config(name: str, policy: str, gate_dir: Path) -> ModelConfig:
    """One request per batch, one batch at a time, under ``policy``; a long SLO."""
    return xy_config(name, max_batch_size=1, parameters={
        "max_inflight_batches": "1", "batch_policy": policy, "slo_ms": "60000",
        "gate_dir": gate_dir, "batch_s": BATCH_S})


SLOW_MODEL = '''
import time
from pathlib import Path

import torch


class Slow(torch.nn.Module):
    """y = 2x, at least ``batch_s`` per batch; waits while ``gate_dir/closed`` exists."""

    def __init__(self, gate_dir, batch_s):
        super().__init__()
        self.dir = Path(gate_dir)
        self.batch_s = batch_s

    def forward(self, x):
        with open(self.dir / "seen", "a") as log:
            log.write("".join(f"{v}\\n" for v in x[:, 0].tolist()))
        (self.dir / "entered").touch()
        deadline = time.monotonic() + 30
        while (self.dir / "closed").exists() and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(self.batch_s)
        return x * 2


def build_model(parameters):
    return Slow(parameters["gate_dir"], float(parameters["batch_s"]))
'''


@pytest.fixture(scope="module")
def slow(server, model_repository, tmp_path_factory) -> dict[str, Gate]:
    gates: dict[str, Gate] = {}
    with Client(server.address, timeout_s=120, retry=RetryPolicy(max_attempts=1)) as client:
        for name, policy in (("slow_fifo", "fifo"), ("slow_deadline", "deadline")):
            gate = Gate(tmp_path_factory.mktemp(name))
            write_model(model_repository, slow_config(name, policy, gate.dir), SLOW_MODEL)
            client.load_model(name)
            gates[name] = gate
    yield gates
    for gate in gates.values():
        gate.open()


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address, timeout_s=60, retry=RetryPolicy(max_attempts=1)) as c:
        yield c


def x_of(value: float) -> np.ndarray:
    return np.full((1, 2), value, np.float32)


def failures(server, model: str, reason: str) -> float:
    return server.metric("batchgate_request_failures_total", model=model, reason=reason)


def test_a_deadline_shorter_than_a_batch_is_refused_as_infeasible(server, slow, client):
    before = failures(server, "slow_deadline", "infeasible")
    with pytest.raises(BatchgateError) as err:
        client.infer("slow_deadline", {"INPUT__0": x_of(7.0)}, timeout_us=int(BATCH_S * 1e6 / 4))
    assert err.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert "cannot be served in time" in str(err.value)
    assert failures(server, "slow_deadline", "infeasible") == before + 1
    assert 7.0 not in slow["slow_deadline"].seen()


def test_valid_requests_are_answered_under_the_deadline_policy(server, slow, client):
    met = server.metric("batchgate_slo_requests_total", model="slow_deadline", result="met")
    out = client.infer("slow_deadline", {"INPUT__0": x_of(3.0)}, timeout_us=60_000_000)
    np.testing.assert_array_equal(out["OUTPUT__0"], x_of(6.0))
    assert server.metric("batchgate_slo_requests_total", model="slow_deadline",
                         result="met") == met + 1


def test_a_wait_longer_than_the_deadline_is_refused_at_admission(server, slow, client):
    gate = slow["slow_fifo"]
    queued_count = 12  # 12 batches of at least BATCH_S each: a 1 s deadline cannot wait that long
    before = failures(server, "slow_fifo", "rejected")
    gate.close()
    with grpc.insecure_channel(server.address) as channel:
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            blocker = stub.ModelInfer.future(infer_request("slow_fifo", {"INPUT__0": x_of(-1.0)}))
            gate.wait_entered()
            queued = [stub.ModelInfer.future(infer_request("slow_fifo", {"INPUT__0": x_of(i)}))
                      for i in range(queued_count)]
            poll(lambda: server.queue_depth("slow_fifo") == queued_count, 30,
                 "the requests never queued")
            probe = infer_request("slow_fifo", {"INPUT__0": x_of(99.0)},
                                  parameters={"timeout": pb.InferParameter(int64_param=1_000_000)})
            with pytest.raises(grpc.RpcError) as err:
                stub.ModelInfer(probe, timeout=60)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "estimated wait" in err.value.details()
            assert "before the request's deadline" in err.value.details()
            assert failures(server, "slow_fifo", "rejected") == before + 1
        finally:
            gate.open()
        np.testing.assert_array_equal(output(blocker.result(60), "OUTPUT__0"), x_of(-2.0))
        for i, future in enumerate(queued):
            np.testing.assert_array_equal(output(future.result(60), "OUTPUT__0"), x_of(2.0 * i))
    assert 99.0 not in gate.seen()
