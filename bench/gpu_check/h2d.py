"""(d) host-to-device time on the critical path: a batch's copy after it closes (pageable and
pinned) and what staging leaves there, timed with CUDA events against the forward."""

from __future__ import annotations

import numpy as np

from batchgate.bench.gpu_check.report import INFO, SKIP, Budget, Report
from batchgate.bench.gpu_check.samples import (EXAMPLE_INPUTS, ROOT, autocast_for,
                                               build_from_source, random_array)

H2D_CASES = (("mlp", 64), ("cnn", 32))
H2D_WARMUP = 5
H2D_REPEATS = 30


def section_h2d(report: Report, budget: Budget) -> None:
    """Per case, copies timed with CUDA events against the forward: what lands on the critical
    path when the batch's inputs cross PCIe after it closes (from pageable memory, as a
    one-process server's request bytes; from pinned memory, as the shared arena), and what
    staging leaves there: the device-to-device gather of rows already on the GPU."""
    import statistics

    import torch

    device = "cuda:0"
    copy_stream = torch.cuda.Stream(device)
    compute_stream = torch.cuda.Stream(device)
    rng = np.random.default_rng()
    for name, batch in H2D_CASES:
        shape, dtype = EXAMPLE_INPUTS[name]
        module = build_from_source(ROOT / "models" / name / "1" / "model.py", device)
        # As the assembler makes it: a tensor over a freshly concatenated (pageable) array.
        pageable = torch.from_numpy(random_array(rng, (batch, *shape), dtype))
        sources = {"pageable": pageable, "pinned": pageable.pin_memory(),
                   "staged": pageable.to(device)}
        slot = torch.empty_like(sources["staged"])  # the batch's buffer in the pool
        for precision in ("fp32", "fp16"):
            check = f"{name} b{batch} {precision}"
            if budget.over():
                report.add("d", check, "not run: over the section's budget", SKIP)
                continue
            timings: dict[str, list[tuple[float, float]]] = {k: [] for k in sources}
            for source_name, source in sources.items():
                for repeat in range(H2D_WARMUP + H2D_REPEATS):
                    events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
                    with torch.cuda.stream(copy_stream):
                        events[0].record()
                        slot.copy_(source, non_blocking=True)
                        events[1].record()
                    compute_stream.wait_event(events[1])
                    with torch.cuda.stream(compute_stream), torch.inference_mode(), \
                            autocast_for(precision, device):
                        events[2].record()
                        module(slot)
                        events[3].record()
                    torch.cuda.synchronize()
                    if repeat >= H2D_WARMUP:
                        timings[source_name].append((events[0].elapsed_time(events[1]),
                                                     events[2].elapsed_time(events[3])))
            forward_ms = statistics.median(f for runs in timings.values() for _, f in runs)
            copy = {k: statistics.median(c for c, _ in runs) for k, runs in timings.items()}
            share = {k: ms / (ms + forward_ms) for k, ms in copy.items()}
            report.add(
                "d", check,
                f"forward {forward_ms * 1e3:.0f} us; on the critical path: pageable copy "
                f"{copy['pageable'] * 1e3:.0f} us ({share['pageable']:.0%}), pinned "
                f"{copy['pinned'] * 1e3:.0f} us ({share['pinned']:.0%}), with staging only the "
                f"gather {copy['staged'] * 1e3:.0f} us ({share['staged']:.1%}; target <= 5 %)",
                INFO, bytes=int(pageable.numel() * pageable.element_size()),
                copy_ms=copy["pageable"], pinned_copy_ms=copy["pinned"],
                staged_gather_ms=copy["staged"], forward_ms=forward_ms,
                copy_share=share["pageable"], pinned_copy_share=share["pinned"],
                staged_share=share["staged"])


