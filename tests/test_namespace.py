"""batchgate keeps to its own names: one import namespace, `batchgate.*`, and its own protobuf pool.

The repository's folders (server/, batcher/, clients/, bench/, protos/) are installed as
`batchgate.server`, ... (setup.py). These tests check the three ways it is imported: the source
tree (every module names `batchgate.…`), the editable install this suite runs on (from the
checkout and from elsewhere), and a wheel in a fresh virtual environment that has only the SDK's
dependencies, where `import tritonclient.grpc` and the batchgate SDK share one process.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from batchgate._checkout import EXAMPLE_MODELS, FOLDERS
from batchgate.protos import inference_pb2, model_config_pb2, registry, wire_pb2

REPO = Path(__file__).resolve().parents[1]
# FOLDERS: installed under batchgate.<name>; at the top level they must not be importable.
SCANNED = (*FOLDERS, "tests", "batchgate")
# "server.cli", "-m server.cli", "bench.loadgen.cli.main": a module path of the old layout.
OLD_PATH = re.compile(rf"(?:^|\s|-m\s*)({'|'.join(FOLDERS)})\.(\w+)")


def _python_files():
    for folder in SCANNED:
        for path in sorted((REPO / folder).rglob("*.py")):
            if "__pycache__" not in path.parts:
                yield path


def _is_module(folder: str, name: str) -> bool:
    return (REPO / folder / f"{name}.py").is_file() or (REPO / folder / name / "__init__.py").is_file()


def test_no_module_names_a_top_level_folder():
    found = []
    for path in _python_files():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        rel = path.relative_to(REPO)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                # Subprocess commands and monkeypatch targets: "server.cli", "-m bench.serving".
                names = [f"{m.group(1)}.{m.group(2)}" for m in OLD_PATH.finditer(node.value)
                         if _is_module(m.group(1), m.group(2))]
            else:
                continue
            found += [f"{rel}:{node.lineno}: {name}" for name in names
                      if name.partition(".")[0] in FOLDERS]
    assert not found, "modules must name batchgate.<folder>, not the folder:\n" + "\n".join(found)


def _run(args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, **kwargs)


IMPORT_CHECK = f"""
import sys
import batchgate.server.frontend.app
import batchgate.clients
print(batchgate.server.frontend.app.__file__)
print(sorted(m for m in sys.modules if m.partition(".")[0] in {FOLDERS!r}))
"""


@pytest.mark.parametrize("cwd", ["checkout", "elsewhere"])
def test_installed_package_maps_to_the_folders(cwd, tmp_path):
    # From the checkout the repository root is on sys.path (`python -c`), and still `server`
    # and `batchgate.server` must not become two copies of one module.
    done = _run([sys.executable, "-c", IMPORT_CHECK], cwd=REPO if cwd == "checkout" else tmp_path)
    assert done.returncode == 0, done.stderr
    app_file, top_level = done.stdout.splitlines()
    # The suite runs on the editable install (`make install`): the checkout's own files.
    assert Path(app_file).samefile(REPO / "server" / "frontend" / "app.py")
    assert top_level == "[]"


def test_a_checkout_that_is_not_installed_imports_from_its_folders(tmp_path):
    # As on a machine with torch preinstalled and nothing of ours: site-packages on the path
    # without its .pth files (-S; PYTHONPATH entries are not site directories), so the editable
    # install's finder is absent and only the checkout itself can map batchgate.<folder>.
    site = os.pathsep.join(dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")))
    script = IMPORT_CHECK + textwrap.dedent("""
        import batchgate.bench.gpu_check.run, batchgate.bench.harness.server
        print(sorted(m for m in sys.modules if m.partition(".")[0] in {folders!r}))
        """).format(folders=FOLDERS)
    env = {**os.environ, "PYTHONPATH": site}
    done = _run([sys.executable, "-S", "-c", script], cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr
    app_file, top_level, after_bench = done.stdout.splitlines()
    assert Path(app_file).samefile(REPO / "server" / "frontend" / "app.py")
    assert top_level == after_bench == "[]"
    # The same process without the checkout's finder: nothing else would have found them.
    bare = _run([sys.executable, "-S", "-c", "import sys, batchgate; "
                 "sys.meta_path[:] = [f for f in sys.meta_path "
                 "if type(f).__name__ != 'CheckoutFinder']; import batchgate.server"],
                cwd=REPO, env=env)
    assert "No module named 'batchgate.server'" in bare.stderr, bare.stderr


def test_an_installed_layout_gets_no_checkout_finder(tmp_path):
    from batchgate import _checkout

    installed = tmp_path / "site" / "batchgate"
    (installed / "server").mkdir(parents=True)
    assert not _checkout.is_checkout(installed)
    assert not _checkout.install(installed)
    assert _checkout.is_checkout(REPO / "batchgate")


# --- the wheel, in a fresh virtual environment -----------------------------------------------

# Third-party modules a process using the SDK and tritonclient imports; the fresh environment
# sees only these (by symlink), so torch and the server's dependencies are absent there.
SDK_IMPORTS = "import grpc, google.protobuf, numpy, grpc_health.v1.health_pb2, tritonclient.grpc"
DEPENDENCY_NAMES = f"""
import json, sys, sysconfig
{SDK_IMPORTS}
site = sysconfig.get_paths()["purelib"]
names = set()
for module in list(sys.modules.values()):
    file = getattr(module, "__file__", None) or ""
    if file.startswith(site + "/"):
        names.add(file[len(site) + 1:].split("/")[0])
print(json.dumps(sorted(names)))
"""


def _copy_sources(destination: Path) -> None:
    """What the wheel is built from, copied so that building writes nothing into the checkout."""
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(REPO / name, destination / name)
    for folder in ("batchgate", *FOLDERS, EXAMPLE_MODELS):
        shutil.copytree(REPO / folder, destination / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "native", "*.egg-info"))


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory):
    """(wheel path, python of a fresh venv with the wheel and only the SDK's dependencies)."""
    root = tmp_path_factory.mktemp("wheel")
    source, dist, venv, deps = root / "source", root / "dist", root / "venv", root / "deps"
    source.mkdir()
    _copy_sources(source)
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                  "--no-index", "-q", "-w", str(dist), str(source)])
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = dist.glob("batchgate-*.whl")

    made = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    installed = _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                      "--no-deps", "--no-index", str(wheel)])
    assert installed.returncode == 0, installed.stdout + installed.stderr

    names = _run([sys.executable, "-I", "-c", DEPENDENCY_NAMES])
    assert names.returncode == 0, names.stderr
    site = Path(sysconfig.get_paths()["purelib"])
    deps.mkdir()
    linked = set(json.loads(names.stdout)) | {p.name for p in site.glob("*.libs")}
    assert not {n for n in linked if n.partition(".")[0] in ("torch", "batchgate", *FOLDERS)}
    for name in linked:
        (deps / name).symlink_to(site / name)
    venv_site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
                     .stdout.strip())
    (venv_site / "sdk_dependencies.pth").write_text(f"{deps}\n")
    return wheel, python


@pytest.mark.slow  # builds and installs the wheel
def test_wheel_holds_only_the_batchgate_namespace(wheel_env):
    wheel, _ = wheel_env
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(n for n in names if n.endswith(".dist-info/METADATA")).rpartition("/")[0]
        record = archive.read(f"{info}/RECORD").decode()
        metadata = archive.read(f"{info}/METADATA").decode()
        top_level = archive.read(f"{info}/top_level.txt").decode().split()
    tops = {line.split(",")[0].split("/")[0] for line in record.splitlines() if line}
    assert tops - {info} == {"batchgate"}
    assert top_level == ["batchgate"]
    for path in ("batchgate/__init__.py", "batchgate/server/frontend/app.py", "batchgate/clients/__init__.py",
                 "batchgate/bench/loadgen/__init__.py", "batchgate/protos/inference_pb2.py",
                 "batchgate/protos/inference.proto", "batchgate/protos/registry.py"):
        assert path in names, path
    # torch only with the server extra: `pip install batchgate` is the SDK alone.
    torch_lines = [line for line in metadata.splitlines()
                   if re.match(r"Requires-Dist: torch\b", line)]
    assert torch_lines and all('extra == "server"' in line for line in torch_lines), torch_lines


IN_ONE_PROCESS = """
import importlib, sys

for name in {folders!r} + ("torch",):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        continue
    raise SystemExit(f"{{name}} is importable from the installed wheel")

import numpy as np
import tritonclient.grpc as triton
import batchgate
from batchgate import Client

assert batchgate.__file__.startswith(sys.prefix), batchgate.__file__
x = np.linspace(-1, 1, 512, dtype=np.float32).reshape(1, 512)
with Client({address!r}, timeout_s=30) as client:
    ours = client.infer("mlp", {{"INPUT__0": x}})["OUTPUT__0"]
theirs_client = triton.InferenceServerClient({address!r})
request = triton.InferInput("INPUT__0", [1, 512], "FP32")
request.set_data_from_numpy(x)
theirs = theirs_client.infer("mlp", [request]).as_numpy("OUTPUT__0")
theirs_client.close()
assert ours.shape == theirs.shape == (1, 512), (ours.shape, theirs.shape)
assert np.array_equal(ours, theirs)
print("ok")
"""


@pytest.mark.slow  # builds and installs the wheel
def test_wheel_sdk_and_tritonclient_in_one_process(wheel_env, server, tmp_path):
    _, python = wheel_env
    script = IN_ONE_PROCESS.format(folders=FOLDERS, address=server.address)
    done = _run([str(python), "-I", "-c", textwrap.dedent(script)], cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["ok"]


@pytest.mark.slow  # builds and installs the wheel
def test_wheel_console_script_without_the_server_extra(wheel_env, tmp_path):
    _, python = wheel_env
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    done = _run([str(python.parent / "batchgate"), "serve"], cwd=tmp_path, env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'batchgate[server]'" in lines[0], done.stderr


# What `pip install 'batchgate[server]'` gives: the wheel, and the server's dependencies from this
# interpreter's site-packages as plain path entries (their .pth files unread: no editable
# finder, so nothing of the checkout), run away from the checkout.
WITH_THE_SERVER_EXTRA = """
import importlib, pkgutil, sys
import numpy as np

try:
    import tests
except ModuleNotFoundError:
    pass
else:
    raise SystemExit(f"a test tree is importable: {tests.__file__}")
import batchgate, batchgate.bench
from batchgate import Client
from batchgate.bench import floor, inprocess, serving
from batchgate.bench.harness.server import start_process
from batchgate.server.config.settings import DEFAULT_REPOSITORY

assert batchgate.__file__.startswith(sys.prefix), batchgate.__file__
names = [m.name for m in pkgutil.walk_packages(batchgate.bench.__path__, "batchgate.bench.")
         if m.name.rpartition(".")[2] != "__main__"]
for name in names:
    importlib.import_module(name)
# The benchmarks' default repository is the server's: the example models, installed.
assert serving.DEFAULT_REPOSITORY.resolve() == DEFAULT_REPOSITORY.resolve()
assert str(DEFAULT_REPOSITORY.resolve()).startswith(sys.prefix), DEFAULT_REPOSITORY
assert floor.SOURCE.is_file() and all(p.is_file() for p in floor._inputs())
measured = inprocess.measure(serving.DEFAULT_REPOSITORY / "mlp", batch_size=2, seconds=0.1)
assert measured["calls"] >= 1, measured
with start_process(DEFAULT_REPOSITORY, "single", models=["mlp"]) as server:
    with Client(server.address, timeout_s=30) as client:
        x = np.ones((1, 512), np.float32)
        assert client.infer("mlp", {"INPUT__0": x})["OUTPUT__0"].shape == (1, 512)
print(len(names), "modules")
"""


@pytest.fixture(scope="module")
def server_wheel_python(wheel_env, tmp_path_factory):
    wheel, _ = wheel_env
    venv = tmp_path_factory.mktemp("server-wheel") / "venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    installed = _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                      "--no-deps", "--no-index", str(wheel)])
    assert installed.returncode == 0, installed.stdout + installed.stderr
    venv_site = Path(_run([str(python), "-c", "import sysconfig; "
                           "print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    here = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (venv_site / "server_dependencies.pth").write_text("".join(f"{d}\n" for d in here))
    return python


@pytest.mark.slow
def test_the_wheel_with_the_server_extra_runs_the_benchmarks_without_a_test_tree(
        server_wheel_python, tmp_path):
    # Every benchmark module imports; the in-process loop measures the installed mlp, and the
    # shared harness starts a server of the installed example repository that answers.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    done = _run([str(server_wheel_python), "-c", WITH_THE_SERVER_EXTRA], cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    count, _ = done.stdout.splitlines()[-1].split()
    assert int(count) > 20, done.stdout


@pytest.mark.slow  # builds and installs the wheel
def test_wheel_holds_the_example_repository_and_the_floors_source(wheel_env):
    wheel, _ = wheel_env
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    for model in ("mlp", "cnn", "encoder"):
        assert f"batchgate/models/{model}/config.pbtxt" in names, model
        assert f"batchgate/models/{model}/1/model.py" in names, model
    assert "batchgate/bench/floor/server.cc" in names


# --- the private descriptor pool, and reflection serving it ------------------------------------


def test_generated_modules_register_in_batchgate_pool():
    for module in (model_config_pb2, inference_pb2, wire_pb2):
        assert module.DESCRIPTOR.pool is registry.POOL, module.__name__
        assert module.DESCRIPTOR.pool is not descriptor_pool.Default()
    assert inference_pb2.ModelInferRequest.__module__ == "batchgate.protos.inference_pb2"
    assert registry.POOL.FindMessageTypeByName("inference.ModelInferRequest") is (
        inference_pb2.ModelInferRequest.DESCRIPTOR)
    # Not in the default pool: tritonclient's copies of the same messages go there.
    with pytest.raises(KeyError):
        descriptor_pool.Default().FindMessageTypeByName("batchgate.wire.ToExecutor")


def test_reflection_describes_services_from_batchgate_pool(server):
    # Health too: the Python front end adds its file to the pool it serves, the native one
    # links in code generated from grpcio-health-checking's descriptor.
    symbols = ["inference.GRPCInferenceService", "inference.ModelInferRequest",
               "grpc.health.v1.Health", "grpc.health.v1.HealthCheckResponse"]
    with grpc.insecure_channel(server.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = [reflection_pb2.ServerReflectionRequest(file_containing_symbol=s) for s in symbols]
        answers = list(stub.ServerReflectionInfo(iter(requests), timeout=30))
    assert len(answers) == len(symbols)
    for symbol, answer in zip(symbols, answers):
        assert answer.WhichOneof("message_response") == "file_descriptor_response", (symbol, answer)
        files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
                 for raw in answer.file_descriptor_response.file_descriptor_proto]
        package, _, name = symbol.rpartition(".")
        assert any(f.package == package and (name in {m.name for m in f.message_type}
                                             or name in {s.name for s in f.service})
                   for f in files), (symbol, [f.name for f in files])
