"""How much a scheduler that knew the future could attain on the deadline benchmark's traces.

``bench/deadline_sim.py`` compares the batch policies on a simulated clock; this asks what any
policy could reach there. A *clairvoyant* planner sees every arrival to come, with its
deadline, and batch times are exact (no jitter). At each moment the device is free it plans
the next ``--horizon-ms`` with a beam search (``--beam`` plans kept per step) over batch sizes,
each batch the earliest-deadline requests that it finishes in time for, scoring a plan by its
requests on time plus those that back-to-back full batches after it would still serve; it runs
the first batch of the best plan and plans again. A request is on time when its batch ends
``--response-ms`` before its deadline.

No real policy knows the arrivals, and a beam search does not find the best plan, so the figure
is neither a bound nor a target: it shows how much room the trace leaves above the deadline
policy. The table gives, on the very same trace and the same criterion (``deadline_sim`` with
no jitter and the response margin set to ``--response-ms``), the deadline policy and the fixed
delay at its best, and then the planner.

    python -m batchgate.bench.deadline_bound [--loads 0.44] [--deadline-ms 100,300] [--seeds 1,2]

A plan costs Python time: with the defaults (500 ms ahead, 64 plans, 20 s of trace) a load
takes about four minutes per seed on one core; a longer horizon and a wider beam attain more
and take much longer.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from batchgate.bench.deadline_sim import Workload, best_fixed, simulate, trace

# The batch sizes a plan may choose from (all of them up to 4, then every other one).
STEP_SIZES = (1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32)


@dataclasses.dataclass
class _Plan:
    on_time: int
    pending: list[float]  # deadlines of the requests waiting, in order
    free_at: float  # when the device is free
    next_arrival: int
    first: int | None  # the size of the plan's first batch


class Clairvoyant:
    """The planner over one trace: ``arrivals`` (s, in order) and their ``deadlines`` (s), on
    the ``device`` a workload describes (its batch times, largest batch and response time)."""

    def __init__(self, device: Workload, arrivals: Sequence[float], deadlines: Sequence[float],
                 *, horizon_s: float, beam: int) -> None:
        self.device = device
        self.arrivals = list(arrivals)
        self.deadlines = list(deadlines)
        self.horizon_s = horizon_s
        self.beam = beam
        self.sizes = sorted({min(s, device.max_batch) for s in STEP_SIZES} | {device.max_batch})

    def run(self) -> int:
        """Requests on time when every batch is the first of a fresh plan."""
        now, nxt, pending, on_time = 0.0, 0, [], 0
        while nxt < len(self.arrivals) or pending:
            nxt = self._admit(pending, nxt, now)
            pending = self._alive(pending, now)
            if not pending:
                if nxt >= len(self.arrivals):
                    break
                now = self.arrivals[nxt]
                continue
            batch = self._batch(pending, now, self._plan(pending, now, nxt) or 1)
            if batch is None:  # nothing can be on time any more
                pending = []
                continue
            now, taken, pending = batch
            on_time += taken
        return on_time

    # -- one batch ------------------------------------------------------------------------------

    def _batch(self, pending: list[float], now: float, size: int
               ) -> tuple[float, int, list[float]] | None:
        """Up to ``size`` of the earliest deadlines that the batch's end still meets: (its end,
        how many it took, the rest), or None when none would be on time."""
        respond = self.device.response_s
        finish = now + self.device.batch_s(size)
        first = bisect.bisect_left(pending, finish + respond)
        count = min(size, len(pending) - first)
        if count <= 0:
            return None
        if count < size:  # a smaller batch ends sooner, so it may meet earlier deadlines
            finish = now + self.device.batch_s(count)
            first = bisect.bisect_left(pending, finish + respond)
            count = min(count, len(pending) - first)
        return finish, count, pending[:first] + pending[first + count:]

    def _admit(self, pending: list[float], nxt: int, until: float) -> int:
        while nxt < len(self.arrivals) and self.arrivals[nxt] <= until:
            bisect.insort(pending, self.deadlines[nxt])
            nxt += 1
        return nxt

    def _alive(self, pending: list[float], now: float) -> list[float]:
        """Without those that even a batch of one starting now would answer late."""
        return pending[bisect.bisect_left(
            pending, now + self.device.batch_s(1) + self.device.response_s):]

    def _full_batches(self, pending: list[float], start: float) -> int:
        """How many of ``pending`` back-to-back full batches from ``start`` serve on time."""
        served = 0
        while pending:
            batch = self._batch(pending, start, min(self.device.max_batch, len(pending)))
            if batch is None:
                break
            start, taken, pending = batch
            served += taken
        return served

    # -- the plan -------------------------------------------------------------------------------

    def _plan(self, pending: list[float], now: float, nxt: int) -> int | None:
        """The first batch size of the best plan found for the next ``horizon_s``."""
        end = now + self.horizon_s
        beam = [_Plan(0, pending, now, nxt, None)]
        finished: list[_Plan] = []
        while beam:
            children: list[_Plan] = []
            for plan in beam:
                if plan.free_at >= end or (not plan.pending
                                           and plan.next_arrival >= len(self.arrivals)):
                    finished.append(plan)
                else:
                    children.extend(self._steps(plan))
            scored = sorted(children, key=lambda p: (self._score(p, end), -p.free_at),
                            reverse=True)
            beam = scored[:self.beam]
        best = max(finished, key=lambda p: (self._score(p, end), -p.free_at), default=None)
        return None if best is None else best.first

    def _steps(self, plan: _Plan) -> list[_Plan]:
        if not plan.pending:  # idle until the next arrival
            pending: list[float] = []
            at = self.arrivals[plan.next_arrival]
            nxt = self._admit(pending, plan.next_arrival, at)
            return [_Plan(plan.on_time, pending, at, nxt, plan.first)]
        steps, seen = [], set()
        for size in self.sizes:
            batch = self._batch(plan.pending, plan.free_at, size)
            if batch is None or batch[1] in seen:
                continue
            seen.add(batch[1])
            finish, taken, rest = batch  # rest is a fresh list: arrivals go into it
            nxt = self._admit(rest, plan.next_arrival, finish)
            steps.append(_Plan(plan.on_time + taken, self._alive(rest, finish), finish, nxt,
                               size if plan.first is None else plan.first))
            if size >= len(plan.pending):
                break
        return steps

    def _score(self, plan: _Plan, end: float) -> int:
        """On time so far, and what full batches would serve of those waiting by ``end``."""
        pending = list(plan.pending)
        self._admit(pending, plan.next_arrival, max(plan.free_at, end))
        return plan.on_time + self._full_batches(pending, plan.free_at)


def compare(workload: Workload, load: float, horizon_s: float, beam: int,
            delays_us: list[int]) -> dict:
    """The fixed delay at its best, the deadline policy and the planner on one trace."""
    fixed = best_fixed(workload, load, delays_us)
    policy = simulate(workload, "deadline", True, load)
    arrivals, deadlines = trace(workload, load)
    planned = Clairvoyant(workload, arrivals.tolist(), deadlines.tolist(),
                          horizon_s=horizon_s, beam=beam).run()
    sent = len(arrivals)
    return {"load": load, "seed": workload.seed, "sent": sent,
            "fixed_best": round(fixed.on_time / sent, 4),
            "deadline_policy": round(policy.on_time / sent, 4),
            "clairvoyant": round(planned / sent, 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchgate.bench.deadline_bound", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loads", default="0.44", help="mean offered loads, × the capacity")
    parser.add_argument("--deadline-ms", default="100,300")
    parser.add_argument("--fixed-ms", type=float, default=20.6)
    parser.add_argument("--per-sample-ms", type=float, default=1.5)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--response-ms", type=float, default=1.0)
    parser.add_argument("--peak", type=float, default=2.5)
    parser.add_argument("--on-s", type=float, default=0.5)
    parser.add_argument("--off-s", type=float, default=1.5)
    parser.add_argument("--delays-us", default="0,1000,5000,20000")
    parser.add_argument("--horizon-ms", type=float, default=500.0)
    parser.add_argument("--beam", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = []
    for load in (float(x) for x in args.loads.split(",")):
        for seed in (int(s) for s in args.seeds.split(",")):
            workload = Workload(
                fixed_s=args.fixed_ms / 1e3, per_sample_s=args.per_sample_ms / 1e3,
                max_batch=args.max_batch,
                deadlines_s=tuple(float(ms) / 1e3 for ms in args.deadline_ms.split(",")),
                jitter=0.0, response_s=args.response_ms / 1e3, margin_s=args.response_ms / 1e3,
                peak=args.peak, on_s=args.on_s, off_s=args.off_s, seconds=args.seconds,
                seed=seed)
            rows.append(compare(workload, load, args.horizon_ms / 1e3, args.beam,
                                [int(d) for d in args.delays_us.split(",")]))
            print(f"[batchgate.bench.deadline_bound] load {load:g} seed {seed} done", file=sys.stderr,
                  flush=True)
    print(f"horizon {args.horizon_ms:g} ms, beam {args.beam}, {args.seconds:g} s per trace, "
          f"deadlines {args.deadline_ms} ms, no jitter, answers {args.response_ms:g} ms after "
          "their batch")
    print("| load | seed | sent | fixed delay at its best | deadline policy "
          "| clairvoyant planner |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['load']:g} | {r['seed']} | {r['sent']} | {r['fixed_best']:.2%} | "
              f"{r['deadline_policy']:.2%} | {r['clairvoyant']:.2%} |")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
