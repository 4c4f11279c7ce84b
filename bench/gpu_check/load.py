"""(c)'s load on the gateway, through the project's load generator (``batchgate.bench.loadgen``).

One closed-loop step: a short warm-up (not measured), then ``seconds`` measured, from spawned
worker processes (the gateway runs in this process: the client's Python work must not share
its interpreter). Requests are the model's inputs as the server describes them, serialized
once; each record's latency and status come back to ``batchgate.bench.loadgen.stats``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import grpc
import numpy as np

from batchgate.bench.loadgen import plan, stats
from batchgate.bench.loadgen.driver import STEP_LEAD_S, DriverConfig, Workers
from batchgate.bench.loadgen.workload import DataOptions, build_variants, describe_models

CONNECT_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 30.0


@dataclasses.dataclass(frozen=True)
class ClosedLoop:
    """``concurrency`` requests in flight over ``processes`` workers, one sample each."""

    concurrency: int
    processes: int
    seconds: float
    warmup_s: float
    int_high: int  # integer inputs are drawn below this (token ids)
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class LoadResult:
    figures: dict[str, Any]  # ``stats.summarize``'s figures of the measured time
    window: tuple[float, float]  # the measured time on the monotonic clock, for NVML samples

    @property
    def ok(self) -> int:
        return int(self.figures["ok"])

    @property
    def errors(self) -> int:
        return sum(self.figures["errors"].values())

    @property
    def first_error(self) -> str:
        """The commonest error's status name, "" with none (the driver keeps only codes)."""
        errors = self.figures["errors"]
        return max(errors, key=errors.get) if errors else ""

    @property
    def samples_per_s(self) -> float:
        return self.figures["samples_per_s"] or 0.0

    def latency_ms(self, name: str) -> float:
        value = self.figures["latency_ms"][name]
        return float("nan") if value is None else value


def closed_loop(address: str, model: str, load: ClosedLoop) -> LoadResult:
    """Run ``load`` against ``model`` at ``address`` and return its figures."""
    options = DataOptions(batch=1, int_range=(0, load.int_high), seed=load.seed)
    with grpc.insecure_channel(address) as channel:
        grpc.channel_ready_future(channel).result(timeout=CONNECT_TIMEOUT_S)
        described = describe_models(channel, [model], options)
    variants = build_variants(described, (), options)
    (step,) = plan.build_steps(plan.RunShape(
        levels=[plan.LoadLevel(concurrency=load.concurrency)], targets=1,
        warmup_s=load.warmup_s, duration_s=load.seconds, requests=None, slice_s=load.seconds,
        variant_weights=np.full(len(variants), 1.0 / len(variants)), seed=load.seed))
    config = DriverConfig(urls=(address,), payloads=tuple(v.payload for v in variants),
                          call_timeout_s=CALL_TIMEOUT_S, connect_timeout_s=CONNECT_TIMEOUT_S)
    with Workers(config, load.processes, in_process=False) as workers:
        origin = time.monotonic() + STEP_LEAD_S
        records = workers.run_step(step, origin)
    figures = stats.summarize(
        stats.merge(records, 0), deadline_s=None,
        samples=np.array([v.samples for v in variants]), models=[model],
        variant_model=np.array([v.model for v in variants]), priorities=[0],
        variant_priority=np.array([v.priority for v in variants]))
    start = origin + load.warmup_s
    return LoadResult(figures, (start, start + load.seconds))
