"""Metrics of a multi-process server: every child process writes, the supervisor sums per scrape.

prometheus_client's multiprocess mode: each child gets ``PROMETHEUS_MULTIPROC_DIR`` in its
environment, so the Counters, Histograms and Gauges it defines (``server/metrics.py``,
``batcher/metrics.py``, unchanged) keep their values in memory-mapped files named by pid in that
folder. The supervisor's ``/metrics`` runs ``MultiProcessCollector`` over the folder on each
scrape, so one scrape shows the whole server under the names single-process mode uses:

- counters and histograms are summed over every process that ever ran, so a restarted front
  end's counts do not go backwards (its old files stay; a new process that reuses a dead pid
  continues that file);
- gauges are summed over the live processes only (``multiprocess_mode="livesum"``): a dead
  process's queue is gone, and ``process_dead`` drops its gauge files.

What does not carry over from one process: there are no ``_created`` samples, and ``remove()``
of a labelled child warns and leaves the files alone, so an unloaded model's series stay in
scrapes with their last values (in single-process mode too: nothing removes them).

The native front end is not Python: it serves its own metrics as Prometheus text on an abstract
socket of its own (same-user peers only), which the scrape reads too (``add_native_sources``),
merging each family with the files' (samples with the same name and labels are summed). So that
its counters do not go backwards when it is restarted, the last values read from a front end
that died are carried over (``process_dead``); what it counted after the last scrape before it
died is lost.

The folder is removed when the supervisor stops. A supervisor that is killed cannot do that, so
each one holds an ``flock`` on its folder while it lives (the kernel drops it when the process
dies, however it dies), and a starting supervisor removes the folders nobody holds.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

from prometheus_client import CollectorRegistry, multiprocess, start_http_server, values
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from batchgate.batcher.telemetry import GpuTelemetry

ENV_VAR = "PROMETHEUS_MULTIPROC_DIR"
PREFIX = "batchgate-metrics-"
# A folder younger than this is left alone even when unlocked: its owner may not have locked it yet.
ABANDONED_AFTER_S = 60.0
# How long a scrape waits for a native front end's metrics.
NATIVE_TIMEOUT_S = 2.0


class MultiProcessMetrics:
    """The folder the children write their metrics to, and the endpoint that sums them."""

    def __init__(self, restarts: Callable[[], Mapping[str, int]] | None = None) -> None:
        """``restarts()`` gives the supervisor's restart count per child role, for a counter."""
        parent = Path(tempfile.gettempdir())
        remove_abandoned(parent)
        self.path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=parent))
        self._lock_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        self.registry = CollectorRegistry()
        self._native: list[_NativeSource] = []
        self.registry.register(_MergedCollector(
            multiprocess.MultiProcessCollector(None, path=str(self.path)), self._native))
        if restarts is not None:
            self.registry.register(_RestartCollector(restarts))
        self._httpd = None

    def child_env(self) -> dict[str, str]:
        """What to add to a child's environment so that its metrics land here."""
        return {ENV_VAR: str(self.path)}

    def add_native_sources(self, socket_names: Iterable[str]) -> None:
        """Read the native front ends' metrics from these abstract sockets on every scrape."""
        self._native.extend(_NativeSource(name) for name in socket_names)

    def process_dead(self, pid: int) -> None:
        """A child exited: its gauges stop counting; its counters and histograms stay."""
        multiprocess.mark_process_dead(pid, str(self.path))
        for source in self._native:
            source.retire(pid)

    def native_process(self, socket_name: str, pid: int) -> None:
        """The native front end serving ``socket_name`` now is process ``pid``."""
        for source in self._native:
            if source.name == socket_name:
                source.pid = pid

    def serve_http(self, host: str, port: int) -> int:
        """Start ``/metrics`` on a daemon thread; returns the port (the one chosen, for 0).
        The GPUs' NVML figures are read here, at scrape time, not from the children's files."""
        self.registry.register(GpuTelemetry())
        self._httpd, _thread = start_http_server(port, addr=host, registry=self.registry)
        return self._httpd.server_port

    def close(self) -> None:
        """Stop the endpoint and remove the folder. Idempotent."""
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        if self._lock_fd >= 0:
            shutil.rmtree(self.path, ignore_errors=True)
            os.close(self._lock_fd)
            self._lock_fd = -1


def read_pid_once() -> None:
    """Make this process's metric updates skip prometheus_client's per-update ``os.getpid()``.

    In multiprocess mode every ``inc``/``set``/``observe`` asks for the pid (a system call) to
    notice a fork: several system calls per request in the executor. Our children are started by
    exec, so the pid is read once here and again in a forked child. Call it before any metric is
    made (each keeps the value class it was made with)."""
    if ENV_VAR not in os.environ:
        return
    pid = [os.getpid()]
    os.register_at_fork(after_in_child=lambda: pid.__setitem__(0, os.getpid()))
    values.ValueClass = values.MultiProcessValue(process_identifier=lambda: pid[0])


def remove_abandoned(parent: Path, min_age_s: float = ABANDONED_AFTER_S) -> list[Path]:
    """Remove the metrics folders under ``parent`` whose supervisor died (nobody holds them)."""
    removed = []
    for path in parent.glob(PREFIX + "*"):
        try:
            if time.time() - path.stat().st_mtime < min_age_s:
                continue
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live supervisor's
        else:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


class _NativeSource:
    """One native front end's metrics socket; counters it served before it died carried over."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pid: int | None = None
        self._last: dict[tuple, tuple[Metric, float]] = {}  # counters and histograms
        self._carried: dict[tuple, tuple[Metric, float]] = {}

    def retire(self, pid: int) -> None:
        if pid != self.pid:
            return
        for key, (family, value) in self._last.items():
            old = self._carried.get(key)
            self._carried[key] = (family, value + (old[1] if old else 0.0))
        self._last = {}
        self.pid = None

    def families(self) -> list[Metric]:
        from batchgate.server.ipc.wire import same_user

        text = b""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(NATIVE_TIMEOUT_S)
                sock.connect("\0" + self.name)
                if same_user(sock):
                    chunks = []
                    while chunk := sock.recv(1 << 16):
                        chunks.append(chunk)
                    text = b"".join(chunks)
        except OSError:
            pass  # not running (restarting): only what it carried over counts
        families = list(text_string_to_metric_families(text.decode())) if text else []
        self._last = {
            (family.name, sample.name, tuple(sorted(sample.labels.items()))): (family, sample.value)
            for family in families if family.type in ("counter", "histogram")
            for sample in family.samples
        }
        if not self._carried:
            return families
        carried: dict[str, Metric] = {}
        for (name, sample_name, labels), (family, value) in self._carried.items():
            target = carried.get(name)
            if target is None:
                target = carried[name] = Metric(family.name, family.documentation, family.type)
            target.add_sample(sample_name, dict(labels), value)
        return families + list(carried.values())


class _MergedCollector:
    """The children's files and the native front ends' sockets, as one set of families:
    samples with the same name and labels (from several processes) are summed."""

    def __init__(self, files: multiprocess.MultiProcessCollector,
                 native: list[_NativeSource]) -> None:
        self._files = files
        self._native = native

    def collect(self) -> Iterator[Metric]:
        if not self._native:
            yield from self._files.collect()
            return
        merged: dict[str, Metric] = {}
        values: dict[str, dict[tuple, float]] = {}
        sources = [list(self._files.collect())] + [s.families() for s in self._native]
        for families in sources:
            for family in families:
                target = merged.get(family.name)
                if target is None:
                    target = merged[family.name] = Metric(family.name, family.documentation,
                                                          family.type)
                    values[family.name] = {}
                samples = values[family.name]
                for sample in family.samples:
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    samples[key] = samples.get(key, 0.0) + sample.value
        for name, family in merged.items():
            for (sample_name, labels), value in values[name].items():
                family.add_sample(sample_name, dict(labels), value)
            yield family


class _RestartCollector:
    """``batchgate_child_restarts_total{role}``: the supervisor's own count, not from a file."""

    def __init__(self, restarts: Callable[[], Mapping[str, int]]) -> None:
        self._restarts = restarts

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "batchgate_child_restarts",
            "Child processes started again after they exited unexpectedly, by role.",
            labels=["role"],
        )
        for role, count in sorted(self._restarts().items()):
            family.add_metric([role], count)
        yield family
