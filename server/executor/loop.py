"""The executor process's event loop, held by its thread except while it waits for events, so
that a batch's answers can go out from the executor thread that finished it.

At low load the loop's thread mostly sleeps in its selector. Waking it for each finished batch
(``call_soon_threadsafe``) costs a wake-up and a hand-over of the GIL per batch: at c=1 that
was half the loop's CPU per request. ``LoopHold`` keeps a lock that the loop's thread holds
whenever it is not inside its selector's wait; an executor thread that takes it may touch what
the loop owns (the front ends' frames, the requests in flight) and answer its batch there and
then (``inline``), while the loop, kept from waking, sees the result afterwards.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import structlog

from batchgate.server.ipc import wire

log = structlog.get_logger(__name__)


def _nothing() -> None:
    pass


class LoopHold:
    """The lock the loop's thread holds except while its selector waits."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._selector = None

    def hold(self, loop: asyncio.AbstractEventLoop) -> None:
        """On ``loop``'s thread, before requests come: from now on that thread holds the lock
        except while its selector waits for events."""
        # The selector event loop's own selector: asyncio has no hook around its wait. Another
        # loop (none is used here) would answer every batch itself, as without this.
        selector = getattr(loop, "_selector", None)
        if selector is None or not hasattr(loop, "_ready"):
            return
        lock = self.lock
        lock.acquire()
        self._loop, self._selector = loop, selector
        select = selector.select

        def waiting(timeout: float | None = None):
            lock.release()
            try:
                return select(timeout)
            finally:
                lock.acquire()

        selector.select = waiting

    def release(self) -> None:
        """On the loop's thread, once it is done serving: ``hold`` undone, deliveries go back
        to the loop."""
        if self._loop is None:
            return
        del self._selector.select  # the class's own again
        self._loop = self._selector = None
        self.lock.release()

    def inline(self, delivery: Callable[[], None]) -> bool:
        """Run a finished batch's ``delivery`` on the calling (executor) thread if the loop
        waits for events with nothing pending: its answers go out at once, without waking the
        loop's thread. False when the loop is busy or has callbacks queued (a batch's answers
        must not pass an earlier one's)."""
        lock = self.lock
        if not lock.acquire(blocking=False):
            return False
        try:
            loop = self._loop
            if loop is None or loop._ready:  # asyncio's queue of callbacks to run
                return False
            try:
                with wire.flushed_here():
                    delivery()
            except Exception:
                log.exception("inline_delivery_failed")
            if loop._ready:  # the delivery left callbacks (a timer's, say): wake the loop
                loop.call_soon_threadsafe(_nothing)
            return True
        finally:
            lock.release()
