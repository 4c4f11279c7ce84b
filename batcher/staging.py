"""Staging: a queued request's inputs copied to the device while it waits, not when its batch
closes.

PCIe copies on the critical path: copied when the batch closes, a batch's inputs
cross PCIe while the GPU waits for them. ``InputStager`` takes each request as it is queued and,
on its own thread and copy stream, copies its inputs from host memory — the shared-memory arena,
which the executor process registers as pinned memory, so the copy is a real asynchronous DMA —
into blocks of the device memory pool, and records an event. When the batch closes, the
assembler gathers the request's rows from those blocks with device-to-device copies (far faster
than PCIe) after waiting for the event; only a request the stager has not reached yet is copied
from host memory then.

A request's blocks are given back when its batch has finished (the gather read them), or, if it
leaves the queue without running (cancelled, expired), after its copy has completed. Staged
bytes per model are capped (``cap_bytes``), so a long queue cannot take the whole pool from the
other models; beyond the cap requests are copied when their batch closes. In a strict pool a
block that does not fit is likewise left to the batch; a permissive pool allocates it outside
the arena and counts the fallback.

Ordering: the stager checks "is the request still queued?" and reserves its bytes under its
lock, copies outside it (the assembler claiming another request's blocks never waits for a
copy), and records the staged entry under the lock only if the request is still queued; the
assembler claims entries under the same lock, and a request is taken from the queue (``TAKEN``)
before its batch is assembled. So a request is staged at most once, its blocks are claimed
exactly once, by its batch or by ``drop``, and blocks whose request was taken while they were
being copied are freed by the stager (the batch copied that request itself).

On the CPU the same code copies into host pool blocks (tests turn it on with the
``input_staging`` parameter; it buys nothing there, so it is off by default).
"""

from __future__ import annotations

import queue as queue_module
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import structlog
import torch

from batchgate.batcher import gpu
from batchgate.batcher.request import QUEUED, InferenceRequest
from batchgate.batcher.tensors import host_array

log = structlog.get_logger(__name__)


class Block:
    """A device buffer a request's input was copied into, and how to give it back."""

    __slots__ = ("tensor", "release", "nbytes", "in_pool")

    def __init__(self, tensor: torch.Tensor, release: Callable[[], None], nbytes: int,
                 in_pool: bool) -> None:
        self.tensor = tensor
        self.release = release
        self.nbytes = nbytes
        self.in_pool = in_pool


# (shape, dtype) -> a Block, or None when no room is left (a strict pool).
Allocate = Callable[[tuple[int, ...], torch.dtype], "Block | None"]


class Staged:
    """One request's inputs on the device: a block per input, and the event of their copy."""

    __slots__ = ("blocks", "ready")

    def __init__(self, blocks: list[Block], ready: Any) -> None:
        self.blocks = blocks
        self.ready = ready  # CUDA event recorded after the copies; None on the CPU

    @property
    def nbytes(self) -> int:
        return sum(block.nbytes for block in self.blocks)


class InputStager:
    """Copies queued requests' inputs into pooled device blocks on a thread of its own."""

    def __init__(self, name: str, device: torch.device, *,
                 to_tensor: Callable[[np.ndarray, int], torch.Tensor],
                 dtypes: Sequence[torch.dtype], allocate: Allocate, cap_bytes: int,
                 on_bytes: Callable[[int], None] | None = None,
                 on_fallback: Callable[[], None] | None = None) -> None:
        """``to_tensor(array, input_index)``: a host tensor over a request's input array;
        ``on_bytes(delta)``: staged bytes went up or down (a metric)."""
        self._name = name
        self._device = device
        self._cuda = device.type == "cuda"
        self._to_tensor = to_tensor
        self._dtypes = list(dtypes)
        self._allocate = allocate
        self._cap_bytes = cap_bytes
        self._on_bytes = on_bytes
        self._on_fallback = on_fallback
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._staged: dict[InferenceRequest, Staged] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self._work: queue_module.SimpleQueue = queue_module.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"{name}-stage", daemon=True)

    @property
    def cap_bytes(self) -> int:
        """The most this model's staged inputs may hold."""
        return self._cap_bytes

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread; blocks still staged are freed (their requests ran or were dropped)."""
        if self._thread.is_alive():
            self._work.put(None)
            self._thread.join()
        with self._lock:
            left = list(self._staged.values())
            self._staged.clear()
        for staged in left:
            self._free(staged)

    # -- the event loop's side ----------------------------------------------------------------

    def put(self, request: InferenceRequest) -> None:
        """``request`` was queued: stage its inputs as soon as the thread gets to it."""
        self._work.put((True, request))

    def drop(self, request: InferenceRequest) -> None:
        """``request`` left the queue without running: free its blocks, if it has any."""
        self._work.put((False, request))

    # -- the assembler's side -----------------------------------------------------------------

    def claim(self, request: InferenceRequest) -> Staged | None:
        """The request's staged inputs (now the caller's to ``release``), or None."""
        with self._lock:
            return self._staged.pop(request, None)

    def release(self, staged: Sequence[Staged]) -> None:
        """Give back blocks claimed by a batch that has finished reading them."""
        for item in staged:
            self._free(item)

    # -- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        if self._cuda:
            torch.cuda.set_device(self._device)
        while (work := self._work.get()) is not None:
            stage, request = work
            try:
                if stage:
                    self._stage(request)
                else:
                    self._drop(request)
            except Exception:  # the batch then copies this request itself
                log.exception("staging_failed", model=self._name, request=request.id)

    def _stage(self, request: InferenceRequest) -> None:
        if request.check_inputs is not None or any(
                isinstance(a, torch.Tensor) for a in request.inputs):
            # In a client's shared memory: the batch reads them from the region itself (a tensor
            # on a device needs no staging).
            return
        nbytes = sum(a.nbytes for a in request.inputs)
        with self._lock:  # reserve the bytes; the copies run outside the lock
            if request.state != QUEUED or request in self._staged:
                return
            if self._bytes + nbytes > self._cap_bytes:
                return
            self._bytes += nbytes
        blocks = self._blocks(request)
        if blocks is None:
            with self._lock:
                self._bytes -= nbytes
            return
        ready = None
        if self._cuda:
            with torch.cuda.stream(self._stream):
                for i, (block, array) in enumerate(zip(blocks, request.inputs)):
                    block.tensor.copy_(self._to_tensor(array, i), non_blocking=True)
                ready = gpu.host_event()
                ready.record(self._stream)
        else:  # numpy copies: a request's arrays may be read-only, which torch warns about
            for block, array in zip(blocks, request.inputs):
                np.copyto(host_array(block.tensor), array)
        staged = Staged(blocks, ready)
        with self._lock:
            # Taken by its batch (which then copied it itself) or dropped meanwhile: not kept.
            keep = request.state == QUEUED
            if keep:
                self._staged[request] = staged
                self._bytes += staged.nbytes - nbytes
        if not keep:
            if ready is not None:
                ready.synchronize()
            for block in blocks:
                block.release()
            with self._lock:
                self._bytes -= nbytes
            return
        if self._on_bytes is not None:
            self._on_bytes(staged.nbytes)

    def _blocks(self, request: InferenceRequest) -> list[Block] | None:
        blocks: list[Block] = []
        for i, array in enumerate(request.inputs):
            block = self._allocate(tuple(array.shape), self._dtypes[i])
            if block is None:
                for taken in blocks:
                    taken.release()
                return None
            if not block.in_pool and self._on_fallback is not None:
                self._on_fallback()
            blocks.append(block)
        return blocks

    def _drop(self, request: InferenceRequest) -> None:
        staged = self.claim(request)
        if staged is not None:
            if staged.ready is not None:
                staged.ready.synchronize()  # the DMA may still be writing into the blocks
            self._free(staged)

    def _free(self, staged: Staged) -> None:
        for block in staged.blocks:
            block.release()
        with self._lock:
            self._bytes -= staged.nbytes
        if self._on_bytes is not None:
            self._on_bytes(-staged.nbytes)
