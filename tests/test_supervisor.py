"""The supervisor of ``batchgate serve --frontend native``, with stand-in children.

The stand-in (``STANDIN`` below, written to a temporary folder) speaks the children's protocol:
it parses exactly the command line the real executor / front end get, checks the arena
descriptor, writes metrics the way the Python executor does (prometheus_client multiprocess
mode), binds the reserved gRPC port with SO_REUSEPORT when it is the front end, prints its ``*_ready`` JSON line,
and waits for SIGTERM. Files beside it change its behaviour: ``crash-<role>`` (exit 3 at once),
``linger-<role>`` (seconds to wait after SIGTERM). Every line it prints carries ``time.monotonic()``
(one clock for all processes), so the tests check ordering across processes from the log.

The last test runs the real executor and the native front end.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from batchgate.protos import handover_pb2
from batchgate.server.frontend.app import Settings
from batchgate.server.config.settings import TOKEN_ENV, fields_for
from batchgate.server.metrics import ServerMetrics
from batchgate.server.supervisor.multiproc_metrics import PREFIX, remove_abandoned
from batchgate.server.supervisor.supervisor import RestartPolicy, Supervisor, SupervisorError
from batchgate.bench.harness.metrics import Samples, metrics_url
from batchgate.bench.harness.metrics import scrape as scrape_url
from tests.support.polling import poll
from tests.support.regions import servers_leftovers
from tests.support.servers import native_or_skip

ROOT = Path(__file__).resolve().parent.parent

STANDIN = textwrap.dedent('''
    import json, os, signal, socket, sys, time
    from pathlib import Path

    sys.path.insert(0, {root!r})
    HERE = Path(__file__).parent
    ROLE = sys.argv[1]
    signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGTERM}})

    LEVELS = {{"debug": 10, "info": 20, "warning": 30, "error": 40}}
    if ROLE == "frontend":  # the native front end's handover: protos/handover.proto
        from google.protobuf.json_format import MessageToDict
        from batchgate.protos import handover_pb2
        message = handover_pb2.FrontendHandover.FromString(sys.stdin.buffer.read())
        handover = MessageToDict(message, preserving_proto_field_name=True,
                                 always_print_fields_with_no_presence=True)
        handover.update(role=ROLE, arena_fd=message.arena_fd, arena_bytes=message.arena_bytes,
                        grpc_port=message.grpc_port, slot=message.slot)
    else:
        handover = json.load(sys.stdin)
    settings = handover["settings"]

    def say(event, level="info", **fields):
        if LEVELS[level] < LEVELS[settings["log_level"]]:
            return
        line = dict(event=event, level=level, role=ROLE, pid=os.getpid(), t=time.monotonic(),
                    **fields)
        sys.stderr.write(json.dumps(line) + "\\n")
        sys.stderr.flush()

    assert handover["role"] == ROLE
    arena_fd = handover["arena_fd"]
    say("standin_started")
    say("standin_warning", level="warning")
    if (HERE / f"crash-{{ROLE}}").exists():
        say("standin_crashing")
        sys.exit(3)
    assert os.fstat(arena_fd).st_size == handover["arena_bytes"]

    from batchgate.server.metrics import ServerMetrics
    metrics = ServerMetrics()
    if ROLE == "frontend":
        metrics.requests.labels("standin", "OK").inc()
        metrics.request_seconds.labels("standin").observe(0.01)
    else:
        b = metrics.batcher
        b.queue_seconds.labels("standin").observe(0.001)
        b.compute_seconds.labels("standin").observe(0.002)
        b.batch_size.labels("standin").observe(4)
        b.batches.labels("standin", "full").inc()
        b.failures.labels("standin", "rejected").inc()
        b.inflight_batches.labels("standin").set(1)
    metrics.batcher.queue_depth.labels("standin").set(1)

    listener = None
    if ROLE == "frontend":
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        listener.bind((settings["host"], handover["grpc_port"]))
        listener.listen()
    sys.stderr.write(f"a plain line from {{ROLE}} {{os.getpid()}}\\n")
    fds = [os.readlink(f"/proc/self/fd/{{fd}}") for fd in os.listdir("/proc/self/fd")
           if os.path.exists(f"/proc/self/fd/{{fd}}")]
    say(f"{{ROLE}}_ready", slot=handover.get("slot"), grpc_port=handover.get("grpc_port"),
        models=["standin"], arena=os.readlink(f"/proc/self/fd/{{arena_fd}}"), fds=fds,
        settings=sorted(settings), environ=sorted(os.environ),
        extensions=handover.get("extensions"),
        cuda_shared_memory=(HERE / "cuda-executor").exists())
    signal.sigwait({{signal.SIGTERM}})
    say("standin_sigterm")
    linger = HERE / f"linger-{{ROLE}}"
    if linger.exists():
        time.sleep(float(linger.read_text()))
    say("standin_exit")
''')

# The supervisor as the CLI runs it, in its own process, with stand-in children.
DRIVER = textwrap.dedent('''
    import json, sys
    from pathlib import Path

    sys.path.insert(0, {root!r})
    from batchgate.server.logs import configure_logging
    from batchgate.server.config.settings import Settings
    from batchgate.server.supervisor.supervisor import RestartPolicy, Supervisor

    configure_logging("info", "json")
    print(json.dumps(dict(event="driver_modules", torch="torch" in sys.modules,
                          grpc="grpc" in sys.modules)), file=sys.stderr, flush=True)
    here = Path(__file__).parent
    settings = Settings(
        host="127.0.0.1", grpc_port=0, metrics_port=0, model_repository=here,
        max_message_bytes=1 << 20, drain_timeout_s=float(sys.argv[1]), switch_interval_s=0.0005,
        device_pool_bytes=1 << 20, device_pool_fraction=None, device_pool_strict=True,
        arena_bytes=1 << 20, log_format="json")
    supervisor = Supervisor(
        settings,
        executor_command=[sys.executable, str(here / "standin.py"), "executor"],
        frontend_command=[sys.executable, str(here / "standin.py"), "frontend"],
        restart_policy=RestartPolicy(backoff_s=0.05, max_backoff_s=0.2, max_crashes=3),
        ready_timeout_s=20)
    sys.exit(supervisor.run())
''')


class LogSink:
    """The supervisor's log stream in tests: keeps the forwarded lines, wakes waiters."""

    def __init__(self) -> None:
        self.lines: list[bytes] = []
        self._changed = threading.Condition()

    def write(self, data: bytes) -> None:
        with self._changed:
            self.lines.append(data)
            self._changed.notify_all()

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def events(self) -> list[dict]:
        with self._changed:
            lines = list(self.lines)
        return [json.loads(line) for line in lines if line.startswith(b"{")]

    def wait_for(self, predicate, timeout_s: float = 15) -> list[dict]:
        with self._changed:
            ok = self._changed.wait_for(lambda: predicate(self.events()), timeout_s)
        assert ok, f"timed out; events: {[e.get('event') for e in self.events()]}"
        return self.events()


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def scrape(port: int) -> Samples:
    return scrape_url(metrics_url(port))


def standin_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "standin"
    folder.mkdir(exist_ok=True)
    (folder / "standin.py").write_text(STANDIN.format(root=str(ROOT)))
    return folder


@pytest.fixture
def make_supervisor(tmp_path, monkeypatch):
    made: list[Supervisor] = []
    # The metrics folders go under tmp_path, not the shared /tmp.
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))

    def make(*, drain_timeout_s: float = 5.0, log_level: str = "info",
             log_format: str = "json", policy: RestartPolicy | None = None,
             shared_memory: bool = False) -> tuple[Supervisor, LogSink]:
        folder = standin_dir(tmp_path)
        script = str(folder / "standin.py")
        settings = Settings(host="127.0.0.1", grpc_port=0, metrics_port=0,
                            model_repository=tmp_path, drain_timeout_s=drain_timeout_s,
                            arena_bytes=1 << 20, log_format=log_format, log_level=log_level,
                            admin_token="a" * 20, shared_memory=shared_memory)
        sink = LogSink()
        supervisor = Supervisor(
            settings, executor_command=[sys.executable, script, "executor"],
            frontend_command=[sys.executable, script, "frontend"],
            restart_policy=policy or RestartPolicy(backoff_s=0.05, max_backoff_s=0.2,
                                                   max_crashes=3),
            ready_timeout_s=20, log_stream=sink,
        )
        made.append(supervisor)
        return supervisor, sink

    yield make
    for supervisor in made:
        if supervisor.wait(0) is None:
            supervisor.stop(drain_timeout_s=1)


def pids(supervisor: Supervisor) -> dict:
    return {(c.role, c.slot): c.pid for c in supervisor.children()}


def ready_pids(supervisor: Supervisor) -> dict | None:
    children = supervisor.children()
    if all(c.ready for c in children):
        return {(c.role, c.slot): c.pid for c in children}
    return None


def test_starts_the_executor_first_then_the_front_end_and_forwards_their_lines(make_supervisor):
    shm_before = {n for n in servers_leftovers(os.listdir("/dev/shm")) if "batchgate" in n}
    supervisor, sink = make_supervisor()
    supervisor.start()
    assert supervisor.serving and supervisor.models == ["standin"]
    assert supervisor.grpc_port > 0 and supervisor.metrics_port > 0
    events = sink.events()
    executor_ready = next(e for e in events if e["event"] == "executor_ready")
    frontend_starts = [e["t"] for e in events
                       if e["event"] == "standin_started" and e["role"] == "frontend"]
    assert len(frontend_starts) == 1 and frontend_starts[0] > executor_ready["t"]
    ready = [e for e in events if e["event"] == "frontend_ready"]
    assert [e["slot"] for e in ready] == [0]
    assert {e["grpc_port"] for e in ready} == {supervisor.grpc_port}
    # Each child is handed exactly the settings its role acts on; the token travels only to
    # the front end, in the handover, never in an environment.
    assert executor_ready["settings"] == sorted(fields_for("executor"))
    assert "model_repository" in executor_ready["settings"]
    # The native front end's settings message carries what it acts on by name; the gRPC
    # connection policy and the wire limits travel in fields of their own.
    native_fields = sorted(f.name for f in handover_pb2.FrontendSettings.DESCRIPTOR.fields)
    assert set(native_fields) <= set(fields_for("frontend"))
    for event in ready:  # (a setting with presence that is None is not set)
        assert set(event["settings"]) <= set(native_fields)
        assert "admin_token" in event["settings"]
    for event in [executor_ready, *ready]:
        assert not set(event["environ"]) & set(TOKEN_ENV.values())
    # Lines are forwarded byte for byte, JSON or not.
    for child in supervisor.children():
        assert f"a plain line from {child.role} {child.pid}\n".encode() in sink.lines
    # The arena is a memfd: nothing under /dev/shm, in any child.
    for event in [executor_ready, *ready]:
        assert event["arena"].startswith("/memfd:")
        assert not [fd for fd in event["fds"] if fd.startswith("/dev/shm")]
    # The front end listens on the port the supervisor reserved; the reservation takes nothing.
    for _ in range(4):
        socket.create_connection(("127.0.0.1", supervisor.grpc_port), timeout=5).close()

    children = list(pids(supervisor).values())
    metrics_dir = supervisor.metrics_dir
    assert metrics_dir.is_dir()
    assert supervisor.stop() == 0
    assert not any(alive(pid) for pid in children)
    assert not metrics_dir.exists()
    assert {n for n in servers_leftovers(os.listdir("/dev/shm")) if "batchgate" in n} <= shm_before


@pytest.mark.parametrize("cuda", [False, True])
def test_the_front_end_lists_cuda_shared_memory_where_the_executor_can_map_cuda_regions(
        make_supervisor, tmp_path, cuda):
    # The stand-in executor's ready line says what a real one says of its device.
    if cuda:
        (standin_dir(tmp_path) / "cuda-executor").touch()
    supervisor, sink = make_supervisor(shared_memory=True)
    supervisor.start()
    [ready] = [e for e in sink.events() if e["event"] == "frontend_ready"]
    assert "system_shared_memory" in ready["extensions"]
    assert ("cuda_shared_memory" in ready["extensions"]) is cuda
    assert supervisor.stop() == 0


def test_one_scrape_sums_every_process_under_the_single_process_names(make_supervisor):
    # A long backoff leaves time to see the killed front end's gauge gone before its restart.
    supervisor, _sink = make_supervisor(policy=RestartPolicy(backoff_s=1.0, max_backoff_s=1.0))
    supervisor.start()
    samples = scrape(supervisor.metrics_port)
    model = (("model", "standin"),)
    assert samples[("batchgate_requests_total", (("model", "standin"), ("status", "OK")))] == 1
    assert samples[("batchgate_request_seconds_count", model)] == 1
    assert samples[("batchgate_queue_depth", model)] == 2  # livesum: executor + front end
    assert samples[("batchgate_batches_total", (("model", "standin"), ("reason", "full")))] == 1
    assert samples[("batchgate_child_restarts_total", (("role", "frontend"),))] == 0

    # The same metrics touched in one process: the same sample names, less ``_created``.
    single = ServerMetrics()
    single.requests.labels("standin", "OK").inc()
    single.request_seconds.labels("standin").observe(0.01)
    b = single.batcher
    for histogram in (b.queue_seconds, b.compute_seconds, b.batch_size):
        histogram.labels("standin").observe(1)
    b.batches.labels("standin", "full").inc()
    b.failures.labels("standin", "rejected").inc()
    b.inflight_batches.labels("standin").set(1)
    b.queue_depth.labels("standin").set(1)
    single_names = {s.name for f in text_string_to_metric_families(
        generate_latest(single.registry).decode()) for s in f.samples}
    multi_names = {name for name, _ in samples} - {"batchgate_child_restarts_total"}
    assert multi_names == {n for n in single_names if not n.endswith("_created")}

    before = pids(supervisor)
    os.kill(before[("frontend", 0)], signal.SIGKILL)
    poll(lambda: pids(supervisor)[("frontend", 0)] is None, what="the exit to be seen")
    samples = scrape(supervisor.metrics_port)
    assert samples[("batchgate_queue_depth", model)] == 1  # the dead process's gauge is gone
    assert samples[("batchgate_requests_total", (("model", "standin"), ("status", "OK")))] == 1
    after = poll(lambda: ready_pids(supervisor), what="the restart")
    assert after[("frontend", 0)] != before[("frontend", 0)]
    samples = scrape(supervisor.metrics_port)
    # Counters keep the dead process's counts: they never go backwards.
    assert samples[("batchgate_requests_total", (("model", "standin"), ("status", "OK")))] == 2
    assert samples[("batchgate_queue_depth", model)] == 2
    assert samples[("batchgate_child_restarts_total", (("role", "frontend"),))] == 1
    assert supervisor.stop() == 0


def test_a_killed_front_end_is_restarted_and_the_executor_left_alone(make_supervisor):
    supervisor, sink = make_supervisor()
    supervisor.start()
    before = pids(supervisor)
    os.kill(before[("frontend", 0)], signal.SIGKILL)
    after = poll(
        lambda: (p := ready_pids(supervisor)) and p[("frontend", 0)] != before[("frontend", 0)]
        and p, what="the front end to be restarted")
    assert after[("executor", None)] == before[("executor", None)]
    sink.wait_for(lambda events: any(
        e["event"] == "frontend_ready" and e["pid"] == after[("frontend", 0)] for e in events))
    assert not alive(before[("frontend", 0)])
    assert supervisor.serving
    assert supervisor.stop() == 0


def test_a_killed_executor_is_restarted_and_the_front_end_keeps_running(make_supervisor):
    supervisor, sink = make_supervisor()
    supervisor.start()
    before = pids(supervisor)
    os.kill(before[("executor", None)], signal.SIGKILL)
    after = poll(
        lambda: (p := ready_pids(supervisor)) and p[("executor", None)] != before[("executor", None)]
        and p, what="the executor to be restarted")
    assert after[("frontend", 0)] == before[("frontend", 0)]
    assert sum(e["event"] == "executor_ready" for e in sink.events()) == 2
    assert supervisor.stop() == 0


def test_gives_up_after_repeated_crashes_and_stops_the_rest(make_supervisor, tmp_path):
    supervisor, sink = make_supervisor()
    supervisor.start()
    before = pids(supervisor)
    (tmp_path / "standin" / "crash-frontend").write_text("")
    os.kill(before[("frontend", 0)], signal.SIGKILL)
    # 3 crashes (the kill, then two restarts that exit at once) within the window: give up.
    assert supervisor.wait(15) == 1
    assert sum(e["event"] == "standin_crashing" for e in sink.events()) == 2
    assert not any(alive(pid) for pid in before.values())
    assert not supervisor.metrics_dir.exists()


def test_a_child_failing_at_startup_fails_start_with_its_exit_code(make_supervisor, tmp_path):
    supervisor, _sink = make_supervisor()
    (tmp_path / "standin" / "crash-executor").write_text("")
    with pytest.raises(SupervisorError, match="executor process exited .exit code 3."):
        supervisor.start()
    assert supervisor.wait(0) == 1
    assert not supervisor.metrics_dir.exists()


def test_drain_kills_what_outlives_the_timeout(make_supervisor, tmp_path):
    supervisor, sink = make_supervisor()
    supervisor.start()
    (tmp_path / "standin" / "linger-frontend").write_text("60")
    frontend = pids(supervisor)[("frontend", 0)]
    started = time.monotonic()
    assert supervisor.stop(drain_timeout_s=0.5) == 0
    assert time.monotonic() - started < 10
    assert not alive(frontend)
    events = sink.events()
    assert not any(e["event"] == "standin_exit" and e["role"] == "frontend" for e in events)
    assert any(e["event"] == "standin_exit" and e["role"] == "executor" for e in events)


def test_children_log_their_ready_lines_whatever_the_level_asked(make_supervisor):
    supervisor, sink = make_supervisor(log_level="warning")
    supervisor.start()
    assert supervisor.serving
    events = sink.events()
    assert events and {e["level"] for e in events} == {"warning"}
    assert sorted(e["role"] for e in events) == ["executor", "frontend"]
    assert any(line.startswith(b"a plain line") for line in sink.lines)
    assert supervisor.stop() == 0


def test_console_format_renders_the_children_json_lines(make_supervisor):
    supervisor, sink = make_supervisor(log_format="console")
    supervisor.start()
    assert supervisor.stop() == 0
    ready = [line.decode() for line in sink.lines if b"frontend_ready" in line]
    assert len(ready) == 1 and not ready[0].startswith("{") and "grpc_port=" in ready[0]


def test_metrics_folders_of_dead_supervisors_are_removed_and_live_ones_kept(tmp_path):
    import fcntl

    dead, live, young = (tmp_path / f"{PREFIX}{name}" for name in ("dead", "live", "young"))
    for folder in (dead, live, young):
        folder.mkdir()
        (folder / "counter_1.db").write_bytes(b"")
    for folder in (dead, live):
        os.utime(folder, (time.time() - 3600, time.time() - 3600))
    held = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        assert remove_abandoned(tmp_path) == [dead]
    finally:
        os.close(held)
    assert not dead.exists() and live.exists() and young.exists()


class DriverProcess:
    """The supervisor's own process (``Supervisor.run``), stand-in children, its stderr parsed."""

    def __init__(self, tmp_path: Path, drain_timeout_s: float = 5.0) -> None:
        folder = standin_dir(tmp_path)
        (folder / "driver.py").write_text(DRIVER.format(root=str(ROOT)))
        self.tmpdir = tmp_path / "tmpdir"
        self.tmpdir.mkdir()
        self.proc = subprocess.Popen(
            [sys.executable, str(folder / "driver.py"), str(drain_timeout_s)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            env={**os.environ, "TMPDIR": str(self.tmpdir)},
        )
        self.sink = LogSink()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.sink.write(line)

    def event(self, name: str) -> dict:
        events = self.sink.wait_for(
            lambda evs: any(e["event"] == name for e in evs) or self.proc.poll() is not None)
        match = [e for e in events if e["event"] == name]
        assert match, f"no {name!r}; got {[e['event'] for e in events]}"
        return match[0]

    def child_pids(self) -> list[int]:
        return [e["pid"] for e in self.sink.events() if e["event"] == "child_started"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for pid in self.child_pids():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_sigterm_drains_the_front_end_before_the_executor_and_exits_0(tmp_path):
    driver = DriverProcess(tmp_path)
    try:
        modules = driver.event("driver_modules")
        assert not modules["torch"] and not modules["grpc"]
        serving = driver.event("serving")
        listening = driver.event("listening")
        assert serving["models"] == ["standin"] and serving["mode"] == "native"
        assert serving["grpc_port"] == listening["grpc_port"] > 0
        assert serving["metrics_port"] == listening["metrics_port"] > 0
        assert list(driver.tmpdir.iterdir())  # the metrics folder
        driver.proc.send_signal(signal.SIGTERM)
        assert driver.proc.wait(30) == 0
        driver._reader.join(10)
        events = driver.sink.events()
        names = [e["event"] for e in events]
        assert names.index("draining") < names.index("stopped")
        front_exits = [e["t"] for e in events
                       if e["event"] == "standin_exit" and e["role"] == "frontend"]
        executor_term = [e["t"] for e in events
                         if e["event"] == "standin_sigterm" and e["role"] == "executor"]
        assert len(front_exits) == 1 and len(executor_term) == 1
        assert front_exits[0] < executor_term[0]
        assert sum(e["event"] == "child_stopped" for e in events) == 2
        assert not any(e["event"] == "child_exited" for e in events)
        assert not list(driver.tmpdir.iterdir())  # the metrics folder is gone
    finally:
        driver.close()


def test_a_killed_supervisor_takes_its_children_along(tmp_path):
    driver = DriverProcess(tmp_path)
    try:
        driver.event("serving")
        children = driver.child_pids()
        assert len(children) == 2 and all(alive(pid) for pid in children)
        driver.proc.kill()
        driver.proc.wait(10)
        poll(lambda: not any(alive(pid) for pid in children), 10,
                   "the children to die with the supervisor")
    finally:
        driver.close()


def test_a_crash_loop_makes_the_supervisor_exit_1_with_the_reason(tmp_path):
    driver = DriverProcess(tmp_path)
    try:
        driver.event("serving")
        (tmp_path / "standin" / "crash-executor").write_text("")
        executor = next(e["pid"] for e in driver.sink.events()
                        if e["event"] == "child_started" and e["role"] == "executor")
        os.kill(executor, signal.SIGKILL)
        assert driver.proc.wait(30) == 1
        driver._reader.join(10)
        exited = [e for e in driver.sink.events() if e["event"] == "child_exited"]
        assert exited[0] == {**exited[0], "role": "executor", "pid": executor, "signal": "SIGKILL"}
        assert exited[1]["exit_code"] == 3
        giving_up = driver.event("giving_up")
        assert giving_up["role"] == "executor" and "3 times" in giving_up["error"]
        assert not any(alive(pid) for pid in driver.child_pids())
        assert not list(driver.tmpdir.iterdir())
    finally:
        driver.close()


@pytest.mark.parametrize("args, message", [
    (["--frontends", "-1"], "--frontends was removed"),
    (["--frontend", "native", "--arena-bytes", "4096"], "got size_bytes 4096"),
])
def test_cli_refuses_bad_process_settings(args, message):
    if "native" in args:
        native_or_skip()
    done = subprocess.run([sys.executable, "-m", "batchgate.server.cli", "serve", *args],
                          check=False, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert message in done.stderr


@pytest.mark.slow
def test_serve_with_the_native_front_end_end_to_end(tmp_path):
    native_or_skip()
    import grpc
    import numpy as np

    from batchgate.protos import inference_pb2 as pb
    from batchgate.protos import inference_pb2_grpc

    proc = subprocess.Popen(
        [sys.executable, "-m", "batchgate.server.cli", "serve", "--frontend", "native", "--host", "127.0.0.1",
         "--grpc-port", "0", "--metrics-port", "0", "--log-format", "json",
         "--arena-bytes", str(64 << 20)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env={**os.environ, "TMPDIR": str(tmp_path)})
    sink = LogSink()
    reader = threading.Thread(target=lambda: [sink.write(line) for line in proc.stderr],
                              daemon=True)
    reader.start()
    try:
        # The supervisor's own ``serving`` line names the mode (children's lines carry a role).
        def supervisor_serving(evs):
            return [e for e in evs if e.get("event") == "serving" and "role" not in e]

        events = sink.wait_for(lambda evs: supervisor_serving(evs) or proc.poll() is not None,
                               timeout_s=120)
        serving = supervisor_serving(events)[0]
        assert set(serving["models"]) >= {"mlp", "cnn", "encoder"}
        with grpc.insecure_channel(f"127.0.0.1:{serving['grpc_port']}") as channel:
            stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
            for _ in range(4):
                req = pb.ModelInferRequest(model_name="cnn")
                req.inputs.add(name="INPUT__0", datatype="FP32", shape=[1, 3, 32, 32])
                req.raw_input_contents.append(np.zeros((1, 3, 32, 32), np.float32).tobytes())
                assert list(stub.ModelInfer(req).outputs[0].shape) == [1, 10]
        samples = scrape(serving["metrics_port"])
        assert samples[("batchgate_requests_total", (("model", "cnn"), ("status", "OK")))] == 4
        assert samples[("batchgate_batch_size_count", (("model", "cnn"),))] >= 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
