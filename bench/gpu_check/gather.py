"""(d) the gather as the executor does it, against a ResNet-50 forward, and the shared arena
pinned as the executor process pins it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from batchgate.bench.gpu_check.machine import torchvision_problem
from batchgate.bench.gpu_check.report import FAIL, INFO, SKIP, Budget, Report

GATHER_REQUESTS = 64  # single-sample requests per batch, as the executor gathers them
GATHER_INPUT = (3, 224, 224)  # ResNet-sized
GATHER_BATCHES = 12
ARENA_PIN_BYTES = 512 << 20


def section_gather(report: Report, budget: Budget) -> None:
    """The gather as the executor does it: GATHER_REQUESTS single-sample requests of a
    ResNet-sized input assembled into a batch (``Executor._assemble``), from the request's own
    pageable bytes (one-process mode) and after staging while queued; the assembly's time on
    the critical path against a ResNet-50-sized forward. Then the shared arena pinned, as the
    executor process pins it (multi-process mode), and what pinning costs."""
    import torch

    from batchgate.batcher.arena import SharedArena
    from batchgate.batcher.metrics import BatcherMetrics
    from batchgate.batcher.model import ServedModel
    from batchgate.batcher.request import InferenceRequest
    from batchgate.batcher.spec import BatchingConfig, ModelSpec, TensorSpec
    from prometheus_client import CollectorRegistry

    device = "cuda:0"
    if torchvision_problem():
        module: Any = torch.nn.Sequential(
            torch.nn.Conv2d(3, 64, 7, stride=2), torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(), torch.nn.Linear(64, 1000))
        forward = "conv stem (torchvision absent)"
    else:
        import torchvision

        module = torchvision.models.resnet50(weights=None)
        forward = "ResNet-50"
    module = module.eval().to(device)
    rng = np.random.default_rng()
    for staging in ("batch", "queue"):
        check = f"gather {GATHER_REQUESTS} x 1 sample {'x'.join(map(str, GATHER_INPUT))}, " \
                f"staged at {staging}"
        if budget.over():
            report.add("d", check, "not run: over the section's budget", SKIP)
            continue
        spec = ModelSpec(name="gather", version="1", platform="test", device=device,
                         inputs=(TensorSpec("x", "FP32", GATHER_INPUT),),
                         outputs=(TensorSpec("y", "FP32", (1000,)),),
                         batching=BatchingConfig(max_batch_size=GATHER_REQUESTS,
                                                 max_queue_delay_us=200_000),
                         buckets=(GATHER_REQUESTS,), input_staging=staging,
                         precision="amp-fp16")
        served = ServedModel(spec, module, metrics=BatcherMetrics(CollectorRegistry()))
        served.start()
        try:
            async def batches() -> None:
                for _ in range(GATHER_BATCHES):
                    await asyncio.gather(*(
                        served.infer(InferenceRequest(
                            [rng.standard_normal((1, *GATHER_INPUT), dtype=np.float32)]))
                        for _ in range(GATHER_REQUESTS)))

            before = served.stats.snapshot()
            asyncio.run(batches())
            after = served.stats.snapshot()
        finally:
            served.stop(5.0)
        runs = after.execution_count - before.execution_count
        # Triton's statistics add a batch's durations once per request in it.
        counted = max(after.compute_input.count - before.compute_input.count, 1)
        input_ms = (after.compute_input.ns - before.compute_input.ns) / 1e6 / counted
        infer_ms = (after.compute_infer.ns - before.compute_infer.ns) / 1e6 / counted
        share = input_ms / (input_ms + infer_ms) if input_ms + infer_ms else 0.0
        report.add("d", check,
                   f"assembly {input_ms:.2f} ms vs {forward} amp-fp16 {infer_ms:.2f} ms a "
                   f"batch over {runs} batches: {share:.1%} on the critical path (target "
                   "<= 5 %)", INFO, input_ms=input_ms, infer_ms=infer_ms, share=share,
                   batches=runs, staging=staging)
    arena = SharedArena.create(ARENA_PIN_BYTES)
    try:
        from batchgate.server.executor_process import pin_arena

        started = time.perf_counter()
        pinned = pin_arena(arena, BatcherMetrics(CollectorRegistry()))
        seconds = time.perf_counter() - started
        report.add("d", f"arena pinned ({ARENA_PIN_BYTES >> 20} MiB)",
                   (f"pinned in {seconds * 1e3:.0f} ms (the whole arena is locked in RAM)"
                    if pinned else "pinning failed: the server falls back to unpinned"),
                   INFO if pinned else FAIL, pinned=pinned, seconds=seconds)
    finally:
        arena.close()


