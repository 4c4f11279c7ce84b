"""The native front end and the one-process server answer every bad request alike, byte for byte.

The same requests go to a server of each mode at once; the status codes and messages (and a
stream's error messages) must be equal. First a matrix of every kind of bad input the codec,
the repository and the executor refuse, then seeded random requests. The native front end is
written apart from the Python code (``server/native/``): this is what holds the two to one
behaviour.

A third server runs the native front end built with AddressSanitizer and UBSan
(``scripts/build-native.sh --sanitize``): it answers everything here too, then a load, a
drain, and its log must hold no sanitizer report.

The servers serve shared-memory tensors (``--shared-memory``), each with the same two regions
registered, so that the matrix holds what the front ends check of a request's
``shared_memory_*`` parameters and what the executor refuses behind them; the setting off is
checked against the one-process server's own message in every mode.
"""

from __future__ import annotations

import mmap
import os
import random
import struct
import uuid

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from batchgate.protos import inference_pb2 as pb
from batchgate.protos import inference_pb2_grpc
from batchgate.server.supervisor import native_binary as native
from batchgate.server.executor.shared_memory import OFF_MESSAGE
from tests.support.load import Load
from tests.support.models import NUMERIC_TYPES
from tests.support.raw_http2 import unary_call
from tests.support.regions import PARITY_REGION_PREFIX
from tests.support.sanitizers import SANITIZED, SANITIZER_ENV, SANITIZER_REPORTS
from tests.support.servers import native_or_skip, start_in_mode

# Slow (every front end side by side, the sanitizer build too): make test-fast leaves it out.
pytestmark = pytest.mark.slow

MODES = ("single", "native", "native-asan")
# Regions every server has registered (SharedRegions): inputs are read from the first, outputs
# written into the second.
REGION_BYTES = 4096
IN_REGION, OUT_REGION = "parity_in", "parity_out"
KEYS = {name: f"/{PARITY_REGION_PREFIX}{name}_{uuid.uuid4().hex[:8]}"
        for name in (IN_REGION, OUT_REGION)}


def start_with_shared_memory(mode: str, model_repository, gate, **overrides):
    if mode == "single":
        return start_in_mode(mode, model_repository, gate, shared_memory=True)
    return start_in_mode(mode, model_repository, gate, extra_args=("--shared-memory",),
                         **overrides)


def start_sanitized(model_repository, gate):
    native_or_skip()
    if not SANITIZED.is_file():
        reason = f"the sanitizer build {SANITIZED} is missing (scripts/build-native.sh --sanitize)"
        if os.environ.get("BATCHGATE_REQUIRE_NATIVE"):
            pytest.fail(reason)
        pytest.skip(reason)
    env = {**os.environ, native.ENV_VAR: str(SANITIZED), **SANITIZER_ENV}
    return start_with_shared_memory("native", model_repository, gate, env=env)


class SharedRegions:
    """Two files in /dev/shm, mapped here, each registered under its name with every server."""

    def __init__(self) -> None:
        self.keys = KEYS
        self.maps = {}
        for name, key in self.keys.items():
            fd = os.open("/dev/shm" + key, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, REGION_BYTES)
                self.maps[name] = mmap.mmap(fd, REGION_BYTES)
            finally:
                os.close(fd)

    def register(self, stub) -> None:
        for name, key in self.keys.items():
            stub.SystemSharedMemoryRegister(pb.SystemSharedMemoryRegisterRequest(
                name=name, key=key, byte_size=REGION_BYTES), timeout=60)

    def close(self) -> None:
        for name, key in self.keys.items():
            self.maps[name].close()
            os.unlink("/dev/shm" + key)


@pytest.fixture(scope="module")
def regions():
    shared = SharedRegions()
    yield shared
    shared.close()


@pytest.fixture(scope="module")
def servers(model_repository, gate, regions):
    running = [start_with_shared_memory(mode, model_repository, gate) for mode in MODES[:-1]]
    running.append(start_sanitized(model_repository, gate))
    for server in running:
        with grpc.insecure_channel(server.address) as channel:
            regions.register(inference_pb2_grpc.GRPCInferenceServiceStub(channel))
    yield running
    gate.open()
    for server in running[:-1]:
        server.stop()
    # The sanitized one is stopped (drained) by test_sanitizers_report_nothing; if that did
    # not run, here.
    if running[-1].supervisor.proc.poll() is None:
        running[-1].stop()


@pytest.fixture(scope="module")
def stubs(servers):
    channels = [grpc.insecure_channel(s.address) for s in servers]
    yield [inference_pb2_grpc.GRPCInferenceServiceStub(c) for c in channels]
    for channel in channels:
        channel.close()


def answer(stub, rpc: str, request) -> tuple[str, str]:
    """``(code name, message)`` of one call (OK and "" when it succeeds)."""
    try:
        if rpc == "ModelStreamInfer":
            replies = list(stub.ModelStreamInfer(iter(request), timeout=60))
            return "OK", " | ".join(r.error_message for r in replies)
        getattr(stub, rpc)(request, timeout=60)
    except grpc.RpcError as err:
        return err.code().name, err.details() or ""
    return "OK", ""


def tensor(request, name: str, datatype: str, shape, raw: bytes | None = None):
    request.inputs.add(name=name, datatype=datatype, shape=shape)
    if raw is not None:
        request.raw_input_contents.append(raw)
    return request.inputs[-1]


def mlp(shape=(1, 512), raw: bytes | None = None, **fields) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="mlp", **fields)
    count = int(np.prod(shape)) if all(d >= 0 for d in shape) and len(shape) < 8 else 0
    tensor(request, "INPUT__0", "FP32", shape, bytes(4 * count) if raw is None else raw)
    return request


def matrix() -> list[tuple[str, str, object]]:
    """``(what, rpc, request)`` for each kind of bad input."""
    cases: list[tuple[str, str, object]] = []

    def infer(what: str, request) -> None:
        cases.append((what, "ModelInfer", request))

    infer("unknown model", pb.ModelInferRequest(model_name="nope"))
    infer("unknown model, quoted", pb.ModelInferRequest(model_name="a'b\nc\\d é"))
    infer("wrong version", mlp(model_version="9"))
    infer("no inputs", pb.ModelInferRequest(model_name="mlp"))
    r = pb.ModelInferRequest(model_name="mlp")
    tensor(r, "NOPE", "FP32", [1, 512], bytes(2048))
    infer("unknown input", r)
    r = mlp()
    tensor(r, "INPUT__0", "FP32", [1, 512], bytes(2048))
    infer("input twice", r)
    for datatype in ("FP16", "BYTES", "FP32\u200b", "fp32", ""):
        r = pb.ModelInferRequest(model_name="mlp")
        tensor(r, "INPUT__0", datatype, [1, 512], bytes(2048))
        infer(f"datatype {datatype!r}", r)
    for shape in ([512], [1, 511], [-1, 512], [0, 512], [65, 512], [1, 512, 1],
                  [2 ** 40, 2 ** 40], [1] * 30, [2 ** 62, 0]):
        infer(f"shape {shape[:4]}", mlp(shape=shape, raw=bytes(16)))
    infer("byte size", mlp(raw=bytes(2047)))
    r = mlp()
    r.raw_input_contents.append(bytes(4))
    infer("two raw buffers for one input", r)
    r = mlp()
    r.inputs[0].contents.fp32_contents.extend([1.0] * 512)
    infer("raw and typed contents", r)
    r = pb.ModelInferRequest(model_name="mlp")
    tensor(r, "INPUT__0", "FP32", [1, 512]).contents.fp32_contents.extend([1.0] * 511)
    infer("typed contents count", r)
    r = pb.ModelInferRequest(model_name="mlp")
    tensor(r, "INPUT__0", "FP32", [1, 512]).contents.int_contents.extend([1] * 512)
    infer("typed contents in the wrong field", r)
    for key, param in (("priority", pb.InferParameter(string_param="high")),
                       ("priority", pb.InferParameter(int64_param=-1)),
                       ("timeout", pb.InferParameter(double_param=1.5)),
                       ("timeout", pb.InferParameter(bool_param=True)),
                       ("priority", pb.InferParameter())):
        r = mlp()
        r.parameters[key].CopyFrom(param)
        infer(f"parameter {key} {param.WhichOneof('parameter_choice')}", r)
    r = pb.ModelInferRequest(model_name="gated")
    tensor(r, "INPUT__0", "FP32", [1, 2], bytes(8))
    r.parameters["priority"].uint64_param = 3
    infer("priority over the model's levels", r)
    cases.extend(shared_memory_cases())
    r = mlp()
    r.outputs.add(name="NOPE")
    infer("unknown output", r)

    # echo: every numeric datatype; its checks per datatype.
    def echo(**bad) -> pb.ModelInferRequest:
        request = pb.ModelInferRequest(model_name="echo")
        for datatype in NUMERIC_TYPES:
            name = f"IN_{datatype}"
            if name in bad:
                bad[name](request, name, datatype)
                continue
            size = 1 if datatype in ("BOOL", "UINT8", "INT8") else \
                2 if datatype in ("UINT16", "INT16", "FP16", "BF16") else \
                8 if datatype in ("UINT64", "INT64", "FP64") else 4
            tensor(request, name, datatype, [1, 3], bytes(3 * size))
        return request

    infer("BOOL byte 2", echo(IN_BOOL=lambda r, n, d: tensor(r, n, d, [1, 3], b"\x00\x02\x01")))
    infer("missing input", echo(IN_FP64=lambda r, n, d: None))

    def typed(r, n, d, field, values):
        r.ClearField("raw_input_contents")
        for t in r.inputs:  # every other input typed too: raw and typed do not mix
            t.contents.Clear()
        getattr(tensor(r, n, d, [1, 3]).contents, field).extend(values)
    for datatype, field, values in (("INT8", "int_contents", [1, 300, 2]),
                                    ("UINT8", "uint_contents", [1, 256, 2]),
                                    ("INT16", "int_contents", [-40000, 0, 1]),
                                    ("FP16", "fp32_contents", [1.0, 2.0, 3.0]),
                                    ("BF16", "fp32_contents", [1.0, 2.0, 3.0])):
        r = pb.ModelInferRequest(model_name="echo")
        getattr(tensor(r, f"IN_{datatype}", datatype, [1, 3]).contents, field).extend(values)
        infer(f"typed {datatype} {values}", r)

    # BYTES.
    r = pb.ModelInferRequest(model_name="strlen")
    tensor(r, "TEXT", "BYTES", [2, 1], struct.pack("<I", 10) + b"abc")
    infer("BYTES encoding", r)
    r = pb.ModelInferRequest(model_name="strlen")
    tensor(r, "TEXT", "BYTES", [2, 1]).contents.bytes_contents.append(b"one")
    infer("BYTES typed count", r)
    r = pb.ModelInferRequest(model_name="strlen")
    tensor(r, "TEXT", "FP32", [1, 1], bytes(4))
    infer("FP32 to a BYTES input", r)

    # What the executor refuses or fails: the answer crosses the wire unchanged.
    r = pb.ModelInferRequest(model_name="failing")
    tensor(r, "INPUT__0", "FP32", [1, 2], np.full((1, 2), 13, np.float32).tobytes())
    infer("the model raised", r)
    r = pb.ModelInferRequest(model_name="wrongbatch")
    tensor(r, "INPUT__0", "FP32", [2, 2], bytes(16))
    infer("the model dropped the batch dimension", r)

    # The other RPCs.
    for rpc, make in (("ModelMetadata", pb.ModelMetadataRequest),
                      ("ModelConfig", pb.ModelConfigRequest),
                      ("ModelStatistics", pb.ModelStatisticsRequest),
                      ("ModelReady", pb.ModelReadyRequest)):
        for name, version in (("nope", ""), ("mlp", "9"), ("x" * 300, ""), ("q'\n", "")):
            cases.append((f"{rpc} {name[:8]!r} {version!r}", rpc, make(name=name,
                                                                         version=version)))
    for rpc, make in (("RepositoryModelLoad", pb.RepositoryModelLoadRequest),
                      ("RepositoryModelUnload", pb.RepositoryModelUnloadRequest)):
        for name in ("nope", "../mlp", "a/b", ".hidden", "x" * 300, ""):
            cases.append((f"{rpc} {name[:8]!r}", rpc, make(model_name=name)))
        cases.append((f"{rpc} a repository name", rpc,
                      make(repository_name="r'\n", model_name="mlp")))
    cases.append(("RepositoryIndex a repository name", "RepositoryIndex",
                  pb.RepositoryIndexRequest(repository_name="x" * 2000)))
    in_key = KEYS[IN_REGION]
    register = pb.SystemSharedMemoryRegisterRequest
    for what, rpc, request in (
            ("status, unknown region", "SystemSharedMemoryStatus",
             pb.SystemSharedMemoryStatusRequest(name="nope")),
            ("status, every region", "SystemSharedMemoryStatus",
             pb.SystemSharedMemoryStatusRequest()),
            ("register, no name", "SystemSharedMemoryRegister", register(key=in_key, byte_size=8)),
            ("register, no key", "SystemSharedMemoryRegister", register(name="r", byte_size=8)),
            ("register, a name taken", "SystemSharedMemoryRegister",
             register(name=IN_REGION, key=in_key, byte_size=8)),
            ("register, a key out of /dev/shm", "SystemSharedMemoryRegister",
             register(name="r", key="/../etc/passwd", byte_size=8)),
            ("register, a key with a slash", "SystemSharedMemoryRegister",
             register(name="r", key="a/b", byte_size=8)),
            ("register, a key that is not there", "SystemSharedMemoryRegister",
             register(name="r", key=f"/{PARITY_REGION_PREFIX}none", byte_size=8)),
            ("register, byte size 0", "SystemSharedMemoryRegister",
             register(name="r", key=in_key, byte_size=0)),
            ("register, past the end of the key", "SystemSharedMemoryRegister",
             register(name="r", key=in_key, offset=8, byte_size=REGION_BYTES)),
            # Not the empty name: that unregisters every region, which the cases here use.
            ("unregister, unknown region", "SystemSharedMemoryUnregister",
             pb.SystemSharedMemoryUnregisterRequest(name="nope")),
            ("CUDA status", "CudaSharedMemoryStatus", pb.CudaSharedMemoryStatusRequest()),
            ("CUDA register", "CudaSharedMemoryRegister",
             pb.CudaSharedMemoryRegisterRequest(name="c", raw_handle=b"x" * 64, byte_size=8)),
            ("CUDA unregister", "CudaSharedMemoryUnregister",
             pb.CudaSharedMemoryUnregisterRequest(name="c")),
            ("TraceSetting", "TraceSetting", pb.TraceSettingRequest()),
            ("LogSettings", "LogSettings", pb.LogSettingsRequest())):
        cases.append((what, rpc, request))
    # A stream keeps going past its errors, each answered in its own message.
    cases.append(("stream", "ModelStreamInfer",
                  [pb.ModelInferRequest(model_name="nope"), mlp(shape=[1, 3], raw=bytes(12))]))
    return cases


def shared_memory_cases() -> list[tuple[str, str, object]]:
    """Requests whose tensors name shared-memory regions: what the front end checks of the
    parameters, and what the executor refuses behind them."""
    cases: list[tuple[str, str, object]] = []

    def infer(what: str, request) -> None:
        cases.append((what, "ModelInfer", request))

    def placed(request, index: int = 0, **parameters):
        tensor = request.inputs[index]
        for key, value in parameters.items():
            tensor.parameters[f"shared_memory_{key}"].CopyFrom(value)
        return request

    def param(**value) -> pb.InferParameter:
        return pb.InferParameter(**value)

    region, size = param(string_param=IN_REGION), param(int64_param=2048)

    def mlp_in_region(shape=(1, 512), **parameters) -> pb.ModelInferRequest:
        request = pb.ModelInferRequest(model_name="mlp")
        tensor(request, "INPUT__0", "FP32", shape)
        return placed(request, **{"region": region, "byte_size": size, **parameters})

    for key in ("region", "byte_size"):
        r = mlp_in_region()
        del r.inputs[0].parameters[f"shared_memory_{key}"]
        infer(f"shm: {key} left out", r)
    r = mlp_in_region(offset=param(int64_param=0))
    del r.inputs[0].parameters["shared_memory_region"]
    del r.inputs[0].parameters["shared_memory_byte_size"]
    infer("shm: offset alone", r)
    for what, value in (("int64", param(int64_param=1)), ("bool", param(bool_param=True)),
                        ("unset", param())):
        infer(f"shm: region {what}", mlp_in_region(region=value))
    for key in ("byte_size", "offset"):
        for what, value in (("string", param(string_param="8")), ("double", param(double_param=8)),
                            ("bool", param(bool_param=False)), ("unset", param()),
                            ("negative", param(int64_param=-8))):
            infer(f"shm: {key} {what}", mlp_in_region(**{key: value}))
    infer("shm: byte size of the shape's bytes less 4",
          mlp_in_region(byte_size=param(int64_param=2044)))
    infer("shm: byte size uint64, not the shape's",
          mlp_in_region(byte_size=param(uint64_param=2 ** 64 - 1)))
    infer("shm: the shape refused before the parameters",
          mlp_in_region(shape=(1, 511), region=param(int64_param=1)))
    r = mlp_in_region()
    r.inputs[0].contents.fp32_contents.extend([1.0] * 512)
    infer("shm: contents too", r)
    r = mlp_in_region()
    r.raw_input_contents.append(bytes(2048))
    infer("shm: a raw buffer for it too", r)
    infer("shm: unknown region", mlp_in_region(region=param(string_param="nope")))
    infer("shm: past the end of the region", mlp_in_region(offset=param(int64_param=3000)))
    infer("shm: an offset of 2**64 - 1",
          mlp_in_region(offset=param(uint64_param=2 ** 64 - 1)))

    # echo: one input of every datatype; every other one in shared memory, the rest raw.
    def echo_half_placed(raw_for_all: bool = False) -> pb.ModelInferRequest:
        request = pb.ModelInferRequest(model_name="echo")
        for i, datatype in enumerate(NUMERIC_TYPES):
            nbytes = 3 * np.dtype(ECHO_DTYPES[datatype]).itemsize
            tensor(request, f"IN_{datatype}", datatype, [1, 3],
                   bytes(nbytes) if raw_for_all or i % 2 else None)
            if i % 2 == 0:
                placed(request, i, region=region, offset=param(int64_param=64 * i),
                       byte_size=param(int64_param=nbytes))
        return request

    infer("shm: a raw buffer for every input, the placed ones too", echo_half_placed(True))
    r = echo_half_placed()
    r.inputs[2].parameters["shared_memory_byte_size"].int64_param = 5
    infer("shm: the byte size of the third input", r)

    # BYTES: only the executor can read its size; the region's zeros are not 2 elements.
    r = pb.ModelInferRequest(model_name="strlen")
    tensor(r, "TEXT", "BYTES", [2, 1])
    infer("shm: BYTES input not in the encoding",
          placed(r, region=region, byte_size=param(int64_param=10)))

    # Outputs.
    def mlp_output(**parameters) -> pb.ModelInferRequest:
        request = mlp()
        output = request.outputs.add(name="OUTPUT__0")
        for key, value in parameters.items():
            output.parameters[f"shared_memory_{key}"].CopyFrom(value)
        return request

    out_region = param(string_param=OUT_REGION)
    infer("shm output: region alone", mlp_output(region=out_region))
    infer("shm output: region int64", mlp_output(region=param(int64_param=3), byte_size=size))
    infer("shm output: byte size double", mlp_output(region=out_region,
                                                     byte_size=param(double_param=1.0)))
    infer("shm output: offset negative", mlp_output(region=out_region, byte_size=size,
                                                    offset=param(int64_param=-1)))
    infer("shm output: unknown region", mlp_output(region=param(string_param="nope"),
                                                   byte_size=size))
    infer("shm output: past the end of the region",
          mlp_output(region=out_region, byte_size=size, offset=param(int64_param=4000)))
    infer("shm output: too small for the output",
          mlp_output(region=out_region, byte_size=param(int64_param=4)))
    r = mlp_output(region=out_region, byte_size=param(int64_param=4))
    r.outputs.add(name="NOPE")
    infer("shm output: an unknown output after it", r)
    # Streams answer in completion order: the front end's refusals in one, the executor's
    # in another.
    cases.append(("shm stream", "ModelStreamInfer",
                  [mlp_in_region(byte_size=param(int64_param=2044)),
                   mlp_output(region=out_region), mlp(shape=[1, 3], raw=bytes(12))]))
    cases.append(("shm stream, the executor's refusal", "ModelStreamInfer",
                  [mlp_in_region(region=param(string_param="nope"))]))
    return cases


ECHO_DTYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32,
               "UINT64": np.uint64, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
               "INT64": np.int64, "FP16": np.float16, "FP32": np.float32, "FP64": np.float64,
               "BF16": np.uint16}
# Cases that may succeed: the status of every region, an unregistration of a region that is not
# there (not an error, as in Triton), CUDA status (an empty list where CUDA is missing).
MAY_SUCCEED = {"status, every region", "unregister, unknown region", "CUDA status",
               "CUDA unregister"}
CASES = matrix()


@pytest.mark.parametrize("what, rpc, request_", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_answered_alike(stubs, what, rpc, request_):
    answers = [answer(stub, rpc, request_) for stub in stubs]
    assert answers[0][0] != "OK" or rpc in ("ModelReady", "ModelStreamInfer") \
        or what in MAY_SUCCEED, answers[0]
    assert answers[1:] == answers[:1] * (len(stubs) - 1), dict(zip(MODES, answers))


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def wire_cases() -> list[tuple[str, bytes]]:
    """``(what, request bytes)`` that the wire scan refuses (each rule one past its default
    bound, where it can be passed), passes right at a bound, or finds malformed."""
    valid = mlp().SerializeToString()
    name = _field(1, b"mlp")
    tensor = _field(1, b"INPUT__0") + _field(2, b"FP32")
    long = b"n" * 1025

    def parameters(field_number: int, count: int) -> bytes:
        return b"".join(_field(field_number, _field(1, b"k%d" % i)) for i in range(count))

    cases = [
        ("1025 outputs", valid + b"\x32\x00" * 1025),
        ("1025 inputs", name + b"\x2a\x00" * 1025),
        ("1025 raw_input_contents", name + b"\x3a\x00" * 1025),
        ("65 request parameters", valid + parameters(4, 65)),
        ("64 request parameters", valid + parameters(4, 64)),
        ("65 parameters of an input", name + _field(5, tensor + parameters(4, 65))),
        ("65 parameters of an output", valid + _field(6, _field(1, b"OUTPUT__0")
                                                      + parameters(2, 65))),
        ("33 dimensions packed", name + _field(5, tensor + _field(3, b"\x01" * 33))),
        ("33 dimensions unpacked", name + _field(5, tensor + b"\x18\x01" * 33)),
        ("32 dimensions, both ways", name + _field(5, tensor + _field(3, b"\x01" * 20)
                                                   + b"\x18\x01" * 12)),
        ("65537 bytes_contents", _field(1, b"strlen") + _field(5, _field(1, b"TEXT")
                                                             + _field(5, b"\x42\x00" * 65537))),
        ("model name of 1025 bytes", _field(1, long)),
        ("model name of 1024 bytes", _field(1, long[:1024])),
        ("model version of 1025 bytes", name + _field(2, long)),
        ("id of 1025 bytes", valid + _field(3, long)),
        ("input name of 1025 bytes", name + _field(5, _field(1, long))),
        ("datatype of 1025 bytes", name + _field(5, _field(2, long))),
        ("parameter key of 1025 bytes", valid + _field(4, _field(1, long))),
        ("string parameter of 1025 bytes", valid + _field(4, _field(1, b"k") + _field(
            2, _field(3, long)))),
        ("output name of 1025 bytes", valid + _field(6, _field(1, long))),
        ("65 unknown fields", valid + b"\x78\x01\x7a\x00\x7d" + bytes(4) + b"\x79"
         + bytes(8) + b"\x7b\x7c" + b"\x7a\x00" * 60),
        ("64 unknown fields", valid + b"\x7a\x00" * 64),
        ("groups nested 70 deep", valid + b"\x7b" * 70 + b"\x7c" * 70),
        ("an output twice, 1024 outputs", valid + _field(6, _field(1, b"OUTPUT__0")) * 1024),
        ("dimensions before a long name", name + _field(5, _field(3, b"\x01" * 33)
                                                        + _field(1, long))),
        ("a long name before dimensions", name + _field(5, _field(1, long)
                                                        + _field(3, b"\x01" * 33))),
        ("8,388,609 int64 contents of a byte each", name + _field(5, tensor + _field(
            5, _field(3, b"\x00" * (8 * 2**20 + 1))))),
        ("a run of unpacked contents mixing fields", name + _field(5, tensor + _field(
            5, b"\x18\x00\x10\x00" * (4 * 2**20 + 1)))),
        ("cut short", valid[:-1]),
        ("field number 0", valid + b"\x02\x00"),
        ("wire type 7", valid + b"\x0f"),
        ("a group's end, none began", valid + b"\x7c"),
        ("a length in six bytes", valid + b"\x0a\x80\x80\x80\x80\x80\x00"),
        ("a tag past 32 bits", valid + b"\x8a\x80\x80\x80\x10\x00"),
        ("malformed inside an input", name + _field(5, b"\x1a\x05\x01")),
        ("outputs past the bound, then malformed", valid + b"\x32\x00" * 1025 + b"\xff"),
    ]
    return cases


WIRE_CASES = wire_cases()
# Right at a bound, inclusive: answered as if there were none.
AT_A_BOUND = {"64 request parameters", "64 unknown fields"}


@pytest.fixture(scope="module")
def raw_calls(servers):
    channels = [grpc.insecure_channel(s.address) for s in servers]
    yield [(c.unary_unary("/inference.GRPCInferenceService/ModelInfer"),
            c.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer"))
           for c in channels]
    for channel in channels:
        channel.close()


def raw_answer(call, data: bytes) -> tuple[str, str]:
    try:
        call(data, timeout=60)
    except grpc.RpcError as err:
        return err.code().name, err.details() or ""
    return "OK", ""


@pytest.mark.parametrize("what, data", WIRE_CASES, ids=[c[0] for c in WIRE_CASES])
def test_request_bytes_are_answered_alike(raw_calls, what, data):
    """What the wire scans count and refuse, in each front end: the same status and message
    (each the rule's refusal of server/rules/request_limits.py), unary and in a stream."""
    answers = [raw_answer(unary, data) for unary, _ in raw_calls]
    assert (answers[0][0] == "OK") == (what in AT_A_BOUND), answers[0]
    assert answers[1:] == answers[:1] * (len(raw_calls) - 1), dict(zip(MODES, answers))
    streamed = []
    for _, stream in raw_calls:
        replies = [pb.ModelStreamInferResponse.FromString(m)
                   for m in stream(iter([data]), timeout=60)]
        streamed.append([r.error_message for r in replies])
    assert streamed[1:] == streamed[:1] * (len(raw_calls) - 1), dict(zip(MODES, streamed))


def health_answers(channel, request: bytes) -> tuple[tuple, tuple]:
    """What Check, and the first message of Watch, answer to a HealthCheckRequest's bytes."""
    def outcome(call):
        try:
            return "OK", health_pb2.HealthCheckResponse.FromString(call()).status
        except grpc.RpcError as err:
            return err.code().name, err.details() or ""

    check = outcome(lambda: channel.unary_unary("/grpc.health.v1.Health/Check")(
        request, timeout=60))
    stream = channel.unary_stream("/grpc.health.v1.Health/Watch")(request, timeout=60)
    watch = outcome(lambda: next(stream))
    stream.cancel()
    return check, watch


def test_health_is_answered_alike(servers):
    named = {"the server": "", "the service": "inference.GRPCInferenceService", "a model": "mlp",
             "an unknown name": "nope", "a 300-byte name": "x" * 300, "a quote": "q'\n"}
    cases = {what: health_pb2.HealthCheckRequest(service=name).SerializeToString()
             for what, name in named.items()}
    cases["bytes that do not parse"] = b"\xff\xff\xff"
    channels = [grpc.insecure_channel(s.address) for s in servers]
    try:
        for what, request in cases.items():
            answers = [health_answers(channel, request) for channel in channels]
            assert answers[1:] == answers[:1] * (len(channels) - 1), (what, dict(zip(MODES, answers)))
        assert health_answers(channels[0], cases["a model"]) == (("OK", 1), ("OK", 1))  # SERVING
        assert health_answers(channels[0], cases["an unknown name"]) == (
            ("NOT_FOUND", ""), ("OK", health_pb2.HealthCheckResponse.SERVICE_UNKNOWN))
    finally:
        for channel in channels:
            channel.close()


def test_shared_memory_replies_are_alike(stubs, regions):
    """echo with every other input read from a region and two outputs in three written into
    one: each server answers the same reply, byte for byte (a placed output's metadata and an
    empty raw_output_contents entry), and writes the same bytes into the region; over
    ModelInfer and over ModelStreamInfer."""
    rng = np.random.default_rng(11)
    request = pb.ModelInferRequest(model_name="echo", id="placed")
    expected = []
    for i, datatype in enumerate(NUMERIC_TYPES):
        values = rng.integers(0, 2 if datatype == "BOOL" else 100, 3)
        data = values.astype(ECHO_DTYPES[datatype]).tobytes()
        expected.append(data)
        request.inputs.add(name=f"IN_{datatype}", datatype=datatype, shape=[1, 3])
        if i % 2 == 0:
            regions.maps[IN_REGION][64 * i:64 * i + len(data)] = data
            parameters = request.inputs[-1].parameters
            parameters["shared_memory_region"].string_param = IN_REGION
            parameters["shared_memory_offset"].int64_param = 64 * i
            parameters["shared_memory_byte_size"].int64_param = len(data)
        else:
            request.raw_input_contents.append(data)
        output = request.outputs.add(name=f"OUT_{datatype}")
        if i % 3:
            output.parameters["shared_memory_region"].string_param = OUT_REGION
            output.parameters["shared_memory_offset"].uint64_param = 64 * i
            output.parameters["shared_memory_byte_size"].int64_param = 64  # room to spare
    replies, written, streamed = [], [], []
    out = regions.maps[OUT_REGION]
    for stub in stubs:
        out[:] = bytes(REGION_BYTES)
        reply = stub.ModelInfer(request, timeout=60)
        replies.append(reply.SerializeToString(deterministic=True))
        written.append(bytes(out))
        out[:] = bytes(REGION_BYTES)
        (message,) = stub.ModelStreamInfer(iter([request]), timeout=60)
        streamed.append((message.error_message, bytes(out),
                         message.infer_response.SerializeToString(deterministic=True)))
    assert replies[1:] == replies[:1] * (len(stubs) - 1)
    assert written[1:] == written[:1] * (len(stubs) - 1)
    # A stream answers it alike too.
    assert streamed == [("", written[0], replies[0])] * len(stubs)
    assert [t.name for t in reply.outputs] == [f"OUT_{t}" for t in NUMERIC_TYPES]
    assert all(list(t.shape) == [1, 3] for t in reply.outputs)
    for i, data in enumerate(expected):
        if i % 3:
            assert reply.raw_output_contents[i] == b""
            assert written[0][64 * i:64 * i + len(data)] == data
        else:
            assert reply.raw_output_contents[i] == data


def test_shared_memory_off_is_answered_with_the_python_message(server):
    """Without --shared-memory (the session's servers): a request naming a region, for an
    input or an output, and each registration RPC, get UNIMPLEMENTED with the message of
    server/executor/shared_memory.py."""
    request = mlp(raw=b"")
    del request.raw_input_contents[:]
    request.inputs[0].parameters["shared_memory_region"].string_param = IN_REGION
    output_request = mlp()
    output_request.outputs.add(name="OUTPUT__0").parameters[
        "shared_memory_region"].string_param = OUT_REGION
    calls = [("ModelInfer", request), ("ModelInfer", output_request),
             ("SystemSharedMemoryStatus", pb.SystemSharedMemoryStatusRequest()),
             ("SystemSharedMemoryRegister", pb.SystemSharedMemoryRegisterRequest(name="r")),
             ("SystemSharedMemoryUnregister", pb.SystemSharedMemoryUnregisterRequest()),
             ("CudaSharedMemoryStatus", pb.CudaSharedMemoryStatusRequest()),
             ("CudaSharedMemoryRegister", pb.CudaSharedMemoryRegisterRequest()),
             ("CudaSharedMemoryUnregister", pb.CudaSharedMemoryUnregisterRequest())]
    with grpc.insecure_channel(server.address) as channel:
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
        answers = [answer(stub, rpc, r) for rpc, r in calls]
    assert answers == [("UNIMPLEMENTED", OFF_MESSAGE)] * len(calls)


def random_shared_memory(rng: random.Random, parameters) -> None:
    """Some of the three shared-memory parameters, each of a type and value drawn at random."""
    choices = {
        "region": [("string_param", IN_REGION), ("string_param", OUT_REGION),
                   ("string_param", "nope"), ("int64_param", 1)],
        "offset": [("int64_param", 0), ("int64_param", 64), ("int64_param", -1),
                   ("uint64_param", 5000), ("string_param", "0")],
        "byte_size": [("int64_param", 12), ("int64_param", 2048), ("uint64_param", 8),
                      ("int64_param", -4), ("double_param", 8.0)],
    }
    for key, values in choices.items():
        if rng.random() < 0.8:
            field, value = rng.choice(values)
            setattr(parameters[f"shared_memory_{key}"], field, value)


def random_requests(count: int, seed: int) -> list[pb.ModelInferRequest]:
    """Requests for the served models with names, datatypes, shapes, byte counts and
    parameters (shared-memory ones too) drawn at random, most of them wrong in some way."""
    rng = random.Random(seed)
    names = ["mlp", "echo", "strlen", "gated", "nope", "é\u200b", "'", ""]
    inputs = ["INPUT__0", "IN_FP32", "IN_BOOL", "TEXT", "X", "in\n"]
    types = ["FP32", "FP16", "BOOL", "BYTES", "INT8", "UINT64", "BF16", "F"]
    requests = []
    for _ in range(count):
        request = pb.ModelInferRequest(model_name=rng.choice(names),
                                       model_version=rng.choice(["", "", "1", "2"]))
        raw = rng.random() < 0.8
        for _ in range(rng.choice([0, 1, 1, 1, 2])):
            shape = [rng.choice([-2, 0, 1, 1, 2, 3, 65, 512]) for _ in range(rng.choice([1, 2, 2, 3]))]
            t = tensor(request, rng.choice(inputs), rng.choice(types), shape)
            if raw:
                request.raw_input_contents.append(bytes(rng.choice([0, 1, 3, 8, 2048, 4096])))
            else:
                t.contents.fp32_contents.extend([0.5] * rng.choice([0, 1, 3, 512]))
            if rng.random() < 0.25:
                random_shared_memory(rng, t.parameters)
        if rng.random() < 0.2:
            request.parameters[rng.choice(["priority", "timeout"])].int64_param = \
                rng.choice([-5, 0, 1, 2, 9])
        if rng.random() < 0.1:
            output = request.outputs.add(name=rng.choice(["OUTPUT__0", "OUT_FP32", "nope"]))
            if rng.random() < 0.5:
                random_shared_memory(rng, output.parameters)
        requests.append(request)
    return requests


@pytest.mark.parametrize("seed", range(4))
def test_random_requests_are_answered_alike(stubs, seed):
    for request in random_requests(60, seed):
        answers = [answer(stub, "ModelInfer", request) for stub in stubs]
        assert answers[1:] == answers[:1] * (len(stubs) - 1), (
            request, dict(zip(MODES, answers)))


def random_request_bytes(count: int, seed: int) -> list[bytes]:
    """The random requests above as bytes, then mutated: bytes changed, dropped, inserted,
    cut, unknown fields and groups appended, varints made longer than they need."""
    rng = random.Random(seed)
    extras = [b"\x7a\x00", b"\x78\x81\x00", b"\x7b\x08\x01\x7c", b"\x7b\x7d", b"\x44",
              b"\x0a\x80\x80\x80\x80\x00", b"\xb2\x00\x00", b"\x32\x00" * 1030]
    out = []
    for request in random_requests(count, seed):
        data = bytearray(request.SerializeToString())
        for _ in range(rng.choice([0, 1, 1, 2, 3])):
            at = rng.randrange(len(data) + 1)
            kind = rng.random()
            if kind < 0.3 and data:
                data[min(at, len(data) - 1)] = rng.randrange(256)
            elif kind < 0.45:
                del data[at:at + 1]
            elif kind < 0.6:
                data.insert(at, rng.randrange(256))
            elif kind < 0.7:
                del data[at:]
            else:
                data += rng.choice(extras)
        out.append(bytes(data))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_random_request_bytes_are_answered_alike(raw_calls, seed):
    for data in random_request_bytes(60, seed):
        answers = [raw_answer(unary, data) for unary, _ in raw_calls]
        assert answers[1:] == answers[:1] * (len(raw_calls) - 1), (
            data.hex(), dict(zip(MODES, answers)))


def test_a_timeout_of_99999999_hours_is_answered_alike(servers):
    """gRPC's largest grpc-timeout, 99999999 hours (3.6e20 ns, past int64's nanoseconds), sent
    as raw HTTP/2 (grpcio will not send it): a deadline that never passes, in every mode. The
    native front end overflowed on it (UBSan aborted the sanitized build; the release build
    carried a garbage deadline)."""
    values = np.linspace(-1, 1, 512, dtype=np.float32)
    request = mlp(raw=values.tobytes(), id="forever").SerializeToString()
    replies = []
    for server in servers:
        messages = unary_call(server.address, "/inference.GRPCInferenceService/ModelInfer",
                              request, {"grpc-timeout": "99999999H"})
        assert len(messages) == 1, server.mode
        replies.append(pb.ModelInferResponse.FromString(messages[0]))
    assert [r.id for r in replies] == ["forever"] * len(servers)
    assert [r.raw_output_contents for r in replies[1:]] == \
        [replies[0].raw_output_contents] * (len(servers) - 1)
    assert len(replies[0].raw_output_contents[0]) == 4 * 512


def test_sanitizers_report_nothing(servers, stubs):
    """Last in this module: after the matrix and the random requests, a load on the sanitized
    front end, then its drain; its whole log is free of sanitizer reports."""
    sanitized = servers[-1]
    with Load(sanitized.address, clients=8) as load:
        load.progress(400, 120, "answers under load from the sanitized front end")
    assert load.wrong == 0 and not load.failures
    # A health watch open through the drain: its end runs too.
    channel = grpc.insecure_channel(sanitized.address)
    watch = channel.unary_stream("/grpc.health.v1.Health/Watch")(
        health_pb2.HealthCheckRequest(service="mlp").SerializeToString(), timeout=120)
    statuses = health_pb2.HealthCheckResponse
    assert statuses.FromString(next(watch)).status == statuses.SERVING
    sanitized.stop()
    assert statuses.FromString(next(watch)).status == statuses.NOT_SERVING
    with pytest.raises(grpc.RpcError) as ended:
        next(watch)
    assert ended.value.code() is grpc.StatusCode.UNAVAILABLE
    channel.close()
    log = b"".join(sanitized.supervisor.lines)
    found = [marker for marker in SANITIZER_REPORTS if marker in log]
    assert not found, log[log.find(found[0]) - 200:][:4000].decode(errors="replace")
    assert not any(e.get("event") == "child_exited" for e in sanitized.supervisor.events)


def test_the_native_unit_tests_pass():
    """server/native/tests: the C++ pieces on their own (text, allocator, tokens, codec,
    metrics), in the release build and in the sanitizer build."""
    native_or_skip()
    import subprocess

    for build in ("native", "native-asan"):
        binary = native.ROOT / "build" / build / "batchgate-native-tests"
        if not binary.is_file():
            continue
        done = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120,
                              env={**os.environ, **SANITIZER_ENV})
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
