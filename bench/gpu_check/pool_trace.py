"""(b) the synthetic allocation trace: ``batchgate.batcher.allocation_trace.mixed_trace`` through arenas
sized as the server sizes them, and (in a child process per allocator setting) through
PyTorch's caching allocator.

The server reserves each model's arena when it loads, at the size of its plan: the most that
model may hold at once, from its config's limits (``batcher/memory.py``). So does this replay:
it cannot be sized from the trace's own peak, which only a replay finds out (and which the
replay then meets by construction). For ``mixed_trace`` those limits are each model's largest
input and output (its max batch times its per-sample bytes) and the most of each one model
holds at once (``LIVE_INPUTS``, ``LIVE_OUTPUTS``: the trace's lifetimes, one batch a step).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

POOL_TRACE_SEEDS = tuple(range(8))  # mixed_trace seeds replayed through both allocators
POOL_TRACE_STEPS = 2000
# mixed_trace frees an input 1-2 steps after its batch and an output 1-6 steps after, one
# batch a step: one model holds at most 2 inputs and 6 outputs at once.
LIVE_INPUTS, LIVE_OUTPUTS = 2, 6


def model_limits(trace: Sequence[tuple]) -> dict[str, dict[str, int]]:
    """Per model of the trace, its largest input and output in bytes. ``mixed_trace`` draws
    each batch up to the model's max batch, so over its steps these are max batch x per-sample
    bytes: what the model's config says before any request arrives."""
    limits: dict[str, dict[str, int]] = {}
    for event in trace:
        if event[0] == "alloc":
            model, _step, kind = event[1].split(".")
            sizes = limits.setdefault(model, {"in": 0, "out": 0})
            sizes[kind] = max(sizes[kind], event[2])
    return limits


def plan_bytes(limits: dict[str, int]) -> int:
    """One model's arena: its most live inputs and outputs, each at its largest, aligned."""
    from batchgate.batcher.memory import arena_bytes

    return arena_bytes([limits["in"]] * LIVE_INPUTS + [limits["out"]] * LIVE_OUTPUTS)


def pool_trace_figure(device: str, seed: int) -> dict[str, Any]:
    """``mixed_trace(seed)`` with each model's allocations in its own arena, every arena
    reserved up front at its plan (``plan_bytes``): the peak of bytes in use (aligned, all
    arenas) and of live bytes, against the bytes reserved; allocations refused (an arena that
    fragments refuses what its plan says fits)."""
    import torch

    from batchgate.batcher.allocation_trace import mixed_trace
    from batchgate.batcher.pool import DevicePool

    trace = mixed_trace(seed, steps=POOL_TRACE_STEPS)
    limits = model_limits(trace)
    arenas = {model: DevicePool(device, plan_bytes(sizes)) for model, sizes in limits.items()}
    reserved = sum(a.bytes_reserved for a in arenas.values())
    live: dict[str, Any] = {}
    live_bytes = peak_live = peak_in_use = refused = allocations = 0
    for event in trace:
        if event[0] == "alloc":
            _, ident, nbytes, lifetime = event
            allocations += 1
            handle = arenas[ident.split(".")[0]].allocate((nbytes,), torch.uint8,
                                                          lifetime=lifetime)
            if handle is None:
                refused += 1
                continue
            live[ident] = handle
            live_bytes += nbytes
            peak_live = max(peak_live, live_bytes)
            peak_in_use = max(peak_in_use, sum(a.bytes_in_use for a in arenas.values()))
        else:
            handle = live.pop(event[1], None)
            if handle is not None:
                live_bytes -= handle.nbytes
                handle.release()
    for handle in live.values():
        handle.release()
    return {"seed": seed, "steps": POOL_TRACE_STEPS, "models": len(arenas),
            "bytes_reserved": reserved, "peak_bytes_in_use": peak_in_use,
            "peak_live_bytes": peak_live, "peak_in_use_fraction": peak_in_use / reserved,
            "peak_live_fraction": peak_live / reserved, "allocations": allocations,
            "refused": refused, "sizing": "per-model plan, reserved up front"}


def alloc_replay_main(allocator: dict[str, Any]) -> int:
    """Child of (b): the ``mixed_trace`` seeds replayed through the caching allocator
    (``torch.empty`` and drop), each from an empty cache, under whatever allocator settings
    the process was started with (``allocator``: them, as in force)."""
    import torch

    from batchgate.batcher.allocation_trace import mixed_trace, peak_live_bytes

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
        "allocator": allocator,
        "ratio": sum(s["ratio"] for s in seeds) / len(seeds),
        "min_ratio": min(s["ratio"] for s in seeds),
        "seeds": seeds,
    }), flush=True)
    return 0
