"""Requests into the executor process: a frame's descriptors become requests whose arrays are
views of the arena, and each model's requests of one read join its queue together.

An ``InferGroup`` (wire.proto) is read column by column: its columns come out of the frame as
lists once, each request costs its views and its ``InferenceRequest`` (no future, no record of
its own: every request of a group shares one ``Caller``), and the read's requests of a model go
into its queue in one call (``ServedModel.submit_group``: one admission bound, one taking of
the queue's lock, one wake-up of its executors). A lone ``Infer`` (outputs named, placements,
BYTES inputs, a model that does not batch) is read as before, a request at a time.
"""

from __future__ import annotations

import math

import numpy as np
import structlog

from batchgate.server.ipc.arena import SharedArena
from batchgate.batcher.errors import BatchgateError
from batchgate.batcher.model import ServedModel
from batchgate.batcher.request import InferenceRequest
from batchgate.protos import wire_pb2
from batchgate.server.frontend.codec import bytes_array
from batchgate.server.executor.fronts import Caller, FrontEnd
from batchgate.server.executor.models import ModelHandles
from batchgate.server.executor.shared_memory import Placement, SharedMemoryRegistry
from batchgate.server.rules.status import Code, status_of

log = structlog.get_logger(__name__)

BAD_TENSORS_MESSAGE = "internal error: the front end described the request's tensors wrongly"
STALE_HANDLE_MESSAGE = (
    "the model was reloaded or unloaded while this request was on its way; retry the request"
)


class Intake:
    """One read's requests, per model, until ``queue`` hands them to their models."""

    def __init__(self, arena: SharedArena, handles: ModelHandles,
                 shared_memory: SharedMemoryRegistry) -> None:
        self._arena = arena
        self._buffer = arena.buffer
        self._handles = handles
        self._shared_memory = shared_memory
        self.pending: dict[ServedModel, list[InferenceRequest]] = {}
        # A request of the read was answered (cancelled, its connection lost) before it queued.
        self._answered_early = False

    def queue(self) -> None:
        """The frames of one read are in: each model's requests of the read are queued in one
        pass, and its queue-depth gauge written once."""
        pending = self.pending
        if not pending:
            return
        self.pending = {}
        early, self._answered_early = self._answered_early, False
        for model, requests in pending.items():
            if early:  # answered already: they do not queue
                requests = [r for r in requests if not r.answered]
                if not requests:
                    continue
            for index, error in model.submit_group(requests):
                _refused(requests[index], error)
            model.publish_depth()

    def cancel(self, front: FrontEnd, rid: int) -> None:
        request = front.requests.get(rid)
        if request is not None:
            if self.pending:
                self._answered_early = True
            request.caller.model.cancel(request)

    def disconnected(self, _front: FrontEnd) -> None:
        """A connection ended: its requests of the read (cancelled now) must not queue."""
        if self.pending:
            self._answered_early = True

    # -- one request ---------------------------------------------------------------------------

    def infer(self, front: FrontEnd, message: wire_pb2.Infer) -> None:
        rid = message.rid
        served = self._handles.get(message.model)
        if served is None:
            front.fail(rid, True, Code.UNAVAILABLE, STALE_HANDLE_MESSAGE)
            return
        model = served.model
        spec = model.spec
        placed: list[tuple[int, str, Placement]] = []
        try:
            arrays, shape_key = self._arrays(front, served.dtypes, message.inputs[:], placed,
                                             served.batching)
        except ValueError as exc:  # a front end's bug: its descriptors do not fit the model
            log.error("bad_descriptor", slot=front.slot, model=spec.name, error=str(exc))
            front.fail(rid, True, Code.INTERNAL, BAD_TENSORS_MESSAGE)
            return
        except BatchgateError as exc:  # a shared-memory input that cannot be read
            front.fail(rid, True, *status_of(exc))
            return
        outputs = tuple(message.outputs[:])  # a slice first: tuple() of upb's container is 2x
        placements = None
        wire_placements = message.placements
        if wire_placements:
            if len(wire_placements) != len(outputs):
                log.error("bad_descriptor", slot=front.slot, model=spec.name,
                          error=f"{len(wire_placements)} placements for "
                                f"{len(outputs)} outputs")
                front.fail(rid, True, Code.INTERNAL,
                           "internal error: the front end described the request's outputs "
                           "wrongly")
                return
            placements = tuple(Placement(p.region, p.offset, p.nbytes) if p.region else None
                               for p in wire_placements)
        deadline_ns = message.deadline_ns
        request = InferenceRequest(
            arrays, batch_size=message.batch_size if served.batching else 1,
            request_id=message.id, priority=message.priority,
            deadline=deadline_ns / 1e9 if deadline_ns else None,
            timeout_us=message.timeout_us,
            requested_outputs=[spec.outputs[i].name for i in outputs] if outputs else None,
            shape_key=shape_key,
        )
        if placed:
            request.check_inputs = self._shared_memory.checker(placed)
        asked = outputs or served.every_output
        request.caller = Caller(front, model, asked, placements,
                                placements is None and asked == served.every_output)
        request.tag = rid
        # A cancel later in the read finds it, and answers it (it then does not queue).
        front.requests[rid] = request
        pending = self.pending.get(model)
        if pending is None:
            self.pending[model] = [request]
        else:
            pending.append(request)

    def _arrays(self, front: FrontEnd, dtypes, tensors, placed: list, batching: bool
                ) -> tuple[list[np.ndarray], tuple]:
        """Views of the request's tensors in the front end's region (BYTES decoded), or in
        the client's shared-memory region, and the request's ``batch_shape_key``; the placed
        ones' (index, name, Placement) into ``placed``. ``dtypes``: per input (dtype, datatype,
        name)."""
        if len(tensors) != len(dtypes):
            raise ValueError(f"{len(tensors)} tensors for {len(dtypes)} inputs")
        start, end = front.region
        arrays = []
        key = []  # the shapes, less the batch dimension when batching
        for tensor, (dtype, datatype, name) in zip(tensors, dtypes):
            shape = tuple(tensor.shape[:])
            key.append(shape[1:] if batching else shape)
            if tensor.HasField("placement"):
                p = tensor.placement
                placement = Placement(p.region, p.offset, p.nbytes, shape)
                if dtype is not None and (math.prod(shape) * dtype.itemsize
                                          != placement.nbytes):
                    raise ValueError(f"shape {list(shape)} of {datatype} is not "
                                     f"{placement.nbytes} bytes")
                placed.append((len(arrays), name, placement))
                arrays.append(self._shared_memory.input_array(placement, name, datatype))
                continue
            offset, nbytes = tensor.offset, tensor.nbytes
            if offset < start or offset + nbytes > end:
                raise ValueError(f"{nbytes} bytes at {offset} lie outside the front end's "
                                 f"region [{start}, {end})")
            if dtype is None:  # BYTES: decoded here, into the numpy object array models take
                arrays.append(bytes_array(self._arena.read(offset, nbytes), shape))
                continue
            if math.prod(shape) * dtype.itemsize != nbytes or min(shape, default=0) < 0:
                raise ValueError(f"shape {list(shape)} of {datatype} is not {nbytes} bytes")
            # The arena's checks, done above once for the whole request.
            arrays.append(np.ndarray(shape, dtype, self._buffer, offset))
        return arrays, tuple(key)

    # -- a group of requests -------------------------------------------------------------------

    def group(self, front: FrontEnd, group: wire_pb2.InferGroup) -> None:
        """A group's requests (wire.proto's InferGroup), as ``infer`` would take each: the
        columns are read once, and a request costs its views and its InferenceRequest."""
        rids = group.rids[:]
        served = self._handles.get(group.model)
        if served is None:
            for rid in rids:
                front.fail(rid, True, Code.UNAVAILABLE, STALE_HANDLE_MESSAGE)
            return
        model, dtypes = served.model, served.dtypes
        count = len(rids)
        sizes, priorities = group.batch_sizes[:], group.priorities[:]
        deadlines, timeouts, ids = group.deadlines_ns[:], group.timeouts_us[:], group.ids[:]
        inputs = group.inputs[:]
        columns = []  # per input: its dtype, its shape past the rows, its row's bytes
        offsets = []  # per input: its offset column
        try:
            if not served.batching:
                raise ValueError("a group of requests for a model that does not batch")
            if len(inputs) != len(dtypes) or not inputs:
                raise ValueError(f"{len(inputs)} tensors for {len(dtypes)} inputs")
            if not (len(sizes) == len(priorities) == len(deadlines) == len(timeouts)
                    == len(ids) == count):
                raise ValueError("the group's columns are not all one entry per request")
            for entry, (dtype, datatype, _name) in zip(inputs, dtypes):
                tail, column = tuple(entry.tail[:]), entry.offsets[:]
                if dtype is None:
                    raise ValueError(f"a group holds a {datatype} input")
                if len(column) != count or min(tail, default=0) < 0:
                    raise ValueError(f"input shape (rows, {tail}) with {len(column)} offsets "
                                     f"for {count} requests")
                columns.append((dtype, tail, math.prod(tail) * dtype.itemsize))
                offsets.append(column)
        except ValueError as exc:  # a front end's bug
            log.error("bad_descriptor", slot=front.slot, model=model.spec.name, error=str(exc))
            for rid in rids:
                front.fail(rid, True, Code.INTERNAL, BAD_TENSORS_MESSAGE)
            return
        key = tuple(tail for _, tail, _ in columns)
        start, end = front.region
        buffer = self._buffer
        in_flight = front.requests
        caller = front.group_caller(model, served.every_output)
        requests = self.pending.get(model)
        if requests is None:
            requests = self.pending[model] = []
        taken = InferenceRequest.taken
        for rid, rows, where, priority, deadline_ns, timeout_us, request_id in zip(
                rids, sizes, zip(*offsets), priorities, deadlines, timeouts, ids):
            arrays = []
            for (dtype, tail, row_bytes), offset in zip(columns, where):
                if offset < start or offset + rows * row_bytes > end:
                    break
                arrays.append(np.ndarray((rows, *tail), dtype, buffer, offset))
            else:
                request = taken(arrays, rows, request_id, priority,
                                deadline_ns / 1e9 if deadline_ns else None, timeout_us, key,
                                caller, rid)
                in_flight[rid] = request
                requests.append(request)
                continue
            log.error("bad_descriptor", slot=front.slot, model=model.spec.name,
                      error=f"{rows * row_bytes} bytes at {offset} lie outside the front "
                            f"end's region [{start}, {end})")
            front.fail(rid, True, Code.INTERNAL, BAD_TENSORS_MESSAGE)
        if not requests:
            del self.pending[model]


def _refused(request: InferenceRequest, error: BatchgateError) -> None:
    front = request.caller.front
    front.requests.pop(request.tag, None)
    front.fail(request.tag, True, *status_of(error))
