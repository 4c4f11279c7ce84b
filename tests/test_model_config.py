"""config.pbtxt -> ModelConfig -> ModelSpec, and the config the server reports back."""

from __future__ import annotations

import dataclasses
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest

from batchgate.batcher.errors import InvalidRequest, LoadError, ModelNotFound
from batchgate.batcher.spec import NUMPY_DTYPES, QueuePolicy
from batchgate.protos import model_config_pb2
from batchgate.server.config.model_config import (
    config_from_json,
    datatype_from_proto,
    datatype_to_proto,
    read_model_config,
)
from batchgate.server.config.model_parameters import PARAMETERS, TRITON_PARAMETERS
from batchgate.server.config.model_spec import effective_config, model_spec_from_config
from batchgate.server.executor.warmup import warmup_inputs
from batchgate.server.executor.repository import ModelRepository

EXAMPLES = Path(__file__).resolve().parent.parent / "models"

BASE = """
backend: "pytorch"
max_batch_size: 8
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""


def write_config(tmp_path: Path, text: str, name: str = "m") -> Path:
    model_dir = tmp_path / name
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(textwrap.dedent(text))
    return model_dir


def spec_of(tmp_path: Path, text: str, *, cuda: bool = False, name: str = "m"):
    config, _ = read_model_config(write_config(tmp_path, text, name))
    return model_spec_from_config(config, "1", cuda_available=cuda)


def with_params(**params: str) -> str:
    entries = "".join(
        f'parameters: {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'
        for key, value in params.items()
    )
    return BASE + entries


# -- the example repository ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "max_batch", "datatype", "in_dims", "out_dims"),
    [
        ("mlp", 64, "FP32", (512,), (512,)),
        ("cnn", 32, "FP32", (3, 32, 32), (10,)),
        ("encoder", 32, "INT64", (16,), (64,)),
    ],
)
def test_example_configs_parse_fully(name, max_batch, datatype, in_dims, out_dims):
    config, unsupported = read_model_config(EXAMPLES / name)
    assert unsupported == []
    spec = model_spec_from_config(config, "1", cuda_available=False)
    assert spec.name == name and spec.version == "1"
    assert spec.platform == "pytorch_libtorch"
    assert spec.max_batch_size == max_batch
    assert [(t.name, t.datatype, t.dims) for t in spec.inputs] == [("INPUT__0", datatype, in_dims)]
    assert [(t.name, t.datatype, t.dims) for t in spec.outputs] == [("OUTPUT__0", "FP32", out_dims)]
    assert spec.batching.dynamic_batching
    assert spec.batching.max_queue_delay_us == 0
    assert spec.intra_op_threads == 1
    assert spec.instance_count == 1
    assert spec.device == "cpu"
    assert model_spec_from_config(config, "1", cuda_available=True).device == "cuda:0"


# -- reading ---------------------------------------------------------------------------------


def test_name_is_taken_from_the_folder_when_empty(tmp_path):
    config, _ = read_model_config(write_config(tmp_path, BASE, name="folder_name"))
    assert config.name == "folder_name"


def test_name_that_differs_from_the_folder_is_refused(tmp_path):
    with pytest.raises(LoadError, match="'other'"):
        read_model_config(write_config(tmp_path, 'name: "other"\n' + BASE, name="m"))


def test_parse_error_names_the_file_and_line(tmp_path):
    model_dir = write_config(tmp_path, BASE + "max_batch_sise: 3\n")
    with pytest.raises(LoadError) as info:
        read_model_config(model_dir)
    message = str(info.value)
    assert str(model_dir / "config.pbtxt") in message
    assert "line 6" in message
    assert "max_batch_sise" in message


def test_missing_config_is_a_load_error(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(LoadError, match="config.pbtxt"):
        read_model_config(tmp_path / "m")


TRITON_STYLE = """
name: "m"
platform: "pytorch_libtorch"
version_policy: { all: {} }
max_batch_size: 8
input [
  {
    name: "INPUT__0"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: [ 4 ]
    reshape: { shape: [ 2, 2 ] }
  }
]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 2 ] label_filename: "labels.txt" } ]
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  max_queue_delay_microseconds: 100
  preserve_ordering: true
}
instance_group [ { count: 2 kind: KIND_CPU rate_limiter: { priority: 1 } } ]
optimization { cuda { graphs: true } }
response_cache { enable: true }
model_warmup [
  {
    name: "zeros"
    batch_size: 2
    inputs { key: "INPUT__0" value: { data_type: TYPE_FP32 dims: [ 4 ] zero_data: true } }
  }
]
parameters: { key: "DISABLE_OPTIMIZED_EXECUTION" value: { string_value: "true" } }
parameters: { key: "my_own_setting" value: { string_value: "42" } }
"""


def test_triton_config_with_unsupported_fields_loads_and_lists_them(tmp_path):
    config, unsupported = read_model_config(write_config(tmp_path, TRITON_STYLE))
    assert set(unsupported) == {
        "version_policy.all (the latest version is served)",
        "input[INPUT__0].reshape",
        "output[OUTPUT__0].label_filename",
        "dynamic_batching.preserve_ordering",
        "instance_group[0].rate_limiter",
        "optimization.cuda.graphs",
        "response_cache",
        "parameters.DISABLE_OPTIMIZED_EXECUTION",
    }
    assert len(unsupported) == len(set(unsupported))
    spec = model_spec_from_config(config, "3", cuda_available=False)
    assert spec.instance_count == 2
    assert spec.batching.preferred_batch_sizes == (4, 8)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ("sequence_batching { max_sequence_idle_microseconds: 5000000 }", "sequence_batching"),
        (
            'ensemble_scheduling { step [ { model_name: "a" model_version: -1 } ] }',
            "ensemble_scheduling",
        ),
        ('batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "N" } ]', "batch_input"),
        ('model_repository_agents { agents [ { name: "checksum" } ] }', "model_repository_agents"),
        ("model_transaction_policy { decoupled: true }", "model_transaction_policy"),
        (
            "instance_group [ { kind: KIND_MODEL } ]",
            "instance_group[0].kind KIND_MODEL (treated as KIND_AUTO)",
        ),
    ],
)
def test_each_unsupported_section_is_listed(tmp_path, extra, field):
    _, unsupported = read_model_config(write_config(tmp_path, BASE + extra + "\n"))
    assert unsupported == [field]


def test_supported_fields_are_not_listed(tmp_path):
    text = BASE + textwrap.dedent(
        """
        version_policy: { latest: { num_versions: 1 } }
        default_model_filename: "model.pt"
        dynamic_batching {
          preferred_batch_size: [ 4 ]
          max_queue_delay_microseconds: 100
          priority_levels: 2
          default_priority_level: 2
          default_queue_policy { max_queue_size: 4 }
          priority_queue_policy { key: 1 value: { max_queue_size: 8 } }
        }
        instance_group [ { name: "g" count: 1 kind: KIND_CPU } ]
        parameters: { key: "precision" value: { string_value: "bf16" } }
        """
    )
    assert read_model_config(write_config(tmp_path, text))[1] == []


# -- resolving -----------------------------------------------------------------------------


def test_every_datatype_maps_both_ways():
    for name, value in model_config_pb2.DataType.items():
        if value == model_config_pb2.TYPE_INVALID:
            continue
        datatype = datatype_from_proto(value)
        assert datatype in NUMPY_DTYPES
        assert datatype_to_proto(datatype) == value
        assert datatype == ("BYTES" if name == "TYPE_STRING" else name.removeprefix("TYPE_"))
    assert datatype_from_proto(model_config_pb2.TYPE_BF16) == "BF16"


def test_invalid_datatype_is_a_load_error(tmp_path):
    with pytest.raises(LoadError, match="INPUT__0"):
        spec_of(tmp_path, BASE.replace("data_type: TYPE_FP32 dims: [ 4 ]", "dims: [ 4 ]"))


def test_string_tensors_are_bytes(tmp_path):
    spec = spec_of(tmp_path, BASE.replace("data_type: TYPE_FP32 dims: [ 4 ]",
                                          "data_type: TYPE_STRING dims: [ -1 ]"))
    assert spec.inputs[0].datatype == "BYTES"
    assert spec.inputs[0].dims == (-1,)


def test_kind_gpu_without_cuda_is_refused(tmp_path):
    text = BASE + "instance_group [ { kind: KIND_GPU gpus: [ 1 ] } ]\n"
    message = "model 'm' asks for KIND_GPU but this machine has no CUDA device"
    with pytest.raises(LoadError, match=message):
        spec_of(tmp_path, text)
    assert spec_of(tmp_path, text, cuda=True).device == "cuda:1"


@pytest.mark.parametrize(
    ("group", "cuda", "device"),
    [
        ("", False, "cpu"),
        ("", True, "cuda:0"),
        ("instance_group [ { kind: KIND_AUTO } ]", True, "cuda:0"),
        ("instance_group [ { kind: KIND_CPU } ]", True, "cpu"),
        ("instance_group [ { kind: KIND_GPU } ]", True, "cuda:0"),
    ],
)
def test_device_follows_instance_kind(tmp_path, group, cuda, device):
    assert spec_of(tmp_path, BASE + group + "\n", cuda=cuda).device == device


def test_instance_counts_are_summed(tmp_path):
    groups = "{ count: 2 kind: KIND_CPU }, { count: 3 kind: KIND_CPU }, { kind: KIND_CPU }"
    text = BASE + f"instance_group [ {groups} ]\n"
    assert spec_of(tmp_path, text).instance_count == 6


def test_other_backends_are_refused(tmp_path):
    with pytest.raises(LoadError, match="got backend 'onnxruntime'"):
        spec_of(tmp_path, BASE.replace('backend: "pytorch"', 'backend: "onnxruntime"'))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("precision", "fp8"),
        ("buckets", "0,4"),
        ("buckets", "1,16"),  # over max_batch_size 8
        ("buckets", "some"),
        ("cuda_graphs", "yes"),
        ("input_staging", "later"),
        ("min_batch_size", "lots"),
        ("min_batch_size", "9"),  # over max_batch_size 8
        ("max_inflight_batches", "0"),
        ("warmup", "maybe"),
        ("execution_timeout_ms", "-5"),
        ("INTRA_OP_THREAD_COUNT", "-1"),
        ("INTER_OP_THREAD_COUNT", "two"),
        ("batch_policy", "lifo"),
        ("slo_ms", "-5"),
        ("slo_ms", "nan"),
        ("response_margin_ms", "-1"),
        ("admission", "sometimes"),
        ("device_share_weight", "heavy"),
    ],
)
def test_bad_parameter_values_say_what_they_got(tmp_path, key, value):
    with pytest.raises(LoadError) as info:
        spec_of(tmp_path, with_params(**{key: value}))
    assert key in str(info.value)
    assert f"got '{value}'" in str(info.value)


def test_documented_parameters_take_effect(tmp_path):
    assert set(PARAMETERS) == {"precision", "min_batch_size", "max_inflight_batches", "warmup",
                               "execution_timeout_ms", "buckets", "cuda_graphs",
                               "input_staging", "batch_policy", "slo_ms", "admission",
                               "device_share_weight", "response_margin_ms"}
    for table in (PARAMETERS, TRITON_PARAMETERS):
        for key, parameter in table.items():
            assert parameter.key == key
            assert parameter.type.strip() and parameter.description.strip()
            assert "\n" not in parameter.description
    default = spec_of(tmp_path, BASE)
    spec = spec_of(
        tmp_path,
        with_params(
            precision="BF16",
            min_batch_size="3",
            max_inflight_batches="4",
            warmup="false",
            execution_timeout_ms="250",
            INTRA_OP_THREAD_COUNT="2",
            INTER_OP_THREAD_COUNT="1",
            buckets="2,4",
            cuda_graphs="true",
            input_staging="queue",
            batch_policy="Deadline",
            slo_ms="12.5",
            response_margin_ms="3",
            admission="false",
            device_share_weight="3",
        ),
    )
    assert (default.precision, spec.precision) == ("fp32", "amp-bf16")
    assert (default.batching.min_batch_size, spec.batching.min_batch_size) == (0, 3)
    assert (default.batching.max_inflight_batches, spec.batching.max_inflight_batches) == (0, 4)
    # Unset, it follows the device: one on the CPU, two on a GPU; the deadline policy, one.
    assert (default.device, default.inflight_batches) == ("cpu", 1)
    assert dataclasses.replace(default, device="cuda:0").inflight_batches == 2
    assert spec.inflight_batches == 1  # batch_policy deadline
    assert dataclasses.replace(
        spec, batching=dataclasses.replace(spec.batching, policy="fifo")).inflight_batches == 4
    assert (default.warmup, spec.warmup) == (True, False)
    assert (default.execution_timeout_ms, spec.execution_timeout_ms) == (0, 250)
    assert (default.intra_op_threads, spec.intra_op_threads) == (0, 2)
    assert (default.inter_op_threads, spec.inter_op_threads) == (0, 1)
    assert (default.batching.policy, spec.batching.policy) == ("fifo", "deadline")
    assert (default.batching.slo_ms, spec.batching.slo_ms) == (0.0, 12.5)
    assert (default.batching.response_margin_ms, spec.batching.response_margin_ms) == (5.0, 3.0)
    assert (default.batching.admission, spec.batching.admission) == (True, False)
    assert (default.batching.device_share_weight, spec.batching.device_share_weight) == (0.0, 3.0)
    assert (default.buckets, spec.buckets) == ((), (2, 4, 8))  # max_batch_size is added
    assert (default.cuda_graphs, spec.cuda_graphs) == (False, True)
    assert (default.input_staging, spec.input_staging) == ("batch", "queue")


@pytest.mark.parametrize(
    ("given", "canonical"),
    [("fp32", "fp32"), ("fp16", "amp-fp16"), ("bf16", "amp-bf16"), ("amp-fp16", "amp-fp16"),
     ("AMP-BF16", "amp-bf16"), ("fp16-weights", "fp16-weights")],
)
def test_precision_names_old_and_new(tmp_path, given, canonical):
    assert spec_of(tmp_path, with_params(precision=given)).precision == canonical


def test_buckets_default_to_powers_of_two_on_a_gpu_and_none_on_the_cpu(tmp_path):
    config, _ = read_model_config(write_config(tmp_path, BASE))
    cpu = model_spec_from_config(config, "1", cuda_available=False)
    gpu = model_spec_from_config(config, "1", cuda_available=True)
    assert cpu.buckets == () and cpu.input_staging == "batch"
    assert gpu.buckets == (1, 2, 4, 8) and gpu.input_staging == "queue"
    assert spec_of(tmp_path, with_params(buckets="pow2")).buckets == (1, 2, 4, 8)
    assert spec_of(tmp_path, with_params(buckets="none")).buckets == ()


def test_queue_policies_map_to_the_batcher(tmp_path):
    text = BASE + textwrap.dedent(
        """
        dynamic_batching {
          max_queue_delay_microseconds: 250
          priority_levels: 3
          default_priority_level: 2
          default_queue_policy {
            timeout_action: DELAY
            default_timeout_microseconds: 5000
            max_queue_size: 16
          }
          priority_queue_policy {
            key: 1
            value: { timeout_action: REJECT allow_timeout_override: true max_queue_size: 4 }
          }
        }
        """
    )
    batching = spec_of(tmp_path, text).batching
    assert batching.dynamic_batching
    assert batching.max_queue_delay_us == 250
    assert batching.levels == 3 and batching.default_level == 2
    assert batching.default_queue_policy == QueuePolicy(
        max_queue_size=16, default_timeout_us=5000, allow_timeout_override=False,
        timeout_action_delay=True,
    )
    assert batching.queue_policy(1) == QueuePolicy(max_queue_size=4, allow_timeout_override=True)
    assert batching.queue_policy(3) == batching.default_queue_policy


def test_queue_policy_for_a_missing_level_is_refused(tmp_path):
    text = BASE + (
        "dynamic_batching { priority_levels: 2 priority_queue_policy { key: 3 value: {} } }\n"
    )
    with pytest.raises(LoadError, match="got 3"):
        spec_of(tmp_path, text)


def test_without_dynamic_batching_each_request_runs_alone(tmp_path):
    batching = spec_of(tmp_path, BASE).batching
    assert not batching.dynamic_batching
    assert batching.max_batch_size == 8
    assert batching.max_queue_delay_us == 0


# -- what the server reports ------------------------------------------------------------------


def test_effective_config_fills_defaults_and_resolved_parameters(tmp_path):
    config, _ = read_model_config(write_config(tmp_path, with_params(precision="fp16", my_own="x")))
    before = config.SerializeToString()
    spec = model_spec_from_config(config, "1", cuda_available=False)
    effective = effective_config(config, spec)
    assert config.SerializeToString() == before  # the parsed config is left alone
    assert effective.name == "m"
    assert effective.platform == "pytorch_libtorch" and effective.backend == "pytorch"
    assert effective.version_policy.latest.num_versions == 1
    assert effective.max_batch_size == 8
    [group] = effective.instance_group
    assert (group.kind, group.count) == (model_config_pb2.ModelInstanceGroup.KIND_CPU, 1)
    params = {k: v.string_value for k, v in effective.parameters.items()}
    assert params == {
        "precision": "amp-fp16",
        "min_batch_size": "8",
        "max_inflight_batches": "1",  # unset: one on the CPU
        "warmup": "true",
        "execution_timeout_ms": "0",
        "batch_policy": "fifo",
        "slo_ms": "0",
        "response_margin_ms": "5",
        "admission": "true",
        "device_share_weight": "0",
        "INTRA_OP_THREAD_COUNT": "0",
        "INTER_OP_THREAD_COUNT": "0",
        "buckets": "none",
        "cuda_graphs": "false",
        "input_staging": "batch",
        "my_own": "x",
    }
    assert not effective.HasField("dynamic_batching")


def test_effective_config_reports_the_gpu(tmp_path):
    text = BASE + "instance_group [ { count: 2 kind: KIND_GPU gpus: [ 1 ] } ]\n"
    config, _ = read_model_config(write_config(tmp_path, text))
    spec = model_spec_from_config(config, "1", cuda_available=True)
    [group] = effective_config(config, spec).instance_group
    assert (group.kind, list(group.gpus), group.count) == (
        model_config_pb2.ModelInstanceGroup.KIND_GPU, [1], 2,
    )


# -- model_warmup ------------------------------------------------------------------------------


def test_model_warmup_becomes_input_sets(tmp_path):
    second_input = '{ name: "INPUT__1" data_type: TYPE_INT64 dims: [ 3 ] }'
    text = BASE.replace("dims: [ 4 ] } ]\noutput", f"dims: [ 4 ] }}, {second_input} ]\noutput")
    text += textwrap.dedent(
        """
        model_warmup [
          {
            name: "a"
            batch_size: 5
            count: 2
            inputs { key: "INPUT__0" value: { data_type: TYPE_FP32 dims: [ 4 ] random_data: true } }
            inputs { key: "INPUT__1" value: { data_type: TYPE_INT64 dims: [ 3 ] zero_data: true } }
          },
          {
            name: "b"
            inputs { key: "INPUT__0" value: { data_type: TYPE_FP32 dims: [ 4 ] input_data_file: "x.bin" } }
            inputs { key: "INPUT__1" value: { data_type: TYPE_INT64 dims: [ 3 ] random_data: true } }
          }
        ]
        """
    )
    model_dir = write_config(tmp_path, text)
    (model_dir / "warmup").mkdir()
    (model_dir / "warmup" / "x.bin").write_bytes(np.arange(4, dtype="<f4").tobytes())
    config, unsupported = read_model_config(model_dir)
    assert unsupported == []
    spec = model_spec_from_config(config, "1", cuda_available=False)
    sets = warmup_inputs(config, spec, model_dir)
    assert len(sets) == 3
    first, again, second = sets
    assert [a.shape for a in first] == [(5, 4), (5, 3)]
    assert [a.dtype for a in first] == [np.dtype("<f4"), np.dtype("<i8")]
    assert np.all((first[0] >= 0) & (first[0] < 1)) and np.all(first[1] == 0)
    assert again is first
    assert [a.shape for a in second] == [(1, 4), (1, 3)]
    np.testing.assert_array_equal(second[0], [[0, 1, 2, 3]])
    assert set(np.unique(second[1])) <= {0, 1}


def test_no_model_warmup_leaves_the_choice_to_the_batcher(tmp_path):
    model_dir = write_config(tmp_path, BASE)
    config, _ = read_model_config(model_dir)
    spec = model_spec_from_config(config, "1", cuda_available=False)
    assert warmup_inputs(config, spec, model_dir) is None


@pytest.mark.parametrize(
    ("sample", "message"),
    [
        ('data_type: TYPE_INT32 dims: [ 4 ] zero_data: true', "got data_type INT32"),
        ('data_type: TYPE_FP32 dims: [ 5 ] zero_data: true', "got [5]"),
        (
            'data_type: TYPE_FP32 dims: [ 4 ] input_data_file: "../config.pbtxt"',
            "got '../config.pbtxt'",
        ),
        ('data_type: TYPE_FP32 dims: [ 4 ] input_data_file: "missing.bin"', "missing.bin"),
    ],
)
def test_bad_model_warmup_is_a_load_error(tmp_path, sample, message):
    warmup = f'name: "w" inputs {{ key: "INPUT__0" value: {{ {sample} }} }}'
    text = BASE + f"model_warmup [ {{ {warmup} }} ]\n"
    model_dir = write_config(tmp_path, text)
    config, _ = read_model_config(model_dir)
    spec = model_spec_from_config(config, "1", cuda_available=False)
    with pytest.raises(LoadError, match=re.escape(message)):
        warmup_inputs(config, spec, model_dir)


# -- model names ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["../outside", "..", ".", ".hidden", "a/b", "/etc", "", "a\\b", "m\x00"]
)
async def test_names_that_are_not_plain_folders_are_refused(tmp_path, name):
    root = tmp_path / "repo"
    write_config(root, BASE, name="m")
    write_config(tmp_path, BASE, name="outside")  # what "../outside" would reach
    write_config(root, BASE, name=".hidden")
    repository = ModelRepository(root, cuda_available=False)
    with pytest.raises(InvalidRequest, match="plain folder name"):
        await repository.load(name)
    with pytest.raises(InvalidRequest):
        await repository.unload(name)
    with pytest.raises(ModelNotFound):
        repository.get(name)
    assert [entry.name for entry in repository.index()] == ["m"]


# -- a load's config parameter (JSON) --------------------------------------------------------


def test_a_json_config_is_protobufs_json_mapping():
    config = config_from_json(
        '{"maxBatchSize": "16", "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [2]}],'
        ' "dynamic_batching": {"max_queue_delay_microseconds": "100"}}')
    assert config.max_batch_size == 16
    assert config.input[0].data_type == model_config_pb2.TYPE_FP32
    assert config.dynamic_batching.max_queue_delay_microseconds == 100


@pytest.mark.parametrize("text, message", [
    ('{"max_batch_size": 16', "is not valid JSON: Expecting ',' delimiter"),
    ("", "is not valid JSON"),
    ("[" * 100_000, "nested too deeply"),
    ('"max_batch_size"', "must be a JSON object (a ModelConfig), got a JSON str"),
    ('{"max_batch_size": "x"}', "Failed to parse max_batch_size field"),
    ('{"input": [{"data_type": "TYPE_X"}]}', "Invalid enum value TYPE_X"),
    ('{"nope": 1}', 'has no field named "nope"'),
])
def test_a_json_config_that_is_not_a_model_config_is_refused(text, message):
    with pytest.raises(InvalidRequest, match="load parameter 'config'") as caught:
        config_from_json(text)
    assert message in str(caught.value)
    assert "Available Fields" not in str(caught.value)  # one line, not protobuf's field list
