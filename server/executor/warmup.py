"""A model's ``model_warmup`` samples, as the input arrays it runs before it reports ready.

:func:`warmup_inputs` turns the config's samples into arrays in the model's input order (without
``model_warmup`` the batcher warms up with zeros at its batch sizes). ``input_data_file`` is read
from the model's ``warmup/`` folder, as Triton does.
"""

from __future__ import annotations

import math
from pathlib import Path, PurePosixPath

import numpy as np

from batchgate.batcher.errors import LoadError
from batchgate.batcher.spec import NUMPY_DTYPES, ModelSpec, TensorSpec
from batchgate.protos import model_config_pb2
from batchgate.server.config.model_config import datatype_from_proto

WARMUP_FOLDER = "warmup"
_WARMUP_SEED = 0


def warmup_inputs(
    config: model_config_pb2.ModelConfig, spec: ModelSpec, model_dir: Path
) -> list[list[np.ndarray]] | None:
    """The config's ``model_warmup`` samples as input sets in the model's input order.

    None when the config has none (the batcher then picks its own). Each sample of
    ``batch_size`` rows runs ``count`` times (0 counts as 1, as in Triton). ``random_data`` is
    uniform in [0, 1) for floating types and 0 or 1 for integer and BOOL inputs, so integer
    inputs stay valid indices; ``zero_data`` is zeros.
    """
    if not config.model_warmup:
        return None
    rng = np.random.default_rng(_WARMUP_SEED)
    sets: list[list[np.ndarray]] = []
    for index, warmup in enumerate(config.model_warmup):
        label = f"model {spec.name!r}: model_warmup {warmup.name or index!r}"
        unknown = sorted(set(warmup.inputs) - {t.name for t in spec.inputs})
        if unknown:
            raise LoadError(f"{label}: the model has no input named {unknown[0]!r}")
        rows = warmup.batch_size or 1
        if spec.max_batch_size and rows > spec.max_batch_size:
            raise LoadError(
                f"{label}: batch_size must lie in 1..max_batch_size ({spec.max_batch_size}), "
                f"got {rows}"
            )
        if not spec.max_batch_size and rows != 1:
            raise LoadError(
                f"{label}: batch_size must be 1 for a model without batching, got {rows}"
            )
        arrays = [
            _warmup_array(label, tensor, warmup.inputs.get(tensor.name), rows,
                          batched=spec.max_batch_size > 0, model_dir=model_dir, rng=rng)
            for tensor in spec.inputs
        ]
        sets.extend([arrays] * (warmup.count or 1))
    return sets


def _warmup_array(
    label: str,
    tensor: TensorSpec,
    sample: model_config_pb2.ModelWarmup.Input | None,
    rows: int,
    *,
    batched: bool,
    model_dir: Path,
    rng: np.random.Generator,
) -> np.ndarray:
    if sample is None:
        raise LoadError(f"{label}: no data for input {tensor.name!r}")
    try:
        datatype = datatype_from_proto(sample.data_type)
    except ValueError as exc:
        raise LoadError(f"{label}: input {tensor.name!r}: {exc}") from None
    if datatype != tensor.datatype:
        raise LoadError(
            f"{label}: input {tensor.name!r} is {tensor.datatype}, got data_type {datatype}"
        )
    if datatype == "BYTES":
        raise LoadError(f"{label}: input {tensor.name!r}: BYTES inputs cannot be warmed up")
    dims = tuple(int(d) for d in sample.dims) or tensor.dims
    if len(dims) != len(tensor.dims) or any(
        d < 0 or (want >= 0 and d != want) for d, want in zip(dims, tensor.dims)
    ):
        raise LoadError(
            f"{label}: input {tensor.name!r} dims must fit {list(tensor.dims)} with no -1, "
            f"got {list(dims)}"
        )
    dtype = NUMPY_DTYPES[datatype]
    count = math.prod(dims)
    source = sample.WhichOneof("input_data_type")
    if source == "input_data_file":
        one = _read_warmup_file(label, tensor.name, model_dir, sample.input_data_file, dtype, count)
    elif source == "random_data":
        if datatype in ("FP16", "FP32", "FP64"):
            one = rng.random(count).astype(dtype)
        elif datatype == "BF16":  # raw bfloat16 bits: the top half of the float32's bits
            one = (rng.random(count, dtype=np.float32).view(np.uint32) >> 16).astype(dtype)
        else:
            one = rng.integers(0, 2, count).astype(dtype)
    else:
        one = np.zeros(count, dtype=dtype)
    one = one.reshape(dims)
    if not batched:
        return one
    return np.ascontiguousarray(np.broadcast_to(one, (rows, *dims)))


def _read_warmup_file(
    label: str, input_name: str, model_dir: Path, filename: str, dtype: np.dtype, count: int
) -> np.ndarray:
    relative = PurePosixPath(filename)
    if relative.is_absolute() or ".." in relative.parts or not relative.parts:
        raise LoadError(
            f"{label}: input {input_name!r}: input_data_file must be a path inside the model's "
            f"{WARMUP_FOLDER}/ folder, got {filename!r}"
        )
    path = model_dir / WARMUP_FOLDER / relative
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise LoadError(
            f"{label}: input {input_name!r}: cannot read {path}: {exc.strerror}"
        ) from None
    need = count * dtype.itemsize
    if len(data) < need:
        raise LoadError(
            f"{label}: input {input_name!r}: {path} must hold at least {need} bytes, "
            f"got {len(data)}"
        )
    return np.frombuffer(data[:need], dtype=dtype).copy()
