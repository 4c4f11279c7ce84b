"""ServedModel: one loaded model version, its queue, its executors, its statistics.

The event loop calls ``infer``; everything blocking (loading steps, draining) happens in
``start`` and ``stop``, which the caller runs off the loop. Each request is answered once (its
``answered`` flag guards it), through the delivery the model's host passed at construction
(``batcher/delivery.py``), and removed from the queue when its caller goes away or its deadline
passes, so nothing leaks and no dead request reaches a batch.

``start`` loads in this order, and the model answers only once all of it is done:

1. the precision check (``batcher/precision.py``): the model in its precision against fp32 on
   seeded inputs; fp16 weights are converted here;
2. the memory plan (``batcher/memory_plan.py``): per instance, an input buffer per batch in flight and,
   with CUDA graphs, each bucket's fixed buffers, and room for the staged inputs, in an arena
   of the device's pool reserved for the model at exactly that size (``batcher/memory.py``),
   all or nothing, else ``ResourceExhausted`` naming the bytes needed and free;
3. warm-up through the real batch path at every batch bucket (and the config's
   ``model_warmup`` samples), then the CUDA graphs' capture;
4. on a GPU, the footprint (weights, the largest batch's peak, the graph pool, staging, the
   plan) measured and admitted against the device's free memory (``batcher/gpu.py``), else
   ``ResourceExhausted`` naming the bytes needed and free;
5. the input stager (``input_staging`` queue) and the executor threads.

What it found goes to ``load_report``, which the server shows in the model's config parameters.
``stop``, once no thread is inside any pool (``ModelMemory.close``, ``batcher/gpu.py``), drops
everything that views the model's memory (its module, graphs, slots, staged blocks), then gives
the plan's arena back and drops the model's own allocator pools, so that their segments go back
to the device whole.

Around the queue: a latency profile (seeded by a timed warm run per batch size, fed by every
batch) that admission control and the deadline policy predict from; the device's weighted turns
when the model sets ``device_share_weight``; and every request that gets no result counted once,
under its reason.
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
import torch

from batchgate.batcher import gpu
from batchgate.batcher import precision as precisions
from batchgate.batcher.accounting import ModelAccounting
from batchgate.batcher.admission import Admission
from batchgate.batcher.buckets import BatchBuckets
from batchgate.batcher.device import Devices
from batchgate.batcher.device_share import DeviceTurns
from batchgate.batcher.errors import (
    LoadError,
    ModelUnavailable,
    ResourceExhausted,
)
from batchgate.batcher.batch import ExecutorPlan, Slot
from batchgate.batcher.delivery import Delivery, FutureDelivery
from batchgate.batcher.expiry import Expiry
from batchgate.batcher.executor import Executor
from batchgate.batcher.forward import unpack_outputs
from batchgate.batcher.tensors import to_torch
from batchgate.batcher.memory import DevicePools
from batchgate.batcher.metrics import BatcherMetrics, ModelMetrics
from batchgate.batcher.model_intake import ModelIntake
from batchgate.batcher.model_memory import ModelMemory
from batchgate.batcher.model_outcomes import ModelOutcomes
from batchgate.batcher.pool import (
    DevicePool,
    ModelReservation,
)
from batchgate.batcher.profile import LatencyProfile
from batchgate.batcher.queue import ModelQueue
from batchgate.batcher.request import InferenceRequest
from batchgate.batcher.spec import ModelSpec
from batchgate.batcher.staging import InputStager
from batchgate.batcher.stats import ModelStats

log = structlog.get_logger(__name__)

_batch_ids = itertools.count(1)
_batch_ids_lock = threading.Lock()


def _next_batch_id() -> int:
    with _batch_ids_lock:
        return next(_batch_ids)


class ServedModel(ModelMemory, ModelIntake, ModelOutcomes):
    def __init__(
        self,
        spec: ModelSpec,
        module: Callable[..., Any],
        *,
        metrics: BatcherMetrics | None = None,
        warmup_inputs: list[list[np.ndarray]] | None = None,
        pools: DevicePools | None = None,
        on_failed: Callable[[str], None] | None = None,
        profile: LatencyProfile | None = None,
        memory: gpu.ModelMemory | None = None,
        devices: Devices | None = None,
        delivery: Delivery | None = None,
    ) -> None:
        """``pools``: the server's device memory pools; without them (tests, benchmarks) the
        model's buffers are plain tensors. ``on_failed(reason)``: an instance stopped for good
        (called from its thread). ``profile``: batch times to start from (tests), instead of
        those measured at warm-up. ``memory``: the model's own allocator pools, which its
        weights were loaded under (default: new ones, which its weights are not in); this
        model closes them when it stops. ``devices``: the process's devices, whose pools and
        weighted turns the models placed on one device share (default: devices of this model's
        own, over ``pools``). ``delivery``: where answers go (``batcher/delivery.py``; default:
        each request's asyncio future, as ``infer`` awaits it)."""
        self._delivery: Delivery = delivery if delivery is not None else FutureDelivery()
        self._spec = spec
        self.memory = memory if memory is not None else gpu.ModelMemory(spec.device, spec.name)
        self.footprint: gpu.Footprint | None = None
        self._memory_refreshed = 0.0
        self._on_failed = on_failed
        self._failed = False
        self._failed_lock = threading.Lock()
        self._module = module
        self._metrics: ModelMetrics | None = metrics.for_model(spec.name) if metrics else None
        self._warmup_inputs = warmup_inputs
        self._device = (devices if devices is not None else Devices(pools)).get(spec.device)
        self.stats = ModelStats()
        # Fixed buffers (and so padding, staging, graphs) need fixed, numeric inputs.
        self._pooled = all(t.fixed() and t.datatype != "BYTES" for t in spec.inputs)
        self._buckets = BatchBuckets(spec.buckets if self._pooled else (),
                                     spec.batching.max_batch_size)
        self._published_largest = self._buckets.top
        batching = spec.batching
        # Batch times per batch size: seeded at warm-up, updated by every batch. A model that
        # pads to buckets takes a bucket's time for any batch in it; one that does not takes
        # its own size's, interpolated between the sizes measured.
        self._profile_given = profile is not None
        self.profile = profile if profile is not None else LatencyProfile(
            batching.max_batch_size, buckets=self._buckets.buckets or None,
            padded=bool(self._buckets.buckets),
            response_margin_s=batching.response_margin_ms / 1e3)
        self._slo_s = batching.slo_s
        # What submit() reads of the batching config, per request: looked up once here.
        self._levels = batching.levels
        self._default_level = batching.default_level
        self._policies = (None, *(
            (policy.default_timeout_us, policy.allow_timeout_override,
             bool(policy.timeout_action_delay))
            for policy in map(batching.queue_policy, range(1, batching.levels + 1))))
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
        self._turns = DeviceTurns(self._device.share) if batching.device_share_weight else None
        self._executors: list[Executor] = []
        self._reservations: list[tuple[DevicePool | None, ModelReservation]] = []
        # The model's arena (batcher/memory.py) and its owner name, once reserved.
        self._arena: tuple[str, DevicePool | None] | None = None
        self._stager: InputStager | None = None
        self.load_report: dict[str, str] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        # Answers DEADLINE_EXCEEDED when a request's deadline passes, queued or running.
        self._expiry = Expiry(self._expire)
        self._accepting = False
        self._accounting = ModelAccounting(stats=self.stats, profile=self.profile,
                                           metrics=self._metrics, slo_s=self._slo_s,
                                           after_batch=self._after_batch)

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
        """Load (see the module docstring), then start serving. Raises LoadError, or
        ResourceExhausted when the model does not fit its device's memory pool."""
        spec = self._spec
        check_inputs = precisions.seeded_inputs(spec)
        if check_inputs is None and self._warmup_inputs:
            check_inputs = self._warmup_inputs[0]
        # warmup false: the model must not run before it is ready, so neither does the check.
        skipped = None if spec.warmup else "the warmup parameter is false"
        self._module, checked = precisions.check(
            spec, self._module, None if skipped else check_inputs, self._run_once, skipped,
            converter=self._convert)
        weights = self._weight_bytes()
        graph_buckets, graphs_status = self._graph_plan()
        self._reserve(graph_buckets)
        self._executors = [self._executor(i, reservation)
                           for i, (_, reservation) in enumerate(self._reservations)]
        warm = self._warm_up()
        self._admit_footprint(weights, warm)
        if graph_buckets:
            graphs_status = warm["graphs"]
        if not self._profile_given:
            for rows, seconds in warm["timed"]:
                self._accounting.publish_profile(self.profile.record(rows, seconds))
        if self._metrics is not None:
            self._metrics.response_margin_seconds.set(self.profile.margin())
        self.load_report = {
            "precision_max_relative_error": checked.parameter(),
            "cuda_graphs_status": graphs_status,
            "memory_plan_bytes": str(sum(r.nbytes for _, r in self._reservations if r)),
            "device_pool_bytes": str(self._arena_bytes()),
            "activation_bytes": ("not measured on the CPU" if warm["activation_bytes"] is None
                                 else str(warm["activation_bytes"])),
            "warmed_up_batch_sizes": ",".join(map(str, warm["batch_sizes"])) or "none",
            "weight_bytes": str(weights),
        }
        if self.footprint is not None:
            self.load_report.update(self.footprint.parameters())
        else:
            self.load_report["footprint_bytes"] = "not measured on the CPU"
        self._refresh_memory(force=True)
        if self._metrics is not None:
            self._published_largest = self._buckets.largest
            self._metrics.largest_bucket.set(self._published_largest)
        if self._stager is not None:
            self._stager.start()
        if self._turns is not None:
            on_charge = (self._metrics.device_share_seconds(spec.device).inc
                         if self._metrics is not None else None)
            self._turns.join(f"{spec.name}:{spec.version}", spec.batching.device_share_weight,
                             backlog=self._backlog, on_charge=on_charge)
        for executor in self._executors:
            executor.start()
        with self._failed_lock:
            self._accepting = not self._failed

    # -- loading steps ---------------------------------------------------------------------------

    def _convert(self, module: Any, precision: str) -> Any:
        """The module in ``precision``'s weights (fp16 weights are made here, in the model's
        weights pool)."""
        with self.memory.use(gpu.WEIGHTS):
            return precisions.convert(module, precision)

    def _run_once(self, module: Any, arrays: list[np.ndarray], precision: str
                  ) -> list[torch.Tensor]:
        """One forward of ``module`` on ``arrays`` (the precision check's runs), in the first
        instance's compute pool, which its warm-up and batches use next."""
        device = torch.device(self._spec.device)
        with self.memory.use(gpu.role("compute", 0)):
            tensors = [to_torch(np.array(a), t.datatype).to(device)
                       for a, t in zip(arrays, self._spec.inputs)]
            with torch.inference_mode(), precisions.autocast(precision, device.type):
                returned = module(*precisions.cast_inputs(tensors, precision))
        returned = unpack_outputs(returned, self._spec.outputs, self._spec.name)
        # BYTES outputs have no precision: the check compares the numeric ones.
        return [t for t, o in zip(returned, self._spec.outputs) if o.datatype != "BYTES"]

    def _executor(self, index: int, reservation: ModelReservation | None) -> Executor:
        spec = self._spec
        if reservation is None:
            slots = [Slot(i, ()) for i in range(spec.inflight_batches)]
            graph_buffers, owned = None, frozenset()
        else:
            slots = [Slot(i, tensors) for i, tensors in sorted(reservation.batch.items())]
            graph_buffers = ((reservation.inputs, reservation.outputs)
                             if reservation.inputs else None)
            owned = frozenset(t.untyped_storage().data_ptr()
                              for group in (reservation.batch, reservation.inputs,
                                            reservation.outputs)
                              for tensors in group.values() for t in tensors)
        plan = ExecutorPlan(
            slots=slots, buckets=self._buckets, stager=self._stager, graph_buffers=graph_buffers,
            owned_storage=owned, memory=self.memory)
        return Executor(
            spec, self._module, index=index, next_batch=self._queue.next_batch,
            wake=self._queue.wake, deliver=self._post, batch_ids=_next_batch_id,
            accounting=self._accounting, on_dead=self._instance_died, plan=plan,
            turns=self._turns, views_wanted=self._delivery.per_request_views)

    def _after_batch(self) -> None:
        """After each batch: the gauges that follow the memory in use, and the largest bucket
        (which comes back up a while after an out-of-memory lowered it)."""
        pools = {pool for pool, _ in self._reservations if pool is not None}
        for pool in pools:
            self._device.refresh(pool)
        self._refresh_memory()
        if self._metrics is not None:
            largest = self._buckets.largest
            if largest != self._published_largest:
                self._published_largest = largest
                self._metrics.largest_bucket.set(largest)

    def _warm_up(self) -> dict[str, Any]:
        """Warm every instance; the first one's report (they run the same batches)."""
        spec = self._spec
        samples = warmup_sets(spec, self._warmup_inputs, self._buckets) if spec.warmup else []
        reports = []
        for executor in self._executors:
            try:
                reports.append(executor.warm_up(samples))
            except torch.OutOfMemoryError as exc:
                log.error("warmup_out_of_memory", model=spec.name, error=str(exc).split("\n")[0])
                raise ResourceExhausted(
                    f"model '{spec.name}' ran out of device memory warming up its batch sizes "
                    f"(up to {spec.max_batch_size or 1}); lower max_batch_size or free memory"
                ) from exc
            except Exception as exc:
                log.exception("warmup_failed", model=spec.name)
                raise LoadError(
                    f"model '{spec.name}' failed its warm-up "
                    f"({type(exc).__name__}); the server log has the details"
                ) from exc
        report = reports[0]
        measured = [r["activation_bytes"] for r in reports if r["activation_bytes"] is not None]
        if measured:  # each instance has a compute pool of its own
            report["activation_bytes"] = sum(measured)
        if samples:
            log.info("model_warmed_up", model=spec.name, batch_sizes=report["batch_sizes"],
                     activation_bytes=report["activation_bytes"])
        return report

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
                self._removed(request)
            self._fail_threadsafe(left, error, "unavailable")
        if self._turns is not None:
            self._turns.leave()
        if self._stager is not None:
            self._stager.stop()
        hung = sum(e.hung_calls for e in self._executors)
        if drained and not hung:
            self._close_memory()
        elif self._reservations:
            # A batch still running (a drain that timed out, a call that hung) may write the
            # buffers: they stay reserved rather than go to another model.
            log.warning("memory_plan_kept", model=self._spec.name, hung_calls=hung,
                        bytes=sum(r.nbytes for _, r in self._reservations if r))

    # -- the event loop's side -----------------------------------------------------------------

    async def infer(self, request: InferenceRequest) -> dict[str, np.ndarray]:
        """Queue ``request`` and wait for its outputs (arrays for this request's rows only):
        for a model answering through futures (``FutureDelivery``, the default). A host with a
        delivery of its own submits (``submit``, ``submit_group``) and is answered through it."""
        if not isinstance(self._delivery, FutureDelivery):
            raise TypeError(f"model '{self._spec.name}' answers through its host's delivery "
                            f"({type(self._delivery).__name__}), not futures: submit instead")
        future = asyncio.get_running_loop().create_future()
        request.caller = future
        self.submit(request)
        try:
            return await future
        except asyncio.CancelledError:
            # A running batch still finishes; its answer is dropped.
            if self._queue.remove(request):
                self._removed(request)
            if not request.answered:
                request.answered = True
                self._count_failure("cancelled", [request])
            raise

    # -- from the executor threads -----------------------------------------------------------



def warmup_sets(spec: ModelSpec, given: list[list[np.ndarray]] | None,
                buckets: BatchBuckets) -> list[list[np.ndarray]]:
    """The input sets to warm up with: the config's ``model_warmup`` samples, else zeros at the
    default batch sizes; then zeros at every bucket no sample lands in, so each is warm."""
    sets = list(given) if given is not None else default_warmup(spec)
    if buckets.buckets:
        covered = {buckets.pad(arrays[0].shape[0]) for arrays in sets}
        sets += [[np.zeros((n, *t.dims), dtype=t.numpy_dtype) for t in spec.inputs]
                 for n in buckets.buckets if n not in covered]
        sets.sort(key=lambda arrays: arrays[0].shape[0])  # smallest first: a cheap failure
    return sets


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
