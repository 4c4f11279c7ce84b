"""Tensors as they cross between the wire's numpy arrays and torch, without copies where
the types allow (KServe v2 datatype strings; BF16 travels as uint16 raw bits)."""

from __future__ import annotations

import numpy as np
import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "UINT8": torch.uint8,
    "UINT16": torch.uint16,
    "UINT32": torch.uint32,
    "UINT64": torch.uint64,
    "INT8": torch.int8,
    "INT16": torch.int16,
    "INT32": torch.int32,
    "INT64": torch.int64,
    "FP16": torch.float16,
    "FP32": torch.float32,
    "FP64": torch.float64,
    "BF16": torch.bfloat16,
}


def to_torch(array: np.ndarray, datatype: str) -> torch.Tensor:
    """A tensor sharing ``array``'s memory (BF16 arrives as uint16 raw bits).

    BYTES inputs stay numpy object arrays: torch has no string tensor, so a model that declares
    them (a Python ``model.py``) receives the array itself.
    """
    if datatype == "BYTES" or isinstance(array, torch.Tensor):
        return array  # a tensor already: on a device, from a client's CUDA shared memory
    if datatype == "BF16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def to_numpy(tensor: torch.Tensor, datatype: str) -> np.ndarray:
    """Host array of ``tensor`` converted to ``datatype``; no copy when it already fits."""
    want = TORCH_DTYPES[datatype]
    if tensor.dtype != want:
        tensor = tensor.to(want)
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if datatype == "BF16":
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def host_input(array):
    """An input as a host array in the wire's representation: numpy arrays as they are, a
    device tensor (a client's CUDA shared memory) copied to the host."""
    if isinstance(array, torch.Tensor):
        return host_array(array.cpu())
    return array


def host_array(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor, in the wire's representation (BF16 as uint16 bits)."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()
