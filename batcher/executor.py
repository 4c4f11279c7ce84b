"""Executors: the threads that turn queued requests into model calls and answers.

Each model instance has at most ``inflight_batches`` batches in flight, each in a *slot*
that owns the batch's input buffers (carved from the device memory pool at load, sized for the
largest batch). Threads:

- the *assembler* waits for the queue's policy to release a batch, copies each request's rows
  into the slot's buffers — on a GPU from the request's staged device blocks (``staging.py``)
  or from host memory, on a copy stream — zeroes the padding rows up to the batch's bucket and
  records an event;
- the *compute* thread (the instance's *model thread*) makes its stream wait for that event,
  runs the model (a captured CUDA graph for the bucket, or eager under the model's precision),
  checks that every output kept the batch dimension, and on a GPU starts the copies of the
  outputs (padding rows dropped) into pinned host memory on an output stream of their own (the
  next batch's compute does not queue behind them) and records a blocking event;
- on a GPU a *finisher* thread waits for that event, splits the outputs per request and hands
  them back. So one batch is assembled and one computes while the last one's outputs come home.
  On the CPU the compute thread finishes its batch itself (nothing is asynchronous there).

With one batch in flight (``ModelSpec.inflight_batches``: by default on the CPU, and always
under the deadline policy) a single thread, the model thread, does all of it, one batch at a
time. The model thread is started by the warm-up and runs it before it serves: one thread per
instance runs the model from its first forward to its last, so its cuBLAS workspaces (one per
thread and stream, never freed) are made once, outside the pools, and a CUDA graph replays
with the workspace of the thread it was captured on, which no other live instance shares. The
event loop is touched once per finished batch (``call_soon_threadsafe``; or not at all, when the
model's delivery has the thread answer the batch itself: ``Delivery.inline``). A
model exception fails only its batch.

With ``execution_timeout_ms`` each batch's run goes through a ``TimedRunner``
(``batcher/watchdog.py``): a batch that overruns fails, and since the abandoned call may still
read its slot's buffers, that slot is retired and the instance goes on with fresh buffers
(allocated outside the pool; at most ``watchdog.MAX_ABANDONED`` times before the instance is
declared dead). On a GPU the limit covers the device's work too: the wait for a batch's event
polls it against the same deadline, and a batch whose kernels are still running then fails the
same way (its slot and staged blocks are kept until its event completes). A model that raises a
``BaseException`` (SystemExit...), a sticky CUDA error (``batcher/gpu.py``: the context is
broken; the process is told through ``gpu.on_device_lost``) or an executor thread that fails
kills the instance (``on_dead``): its queued batches fail with UNAVAILABLE.

Filling a slot's buffers (the gather, padding, host concatenation) is ``batcher/assembly.py``;
the model call itself (precision, the outputs' check, graph replay, the out-of-memory split)
is ``batcher/forward.py``; the batch and slot types and the accounting interface are
``batcher/batch.py``.

Memory (``ExecutorPlan.memory``, ``batcher/gpu.py``): the allocator lets one thread at a time
into a pool, so each instance allocates into pools of its own, one per thread role: its
forwards (eager batches, graph warm-ups) into ``compute<i>``, its graph captures into
``graphs<i>``, and, for a model without fixed buffers, its assembler's host-to-device copies
into ``gather<i>``; the fixed-buffer gather allocates nothing. When a call hangs past
``execution_timeout_ms`` its runner keeps the compute pool it is in, and the next runner gets a
fresh one. Device memory a stream other than its own reads is kept referenced by its batch until
the batch's event completed, never ``record_stream``-ed: while any thread is inside a pool the
allocator defers such frees indefinitely. Waits after a failure synchronize this instance's
streams, never the whole device.

Models whose inputs have variable dims or are BYTES cannot have fixed buffers: their batches
are concatenated on the host and copied to the device as they are (no padding, no graphs).
"""

from __future__ import annotations

import contextlib
import queue as queue_module
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import structlog
import torch

from batchgate.batcher import gpu
from batchgate.batcher.assembly import BatchAssembly
from batchgate.batcher.batch import (
    Batch,
    BatchAccounting,
    ExecutorPlan,
    InstanceDead,
    Outcome,
    Slot,
    default_plan,
)
from batchgate.batcher.device_share import DeviceTurns
from batchgate.batcher.errors import (
    BatchgateError,
    ModelExecutionError,
)
from batchgate.batcher.executor_outcomes import ExecutorOutcomes
from batchgate.batcher.executor_threads import ExecutorThreads
from batchgate.batcher.executor_warmup import ExecutorWarmup
from batchgate.batcher.forward import ModelForward
from batchgate.batcher.request import InferenceRequest
from batchgate.batcher.spec import ModelSpec, TensorSpec
from batchgate.batcher.tensors import TORCH_DTYPES, to_numpy
from batchgate.batcher.watchdog import ExecutionTimeout, TimedRunner, TooManyHungCalls

log = structlog.get_logger(__name__)

_SERVE = object()  # the model thread's last job: serve until the queue closes


class Executor(ExecutorWarmup, ExecutorThreads, ExecutorOutcomes):
    """One model instance: its slots, streams and threads."""

    def __init__(
        self,
        spec: ModelSpec,
        module: Callable[..., Any],
        *,
        index: int,
        next_batch: Callable[..., tuple[list[InferenceRequest], str] | None],
        wake: Callable[[], None],
        deliver: Callable[[Outcome], None],
        batch_ids: Callable[[], int],
        accounting: BatchAccounting | None = None,
        on_dead: Callable[[str], None] | None = None,
        plan: ExecutorPlan | None = None,
        turns: DeviceTurns | None = None,
        views_wanted: bool = True,
    ) -> None:
        self._spec = spec
        # False when whoever takes the outcome reads only its whole outputs (the executor
        # process's delivery), so no request gets its own views of them.
        self._views_wanted = views_wanted
        self._index = index
        self._next_batch = next_batch
        self._wake = wake
        # Batches handed to the compute thread and not finished yet.
        self._running = 0
        self._deliver = deliver
        self._batch_ids = batch_ids
        self._accounting = accounting if accounting is not None else BatchAccounting()
        # The device's weighted turns (batcher/device_share.py), when the model takes part.
        self._turns = turns
        self._plan = plan if plan is not None else default_plan(spec)
        self._buckets = self._plan.buckets
        self._stager = self._plan.stager
        self._pooled = bool(self._plan.slots[0].inputs)
        self._device = torch.device(spec.device)
        self._cuda = self._device.type == "cuda"
        self._batching = spec.batching.max_batch_size > 0
        self._free_slots: queue_module.SimpleQueue[Slot] = queue_module.SimpleQueue()
        for slot in self._plan.slots:
            self._free_slots.put(slot)
        self._pipelined = len(self._plan.slots) > 1
        self._running_lock = threading.Lock()
        self._handoff: queue_module.SimpleQueue[Batch | None] = queue_module.SimpleQueue()
        self._finishing: queue_module.SimpleQueue[tuple | None] = queue_module.SimpleQueue()
        self._copy_stream = torch.cuda.Stream(self._device) if self._cuda else None
        self._compute_stream = torch.cuda.Stream(self._device) if self._cuda else None
        self._output_stream = torch.cuda.Stream(self._device) if self._cuda else None
        self._outputs_read: Any = None  # the last batch's output copies (an event)
        self._memory = (self._plan.memory if self._plan.memory is not None
                        else gpu.ModelMemory("cpu"))
        # The pool this instance's forwards allocate into; a new one after a hung call.
        self._compute_role = gpu.role("compute", index)
        self._compute_generation = 0
        self._overdue: list[Batch] = []  # failed past the timeout, device work still running
        self._input_types = [t.datatype for t in spec.inputs]
        self._output_specs: Sequence[TensorSpec] = spec.outputs
        self._model = ModelForward(spec, module, buckets=self._buckets, pooled=self._pooled,
                                   accounting=self._accounting,
                                   pool=lambda: self._memory.use(self._compute_role),
                                   reclaim=self._memory.reclaim)
        self._assembly = BatchAssembly(
            spec, buckets=self._buckets, stager=self._stager, pooled=self._pooled,
            copy_stream=self._copy_stream, memory=self._memory, accounting=self._accounting,
            gather_role=gpu.role("gather", index))
        # Storages of our buffers, for the alias check; grows when a slot is replaced.
        self._owned_storage = set(self._plan.owned_storage)
        self._threads: list[threading.Thread] = []
        # The model thread's work: warm-up jobs, then _SERVE (or None: stop unserved).
        self._model_jobs: queue_module.SimpleQueue = queue_module.SimpleQueue()
        self._model_thread: threading.Thread | None = None
        self._started = False
        self.alive = threading.Event()
        self._on_dead = on_dead
        self._dead = False  # set under _running_lock: no batch is handed over after it
        self._warned_cpus = False  # intra_op_threads_exceed_model_cpus, said once
        timeout_ms = spec.execution_timeout_ms
        self._runner = (
            TimedRunner(f"{spec.name}-{index}", timeout_ms / 1e3, self._configure_thread)
            if timeout_ms else None
        )

    @property
    def graph_buckets(self) -> tuple[int, ...]:
        return self._model.graphs.buckets if self._model.graphs is not None else ()

    @property
    def hung_calls(self) -> int:
        """Timed-out calls that have not returned: they may still use the model's buffers."""
        return self._runner.hung if self._runner is not None else 0

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        name = f"{self._spec.name}-{self._index}"
        self._threads = []
        if self._pipelined:
            self._threads.append(threading.Thread(
                target=self._assemble_loop, name=f"{name}-assemble", daemon=True))
            if self._cuda:
                self._threads.append(threading.Thread(
                    target=self._finish_loop, name=f"{name}-finish", daemon=True))
        self.alive.set()
        self._started = True
        self._start_model_thread()
        self._model_jobs.put(_SERVE)
        for thread in self._threads:
            thread.start()

    def _start_model_thread(self) -> None:
        """The thread that runs the model: with one batch in flight it forms, assembles and
        computes (saving a thread and a GIL hand-off per batch); with more, it computes."""
        if self._model_thread is not None:
            return
        role = "compute" if self._pipelined else "batch"
        self._model_thread = threading.Thread(
            target=self._model_thread_main, name=f"{self._spec.name}-{self._index}-{role}",
            daemon=True)
        self._model_thread.start()

    def _model_thread_main(self) -> None:
        self._configure_thread()
        while True:
            job = self._model_jobs.get()
            if job is None:  # stopped before it served
                return
            if job is _SERVE:
                (self._compute_loop if self._pipelined else self._serial_loop)()
                return
            job()
            job = None  # the warm-up's closure and what it holds go now

    def join(self, timeout_s: float | None) -> bool:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        threads = list(self._threads)
        if self._model_thread is not None:
            if not self._started:
                # Warmed up, never started: it waits idle for a job, and ends at this one.
                self._model_jobs.put(None)
                self._model_thread.join()
            threads.append(self._model_thread)
        for thread in threads:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            thread.join(left)
        return not any(t.is_alive() for t in threads)

    def release(self) -> None:
        """The instance has stopped: drop what holds the model's memory (its module, its graphs
        and their pool, its slots' buffers, which view the model's arena, the stager's blocks)
        so that its pools and arena can go back to the device. Call it with no thread inside
        a pool (the pool gate held exclusively, ``ModelMemory.close``)."""
        self._model.module = None
        self._model.graphs = None
        self._plan = None
        self._stager = None
        self._assembly = None
        self._free_slots = queue_module.SimpleQueue()
        self._overdue = []
        self._outputs_read = None

    # -- the threads ---------------------------------------------------------------------------

    # -- when the instance dies ----------------------------------------------------------------

    # -- assembling one batch -----------------------------------------------------------------

    def _assemble(self, batch: Batch) -> None:
        self._assembly.assemble(batch, self._model.graphs)

    # -- computing one batch ------------------------------------------------------------------

    def _compute(self, batch: Batch) -> None:
        spec = self._spec
        if self._turns is not None:
            self._turns.begin(batch.id)  # ended in _finish, when the batch has completed
        batch.started_at = time.monotonic()
        started = time.perf_counter_ns()
        finisher = self._cuda and self._pipelined
        try:
            if self._runner is None:
                outputs = self._launch(batch)
            else:
                outputs = self._runner.run(self._launch, batch,
                                           on_late=lambda: self._release_late(batch))
            infer_done = time.perf_counter_ns()
        except ExecutionTimeout:
            log.error("batch_timed_out", model=spec.name, batch=batch.id, size=batch.samples,
                      execution_timeout_ms=spec.execution_timeout_ms,
                      requests=[r.id for r in batch.requests])
            self._finish(batch, None, ModelExecutionError(
                f"model '{spec.name}' did not finish a batch of {batch.samples} within "
                f"execution_timeout_ms={spec.execution_timeout_ms}; the batch failed and the "
                "instance continues on a fresh thread"), inputs_in_use=True)
            self._retire_compute_pool()
            if finisher:
                self._retire()
            return
        except TooManyHungCalls as exc:
            self._finish(batch, None, self._dead_error(), inputs_in_use=True)
            raise InstanceDead(f"{exc} (execution_timeout_ms="
                               f"{spec.execution_timeout_ms})") from None
        except BatchgateError as exc:
            log.error("batch_failed", model=spec.name, batch=batch.id, error=str(exc),
                      requests=[r.id for r in batch.requests])
            error: Exception = exc
        except Exception as exc:
            log.exception("model_raised", model=spec.name, batch=batch.id, size=batch.samples,
                          requests=[r.id for r in batch.requests])
            if gpu.classify(exc) == "sticky":
                self._device_broken(batch, exc)
            error = ModelExecutionError(
                f"model '{spec.name}' raised {type(exc).__name__} while running a batch of "
                f"{batch.samples}; the server log has the details")
        except BaseException as exc:  # SystemExit, KeyboardInterrupt...: this instance is done
            self._finish(batch, None, ModelExecutionError(
                f"model '{spec.name}' raised {type(exc).__name__} while running a batch of "
                f"{batch.samples} and stopped serving; the server log has the details"))
            raise InstanceDead(f"the model raised {type(exc).__name__}") from exc
        else:
            if finisher:
                self._finishing.put((batch, outputs, started, infer_done))
            else:
                self._complete(batch, outputs, started, infer_done)
            return
        self._fail(batch, error)
        if finisher:  # this batch never reaches the finisher, which retires the others
            self._retire()

    def _launch(self, batch: Batch) -> list[torch.Tensor]:
        """Run the batch; host tensors of its outputs, padding rows dropped. On a GPU their
        copies are still under way: they are valid once ``batch.done`` has completed, and the
        device outputs they are copied from stay referenced by the batch until then."""
        if not self._cuda:
            return [self._owned(t) for t in self._run(batch)]
        stream = self._model.graphs.replay_stream if batch.graph else self._compute_stream
        with torch.cuda.stream(stream):
            if batch.ready is not None:
                stream.wait_event(batch.ready)
            if batch.graph and self._outputs_read is not None:
                # The replay rewrites the graph's fixed output buffers: the last batch's
                # copies out of them (on the output stream) must have been made.
                stream.wait_event(self._outputs_read)
            outputs = self._run(batch)
            computed = torch.cuda.Event()
            computed.record(stream)
        # The device-to-host copies run on a stream of their own, so the next batch's compute
        # does not queue behind them on this one.
        out = self._output_stream
        with torch.cuda.stream(out):
            out.wait_event(computed)
            host = []
            for tensor, spec in zip(outputs, self._output_specs):
                if not isinstance(tensor, torch.Tensor):  # BYTES: already on the host
                    host.append(tensor)
                    continue
                pinned = torch.empty(tensor.shape, dtype=TORCH_DTYPES[spec.datatype],
                                     pin_memory=True)
                pinned.copy_(tensor, non_blocking=True)
                host.append(pinned)
            batch.done = gpu.host_event()
            batch.done.record(out)
        batch.device_outputs = outputs  # read by the output stream until batch.done
        self._outputs_read = batch.done
        return host

    def _run(self, batch: Batch) -> list[torch.Tensor]:
        started = time.thread_time_ns()
        try:
            return self._model.run(batch)
        finally:
            batch.model_cpu_ns += time.thread_time_ns() - started

    def _owned(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, copied if it is a view of our buffers (a model that returns its input,
        or a view of it): the slot is reused while the answer is still being sent."""
        if (isinstance(tensor, torch.Tensor)
                and tensor.untyped_storage().data_ptr() in self._owned_storage):
            return tensor.clone()
        return tensor

    def _complete(self, batch: Batch, outputs: list[torch.Tensor], started: int,
                  infer_done: int) -> None:
        self._reap_overdue()
        if batch.done is not None:
            # Outside the try below: an instance declared dead here must stop its thread.
            try:
                finished = gpu.wait_event(batch.done, self._device_time_left(batch))
            except Exception as exc:  # the device's errors surface here, asynchronously
                self._device_failed(batch, exc)
                return
            if not finished:
                self._device_overran(batch)
                return
            infer_done = time.perf_counter_ns()
        try:
            host = [to_numpy(t, o.datatype) for t, o in zip(outputs, self._output_specs)]
            results = self._split(batch.requests, host) if self._views_wanted else None
        except Exception as exc:
            log.exception("batch_outputs_failed", model=self._spec.name, batch=batch.id)
            self._fail(batch, ModelExecutionError(
                f"model '{self._spec.name}': its outputs could not be read back "
                f"({type(exc).__name__}); the server log has the details"))
            return
        done = time.perf_counter_ns()
        log.debug("batch_done", model=self._spec.name, batch=batch.id, size=batch.samples,
                  bucket=batch.bucket, graph=batch.graph, reason=batch.reason,
                  infer_ms=(infer_done - started) / 1e6)
        self._finish(batch, results, None, outputs=host,
                     ran=(infer_done - started, done - infer_done))

    def _sync_streams(self) -> None:
        """Wait for this instance's device work (its streams; never the whole device, where
        other models' work runs)."""
        if not self._cuda:
            return
        graphs = self._model.graphs
        streams = (self._copy_stream, self._compute_stream, self._output_stream,
                   graphs.replay_stream if graphs is not None else None)
        for stream in streams:
            if stream is not None:
                with contextlib.suppress(Exception):
                    stream.synchronize()

    def _retire_compute_pool(self) -> None:
        """A call that timed out may still be inside the compute pool on its abandoned runner
        (and never come back): the next runner allocates into a fresh one."""
        self._memory.retire(self._compute_role)
        self._compute_generation += 1
        self._compute_role = gpu.role("compute", self._index, self._compute_generation)

