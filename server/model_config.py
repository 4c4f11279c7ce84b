"""Read a Triton ``config.pbtxt`` and turn it into the batcher's :class:`~batcher.spec.ModelSpec`.

Three steps, each a function:

- :func:`read_model_config` parses the file (protobuf text format of Triton's ``ModelConfig``)
  and lists the fields that are set but that batchgate does not act on, so the repository can
  say so once at load instead of dropping them silently; :func:`config_from_json` parses the
  ``config`` parameter of a load request (the same message as JSON) that replaces the file;
- :func:`model_spec_from_config` resolves the config into a ``ModelSpec``: datatypes, device,
  instance count, batching and queue policies, and the ``parameters`` below;
- :func:`effective_config` is the config the server reports through the ModelConfig RPC: the
  parsed one with defaults filled in and the resolved settings written back.

``parameters`` entries (``parameters: { key: "K" value: { string_value: "V" } }``) that batchgate
reads are listed in :data:`PARAMETERS`; every entry, known or not, is also handed to a
``model.py``'s ``build_model(parameters)``.

``model_warmup`` samples become the arrays :func:`warmup_inputs` returns, which the model runs
before it reports ready (without ``model_warmup`` the batcher warms up with zeros at its batch
sizes). ``input_data_file`` is read from the model's ``warmup/`` folder, as Triton does.

Without ``dynamic_batching`` a model runs each request on its own, as Triton's default scheduler
does: ``BatchingConfig.dynamic_batching`` is False and the batcher never combines requests. A
client may still send its own batch of up to ``max_batch_size`` samples.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

import numpy as np
from google.protobuf import json_format, text_format
from google.protobuf.message import Message

from batcher.errors import InvalidRequest, LoadError
from batcher.buckets import default_buckets
from batcher.spec import (
    BATCH_POLICIES,
    NUMPY_DTYPES,
    INPUT_STAGING,
    PRECISION_ALIASES,
    PRECISIONS,
    BatchingConfig,
    ModelSpec,
    QueuePolicy,
    TensorSpec,
)
from protos import model_config_pb2

CONFIG_FILENAME = "config.pbtxt"
WARMUP_FOLDER = "warmup"
_WARMUP_SEED = 0
PLATFORM = "pytorch_libtorch"
BACKEND = "pytorch"

# batchgate's own parameter keys: key -> what it sets. README's parameter table comes from here.
PARAMETERS: Mapping[str, str] = {
    "precision": (
        "fp32 | amp-fp16 | amp-bf16 | fp16-weights: autocast to fp16 or bf16, or the weights "
        "converted to fp16 (default fp32; fp16 and bf16 are accepted for amp-fp16 and amp-bf16)"
    ),
    "buckets": (
        "batch sizes a batch is padded up to: a list (1,4,16,64), pow2 (1, 2, 4, ... up to "
        "max_batch_size) or none; default pow2 on a GPU, none on the CPU"
    ),
    "cuda_graphs": "true | false: capture a CUDA graph per bucket at load (default false)",
    "input_staging": (
        "queue | batch: copy a request's inputs to the device as soon as it is queued, or when "
        "its batch is assembled (default queue on a GPU, batch on the CPU)"
    ),
    "min_batch_size": (
        "MIN_BATCH: with a queue delay, dispatch once this many samples wait "
        "(default: largest preferred_batch_size, else max_batch_size)"
    ),
    "max_inflight_batches": (
        "batches in flight per instance: one assembling while one computes (default 2 on a "
        "GPU, 1 on the CPU; always 1 under batch_policy deadline)"
    ),
    "warmup": "true | false: run the model before reporting it ready (default true)",
    "execution_timeout_ms": (
        "a batch still running after this long fails (INTERNAL) and the instance goes on on a "
        "fresh thread; 0 = no limit (default 0; costs one thread hand-off per batch)"
    ),
    "batch_policy": (
        "fifo | deadline: arrival order, or earliest deadline first with batches sized from the "
        "latency profile (default fifo)"
    ),
    "slo_ms": (
        "the model's latency objective in ms: target of the SLO attainment metric and, under "
        "the deadline policy, the scheduling deadline of requests without an earlier one (0: none)"
    ),
    "response_margin_ms": (
        "ms kept free before every deadline (deadline policy, admission control) for an answer "
        "to reach its client, on top of the delivery measured inside the server (default 5)"
    ),
    "admission": (
        "true | false: refuse at once (RESOURCE_EXHAUSTED) a request whose estimated queue wait "
        "exceeds its deadline (default true)"
    ),
    "device_share_weight": (
        "> 0: run batches in weighted turns with the other models on the device that set one "
        "(default 0: no turns)"
    ),
}

# Keys of Triton's PyTorch backend that batchgate honours.
TRITON_PARAMETERS: Mapping[str, str] = {
    "INTRA_OP_THREAD_COUNT": (
        "threads inside one operator, set in each executor thread (0: torch's default)"
    ),
    "INTER_OP_THREAD_COUNT": "threads across independent operators (0: torch's default)",
}

# Keys of Triton's PyTorch backend that batchgate reads but does not act on.
_IGNORED_TRITON_PARAMETERS = frozenset(
    {
        "DISABLE_OPTIMIZED_EXECUTION",
        "INFERENCE_MODE",
        "DISABLE_CUDNN",
        "ENABLE_NVFUSER",
        "ENABLE_JIT_EXECUTOR",
        "ENABLE_JIT_PROFILING",
        "ENABLE_TENSOR_FUSER",
        "ENABLE_WEIGHT_SHARING",
        "ENABLE_CACHE_CLEANING",
        "NUM_THREADS",
    }
)

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
        if key in _IGNORED_TRITON_PARAMETERS
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


def model_spec_from_config(
    config: model_config_pb2.ModelConfig, version: str, *, cuda_available: bool
) -> ModelSpec:
    """Resolve ``config`` (as returned by :func:`read_model_config`) into a ``ModelSpec``."""
    name = config.name
    _check_backend(config)
    if config.max_batch_size < 0:
        raise LoadError(f"model {name!r}: max_batch_size must be >= 0, got {config.max_batch_size}")
    params = {key: value.string_value for key, value in config.parameters.items()}

    inputs = tuple(
        _tensor_spec(name, "input", t.name, t.data_type, t.dims, t.optional) for t in config.input
    )
    outputs = tuple(
        _tensor_spec(name, "output", t.name, t.data_type, t.dims, False) for t in config.output
    )
    _check_unique(name, "input", [t.name for t in inputs])
    _check_unique(name, "output", [t.name for t in outputs])

    batching = _batching_config(config, params)
    device = _device(config, cuda_available=cuda_available)
    on_gpu = device.startswith("cuda")
    try:
        return ModelSpec(
            name=name,
            version=version,
            platform=PLATFORM,
            inputs=inputs,
            outputs=outputs,
            batching=batching,
            instance_count=_instance_count(config),
            device=device,
            precision=_choice(name, params, "precision",
                              (*PRECISIONS, *PRECISION_ALIASES), "fp32"),
            intra_op_threads=_int_param(name, params, "INTRA_OP_THREAD_COUNT", 0, minimum=0),
            inter_op_threads=_int_param(name, params, "INTER_OP_THREAD_COUNT", 0, minimum=0),
            warmup=_bool_param(name, params, "warmup", True),
            buckets=_buckets(name, params, batching.max_batch_size, on_gpu=on_gpu),
            cuda_graphs=_bool_param(name, params, "cuda_graphs", False),
            input_staging=_choice(name, params, "input_staging", INPUT_STAGING,
                                  "queue" if on_gpu else "batch"),
            execution_timeout_ms=_int_param(name, params, "execution_timeout_ms", 0, minimum=0),
        )
    except ValueError as exc:
        raise LoadError(f"model {name!r}: {exc}") from None


def effective_config(
    config: model_config_pb2.ModelConfig, spec: ModelSpec,
    load_report: Mapping[str, str] | None = None,
) -> model_config_pb2.ModelConfig:
    """The config as served: ``config`` with defaults and resolved settings filled in, plus what
    the load found out (``load_report``: the precision check's error, CUDA graphs, memory plan)."""
    out = model_config_pb2.ModelConfig()
    out.CopyFrom(config)
    out.name = spec.name
    out.platform = PLATFORM
    out.backend = BACKEND
    # Whatever the policy asked for, one version (the latest) is what is served.
    out.version_policy.latest.num_versions = 1

    group_name = config.instance_group[0].name if config.instance_group else ""
    del out.instance_group[:]
    group = out.instance_group.add(name=group_name or spec.name, count=spec.instance_count)
    if spec.device.startswith("cuda"):
        group.kind = _Kind.KIND_GPU
        group.gpus.append(_device_index(spec.device))
    else:
        group.kind = _Kind.KIND_CPU

    if out.HasField("dynamic_batching"):
        batching = spec.batching
        dynamic = out.dynamic_batching
        if batching.priority_levels:
            dynamic.default_priority_level = batching.default_level
        _fill_queue_policy(dynamic.default_queue_policy, batching.default_queue_policy)

    resolved = {
        "precision": spec.precision,
        "min_batch_size": str(spec.batching.effective_min_batch),
        "max_inflight_batches": str(spec.inflight_batches),
        "warmup": "true" if spec.warmup else "false",
        "execution_timeout_ms": str(spec.execution_timeout_ms),
        "batch_policy": spec.batching.policy,
        "slo_ms": f"{spec.batching.slo_ms:g}",
        "response_margin_ms": f"{spec.batching.response_margin_ms:g}",
        "admission": "true" if spec.batching.admission else "false",
        "device_share_weight": f"{spec.batching.device_share_weight:g}",
        "INTRA_OP_THREAD_COUNT": str(spec.intra_op_threads),
        "INTER_OP_THREAD_COUNT": str(spec.inter_op_threads),
        "buckets": ",".join(map(str, spec.buckets)) if spec.buckets else "none",
        "cuda_graphs": "true" if spec.cuda_graphs else "false",
        "input_staging": spec.input_staging,
        **(load_report or {}),
    }
    for key, value in resolved.items():
        out.parameters[key].string_value = value
    return out


def _check_backend(config: model_config_pb2.ModelConfig) -> None:
    if config.backend not in ("", BACKEND):
        raise LoadError(
            f"model {config.name!r}: batchgate serves PyTorch models only "
            f"(backend {BACKEND!r}), got backend {config.backend!r}"
        )
    if config.platform not in ("", PLATFORM):
        raise LoadError(
            f"model {config.name!r}: batchgate serves PyTorch models only "
            f"(platform {PLATFORM!r}), got platform {config.platform!r}"
        )


def _tensor_spec(
    model: str, role: str, name: str, data_type: int, dims, optional: bool
) -> TensorSpec:
    if not name:
        raise LoadError(f"model {model!r}: every {role} needs a name")
    try:
        datatype = datatype_from_proto(data_type)
        return TensorSpec(
            name=name, datatype=datatype, dims=tuple(int(d) for d in dims), optional=optional
        )
    except ValueError as exc:
        raise LoadError(f"model {model!r}: {role} {name!r}: {exc}") from None


def _check_unique(model: str, role: str, names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise LoadError(f"model {model!r}: {role} names must be unique, got {name!r} twice")
        seen.add(name)


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


def _batching_config(
    config: model_config_pb2.ModelConfig, params: Mapping[str, str]
) -> BatchingConfig:
    name = config.name
    max_batch = config.max_batch_size
    min_batch = _int_param(name, params, "min_batch_size", 0, minimum=0)
    if min_batch > max(max_batch, 1):
        raise LoadError(
            f"model {name!r}: parameter min_batch_size must lie in 0..max_batch_size "
            f"({max_batch}), got {params['min_batch_size']!r}"
        )
    inflight = _int_param(name, params, "max_inflight_batches", 0, minimum=1)  # 0: by device
    scheduling = {
        "policy": _choice(name, params, "batch_policy", BATCH_POLICIES, "fifo"),
        "slo_ms": _float_param(name, params, "slo_ms", 0.0),
        "response_margin_ms": _float_param(name, params, "response_margin_ms", 5.0),
        "admission": _bool_param(name, params, "admission", True),
        "device_share_weight": _float_param(name, params, "device_share_weight", 0.0),
    }
    if not config.HasField("dynamic_batching"):
        return _batching(name, max_batch_size=max_batch, min_batch_size=min_batch,
                         max_inflight_batches=inflight, dynamic_batching=False, **scheduling)

    dynamic = config.dynamic_batching
    levels = dynamic.priority_levels
    if dynamic.default_priority_level > levels:
        raise LoadError(
            f"model {name!r}: dynamic_batching.default_priority_level must lie in "
            f"0..priority_levels ({levels}), got {dynamic.default_priority_level}"
        )
    per_level: dict[int, QueuePolicy] = {}
    for level, policy in dynamic.priority_queue_policy.items():
        if not 1 <= level <= levels:
            raise LoadError(
                f"model {name!r}: dynamic_batching.priority_queue_policy keys must lie in "
                f"1..priority_levels ({levels}), got {level}"
            )
        per_level[int(level)] = queue_policy_from_proto(policy)
    default_policy = (
        queue_policy_from_proto(dynamic.default_queue_policy)
        if dynamic.HasField("default_queue_policy")
        else QueuePolicy()
    )
    return _batching(
        name,
        max_batch_size=max_batch,
        preferred_batch_sizes=tuple(sorted(set(dynamic.preferred_batch_size))),
        max_queue_delay_us=dynamic.max_queue_delay_microseconds,
        min_batch_size=min_batch,
        priority_levels=levels,
        default_priority_level=dynamic.default_priority_level,
        default_queue_policy=default_policy,
        priority_queue_policy=per_level,
        max_inflight_batches=inflight,
        dynamic_batching=True,
        **scheduling,
    )


def _batching(model: str, **fields) -> BatchingConfig:
    try:
        return BatchingConfig(**fields)
    except ValueError as exc:
        raise LoadError(f"model {model!r}: {exc}") from None


def queue_policy_from_proto(policy: model_config_pb2.ModelQueuePolicy) -> QueuePolicy:
    """Triton's ``ModelQueuePolicy`` as written in the config (proto3 defaults included)."""
    return QueuePolicy(
        max_queue_size=policy.max_queue_size,
        default_timeout_us=policy.default_timeout_microseconds,
        allow_timeout_override=policy.allow_timeout_override,
        timeout_action_delay=policy.timeout_action == model_config_pb2.ModelQueuePolicy.DELAY,
    )


def _fill_queue_policy(out: model_config_pb2.ModelQueuePolicy, policy: QueuePolicy) -> None:
    out.max_queue_size = policy.max_queue_size
    out.default_timeout_microseconds = policy.default_timeout_us
    out.allow_timeout_override = policy.allow_timeout_override
    out.timeout_action = (
        model_config_pb2.ModelQueuePolicy.DELAY
        if policy.timeout_action_delay
        else model_config_pb2.ModelQueuePolicy.REJECT
    )


def _instance_count(config: model_config_pb2.ModelConfig) -> int:
    if not config.instance_group:
        return 1
    for group in config.instance_group:
        if group.count < 0:
            raise LoadError(
                f"model {config.name!r}: instance_group count must be >= 0, got {group.count}"
            )
    # Triton treats a count of 0 (unset) as 1.
    return sum(group.count or 1 for group in config.instance_group)


def _device(config: model_config_pb2.ModelConfig, *, cuda_available: bool) -> str:
    group = config.instance_group[0] if config.instance_group else None
    kind = group.kind if group is not None else _Kind.KIND_AUTO
    if kind == _Kind.KIND_CPU:
        return "cpu"
    if kind == _Kind.KIND_GPU:
        if not cuda_available:
            raise LoadError(
                f"model {config.name!r} asks for KIND_GPU but this machine has no CUDA device"
            )
        gpu = group.gpus[0] if group.gpus else 0
        if gpu < 0:
            raise LoadError(f"model {config.name!r}: instance_group gpus must be >= 0, got {gpu}")
        return f"cuda:{gpu}"
    return "cuda:0" if cuda_available else "cpu"


def _device_index(device: str) -> int:
    _, _, index = device.partition(":")
    return int(index) if index else 0


def _int_param(
    model: str, params: Mapping[str, str], key: str, default: int, *, minimum: int
) -> int:
    raw = params.get(key)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise LoadError(
            f"model {model!r}: parameter {key} must be an integer >= {minimum}, got {raw!r}"
        )
    return value


def _float_param(model: str, params: Mapping[str, str], key: str, default: float) -> float:
    """A finite number >= 0."""
    raw = params.get(key)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw.strip())
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise LoadError(f"model {model!r}: parameter {key} must be a number >= 0, got {raw!r}")
    return value


def _bool_param(model: str, params: Mapping[str, str], key: str, default: bool) -> bool:
    raw = params.get(key)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in ("true", "false"):
        raise LoadError(f"model {model!r}: parameter {key} must be true or false, got {raw!r}")
    return value == "true"


def _buckets(model: str, params: Mapping[str, str], max_batch: int, *, on_gpu: bool
             ) -> tuple[int, ...]:
    raw = params.get("buckets")
    value = (raw or "").strip().lower()
    if not value:
        value = "pow2" if on_gpu else "none"
    if max_batch == 0 or value == "none":
        return ()
    if value == "pow2":
        return default_buckets(max_batch)
    try:
        sizes = sorted({int(part) for part in value.split(",") if part.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1 or sizes[-1] > max_batch:
        raise LoadError(
            f"model {model!r}: parameter buckets must be pow2, none, or a comma-separated list "
            f"of batch sizes in 1..max_batch_size ({max_batch}), got {raw!r}"
        )
    if sizes[-1] != max_batch:
        sizes.append(max_batch)  # every batch needs a bucket that holds it
    return tuple(sizes)


def _choice(
    model: str, params: Mapping[str, str], key: str, choices: tuple[str, ...], default: str
) -> str:
    raw = params.get(key)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in choices:
        raise LoadError(
            f"model {model!r}: parameter {key} must be one of {' | '.join(choices)}, got {raw!r}"
        )
    return value


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
