"""Running a model call with a time limit, and replacing the thread that hung in it.

Python cannot stop a thread, and a model can hang: a deadlocked custom op, a stuck collective, a
Python ``model.py`` waiting on something that never comes. With an ``execution_timeout_ms``
configured, the executor runs each forward on a *runner* thread and waits for it at most that
long. When the time is up, the batch fails with a clear status, the runner is abandoned (it
keeps its stack until the call returns, if ever) and a fresh runner takes over, so the instance
serves the next batch. The abandoned call's inputs are released only when it returns.

Runners that never come back pile up: past ``max_abandoned`` of them the instance is declared
dead, so a model that hangs on every batch ends NOT_SERVING instead of leaking a thread per
batch. The cost of the limit is one thread hand-off per batch, which is why it is opt-in.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

MAX_ABANDONED = 4


class ExecutionTimeout(Exception):
    """The call did not return within the limit; its runner was abandoned."""


class TooManyHungCalls(Exception):
    """Too many abandoned calls are still running: the instance should stop."""


class _Call:
    __slots__ = ("fn", "args", "done", "result", "error", "abandoned", "on_late")

    def __init__(self, fn: Callable[..., Any], args: tuple, on_late: Callable[[], None] | None):
        self.fn = fn
        self.args = args
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.abandoned = False
        self.on_late = on_late


class TimedRunner:
    """Runs one call at a time on a worker thread; gives up on a call after ``timeout_s``."""

    def __init__(self, name: str, timeout_s: float, configure: Callable[[], None] = lambda: None,
                 max_abandoned: int = MAX_ABANDONED) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._name = name
        self._timeout_s = timeout_s
        self._configure = configure
        self._max_abandoned = max_abandoned
        self._lock = threading.Lock()
        self._hung = 0  # abandoned calls that have not returned yet
        self._generation = 0
        self._work: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._start_worker()

    @property
    def hung(self) -> int:
        with self._lock:
            return self._hung

    def run(self, fn: Callable[..., Any], *args: Any,
            on_late: Callable[[], None] | None = None) -> Any:
        """``fn(*args)`` on the runner; its result, or its exception re-raised here.

        Raises ExecutionTimeout when the call outlives the limit (``on_late`` is then called on
        the abandoned runner if the call ever returns), or TooManyHungCalls when too many
        abandoned calls are still stuck to start another runner.
        """
        call = _Call(fn, args, on_late)
        self._work.put(call)
        if not call.done.wait(self._timeout_s):
            with self._lock:
                if not call.done.is_set():  # still running: abandon it, under the worker's lock
                    call.abandoned = True
                    self._hung += 1
                    hung = self._hung
            if call.abandoned:
                # The stuck worker keeps the old queue; a new worker serves a new one.
                self._work = queue.SimpleQueue()
                if hung > self._max_abandoned:
                    raise TooManyHungCalls(f"{hung} calls are still hung")
                self._start_worker()
                raise ExecutionTimeout(f"no result within {self._timeout_s * 1e3:g} ms")
        if call.error is not None:
            raise call.error
        return call.result

    def close(self) -> None:
        """Let the current worker exit once idle (abandoned ones exit when their call returns)."""
        self._work.put(None)

    def _start_worker(self) -> None:
        self._generation += 1
        thread = threading.Thread(target=self._serve, args=(self._work,),
                                  name=f"{self._name}-runner-{self._generation}", daemon=True)
        thread.start()

    def _serve(self, work: queue.SimpleQueue) -> None:
        self._configure()
        while (call := work.get()) is not None:
            try:
                call.result = call.fn(*call.args)
            except BaseException as exc:  # handed to the caller, which decides
                call.error = exc
            with self._lock:
                call.done.set()
                late = call.abandoned
                if late:
                    self._hung -= 1
            if late:
                if call.on_late is not None:
                    call.on_late()
                return  # a replacement serves the new queue
