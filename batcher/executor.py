"""Executors: the threads that turn queued requests into model calls and answers.

Each model instance has two threads and at most ``max_inflight_batches`` batches between them:

- the *assembler* waits for the queue's policy to release a batch, concatenates the requests'
  arrays into batch tensors and, on a GPU, copies them to the device on its own stream;
- the *compute* thread runs the model (autocast for fp16/bf16), checks that every output kept
  the batch dimension, brings outputs back to host memory and splits them per request.

So one batch is assembled while another computes. Both threads release the GIL inside torch and
numpy; the event loop is touched once per finished batch (``call_soon_threadsafe``), which
resolves the requests' futures. A model exception fails only its batch.
"""

from __future__ import annotations

import contextlib
import queue as queue_module
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import structlog
import torch

from batcher.errors import ModelExecutionError, ModelUnavailable
from batcher.request import InferenceRequest
from batcher.spec import ModelSpec, TensorSpec
from batcher.watchdog import ExecutionTimeout, TimedRunner, TooManyHungCalls

log = structlog.get_logger(__name__)

TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "UINT8": torch.uint8,
    "UINT16": torch.uint16,
    "UINT32": torch.uint32,
    "UINT64": torch.uint64,
    "INT8": torch.int8,
    "INT16": torch.int16,
    "INT32": torch.int32,
    "INT64": torch.int64,
    "FP16": torch.float16,
    "FP32": torch.float32,
    "FP64": torch.float64,
    "BF16": torch.bfloat16,
}
AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

_interop_lock = threading.Lock()
_interop_set = False


def to_torch(array: np.ndarray, datatype: str) -> torch.Tensor:
    """A tensor sharing ``array``'s memory (BF16 arrives as uint16 raw bits).

    BYTES inputs stay numpy object arrays: torch has no string tensor, so a model that declares
    them (a Python ``model.py``) receives the array itself.
    """
    if datatype == "BYTES":
        return array
    if datatype == "BF16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def to_numpy(tensor: torch.Tensor, datatype: str) -> np.ndarray:
    """Host array of ``tensor`` converted to ``datatype``; no copy when it already fits."""
    want = TORCH_DTYPES[datatype]
    if tensor.dtype != want:
        tensor = tensor.to(want)
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if datatype == "BF16":
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


class Batch:
    __slots__ = ("id", "requests", "reason", "samples", "tensors", "ready", "taken_at",
                 "input_ns")

    def __init__(self, batch_id: int, requests: list[InferenceRequest], reason: str) -> None:
        self.id = batch_id
        self.requests = requests
        self.reason = reason
        self.samples = sum(r.batch_size for r in requests)
        self.tensors: list[Any] = []
        self.ready: Any = None  # CUDA event: inputs are on the device
        self.taken_at = time.monotonic()
        self.input_ns = 0


class Outcome:
    """What the compute thread hands back to the event loop for one batch.

    ``inputs_in_use``: a call that timed out may still read the batch's inputs, so they are not
    released with the answers; a second, ``release_only`` outcome follows if the call returns.
    """

    __slots__ = ("batch", "results", "error", "inputs_in_use", "release_only")

    def __init__(self, batch: Batch, results: list[dict[str, np.ndarray]] | None,
                 error: Exception | None, *, inputs_in_use: bool = False,
                 release_only: bool = False) -> None:
        self.batch = batch
        self.results = results
        self.error = error
        self.inputs_in_use = inputs_in_use
        self.release_only = release_only


class InstanceDead(Exception):
    """The instance cannot run batches any more (the model raised a BaseException such as
    SystemExit, too many calls hung, or the executor's own code failed)."""


class Executor:
    """One model instance: an assembler thread and a compute thread."""

    def __init__(
        self,
        spec: ModelSpec,
        module: Callable[..., Any],
        *,
        index: int,
        next_batch: Callable[..., tuple[list[InferenceRequest], str] | None],
        wake: Callable[[], None],
        deliver: Callable[[Outcome], None],
        on_batch: Callable[[Batch, int, int], None],
        batch_ids: Callable[[], int],
        on_inflight: Callable[[int], None] | None = None,
        on_dead: Callable[[str], None] | None = None,
    ) -> None:
        self._spec = spec
        self._module = module
        self._index = index
        self._next_batch = next_batch
        self._wake = wake
        # Batches handed to the compute thread and not finished yet.
        self._running = 0
        self._deliver = deliver
        self._on_batch = on_batch
        self._batch_ids = batch_ids
        self._on_inflight = on_inflight
        self._device = torch.device(spec.device)
        self._cuda = self._device.type == "cuda"
        self._batching = spec.batching.max_batch_size > 0
        self._slots = threading.Semaphore(spec.batching.max_inflight_batches)
        self._running_lock = threading.Lock()
        self._handoff: queue_module.SimpleQueue[Batch | None] = queue_module.SimpleQueue()
        self._copy_stream = torch.cuda.Stream(self._device) if self._cuda else None
        self._compute_stream = torch.cuda.Stream(self._device) if self._cuda else None
        self._input_types = [t.datatype for t in spec.inputs]
        self._output_specs: Sequence[TensorSpec] = spec.outputs
        self._autocast = AUTOCAST_DTYPES.get(spec.precision)
        self._threads: list[threading.Thread] = []
        self.alive = threading.Event()
        self._on_dead = on_dead
        self._dead = False  # set under _running_lock: no batch is handed over after it
        timeout_ms = spec.execution_timeout_ms
        self._runner = (
            TimedRunner(f"{spec.name}-{index}", timeout_ms / 1e3, self._configure_thread)
            if timeout_ms else None
        )

    # -- lifecycle -----------------------------------------------------------------------------

    def warm_up(self, samples: Sequence[Sequence[np.ndarray]]) -> None:
        """Run the model on each input set, on a thread configured like the compute thread."""
        failure: list[BaseException] = []

        def run() -> None:
            self._configure_thread()
            try:
                for arrays in samples:
                    tensors = [to_torch(a.copy(), t) for a, t in zip(arrays, self._input_types)]
                    rows = arrays[0].shape[0] if self._batching else 1
                    moved, ready = self._to_device(tensors)
                    if ready is not None:
                        ready.synchronize()
                    self._forward(moved, rows)
                if self._cuda:
                    torch.cuda.synchronize(self._device)
            except BaseException as exc:  # reported to the loader below
                failure.append(exc)

        thread = threading.Thread(target=run, name=f"{self._spec.name}-warmup", daemon=True)
        thread.start()
        thread.join()
        if failure:
            raise failure[0]

    def start(self) -> None:
        name = f"{self._spec.name}-{self._index}"
        if self._spec.batching.max_inflight_batches == 1:
            # One batch at a time: forming, assembling and computing on one thread saves a
            # thread hand-off (and a GIL hand-off) per batch.
            self._threads = [
                threading.Thread(target=self._serial_loop, name=f"{name}-batch", daemon=True),
            ]
        else:
            self._threads = [
                threading.Thread(target=self._assemble_loop, name=f"{name}-assemble", daemon=True),
                threading.Thread(target=self._compute_loop, name=f"{name}-compute", daemon=True),
            ]
        self.alive.set()
        for thread in self._threads:
            thread.start()

    def join(self, timeout_s: float | None) -> bool:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for thread in self._threads:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            thread.join(left)
        return not any(t.is_alive() for t in self._threads)

    # -- the two threads ---------------------------------------------------------------------

    def _configure_thread(self) -> None:
        # OpenMP's thread count is per calling thread: set it here, not on the main thread.
        if self._spec.intra_op_threads:
            torch.set_num_threads(self._spec.intra_op_threads)
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
        try:
            while True:
                self._slots.acquire()
                taken = self._next_batch(self._busy)
                if taken is None:
                    break
                batch = self._prepare(*taken)
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
        self._configure_thread()
        try:
            while True:
                self._slots.acquire()
                taken = self._next_batch(None)
                if taken is None:
                    break
                batch = self._prepare(*taken)
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

    def _prepare(self, requests: list[InferenceRequest], reason: str) -> Batch | None:
        """The batch with its inputs assembled (on the device), or None if that failed."""
        batch = Batch(self._batch_ids(), requests, reason)
        if self._on_inflight is not None:
            self._on_inflight(1)
        try:
            started = time.perf_counter_ns()
            batch.tensors, batch.ready = self._assemble(requests)
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
        self._configure_thread()
        try:
            while (batch := self._handoff.get()) is not None:
                self._compute(batch)
                with self._running_lock:
                    self._running -= 1
                # The assembler may be holding back a partial batch until this one ended.
                self._wake()
        except InstanceDead as exc:
            self._die(str(exc), None)
        except BaseException as exc:
            self._die(f"its compute thread failed ({type(exc).__name__})", exc)
        finally:
            self.alive.clear()
            if self._runner is not None:
                self._runner.close()

    # -- when the instance dies ----------------------------------------------------------------

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

    # -- one batch ---------------------------------------------------------------------------

    def _assemble(self, requests: list[InferenceRequest]) -> tuple[list[Any], Any]:
        if len(requests) == 1:
            # Decoded inputs are read-only views of the request's bytes; a model may write to
            # its inputs, so it gets its own copy (concatenation makes one anyway).
            arrays = [a if a.flags.writeable else a.copy() for a in requests[0].inputs]
        else:
            arrays = [
                np.concatenate([r.inputs[i] for r in requests])
                for i in range(len(self._input_types))
            ]
        tensors = [to_torch(a, t) for a, t in zip(arrays, self._input_types)]
        return self._to_device(tensors)

    def _to_device(self, tensors: list[Any]) -> tuple[list[Any], Any]:
        """Start the host-to-device copies on the copy stream; the event marks their end."""
        if not self._cuda:
            return tensors, None
        with torch.cuda.stream(self._copy_stream):
            moved = [
                t.to(self._device, non_blocking=True) if isinstance(t, torch.Tensor) else t
                for t in tensors
            ]
            ready = torch.cuda.Event()
            ready.record()
        return moved, ready

    def _forward(self, tensors: list[Any], rows: int) -> list[torch.Tensor]:
        autocast = (
            torch.autocast(self._device.type, dtype=self._autocast)
            if self._autocast is not None
            else contextlib.nullcontext()
        )
        with torch.inference_mode(), autocast:
            returned = self._module(*tensors)
        return self._outputs_of(returned, rows)

    def _infer(self, batch: Batch) -> list[torch.Tensor]:
        if not self._cuda:
            return self._forward(batch.tensors, batch.samples)
        self._compute_stream.wait_event(batch.ready)
        with torch.cuda.stream(self._compute_stream):
            for t in batch.tensors:
                t.record_stream(self._compute_stream)
            return self._forward(batch.tensors, batch.samples)

    def _compute(self, batch: Batch) -> None:
        spec = self._spec
        started = time.perf_counter_ns()
        try:
            if self._runner is None:
                outputs = self._infer(batch)
            else:
                outputs = self._runner.run(self._infer, batch, on_late=lambda: self._deliver(
                    Outcome(batch, None, None, release_only=True)))
            infer_done = time.perf_counter_ns()
            host = [to_numpy(t, o.datatype) for t, o in zip(outputs, self._output_specs)]
            results = self._split(batch.requests, host)
        except ExecutionTimeout:
            log.error("batch_timed_out", model=spec.name, batch=batch.id, size=batch.samples,
                      execution_timeout_ms=spec.execution_timeout_ms,
                      requests=[r.id for r in batch.requests])
            self._finish(batch, None, ModelExecutionError(
                f"model '{spec.name}' did not finish a batch of {batch.samples} within "
                f"execution_timeout_ms={spec.execution_timeout_ms}; the batch failed and the "
                "instance continues on a fresh thread"), inputs_in_use=True)
            return
        except TooManyHungCalls as exc:
            self._finish(batch, None, self._dead_error(), inputs_in_use=True)
            raise InstanceDead(f"{exc} (execution_timeout_ms="
                               f"{spec.execution_timeout_ms})") from None
        except ModelExecutionError as exc:
            log.error("batch_failed", model=spec.name, batch=batch.id, error=str(exc),
                      requests=[r.id for r in batch.requests])
            self._finish(batch, None, exc)
            return
        except Exception as exc:
            log.exception("model_raised", model=spec.name, batch=batch.id, size=batch.samples,
                          requests=[r.id for r in batch.requests])
            self._finish(batch, None, ModelExecutionError(
                f"model '{spec.name}' raised {type(exc).__name__} while running a batch of "
                f"{batch.samples}; the server log has the details"))
            return
        except BaseException as exc:  # SystemExit, KeyboardInterrupt...: this instance is done
            self._finish(batch, None, ModelExecutionError(
                f"model '{spec.name}' raised {type(exc).__name__} while running a batch of "
                f"{batch.samples} and stopped serving; the server log has the details"))
            raise InstanceDead(f"the model raised {type(exc).__name__}") from exc
        done = time.perf_counter_ns()
        log.debug("batch_done", model=spec.name, batch=batch.id, size=batch.samples,
                  reason=batch.reason, infer_ms=(infer_done - started) / 1e6)
        self._on_batch(batch, infer_done - started, done - infer_done)
        self._finish(batch, results, None)

    def _finish(self, batch: Batch, results: list[dict[str, np.ndarray]] | None,
                error: Exception | None, *, inputs_in_use: bool = False) -> None:
        batch.tensors = []
        self._slots.release()
        if self._on_inflight is not None:
            self._on_inflight(-1)
        self._deliver(Outcome(batch, results, error, inputs_in_use=inputs_in_use))

    def _outputs_of(self, returned: Any, rows: int) -> list[torch.Tensor]:
        specs = self._output_specs
        if isinstance(returned, torch.Tensor):
            returned = (returned,)
        if isinstance(returned, dict):
            missing = [o.name for o in specs if o.name not in returned]
            if missing:
                raise ModelExecutionError(
                    f"model '{self._spec.name}' returned a dict without outputs {missing}")
            tensors = [returned[o.name] for o in specs]
        elif isinstance(returned, (tuple, list)):
            if len(returned) < len(specs):
                raise ModelExecutionError(
                    f"model '{self._spec.name}' returned {len(returned)} outputs, "
                    f"its configuration declares {len(specs)}")
            tensors = list(returned[: len(specs)])
        else:
            raise ModelExecutionError(
                f"model '{self._spec.name}' returned {type(returned).__name__}, "
                "expected a tensor, a tuple of tensors or a dict of tensors")
        if self._batching:
            for tensor, o in zip(tensors, specs):
                if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0 or tensor.shape[0] != rows:
                    got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                    raise ModelExecutionError(
                        f"model '{self._spec.name}' returned output '{o.name}' with shape "
                        f"{got} for a batch of {rows}: the batch dimension must be kept")
        return tensors

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
