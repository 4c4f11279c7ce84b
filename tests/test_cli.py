"""`batchgate serve` as users run it: a real process, the example repository, SIGTERM drain."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import numpy as np

from protos import inference_pb2 as pb
from protos import inference_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent


class ServerProcess:
    def __init__(self, *args: str, env: dict | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server.cli", *args],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {})},
        )
        self.events: list[dict] = []
        self._seen = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            with self._seen:
                self.events.append(event)
                self._seen.notify_all()
        with self._seen:
            self._seen.notify_all()

    def wait_for(self, name: str, timeout_s: float = 120) -> dict:
        with self._seen:
            found = self._seen.wait_for(
                lambda: any(e.get("event") == name and "role" not in e for e in self.events)
                or self.proc.poll() is not None,
                timeout_s,
            )
            match = [e for e in self.events if e.get("event") == name and "role" not in e]
        assert found and match, f"no '{name}' event; got {[e.get('event') for e in self.events]}"
        return match[0]


def test_serve_defaults_to_the_example_repository_and_drains_on_sigterm():
    server = ServerProcess("serve", "--host", "127.0.0.1", "--grpc-port", "0",
                           "--metrics-port", "0", "--log-format", "json")
    try:
        port = server.wait_for("listening")["grpc_port"]
        assert set(server.wait_for("serving")["models"]) >= {"mlp", "cnn", "encoder"}
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
            assert stub.ServerReady(pb.ServerReadyRequest()).ready
            req = pb.ModelInferRequest(model_name="cnn")
            req.inputs.add(name="INPUT__0", datatype="FP32", shape=[1, 3, 32, 32])
            req.raw_input_contents.append(np.zeros((1, 3, 32, 32), np.float32).tobytes())
            response = stub.ModelInfer(req)
            assert list(response.outputs[0].shape) == [1, 10]
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
        server.wait_for("stopped")
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_help_lists_triton_style_flags():
    done = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--help"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    for flag in ("--grpc-port", "--metrics-port", "--host", "--model-repository"):
        assert flag in done.stdout


def test_bad_setting_is_refused_with_the_value():
    done = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--grpc-port", "70000"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "got 70000" in done.stderr


def test_frontends_default_follows_the_core_count():
    from server.cli import default_frontends, parse_frontends

    assert [default_frontends(c) for c in (1, 2, 4, 16, 64)] == [0, 0, 2, 8, 8]
    assert parse_frontends("3") == 3
    import os

    assert parse_frontends("auto") == default_frontends(len(os.sched_getaffinity(0)))

