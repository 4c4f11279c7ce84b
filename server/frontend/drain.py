"""The drain's hold on the calls that arrive while the server shuts down (``Gateway.stop``).

gRPC's shutdown cancels the calls it holds that no handler has taken yet, and every call that
reaches the server after the shutdown began and before its client has read the GOAWAY the
shutdown sends: those clients would see CANCELLED for requests that reached the server. So a
drain goes in steps, and the shutdown comes last:

1. **draining**: health is NOT_SERVING; new requests get UNAVAILABLE at once, while those
   accepted before finish (within the drain timeout);
2. **parking**: new calls wait, unanswered. A client waiting for its answer sends no other
   call, so once arrivals have been quiet for ``QUIET_ARRIVALS_S`` (``MAX_PARKING_S`` at most)
   nothing is on its way, and gRPC holds no call unhandled: the serving loop, idle, takes each
   as it comes;
3. **shutdown**: the GOAWAY goes out; ``GOAWAY_PROPAGATION_S`` later the parked calls get
   UNAVAILABLE and open streams end with UNAVAILABLE; their clients retry elsewhere.

The native front end drains the same way, with the same times (``Frontend::Drain`` in
``server/native/src/frontend.cc``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

# A client answered just before the parking began needs the quiet period to send its next call
# (and have it parked); a GOAWAY needs a round trip and the client's reading to take effect.
QUIET_ARRIVALS_S = 0.05
MAX_PARKING_S = 1.0
GOAWAY_PROPAGATION_S = 0.25
# The shutdown's grace once the drain timeout is spent: time for the parked calls' answers.
LAST_ANSWERS_S = 0.25


class DrainGate:
    """Where the service's handlers meet the drain: ``draining`` to refuse, ``refuse()`` to wait
    (parked) before answering UNAVAILABLE, ``watch_stream`` for a stream the drain will end."""

    def __init__(self) -> None:
        self.draining = False
        self.streams_ended = False
        self._released: asyncio.Event | None = None  # exists from the parking on
        self._last_arrival = 0.0
        self._streams: set[Callable[[], None]] = set()

    def start(self) -> None:
        self.draining = True

    async def refuse(self) -> None:
        """A call that arrived while draining: returns once it may be answered UNAVAILABLE."""
        self._last_arrival = time.monotonic()
        await self.hold()

    async def hold(self) -> None:
        """Returns once the parking is over (at once outside of it)."""
        if self._released is not None:
            await self._released.wait()

    async def park_until_quiet(self, until: float) -> None:
        """Park new calls; return once arrivals were quiet for ``QUIET_ARRIVALS_S``, after
        ``MAX_PARKING_S``, or at ``until`` (``time.monotonic()``), whichever comes first."""
        if self._released is None:
            self._released = asyncio.Event()
        parked_at = time.monotonic()
        until = min(until, parked_at + MAX_PARKING_S)
        while True:
            wake = min(until, max(parked_at, self._last_arrival) + QUIET_ARRIVALS_S)
            now = time.monotonic()
            if now >= wake:
                return
            await asyncio.sleep(wake - now)

    def release(self) -> None:
        """The parked calls go on (to UNAVAILABLE); open streams end."""
        if self._released is None:
            self._released = asyncio.Event()
        self._released.set()
        self.streams_ended = True
        for end in list(self._streams):
            end()

    def watch_stream(self, end: Callable[[], None]) -> None:
        self._streams.add(end)

    def forget_stream(self, end: Callable[[], None]) -> None:
        self._streams.discard(end)
