"""Proto ⇄ numpy for inference: decode and validate a ModelInferRequest against a model's spec,
encode a request's outputs into a ModelInferResponse.

Every check happens here, before a request reaches a queue, so a bad request never joins (and
never fails) a batch. Raw buffers become arrays with ``numpy.frombuffer`` (no copy, no
per-element Python); typed ``contents`` go through one vectorised conversion.

Shapes are checked before anything is allocated from them: the rank first (in O(1), so a
shape of a million dimensions costs nothing), then negative dimensions, then the server's
``RequestLimits``, with the product of the dimensions given up as soon as it passes the limit
(a shape like ``[2**40, 2**40]`` never becomes a huge integer, let alone an array). A limit
refused is RESOURCE_EXHAUSTED, like gRPC's own message-size limit, and its message names the
flag and its value; the shape not matching the model is INVALID_ARGUMENT. Shapes quoted in
messages are cut short, since clients refuse long status messages.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping

import numpy as np

from batchgate.batcher.errors import InvalidRequest, NotSupported, ResourceExhausted, quoted, quoted_list
from batchgate.batcher.request import InferenceRequest, batch_shape_key
from batchgate.batcher.spec import ModelSpec, TensorSpec
from batchgate.protos import inference_pb2 as pb
from batchgate.protos.datatypes import (  # bytes_encoding: also known here by the codec's importers
    BYTES_LENGTH,
    CONTENTS_FIELDS,
    ELEMENT_SIZES,
    NUMPY_DTYPES,
    bytes_encoding,
)
from batchgate.server.rules import messages
from batchgate.server.config.settings import Settings
from batchgate.server.executor.shared_memory import OFF_MESSAGE, Placed, Placement

SHARED_MEMORY_KEYS = ("shared_memory_region", "shared_memory_offset", "shared_memory_byte_size")


# The settings' declared defaults: RequestLimits() is what a server started without flags allows.
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Settings)}


@dataclasses.dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one inference request may ask for: the server's ``--max-*`` settings."""

    max_request_bytes: int = _DEFAULTS["max_message_bytes"]  # --max-request-bytes unset
    """Sum of the input tensors' bytes (``--max-request-bytes``)."""
    max_tensor_elements: int = _DEFAULTS["max_tensor_elements"]
    """Elements of one input tensor, a zero dimension counted as one (``--max-tensor-elements``)."""
    max_reply_bytes: int = _DEFAULTS["max_message_bytes"]
    """The serialized reply, checked before it is built (``--max-message-bytes``)."""


DEFAULT_LIMITS = RequestLimits()


class PlacedRequest(InferenceRequest):
    """A request with tensors in the client's shared-memory regions: ``input_placements`` per
    model input (None: the input is in ``inputs``), ``output_placements`` per requested output
    (None: the output goes in the reply). A placed input's entry in ``inputs`` is None until
    the process holding the registrations puts the region's view there."""

    __slots__ = ("input_placements", "output_placements")


def _is_placed(tensor) -> bool:
    parameters = tensor.parameters
    return bool(parameters) and any(k in parameters for k in SHARED_MEMORY_KEYS)


def _placement(model: str, kind: str, tensor, shape: tuple[int, ...] = ()) -> Placement:
    """The (region, offset, byte size) a tensor's ``shared_memory_*`` parameters name."""
    parameters = tensor.parameters
    where = {"model": model, "tensor": kind, "name": quoted(tensor.name)}
    if "shared_memory_region" not in parameters or "shared_memory_byte_size" not in parameters:
        raise InvalidRequest(messages.PLACEMENT_INCOMPLETE(**where))
    region = parameters["shared_memory_region"]
    which = region.WhichOneof("parameter_choice")
    if which != "string_param":
        raise InvalidRequest(messages.PLACEMENT_REGION_NOT_STRING(**where, kind=which))
    values = []
    for key in ("shared_memory_offset", "shared_memory_byte_size"):
        if key not in parameters:
            values.append(0)
            continue
        param = parameters[key]
        which = param.WhichOneof("parameter_choice")
        if which not in ("int64_param", "uint64_param"):
            raise InvalidRequest(messages.PLACEMENT_NOT_INTEGER(**where, key=key, kind=which))
        value = getattr(param, which)
        if value < 0:
            raise InvalidRequest(messages.PLACEMENT_NEGATIVE(**where, key=key, value=value))
        values.append(value)
    return Placement(region.string_param, values[0], values[1], shape)


def _int_parameter(parameters, key: str) -> int:
    param = parameters[key]
    which = param.WhichOneof("parameter_choice")
    if which in ("int64_param", "uint64_param"):
        value = getattr(param, which)
    else:
        raise InvalidRequest(messages.PARAMETER_NOT_INTEGER(key=key, kind=which))
    if value < 0:
        raise InvalidRequest(messages.PARAMETER_NEGATIVE(key=key, value=value))
    return value


def decode_request(
    msg: pb.ModelInferRequest,
    spec: ModelSpec,
    *,
    deadline: float | None = None,
    limits: RequestLimits = DEFAULT_LIMITS,
    shared_memory: bool = False,
) -> InferenceRequest:
    """An InferenceRequest with inputs in the model's order, or InvalidRequest (the request does
    not fit the model) / ResourceExhausted (it is over one of ``limits``) saying why.

    ``shared_memory``: whether the server serves shared-memory tensors (``--shared-memory``);
    a request naming a region is then a ``PlacedRequest``, checked here for all that can be
    checked without the region (parameter types, byte size against the shape)."""
    name = spec.name
    priority = 0
    timeout_us = 0
    if msg.parameters:
        if "priority" in msg.parameters:
            priority = _int_parameter(msg.parameters, "priority")
        if "timeout" in msg.parameters:
            timeout_us = _int_parameter(msg.parameters, "timeout")

    n_inputs = len(msg.inputs)
    raw = msg.raw_input_contents
    placed = [_is_placed(t) for t in msg.inputs] if any(t.parameters for t in msg.inputs) else ()
    if any(placed) and not shared_memory:
        raise NotSupported(OFF_MESSAGE)
    if raw:
        n_raw = n_inputs - sum(placed)
        if len(raw) != n_raw:
            advice = (messages.RAW_COUNT_ADVICE_PLACED if n_raw != n_inputs
                      else messages.RAW_COUNT_ADVICE)
            raise InvalidRequest(messages.RAW_COUNT(model=name, raw=len(raw), inputs=n_raw,
                                                    advice=advice.text))
    batching = spec.batching.max_batch_size > 0
    arrays: dict[str, np.ndarray | None] = {}
    placements: dict[str, Placement] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    batch_size = -1
    request_bytes = 0
    raw_index = 0
    for index, tensor in enumerate(msg.inputs):
        tspec = spec.input(tensor.name)
        if tspec is None:
            raise InvalidRequest(messages.NO_SUCH_INPUT(
                model=name, input=tensor.name, inputs=quoted_list(t.name for t in spec.inputs)))
        if tensor.name in arrays:
            raise InvalidRequest(messages.INPUT_TWICE(model=name, input=tensor.name))
        if tensor.datatype != tspec.datatype:
            if tensor.datatype == "BYTES":
                raise InvalidRequest(messages.BYTES_NOT_DECLARED(
                    model=name, input=tensor.name, datatype=tspec.datatype))
            raise InvalidRequest(messages.WRONG_DATATYPE(
                model=name, input=tensor.name, datatype=tspec.datatype,
                sent=quoted(tensor.datatype)))
        rows, count, shape = _check_shape(name, tspec, tensor.shape, batching,
                                          spec.batching.max_batch_size, limits)
        if batching:
            if batch_size == -1:
                batch_size = rows
            elif rows != batch_size:
                raise InvalidRequest(messages.BATCH_DISAGREES(
                    model=name, first=batch_size, rows=rows, input=tensor.name))
        if placed and placed[index]:
            placement = _placement(name, "input", tensor, shape)
            if tensor.HasField("contents"):
                raise InvalidRequest(messages.PLACED_WITH_CONTENTS(
                    model=name, name=quoted(tensor.name)))
            size = ELEMENT_SIZES.get(tspec.datatype)
            if size is not None and placement.nbytes != count * size:
                raise InvalidRequest(messages.PLACED_SIZE(
                    model=name, name=quoted(tensor.name), shape=_shape_text(shape),
                    datatype=tspec.datatype, expected=count * size, nbytes=placement.nbytes))
            request_bytes += _nbytes(tspec, count, placement.nbytes)
            _check_request_bytes(name, request_bytes, limits)
            arrays[tensor.name] = None
            placements[tensor.name] = placement
            shapes[tensor.name] = shape
        elif raw:
            if tensor.HasField("contents"):
                raise InvalidRequest(messages.RAW_WITH_CONTENTS(model=name, input=tensor.name))
            buffer = raw[raw_index]
            raw_index += 1
            request_bytes += _nbytes(tspec, count, len(buffer))
            _check_request_bytes(name, request_bytes, limits)
            arrays[tensor.name] = _from_raw(name, tspec, shape, count, buffer)
        else:
            request_bytes += _nbytes(tspec, count, tensor.contents.ByteSize())
            _check_request_bytes(name, request_bytes, limits)
            arrays[tensor.name] = _from_contents(name, tspec, shape, count, tensor)

    if len(arrays) != len(spec.inputs):
        missing = [t.name for t in spec.inputs if t.name not in arrays]
        raise InvalidRequest(messages.MISSING_INPUTS(model=name, inputs=quoted_list(missing)))

    requested = None
    output_placements = None
    if msg.outputs:
        requested = []
        seen = set()
        for index, out in enumerate(msg.outputs):
            if spec.output(out.name) is None:
                raise InvalidRequest(messages.NO_SUCH_OUTPUT(
                    model=name, output=out.name,
                    outputs=quoted_list(t.name for t in spec.outputs)))
            # Triton refuses it too; each repeat would cost the reply the output's bytes again.
            if out.name in seen:
                raise InvalidRequest(messages.OUTPUT_TWICE(model=name, output=out.name))
            seen.add(out.name)
            requested.append(out.name)
            if out.parameters and _is_placed(out):
                if not shared_memory:
                    raise NotSupported(OFF_MESSAGE)
                if output_placements is None:
                    output_placements = [None] * len(msg.outputs)
                output_placements[index] = _placement(name, "output", out)

    ordered = [arrays[t.name] for t in spec.inputs]
    if placements:
        shape_list = [shapes[t.name] if arrays[t.name] is None else arrays[t.name].shape
                      for t in spec.inputs]
    else:
        shape_list = [a.shape for a in ordered]
    cls = PlacedRequest if placements or output_placements else InferenceRequest
    request = cls(
        ordered,
        batch_size=batch_size if batching else 1,
        request_id=msg.id,
        priority=priority,
        deadline=deadline,
        timeout_us=timeout_us,
        requested_outputs=requested,
        shape_key=batch_shape_key(shape_list, batching=batching),
    )
    if cls is PlacedRequest:
        request.input_placements = tuple(placements.get(t.name) for t in spec.inputs)
        request.output_placements = (tuple(output_placements) if output_placements
                                     else (None,) * len(requested or ()))
    return request


def _check_shape(model: str, tspec: TensorSpec, wire_shape, batching: bool, max_batch: int,
                 limits: RequestLimits) -> tuple[int, int, tuple[int, ...]]:
    """``(rows, elements, shape)`` of an input whose shape fits the model and the limits."""
    dims = tspec.dims
    if len(wire_shape) != len(dims) + batching:
        raise InvalidRequest(_shape_mismatch(model, tspec, batching, wire_shape))
    shape = tuple(wire_shape)
    if any(d < 0 for d in shape):
        raise InvalidRequest(messages.NEGATIVE_DIMENSION(
            model=model, input=tspec.name, shape=_shape_text(shape)))
    count = _element_count(model, tspec, shape, limits.max_tensor_elements)
    rows = 1
    body = shape
    if batching:
        rows = shape[0]
        body = shape[1:]
        if rows < 1 or rows > max_batch:
            raise InvalidRequest(messages.BATCH_SIZE_RANGE(
                model=model, max_batch_size=max_batch, rows=rows, input=tspec.name))
    if any(d != -1 and d != s for d, s in zip(dims, body)):
        raise InvalidRequest(_shape_mismatch(model, tspec, batching, shape))
    return rows, count, shape


def _element_count(model: str, tspec: TensorSpec, shape: tuple, limit: int) -> int:
    """The product of ``shape``; ResourceExhausted as soon as the product of its non-zero
    dimensions passes ``limit`` (a zero dimension does not make ``[2**62, 0]`` harmless:
    numpy refuses such a shape)."""
    extent = 1
    count = 1
    for d in shape:
        extent *= d or 1
        count *= d
        if extent > limit:
            raise ResourceExhausted(messages.TOO_MANY_ELEMENTS(
                model=model, input=tspec.name, shape=_shape_text(shape), most=limit))
    return count


def _nbytes(tspec: TensorSpec, count: int, wire_bytes: int) -> int:
    """Bytes an input counts for against --max-request-bytes: its decoded size, or for BYTES
    (variable length) what it takes on the wire."""
    size = ELEMENT_SIZES.get(tspec.datatype)
    return wire_bytes if size is None else count * size


def _check_request_bytes(model: str, request_bytes: int, limits: RequestLimits) -> None:
    if request_bytes > limits.max_request_bytes:
        raise ResourceExhausted(messages.TOO_MANY_BYTES(model=model,
                                                        most=limits.max_request_bytes))


def _shape_mismatch(model: str, tspec: TensorSpec, batching: bool, shape) -> str:
    expected = (["batch"] if batching else []) + [str(d) for d in tspec.dims]
    return messages.SHAPE_MISMATCH(model=model, input=tspec.name, expected=", ".join(expected),
                                   shape=_shape_text(shape))


def _shape_text(shape) -> str:
    if len(shape) <= messages.SHOWN_DIMENSIONS:
        return str(list(shape))
    return messages.SHAPE_CUT(shown=", ".join(str(d) for d in shape[:messages.SHOWN_DIMENSIONS]),
                              dimensions=len(shape))


def _from_raw(model: str, tspec: TensorSpec, shape: tuple, count: int,
              buffer: bytes) -> np.ndarray:
    if tspec.datatype == "BYTES":
        return _bytes_from_raw(model, tspec, shape, count, buffer)
    expected = count * ELEMENT_SIZES[tspec.datatype]
    if len(buffer) != expected:
        raise InvalidRequest(messages.RAW_SIZE(
            model=model, input=tspec.name, shape=list(shape), datatype=tspec.datatype,
            expected=expected, sent=len(buffer)))
    if tspec.datatype == "BOOL" and buffer and np.frombuffer(buffer, np.uint8).max() > 1:
        # Any other byte is not a bool: torch would compute with it (~x of 2 is still true).
        raise InvalidRequest(messages.BOOL_NOT_0_OR_1(model=model, input=tspec.name))
    return np.frombuffer(buffer, dtype=NUMPY_DTYPES[tspec.datatype]).reshape(shape)


def _bytes_from_raw(model: str, tspec: TensorSpec, shape: tuple, count: int,
                    buffer: bytes) -> np.ndarray:
    items = _split_bytes(buffer, count)
    if items is None:
        raise InvalidRequest(messages.BYTES_NOT_ENCODED(model=model, input=tspec.name,
                                                        count=count))
    return _object_array(items, shape)


def _split_bytes(buffer, count: int) -> list[bytes] | None:
    """The ``count`` elements of a BYTES tensor's encoding (a 4-byte little-endian length,
    then that many bytes, per element), or None when ``buffer`` is not exactly that."""
    items = []
    offset = 0
    size = len(buffer)
    while offset < size and len(items) < count:
        if offset + 4 > size:
            break
        (length,) = BYTES_LENGTH.unpack_from(buffer, offset)
        offset += 4
        if offset + length > size:
            break
        items.append(bytes(buffer[offset:offset + length]))
        offset += length
    if len(items) != count or offset != size:
        return None
    return items


def _object_array(items: list[bytes], shape: tuple) -> np.ndarray:
    array = np.empty(len(items), dtype=object)
    array[:] = items
    return array.reshape(shape)


def bytes_array(buffer, shape: tuple) -> np.ndarray:
    """The numpy object array (what models take) of a BYTES tensor's encoding, which a front
    end has checked; ValueError when it is not a tensor of ``shape``."""
    count = 1
    for d in shape:
        count *= d
    items = _split_bytes(buffer, count)
    if items is None:
        raise ValueError(f"the buffer is not a BYTES tensor of shape {list(shape)}")
    return _object_array(items, tuple(shape))


def _from_contents(model: str, tspec: TensorSpec, shape: tuple, count: int,
                   tensor) -> np.ndarray:
    datatype = tspec.datatype
    if datatype == "BYTES":
        values = tensor.contents.bytes_contents
        if len(values) != count:
            raise InvalidRequest(messages.BYTES_CONTENTS_COUNT(
                model=model, input=tspec.name, shape=list(shape), count=count,
                sent=len(values)))
        array = np.empty(count, dtype=object)
        array[:] = list(values)
        return array.reshape(shape)
    typed = CONTENTS_FIELDS.get(datatype)
    if typed is None:
        raise InvalidRequest(messages.NO_TYPED_CONTENTS(model=model, input=tspec.name,
                                                        datatype=datatype))
    field, wire_dtype = typed
    values = getattr(tensor.contents, field)
    if len(values) != count:
        raise InvalidRequest(messages.CONTENTS_COUNT(
            model=model, input=tspec.name, shape=list(shape), count=count, field=field,
            sent=len(values)))
    wire = np.array(values, dtype=wire_dtype)
    target = NUMPY_DTYPES[datatype]
    if wire_dtype == target:
        return wire.reshape(shape)
    array = wire.astype(target)
    if not np.array_equal(array, wire):
        raise InvalidRequest(messages.CONTENTS_OUT_OF_RANGE(model=model, input=tspec.name,
                                                            datatype=datatype))
    return array.reshape(shape)


def encode_outputs(
    response: pb.ModelInferResponse,
    spec: ModelSpec,
    outputs: Mapping[str, np.ndarray | Placed],
    requested: tuple[str, ...] | None,
    *,
    max_reply_bytes: int | None = None,
    stream: bool = False,
) -> pb.ModelInferResponse:
    """Fill ``response`` with the requested outputs (all when none were named) as raw bytes.

    ``max_reply_bytes``: ResourceExhausted, before any output's bytes are copied into the
    reply, when the serialized reply (inside a ModelStreamInferResponse, with ``stream``)
    would take more."""
    names = requested if requested is not None else [o.name for o in spec.outputs]
    tensors = response.outputs
    raws: list = []
    for name in names:
        array = outputs[name]
        datatype = spec.output(name).datatype
        tensors.add(name=name, datatype=datatype, shape=array.shape)
        if type(array) is Placed:
            # Written into the client's region: an empty entry keeps raw_output_contents
            # aligned with outputs, as clients index them together (Triton does the same).
            raws.append(b"")
        elif datatype == "BYTES":
            raws.append(bytes_encoding(array))
        else:
            raws.append(array)  # copied once it is known to fit
    if max_reply_bytes is not None:
        size = response.ByteSize()
        for raw in raws:
            size += _length_delimited(raw.nbytes if isinstance(raw, np.ndarray) else len(raw))
        if stream:
            size = _length_delimited(size)
        if size > max_reply_bytes:
            raise ResourceExhausted(messages.REPLY_TOO_LARGE(model=spec.name, size=size,
                                                             most=max_reply_bytes))
    response.raw_output_contents.extend(
        raw.tobytes() if isinstance(raw, np.ndarray) else raw for raw in raws)
    return response


def _length_delimited(size: int) -> int:
    """What a length-delimited field of ``size`` bytes takes, numbered under 16 (a one-byte
    tag): the tag, the varint of its length, its bytes."""
    return 1 + max(1, (size.bit_length() + 6) // 7) + size


def bytes_row_offsets(array: np.ndarray) -> np.ndarray:
    """Where each row of ``array`` (batch dimension first, ``bytes`` elements) starts in its
    :func:`bytes_encoding`, and where the last ends: ``len(array) + 1`` offsets, so a request's
    rows of a batch's encoding are one slice of it."""
    rows = len(array)
    flat = array.reshape(-1)
    lengths = np.fromiter(map(len, flat), dtype=np.int64, count=flat.size)
    per_row = (lengths.reshape(rows, -1).sum(axis=1)
               + BYTES_LENGTH.size * (flat.size // max(rows, 1)))
    offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(per_row, out=offsets[1:])
    return offsets


def deadline_from(time_remaining: float | None) -> float | None:
    """A monotonic deadline from gRPC's ``context.time_remaining()``."""
    if time_remaining is None:
        return None
    return time.monotonic() + time_remaining
