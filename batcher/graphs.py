"""CUDA graphs per batch bucket, captured at load into one graph memory pool per device.

A captured graph replays a whole forward with one launch, which removes the CPU's kernel-launch
gaps between small kernels, where the GPU sits idle. Each bucket of a model gets its
graph, captured on the bucket's fixed input buffers (``static_inputs``, in the device memory
pool) and ending with a copy of the outputs into the bucket's fixed output buffers
(``static_outputs``, in the pool too), so nothing a replay leaves behind lives in the graph pool.

One graph pool per device (``torch.cuda.graph_pool_handle``) holds every graph's activations,
so models share that memory instead of each keeping its own. Sharing is only safe while no two
graphs of the pool run at once: every replay therefore runs on the device's one *replay stream*
(``DeviceGraphs.replay_stream``), which orders them on the GPU, and captures take turns
(``DeviceGraphs.lock``) on the device's one capture stream, as torch advises for a shared pool.
Largest bucket first, so smaller graphs reuse its memory.

Capture uses ``capture_error_mode="thread_local"``: other models keep serving from other threads
while one captures. Autocast runs with its cast cache off inside a capture (cached casts would be
freed while the graph still reads them).

CUDA only. ``unavailable_reason`` says why a model runs eager instead ("no CUDA device", an
output with variable dims); a failed capture is reported by the caller, which then runs eager.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence

import torch

from batcher.spec import ModelSpec

# Eager runs on the capture stream before capturing: lazy initialisation (cuBLAS handles and
# workspaces, cuDNN plans, a traced module's profiling runs) must not happen inside a capture.
WARMUP_RUNS = 3


@dataclasses.dataclass
class DeviceGraphs:
    """What the graphs of one device share."""

    pool: tuple
    capture_stream: torch.cuda.Stream
    replay_stream: torch.cuda.Stream
    lock: threading.Lock


_devices: dict[int, DeviceGraphs] = {}
_devices_lock = threading.Lock()


def device_graphs(device: torch.device) -> DeviceGraphs:
    """The shared graph pool and streams of ``device`` (created on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _devices_lock:
        shared = _devices.get(index)
        if shared is None:
            with torch.cuda.device(index):
                shared = DeviceGraphs(torch.cuda.graph_pool_handle(), torch.cuda.Stream(),
                                      torch.cuda.Stream(), threading.Lock())
            _devices[index] = shared
        return shared


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
                 static_outputs: dict[int, tuple[torch.Tensor, ...]]) -> None:
        """``forward(inputs, capturing)`` runs the model (precision applied) and returns its
        outputs, batch dimension first."""
        self._device = device
        self._forward = forward
        self._inputs = static_inputs
        self._outputs = static_outputs
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.shared = device_graphs(device)

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def capture(self) -> None:
        """Capture every bucket's graph, largest first. Raises what the capture raised."""
        shared = self.shared
        with shared.lock:
            for bucket in sorted(self._inputs, reverse=True):
                self._graphs[bucket] = self._capture_one(bucket)

    def _capture_one(self, bucket: int) -> torch.cuda.CUDAGraph:
        shared = self.shared
        inputs, outputs = self._inputs[bucket], self._outputs[bucket]
        for tensor in inputs:
            tensor.zero_()
        shared.capture_stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(shared.capture_stream):
            for _ in range(WARMUP_RUNS):
                self._forward(inputs, False)
        torch.cuda.current_stream(self._device).wait_stream(shared.capture_stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=shared.pool, stream=shared.capture_stream,
                              capture_error_mode="thread_local"):
            for static, produced in zip(outputs, self._forward(inputs, True)):
                static.copy_(produced)
        torch.cuda.synchronize(self._device)
        return graph

    def replay(self, bucket: int, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Copy ``inputs`` (``bucket`` rows each, on the device) into the graph's buffers and
        replay it on the current stream, which must be ``shared.replay_stream``. Returns the
        fixed output buffers: read them (enqueue the copies) before the next replay."""
        for static, given in zip(self._inputs[bucket], inputs):
            static.copy_(given, non_blocking=True)
        self._graphs[bucket].replay()
        return self._outputs[bucket]
