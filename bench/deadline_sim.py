"""The batch policies on a simulated clock: the same arrival trace through each, no noise.

``bench/deadline.py`` measures the policies through a real server, where a shared machine and a
Python load driver add their own noise. This runs the real ``ModelQueue`` (and ``Admission``)
on a fake clock instead: one executor whose batch of n takes ``fixed + per_sample × n`` ms
(times a seeded normal jitter; it runs a batch at its own size, as a CPU model without buckets
does, and its warm-up timed a batch of 1 and a full one), the bursty on/off arrivals
``batchgate bench`` sends (``batchgate.bench.deadline.burst_arrival``), each request with one of the
deadlines, queued requests expiring at their deadline as the server's timers do. So the policies' decisions are compared on identical traces, and a change to the
policy shows up here first. It is a model of the server, not a measurement of it: no figure
from here is quoted as a measurement (docs/benchmarks.md).

    python -m batchgate.bench.deadline_sim [--loads 0.3,0.45,0.6,0.9] [--deadline-ms 150[,300]]
                                 [--seeds 1,2,3] [--json F]

At each load it runs the fixed delay at its best (each of ``--delays-us``, admission control off
and on), at its best without admission control, and the deadline policy; then, from their mean
attainment over the seeds, it reads the target: where each baseline falls through
90 % (linearly between the two loads around it), what the deadline policy attains there.

Like ``batchgate.bench.inprocess`` it imports the batcher (and so torch); the rest of ``bench/`` does not.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from batchgate.batcher.admission import Admission
from batchgate.batcher.errors import AdmissionRefused, DeadlineInfeasible
from batchgate.batcher.profile import LatencyProfile
from batchgate.batcher.queue import ModelQueue
from batchgate.batcher.request import QUEUED, InferenceRequest
from batchgate.batcher.spec import BatchingConfig
from batchgate.bench.deadline import burst_arrival
from batchgate.bench.loadgen.arrivals import schedule



@dataclasses.dataclass(frozen=True)
class Workload:
    fixed_s: float = 0.020
    per_sample_s: float = 0.0015
    max_batch: int = 32
    deadlines_s: tuple[float, ...] = (0.150,)  # each request gets one, equally often
    jitter: float = 0.1  # relative standard deviation of a batch's time
    response_s: float = 0.0  # from a batch's end until its answers reach the clients
    margin_s: float = 0.0  # the profile's response margin (what the server keeps free for it)
    on_s: float = 0.5
    off_s: float = 1.5
    peak: float = 2.5
    seconds: float = 60.0
    seed: int = 1

    @property
    def capacity(self) -> float:
        return self.max_batch / (self.fixed_s + self.per_sample_s * self.max_batch)

    def batch_s(self, samples: int) -> float:
        return self.fixed_s + self.per_sample_s * samples


@dataclasses.dataclass
class Outcome:
    policy: str
    admission: bool
    load: float
    sent: int
    delay_us: int = 0
    on_time: int = 0
    late: int = 0  # ran, but finished after its deadline: device time spent for nothing
    expired: int = 0
    refused: int = 0
    infeasible: int = 0
    batches: int = 0
    samples: int = 0
    decide_s: float = 0.0  # wall-clock seconds spent in ModelQueue.next_batch (this process)

    def row(self, seconds: float) -> dict:
        return {
            "policy": self.policy, "admission": self.admission, "delay_us": self.delay_us,
            "load": self.load,
            "sent": self.sent, "attainment": round(self.on_time / self.sent, 4),
            "goodput_per_s": round(self.on_time / seconds, 1), "late": self.late,
            "expired": self.expired, "refused": self.refused, "infeasible": self.infeasible,
            "mean_batch": round(self.samples / max(self.batches, 1), 1),
            "decide_us_per_batch": round(self.decide_s / max(self.batches, 1) * 1e6, 1),
        }


class _Wait(Exception):
    """The queue would block: for ``timeout_s`` (None: until something arrives)."""

    def __init__(self, timeout_s: float | None) -> None:
        super().__init__(timeout_s)
        self.timeout_s = timeout_s


def _raise_wait(timeout_s: float | None, *, eager: bool) -> None:
    raise _Wait(timeout_s)


def trace(workload: Workload, load: float) -> tuple[np.ndarray, np.ndarray]:
    """The arrivals (s, in order) at ``load`` × capacity and each one's deadline (s): the
    trace every policy of one seed and load sees (``batchgate.bench.deadline_bound`` replays it too)."""
    w = workload
    arrival = burst_arrival(load * w.capacity, on_s=w.on_s, off_s=w.off_s, peak=w.peak)
    arrivals = schedule(arrival, np.random.default_rng(w.seed), start_s=0.0, duration_s=w.seconds)
    budgets = np.random.default_rng([w.seed, 1]).choice(w.deadlines_s, size=len(arrivals))
    return arrivals, arrivals + budgets


def simulate(workload: Workload, policy: str, admission: bool, load: float,
             delay_us: int = 0) -> Outcome:
    """One executor serving the trace at ``load`` × capacity under ``policy``, with a
    ``max_queue_delay_microseconds`` of ``delay_us``."""
    w = workload
    arrivals, deadlines = trace(w, load)
    rng = np.random.default_rng(w.seed)
    now = [0.0]
    dropped: list[InferenceRequest] = []
    # The simulated model runs a batch at its own size, as a CPU model without buckets does;
    # its warm-up times a batch of 1 and a full one (batchgate.batcher.model.default_warmup).
    profile = LatencyProfile(w.max_batch, padded=False, response_margin_s=w.margin_s)
    for size in (1, w.max_batch):
        profile.record(size, w.batch_s(size))
    queue = ModelQueue(BatchingConfig(max_batch_size=w.max_batch, policy=policy,
                                      max_queue_delay_us=delay_us),
                       clock=lambda: now[0], profile=profile, on_infeasible=dropped.extend)
    # Where the server's executor would block on the queue's condition, the simulation moves
    # its clock on instead: to the end of the wait or the next arrival, whichever is first.
    queue._wait = _raise_wait  # type: ignore[method-assign]
    door = (Admission("sim", profile, max_batch=w.max_batch, instances=1,
                      include_own=policy == "deadline") if admission else None)
    out = Outcome(policy, admission, load, len(arrivals), delay_us=delay_us)
    x = np.zeros((1, 1), np.float32)
    waiting: list[InferenceRequest] = []
    next_arrival = 0
    running = (0.0, 0.0, 0)  # the executor's batch: start, end, samples

    def in_flight(at: float) -> tuple[float, float]:
        """Admission's view of the running batch, as the server's (``_inflight_work_s``): its
        mean time less its run, and its squared deviation."""
        start, end, samples = running
        if at >= end:
            return 0.0, 0.0
        return (max(0.0, (profile.mean(samples) or 0.0) - (at - start)),
                (profile.deviation(samples) or 0.0) ** 2)

    def arrive(until: float) -> None:
        nonlocal next_arrival
        while next_arrival < len(arrivals) and arrivals[next_arrival] <= until:
            now[0] = at = float(arrivals[next_arrival])
            next_arrival += 1
            request = InferenceRequest([x], deadline=float(deadlines[next_arrival - 1]))
            request.level, request.arrival = 1, at
            if door is not None:
                try:
                    left_s, variance = in_flight(at)
                    door.check(batch_size=1, deadline=request.deadline, now=at,
                               samples_ahead=queue.samples_ahead(1, request),
                               in_flight_s=left_s, in_flight_var=variance)
                except (AdmissionRefused, DeadlineInfeasible):
                    out.refused += 1
                    continue
            queue.put(request)
            if door is not None:
                door.queued(1, at)
            waiting.append(request)

    clock = 0.0
    while next_arrival < len(arrivals) or queue.depth:
        arrive(clock)
        now[0] = clock
        for request in waiting:  # the server's deadline timers
            if request.deadline < clock and queue.remove(request):
                out.expired += 1
        waiting[:] = [r for r in waiting if r.state == QUEUED]
        if not queue.depth:
            if next_arrival >= len(arrivals):
                break
            clock = float(arrivals[next_arrival])
            continue
        asked = time.perf_counter()
        try:
            batch, _ = queue.next_batch()
        except _Wait as wait:
            out.decide_s += time.perf_counter() - asked
            clock = min(clock + wait.timeout_s if wait.timeout_s is not None else math.inf,
                        float(arrivals[next_arrival]) if next_arrival < len(arrivals) else math.inf)
            if math.isinf(clock):
                break
            continue
        out.decide_s += time.perf_counter() - asked
        samples = sum(r.batch_size for r in batch)
        took = max(w.batch_s(samples) * (1 + w.jitter * rng.standard_normal()), 1e-4)
        profile.record(samples, took)
        running = (clock, clock + took, samples)
        arrive(clock + took)
        clock += took
        out.batches += 1
        out.samples += samples
        for request in batch:
            if clock + w.response_s <= request.deadline:
                out.on_time += 1
            else:
                out.late += 1
    out.infeasible = len(dropped)
    return out


def fixed_trials(workload: Workload, load: float, delays_us: list[int]) -> list[Outcome]:
    """The fixed delay at this load with each delay, admission control off and on."""
    return [simulate(workload, "fifo", admission, load, delay)
            for delay in delays_us for admission in (False, True)]


def best_of(trials: list[Outcome]) -> Outcome:
    """The trial with the most requests on time (the shorter delay on ties)."""
    return max(trials, key=lambda o: (o.on_time, -o.delay_us))


def best_fixed(workload: Workload, load: float, delays_us: list[int]) -> Outcome:
    """The fixed delay at its best settings for this load: each delay, admission off and on."""
    return best_of(fixed_trials(workload, load, delays_us))


def at_target(loads: list[float], baseline: list[float], policy: list[float],
              target: float = 0.9) -> tuple[float, float] | None:
    """(load, the policy's attainment there) where ``baseline`` (attainment per load, loads
    ascending) first falls to ``target``, both read linearly between the two loads around it;
    None if it never falls from at or above the target to below it over ``loads``."""
    for i in range(1, len(loads)):
        if baseline[i - 1] >= target > baseline[i]:
            share = (baseline[i - 1] - target) / (baseline[i - 1] - baseline[i])
            return (loads[i - 1] + share * (loads[i] - loads[i - 1]),
                    policy[i - 1] + share * (policy[i] - policy[i - 1]))
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchgate.bench.deadline_sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loads", default="0.3,0.45,0.6,0.9",
                        help="mean offered loads, × the capacity at the largest batch")
    parser.add_argument("--deadline-ms", default="150",
                        help="each request's deadline; a list (100,300) mixes them equally")
    parser.add_argument("--fixed-ms", type=float, default=20.0)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--jitter", type=float, default=0.1,
                        help="relative standard deviation of a batch's time")
    parser.add_argument("--response-ms", type=float, default=0.0,
                        help="from a batch's end until its answers reach the clients")
    parser.add_argument("--margin-ms", type=float, default=0.0,
                        help="the models' response_margin_ms")
    parser.add_argument("--per-sample-ms", type=float, default=1.5)
    parser.add_argument("--peak", type=float, default=2.5)
    parser.add_argument("--on-s", type=float, default=0.5)
    parser.add_argument("--off-s", type=float, default=1.5)
    parser.add_argument("--delays-us", default="0,1000,5000,20000",
                        help="max_queue_delay_microseconds tried for the fixed delay")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--seeds", default="",
                        help="several seeds (e.g. 1,2,3), instead of --seed: each load runs "
                             "each, and the 90 %% points are read from their mean")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    workload = Workload(fixed_s=args.fixed_ms / 1e3, per_sample_s=args.per_sample_ms / 1e3,
                        deadlines_s=tuple(float(ms) / 1e3 for ms in args.deadline_ms.split(",")),
                        peak=args.peak, on_s=args.on_s,
                        off_s=args.off_s, seconds=args.seconds, seed=args.seed,
                        max_batch=args.max_batch, jitter=args.jitter,
                        response_s=args.response_ms / 1e3, margin_s=args.margin_ms / 1e3)
    delays = [int(d) for d in args.delays_us.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [args.seed]
    loads = [float(x) for x in args.loads.split(",")]
    rows = []
    # Mean attainment per load over the seeds: the fixed delay at its best, at its best
    # without admission control, the deadline policy.
    means: dict[str, list[float]] = {"fixed": [], "no_admission": [], "deadline": []}
    for load in loads:
        got = {key: 0.0 for key in means}
        for seed in seeds:
            w = dataclasses.replace(workload, seed=seed)
            trials = fixed_trials(w, load, delays)
            fixed = best_of(trials)
            lazy = best_of([t for t in trials if not t.admission])
            deadline = simulate(w, "deadline", True, load)
            rows.append(dict(fixed.row(w.seconds), seed=seed))
            if lazy is not fixed:
                rows.append(dict(lazy.row(w.seconds), seed=seed))
            rows.append(dict(deadline.row(w.seconds), seed=seed))
            for key, outcome in (("fixed", fixed), ("no_admission", lazy),
                                 ("deadline", deadline)):
                got[key] += outcome.on_time / outcome.sent / len(seeds)
        for key in means:
            means[key].append(got[key])
    print(f"capacity {workload.capacity:.0f}/s, seeds {seeds}, "
          f"{dict(dataclasses.asdict(workload), seed=None)}")
    print("| policy | admission | delay µs | seed | load | attainment | goodput/s | late "
          "| expired | refused | infeasible | mean batch | µs per batch decision |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['admission']} | {r['delay_us']} | {r['seed']} | "
              f"{r['load']:g} | {r['attainment']:.1%} | {r['goodput_per_s']} | {r['late']} | "
              f"{r['expired']} | {r['refused']} | {r['infeasible']} | {r['mean_batch']} | "
              f"{r['decide_us_per_batch']} |")
    verdicts = {}
    for key, against in (("fixed", "the fixed delay at its best"),
                         ("no_admission", "the fixed delay without admission control")):
        found = at_target(loads, means[key], means["deadline"])
        verdicts[key] = None if found is None else {"load": found[0], "deadline": found[1]}
        print(f"against {against} (mean of the seeds): " + (
            "it does not fall through 90 % over --loads" if found is None else
            f"90 % at {found[0]:.3f} × capacity, the deadline policy {found[1]:.1%} there "
            f"(read linearly between the loads around it)"))
    if args.json:
        args.json.write_text(json.dumps({"workload": dataclasses.asdict(workload),
                                         "seeds": seeds, "rows": rows,
                                         "mean_attainment": dict(means, loads=loads),
                                         "at_90": verdicts}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
