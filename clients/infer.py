"""An inference request and its result, and their protocol messages."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from batchgate.clients.codec import decode_outputs, encode_inputs
from batchgate.protos import inference_pb2

ParameterValue = bool | int | float | str

# Set through their own arguments, so that they are encoded one way only (as tritonclient does).
_RESERVED_PARAMETERS = frozenset({"priority", "timeout"})


@dataclass(frozen=True)
class InferRequest:
    """One inference, as `Client.stream_infer` takes it (`infer` takes the same as arguments).

    `priority`: the queue priority level, 1 the highest; None or 0 leaves the model's default.
    `timeout_us`: how long the server may keep the request queued, in microseconds.
    `datatypes`: per-input datatype overrides; only "BF16" for a uint16 array of bit patterns.
    `parameters`: extra request parameters (bool, int → int64, float → double, str, or an
    `inference_pb2.InferParameter` for other types).
    """

    model: str
    inputs: Mapping[str, np.ndarray]
    outputs: Sequence[str] | None = None
    version: str = ""
    request_id: str = ""
    priority: int | None = None
    timeout_us: int | None = None
    parameters: Mapping[str, ParameterValue | inference_pb2.InferParameter] | None = None
    datatypes: Mapping[str, str] | None = None

    def to_proto(self) -> inference_pb2.ModelInferRequest:
        """The ModelInferRequest message; raises ValueError/TypeError for bad arguments."""
        if not isinstance(self.model, str) or not self.model:
            raise TypeError(f"model must be a non-empty string, got {self.model!r}")
        if isinstance(self.outputs, str):
            raise TypeError(f"outputs must be a sequence of names, got the string {self.outputs!r}")
        tensors, raws = encode_inputs(self.inputs, self.datatypes)
        request = inference_pb2.ModelInferRequest(
            model_name=self.model,
            model_version=self.version,
            id=self.request_id,
            inputs=tensors,
            outputs=[
                inference_pb2.ModelInferRequest.InferRequestedOutputTensor(name=name)
                for name in self.outputs or ()
            ],
            raw_input_contents=raws,
        )
        # Same encoding as tritonclient: priority as uint64, omitted when 0 (the model's
        # default); timeout in microseconds as int64.
        if self.priority is not None:
            _check_int("priority", self.priority, upper=2**64 - 1)
            if self.priority:
                request.parameters["priority"].uint64_param = self.priority
        if self.timeout_us is not None:
            _check_int("timeout_us", self.timeout_us, upper=2**63 - 1)
            request.parameters["timeout"].int64_param = self.timeout_us
        for key, value in (self.parameters or {}).items():
            if key in _RESERVED_PARAMETERS:
                raise ValueError(
                    f"set {key!r} with the priority= / timeout_us= arguments, not parameters; "
                    f"got parameters[{key!r}]"
                )
            _set_parameter(request.parameters[key], key, value)
        return request


def _check_int(name: str, value: int, *, upper: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if not 0 <= value <= upper:
        raise ValueError(f"{name} must be in [0, {upper}], got {value}")


def _set_parameter(
    target: inference_pb2.InferParameter,
    key: str,
    value: ParameterValue | inference_pb2.InferParameter,
) -> None:
    # bool before int: bool is a subclass of int.
    if isinstance(value, inference_pb2.InferParameter):
        target.CopyFrom(value)
    elif isinstance(value, bool):
        target.bool_param = value
    elif isinstance(value, int):
        if not -(2**63) <= value < 2**63:
            raise ValueError(f"parameter {key!r} does not fit int64, got {value}")
        target.int64_param = value
    elif isinstance(value, float):
        target.double_param = value
    elif isinstance(value, str):
        target.string_param = value
    else:
        raise TypeError(
            f"parameter {key!r} must be bool, int, float, str or InferParameter, got {value!r}"
        )


def parameter_value(parameter: inference_pb2.InferParameter) -> ParameterValue | None:
    """The Python value an InferParameter holds (None when unset)."""
    choice = parameter.WhichOneof("parameter_choice")
    return None if choice is None else getattr(parameter, choice)


@dataclass(frozen=True)
class InferResult:
    """A successful inference: `outputs` (name → numpy array) and the response's metadata.

    `datatypes` gives each output's protocol datatype: the only place that tells a BF16 output
    (returned as uint16 bit patterns) from a UINT16 one.
    """

    outputs: dict[str, np.ndarray]
    model_name: str
    model_version: str
    id: str
    parameters: dict[str, ParameterValue | None] = field(default_factory=dict)
    datatypes: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_proto(cls, response: inference_pb2.ModelInferResponse) -> InferResult:
        """Decode a ModelInferResponse; raises BatchgateError when it is malformed."""
        return cls(
            outputs=decode_outputs(response),
            model_name=response.model_name,
            model_version=response.model_version,
            id=response.id,
            parameters={k: parameter_value(v) for k, v in response.parameters.items()},
            datatypes={o.name: o.datatype for o in response.outputs},
        )
