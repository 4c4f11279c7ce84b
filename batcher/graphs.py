"""CUDA graphs per batch bucket, captured at load into the model's own graph pool.

A captured graph replays a whole forward with one launch, which removes the CPU's kernel-launch
gaps between small kernels, where the GPU sits idle. Each bucket of a model gets its
graph, captured on the bucket's fixed input buffers (``static_inputs``, in the device memory
pool) and ending with a copy of the outputs into the bucket's fixed output buffers
(``static_outputs``, in the pool too), so nothing a replay leaves behind lives in the graph pool.

Each model has its own graph pool (``ModelMemory.graph_pool_id``, ``batcher/gpu.py``), its own
capture stream and its own replay stream. Its buckets share the pool, which is safe because they
replay on that one stream, in order; largest bucket first, so smaller graphs reuse its memory.
Nothing is shared with another model: one model's capture never touches the streams (and so the
cuBLAS workspaces, which are kept per handle and stream) another model replays on, and graph
models on one GPU run concurrently.

Capture calls ``CUDAGraph.capture_begin``/``capture_end`` on the model's capture stream rather
than ``torch.cuda.graph``, which synchronizes the whole device and empties the caching
allocator's device and pinned-host caches: loading one graph model would stall every model
serving on the device. Only the capture stream is synchronized. ``capture_error_mode=
"thread_local"``: other models keep serving from other threads while one captures. Autocast runs
with its cast cache off inside a capture (cached casts would be freed while the graph still reads
them).

CUDA only. ``unavailable_reason`` says why a model runs eager instead ("no CUDA device", an
output with variable dims); a failed capture is reported by the caller, which then runs eager.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from batchgate.batcher.spec import ModelSpec

# Eager runs on the capture stream before capturing: lazy initialisation (cuBLAS handles and
# workspaces, cuDNN plans, a traced module's profiling runs) must not happen inside a capture.
WARMUP_RUNS = 3


def unavailable_reason(spec: ModelSpec) -> str | None:
    """Why ``spec`` cannot have CUDA graphs, or None when it can."""
    if not spec.device.startswith("cuda"):
        return "no CUDA device: the model runs on the CPU"
    if not spec.buckets:
        return "no batch buckets: a graph has one fixed batch size (set buckets)"
    for tensor in (*spec.inputs, *spec.outputs):
        if not tensor.fixed() or tensor.datatype == "BYTES":
            return f"tensor {tensor.name!r} has variable dims or is BYTES"
    return None


Forward = Callable[[Sequence[torch.Tensor], bool], Sequence[torch.Tensor]]


class BucketGraphs:
    """One captured graph per bucket, with its fixed input and output buffers."""

    def __init__(self, device: torch.device, forward: Forward,
                 static_inputs: dict[int, tuple[torch.Tensor, ...]],
                 static_outputs: dict[int, tuple[torch.Tensor, ...]], *,
                 pool: Any = None, use_pool: Callable[[], Any] | None = None) -> None:
        """``forward(inputs, capturing)`` runs the model (precision applied) and returns its
        outputs, batch dimension first. ``pool``: the graph pool handle (default: a new private
        one); ``use_pool()``: the context the eager runs before capture allocate under."""
        self._device = device
        self._forward = forward
        self._inputs = static_inputs
        self._outputs = static_outputs
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        with torch.cuda.device(device):
            self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
            self.capture_stream = torch.cuda.Stream(device)
            self.replay_stream = torch.cuda.Stream(device)
        self._use_pool = use_pool if use_pool is not None else contextlib.nullcontext

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def capture(self) -> None:
        """Capture every bucket's graph, largest first. Raises what the capture raised."""
        for bucket in sorted(self._inputs, reverse=True):
            self._graphs[bucket] = self._capture_one(bucket)

    def _capture_one(self, bucket: int) -> torch.cuda.CUDAGraph:
        stream = self.capture_stream
        inputs, outputs = self._inputs[bucket], self._outputs[bucket]
        for tensor in inputs:
            tensor.zero_()
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with self._use_pool(), torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                self._forward(inputs, False)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            graph.capture_begin(self.pool, capture_error_mode="thread_local")
            try:
                for static, produced in zip(outputs, self._forward(inputs, True)):
                    static.copy_(produced)
            finally:
                graph.capture_end()
        stream.synchronize()
        return graph

    def replay(self, bucket: int, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Copy ``inputs`` (``bucket`` rows each, on the device) into the graph's buffers and
        replay it on the current stream, which must be ``replay_stream``. Returns the fixed
        output buffers: read them (enqueue the copies) before the next replay."""
        for static, given in zip(self._inputs[bucket], inputs):
            static.copy_(given, non_blocking=True)
        self._graphs[bucket].replay()
        return self._outputs[bucket]
