"""The native front end and the Python one answer every bad request alike, byte for byte.

The same requests go to a server of each mode at once; the status codes and messages (and a
stream's error messages) must be equal. First a matrix of every kind of bad input the codec,
the repository and the executor refuse, then seeded random requests. The native front end is
written apart from the Python code (``server/native/``): this is what holds the two to one
behaviour.

A fourth server runs the native front end built with AddressSanitizer and UBSan
(``scripts/build-native.sh --sanitize``): it answers everything here too, then a load, a
drain, and its log must hold no sanitizer report.
"""

from __future__ import annotations

import os
import random
import struct

import grpc
import numpy as np
import pytest

from protos import inference_pb2 as pb
from protos import inference_pb2_grpc
from server import native
from tests.conftest import NUMERIC_TYPES, Load, native_or_skip, start_in_mode

MODES = ("single", "python", "native", "native-asan")
SANITIZED = native.ROOT / "build" / "native-asan" / "batchgate-frontend"
# A report stops the process (the supervisor would restart it: the test sees the report in the
# log either way); LeakSanitizer reports at the drained process's exit.
SANITIZER_ENV = {"ASAN_OPTIONS": "halt_on_error=1:detect_leaks=1:abort_on_error=0",
                 "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}
SANITIZER_REPORTS = (b"ERROR: AddressSanitizer", b"ERROR: LeakSanitizer", b"runtime error:",
                     b"SUMMARY: UndefinedBehavior")


def start_sanitized(model_repository, gate):
    native_or_skip()
    if not SANITIZED.is_file():
        reason = f"the sanitizer build {SANITIZED} is missing (scripts/build-native.sh --sanitize)"
        if os.environ.get("BATCHGATE_REQUIRE_NATIVE"):
            pytest.fail(reason)
        pytest.skip(reason)
    env = {**os.environ, native.ENV_VAR: str(SANITIZED), **SANITIZER_ENV}
    return start_in_mode("native", model_repository, gate, env=env)


@pytest.fixture(scope="module")
def servers(model_repository, gate):
    running = [start_in_mode(mode, model_repository, gate) for mode in MODES[:-1]]
    running.append(start_sanitized(model_repository, gate))
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
    r = mlp()
    r.inputs[0].parameters["shared_memory_region"].string_param = "region"
    infer("shared-memory input", r)
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
    for rpc, request in (("SystemSharedMemoryStatus", pb.SystemSharedMemoryStatusRequest()),
                         ("SystemSharedMemoryRegister",
                          pb.SystemSharedMemoryRegisterRequest(name="r")),
                         ("SystemSharedMemoryUnregister",
                          pb.SystemSharedMemoryUnregisterRequest()),
                         ("CudaSharedMemoryStatus", pb.CudaSharedMemoryStatusRequest()),
                         ("CudaSharedMemoryRegister", pb.CudaSharedMemoryRegisterRequest()),
                         ("CudaSharedMemoryUnregister", pb.CudaSharedMemoryUnregisterRequest()),
                         ("TraceSetting", pb.TraceSettingRequest()),
                         ("LogSettings", pb.LogSettingsRequest())):
        cases.append((rpc, rpc, request))
    # A stream keeps going past its errors, each answered in its own message.
    cases.append(("stream", "ModelStreamInfer",
                  [pb.ModelInferRequest(model_name="nope"), mlp(shape=[1, 3], raw=bytes(12))]))
    return cases


CASES = matrix()


@pytest.mark.parametrize("what, rpc, request_", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_answered_alike(stubs, what, rpc, request_):
    answers = [answer(stub, rpc, request_) for stub in stubs]
    assert answers[0][0] != "OK" or rpc in ("ModelReady", "ModelStreamInfer"), answers[0]
    assert answers[1:] == answers[:1] * (len(stubs) - 1), dict(zip(MODES, answers))


def random_requests(count: int, seed: int) -> list[pb.ModelInferRequest]:
    """Requests for the served models with names, datatypes, shapes, byte counts and
    parameters drawn at random, most of them wrong in some way."""
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
        if rng.random() < 0.2:
            request.parameters[rng.choice(["priority", "timeout"])].int64_param = \
                rng.choice([-5, 0, 1, 2, 9])
        if rng.random() < 0.1:
            request.outputs.add(name=rng.choice(["OUTPUT__0", "OUT_FP32", "nope"]))
        requests.append(request)
    return requests


@pytest.mark.parametrize("seed", range(4))
def test_random_requests_are_answered_alike(stubs, seed):
    for request in random_requests(60, seed):
        answers = [answer(stub, "ModelInfer", request) for stub in stubs]
        assert answers[1:] == answers[:1] * (len(stubs) - 1), (
            request, dict(zip(MODES, answers)))


def test_sanitizers_report_nothing(servers, stubs):
    """Last in this module: after the matrix and the random requests, a load on the sanitized
    front end, then its drain; its whole log is free of sanitizer reports."""
    sanitized = servers[-1]
    with Load(sanitized.address, clients=8) as load:
        load.progress(400, 120, "answers under load from the sanitized front end")
    assert load.wrong == 0 and not load.failures
    sanitized.stop()
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
