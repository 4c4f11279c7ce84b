"""A process's resident memory from ``/proc``: how far it rose above where it was while a block
ran (``PeakGrowth``), for tests that bound what a request may make a server allocate."""

from __future__ import annotations

import threading
from pathlib import Path


def status_bytes(pid: int, key: str) -> int:
    """A ``/proc/<pid>/status`` size (``VmRSS``, ``VmHWM``...) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0]) * 1024
    raise KeyError(f"/proc/{pid}/status has no {key}")


class PeakGrowth:
    """``with PeakGrowth(pid) as peak: ...``; then ``peak.bytes``: the process's highest resident
    memory during the block above its resident memory at the start.

    The peak is the kernel's own (VmHWM), reset to the current size as the block starts by
    writing 5 to ``/proc/<pid>/clear_refs``; where that is not allowed (another user's process),
    VmRSS is sampled every millisecond instead, which can miss a peak shorter than that."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.bytes = 0
        self._start = 0
        self._sampled = 0
        self._sampler: threading.Thread | None = None
        self._done = threading.Event()

    def __enter__(self) -> PeakGrowth:
        self._start = status_bytes(self.pid, "VmRSS")
        try:
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")
        except OSError:
            self._sampled = self._start
            self._sampler = threading.Thread(target=self._sample, name="peak-rss", daemon=True)
            self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.001):
            self._sampled = max(self._sampled, status_bytes(self.pid, "VmRSS"))

    def __exit__(self, *exc) -> None:
        if self._sampler is not None:
            self._done.set()
            self._sampler.join()
            peak = max(self._sampled, status_bytes(self.pid, "VmRSS"))
        else:
            peak = status_bytes(self.pid, "VmHWM")
        self.bytes = max(0, peak - self._start)
