"""The models the executor process serves, as front ends see them: a handle per READY load.

A front end checks each request against the ``ModelState`` it was last told, and names the
state's handle in the request (``Infer.model``); every load gets a new handle, so a request
checked against a model since reloaded or unloaded is answered UNAVAILABLE instead of running
against a spec it was not checked against.
"""

from __future__ import annotations

import itertools

import numpy as np

from batchgate.batcher.errors import BatchgateError
from batchgate.batcher.model import ServedModel
from batchgate.batcher.spec import NUMPY_DTYPES, ModelSpec
from batchgate.protos import wire_pb2
from batchgate.server.ipc import wire
from batchgate.server.executor.repository import READY, ModelIndexEntry, ModelRepository


class Served:
    """One READY handle: its model and what a request's intake reads of it, looked up once."""

    __slots__ = ("handle", "model", "dtypes", "batching", "every_output")

    def __init__(self, handle: int, model: ServedModel) -> None:
        self.handle = handle
        self.model = model
        self.dtypes = input_dtypes(model.spec)
        self.batching = model.spec.batching.max_batch_size > 0
        # What a request that names no output asks for: all of them, in the model's order.
        self.every_output = tuple(range(len(model.spec.outputs)))


class ModelHandles:
    """READY handle -> ``Served``, kept in step with the repository (``state``)."""

    def __init__(self) -> None:
        self.served: dict[int, Served] = {}
        self._current: dict[str, Served] = {}  # name -> its current handle
        self._next = itertools.count(1)
        self.repository: ModelRepository | None = None

    def get(self, handle: int) -> Served | None:
        return self.served.get(handle)

    def add(self, model: ServedModel) -> Served:
        """A handle for ``model`` (tests, benchmarks: a model without a repository)."""
        served = Served(next(self._next), model)
        self.served[served.handle] = served
        self._current[model.spec.name] = served
        return served

    def state(self, name: str, entry: ModelIndexEntry | None = None) -> wire_pb2.ModelState:
        """``name``'s state as front ends see it; a READY model gets a handle per load."""
        repository = self.repository
        if entry is None:
            entry = next((e for e in repository.index() if e.name == name), None)
        state = wire_pb2.ModelState(name=name, state=entry.state if entry else "UNAVAILABLE",
                                    reason=entry.reason if entry else "unknown")
        current = self._current.get(name)
        model = None
        if state.state == READY:
            try:
                model = repository.get(name)
                config = repository.config(name)
            except BatchgateError:
                state.state, model = "UNAVAILABLE", None
        if model is None:
            if current is not None:
                del self._current[name]
                self.served.pop(current.handle, None)
            return state
        if current is None or current.model is not model:
            if current is not None:
                self.served.pop(current.handle, None)
            current = self.add(model)
        state.handle = current.handle
        describe(model.spec, state.spec)
        state.config.CopyFrom(config)
        return state

    def every_state(self) -> list[wire_pb2.ModelState]:
        """Every model's state (a welcome's)."""
        return [self.state(entry.name, entry) for entry in self.repository.index()]


def state_entry(state: wire_pb2.ModelState) -> tuple[wire_pb2.ModelState, int]:
    """``state`` and its entry's size, or, for a model whose description alone would not fit a
    frame (a config of that size), the model as UNAVAILABLE saying why."""
    nbytes = wire.ENTRY_BYTES + state.ByteSize()
    if nbytes <= wire.capacity_bytes():
        return state, nbytes
    state = wire_pb2.ModelState(
        name=state.name, state="UNAVAILABLE",
        reason=f"its description ({nbytes} bytes) is larger than a frame from the executor "
               f"process to the front end ({wire.MAX_FRAME_BYTES} bytes)")
    return state, wire.ENTRY_BYTES + state.ByteSize()


def input_dtypes(spec: ModelSpec) -> tuple[tuple[np.dtype | None, str, str], ...]:
    """Per input, its numpy dtype (None for BYTES), datatype and name."""
    return tuple((None if t.datatype == "BYTES" else NUMPY_DTYPES[t.datatype], t.datatype,
                  t.name) for t in spec.inputs)


def describe(spec: ModelSpec, into: wire_pb2.ModelSpec) -> None:
    into.name = spec.name
    into.version = spec.version
    into.platform = spec.platform
    into.max_batch_size = spec.batching.max_batch_size
    for tensors, target in ((spec.inputs, into.inputs), (spec.outputs, into.outputs)):
        for tensor in tensors:
            target.add(name=tensor.name, datatype=tensor.datatype, dims=tensor.dims)
