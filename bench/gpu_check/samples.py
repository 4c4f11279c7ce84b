"""Helpers the sections share: the example models' inputs, random data of their datatypes,
building a model.py with torch alone, autocast and synchronisation by device."""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
TOKEN_IDS_HIGH = 1000  # integer inputs are token ids below the smallest vocabulary (encoder's)

# Input of each example model, as in models/<name>/config.pbtxt: (b) and (d) need only torch.
EXAMPLE_INPUTS: dict[str, tuple[tuple[int, ...], str]] = {
    "mlp": ((512,), "float32"),
    "cnn": ((3, 32, 32), "float32"),
    "encoder": ((16,), "int64"),
}


_source_numbers = itertools.count(1)


def build_from_source(path: Path, device: str) -> Any:
    """``build_model({})`` of a model.py, on ``device``, in eval mode (torch only, no batcher)."""
    name = f"gpu_check_model_{next(_source_numbers)}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.build_model({}).to(device).eval()


def random_array(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    if np.issubdtype(np.dtype(dtype), np.integer):
        return rng.integers(0, TOKEN_IDS_HIGH, shape).astype(dtype)
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def random_tensor(shape: tuple[int, ...], dtype: str, device: str) -> Any:
    import torch

    if dtype == "int64":
        return torch.randint(0, TOKEN_IDS_HIGH, shape, device=device)
    return torch.randn(shape, device=device)


def autocast_for(precision: str, device: str) -> contextlib.AbstractContextManager:
    import torch

    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    if precision not in dtypes:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtypes[precision])


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()

def has_convolutions(module: Any) -> bool:
    # A traced module's submodules are ScriptModules that keep the eager class name here.
    return any((getattr(m, "original_name", "") or type(m).__name__).startswith("Conv")
               for m in module.modules())


