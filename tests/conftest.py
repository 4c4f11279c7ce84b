"""Shared fixtures: a real batchgate server on port 0, serving the example models plus test models.

The server runs on its own thread with its own event loop, as in production it runs in its own
process; tests talk to it over real gRPC on loopback. Test models live in a temporary
repository: ``gated`` (y = 2x, can be held by a gate so queues can be observed), ``failing``
(raises on the value 13), ``wrongbatch`` (drops the batch dimension), ``strings`` (BYTES in and
out), among others below.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from server.app import Gateway, Settings

ROOT = Path(__file__).resolve().parent.parent
# Triton's perf_analyzer, installed by `make tools` (scripts/install-perf-analyzer.sh).
PERF_ANALYZER = ROOT / "scripts" / "perf_analyzer"


def perf_analyzer_unavailable() -> str | None:
    """None if perf_analyzer runs here, else the reason it does not (for a skip)."""
    if not PERF_ANALYZER.exists() or not (ROOT / ".tools" / "perf_analyzer" / "bin").exists():
        return "perf_analyzer is not installed (make test runs scripts/install-perf-analyzer.sh)"
    probe = subprocess.run([str(PERF_ANALYZER), "--version"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"perf_analyzer does not run here: {probe.stderr.strip()[:200]}"
    return None
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
parameters { key: "gate_dir" value: { string_value: "GATE_DIR" } }
"""

GATED_MODEL = '''
import time
from pathlib import Path

import torch


class Gated(torch.nn.Module):
    """y = 2x. Files in ``gate_dir`` drive it from another process: while ``closed`` exists each
    batch waits; ``entered`` appears when a batch starts; ``seen`` logs each row's first value."""

    def __init__(self, gate_dir):
        super().__init__()
        self.dir = Path(gate_dir)

    def forward(self, x):
        with open(self.dir / "seen", "a") as log:
            log.write("".join(f"{v}\\n" for v in x[:, 0].tolist()))
        (self.dir / "entered").touch()
        deadline = time.monotonic() + 30
        while (self.dir / "closed").exists() and time.monotonic() < deadline:
            time.sleep(0.001)
        return x * 2


def build_model(parameters):
    return Gated(parameters["gate_dir"])
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

# A batch holding a 7 hangs until the file "unhang" appears in the gate folder (at most 120 s);
# a 1-second execution timeout fails it first. Two batches in flight (one is the CPU default):
# the timeout must also work with the assembler/compute thread pair.
HANGING_CONFIG = FAILING_CONFIG.replace('"failing"', '"hanging"') + """
parameters { key: "max_inflight_batches" value: { string_value: "2" } }
parameters { key: "execution_timeout_ms" value: { string_value: "1000" } }
parameters { key: "gate_dir" value: { string_value: "GATE_DIR" } }
"""
HANGING_MODEL = '''
import time
from pathlib import Path

import torch


class Hanging(torch.nn.Module):
    def __init__(self, gate_dir):
        super().__init__()
        self.unhang = Path(gate_dir) / "unhang"

    def forward(self, x):
        if bool((x == 7).any()):
            deadline = time.monotonic() + 120
            while not self.unhang.exists() and time.monotonic() < deadline:
                time.sleep(0.005)
        return x + 1


def build_model(parameters):
    return Hanging(parameters["gate_dir"])
'''

# A batch holding a 13 raises SystemExit, which no model should: the instance stops for good.
FATAL_CONFIG = FAILING_CONFIG.replace('"failing"', '"fatal"')
FATAL_MODEL = '''
import torch


class Fatal(torch.nn.Module):
    def forward(self, x):
        if bool((x == 13).any()):
            raise SystemExit(3)
        return x + 1


def build_model(parameters):
    return Fatal()
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

# BYTES in and out. A batch is released when it holds 4 rows (the long delay makes requests of
# fewer rows wait for each other, so one batch is split per request). A batch whose first element
# names a fault returns that fault instead, which must fail the batch.
STRINGS_CONFIG = """
name: "strings"
backend: "pytorch"
max_batch_size: 4
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 2 ] } ]
output [
  { name: "UPPER" data_type: TYPE_STRING dims: [ 2 ] },
  { name: "SWAPPED" data_type: TYPE_STRING dims: [ 2 ] },
  { name: "JOINED" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "LENGTH" data_type: TYPE_INT64 dims: [ 2 ] }
]
dynamic_batching { max_queue_delay_microseconds: 10000000 }
"""
STRINGS_MODEL = '''
import numpy as np
import torch


class Strings(torch.nn.Module):
    """UPPER: a numpy object array; SWAPPED: a list of rows, each a list of bytes; JOINED: a
    list of str, one per row (sent as UTF-8); LENGTH: a tensor of byte lengths."""

    def forward(self, text):
        upper = np.vectorize(bytes.upper, otypes=[object])(text)
        swapped = [[row[1], row[0]] for row in text]
        joined = [b"+".join(row).decode("latin-1") + "\u00e9" for row in text]
        length = torch.from_numpy(np.vectorize(len, otypes=[np.int64])(text))
        fault = text[0, 0]
        if fault == b"int":
            upper[-1, 1] = 7
        elif fault == b"float":
            upper = torch.zeros(text.shape)
        elif fault == b"short":
            joined = joined[1:]
        elif fault == b"unbatched":
            swapped = upper.reshape(-1)
        elif fault == b"object":
            length = length.numpy().astype(object)
        return upper, swapped, joined, length


def build_model(parameters):
    return Strings()
'''

TEST_MODELS = {
    "echo": (ECHO_CONFIG, ECHO_MODEL),
    "strlen": (STRLEN_CONFIG, STRLEN_MODEL),
    "strings": (STRINGS_CONFIG, STRINGS_MODEL),
    "spare": (FAILING_CONFIG.replace('"failing"', '"spare"'), FAILING_MODEL),
    "gated": (GATED_CONFIG, GATED_MODEL),
    "failing": (FAILING_CONFIG, FAILING_MODEL),
    "wrongbatch": (WRONGBATCH_CONFIG, WRONGBATCH_MODEL),
    "hanging": (HANGING_CONFIG, HANGING_MODEL),
    "fatal": (FATAL_CONFIG, FATAL_MODEL),
}


def write_test_repository(root: Path, gate_dir: Path) -> Path:
    for child in EXAMPLE_MODELS.iterdir():
        if child.is_dir() and (child / "config.pbtxt").exists():
            shutil.copytree(child, root / child.name, ignore=shutil.ignore_patterns("__pycache__"))
    for name, (config, model) in TEST_MODELS.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(
            textwrap.dedent(config).replace("GATE_DIR", str(gate_dir)))
        (root / name / "1" / "model.py").write_text(model)
    # wrongbatch would fail its warm-up; it must load so that the server can report the error.
    (root / "wrongbatch" / "config.pbtxt").write_text(
        textwrap.dedent(WRONGBATCH_CONFIG)
        + 'parameters { key: "warmup" value: { string_value: "false" } }\n'
    )
    return root


class Gate:
    """Drives the ``gated`` test model through files, so it works across processes."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory

    def close(self) -> None:
        (self.dir / "entered").unlink(missing_ok=True)
        (self.dir / "seen").unlink(missing_ok=True)
        (self.dir / "closed").touch()

    def open(self) -> None:
        (self.dir / "closed").unlink(missing_ok=True)

    def wait_entered(self, timeout_s: float = 30) -> None:
        poll(lambda: (self.dir / "entered").exists(), timeout_s, "the gated model never ran")

    def seen(self) -> list[float]:
        path = self.dir / "seen"
        return [float(v) for v in path.read_text().split()] if path.exists() else []


def poll(predicate, timeout_s: float = 30, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout_s} s")
        time.sleep(0.002)


_REFERENCE_MODULES: dict[str, object] = {}


def reference(model: str, x: np.ndarray) -> np.ndarray:
    """The example model's own output on ``x`` alone, computed in this process (seeded weights)."""
    module = _REFERENCE_MODULES.get(model)
    if module is None:
        from batcher.loading import latest_version, load_module

        version = latest_version(EXAMPLE_MODELS / model)
        module = _REFERENCE_MODULES[model] = load_module(
            version, filename=None, parameters={}, device="cpu")
    with torch.inference_mode():
        return module(torch.from_numpy(np.ascontiguousarray(x))).numpy()


class Load:
    """Closed-loop SDK clients on threads, inferring the example ``mlp``: every answer checked,
    final failures counted by status code. Each client has its own connection (gRPC shares one
    per target otherwise), so load balancers and SO_REUSEPORT spread them. Bounded in time:
    clients stop after ``max_s`` whatever happens."""

    def __init__(self, address: str, clients: int = 8, retry=None, max_s: float = 120) -> None:
        from clients import RetryPolicy

        self.address = address
        self.max_s = max_s
        self.retry = retry or RetryPolicy(max_attempts=1)
        self.ok = 0
        self.wrong = 0
        self.failures: collections.Counter = collections.Counter()
        self.failure_details: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._x = np.random.default_rng(0).standard_normal((1, 512), dtype=np.float32)
        self._expected = reference("mlp", self._x)
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def _run(self) -> None:
        from clients import BatchgateError, Client

        with Client(self.address, timeout_s=10, retry=self.retry,
                    options=[("grpc.use_local_subchannel_pool", 1)]) as client:
            deadline = time.monotonic() + self.max_s
            while not self._stop.is_set() and time.monotonic() < deadline:
                try:
                    out = client.infer("mlp", {"INPUT__0": self._x})["OUTPUT__0"]
                except BatchgateError as exc:
                    with self._lock:
                        self.failures[exc.code] += 1
                        self.failure_details.append(str(exc)[:200])
                    continue
                good = np.allclose(out, self._expected, rtol=1e-4, atol=1e-5)
                with self._lock:
                    self.ok += 1 if good else 0
                    self.wrong += 0 if good else 1

    def __enter__(self):
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def answered(self) -> int:
        with self._lock:
            return self.ok

    def progress(self, more: int, timeout_s: float, what: str) -> int:
        """Wait until ``more`` further answers came; return how many did."""
        start = self.answered()
        poll(lambda: self.answered() >= start + more, timeout_s, what)
        return self.answered() - start


class RunningServer:
    """A server under test: ``mode`` "single" (one process: the server runs on a thread here),
    "python" (the supervisor, an executor process and Python front-end processes) or "native"
    (the supervisor, an executor process and the native front end)."""

    def __init__(self, mode: str, grpc_port: int, metrics_port: int, gate: Gate, stop) -> None:
        self.mode = mode
        self.grpc_port = grpc_port
        self.metrics_port = metrics_port
        self.gate = gate
        self._stop = stop
        self.gateway: Gateway | None = None  # single mode only
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None

    @property
    def multiprocess(self) -> bool:
        return self.mode != "single"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def call(self, coroutine, timeout_s: float = 60):
        """Run ``coroutine`` on the in-process server's loop (single mode)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def metric(self, name: str, **labels) -> float:
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        total = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
        return total

    def queue_depth(self, model: str) -> float:
        return self.metric("batchgate_queue_depth", model=model)

    def stop(self) -> None:
        self._stop()


def start_server(repository: Path, gate: Gate | None = None, **overrides) -> RunningServer:
    """A single-process server on a thread of this process."""
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
    gateway, loop = box["gateway"], box["loop"]

    def stop() -> None:
        if loop.is_running():
            asyncio.run_coroutine_threadsafe(gateway.stop(drain_timeout_s=5), loop).result(60)
            loop.call_soon_threadsafe(loop.stop)
        thread.join(30)

    running = RunningServer("single", gateway.grpc_port, gateway.metrics_port, gate, stop)
    running.gateway, running.loop, running.thread = gateway, loop, thread
    return running


class ServeProcess:
    """``batchgate`` as its own process (``python -m server.cli ARGS``), its JSON log lines parsed.

    Children's lines (multi-process mode) carry a ``role``; ``wait_for`` and ``pids`` tell them
    apart from the server's own."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server.cli", *args],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
        )
        self.events: list[dict] = []
        self.lines: list[bytes] = []  # every line of stderr, JSON or not
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            with self._changed:
                self.lines.append(line)
            try:
                event = json.loads(line)
            except ValueError:
                continue
            with self._changed:
                self.events.append(event)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, name: str, timeout_s: float = 120) -> dict:
        """The server's own first ``name`` event."""
        def found():
            return [e for e in self.events if e.get("event") == name and "role" not in e]

        with self._changed:
            self._changed.wait_for(lambda: found() or self.proc.poll() is not None, timeout_s)
            match = found()
        if not match:
            raise AssertionError(f"no {name!r} event; got {[e.get('event') for e in self.events]}")
        return match[0]

    def pids(self, role: str) -> dict:
        """The latest ready process per slot of ``role`` ("executor" has slot None)."""
        event = f"{role}_ready"
        with self._changed:
            return {e.get("slot"): e["pid"] for e in self.events if e.get("event") == event}

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def native_or_skip() -> None:
    """Skip the test, saying why, when the native front end is not built; fail instead where
    it must be ($BATCHGATE_REQUIRE_NATIVE, which CI sets: a broken build must not pass)."""
    from server import native

    reason = native.unavailable_reason()
    if reason is None:
        return
    if os.environ.get("BATCHGATE_REQUIRE_NATIVE"):
        pytest.fail(f"$BATCHGATE_REQUIRE_NATIVE is set and {reason}")
    pytest.skip(reason)


def start_multiprocess_server(repository: Path, gate: Gate | None = None, frontends: int = 2,
                              extra_args: tuple[str, ...] = (),
                              env: dict[str, str] | None = None,
                              frontend: str = "python") -> RunningServer:
    """The supervisor with an executor process and its front end: ``frontends`` Python
    processes, or (``frontend`` "native") the native one; ``extra_args``: further ``serve``
    flags; ``env``: the server's whole environment."""
    if frontend == "native":
        native_or_skip()
        processes = ["--frontend", "native"]
    else:
        processes = ["--frontend", "python", "--frontends", str(frontends)]
    # The supervisor runs apart from the test process on purpose: it forks its children, and a
    # fork of a process whose threads are inside gRPC (the tests' clients) is not safe.
    supervisor = ServeProcess(
        "serve", *processes, "--host", "127.0.0.1", "--grpc-port", "0",
        "--metrics-port", "0", "--model-repository", str(repository),
        "--arena-bytes", str(256 << 20), "--drain-timeout-s", "10", "--log-format", "json",
        "--no-gc-freeze", *extra_args, env=env)
    try:
        serving = supervisor.wait_for("serving")
    except BaseException:
        supervisor.proc.kill()
        raise

    def stop() -> None:
        code = supervisor.stop()
        assert code == 0, f"the supervisor exited {code}"

    running = RunningServer(frontend, serving["grpc_port"], serving["metrics_port"], gate, stop)
    running.supervisor = supervisor
    return running


def make_pki(directory: Path) -> dict[str, Path]:
    """Throwaway certificates, made with the ``openssl`` command: a CA; a server certificate it
    signed for localhost and 127.0.0.1; a client certificate it signed; and a client
    certificate signed by another CA (``rogue_*``), which a server trusting the first refuses.
    Keys are P-256: quick to make. Paths by name: ``ca``, ``server_cert``, ``server_key``,
    ``client_cert``, ``client_key``, ``rogue_cert``, ``rogue_key``."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True,
                       timeout=60)

    def ca(name: str) -> None:
        run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-days", "2", "-subj", f"/CN=batchgate test {name}",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            "-keyout", f"{name}.key", "-out", f"{name}.pem")

    def leaf(name: str, issuer: str, extensions: str) -> None:
        (directory / f"{name}.ext").write_text(extensions)
        run("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.csr")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", f"{issuer}.pem", "-CAkey",
            f"{issuer}.key", "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext",
            "-out", f"{name}.pem")

    ca("ca")
    ca("rogue-ca")
    leaf("server", "ca", "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
                         "extendedKeyUsage=serverAuth\n")
    leaf("client", "ca", "extendedKeyUsage=clientAuth\n")
    leaf("rogue", "rogue-ca", "extendedKeyUsage=clientAuth\n")
    return {
        "ca": directory / "ca.pem",
        "server_cert": directory / "server.pem", "server_key": directory / "server.key",
        "client_cert": directory / "client.pem", "client_key": directory / "client.key",
        "rogue_cert": directory / "rogue.pem", "rogue_key": directory / "rogue.key",
    }


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> dict[str, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make the test certificates")
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def gate(tmp_path_factory) -> Gate:
    return Gate(tmp_path_factory.mktemp("gate"))


@pytest.fixture(scope="session")
def model_repository(tmp_path_factory, gate) -> Path:
    return write_test_repository(tmp_path_factory.mktemp("models"), gate.dir)


SERVER_MODES = ("single", "python", "native")


def start_in_mode(mode: str, repository: Path, gate: Gate | None = None,
                  **overrides) -> RunningServer:
    """A server of ``mode`` (SERVER_MODES). ``overrides``: settings of the single-process
    server (``Settings`` fields), or ``extra_args``/``env``/``frontends`` of the others."""
    if mode == "single":
        return start_server(repository, gate, **overrides)
    return start_multiprocess_server(repository, gate, frontend=mode, **overrides)


@pytest.fixture(scope="session", params=SERVER_MODES)
def server(request, model_repository, gate) -> RunningServer:
    """The server in every mode: every test that uses it runs against each."""
    running = start_in_mode(request.param, model_repository, gate)
    yield running
    gate.open()
    running.stop()
