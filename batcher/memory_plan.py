"""What a model reserves at load: its ``MemoryPlan``, the buffers it needs in its device arena.

Per batch in flight one input buffer per input, of the most rows a batch may have, where the
requests' rows are gathered; per CUDA-graph bucket the graph's fixed input and output buffers;
and an activation pool. ``batchgate.batcher.pool`` reserves a plan all or nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import torch

BUFFER_KINDS = ("input", "output", "batch")


@dataclasses.dataclass(frozen=True)
class PlannedBuffer:
    """One buffer of a ``MemoryPlan``: the ``index``-th input or output at batch ``bucket``.

    Kind ``batch`` is a forming batch's input buffer (``bucket`` rows, the largest batch) of
    in-flight ``slot``; ``input``/``output`` are a bucket's fixed buffers (a CUDA graph's).
    """

    kind: str  # one of BUFFER_KINDS
    bucket: int
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    slot: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What a model reserves at load: its per-bucket I/O buffers plus an activation pool."""

    buffers: tuple[PlannedBuffer, ...]
    activation_bytes: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.activation_bytes, int) or self.activation_bytes < 0:
            raise ValueError(
                f"activation_bytes must be an int >= 0, got {self.activation_bytes!r}"
            )
        for buffer in self.buffers:
            if buffer.kind not in BUFFER_KINDS:
                raise ValueError(f"buffer kind must be one of {BUFFER_KINDS}, got {buffer.kind!r}")

    @property
    def buckets(self) -> tuple[int, ...]:
        """The buckets with fixed input/output buffers."""
        return tuple(sorted({b.bucket for b in self.buffers if b.kind != "batch"}))

    @property
    def slots(self) -> int:
        return len({b.slot for b in self.buffers if b.kind == "batch"})

    @property
    def nbytes(self) -> int:
        """Bytes asked for, before rounding to the pool's alignment."""
        return sum(buffer.nbytes for buffer in self.buffers) + self.activation_bytes

    def describe(self) -> str:
        fixed = [b for b in self.buffers if b.kind != "batch"]
        batch = [b for b in self.buffers if b.kind == "batch"]
        parts = []
        if batch:
            parts.append(f"{len(batch)} batch input buffers for {self.slots} batches in flight "
                         f"({sum(b.nbytes for b in batch)} bytes)")
        if fixed or not batch:
            parts.append(f"{len(fixed)} input/output buffers over buckets {self.buckets} "
                         f"({sum(b.nbytes for b in fixed)} bytes)")
        return " + ".join(parts) + f" + {self.activation_bytes} bytes of activations"


Spec = tuple[tuple[int, ...], torch.dtype]


def plan_for(
    input_specs: Iterable[Spec],
    output_specs: Iterable[Spec],
    buckets: Sequence[int],
    activation_bytes: int,
) -> MemoryPlan:
    """A plan from per-sample ``(dims, dtype)`` specs: one buffer ``(bucket, *dims)`` each."""
    inputs, outputs = list(input_specs), list(output_specs)
    if not buckets:
        raise ValueError("buckets must not be empty")
    for bucket in buckets:
        if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1:
            raise ValueError(f"buckets must be ints >= 1, got {bucket!r}")
    for dims, dtype in inputs + outputs:
        if not isinstance(dtype, torch.dtype) or any(d < 0 for d in dims):
            raise ValueError(f"a spec is (dims >= 0, torch.dtype), got {(dims, dtype)!r}")
    buffers = []
    for bucket in sorted(set(buckets)):
        for kind, specs in (("input", inputs), ("output", outputs)):
            for index, (dims, dtype) in enumerate(specs):
                buffers.append(PlannedBuffer(kind, bucket, index, (bucket, *dims), dtype))
    return MemoryPlan(tuple(buffers), activation_bytes)


def model_plan(
    input_specs: Iterable[Spec],
    output_specs: Iterable[Spec],
    *,
    max_rows: int | None,
    slots: int,
    graph_buckets: Sequence[int] = (),
) -> MemoryPlan:
    """A served model's plan: per batch in flight (``slots``), one input buffer per input of
    ``max_rows`` rows (None: the model does not batch, a buffer is one sample), where requests'
    rows are gathered; and per CUDA-graph bucket the graph's fixed input and output buffers."""
    inputs, outputs = list(input_specs), list(output_specs)
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    lead = () if max_rows is None else (max_rows,)
    buffers = [
        PlannedBuffer("batch", max_rows or 1, index, (*lead, *dims), dtype, slot)
        for slot in range(slots)
        for index, (dims, dtype) in enumerate(inputs)
    ]
    if graph_buckets:
        buffers.extend(plan_for(inputs, outputs, graph_buckets, 0).buffers)
    return MemoryPlan(tuple(buffers), 0)
