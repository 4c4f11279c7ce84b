"""The one poll-until helper: a predicate checked until it holds or a deadline passes.

Prefer an event where one exists; this is for state that can only be looked at (a file, a
process table, a metric, another process's log)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class _Tries(Generic[T]):
    """``predicate`` against a deadline: ``held()`` calls it once and says whether it held
    (its value kept in ``value``), raising ``AssertionError`` once the deadline has passed."""

    def __init__(self, predicate: Callable[[], T], timeout_s: float, what: str) -> None:
        self.predicate, self.timeout_s, self.what = predicate, timeout_s, what
        self.deadline = time.monotonic() + timeout_s
        self.value: T | None = None

    def held(self) -> bool:
        self.value = self.predicate()
        if self.value:
            return True
        if time.monotonic() > self.deadline:
            raise AssertionError(f"{self.what}: not reached within {self.timeout_s:g} s")
        return False


def poll(predicate: Callable[[], T], timeout_s: float = 30, what: str = "condition", *,
         interval_s: float = 0.002, step: Callable[[], object] | None = None) -> T:
    """Call ``predicate`` until it returns something truthy, and return that; raise
    ``AssertionError`` naming ``what`` after ``timeout_s``. Between calls, ``step()`` runs if
    given (something that moves the state on, e.g. a request), else it sleeps ``interval_s``."""
    tries = _Tries(predicate, timeout_s, what)
    while not tries.held():
        if step is not None:
            step()
        else:
            time.sleep(interval_s)
    return tries.value


async def apoll(predicate: Callable[[], T], timeout_s: float = 10, what: str = "condition", *,
                interval_s: float = 0.001,
                step: Callable[[], Awaitable[object]] | None = None) -> T:
    """``poll`` for a coroutine: between calls it awaits ``step()`` if given, else yields to the
    event loop for ``interval_s``."""
    tries = _Tries(predicate, timeout_s, what)
    while not tries.held():
        if step is not None:
            await step()
        else:
            await asyncio.sleep(interval_s)
    return tries.value
