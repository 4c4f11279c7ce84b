"""What an instance's batches are made of, and what it reports about them.

``Slot``: one batch in flight's input buffers; ``ExecutorPlan``: what an instance runs with
(its slots, buckets, stager, graph buffers, memory pools); ``Batch``: one batch from its forming
to its answers; ``Outcome``: what the executor hands back to the event loop for it;
``BatchAccounting``: the one object an executor reports its batches to (statistics, failures,
in-flight work, out-of-memory events, copies), which ``ServedModel``'s accounting
(``batcher/accounting.py``) implements; the executor itself (``batcher/executor.py``) knows
nothing of what is done with it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from batchgate.batcher import gpu
from batchgate.batcher.buckets import BatchBuckets
from batchgate.batcher.request import InferenceRequest
from batchgate.batcher.spec import ModelSpec
from batchgate.batcher.staging import InputStager, Staged
from batchgate.batcher.tensors import host_array


class Slot:
    """One batch in flight: the input buffers a batch's requests are gathered into."""

    __slots__ = ("index", "inputs", "host", "pinned", "_pinned_views")

    def __init__(self, index: int, inputs: Sequence[torch.Tensor]) -> None:
        self.index = index
        self.inputs = tuple(inputs)  # () when the model's inputs cannot have fixed buffers
        # On the CPU, numpy views of the buffers: np.copyto takes read-only sources as they are.
        cpu = all(t.device.type == "cpu" for t in self.inputs)
        self.host = [host_array(t) for t in self.inputs] if cpu else None
        # On a GPU, pinned host copies of the buffers that host inputs are gathered into
        # (made at the first gather from host memory: the warm-up's).
        self.pinned: tuple[torch.Tensor, ...] = ()
        self._pinned_views: list[np.ndarray] = []

    def pinned_views(self) -> list[np.ndarray]:
        if not self.pinned:
            self.pinned = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                                for t in self.inputs)
            self._pinned_views = [host_array(t) for t in self.pinned]
        return self._pinned_views


@dataclasses.dataclass
class ExecutorPlan:
    """What one instance runs with, set up by its ``ServedModel`` at load."""

    slots: list[Slot]
    buckets: BatchBuckets
    stager: InputStager | None = None
    # Per bucket: a CUDA graph's fixed input and output buffers (None: no graphs).
    graph_buffers: tuple[dict[int, tuple[torch.Tensor, ...]],
                         dict[int, tuple[torch.Tensor, ...]]] | None = None
    # Storages of the buffers above: an output that aliases one is copied before it leaves.
    owned_storage: frozenset[int] = frozenset()
    memory: gpu.ModelMemory | None = None  # the model's pools (None: the default allocator)


def default_plan(spec: ModelSpec) -> ExecutorPlan:
    """Slots without buffers and no padding: the host-concatenation path."""
    slots = [Slot(i, ()) for i in range(spec.inflight_batches)]
    return ExecutorPlan(slots, BatchBuckets((), spec.batching.max_batch_size))


class Batch:
    __slots__ = ("id", "requests", "reason", "samples", "bucket", "slot", "tensors", "ready",
                 "done", "staged", "graph", "taken_at", "started_at", "finished_at", "input_ns",
                 "model_cpu_ns", "device_outputs")

    def __init__(self, batch_id: int, requests: list[InferenceRequest], reason: str) -> None:
        self.id = batch_id
        self.requests = requests
        self.reason = reason
        self.samples = sum(r.batch_size for r in requests)
        self.bucket = self.samples  # rows the model runs at (padding included)
        self.slot: Slot | None = None
        self.tensors: list[Any] = []
        self.ready: Any = None  # CUDA event: inputs are on the device
        self.done: Any = None  # CUDA event: outputs are in host memory
        # On a GPU: the device outputs the copies to host read, kept until ``done``.
        self.device_outputs: list[Any] | None = None
        self.staged: list[Staged] = []
        self.graph = False  # runs as a captured CUDA graph
        self.taken_at = time.monotonic()
        self.started_at: float | None = None  # when its compute began (monotonic)
        self.finished_at: float | None = None  # when its answers were handed on (monotonic)
        self.input_ns = 0
        self.model_cpu_ns = 0  # CPU time of the thread that ran the forward, inside it


class Outcome:
    """What the compute thread hands back to the event loop for one batch.

    ``outputs``: the batch's host arrays, one per output in the model's order, padding rows
    dropped; ``results`` holds each request's views of them. ``inputs_in_use``: a call that
    timed out may still read the batch's inputs, so they are not released with the answers; a
    second, ``release_only`` outcome follows if the call returns. ``accounting``: the batch's
    bookkeeping (statistics, metrics, latency profile, memory gauges), for the receiver to run
    once, right after the answers (``ServedModel._deliver``): off the answers' path and the
    model's thread, yet done before the loop takes its next message.
    """

    __slots__ = ("batch", "results", "outputs", "error", "inputs_in_use", "release_only",
                 "accounting")

    def __init__(self, batch: Batch, results: list[dict[str, np.ndarray]] | None,
                 error: Exception | None, *, outputs: list[np.ndarray] | None = None,
                 inputs_in_use: bool = False, release_only: bool = False,
                 accounting: Callable[[], None] | None = None) -> None:
        self.batch = batch
        self.results = results
        self.outputs = outputs
        self.error = error
        self.inputs_in_use = inputs_in_use
        self.release_only = release_only
        self.accounting = accounting

    def account(self) -> None:
        """Run the batch's ``accounting``, if it has any."""
        if self.accounting is not None:
            self.accounting()


class InstanceDead(Exception):
    """The instance cannot run batches any more (the model raised a BaseException such as
    SystemExit, too many calls hung, or the executor's own code failed)."""


class BatchAccounting:
    """What an executor reports about its batches, from its threads. The defaults do nothing
    (an executor built alone, in tests)."""

    def taken(self, batch: Batch) -> None:
        """``batch`` was formed: it is in flight until ``ended``."""

    def ended(self, batch: Batch) -> None:
        """``batch`` finished (answered or failed)."""

    def ran(self, batch: Batch, infer_ns: int, output_ns: int) -> None:
        """``batch`` ran to its answers: its forward and output times (called after the
        answers, by whoever delivered them: ``Outcome.accounting``)."""

    def out_of_memory(self, rows: int, largest: int) -> None:
        """A batch of ``rows`` ran out of memory; ``largest`` is the new largest bucket."""

    def copies(self, queued: int, at_batch: int) -> None:
        """A batch's requests: ``queued`` were staged while waiting, ``at_batch`` copied now."""

    def after_batch(self) -> None:
        """After each batch's answers (gauges that follow the memory in use), as ``ran``."""
