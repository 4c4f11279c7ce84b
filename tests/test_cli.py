"""`batchgate serve` as users run it: a real process, the example repository, SIGTERM drain."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np

from batchgate.protos import inference_pb2 as pb
from batchgate.protos import inference_pb2_grpc
from batchgate.bench.harness.server import ServeProcess

ROOT = Path(__file__).resolve().parent.parent


def test_serve_defaults_to_the_example_repository_and_drains_on_sigterm():
    server = ServeProcess("serve", "--host", "127.0.0.1", "--grpc-port", "0",
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
    done = subprocess.run([sys.executable, "-m", "batchgate.server.cli", "serve", "--help"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    for flag in ("--grpc-port", "--metrics-port", "--host", "--model-repository"):
        assert flag in done.stdout


def test_bad_setting_is_refused_with_the_value():
    done = subprocess.run([sys.executable, "-m", "batchgate.server.cli", "serve", "--grpc-port", "70000"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "got 70000" in done.stderr


def test_frontends_default_follows_the_core_count(model_repository):
    from batchgate.server.cli import default_frontends, resolve_mode
    from batchgate.server.settings import Settings

    assert [default_frontends(c) for c in (1, 2, 4, 16, 64)] == [0, 0, 2, 8, 8]
    python = Settings(model_repository=model_repository, frontend="python")
    cores = len(os.sched_getaffinity(0))
    assert resolve_mode(python)[:2] == ("python", default_frontends(cores))
    assert resolve_mode(Settings(model_repository=model_repository, frontends=3))[:2] == (
        "python", 3)


def test_grpc_port_comes_from_the_environment_when_not_given(monkeypatch):
    import argparse

    from batchgate.server import cli

    parser = argparse.ArgumentParser()
    cli.add_serve_arguments(parser)
    monkeypatch.setenv("BATCHGATE_GRPC_PORT", "9123")
    assert cli.settings_from(parser.parse_args([])).grpc_port == 9123
    assert cli.settings_from(parser.parse_args(["--grpc-port", "7"])).grpc_port == 7
    monkeypatch.delenv("BATCHGATE_GRPC_PORT")
    assert cli.settings_from(parser.parse_args([])).grpc_port == 8001
