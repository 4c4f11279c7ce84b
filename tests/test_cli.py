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


def test_auto_is_native_where_built_else_one_process(model_repository, monkeypatch, tmp_path):
    import pytest

    from batchgate.server.supervisor import native_binary as native
    from batchgate.server.cli import resolve_mode
    from batchgate.server.config.settings import Settings

    settings = lambda **kw: Settings(model_repository=model_repository, **kw)  # noqa: E731
    monkeypatch.setenv(native.ENV_VAR, sys.executable)  # an executable: what "built" is checked by
    assert resolve_mode(settings()) == ("native", None)
    assert resolve_mode(settings(frontend="single")) == ("single", None)
    monkeypatch.setenv(native.ENV_VAR, str(tmp_path / "absent"))
    mode, why = resolve_mode(settings())
    assert mode == "single" and "the native front end is not built" in why
    with pytest.raises(ValueError, match="--frontend native: the native front end is not built"):
        resolve_mode(settings(frontend="native"))
    with pytest.raises(ValueError, match="--frontend python .* was removed: use --frontend native"):
        settings(frontend="python")


def test_serve_without_the_native_build_says_it_falls_back_to_one_process(tmp_path):
    """``auto`` where the native front end is not built: one process, with a warning that says
    why and what the mode is for; ``--frontend single`` says what it is for too."""
    import shutil

    from batchgate.server.supervisor import native_binary as native
    from tests.support import EXAMPLE_MODELS

    shutil.copytree(EXAMPLE_MODELS / "mlp", tmp_path / "models" / "mlp",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, native.ENV_VAR: str(tmp_path / "absent")}
    for args, event, level in (([], "native_front_end_unavailable", "warning"),
                               (["--frontend", "single"], "single_process_mode", "info")):
        server = ServeProcess("serve", *args, "--host", "127.0.0.1", "--grpc-port", "0",
                              "--metrics-port", "-1", "--log-format", "json",
                              "--model-repository", str(tmp_path / "models"), env=env)
        try:
            said = server.wait_for(event)
            assert said["level"] == level and said["mode"] == "single"
            assert "for debugging" in said["purpose"] and "--frontend native" in said["purpose"]
            if not args:
                assert str(tmp_path / "absent") in said["reason"]
            assert server.wait_for("serving")["mode"] == "single"
            assert not server.pids("executor")  # no other process serves
        finally:
            assert server.stop() == 0


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
