"""batcher/expiry.py: one timer for a model's deadlines, holding no request alive."""

from __future__ import annotations

import asyncio
import gc

import numpy as np

from batchgate.batcher import expiry as expiry_module
from batchgate.batcher.expiry import SWEEP_AT, Expiry
from batchgate.batcher.request import InferenceRequest


def waiting(loop: asyncio.AbstractEventLoop, deadline: float) -> InferenceRequest:
    return InferenceRequest([np.zeros((1, 1), np.float32)], deadline=deadline)


async def test_requests_expire_in_deadline_order_and_answered_ones_do_not():
    loop = asyncio.get_running_loop()
    expired: list[InferenceRequest] = []
    last = asyncio.Event()

    def expire(request: InferenceRequest) -> None:
        expired.append(request)
        if request is late:
            last.set()

    expiry = Expiry(expire)
    now = loop.time()
    late = waiting(loop, now + 0.06)
    answered = waiting(loop, now + 0.01)
    early = waiting(loop, now + 0.02)
    for request in (late, answered, early):  # the earlier deadlines re-arm the timer
        expiry.watch(request, loop)
    answered.answered = True
    await asyncio.wait_for(last.wait(), 10)
    assert expired == [early, late]
    assert len(expiry) == 0


async def test_a_past_deadline_expires_on_the_next_loop_turn():
    loop = asyncio.get_running_loop()
    expired = asyncio.Event()
    expiry = Expiry(lambda request: expired.set())
    request = waiting(loop, loop.time() - 1.0)
    expiry.watch(request, loop)
    await asyncio.wait_for(expired.wait(), 10)


async def test_the_heap_holds_no_request_alive_and_sweeps_answered_ones():
    loop = asyncio.get_running_loop()
    expired: list[InferenceRequest] = []
    expiry = Expiry(expired.append)
    gc.disable()  # the entries must die by reference counting alone, as in the server
    try:
        request = waiting(loop, loop.time() + 3600)
        expiry.watch(request, loop)
        probe = expiry._heap[0][2]
        del request
        assert probe() is None
        for _ in range(3 * SWEEP_AT):  # answered long before their deadlines
            request = waiting(loop, loop.time() + 3600)
            expiry.watch(request, loop)
            request.answered = True
        del request
    finally:
        gc.enable()
    # Swept whenever it doubled past SWEEP_AT: never more than that many dead entries.
    assert len(expiry) < SWEEP_AT
    assert expired == []
    expiry.close()


async def test_a_dead_first_entry_sweeps_instead_of_one_firing_per_dead_entry(monkeypatch):
    loop = asyncio.get_running_loop()
    fired = 0
    fire = Expiry._fire

    def counting(self: Expiry) -> None:
        nonlocal fired
        fired += 1
        fire(self)

    monkeypatch.setattr(expiry_module.Expiry, "_fire", counting)
    done = asyncio.Event()
    expiry = Expiry(lambda request: done.set())
    now = loop.time()
    for i in range(100):  # answered requests due over the next 0.1 s
        request = waiting(loop, now + 0.001 * (i + 1))
        expiry.watch(request, loop)
        request.answered = True
    expiry.watch(live := waiting(loop, now + 0.2), loop)
    await asyncio.wait_for(done.wait(), 10)
    assert not live.answered  # expire() is the caller's to act on
    assert fired == 2  # the first dead entry's deadline, then the live one's
