"""A served model's memory: its plan reserved in the device's pool, the footprint admitted
against the device, the input stager's room, and all of it given back when the model stops.

``ServedModel`` (``batcher/model.py``) takes these methods from ``ModelMemory``; they read and
set its state (``self._pool``, ``self._reservation``, ...) and run where ``start`` and ``stop``
run, off the event loop.
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Any

import structlog
import torch

from batchgate.batcher import gpu
from batchgate.batcher import graphs as cuda_graphs
from batchgate.batcher.errors import ResourceExhausted
from batchgate.batcher.tensors import TORCH_DTYPES, to_torch
from batchgate.batcher.memory_plan import model_plan
from batchgate.batcher.pool import (
    DEFAULT_POOL_ALIGNMENT,
    DevicePool,
    unpooled_reservation,
)
from batchgate.batcher.staging import Block, InputStager

log = structlog.get_logger(__name__)

_reservation_ids = itertools.count(1)
# Staged inputs a model may hold in its pool, in batches' worth beyond those in flight.
STAGING_BATCHES = 2


class ModelMemory:
    """The memory half of ``ServedModel``."""

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
