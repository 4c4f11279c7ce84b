"""ServedModel: one loaded model version, its queue, its executors, its statistics.

The event loop calls ``infer``; everything blocking (warm-up, draining) happens in ``start`` and
``stop``, which the caller runs off the loop. Each request gets one future, resolved only
through guarded helpers (never twice), and removed from the queue in ``finally`` when its
caller goes away or its deadline passes, so nothing leaks and no dead request reaches a batch.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import structlog

from batcher.errors import (
    DeadlineExceeded,
    InvalidRequest,
    LoadError,
    ModelUnavailable,
    QueueFull,
    RequestCancelled,
)
from batcher.executor import Batch, Executor, Outcome
from batcher.metrics import BatcherMetrics, ModelMetrics
from batcher.queue import ModelQueue
from batcher.request import DONE, InferenceRequest
from batcher.spec import ModelSpec
from batcher.stats import ModelStats

log = structlog.get_logger(__name__)

_batch_ids = itertools.count(1)
_batch_ids_lock = threading.Lock()


def _next_batch_id() -> int:
    with _batch_ids_lock:
        return next(_batch_ids)


def _resolve(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


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
        on_failed: Callable[[str], None] | None = None,
    ) -> None:
        self._spec = spec
        self._on_failed = on_failed
        self._failed = False
        self._failed_lock = threading.Lock()
        self._module = module
        self._metrics: ModelMetrics | None = metrics.for_model(spec.name) if metrics else None
        self._warmup_inputs = warmup_inputs
        self.stats = ModelStats()
        self._queue = ModelQueue(
            spec.batching,
            on_depth_change=self._metrics.queue_depth.set if self._metrics else None,
        )
        self._executors = [
            Executor(
                spec, module, index=i, next_batch=self._queue.next_batch, wake=self._queue.wake,
                deliver=self._post, on_batch=self._record_batch, batch_ids=_next_batch_id,
                on_inflight=self._metrics.inflight_batches.inc if self._metrics else None,
                on_dead=self._instance_died,
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
        for executor in self._executors:
            executor.start()
        with self._failed_lock:
            self._accepting = not self._failed

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
            for request in left:
                self._fail_threadsafe(request, error)

    # -- the event loop's side -----------------------------------------------------------------

    async def infer(self, request: InferenceRequest) -> dict[str, np.ndarray]:
        """Queue ``request`` and wait for its outputs (arrays for this request's rows only)."""
        future = self.submit(request)
        try:
            return await future
        except asyncio.CancelledError:
            if self._queue.remove(request):
                self._count_failure("cancelled", [request])
            raise

    def submit(self, request: InferenceRequest) -> asyncio.Future:
        """Queue ``request``; its future resolves to its outputs (on the running loop).

        Refusals (unavailable, bad priority, queue full) raise at once. The caller that gives
        up on the future must call ``cancel(request)`` (``infer`` does).
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
        """Take a request out of the queue on its caller's behalf (stream cancellation)."""
        if self._queue.remove(request) and request.future is not None:
            self._count_failure("cancelled", [request])
            _reject(request.future, RequestCancelled("the request was cancelled"))

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
        if not outcome.inputs_in_use:
            for request in requests:
                request.state = DONE
                if request.on_release is not None:
                    request.on_release()
            if outcome.release_only:
                return
        if outcome.error is not None:
            self._count_failure("model_error", requests)
            for request in requests:
                _reject(request.future, outcome.error)
            return
        now = time.monotonic()
        success_ns = 0
        for request, result in zip(requests, outcome.results):
            _resolve(request.future, result)
            success_ns += int((now - request.arrival) * 1e9)
        self.stats.record_success(len(requests), success_ns)

    def _instance_died(self, reason: str) -> None:
        """An executor stopped for good (executor thread): the model stops serving.

        Queued requests get UNAVAILABLE at once rather than waiting for their deadlines; the
        repository is told, so health reports NOT_SERVING and a load RPC brings the model back.
        """
        with self._failed_lock:
            if self._failed:
                return
            self._failed = True
        self._accepting = False
        self._queue.close()
        error = ModelUnavailable(
            f"model '{self._spec.name}' stopped serving ({reason}); retry after it is loaded again"
        )
        for request in self._queue.drain_remaining():
            self._count_failure("unavailable", [request])
            self._fail_threadsafe(request, error)
        if self._on_failed is not None:
            self._on_failed(reason)

    def _fail_threadsafe(self, request: InferenceRequest, error: Exception) -> None:
        loop = self._loop
        if request.future is None or loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(_reject, request.future, error)
        except RuntimeError:
            pass

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
        if metrics is not None:
            metrics.batch_size.observe(batch.samples)
            metrics.batches[batch.reason].inc()
            metrics.compute_seconds.observe((batch.input_ns + infer_ns + output_ns) / 1e9)

    def _count_failure(self, reason: str, requests: list[InferenceRequest]) -> None:
        now = time.monotonic()
        for request in requests:
            self.stats.record_failure(int((now - request.arrival) * 1e9))
        if self._metrics is not None:
            self._metrics.failures[reason].inc(len(requests))


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
