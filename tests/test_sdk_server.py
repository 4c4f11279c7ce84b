"""The SDK against the real batchgate server: inference, errors with status codes, repository."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from batchgate.clients import AsyncClient, BatchgateError, Client, RetryPolicy
from tests.support import models


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address, timeout_s=30) as c:
        yield c


def reference(server, model: str, x: np.ndarray) -> np.ndarray:
    return models.reference(model, x)


def test_infer_matches_the_model(server, client):
    x = np.random.default_rng(0).standard_normal((3, 3, 32, 32), dtype=np.float32)
    result = client.infer_result("cnn", {"INPUT__0": x}, request_id="sdk-1")
    assert result.id == "sdk-1" and result.model_version == "1"
    np.testing.assert_allclose(result.outputs["OUTPUT__0"], reference(server, "cnn", x),
                               rtol=1e-4, atol=1e-5)


def test_encoder_takes_int64_token_ids(server, client):
    ids = np.random.default_rng(1).integers(0, 1000, (4, 16), dtype=np.int64)
    out = client.infer("encoder", {"INPUT__0": ids})["OUTPUT__0"]
    assert out.shape == (4, 64)
    np.testing.assert_allclose(out, reference(server, "encoder", ids), rtol=1e-4, atol=1e-5)


def test_errors_keep_the_status_code(client):
    with pytest.raises(BatchgateError) as err:
        client.infer("nope", {"INPUT__0": np.zeros((1, 2), np.float32)})
    assert err.value.code is grpc.StatusCode.NOT_FOUND
    with pytest.raises(BatchgateError) as err:
        client.infer("mlp", {"INPUT__0": np.zeros((1, 3), np.float32)})
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT


def test_unload_and_load_at_run_time(server):
    with Client(server.address, timeout_s=60, retry=RetryPolicy(max_attempts=1)) as client:
        x = np.ones((1, 2), np.float32)
        assert client.model_ready("spare")
        client.unload_model("spare")
        assert not client.model_ready("spare")
        assert client.health("spare") == "NOT_SERVING"
        with pytest.raises(BatchgateError) as err:
            client.infer("spare", {"INPUT__0": x})
        assert err.value.code is grpc.StatusCode.UNAVAILABLE
        states = {m.name: m.state for m in client.repository_index()}
        assert states["spare"] == "UNAVAILABLE"
        client.load_model("spare")
        assert client.model_ready("spare")
        assert client.health("spare") == "SERVING"
        np.testing.assert_array_equal(client.infer("spare", {"INPUT__0": x})["OUTPUT__0"], x + 1)


def test_load_refuses_path_traversal(client):
    with pytest.raises(BatchgateError) as err:
        client.load_model("../models")
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT


async def test_async_client_batches_concurrent_requests(server):
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal((1, 512), dtype=np.float32) for _ in range(64)]
    async with AsyncClient(server.address, timeout_s=30) as client:
        import asyncio

        outs = await asyncio.gather(*(client.infer("mlp", {"INPUT__0": x}) for x in xs))
        stats = await client.model_statistics("mlp")
    for x, out in zip(xs, outs):
        np.testing.assert_allclose(out["OUTPUT__0"], reference(server, "mlp", x), rtol=1e-4, atol=1e-5)
    assert stats[0].inference_count >= 64
