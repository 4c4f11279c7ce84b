"""batchgate-floor, the serving benchmark's all-C++ yardstick (bench/floor): built here, it
answers what the model computes, keeps each request's rows when requests share a batch, refuses
a bad input and still serves, counts what it ran, and stops with exit status 0 on SIGTERM; a
model it cannot serve is refused saying why."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from batchgate.bench import floor
from batchgate.bench.harness.repository import model_config, tensor, write_model
from tests.support.models import xy_config

# Slow (it compiles batchgate-floor against torch's C++ libraries): make test-fast leaves it
# out.
pytestmark = pytest.mark.slow

# y = x @ W.T + b with fixed weights: the answer is known in closed form.
WEIGHT = np.array([[1.0, 2.0], [3.0, -1.0]], dtype=np.float32)
BIAS = np.array([0.5, -0.5], dtype=np.float32)
TRACED = """
import torch


def build_model(parameters):
    layer = torch.nn.Linear(2, 2)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, -1.0]]))
        layer.bias.copy_(torch.tensor([0.5, -0.5]))
    return torch.jit.trace(layer.eval(), torch.zeros(1, 2))
"""
EAGER = """
import torch


def build_model(parameters):
    return torch.nn.Linear(2, 2)
"""


@pytest.fixture(scope="module")
def binary():
    try:
        return floor.build()
    except floor.FloorUnavailable as exc:
        if os.environ.get("BATCHGATE_REQUIRE_NATIVE"):
            pytest.fail(f"$BATCHGATE_REQUIRE_NATIVE is set and batchgate-floor did not build: "
                        f"{exc}")
        pytest.skip(f"batchgate-floor cannot be built here: {exc}")


@pytest.fixture
def served(binary, tmp_path):
    model_dir = write_model(tmp_path / "repo", xy_config("affine", max_batch_size=8), TRACED)
    exported = floor.export(model_dir, tmp_path / "affine.pt")
    server = floor.FloorServer(binary, exported, workers=2)
    yield server
    server.stop()


def _infer(client, rows: np.ndarray):
    import tritonclient.grpc as grpcclient

    data = grpcclient.InferInput("INPUT__0", list(rows.shape), "FP32")
    data.set_data_from_numpy(rows)
    return client.infer("affine", [data]).as_numpy("OUTPUT__0")


def test_the_export_says_what_the_floor_is_told(served):
    model = served.model
    assert (model.name, model.input, model.output) == ("affine", "INPUT__0", "OUTPUT__0")
    assert (model.in_width, model.out_width, model.max_batch_size) == (2, 2, 8)
    assert model.intra_op_threads == 0  # the config sets none: the floor leaves torch's default


def test_the_floor_answers_what_the_model_computes_and_keeps_rows_apart(served):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(served.address)
    assert client.is_model_ready("affine")
    x = np.array([[1.0, 2.0]], dtype=np.float32)
    np.testing.assert_allclose(_infer(client, x), x @ WEIGHT.T + BIAS, rtol=1e-6)

    # Requests at once: whatever batches they share, each gets its own row's answer.
    inputs = [np.array([[i, -2.0 * i]], dtype=np.float32) for i in range(32)]
    results: dict[int, object] = {}
    done = threading.Event()

    def answered(i, result, error):
        results[i] = error if error is not None else result.as_numpy("OUTPUT__0")
        if len(results) == len(inputs):
            done.set()

    for i, x in enumerate(inputs):
        data = grpcclient.InferInput("INPUT__0", [1, 2], "FP32")
        data.set_data_from_numpy(x)
        client.async_infer("affine", [data],
                           callback=lambda result, error, i=i: answered(i, result, error))
    assert done.wait(30), f"{len(results)} of {len(inputs)} answered"
    for i, x in enumerate(inputs):
        np.testing.assert_allclose(results[i], x @ WEIGHT.T + BIAS, rtol=1e-6)

    counters = served.counters()
    assert counters["samples"] == 1 + len(inputs)
    assert 1 <= counters["batches"] <= counters["samples"]
    assert counters["model_cpu_s"] > 0
    metrics = served.metrics_text()
    assert f'batchgate_batch_size_sum{{model="affine"}} {1 + len(inputs)}' in metrics
    assert f'batchgate_requests_total{{model="affine",status="OK"}} {1 + len(inputs)}' in metrics


def test_a_bad_input_is_refused_and_the_floor_still_serves(served):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(served.address)
    with pytest.raises(InferenceServerException) as refused:
        _infer(client, np.ones((1, 3), dtype=np.float32))
    assert "INVALID_ARGUMENT" in str(refused.value.status())
    x = np.array([[0.0, 1.0]], dtype=np.float32)
    np.testing.assert_allclose(_infer(client, x), x @ WEIGHT.T + BIAS, rtol=1e-6)
    assert served.counters()["samples"] == 1


def test_sigterm_stops_the_floor_with_status_zero(binary, tmp_path):
    model_dir = write_model(tmp_path / "repo", xy_config("affine"), TRACED)
    server = floor.FloorServer(binary, floor.export(model_dir, tmp_path / "a.pt"), workers=1)
    assert server.counters() == {"batches": 0, "samples": 0, "model_cpu_s": 0.0}
    assert server.stop() == 0


def test_a_model_the_floor_cannot_serve_is_refused_saying_why(tmp_path):
    eager = write_model(tmp_path / "repo", xy_config("eager"), EAGER)
    with pytest.raises(floor.FloorUnavailable, match="TorchScript modules only"):
        floor.export(eager, tmp_path / "eager.pt")
    square = model_config("square", max_batch_size=4,
                          input=[tensor("INPUT__0", "FP32", [2, 2])],
                          output=[tensor("OUTPUT__0", "FP32", [2])])
    model_dir = write_model(tmp_path / "repo", square, TRACED)
    with pytest.raises(floor.FloorUnavailable, match=r"one FP32 input \[-1, n\]"):
        floor.export(model_dir, tmp_path / "square.pt")
