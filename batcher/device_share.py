"""DeviceShare: models on one device take turns at it in proportion to configured weights.

Left alone, models on one device get it first come, first served: the one with the most traffic
and the longest batches takes most of it, and a small model's latency follows its neighbour's
load. Models that set ``device_share_weight`` instead run their batches in turns: before a batch
runs its executor asks for the device (``turn``), one batch runs at a time among the members,
and the device goes to the member that has used the least device time for its weight.

This is stride scheduling over device seconds: each member has a *pass*, advanced after every
batch by the batch's measured seconds divided by the member's weight; of the members that want
the device, the one with the lowest pass gets it (ties: the one that joined first). Two members
that always have work get device time in the ratio of their weights; one that is alone gets the
whole device (work-conserving). A member that was idle re-enters at the current virtual time
(the pass of the last batch granted), so idling banks no credit.

A turn lasts from the batch's start to its end on the device, so one model's batches no
longer overlap on it either (on a GPU the next launch waits for the previous batch).

One subtlety makes the ratio hold: an executor that finishes a batch asks again a moment later,
and a decision taken in that moment among the members already waiting would hand the device to
the other member every time (1 : 1 whatever the weights). So a member that releases the device
while it still has work (``backlog()``: requests queued or a batch formed) keeps a *reservation*
for ``reserve_s``: until it comes back, expires or leaves, it competes as if it were waiting.
Each member has its own: another member's turn meanwhile does not end it.

Members that set no weight are not members: they run when they like, as before.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

# Long enough for an executor with a batch in hand to come back, short enough that a member
# whose queue only holds requests still waiting for their batch to fill blocks nobody for long.
DEFAULT_RESERVE_S = 0.002


class ShareMember:
    """One model (all its instances) in one device's share."""

    __slots__ = ("backlog", "name", "on_charge", "order", "pass_", "reserved_until", "waiting",
                 "weight")

    def __init__(self, name: str, weight: float, backlog: Callable[[], bool],
                 on_charge: Callable[[float], None] | None, order: int) -> None:
        self.name = name
        self.weight = weight
        self.backlog = backlog
        self.on_charge = on_charge
        self.pass_ = 0.0
        self.waiting = 0  # executor threads of this member waiting for a turn
        self.reserved_until = 0.0  # it competes as if waiting until then (its reservation)
        self.order = order


class DeviceShare:
    """The turns of one device. Thread-safe; ``clock`` is injectable for tests."""

    def __init__(self, device: str, *, clock: Callable[[], float] = time.monotonic,
                 reserve_s: float = DEFAULT_RESERVE_S) -> None:
        self.device = device
        self._clock = clock
        self._reserve_s = reserve_s
        self._cond = threading.Condition(threading.Lock())
        self._members: list[ShareMember] = []
        self._orders = itertools.count()
        self._holder: ShareMember | None = None
        self._vtime = 0.0

    def join(self, name: str, weight: float, *, backlog: Callable[[], bool] = lambda: False,
             on_charge: Callable[[float], None] | None = None) -> ShareMember:
        """Add a member; ``backlog()`` says whether it has more work right now (cheap, no locks)."""
        if not weight > 0:
            raise ValueError(f"weight must be > 0, got {weight}")
        with self._cond:
            member = ShareMember(name, weight, backlog, on_charge, next(self._orders))
            member.pass_ = self._vtime
            self._members.append(member)
        return member

    def leave(self, member: ShareMember) -> None:
        with self._cond:
            if member in self._members:
                self._members.remove(member)
            member.reserved_until = 0.0
            self._cond.notify_all()

    def now(self) -> float:
        return self._clock()

    def acquire(self, member: ShareMember, *, blocking: bool = True) -> bool:
        """Take the device for ``member``; without ``blocking``, only if it is its turn now."""
        with self._cond:
            if member.reserved_until <= self._clock():  # an idle member banks no credit
                member.pass_ = max(member.pass_, self._vtime)
            member.reserved_until = 0.0  # it came back: it competes as waiting from now on
            member.waiting += 1
            try:
                while not self._may_start(member):
                    if not blocking:
                        return False
                    self._cond.wait(self._recheck_s())
            finally:
                member.waiting -= 1
            self._holder = member
            self._vtime = max(self._vtime, member.pass_)
            return True

    def release(self, member: ShareMember, seconds: float) -> None:
        """The device is free again; ``member`` used it ``seconds``."""
        with self._cond:
            self._holder = None
            member.pass_ += max(seconds, 0.0) / member.weight
            if member in self._members and member.backlog():
                member.reserved_until = self._clock() + self._reserve_s
            self._cond.notify_all()
        if member.on_charge is not None:
            member.on_charge(seconds)

    # -- internals (lock held) -------------------------------------------------------------

    def _may_start(self, member: ShareMember) -> bool:
        if self._holder is not None:
            return False
        if member not in self._members:
            return True  # a thread of a member that left (a model being replaced): let it finish
        now = self._clock()
        contenders = [m for m in self._members if m.waiting or m.reserved_until > now]
        return min(contenders, key=lambda m: (m.pass_, m.order)) is member

    def _recheck_s(self) -> float | None:
        # Waiters must look again when a reservation runs out, not only when notified.
        now = self._clock()
        ends = [m.reserved_until for m in self._members if m.reserved_until > now]
        return min(ends) - now if ends else None


class DeviceTurns:
    """One model's batches in its device's share: ``begin`` before a batch runs, ``end`` once it
    has finished — on a GPU that is on the executor's finisher thread, when the batch's work on
    the device is done, so the turn covers the device time and not only the launch. Until the
    model ``join``s (after its warm-up) and after it ``leave``s, both do nothing."""

    def __init__(self, share: DeviceShare) -> None:
        self._share = share
        self._member: ShareMember | None = None
        self._started: dict[int, float] = {}  # batch id -> when its turn began

    def join(self, name: str, weight: float, *, backlog: Callable[[], bool],
             on_charge: Callable[[float], None] | None) -> None:
        self._member = self._share.join(name, weight, backlog=backlog, on_charge=on_charge)

    def leave(self) -> None:
        if self._member is not None:
            self._share.leave(self._member)

    def begin(self, batch_id: int) -> None:
        if self._member is None:
            return
        self._share.acquire(self._member)
        self._started[batch_id] = self._share.now()

    def end(self, batch_id: int) -> None:
        started = self._started.pop(batch_id, None)
        if started is not None:
            self._share.release(self._member, self._share.now() - started)
