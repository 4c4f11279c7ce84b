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

The folder is removed when the supervisor stops. A supervisor that is killed cannot do that, so
each one holds an ``flock`` on its folder while it lives (the kernel drops it when the process
dies, however it dies), and a starting supervisor removes the folders nobody holds.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from prometheus_client import CollectorRegistry, multiprocess, start_http_server
from prometheus_client.core import CounterMetricFamily

from batcher.telemetry import GpuTelemetry

ENV_VAR = "PROMETHEUS_MULTIPROC_DIR"
PREFIX = "batchgate-metrics-"
# A folder younger than this is left alone even when unlocked: its owner may not have locked it yet.
ABANDONED_AFTER_S = 60.0


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
        multiprocess.MultiProcessCollector(self.registry, path=str(self.path))
        if restarts is not None:
            self.registry.register(_RestartCollector(restarts))
        self._httpd = None

    def child_env(self) -> dict[str, str]:
        """What to add to a child's environment so that its metrics land here."""
        return {ENV_VAR: str(self.path)}

    def process_dead(self, pid: int) -> None:
        """A child exited: its gauges stop counting; its counters and histograms stay."""
        multiprocess.mark_process_dead(pid, str(self.path))

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
