"""(b) what the server itself allocates: a child process per allocator setting."""

from __future__ import annotations

import asyncio
import json
import os
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
SERVER_TRACE_ROUNDS = 60  # rounds of SERVER_TRACE_WIDTH requests over the loaded models
SERVER_TRACE_WIDTH = 16
SERVER_TRACE_SECONDS = 25.0
SERVER_TRACE_POOL_BYTES = 256 << 20  # the cap of the device pool the plans are admitted into


def server_trace_main(argument: str) -> int:
    """Child of (b): what the server itself allocates. ServedModels of several sizes (the
    example models and linear stacks), each with its own pool or not (the mode), served
    requests of random batch sizes concurrently; mid-trace one model is unloaded and another
    loaded while the rest serve; with pools a CUDA-graph model is loaded while the others serve
    and its answers are checked. The device's bytes in use / reserved is sampled after every
    round. Prints one SERVER_TRACE JSON line."""
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
    rng = np.random.default_rng(TRACE_SEED)
    stacks = (((256, 4), 64), ((1024, 4), 128), ((4096, 3), 64), ((2048, 3), 128))
    if not cuda:
        stacks = (((64, 2), 16), ((128, 2), 16), ((256, 2), 8), ((96, 2), 16))

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
                         batching=BatchingConfig(max_batch_size=max_batch), **fields)
        model = ServedModel(spec, module, pools=pools, memory=memory)
        model.start()
        return model, cpu_module

    models: dict[str, tuple[Any, Any]] = {}
    for number, ((width, layers), max_batch) in enumerate(stacks[:3]):
        name = f"linear{width}x{layers}"
        models[name] = served(name, width, layers, max_batch, number)
    samples: list[float] = []
    correct = True
    requests = 0
    unloaded = next(iter(models))
    (late_width, late_layers), late_batch = stacks[3]
    loaded = f"linear{late_width}x{late_layers}"
    graph: dict[str, Any] | None = None

    def sample() -> None:
        if cuda:
            torch.cuda.synchronize()
            reserved = torch.cuda.memory_reserved()
            if reserved:
                samples.append(torch.cuda.memory_allocated() / reserved)

    async def one(model: Any, cpu_module: Any, rows: int) -> bool:
        x = rng.standard_normal((rows, model.spec.inputs[0].dims[0]), dtype=np.float32)
        out = (await model.infer(InferenceRequest([x], batch_size=rows)))["y"]
        with torch.inference_mode():
            want = cpu_module(torch.from_numpy(x)).numpy()
        return bool(np.abs(out - want).max() <= 1e-3 * max(1.0, float(np.abs(want).max())))

    async def trace() -> None:
        nonlocal correct, requests, graph
        started = time.monotonic()
        swap: asyncio.Future | None = None
        graph_load: asyncio.Future | None = None
        for round_number in range(SERVER_TRACE_ROUNDS):
            if time.monotonic() - started > SERVER_TRACE_SECONDS:
                break
            if round_number == SERVER_TRACE_ROUNDS // 3:
                # Unload one model and load another while the rest keep serving.
                gone = models.pop(unloaded)[0]
                swap = asyncio.ensure_future(asyncio.gather(
                    asyncio.to_thread(gone.stop, 5.0),
                    asyncio.to_thread(served, loaded, late_width, late_layers, late_batch, 7)))
            if round_number == SERVER_TRACE_ROUNDS // 2 and cuda and pooled:
                graph_load = asyncio.ensure_future(asyncio.to_thread(
                    served, "graphs", 512, 3, 64, 11, cuda_graphs=True, buckets=(1, 8, 64)))
            if swap is not None and swap.done():
                models[loaded] = swap.result()[1]
                swap = None
            if graph_load is not None and graph_load.done():
                model, cpu_module = graph_load.result()
                results = await asyncio.gather(*(one(model, cpu_module, rows)
                                                 for rows in (1, 5, 8, 33, 64)))
                graph = {"status": model.load_report.get("cuda_graphs_status", ""),
                         "ok": all(results) and model.load_report.get(
                             "cuda_graphs_status", "").startswith("captured"),
                         "error": 0.0 if all(results) else 1.0}
                model.stop(5.0)
                graph_load = None
            names = list(models)
            jobs = []
            for _ in range(SERVER_TRACE_WIDTH):
                model, cpu_module = models[names[int(rng.integers(len(names)))]]
                jobs.append(one(model, cpu_module,
                                int(rng.integers(1, model.spec.max_batch_size + 1))))
            results = await asyncio.gather(*jobs)
            correct = correct and all(results)
            requests += len(results)
            sample()
        if swap is not None:
            models[loaded] = (await swap)[1]
        if graph_load is not None:
            model, _ = await graph_load
            graph = {"status": "loaded after the trace ended", "ok": False, "error": 1.0}
            model.stop(5.0)

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    asyncio.run(trace())
    result: dict[str, Any] = {
        "mode": label, "alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF", ""),
        "pooled": pooled, "models": sorted([*models, unloaded]), "unloaded": unloaded,
        "loaded": loaded, "requests": requests, "correct": correct, "graph_model": graph,
        "ratio_end": None, "ratio_mean": None, "ratio_min": None,
    }
    if cuda and samples:
        result.update(ratio_end=samples[-1], ratio_mean=sum(samples) / len(samples),
                      ratio_min=min(samples), peak_reserved=torch.cuda.max_memory_reserved(),
                      peak_allocated=torch.cuda.max_memory_allocated(),
                      fragmentation_end=torch.cuda.memory_reserved()
                      - torch.cuda.memory_allocated())
    for model, _ in models.values():
        model.stop(5.0)
    print("SERVER_TRACE " + json.dumps(result), flush=True)
    return 0


