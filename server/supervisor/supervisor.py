"""The supervisor of a multi-process server: one executor process and the native front end.

``--frontend native``: the front end is one C++ process using every core (``server/native/``).
The supervisor is a thin parent that imports neither torch nor grpc. It owns the shared arena
(a memfd, handed to each child by descriptor), reserves the gRPC port so that the front end,
restarted, binds the same one (SO_REUSEPORT), starts the executor and waits for its
``executor_ready`` line, then the front end and its ``frontend_ready`` line, and serves one
``/metrics`` for both (``server/supervisor/multiproc_metrics.py``). Children log JSON lines on stderr; a thread per child forwards
each line to the supervisor's stderr as it comes, so the server's log stays one stream
(``server/supervisor/child_logs.py``).

Each child gets what it needs on its standard input (``server/supervisor/handover.py``): its
place (arena, sockets, the reserved port; an executor, the pid of the front end alive, whose
reads of the arena it must let end) and the settings it acts on, resolved here once
(``Settings.handover``). No child parses flags, and none is handed a setting it does
not act on. Bearer tokens travel only to the front end, this way: never on a command line, which
``ps`` shows to every user, nor in an environment another process could inherit.

A child that exits while serving is started again with the same command line after a backoff
that doubles with each crash; one child crashing ``RestartPolicy.max_crashes`` times within
``window_s`` makes the supervisor give up: it drains the others and exits 1. SIGTERM or SIGINT
drains: the front end first (it goes NOT_SERVING, refuses new requests, finishes in-flight
ones), then the executor; whatever outlives its time is killed.

Children run in their own session, so a terminal's Ctrl-C reaches only the supervisor, which
then stops them in order. Each has PR_SET_PDEATHSIG=SIGKILL, so a supervisor that is killed takes
its children along. The kernel sends that signal when the *thread* that forked the child exits,
which is why one supervisor thread spawns every child and outlives them all
(``server/supervisor/posix.py`` holds those POSIX pieces).
"""

from __future__ import annotations

import functools
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, BinaryIO

import structlog

from batchgate.server.ipc.arena import ArenaLayout, SharedArena
from batchgate.server import server_extensions
from batchgate.server.supervisor import native_binary as native
from batchgate.server.supervisor.child_logs import ChildLogs
from batchgate.server.supervisor.children import Child, ChildInfo, RestartPolicy
from batchgate.server.supervisor.handover import executor_handover, frontend_handover
from batchgate.server.frontend.drain import GOAWAY_PROPAGATION_S, LAST_ANSWERS_S
from batchgate.server.supervisor.multiproc_metrics import MultiProcessMetrics
from batchgate.server.supervisor.posix import describe_exit, die_with_parent, exit_fields, hand_over, reserve_port
from batchgate.server.config.settings import EXECUTOR, FRONTEND, TOKEN_ENV

if TYPE_CHECKING:
    from batchgate.server.config.settings import Settings

log = structlog.get_logger(__name__)

EXECUTOR_COMMAND = (sys.executable, "-m", "batchgate.server.executor.process")
# The one front end's arena slot: the wire and the arena name front ends by slot.
FRONTEND_SLOT = 0
# How long an exited child's last log lines may take to be forwarded (a grandchild that
# inherited its stderr could hold the pipe open for ever).
LAST_LINES_S = 2.0
# The executor's share of a drain whose front end used up the whole timeout: enough to close.
EXECUTOR_MIN_GRACE_S = 5.0
# The front end's drain ends with gRPC's shutdown, after the timeout for requests in flight: the
# GOAWAY's way to the clients, then the last answers (as server/frontend/drain.py's).
FRONTEND_SHUTDOWN_S = GOAWAY_PROPAGATION_S + LAST_ANSWERS_S



class SupervisorError(RuntimeError):
    """The server could not start: a child failed before it was ready."""


class _StartupFailed(Exception):
    pass


class Supervisor:
    """Runs the executor and the native front end; ``start()``, then ``stop()`` or ``run()``.

    ``executor_command`` and ``frontend_command`` are the children's command lines (tests pass
    stand-in scripts); the front end's defaults to the native binary.
    ``log_stream`` is the binary stream child log lines are forwarded to (default: this
    process's stderr).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        executor_command: Sequence[str] = EXECUTOR_COMMAND,
        frontend_command: Sequence[str] | None = None,
        restart_policy: RestartPolicy | None = None,
        ready_timeout_s: float = 300.0,
        log_stream: BinaryIO | None = None,
    ) -> None:
        ArenaLayout(settings.arena_size, 1)  # refuses an arena too small for its regions
        if ready_timeout_s <= 0:
            raise ValueError(f"ready_timeout_s must be > 0, got {ready_timeout_s}")
        log_level = settings.log_level
        self._logs = ChildLogs(log_level, settings.log_format, log_stream)
        self.settings = settings
        self.arena_bytes = settings.arena_size
        self.log_level = log_level
        self.log_format = settings.log_format
        self.executor_command = list(executor_command)
        if frontend_command is None:
            frontend_command = [str(native.binary())]
        self.frontend_command = list(frontend_command)
        self.policy = restart_policy if restart_policy is not None else RestartPolicy()
        self.ready_timeout_s = ready_timeout_s
        self.grpc_port = 0
        self.metrics_port: int | None = None
        self.metrics_dir = None
        self.socket_name = f"batchgate-{os.getpid()}-{secrets.token_hex(4)}"
        self.models: list[str] = []
        # Whether the executor can map clients' CUDA regions (its ready line says): the front
        # end then lists cuda_shared_memory. It starts after the executor is ready, and every
        # restart of the executor says again.
        self.cuda_shared_memory = False
        self.serving = False
        self.exit_code: int | None = None

        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._children: list[Child] = []
        self._restarts = {"executor": 0, "frontend": 0}
        self._phase = "idle"
        self._stop_requested = False
        self._drain_timeout_s = settings.drain_timeout_s
        self._gave_up = False
        self._failure: str | None = None
        self._started = threading.Event()
        self._thread: threading.Thread | None = None
        self._arena: SharedArena | None = None
        self._port_reservation: socket.socket | None = None
        self._metrics: MultiProcessMetrics | None = None
        self._env: dict[str, str] = {}

    # -- the public surface ---------------------------------------------------------------

    def start(self) -> None:
        """Bind the ports, start every child, return once all are ready.

        Raises ``SupervisorError`` (after stopping whatever had started) when a child exits or
        stays unready past ``ready_timeout_s``; ``OSError`` when a port cannot be bound.
        """
        if self._thread is not None:
            raise RuntimeError("the supervisor was already started")
        self._logs.open()
        s = self.settings
        try:
            self._arena = SharedArena.create(self.arena_bytes)
            self._port_reservation = reserve_port(s.host, s.grpc_port)
            self.grpc_port = self._port_reservation.getsockname()[1]
            self._metrics = MultiProcessMetrics(restarts=lambda: dict(self._restarts))
            self.metrics_dir = self._metrics.path
            if s.metrics_port is not None:
                self.metrics_port = self._metrics.serve_http(s.host, s.metrics_port)
        except BaseException:
            self._release()
            self.exit_code = 1
            raise
        self._metrics.add_native_sources([self._metrics_socket(FRONTEND_SLOT)])
        # Tokens reach the front end in its handover only.
        self._env = {k: v for k, v in {**os.environ, **self._metrics.child_env()}.items()
                     if k not in TOKEN_ENV.values()}
        self._children = [Child("executor", None, self.executor_command,
                                 self._handover_of_executor)]
        self._children.append(Child("frontend", FRONTEND_SLOT, self.frontend_command,
                                     functools.partial(self._handover_of_frontend, FRONTEND_SLOT)))
        self._thread = threading.Thread(target=self._supervise, name="batchgate-supervisor",
                                        daemon=True)
        self._thread.start()
        self._started.wait()
        if self._failure is not None:
            self.wait()
            raise SupervisorError(self._failure)

    def request_stop(self, drain_timeout_s: float | None = None) -> None:
        """Ask for a drain; returns at once. Safe from a signal handler."""
        self._events.put(("stop", drain_timeout_s))

    def stop(self, drain_timeout_s: float | None = None) -> int:
        """Drain (the front end, then the executor) and return the exit code."""
        self.request_stop(drain_timeout_s)
        return self.wait()

    def wait(self, timeout_s: float | None = None) -> int | None:
        """Wait until every child is gone and everything is released: the exit code, or None
        when ``timeout_s`` passed first."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                return None
        return 1 if self.exit_code is None else self.exit_code

    def run(self) -> int:
        """The CLI's entry: start, serve until SIGTERM/SIGINT or giving up, drain; exit code."""
        def on_signal(signum, frame) -> None:
            self.request_stop()

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            try:
                self.start()
            except (SupervisorError, OSError) as exc:
                log.error("supervisor_failed", error=str(exc))
                return 1
            return self.wait()
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)

    def children(self) -> list[ChildInfo]:
        return [ChildInfo(c.role, c.slot, c.proc.pid if c.proc else None, c.ready, c.starts)
                for c in self._children]

    # -- the supervisor thread ---------------------------------------------------------------

    def _supervise(self) -> None:
        try:
            self._phase = "starting"
            try:
                self._start_children()
            except _StartupFailed as exc:
                self._failure = str(exc)
                self.exit_code = 1
            if self._failure is None and not self._stop_requested:
                self._phase = "serving"
                self.serving = True
                log.info("listening", grpc_port=self.grpc_port, metrics_port=self.metrics_port,
                         model_repository=str(self.settings.model_repository),
                         **self.settings.security())
                log.info("serving", models=self.models, grpc_port=self.grpc_port,
                         metrics_port=self.metrics_port, mode="native")
            self._started.set()
            if self.serving:
                self._serve()
            self._phase = "draining"
            self._drain()
        except BaseException as exc:
            log.exception("supervisor_crashed")
            self.exit_code = 1
            if not self._started.is_set():
                self._failure = f"the supervisor failed while starting: {exc!r}"
        finally:
            self._kill_all()
            self._release()
            self.serving = False
            if self.exit_code is None:
                self.exit_code = 0
            self._started.set()
            log.info("stopped", exit_code=self.exit_code)

    def _start_children(self) -> None:
        executor, frontend = self._children
        self._spawn(executor)
        self._wait_until(lambda: executor.ready, "the executor")
        self._spawn(frontend)
        self._wait_until(lambda: frontend.ready, "the front end")

    def _wait_until(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while not done() and not self._stop_requested:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _StartupFailed(f"{what} did not report ready within {self.ready_timeout_s} s")
            try:
                event = self._events.get(timeout=remaining)
            except queue.Empty:
                continue
            self._handle(event)

    def _serve(self) -> None:
        while not self._stop_requested and not self._gave_up:
            try:
                event = self._events.get(timeout=self._next_timer_s())
            except queue.Empty:
                event = None
            if event is not None:
                self._handle(event)
            self._run_timers()

    def _next_timer_s(self) -> float | None:
        times = [c.restart_at for c in self._children
                 if c.proc is None and c.restart_at is not None]
        times += [c.ready_deadline for c in self._children
                  if c.proc is not None and c.ready_deadline is not None]
        return max(0.0, min(times) - time.monotonic()) if times else None

    def _run_timers(self) -> None:
        now = time.monotonic()
        for child in self._children:
            if child.proc is None and child.restart_at is not None and child.restart_at <= now:
                child.restart_at = None
                self._spawn(child)
            elif child.proc is not None and child.ready_deadline is not None \
                    and child.ready_deadline <= now:
                # A restarted child that never becomes ready counts as a crash.
                child.ready_deadline = None
                log.error("child_not_ready", **child.fields(), ready_timeout_s=self.ready_timeout_s)
                child.proc.kill()

    def _handle(self, event: tuple) -> None:
        kind = event[0]
        if kind == "stop":
            self._stop_requested = True
            if event[1] is not None:
                self._drain_timeout_s = event[1]
        elif kind == "ready":
            _, child, proc, info = event
            if child.proc is proc:
                child.ready = True
                child.ready_deadline = None
                if child.role == "executor":
                    self.models = list(info.get("models") or [])
                    self.cuda_shared_memory = bool(info.get("cuda_shared_memory"))
                else:
                    self._metrics.native_process(self._metrics_socket(child.slot), proc.pid)
        elif kind == "exit":
            _, child, proc, returncode = event
            if child.proc is not proc:
                return
            self._metrics.process_dead(proc.pid)
            child.proc = None
            child.ready = False
            child.ready_deadline = None
            how = exit_fields(returncode)
            if self._phase == "draining":
                log.info("child_stopped", **child.fields(proc), **how)
                return
            log.error("child_exited", **child.fields(proc), **how)
            if self._phase == "starting":
                raise _StartupFailed(
                    f"the {child.name} process exited ({describe_exit(how)}) before it was ready; "
                    "its log is above"
                )
            self._crashed(child)

    def _crashed(self, child: Child) -> None:
        now = time.monotonic()
        child.crashes.append(now)
        while child.crashes and child.crashes[0] <= now - self.policy.window_s:
            child.crashes.popleft()
        if len(child.crashes) >= self.policy.max_crashes:
            log.error("giving_up", role=child.role, slot=child.slot, crashes=len(child.crashes),
                      window_s=self.policy.window_s,
                      error=f"the {child.name} process exited {len(child.crashes)} times within "
                            f"{self.policy.window_s} s; stopping the server")
            self._gave_up = True
            self.exit_code = 1
            return
        delay_s = self.policy.delay_s(len(child.crashes))
        child.restart_at = now + delay_s
        log.info("child_restarting", role=child.role, slot=child.slot, delay_s=delay_s)

    def _drain(self) -> None:
        timeout_s = self._drain_timeout_s
        log.info("draining", drain_timeout_s=timeout_s)
        for child in self._children:
            child.restart_at = None
        deadline = time.monotonic() + timeout_s
        self._terminate([c for c in self._children[1:] if c.proc is not None],
                        deadline + FRONTEND_SHUTDOWN_S)
        executor = self._children[0] if self._children else None
        if executor is not None and executor.proc is not None:
            grace_s = max(deadline - time.monotonic(), min(timeout_s, EXECUTOR_MIN_GRACE_S))
            self._terminate([executor], time.monotonic() + grace_s)

    def _terminate(self, children: list[Child], deadline: float) -> None:
        """SIGTERM ``children``, wait for them until ``deadline``, SIGKILL the rest."""
        for child in children:
            child.proc.send_signal(signal.SIGTERM)
        self._wait_for_exits(children, deadline)
        for child in children:
            if child.proc is not None:
                log.warning("child_killed", **child.fields(), reason="drain timeout")
                child.proc.kill()
        self._wait_for_exits(children, None)

    def _wait_for_exits(self, children: list[Child], deadline: float | None) -> None:
        while any(c.proc is not None for c in children):
            timeout = None if deadline is None else deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                return
            try:
                event = self._events.get(timeout=timeout)
            except queue.Empty:
                return
            if event[0] != "stop":  # already draining
                self._handle(event)

    def _kill_all(self) -> None:
        for child in self._children:
            proc = child.proc
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()

    def _release(self) -> None:
        if self._port_reservation is not None:
            self._port_reservation.close()
            self._port_reservation = None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    # -- children ------------------------------------------------------------------------

    def _handover_of_executor(self) -> bytes:
        # A restart: the front end alive now may still read the output blocks of the executor
        # before this one, which this one reuses; it welcomes it only once it is done
        # (wire.proto's Restarts).
        frontend_pids = {str(c.slot): c.proc.pid for c in self._children[1:]
                         if c.proc is not None and c.proc.poll() is None}
        return executor_handover(arena_fd=self._arena.fd, arena_bytes=self.arena_bytes,
                                 socket=self.socket_name, frontend_pids=frontend_pids,
                                 settings=self._settings_for(EXECUTOR))

    def _handover_of_frontend(self, slot: int) -> bytes:
        offset, size = ArenaLayout(self.arena_bytes, 1).input_region(slot)
        extensions = server_extensions(self.settings.shared_memory, cuda=self.cuda_shared_memory)
        return frontend_handover(
            self.settings, self._settings_for(FRONTEND), slot=slot, arena_fd=self._arena.fd,
            arena_bytes=self.arena_bytes, input_region=(offset, size),
            executor_socket=self.socket_name, metrics_socket=self._metrics_socket(slot),
            grpc_port=self.grpc_port, extensions=extensions).SerializeToString()

    def _settings_for(self, role: str) -> dict:
        values = self.settings.handover(role)
        # Children always log JSON at info at least: the supervisor reads their lines, drops
        # what is below the level asked for, and renders them for a terminal itself.
        values["log_level"] = self._logs.child_log_level
        return values

    def _metrics_socket(self, slot: int) -> str:
        return f"{self.socket_name}-metrics-{slot}"

    def _spawn(self, child: Child) -> None:
        try:
            proc = subprocess.Popen(
                child.argv, stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=self._env,
                pass_fds=(self._arena.fd,), start_new_session=True,
                # Between fork and exec this runs only prctl and getppid: no lock that another
                # thread could have held at fork time.
                preexec_fn=die_with_parent(os.getpid()),  # noqa: PLW1509
            )
            hand_over(proc, child.handover())
        except OSError as exc:
            log.error("child_start_failed", role=child.role, slot=child.slot, error=str(exc))
            if self._phase == "starting":
                raise _StartupFailed(f"could not start the {child.name} process: {exc}") from exc
            self._crashed(child)
            return
        if child.starts:
            self._restarts[child.role] += 1
        child.starts += 1
        child.proc = proc
        child.ready = False
        child.ready_deadline = time.monotonic() + self.ready_timeout_s
        log.info("child_started", **child.fields(), starts=child.starts)
        reader = threading.Thread(target=self._read, args=(child, proc), daemon=True,
                                  name=f"batchgate-log-{proc.pid}")
        reader.start()
        threading.Thread(target=self._reap, args=(child, proc, reader), daemon=True,
                         name=f"batchgate-wait-{proc.pid}").start()

    def _read(self, child: Child, proc: subprocess.Popen) -> None:
        self._logs.read(proc.stderr, f"{child.role}_ready",
                        lambda event: self._events.put(("ready", child, proc, event)))

    def _reap(self, child: Child, proc: subprocess.Popen, reader: threading.Thread) -> None:
        returncode = proc.wait()
        reader.join(LAST_LINES_S)
        self._events.put(("exit", child, proc, returncode))


