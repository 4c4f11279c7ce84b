"""Assembling a batch: its requests' inputs into the slot's buffers the model runs on.

For a model with fixed buffers (``ExecutorPlan.slots``), each input is gathered with one
operation where it can be: a ``torch.cat`` of the requests' staged device blocks
(``batcher/staging.py``), or one host concatenation into the slot's pinned mirror and one
asynchronous copy to the device; per request only when a batch mixes staged and unstaged
requests (or holds inputs already on the device, from a client's CUDA shared memory). Padding
rows up to the batch's bucket are zeroed, and on a GPU all of it runs on the instance's copy
stream, ending with an event the compute stream waits for. Models whose inputs have variable
dims or are BYTES have no fixed buffers: their batches are concatenated on the host and copied
to the device as they are.

Memory: filling fixed buffers allocates nothing on the device (copies into views of the
model's arena), so the assembler enters no pool; the host-to-device copies of a model without
fixed buffers allocate into the instance's ``gather`` pool, which only its assembler enters
(``batcher/gpu.py``: one thread at a time in a pool).

A request whose inputs must be checked or read right before the batch reads them
(``check_inputs``: a shared-memory region, read then, which may have shrunk) is checked here;
when the check fails, that request alone is answered with the error and the batch reads zeros
in its place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from batchgate.batcher.batch import Batch, BatchAccounting, Slot
from batchgate.batcher.buckets import BatchBuckets
from batchgate.batcher.errors import BatchgateError
from batchgate.batcher.gpu import ModelMemory
from batchgate.batcher.graphs import BucketGraphs
from batchgate.batcher.request import InferenceRequest
from batchgate.batcher.spec import ModelSpec
from batchgate.batcher.tensors import host_input, to_torch


class BatchAssembly:
    """How one model instance fills its slots' buffers."""

    def __init__(self, spec: ModelSpec, *, buckets: BatchBuckets, stager: Any, pooled: bool,
                 copy_stream: torch.cuda.Stream | None, memory: ModelMemory,
                 accounting: BatchAccounting, gather_role: str = "gather") -> None:
        self._buckets = buckets
        self._stager = stager
        self._pooled = pooled
        self._copy_stream = copy_stream
        self._memory = memory
        self._gather_role = gather_role
        self._accounting = accounting
        self._device = torch.device(spec.device)
        self._cuda = self._device.type == "cuda"
        self._batching = spec.batching.max_batch_size > 0
        self._input_types = [t.datatype for t in spec.inputs]

    def assemble(self, batch: Batch, graphs: BucketGraphs | None) -> None:
        """The batch's requests into its slot's buffers (or concatenated, for a model without
        fixed buffers), padding rows zeroed up to its bucket; on a GPU on the copy stream, with
        ``batch.ready`` recorded after. ``graphs``: the model's captured graphs, if any."""
        if not self._pooled:
            self._concatenate(batch)
            return
        rows = batch.samples
        batch.bucket = self._buckets.pad(rows) if self._batching else 1
        stream = torch.cuda.stream(self._copy_stream) if self._cuda else contextlib.nullcontext()
        with stream:
            self._gather(batch)
            if batch.bucket > rows:
                for buffer in batch.slot.inputs:
                    buffer[rows:batch.bucket].zero_()
            if self._cuda:
                batch.ready = torch.cuda.Event()
                batch.ready.record(self._copy_stream)
        inputs = batch.slot.inputs
        batch.tensors = [b[:batch.bucket] for b in inputs] if self._batching else list(inputs)
        batch.graph = (graphs is not None and batch.bucket in graphs.buckets
                       and rows <= self._buckets.largest)

    def _gather(self, batch: Batch) -> None:
        """The requests' rows into the slot's buffers: one operation per input (a ``torch.cat``
        of their staged blocks, or a host concatenation and, on a GPU, one copy from pinned
        memory), per request only when a batch mixes staged and unstaged requests."""
        slot, requests = batch.slot, batch.requests
        for request in requests:
            if request.check_inputs is not None:
                _check_inputs(request)
        # Inputs in a client's CUDA shared memory are device tensors: copied as they are.
        direct = any(isinstance(a, torch.Tensor) for r in requests for a in r.inputs)
        claimed = ([self._stager.claim(r) for r in requests] if self._stager is not None
                   else [None] * len(requests))
        staged = [c for c in claimed if c is not None]
        batch.staged.extend(staged)
        for item in staged:
            if item.ready is not None:
                self._copy_stream.wait_event(item.ready)
        rows = batch.samples
        if not self._batching:  # one request; the buffers are one sample
            if staged:
                for buffer, block in zip(slot.inputs, staged[0].blocks):
                    buffer.copy_(block.tensor, non_blocking=self._cuda)
            else:
                self._request_into(slot, requests[0], slice(None))
        elif len(staged) == len(requests):
            for i, buffer in enumerate(slot.inputs):
                blocks = [item.blocks[i].tensor for item in staged]
                if len(blocks) == 1:
                    buffer[:rows].copy_(blocks[0], non_blocking=self._cuda)
                else:
                    torch.cat(blocks, out=buffer[:rows])
        elif not staged and not direct:
            self._from_host(slot, [request.inputs for request in requests], rows)
        else:
            offset = 0
            for request, item in zip(requests, claimed):
                where = slice(offset, offset + request.batch_size)
                if item is not None:
                    for buffer, block in zip(slot.inputs, item.blocks):
                        buffer[where].copy_(block.tensor, non_blocking=self._cuda)
                else:
                    self._request_into(slot, request, where)
                offset += request.batch_size
        if batch.id:  # id 0: a warm-up run
            self._accounting.copies(len(staged), len(requests) - len(staged))

    def _request_into(self, slot: Slot, request: InferenceRequest, where: slice) -> None:
        """One request's inputs into ``slot``'s buffers at ``where``."""
        if not any(isinstance(a, torch.Tensor) for a in request.inputs):
            self._from_host(slot, [request.inputs], None, where)
            return
        for i, (buffer, array) in enumerate(zip(slot.inputs, request.inputs)):
            if slot.host is not None:
                np.copyto(slot.host[i][where], host_input(array))
            elif isinstance(array, torch.Tensor):
                buffer[where].copy_(array, non_blocking=True)
            else:
                buffer[where].copy_(to_torch(array, self._input_types[i]), non_blocking=True)

    def _from_host(self, slot: Slot, inputs: list[Sequence[np.ndarray]], rows: int | None,
                   where: slice | None = None) -> None:
        """Host arrays (per request, per input) into ``slot``'s buffers at ``where`` (default:
        from row 0): on the CPU one concatenation per input straight into the buffer; on a GPU
        into the slot's pinned host mirror, then one asynchronous copy per input (from pinned
        memory the copy is a real DMA; from the request's pageable bytes it would not be)."""
        if where is None:
            where = slice(0, rows) if rows is not None else slice(None)
        targets = slot.host if slot.host is not None else slot.pinned_views()
        for i, target in enumerate(targets):
            arrays = [request_inputs[i] for request_inputs in inputs]
            if len(arrays) == 1:
                np.copyto(target[where], arrays[0])
            else:
                np.concatenate(arrays, out=target[where])
        if slot.host is None:
            for buffer, pinned in zip(slot.inputs, slot.pinned):
                buffer[where].copy_(pinned[where], non_blocking=True)

    def _concatenate(self, batch: Batch) -> None:
        requests = batch.requests
        for request in requests:
            if request.check_inputs is not None:
                _check_inputs(request)
        if len(requests) == 1:
            # Decoded inputs are read-only views of the request's bytes; a model may write to
            # its inputs, so it gets its own copy (concatenation makes one anyway).
            arrays = [a if a.flags.writeable else a.copy()
                      for a in map(host_input, requests[0].inputs)]
        else:
            arrays = [
                np.concatenate([host_input(r.inputs[i]) for r in requests])
                for i in range(len(self._input_types))
            ]
        tensors = [to_torch(a, t) for a, t in zip(arrays, self._input_types)]
        if not self._cuda:
            batch.tensors = tensors
            return
        with torch.cuda.stream(self._copy_stream), self._memory.use(self._gather_role):
            batch.tensors = [
                t.to(self._device, non_blocking=True) if isinstance(t, torch.Tensor) else t
                for t in tensors
            ]
            batch.ready = torch.cuda.Event()
            batch.ready.record(self._copy_stream)


def _check_inputs(request: InferenceRequest) -> None:
    """Run the request's check right before its inputs are read; when it fails, the request
    is answered with that error and the batch reads zeros in its place (never its memory)."""
    try:
        request.check_inputs(request)
    except BatchgateError as exc:
        request.input_error = exc
        request.inputs = [
            torch.zeros_like(a) if isinstance(a, torch.Tensor)
            else np.full(a.shape, b"", dtype=object) if a.dtype == object
            else np.zeros(a.shape, a.dtype)
            for a in request.inputs]
