"""The deadline batch policy, the latency profile, admission control and device sharing.

Deterministic: the queue, the profile and the device share run on a fake clock; profiles are
given, not measured; models are fake callables held by gates. Nothing here asserts a duration.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from batchgate.batcher.admission import Admission, RecentArrivals
from batchgate.batcher.deadline_search import DeadlineSearch
from batchgate.batcher.device_share import DeviceShare, DeviceTurns
from batchgate.batcher.errors import (
    AdmissionRefused,
    DeadlineExceeded,
    DeadlineInfeasible,
    ModelUnavailable,
    RequestCancelled,
)
from batchgate.batcher.metrics import BatcherMetrics
from batchgate.batcher.model import ServedModel
from batchgate.batcher.profile import LatencyProfile, size_classes
from batchgate.batcher.queue import ModelQueue
from batchgate.batcher.request import QUEUED, REMOVED
from batchgate.batcher.spec import BatchingConfig
from tests.support.polling import apoll, poll
from tests.support.batching import RecordingModel, hold_executor, make_spec, request

NOW = 100.0


class FakeClock:
    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def profile_of(times: dict[int, float], max_batch: int = 8) -> LatencyProfile:
    """A profile whose buckets took exactly ``times`` (so p99 == mean)."""
    profile = LatencyProfile(max_batch)
    for size, seconds in times.items():
        profile.record(size, seconds)
    return profile


def deadline_queue(clock: FakeClock, profile: LatencyProfile | None = None, dropped=None,
                   **batching) -> ModelQueue:
    batching.setdefault("max_batch_size", 8)
    config = BatchingConfig(policy="deadline", **batching)
    on_infeasible = dropped.extend if dropped is not None else None
    return ModelQueue(config, clock=clock, profile=profile, on_infeasible=on_infeasible)


def put(queue: ModelQueue, clock: FakeClock, value: float, *, deadline: float | None = None,
        level: int = 1, rows: int = 1):
    """Queue a request arriving now; ``deadline`` is in seconds from now."""
    r = request(value, rows=rows, deadline=None if deadline is None else clock.now + deadline)
    r.level = level
    r.arrival = clock.now
    queue.put(r)
    return r


def values(batch) -> list[float]:
    return [float(r.inputs[0][0, 0]) for r in batch]


# -- the latency profile -------------------------------------------------------------------------

def test_profile_keeps_an_ewma_of_mean_and_deviation_per_bucket():
    profile = LatencyProfile(8)
    assert profile.buckets == (1, 2, 4, 8)
    assert profile.mean(1) is None and profile.p99(1) is None and not profile.measured
    profile.record(1, 1.0)
    assert profile.mean(1) == pytest.approx(1.0) and profile.p99(1) == pytest.approx(1.0)
    profile.record(1, 2.0)
    # mean += 0.1 * (2 - 1); deviation += 0.1 * (1 - 0); p99 = mean + 3 deviations
    assert profile.mean(1) == pytest.approx(1.1)
    assert profile.p99(1) == pytest.approx(1.1 + 3 * 0.1)
    assert profile.record(3, 2.0) == 4  # the class it updated: bucket 4
    assert profile.mean(3) == profile.mean(4) == pytest.approx(2.0)
    assert profile.snapshot()[4] == (pytest.approx(2.0), pytest.approx(2.0), 1)
    assert profile.measured_class(4) == (pytest.approx(2.0), pytest.approx(2.0))
    assert profile.measured_class(2) is None  # measured classes only, nothing borrowed
    assert profile.record(1, -1.0) is None  # a negative time is ignored


def test_profile_optimistic_time_is_one_deviation_below_the_mean():
    profile = profile_of({1: 1.0})
    profile.record(1, 2.0)  # mean 1.1, deviation 0.1
    assert profile.optimistic(1) == pytest.approx(1.0)
    assert LatencyProfile(4).optimistic(1) is None


def test_profile_borrows_from_measured_neighbours():
    profile = profile_of({4: 2.0}, max_batch=16)
    assert profile.mean(2) == pytest.approx(2.0)  # a larger bucket's time bounds a smaller one
    assert profile.mean(8) == pytest.approx(4.0)  # scaled linearly from the largest smaller one
    assert profile.mean(16) == pytest.approx(8.0)
    assert profile.mean(100) == pytest.approx(8.0)  # clamped to the largest bucket


def test_unpadded_size_classes_are_every_size_to_16_then_an_eighth_apart():
    assert size_classes(32) == (*range(1, 17), 18, 21, 24, 27, 31, 32)
    assert size_classes(1) == (1,) and size_classes(17) == tuple(range(1, 18))
    assert len(size_classes(256)) == 39
    assert LatencyProfile(32, padded=False).buckets == size_classes(32)
    with pytest.raises(ValueError, match="max_batch"):
        size_classes(0)


def test_unpadded_profile_interpolates_between_the_sizes_it_measured():
    # What a warm-up of an unpadded model measures: a batch of 1 and a full one.
    profile = LatencyProfile(32, padded=False)
    profile.record(1, 0.0215)
    profile.record(32, 0.068)
    # A model whose batch of n takes 20 + 1.5 n ms is predicted exactly at every size.
    for n in (2, 5, 16, 22, 31):
        assert profile.mean(n) == pytest.approx(0.020 + 0.0015 * n)
    # Padded, the same measurements give every size above 1 the full batch's time.
    padded = LatencyProfile(32)
    padded.record(1, 0.0215)
    padded.record(32, 0.068)
    assert padded.mean(17) == padded.mean(2) == pytest.approx(0.068)


def test_unpadded_profile_bounds_sizes_outside_what_it_measured():
    profile = LatencyProfile(32, padded=False)
    profile.record(8, 2.0)
    profile.record(8, 2.0)
    assert profile.mean(1) == pytest.approx(2.0)  # no smaller batch measured: no less time
    assert profile.mean(16) == pytest.approx(4.0)  # scaled linearly from the largest measured
    assert profile.mean(100) == pytest.approx(8.0)  # clamped to max_batch


def test_unpadded_class_interpolates_from_the_mean_size_it_saw():
    profile = LatencyProfile(32, padded=False, alpha=0.5)
    profile.record(1, 1.0)
    profile.record(19, 19.0)  # class 21 (19 to 21), seen at 19
    assert profile.mean(10) == pytest.approx(10.0)
    profile.record(21, 23.0)  # its mean size moves to 20 and its mean time to 21
    assert profile.mean(10) == pytest.approx(1.0 + (10 - 1) * (21.0 - 1.0) / (20 - 1))
    assert profile.snapshot()[21][2] == 2


def test_a_class_spanning_several_sizes_does_not_count_their_difference_as_spread():
    """Class 21 holds batches of 19 to 21: a model that takes exactly 20 + 1.5 n ms has no
    spread there, though its batches of 19 and 21 differ by 3 ms."""
    profile = LatencyProfile(32, padded=False, alpha=0.5)
    for size in (16, 24):
        profile.record(size, 0.020 + 0.0015 * size)
    for size in (19, 21) * 20:
        profile.record(size, 0.020 + 0.0015 * size)
    mean, p99 = profile.measured_class(21)
    assert p99 - mean == pytest.approx(0.0, abs=1e-9)
    assert profile.p99(20) == pytest.approx(0.050, abs=2e-4)
    # Real spread still counts: the same sizes, every batch of 21 now 1 ms slow.
    for size in (19, 21) * 20:
        profile.record(size, 0.020 + 0.0015 * size + (0.001 if size == 21 else 0.0))
    mean, p99 = profile.measured_class(21)
    assert p99 - mean > 0.001


def test_an_unpadded_profile_lets_the_batch_fall_between_powers_of_two():
    clock = FakeClock()
    profile = LatencyProfile(32, padded=False)
    profile.record(1, 0.0215)
    profile.record(32, 0.068)  # a batch of n: 20 + 1.5 n ms
    q = deadline_queue(clock, profile, max_batch_size=32)
    for i in range(32):
        put(q, clock, float(i), deadline=0.055)
    # 21 samples take 51.5 ms and 24 take 56 ms: the largest class meeting 55 ms is 21,
    # where power-of-two classes would stop at 16.
    assert len(q.next_batch()[0]) == 21


def test_margin_is_the_response_margin_plus_the_measured_delivery_p99():
    profile = LatencyProfile(8, response_margin_s=0.002)
    assert profile.margin() == pytest.approx(0.002)  # nothing delivered yet
    profile.record_delivery(0.001)
    assert profile.margin() == pytest.approx(0.003)
    profile.record_delivery(0.002)  # mean 0.0011, deviation 0.0001
    assert profile.margin() == pytest.approx(0.002 + 0.0011 + 3 * 0.0001)
    with pytest.raises(ValueError, match="response_margin_s"):
        LatencyProfile(8, response_margin_s=-1.0)


# -- EDF order ---------------------------------------------------------------------------------

def test_earliest_deadline_first_within_a_level_levels_first():
    clock = FakeClock()
    q = deadline_queue(clock, max_batch_size=1, priority_levels=2)
    put(q, clock, 1.0, deadline=1.0, level=2)
    put(q, clock, 2.0, deadline=9.0)
    put(q, clock, 3.0, deadline=5.0)
    put(q, clock, 4.0)  # no deadline: after every request that has one
    put(q, clock, 5.0, deadline=5.0)  # same deadline as 3.0: arrival order
    order = [values(q.next_batch()[0])[0] for _ in range(5)]
    assert order == [3.0, 5.0, 2.0, 4.0, 1.0]


def test_a_batch_is_gathered_in_deadline_order():
    clock = FakeClock()
    q = deadline_queue(clock)
    for value, deadline in [(1.0, 5.0), (2.0, 3.0), (3.0, 9.0), (4.0, 4.0), (5.0, None)]:
        put(q, clock, value, deadline=deadline)
    batch, reason = q.next_batch()
    assert values(batch) == [2.0, 4.0, 1.0, 3.0, 5.0] and reason == "idle"


def test_slo_orders_requests_without_their_own_deadline():
    clock = FakeClock()
    q = deadline_queue(clock, max_batch_size=1, slo_ms=2000)
    put(q, clock, 1.0)  # SLO: due at NOW + 2
    put(q, clock, 2.0, deadline=3.0)
    put(q, clock, 3.0, deadline=1.0)
    assert [values(q.next_batch()[0])[0] for _ in range(3)] == [3.0, 1.0, 2.0]


def test_fifo_stays_arrival_order():
    clock = FakeClock()
    q = ModelQueue(BatchingConfig(max_batch_size=8), clock=clock)
    for value, deadline in [(1.0, 5.0), (2.0, 3.0), (3.0, None)]:
        put(q, clock, value, deadline=deadline)
    assert values(q.next_batch()[0]) == [1.0, 2.0, 3.0]


# -- infeasible drops ------------------------------------------------------------------------------

def test_a_request_that_cannot_meet_its_deadline_alone_is_dropped_before_running():
    clock = FakeClock()
    dropped: list = []
    q = deadline_queue(clock, profile_of({1: 2.0}), dropped, max_batch_size=1)
    late = put(q, clock, 1.0, deadline=1.5)  # needs 2 s alone
    put(q, clock, 2.0, deadline=10.0)
    put(q, clock, 3.0)
    batch, _ = q.next_batch()
    assert values(batch) == [2.0]
    assert dropped == [late] and late.state == REMOVED
    assert q.depth == 1 and q.samples_ahead(1) == 1


def test_a_request_with_only_an_slo_is_never_dropped():
    clock = FakeClock()
    dropped: list = []
    q = deadline_queue(clock, profile_of({1: 2.0}), dropped, max_batch_size=1, slo_ms=500)
    put(q, clock, 1.0)
    assert values(q.next_batch()[0]) == [1.0] and dropped == []


def test_infeasible_requests_met_while_gathering_are_dropped_too():
    clock = FakeClock()
    dropped: list = []
    q = deadline_queue(clock, profile_of({1: 1.0, 4: 1.0}), dropped, slo_ms=100)
    put(q, clock, 1.0)  # scheduled by the SLO (0.1 s), which is no hard deadline
    hopeless = put(q, clock, 2.0, deadline=0.5, rows=4)  # 4 rows take 1 s
    put(q, clock, 3.0)
    assert values(q.next_batch()[0]) == [1.0, 3.0]
    assert dropped == [hopeless] and q.depth == 0


# -- the batch size chosen against the profile ----------------------------------------------------

def test_the_batch_is_the_largest_whose_p99_meets_its_earliest_deadline():
    clock = FakeClock()
    q = deadline_queue(clock, profile_of({1: 1.0, 2: 1.5, 4: 2.0, 8: 4.0}))
    for i in range(8):
        put(q, clock, float(i), deadline=3.0)
    batch, reason = q.next_batch()
    # 4 samples take 2 s (done at NOW + 2 <= NOW + 3); 5..8 fall in bucket 8: 4 s, too late.
    assert (len(batch), reason) == (4, "full")
    assert len(q.next_batch()[0]) == 4


def test_the_margin_comes_off_every_deadline_when_sizing_and_dropping():
    clock = FakeClock()
    profile = profile_of({1: 1.0, 2: 1.5, 4: 2.0, 8: 4.0})
    profile.response_margin_s = 1.5
    dropped: list = []
    q = deadline_queue(clock, profile, dropped)
    for i in range(8):
        put(q, clock, float(i), deadline=3.0)
    # 4 samples would end at 2 s, but their answers need 1.5 s more: only 2 (1.5 s) fit.
    assert len(q.next_batch()[0]) == 2
    clock.advance(1.0)  # 2 s left for the rest: even alone (1 s) + 1.5 s is too late
    put(q, clock, 99.0)  # no deadline
    assert values(q.next_batch()[0]) == [99.0]
    assert len(dropped) == 6 and q.depth == 0


def test_a_tight_deadline_keeps_the_batch_small():
    clock = FakeClock()
    q = deadline_queue(clock, profile_of({1: 1.0, 2: 1.5, 4: 2.0, 8: 4.0}))
    put(q, clock, 0.0, deadline=1.6)
    for i in range(1, 6):
        put(q, clock, float(i), deadline=10.0)
    assert values(q.next_batch()[0]) == [0.0, 1.0]  # 2 take 1.5 s; 3 would take 2 s
    assert values(q.next_batch()[0]) == [2.0, 3.0, 4.0, 5.0]


def test_a_tight_head_does_not_shrink_the_batch_when_that_would_lose_more_behind_it():
    clock = FakeClock()
    q = deadline_queue(clock, profile_of({1: 1.0, 2: 1.0, 4: 1.0, 8: 2.0}))
    head = put(q, clock, 0.0, deadline=1.5)  # only a batch of up to 4 finishes in time for it
    for i in range(1, 12):
        put(q, clock, float(i), deadline=2.5)
    # Batches of 1..4 would serve the head, and then none of the next 8 could make 2.5 s.
    batch, _ = q.next_batch()
    assert values(batch) == [float(i) for i in range(1, 9)] and head not in batch
    # The head was not dropped: it still fits alone, and now goes with the rest.
    assert values(q.next_batch()[0]) == [0.0, 9.0, 10.0, 11.0]


def test_a_tight_head_is_served_when_the_loose_requests_behind_it_can_wait():
    clock = FakeClock()
    q = deadline_queue(clock, profile_of({1: 1.0, 2: 1.5, 4: 2.0}, max_batch=4),
                       max_batch_size=4)
    put(q, clock, 0.0, deadline=1.6)  # only a batch of up to 2 finishes in time for it
    for i in range(1, 8):
        put(q, clock, float(i), deadline=10.0)
    # A full batch now serves 4 and the next full one 4 more, against 2 + 4 for a batch of 2:
    # judged over two batches the head would lose. But the loose 7 all make 10 s in later
    # batches either way, so the batch of 2 loses nobody and the full one loses the head.
    assert values(q.next_batch()[0]) == [0.0, 1.0]


@settings(max_examples=300, deadline=None)
@given(deadlines=st.lists(st.floats(0.0, 0.3), min_size=1, max_size=40),
       per_sample=st.floats(0.0, 0.01), jitter=st.floats(0.0, 0.005),
       padded=st.booleans(), limit=st.sampled_from([4, 8, 16]))
def test_the_bisecting_choice_matches_composing_every_batch(deadlines, per_sample, jitter,
                                                            padded, limit):
    """In deadline order (one priority level), ``best_batch`` bisects; it must choose as
    composing and weighing every batch does."""
    clock = FakeClock()
    profile = LatencyProfile(16, padded=padded, alpha=0.5)
    for size in (1, 4, 16):
        profile.record(size, 0.01 + per_sample * size)
        profile.record(size, 0.01 + per_sample * size + jitter)
    q = deadline_queue(clock, profile, max_batch_size=16)
    candidates = [(clock.now + d, put(q, clock, float(i), deadline=d))
                  for i, d in enumerate(sorted(deadlines))]
    search = DeadlineSearch(profile)
    assert search.best_batch(candidates, limit, clock.now) == search.best_batch_composed(
        candidates, limit, clock.now)


def test_a_deadline_batch_takes_only_requests_shaped_as_its_head():
    clock = FakeClock()
    q = deadline_queue(clock, profile_of({1: 0.01, 8: 0.02}))
    narrow = [put(q, clock, float(i), deadline=1.0 + i) for i in range(3)]
    wide = request(9.0, width=3, deadline=clock.now + 0.5)  # earliest, but another shape
    wide.level, wide.arrival = 1, clock.now
    q.put(wide)
    assert q.next_batch()[0] == [wide]
    assert q.next_batch()[0] == narrow
    assert q.depth == 0


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "put", "put", "take", "remove"]),
                              st.floats(0.0, 2.0), st.integers(1, 2), st.integers(1, 3),
                              st.booleans()), min_size=1, max_size=60))
def test_deadline_levels_stay_consistent_through_any_puts_takes_and_removes(ops):
    """Batches are taken from the front of a level in one slice, or filtered out of it when
    they are not its front; either way each level holds exactly its queued requests, sorted,
    and the counts agree."""
    clock = FakeClock()
    dropped: list = []
    q = deadline_queue(clock, profile_of({1: 0.2, 2: 0.25, 4: 0.3, 8: 0.4}), dropped,
                       priority_levels=2)
    queued: list = []
    for op, seconds, level, rows, wide in ops:
        clock.advance(0.05)
        if op == "put":
            r = request(seconds, rows=rows, width=3 if wide else 2,
                        deadline=clock.now + seconds)
            r.level, r.arrival = level, clock.now
            q.put(r)
            queued.append(r)
        elif op == "remove" and queued:
            q.remove(queued[int(seconds * 10) % len(queued)])
        elif op == "take" and any(r.deadline >= clock.now + 0.5 for r in queued):
            # Something every batch size (at most 0.4 s) still serves: next_batch won't block.
            batch, _ = q.next_batch()
            assert batch and len({r.shape_key for r in batch}) == 1
            assert sum(r.batch_size for r in batch) <= 8
        queued = [r for r in queued if r.state == QUEUED]
        live = [entry for level in q._levels for entry in level.entries()]
        assert sorted(id(e[2]) for e in live) == sorted(id(r) for r in queued)
        for index, level in enumerate(q._levels):
            entries = level.entries()
            assert entries == sorted(entries, key=lambda e: (e[0], e[1]))
            assert len(entries) == q._level_counts[index]
            assert sum(e[2].batch_size for e in entries) == q._level_samples[index]
        assert q.depth == len(queued)


def test_spare_room_takes_a_request_that_only_a_quick_run_would_serve():
    clock = FakeClock()
    profile = profile_of({1: 1.0, 2: 1.0})
    for size in (1, 2):
        profile.record(size, 2.0)  # mean 1.1, p99 1.4, optimistic 1.0
    dropped: list = []
    q = deadline_queue(clock, profile, dropped, max_batch_size=2)
    hopeless = put(q, clock, 0.0, deadline=0.9)  # even a quick run (1.0 s) misses: dropped
    hopeful = put(q, clock, 1.0, deadline=1.2)  # the p99 (1.4 s) misses, a quick run does not
    put(q, clock, 2.0, deadline=5.0)
    batch, _ = q.next_batch()
    assert values(batch) == [2.0, 1.0] and hopeful in batch
    assert dropped == [hopeless]


def test_a_batch_already_late_for_its_slo_is_sized_for_throughput():
    clock = FakeClock()
    q = deadline_queue(clock, profile_of({1: 1.0, 8: 4.0}), slo_ms=500)
    for i in range(6):
        put(q, clock, float(i))  # SLO 0.5 s, which even one sample (1 s) misses
    assert len(q.next_batch()[0]) == 6


def test_no_profile_means_fifo_sized_batches_in_deadline_order():
    clock = FakeClock()
    q = deadline_queue(clock)
    for i in range(10):
        put(q, clock, float(i), deadline=0.001)
    assert len(q.next_batch()[0]) == 8


def test_a_delayed_batch_is_dispatched_when_its_deadline_needs_it():
    clock = FakeClock()
    profile = profile_of({1: 0.5, 8: 4.0})
    q = deadline_queue(clock, profile, max_queue_delay_us=10_000_000)
    put(q, clock, 1.0, deadline=5.0)
    clock.advance(1.5)  # past NOW + 5 - 4: a batch of MIN_BATCH (8) would now finish late
    batch, reason = q.next_batch()
    assert (values(batch), reason) == ([1.0], "deadline")

    q = deadline_queue(clock, profile, max_queue_delay_us=10_000_000)
    put(q, clock, 2.0, deadline=60.0)
    clock.advance(10.5)  # the queue delay is the earlier limit
    assert q.next_batch()[1] == "delay"


# -- admission control ---------------------------------------------------------------------------

def test_admission_estimates_the_wait_from_queue_depth_profile_and_instances():
    admission = Admission("m", profile_of({1: 0.01, 4: 0.1}, max_batch=4), max_batch=4,
                          instances=2, include_own=False)
    # Nothing ahead: its own batch starts at once.
    assert admission.estimate_s(0) == pytest.approx((0.0, 0.01 / 2))
    # 8 ahead + itself, 0.1 s of work left in batches taken: that, two full batches of 4
    # (0.1 s each), all over 2 instances, then its own, which later arrivals fill.
    assert admission.estimate_s(8, in_flight_s=0.1) == pytest.approx((3 * 0.1 / 2, 4 * 0.1 / 2))
    # 3 ahead + itself fill one batch: it starts when the work in flight is done.
    assert admission.estimate_s(3, in_flight_s=0.1) == pytest.approx((0.1 / 2, 2 * 0.1 / 2))
    assert admission.estimate_s(3, in_flight_s=0.02) == pytest.approx((0.01, 0.06))
    with pytest.raises(AdmissionRefused,
                       match=r"estimated wait 150.0 ms, done in 200.0 ms .* 100.0 ms left"):
        admission.check(batch_size=1, deadline=NOW + 0.1, now=NOW, samples_ahead=8,
                        in_flight_s=0.1)
    admission.check(batch_size=1, deadline=NOW + 0.201, now=NOW, samples_ahead=8,
                    in_flight_s=0.1)
    admission.check(batch_size=1, deadline=None, now=NOW, samples_ahead=1000)


@settings(max_examples=300, deadline=None)
@given(
    records=st.lists(st.tuples(st.integers(1, 16), st.floats(0.0, 0.05)), min_size=1,
                     max_size=12),
    padded=st.booleans(), include_own=st.booleans(), instances=st.integers(1, 3),
    in_flight=st.lists(st.tuples(st.integers(1, 16), st.floats(0.0, 0.05) | st.none()),
                       max_size=3),
    samples_ahead=st.integers(0, 60), batch_size=st.integers(1, 16),
    arrivals=st.lists(st.integers(1, 4), max_size=20), left_s=st.floats(0.0, 0.5),
)
def test_a_request_surely_in_time_is_one_the_full_check_admits(
        records, padded, include_own, instances, in_flight, samples_ahead, batch_size,
        arrivals, left_s):
    """The quick bound never admits what the full estimate would refuse."""
    profile = LatencyProfile(16, buckets=[1, 2, 4, 8, 16] if padded else None, padded=padded,
                             response_margin_s=0.002)
    for size, seconds in records:
        profile.record(size, seconds)
    profile.record_delivery(0.001)
    admission = Admission("m", profile, max_batch=16, instances=instances,
                          include_own=include_own)
    for i, samples in enumerate(arrivals):
        admission.queued(samples, NOW - 0.001 * (len(arrivals) - i))
    # What ModelAccounting.inflight_work_s passes: each batch's work left, ran `ran` seconds.
    work = variance = 0.0
    for size, ran in in_flight:
        mean = profile.mean(size)
        work += mean if ran is None else max(0.0, mean - ran)
        variance += profile.deviation(size) ** 2
    deadline = NOW + left_s
    if admission.surely_in_time(batch_size=batch_size, deadline=deadline, now=NOW,
                                samples_queued=samples_ahead, batches_in_flight=len(in_flight)):
        admission.check(batch_size=batch_size, deadline=deadline, now=NOW,
                        samples_ahead=samples_ahead, in_flight_s=work, in_flight_var=variance)


def test_admission_answers_a_loose_deadline_without_the_full_estimate(monkeypatch):
    profile = profile_of({1: 0.01, 4: 0.1}, max_batch=4)
    admission = Admission("m", profile, max_batch=4, instances=1, include_own=False)
    # 2 batches in flight + 3 queued batches' worth: at most 5 x (0.1 + 3 deviations) s.
    assert admission.surely_in_time(batch_size=1, deadline=NOW + 1.0, now=NOW,
                                    samples_queued=11, batches_in_flight=2)
    assert not admission.surely_in_time(batch_size=1, deadline=NOW + 0.3, now=NOW,
                                        samples_queued=11, batches_in_flight=2)
    assert LatencyProfile(4).ceiling() is None
    assert Admission("m", LatencyProfile(4), max_batch=4, instances=1,
                     include_own=True).surely_in_time(batch_size=1, deadline=NOW, now=NOW,
                                                      samples_queued=100,
                                                      batches_in_flight=1)


def test_admission_keeps_the_margin_free_before_the_deadline():
    profile = profile_of({1: 0.01, 4: 0.1}, max_batch=4)
    fifo = Admission("m", profile, max_batch=4, instances=1, include_own=False)
    deadline = Admission("m", profile, max_batch=4, instances=1, include_own=True)
    fifo.check(batch_size=1, deadline=NOW + 0.1, now=NOW, samples_ahead=0, in_flight_s=0.05)
    deadline.check(batch_size=1, deadline=NOW + 0.015, now=NOW, samples_ahead=0)
    profile.response_margin_s = 0.05
    # Done in 60 ms, answered 50 ms later: after the 100 ms deadline.
    with pytest.raises(AdmissionRefused):
        fifo.check(batch_size=1, deadline=NOW + 0.1, now=NOW, samples_ahead=0, in_flight_s=0.05)
    # Even alone (10 ms) and answered 50 ms later, after 15 ms.
    with pytest.raises(DeadlineInfeasible):
        deadline.check(batch_size=1, deadline=NOW + 0.015, now=NOW, samples_ahead=0)


def test_admission_admits_everything_before_anything_is_measured():
    admission = Admission("m", LatencyProfile(4), max_batch=4, instances=1, include_own=True)
    assert admission.estimate_s(100) is None
    admission.check(batch_size=1, deadline=NOW + 1e-6, now=NOW, samples_ahead=100)


def test_admission_under_the_deadline_policy_holds_the_completion_to_the_deadline():
    admission = Admission("m", profile_of({1: 0.01, 4: 0.1}, max_batch=4), max_batch=4,
                          instances=2, include_own=True)
    with pytest.raises(DeadlineInfeasible, match="cannot be served in time"):
        admission.check(batch_size=1, deadline=NOW + 0.005, now=NOW, samples_ahead=0)
    # Two full batches ahead and 0.05 s of work in flight: waits (0.05 + 2 x 0.1) s over 2
    # instances, done after its own full batch.
    with pytest.raises(AdmissionRefused, match=r"estimated wait 125.0 ms, done in 175.0 ms"):
        admission.check(batch_size=1, deadline=NOW + 0.174, now=NOW, samples_ahead=8,
                        in_flight_s=0.05)
    admission.check(batch_size=1, deadline=NOW + 0.176, now=NOW, samples_ahead=8,
                    in_flight_s=0.05)


def test_under_the_deadline_policy_only_requests_due_first_count_as_ahead():
    clock = FakeClock()
    queue = deadline_queue(clock, profile_of({1: 0.01, 8: 0.05}))
    loose = [put(queue, clock, i, deadline=1.0) for i in range(6)]
    put(queue, clock, 6, deadline=0.03)  # due before the tight one below
    tight = request(7.0, deadline=clock.now + 0.05)
    tight.level, tight.arrival = 1, clock.now
    later = request(8.0, deadline=clock.now + 2.0)
    later.level, later.arrival = 1, clock.now
    # EDF serves the tight one after the single request due before it, not after all seven.
    assert queue.samples_ahead(1, tight) == 1
    assert queue.samples_ahead(1, later) == queue.samples_ahead(1) == 7
    # Requests that leave the queue (removed, or taken in a batch) stop counting.
    queue.remove(loose[0])
    assert queue.samples_ahead(1, later) == 6
    batch, _ = queue.next_batch()
    assert batch and queue.samples_ahead(1, later) == 6 - len(batch)
    # Under fifo everything queued at the level or above is ahead, whatever its deadline.
    fifo = ModelQueue(BatchingConfig(max_batch_size=8), clock=clock)
    for i in range(3):
        put(fifo, clock, i, deadline=1.0)
    assert fifo.samples_ahead(1, tight) == 3


def test_deadline_admission_lets_a_tight_request_overtake_a_loose_backlog():
    clock = FakeClock()
    profile = profile_of({1: 0.01, 8: 0.05})
    queue = deadline_queue(clock, profile)
    for i in range(40):  # five full batches of loose requests: 250 ms of work
        put(queue, clock, i, deadline=5.0)
    door = Admission("m", profile, max_batch=8, instances=1, include_own=True)
    tight = request(99.0, deadline=clock.now + 0.1)
    tight.level, tight.arrival = 1, clock.now
    door.check(batch_size=1, deadline=tight.deadline, now=clock.now,
               samples_ahead=queue.samples_ahead(1, tight))
    with pytest.raises(AdmissionRefused):  # counted behind the backlog, it would be refused
        door.check(batch_size=1, deadline=tight.deadline, now=clock.now,
                   samples_ahead=queue.samples_ahead(1))


# -- through ServedModel, with a fake model --------------------------------------------------------

@pytest.fixture
def registry():
    return CollectorRegistry()


@pytest.fixture
def served(registry):
    models: list[tuple[ServedModel, RecordingModel]] = []

    def build(spec, fake: RecordingModel, profile: LatencyProfile | None = None) -> ServedModel:
        model = ServedModel(spec, fake, metrics=BatcherMetrics(registry), profile=profile)
        model.start()
        models.append((model, fake))
        return model

    yield build
    for model, fake in models:
        if fake.gate is not None:
            fake.gate.set()
        model.stop(drain_timeout_s=5)


@pytest.mark.parametrize(("buckets", "padded", "classes"), [
    ((), False, size_classes(8)), ((1, 2, 4, 8), True, (1, 2, 4, 8))])
def test_a_model_profiles_by_bucket_when_it_pads_and_by_size_when_it_does_not(
        served, buckets, padded, classes):
    model = served(dataclasses.replace(make_spec(max_batch_size=8), buckets=buckets),
                   RecordingModel())
    assert model.profile.padded is padded and model.profile.buckets == classes


def failures(registry, reason: str) -> float:
    return registry.get_sample_value(
        "batchgate_request_failures_total", {"model": "fake", "reason": reason}) or 0.0


def slo(registry, result: str) -> float:
    return registry.get_sample_value(
        "batchgate_slo_requests_total", {"model": "fake", "result": result}) or 0.0


async def test_admission_refuses_with_resource_exhausted_and_counts_rejected(served, registry):
    fake = RecordingModel()
    model = served(make_spec(max_batch_size=1, max_inflight_batches=1), fake,
                   profile_of({1: 3.0}, max_batch=1))
    blocker = await hold_executor(model, fake)
    queued = asyncio.ensure_future(model.infer(request(1.0)))
    await apoll(lambda: model.queue_depth == 1)
    # The running batch (less the moment it has run), the queued one, then its own: done in
    # about 9 s, 5 s left (alone, 3 s would fit: the queue is to blame, so a retry elsewhere
    # may succeed).
    with pytest.raises(AdmissionRefused,
                       match=r"estimated wait (59\d\d|6000)\.\d ms, done in (89\d\d|9000)\.\d ms"):
        await model.infer(request(2.0, timeout_us=5_000_000))
    assert model.queue_depth == 1
    assert failures(registry, "rejected") == 1 and slo(registry, "missed") == 1
    fake.gate.set()
    await asyncio.gather(blocker, queued)
    assert 2.0 not in [v for b in fake.batches for v in b]


@pytest.mark.parametrize("policy", ["fifo", "deadline"])
async def test_admission_counts_a_batch_in_flight_by_its_size_less_what_it_has_run(
        served, registry, policy):
    fake = RecordingModel()
    model = served(make_spec(max_batch_size=4, max_inflight_batches=1, policy=policy,
                             response_margin_ms=0.0), fake,
                   profile_of({1: 0.5, 2: 0.6, 4: 10.0}, max_batch=4))
    blocker = await hold_executor(model, fake)  # running: a batch of 1, 0.5 s expected
    accounting = model._accounting
    (running,) = accounting.inflight()
    assert accounting.inflight_work_s(running.started_at) == pytest.approx((0.5, 0.0))
    assert accounting.inflight_work_s(running.started_at + 0.2) == pytest.approx((0.3, 0.0))
    assert accounting.inflight_work_s(running.started_at + 5.0) == (0.0, 0.0)
    # Counted as a full batch (10 s) the running one would refuse a request with 5 s left; by
    # its own size it leaves at most 0.5 s, and the request's own batch takes 0.5 s (0.6 s
    # under fifo, which expects the blocker's arrival rate to add one more to it).
    queued = asyncio.ensure_future(model.infer(request(1.0, timeout_us=5_000_000)))
    await apoll(lambda: model.queue_depth == 1 or queued.done())
    assert failures(registry, "rejected") == 0
    fake.gate.set()
    await blocker
    await queued
    assert not accounting.inflight()


def test_recent_arrivals_count_the_samples_within_a_time():
    arrivals = RecentArrivals(keep=4)
    assert arrivals.within(1.0, NOW) == 0
    for at, samples in ((NOW, 1), (NOW + 1, 2), (NOW + 2, 3)):
        arrivals.add(samples, at)
    assert arrivals.within(0.5, NOW + 2.2) == 3
    assert arrivals.within(1.5, NOW + 2.2) == 5
    assert arrivals.within(10.0, NOW + 2.2) == 6
    assert arrivals.within(0.1, NOW + 5) == 0
    arrivals.add(1, NOW + 1.5)  # out of order: counted as arriving with the latest
    assert arrivals.within(0.1, NOW + 2.0) == 4
    arrivals.add(1, NOW + 3)  # only the last 4 arrivals are kept
    assert arrivals.within(10.0, NOW + 3) == 2 + 3 + 1 + 1


def test_fifo_admission_expects_recent_arrivals_to_join_its_batch():
    """A fifo batch takes what is queued when it starts: at the rate seen lately, the request's
    own batch grows while it waits (with its own size only, bursts let in requests that then
    expired); the deadline policy's estimate does not (under EDF later arrivals with later
    deadlines do not run before it)."""
    profile = profile_of({1: 0.01, 2: 0.02, 4: 0.04, 8: 0.08}, max_batch=8)
    fifo = Admission("m", profile, max_batch=8, instances=1, include_own=False)
    deadline = Admission("m", profile, max_batch=8, instances=1, include_own=True)
    for door in (fifo, deadline):
        assert door.estimate_s(1, in_flight_s=0.05, now=NOW) == pytest.approx((0.05, 0.07))
        for i in range(5):  # 5 samples in the last 50 ms, 10 ms apart
            door.queued(1, NOW - 0.04 + 0.01 * i)
    # 1 queued + itself + the 5 expected in its 50 ms wait: a batch of 7 (bucket 8, 80 ms).
    assert fifo.estimate_s(1, in_flight_s=0.05, now=NOW) == pytest.approx((0.05, 0.13))
    assert deadline.estimate_s(1, in_flight_s=0.05, now=NOW) == pytest.approx((0.05, 0.07))
    # A wait of 5 ms expects 1 (one arrived in the last 5 ms): a batch of 3 (bucket 4, 40 ms).
    assert fifo.estimate_s(1, in_flight_s=0.005, now=NOW) == pytest.approx((0.005, 0.045))
    with pytest.raises(AdmissionRefused):
        fifo.check(batch_size=1, deadline=NOW + 0.1, now=NOW, samples_ahead=1, in_flight_s=0.05)
    deadline.check(batch_size=1, deadline=NOW + 0.1, now=NOW, samples_ahead=1, in_flight_s=0.05)


def test_fifo_admission_holds_the_completion_at_its_p99():
    """Means alone put the request right at its deadline under overload, and half such
    requests finish late; fifo adds 3 deviations of the sum (squares add: the batch in
    flight's, the full batches' ahead, its own)."""
    profile = LatencyProfile(4, padded=False)
    for seconds in (0.08, 0.12, 0.08, 0.12):  # full batches: mean ~0.1, some spread
        profile.record(4, seconds)
    mean, deviation = profile.mean(4), profile.deviation(4)
    assert deviation > 0.005
    fifo = Admission("m", profile, max_batch=4, instances=1, include_own=False)
    deadline = Admission("m", profile, max_batch=4, instances=1, include_own=True)
    # 4 queued ahead: one full batch, then its own (full: later arrivals fill it), after
    # 0.05 s in flight whose squared deviation is 0.0001.
    spread = (0.0001 + 2 * deviation ** 2) ** 0.5
    assert fifo.estimate_s(4, in_flight_s=0.05, in_flight_var=0.0001) == pytest.approx(
        (0.05 + mean, 0.05 + 2 * mean + 3 * spread))
    assert deadline.estimate_s(4, in_flight_s=0.05, in_flight_var=0.0001) == pytest.approx(
        (0.05 + mean, 0.05 + 2 * mean))


async def test_a_model_measures_the_delivery_of_its_answers_into_the_margin(served):
    model = served(make_spec(max_batch_size=4, response_margin_ms=2.0), RecordingModel())
    assert model.profile.margin() == pytest.approx(0.002)  # configured, nothing measured
    await model.infer(request(1.0))
    assert model.profile.margin() > 0.002  # plus the hop from the batch thread to the loop


def test_fifo_admission_lets_in_a_request_too_short_for_its_own_batch():
    """Only the queue is judged under fifo: the profile may be stale, the request may still
    make it; the deadline policy is the one that refuses it as infeasible."""
    admission = Admission("m", profile_of({1: 0.01, 4: 0.1}, max_batch=4), max_batch=4,
                          instances=1, include_own=False)
    admission.check(batch_size=1, deadline=NOW + 0.005, now=NOW, samples_ahead=8,
                    in_flight_s=0.1)


async def test_admission_can_be_disabled(served):
    fake = RecordingModel()
    model = served(make_spec(max_batch_size=1, max_inflight_batches=1, admission=False), fake,
                   profile_of({1: 10.0}, max_batch=1))
    blocker = await hold_executor(model, fake)
    queued = asyncio.ensure_future(model.infer(request(1.0)))
    await apoll(lambda: model.queue_depth == 1)
    admitted = asyncio.ensure_future(model.infer(request(2.0, timeout_us=60_000_000)))
    await apoll(lambda: model.queue_depth == 2)
    fake.gate.set()
    await asyncio.gather(blocker, queued, admitted)


async def test_a_request_infeasible_alone_is_refused_at_admission(served, registry):
    fake = RecordingModel()
    model = served(make_spec(policy="deadline"), fake, profile_of({1: 10.0}))
    with pytest.raises(DeadlineInfeasible) as info:
        await model.infer(request(1.0, timeout_us=1_000_000))
    assert isinstance(info.value, DeadlineExceeded)
    assert failures(registry, "infeasible") == 1 and fake.batches == []


async def test_a_queued_request_that_became_infeasible_never_runs(served, registry):
    fake = RecordingModel()
    profile = LatencyProfile(1)
    model = served(make_spec(max_batch_size=1, max_inflight_batches=1, policy="deadline"),
                   fake, profile)
    blocker = await hold_executor(model, fake)
    doomed = asyncio.ensure_future(model.infer(request(1.0, timeout_us=30_000_000)))
    await apoll(lambda: model.queue_depth == 1)  # admitted: nothing measured yet
    profile.record(1, 100.0)  # now the model is known to take 100 s a batch
    fake.gate.set()
    await blocker
    with pytest.raises(DeadlineInfeasible, match="dropped before running"):
        await doomed
    assert fake.batches == [[-1.0]]
    assert failures(registry, "infeasible") == 1 and failures(registry, "expired") == 0
    assert model.queue_depth == 0


async def test_slo_attainment_and_slack_are_measured(served, registry):
    fake = RecordingModel()
    model = served(make_spec(max_batch_size=1, max_inflight_batches=1, slo_ms=600_000), fake)
    await asyncio.gather(*(model.infer(request(float(i))) for i in range(3)))
    assert slo(registry, "met") == 3 and slo(registry, "missed") == 0
    labels = {"model": "fake"}
    assert registry.get_sample_value("batchgate_deadline_slack_seconds_count", labels) == 3
    # answered within the SLO: no slack below zero
    assert registry.get_sample_value(
        "batchgate_deadline_slack_seconds_bucket", {**labels, "le": "0.0"}) == 0

    blocker = await hold_executor(model, fake)
    with pytest.raises(DeadlineExceeded):
        await model.infer(request(9.0, timeout_us=20_000))
    assert slo(registry, "missed") == 1 and failures(registry, "expired") == 1
    fake.gate.set()
    await blocker
    assert slo(registry, "met") == 4


async def test_the_latency_profile_and_response_margin_are_metrics(served, registry):
    model = served(make_spec(max_batch_size=4, max_inflight_batches=1), RecordingModel())
    def gauge(size: int, estimate: str) -> float | None:
        return registry.get_sample_value("batchgate_latency_profile_seconds", {
            "model": "fake", "batch_size": str(size), "estimate": estimate})

    assert gauge(3, "mean") is None  # nothing measured yet (no warm-up)
    await model.infer(request(1.0, rows=3))
    mean, p99 = model.profile.measured_class(3)
    assert (gauge(3, "mean"), gauge(3, "p99")) == (mean, p99)
    assert 0.0 < mean <= p99
    assert registry.get_sample_value(
        "batchgate_response_margin_seconds", {"model": "fake"}) == model.profile.margin()
    # Each batch updates its own class only.
    await model.infer(request(2.0, rows=1))
    assert gauge(1, "mean") == model.profile.measured_class(1)[0]
    assert gauge(3, "mean") == mean


async def test_requests_without_deadline_or_slo_are_not_counted_for_the_slo(served, registry):
    model = served(make_spec(), RecordingModel())
    await model.infer(request(1.0))
    assert slo(registry, "met") == 0 and slo(registry, "missed") == 0


# -- failure reasons: each refusal or loss counted once, under its own reason ---------------------

async def test_a_request_cancelled_while_its_batch_runs_is_counted_cancelled(served, registry):
    fake = RecordingModel()
    model = served(make_spec(max_batch_size=1, max_inflight_batches=1), fake)
    running = await hold_executor(model, fake)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    fake.gate.set()
    await model.infer(request(1.0))  # the held batch has finished by the time this one ran
    assert failures(registry, "cancelled") == 1
    stats = model.stats.snapshot()
    assert (stats.success.count, stats.fail.count) == (1, 1)  # the cancelled one is no success


async def test_cancel_answers_a_running_request_at_once_and_counts_it(served, registry):
    fake = RecordingModel()
    model = served(make_spec(max_batch_size=1, max_inflight_batches=1), fake)
    fake.gate = threading.Event()
    held = request(1.0)
    future = asyncio.ensure_future(model.infer(held))
    await asyncio.get_running_loop().run_in_executor(None, fake.entered.wait, 10)
    model.cancel(held)
    with pytest.raises(RequestCancelled):
        await future
    fake.gate.set()
    await model.infer(request(2.0))
    assert failures(registry, "cancelled") == 1


async def test_requests_left_when_a_drain_times_out_are_counted_unavailable(registry):
    fake = RecordingModel()
    model = ServedModel(make_spec(max_batch_size=1, max_inflight_batches=1), fake,
                        metrics=BatcherMetrics(registry))
    model.start()
    running = await hold_executor(model, fake)
    queued = asyncio.ensure_future(model.infer(request(4.0)))
    await apoll(lambda: model.queue_depth == 1)
    await asyncio.get_running_loop().run_in_executor(None, model.stop, 0.05)
    with pytest.raises(ModelUnavailable):
        await queued
    assert failures(registry, "unavailable") == 1
    fake.gate.set()
    await running


# -- device sharing ------------------------------------------------------------------------------

def test_two_backlogged_members_get_device_time_in_the_ratio_of_their_weights():
    clock = FakeClock()
    share = DeviceShare("cpu", clock=clock)
    working = threading.Event()
    working.set()
    heavy = share.join("heavy", 3, backlog=working.is_set)
    light = share.join("light", 1, backlog=working.is_set)
    grants: list[str] = []
    total = 400
    peers, done = {"heavy": light, "light": heavy}, set()

    def executor(member) -> None:
        peer = peers[member.name]
        while True:
            share.acquire(member)
            if len(grants) >= total:
                working.clear()  # no reservation for a member that has stopped
                done.add(member.name)
                share.release(member, 0.0)
                return
            grants.append(member.name)
            # A real batch lasts long enough for the other executor to come back and wait for
            # the device; these take no real time, so the batch waits for it (on a loaded
            # machine it was sometimes not back yet, and this member ran twice in a row).
            poll(lambda: peer.waiting or peer.name in done, 30, f"{peer.name} waiting")
            clock.advance(3.0)
            share.release(member, 3.0)  # every batch: 3 s of (fake) device time, exact passes

    # Hold the device until both executors wait for it, so neither runs alone at first.
    gatekeeper = share.join("gatekeeper", 1)
    assert share.acquire(gatekeeper, blocking=False)
    threads = [threading.Thread(target=executor, args=(m,)) for m in (heavy, light)]
    for thread in threads:
        thread.start()
    poll(lambda: heavy.waiting and light.waiting, 30, "both executors waiting")
    share.release(gatekeeper, 0.0)
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads)
    assert abs(grants.count("heavy") - 300) <= 2, grants.count("heavy")
    # Stride order: never more than 3 heavy turns in a row once both run.
    run = longest = 0
    for name in grants[4:]:
        run = run + 1 if name == "heavy" else 0
        longest = max(longest, run)
    assert longest <= 4


def test_a_member_that_just_ran_keeps_its_turn_while_it_has_work():
    clock = FakeClock()
    share = DeviceShare("cpu", clock=clock, reserve_s=0.002)
    has_work = threading.Event()
    has_work.set()
    light = share.join("light", 1)
    heavy = share.join("heavy", 4, backlog=has_work.is_set)
    assert share.acquire(light, blocking=False)
    share.release(light, 1.0)  # light's pass: 1.0
    for _ in range(3):
        assert share.acquire(heavy, blocking=False)
        share.release(heavy, 1.0)  # heavy's pass: +0.25, still below light's
        # heavy is between batches but has work: light must not take the device.
        assert not share.acquire(light, blocking=False)
    clock.advance(0.003)  # heavy did not come back within its reservation
    assert share.acquire(light, blocking=False)
    share.release(light, 1.0)


def test_a_reservation_lasts_through_another_members_turn():
    clock = FakeClock()
    share = DeviceShare("cpu", clock=clock, reserve_s=0.002)
    a = share.join("a", 1, backlog=lambda: True)
    b = share.join("b", 1)
    c = share.join("c", 1)
    assert share.acquire(c, blocking=False)
    share.release(c, 3.0)  # c's pass: 3
    assert share.acquire(a, blocking=False)
    share.release(a, 1.0)  # a's pass: 1, and a has more work: reserved
    assert share.acquire(b, blocking=False)  # b's pass (0) is lower than a's: b's turn
    share.release(b, 0.5)
    # a has not come back yet, but its reservation stands: c (pass 3) must not overtake it.
    assert not share.acquire(c, blocking=False)
    clock.advance(0.003)  # a did not come back within its reservation
    assert share.acquire(c, blocking=False)
    share.release(c, 1.0)


def test_a_member_alone_gets_the_whole_device_and_idling_banks_no_credit():
    clock = FakeClock()
    share = DeviceShare("cpu", clock=clock)
    busy = share.join("busy", 1)
    idle = share.join("idle", 1)
    for _ in range(10):
        assert share.acquire(busy, blocking=False)
        share.release(busy, 1.0)
    # idle re-enters at the current virtual time, not at 0: it does not get 10 turns in a row.
    assert share.acquire(idle, blocking=False)
    share.release(idle, 1.0)
    assert idle.pass_ >= 9.0
    share.leave(busy)
    share.leave(idle)


def test_a_batch_turn_ends_on_whichever_thread_finishes_the_batch():
    clock = FakeClock()
    share = DeviceShare("cuda:0", clock=clock)
    charged: list[float] = []
    turns = DeviceTurns(share)
    turns.begin(1)  # not joined yet (warm-up): no turn taken
    turns.end(1)
    turns.join("gpu-model", 1, backlog=lambda: False, on_charge=charged.append)
    other = share.join("other", 1)
    turns.begin(7)  # the compute thread launches batch 7
    assert not share.acquire(other, blocking=False)
    clock.advance(0.25)
    finisher = threading.Thread(target=turns.end, args=(7,))  # the batch completes there
    finisher.start()
    finisher.join(10)
    assert charged == [0.25]
    assert share.acquire(other, blocking=False)
    share.release(other, 0.0)
    turns.end(7)  # a second end of the same batch is a no-op
    assert charged == [0.25]
    turns.leave()


async def test_served_models_with_a_weight_take_turns_and_are_metered(served, registry):
    spec = make_spec(device_share_weight=2)
    model = served(spec, RecordingModel())
    results = await asyncio.gather(*(model.infer(request(float(i))) for i in range(5)))
    assert [float(r["y"][0, 0]) for r in results] == [2.0 * i for i in range(5)]
    # Charged when the turn ends, just after the answers went out.
    await apoll(lambda: (registry.get_sample_value(
        "batchgate_device_share_seconds_total", {"model": "fake", "device": "cpu"}) or 0) > 0)


class _WouldBlock(Exception):
    pass


def _never_block(timeout_s, *, eager):
    raise _WouldBlock(timeout_s)


@pytest.mark.parametrize("policy", ["fifo", "deadline"])
def test_a_busy_executor_takes_a_full_batch_early_only_under_fifo(policy):
    # Under the deadline policy a batch taken while the previous one runs would shut out a
    # tight request arriving in the meantime, so the busy executor waits for its batch to end.
    clock = FakeClock()
    queue = ModelQueue(BatchingConfig(max_batch_size=4, policy=policy), clock=clock,
                       profile=profile_of({1: 0.01, 4: 0.02}, max_batch=4))
    queue._wait = _never_block  # where it would block on its condition, raise instead
    for i in range(4):
        put(queue, clock, i, deadline=1.0)
    if policy == "fifo":
        batch, reason = queue.next_batch(busy=lambda: True)
        assert (len(batch), reason) == (4, "full")
    else:
        with pytest.raises(_WouldBlock):
            queue.next_batch(busy=lambda: True)
        batch, reason = queue.next_batch(busy=lambda: False)  # its running batch ended
        assert (len(batch), reason) == (4, "full")


@pytest.mark.parametrize(("policy", "threads"), [
    ("fifo", {"fake-0-assemble", "fake-0-compute"}), ("deadline", {"fake-0-batch"})])
def test_the_deadline_policy_keeps_one_batch_in_flight_on_one_thread(served, policy, threads):
    # A busy instance takes no batch under the deadline policy, so a second slot would stand
    # idle and its assembler thread only add hand-offs between batches.
    spec = make_spec(max_batch_size=8, max_inflight_batches=2, policy=policy)
    assert spec.inflight_batches == (1 if policy == "deadline" else 2)
    served(spec, RecordingModel())
    running = {t.name for t in threading.enumerate() if t.name.startswith("fake-0-")}
    assert running == threads
