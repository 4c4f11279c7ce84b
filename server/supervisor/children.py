"""A child process's place in the supervisor: its restart policy, its state, what it reports."""

from __future__ import annotations

import dataclasses
import subprocess
from collections import deque
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """When a child that exited is started again, and when the supervisor stops trying."""

    backoff_s: float = 0.5
    """Delay before the first restart; it doubles with each crash inside ``window_s``."""
    max_backoff_s: float = 10.0
    """Longest delay before a restart."""
    max_crashes: int = 5
    """One child exiting this many times within ``window_s`` makes the supervisor give up."""
    window_s: float = 60.0
    """The window, in seconds, in which crashes are counted."""

    def __post_init__(self) -> None:
        if self.backoff_s < 0:
            raise ValueError(f"backoff_s must be >= 0, got {self.backoff_s}")
        if self.max_backoff_s < self.backoff_s:
            raise ValueError(f"max_backoff_s must be >= backoff_s, got {self.max_backoff_s}")
        if self.max_crashes < 1:
            raise ValueError(f"max_crashes must be >= 1, got {self.max_crashes}")
        if self.window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")

    def delay_s(self, recent_crashes: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** max(0, recent_crashes - 1))


@dataclasses.dataclass(frozen=True)
class ChildInfo:
    """A snapshot of one child: ``pid`` is None while it waits to be restarted."""

    role: str  # "executor" or "frontend"
    slot: int | None  # the front end's arena slot; None for the executor
    pid: int | None
    ready: bool
    starts: int


class Child:
    """One child's place: its command line and handover, and the process currently filling it.
    ``handover()`` makes the handover at each start: a front end's carries what the executor
    that is ready then said of itself."""

    def __init__(self, role: str, slot: int | None, argv: list[str],
                 handover: Callable[[], bytes]) -> None:
        self.role = role
        self.slot = slot
        self.argv = argv
        self.handover = handover
        self.proc: subprocess.Popen | None = None
        self.ready = False
        self.starts = 0
        self.ready_deadline: float | None = None
        self.restart_at: float | None = None
        self.crashes: deque[float] = deque()

    @property
    def name(self) -> str:
        return self.role if self.slot is None else f"{self.role} {self.slot}"

    def fields(self, proc: subprocess.Popen | None = None) -> dict:
        proc = proc or self.proc
        return {"role": self.role, "slot": self.slot, "pid": proc.pid if proc else None}
