"""(b) the allocation trace: ``batchgate.batcher.pool.mixed_trace`` through our device pool, and (in a
child process per allocator setting) through PyTorch's caching allocator."""

from __future__ import annotations

import json
import os
from typing import Any

POOL_TRACE_SEEDS = tuple(range(8))  # mixed_trace seeds replayed through both allocators
POOL_TRACE_STEPS = 2000
POOL_SEARCH_PRECISION = 0.005


def pool_trace_figure(device: str, seed: int) -> dict[str, Any]:
    """``mixed_trace(seed)`` through our pool: the smallest arena that serves it with no refusal
    (bisection to POOL_SEARCH_PRECISION of the trace's peak live bytes), then the replay's
    figures in that arena. An operator sizes the pool once; this is the best that sizing does."""
    from batchgate.batcher.pool import DevicePool, mixed_trace, peak_live_bytes, replay_trace

    trace = mixed_trace(seed, steps=POOL_TRACE_STEPS)
    live = peak_live_bytes(trace)

    def refused(size: int) -> bool:
        return replay_trace(lambda: DevicePool(device, size), trace)["refused"] > 0

    low, high = live - 1, live
    while refused(high):
        low, high = high, high * 2
    while high - low > live * POOL_SEARCH_PRECISION:
        middle = (low + high) // 2
        if refused(middle):
            low = middle
        else:
            high = middle
    result = replay_trace(lambda: DevicePool(device, high), trace)
    result.update(seed=seed, steps=POOL_TRACE_STEPS)
    return result


def alloc_replay_main() -> int:
    """Child of (b): the ``mixed_trace`` seeds replayed through the caching allocator
    (``torch.empty`` and drop), each from an empty cache, under whatever
    PYTORCH_CUDA_ALLOC_CONF it was started with."""
    import torch

    from batchgate.batcher.pool import mixed_trace, peak_live_bytes

    torch.cuda.init()
    seeds = []
    for seed in POOL_TRACE_SEEDS:
        trace = mixed_trace(seed, steps=POOL_TRACE_STEPS)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        live: dict[str, Any] = {}
        for event in trace:
            if event[0] == "alloc":
                live[event[1]] = torch.empty(event[2], dtype=torch.uint8, device="cuda")
            else:
                live.pop(event[1], None)
        live.clear()
        torch.cuda.synchronize()
        allocated = torch.cuda.max_memory_allocated()
        reserved = torch.cuda.max_memory_reserved()
        seeds.append({"seed": seed, "peak_live_bytes": peak_live_bytes(trace),
                      "peak_allocated": allocated, "peak_reserved": reserved,
                      "ratio": allocated / reserved if reserved else 0.0,
                      "segments_peak": torch.cuda.memory_stats().get("segment.all.peak", 0)})
    print("ALLOC_REPLAY " + json.dumps({
        "alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF", ""),
        "ratio": sum(s["ratio"] for s in seeds) / len(seeds),
        "min_ratio": min(s["ratio"] for s in seeds),
        "seeds": seeds,
    }), flush=True)
    return 0


