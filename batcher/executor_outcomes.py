"""An executor's batch outcomes: results split per request and delivered, the slot recycled
or replaced, a batch that overran its device time or broke the device failed alone, and every
batch accounted.

``Executor`` (``batcher/executor.py``) takes these methods from ``ExecutorOutcomes``.
"""

from __future__ import annotations

import functools
import time

import numpy as np
import structlog
import torch

from batchgate.batcher import gpu
from batchgate.batcher.batch import (
    Batch,
    InstanceDead,
    Outcome,
    Slot,
)
from batchgate.batcher.errors import (
    ModelExecutionError,
    first_line,
)
from batchgate.batcher.request import InferenceRequest
from batchgate.batcher.watchdog import MAX_ABANDONED

log = structlog.get_logger(__name__)


class ExecutorOutcomes:
    """How ``Executor`` finishes, fails and accounts a batch."""

    def _device_broken(self, batch: Batch, exc: BaseException) -> None:
        """A sticky CUDA error: the context is broken and every later call would fail too.
        The instance (and the process's hook) hear of it before the batch's callers."""
        reason = f"a CUDA error broke the device ({first_line(exc)})"
        gpu.device_lost(reason)
        self._die(reason, None)
        self._finish(batch, None, ModelExecutionError(
            f"model '{self._spec.name}' hit a CUDA error that leaves {self._spec.device} "
            "unusable while running a batch; it stopped serving and the server log has the "
            "details"))
        raise InstanceDead(reason) from None

    def _device_failed(self, batch: Batch, exc: Exception) -> None:
        """Waiting for the batch's device work raised (a kernel's error, reported late)."""
        log.error("batch_device_failed", model=self._spec.name, batch=batch.id,
                  error=first_line(exc), requests=[r.id for r in batch.requests])
        if gpu.classify(exc) == "sticky":
            self._device_broken(batch, exc)
        self._finish(batch, None, ModelExecutionError(
            f"model '{self._spec.name}' failed on {self._spec.device} while running a batch of "
            f"{batch.samples} ({type(exc).__name__}); the server log has the details"))

    def _device_time_left(self, batch: Batch) -> float | None:
        """Seconds left of the batch's ``execution_timeout_ms`` (None: no limit). The limit
        covers the device's work, not only the launches: it counts from the compute's start."""
        timeout_ms = self._spec.execution_timeout_ms
        if not timeout_ms or batch.started_at is None:
            return None
        return batch.started_at + timeout_ms / 1e3 - time.monotonic()

    def _device_overran(self, batch: Batch) -> None:
        """The batch's device work outlived ``execution_timeout_ms`` (a hung or far too slow
        kernel): it fails; its slot and staged blocks stay with it until its event completes
        (``_reap_overdue``). Too many such batches still running and the instance is dead."""
        spec = self._spec
        log.error("batch_timed_out", model=spec.name, batch=batch.id, size=batch.samples,
                  execution_timeout_ms=spec.execution_timeout_ms, on="device",
                  requests=[r.id for r in batch.requests])
        with self._running_lock:
            self._overdue.append(batch)
            overdue = len(self._overdue)
        self._finish(batch, None, ModelExecutionError(
            f"model '{spec.name}' did not finish a batch of {batch.samples} within "
            f"execution_timeout_ms={spec.execution_timeout_ms} (its work on {spec.device} was "
            "still running); the batch failed"), inputs_in_use=True)
        if overdue > MAX_ABANDONED:
            raise InstanceDead(f"{overdue} batches overran execution_timeout_ms="
                               f"{spec.execution_timeout_ms} on the device and are still running")

    def _reap_overdue(self) -> None:
        """Overdue batches whose device work has ended give back their inputs."""
        with self._running_lock:
            if not self._overdue:
                return
            ended = [b for b in self._overdue if b.done.query()]
            self._overdue = [b for b in self._overdue if b not in ended]
        for batch in ended:
            batch.tensors = []
            batch.device_outputs = None
            if batch.staged:
                self._stager.release(batch.staged)
                batch.staged = []
            self._deliver(Outcome(batch, None, None, release_only=True))

    def _fail(self, batch: Batch, error: Exception) -> None:
        # The failed forward may have left copies or kernels reading the slot's buffers: they
        # must end before the slot and the staged blocks are reused.
        self._sync_streams()
        self._finish(batch, None, error)

    def _finish(self, batch: Batch, results: list[dict[str, np.ndarray]] | None,
                error: Exception | None, *, outputs: list[np.ndarray] | None = None,
                inputs_in_use: bool = False, ran: tuple[int, int] | None = None) -> None:
        """Hand the batch's answers (or its ``error``) on. ``ran``: the forward's and the
        outputs' nanoseconds of a batch that ran; its accounting travels with the outcome, for
        the receiver to run after the answers have gone."""
        if inputs_in_use:
            # Its device work may still read them: the tensors stay with the batch too.
            self._replace_slot(batch.slot)  # staged blocks too stay with the batch
        else:
            batch.tensors = []
            batch.device_outputs = None
            self._recycle(batch)
        self._accounting.ended(batch)
        if self._turns is not None:  # after the count: the share asks whether more work waits
            self._turns.end(batch.id)
        batch.finished_at = time.monotonic()
        self._deliver(Outcome(batch, results, error, outputs=outputs,
                              inputs_in_use=inputs_in_use,
                              accounting=functools.partial(self._account, batch, ran)))

    def _account(self, batch: Batch, ran: tuple[int, int] | None) -> None:
        """A finished batch's statistics, metrics and latency profile (if it ran), and the
        gauges that follow memory."""
        if ran is not None:
            self._accounting.ran(batch, *ran)
        self._accounting.after_batch()

    def _recycle(self, batch: Batch) -> None:
        """The batch's staged blocks and slot go back: nothing reads them any more."""
        if batch.staged:
            self._stager.release(batch.staged)
            batch.staged = []
        self._free_slots.put(batch.slot)

    def _replace_slot(self, slot: Slot) -> None:
        """A call that timed out may still read ``slot``'s buffers: they stay with it (the
        model's plan keeps them until unload) and the instance goes on with fresh ones, made
        outside the pool (bounded by the runner's limit on hung calls)."""
        fresh = Slot(slot.index, [torch.empty_like(t) for t in slot.inputs])
        self._owned_storage.update(t.untyped_storage().data_ptr() for t in fresh.inputs)
        log.warning("batch_buffers_replaced", model=self._spec.name, instance=self._index,
                    slot=slot.index, bytes=sum(t.nbytes for t in fresh.inputs))
        self._free_slots.put(fresh)

    def _release_late(self, batch: Batch) -> None:
        """A timed-out call returned (on its abandoned runner): its inputs are free now."""
        self._sync_streams()
        batch.tensors = []
        batch.device_outputs = None
        if batch.staged:
            self._stager.release(batch.staged)
            batch.staged = []
        self._deliver(Outcome(batch, None, None, release_only=True))

    def _split(self, requests: list[InferenceRequest], host: list[np.ndarray]
               ) -> list[dict[str, np.ndarray]]:
        names = [o.name for o in self._output_specs]
        if not self._batching or len(requests) == 1:
            return [dict(zip(names, host))]
        results = []
        start = 0
        for request in requests:
            stop = start + request.batch_size
            results.append({name: array[start:stop] for name, array in zip(names, host)})
            start = stop
        return results
