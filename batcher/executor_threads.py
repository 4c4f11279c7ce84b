"""An executor's threads: the model thread's own set-up, the assemble, compute and finish
loops (or the one serial loop with one batch in flight), and how an instance dies when one of
them fails.

``Executor`` (``batcher/executor.py``) takes these methods from ``ExecutorThreads``.
"""

from __future__ import annotations

import queue as queue_module
import threading
import time

import structlog
import torch

from batchgate.batcher import scheduling
from batchgate.batcher.batch import (
    Batch,
    InstanceDead,
    Slot,
)
from batchgate.batcher.errors import (
    ModelExecutionError,
    ModelUnavailable,
)
from batchgate.batcher.request import InferenceRequest

log = structlog.get_logger(__name__)

_interop_lock = threading.Lock()
_interop_set = False


class ExecutorThreads:
    """The loops of ``Executor``'s threads."""

    def _configure_thread(self) -> None:
        # Not the request path's SCHED_BATCH, which it would inherit (batcher/scheduling.py).
        scheduling.model_thread(threading.current_thread().name)
        if self._cuda:  # the current device is per thread too (events are made on it)
            torch.cuda.set_device(self._device)
        # OpenMP's thread count is per calling thread: set it here, not on the main thread.
        # Confined to the model CPUs (--model-cpus), torch's default is one per CPU there
        # (tests/test_scheduling.py); more, set by the model's config, take turns on them.
        threads = self._spec.intra_op_threads
        cpus = scheduling.model_cpus()
        if cpus is not None and threads > len(cpus) and not self._warned_cpus:
            self._warned_cpus = True
            log.warning("intra_op_threads_exceed_model_cpus", model=self._spec.name,
                        intra_op_threads=threads, model_cpus=sorted(cpus),
                        effect="the model's threads take turns on its CPUs")
        if threads:
            torch.set_num_threads(threads)
        global _interop_set
        if self._spec.inter_op_threads:
            with _interop_lock:
                if not _interop_set:
                    try:
                        torch.set_num_interop_threads(self._spec.inter_op_threads)
                    except RuntimeError:
                        log.warning("inter_op_threads_not_applied", model=self._spec.name,
                                    reason="torch's inter-op pool was already started")
                    _interop_set = True

    def _assemble_loop(self) -> None:
        scheduling.model_thread(threading.current_thread().name)
        if self._cuda:
            torch.cuda.set_device(self._device)
        try:
            while True:
                # The last batch's requests are not kept alive while the next is awaited (their
                # inputs may map a client's shared memory that is to be unmapped).
                taken = batch = None
                slot = self._free_slots.get()
                taken = self._next_batch(self._busy)
                if taken is None:
                    break
                batch = self._prepare(slot, *taken)
                if batch is None:
                    continue
                with self._running_lock:
                    if not self._dead:
                        self._running += 1
                        self._handoff.put(batch)
                        continue
                self._finish(batch, None, self._dead_error())
                break
        except BaseException as exc:
            self._die(f"its batching thread failed ({type(exc).__name__})", exc)
        finally:
            self._handoff.put(None)

    def _serial_loop(self) -> None:
        try:
            while True:
                taken = batch = None  # as in _assemble_loop
                slot = self._free_slots.get()
                taken = self._next_batch(None)
                if taken is None:
                    break
                batch = self._prepare(slot, *taken)
                if batch is not None:
                    self._compute(batch)
        except InstanceDead as exc:
            self._die(str(exc), None)
        except BaseException as exc:
            self._die(f"its batching thread failed ({type(exc).__name__})", exc)
        finally:
            self.alive.clear()
            if self._runner is not None:
                self._runner.close()

    def _prepare(self, slot: Slot, requests: list[InferenceRequest], reason: str
                 ) -> Batch | None:
        """The batch with its inputs assembled (on the device), or None if that failed."""
        batch = Batch(self._batch_ids(), requests, reason)
        batch.slot = slot
        self._accounting.taken(batch)
        try:
            started = time.perf_counter_ns()
            self._assemble(batch)
            batch.input_ns = time.perf_counter_ns() - started
        except Exception as exc:
            log.exception("batch_assembly_failed", model=self._spec.name, batch=batch.id)
            self._finish(batch, None, ModelExecutionError(
                f"model '{self._spec.name}': could not assemble a batch of "
                f"{batch.samples} ({type(exc).__name__})"))
            return None
        return batch

    def _busy(self) -> bool:
        return self._running > 0

    def _compute_loop(self) -> None:
        try:
            while (batch := self._handoff.get()) is not None:
                self._compute(batch)
                if not self._cuda:
                    self._retire()
                batch = None  # as in _assemble_loop
        except InstanceDead as exc:
            self._die(str(exc), None)
        except BaseException as exc:
            self._die(f"its compute thread failed ({type(exc).__name__})", exc)
        finally:
            self._finishing.put(None)
            self.alive.clear()
            if self._runner is not None:
                self._runner.close()

    def _finish_loop(self) -> None:
        scheduling.model_thread(threading.current_thread().name)
        torch.cuda.set_device(self._device)
        try:
            while (item := self._finishing.get()) is not None:
                self._complete(*item)
                self._retire()
                item = None  # as in _assemble_loop
        except InstanceDead as exc:
            self._die(str(exc), None)
            self._fail_finishing()
        except BaseException as exc:
            self._die(f"its finishing thread failed ({type(exc).__name__})", exc)
            self._fail_finishing()

    def _fail_finishing(self) -> None:
        """The finisher stopped: the batches still handed to it fail (compute goes on until
        its end mark)."""
        while (item := self._finishing.get()) is not None:
            self._finish(item[0], None, self._dead_error())
            self._retire()

    def _retire(self) -> None:
        with self._running_lock:
            self._running -= 1
        # The assembler may be holding back a partial batch until this one ended.
        self._wake()

    def _dead_error(self) -> ModelUnavailable:
        return ModelUnavailable(f"model '{self._spec.name}' stopped serving; retry after it is "
                                "loaded again")

    def _die(self, reason: str, exc: BaseException | None) -> None:
        """Stop taking batches, fail the ones handed over, and tell the model (once)."""
        with self._running_lock:
            if self._dead:
                return
            self._dead = True
        self.alive.clear()
        if exc is not None:
            log.error("executor_failed", model=self._spec.name, instance=self._index,
                      reason=reason, exc_info=exc)
        else:
            log.error("executor_failed", model=self._spec.name, instance=self._index,
                      reason=reason)
        while True:
            try:
                batch = self._handoff.get_nowait()
            except queue_module.Empty:
                break
            if batch is None:
                self._handoff.put(None)  # the assembler's end mark stays for the compute loop
                break
            self._finish(batch, None, self._dead_error())
        if self._on_dead is not None:
            self._on_dead(reason)
