"""Shared fixtures: a real batchgate server on port 0, serving the example models plus test models.

The server runs on its own thread with its own event loop, as in production it runs in its own
process; tests talk to it over real gRPC on loopback. Test models live in a temporary
repository: ``gated`` (y = 2x, can be held by a gate so queues can be observed), ``failing``
(raises on the value 13), ``wrongbatch`` (drops the batch dimension).
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import textwrap
import threading
from pathlib import Path

import pytest

from server.app import Gateway, Settings

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_MODELS = ROOT / "models"

GATED_CONFIG = """
name: "gated"
backend: "pytorch"
max_batch_size: 8
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]
dynamic_batching {
  max_queue_delay_microseconds: 0
  priority_levels: 2
  default_priority_level: 2
  default_queue_policy { max_queue_size: 16 }
}
instance_group [ { kind: KIND_CPU count: 1 } ]
parameters { key: "max_inflight_batches" value: { string_value: "1" } }
parameters { key: "warmup" value: { string_value: "false" } }
"""

GATED_MODEL = '''
import threading
import torch


class Gated(torch.nn.Module):
    """y = 2x. While ``gate`` is clear, each batch waits for it; ``entered`` says one arrived.
    ``seen`` records the first value of every row, in execution order."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.seen = []

    def forward(self, x):
        self.seen.extend(x[:, 0].tolist())
        self.entered.set()
        self.gate.wait(30)
        return x * 2


def build_model(parameters):
    return Gated()
'''

FAILING_CONFIG = """
name: "failing"
backend: "pytorch"
max_batch_size: 8
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]
dynamic_batching { max_queue_delay_microseconds: 0 }
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

FAILING_MODEL = '''
import torch


class Failing(torch.nn.Module):
    def forward(self, x):
        if bool((x == 13).any()):
            raise ValueError("secret internal detail")
        return x + 1


def build_model(parameters):
    return Failing()
'''

WRONGBATCH_CONFIG = FAILING_CONFIG.replace('"failing"', '"wrongbatch"')
WRONGBATCH_MODEL = '''
import torch


class WrongBatch(torch.nn.Module):
    def forward(self, x):
        return x[:1]


def build_model(parameters):
    return WrongBatch()
'''

NUMERIC_TYPES = ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32",
                 "INT64", "FP16", "FP32", "FP64", "BF16")
TRITON_TYPES = {"BOOL": "TYPE_BOOL", "BF16": "TYPE_BF16"}
ECHO_CONFIG = (
    'name: "echo"\nbackend: "pytorch"\nmax_batch_size: 4\n'
    + "".join(
        f'input {{ name: "IN_{t}" data_type: {TRITON_TYPES.get(t, "TYPE_" + t)} dims: [ 3 ] }}\n'
        for t in NUMERIC_TYPES)
    + "".join(
        f'output {{ name: "OUT_{t}" data_type: {TRITON_TYPES.get(t, "TYPE_" + t)} dims: [ 3 ] }}\n'
        for t in NUMERIC_TYPES)
    + "dynamic_batching { max_queue_delay_microseconds: 1000 }\n"
)
ECHO_MODEL = """
import torch


class Echo(torch.nn.Module):
    \"\"\"Returns every input unchanged: the codec's round trip for each datatype.\"\"\"

    def forward(self, *inputs):
        return tuple(t.clone() for t in inputs)


def build_model(parameters):
    return Echo()
"""

STRLEN_CONFIG = """
name: "strlen"
backend: "pytorch"
max_batch_size: 8
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "LENGTH" data_type: TYPE_INT64 dims: [ 1 ] } ]
dynamic_batching { max_queue_delay_microseconds: 0 }
"""
STRLEN_MODEL = '''
import numpy as np
import torch


class StrLen(torch.nn.Module):
    """BYTES in: the module gets the numpy object array of the batch; returns byte lengths."""

    def forward(self, text):
        return torch.from_numpy(np.vectorize(len, otypes=[np.int64])(text))


def build_model(parameters):
    return StrLen()
'''

TEST_MODELS = {
    "echo": (ECHO_CONFIG, ECHO_MODEL),
    "strlen": (STRLEN_CONFIG, STRLEN_MODEL),
    "spare": (FAILING_CONFIG.replace('"failing"', '"spare"'), FAILING_MODEL),
    "gated": (GATED_CONFIG, GATED_MODEL),
    "failing": (FAILING_CONFIG, FAILING_MODEL),
    "wrongbatch": (WRONGBATCH_CONFIG, WRONGBATCH_MODEL),
}


def write_test_repository(root: Path) -> Path:
    for child in EXAMPLE_MODELS.iterdir():
        if child.is_dir() and (child / "config.pbtxt").exists():
            shutil.copytree(child, root / child.name, ignore=shutil.ignore_patterns("__pycache__"))
    for name, (config, model) in TEST_MODELS.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(textwrap.dedent(config))
        (root / name / "1" / "model.py").write_text(model)
    # wrongbatch would fail its warm-up; it must load so that the server can report the error.
    (root / "wrongbatch" / "config.pbtxt").write_text(
        textwrap.dedent(WRONGBATCH_CONFIG)
        + 'parameters { key: "warmup" value: { string_value: "false" } }\n'
    )
    return root


@dataclasses.dataclass
class RunningServer:
    gateway: Gateway
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gateway.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.metrics_port}/metrics"

    def call(self, coroutine, timeout_s: float = 60):
        """Run ``coroutine`` on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def module(self, model: str):
        """The loaded torch module of ``model`` (for test models' gates)."""
        return self.gateway.repository.get(model).module

    def stop(self) -> None:
        if self.loop.is_running():
            self.call(self.gateway.stop(drain_timeout_s=5))
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def start_server(repository: Path, **overrides) -> RunningServer:
    settings = Settings(
        host="127.0.0.1", grpc_port=0, metrics_port=0, model_repository=repository,
        gc_freeze=False, **overrides,
    )
    started = threading.Event()
    box: dict = {}

    def run() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        box["loop"] = loop
        try:
            gateway = Gateway(settings)
            box["gateway"] = gateway
            loop.run_until_complete(gateway.start())
        except BaseException as exc:  # reported to the test below
            box["error"] = exc
            started.set()
            return
        started.set()
        loop.run_forever()
        loop.close()

    thread = threading.Thread(target=run, name="batchgate-test-server", daemon=True)
    thread.start()
    if not started.wait(120):
        raise RuntimeError("the test server did not start within 120 s")
    if "error" in box:
        raise box["error"]
    return RunningServer(box["gateway"], box["loop"], thread)


@pytest.fixture(scope="session")
def model_repository(tmp_path_factory) -> Path:
    return write_test_repository(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def server(model_repository) -> RunningServer:
    running = start_server(model_repository)
    yield running
    running.stop()
