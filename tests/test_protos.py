"""The generated protobuf modules are fresh and wire-compatible with Triton's.

tritonclient ships Triton's own generated modules (`tritonclient.grpc.service_pb2`,
`model_config_pb2`), registered in protobuf's default descriptor pool; ours register the same
`inference.*` symbols in batchgate's own pool, so both load in one process (tests/test_namespace.py
checks that). Triton's side still runs in a subprocess that prints a JSON description, so that
what it describes comes from a process where batchgate was never imported.
"""

from __future__ import annotations

import base64
import importlib.util
import inspect
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from google.protobuf import text_format
from google.protobuf.descriptor import FieldDescriptor

from batchgate.protos import generate, inference_pb2, inference_pb2_grpc, model_config_pb2
from batchgate.protos.datatypes import CONTENTS_FIELDS, NUMPY_DTYPES

SERVICE = "inference.GRPCInferenceService"

TRITON_CONFIG_PBTXT = """
name: "resnet50"
platform: "pytorch_libtorch"
backend: "pytorch"
max_batch_size: 32
version_policy { latest { num_versions: 1 } }
input [
  {
    name: "INPUT__0"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: [ 3, 224, 224 ]
  }
]
output [
  {
    name: "OUTPUT__0"
    data_type: TYPE_FP32
    dims: [ 1000 ]
    label_filename: "labels.txt"
  }
]
dynamic_batching {
  preferred_batch_size: [ 8, 16 ]
  max_queue_delay_microseconds: 500
  preserve_ordering: true
  priority_levels: 2
  default_priority_level: 2
  default_queue_policy {
    timeout_action: REJECT
    default_timeout_microseconds: 100000
    allow_timeout_override: true
    max_queue_size: 64
  }
  priority_queue_policy {
    key: 1
    value {
      timeout_action: DELAY
      default_timeout_microseconds: 20000
      max_queue_size: 16
    }
  }
}
instance_group [
  { name: "gpu_pair" kind: KIND_GPU count: 2 gpus: [ 0, 1 ] },
  { kind: KIND_CPU count: 1 }
]
optimization {
  priority: PRIORITY_MAX
  cuda { graphs: true busy_wait_events: false }
  input_pinned_memory { enable: true }
  output_pinned_memory { enable: false }
  gather_kernel_buffer_threshold: 0
  eager_batching: true
}
parameters { key: "DISABLE_OPTIMIZED_EXECUTION" value { string_value: "true" } }
parameters { key: "INFERENCE_MODE" value: { string_value: "true" } }
model_warmup [
  {
    name: "zeros"
    batch_size: 8
    inputs { key: "INPUT__0" value { data_type: TYPE_FP32 dims: [ 3, 224, 224 ] zero_data: true } }
  }
]
model_transaction_policy { decoupled: false }
response_cache { enable: false }
"""


def describe_files(module_names: list[str]) -> dict:
    """A JSON-ready description of the protobuf files behind `module_names`.

    Self-contained (its imports are inside) because the subprocess runs its source text.
    """
    import importlib

    from google.protobuf import descriptor_pb2

    field_types = {v: k for k, v in descriptor_pb2.FieldDescriptorProto.Type.items()}
    field_labels = {v: k for k, v in descriptor_pb2.FieldDescriptorProto.Label.items()}
    messages: dict = {}
    enums: dict = {}
    services: dict = {}

    def add_enum(enum, scope):
        enums[f"{scope}.{enum.name}"] = {value.name: value.number for value in enum.value}

    def add_message(message, scope):
        full_name = f"{scope}.{message.name}"
        oneofs = [oneof.name for oneof in message.oneof_decl]
        messages[full_name] = {
            field.name: {
                "number": field.number,
                "type": field_types[field.type],
                "label": field_labels[field.label],
                "type_name": field.type_name,
                "oneof": oneofs[field.oneof_index] if field.HasField("oneof_index") else None,
            }
            for field in message.field
        }
        for nested in message.nested_type:
            add_message(nested, full_name)
        for enum in message.enum_type:
            add_enum(enum, full_name)

    for module_name in module_names:
        file_proto = descriptor_pb2.FileDescriptorProto()
        importlib.import_module(module_name).DESCRIPTOR.CopyToProto(file_proto)
        for message in file_proto.message_type:
            add_message(message, file_proto.package)
        for enum in file_proto.enum_type:
            add_enum(enum, file_proto.package)
        for service in file_proto.service:
            services[f"{file_proto.package}.{service.name}"] = {
                method.name: {
                    "input": method.input_type,
                    "output": method.output_type,
                    "client_streaming": method.client_streaming,
                    "server_streaming": method.server_streaming,
                }
                for method in service.method
            }
    return {"messages": messages, "enums": enums, "services": services}


def _run_triton_side(body: str) -> str:
    """Run `body` in a fresh interpreter that has `describe_files` and may import tritonclient."""
    if importlib.util.find_spec("tritonclient") is None:
        pytest.skip("tritonclient is not installed (pip install -e '.[test]')")
    script = inspect.getsource(describe_files) + "\n" + textwrap.dedent(body)
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"tritonclient subprocess failed:\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def triton() -> dict:
    out = _run_triton_side(
        """
        import json
        print(json.dumps(describe_files([
            "tritonclient.grpc.model_config_pb2",
            "tritonclient.grpc.service_pb2",
        ])))
        """
    )
    return json.loads(out)


@pytest.fixture(scope="module")
def ours() -> dict:
    return describe_files(["batchgate.protos.model_config_pb2", "batchgate.protos.inference_pb2"])


# --- generated code -----------------------------------------------------------------------------


def test_generated_modules_are_not_stale():
    stale = generate.stale_files()
    assert not stale, f"stale: {stale}; run `python -m batchgate.protos.generate`"


def test_generated_modules_import_each_other_as_protos_package():
    assert inference_pb2.DESCRIPTOR.name == "protos/inference.proto"
    assert [dep.name for dep in inference_pb2.DESCRIPTOR.dependencies] == [
        "protos/model_config.proto"
    ]
    assert (
        inference_pb2.ModelConfigResponse.DESCRIPTOR.fields_by_name["config"].message_type
        is model_config_pb2.ModelConfig.DESCRIPTOR
    )


# --- wire facts ---------------------------------------------------------------------------------


def _number(message, field: str) -> int:
    return message.DESCRIPTOR.fields_by_name[field].number


def test_infer_field_numbers():
    assert _number(inference_pb2.ModelInferRequest, "parameters") == 4
    assert _number(inference_pb2.ModelInferRequest, "inputs") == 5
    assert _number(inference_pb2.ModelInferRequest, "outputs") == 6
    assert _number(inference_pb2.ModelInferRequest, "raw_input_contents") == 7
    assert _number(inference_pb2.ModelInferResponse, "raw_output_contents") == 6
    assert _number(inference_pb2.ModelInferRequest.InferInputTensor, "contents") == 5
    assert _number(inference_pb2.InferParameter, "double_param") == 4
    assert _number(inference_pb2.InferParameter, "uint64_param") == 5
    assert _number(inference_pb2.InferTensorContents, "bytes_contents") == 8
    assert _number(inference_pb2.ModelStreamInferResponse, "error_message") == 1
    assert _number(inference_pb2.ModelStreamInferResponse, "infer_response") == 2


def test_statistics_field_numbers():
    stats = inference_pb2.ModelStatistics
    assert [(f.name, f.number) for f in stats.DESCRIPTOR.fields] == [
        ("name", 1),
        ("version", 2),
        ("last_inference", 3),
        ("inference_count", 4),
        ("execution_count", 5),
        ("inference_stats", 6),
        ("batch_stats", 7),
        ("memory_usage", 8),
        ("response_stats", 9),
    ]
    assert _number(inference_pb2.InferStatistics, "cache_miss") == 8
    assert _number(inference_pb2.StatisticDuration, "ns") == 2


def test_model_config_field_numbers():
    config = model_config_pb2.ModelConfig
    assert _number(config, "max_batch_size") == 4
    assert _number(config, "instance_group") == 7
    assert _number(config, "dynamic_batching") == 11
    assert _number(config, "optimization") == 12
    assert _number(config, "parameters") == 14
    assert _number(config, "backend") == 17
    assert config.DESCRIPTOR.fields_by_name["dynamic_batching"].containing_oneof.name == (
        "scheduling_choice"
    )
    assert _number(model_config_pb2.ModelDynamicBatching, "priority_queue_policy") == 7
    assert _number(model_config_pb2.ModelQueuePolicy, "max_queue_size") == 4
    assert model_config_pb2.ModelQueuePolicy.DELAY == 1
    assert model_config_pb2.ModelInstanceGroup.KIND_CPU == 2
    assert model_config_pb2.TYPE_BF16 == 14


class _RecordingChannel:
    """Stands in for grpc.Channel: records the method paths and kinds a stub asks for."""

    def __init__(self) -> None:
        self.paths: dict[str, str] = {}

    def _record(self, kind):
        def make(path, *args, **kwargs):
            self.paths[path] = kind
            return None

        return make

    def __getattr__(self, kind):
        if kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            return self._record(kind)
        raise AttributeError(kind)


def test_stub_uses_the_protocol_method_paths():
    channel = _RecordingChannel()
    inference_pb2_grpc.GRPCInferenceServiceStub(channel)
    assert channel.paths[f"/{SERVICE}/ModelInfer"] == "unary_unary"
    assert channel.paths[f"/{SERVICE}/ModelStreamInfer"] == "stream_stream"
    assert channel.paths[f"/{SERVICE}/ServerLive"] == "unary_unary"
    expected = {
        "ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata",
        "ModelInfer", "ModelStreamInfer", "ModelConfig", "ModelStatistics", "RepositoryIndex",
        "RepositoryModelLoad", "RepositoryModelUnload", "SystemSharedMemoryStatus",
        "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister", "CudaSharedMemoryStatus",
        "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister", "TraceSetting", "LogSettings",
    }  # fmt: skip
    assert set(channel.paths) == {f"/{SERVICE}/{name}" for name in expected}


# --- against Triton's own generated modules -----------------------------------------------------


def test_every_field_we_define_matches_triton(ours, triton):
    mismatches = []
    for message, fields in ours["messages"].items():
        if message not in triton["messages"]:
            mismatches.append(f"{message}: no such message in Triton")
            continue
        theirs = triton["messages"][message]
        for name, ours_field in fields.items():
            if theirs.get(name) != ours_field:
                mismatches.append(f"{message}.{name}: ours {ours_field}, Triton {theirs.get(name)}")
    assert not mismatches, "\n".join(mismatches)


def test_every_enum_value_we_define_matches_triton(ours, triton):
    mismatches = [
        f"{enum}.{name} = {number}: Triton {triton['enums'].get(enum, {}).get(name)}"
        for enum, values in ours["enums"].items()
        for name, number in values.items()
        if triton["enums"].get(enum, {}).get(name) != number
    ]
    assert not mismatches, "\n".join(mismatches)


def test_every_rpc_we_define_matches_triton(ours, triton):
    assert list(ours["services"]) == [SERVICE]
    theirs = triton["services"][SERVICE]
    for method, signature in ours["services"][SERVICE].items():
        assert theirs.get(method) == signature, method


def test_we_define_everything_triton_defines(ours, triton):
    # Not needed for the wire, but a Triton config.pbtxt using a field we lacked would not parse.
    missing = [
        f"{message}.{name}"
        for message, fields in triton["messages"].items()
        for name in fields
        if name not in ours["messages"].get(message, {})
    ]
    missing += [
        f"{enum}.{name}"
        for enum, values in triton["enums"].items()
        for name in values
        if name not in ours["enums"].get(enum, {})
    ]
    missing += [
        f"rpc {method}"
        for method in triton["services"][SERVICE]
        if method not in ours["services"][SERVICE]
    ]
    assert not missing, "Triton defines, we do not:\n" + "\n".join(missing)


# --- config.pbtxt in Triton's format ------------------------------------------------------------


def test_triton_config_pbtxt_parses_into_our_model_config():
    config = text_format.Parse(TRITON_CONFIG_PBTXT, model_config_pb2.ModelConfig())

    assert config.max_batch_size == 32
    assert config.WhichOneof("scheduling_choice") == "dynamic_batching"
    batching = config.dynamic_batching
    assert list(batching.preferred_batch_size) == [8, 16]
    assert batching.default_queue_policy.max_queue_size == 64
    level_1 = batching.priority_queue_policy[1]
    assert level_1.timeout_action == model_config_pb2.ModelQueuePolicy.DELAY
    assert level_1.max_queue_size == 16
    assert [g.kind for g in config.instance_group] == [
        model_config_pb2.ModelInstanceGroup.KIND_GPU,
        model_config_pb2.ModelInstanceGroup.KIND_CPU,
    ]
    assert list(config.instance_group[0].gpus) == [0, 1]
    assert config.parameters["INFERENCE_MODE"].string_value == "true"
    assert config.optimization.input_pinned_memory.enable
    assert config.optimization.eager_batching
    assert config.input[0].format == model_config_pb2.ModelInput.FORMAT_NCHW
    assert config.model_warmup[0].inputs["INPUT__0"].zero_data


def test_triton_serialized_config_decodes_identically():
    out = _run_triton_side(
        f"""
        import base64
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
        config = text_format.Parse({TRITON_CONFIG_PBTXT!r}, model_config_pb2.ModelConfig())
        print(base64.b64encode(config.SerializeToString(deterministic=True)).decode())
        """
    )
    from_triton = model_config_pb2.ModelConfig.FromString(base64.b64decode(out))
    ours = text_format.Parse(TRITON_CONFIG_PBTXT, model_config_pb2.ModelConfig())
    assert from_triton == ours
    assert from_triton.SerializeToString(deterministic=True) == base64.b64decode(out)


# -- the datatype table (protos/datatypes.py) --------------------------------------------------

_PROTO_FIELD_DTYPES = {
    "TYPE_BOOL": "bool", "TYPE_INT32": "int32", "TYPE_INT64": "int64", "TYPE_UINT32": "uint32",
    "TYPE_UINT64": "uint64", "TYPE_FLOAT": "float32", "TYPE_DOUBLE": "float64",
}


def test_contents_fields_are_the_protos_typed_fields():
    fields = inference_pb2.InferTensorContents.DESCRIPTOR.fields_by_name
    type_names = {v: k for k, v in vars(FieldDescriptor).items() if k.startswith("TYPE_")}
    for datatype, (name, dtype) in CONTENTS_FIELDS.items():
        assert datatype in NUMPY_DTYPES
        assert _PROTO_FIELD_DTYPES[type_names[fields[name].type]] == dtype.name, datatype
        # The field holds every value of the datatype (narrow integers widened).
        assert np.can_cast(NUMPY_DTYPES[datatype], dtype, "safe"), datatype
    used = {name for name, _ in CONTENTS_FIELDS.values()}
    assert used == set(fields) - {"bytes_contents"}

