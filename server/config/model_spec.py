"""Resolve a parsed ``config.pbtxt`` into the batcher's :class:`~batchgate.batcher.spec.ModelSpec`, and back.

- :func:`model_spec_from_config` resolves the config (``server/config/model_config.py`` parses it)
  into a ``ModelSpec``: datatypes, device, instance count, batching and queue policies, and the
  ``parameters`` keys (``server/config/model_parameters.py``);
- :func:`effective_config` is the config the server reports through the ModelConfig RPC: the
  parsed one with defaults filled in and the resolved settings written back.

Without ``dynamic_batching`` a model runs each request on its own, as Triton's default scheduler
does: ``BatchingConfig.dynamic_batching`` is False and the batcher never combines requests. A
client may still send its own batch of up to ``max_batch_size`` samples.
"""

from __future__ import annotations

from collections.abc import Mapping

from batchgate.batcher.errors import LoadError
from batchgate.batcher.spec import BatchingConfig, ModelSpec, QueuePolicy, TensorSpec
from batchgate.protos import model_config_pb2
from batchgate.server.config.model_config import BACKEND, PLATFORM, datatype_from_proto
from batchgate.server.config.model_parameters import ModelParameters

_Kind = model_config_pb2.ModelInstanceGroup.Kind


def model_spec_from_config(
    config: model_config_pb2.ModelConfig, version: str, *, cuda_available: bool
) -> ModelSpec:
    """Resolve ``config`` (as returned by :func:`read_model_config`) into a ``ModelSpec``."""
    name = config.name
    _check_backend(config)
    if config.max_batch_size < 0:
        raise LoadError(f"model {name!r}: max_batch_size must be >= 0, got {config.max_batch_size}")
    params = ModelParameters(
        name, {key: value.string_value for key, value in config.parameters.items()})

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
            precision=params.choice("precision"),
            intra_op_threads=params.integer("INTRA_OP_THREAD_COUNT", minimum=0),
            inter_op_threads=params.integer("INTER_OP_THREAD_COUNT", minimum=0),
            warmup=params.flag("warmup"),
            buckets=params.buckets(batching.max_batch_size, on_gpu=on_gpu),
            cuda_graphs=params.flag("cuda_graphs"),
            input_staging=params.choice("input_staging",
                                        default="queue" if on_gpu else "batch"),
            execution_timeout_ms=params.integer("execution_timeout_ms", minimum=0),
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


def _batching_config(
    config: model_config_pb2.ModelConfig, params: ModelParameters
) -> BatchingConfig:
    name = config.name
    max_batch = config.max_batch_size
    min_batch = params.integer("min_batch_size", minimum=0, default=0)
    if min_batch > max(max_batch, 1):
        raise LoadError(
            f"model {name!r}: parameter min_batch_size must lie in 0..max_batch_size "
            f"({max_batch}), got {params.value('min_batch_size')!r}"
        )
    inflight = params.integer("max_inflight_batches", minimum=1, default=0)  # 0: by device
    scheduling = {
        "policy": params.choice("batch_policy"),
        "slo_ms": params.number("slo_ms"),
        "response_margin_ms": params.number("response_margin_ms"),
        "admission": params.flag("admission"),
        "device_share_weight": params.number("device_share_weight"),
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
