"""Intended send times for the open loop: constant, Poisson, or bursty on/off.

Bursty load is Poisson at the rate during on-periods and at ``off_rate_per_s`` (by default
nothing) during off-periods: real traffic rarely stops between bursts, and a deadline policy is
judged by how it clears a burst's backlog while requests keep coming.

The schedule is drawn before the run (seeded) and never adapts to the server: a request is due
at its time whether or not earlier ones have been answered, and its latency is counted from
that time. That is what keeps queueing visible when the server stalls.
"""

from __future__ import annotations

import dataclasses

import numpy as np

ARRIVALS = ("constant", "poisson", "bursty")
MAX_ARRIVALS = 50_000_000  # 400 MB of float64 times: far beyond what one machine can send


@dataclasses.dataclass(frozen=True)
class Arrival:
    """``kind`` at ``rate_per_s``; bursty sends Poisson arrivals at that rate during on-periods
    of ``on_s`` and at ``off_rate_per_s`` during off-periods of ``off_s``, starting with an
    on-period."""

    kind: str
    rate_per_s: float
    on_s: float = 1.0
    off_s: float = 1.0
    off_rate_per_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ARRIVALS:
            raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)}, got {self.kind!r}")
        if not self.rate_per_s > 0:
            raise ValueError(f"rate must be > 0, got {self.rate_per_s}")
        if self.kind == "bursty" and not (self.on_s > 0 and self.off_s >= 0):
            raise ValueError(f"bursts need on > 0 s and off >= 0 s, got {self.on_s}, {self.off_s}")
        if self.off_rate_per_s < 0 or (self.off_rate_per_s and self.kind != "bursty"):
            raise ValueError(f"an off-period rate ({self.off_rate_per_s}) needs bursty arrivals "
                             "and must be >= 0")

    @property
    def mean_rate_per_s(self) -> float:
        if self.kind != "bursty":
            return self.rate_per_s
        return ((self.rate_per_s * self.on_s + self.off_rate_per_s * self.off_s)
                / (self.on_s + self.off_s))


def schedule(arrival: Arrival, rng: np.random.Generator, *, start_s: float,
             duration_s: float | None = None, count: int | None = None,
             phase_origin_s: float = 0.0) -> np.ndarray:
    """Sorted intended send times (seconds) from ``start_s``: those before ``start_s +
    duration_s``, or exactly ``count`` of them. Bursts are phased from ``phase_origin_s``."""
    if (duration_s is None) == (count is None):
        raise ValueError("give exactly one of duration_s and count")
    if count is not None:
        return _first(arrival, rng, start_s, count, phase_origin_s)
    expected = arrival.mean_rate_per_s * duration_s
    if expected > MAX_ARRIVALS:
        raise ValueError(f"{expected:,.0f} arrivals in one step; lower the rate or the duration")
    end = start_s + duration_s
    # Draw a little more than expected, and more again in the rare case that was not enough.
    n = int(expected + 6 * np.sqrt(expected) + 16)
    while True:
        times = _first(arrival, rng, start_s, n, phase_origin_s)
        if times.size and times[-1] >= end:
            return times[times < end]
        n *= 2


def _first(arrival: Arrival, rng: np.random.Generator, start_s: float, count: int,
           phase_origin_s: float) -> np.ndarray:
    rate = arrival.rate_per_s
    if arrival.kind == "constant":
        return start_s + np.arange(count, dtype=np.float64) / rate
    busy = start_s + np.cumsum(rng.exponential(1.0 / rate, size=count))
    if arrival.kind == "poisson":
        return busy
    on, off = arrival.on_s, arrival.off_s
    times = _phase_only(busy, start_s, phase_origin_s, on, off, 0.0)
    if arrival.off_rate_per_s and off > 0:
        # Each process alone has ``count`` arrivals, so the first ``count`` of both merged are
        # exactly the merged process's first ``count``.
        quiet = start_s + np.cumsum(rng.exponential(1.0 / arrival.off_rate_per_s, size=count))
        times = np.sort(np.concatenate(
            [times, _phase_only(quiet, start_s, phase_origin_s, off, on, on)]))[:count]
    return times


def _phase_only(busy: np.ndarray, start_s: float, origin_s: float, length_s: float,
                other_s: float, offset_s: float) -> np.ndarray:
    """Lay a process ``busy`` (times from ``start_s``) over a clock that runs only during the
    phases of ``length_s`` that begin ``offset_s`` into each cycle of ``length_s + other_s``."""
    period = length_s + other_s
    origin = origin_s + offset_s
    # The phase clock's reading at start_s; the phase before ``origin`` counts as the last one.
    elapsed = start_s - origin
    phase_time = elapsed // period * length_s + min(max(elapsed % period, 0.0), length_s)
    phase_time = phase_time + (busy - start_s)
    return origin + phase_time // length_s * period + phase_time % length_s
