"""Read a Triton ``config.pbtxt``, or a load request's config, and say what it sets that is not acted on.

- :func:`read_model_config` parses the file (protobuf text format of Triton's ``ModelConfig``)
  and lists the fields that are set but that batchgate does not act on, so the repository can
  say so once at load instead of dropping them silently (:func:`unsupported_fields`);
- :func:`config_from_json` parses the ``config`` parameter of a load request (the same message
  as JSON) that replaces the file.

What the parsed config becomes is ``server/config/model_spec.py``'s (the ``ModelSpec``),
``server/config/model_parameters.py``'s (the ``parameters`` keys) and ``server/executor/warmup.py``'s (the
``model_warmup`` samples).
"""

from __future__ import annotations

import json
from pathlib import Path

from google.protobuf import json_format, text_format
from google.protobuf.message import Message

from batchgate.batcher.errors import InvalidRequest, LoadError
from batchgate.protos import model_config_pb2
from batchgate.server.config.model_parameters import IGNORED_TRITON_PARAMETERS

CONFIG_FILENAME = "config.pbtxt"
PLATFORM = "pytorch_libtorch"
BACKEND = "pytorch"

# Top-level fields batchgate acts on; any other field that is set is reported.
_SUPPORTED_FIELDS = frozenset(
    {
        "name",
        "platform",
        "backend",
        "version_policy",
        "max_batch_size",
        "input",
        "output",
        "instance_group",
        "default_model_filename",
        "dynamic_batching",
        "parameters",
        "model_warmup",
    }
)

# Sub-fields, per message type, that are carried but not acted on.
_UNSUPPORTED_INPUT_FIELDS = (
    "reshape", "is_shape_tensor", "allow_ragged_batch", "optional", "is_non_linear_format_io",
)
_UNSUPPORTED_OUTPUT_FIELDS = (
    "label_filename", "reshape", "is_shape_tensor", "is_non_linear_format_io",
)
_UNSUPPORTED_INSTANCE_FIELDS = (
    "profile", "rate_limiter", "passive", "secondary_devices", "host_policy",
)

_Kind = model_config_pb2.ModelInstanceGroup.Kind


def read_model_config(model_dir: Path) -> tuple[model_config_pb2.ModelConfig, list[str]]:
    """Parse ``model_dir/config.pbtxt``; return it and the fields set that are not acted on."""
    path = model_dir / CONFIG_FILENAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LoadError(
            f"{path}: not found; every model folder needs a {CONFIG_FILENAME}"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise LoadError(f"{path}: cannot be read: {exc}") from None

    config = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        line = exc.GetLine()
        where = f"line {line}" if line else "parse error"
        message = str(exc)
        # ParseError's text starts with "line:column : " when the position is known.
        prefix, sep, rest = message.partition(" : ")
        if sep and prefix.replace(":", "").isdigit():
            message = rest
        raise LoadError(f"{path}: {where}: {message}") from None

    folder = model_dir.name
    if not config.name:
        config.name = folder
    elif config.name != folder:
        raise LoadError(
            f"{path}: name must match the model's folder name {folder!r}, got {config.name!r}"
        )
    return config, unsupported_fields(config)


def config_from_json(text: str) -> model_config_pb2.ModelConfig:
    """A load request's ``config`` parameter: a ``ModelConfig`` in protobuf's JSON mapping
    (field names as in the proto or in lowerCamelCase). Unknown fields are refused, as
    malformed JSON is: InvalidRequest naming what is wrong."""
    try:
        document = json.loads(text)
    except ValueError as exc:  # json.JSONDecodeError
        raise InvalidRequest(f"load parameter 'config' is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest("load parameter 'config' is not valid JSON: nested too deeply") from None
    if not isinstance(document, dict):
        raise InvalidRequest(
            "load parameter 'config' must be a JSON object (a ModelConfig), "
            f"got a JSON {type(document).__name__}")
    config = model_config_pb2.ModelConfig()
    try:
        json_format.ParseDict(document, config)
    except (json_format.ParseError, RecursionError) as exc:
        # The first line says what and where; protobuf then lists every field name.
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidRequest(f"load parameter 'config' is not a ModelConfig: {first}") from None
    return config


def unsupported_fields(config: model_config_pb2.ModelConfig) -> list[str]:
    """Dotted names of the fields set in ``config`` that batchgate does not act on."""
    found: list[str] = []
    for field, _ in config.ListFields():
        if field.name not in _SUPPORTED_FIELDS:
            if field.name == "optimization":
                found.extend(_set_paths(config.optimization, "optimization"))
            else:
                found.append(field.name)

    policy = config.version_policy.WhichOneof("policy_choice")
    if policy in ("all", "specific"):
        found.append(f"version_policy.{policy} (the latest version is served)")
    elif policy == "latest" and config.version_policy.latest.num_versions > 1:
        found.append("version_policy.latest.num_versions (one version is served)")

    for tensor in config.input:
        found.extend(
            f"input[{tensor.name}].{name}"
            for name in _UNSUPPORTED_INPUT_FIELDS
            if _is_set(tensor, name)
        )
    for tensor in config.output:
        found.extend(
            f"output[{tensor.name}].{name}"
            for name in _UNSUPPORTED_OUTPUT_FIELDS
            if _is_set(tensor, name)
        )

    if config.HasField("dynamic_batching") and config.dynamic_batching.preserve_ordering:
        found.append("dynamic_batching.preserve_ordering")

    for index, group in enumerate(config.instance_group):
        label = group.name or str(index)
        found.extend(
            f"instance_group[{label}].{name}"
            for name in _UNSUPPORTED_INSTANCE_FIELDS
            if _is_set(group, name)
        )
        if group.kind == _Kind.KIND_MODEL:
            found.append(f"instance_group[{label}].kind KIND_MODEL (treated as KIND_AUTO)")
        if len(group.gpus) > 1:
            found.append(f"instance_group[{label}].gpus (only the first GPU is used)")
    if len({(g.kind, tuple(g.gpus[:1])) for g in config.instance_group}) > 1:
        found.append("instance_group (groups on different devices: all run on the first group's)")

    found.extend(
        f"parameters.{key}"
        for key in sorted(config.parameters)
        if key in IGNORED_TRITON_PARAMETERS
    )
    return found


def _is_set(message: Message, field_name: str) -> bool:
    # ListFields() holds exactly the fields that are set: present messages, non-empty repeated
    # fields, scalars away from their default.
    return any(field.name == field_name for field, _ in message.ListFields())


def _set_paths(message: Message, prefix: str) -> list[str]:
    """Leaf paths of the fields set under ``message`` (``optimization.cuda.graphs``)."""
    paths: list[str] = []
    for field, value in message.ListFields():
        path = f"{prefix}.{field.name}"
        if isinstance(value, Message):  # a singular sub-message: name its leaves
            paths.extend(_set_paths(value, path) or [path])
        else:
            paths.append(path)
    return paths


def datatype_from_proto(data_type: int) -> str:
    """Triton's ``DataType`` enum value -> KServe v2 datatype string (TYPE_STRING -> BYTES)."""
    if data_type == model_config_pb2.TYPE_STRING:
        return "BYTES"
    valid = model_config_pb2.DataType.values()
    if data_type == model_config_pb2.TYPE_INVALID or data_type not in valid:
        raise ValueError(f"data_type must be a valid TYPE_*, got {data_type}")
    return model_config_pb2.DataType.Name(data_type).removeprefix("TYPE_")


def datatype_to_proto(datatype: str) -> int:
    """KServe v2 datatype string -> Triton's ``DataType`` enum value (BYTES -> TYPE_STRING)."""
    if datatype == "BYTES":
        return model_config_pb2.TYPE_STRING
    try:
        return model_config_pb2.DataType.Value(f"TYPE_{datatype}")
    except ValueError:
        raise ValueError(f"unknown datatype, got {datatype!r}") from None
