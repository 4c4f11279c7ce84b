"""One inference request as the batcher sees it: decoded arrays plus scheduling facts."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

# Life of a request inside a ModelQueue. A request is NEW until the queue takes it (one refused
# stays NEW). It leaves QUEUED exactly once, under the queue's lock: taken into a batch, or
# removed (cancelled, expired, refused at close). A taken request is DONE when its batch has
# finished: from then on nothing reads its input arrays.
QUEUED = 0
TAKEN = 1
REMOVED = 2
DONE = 3
NEW = 4

_monotonic = time.monotonic


def batch_shape_key(shapes: Sequence[tuple[int, ...]], *, batching: bool) -> tuple:
    """The key of the requests that may share a batch: only requests with equal keys do. It is
    the inputs' shapes (in the model's input order) without their batch dimension where the
    model batches, the whole shapes where it does not."""
    return tuple([s[1:] for s in shapes]) if batching else tuple(shapes)


class InferenceRequest:
    """Inputs in the model's input order, each with its batch dimension first (when batching).

    ``deadline`` is on the ``time.monotonic()`` clock; ``timeout_us`` is the request's own
    ``timeout`` parameter (0 = none), resolved against the queue policy by the model.
    """

    __slots__ = (
        "id",
        "inputs",
        "batch_size",
        "priority",
        "level",
        "deadline",
        "timeout_us",
        "requested_outputs",
        "shape_key",
        "arrival",
        "enqueued",
        "state",
        "answered",
        "caller",
        "tag",
        "on_release",
        "check_inputs",
        "input_error",
        "__weakref__",  # batcher/expiry.py watches deadlines without keeping requests alive
    )

    def __init__(
        self,
        inputs: Sequence[np.ndarray],
        *,
        batch_size: int = 1,
        request_id: str = "",
        priority: int = 0,
        deadline: float | None = None,
        timeout_us: int = 0,
        requested_outputs: Sequence[str] | None = None,
        shape_key: tuple | None = None,
    ) -> None:
        self.id = request_id
        self.inputs = list(inputs)
        self.batch_size = batch_size
        self.priority = priority  # as asked for; 0 = the model's default level
        self.level = 0  # resolved priority level, 1 = highest
        self.deadline = deadline
        self.timeout_us = timeout_us
        self.requested_outputs = tuple(requested_outputs) if requested_outputs else None
        self.shape_key = (
            shape_key if shape_key is not None
            else batch_shape_key([a.shape for a in self.inputs], batching=True)
        )
        self.arrival = time.monotonic()
        self.enqueued = 0.0
        self.state = NEW
        # Set once, when the model answers the request (a result or an error): nothing answers
        # it again, and a batch it is still in drops it.
        self.answered = False
        # The caller the model's host answers (``batcher/delivery.py``): an asyncio future for
        # ``ServedModel.infer``, the host's own record of the caller otherwise; ``tag`` is the
        # host's number for the request. The batcher never reads either.
        self.caller: Any = None
        self.tag = 0
        # Called on the event loop when a taken request's batch has finished (its inputs may
        # live in shared memory that their owner reuses only after this).
        self.on_release: Callable[[], None] | None = None
        # Called with the request by the batch right before it reads the inputs (on its
        # thread): puts in ``inputs`` what must be read then (a client's shared memory), or
        # raises a BatchgateError when they can no longer be read (its region shrank). The
        # request then fails alone with that error, and the batch reads zeros in its place.
        self.check_inputs: Callable[[InferenceRequest], None] | None = None
        self.input_error: BaseException | None = None

    @classmethod
    def taken(cls, inputs: list[np.ndarray], batch_size: int, request_id: str, priority: int,
              deadline: float | None, timeout_us: int, shape_key: tuple, caller: Any,
              tag: int) -> InferenceRequest:
        """A request as ``__init__`` makes it from these (``inputs`` kept as given, the caller
        and tag set), without its keyword handling: for a host that makes a read's worth at a
        time (the executor process's group intake)."""
        self = cls.__new__(cls)
        self.id = request_id
        self.inputs = inputs
        self.batch_size = batch_size
        self.priority = priority
        self.level = 0
        self.deadline = deadline
        self.timeout_us = timeout_us
        self.requested_outputs = None
        self.shape_key = shape_key
        self.arrival = _monotonic()
        self.enqueued = 0.0
        self.state = NEW
        self.answered = False
        self.caller = caller
        self.tag = tag
        self.on_release = None
        self.check_inputs = None
        self.input_error = None
        return self

    @property
    def holds_inputs(self) -> bool:
        """True while a running batch may still read this request's input arrays."""
        return self.state == TAKEN

