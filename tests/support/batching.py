"""The batch loop's test helpers: a fake model that records and can be held, a spec for it,
requests of one value, and holding the only executor busy."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import torch

from batchgate.batcher.model import ServedModel
from batchgate.batcher.request import InferenceRequest
from batchgate.batcher.spec import BatchingConfig, ModelSpec, TensorSpec


class RecordingModel:
    """y = 2x; records each batch's first column; waits on ``gate`` when one is set."""

    def __init__(self) -> None:
        self.batches: list[list[float]] = []
        self.gate: threading.Event | None = None
        self.entered = threading.Event()
        self.fail_on: float | None = None
        self.lock = threading.Lock()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        with self.lock:
            self.batches.append(x[:, 0].tolist())
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail_on is not None and bool((x[:, 0] == self.fail_on).any()):
            raise RuntimeError("poisoned input")
        return x * 2


def make_spec(dims=(2,), **batching) -> ModelSpec:
    batching.setdefault("max_batch_size", 8)
    return ModelSpec(
        name="fake", version="1", platform="test",
        inputs=(TensorSpec("x", "FP32", dims),), outputs=(TensorSpec("y", "FP32", dims),),
        batching=BatchingConfig(**batching), warmup=False,
    )


def request(value: float, *, rows: int = 1, width: int = 2, **kwargs) -> InferenceRequest:
    return InferenceRequest([np.full((rows, width), value, dtype=np.float32)], batch_size=rows,
                            **kwargs)


async def hold_executor(model: ServedModel, fake: RecordingModel, **kwargs) -> asyncio.Task:
    """Occupy the only executor with a batch that waits on the gate."""
    fake.gate = threading.Event()
    model._test_gate = fake.gate
    blocker = asyncio.ensure_future(model.infer(request(-1.0, **kwargs)))
    await asyncio.get_running_loop().run_in_executor(None, fake.entered.wait, 10)
    return blocker


def unit_spec(**fields) -> ModelSpec:
    """A spec "unit": FP32 [2] in ``x``, out ``y``, batches of up to 8, ``inflight`` (default 1)
    batches in flight; ``fields``: further ``ModelSpec`` fields."""
    batching = BatchingConfig(max_batch_size=8, max_inflight_batches=fields.pop("inflight", 1))
    return ModelSpec(name="unit", version="1", platform="test",
                     inputs=(TensorSpec("x", "FP32", (2,)),),
                     outputs=(TensorSpec("y", "FP32", (2,)),), batching=batching, **fields)


async def infer_x(model: ServedModel, x: np.ndarray, timeout_s: float = 20) -> np.ndarray:
    """``model``'s ``y`` for the one input ``x`` (its rows the batch)."""
    request = InferenceRequest([x], batch_size=x.shape[0])
    return (await asyncio.wait_for(model.infer(request), timeout_s))["y"]
