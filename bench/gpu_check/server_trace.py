"""(b) what the server itself allocates, sampled while it serves: a child process per allocator
setting (the allocator reads its settings once, when CUDA starts in the process)."""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import time
from typing import Any

import numpy as np

TRACE_SEED = 4
# The allocator settings compared, as (label, PYTORCH_ALLOC_CONF, per-model pools).
SERVER_TRACE_MODES = (
    ("per-model pools", "expandable_segments:True", True),
    ("PyTorch default", "expandable_segments:False", False),
    ("expandable_segments alone", "expandable_segments:True", False),
)
# Every model runs as the GPU serves by default and beyond: two instances, each with two batches
# in flight (one assembling while one computes), so the pools see every thread that enters them.
TRACE_INSTANCES = 2
TRACE_INFLIGHT = 2
TRACE_CLIENTS = 24  # requests in flight at once over all models, each client a closed loop
TRACE_SECONDS = {"cuda": 12.0, "cpu": 3.0}
SAMPLE_INTERVAL_S = 0.005
SERVER_TRACE_POOL_BYTES = 256 << 20  # the cap of the device pool the plans are admitted into
# (width, layers), max batch: three serve from the start, the fourth is loaded mid-trace.
GPU_STACKS = (((256, 4), 64), ((1024, 4), 128), ((4096, 3), 64), ((2048, 3), 128))
CPU_STACKS = (((64, 2), 16), ((128, 2), 16), ((256, 2), 8), ((96, 2), 16))
ANSWER_TOLERANCE = 1e-3  # of max |reference|: fp32 on both sides


class DeviceSampler:
    """The device's bytes in use and reserved every SAMPLE_INTERVAL_S on a thread, while the
    trace is being served: no synchronize, so these are the allocator's figures as the streams
    run. In use is what torch has handed out less the device pool's arenas' free room (an
    arena is one allocation to torch, whatever of it the plans and staged inputs use)."""

    def __init__(self, device: str, pools: Any) -> None:
        self.device = device
        self.pools = pools
        self.samples: list[tuple[int, int]] = []  # (in use, reserved)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def __enter__(self) -> DeviceSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        import torch

        while not self._stop.wait(SAMPLE_INTERVAL_S):
            reserved = torch.cuda.memory_reserved(self.device)
            allocated = torch.cuda.memory_allocated(self.device)
            arena_free = sum(p.bytes_reserved - p.bytes_in_use for p in self.pools.pools())
            if reserved:
                self.samples.append((allocated - arena_free, reserved))

    def figures(self) -> dict[str, Any]:
        if not self.samples:
            return {"samples": 0}
        ratios = sorted(used / reserved for used, reserved in self.samples)
        peak_used, peak_reserved = max(self.samples, key=lambda s: s[1])
        return {"samples": len(ratios), "ratio_mean": sum(ratios) / len(ratios),
                "ratio_min": ratios[0], "ratio_p10": ratios[len(ratios) // 10],
                "ratio_at_peak_reserved": peak_used / peak_reserved,
                "peak_reserved_sampled": peak_reserved,
                "peak_in_use_sampled": max(used for used, _ in self.samples)}


def server_trace_main(argument: str, allocator: dict[str, Any]) -> int:
    """Child of (b): ServedModels of several sizes (linear stacks; each with pools of its own or
    not: the mode), TRACE_INSTANCES instances of TRACE_INFLIGHT batches in flight, serve
    TRACE_CLIENTS closed-loop clients sending random batch sizes; a third of the way in one
    model is unloaded and another loaded while the rest serve, half way (with pools) a
    CUDA-graph model is loaded and its answers checked. Every answer is checked against the
    module on the CPU; every failed request is counted with its error. The device's bytes in use
    and reserved are sampled on a thread throughout (``DeviceSampler``). ``allocator``: the
    settings this process runs with. Prints one SERVER_TRACE JSON line."""
    import torch

    from batchgate.batcher.gpu import ModelMemory
    from batchgate.batcher.memory import DevicePools, PoolSettings
    from batchgate.batcher.model import ServedModel
    from batchgate.batcher.request import InferenceRequest
    from batchgate.batcher.spec import BatchingConfig, ModelSpec, TensorSpec

    device, index = argument.split(",")
    label, _conf, pooled = SERVER_TRACE_MODES[int(index)]
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.init()
    pools = DevicePools(PoolSettings(SERVER_TRACE_POOL_BYTES))
    stacks = GPU_STACKS if cuda else CPU_STACKS
    seconds = TRACE_SECONDS["cuda" if cuda else "cpu"]

    def linear(width: int, layers: int, seed: int) -> Any:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return torch.nn.Sequential(*[torch.nn.Linear(width, width)
                                         for _ in range(layers)]).eval()

    def served(name: str, width: int, layers: int, max_batch: int, seed: int,
               **fields: Any) -> tuple[Any, Any]:
        memory = ModelMemory(device, name, pooled=pooled)
        cpu_module = linear(width, layers, seed)
        with memory.use():
            module = linear(width, layers, seed).to(device)
        spec = ModelSpec(name=name, version="1", platform="test", device=device,
                         inputs=(TensorSpec("x", "FP32", (width,)),),
                         outputs=(TensorSpec("y", "FP32", (width,)),),
                         batching=BatchingConfig(max_batch_size=max_batch,
                                                 max_inflight_batches=TRACE_INFLIGHT),
                         instance_count=TRACE_INSTANCES, **fields)
        model = ServedModel(spec, module, pools=pools, memory=memory)
        model.start()
        return model, cpu_module

    models: dict[str, tuple[Any, Any]] = {}
    for number, ((width, layers), max_batch) in enumerate(stacks[:3]):
        name = f"linear{width}x{layers}"
        models[name] = served(name, width, layers, max_batch, number)
    all_models = list(models)
    unloaded = all_models[0]
    (late_width, late_layers), late_batch = stacks[3]
    loaded = f"linear{late_width}x{late_layers}"
    all_models.append(loaded)
    counts = {"requests": 0, "failed": 0, "wrong": 0}
    errors: collections.Counter[str] = collections.Counter()
    graph: dict[str, Any] | None = None
    stopped: list[Any] = []
    problems: list[str] = []  # the swap's or the graph model's load that raised

    async def one(model: Any, cpu_module: Any, x: np.ndarray) -> None:
        try:
            out = (await model.infer(InferenceRequest([x], batch_size=x.shape[0])))["y"]
        except Exception as exc:
            counts["failed"] += 1
            errors[f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"] += 1
            return
        finally:
            counts["requests"] += 1

        def reference() -> np.ndarray:
            with torch.inference_mode():
                return cpu_module(torch.from_numpy(x)).numpy()

        want = await asyncio.to_thread(reference)
        if not np.abs(out - want).max() <= ANSWER_TOLERANCE * max(1.0, float(np.abs(want).max())):
            counts["wrong"] += 1

    async def client(number: int, deadline: float) -> None:
        rng = np.random.default_rng((TRACE_SEED, number))
        while time.monotonic() < deadline:
            names = sorted(models)
            # Picked and submitted with no await between: an unloaded model is never picked.
            model, cpu_module = models[names[int(rng.integers(len(names)))]]
            rows = int(rng.integers(1, model.spec.max_batch_size + 1))
            width = model.spec.inputs[0].dims[0]
            await one(model, cpu_module, rng.standard_normal((rows, width), dtype=np.float32))

    async def swap_and_graphs(started: float) -> None:
        try:
            await swap_and_graph_model(started)
        except Exception as exc:  # the row says so; the trace and its figures go on
            problems.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")

    async def swap_and_graph_model(started: float) -> None:
        nonlocal graph
        await asyncio.sleep(max(0.0, started + seconds / 3 - time.monotonic()))
        gone = models.pop(unloaded)[0]
        stopped.append(gone)
        _, late = await asyncio.gather(
            asyncio.to_thread(gone.stop, 5.0),
            asyncio.to_thread(served, loaded, late_width, late_layers, late_batch, 7))
        models[loaded] = late
        if not (cuda and pooled):
            return
        await asyncio.sleep(max(0.0, started + seconds / 2 - time.monotonic()))
        model, cpu_module = await asyncio.to_thread(
            served, "graphs", 512, 3, 64, 11, cuda_graphs=True, buckets=(1, 8, 64))
        before = dict(counts)
        rng = np.random.default_rng(TRACE_SEED)
        await asyncio.gather(*(one(model, cpu_module,
                                   rng.standard_normal((rows, 512), dtype=np.float32))
                               for rows in (1, 5, 8, 33, 64)))
        status = model.load_report.get("cuda_graphs_status", "")
        failed = counts["failed"] - before["failed"]
        wrong = counts["wrong"] - before["wrong"]
        graph = {"status": status, "failed": failed, "wrong": wrong,
                 "ok": failed == 0 and wrong == 0 and status.startswith("captured")}
        await asyncio.to_thread(model.stop, 5.0)

    async def trace() -> None:
        started = time.monotonic()
        deadline = started + seconds
        await asyncio.gather(swap_and_graphs(started),
                             *(client(n, deadline) for n in range(TRACE_CLIENTS)))

    if cuda:
        torch.cuda.reset_peak_memory_stats()
        with DeviceSampler(device, pools) as sampler:
            asyncio.run(trace())
    else:
        sampler = None
        asyncio.run(trace())
    failed_by_stats = sum(m.stats.snapshot().fail.count
                          for m in [*stopped, *(m for m, _ in models.values())])
    result: dict[str, Any] = {
        "mode": label, "allocator": allocator, "pooled": pooled, "device": device,
        "instances": TRACE_INSTANCES, "inflight_batches": TRACE_INFLIGHT,
        "clients": TRACE_CLIENTS, "seconds": seconds, "models": all_models,
        "unloaded": unloaded, "loaded": loaded, **counts,
        "failed_by_stats": failed_by_stats, "errors": dict(errors.most_common(3)),
        "correct": counts["wrong"] == 0 and counts["failed"] == 0 and not problems,
        "problems": problems, "graph_model": graph,
        "ratio_mean": None, "ratio_min": None,
    }
    if sampler is not None:
        result.update(sampler.figures(), peak_reserved=torch.cuda.max_memory_reserved(),
                      peak_allocated=torch.cuda.max_memory_allocated())
        result["model_pools"] = {
            name: {pool: {"reserved": s.reserved, "allocated": s.allocated}
                   for pool, s in (model.memory.stats() or {}).items()}
            for name, (model, _) in models.items()}
    for model, _ in models.values():
        model.stop(5.0)
    print("SERVER_TRACE " + json.dumps(result), flush=True)
    return 0
