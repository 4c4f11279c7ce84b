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
import functools
import itertools
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import structlog
import torch

from batchgate.batcher import gpu
from batchgate.batcher import graphs as cuda_graphs
from batchgate.batcher import precision as precisions
from batchgate.batcher.accounting import ModelAccounting
from batchgate.batcher.admission import Admission
from batchgate.batcher.buckets import BatchBuckets
from batchgate.batcher.device import Devices
from batchgate.batcher.device_share import DeviceTurns
from batchgate.batcher.errors import (
    AdmissionRefused,
    BatchgateError,
    DeadlineExceeded,
    DeadlineInfeasible,
    InvalidRequest,
    LoadError,
    ModelUnavailable,
    QueueFull,
    RequestCancelled,
    ResourceExhausted,
)
from batchgate.batcher.batch import ExecutorPlan, Outcome, Slot
from batchgate.batcher.delivery import Delivery, FutureDelivery
from batchgate.batcher.expiry import Expiry
from batchgate.batcher.executor import Executor
from batchgate.batcher.forward import unpack_outputs
from batchgate.batcher.tensors import TORCH_DTYPES, to_torch
from batchgate.batcher.memory import DevicePools
from batchgate.batcher.metrics import BatcherMetrics, ModelMetrics
from batchgate.batcher.memory_plan import model_plan
from batchgate.batcher.pool import (
    DEFAULT_POOL_ALIGNMENT,
    DevicePool,
    ModelReservation,
    unpooled_reservation,
)
from batchgate.batcher.profile import LatencyProfile
from batchgate.batcher.queue import ModelQueue
from batchgate.batcher.request import DONE, InferenceRequest
from batchgate.batcher.spec import ModelSpec
from batchgate.batcher.staging import Block, InputStager
from batchgate.batcher.stats import ModelStats

log = structlog.get_logger(__name__)

_batch_ids = itertools.count(1)
_batch_ids_lock = threading.Lock()
_reservation_ids = itertools.count(1)
# Staged inputs a model may hold in its pool, in batches' worth beyond those in flight.
STAGING_BATCHES = 2


def _next_batch_id() -> int:
    with _batch_ids_lock:
        return next(_batch_ids)


class ServedModel:
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

    def _weight_bytes(self) -> int:
        """What the model holds before any batch: its pool's allocated bytes when its weights
        were loaded under it, else its parameters' and buffers' bytes on its device."""
        stats = self.memory.stats()
        in_pool = stats["weights"].allocated if stats and "weights" in stats else 0
        return in_pool or gpu.module_bytes(self._module, torch.device(self._spec.device))

    def _admit_footprint(self, weights: int, warm: dict[str, Any]) -> None:
        """Measure what the warm model holds and admit it against the device's free memory
        (where memory is measured: CUDA). Raises ResourceExhausted; ``stop`` then frees it."""
        memory = self.memory
        if not memory.measures:
            return
        stats = memory.stats() or {}
        graphs = stats["graphs"].reserved if "graphs" in stats else 0
        # Every instance's own pools: their segments stay cached, so what they reserved is
        # their peak, measured without synchronizing the device or counting other models.
        activations = stats["activations"].reserved if "activations" in stats else 0
        plan = sum(r.nbytes for _, r in self._reservations if r)
        staging = self._stager.cap_bytes if self._stager is not None else 0
        self.footprint = footprint = gpu.Footprint(
            weights=weights, activations=activations, graphs=graphs, staging=staging, plan=plan)
        # Taken from the device already: the pools' segments (which hold the warm-up's peak)
        # and the plan and staging, which the model's arena reserved before the warm-up.
        held = sum(s.reserved for s in stats.values()) + plan + staging
        free, total = memory.free_and_total()
        try:
            gpu.admit(self._spec.name, self._spec.device, footprint, held=held, free=free,
                      total=total)
        except ResourceExhausted as exc:
            log.error("model_does_not_fit", model=self._spec.name, reason=str(exc))
            raise
        log.info("model_footprint", model=self._spec.name, device=self._spec.device,
                 **footprint.parameters(), device_free_bytes=free)

    def _refresh_memory(self, *, force: bool = False, closing: bool = False) -> None:
        """Set the memory gauges of this model and its device (at most once a second, after
        batches: reading the pools walks the allocator's segments)."""
        metrics, memory = self._metrics, self.memory
        if metrics is None or not memory.measures and not closing:
            return
        now = time.monotonic()
        if not force and now - self._memory_refreshed < 1.0:
            return
        self._memory_refreshed = now
        device = self._spec.device
        reserved_gauge = metrics.model_device_bytes_reserved(device)
        allocated_gauge = metrics.model_device_bytes_allocated(device)
        stats = None if closing else memory.stats()
        if stats is None:
            reserved_gauge.set(0)
            allocated_gauge.set(0)
            for part in gpu.FOOTPRINT_PARTS:
                metrics.footprint_bytes(device, part).set(0)
        else:
            reserved_gauge.set(sum(s.reserved for s in stats.values()))
            allocated_gauge.set(sum(s.allocated for s in stats.values()))
            if self.footprint is not None:
                for part in gpu.FOOTPRINT_PARTS:
                    metrics.footprint_bytes(device, part).set(getattr(self.footprint, part))
        if memory.measures:
            whole = memory.device_stats()
            metrics.device(device, whole.reserved, whole.allocated)

    def _graph_plan(self) -> tuple[tuple[int, ...], str]:
        """The buckets to capture CUDA graphs for, and what to report when there are none."""
        spec = self._spec
        if not spec.cuda_graphs:
            return (), "off"
        reason = cuda_graphs.unavailable_reason(spec, self.memory)
        if reason is not None:
            log.info("cuda_graphs_unavailable", model=spec.name, reason=reason, running="eager")
            return (), f"eager: {reason}"
        return spec.buckets, ""

    def _reserve(self, graph_buckets: tuple[int, ...]) -> None:
        """One memory plan per instance and room for the staged inputs, in an arena reserved
        for this model at exactly that size (``batcher/memory.py``), all or nothing."""
        spec = self._spec
        slots = spec.inflight_batches
        if not self._pooled:
            self._reservations = [(None, None)] * spec.instance_count
            return
        plan = model_plan(
            [(t.dims, TORCH_DTYPES[t.datatype]) for t in spec.inputs],
            [(t.dims, TORCH_DTYPES[t.datatype]) for t in spec.outputs] if graph_buckets else [],
            max_rows=spec.max_batch_size or None, slots=slots, graph_buckets=graph_buckets)
        staging = self._staging_room() if spec.input_staging == "queue" else 0
        per_instance = [b.nbytes for b in plan.buffers] + [plan.activation_bytes]
        sizes = per_instance * spec.instance_count + ([staging] if staging else [])
        owner = f"{spec.name}:{spec.version}#{next(_reservation_ids)}"
        what = plan.describe() + (f", x{spec.instance_count} instances"
                                  if spec.instance_count > 1 else "") + \
            (f" + {staging} bytes of staged inputs" if staging else "")
        try:
            pool = self._device.reserve(owner, sizes, what)
        except ResourceExhausted as exc:
            log.error("model_does_not_fit", model=spec.name, reason=str(exc))
            raise ResourceExhausted(f"model '{spec.name}' was not loaded: {exc}") from None
        self._arena = (owner, pool)
        for index in range(spec.instance_count):
            name = f"{owner}.{index}"
            if pool is None:
                reservation = unpooled_reservation(name, plan, spec.device)
            else:
                try:
                    reservation = pool.admit(name, plan)
                except ResourceExhausted as exc:  # sized for it: only a defect gets here
                    log.error("model_does_not_fit", model=spec.name, reason=str(exc))
                    self._release()
                    raise ResourceExhausted(
                        f"model '{spec.name}' was not loaded: {exc}") from None
            self._reservations.append((pool, reservation))
            self._count_reserved(pool, reservation.nbytes, reservation.fallbacks)
        if self._metrics is not None and pool is not None:
            # The whole arena is the model's: the plan, and the room left for staged inputs.
            self._metrics.pool_bytes_reserved.set(pool.bytes_reserved)
        log.info("memory_plan_admitted", model=spec.name, device=spec.device,
                 instances=spec.instance_count, plan=plan.describe(),
                 bytes=sum(r.nbytes for _, r in self._reservations), staging_bytes=staging,
                 pool_bytes=pool.bytes_reserved if pool is not None else 0,
                 pooled=pool is not None)
        if spec.input_staging == "queue":
            self._stager = self._new_stager(pool)

    def _arena_bytes(self) -> int:
        """What the device pool holds for this model: its arena (0 when it has none)."""
        pool = self._arena[1] if self._arena is not None else None
        return pool.bytes_reserved if pool is not None else 0

    def _staging_room(self) -> int:
        """The arena bytes the staged inputs may need at most: the cap's worth of one-row
        requests (the worst case: each input's block is rounded up to the pool's alignment)."""
        spec = self._spec
        align = DEFAULT_POOL_ALIGNMENT
        per_sample = sum(max(-(-math.prod(t.dims) * TORCH_DTYPES[t.datatype].itemsize // align),
                             1) * align for t in spec.inputs)
        batches = spec.inflight_batches * spec.instance_count + STAGING_BATCHES
        return batches * max(spec.max_batch_size, 1) * per_sample

    def _staging_cap(self) -> int:
        """The most the queued requests' staged inputs may hold (the stager's cap)."""
        spec = self._spec
        per_sample = sum(math.prod(t.dims) * TORCH_DTYPES[t.datatype].itemsize
                         for t in spec.inputs)
        batches = spec.inflight_batches * spec.instance_count + STAGING_BATCHES
        return batches * max(spec.max_batch_size, 1) * per_sample

    def _count_reserved(self, pool: DevicePool | None, nbytes: int, fallbacks: int) -> None:
        if self._metrics is not None:
            self._metrics.pool_bytes_reserved.inc(nbytes)
            self._metrics.pool_bytes_in_use.inc(nbytes)
            if fallbacks:
                self._metrics.pool_fallbacks.inc(fallbacks)
        if pool is not None:
            self._device.refresh(pool)

    def _new_stager(self, pool: DevicePool | None) -> InputStager:
        spec = self._spec
        device = torch.device(spec.device)
        metrics = self._metrics

        staging = gpu.role("staging")

        def allocate(shape: tuple[int, ...], dtype: torch.dtype) -> Block | None:
            # On the stager's thread: what does not come from the arena comes from the
            # model's staging pool.
            if pool is None:
                with self.memory.use(staging):
                    tensor = torch.empty(shape, dtype=dtype, device=device)
                return Block(tensor, lambda: None, tensor.nbytes, True)
            handle = pool.allocate(shape, dtype, lifetime="short",  # freed once its batch ran
                                   outside=lambda: self.memory.use(staging))
            if handle is None:
                return None
            return Block(handle.tensor, handle.release, handle.nbytes, handle.in_pool)

        types = [t.datatype for t in spec.inputs]
        return InputStager(
            spec.name, device,
            to_tensor=lambda array, i: to_torch(array, types[i]),
            dtypes=[TORCH_DTYPES[t] for t in types], allocate=allocate,
            cap_bytes=self._staging_cap(),
            on_bytes=metrics.pool_bytes_in_use.inc if metrics is not None else None,
            on_fallback=metrics.pool_fallbacks.inc if metrics is not None else None)

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

    def _release(self) -> None:
        """Give the memory plans back to the pool, then the model's arena (idempotent)."""
        reservations, self._reservations = self._reservations, []
        for pool, reservation in reservations:
            if reservation is None:
                continue
            if pool is not None:
                pool.release(reservation.name)
            if self._metrics is not None:
                self._metrics.pool_bytes_in_use.dec(reservation.nbytes)
        arena, self._arena = self._arena, None
        if arena is not None and arena[1] is not None:
            self._device.release(*arena)
        if self._metrics is not None:
            self._metrics.pool_bytes_reserved.set(0)

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

    def _close_memory(self) -> None:
        """Give the model's memory back to the device: with no thread inside any pool, drop
        every view of it (executors' slots and graphs, the stager, the plan), then the arena,
        then the model's pools (``ModelMemory.close``)."""
        def drop_views() -> None:
            for executor in self._executors:
                executor.release()
            self._module = None
            self._stager = None
            self._release()

        self.memory.close(before=drop_views)
        self._refresh_memory(force=True, closing=True)

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

    def submit(self, request: InferenceRequest, *, publish_depth: bool = True) -> None:
        """Queue ``request``; its answer goes to the model's delivery (on the running loop).

        Refusals (unavailable, bad priority, queue full, admission control) raise at once. A
        caller that gives up on the request calls ``cancel(request)`` (``infer`` does).
        ``publish_depth`` False: the queue-depth gauge is left for the caller's
        ``publish_depth`` after the run of requests it submits in one go.
        """
        if not self._accepting:
            raise ModelUnavailable(self._not_serving())
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        self._resolve(request)
        if self._admission is not None and request.deadline is not None:
            self._admit(request)
        try:
            self._queue.put(request, publish_depth)
        except QueueFull:
            self._count_failure("rejected", [request])
            raise
        self._queued(request, loop)

    def submit_group(self, requests: list[InferenceRequest]
                     ) -> list[tuple[int, BatchgateError]]:
        """``submit(request, publish_depth=False)`` for each of ``requests``, in order (the
        executor process's requests of one read): the ones refused, as (index, error); the
        others are queued. Admission control's quick bound is asked once for them all, and the
        queue's lock taken once; where the bound cannot tell, each is submitted in turn, seeing
        the ones before it queued."""
        if len(requests) > 1 and self._accepting:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            refused: list[tuple[int, BatchgateError]] = []
            resolved: list[int] = []  # indexes of the requests whose level and deadline are set
            for index, request in enumerate(requests):
                try:
                    self._resolve(request)
                except BatchgateError as exc:
                    refused.append((index, exc))
                    continue
                resolved.append(index)
            chosen = [requests[i] for i in resolved]
            if chosen and self._surely_admitted(chosen):
                turned_away = self._queue.put_all(chosen)
                full = [chosen[i] for i, error in turned_away if isinstance(error, QueueFull)]
                if full:
                    self._count_failure("rejected", full)
                away = {i for i, _ in turned_away}
                for i, request in enumerate(chosen):
                    if i not in away:
                        self._queued(request, self._loop)
                refused.extend((resolved[i], error) for i, error in turned_away)
                return refused
            requests = chosen  # the bound cannot tell: each in turn, as below
        else:
            refused, resolved = [], list(range(len(requests)))
        for index, request in zip(resolved, requests):
            try:
                self.submit(request, publish_depth=False)
            except BatchgateError as exc:
                refused.append((index, exc))
        return refused

    def _not_serving(self) -> str:
        return f"model '{self._spec.name}' is not serving; retry later"

    def _resolve(self, request: InferenceRequest) -> None:
        """The request's priority level and its deadline (its own, or its timeout's under the
        level's queue policy); raises InvalidRequest for a priority out of range."""
        level = request.priority or self._default_level
        if not 0 < level <= self._levels:
            raise InvalidRequest(
                f"priority must lie in 1..{self._levels} for model '{self._spec.name}' "
                f"(0 = default), got {request.priority}"
            )
        request.level = level
        timeout_us, may_override, delays = self._policies[level]
        if request.timeout_us and (may_override or not timeout_us):
            timeout_us = request.timeout_us
        deadline = request.deadline
        if timeout_us and not delays:
            by_timeout = request.arrival + timeout_us / 1e6
            deadline = by_timeout if deadline is None else min(deadline, by_timeout)
        request.deadline = deadline  # the queue's deadline policy reads it

    def _surely_admitted(self, requests: list[InferenceRequest]) -> bool:
        """True when admission control would admit every one of ``requests`` queued one after
        another: its quick bound holds for them all at once (their samples all queued ahead of
        each, the earliest deadline for each), or none has a deadline to check."""
        if self._admission is None:
            return True
        deadline = min([r.deadline for r in requests if r.deadline is not None], default=None)
        if deadline is None:
            return True
        queue = self._queue
        return self._admission.surely_in_time(
            batch_size=sum([r.batch_size for r in requests]), deadline=deadline,
            now=time.monotonic(),
            samples_queued=queue.samples_ahead(max([r.level for r in requests])),
            batches_in_flight=self._accounting.inflight_count())

    def _queued(self, request: InferenceRequest, loop: asyncio.AbstractEventLoop) -> None:
        """What follows a request's joining the queue: fifo admission's arrivals, its inputs'
        staging, and its deadline's watch."""
        if self._admission is not None:
            self._admission.queued(request.batch_size, request.arrival)
        if self._stager is not None:
            self._stager.put(request)
        if request.deadline is not None:
            self._expiry.watch(request, loop)

    def publish_depth(self) -> None:
        """The queue-depth gauge gets the queue's depth (after ``submit(publish_depth=False)``)."""
        self._queue.publish_depth()

    def _admit(self, request: InferenceRequest) -> None:
        """Admission control (``batcher/admission.py``): raise, counted, if it cannot be in time."""
        now = time.monotonic()
        admission, queue = self._admission, self._queue
        if admission.surely_in_time(batch_size=request.batch_size, deadline=request.deadline,
                                    now=now, samples_queued=queue.samples_ahead(request.level),
                                    batches_in_flight=self._accounting.inflight_count()):
            return
        in_flight_s, in_flight_var = self._accounting.inflight_work_s(now)
        try:
            admission.check(batch_size=request.batch_size, deadline=request.deadline, now=now,
                            samples_ahead=queue.samples_ahead(request.level, request),
                            in_flight_s=in_flight_s, in_flight_var=in_flight_var)
        except AdmissionRefused:
            self._count_failure("rejected", [request])
            raise
        except DeadlineInfeasible:
            self._count_failure("infeasible", [request])
            raise

    def _expire(self, request: InferenceRequest) -> None:
        # A running batch still finishes; its answer is dropped.
        if self._queue.remove(request):
            self._removed(request)
        if not request.answered:
            request.answered = True
            self._count_failure("expired", [request])
            self._delivery.failed([request], DeadlineExceeded(
                f"request expired after waiting "
                f"{(time.monotonic() - request.arrival) * 1e3:.1f} ms "
                f"for model '{self._spec.name}'"))

    def cancel(self, request: InferenceRequest) -> None:
        """Answer a request CANCELLED on its caller's behalf (stream cancellation, a front end
        that went away): a queued one leaves the queue; a running one's answer is dropped."""
        if self._queue.remove(request):
            self._removed(request)
        if not request.answered:
            request.answered = True
            self._count_failure("cancelled", [request])
            self._delivery.failed([request], RequestCancelled("the request was cancelled"))

    def _removed(self, request: InferenceRequest) -> None:
        """``request`` left the queue without running: its staged inputs go back."""
        if self._stager is not None:
            self._stager.drop(request)

    # -- from the executor threads -----------------------------------------------------------

    def _post(self, outcome: Outcome) -> None:
        """On the executor's thread: the outcome to the loop, or delivered here while the loop
        waits for events (``Delivery.inline``)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            outcome.account()
            return
        if not self._queue.depth and self._delivery.inline(
                functools.partial(self._deliver, outcome)):
            return
        try:
            loop.call_soon_threadsafe(self._deliver, outcome)
        except RuntimeError:  # the loop closed meanwhile: nobody is waiting any more
            outcome.account()

    def _deliver(self, outcome: Outcome) -> None:
        """The batch's answers (or its error) to its requests; then its accounting, off the
        answers' path but before the loop takes its next message, so that a statistics call
        after an answer counts its batch (and the model's thread is free for the next one)."""
        try:
            self._answer(outcome)
        finally:
            outcome.account()

    def _answer(self, outcome: Outcome) -> None:
        requests = outcome.batch.requests
        if not outcome.inputs_in_use:
            for request in requests:
                request.state = DONE
                if request.on_release is not None:
                    request.on_release()
            if outcome.release_only:
                return
        delivery = self._delivery
        if outcome.error is not None:
            pending = [r for r in requests if not r.answered]
            self._count_failure("model_error", pending)
            for request in pending:
                request.answered = True
            delivery.failed(pending, outcome.error)
            return
        # Expired or cancelled while the batch ran (answered and counted then) are left out.
        live, first_rows, views = [], [], []
        results = outcome.results
        row = 0
        for index, request in enumerate(requests):
            if not request.answered:
                request.answered = True
                if request.input_error is not None:  # its inputs could not be read: it fails
                    delivery.failed([request], request.input_error)
                else:
                    live.append(request)
                    first_rows.append(row)
                    if results is not None:
                        views.append(results[index])
            row += request.batch_size
        now = time.monotonic()
        if outcome.batch.finished_at is not None:
            self._accounting.delivered(now - outcome.batch.finished_at)
        if live:
            delivery.results(live, first_rows, outcome.outputs,
                             views if results is not None else None)
        self._accounting.answered(live, now)

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
        left = self._queue.drain_remaining()
        for request in left:
            self._removed(request)
        self._fail_threadsafe(left, error, "unavailable")
        if self._on_failed is not None:
            self._on_failed(reason)

    def _fail_threadsafe(self, requests: list[InferenceRequest], error: Exception,
                         reason: str) -> None:
        """From a thread: answer ``requests`` with ``error`` on the loop, counted under ``reason``
        (there, so that a request whose deadline fired meanwhile is counted once)."""
        loop = self._loop
        if not requests or loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._fail, requests, error, reason)
        except RuntimeError:
            pass

    def _fail(self, requests: list[InferenceRequest], error: Exception, reason: str) -> None:
        pending = [r for r in requests if not r.answered]
        self._count_failure(reason, pending)
        for request in pending:
            request.answered = True
        if pending:
            self._delivery.failed(pending, error)

    def _infeasible_threadsafe(self, requests: list[InferenceRequest]) -> None:
        """The queue dropped ``requests``: their deadlines cannot be met. Called under the
        queue's lock, so it only hands them on to the loop."""
        error = DeadlineInfeasible(
            f"model '{self._spec.name}' could not have finished this request before its "
            "deadline, so it was dropped before running"
        )
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._drop_infeasible, requests, error)
        except RuntimeError:
            pass

    def _drop_infeasible(self, requests: list[InferenceRequest], error: Exception) -> None:
        for request in requests:
            self._removed(request)
        self._fail(requests, error, "infeasible")

    def _backlog(self) -> bool:
        """Work this model has right now: queued requests, or batches formed and not finished."""
        return self._queue.depth > 0 or self._accounting.has_inflight()

    def _count_failure(self, reason: str, requests: list[InferenceRequest]) -> None:
        self._accounting.failed(reason, requests)



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
