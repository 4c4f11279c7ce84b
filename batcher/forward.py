"""The model call of one instance: the forward in its precision, inside the instance's memory
pool, the check of what it returned, a captured CUDA graph's replay, and out-of-memory
recovery.

``ModelForward.run(batch)`` runs a batch whose inputs are on the device and returns its
outputs (padding rows dropped). The forward allocates inside the instance's own pool
(``pool()``, ``batcher/gpu.py``), entered around each forward and nothing else: a replay
allocates nothing.

Out of memory (``torch.OutOfMemoryError``, or a cuBLAS/cuDNN allocation failure:
``batcher/gpu.py``): inside a pool the allocator frees no other cached block before it gives
up, so the first failure is not the last word. The forward leaves the pool, its frames are
gone (outside the ``except`` block, whose traceback would keep them and their activations
alive), ``reclaim()`` gives the device's unused cached segments back once no thread is inside a
pool, and the batch runs once more. Only when that fails too is it split in halves, each run
again, and the largest bucket lowered below the size that failed (``BatchBuckets.lower``: for
a while, not for good; it comes back when memory allows). Only a single sample that does not
fit fails, with RESOURCE_EXHAUSTED. During warm-up (``warming``) nothing is split: a model
that does not fit must not load (the retry after a reclaim still runs).

Outputs: a tensor, a tuple or list of tensors, or a dict by output name; each must keep the
batch dimension, and a BYTES output becomes the object array of bytes it is sent as.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import numpy as np
import structlog
import torch

from batchgate.batcher import gpu
from batchgate.batcher import graphs as cuda_graphs
from batchgate.batcher import precision as precisions
from batchgate.batcher.batch import Batch, BatchAccounting
from batchgate.batcher.buckets import BatchBuckets
from batchgate.batcher.errors import ModelExecutionError, ResourceExhausted
from batchgate.batcher.spec import ModelSpec, TensorSpec
from batchgate.batcher.tensors import bytes_tensor

log = structlog.get_logger(__name__)


def unpack_outputs(returned: Any, outputs: Sequence[TensorSpec], model: str) -> list[Any]:
    """What a model's forward returned, as one value per declared output, in ``outputs``' order.

    The one rule for every caller (serving, the precision check, the GPU check): a tensor (or
    numpy array) is the one output; a tuple or list holds the outputs in declared order (extra
    trailing values are dropped, too few is an error); a dict is keyed by output name (a missing
    name is an error, other keys are ignored). Anything else is an error. Errors are
    ``ModelExecutionError`` naming ``model``. The values are not checked here (their batch
    dimension, a BYTES output's shape: ``ModelForward.outputs_of``).
    """
    if isinstance(returned, (torch.Tensor, np.ndarray)):
        returned = (returned,)
    if isinstance(returned, dict):
        missing = [o.name for o in outputs if o.name not in returned]
        if missing:
            raise ModelExecutionError(f"model '{model}' returned a dict without outputs {missing}")
        return [returned[o.name] for o in outputs]
    if isinstance(returned, (tuple, list)):
        if len(returned) < len(outputs):
            raise ModelExecutionError(
                f"model '{model}' returned {len(returned)} outputs, "
                f"its configuration declares {len(outputs)}")
        return list(returned[: len(outputs)])
    raise ModelExecutionError(
        f"model '{model}' returned {type(returned).__name__}, "
        "expected a tensor, a tuple of tensors or a dict of tensors")


class ModelForward:
    """One instance's model call (see the module docstring)."""

    def __init__(self, spec: ModelSpec, module: Any, *, buckets: BatchBuckets, pooled: bool,
                 accounting: BatchAccounting,
                 pool: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 reclaim: Callable[[], None] = lambda: None) -> None:
        """``pool()``: the context the forward allocates under (the instance's pool);
        ``reclaim()``: frees the device's unused cached memory, called outside it."""
        self._spec = spec
        self.module = module
        self._device = torch.device(spec.device)
        self._batching = spec.batching.max_batch_size > 0
        self._buckets = buckets
        self._pooled = pooled  # fixed buffers: a batch's tensors hold its bucket's rows
        self._accounting = accounting
        self._pool = pool
        self._reclaim = reclaim
        self._output_specs: Sequence[TensorSpec] = spec.outputs
        self._bytes_outputs = tuple(i for i, o in enumerate(spec.outputs)
                                    if o.datatype == "BYTES")
        self.graphs: cuda_graphs.BucketGraphs | None = None  # set once captured
        self.warming = False  # during warm-up out of memory is not split

    def run(self, batch: Batch) -> list[torch.Tensor]:
        rows = batch.samples
        if batch.graph:
            outputs = self.graphs.replay(batch.bucket, batch.tensors)
            return [t[:rows] for t in outputs]
        if not self._batching:
            return self.eager(batch.tensors, rows, split=False)
        return self.eager(batch.tensors, rows)

    def eager(self, tensors: Sequence[Any], rows: int, *, split: bool = True,
              reclaimed: bool = False) -> list[torch.Tensor]:
        """Outputs of the first ``rows`` rows of ``tensors`` (which may hold padding after
        them), in pieces when ``rows`` is over the largest bucket; out of memory is retried
        once after a reclaim, then split (module docstring). ``split`` False: one sample,
        never split."""
        largest = self._buckets.largest
        if split and rows > largest:
            return self._in_pieces(tensors, rows, largest, reclaimed)
        running = tensors[0].shape[0] if self._pooled and split else rows
        outputs = self._attempt(tensors, running)
        if outputs is None and not reclaimed:
            # Outside the pool and the except block: the failed forward's memory is free.
            log.warning("batch_out_of_memory", model=self._spec.name, rows=running,
                        retrying="after giving cached memory back")
            self._reclaim()
            reclaimed = True
            outputs = self._attempt(tensors, running)
        if outputs is not None:
            if split and running == self._buckets.top:
                self._buckets.recovered()
            return [t[:rows] for t in outputs] if running != rows else outputs
        if self.warming:
            raise torch.OutOfMemoryError(
                f"model '{self._spec.name}' ran out of device memory warming up a batch of "
                f"{running}")
        if rows == 1 or not split:
            raise ResourceExhausted(
                f"model '{self._spec.name}' ran out of device memory on a single sample")
        largest = self._buckets.lower(running)
        log.warning("batch_out_of_memory", model=self._spec.name, rows=running,
                    largest_bucket=largest, retrying_in=2)
        self._accounting.out_of_memory(running, largest)
        return self._in_pieces(tensors, rows, min(largest, -(-rows // 2)), reclaimed)

    def _attempt(self, tensors: Sequence[Any], rows: int) -> list[torch.Tensor] | None:
        """One forward inside the pool; None when it ran out of memory (its frames gone)."""
        try:
            with self._pool():
                return self.forward(tensors, rows)
        except Exception as exc:
            if gpu.classify(exc) != "oom":
                raise
        return None

    def _in_pieces(self, tensors: Sequence[Any], rows: int, size: int, reclaimed: bool
                   ) -> list[torch.Tensor]:
        parts = [self.eager([t[start:min(start + size, rows)] for t in tensors],
                            min(size, rows - start), reclaimed=reclaimed)
                 for start in range(0, rows, size)]
        return [np.concatenate(column) if isinstance(column[0], np.ndarray) else torch.cat(column)
                for column in zip(*parts)]

    def forward(self, tensors: Sequence[Any], rows: int, *, capturing: bool = False
                 ) -> list[torch.Tensor]:
        precision = self._spec.precision
        inputs = precisions.cast_inputs(tensors, precision)
        with torch.inference_mode(), precisions.autocast(precision, self._device.type,
                                                         capturing=capturing):
            returned = self.module(*inputs)
        return self.outputs_of(returned, rows)

    def outputs_of(self, returned: Any, rows: int) -> list[torch.Tensor]:
        specs = self._output_specs
        tensors = unpack_outputs(returned, specs, self._spec.name)
        for i in self._bytes_outputs:
            tensors[i] = self._bytes_output(tensors[i], specs[i], rows)
        for tensor, o in zip(tensors, specs):
            if isinstance(tensor, torch.Tensor):
                if self._batching and (tensor.dim() == 0 or tensor.shape[0] != rows):
                    self._lost_batch(tuple(tensor.shape), o, rows)
            elif o.datatype != "BYTES":
                self._not_a_tensor(tensor, o, rows)
        return tensors

    def _lost_batch(self, got: Any, o: TensorSpec, rows: int) -> NoReturn:
        raise ModelExecutionError(
            f"model '{self._spec.name}' returned output '{o.name}' with shape {got} for a "
            f"batch of {rows}: the batch dimension must be kept")

    def _not_a_tensor(self, returned: Any, o: TensorSpec, rows: int) -> NoReturn:
        if isinstance(returned, np.ndarray) and returned.dtype.kind in "OSU":
            raise ModelExecutionError(
                f"model '{self._spec.name}' returned {o.datatype} output '{o.name}' as a numpy "
                f"{returned.dtype} array: only a BYTES (TYPE_STRING) output may hold bytes or "
                "str; return a tensor")
        if not self._batching:
            raise ModelExecutionError(
                f"model '{self._spec.name}' returned output '{o.name}' as "
                f"{type(returned).__name__}, expected a tensor")
        self._lost_batch(type(returned).__name__, o, rows)

    def _bytes_output(self, returned: Any, o: TensorSpec, rows: int) -> np.ndarray:
        """The object array of bytes a BYTES output is sent as (``bytes_tensor``), with the
        batch dimension kept and the declared dims."""
        try:
            array = bytes_tensor(returned, o.dims, self._batching)
        except TypeError as exc:
            raise ModelExecutionError(
                f"model '{self._spec.name}' returned BYTES output '{o.name}' {exc}") from None
        shape = array.shape
        if self._batching:
            if not shape or shape[0] != rows:
                self._lost_batch(shape, o, rows)
            shape = shape[1:]
        if len(shape) != len(o.dims) or any(d >= 0 and n != d for n, d in zip(shape, o.dims)):
            batch = f" for a batch of {rows}" if self._batching else ""
            raise ModelExecutionError(
                f"model '{self._spec.name}' returned BYTES output '{o.name}' with shape "
                f"{array.shape}{batch}: its configuration declares dims {list(o.dims)}")
        return array
