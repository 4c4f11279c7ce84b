"""System and CUDA shared memory (``--shared-memory``) in every mode, through tritonclient's own
``utils.shared_memory`` helpers and perf_analyzer's ``--shared-memory system``.

tritonclient cannot share a process with our protos (both register protobuf package
``inference``), so its calls run in a subprocess that prints JSON and the assertions run here.
The tests that need no tritonclient (a region shrinking while its request is queued, the
setting off) speak our protos over gRPC.
"""

from __future__ import annotations

import collections
import json
import mmap
import os
import subprocess
import sys
import textwrap
import threading
import types
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest

from batchgate.protos import inference_pb2 as pb
from batchgate.protos import inference_pb2_grpc
from tests.support.polling import poll
from tests.support.regions import CLIENT_REGION_PREFIX
from tests.support.servers import SERVER_MODES, start_in_mode
from tests.support.tools import PERF_ANALYZER, PERF_ANALYZER_ANY_STABILITY, perf_analyzer_unavailable

ROOT = Path(__file__).resolve().parent.parent


def start_with_shared_memory(mode: str, repository: Path, gate):
    if mode == "single":
        return start_in_mode(mode, repository, gate, shared_memory=True)
    return start_in_mode(mode, repository, gate, extra_args=("--shared-memory",))


@pytest.fixture(scope="module", params=SERVER_MODES)
def shm_server(request, model_repository, gate):
    running = start_with_shared_memory(request.param, model_repository, gate)
    yield running
    gate.open()
    running.stop()


# -- tritonclient ------------------------------------------------------------------------------

TRITONCLIENT_SCRIPT = textwrap.dedent('''
    import json, os, sys
    import numpy as np
    import tritonclient.grpc as grpcclient
    import tritonclient.utils.shared_memory as shm
    from tritonclient.utils import InferenceServerException

    url, prefix, tag = sys.argv[1], sys.argv[2], sys.argv[3]
    c = grpcclient.InferenceServerClient(url=url)
    out = {"extensions": list(c.get_server_metadata().extensions)}

    def error(call):
        try:
            call()
        except InferenceServerException as e:
            return [e.status(), e.message()]
        return None

    # "failing" is y = x + 1 over FP32 [2], batching up to 8.
    x = np.array([[1.5, -2.0], [3.0, 4.25]], dtype=np.float32)
    nbytes = x.nbytes
    h_in = shm.create_shared_memory_region("in", prefix + "in_" + tag, 64)
    h_out = shm.create_shared_memory_region("out", prefix + "out_" + tag, 64)
    shm.set_shared_memory_region(h_in, [x], offset=16)
    c.register_system_shared_memory("in", prefix + "in_" + tag, 48, offset=16)
    c.register_system_shared_memory("out", prefix + "out_" + tag, 64)
    out["duplicate"] = error(
        lambda: c.register_system_shared_memory("in", prefix + "in_" + tag, 8))

    def request(in_offset=0, in_bytes=nbytes, out_region="out", out_bytes=nbytes, out_offset=0):
        i = grpcclient.InferInput("INPUT__0", list(x.shape), "FP32")
        i.set_shared_memory("in", in_bytes, offset=in_offset)
        o = grpcclient.InferRequestedOutput("OUTPUT__0")
        if out_region is not None:
            o.set_shared_memory(out_region, out_bytes, offset=out_offset)
        return [i], [o]

    inputs, outputs = request(out_offset=8)
    result = c.infer("failing", inputs, outputs=outputs)
    response = result.get_response()
    out["reply_outputs"] = [[t.name, t.datatype, list(t.shape), dict(t.parameters)]
                            for t in response.outputs]
    out["reply_raw"] = [len(r) for r in response.raw_output_contents]
    out["placed"] = shm.get_contents_as_numpy(h_out, np.float32, [2, 2], offset=8).tolist()

    # Input in shared memory, output in the reply.
    inputs, outputs = request(out_region=None)
    out["in_reply"] = c.infer("failing", inputs, outputs=outputs).as_numpy("OUTPUT__0").tolist()

    # A raw input, its output in shared memory.
    i = grpcclient.InferInput("INPUT__0", [1, 2], "FP32")
    i.set_data_from_numpy(x[:1] * 10)
    o = grpcclient.InferRequestedOutput("OUTPUT__0")
    o.set_shared_memory("out", 8, offset=32)
    c.infer("failing", [i], outputs=[o])
    out["raw_in_placed_out"] = shm.get_contents_as_numpy(h_out, np.float32, [1, 2],
                                                         offset=32).tolist()

    # BYTES through shared memory: strlen's TEXT in, LENGTH out.
    words = np.array([[b"shared"], [b"memory!"]], dtype=np.object_)
    from tritonclient.utils import serialize_byte_tensor
    serialized = serialize_byte_tensor(words)
    text_bytes = len(serialized.item())
    h_text = shm.create_shared_memory_region("text", prefix + "text_" + tag, 256)
    shm.set_shared_memory_region(h_text, [serialized])
    c.register_system_shared_memory("text", prefix + "text_" + tag, 256)
    i = grpcclient.InferInput("TEXT", [2, 1], "BYTES")
    i.set_shared_memory("text", text_bytes)
    o = grpcclient.InferRequestedOutput("LENGTH")
    o.set_shared_memory("out", 16, offset=48)
    c.infer("strlen", [i], outputs=[o])
    out["bytes_lengths"] = shm.get_contents_as_numpy(h_out, np.int64, [2, 1], offset=48).tolist()

    status = c.get_system_shared_memory_status(as_json=True)
    out["status"] = sorted((r["name"], r["key"], int(r.get("offset", 0)), int(r["byte_size"]))
                           for r in status.get("regions", {}).values())
    out["status_one"] = list(c.get_system_shared_memory_status("in", as_json=True)["regions"])
    out["status_unknown"] = error(lambda: c.get_system_shared_memory_status("nope"))

    # Bad requests: each fails alone, with what was wrong.
    def infer_error(**kwargs):
        inputs, outputs = request(**kwargs)
        return error(lambda: c.infer("failing", inputs, outputs=outputs))

    c.register_system_shared_memory("small", prefix + "in_" + tag, 8)
    def small():
        i = grpcclient.InferInput("INPUT__0", list(x.shape), "FP32")
        i.set_shared_memory("small", nbytes)
        return c.infer("failing", [i])
    out["too_small"] = error(small)
    out["offset_past_end"] = infer_error(in_offset=48)
    out["byte_size_wrong"] = infer_error(in_bytes=nbytes - 4)
    out["output_too_small"] = infer_error(out_bytes=8)
    out["unknown_region"] = infer_error(out_region="nope")
    out["register_past_end"] = error(
        lambda: c.register_system_shared_memory("big", prefix + "in_" + tag, 64, offset=8))
    out["register_no_key"] = error(
        lambda: c.register_system_shared_memory("none", prefix + "none_" + tag, 8))
    out["register_escape"] = error(
        lambda: c.register_system_shared_memory("esc", "/../etc/passwd", 8))

    # A region the client unlinks while it is registered.
    h_gone = shm.create_shared_memory_region("gone", prefix + "gone_" + tag, 64)
    shm.set_shared_memory_region(h_gone, [x])
    c.register_system_shared_memory("gone", prefix + "gone_" + tag, 64)
    shm.destroy_shared_memory_region(h_gone)
    def gone():
        i = grpcclient.InferInput("INPUT__0", list(x.shape), "FP32")
        i.set_shared_memory("gone", nbytes)
        return c.infer("failing", [i])
    out["unlinked"] = error(gone)
    # A region the client truncates while it is registered: an error, never a crash.
    c.unregister_system_shared_memory("small")
    os.truncate("/dev/shm" + prefix + "in_" + tag, 0)
    out["truncated"] = infer_error()
    out["live_after"] = c.is_server_live()

    c.unregister_system_shared_memory("in")
    out["after_one"] = sorted(c.get_system_shared_memory_status(as_json=True)
                              .get("regions", {}))
    c.unregister_system_shared_memory("never-registered")
    c.unregister_system_shared_memory()
    out["after_all"] = sorted(c.get_system_shared_memory_status(as_json=True)
                              .get("regions", {}))

    out["cuda_status"] = error(lambda: c.get_cuda_shared_memory_status())
    out["cuda_register"] = error(
        lambda: c.register_cuda_shared_memory("gpu", b"\\0" * 64, 0, 64))
    for h in (h_in, h_out, h_text):
        shm.destroy_shared_memory_region(h)
    print(json.dumps(out))
''')


def run_tritonclient(address: str) -> dict:
    tag = uuid.uuid4().hex[:12]
    try:
        done = subprocess.run([sys.executable, "-c", TRITONCLIENT_SCRIPT, address,
                               "/" + CLIENT_REGION_PREFIX, tag],
                              capture_output=True, text=True, timeout=120)
    finally:  # what a script that failed half-way left behind
        for name in os.listdir("/dev/shm"):
            if name.startswith(CLIENT_REGION_PREFIX) and name.endswith("_" + tag):
                os.unlink("/dev/shm/" + name)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_tritonclient_shared_memory(shm_server):
    out = run_tritonclient(shm_server.address)
    assert "system_shared_memory" in out["extensions"]
    # CUDA's only where the models' process has a device to map a client's regions on.
    assert ("cuda_shared_memory" in out["extensions"]) == _has_cuda()
    x = np.array([[1.5, -2.0], [3.0, 4.25]], dtype=np.float32)

    # Inputs read from the region at its offset, outputs written into the other.
    assert out["placed"] == (x + 1).tolist()
    assert out["reply_outputs"] == [["OUTPUT__0", "FP32", [2, 2], {}]]
    assert out["reply_raw"] == [0]  # an empty entry keeps outputs and raw contents aligned
    assert out["in_reply"] == (x + 1).tolist()
    assert out["raw_in_placed_out"] == (x[:1] * 10 + 1).tolist()
    assert out["bytes_lengths"] == [[6], [7]]

    assert out["duplicate"][0] == "StatusCode.ALREADY_EXISTS"
    assert out["status_one"] == ["in"]
    assert out["status_unknown"][0] == "StatusCode.NOT_FOUND"

    assert out["too_small"][0] == "StatusCode.INVALID_ARGUMENT"
    assert "past the end of shared-memory region 'small' (8 bytes registered)" in (
        out["too_small"][1])
    assert out["offset_past_end"][0] == "StatusCode.INVALID_ARGUMENT"
    assert "16 bytes at offset 48" in out["offset_past_end"][1]
    assert out["byte_size_wrong"][0] == "StatusCode.INVALID_ARGUMENT"
    assert "needs 16 bytes, shared_memory_byte_size is 12" in out["byte_size_wrong"][1]
    assert out["output_too_small"][0] == "StatusCode.INVALID_ARGUMENT"
    assert "output 'OUTPUT__0' needs 16 bytes; shared_memory_byte_size gives it 8" in (
        out["output_too_small"][1])
    assert out["unknown_region"][0] == "StatusCode.NOT_FOUND"
    assert "no shared-memory region 'nope' is registered" in out["unknown_region"][1]
    assert out["register_past_end"][0] == "StatusCode.INVALID_ARGUMENT"
    assert "past the end of key" in out["register_past_end"][1]
    assert out["register_no_key"][0] == "StatusCode.NOT_FOUND"
    assert out["register_escape"][0] == "StatusCode.INVALID_ARGUMENT"
    assert "must be one name in /dev/shm" in out["register_escape"][1]

    assert out["unlinked"][0] == "StatusCode.INVALID_ARGUMENT"
    assert "removed (unlinked)" in out["unlinked"][1]
    assert out["truncated"][0] == "StatusCode.INVALID_ARGUMENT"
    assert "shrank" in out["truncated"][1]
    assert out["live_after"]

    assert out["after_one"] == ["gone", "out", "text"]
    assert out["after_all"] == []

    assert out["cuda_status"][0] == "StatusCode.FAILED_PRECONDITION" or _has_cuda()
    if not _has_cuda():
        assert "has no CUDA device" in out["cuda_status"][1]
        assert out["cuda_register"][0] == "StatusCode.FAILED_PRECONDITION"


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# -- a region that shrinks while its request waits in the queue ----------------------------------

class Region:
    """A file in /dev/shm, as a client's shm_open makes one."""

    def __init__(self, size: int) -> None:
        self.key = f"/{CLIENT_REGION_PREFIX}test_{uuid.uuid4().hex[:12]}"
        self.path = "/dev/shm" + self.key
        self.fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(self.fd, size)
        self.map = mmap.mmap(self.fd, size)

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)
        if os.path.exists(self.path):
            os.unlink(self.path)


def _stub(address: str):
    return inference_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(address))


def _gated_request(value: float, region: str | None = None) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="gated")
    tensor = request.inputs.add(name="INPUT__0", datatype="FP32", shape=[1, 2])
    x = np.full((1, 2), value, np.float32)
    if region is None:
        request.raw_input_contents.append(x.tobytes())
    else:
        tensor.parameters["shared_memory_region"].string_param = region
        tensor.parameters["shared_memory_byte_size"].int64_param = x.nbytes
    return request


def test_a_region_that_shrinks_while_queued_fails_its_request_alone(shm_server, gate):
    region = Region(4096)
    region.map[:8] = np.full((1, 2), 7.0, np.float32).tobytes()
    stub = _stub(shm_server.address)
    try:
        stub.SystemSharedMemoryRegister(pb.SystemSharedMemoryRegisterRequest(
            name="shrinking", key=region.key, byte_size=4096), timeout=30)
        gate.close()
        first = stub.ModelInfer.future(_gated_request(1.0), timeout=60)
        gate.wait_entered()
        placed = stub.ModelInfer.future(_gated_request(0.0, "shrinking"), timeout=60)
        neighbour = stub.ModelInfer.future(_gated_request(3.0), timeout=60)
        poll(lambda: shm_server.queue_depth("gated") >= 2, 30, "both requests queued")
        os.ftruncate(region.fd, 0)  # after its intake checks, before its batch reads it
        gate.open()
        assert np.frombuffer(first.result().raw_output_contents[0], np.float32).tolist() == [
            2.0, 2.0]
        with pytest.raises(grpc.RpcError) as info:
            placed.result()
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "shrank" in info.value.details()
        # The request it was batched with is answered as usual.
        assert np.frombuffer(neighbour.result().raw_output_contents[0],
                             np.float32).tolist() == [6.0, 6.0]
    finally:
        gate.open()
        region.close()
        stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest(), timeout=30)


def test_a_region_truncated_and_restored_under_load_never_faults_the_server(shm_server):
    # Its inputs are read with pread, never through a mapping: a file that shrinks under a read
    # makes the read come back short (INVALID_ARGUMENT, that request alone), not a SIGBUS that
    # kills the process holding the models.
    rows, width = 64, 512
    size = rows * width * 4
    region = Region(size)
    region.map[:] = np.ones(rows * width, np.float32).tobytes()
    stub = _stub(shm_server.address)
    executors = shm_server.supervisor.pids("executor") if shm_server.multiprocess else None
    stop = threading.Event()

    def flap() -> None:
        while not stop.is_set():
            os.ftruncate(region.fd, 0)
            os.ftruncate(region.fd, size)

    request = pb.ModelInferRequest(model_name="mlp")
    tensor = request.inputs.add(name="INPUT__0", datatype="FP32", shape=[rows, width])
    tensor.parameters["shared_memory_region"].string_param = "flapping"
    tensor.parameters["shared_memory_byte_size"].int64_param = size
    flapper = threading.Thread(target=flap)
    try:
        stub.SystemSharedMemoryRegister(pb.SystemSharedMemoryRegisterRequest(
            name="flapping", key=region.key, byte_size=size), timeout=30)
        flapper.start()
        codes = collections.Counter()
        for _ in range(8):
            calls = [stub.ModelInfer.future(request, timeout=60) for _ in range(16)]
            for call in calls:
                try:
                    call.result()
                    codes[grpc.StatusCode.OK] += 1
                except grpc.RpcError as exc:
                    codes[exc.code()] += 1
                    assert exc.code() is not grpc.StatusCode.INVALID_ARGUMENT or (
                        "shrank" in exc.details() or "early" in exc.details()), exc.details()
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}, codes
    finally:
        stop.set()
        if flapper.is_alive():
            flapper.join()
        stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest(), timeout=30)
        region.close()
    if executors is not None:
        assert shm_server.supervisor.pids("executor") == executors  # never restarted


def test_registrations_survive_the_client_and_serve_every_front_end(shm_server):
    region = Region(64)
    region.map[:8] = np.array([[5.0, 6.0]], np.float32).tobytes()
    try:
        with grpc.insecure_channel(shm_server.address) as channel:
            inference_pb2_grpc.GRPCInferenceServiceStub(channel).SystemSharedMemoryRegister(
                pb.SystemSharedMemoryRegisterRequest(name="kept", key=region.key, byte_size=64),
                timeout=30)
        # Another connection (another front end process, maybe) sees and uses it.
        stub = _stub(shm_server.address)
        status = stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest(), timeout=30)
        assert status.regions["kept"].key == region.key
        assert status.regions["kept"].byte_size == 64
        request = pb.ModelInferRequest(model_name="failing")
        tensor = request.inputs.add(name="INPUT__0", datatype="FP32", shape=[1, 2])
        tensor.parameters["shared_memory_region"].string_param = "kept"
        tensor.parameters["shared_memory_byte_size"].int64_param = 8
        output = request.outputs.add(name="OUTPUT__0")
        output.parameters["shared_memory_region"].string_param = "kept"
        output.parameters["shared_memory_offset"].int64_param = 8
        output.parameters["shared_memory_byte_size"].uint64_param = 8
        reply = stub.ModelInfer(request, timeout=30)
        assert reply.raw_output_contents == [b""]
        assert list(reply.outputs[0].shape) == [1, 2]
        assert np.frombuffer(region.map[8:16], np.float32).tolist() == [6.0, 7.0]
    finally:
        region.close()
        _stub(shm_server.address).SystemSharedMemoryUnregister(
            pb.SystemSharedMemoryUnregisterRequest(name="kept"), timeout=30)


@pytest.mark.parametrize("parameters, message", [
    ({"shared_memory_region": ("string_param", "r")},
     "'shared_memory_region' and 'shared_memory_byte_size' go together"),
    ({"shared_memory_region": ("int64_param", 1), "shared_memory_byte_size": ("int64_param", 8)},
     "parameter 'shared_memory_region' must be a string, got int64_param"),
    ({"shared_memory_region": ("string_param", "r"),
      "shared_memory_byte_size": ("string_param", "8")},
     "parameter 'shared_memory_byte_size' must be an integer, got string_param"),
    ({"shared_memory_region": ("string_param", "r"), "shared_memory_byte_size": ("int64_param", 8),
      "shared_memory_offset": ("int64_param", -1)},
     "parameter 'shared_memory_offset' must be >= 0, got -1"),
])
def test_the_front_end_checks_the_parameters(shm_server, parameters, message):
    request = pb.ModelInferRequest(model_name="failing")
    tensor = request.inputs.add(name="INPUT__0", datatype="FP32", shape=[1, 2])
    for key, (field, value) in parameters.items():
        setattr(tensor.parameters[key], field, value)
    with pytest.raises(grpc.RpcError) as info:
        _stub(shm_server.address).ModelInfer(request, timeout=30)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()


def test_an_input_in_shared_memory_with_contents_is_refused(shm_server):
    request = pb.ModelInferRequest(model_name="failing")
    tensor = request.inputs.add(name="INPUT__0", datatype="FP32", shape=[1, 2])
    tensor.parameters["shared_memory_region"].string_param = "r"
    tensor.parameters["shared_memory_byte_size"].int64_param = 8
    tensor.contents.fp32_contents.extend([1.0, 2.0])
    with pytest.raises(grpc.RpcError) as info:
        _stub(shm_server.address).ModelInfer(request, timeout=30)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "is in shared memory and has contents too" in info.value.details()


# -- the setting off (the shared server fixture runs without --shared-memory) -------------------

def test_shared_memory_is_off_unless_turned_on(server):
    stub = _stub(server.address)
    assert "system_shared_memory" not in stub.ServerMetadata(
        pb.ServerMetadataRequest(), timeout=30).extensions
    for rpc, request in (("SystemSharedMemoryStatus", pb.SystemSharedMemoryStatusRequest()),
                         ("SystemSharedMemoryRegister", pb.SystemSharedMemoryRegisterRequest(
                             name="r", key="/k", byte_size=8)),
                         ("CudaSharedMemoryStatus", pb.CudaSharedMemoryStatusRequest())):
        with pytest.raises(grpc.RpcError) as info:
            getattr(stub, rpc)(request, timeout=30)
        assert info.value.code() is grpc.StatusCode.UNIMPLEMENTED
        assert "--shared-memory" in info.value.details()
    request = _gated_request(1.0, "r")
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request, timeout=30)
    assert info.value.code() is grpc.StatusCode.UNIMPLEMENTED
    assert "--shared-memory" in info.value.details()


# -- perf_analyzer --------------------------------------------------------------------------------


@pytest.mark.skipif(perf_analyzer_unavailable() is not None,
                    reason=str(perf_analyzer_unavailable()))
def test_perf_analyzer_with_system_shared_memory_has_no_errors(shm_server, tmp_path):
    stub = _stub(shm_server.address)

    def stats():
        return stub.ModelStatistics(pb.ModelStatisticsRequest(name="failing"),
                                    timeout=30).model_stats[0]

    before = stats()
    csv = tmp_path / "pa.csv"
    done = subprocess.run(
        [str(PERF_ANALYZER), "-m", "failing", "-i", "grpc", "-u", shm_server.address,
         "--shared-memory", "system", "--output-shared-memory-size", "64",
         "--concurrency-range", "4:4", "--measurement-interval", "1000",
         "--max-trials", "6", *PERF_ANALYZER_ANY_STABILITY, "-f", str(csv)],
        capture_output=True, text=True, timeout=240,
    )
    after = stats()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Inferences/Second" in csv.read_text()
    assert after.inference_stats.fail.count == before.inference_stats.fail.count
    assert after.inference_stats.success.count > before.inference_stats.success.count
    # perf_analyzer unregisters its regions when it ends.
    assert not stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest(),
                                             timeout=30).regions


# The CUDA client, in a process of its own: CUDA refuses to open an IPC handle in the process
# that made it, and in one-process mode the server is this test's process. Each region is its
# own cudaMalloc allocation, so the handle's base (what the server maps) is the region's start;
# the tensors lie at offsets inside the regions, and the bytes around the output are read back
# to show that the offset, not the base, was written.
CUDA_CLIENT_SCRIPT = textwrap.dedent("""
    import ctypes, json, sys
    import grpc, numpy as np, torch
    from batchgate.protos import inference_pb2 as pb, inference_pb2_grpc
    from batchgate.server.executor.cuda_ipc import runtime_soname

    REGION, IN_AT, OUT_AT = 1024, 256, 512
    torch.cuda.init()  # loads torch's CUDA runtime: the soname below is that library
    rt = ctypes.CDLL(runtime_soname(torch.version.cuda))

    def check(status, what):
        if status != 0:
            raise SystemExit(f"{what}: CUDA error {status}")

    def allocate():
        pointer = ctypes.c_void_p()
        check(rt.cudaMalloc(ctypes.byref(pointer), ctypes.c_size_t(REGION)), "cudaMalloc")
        check(rt.cudaMemset(pointer, 0, ctypes.c_size_t(REGION)), "cudaMemset")
        handle = (ctypes.c_char * 64)()
        check(rt.cudaIpcGetMemHandle(handle, pointer), "cudaIpcGetMemHandle")
        return pointer.value, bytes(handle)

    def copy(dst, src, nbytes, kind):  # kind 1: host to device, 2: device to host
        check(rt.cudaMemcpy(ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes),
                            kind), "cudaMemcpy")

    x = np.array([[1.5, -2.0]], dtype=np.float32)
    (x_ptr, x_handle), (out_ptr, out_handle) = allocate(), allocate()
    copy(x_ptr + IN_AT, x.ctypes.data, x.nbytes, 1)
    stub = inference_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(sys.argv[1]))
    found = {"extensions": list(stub.ServerMetadata(pb.ServerMetadataRequest(),
                                                    timeout=30).extensions)}
    for name, handle in (("gx", x_handle), ("gy", out_handle)):
        stub.CudaSharedMemoryRegister(pb.CudaSharedMemoryRegisterRequest(
            name=name, raw_handle=handle, device_id=0, byte_size=REGION), timeout=30)
    try:
        found["regions"] = sorted(stub.CudaSharedMemoryStatus(
            pb.CudaSharedMemoryStatusRequest(), timeout=30).regions)
        request = pb.ModelInferRequest(model_name="failing")
        tensor = request.inputs.add(name="INPUT__0", datatype="FP32", shape=[1, 2])
        tensor.parameters["shared_memory_region"].string_param = "gx"
        tensor.parameters["shared_memory_offset"].int64_param = IN_AT
        tensor.parameters["shared_memory_byte_size"].int64_param = x.nbytes
        output = request.outputs.add(name="OUTPUT__0")
        output.parameters["shared_memory_region"].string_param = "gy"
        output.parameters["shared_memory_offset"].int64_param = OUT_AT
        output.parameters["shared_memory_byte_size"].int64_param = x.nbytes
        found["raw_output_contents"] = [len(r) for r in stub.ModelInfer(
            request, timeout=30).raw_output_contents]
        # The server synchronised its copy before it replied.
        around = np.zeros(8, np.float32)  # 16 bytes either side of the output
        copy(around.ctypes.data, out_ptr + OUT_AT - 16, around.nbytes, 2)
        found["around_output"] = around.tolist()
    finally:
        stub.CudaSharedMemoryUnregister(pb.CudaSharedMemoryUnregisterRequest(), timeout=30)
    rt.cudaFree(ctypes.c_void_p(x_ptr))
    rt.cudaFree(ctypes.c_void_p(out_ptr))
    print(json.dumps(found))
""")


@pytest.mark.cuda
@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA device (this machine has none)")
def test_cuda_shared_memory_inputs_and_outputs(shm_server):
    done = subprocess.run([sys.executable, "-c", CUDA_CLIENT_SCRIPT, shm_server.address],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert "cuda_shared_memory" in found["extensions"]
    assert found["regions"] == ["gx", "gy"]
    assert found["raw_output_contents"] == [0]  # the output went to the region
    # x + 1 at the output's offset, nothing written before or after it.
    assert found["around_output"] == [0.0] * 4 + [2.5, -1.0] + [0.0] * 2


def test_the_cuda_runtime_is_the_one_of_the_cuda_torch_was_built_for():
    from batchgate.server.executor.cuda_ipc import runtime_soname
    from batchgate.server.rules.status import Code, StatusError

    assert runtime_soname("13.0") == "libcudart.so.13"
    assert runtime_soname("12.8") == "libcudart.so.12"
    assert runtime_soname("11.8") == "libcudart.so.11.0"
    with pytest.raises(StatusError) as info:
        runtime_soname(None)  # a CPU build of torch
    assert info.value.code == Code.FAILED_PRECONDITION
    assert "not built with CUDA" in str(info.value)


# -- the registry itself, without a server --------------------------------------------------------

def _registry():
    from batchgate.server.executor.shared_memory import SharedMemoryRegistry

    return SharedMemoryRegistry(True)


def _register(registry, name, key, byte_size, offset=0):
    import asyncio

    return asyncio.run(registry.system_register(pb.SystemSharedMemoryRegisterRequest(
        name=name, key=key, offset=offset, byte_size=byte_size)))


def _status_error(call):
    from batchgate.batcher.errors import BatchgateError
    from batchgate.server.rules.status import status_of

    with pytest.raises(BatchgateError) as info:
        call()
    return status_of(info.value)


def test_keys_that_leave_dev_shm_or_are_links_are_refused():
    from batchgate.server.rules.status import Code

    registry = _registry()
    target = Region(64)
    link = "/dev/shm" + target.key + "_link"
    os.symlink(target.path, link)
    try:
        for key in ("/../etc/passwd", "a/b", "", "/", "..", "/" + target.key[1:] + "_link"):
            code, message = _status_error(lambda: _register(registry, "r", key, 8))
            assert code in (Code.INVALID_ARGUMENT, Code.NOT_FOUND), (key, message)
        code, message = _status_error(lambda: _register(registry, "r", target.key + "_link", 8))
        assert code is Code.INVALID_ARGUMENT and "cannot open" in message  # O_NOFOLLOW
        _register(registry, "r", target.key, 64)  # the file itself is fine
    finally:
        os.unlink(link)
        registry.close()
        target.close()


def test_a_request_in_flight_keeps_reading_a_region_unregistered_meanwhile():
    import asyncio

    from batchgate.server.executor.shared_memory import Placement

    registry = _registry()
    region = Region(64)
    region.map[:8] = np.array([1.0, 2.0], np.float32).tobytes()
    try:
        _register(registry, "r", region.key, 64)
        placement = Placement("r", 0, 8, (1, 2))
        view = registry.input_array(placement, "INPUT__0", "FP32")
        check = registry.checker([(0, "INPUT__0", placement)])
        assert not view.flags.writeable  # a stand-in for the shape: never read
        asyncio.run(registry.system_unregister(pb.SystemSharedMemoryUnregisterRequest()))
        request = types.SimpleNamespace(inputs=[view])
        check(request)  # the descriptor is still open for it
        assert request.inputs[0].tolist() == [[1.0, 2.0]] and request.inputs[0] is not view
        os.ftruncate(region.fd, 0)
        from batchgate.batcher.errors import InvalidRequest

        with pytest.raises(InvalidRequest, match="shrank"):
            check(types.SimpleNamespace(inputs=[view]))
    finally:
        registry.close()
        region.close()


def test_bool_inputs_in_shared_memory_hold_only_0_and_1():
    from batchgate.batcher.errors import InvalidRequest
    from batchgate.server.executor.shared_memory import Placement

    registry = _registry()
    region = Region(64)
    region.map[:3] = bytes([0, 1, 2])
    try:
        _register(registry, "r", region.key, 64)
        assert registry.input_array(Placement("r", 0, 2, (1, 2)), "B", "BOOL").tolist() == [
            [False, True]]
        with pytest.raises(InvalidRequest, match="bytes 0 and 1 only"):
            registry.input_array(Placement("r", 0, 3, (1, 3)), "B", "BOOL")
    finally:
        registry.close()
        region.close()


def _executor_holds(pid: int, path: str) -> bool:
    """Whether process ``pid`` maps ``path`` or has a descriptor of it open."""
    if path in Path(f"/proc/{pid}/maps").read_text():
        return True
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd) == path:
                return True
        except OSError:
            continue
    return False


def test_unregistering_releases_the_mapping_and_the_descriptor(shm_server):
    import gc
    import weakref

    region = Region(4096)
    region.map[:8] = np.array([[1.0, 2.0]], np.float32).tobytes()
    stub = _stub(shm_server.address)
    try:
        stub.SystemSharedMemoryRegister(pb.SystemSharedMemoryRegisterRequest(
            name="released", key=region.key, byte_size=4096), timeout=30)
        if shm_server.mode == "single":  # this process maps the file too: ask the registry
            held = weakref.ref(shm_server.gateway.shared_memory._system["released"])
            holds = lambda: held() is not None  # noqa: E731 (its finalizer closes the fd)
        else:
            pid = shm_server.supervisor.pids("executor")[None]
            holds = lambda: _executor_holds(pid, region.path)  # noqa: E731
        assert holds()
        request = pb.ModelInferRequest(model_name="failing")
        tensor = request.inputs.add(name="INPUT__0", datatype="FP32", shape=[1, 2])
        tensor.parameters["shared_memory_region"].string_param = "released"
        tensor.parameters["shared_memory_byte_size"].int64_param = 8
        reply = stub.ModelInfer(request, timeout=30)
        assert np.frombuffer(reply.raw_output_contents[0], np.float32).tolist() == [2.0, 3.0]
        stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest(), timeout=30)
        # No collection is needed: nothing but the registration and requests hold a region.
        gc.disable()
        try:
            poll(lambda: not holds(), 30, "the server let go of the region")
        finally:
            gc.enable()
    finally:
        region.close()


def _decode_bytes(data: bytes, count: int) -> list[bytes]:
    items, at = [], 0
    for _ in range(count):
        length = int.from_bytes(data[at:at + 4], "little")
        items.append(data[at + 4:at + 4 + length])
        at += 4 + length
    return items


def test_bytes_outputs_of_a_shared_batch_go_into_the_region_row_for_row(shm_server):
    # "strings" batches up to 4 rows and waits for them: two requests of 2 rows share a batch.
    region = Region(4096)
    stub = _stub(shm_server.address)

    def request(words, placed):
        r = pb.ModelInferRequest(model_name="strings")
        t = r.inputs.add(name="TEXT", datatype="BYTES", shape=[2, 2])
        t.contents.bytes_contents.extend(words)
        for name, offset in (("UPPER", 0), ("SWAPPED", 512)):
            out = r.outputs.add(name=name)
            if placed:
                out.parameters["shared_memory_region"].string_param = "bytes-out"
                out.parameters["shared_memory_offset"].int64_param = offset
                out.parameters["shared_memory_byte_size"].int64_param = 512
        return r

    try:
        stub.SystemSharedMemoryRegister(pb.SystemSharedMemoryRegisterRequest(
            name="bytes-out", key=region.key, byte_size=4096), timeout=30)
        plain = stub.ModelInfer.future(request([b"a", b"b", b"c", b"d"], False), timeout=60)
        placed = stub.ModelInfer.future(request([b"ef", b"gh", b"ij", b"kl"], True), timeout=60)
        reply = placed.result()
        assert [list(o.shape) for o in reply.outputs] == [[2, 2], [2, 2]]
        assert reply.raw_output_contents == [b"", b""]
        assert _decode_bytes(region.map[:512], 4) == [b"EF", b"GH", b"IJ", b"KL"]
        assert _decode_bytes(region.map[512:1024], 4) == [b"gh", b"ef", b"kl", b"ij"]
        neighbour = plain.result()
        assert _decode_bytes(neighbour.raw_output_contents[0], 4) == [b"A", b"B", b"C", b"D"]
        assert _decode_bytes(neighbour.raw_output_contents[1], 4) == [b"b", b"a", b"d", b"c"]
    finally:
        region.close()
        stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest(), timeout=30)
