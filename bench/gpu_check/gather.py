"""(d) the gather as the executor does it, against a ResNet-50 forward, and the shared arena
pinned as the executor process pins it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from batchgate.bench.gpu_check.copy_events import CopyStreamProbe, ProbeUnavailable
from batchgate.bench.gpu_check.machine import torchvision_problem
from batchgate.bench.gpu_check.report import FAIL, INFO, SKIP, UNMEASURED, Budget, Report

GATHER_REQUESTS = 64  # single-sample requests per batch, as the executor gathers them
GATHER_INPUT = (3, 224, 224)  # ResNet-sized
GATHER_BATCHES = 12
ARENA_PIN_BYTES = 512 << 20


def section_gather(report: Report, budget: Budget) -> None:
    """The gather as the executor does it: GATHER_REQUESTS single-sample requests of a
    ResNet-sized input assembled into a batch (``Executor._assemble``), from the request's own
    pageable bytes (one-process mode) and after staging while queued; the inputs' time on the
    copy stream against the forward's on its stream, both from CUDA events
    (``CopyStreamProbe``), beside the host's time around the assembly (the executor's
    ``compute_input``, which does not include the copy stream's work). Then the shared arena
    pinned, as the executor process pins it (multi-process mode), and what pinning costs."""
    import torch

    from batchgate.server.ipc.arena import SharedArena
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
            if staging == "queue":
                report.unmeasured("h2d", "the gather staged at queue did not run: over (d)'s "
                                  "budget")
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
            try:
                probe: CopyStreamProbe | None = CopyStreamProbe(
                    list(getattr(served, "_executors", [])))
            except ProbeUnavailable as exc:
                probe = None
                report.unmeasured("h2d", str(exc))

            async def batches() -> None:
                for _ in range(GATHER_BATCHES):
                    await asyncio.gather(*(
                        served.infer(InferenceRequest(
                            [rng.standard_normal((1, *GATHER_INPUT), dtype=np.float32)]))
                        for _ in range(GATHER_REQUESTS)))

            before = served.stats.snapshot()
            asyncio.run(batches())
            after = served.stats.snapshot()
            torch.cuda.synchronize()  # every event has completed: their times can be read
        finally:
            served.stop(5.0)
        runs = after.execution_count - before.execution_count
        # Triton's statistics add a batch's durations once per request in it.
        counted = max(after.compute_input.count - before.compute_input.count, 1)
        host_ms = (after.compute_input.ns - before.compute_input.ns) / 1e6 / counted
        events = probe.figures() if probe is not None else {"batches": 0}
        if not events["batches"]:
            report.add("d", check, f"host time around the assembly {host_ms:.2f} ms a batch "
                       f"over {runs} batches; the copy stream's time unmeasured (no events)",
                       UNMEASURED, host_ms=host_ms, batches=runs, staging=staging)
            if staging == "queue" and probe is not None:
                report.unmeasured("h2d", "no batch's copy-stream events were recorded")
            continue
        report.add("d", check,
                   f"inputs ready on the copy stream {events['copy_ms']:.3f} ms vs {forward} "
                   f"amp-fp16 {events['forward_ms']:.2f} ms a batch (CUDA events, medians over "
                   f"{events['batches']} batches): {events['share']:.1%} of the two, "
                   f"{events['exposed_share']:.1%} with the compute stream idle; host time "
                   f"around the assembly {host_ms:.2f} ms", INFO,
                   target="h2d" if staging == "queue" else None, host_ms=host_ms,
                   batches=runs, staging=staging, **events)
    arena = SharedArena.create(ARENA_PIN_BYTES)
    try:
        from batchgate.server.executor.process import pin_arena

        started = time.perf_counter()
        pinned = pin_arena(arena, BatcherMetrics(CollectorRegistry()))
        seconds = time.perf_counter() - started
        report.add("d", f"arena pinned ({ARENA_PIN_BYTES >> 20} MiB)",
                   (f"pinned in {seconds * 1e3:.0f} ms (the whole arena is locked in RAM)"
                    if pinned else "pinning failed: the server falls back to unpinned"),
                   INFO if pinned else FAIL, pinned=pinned, seconds=seconds)
    finally:
        arena.close()


