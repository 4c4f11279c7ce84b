"""Tensors as they cross between the wire's numpy arrays and torch, without copies where
the types allow (KServe v2 datatype strings; BF16 travels as uint16 raw bits)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from batchgate.protos.datatypes import FIXED_DTYPES

# Datatype -> torch dtype, for the fixed-size datatypes (torch has no string tensor): numpy's
# own counterpart for each, except BF16, which the host holds as uint16 bits.
TORCH_DTYPES: dict[str, torch.dtype] = {
    name: torch.bfloat16 if name == "BF16" else torch.from_numpy(np.empty(0, dtype)).dtype
    for name, dtype in FIXED_DTYPES.items()
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
    """Host array of ``tensor`` converted to ``datatype``; no copy when it already fits. A
    BYTES output is already the object array :func:`bytes_tensor` made of it."""
    if datatype == "BYTES":
        return tensor
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


# The ends of the messages bytes_tensor raises (after "returned BYTES output 'NAME' ").
_BYTES_FORMS = ("a BYTES output must be a numpy object, bytes_ or str_ array, or a list with "
                "one entry per row")
_NOT_UTF8 = "with a str element that cannot be encoded as UTF-8 (a lone surrogate)"
_RAGGED = "as a list whose rows differ in shape: each row must have the output's dims"


def bytes_tensor(value: Any, dims: tuple[int, ...], batched: bool) -> np.ndarray:
    """The numpy object array of ``bytes`` a BYTES output is sent as, from what a model returned:
    a numpy object, ``bytes_`` or ``str_`` array, or (``batched``) a list with one entry per
    row, each a bytes/str (one element, shaped ``[1, ...]`` to the rank of ``dims``, the
    output's dims) or a nested list/array of them. ``str`` elements are encoded as UTF-8.

    Raises TypeError saying what ``value`` is when it is none of these (the caller names the
    model and the output).
    """
    if isinstance(value, np.ndarray):
        if value.dtype.kind == "S":  # fixed-width bytes: numpy drops trailing NULs, as it does
            return value.astype(object)
        if value.dtype.kind == "U":
            try:
                return np.char.encode(value, "utf-8").astype(object)
            except UnicodeEncodeError:
                raise TypeError(_NOT_UTF8) from None
        if value.dtype != object:
            raise TypeError(f"as a numpy {value.dtype} array: {_BYTES_FORMS}")
        array = value
    elif isinstance(value, (list, tuple)):
        return _as_bytes(_from_rows(value, dims, batched), rows=True)
    elif isinstance(value, torch.Tensor):
        raise TypeError(f"as a {value.dtype} tensor: {_BYTES_FORMS}")
    else:
        raise TypeError(f"as {type(value).__name__}: {_BYTES_FORMS}")
    return _as_bytes(array)


def _from_rows(rows: list | tuple, dims: tuple[int, ...], batched: bool) -> np.ndarray:
    try:
        array = np.array(rows, dtype=object)
    except ValueError:  # numpy could not tell the nesting apart
        raise TypeError(_RAGGED) from None
    if batched and array.ndim == 1 and dims:
        array = array.reshape(len(rows), *(1 for _ in dims))  # rows of one element each
    return array


def _as_bytes(array: np.ndarray, rows: bool = False) -> np.ndarray:
    """``array`` when every element is bytes, else a copy with ``str`` elements encoded.
    ``rows``: ``array`` was made of a list's rows (a sequence left in it means they were ragged)."""
    flat = array.reshape(-1)
    kinds = set(map(type, flat))  # one pass in C; the usual answer is {bytes}
    if kinds <= {bytes}:
        return array
    for kind in kinds:
        if rows and issubclass(kind, (list, tuple, np.ndarray)):
            raise TypeError(_RAGGED)
        if not issubclass(kind, (bytes, str)):
            raise TypeError(f"with an element of type {kind.__name__}: BYTES elements must "
                            "be bytes or str")
    encoded = np.empty(flat.size, dtype=object)
    try:
        encoded[:] = [x.encode("utf-8") if isinstance(x, str) else x for x in flat]
    except UnicodeEncodeError:
        raise TypeError(_NOT_UTF8) from None
    return encoded.reshape(array.shape)
