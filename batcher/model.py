"""ServedModel: one loaded model version, its queue, its executors, its statistics.

The event loop calls ``infer``; everything blocking (warm-up, draining) happens in ``start`` and
``stop``, which the caller runs off the loop. Each request gets one future, resolved only
through guarded helpers (never twice), and removed from the queue in ``finally`` when its
caller goes away or its deadline passes, so nothing leaks and no dead request reaches a batch.

Around the queue: a latency profile (seeded at warm-up, fed by every batch) that admission
control and the deadline policy predict from; the device's weighted turns when the model sets
``device_share_weight``; and every request that gets no result counted once, under its reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import structlog

from batcher.admission import Admission
from batcher.device_share import DeviceShare, ShareMember, share_for
from batcher.errors import (
    AdmissionRefused,
    DeadlineExceeded,
    DeadlineInfeasible,
    InvalidRequest,
    LoadError,
    ModelUnavailable,
    QueueFull,
    RequestCancelled,
)
from batcher.executor import Batch, Executor, Outcome
from batcher.metrics import BatcherMetrics, ModelMetrics
from batcher.profile import LatencyProfile
from batcher.queue import ModelQueue, scheduling_deadline
from batcher.request import DONE, InferenceRequest
from batcher.spec import ModelSpec
from batcher.stats import ModelStats

log = structlog.get_logger(__name__)

_batch_ids = itertools.count(1)
_batch_ids_lock = threading.Lock()


def _next_batch_id() -> int:
    with _batch_ids_lock:
        return next(_batch_ids)


def _reject(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


class ServedModel:
    def __init__(
        self,
        spec: ModelSpec,
        module: Callable[..., Any],
        *,
        metrics: BatcherMetrics | None = None,
        warmup_inputs: list[list[np.ndarray]] | None = None,
        profile: LatencyProfile | None = None,
    ) -> None:
        self._spec = spec
        self._module = module
        self._metrics: ModelMetrics | None = metrics.for_model(spec.name) if metrics else None
        self._warmup_inputs = warmup_inputs
        self.stats = ModelStats()
        batching = spec.batching
        # Batch times per batch size: seeded at warm-up, updated by every batch.
        self.profile = profile if profile is not None else LatencyProfile(batching.max_batch_size)
        self._slo_s = batching.slo_s
        self._queue = ModelQueue(
            batching,
            on_depth_change=self._metrics.queue_depth.set if self._metrics else None,
            profile=self.profile, on_infeasible=self._infeasible_threadsafe,
        )
        self._admission = (
            Admission(spec.name, self.profile, max_batch=batching.effective_max_batch,
                      instances=spec.instance_count, include_own=batching.policy == "deadline")
            if batching.admission else None
        )
        self._share: DeviceShare | None = None
        self._share_member: ShareMember | None = None
        self._executors = [
            Executor(
                spec, module, index=i, next_batch=self._queue.next_batch, wake=self._queue.wake,
                deliver=self._post, on_batch=self._record_batch, batch_ids=_next_batch_id,
                on_inflight=self._on_inflight,
                turn=self._device_turn if batching.device_share_weight else None,
            )
            for i in range(spec.instance_count)
        ]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._accepting = False
        self._inflight = 0
        self._inflight_lock = threading.Lock()

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    @property
    def module(self) -> Callable[..., Any]:
        return self._module

    @property
    def ready(self) -> bool:
        return self._accepting and all(e.alive.is_set() for e in self._executors)

    @property
    def queue_depth(self) -> int:
        return self._queue.depth

    # -- lifecycle (blocking; run off the event loop) ------------------------------------------

    def start(self) -> None:
        """Warm up every instance, then start serving. Raises LoadError if warm-up fails."""
        if self._spec.warmup:
            inputs = self._warmup_inputs if self._warmup_inputs is not None else default_warmup(self._spec)
            for executor in self._executors:
                try:
                    executor.warm_up(inputs)
                except Exception as exc:
                    log.exception("warmup_failed", model=self._spec.name)
                    raise LoadError(
                        f"model '{self._spec.name}' failed its warm-up "
                        f"({type(exc).__name__}); the server log has the details"
                    ) from exc
            self._profile_warm(inputs)
        batching = self._spec.batching
        if batching.device_share_weight:
            self._share = share_for(self._spec.device)
            self._share_member = self._share.join(
                f"{self._spec.name}:{self._spec.version}", batching.device_share_weight,
                backlog=self._backlog,
                on_charge=(self._metrics.device_share_seconds(self._spec.device).inc
                           if self._metrics else None),
            )
        for executor in self._executors:
            executor.start()
        self._accepting = True

    def _profile_warm(self, inputs: list[list[np.ndarray]]) -> None:
        """Seed the latency profile: time one warm (second) run per warm-up batch size."""
        if self._spec.batching.policy != "deadline" and not self._spec.batching.admission:
            return
        batched = self._spec.batching.max_batch_size > 0
        by_size = {(arrays[0].shape[0] if batched else 1): arrays for arrays in inputs if arrays}
        executor = self._executors[0]
        for size, arrays in sorted(by_size.items()):
            started = time.perf_counter()
            executor.warm_up([arrays])
            self.profile.record(size, time.perf_counter() - started)

    def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Refuse new requests, let queued and running ones finish, then stop the threads."""
        self._accepting = False
        self._queue.close()
        deadline = time.monotonic() + drain_timeout_s
        drained = all(e.join(max(0.0, deadline - time.monotonic())) for e in self._executors)
        if not drained:
            left = self._queue.drain_remaining()
            log.warning("drain_timed_out", model=self._spec.name, abandoned=len(left))
            error = ModelUnavailable(
                f"model '{self._spec.name}' was unloaded before this request ran; retry"
            )
            self._fail_threadsafe(left, error, "unavailable")
        if self._share_member is not None:
            self._share.leave(self._share_member)

    # -- the event loop's side -----------------------------------------------------------------

    async def infer(self, request: InferenceRequest) -> dict[str, np.ndarray]:
        """Queue ``request`` and wait for its outputs (arrays for this request's rows only)."""
        future = self.submit(request)
        try:
            return await future
        except asyncio.CancelledError:
            self._queue.remove(request)  # a running batch still finishes; its answer is dropped
            if future.cancelled():
                self._count_failure("cancelled", [request])
            raise

    def submit(self, request: InferenceRequest) -> asyncio.Future:
        """Queue ``request``; its future resolves to its outputs (on the running loop).

        Refusals (unavailable, bad priority, queue full, admission control) raise at once. The
        caller that gives up on the future must call ``cancel(request)`` (``infer`` does).
        """
        if not self._accepting:
            raise ModelUnavailable(f"model '{self._spec.name}' is not serving; retry later")
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        batching = self._spec.batching
        level = request.priority or batching.default_level
        if level > batching.levels:
            raise InvalidRequest(
                f"priority must lie in 1..{batching.levels} for model '{self._spec.name}' "
                f"(0 = default), got {request.priority}"
            )
        request.level = level
        policy = batching.queue_policy(level)
        timeout_us = policy.default_timeout_us
        if request.timeout_us and (policy.allow_timeout_override or not timeout_us):
            timeout_us = request.timeout_us
        deadline = request.deadline
        if timeout_us and not policy.timeout_action_delay:
            by_timeout = request.arrival + timeout_us / 1e6
            deadline = by_timeout if deadline is None else min(deadline, by_timeout)
        request.deadline = deadline  # the queue's deadline policy reads it
        if self._admission is not None and deadline is not None:
            self._admit(request)

        future = loop.create_future()
        request.future = future
        try:
            self._queue.put(request)
        except QueueFull:
            self._count_failure("rejected", [request])
            raise
        if deadline is not None:
            timer = loop.call_later(max(0.0, deadline - time.monotonic()), self._expire, request)
            future.add_done_callback(lambda _: timer.cancel())
        return future

    def _admit(self, request: InferenceRequest) -> None:
        """Admission control (``batcher/admission.py``): raise, counted, if it cannot be in time."""
        try:
            self._admission.check(batch_size=request.batch_size, deadline=request.deadline,
                                  now=time.monotonic(),
                                  samples_ahead=self._queue.samples_ahead(request.level))
        except AdmissionRefused:
            self._count_failure("rejected", [request])
            raise
        except DeadlineInfeasible:
            self._count_failure("infeasible", [request])
            raise

    def _expire(self, request: InferenceRequest) -> None:
        self._queue.remove(request)  # a running batch still finishes; its answer is dropped
        if request.future is not None and not request.future.done():
            self._count_failure("expired", [request])
            request.future.set_exception(
                DeadlineExceeded(f"request expired after waiting "
                                 f"{(time.monotonic() - request.arrival) * 1e3:.1f} ms "
                                 f"for model '{self._spec.name}'")
            )

    def cancel(self, request: InferenceRequest) -> None:
        """Answer a request CANCELLED on its caller's behalf (stream cancellation, a front end
        that went away): a queued one leaves the queue; a running one's answer is dropped."""
        self._queue.remove(request)
        if request.future is not None and not request.future.done():
            self._count_failure("cancelled", [request])
            request.future.set_exception(RequestCancelled("the request was cancelled"))

    # -- from the executor threads -----------------------------------------------------------

    def _post(self, outcome: Outcome) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._deliver, outcome)
        except RuntimeError:  # the loop closed meanwhile: nobody is waiting any more
            pass

    def _deliver(self, outcome: Outcome) -> None:
        requests = outcome.batch.requests
        for request in requests:
            request.state = DONE
            if request.on_release is not None:
                request.on_release()
        if outcome.error is not None:
            self._count_failure("model_error", [r for r in requests if not r.future.done()])
            for request in requests:
                _reject(request.future, outcome.error)
            return
        now = time.monotonic()
        success_ns = answered = 0
        met = missed = 0
        slack = self._metrics.deadline_slack_seconds if self._metrics is not None else None
        for request, result in zip(requests, outcome.results):
            if request.future.done():  # expired or cancelled while its batch ran: counted then
                continue
            request.future.set_result(result)
            answered += 1
            success_ns += int((now - request.arrival) * 1e9)
            target = scheduling_deadline(request, self._slo_s)
            if slack is not None and target != math.inf:
                slack.observe(target - now)
                if now <= target:
                    met += 1
                else:
                    missed += 1
        self.stats.record_success(answered, success_ns)
        if met:
            self._metrics.slo_met.inc(met)
        if missed:
            self._metrics.slo_missed.inc(missed)

    def _fail_threadsafe(self, requests: list[InferenceRequest], error: Exception,
                         reason: str) -> None:
        """From a thread: answer ``requests`` with ``error`` on the loop, counted under ``reason``."""
        loop = self._loop
        if not requests or loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._fail, requests, error, reason)
        except RuntimeError:
            pass

    def _fail(self, requests: list[InferenceRequest], error: Exception, reason: str) -> None:
        pending = [r for r in requests if r.future is not None and not r.future.done()]
        self._count_failure(reason, pending)
        for request in pending:
            request.future.set_exception(error)

    def _infeasible_threadsafe(self, requests: list[InferenceRequest]) -> None:
        """The queue dropped ``requests``: their deadlines cannot be met (lock held: hand on)."""
        error = DeadlineInfeasible(
            f"model '{self._spec.name}' could not have finished this request before its "
            "deadline, so it was dropped before running"
        )
        self._fail_threadsafe(requests, error, "infeasible")

    def _on_inflight(self, delta: int) -> None:
        with self._inflight_lock:
            self._inflight += delta
        if self._metrics is not None:
            self._metrics.inflight_batches.inc(delta)

    def _backlog(self) -> bool:
        """Work this model has right now: queued requests, or batches formed and not finished."""
        return self._queue.depth > 0 or self._inflight > 0

    def _device_turn(self) -> contextlib.AbstractContextManager:
        # Executor threads start after start() joined the share (warm-up runs outside turns).
        return self._share.turn(self._share_member)

    def _record_batch(self, batch: Batch, infer_ns: int, output_ns: int) -> None:
        queue_ns = 0
        metrics = self._metrics
        for request in batch.requests:
            waited = batch.taken_at - request.enqueued
            queue_ns += int(waited * 1e9)
            if metrics is not None:
                metrics.queue_seconds.observe(waited)
        self.stats.record_batch(
            requests=len(batch.requests), samples=batch.samples, queue_ns=queue_ns,
            input_ns=batch.input_ns, infer_ns=infer_ns, output_ns=output_ns,
        )
        compute_s = (batch.input_ns + infer_ns + output_ns) / 1e9
        self.profile.record(batch.samples, compute_s)
        if metrics is not None:
            metrics.batch_size.observe(batch.samples)
            metrics.batches[batch.reason].inc()
            metrics.compute_seconds.observe(compute_s)

    def _count_failure(self, reason: str, requests: list[InferenceRequest]) -> None:
        now = time.monotonic()
        missed = 0
        for request in requests:
            self.stats.record_failure(int((now - request.arrival) * 1e9))
            if reason != "cancelled" and scheduling_deadline(request, self._slo_s) != math.inf:
                missed += 1
        if self._metrics is not None and requests:
            self._metrics.failures[reason].inc(len(requests))
            if missed:
                self._metrics.slo_missed.inc(missed)


def default_warmup(spec: ModelSpec) -> list[list[np.ndarray]]:
    """Zero inputs at batch 1 and at the largest batch, for models whose dims are all fixed.

    A model with variable dims is warmed up only through its config's ``model_warmup``.
    """
    if not all(t.fixed() for t in spec.inputs) or any(t.datatype == "BYTES" for t in spec.inputs):
        return []
    if spec.batching.max_batch_size == 0:
        return [[np.zeros(t.dims, dtype=t.numpy_dtype) for t in spec.inputs]]
    sizes = sorted({1, *spec.batching.preferred_batch_sizes, spec.batching.max_batch_size})
    return [[np.zeros((n, *t.dims), dtype=t.numpy_dtype) for t in spec.inputs] for n in sizes]
