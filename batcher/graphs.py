"""CUDA graphs per batch bucket, captured at load into the instance's own graph pool.

A captured graph replays a whole forward with one launch, which removes the CPU's kernel-launch
gaps between small kernels, where the GPU sits idle. Each bucket of an instance gets its
graph, captured on the bucket's fixed input buffers (``static_inputs``, in the device memory
pool) and ending with a copy of the outputs into the bucket's fixed output buffers
(``static_outputs``, in the pool too), so nothing a replay leaves behind lives in the graph pool.

Each instance has its own graph pool (the ``graphs<i>`` role of the model's memory,
``batcher/gpu.py``), its own capture stream and its own replay stream: graphs replayed at once
on different streams must not share a pool, and two instances of a model replay at once. An
instance's buckets share its pool, which is safe because they replay on its one stream, in
order; largest bucket first, so smaller graphs reuse its memory. The eager runs before a
capture allocate into the instance's compute pool, as its eager batches do.

The instance's model thread captures (``batcher/executor.py``), the thread that later replays
and runs its eager batches: the cuBLAS workspace a graph's kernels were captured with is that
thread's own for the stream (``batcher/allocator.py``), and no live thread of another instance
has that handle.

Capture goes through the allocator (``ModelMemory.capture``), not ``torch.cuda.graph``, which
synchronizes the whole device and empties the caching allocator's device and pinned-host
caches: loading one graph model would stall every model serving on the device. Only the
capture stream is synchronized. ``capture_error_mode="thread_local"``: other models keep
serving from other threads while one captures. Autocast runs with its cast cache off inside a
capture (cached casts would be freed while the graph still reads them).

``unavailable_reason`` says why a model runs eager instead ("no CUDA device", an output with
variable dims); a failed capture is reported by the caller, which then runs eager.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from batchgate.batcher import gpu
from batchgate.batcher.spec import ModelSpec

# Eager runs on the capture stream before capturing: lazy initialisation (cuBLAS handles and
# workspaces, cuDNN plans, a traced module's profiling runs) must not happen inside a capture.
WARMUP_RUNS = 3


def unavailable_reason(spec: ModelSpec, memory: gpu.ModelMemory | None = None) -> str | None:
    """Why ``spec`` cannot have CUDA graphs (captured into ``memory``'s pools), or None."""
    if memory is not None and memory.supports_graphs:
        pass
    elif not spec.device.startswith("cuda"):
        return "no CUDA device: the model runs on the CPU"
    if not spec.buckets:
        return "no batch buckets: a graph has one fixed batch size (set buckets)"
    for tensor in (*spec.inputs, *spec.outputs):
        if not tensor.fixed() or tensor.datatype == "BYTES":
            return f"tensor {tensor.name!r} has variable dims or is BYTES"
    return None


Forward = Callable[[Sequence[torch.Tensor], bool], Sequence[torch.Tensor]]


def on_stream(stream: Any) -> contextlib.AbstractContextManager:
    """``torch.cuda.stream(stream)``, or nothing where there are no streams (None)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class BucketGraphs:
    """One instance's captured graph per bucket, with their fixed input and output buffers."""

    def __init__(self, device: torch.device, forward: Forward,
                 static_inputs: dict[int, tuple[torch.Tensor, ...]],
                 static_outputs: dict[int, tuple[torch.Tensor, ...]], *,
                 memory: gpu.ModelMemory, instance: int) -> None:
        """``forward(inputs, capturing)`` runs the model (precision applied) and returns its
        outputs, batch dimension first; ``memory``: the model's pools, ``instance``'s roles."""
        self._device = device
        self._forward = forward
        self._inputs = static_inputs
        self._outputs = static_outputs
        self._graphs: dict[int, Any] = {}
        self._memory = memory
        self._allocator = memory.allocator
        self._graph_role = gpu.role("graphs", instance)
        self._eager_role = gpu.role("compute", instance)
        self.capture_stream = self._allocator.stream(device)
        self.replay_stream = self._allocator.stream(device)

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def capture(self) -> None:
        """Capture every bucket's graph, largest first. Raises what the capture raised."""
        for bucket in sorted(self._inputs, reverse=True):
            self._graphs[bucket] = self._capture_one(bucket)

    def _capture_one(self, bucket: int) -> Any:
        stream = self.capture_stream
        inputs, outputs = self._inputs[bucket], self._outputs[bucket]
        for tensor in inputs:
            tensor.zero_()
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self._device))
        with on_stream(stream):
            for _ in range(WARMUP_RUNS):
                with self._memory.use(self._eager_role):
                    self._forward(inputs, False)
        graph = self._allocator.new_graph()

        def body() -> None:
            for static, produced in zip(outputs, self._forward(inputs, True)):
                static.copy_(produced)

        self._memory.capture(self._graph_role, graph, stream, body)
        self._allocator.synchronize(stream)
        return graph

    def replay(self, bucket: int, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Copy ``inputs`` (``bucket`` rows each, on the device) into the graph's buffers and
        replay it on the current stream, which must be ``replay_stream``. Returns the fixed
        output buffers: read them (enqueue the copies) before the next replay."""
        for static, given in zip(self._inputs[bucket], inputs):
            static.copy_(given, non_blocking=True)
        self._allocator.replay(self._graphs[bucket])
        return self._outputs[bucket]
