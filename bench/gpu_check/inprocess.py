"""Section (c)'s ceiling: a model called back to back in this process on one batch already on
the device, eager or replayed as one CUDA graph."""

from __future__ import annotations

import time
from typing import Any

from batchgate.bench.gpu_check.samples import autocast_for, random_tensor, synchronize
from batchgate.bench.gpu_check.workloads import ThroughputModel, ThroughputSettings

# A traced module's profiling executor runs its first calls (about a dozen) far slower.
INPROCESS_WARMUP_CALLS = 20


def inprocess_rate(module: Any, model: ThroughputModel, settings: ThroughputSettings,
                   precision: str) -> dict[str, Any]:
    """Samples/s of ``module`` called back to back on one fixed batch already on the device."""
    import torch

    x = random_tensor((settings.batch, *model.input_dims), model.input_dtype, settings.device)
    with torch.inference_mode(), autocast_for(precision, settings.device):
        for _ in range(INPROCESS_WARMUP_CALLS):
            module(x)
        synchronize(settings.device)
        started = time.monotonic()  # the NVML samples' clock
        calls = 0
        while True:
            module(x)
            calls += 1
            # The host runs ahead of the device; the synchronize below settles the account.
            if calls % 4 == 0 and time.monotonic() - started >= settings.inprocess_s:
                break
        synchronize(settings.device)
        wall = time.monotonic() - started
    return {"samples_per_s": calls * settings.batch / wall, "calls": calls, "seconds": wall,
            "window": (started, started + wall)}


def inprocess_graph_rate(module: Any, model: ThroughputModel, settings: ThroughputSettings,
                         precision: str) -> dict[str, Any]:
    """Samples/s of one CUDA graph of ``module`` at the batch, replayed back to back."""
    import torch

    from batchgate.batcher import precision as precisions

    amp = f"amp-{precision}"
    x = random_tensor((settings.batch, *model.input_dims), model.input_dtype, settings.device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode(), autocast_for(precision, settings.device):
        for _ in range(INPROCESS_WARMUP_CALLS):
            module(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph), \
            precisions.autocast(amp, "cuda", capturing=True):
        module(x)
    synchronize(settings.device)
    started = time.monotonic()
    calls = 0
    while True:
        graph.replay()
        calls += 1
        if calls % 4 == 0 and time.monotonic() - started >= settings.inprocess_s:
            break
    synchronize(settings.device)
    wall = time.monotonic() - started
    return {"samples_per_s": calls * settings.batch / wall, "calls": calls, "seconds": wall}
