"""bench/deadline.py and bench/deadline_sim.py work: arrivals, figures, the stand-in driver
against a real server, and the policies on a simulated clock. No timing is asserted: figures
are for ``python -m bench.deadline`` to report."""

from __future__ import annotations

import numpy as np
import pytest

from bench.deadline import LoadSpec, Record, bursty_offsets, drive_open_loop, summarize
from bench.deadline_sim import Workload, simulate


def test_bursty_arrivals_average_the_mean_rate_and_burst_at_the_peak():
    offsets = bursty_offsets(200.0, 40.0, on_s=0.5, off_s=1.5, peak=2.5, seed=3)
    assert np.all(np.diff(offsets) >= 0) and offsets[-1] < 40.0
    assert len(offsets) == pytest.approx(200 * 40, rel=0.05)
    in_bursts = np.count_nonzero(offsets % 2.0 < 0.5)
    assert in_bursts == pytest.approx(2.5 * 200 * 0.5 * 20, rel=0.05)
    with pytest.raises(ValueError, match="exceeds a whole cycle"):
        bursty_offsets(200.0, 10.0, on_s=0.5, off_s=1.5, peak=5.0)


def test_attainment_and_goodput_count_only_answers_within_the_deadline():
    records = [
        Record(0.5, 0.010, "OK"),  # warm-up: left out
        Record(1.0, 0.010, "OK"),
        Record(1.1, 0.060, "OK"),  # answered, but late
        Record(1.2, 0.001, "RESOURCE_EXHAUSTED"),
        Record(1.3, 0.050, "DEADLINE_EXCEEDED"),
    ]
    result = summarize(records, deadline_s=0.05, warmup_s=1.0, seconds=3.0, policy="p",
                       load=1.0, rate=10.0, server={})
    assert (result.sent, result.attained) == (4, 1)
    assert result.attainment == 0.25 and result.goodput == 0.5
    assert result.codes == {"OK": 2, "RESOURCE_EXHAUSTED": 1, "DEADLINE_EXCEEDED": 1}


def test_the_open_loop_driver_sends_every_request_and_records_each_answer(server):
    x = np.random.default_rng(0).standard_normal((1, 512), dtype=np.float32)
    offsets = np.linspace(0.0, 0.2, 20)
    records = drive_open_loop(LoadSpec(server.address, "mlp", {"INPUT__0": x}, offsets, 30.0))
    assert sorted(r.offset_s for r in records) == pytest.approx(list(offsets))
    assert {r.code for r in records} == {"OK"}


def test_the_deadline_policy_never_runs_a_request_that_finishes_late():
    # Batch times exactly as profiled (no jitter): every batch the deadline policy runs meets
    # the deadline of each request in it, on a trace where FIFO finishes many late.
    workload = Workload(jitter=0.0, seconds=20.0)
    fifo = simulate(workload, "fifo", False, 0.6)
    deadline = simulate(workload, "deadline", True, 0.6)
    assert fifo.late > 0
    assert deadline.late == 0
    assert deadline.on_time > fifo.on_time
    assert deadline.sent == fifo.sent
    assert deadline.on_time + deadline.expired + deadline.refused + deadline.infeasible == deadline.sent
