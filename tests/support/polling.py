"""The one poll-until helper: a predicate checked until it holds or a deadline passes.

Prefer an event where one exists; this is for state that can only be looked at (a file, a
process table, a metric, another process's log)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def poll(predicate: Callable[[], T], timeout_s: float = 30, what: str = "condition", *,
         interval_s: float = 0.002, step: Callable[[], object] | None = None) -> T:
    """Call ``predicate`` until it returns something truthy, and return that; raise
    ``AssertionError`` naming ``what`` after ``timeout_s``. Between calls, ``step()`` runs if
    given (something that moves the state on, e.g. a request), else it sleeps ``interval_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout_s:g} s")
        if step is not None:
            step()
        else:
            time.sleep(interval_s)


async def apoll(predicate: Callable[[], T], timeout_s: float = 10, what: str = "condition", *,
                interval_s: float = 0.001,
                step: Callable[[], Awaitable[object]] | None = None) -> T:
    """``poll`` for a coroutine: between calls it awaits ``step()`` if given, else yields to the
    event loop for ``interval_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout_s:g} s")
        if step is not None:
            await step()
        else:
            await asyncio.sleep(interval_s)
