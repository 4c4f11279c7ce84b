"""The tests' servers: the harness with the tests' defaults, in every mode of ``SERVER_MODES``
("single" runs on a thread of the test process)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from batchgate.bench.harness.server import RunningServer, start_in_thread, start_process

SERVER_MODES = ("single", "native")


def native_or_skip() -> None:
    """Skip the test, saying why, when the native front end is not built; fail instead where
    it must be ($BATCHGATE_REQUIRE_NATIVE, which CI sets: a broken build must not pass)."""
    from batchgate.server.supervisor import native_binary as native

    reason = native.unavailable_reason()
    if reason is None:
        return
    if os.environ.get("BATCHGATE_REQUIRE_NATIVE"):
        pytest.fail(f"$BATCHGATE_REQUIRE_NATIVE is set and {reason}")
    pytest.skip(reason)


def fast_mode() -> str:
    """The one server mode ``pytest --fast`` (``make test-fast``) runs: native where it is
    built, else single."""
    from batchgate.server.supervisor import native_binary as native

    return "native" if native.unavailable_reason() is None else "single"


def start_server(repository: Path, gate=None, **overrides) -> RunningServer:
    """A single-process server on a thread of this process; ``overrides``: ``Settings`` fields."""
    running = start_in_thread(repository, **overrides)
    running.gate = gate
    return running


def start_multiprocess_server(repository: Path, gate=None, extra_args: tuple[str, ...] = (),
                              env: dict[str, str] | None = None) -> RunningServer:
    """The supervisor with an executor process and the native front end; ``extra_args``:
    further ``serve`` flags; ``env``: the server's whole environment. ``stop()`` fails unless
    it exits 0."""
    native_or_skip()
    # The supervisor runs apart from the test process on purpose: it forks its children, and a
    # fork of a process whose threads are inside gRPC (the tests' clients) is not safe.
    running = start_process(
        repository, "native", env=env,
        extra_args=("--arena-bytes", str(256 << 20), "--drain-timeout-s", "10",
                    "--no-gc-freeze", *extra_args))
    running.gate = gate
    return running


def start_in_mode(mode: str, repository: Path, gate=None, **overrides) -> RunningServer:
    """A server of ``mode`` (SERVER_MODES). ``overrides``: settings of the single-process
    server (``Settings`` fields), or ``extra_args``/``env`` of the native one."""
    if mode == "single":
        return start_server(repository, gate, **overrides)
    return start_multiprocess_server(repository, gate, **overrides)


def threads(pid: int, read=lambda tid: None) -> dict[int, tuple[str, object]]:
    """tid -> (name, ``read(tid)``) of every thread of ``pid`` (``read``: e.g.
    ``os.sched_getscheduler``), skipping a thread that ends while it is read."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found[int(task.name)] = ((task / "comm").read_text().strip(), read(int(task.name)))
        except (FileNotFoundError, ProcessLookupError):
            pass
    return found
