"""What to send: each model's inputs, built from what the server says, serialized once.

The server's ModelMetadata gives input names, datatypes and shapes; its ModelConfig (a Triton
extension; a server without it answers UNIMPLEMENTED) says whether the first dimension is the
batch. Inputs are random data of the right datatype, or the arrays of an ``.npz`` file keyed by
input name. Every combination of model, priority level and data variant becomes one
``ModelInferRequest`` serialized to bytes here, so the hot path sends bytes and builds nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc
import numpy as np

from batchgate.protos import inference_pb2 as pb
from batchgate.protos import inference_pb2_grpc
from batchgate.protos.datatypes import FIXED_DTYPES, bytes_encoding

# Random data sets per model: a server that caches by content still sees varied requests.
DATA_VARIANTS = 4
BYTES_ELEMENT_LENGTH = 8



class WorkloadError(RuntimeError):
    """The workload cannot be built; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class ModelChoice:
    """``--model NAME[:WEIGHT]``."""

    name: str
    weight: float = 1.0


@dataclasses.dataclass(frozen=True)
class PriorityChoice:
    """``--priority LEVEL:WEIGHT``; level 0 sends no ``priority`` parameter."""

    level: int
    weight: float = 1.0


@dataclasses.dataclass(frozen=True)
class DeadlineChoice:
    """``--deadline-ms MS[:WEIGHT]``: a request's deadline, from its intended send time."""

    ms: float
    weight: float = 1.0


@dataclasses.dataclass(frozen=True)
class InputSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]  # as sent, batch dimension included where the model batches


@dataclasses.dataclass(frozen=True)
class ModelInputs:
    """One model's inputs as they will be sent."""

    name: str
    max_batch_size: int | None  # None: the server has no ModelConfig
    inputs: tuple[InputSpec, ...]

    @property
    def samples(self) -> int:
        """Samples per request: the batch dimension where the model batches, else 1."""
        if self.max_batch_size and self.inputs and self.inputs[0].shape:
            return self.inputs[0].shape[0]
        return 1


@dataclasses.dataclass(frozen=True)
class Variant:
    """One pre-serialized request; ``model``, ``priority`` and ``deadline`` index the run's
    mixes (``deadline`` 0 when there is no deadline)."""

    payload: bytes
    model: int
    priority: int
    samples: int
    deadline: int = 0


@dataclasses.dataclass(frozen=True)
class DataOptions:
    batch: int = 1
    shapes: Mapping[tuple[str | None, str], tuple[int, ...]] = dataclasses.field(default_factory=dict)
    npz: Mapping[str | None, Path] = dataclasses.field(default_factory=dict)
    int_range: tuple[int, int] = (0, 100)
    seed: int = 0


def describe_models(channel: grpc.Channel, names: Sequence[str], options: DataOptions,
                    timeout_s: float = 30.0) -> list[ModelInputs]:
    """Each model's inputs as they will be sent; WorkloadError names a model the server lacks."""
    stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
    described = []
    for name in names:
        try:
            metadata = stub.ModelMetadata(pb.ModelMetadataRequest(name=name), timeout=timeout_s)
        except grpc.RpcError as exc:
            raise WorkloadError(
                f"ModelMetadata of {name!r} failed: {exc.code().name}: {exc.details()}") from exc
        max_batch_size = _max_batch_size(stub, name, timeout_s)
        described.append(_model_inputs(metadata, max_batch_size, options))
    return described


def _max_batch_size(stub, name: str, timeout_s: float) -> int | None:
    try:
        reply = stub.ModelConfig(pb.ModelConfigRequest(name=name), timeout=timeout_s)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            return None
        raise WorkloadError(
            f"ModelConfig of {name!r} failed: {exc.code().name}: {exc.details()}") from exc
    return reply.config.max_batch_size


def _model_inputs(metadata, max_batch_size: int | None, options: DataOptions) -> ModelInputs:
    name = metadata.name
    arrays = _npz_arrays(name, options)
    inputs = []
    for tensor in metadata.inputs:
        shape = list(tensor.shape)
        # Without ModelConfig, a leading -1 is taken as the batch dimension (MLServer's habit).
        batching = max_batch_size > 0 if max_batch_size is not None else shape[:1] == [-1]
        dims = shape[1:] if batching else shape
        if arrays is not None:
            if tensor.name not in arrays:
                raise WorkloadError(f"the .npz for {name!r} has no array {tensor.name!r}; "
                                    f"it has {sorted(arrays)}")
            full = arrays[tensor.name].shape
        else:
            dims = _resolve_dims(name, tensor.name, dims, options.shapes)
            full = (options.batch, *dims) if batching else tuple(dims)
        inputs.append(InputSpec(tensor.name, tensor.datatype, tuple(int(d) for d in full)))
    return ModelInputs(name, max_batch_size, tuple(inputs))


def _resolve_dims(model: str, tensor: str, dims: Sequence[int],
                  shapes: Mapping[tuple[str | None, str], tuple[int, ...]]) -> tuple[int, ...]:
    given = shapes.get((model, tensor), shapes.get((None, tensor)))
    if given is not None:
        if len(given) != len(dims) or any(d not in (-1, g) for d, g in zip(dims, given)):
            raise WorkloadError(f"--shape {tensor}:{','.join(map(str, given))} does not fit "
                                f"{model!r}'s dims {list(dims)} (batch dimension left out)")
        return tuple(given)
    if any(d < 0 for d in dims):
        raise WorkloadError(f"input {tensor!r} of {model!r} has variable dims {list(dims)}; "
                            f"give them with --shape {tensor}:D1,D2,... (batch dimension left out)")
    return tuple(dims)


def _npz_arrays(model: str, options: DataOptions) -> dict[str, np.ndarray] | None:
    path = options.npz.get(model, options.npz.get(None))
    if path is None:
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            return {key: data[key] for key in data.files}
    except (OSError, ValueError) as exc:
        raise WorkloadError(f"cannot read {path}: {exc}") from exc


def build_variants(models: Sequence[ModelInputs], priorities: Sequence[PriorityChoice],
                   options: DataOptions, *, deadlines: Sequence[DeadlineChoice] = (),
                   timeout_parameter: bool = False) -> list[Variant]:
    """Every (model, data variant, priority, deadline) request, serialized;
    ``timeout_parameter`` sets each request's ``timeout`` parameter to its deadline (µs, as
    Triton reads it)."""
    rng = np.random.default_rng(options.seed)
    levels = priorities or [PriorityChoice(0)]
    timeouts = [int(d.ms * 1e3) if timeout_parameter else None for d in deadlines] or [None]
    variants = []
    for m, model in enumerate(models):
        arrays = _npz_arrays(model.name, options)
        count = 1 if arrays is not None else DATA_VARIANTS
        for _ in range(count):
            raw = [_raw_input(spec, arrays, rng, options.int_range) for spec in model.inputs]
            for p, level in enumerate(levels):
                for d, timeout_us in enumerate(timeouts):
                    request = _request(model, raw, level.level, timeout_us)
                    variants.append(Variant(request.SerializeToString(), m, p, model.samples, d))
    return variants


def _request(model: ModelInputs, raw: list[bytes], priority: int,
             timeout_us: int | None) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(
        model_name=model.name,
        inputs=[pb.ModelInferRequest.InferInputTensor(name=s.name, datatype=s.datatype, shape=s.shape)
                for s in model.inputs],
        raw_input_contents=raw,
    )
    if priority:
        request.parameters["priority"].uint64_param = priority
    if timeout_us is not None:
        request.parameters["timeout"].int64_param = timeout_us
    return request


def _raw_input(spec: InputSpec, arrays: Mapping[str, np.ndarray] | None,
               rng: np.random.Generator, int_range: tuple[int, int]) -> bytes:
    if arrays is not None:
        return _array_bytes(spec, np.asarray(arrays[spec.name]))
    return random_bytes(spec.datatype, spec.shape, rng, int_range)


def _array_bytes(spec: InputSpec, array: np.ndarray) -> bytes:
    if spec.datatype == "BYTES":
        return bytes_encoding([bytes(v) if not isinstance(v, str) else v.encode()
                              for v in array.reshape(-1)])
    if spec.datatype == "BF16":
        return _bf16(array.astype(np.float32))
    dtype = FIXED_DTYPES.get(spec.datatype)
    if dtype is None:
        raise WorkloadError(f"input {spec.name!r}: datatype {spec.datatype} is not supported")
    if array.dtype != dtype:
        raise WorkloadError(f"input {spec.name!r} is {spec.datatype} ({dtype}); "
                            f"the .npz array is {array.dtype}")
    return np.ascontiguousarray(array).astype(dtype.newbyteorder("<"), copy=False).tobytes()


def random_bytes(datatype: str, shape: Sequence[int], rng: np.random.Generator,
                 int_range: tuple[int, int] = (0, 100)) -> bytes:
    """Raw little-endian bytes of a random tensor of ``datatype`` and ``shape``."""
    count = int(np.prod(shape, dtype=np.int64))
    if datatype == "BYTES":
        letters = rng.integers(ord("a"), ord("z") + 1, size=(count, BYTES_ELEMENT_LENGTH),
                               dtype=np.uint8)
        return bytes_encoding([row.tobytes() for row in letters])
    if datatype == "BF16":
        return _bf16(rng.standard_normal(count, dtype=np.float32))
    dtype = FIXED_DTYPES.get(datatype)
    if dtype is None:
        raise WorkloadError(f"datatype {datatype!r} is not supported")
    if dtype.kind == "f":
        values = rng.standard_normal(count).astype(dtype)
    elif dtype.kind == "b":
        values = rng.integers(0, 2, size=count).astype(dtype)
    else:
        low, high = int_range
        values = rng.integers(max(low, np.iinfo(dtype).min), min(high, np.iinfo(dtype).max),
                              size=count, endpoint=False).astype(dtype)
    return values.astype(dtype.newbyteorder("<"), copy=False).tobytes()


def _bf16(values: np.ndarray) -> bytes:
    """bfloat16 as the top half of each float32 (truncated), little-endian."""
    return (np.ascontiguousarray(values, dtype="<f4").view("<u4") >> 16).astype("<u2").tobytes()

