"""Graceful drain: health goes NOT_SERVING, new requests get UNAVAILABLE, queued ones finish."""

from __future__ import annotations

import json
import queue
import shutil
import signal
import subprocess
import sys
import textwrap
import threading

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batchgate.protos import inference_pb2_grpc
from batchgate.bench.harness.server import RunningServer, ServeProcess, mode_args
from batchgate.bench.harness.repository import with_parameters, write_model
from tests.support import EXAMPLE_MODELS, ROOT
from tests.support.messages import infer_request
from tests.support.models import GATED_CONFIG, GATED_MODEL
from tests.support.polling import poll
from tests.support.servers import SERVER_MODES, native_or_skip, start_in_mode


@pytest.mark.parametrize("mode", SERVER_MODES)
def test_stop_answers_queued_requests_and_refuses_new_ones(model_repository, gate, mode):
    server = start_in_mode(mode, model_repository, gate)
    stopping = None
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            gate.close()
            x = lambda v: infer_request("gated", {"INPUT__0": np.full((1, 2), v, np.float32)})
            running = stub.ModelInfer.future(x(1))
            gate.wait_entered()
            queued = stub.ModelInfer.future(x(2))
            poll(lambda: server.queue_depth("gated") == 1, what="request queued")
            watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING

            stopping = threading.Thread(target=server.stop)
            stopping.start()
            poll(lambda: health.Check(health_pb2.HealthCheckRequest(service="")).status
                 == health_pb2.HealthCheckResponse.NOT_SERVING, what="NOT_SERVING")
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as err:
                stub.ModelInfer(x(3), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            gate.open()
            out = [np.frombuffer(f.result(10).raw_output_contents[0], np.float32)
                   for f in (running, queued)]
            assert [o[0] for o in out] == [2.0, 4.0]
            stopping.join(60)
            assert not stopping.is_alive()
            # The drain ends open watches once their status is written (grpcio alone would keep
            # them open, and the shutdown waiting, until its grace ran out).
            with pytest.raises(grpc.RpcError) as ended:
                next(watch)
            assert (ended.value.code(), ended.value.details()) == (
                grpc.StatusCode.UNAVAILABLE,
                "the server is shutting down; retry on another replica")
    finally:
        gate.open()
        if stopping is None:
            server.stop()


# One line per round on stdin: a server's port. BURST threads share one tritonclient client,
# connected before they start; each sends mlp requests, one after the other, until one fails.
# It prints "answered" once every thread has had an answer (so all of them are sending), then,
# once every thread is done, the answers' status codes as JSON.
BURST = 64
TRITONCLIENT_BURST = textwrap.dedent(f'''
    import collections, json, sys, threading
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    x = np.random.default_rng(0).standard_normal((1, 512), dtype=np.float32)
    for line in sys.stdin:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{{line.strip()}}")
        assert client.is_server_ready()
        inputs = [grpcclient.InferInput("INPUT__0", [1, 512], "FP32")]
        inputs[0].set_data_from_numpy(x)
        codes = collections.Counter()
        lock = threading.Lock()
        answered = []
        all_answered = threading.Event()

        def send():
            for calls in range(1000):
                try:
                    client.infer("mlp", inputs, client_timeout=60)
                    code = "OK"
                except InferenceServerException as exc:
                    code = str(exc.status()).removeprefix("StatusCode.")
                with lock:
                    codes[code] += 1
                    if calls == 0:
                        answered.append(code)
                        if len(answered) == {BURST}:
                            all_answered.set()
                if code != "OK":
                    return

        threads = [threading.Thread(target=send) for _ in range({BURST})]
        for thread in threads:
            thread.start()
        print("answered" if all_answered.wait(60) else "not answered", flush=True)
        for thread in threads:
            thread.join()
        client.close()
        print(json.dumps(codes), flush=True)
''')
DRAIN_ROUNDS = 4


def serve(mode: str, repository, *flags: str) -> ServeProcess:
    """``batchgate serve`` in ``mode`` as its own process, every port chosen by the system."""
    arena = () if mode == "single" else ("--arena-bytes", str(256 << 20))
    return ServeProcess(
        "serve", *mode_args(mode), *arena, "--host", "127.0.0.1", "--grpc-port", "0",
        "--metrics-port", "0", "--model-repository", str(repository), "--log-format", "json",
        "--no-gc-freeze", *flags)


@pytest.fixture
def mlp_only(tmp_path):
    """A repository of the example mlp alone: each round starts a server, quickly."""
    shutil.copytree(EXAMPLE_MODELS / "mlp", tmp_path / "mlp",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


@pytest.mark.parametrize("mode", SERVER_MODES)
def test_sigterm_amid_arriving_requests_answers_every_one(mlp_only, mode):
    """SIGTERM while 64 clients send, in several rounds: every call that reached the server is
    answered OK or UNAVAILABLE, none CANCELLED, and the server exits 0. gRPC's shutdown cancels
    the calls it holds unhandled and those arriving before their client heard the GOAWAY
    (server/frontend/drain.py): before the drain parked them, every round lost some."""
    if mode == "native":
        native_or_skip()
    clients = subprocess.Popen([sys.executable, "-c", TRITONCLIENT_BURST], cwd=ROOT,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    rounds = []
    try:
        for _ in range(DRAIN_ROUNDS):
            server = serve(mode, mlp_only, "--drain-timeout-s", "10")
            try:
                port = server.wait_for("listening")["grpc_port"]
                server.wait_for("serving")
                clients.stdin.write(f"{port}\n")
                clients.stdin.flush()
                assert clients.stdout.readline().strip() == "answered"
                server.proc.send_signal(signal.SIGTERM)
                rounds.append(json.loads(clients.stdout.readline()))
                assert server.proc.wait(60) == 0
                server.wait_for("stopped")
            finally:
                if server.proc.poll() is None:
                    server.proc.kill()
    finally:
        clients.stdin.close()
        clients.wait(60)
    for codes in rounds:
        assert set(codes) <= {"OK", "UNAVAILABLE"}, rounds
        # Each client sent until refused: the drain overlapped every client's calls.
        assert codes["UNAVAILABLE"] == BURST, rounds


@pytest.mark.parametrize("mode", SERVER_MODES)
def test_drain_ends_open_streams_with_unavailable(mlp_only, mode):
    """A stream left open by its client ends with UNAVAILABLE once the drain shuts down, not
    when gRPC cancels what is left at the end of the grace."""
    if mode == "native":
        native_or_skip()
    server = serve(mode, mlp_only, "--drain-timeout-s", "10")
    try:
        port = server.wait_for("listening")["grpc_port"]
        server.wait_for("serving")
        x = infer_request("mlp", {"INPUT__0": np.zeros((1, 512), np.float32)})
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
            requests: queue.Queue = queue.Queue()
            open_stream = stub.ModelStreamInfer(iter(requests.get, None), timeout=60)
            requests.put(x)
            assert not next(open_stream).error_message
            server.proc.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.RpcError) as err:
                next(open_stream)
            # Ours, not gRPC's "Cancelling all calls" at the end of the grace.
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in err.value.details()
            requests.put(None)
        assert server.proc.wait(30) == 0
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


@pytest.fixture
def gated_only(tmp_path, gate):
    """A repository of the ``gated`` test model alone."""
    write_model(tmp_path, with_parameters(GATED_CONFIG, gate_dir=gate.dir), GATED_MODEL)
    return tmp_path


@pytest.mark.parametrize("mode", SERVER_MODES)
def test_requests_left_at_the_drain_timeout_get_unavailable(gated_only, gate, mode):
    """A batch that outlives --drain-timeout-s and the request queued behind it are answered
    UNAVAILABLE (retryable), not cancelled, and the server still exits 0."""
    if mode == "native":
        native_or_skip()
    server = serve(mode, gated_only, "--drain-timeout-s", "1")
    try:
        listening = server.wait_for("listening")
        server.wait_for("serving")
        metrics = RunningServer(mode, listening["grpc_port"], listening["metrics_port"],
                                supervisor=server)
        with grpc.insecure_channel(metrics.address) as channel:
            stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
            gate.close()
            x = lambda v: infer_request("gated", {"INPUT__0": np.full((1, 2), v, np.float32)})
            running = stub.ModelInfer.future(x(1))
            gate.wait_entered()
            queued = stub.ModelInfer.future(x(2))
            poll(lambda: metrics.queue_depth("gated") == 1, what="request queued")
            server.proc.send_signal(signal.SIGTERM)
            codes = []
            for call in (running, queued):
                with pytest.raises(grpc.RpcError) as err:
                    call.result(30)
                codes.append(err.value.code())
            assert codes == [grpc.StatusCode.UNAVAILABLE] * 2
        gate.open()
        assert server.proc.wait(30) == 0
    finally:
        gate.open()
        if server.proc.poll() is None:
            server.proc.kill()
