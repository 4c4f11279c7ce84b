"""Every ``batchgate serve`` flag has its effect, in every mode — or is refused where the mode
does not act on it.

One server per mode, started with every flag set away from its default, then each flag's
effect checked from outside: what the server answers, what it listens on, what its processes
report they run with (their ready lines read the interpreter's own state), what ``/proc``
shows. ``CHECKED`` lists the flags the checks cover; a flag added to ``Settings`` and not here
fails ``test_every_flag_is_checked``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from batchgate.clients import BatchgateError, Client, RetryPolicy
from batchgate.protos import inference_pb2 as pb
from batchgate.protos import inference_pb2_grpc
from batchgate.server import cli
from batchgate.bench.harness.server import ServeProcess
from batchgate.bench.harness.metrics import metrics_url, read_metrics, scrape
from batchgate.bench.harness.repository import model_config, tensor, with_parameters, write_model
from tests.support import http2
from tests.support.http2 import Http2Connection
from tests.support.servers import SERVER_MODES, native_or_skip, threads

ROOT = Path(__file__).resolve().parent.parent
ADMIN_TOKEN = "admin-" + "a" * 26
INFER_TOKEN = "infer-" + "b" * 26
MAX_MESSAGE = 1 << 20
MAX_REQUEST = 8192
MAX_ELEMENTS = 4096
# The wire limits, each away from its default: flag -> bound.
WIRE = {"--max-tensor-dimensions": 5, "--max-request-inputs": 3, "--max-request-outputs": 2,
        "--max-request-parameters": 4, "--max-request-string-elements": 6,
        "--max-request-name-bytes": 100, "--max-request-unknown-fields": 1}
# The connection policy (server/rules/connections.py), each away from its default.
STREAMS_PER_CONNECTION = 5
KEEPALIVE_S, KEEPALIVE_TIMEOUT_S = 1, 2
PING_INTERVAL_S, PING_STRIKES = 0.2, 1
IDLE_S, AGE_S, AGE_GRACE_S = 3, 8, 2
BACKLOG_BYTES = 4096
GRPC_MEMORY_BYTES, GRPC_THREADS = 64 << 20, 5
CONNECTIONS = {"--max-concurrent-streams": STREAMS_PER_CONNECTION,
               "--grpc-keepalive-time-s": KEEPALIVE_S,
               "--grpc-keepalive-timeout-s": KEEPALIVE_TIMEOUT_S,
               "--grpc-min-ping-interval-s": PING_INTERVAL_S,
               "--grpc-max-ping-strikes": PING_STRIKES, "--grpc-max-connection-idle-s": IDLE_S,
               "--grpc-max-connection-age-s": AGE_S,
               "--grpc-max-connection-age-grace-s": AGE_GRACE_S,
               "--max-stream-backlog-bytes": BACKLOG_BYTES}
MAX_LOAD_FILES = 2048
POOL_BYTES = 4096
ARENA_BYTES = 96 << 20
DRAIN_S = 7.0
SWITCH_S = 0.002
THREADS = 3
CPUS = frozenset(os.sched_getaffinity(0))
MODEL_CPU = max(CPUS) if len(CPUS) >= 2 else None  # --model-cpus: the last, the rest request path
NO_RETRY = RetryPolicy(max_attempts=1)

# ``vec``: y = x over any length (limits are tried on it); ``fixed``: y = x + 1 over [256],
# whose buffers do not fit a 4096-byte pool (the permissive pool allocates them outside).
VEC_CONFIG = model_config("vec", max_batch_size=8, input=[tensor("X", "FP32", [-1])],
                          output=[tensor("Y", "FP32", [-1])], parameters={"warmup": "false"})
FIXED_CONFIG = model_config("fixed", max_batch_size=8, input=[tensor("X", "FP32", [256])],
                            output=[tensor("Y", "FP32", [256])])
MODEL = """
import torch


class Plus(torch.nn.Module):
    def __init__(self, k):
        super().__init__()
        self.k = k

    def forward(self, x):
        return x + self.k


def build_model(parameters):
    return Plus(float(parameters.get("k", "0")))
"""

# Flag -> what shows it acted (the checks below). Per mode, the flags that mode acts on.
CHECKED = {
    "--host": "listens on 127.0.0.1 only",
    "--grpc-port": "listens on the port given",
    "--metrics-port": "serves /metrics on the port given",
    "--model-repository": "serves that repository's models",
    "--max-load-files-bytes": "a load bringing more file: bytes is RESOURCE_EXHAUSTED, naming it",
    "--max-message-bytes": "a larger message is RESOURCE_EXHAUSTED",
    "--max-request-bytes": "larger inputs are RESOURCE_EXHAUSTED, naming the flag",
    "--max-tensor-elements": "a larger tensor is RESOURCE_EXHAUSTED, naming the flag",
    "--max-tensor-dimensions": "a shape of more is RESOURCE_EXHAUSTED, naming the flag",
    "--max-request-inputs": "more inputs are RESOURCE_EXHAUSTED, naming the flag",
    "--max-request-outputs": "more outputs are RESOURCE_EXHAUSTED, naming the flag",
    "--max-request-parameters": "more parameters are RESOURCE_EXHAUSTED, naming the flag",
    "--max-request-string-elements": "more bytes_contents are RESOURCE_EXHAUSTED, naming it",
    "--max-request-name-bytes": "a longer name is RESOURCE_EXHAUSTED, naming the flag",
    "--max-request-unknown-fields": "more unknown fields are RESOURCE_EXHAUSTED, naming it",
    "--no-reflection": "reflection is UNIMPLEMENTED",
    "--max-concurrent-streams": "the server's HTTP/2 SETTINGS say it",
    "--grpc-memory-bytes": "the native front end's ready line; refused with Python",
    "--grpc-max-threads": "the native front end's ready line; refused with Python",
    "--grpc-keepalive-time-s": "a bare connection gets the server's ping",
    "--grpc-keepalive-timeout-s": "a connection that does not answer pings is closed",
    "--grpc-min-ping-interval-s": "pings that far apart are no strikes",
    "--grpc-max-ping-strikes": "the second strike gets GOAWAY too_many_pings",
    "--grpc-max-connection-idle-s": "a connection without calls gets an idle GOAWAY",
    "--grpc-max-connection-age-s": "an open stream is cut after the age and grace",
    "--grpc-max-connection-age-grace-s": "an open stream is cut after the age and grace",
    "--max-stream-backlog-bytes": "a stream with requests in flight stops reading (counted)",
    "--tls-cert": "the port speaks TLS",
    "--tls-key": "the port speaks TLS",
    "--tls-client-ca": "a client without a certificate is refused",
    "--admin-token-file": "the index needs the admin token",
    "--infer-token-file": "inference needs the infer token",
    "--device-pool-bytes": "the most the CPU's pool holds, whatever its models plan",
    "--device-pool-fraction": "refused on a machine without CUDA",
    "--device-pool-permissive": "what does not fit the pool is allocated outside it",
    "--frontend": "the processes that run",
    "--frontends": "removed: refused, naming what replaces it",
    "--frontend-threads": "the native front end's gRPC threads; refused with one process",
    "--arena-bytes": "the executor's arena size; refused with one process",
    "--drain-timeout-s": "every process drains with it",
    "--switch-interval-s": "the Python processes' GIL switch interval",
    "--request-scheduling": "no serving thread runs SCHED_BATCH",
    "--model-cpus": "model threads run on that CPU, the request path's threads on the others",
    "--no-gc-freeze": "the Python processes' garbage collector is not frozen",
    "--log-level": "debug lines are written",
    "--log-format": "every line is JSON",
    "--shared-memory": "ServerMetadata lists system_shared_memory; registering needs the admin "
                       "token",
}


def serve_flags() -> list[str]:
    parser = argparse.ArgumentParser()
    cli.add_serve_arguments(parser)
    return [opt for action in parser._actions for opt in action.option_strings
            if opt.startswith("--") and opt != "--help"]


def test_every_flag_is_checked():
    assert sorted(serve_flags()) == sorted(CHECKED)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def repository(root: Path) -> Path:
    for name, config, k in (("vec", VEC_CONFIG, "0"), ("fixed", FIXED_CONFIG, "1")):
        write_model(root, with_parameters(config, k=k), MODEL)
    return root


class Running:
    def __init__(self, mode: str, process: ServeProcess, grpc_port: int, metrics_port: int,
                 pki: dict) -> None:
        self.mode, self.process, self.pki = mode, process, pki
        self.grpc_port, self.metrics_port = grpc_port, metrics_port
        self.address = f"127.0.0.1:{grpc_port}"

    def client(self, token: str | None = INFER_TOKEN, client_cert: bool = True) -> Client:
        certs = dict(certificate_chain=self.pki["client_cert"],
                     private_key=self.pki["client_key"]) if client_cert else {}
        return Client(self.address, timeout_s=30, retry=NO_RETRY, token=token,
                      root_certificates=self.pki["ca"], **certs)

    def channel(self) -> grpc.Channel:
        read = lambda key: Path(self.pki[key]).read_bytes()  # noqa: E731
        credentials = grpc.ssl_channel_credentials(read("ca"), read("client_key"),
                                                   read("client_cert"))
        return grpc.secure_channel(self.address, credentials)

    def ready_lines(self) -> list[dict]:
        """The lines each process says it is ready with (the single process: ``serving``)."""
        if self.mode == "single":
            return [self.process.wait_for("serving")]
        return [e for e in self.process.events
                if e.get("event") in ("executor_ready", "frontend_ready")]


@pytest.fixture(scope="module", params=SERVER_MODES)
def running(request, tmp_path_factory, pki):
    mode = request.param
    if mode == "native":
        native_or_skip()
    root = tmp_path_factory.mktemp(f"settings-{mode}")
    models = repository(root / "models")
    for role, token in (("admin", ADMIN_TOKEN), ("infer", INFER_TOKEN)):
        (root / role).write_text(token)
    grpc_port, metrics_port = free_port(), free_port()
    processes = {"single": ["--frontend", "single"],
                 "native": ["--frontend", "native", "--frontend-threads", str(THREADS),
                            "--arena-bytes", str(ARENA_BYTES),
                            "--grpc-memory-bytes", str(GRPC_MEMORY_BYTES),
                            "--grpc-max-threads", str(GRPC_THREADS)]}[mode]
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHGATE_")}
    if os.environ.get("BATCHGATE_NATIVE_FRONTEND"):
        env["BATCHGATE_NATIVE_FRONTEND"] = os.environ["BATCHGATE_NATIVE_FRONTEND"]
    process = ServeProcess(
        "serve", *processes, "--host", "127.0.0.1", "--grpc-port", str(grpc_port),
        "--metrics-port", str(metrics_port), "--model-repository", str(models),
        "--max-message-bytes", str(MAX_MESSAGE), "--max-request-bytes", str(MAX_REQUEST),
        "--max-tensor-elements", str(MAX_ELEMENTS),
        *(text for flag, most in WIRE.items() for text in (flag, str(most))),
        *(text for flag, value in CONNECTIONS.items() for text in (flag, str(value))),
        "--max-load-files-bytes",
        str(MAX_LOAD_FILES), "--no-reflection",
        "--tls-cert", str(pki["server_cert"]), "--tls-key", str(pki["server_key"]),
        "--tls-client-ca", str(pki["ca"]), "--admin-token-file", str(root / "admin"),
        "--infer-token-file", str(root / "infer"), "--device-pool-bytes", str(POOL_BYTES),
        "--device-pool-permissive", "--drain-timeout-s", str(DRAIN_S),
        "--switch-interval-s", str(SWITCH_S), "--no-gc-freeze", "--request-scheduling", "normal",
        *(["--model-cpus", str(MODEL_CPU)] if MODEL_CPU is not None else []),
        "--log-level", "debug",
        "--log-format", "json", "--shared-memory", env=env)
    try:
        process.wait_for("serving")
    except BaseException:
        process.proc.kill()
        raise
    yield Running(mode, process, grpc_port, metrics_port, pki)
    if process.proc.poll() is None:
        process.stop()


def code_of(call) -> grpc.StatusCode | None:
    try:
        call()
    except BatchgateError as exc:
        return exc.code
    except grpc.RpcError as exc:
        return exc.code()
    return None


def test_the_network_flags(running):
    # --host, --grpc-port, --metrics-port: both ports listen on 127.0.0.1 alone.
    listening = _listening()
    assert listening[running.grpc_port] == {"127.0.0.1"}
    assert listening[running.metrics_port] == {"127.0.0.1"}
    text = read_metrics(metrics_url(running.metrics_port))
    assert any(f.name == "batchgate_pool_bytes_reserved"
               for f in text_string_to_metric_families(text))
    # --no-reflection.
    with running.channel() as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
            metadata=[("authorization", f"Bearer {INFER_TOKEN}")], timeout=30)
        assert code_of(lambda: next(answers)) is grpc.StatusCode.UNIMPLEMENTED


def test_the_limits(running):
    with running.client() as client:
        assert client.infer("vec", {"X": np.ones((1, 8), np.float32)})["Y"].shape == (1, 8)
        big = np.zeros((1, (MAX_MESSAGE // 4) + 1024), np.float32)
        assert code_of(lambda: client.infer("vec", {"X": big})) is (
            grpc.StatusCode.RESOURCE_EXHAUSTED)
        over_bytes = np.zeros((1, MAX_REQUEST // 4 + 1), np.float32)  # fewer elements than
        with pytest.raises(BatchgateError) as info:                    # the element limit
            client.infer("vec", {"X": over_bytes})
        assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"--max-request-bytes {MAX_REQUEST}" in str(info.value)
        with pytest.raises(BatchgateError) as info:
            client.infer("vec", {"X": np.zeros((2, MAX_ELEMENTS // 2 + 1), np.float32)})
        assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"--max-tensor-elements {MAX_ELEMENTS}" in str(info.value)
    # The wire limits: one past each is refused before the request is parsed.
    with running.channel() as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        for flag, data in wire_attempts():
            with pytest.raises(grpc.RpcError) as refused:
                call(data, timeout=30, metadata=(("authorization", f"Bearer {INFER_TOKEN}"),))
            assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, flag
            assert refused.value.details().endswith(f"({flag} {WIRE[flag]})"), (
                flag, refused.value.details())
    with running.client(token=ADMIN_TOKEN) as admin:
        config = ('{"max_batch_size": 8, "input": [{"name": "X", "data_type": "TYPE_FP32", '
                  '"dims": [-1]}], "output": [{"name": "Y", "data_type": "TYPE_FP32", '
                  '"dims": [-1]}]}')
        with pytest.raises(BatchgateError) as info:
            admin.load_model("vec", config=config,
                             files={"1/model.py": b"#" * (MAX_LOAD_FILES + 1)})
        assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"--max-load-files-bytes {MAX_LOAD_FILES}" in str(info.value)


def wire_attempts() -> list[tuple[str, bytes]]:
    """(flag, a vec request one past that flag's bound in WIRE)."""
    def vec(**fields) -> pb.ModelInferRequest:
        request = pb.ModelInferRequest(model_name="vec", **fields)
        request.inputs.add(name="X", datatype="FP32", shape=[1, 1])
        request.raw_input_contents.append(bytes(4))
        return request

    inputs = vec()
    for _ in range(3):
        inputs.inputs.add(name="X", datatype="FP32", shape=[1, 1])
    outputs = vec()
    for _ in range(3):
        outputs.outputs.add(name="Y")
    parameters = vec()
    for key in "abcde":
        parameters.parameters[key].bool_param = True
    dimensions = vec()
    dimensions.inputs[0].shape[:] = [1] * 6
    strings = vec()
    strings.inputs[0].contents.bytes_contents.extend([b"s"] * 7)
    return [
        ("--max-request-inputs", inputs.SerializeToString()),
        ("--max-request-outputs", outputs.SerializeToString()),
        ("--max-request-parameters", parameters.SerializeToString()),
        ("--max-tensor-dimensions", dimensions.SerializeToString()),
        ("--max-request-string-elements", strings.SerializeToString()),
        ("--max-request-name-bytes", vec(id="i" * 101).SerializeToString()),
        ("--max-request-unknown-fields", vec().SerializeToString() + b"\x78\x01\x7a\x00"),
    ]


def test_the_connection_flags(running):
    tls = ssl.create_default_context(cafile=running.pki["ca"])
    tls.load_cert_chain(running.pki["client_cert"], running.pki["client_key"])
    # --max-concurrent-streams; --grpc-keepalive-time-s: the server pings a bare connection.
    with Http2Connection(running.address, tls) as connection:
        settings = connection.wait_for(http2.SETTINGS, flags=0).settings()
        assert settings[http2.SETTINGS_MAX_CONCURRENT_STREAMS] == STREAMS_PER_CONNECTION
        connection.wait_for(http2.PING, flags=0, timeout_s=30 * KEEPALIVE_S)
        # --grpc-max-connection-idle-s: with no call open, it is told to go (gRPC's idle
        # GOAWAY; the default is an hour).
        last, _, debug = connection.wait_for(http2.GOAWAY, timeout_s=30 * IDLE_S).goaway()
        assert last == 0 and b"idle" in debug, debug
    # --grpc-keepalive-timeout-s: a connection that answers no ping is closed.
    with Http2Connection(running.address, tls, ack_pings=False) as connection:
        connection.wait_for_close(30 * (KEEPALIVE_S + KEEPALIVE_TIMEOUT_S))
    # --grpc-min-ping-interval-s: pings further apart than it are no strikes (at the default
    # 10 s, these three would be two strikes); --grpc-max-ping-strikes 1: three at once are.
    with Http2Connection(running.address, tls) as spaced:
        spaced.wait_for(http2.SETTINGS, flags=0)
        for _ in range(3):
            spaced.send_ping()
            spaced.wait_for(http2.PING, flags=http2.ACK)
            time.sleep(2 * PING_INTERVAL_S)  # the spacing is what is tried
        spaced.send_ping()
        spaced.wait_for(http2.PING, flags=http2.ACK)
        assert not [f for f in spaced.frames if f.type == http2.GOAWAY]
    with Http2Connection(running.address, tls) as hasty:
        hasty.wait_for(http2.SETTINGS, flags=0)
        for _ in range(3):
            hasty.send_ping()
        _, code, debug = hasty.wait_for(http2.GOAWAY).goaway()
        assert (code, debug) == (http2.ENHANCE_YOUR_CALM, b"too_many_pings")
    token = (("authorization", f"Bearer {INFER_TOKEN}"),)
    request = pb.ModelInferRequest(model_name="vec")
    request.inputs.add(name="X", datatype="FP32", shape=[1, 1])
    request.raw_input_contents.append(bytes(4))
    with running.channel() as channel:
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                       request_serializer=pb.ModelInferRequest.SerializeToString,
                                       response_deserializer=pb.ModelStreamInferResponse.FromString)
        # --max-stream-backlog-bytes: three requests sent at once; a reply not yet known counts
        # as large as a message may be (1 MiB here), past the bound: the stream pauses.
        before = _scrape(running).get(("batchgate_stream_pauses_total", ()), 0)
        answers = list(stream(iter([request] * 3), timeout=60, metadata=token))
        assert len(answers) == 3 and not any(a.error_message for a in answers)
        assert _scrape(running)[("batchgate_stream_pauses_total", ())] > before
        # --grpc-max-connection-age-s and its grace: a stream held open is cut after both.
        gate = threading.Event()

        def one_then_hold():
            yield request
            gate.wait(60)

        held = stream(one_then_hold(), timeout=60, metadata=token)
        assert not next(held).error_message
        with pytest.raises(grpc.RpcError) as cut:
            next(held)
        gate.set()
        assert cut.value.code() is not grpc.StatusCode.DEADLINE_EXCEEDED, cut.value
    # --grpc-memory-bytes, --grpc-max-threads: the native front end's ResourceQuota.
    if running.mode == "native":
        [ready] = [e for e in running.ready_lines() if e.get("event") == "frontend_ready"]
        assert (ready["grpc_memory_bytes"], ready["grpc_max_threads"]) == (
            GRPC_MEMORY_BYTES, GRPC_THREADS)


def test_the_connection_settings_are_checked():
    from batchgate.server.config.settings import Settings

    assert Settings().grpc_memory_limit >= 4 * Settings().max_message_bytes
    for name, value, message in (
            ("max_concurrent_streams", 0, "max_concurrent_streams must be >= 1, got 0"),
            ("grpc_memory_bytes", 1000, "grpc_memory_bytes must be >= max_message_bytes"),
            ("grpc_max_threads", 1, "grpc_max_threads must be >= 2"),
            ("grpc_keepalive_time_s", 0, "grpc_keepalive_time_s must lie in \\(0, "),
            ("grpc_min_ping_interval_s", -1, "grpc_min_ping_interval_s must lie in \\[0, "),
            ("grpc_max_connection_age_s", 3e6, "grpc_max_connection_age_s must lie in"),
            ("grpc_max_ping_strikes", -1, "grpc_max_ping_strikes must be >= 0"),
            ("max_stream_backlog_bytes", 0, "max_stream_backlog_bytes must be >= 1, got 0")):
        with pytest.raises(ValueError, match=message):
            Settings(**{name: value})


def test_the_wire_limits_are_checked():
    from batchgate.server.config.settings import Settings

    for name in ("max_tensor_dimensions", "max_request_inputs", "max_request_outputs",
                 "max_request_parameters", "max_request_name_bytes"):
        with pytest.raises(ValueError, match=f"^{name} must be >= 1, got 0$"):
            Settings(**{name: 0})
    for name in ("max_request_string_elements", "max_request_unknown_fields"):
        assert getattr(Settings(**{name: 0}), name) == 0  # 0: none allowed
        with pytest.raises(ValueError, match=f"^{name} must be >= 0 \\(0: none\\), got -1$"):
            Settings(**{name: -1})


def test_the_security_flags(running):
    # --tls-cert / --tls-key: plaintext gets no answer; --tls-client-ca: nor TLS without a
    # client certificate; --infer-token-file and --admin-token-file: each RPC its token.
    with grpc.insecure_channel(running.address) as plain:
        ready = plain.unary_unary("/inference.GRPCInferenceService/ServerReady",
                                  request_serializer=pb.ServerReadyRequest.SerializeToString,
                                  response_deserializer=pb.ServerReadyResponse.FromString)
        assert code_of(lambda: ready(pb.ServerReadyRequest(), timeout=10)) is (
            grpc.StatusCode.UNAVAILABLE)
    with running.client(client_cert=False) as uncertified:
        assert code_of(lambda: uncertified.server_ready()) is grpc.StatusCode.UNAVAILABLE
    x = {"X": np.ones((1, 4), np.float32)}
    with running.client(token=None) as anonymous:
        assert code_of(lambda: anonymous.infer("vec", x)) is grpc.StatusCode.UNAUTHENTICATED
    with running.client(token=INFER_TOKEN) as inferer:
        assert code_of(lambda: inferer.infer("vec", x)) is None
        assert code_of(lambda: inferer.repository_index()) is grpc.StatusCode.PERMISSION_DENIED
    with running.client(token=ADMIN_TOKEN) as admin:
        assert {m.name for m in admin.repository_index()} == {"vec", "fixed"}  # the repository


def test_the_shared_memory_flag(running):
    # The extension is listed, and its registrations (files opened on the server's host by
    # name) need the admin token, not the infer token.
    with running.channel() as channel:
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)

        def token(value):
            return (("authorization", f"Bearer {value}"),)

        metadata = stub.ServerMetadata(pb.ServerMetadataRequest(), timeout=30,
                                       metadata=token(INFER_TOKEN))
        assert "system_shared_memory" in metadata.extensions
        status = pb.SystemSharedMemoryStatusRequest()
        with pytest.raises(grpc.RpcError) as info:
            stub.SystemSharedMemoryStatus(status, timeout=30, metadata=token(INFER_TOKEN))
        assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert not stub.SystemSharedMemoryStatus(status, timeout=30,
                                                 metadata=token(ADMIN_TOKEN)).regions


def test_the_device_pool_flags(running):
    # --device-pool-bytes: the CPU's pool's cap; --device-pool-permissive: ``fixed``'s buffers
    # do not fit under it and went outside, counted, instead of refusing the model.
    samples = _scrape(running)
    assert 0 < samples[("batchgate_pool_bytes_reserved", (("device", "cpu"),))] <= POOL_BYTES
    assert samples[("batchgate_pool_fallbacks_total", (("device", "cpu"),))] > 0
    with running.client() as client:
        assert client.model_ready("fixed")


def test_the_process_flags(running):
    ready = running.ready_lines()
    # --switch-interval-s and --no-gc-freeze, in every Python process that serves.
    python_lines = [e for e in ready if e.get("role") != "frontend" and "switch_interval_s" in e]
    assert python_lines and all(e["switch_interval_s"] == SWITCH_S for e in python_lines)
    assert all(e["gc_frozen"] is False for e in python_lines)
    # --request-scheduling normal: the request path stays as started (the default's SCHED_BATCH
    # is tests/test_scheduling.py's).
    assert all(e["scheduling"] == "normal" for e in python_lines)
    if running.mode == "single":
        return
    # --frontend, --frontend-threads: the processes that run.
    frontends = running.process.pids("frontend")
    assert len(frontends) == 1
    [pid] = frontends.values()
    command = Path(f"/proc/{pid}/cmdline").read_bytes()
    assert b"batchgate-frontend" in command
    workers = [t for t in Path(f"/proc/{pid}/task").iterdir()
               if (t / "comm").read_text().startswith("bg-worker")]
    assert len(workers) == THREADS
    assert {os.sched_getscheduler(int(t.name)) for t in workers} == {os.SCHED_OTHER}
    # --arena-bytes: the executor's memfd.
    [executor] = running.process.pids("executor").values()
    sizes = {os.stat(f"/proc/{executor}/fd/{fd}").st_size
             for fd in os.listdir(f"/proc/{executor}/fd")
             if os.readlink(f"/proc/{executor}/fd/{fd}").startswith("/memfd:batchgate-arena")}
    assert sizes == {ARENA_BYTES}


def test_the_model_cpus_flag(running):
    if MODEL_CPU is None:
        pytest.skip("splitting CPUs between model threads and the request path needs two, and "
                    f"this process may run on {len(CPUS)}")
    # --model-cpus: the model threads on that CPU; the process that runs them, and every thread
    # of a native front end, on the others.
    rest = CPUS - {MODEL_CPU}
    runner = (running.process.proc.pid if running.mode == "single"
              else running.process.pids("executor")[None])
    assert os.sched_getaffinity(runner) == rest
    models = {name: cpus for name, cpus in threads(runner, os.sched_getaffinity).values()
              if name.endswith("-batch")}
    assert set(models) == {"vec-0-batch", "fixed-0-batch"}, models
    assert all(cpus == {MODEL_CPU} for cpus in models.values()), models
    if running.mode == "single":
        return
    [frontend] = running.process.pids("frontend").values()
    found = list(threads(frontend, os.sched_getaffinity).values())
    assert any(name.startswith("bg-worker") for name, _ in found)
    assert all(cpus == rest for _, cpus in found), found


def test_cpu_lists_are_read_as_taskset_writes_them_and_checked():
    from batchgate.server.config.settings import Settings, cpu_list

    assert cpu_list("1") == (1,)
    assert cpu_list("4-6,1, 5") == (1, 4, 5, 6)
    for text in ("", "a", "3-1", "-1", "1,,2"):
        with pytest.raises(ValueError, match="model_cpus must be a CPU list such as 1 or 2-7,9"):
            cpu_list(text)
    assert Settings().model_cpus is None
    with pytest.raises(ValueError, match="model_cpus must be CPUs this server may run on"):
        Settings(model_cpus=(max(CPUS) + 1,))
    with pytest.raises(ValueError, match="model_cpus must leave the request path at least one"):
        Settings(model_cpus=tuple(CPUS))
    if MODEL_CPU is not None:
        assert Settings(model_cpus=(MODEL_CPU,)).model_cpus == (MODEL_CPU,)


def test_the_log_flags_and_the_drain(running):
    with running.client() as client:  # a refusal is logged, at debug only
        assert code_of(lambda: client.infer("nope", {"X": np.ones((1, 1), np.float32)}))
    assert running.process.stop() == 0
    # --log-format json: every line; --log-level debug: debug lines were written.
    lines = [line for line in running.process.lines if line.strip()]
    assert len(running.process.events) == len(lines), [
        line for line in lines if not line.startswith(b"{")]
    assert any(e.get("level") == "debug" for e in running.process.events)
    # --drain-timeout-s: each process drained with it.
    drains = [e for e in running.process.events
              if e.get("event") in ("draining", "executor_draining")]
    roles = {e.get("role", "supervisor") for e in drains}
    assert roles == ({"supervisor"} if running.mode == "single"
                     else {"supervisor", "executor", "frontend"})
    assert all(e["drain_timeout_s"] == DRAIN_S for e in drains)


@pytest.mark.parametrize("args, message", [
    (["--frontend", "single", "--frontend-threads", "2"], "--frontend-threads sizes the native"),
    (["--frontend", "single", "--arena-bytes", str(64 << 20)],
     "one process (--frontend single) has none"),
    (["--frontend", "single", "--device-pool-fraction", "0.5"], "--device-pool-fraction caps"),
    (["--frontend", "single", "--grpc-memory-bytes", str(1 << 30)],
     "which grpcio (one process, --frontend single)"),
    (["--frontend", "single", "--grpc-max-threads", "4"], "--grpc-max-threads sets the native"),
    # Removed with the Python front-end processes: an old command line fails, naming what
    # replaces what it asked for, however it is written.
    (["--frontend", "native", "--frontends", "2"],
     "--frontends was removed with the Python front-end processes"),
    (["--frontends=0"], "--frontend single replaces --frontends 0, got --frontends 0"),
    (["--frontends"], "(--frontend native; one process using every core"),
    (["--frontend", "python"], "use --frontend native (the C++ front end, built by make native) "
                               "or --frontend single (one Python process, for debugging), "
                               "got --frontend python"),
])
def test_flags_the_mode_does_not_act_on_are_refused(args, message):
    if "--device-pool-fraction" in args:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a CUDA device is present: the fraction is acted on")
    if "native" in args:
        native_or_skip()
    done = subprocess.run([sys.executable, "-m", "batchgate.server.cli", "serve", "--grpc-port", "0",
                           "--metrics-port", "-1", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr


def test_the_fraction_is_refused_by_the_executor_process_too(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the fraction is acted on")
    native_or_skip()
    process = ServeProcess("serve", "--frontend", "native", "--grpc-port", "0", "--metrics-port",
                           "-1", "--model-repository", str(repository(tmp_path / "models")),
                           "--device-pool-fraction", "0.5", "--log-format", "json")
    assert process.proc.wait(120) == 1
    refused = [e for e in process.events if e.get("event") == "settings_refused"]
    assert refused and "--device-pool-fraction caps" in refused[0]["error"]


def _listening() -> dict[int, set[str]]:
    """Listening TCP sockets: port -> local addresses (IPv4-mapped IPv6 ones as IPv4: gRPC
    binds 127.0.0.1 as ::ffff:127.0.0.1)."""
    found: dict[int, set[str]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state = fields[1], fields[3]
            if state != "0A":  # LISTEN
                continue
            address, port = local.split(":")
            raw = bytes.fromhex(address)
            # /proc prints each 32-bit word in host (little-endian) order.
            words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            if len(words) == 16 and words[:12] == bytes(10) + b"\xff\xff":
                words = words[12:]
            ip = socket.inet_ntop(socket.AF_INET if len(words) == 4 else socket.AF_INET6, words)
            found.setdefault(int(port, 16), set()).add(ip)
    return found


def _scrape(running: Running) -> dict:
    return scrape(metrics_url(running.metrics_port))

def test_the_device_pool_has_no_cap_by_default_and_a_cap_below_a_page_is_refused():
    from batchgate.server.config.settings import Settings

    assert Settings().device_pool_bytes is None  # nothing reserved up front, nothing capped
    assert Settings(device_pool_bytes=4096).device_pool_bytes == 4096
    with pytest.raises(ValueError, match="device_pool_bytes must be >= 4096"):
        Settings(device_pool_bytes=100)
    with pytest.raises(ValueError, match="device_pool_fraction must lie in"):
        Settings(device_pool_fraction=0.0)
