"""A finished batch's answers, from the executor process to its front ends: the models'
``Delivery`` (``batcher/delivery.py``) here.

A batch's outputs are written into the executor's region of the arena once, whole, and every
request of the batch gets a descriptor of its rows. Where every request takes every output in
rows of a fixed size (the common case: no BYTES, no placements, no outputs named), a front
end's requests of the batch are described by one ``Batch`` message, its columns built from the
batch as lists (wire.proto); otherwise each request gets a ``Result``. Either way one frame per
front end answers the whole batch, written before the batch's accounting runs. Errors go out
as a ``Failure`` each.

Each Output a front end receives is one reference to its block (``OutputRegion``); the front
end returns it (``ToExecutor.free``) once it has copied the bytes, and the block is reused
once its last reference is back.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import numpy as np
import structlog

from batchgate.server.ipc.arena import ArenaLayout, SharedArena
from batchgate.batcher.arena_allocator import ArenaAllocator
from batchgate.batcher.errors import BatchgateError, ModelExecutionError, ResourceExhausted
from batchgate.batcher.metrics import BatcherMetrics
from batchgate.batcher.request import InferenceRequest
from batchgate.batcher.spec import ModelSpec
from batchgate.server.ipc import wire
from batchgate.server.frontend.codec import bytes_encoding, bytes_row_offsets
from batchgate.server.executor.fronts import Caller, FrontEnd, FrontEnds
from batchgate.server.executor.shared_memory import SharedMemoryRegistry
from batchgate.server.rules.status import INTERNAL_MESSAGE, Code, status_of

log = structlog.get_logger(__name__)

# Bounds on the encoded size of the answers' entries (wire.Link.room): a number field is
# wire.NUMBER_BYTES at most, a bool 2, an entry's own tag and length wire.ENTRY_BYTES.
_N, _E = wire.NUMBER_BYTES, wire.ENTRY_BYTES
_RESULT_BYTES = _E + _N + 2  # rid, released; its outputs come on top
_BATCH_BYTES = _E + 3 * _E + 2  # rids, first_rows and rows (packed), released
_BATCH_MEMBER_BYTES = 3 * (_N - 1)  # a request's rid, first row and rows
TOO_MANY_OUTPUTS_MESSAGE = (
    "the answer describes {outputs} outputs, more than one frame from the executor process to "
    "the front end holds ({limit} bytes); ask for fewer outputs")


class OutputRegionFull(Exception):
    def __init__(self, in_use: int) -> None:
        super().__init__()
        self.error = ResourceExhausted(
            f"the executor's shared-memory output region is full ({in_use} bytes in use); "
            "retry later")


class OutputRegion:
    """The executor's region of the arena: a block per batch output, and the front ends'
    references to each (a block is reused once its last reference is back)."""

    def __init__(self, arena: SharedArena, layout: ArenaLayout,
                 metrics: BatcherMetrics) -> None:
        self._arena = arena
        self._allocator = ArenaAllocator(*layout.output_region())
        self._references: dict[int, int] = {}  # block -> references held by front ends
        self._in_use = metrics.arena_bytes_in_use.labels("output")
        self._in_use_shown = -1  # what the gauge holds: it is written only when that changes

    @property
    def bytes_in_use(self) -> int:
        return self._allocator.bytes_in_use

    def write(self, array: np.ndarray) -> int:
        """A block holding ``array``'s bytes; OutputRegionFull when none is free."""
        block = self._allocator.alloc(array.nbytes)
        if block is None:
            raise OutputRegionFull(self._allocator.bytes_in_use)
        np.copyto(self._arena.array(block, array.dtype, array.shape), array)
        return block

    def write_bytes(self, array: np.ndarray, rows: bool) -> tuple[tuple[int, int], np.ndarray]:
        """The batch's encoding of a BYTES output in a block of its own: ``((block, bytes),
        row offsets)``, the offsets only when ``rows`` (the batch is split per request)."""
        data = bytes_encoding(array)
        block = self._allocator.alloc(len(data))
        if block is None:
            raise OutputRegionFull(self._allocator.bytes_in_use)
        self._arena.write(block, data)
        return (block, len(data)), (bytes_row_offsets(array) if rows else None)

    def discard(self, block: int) -> None:
        """A block nobody was handed."""
        self._allocator.free(block)

    def hand_out(self, held: dict[tuple[FrontEnd, int], int], written: Sequence[int]) -> None:
        """The references ``held`` ((front end, block) -> count) were handed out; the blocks of
        ``written`` that none names are free again."""
        for (front, block), count in held.items():
            front.blocks[block] += count
            self._references[block] = self._references.get(block, 0) + count
        for block in written:
            if block not in self._references:
                self._allocator.free(block)
        self.show_in_use()

    def free(self, front: FrontEnd, blocks: Sequence[int]) -> None:
        """``front`` returned one reference per entry of ``blocks``."""
        # A batch's requests share a block and are usually freed in one frame: one update each.
        counts = ((blocks[0], 1),) if len(blocks) == 1 else collections.Counter(blocks).items()
        for block, count in counts:
            holding = front.blocks.get(block, 0)
            if holding < count:
                log.error("bad_free", slot=front.slot, block=block)
                count = holding
                if not count:
                    continue
            if holding == count:
                del front.blocks[block]
            else:
                front.blocks[block] = holding - count
            self.drop_references(block, count)
        self.show_in_use()

    def drop_references(self, block: int, count: int) -> None:
        left = self._references[block] - count
        if left:
            self._references[block] = left
        else:
            del self._references[block]
            self._allocator.free(block)

    def show_in_use(self) -> None:
        # Most frees drop one of a batch's references to a block and free nothing.
        in_use = self._allocator.bytes_in_use
        if in_use != self._in_use_shown:
            self._in_use_shown = in_use
            self._in_use.set(in_use)


class BatchAnswers:
    """The models' delivery in the executor process: answers into the front ends' frames."""

    per_request_views = False  # a batch's outputs are written whole, once

    def __init__(self, region: OutputRegion, fronts: FrontEnds,
                 shared_memory: SharedMemoryRegistry,
                 inline: Callable[[Callable[[], None]], bool]) -> None:
        self._region = region
        self._fronts = fronts
        self._shared_memory = shared_memory
        self.inline = inline

    # -- Delivery ------------------------------------------------------------------------------

    def failed(self, requests: Sequence[InferenceRequest], error: BaseException) -> None:
        if not isinstance(error, BatchgateError):
            log.error("executor_request_failed", requests=[r.id for r in requests],
                      exc_info=error)
            error = ModelExecutionError(INTERNAL_MESSAGE)
        code, text = status_of(error)
        for request in requests:
            front, rid = request.caller.front, request.tag
            front.requests.pop(rid, None)
            released = not request.holds_inputs
            if not released:
                # Expired or cancelled while its batch runs: the batch may still read the
                # inputs; the front end reuses them once told.
                front.hold(rid, request)
            front.fail(rid, released, code, text)

    def results(self, requests: Sequence[InferenceRequest], first_rows: Sequence[int],
                outputs: list[np.ndarray], per_request=None) -> None:
        """Write the batch's outputs into the arena once and describe each request's rows: in
        one Batch per front end where every request takes every output in fixed-size rows."""
        live = []
        for request in requests:
            front = request.caller.front
            front.requests.pop(request.tag, None)
            if not front.closed:
                live.append(request)
        if not live:
            return
        if len(live) < len(requests):
            keep = {id(r) for r in live}
            first_rows = [f for r, f in zip(requests, first_rows) if id(r) in keep]
        callers = {id(r.caller): r.caller for r in live}.values()
        spec = live[0].caller.model.spec
        wanted = set()  # what goes into the arena: the outputs not in a client's region
        for caller in callers:
            if caller.placements is None:
                wanted.update(caller.outputs)
            else:
                wanted.update(k for k, p in zip(caller.outputs, caller.placements) if p is None)
        # A request's rows of an output: requests lie in the batch in order, each its rows.
        split = spec.batching.max_batch_size > 0 and (
            len(live) > 1 or first_rows[0] > 0
            or any(len(array) != live[0].batch_size for array in outputs))
        region = self._region
        blocks: dict[int, tuple[int, int]] = {}  # output index -> (block, bytes) of the batch's
        # Per output, the byte offset in its block of each row, and of the end (rows + 1 values).
        row_offsets: dict[int, np.ndarray | int] = {}
        try:
            for k in sorted(wanted):
                if spec.outputs[k].datatype == "BYTES":
                    blocks[k], row_offsets[k] = region.write_bytes(outputs[k], split)
                else:
                    blocks[k] = (region.write(outputs[k]), outputs[k].nbytes)
                    row_offsets[k] = outputs[k].nbytes // max(len(outputs[k]), 1)
        except OutputRegionFull as full:
            for block, _ in blocks.values():
                region.discard(block)
            self.failed(live, full.error)
            return
        # Per output in the arena: its block, its bytes, its row offsets, its shape past rows.
        layout = {k: (block, nbytes, row_offsets[k], outputs[k].shape[1:])
                  for k, (block, nbytes) in blocks.items()}
        held: dict[tuple[FrontEnd, int], int] = {}  # (front end, block) -> references
        if (split and len(layout) == len(spec.outputs)
                and all(entry[2].__class__ is int for entry in layout.values())
                and all(caller.whole for caller in callers)):
            self._describe_batch(live, first_rows, outputs, layout, held)
        else:
            self._describe_each(live, first_rows, spec, outputs, split, layout, held)
        region.hand_out(held, [block for block, _ in blocks.values()])
        # The answers go out before the batch's accounting runs: every front end's frame (one
        # or two), not a set of the batch's requests' front ends.
        for front in self._fronts.connected:
            front.flush()

    # -- describing a batch ----------------------------------------------------------------------

    def _describe_batch(self, live: list[InferenceRequest], first_rows: Sequence[int],
                        outputs: list[np.ndarray], layout: dict, held: dict) -> None:
        """One Batch per front end (wire.proto) in place of a Result each, or several where
        one would not fit a frame."""
        by_front: dict[FrontEnd, tuple[list[InferenceRequest], list[int]]] = {}
        for request, first in zip(live, first_rows):
            front = request.caller.front
            members = by_front.get(front)
            if members is None:
                by_front[front] = ([request], [first])
            else:
                members[0].append(request)
                members[1].append(first)
        described = [layout[k] for k in sorted(layout)]
        fixed = _BATCH_BYTES + sum([_batch_output_bytes(outputs[k].ndim) for k in layout])
        most = max(1, (wire.capacity_bytes() - fixed) // _BATCH_MEMBER_BYTES)
        for front, (members, firsts) in by_front.items():
            holding = [r.holds_inputs for r in members]
            if any(holding) and not all(holding):
                # A batch's requests are released together (ServedModel._answer); were they
                # not, each says so in its own Result.
                self._describe_each(members, firsts, members[0].caller.model.spec, outputs,
                                    True, layout, held)
                continue
            released = not holding[0]
            for at in range(0, len(members), most):
                part = members[at:at + most]
                out = front.out(fixed + len(part) * _BATCH_MEMBER_BYTES)
                if out is None:
                    break
                batch = out.batches.add(released=released)
                batch.rids.extend([r.tag for r in part])
                batch.first_rows.extend(firsts[at:at + most])
                batch.rows.extend([r.batch_size for r in part])
                for block, _, row_bytes, tail in described:
                    batch.outputs.add(block=block, row_bytes=row_bytes, tail=tail)
                    held[(front, block)] = held.get((front, block), 0) + len(part)

    def _describe_each(self, live: list[InferenceRequest], first_rows: Sequence[int],
                       spec: ModelSpec, outputs: list[np.ndarray], split: bool, layout: dict,
                       held: dict) -> None:
        """One Result per request: its rows of each output it asked for (or its placements).
        A Result that would not fit a frame alone fails its request alone."""
        per_output = [_output_bytes(array.ndim) for array in outputs]
        sizes: dict[tuple[int, ...], int] = {}  # the outputs asked for -> their Result's bound
        capacity = wire.capacity_bytes()
        for request, first in zip(live, first_rows):
            caller: Caller = request.caller
            front, rid = caller.front, request.tag
            if front.closed:
                continue
            asked = caller.outputs
            nbytes = sizes.get(asked)
            if nbytes is None:
                nbytes = sizes[asked] = _RESULT_BYTES + sum([per_output[k] for k in asked])
            if nbytes > capacity:
                front.fail(rid, not request.holds_inputs, Code.RESOURCE_EXHAUSTED,
                           TOO_MANY_OUTPUTS_MESSAGE.format(outputs=len(asked),
                                                           limit=wire.MAX_FRAME_BYTES))
                continue
            placed = None
            if caller.placements is not None:
                try:
                    placed = self._place(request, first, spec, outputs, split)
                except BatchgateError as exc:  # an output that does not fit the client's region
                    front.fail(rid, not request.holds_inputs, *status_of(exc))
                    continue
            out = front.out(nbytes)
            if out is None:
                continue
            add = out.results.add(rid=rid, released=not request.holds_inputs).outputs.add
            rows = request.batch_size
            for k in asked:
                if placed is not None and k in placed:
                    nbytes, shape = placed[k]
                    add(placed=True, nbytes=nbytes, shape=shape)  # no block to free
                    continue
                block, nbytes, per_row, tail = layout[k]
                if not split:
                    add(block=block, offset=block, nbytes=nbytes, shape=outputs[k].shape)
                elif per_row.__class__ is int:  # fixed-size rows; else BYTES' row offsets
                    add(block=block, offset=block + first * per_row, nbytes=rows * per_row,
                        shape=(rows, *tail))
                else:
                    offset, nbytes = _rows_of(per_row, first, rows)
                    add(block=block, offset=block + offset, nbytes=nbytes, shape=(rows, *tail))
                key = (front, block)
                held[key] = held.get(key, 0) + 1

    def _place(self, request: InferenceRequest, first: int, spec: ModelSpec,
               outputs: list[np.ndarray], split: bool) -> dict[int, tuple[int, tuple]]:
        """Write the request's placed outputs (its rows of the batch's) into the client's
        regions: output index -> (bytes written, shape)."""
        placed = {}
        caller = request.caller
        for k, placement in zip(caller.outputs, caller.placements):
            if placement is None:
                continue
            array = outputs[k]
            if split:
                array = array[first:first + request.batch_size]
            tspec = spec.outputs[k]
            written = self._shared_memory.write_output(placement, tspec.name, tspec.datatype,
                                                       array)
            placed[k] = (written.nbytes, written.shape)
        return placed


def _output_bytes(ndim: int) -> int:
    """A bound on one Output entry's size (a Result's) for an output of ``ndim`` dimensions:
    block, offset, nbytes, placed, and the packed shape."""
    return wire.ENTRY_BYTES + 3 * wire.NUMBER_BYTES + 2 + wire.ENTRY_BYTES + 10 * ndim


def _batch_output_bytes(ndim: int) -> int:
    """The same for a BatchOutput: block, row_bytes and the shape past the rows."""
    return wire.ENTRY_BYTES + 2 * wire.NUMBER_BYTES + wire.ENTRY_BYTES + 10 * max(ndim - 1, 0)


def _rows_of(row_offsets: np.ndarray, first: int, rows: int) -> tuple[int, int]:
    """``(offset, nbytes)`` of rows ``first .. first + rows`` in a BYTES output's block, from the
    offsets of every row (fixed-size rows are ``first * row_bytes``, ``rows * row_bytes``)."""
    begin = int(row_offsets[first])
    return begin, int(row_offsets[first + rows]) - begin
