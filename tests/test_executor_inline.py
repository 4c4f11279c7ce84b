"""Answering a batch off the executor's loop (``LoopHold.inline``, server/executor/loop.py): only while the
loop's thread waits for events with nothing queued, on the calling thread, its frames written
before it returns. A real event loop, real threads, a real abstract socket."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from batchgate.protos import wire_pb2
from batchgate.server.ipc import wire
from batchgate.server.executor.loop import LoopHold


@pytest.fixture
def server():
    return LoopHold()


def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")


def _loop_waiting(server: LoopHold) -> None:
    """Return once the loop's thread waits in its selector (it let go of the loop lock); it
    keeps waiting until something wakes it."""
    lock = server.lock

    def free() -> bool:
        if lock.acquire(blocking=False):
            lock.release()
            return True
        return False

    _until(free)


async def test_a_delivery_runs_off_the_loop_only_while_the_loop_waits_with_nothing_queued(server):
    loop = asyncio.get_running_loop()
    ran: list[int] = []

    def delivery() -> None:
        ran.append(threading.get_ident())

    server.hold(loop)
    try:
        # The loop's thread is busy (here: blocked in a join, outside its selector): refused.
        answers: list[bool] = []
        busy = threading.Thread(target=lambda: answers.append(server.inline(delivery)))
        busy.start()
        busy.join()
        assert answers == [False] and ran == []

        def off_the_loop() -> tuple[bool, bool]:
            _loop_waiting(server)
            # A callback queued for the loop (an earlier batch's answer, say) goes first.
            loop.call_soon(lambda: None)  # queued without waking the loop
            behind = server.inline(delivery)
            loop.call_soon_threadsafe(lambda: None)  # now it runs what is queued
            _until(lambda: not loop._ready)
            _loop_waiting(server)
            return behind, server.inline(delivery)

        behind, waiting = await asyncio.to_thread(off_the_loop)
        assert behind is False
        assert waiting is True and len(ran) == 1 and ran[0] != threading.get_ident()
    finally:
        server.release()
    # Undone: the loop's own selector again, and nothing delivered off it.
    assert "select" not in vars(loop._selector)
    assert server.inline(delivery) is False and len(ran) == 1


async def test_frames_filled_off_the_loop_are_written_before_the_delivery_returns():
    """A frame filled inside ``wire.flushed_here`` is written when the block ends, by the
    thread that ran it: the loop, which it does not wake, could not write it."""
    name = f"batchgate-test-inline-{os.getpid()}-{os.urandom(4).hex()}"
    got: asyncio.Queue = asyncio.Queue()

    class Handler:
        def frame(self, frame: wire_pb2.ToExecutor) -> None:
            got.put_nowait(frame)

        def read(self) -> None:
            pass

        def lost(self, _reason) -> None:
            pass

    loop = asyncio.get_running_loop()
    listener = await wire.serve_frontends(name, lambda link: Handler())
    link = await wire.connect_to_executor(name)
    try:
        def fill() -> None:
            with wire.flushed_here():
                link.out.cancel.append(7)
                link.out.free.append(3)  # the same frame
                assert link.pending_bytes > 0  # not written yet
                # ... and not left to the loop either.
                assert all(getattr(h, "_callback", None) != link.flush for h in list(loop._ready))
            assert link.pending_bytes == 0

        await asyncio.to_thread(fill)
        frame = await asyncio.wait_for(got.get(), 10)
        assert list(frame.cancel) == [7] and list(frame.free) == [3]
    finally:
        link.close()
        listener.close()
