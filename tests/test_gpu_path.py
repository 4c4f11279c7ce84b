"""The GPU data path, run on the CPU device: batch buckets, precision, the memory pool and its
metrics, staging, out-of-memory recovery, CUDA graphs' fallback; CUDA-only checks are marked.

Servers here serve a repository of their own (``gpu_repository``): copies of the example mlp
in other precisions and with buckets, and small test models that write down the batch sizes
they run, so padding and warm-up can be seen from outside. Every server test runs in both
modes (one process; the native front end + an executor process).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from batchgate.batcher import precision
from batchgate.batcher.buckets import BatchBuckets
from batchgate.batcher.errors import ModelExecutionError, ResourceExhausted
from batchgate.batcher.memory import DevicePools, PoolSettings
from batchgate.batcher.metrics import BatcherMetrics
from batchgate.batcher.model import ServedModel
from batchgate.batcher.spec import BatchingConfig, ModelSpec, TensorSpec
from batchgate.clients import BatchgateError, Client
from batchgate.bench.harness.server import ServeProcess
from batchgate.protos.model_config_pb2 import ModelConfig
from batchgate.bench.harness.metrics import sample, scrape
from batchgate.bench.harness.repository import copy_model, write_model
from tests.support import EXAMPLE_MODELS
from tests.support.batching import infer_x, unit_spec
from tests.support.models import reference, xy_config
from tests.support.polling import poll
from tests.support.servers import (
    SERVER_MODES,
    native_or_skip,
    start_multiprocess_server,
    start_server,
)

CUDA = torch.cuda.is_available()



def small_config(name: str, log_dir: Path, kind: str = "KIND_CPU", **params: str) -> ModelConfig:
    """An FP32 [2] model that logs to ``log_dir``/``name``, with ``params``."""
    return xy_config(name, kind=kind, parameters={"log_dir": log_dir, "log_name": name, **params})


# y = 3x; appends each batch's row count (padding included) to log_dir/NAME.
RECORDER_MODEL = '''
from pathlib import Path

import torch


class Recorder(torch.nn.Module):
    def __init__(self, log):
        super().__init__()
        self.log = log

    def forward(self, x):
        with open(self.log, "a") as out:
            out.write(f"{x.shape[0]}\\n")
        return x * 3


def build_model(parameters):
    return Recorder(Path(parameters["log_dir"]) / parameters["log_name"])
'''

# y = x + 1; a batch of more than 4 non-zero rows raises CUDA's out-of-memory error (zeros,
# the warm-up's, never do: the model must load). Row counts go to log_dir/NAME.
OOM_MODEL = '''
from pathlib import Path

import torch


class RunsOutOfMemory(torch.nn.Module):
    def __init__(self, log):
        super().__init__()
        self.log = log

    def forward(self, x):
        with open(self.log, "a") as out:
            out.write(f"{x.shape[0]}\\n")
        if x.shape[0] > 4 and bool(x.abs().sum() > 0):
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test model)")
        return x + 1


def build_model(parameters):
    return RunsOutOfMemory(Path(parameters["log_dir"]) / parameters["log_name"])
'''

# y = 2x; while log_dir/closed exists each batch waits (up to 30 s).
GATED_MODEL = '''
import time
from pathlib import Path

import torch


class Gated(torch.nn.Module):
    def __init__(self, folder):
        super().__init__()
        self.folder = folder

    def forward(self, x):
        (self.folder / "entered").touch()
        deadline = time.monotonic() + 30
        while (self.folder / "closed").exists() and time.monotonic() < deadline:
            time.sleep(0.001)
        return x * 2


def build_model(parameters):
    return Gated(Path(parameters["log_dir"]))
'''

# fp16 overflows where fp32 does not: x * 1e5 is over fp16's 65504.
OVERFLOW_MODEL = '''
import torch


class Overflow(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(1e5), requires_grad=False)

    def forward(self, x):
        return x * self.scale / self.scale


def build_model(parameters):
    return Overflow()
'''


def _mlp(root: Path, name: str, **params: str) -> None:
    copy_model(EXAMPLE_MODELS / "mlp", root, name, params)


def write_gpu_repository(root: Path, log_dir: Path) -> Path:
    _mlp(root, "mlp_buckets", buckets="pow2")
    _mlp(root, "mlp_bf16", precision="amp-bf16")
    _mlp(root, "mlp_fp16w", precision="fp16-weights")
    _mlp(root, "mlp_graphs", buckets="1,8,64", cuda_graphs="true")
    write_model(root, small_config("recorder", log_dir, buckets="1,2,4,8"), RECORDER_MODEL)
    write_model(root, small_config("oom", log_dir, buckets="pow2"), OOM_MODEL)
    write_model(root, small_config("staged", log_dir, input_staging="queue",
                                   max_inflight_batches="1"), GATED_MODEL)
    write_model(root, small_config("overflow", log_dir, precision="fp16-weights"), OVERFLOW_MODEL)
    return root


@pytest.fixture
def log_dir(tmp_path) -> Path:
    """For the servers a test starts itself."""
    return tmp_path


@pytest.fixture(scope="module", params=SERVER_MODES)
def gpu_server(request, tmp_path_factory):
    """A server of ``write_gpu_repository``; ``.log_dir`` holds what its test models wrote."""
    log_dir = tmp_path_factory.mktemp(f"gpu-path-logs-{request.param}")
    repository = write_gpu_repository(tmp_path_factory.mktemp("gpu-models"), log_dir)
    if request.param == "single":
        running = start_server(repository)
    else:
        running = start_multiprocess_server(repository)
    running.log_dir = log_dir
    yield running
    (log_dir / "closed").unlink(missing_ok=True)
    running.stop()


def sizes(log_dir: Path, name: str) -> list[int]:
    path = log_dir / name
    return [int(v) for v in path.read_text().split()] if path.exists() else []


def config_parameters(address: str, model: str) -> dict[str, str]:
    with Client(address, timeout_s=30) as client:
        config = client.model_config(model)
    return {key: value.string_value for key, value in config.parameters.items()}


# -- buckets -----------------------------------------------------------------------------------


def test_bucket_padding_is_dropped_from_every_answer(gpu_server):
    rng = np.random.default_rng(7)
    inputs = {n: rng.standard_normal((n, 512), dtype=np.float32) for n in range(1, 65)}
    # All at once, so that batches of mixed requests form and get padded to their buckets.
    with Client(gpu_server.address, timeout_s=60) as client, \
            concurrent.futures.ThreadPoolExecutor(16) as workers:
        answers = dict(zip(inputs, workers.map(
            lambda x: client.infer("mlp_buckets", {"INPUT__0": x})["OUTPUT__0"],
            inputs.values())))
    for n, x in inputs.items():
        assert answers[n].shape == (n, 512), n
        np.testing.assert_allclose(answers[n], reference("mlp", x), rtol=1e-4, atol=1e-5,
                                   err_msg=f"batch of {n}")


def test_batches_run_at_their_bucket_and_answers_keep_their_rows(gpu_server):
    log_dir = gpu_server.log_dir
    before = len(sizes(log_dir, "recorder"))
    with Client(gpu_server.address, timeout_s=30) as client:
        for rows in (1, 3, 5, 8):
            x = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) + 1
            out = client.infer("recorder", {"INPUT__0": x})["OUTPUT__0"]
            np.testing.assert_array_equal(out, 3 * x)
    assert sizes(log_dir, "recorder")[before:] == [1, 4, 8, 8]


def test_every_bucket_is_warmed_up_before_ready(gpu_server):
    log_dir = gpu_server.log_dir
    # The module logs every batch it runs: the first ones are the load's warm-up.
    assert set(sizes(log_dir, "recorder")[:4]) == {1, 2, 4, 8}
    params = config_parameters(gpu_server.address, "recorder")
    assert params["buckets"] == "1,2,4,8"
    assert sorted(map(int, params["warmed_up_batch_sizes"].split(","))) == [1, 2, 4, 8]
    mlp = config_parameters(gpu_server.address, "mlp_buckets")
    assert mlp["warmed_up_batch_sizes"] == "1,2,4,8,16,32,64"


def test_batch_buckets_pad_and_lower():
    buckets = BatchBuckets((1, 2, 4, 8), 8)
    assert [buckets.pad(n) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert buckets.lower(8) == 4 and buckets.largest == 4
    assert buckets.pad(3) == 4 and buckets.pad(6) == 6  # over the largest: runs in pieces
    assert buckets.lower(8) == 4
    plain = BatchBuckets((), 8)
    assert plain.pad(5) == 5 and plain.lower(5) == 2


def test_a_lowered_bucket_comes_back_and_waits_longer_each_time_it_fails_again():
    now = [0.0]
    buckets = BatchBuckets((1, 2, 4, 8), 8, recover_after_s=10, clock=lambda: now[0])
    assert buckets.lower(8) == 4 and buckets.lowered
    now[0] = 9.9
    assert buckets.largest == 4
    now[0] = 10.0
    assert buckets.largest == 8 and not buckets.lowered  # the whole batch is tried again
    assert buckets.lower(8) == 4  # ...and fails: lowered twice as long
    now[0] = 29.9
    assert buckets.largest == 4
    now[0] = 30.0
    assert buckets.largest == 8
    buckets.recovered()  # a whole batch ran: the next failure waits the shortest again
    assert buckets.lower(8) == 4
    now[0] = 40.0
    assert buckets.largest == 8


# -- precision ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("model", "tolerance"), [("mlp_bf16", 5e-2), ("mlp_fp16w", 2e-2)])
def test_reduced_precision_answers_and_reports_its_error(gpu_server, model, tolerance):
    params = config_parameters(gpu_server.address, model)
    error = float(params["precision_max_relative_error"])
    assert 0 < error < tolerance, params
    x = np.random.default_rng(3).standard_normal((5, 512), dtype=np.float32)
    with Client(gpu_server.address, timeout_s=30) as client:
        out = client.infer(model, {"INPUT__0": x})["OUTPUT__0"]
    assert out.dtype == np.float32  # the configured datatype, whatever ran inside
    want = reference("mlp", x)
    assert np.abs(out - want).max() / np.abs(want).max() < tolerance


def test_fp32_reports_no_error(gpu_server):
    assert config_parameters(gpu_server.address, "mlp_buckets")[
        "precision_max_relative_error"] == "0.000e+00"


def test_a_precision_that_overflows_fails_its_load(gpu_server):
    with Client(gpu_server.address, timeout_s=60) as client:
        with pytest.raises(BatchgateError) as info:
            client.load_model("overflow")
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "non-finite" in str(info.value) and "fp16-weights" in str(info.value)


# -- memory pool -------------------------------------------------------------------------------


def test_pool_metrics_per_device_and_model(gpu_server):
    samples = scrape(gpu_server.metrics_url)
    reserved = sample(samples, "batchgate_pool_bytes_reserved", device="cpu")
    in_use = sample(samples, "batchgate_pool_bytes_in_use", device="cpu")
    largest = sample(samples, "batchgate_pool_largest_free_block_bytes", device="cpu")
    models = {labels[0][1]: value for (name, labels), value in samples.items()
              if name == "batchgate_model_pool_bytes_reserved"}
    used = {labels[0][1]: value for (name, labels), value in samples.items()
            if name == "batchgate_model_pool_bytes_in_use"}
    # The pool is its models' arenas, each sized from its plan: no blanket reservation.
    assert reserved == sum(models.values()) < 1 << 30
    assert 0 < in_use <= reserved and 0 < largest <= reserved - in_use
    # A 64-row input buffer per batch in flight: one, the CPU default.
    assert models["mlp_buckets"] >= 64 * 512 * 4
    assert sum(used.values()) == in_use  # nothing else is in the pool while idle
    params = config_parameters(gpu_server.address, "mlp_buckets")
    assert int(params["device_pool_bytes"]) == models["mlp_buckets"]
    assert int(params["device_pool_bytes"]) >= int(params["memory_plan_bytes"])
    assert sample(samples, "batchgate_pool_fallbacks_total", device="cpu") in (None, 0.0)


def test_pooled_buffers_go_back_after_traffic(gpu_server):
    baseline = sample(scrape(gpu_server.metrics_url), "batchgate_pool_bytes_in_use", device="cpu")
    x = np.ones((3, 512), dtype=np.float32)
    with Client(gpu_server.address, timeout_s=60) as client, \
            concurrent.futures.ThreadPoolExecutor(8) as workers:
        list(workers.map(lambda _: client.infer("mlp_buckets", {"INPUT__0": x}), range(64)))
    poll(lambda: sample(scrape(gpu_server.metrics_url), "batchgate_pool_bytes_in_use",
                        device="cpu") == baseline, 30, "pool bytes in use back to the baseline")


TINY_POOL = 64 * 1024  # the small models fit; the mlp's 64-row buffers do not


def _tiny_repository(root: Path, log_dir: Path) -> Path:
    write_model(root, small_config("small", log_dir), RECORDER_MODEL)
    _mlp(root, "big")
    return root


def test_a_model_that_does_not_fit_the_pool_fails_to_load_with_resource_exhausted(
        tmp_path, log_dir):
    running = start_server(_tiny_repository(tmp_path / "models", log_dir), device_pool_bytes=TINY_POOL)
    try:
        _check_refusal(running.address)
    finally:
        running.stop()


def test_the_refusal_holds_in_multiprocess_mode(tmp_path, log_dir):
    repository = _tiny_repository(tmp_path / "models", log_dir)
    native_or_skip()
    server = ServeProcess("serve", "--frontend", "native", "--host", "127.0.0.1", "--grpc-port", "0",
                          "--metrics-port", "-1", "--model-repository", str(repository),
                          "--device-pool-bytes", str(TINY_POOL), "--arena-bytes",
                          str(64 << 20), "--log-format", "json", "--no-gc-freeze")
    try:
        serving = server.wait_for("serving")
        _check_refusal(f"127.0.0.1:{serving['grpc_port']}")
    finally:
        assert server.stop() == 0


def _check_refusal(address: str) -> None:
    with Client(address, timeout_s=60) as client:
        assert client.model_ready("small")
        with pytest.raises(BatchgateError) as info:
            client.load_model("big")
        message = str(info.value)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, message
        needed = int(message.split(" needs ")[1].split()[0])
        free = int(message.split(" bytes are free")[0].split()[-1])
        assert needed > free and needed >= 64 * 512 * 4, message  # one 64-row buffer at least
        entry = {m.name: m for m in client.repository_index()}["big"]
        assert entry.state == "UNAVAILABLE" and "needs" in entry.reason
        # What did fit keeps serving.
        out = client.infer("small", {"INPUT__0": np.ones((2, 2), np.float32)})["OUTPUT__0"]
        np.testing.assert_array_equal(out, np.full((2, 2), 3, np.float32))


def test_a_permissive_pool_loads_outside_it_and_counts_every_fallback(tmp_path, log_dir):
    running = start_server(_tiny_repository(tmp_path / "models", log_dir), device_pool_bytes=TINY_POOL,
                           device_pool_strict=False)
    try:
        x = np.ones((2, 512), np.float32)
        with Client(running.address, timeout_s=30) as client:
            np.testing.assert_allclose(client.infer("big", {"INPUT__0": x})["OUTPUT__0"],
                                       reference("mlp", x), rtol=1e-4, atol=1e-5)
        samples = scrape(running.metrics_url)
        assert sample(samples, "batchgate_pool_fallbacks_total", device="cpu") >= 2
        assert sample(samples, "batchgate_model_pool_fallbacks_total", model="big") >= 2
        assert sample(samples, "batchgate_model_pool_fallbacks_total", model="small") == 0
    finally:
        running.stop()


# -- staging -----------------------------------------------------------------------------------


def test_queued_requests_are_staged_in_the_pool_and_answered(gpu_server):
    check_staging(gpu_server, gpu_server.log_dir)


def check_staging(gpu_server, log_dir: Path) -> None:
    """Hold the gated ``staged`` model on a first request, queue three more: their inputs are
    staged into the pool while they wait, answered right, and the blocks go back."""
    gate = log_dir / "closed"
    (log_dir / "entered").unlink(missing_ok=True)
    base = scrape(gpu_server.metrics_url)
    reserved = sample(base, "batchgate_model_pool_bytes_reserved", model="staged")
    idle = sample(base, "batchgate_model_pool_bytes_in_use", model="staged")  # its plan
    queued_before = sample(base, "batchgate_input_copies_total", model="staged",
                           when="queued") or 0
    gate.touch()
    xs = [np.full((rows, 2), rows, np.float32) for rows in (1, 2, 3, 4)]
    with Client(gpu_server.address, timeout_s=60) as client, \
            concurrent.futures.ThreadPoolExecutor(4) as workers:
        first = workers.submit(client.infer, "staged", {"INPUT__0": xs[0]})
        poll(lambda: (log_dir / "entered").exists(), 30, "the gated model never ran")
        rest = [workers.submit(client.infer, "staged", {"INPUT__0": x}) for x in xs[1:]]
        # The queued requests' inputs land in pool blocks while the first batch is held.
        staged_bytes = (2 + 3 + 4) * 2 * 4
        poll(lambda: sample(scrape(gpu_server.metrics_url), "batchgate_model_pool_bytes_in_use",
                            model="staged") >= idle + staged_bytes, 30, "inputs staged")
        # The staged blocks came out of the room the model's arena was sized with.
        assert sample(scrape(gpu_server.metrics_url), "batchgate_model_pool_bytes_reserved",
                      model="staged") == reserved
        gate.unlink()
        answers = [first.result(60)] + [f.result(60) for f in rest]
    for x, answer in zip(xs, answers):
        np.testing.assert_array_equal(answer["OUTPUT__0"], 2 * x)
    after = scrape(gpu_server.metrics_url)
    assert sample(after, "batchgate_input_copies_total", model="staged",
                  when="queued") >= queued_before + 3
    poll(lambda: sample(scrape(gpu_server.metrics_url), "batchgate_model_pool_bytes_in_use",
                        model="staged") == idle, 30, "staged blocks given back")


# -- out of memory -----------------------------------------------------------------------------


def test_a_batch_out_of_memory_is_split_and_the_bucket_lowered(gpu_server):
    log_dir = gpu_server.log_dir
    before = len(sizes(log_dir, "oom"))
    x = np.arange(16, dtype=np.float32).reshape(8, 2) + 1
    with Client(gpu_server.address, timeout_s=30) as client:
        np.testing.assert_array_equal(client.infer("oom", {"INPUT__0": x})["OUTPUT__0"], x + 1)
        samples = scrape(gpu_server.metrics_url)
        assert sample(samples, "batchgate_oom_events_total", model="oom") == 1
        assert sample(samples, "batchgate_model_largest_bucket", model="oom") == 4
        # Now batches over 4 run in pieces of 4: no second out-of-memory.
        np.testing.assert_array_equal(client.infer("oom", {"INPUT__0": -x})["OUTPUT__0"], 1 - x)
    # 8 rows fail, fail again after the cache was given back, then run as two halves.
    assert sizes(log_dir, "oom")[before:] == [8, 8, 4, 4, 4, 4]
    assert sample(scrape(gpu_server.metrics_url), "batchgate_oom_events_total", model="oom") == 1


# -- CUDA graphs -------------------------------------------------------------------------------


@pytest.mark.skipif(CUDA, reason="on a GPU the graphs are captured: test_graphs_on_cuda")
def test_cuda_graphs_are_accepted_and_run_eager_on_the_cpu(gpu_server):
    params = config_parameters(gpu_server.address, "mlp_graphs")
    assert params["cuda_graphs"] == "true"
    assert params["cuda_graphs_status"].startswith("eager: no CUDA device")
    x = np.ones((9, 512), np.float32)
    with Client(gpu_server.address, timeout_s=30) as client:
        np.testing.assert_allclose(client.infer("mlp_graphs", {"INPUT__0": x})["OUTPUT__0"],
                                   reference("mlp", x), rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device; this machine has none")
def test_graphs_on_cuda(tmp_path, log_dir):
    repository = tmp_path / "models"
    _mlp(repository, "mlp_graphs", buckets="1,8,64", cuda_graphs="true")
    running = start_server(repository)
    try:
        params = config_parameters(running.address, "mlp_graphs")
        assert params["cuda_graphs_status"] == "captured for buckets 1,8,64", params
        rng = np.random.default_rng(0)
        with Client(running.address, timeout_s=30) as client:
            for rows in (1, 5, 8, 33, 64):
                x = rng.standard_normal((rows, 512), dtype=np.float32)
                out = client.infer("mlp_graphs", {"INPUT__0": x})["OUTPUT__0"]
                np.testing.assert_allclose(out, reference("mlp", x), rtol=2e-3, atol=2e-3)
    finally:
        running.stop()


# -- the executor on its own (no server) -------------------------------------------------------


async def test_an_output_that_is_the_input_buffer_is_copied_before_the_buffer_is_reused():
    # Identity: the model hands back the pooled batch buffer itself. With one batch in flight
    # the next batch reuses that buffer while the first answer may still be on its way out.
    model = ServedModel(unit_spec(warmup=False), lambda x: x,
                        pools=DevicePools(PoolSettings(1 << 20)))
    model.start()
    try:
        first = await infer_x(model, np.full((3, 2), 1.0, np.float32))
        second = await infer_x(model, np.full((3, 2), 2.0, np.float32))
    finally:
        model.stop(5)
    np.testing.assert_array_equal(first, np.full((3, 2), 1.0, np.float32))
    np.testing.assert_array_equal(second, np.full((3, 2), 2.0, np.float32))


async def test_a_single_sample_out_of_memory_fails_with_resource_exhausted():
    def never_fits(x):
        if bool(x.abs().sum() > 0):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return x

    registry = CollectorRegistry()
    model = ServedModel(unit_spec(buckets=(1, 2, 4, 8)), never_fits,
                        metrics=BatcherMetrics(registry))
    model.start()  # the warm-up's zeros fit
    try:
        with pytest.raises(ResourceExhausted, match="single sample"):
            await infer_x(model, np.ones((2, 2), np.float32))
        # The failure was the batch's, not the model's: it still answers what fits.
        np.testing.assert_array_equal(await infer_x(model, np.zeros((2, 2), np.float32)),
                                      np.zeros((2, 2), np.float32))
    finally:
        model.stop(5)
    assert registry.get_sample_value("batchgate_oom_events_total", {"model": "unit"}) == 1
    assert registry.get_sample_value("batchgate_model_largest_bucket", {"model": "unit"}) == 1


async def test_pipelined_batches_with_staging_answer_every_request_on_the_cpu():
    registry = CollectorRegistry()
    metrics = BatcherMetrics(registry)
    pools = DevicePools(PoolSettings(1 << 20), metrics)
    model = ServedModel(unit_spec(inflight=2, buckets=(2, 4, 8), input_staging="queue"),
                        lambda x: x * 2 + 1, metrics=metrics, pools=pools)
    model.start()
    baseline = registry.get_sample_value("batchgate_pool_bytes_in_use", {"device": "cpu"})
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((int(rng.integers(1, 9)), 2), dtype=np.float32)
          for _ in range(200)]
    try:
        answers = await asyncio.gather(*(infer_x(model, x) for x in xs))
    finally:
        model.stop(5)
    for x, y in zip(xs, answers):
        np.testing.assert_allclose(y, x * 2 + 1, rtol=1e-6)
    copies = sum(registry.get_sample_value("batchgate_input_copies_total",
                                           {"model": "unit", "when": when}) or 0
                 for when in ("queued", "batch"))
    assert copies == len(xs)
    assert baseline > 0
    assert registry.get_sample_value("batchgate_pool_bytes_in_use", {"device": "cpu"}) == 0


def test_the_precision_check_says_why_it_could_not_measure():
    spec = ModelSpec(name="v", version="1", platform="test",
                     inputs=(TensorSpec("x", "FP32", (-1,)),),
                     outputs=(TensorSpec("y", "FP32", (-1,)),),
                     batching=BatchingConfig(max_batch_size=4), precision="amp-bf16")
    module, report = precision.check(spec, torch.nn.Identity(), None, lambda *a: [])
    assert report.max_relative_error is None
    assert report.parameter().startswith("not measured: inputs with variable dims")


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device; this machine has none")
def test_staging_from_the_pinned_arena_on_cuda(tmp_path):
    # Multi-process mode: requests arrive in the shared arena, which the executor pins.
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    repository = tmp_path / "models"
    write_model(repository, small_config("staged", log_dir, "KIND_GPU", max_inflight_batches="1"),
                GATED_MODEL)
    running = start_multiprocess_server(repository)
    try:
        params = config_parameters(running.address, "staged")
        assert params["input_staging"] == "queue" and params["buckets"] == "1,2,4,8"
        check_staging(running, log_dir)
        samples = scrape(running.metrics_url)
        # The device's pool is the model's arena alone: its plan and its staging room.
        assert sample(samples, "batchgate_pool_bytes_reserved", device="cuda:0") == \
            int(config_parameters(running.address, "staged")["device_pool_bytes"]) == \
            sample(samples, "batchgate_model_pool_bytes_reserved", model="staged") > 0
    finally:
        running.stop()


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device; this machine has none")
def test_a_pool_capped_by_a_fraction_of_the_device_holds_only_the_plan_on_cuda(tmp_path):
    repository = tmp_path / "models"
    _mlp(repository, "mlp_fp16", precision="amp-fp16")
    _free, total = torch.cuda.mem_get_info(0)
    running = start_server(repository, device_pool_fraction=0.02)
    try:
        reserved = sample(scrape(running.metrics_url), "batchgate_pool_bytes_reserved",
                          device="cuda:0")
        params = config_parameters(running.address, "mlp_fp16")
        # A cap, not a reservation: the pool holds the model's arena, sized from its plan.
        assert reserved == int(params["device_pool_bytes"]) < 0.02 * total
        assert reserved >= int(params["memory_plan_bytes"]) > 0
        assert 0 < float(params["precision_max_relative_error"]) < 2e-2
        assert int(params["activation_bytes"]) > 0
        x = np.random.default_rng(0).standard_normal((37, 512), dtype=np.float32)
        with Client(running.address, timeout_s=30) as client:
            out = client.infer("mlp_fp16", {"INPUT__0": x})["OUTPUT__0"]
        want = reference("mlp", x)
        assert np.abs(out - want).max() / np.abs(want).max() < 2e-2
    finally:
        running.stop()


async def test_after_a_timed_out_batch_the_instance_serves_on_fresh_buffers():
    # The abandoned call keeps its slot's buffers (it may still write them); the next batches
    # must get buffers of their own and come out right, before and after it returns.
    release = threading.Event()

    def hangs_on_13(x):
        if bool((x == 13).any()):
            release.wait(30)
            x.fill_(-1.0)  # the late call scribbles on its inputs
        return x * 2

    model = ServedModel(unit_spec(warmup=False, execution_timeout_ms=200), hangs_on_13,
                        pools=DevicePools(PoolSettings(1 << 20)))
    model.start()
    try:
        with pytest.raises(ModelExecutionError, match="execution_timeout_ms=200"):
            await infer_x(model, np.full((2, 2), 13.0, np.float32))
        np.testing.assert_array_equal(await infer_x(model, np.ones((2, 2), np.float32)),
                                      np.full((2, 2), 2.0, np.float32))
        release.set()
        for value in (3.0, 4.0, 5.0):
            np.testing.assert_array_equal(
                await infer_x(model, np.full((2, 2), value, np.float32)),
                np.full((2, 2), 2 * value, np.float32))
    finally:
        release.set()
        model.stop(5)
