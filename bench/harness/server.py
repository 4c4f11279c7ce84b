"""The one server harness for tests and benchmarks: a batchgate server on port 0, in any mode.

- ``start_process(repository, mode)``: ``python -m batchgate.server.cli serve`` as its own process, in
  mode "native" (the supervisor, an executor process and the native front end), "single"
  (one process, ``--frontend single``) or "auto" (the server's own choice: no mode flags); its
  JSON log lines are parsed on a thread.
- ``start_in_thread(repository)``: ``batchgate.server.frontend.app.Gateway`` on a thread of this process, on its
  own event loop (settings overridable); what ``--frontend single`` runs, without a process.

Both return a ``RunningServer``: its ports, ``address`` (``host:port``, what the SDK and
tritonclient take), ``metrics_url``, ``pid`` (for ``/proc``), ``stop()`` (SIGTERM and a
timeout; the exit status), and, for a process, its log (``log_tail()``, included in every
error). ``ServeProcess`` is the bare process (any ``batchgate.server.cli`` arguments), for tests of the
command line itself.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import batchgate
from batchgate import _checkout
from batchgate.bench.harness.metrics import Samples, parse_samples, read_metrics, total

MODES = ("native", "single")
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0
# A checkout that is not installed imports batchgate from its root (the working directory of
# `python -m`): the server runs from there too. Installed, it finds batchgate wherever it is.
_PACKAGE = Path(batchgate.__file__).resolve().parent
SERVER_CWD = _PACKAGE.parent if _checkout.is_checkout(_PACKAGE) else None


class ServerError(RuntimeError):
    """The server did not start, or did not stop as it should; the message holds its log."""


def mode_args(mode: str) -> list[str]:
    """The ``serve`` flags that select ``mode`` (one of ``MODES``, or "auto": none)."""
    if mode == "auto":
        return []
    if mode in MODES:
        return ["--frontend", mode]
    raise ValueError(f"mode must be auto or one of {', '.join(MODES)}; got {mode!r}")


class ServeProcess:
    """``python -m batchgate.server.cli ARGS`` as its own process, its stderr read on a thread: every line
    (``lines``) and every JSON one parsed (``events``). Children's lines (multi-process mode)
    carry a ``role``; ``wait_for`` and ``pids`` tell them apart from the server's own."""

    def __init__(self, *args: str, env: dict[str, str] | None = None,
                 tail_lines: int = 200) -> None:
        self.command = [sys.executable, "-m", "batchgate.server.cli", *args]
        self.proc = subprocess.Popen(
            self.command, cwd=SERVER_CWD, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, env=env,
        )
        self.events: list[dict] = []
        self.lines: list[bytes] = []  # every line of stderr, JSON or not
        self._tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, name="server-stderr", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._changed:
                self.lines.append(line)
                self._tail.append(line.decode("utf-8", "replace").rstrip())
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if not isinstance(event, dict):
                continue
            with self._changed:
                self.events.append(event)
                self._changed.notify_all()
        # The end of stderr comes just before the exit: waiters are told once poll() sees it.
        self.proc.wait()
        with self._changed:
            self._changed.notify_all()

    def log_tail(self, lines: int = 20) -> str:
        with self._changed:
            return "\n".join(list(self._tail)[-lines:])

    def wait_for(self, name: str, timeout_s: float = START_TIMEOUT_S) -> dict:
        """The server's own first ``name`` event; ``ServerError`` (with the log) if it has not
        come within ``timeout_s`` or the process exited first."""
        def found():
            return [e for e in self.events if e.get("event") == name and "role" not in e]

        with self._changed:
            self._changed.wait_for(lambda: found() or self.proc.poll() is not None, timeout_s)
            match = found()
            seen = [e.get("event") for e in self.events]
        if not match:
            state = (f"it exited {self.proc.returncode}" if self.proc.poll() is not None
                     else f"not within {timeout_s:g} s")
            raise ServerError(f"no {name!r} event ({state}); events {seen}; log:\n"
                              f"{self.log_tail()}")
        return match[0]

    def pids(self, role: str) -> dict:
        """The latest ready process per slot of ``role`` ("executor" has slot None)."""
        event = f"{role}_ready"
        with self._changed:
            return {e.get("slot"): e["pid"] for e in self.events if e.get("event") == event}

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, then the exit status; killed (and its negative status returned) if it has
        not exited within ``timeout_s``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(5)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class RunningServer:
    """A server under test or benchmark, started by ``start_process`` or ``start_in_thread``.

    ``mode``: "native", "single" (``MODES``; an in-thread server is "single") or
    "auto" (a process in the mode the server chose).
    ``supervisor``: the ``ServeProcess`` (processes only); ``gateway``/``loop``/``thread``: the
    in-thread server's own."""

    def __init__(self, mode: str, grpc_port: int, metrics_port: int | None, *,
                 supervisor: ServeProcess | None = None, check_exit: bool = True) -> None:
        self.mode = mode
        self.grpc_port = grpc_port
        self.metrics_port = metrics_port
        self.supervisor = supervisor
        self.check_exit = check_exit
        self.gateway: Any = None  # thread only: batchgate.server.frontend.app.Gateway
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.gate: Any = None  # what a test attaches to drive its models
        self.exit_code: int | None = None

    @property
    def multiprocess(self) -> bool:
        """Whether it runs an executor process of its own (native mode)."""
        return self.supervisor is not None and bool(self.supervisor.pids("executor"))

    @property
    def in_thread(self) -> bool:
        return self.supervisor is None

    @property
    def address(self) -> str:
        """``127.0.0.1:PORT``: the SDK's address and tritonclient's ``url``."""
        return f"127.0.0.1:{self.grpc_port}"

    url = address

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def pid(self) -> int:
        """The server's process (the supervisor's, in multi-process mode): for ``/proc``."""
        return self.supervisor.pid if self.supervisor is not None else os.getpid()

    @property
    def command(self) -> list[str]:
        return list(self.supervisor.command) if self.supervisor is not None else []

    def log_tail(self, lines: int = 20) -> str:
        return self.supervisor.log_tail(lines) if self.supervisor is not None else ""

    def call(self, coroutine, timeout_s: float = 60):
        """Run ``coroutine`` on the in-thread server's loop."""
        assert self.loop is not None, "call() needs a server started by start_in_thread"
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def metrics_text(self) -> str:
        return read_metrics(self.metrics_url)

    def samples(self) -> Samples:
        """Every sample of its ``/metrics``: (name, sorted labels) -> value."""
        return parse_samples(self.metrics_text())

    def metric(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels``."""
        return total(self.samples(), name, **labels)

    def queue_depth(self, model: str) -> float:
        return self.metric("batchgate_queue_depth", model=model)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """Stop it (a process: SIGTERM, killed after ``timeout_s``) and return the exit status
        (0 for a thread); with ``check_exit``, ``ServerError`` unless that is 0. Idempotent."""
        if self.exit_code is None:
            self.exit_code = self._stop(timeout_s)
            if self.check_exit and self.exit_code != 0:
                raise ServerError(f"the {self.mode} server exited {self.exit_code}; log:\n"
                                  f"{self.log_tail()}")
        return self.exit_code

    def _stop(self, timeout_s: float) -> int:
        if self.supervisor is not None:
            return self.supervisor.stop(timeout_s)
        loop, gateway = self.loop, self.gateway
        if loop is not None and loop.is_running():
            asyncio.run_coroutine_threadsafe(
                gateway.stop(drain_timeout_s=min(5.0, timeout_s)), loop).result(timeout_s)
            loop.call_soon_threadsafe(loop.stop)
        if self.thread is not None:
            self.thread.join(timeout_s)
        return 0

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is not None and self.supervisor is not None:
            self.check_exit = False  # the first error is the one to see
        self.stop()


def start_process(repository: Path, mode: str = "auto", *, extra_args: Sequence[str] = (), env: dict[str, str] | None = None,
                  models: Sequence[str] = (), timeout_s: float = START_TIMEOUT_S,
                  check_exit: bool = True) -> RunningServer:
    """``batchgate serve`` of ``repository`` in ``mode`` (``MODES`` or "auto") on loopback, port
    0 for gRPC and metrics, JSON logs; ``extra_args``: further ``serve`` flags (later ones win);
    ``env``: its whole environment (default: this process's). Returns once it logged
    ``serving`` (``ServerError`` with its log otherwise, the process killed), with ``models``
    among those it serves. ``check_exit``: whether ``stop()`` raises unless it exits 0."""
    process = ServeProcess(
        "serve", *mode_args(mode), "--host", "127.0.0.1", "--grpc-port", "0",
        "--metrics-port", "0", "--log-format", "json", "--model-repository", str(repository),
        *extra_args, env=env)
    try:
        deadline = time.monotonic() + timeout_s
        listening = process.wait_for("listening", timeout_s)
        serving = process.wait_for("serving", max(0.0, deadline - time.monotonic()))
        missing = sorted(set(models) - set(serving.get("models", [])))
        if missing:
            raise ServerError(f"the server is serving without {missing}; log:\n"
                              f"{process.log_tail()}")
    except BaseException:
        process.kill()
        raise
    return RunningServer(mode, int(listening["grpc_port"]), listening.get("metrics_port"),
                         supervisor=process, check_exit=check_exit)


def start_in_thread(repository: Path, *, timeout_s: float = START_TIMEOUT_S,
                    **settings: Any) -> RunningServer:
    """``batchgate.server.frontend.app.Gateway`` of ``repository`` on a thread of this process, on loopback, port
    0; ``settings``: further ``batchgate.server.frontend.app.Settings`` fields (``metrics_port=None``: none).
    Returns once it serves; what it raised while starting is raised here."""
    from batchgate.server.frontend.app import Gateway, Settings

    config = Settings(**{"host": "127.0.0.1", "grpc_port": 0, "metrics_port": 0,
                         "model_repository": repository, "gc_freeze": False, **settings})
    started = threading.Event()
    box: dict[str, Any] = {}

    def run() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        box["loop"] = loop
        try:
            gateway = Gateway(config)
            box["gateway"] = gateway
            loop.run_until_complete(gateway.start())
        except BaseException as exc:  # raised by the caller below
            box["error"] = exc
            started.set()
            loop.close()
            return
        started.set()
        loop.run_forever()
        loop.close()

    thread = threading.Thread(target=run, name="batchgate-server", daemon=True)
    thread.start()
    if not started.wait(timeout_s):
        raise ServerError(f"the in-thread server did not start within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    gateway = box["gateway"]
    running = RunningServer("single", gateway.grpc_port, gateway.metrics_port)
    running.gateway, running.loop, running.thread = gateway, box["loop"], thread
    return running
