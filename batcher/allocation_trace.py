"""Synthetic allocation traces, replayed through a ``DevicePool``: how the tests and the GPU check
(section b) hold the arena allocator to mixed sizes and interleaved lifetimes.

``mixed_trace`` is several models whose per-sample sizes differ by orders of magnitude, random
batch sizes, inputs freed 1-2 steps later and outputs 1-6, so lifetimes interleave;
``replay_trace`` runs one through a fresh pool and reports the peak bytes held against the
bytes reserved and the allocations refused.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from batchgate.batcher.pool import DevicePool, PoolTensor

Event = tuple  # ("alloc", id, nbytes, lifetime) or ("free", id)


def mixed_trace(seed: int, models: int = 4, steps: int = 2000) -> list[Event]:
    """A multi-model allocation trace: each step one model's batch allocates its input and
    output buffers (per-sample sizes differ by model, batch sizes are random); the input is
    freed 1-2 steps later (compute done), the output 1-6 steps later (response sent), so inputs
    are allocated ``"short"``-lived and outputs ``"long"``-lived. Every allocation is freed by
    the end."""
    if models < 1 or steps < 0:
        raise ValueError(f"need models >= 1 and steps >= 0, got {models}, {steps}")
    rng = random.Random(seed)
    profiles = []
    for _ in range(models):
        scale = rng.choice([1, 4, 16, 64])  # models differ by orders of magnitude
        profiles.append((
            rng.randint(256, 4096) * scale,  # input bytes per sample
            rng.randint(16, 1024) * scale,  # output bytes per sample
            rng.choice([4, 8, 16, 32]),  # max batch
        ))
    trace: list[Event] = []
    due: dict[int, list[str]] = {}
    for step in range(steps):
        for ident in due.pop(step, []):
            trace.append(("free", ident))
        model = rng.randrange(models)
        in_per_sample, out_per_sample, max_batch = profiles[model]
        batch = rng.randint(1, max_batch)
        for kind, per_sample, steps_held, lifetime in (
                ("in", in_per_sample, rng.randint(1, 2), "short"),
                ("out", out_per_sample, rng.randint(1, 6), "long")):
            ident = f"m{model}.s{step}.{kind}"
            trace.append(("alloc", ident, batch * per_sample, lifetime))
            due.setdefault(step + steps_held, []).append(ident)
    for step in sorted(due):
        trace.extend(("free", ident) for ident in due[step])
    return trace


def peak_live_bytes(trace: Sequence[Event]) -> int:
    """The most bytes the trace holds live at once (what a perfect allocator would need)."""
    live: dict[str, int] = {}
    current = peak = 0
    for event in trace:
        if event[0] == "alloc":
            live[event[1]] = event[2]
            current += event[2]
            peak = max(peak, current)
        else:
            current -= live.pop(event[1], 0)
    return peak


def replay_trace(pool_factory: Callable[[], DevicePool], trace: Sequence[Event]) -> dict:
    """Replay ``trace`` through a fresh pool; frees of refused allocations are skipped.

    Returns ``peak_bytes_in_use`` (aligned bytes the allocator held), ``peak_live_bytes``
    (bytes the trace asked for), ``bytes_reserved``, ``peak_in_use_fraction`` (peak in use /
    reserved), ``allocations``, ``refused`` and ``fallbacks``. What the trace leaves live is
    freed at the end, and ``bytes_in_use_after`` says what the pool then holds (0).
    """
    pool = pool_factory()
    live: dict[str, PoolTensor] = {}
    live_bytes = peak_live = peak_in_use = allocations = refused = 0
    for event in trace:
        if event[0] == "alloc":
            _, ident, nbytes, lifetime = event
            allocations += 1
            handle = pool.allocate((nbytes,), torch.uint8, lifetime=lifetime)
            if handle is None:
                refused += 1
                continue
            live[ident] = handle
            live_bytes += nbytes
            peak_live = max(peak_live, live_bytes)
            peak_in_use = max(peak_in_use, pool.bytes_in_use)
        elif event[0] == "free":
            handle = live.pop(event[1], None)
            if handle is not None:
                live_bytes -= handle.nbytes
                handle.release()
        else:
            raise ValueError(f"unknown trace event {event!r}")
    for handle in live.values():
        handle.release()
    return {
        "device": str(pool.device),
        "bytes_reserved": pool.bytes_reserved,
        "peak_bytes_in_use": peak_in_use,
        "peak_live_bytes": peak_live,
        "peak_in_use_fraction": peak_in_use / pool.bytes_reserved,
        "allocations": allocations,
        "refused": refused,
        "fallbacks": pool.fallbacks,
        "bytes_in_use_after": pool.bytes_in_use,
    }
