"""RepositoryModelLoad's ``config`` and ``file:`` parameters against real servers, every mode.

tritonclient (``load_model(name, config=..., files=...)``) runs in a subprocess, as in
``test_ecosystem.py``: it registers protobuf package ``inference`` as our ``protos`` do. The
refusals are checked parameter by parameter with our own stub, which can send what no client
library would (a config as bytes, an unknown key).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batchgate.protos import inference_pb2 as pb
from batchgate.protos import inference_pb2_grpc
from batchgate.bench.harness.repository import write_model
from tests.support.models import xy_config
from tests.support.servers import SERVER_MODES, start_in_mode

MAX_FILES_BYTES = 4096
TIMEOUT_S = 60

PLUS_CONFIG = xy_config("plus")
PLUS_MODEL = """
import torch


class Plus(torch.nn.Module):
    def forward(self, x):
        return x + 1


def build_model(parameters):
    return Plus()
"""
# The same config as JSON (protobuf's JSON mapping), as a load's config parameter carries it.
PLUS_JSON = {
    "name": "plus", "backend": "pytorch", "max_batch_size": 8,
    "input": [{"name": "INPUT__0", "data_type": "TYPE_FP32", "dims": [2]}],
    "output": [{"name": "OUTPUT__0", "data_type": "TYPE_FP32", "dims": [2]}],
    "dynamic_batching": {"max_queue_delay_microseconds": "0"},
    "instance_group": [{"kind": "KIND_CPU", "count": 1}],
}
TIMES3_MODEL = PLUS_MODEL.replace("x + 1", "x * 3")
RAISING_MODEL = "def build_model(parameters):\n    raise ValueError('the weights are missing')\n"

TRITONCLIENT_SCRIPT = textwrap.dedent('''
    import json, sys
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    url, plus_json, times3, raising = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
    c = grpcclient.InferenceServerClient(url=url)
    out = {}

    def max_batch():
        return c.get_model_config("plus", as_json=True)["config"]["max_batch_size"]

    def infer(model, rows):
        i = grpcclient.InferInput("INPUT__0", [rows, 2], "FP32")
        i.set_data_from_numpy(np.ones((rows, 2), np.float32))
        return c.infer(model, [i]).as_numpy("OUTPUT__0")[0].tolist()

    def refused(**kwargs):
        try:
            c.load_model("plus", **kwargs)
        except InferenceServerException as e:
            return [e.status(), e.message()]
        return None

    out["before"] = [max_batch(), infer("plus", 1)]
    sixteen = dict(plus_json, max_batch_size="16")
    c.load_model("plus", config=json.dumps(sixteen))
    out["override"] = [max_batch(), infer("plus", 16)]

    out["malformed"] = refused(config='{"max_batch_size": 16')
    out["unknown_field"] = refused(config='{"max_batch_sizes": 16}')
    out["alone"] = refused(config='{"max_batch_size": "16"}')
    out["after_refusals"] = [c.is_model_ready("plus"), max_batch(), infer("plus", 16)]

    files = {"file:1/model.py": times3.encode()}
    c.load_model("plus", config=json.dumps(plus_json), files=files)
    out["files"] = [max_batch(), infer("plus", 1)]
    out["files_without_config"] = refused(files=files)
    out["raising"] = refused(config=json.dumps(plus_json),
                             files={"file:1/model.py": raising.encode()})
    out["traversal"] = refused(config=json.dumps(plus_json),
                               files={"file:../plus/1/model.py": times3.encode()})
    out["after_file_refusals"] = [c.is_model_ready("plus"), max_batch(), infer("plus", 1)]

    # A model that the repository does not hold: its files are the whole model folder.
    fresh = dict(plus_json, name="fresh")
    c.load_model("fresh", config=json.dumps(fresh), files=files)
    out["fresh"] = [c.is_model_ready("fresh"), infer("fresh", 2)]
    c.unload_model("fresh")
    out["fresh_unloaded"] = c.is_model_ready("fresh")

    c.load_model("plus")  # no parameters: the repository's own again
    out["restored"] = [max_batch(), infer("plus", 1)]
    print(json.dumps(out))
''')


@pytest.fixture(scope="module", params=SERVER_MODES)
def server(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"overrides-{request.param}")
    write_model(root, PLUS_CONFIG, PLUS_MODEL)
    if request.param == "single":
        running = start_in_mode("single", root, max_load_files_bytes=MAX_FILES_BYTES)
    else:
        running = start_in_mode(request.param, root,
                                extra_args=("--max-load-files-bytes", str(MAX_FILES_BYTES)))
    yield running
    running.stop()


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield inference_pb2_grpc.GRPCInferenceServiceStub(channel)


def test_tritonclient_loads_with_config_and_files(server):
    done = subprocess.run(
        [sys.executable, "-c", TRITONCLIENT_SCRIPT, server.address, json.dumps(PLUS_JSON),
         TIMES3_MODEL, RAISING_MODEL],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    invalid = "StatusCode.INVALID_ARGUMENT"

    assert out["before"] == [8, [2.0, 2.0]]
    # ModelConfig reports what is served: a batch of 16 now fits.
    assert out["override"] == [16, [2.0, 2.0]]

    status, message = out["malformed"]
    assert status == invalid and "load parameter 'config' is not valid JSON" in message
    status, message = out["unknown_field"]
    assert status == invalid and 'no field named "max_batch_sizes"' in message
    status, message = out["alone"]  # a config is replaced whole, as in Triton
    assert status == invalid and "at least one input is required" in message
    assert out["after_refusals"] == [True, 16, [2.0, 2.0]]  # the override still serves

    assert out["files"] == [8, [3.0, 3.0]]
    status, message = out["files_without_config"]
    assert status == invalid and "need its config too" in message
    status, message = out["raising"]
    assert status == invalid
    assert "file:1/model.py: build_model(parameters) raised: ValueError" in message
    assert "the weights are missing" in message
    status, message = out["traversal"]
    assert status == invalid and "'../plus/1/model.py'" in message
    assert out["after_file_refusals"] == [True, 8, [3.0, 3.0]]  # the files' version serves

    assert out["fresh"] == [True, [3.0, 3.0]]
    assert out["fresh_unloaded"] is False
    assert out["restored"] == [8, [2.0, 2.0]]


def load(stub, parameters: dict[str, tuple[str, object]], name: str = "plus"
         ) -> tuple[grpc.StatusCode, str]:
    """Load ``name`` with ``parameters`` (key -> (ModelRepositoryParameter field, value))."""
    request = pb.RepositoryModelLoadRequest(model_name=name)
    for key, (kind, value) in parameters.items():
        setattr(request.parameters[key], kind, value)
    try:
        stub.RepositoryModelLoad(request, timeout=TIMEOUT_S)
    except grpc.RpcError as err:
        return err.code(), err.details()
    return grpc.StatusCode.OK, ""


def served_max_batch(stub) -> int:
    return stub.ModelConfig(pb.ModelConfigRequest(name="plus"), timeout=TIMEOUT_S
                            ).config.max_batch_size


def test_parameters_not_acted_on_are_refused(server, stub):
    sixteen = ("string_param", json.dumps(dict(PLUS_JSON, max_batch_size=16)))
    model = ("bytes_param", TIMES3_MODEL.encode())
    assert load(stub, {"config": ("string_param", json.dumps(PLUS_JSON))}) == (
        grpc.StatusCode.OK, "")
    cases = {
        "an unknown key": ({"configs": sixteen}, "unknown load parameter 'configs'"),
        "config as bytes": ({"config": ("bytes_param", sixteen[1].encode())},
                            "parameter 'config' must be a string"),
        "a file as a string": ({"config": sixteen, "file:1/model.py": ("string_param", "x")},
                               "parameter 'file:1/model.py' must be bytes"),
        "a JSON array": ({"config": ("string_param", "[]")}, "must be a JSON object"),
        "another model's name": (
            {"config": ("string_param", json.dumps(dict(PLUS_JSON, name="other")))},
            "name must be the model's name 'plus'"),
        "config.pbtxt as a file": ({"config": sixteen, "file:config.pbtxt": model},
                                   "inside the model folder"),
        "an absolute path": ({"config": sixteen, "file:/1/model.py": model},
                             "inside the model folder"),
        "a file that is a folder too": (
            {"config": sixteen, "file:1/model.py": model, "file:1/model.py/x": model},
            "'1/model.py' of the load is also a folder"),
    }
    for what, (parameters, expected) in cases.items():
        code, details = load(stub, parameters)
        assert (code, expected in details) == (grpc.StatusCode.INVALID_ARGUMENT, True), (
            what, code, details)
    too_large = ("bytes_param", b"#" * (MAX_FILES_BYTES + 1))
    code, details = load(stub, {"config": sixteen, "file:1/model.py": too_large})
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (f"hold {MAX_FILES_BYTES + 1} bytes, more than --max-load-files-bytes "
            f"{MAX_FILES_BYTES}") in details
    assert served_max_batch(stub) == 8  # nothing above was loaded

    unload = pb.RepositoryModelUnloadRequest(model_name="plus")
    unload.parameters["cascade"].bool_param = True
    with pytest.raises(grpc.RpcError) as caught:
        stub.RepositoryModelUnload(unload, timeout=TIMEOUT_S)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown unload parameter 'cascade'" in caught.value.details()
    assert stub.ModelReady(pb.ModelReadyRequest(name="plus"), timeout=TIMEOUT_S).ready

    # A repository name is not taken for this server's one repository.
    for rpc, request in (
            ("RepositoryIndex", pb.RepositoryIndexRequest(repository_name="models")),
            ("RepositoryModelLoad",
             pb.RepositoryModelLoadRequest(repository_name="models", model_name="plus")),
            ("RepositoryModelUnload",
             pb.RepositoryModelUnloadRequest(repository_name="models", model_name="plus"))):
        with pytest.raises(grpc.RpcError) as caught:
            getattr(stub, rpc)(request, timeout=TIMEOUT_S)
        assert (caught.value.code(), caught.value.details()) == (
            grpc.StatusCode.UNIMPLEMENTED,
            "repository_name 'models' is not supported: this server serves one model "
            "repository (--model-repository); leave repository_name empty"), rpc
    assert stub.ModelReady(pb.ModelReadyRequest(name="plus"), timeout=TIMEOUT_S).ready


def test_a_health_watch_follows_a_model_through_unload_and_load(server, stub):
    """Watch sends the model's status, then each one it takes: NOT_SERVING once unloaded,
    SERVING once loaded again; a Watch of a name no model has says SERVICE_UNKNOWN."""
    health = health_pb2.HealthCheckResponse
    with grpc.insecure_channel(server.address) as channel:
        watcher = health_pb2_grpc.HealthStub(channel)
        unknown = watcher.Watch(health_pb2.HealthCheckRequest(service="nope"), timeout=TIMEOUT_S)
        assert next(unknown).status == health.SERVICE_UNKNOWN
        unknown.cancel()
        watch = watcher.Watch(health_pb2.HealthCheckRequest(service="plus"), timeout=TIMEOUT_S)
        assert next(watch).status == health.SERVING
        stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="plus"),
                                   timeout=TIMEOUT_S)
        assert next(watch).status == health.NOT_SERVING
        stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="plus"),
                                 timeout=TIMEOUT_S)
        assert next(watch).status == health.SERVING
        watch.cancel()
    assert stub.ModelReady(pb.ModelReadyRequest(name="plus"), timeout=TIMEOUT_S).ready
