"""Each model's own device memory: the footprint measured at warm-up, admission against the
device's free memory, the metrics, and unload giving the bytes back.

On the CPU a model's memory is not measured (``ModelMemory`` is inert there), so these tests
put the allocator contract's double in place (``tests/support/allocator_contract.py``): models
get pools whose bytes the test's modules set, and the device's free memory is the double's.
What only a GPU can show (real ``torch.cuda.MemPool`` segments, their release at unload) is in
the ``cuda``-marked tests.
"""

from __future__ import annotations

import asyncio
import copy
import gc

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from batchgate.batcher import gpu, gpu_env
from batchgate.batcher.errors import ResourceExhausted
from batchgate.batcher.memory import DevicePools, PoolSettings
from batchgate.batcher.metrics import BatcherMetrics
from batchgate.batcher.model import ServedModel
from batchgate.batcher.request import InferenceRequest
from batchgate.batcher.spec import BatchingConfig, ModelSpec, TensorSpec
from tests.support.allocator_contract import contract_installed

CUDA = torch.cuda.is_available()
MIB = 1 << 20


class Activations(torch.nn.Module):
    """y = 3x, holding ``peak`` bytes of the contract double's pool while it runs."""

    def __init__(self, contract, peak: int) -> None:
        super().__init__()
        self._contract, self._peak = contract, peak

    def forward(self, x):
        token = self._contract.allocate(self._peak)
        self._contract.free(token)
        return x * 3


def _spec() -> ModelSpec:
    return ModelSpec(name="m", version="1", platform="test",
                     inputs=(TensorSpec("x", "FP32", (4,)),),
                     outputs=(TensorSpec("y", "FP32", (4,)),),
                     batching=BatchingConfig(max_batch_size=8), buckets=(1, 8))


def _model(contract, registry: CollectorRegistry, *, weights: int, peak: int) -> ServedModel:
    """A model whose load put ``weights`` bytes in its weights pool."""
    memory = gpu.ModelMemory("cpu", "m")
    with memory.use():
        assert contract.allocate(weights) is not None
    return ServedModel(_spec(), Activations(contract, peak), metrics=BatcherMetrics(registry),
                       pools=DevicePools(PoolSettings(1 << 20)), memory=memory)


def _gauge(registry, name, **labels):
    return registry.get_sample_value(name, labels)


async def test_the_footprint_is_measured_reported_and_given_back_at_unload():
    registry = CollectorRegistry()
    with contract_installed() as contract:
        model = _model(contract, registry, weights=40 * MIB, peak=12 * MIB)
        other = gpu.ModelMemory("cpu", "other")
        # Another model's traffic on the device does not count in this one's figures.
        with other.use(gpu.role("compute", 0)):
            contract.free(contract.allocate(500 * MIB))
        model.start()
        try:
            x = np.ones((3, 4), np.float32)
            out = await model.infer(InferenceRequest([x], batch_size=3))
            np.testing.assert_array_equal(out["y"], x * 3)
            report = model.load_report
            plan = int(report["memory_plan_bytes"])
            assert plan > 0
            assert report["weight_bytes"] == str(40 * MIB)
            assert report["activation_bytes"] == str(12 * MIB)
            assert report["footprint_bytes"] == str(52 * MIB + plan)
            labels = {"model": "m", "device": "cpu"}
            for part, value in (("weights", 40 * MIB), ("activations", 12 * MIB),
                                ("plan", plan)):
                assert _gauge(registry, "batchgate_model_footprint_bytes", part=part,
                              **labels) == value
            assert _gauge(registry, "batchgate_model_device_bytes_reserved", **labels) == 52 * MIB
            assert _gauge(registry, "batchgate_model_device_bytes_allocated",
                          **labels) == 40 * MIB
            # Device-wide: every pool together, the other model's 500 MiB cached included.
            assert _gauge(registry, "batchgate_device_fragmentation_bytes", device="cpu") == \
                12 * MIB + 500 * MIB
            # The model's batches (and its warm-up) ran in its instance's compute pool, on its
            # model thread only.
            compute = [pool for pool, names in
                       ((p, contract.threads_in(p)) for p in contract.pools)
                       if names == {"m-0-batch"}]
            assert len(compute) == 1
        finally:
            model.stop(5)
            other.close()
        assert model.memory.closed and model.module is None
        assert not contract.live_pools()
    labels = {"model": "m", "device": "cpu"}
    assert _gauge(registry, "batchgate_model_device_bytes_reserved", **labels) == 0
    assert _gauge(registry, "batchgate_model_footprint_bytes", part="weights", **labels) == 0


def test_a_model_whose_footprint_does_not_fit_is_refused_naming_the_bytes():
    registry = CollectorRegistry()
    # 5 % of 16 GiB of headroom is more than the 100 MiB left free after its load.
    with contract_installed(total_bytes=16 << 30, free_bytes=100 * MIB) as contract:
        model = _model(contract, registry, weights=40 * MIB, peak=12 * MIB)
        with pytest.raises(ResourceExhausted) as info:
            model.start()
        model.stop(0)  # what the repository does with a model that failed its load
        assert model.memory.closed and not contract.live_pools()
    message = str(info.value)
    assert "model 'm' needs" in message and f"weights {40 * MIB}" in message
    assert f"{100 * MIB} bytes are free" in message


def test_admission_counts_only_what_the_model_has_not_taken_yet():
    footprint = gpu.Footprint(weights=600, activations=300, graphs=100, staging=0, plan=0)
    gpu.admit("a", "cuda:0", footprint, held=1000, free=50, total=1000,
              headroom_fraction=0.05)  # all of it held; 50 free covers the headroom
    with pytest.raises(ResourceExhausted, match=r"needs 1000 bytes on cuda:0.*400 more bytes "
                                                r"plus 50 of headroom are needed and 60 bytes"):
        gpu.admit("a", "cuda:0", footprint, held=600, free=60, total=1000,
                  headroom_fraction=0.05)


def test_on_the_cpu_memory_is_not_measured_and_serving_is_unchanged():
    memory = gpu.ModelMemory("cpu")
    assert not memory.measures and memory.stats() is None
    with memory.use():
        torch.ones(3)
    model = ServedModel(_spec(), torch.nn.Linear(4, 4))
    model.start()
    try:
        assert model.load_report["footprint_bytes"] == "not measured on the CPU"
        assert model.load_report["weight_bytes"] == str((16 + 4) * 4)  # its parameters
    finally:
        model.stop(5)


@pytest.mark.parametrize(("given", "expected"), [
    ({}, {"PYTORCH_ALLOC_CONF": "expandable_segments:True", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"},  # the operator's, kept as it is
     {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}),
    ({"CUDA_DEVICE_ORDER": "FASTEST_FIRST"},
     {"PYTORCH_ALLOC_CONF": "expandable_segments:True", "CUDA_DEVICE_ORDER": "FASTEST_FIRST"}),
])
def test_the_allocator_configuration_is_set_unless_the_operator_set_one(given, expected):
    environ = dict(given)
    gpu_env.configure(environ)
    assert environ == expected


# -- on a GPU ----------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device; this machine has none")
async def test_a_model_pool_holds_its_weights_and_activations_and_unload_returns_them():
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(0)
    memory = gpu.ModelMemory("cuda:0", "pooled")
    with memory.use():
        module = torch.nn.Sequential(torch.nn.Linear(512, 4096), torch.nn.ReLU(),
                                     torch.nn.Linear(4096, 512)).cuda()
    weights = sum(p.numel() * 4 for p in module.parameters())
    spec = ModelSpec(name="pooled", version="1", platform="test", device="cuda:0",
                     inputs=(TensorSpec("x", "FP32", (512,)),),
                     outputs=(TensorSpec("y", "FP32", (512,)),),
                     batching=BatchingConfig(max_batch_size=64), buckets=(1, 8, 64))
    x = np.random.default_rng(0).standard_normal((5, 512), dtype=np.float32)
    with torch.inference_mode():
        want = module(torch.from_numpy(x).cuda()).cpu().numpy()
    model = ServedModel(spec, module, memory=memory)
    del module
    model.start()
    try:
        assert int(model.load_report["weight_bytes"]) >= weights
        assert memory.stats()["weights"].reserved >= weights
        assert int(model.load_report["footprint_bytes"]) >= weights
        out = await model.infer(InferenceRequest([x], batch_size=5))
        np.testing.assert_allclose(out["y"], want, rtol=1e-4, atol=1e-4)
    finally:
        model.stop(5)
    del model
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # The weights' segments went back to the device with the pool (a cuBLAS workspace may stay).
    assert torch.cuda.memory_reserved(0) - before < weights


def _linear_model(name: str, width: int, **fields) -> tuple[ServedModel, torch.nn.Module]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(width)
        cpu = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                                  torch.nn.Linear(width, width)).eval()
    memory = gpu.ModelMemory("cuda:0", name)
    with memory.use():  # its weights in its own pool
        module = copy.deepcopy(cpu).to("cuda:0")
    fields.setdefault("batching", BatchingConfig(max_batch_size=64))
    spec = ModelSpec(name=name, version="1", platform="test", device="cuda:0",
                     inputs=(TensorSpec("x", "FP32", (width,)),),
                     outputs=(TensorSpec("y", "FP32", (width,)),), buckets=(1, 8, 64),
                     **fields)
    return ServedModel(spec, module, memory=memory), cpu


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device; this machine has none")
async def test_a_graph_model_captured_while_another_serves_leaves_both_correct():
    serving, serving_cpu = _linear_model("serving", 1024, cuda_graphs=True)
    serving.start()
    late = None
    try:
        assert serving.load_report["cuda_graphs_status"].startswith("captured")
        rng = np.random.default_rng(0)

        async def check(model, cpu_module, rows):
            x = rng.standard_normal((rows, model.spec.inputs[0].dims[0]), dtype=np.float32)
            out = (await model.infer(InferenceRequest([x], batch_size=rows)))["y"]
            with torch.inference_mode():
                want = cpu_module(torch.from_numpy(x)).numpy()
            np.testing.assert_allclose(out, want, rtol=2e-3, atol=2e-3)

        stop = False

        async def traffic():
            while not stop:
                await asyncio.gather(*(check(serving, serving_cpu, rows)
                                       for rows in (1, 5, 8, 40, 64)))

        running = asyncio.ensure_future(traffic())
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved(0)
        late, late_cpu = _linear_model("late", 512, cuda_graphs=True)
        await asyncio.to_thread(late.start)  # captures while "serving" replays its graphs
        # torch.cuda.graph would have emptied the caching allocator's cache here.
        assert torch.cuda.memory_reserved(0) >= reserved
        assert late.load_report["cuda_graphs_status"].startswith("captured")
        await asyncio.gather(*(check(late, late_cpu, rows) for rows in (1, 8, 33, 64)))
        stop = True
        await running
    finally:
        if late is not None:
            late.stop(5)
        serving.stop(5)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device; this machine has none")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
async def test_two_instances_with_two_batches_in_flight_answer_concurrent_load_on_cuda(graphs):
    model, cpu = _linear_model("pair", 1024, cuda_graphs=graphs, instance_count=2,
                               batching=BatchingConfig(max_batch_size=64,
                                                       max_inflight_batches=2))
    model.start()
    try:
        if graphs:
            assert model.load_report["cuda_graphs_status"].startswith("captured")
        rng = np.random.default_rng(1)
        xs = [rng.standard_normal((rows, 1024), dtype=np.float32)
              for rows in (1, 3, 64, 17, 8, 40, 2, 64) * 25]
        outs = await asyncio.gather(*(model.infer(InferenceRequest([x], batch_size=len(x)))
                                      for x in xs))
        with torch.inference_mode():
            for x, out in zip(xs, outs):
                np.testing.assert_allclose(out["y"], cpu(torch.from_numpy(x)).numpy(),
                                           rtol=2e-3, atol=2e-3)
        # No cuBLAS workspace (32 MiB each on an H100, never freed) landed in the pools: after
        # the batches, nothing is left allocated in the instances' compute pools.
        stats = model.memory.stats()
        assert stats["activations"].allocated == 0, stats
        weights = sum(p.numel() * 4 for p in cpu.parameters())
        assert stats["weights"].allocated == weights, stats
    finally:
        model.stop(5)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device; this machine has none")
async def test_unloading_a_model_while_another_serves_returns_its_pools_on_cuda():
    serving, serving_cpu = _linear_model("stays", 1024)
    leaving, _ = _linear_model("goes", 2048)
    serving.start()
    leaving.start()
    try:
        stop = False

        async def traffic():
            rng = np.random.default_rng(2)
            while not stop:
                x = rng.standard_normal((8, 1024), dtype=np.float32)
                out = await serving.infer(InferenceRequest([x], batch_size=8))
                with torch.inference_mode():
                    want = serving_cpu(torch.from_numpy(x)).numpy()
                np.testing.assert_allclose(out["y"], want, rtol=2e-3, atol=2e-3)

        running = asyncio.ensure_future(traffic())
        held = sum(s.reserved for s in leaving.memory.stats().values())
        before = torch.cuda.memory_reserved(0)
        await asyncio.to_thread(leaving.stop, 5)
        # Its pools went back to the device whole, while the other model kept serving.
        assert before - torch.cuda.memory_reserved(0) >= held
        stop = True
        await running
    finally:
        serving.stop(5)


# -- the device pool sized from the models' plans ----------------------------------------------


def _plan_model(name: str, pools: DevicePools, metrics: BatcherMetrics | None,
                rows: int = 8, staging: str = "queue") -> ServedModel:
    spec = ModelSpec(name=name, version="1", platform="test",
                     inputs=(TensorSpec("x", "FP32", (256,)),),
                     outputs=(TensorSpec("y", "FP32", (256,)),),
                     batching=BatchingConfig(max_batch_size=rows), buckets=(1, rows),
                     input_staging=staging)
    return ServedModel(spec, lambda x: x + 1, metrics=metrics, pools=pools)


async def test_the_pool_grows_by_each_model_s_plan_and_shrinks_when_one_unloads():
    registry = CollectorRegistry()
    metrics = BatcherMetrics(registry)
    pools = DevicePools(PoolSettings(), metrics)
    assert _gauge(registry, "batchgate_pool_bytes_reserved", device="cpu") in (None, 0.0)
    assert pools.bytes_reserved("cpu") == 0  # nothing before a model is admitted
    a = _plan_model("a", pools, metrics, rows=8)
    b = _plan_model("b", pools, metrics, rows=32)
    a.start()
    try:
        held_a = int(a.load_report["device_pool_bytes"])
        # Its plan (one 8-row batch buffer, and the empty activation block's one alignment)
        # and its staging room (3 batches' worth), plus the arena's alignment skip; no more.
        plan_a = int(a.load_report["memory_plan_bytes"])
        assert plan_a == 8 * 256 * 4 + 512 and held_a == plan_a + 3 * 8 * 256 * 4 + 512
        assert pools.bytes_reserved("cpu") == held_a
        b.start()
        held_b = int(b.load_report["device_pool_bytes"])
        assert held_b > held_a
        assert pools.bytes_reserved("cpu") == held_a + held_b
        assert _gauge(registry, "batchgate_pool_bytes_reserved", device="cpu") == held_a + held_b
        assert _gauge(registry, "batchgate_model_pool_bytes_reserved", model="b") == held_b
        x = np.ones((5, 256), np.float32)
        out = await b.infer(InferenceRequest([x], batch_size=5))
        np.testing.assert_array_equal(out["y"], x + 1)
    finally:
        a.stop(5)
    try:
        # a's share went back; b's stays.
        assert pools.bytes_reserved("cpu") == held_b
        assert _gauge(registry, "batchgate_pool_bytes_reserved", device="cpu") == held_b
        assert _gauge(registry, "batchgate_model_pool_bytes_reserved", model="a") == 0
    finally:
        b.stop(5)
    assert pools.bytes_reserved("cpu") == 0
    assert _gauge(registry, "batchgate_pool_bytes_in_use", device="cpu") == 0


def test_a_model_past_the_pool_s_cap_is_refused_naming_the_bytes_and_the_rest_serve():
    small = _plan_model("small", DevicePools(PoolSettings()), None, staging="batch")
    small.start()
    small_bytes = int(small.load_report["device_pool_bytes"])
    small.stop(5)
    cap = small_bytes + 4096  # room for "small", not for "big"'s 64-row buffer too
    registry = CollectorRegistry()
    metrics = BatcherMetrics(registry)
    pools = DevicePools(PoolSettings(cap), metrics)
    first = _plan_model("small", pools, metrics, staging="batch")
    big = _plan_model("big", pools, metrics, rows=64, staging="batch")
    first.start()
    try:
        with pytest.raises(ResourceExhausted) as info:
            big.start()
        message = str(info.value)
        needed = int(message.split(" needs ")[1].split()[0])
        free = int(message.split(" bytes are free")[0].split()[-1])
        assert free == cap - small_bytes and needed >= 64 * 256 * 4 > free, message
        assert f"capped at {cap} bytes" in message
        big.stop(5)
        assert pools.bytes_reserved("cpu") == small_bytes  # the refusal took nothing
    finally:
        first.stop(5)
    assert pools.bytes_reserved("cpu") == 0
