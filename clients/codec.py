"""numpy arrays ⇄ Open Inference Protocol tensors, on the client side.

Requests always carry raw little-endian, row-major bytes (`raw_input_contents`). Responses are
decoded from `raw_output_contents` with `numpy.frombuffer`, or from the typed `contents` when a
server answered with those. BF16 has no numpy dtype: it travels as its raw 16-bit patterns, sent
from a `uint16` array with the datatype "BF16" (or from an `ml_dtypes.bfloat16` array) and
returned as a `uint16` array (`.view(ml_dtypes.bfloat16)` turns it into numbers).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import grpc
import numpy as np

from batchgate.clients.errors import BatchgateError
from batchgate.protos import inference_pb2
from batchgate.protos.datatypes import CONTENTS_FIELDS, DATATYPE_BY_DTYPE_NAME, FIXED_DTYPES

InferInputTensor = inference_pb2.ModelInferRequest.InferInputTensor


def datatype_of(array: np.ndarray) -> str:
    """The protocol datatype string for a numpy array's dtype ("FP32", "BOOL", ...)."""
    datatype = DATATYPE_BY_DTYPE_NAME.get(array.dtype.name)
    if datatype is None:
        raise ValueError(
            "unsupported dtype: the SDK sends bool, (u)int8..64, float16/32/64 and bfloat16 "
            f"(BF16); got {array.dtype}"
        )
    return datatype


def encode_input(
    name: str, array: np.ndarray, datatype: str | None = None
) -> tuple[InferInputTensor, bytes]:
    """One input as its tensor descriptor and its raw bytes.

    `datatype` overrides the datatype taken from the dtype; the only override allowed is "BF16"
    for a `uint16` array holding bfloat16 bit patterns.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"input names must be non-empty strings, got {name!r}")
    array = np.asarray(array)
    given_dtype = array.dtype
    natural = datatype_of(array)
    if natural == "BF16":
        # An ml_dtypes.bfloat16 array: its bit patterns are what travels.
        array = array.view(np.uint16)
    if datatype is None:
        datatype = natural
    elif datatype != natural and not (datatype == "BF16" and natural == "UINT16"):
        raise ValueError(
            f"input {name!r}: datatype {datatype} does not fit a {given_dtype} array (only a "
            f"uint16 array of bit patterns may be sent as BF16); got {datatype}"
        )
    wire_dtype = FIXED_DTYPES[datatype]
    if array.dtype != wire_dtype:
        array = array.astype(wire_dtype)
    tensor = InferInputTensor(name=name, datatype=datatype, shape=array.shape)
    # tobytes() writes row-major whatever the array's strides: one copy, no per-element Python.
    return tensor, array.tobytes()


def encode_inputs(
    inputs: Mapping[str, np.ndarray], datatypes: Mapping[str, str] | None = None
) -> tuple[list[InferInputTensor], list[bytes]]:
    """Every input, in the mapping's order, as tensor descriptors and raw buffers."""
    datatypes = dict(datatypes or {})
    unknown = set(datatypes) - set(inputs)
    if unknown:
        raise ValueError(f"datatypes names inputs that are not given: got {sorted(unknown)}")
    tensors: list[InferInputTensor] = []
    raws: list[bytes] = []
    for name, array in inputs.items():
        tensor, raw = encode_input(name, array, datatypes.get(name))
        tensors.append(tensor)
        raws.append(raw)
    return tensors, raws


def _malformed(message: str) -> BatchgateError:
    return BatchgateError(grpc.StatusCode.INTERNAL, f"malformed response: {message}")


def _checked_shape(output) -> tuple[tuple[int, ...], int]:
    shape = tuple(output.shape)
    if any(d < 0 for d in shape):
        raise _malformed(f"output {output.name!r} has shape {list(shape)}")
    return shape, math.prod(shape)


def _wire_dtype(output) -> np.dtype:
    dtype = FIXED_DTYPES.get(output.datatype)
    if dtype is None:
        raise BatchgateError(
            grpc.StatusCode.UNIMPLEMENTED,
            f"output {output.name!r} has datatype {output.datatype!r}, which the SDK does not "
            "decode",
        )
    return dtype


def decode_outputs(response: inference_pb2.ModelInferResponse) -> dict[str, np.ndarray]:
    """A response's outputs as name → array.

    Arrays decoded from raw bytes are read-only views of the response's buffers (no copy); call
    `.copy()` to modify one. BF16 outputs come back as `uint16` bit patterns.
    """
    outputs = response.outputs
    raws = response.raw_output_contents
    if raws and len(raws) != len(outputs):
        raise _malformed(f"{len(outputs)} outputs but {len(raws)} raw buffers")
    decoded: dict[str, np.ndarray] = {}
    for index, output in enumerate(outputs):
        dtype = _wire_dtype(output)
        shape, count = _checked_shape(output)
        if raws:
            raw = raws[index]
            if len(raw) != count * dtype.itemsize:
                raise _malformed(
                    f"output {output.name!r} ({output.datatype} {list(shape)}) needs "
                    f"{count * dtype.itemsize} bytes, got {len(raw)}"
                )
            array = np.frombuffer(raw, dtype=dtype)
        else:
            array = _decode_contents(output, dtype, count)
        decoded[output.name] = array.reshape(shape)
    return decoded


def _decode_contents(output, dtype: np.dtype, count: int) -> np.ndarray:
    field = CONTENTS_FIELDS.get(output.datatype)
    if field is None:
        raise _malformed(f"output {output.name!r} is {output.datatype}, which travels only raw")
    field_name, field_dtype = field
    # np.asarray walks protobuf's repeated field in C: no Python loop per element.
    values = np.asarray(getattr(output.contents, field_name), dtype=field_dtype)
    if values.size != count:
        raise _malformed(
            f"output {output.name!r} has {values.size} values in {field_name}, "
            f"its shape {list(output.shape)} needs {count}"
        )
    return values.astype(dtype, copy=False)
