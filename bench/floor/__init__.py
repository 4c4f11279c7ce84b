"""The floor: the serving benchmark's all-C++ yardstick.

``batchgate-floor`` (``server.cc``) is what a gateway with no Python anywhere reaches on this
machine: the KServe v2 gRPC service on the native front end's threading (gRPC's async API, a
completion queue and a thread per worker, answers handed back through a doorbell alarm) and one
C++ thread running the model's TorchScript through libtorch in work-conserving batches. No
executor process, no shared memory, no request checks beyond the shapes, no metrics: not a
server to deploy. ``batchgate.bench.serving --modes ...,floor`` measures it beside the modes,
under the same load generators and in the same run, so that a mode's shortfall can be read
against what this machine allows at all.

It serves models of one FP32 input ``[-1, in]`` and one FP32 output ``[-1, out]`` whose module
is TorchScript (as the example ``mlp``), on the intra-op threads their config asks.

Building needs what the native front end needs (a C++17 compiler, gRPC C++ and protobuf with
their compilers, Abseil) and torch's C++ headers and libraries, which the torch wheel ships;
``build()`` compiles it once into ``build/floor/`` (about a minute on 2 cores) and again when
``server.cc`` or the protocols change.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import selectors
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
SOURCE = Path(__file__).with_name("server.cc")
BUILD_DIR = ROOT / "build" / "floor"
BINARY = "batchgate-floor"
PROTOS = ("inference", "model_config")
_PKG_CONFIG = ("grpc++", "protobuf", "absl_synchronization")
START_TIMEOUT_S = 60.0


class FloorUnavailable(RuntimeError):
    """The floor cannot be built or cannot serve this model; the message says why."""


def torch_dir() -> Path:
    """The installed torch package's folder, found without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise FloorUnavailable("torch is not installed in this Python")
    return Path(next(iter(spec.submodule_search_locations)))


def _inputs() -> list[Path]:
    """The files the binary is built from, in this checkout."""
    return [SOURCE, *(ROOT / "protos" / f"{name}.proto" for name in PROTOS)]


def _torch_includes(torch: Path, build_dir: Path) -> Path:
    """torch's include folder less its bundled ``google/protobuf`` headers, which belong to
    another protobuf than the one gRPC is built with: a folder of links to the rest."""
    source = torch / "include"
    if not (source / "torch" / "script.h").exists():
        raise FloorUnavailable(f"torch's C++ headers are not in {source}")
    linked = build_dir / "torch-include"
    shutil.rmtree(linked, ignore_errors=True)
    linked.mkdir(parents=True)
    for entry in source.iterdir():
        if entry.name != "google":
            (linked / entry.name).symlink_to(entry)
    return linked


def _run(command: list[str], what: str) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    except OSError as error:
        raise FloorUnavailable(f"{what}: {error}") from None
    if done.returncode != 0:
        raise FloorUnavailable(f"{what} failed (exit {done.returncode}): {done.stderr[-1500:]}")
    return done.stdout


def build(build_dir: Path = BUILD_DIR) -> Path:
    """``batchgate-floor``, compiled if it is missing or older than its sources."""
    missing = [str(p) for p in _inputs() if not p.exists()]
    if missing:  # an installed package: like bench.serving, the floor runs from a checkout
        raise FloorUnavailable(f"batchgate-floor's sources are not here ({', '.join(missing)}): "
                               "run it from a checkout of the repository")
    binary = build_dir / BINARY
    torch = torch_dir()
    built_from = [*_inputs(), torch / "version.py"]  # another torch: built again
    if binary.exists() and all(binary.stat().st_mtime >= p.stat().st_mtime
                               for p in built_from if p.exists()):
        return binary
    # $CXX may carry a launcher or flags ("ccache g++"): split as a shell would.
    compiler_command = shlex.split(os.environ.get("CXX", "")) or [
        shutil.which("c++") or shutil.which("g++") or ""]
    compiler = shutil.which(compiler_command[0]) if compiler_command[0] else None
    protoc, plugin = shutil.which("protoc"), shutil.which("grpc_cpp_plugin")
    missing = [name for name, path in (("a C++ compiler", compiler), ("protoc", protoc),
                                       ("grpc_cpp_plugin", plugin),
                                       ("pkg-config", shutil.which("pkg-config"))) if not path]
    if missing:
        raise FloorUnavailable(f"building batchgate-floor needs {', '.join(missing)} "
                               "(the native front end's build packages)")
    if not list((torch / "lib").glob("libtorch_cpu.*")):
        raise FloorUnavailable(f"torch's C++ libraries are not in {torch / 'lib'}")
    flags = _run(["pkg-config", "--cflags", "--libs", *_PKG_CONFIG],
                 "pkg-config " + " ".join(_PKG_CONFIG)).split()
    generated = build_dir / "generated"
    (generated / "protos").mkdir(parents=True, exist_ok=True)
    _run([protoc, f"-I{ROOT}", f"--cpp_out={generated}", f"--grpc_out={generated}",
          f"--plugin=protoc-gen-grpc={plugin}", *(f"protos/{name}.proto" for name in PROTOS)],
         "protoc")
    includes = _torch_includes(torch, build_dir)
    common = [*compiler_command, "-std=c++17", "-O2", "-DNDEBUG", "-Wall", "-Wextra",
              f"-I{generated}",
              f"-isystem{includes}", f"-isystem{includes / 'torch/csrc/api/include'}",
              *[f for f in flags if f.startswith("-I") or f.startswith("-D")]]
    units = [SOURCE, *(generated / "protos" / f"{name}.pb.cc" for name in PROTOS),
             generated / "protos" / "inference.grpc.pb.cc"]
    objects = [build_dir / (unit.name + ".o") for unit in units]
    # In parallel: the server's unit (torch's headers) is the long one.
    # Our own unit builds warning-free; the generated ones are protoc's.
    jobs = [subprocess.Popen([*common, *(["-Werror"] if unit == SOURCE else []), "-c", str(unit),
                              "-o", str(obj)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for unit, obj in zip(units, objects)]
    failures = []
    for unit, job in zip(units, jobs):
        _out, err = job.communicate()
        if job.returncode != 0:
            failures.append(f"{unit.name}: {err[-1500:]}")
    if failures:
        raise FloorUnavailable("compiling batchgate-floor failed: " + "\n".join(failures))
    partial = build_dir / (BINARY + ".partial")
    _run([*compiler_command, *map(str, objects), "-o", str(partial),
          *[f for f in flags if not (f.startswith("-I") or f.startswith("-D"))],
          f"-L{torch / 'lib'}", "-ltorch", "-ltorch_cpu", "-lc10",
          f"-Wl,-rpath,{torch / 'lib'}", "-pthread"], "linking batchgate-floor")
    partial.replace(binary)
    return binary


@dataclasses.dataclass(frozen=True)
class FloorModel:
    """What ``batchgate-floor`` is told of the model (``export``'s answer)."""

    path: Path
    name: str
    input: str
    output: str
    in_width: int
    out_width: int
    max_batch_size: int
    intra_op_threads: int


def export(model_dir: Path, dest: Path) -> FloorModel:
    """The model of ``model_dir``, loaded as the server loads it, saved as TorchScript at
    ``dest``: in a subprocess, so the caller never imports torch."""
    done = subprocess.run(
        [sys.executable, "-m", "batchgate.bench.floor.export", str(model_dir), str(dest)],
        capture_output=True, text=True, cwd=ROOT, timeout=300)
    if done.returncode != 0:
        raise FloorUnavailable(done.stderr.strip().splitlines()[-1] if done.stderr.strip()
                               else f"exporting {model_dir.name} failed (exit {done.returncode})")
    return FloorModel(path=dest, **json.loads(done.stdout))


class FloorServer:
    """A running ``batchgate-floor``, with what ``batchgate.bench.serving`` asks of a server:
    its address, its process, its counters as ``/metrics`` lines, a stop that returns the exit
    status."""

    metrics_url = None  # it has no /metrics: its counters come through metrics_text()

    def __init__(self, binary: Path, model: FloorModel, workers: int) -> None:
        self.model = model
        self.command = [str(binary), str(model.path), model.name, model.input, model.output,
                        str(model.in_width), str(model.out_width), str(model.max_batch_size),
                        str(workers), str(model.intra_op_threads)]
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self._tail: str | None = None  # the log's end, kept once stopped
        self.process = subprocess.Popen(self.command, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        try:
            line = self._read_line(START_TIMEOUT_S)
            self.port = int(json.loads(line)["port"])
        except BaseException:
            self.process.kill()
            self.process.wait()
            raise
        self.address = f"127.0.0.1:{self.port}"
        self.pid = self.process.pid

    def _read_line(self, timeout_s: float) -> str:
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            if not selector.select(timeout_s):
                raise FloorUnavailable(f"batchgate-floor said nothing in {timeout_s:g} s: "
                                       f"{self.log_tail()}")
        line = self.process.stdout.readline()
        if not line:
            raise FloorUnavailable(f"batchgate-floor exited {self.process.wait()}: "
                                   f"{self.log_tail()}")
        return line

    def counters(self) -> dict[str, Any]:
        """Batches, samples and the model thread's CPU seconds inside forward(), so far."""
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        return json.loads(self._read_line(10.0))

    def metrics_text(self) -> str:
        """The counters as the ``batchgate_*`` samples the serving benchmark reads."""
        c, label = self.counters(), f'{{model="{self.model.name}"}}'
        return "\n".join([
            f"batchgate_batch_size_count{label} {c['batches']}",
            f"batchgate_batch_size_sum{label} {c['samples']}",
            f"batchgate_model_cpu_seconds_total{label} {c['model_cpu_s']}",
            f'batchgate_requests_total{{model="{self.model.name}",status="OK"}} {c["samples"]}',
        ]) + "\n"

    def log_tail(self) -> str:
        if self._tail is not None:
            return self._tail
        self._stderr.seek(0)
        return self._stderr.read()[-2000:]

    def stop(self) -> int:
        """SIGTERM, then its exit status (killed after 30 s)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()
        finally:
            if self._tail is None:
                self._tail = self.log_tail()
                self._stderr.close()
                self.process.stdin.close()
                self.process.stdout.close()
