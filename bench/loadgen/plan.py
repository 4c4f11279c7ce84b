"""The shape of a run: steps of a sweep, each a warm-up then measured segments, split over workers.

A step is one load level (a concurrency, or a rate). Within a step, segments run back to back:
a warm-up per target (not measured), then the measured time, which with ``--compare`` is cut in
slices that alternate between the targets, so drift on a shared machine touches both alike.

Closed-loop segments run for their duration after the previous one has drained (its senders
finish their last call). Open-loop segments are laid on the step's clock: their arrival times
are offsets from the step's start and nothing waits for answers, except where the target
changes (a server's backlog must not run during the other's slice: the driver waits for it and
lays the rest of the schedule that much later) and at the end of the step, which drains before
the next step starts.

Each worker process gets its own share of every segment: concurrency and request budgets are
divided, open-loop arrivals are dealt round robin (so the merged schedule is exactly the drawn
one), and the mix of variants is drawn once, here, from the run's seed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from batchgate.bench.loadgen.arrivals import Arrival, schedule

# A closed-loop sender walks a cyclic sequence of variant choices of this length.
CHOICE_CYCLE = 4096


@dataclasses.dataclass(frozen=True)
class LoadLevel:
    """One step of the sweep: a concurrency (closed loop) or an arrival process (open loop)."""

    concurrency: int | None = None
    arrival: Arrival | None = None

    @property
    def closed(self) -> bool:
        return self.concurrency is not None

    @property
    def offered(self) -> dict[str, float | int | str]:
        if self.closed:
            return {"concurrency": self.concurrency}
        return {"rate_per_s": self.arrival.rate_per_s, "arrival": self.arrival.kind}

    @property
    def x(self) -> float:
        """The offered load as a number, for plots."""
        return float(self.concurrency) if self.closed else self.arrival.mean_rate_per_s

    @property
    def label(self) -> str:
        if self.closed:
            return f"c={self.concurrency}"
        return f"{self.arrival.kind} {self.arrival.rate_per_s:g}/s"


@dataclasses.dataclass(frozen=True)
class Segment:
    """Load on one target. Closed loop: ``concurrency`` senders for ``duration_s`` or until
    ``requests`` have been sent. Open loop: one request at each of ``times`` (seconds from the
    step's start). ``choices`` are indices into the run's variants: one per arrival (open), or a
    cycle the senders walk (closed)."""

    target: int
    measured: bool
    choices: np.ndarray
    start_s: float = 0.0
    duration_s: float | None = None
    requests: int | None = None
    concurrency: int = 0
    times: np.ndarray | None = None

    @property
    def closed(self) -> bool:
        return self.times is None


@dataclasses.dataclass(frozen=True)
class Step:
    level: LoadLevel
    segments: tuple[Segment, ...]


@dataclasses.dataclass(frozen=True)
class RunShape:
    """What ``build_steps`` needs from the command line."""

    levels: Sequence[LoadLevel]
    targets: int
    warmup_s: float
    duration_s: float | None
    requests: int | None
    slice_s: float
    variant_weights: np.ndarray  # probability of each variant
    seed: int


def build_steps(shape: RunShape) -> list[Step]:
    rng = np.random.default_rng(shape.seed)
    steps = []
    for level in shape.levels:
        windows = _windows(shape)
        segments = []
        for target, start, length, measured in windows:
            segments.append(_segment(level, shape, rng, target, start, length, measured))
        if shape.requests is not None:
            segments.append(_segment(level, shape, rng, 0, _end(windows), None, True))
        steps.append(Step(level, tuple(segments)))
    return steps


def _windows(shape: RunShape) -> list[tuple[int, float, float, bool]]:
    """(target, start, length, measured) of each timed segment, on the step's clock."""
    windows, clock = [], 0.0
    if shape.warmup_s > 0:
        for target in range(shape.targets):
            windows.append((target, clock, shape.warmup_s, False))
            clock += shape.warmup_s
    if shape.duration_s is None:
        return windows
    done = [0.0] * shape.targets
    while done[-1] < shape.duration_s - 1e-9:
        for target in range(shape.targets):
            length = min(shape.slice_s, shape.duration_s - done[target])
            windows.append((target, clock, length, True))
            clock += length
            done[target] += length
    return windows


def _end(windows: list[tuple[int, float, float, bool]]) -> float:
    return windows[-1][1] + windows[-1][2] if windows else 0.0


def _segment(level: LoadLevel, shape: RunShape, rng: np.random.Generator, target: int,
             start: float, length: float | None, measured: bool) -> Segment:
    weights = shape.variant_weights
    if level.closed:
        choices = rng.choice(len(weights), size=CHOICE_CYCLE, p=weights).astype(np.int32)
        requests = shape.requests if length is None else None
        return Segment(target, measured, choices, start, length, requests, level.concurrency)
    if length is None:
        times = schedule(level.arrival, rng, start_s=start, count=shape.requests)
    else:
        times = schedule(level.arrival, rng, start_s=start, duration_s=length)
    choices = rng.choice(len(weights), size=times.size, p=weights).astype(np.int32)
    return Segment(target, measured, choices, start, length, None, 0, times)


def split(step: Step, workers: int) -> list[Step]:
    """Each worker's share of ``step``; a worker may get nothing of a segment (0 senders)."""
    shares = []
    for w in range(workers):
        segments = []
        for seg in step.segments:
            if seg.closed:
                # Only the first min(workers, concurrency) workers have senders to spend a budget.
                active = min(workers, seg.concurrency)
                requests = None
                if seg.requests is not None:
                    requests = _share(seg.requests, active, w) if w < active else 0
                segments.append(dataclasses.replace(
                    seg, concurrency=_share(seg.concurrency, workers, w), requests=requests))
            else:
                segments.append(dataclasses.replace(
                    seg, times=seg.times[w::workers], choices=seg.choices[w::workers]))
        shares.append(Step(step.level, tuple(segments)))
    return shares


def _share(total: int, parts: int, index: int) -> int:
    return total // parts + (1 if index < total % parts else 0)
