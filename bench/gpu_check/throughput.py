"""(c) throughput: in-process loops (fp32, amp, amp replayed as one CUDA graph) against the whole
gateway under load, and (e) the GPU busy % while each runs."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.gpu_check.machine import torchvision_problem
from bench.gpu_check.nvml import NvmlSampler, busy_summary
from bench.gpu_check.report import ERROR, INFO, SKIP, Budget, Report, chain
from bench.gpu_check.samples import (ROOT, TOKEN_IDS_HIGH, autocast_for, build_from_source,
                                     random_tensor, synchronize)

if TYPE_CHECKING:
    from tests.support.harness import RunningServer

THROUGHPUT_BATCH = 64
INPROCESS_SECONDS = 2.0
# A traced module's profiling executor runs its first calls (about a dozen) far slower.
INPROCESS_WARMUP_CALLS = 20
LOAD_SECONDS = 8.0
LOAD_PROCESSES = 8  # the client's per-request Python work must not be the bottleneck
LOAD_CONCURRENCY = 128  # requests in flight, over all load processes
LOAD_WARMUP_S = 1.0  # the load's first second is not measured (ramp-up), nor sampled by NVML
GATEWAY_QUEUE_DELAY_US = 1000

BIG_ENCODER_SOURCE = '''\
"""gpu_check's bigger encoder: INT64 token ids [128] -> mean-pooled FP32 [512].

d_model 512, 6 layers, 8 heads, feed-forward 2048, vocabulary 8192; weights from a fixed seed.
"""

import torch
from torch import nn

SEED = 20240515
VOCAB = 8192
SEQUENCE = 128
D_MODEL = 512


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, D_MODEL)
        self.positions = nn.Parameter(torch.randn(SEQUENCE, D_MODEL) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model=D_MODEL, nhead=8, dim_feedforward=4 * D_MODEL, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=6, enable_nested_tensor=False)

    def forward(self, ids):
        return self.encoder(self.tokens(ids) + self.positions).mean(dim=1)


def build_model(parameters):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = Encoder()
    return model.eval()
'''

RESNET50_SOURCE = '''\
"""ResNet-50 with random weights (nothing is downloaded): FP32 [3, 224, 224] -> [1000]."""

import torch
import torchvision


def build_model(parameters):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(20240516)
        model = torchvision.models.resnet50(weights=None)
    return model.eval()
'''


@dataclasses.dataclass(frozen=True)
class ThroughputModel:
    """A model of section (c): where its ``model.py`` comes from and its one input and output."""

    name: str
    label: str
    source: Path | str  # a model.py to copy, or its text
    input_dims: tuple[int, ...]
    input_dtype: str  # numpy dtype name
    output_dims: tuple[int, ...]


def throughput_models() -> list[ThroughputModel]:
    return [
        ThroughputModel("encoder", "encoder (example: d64 x2, seq 16, traced)",
                        ROOT / "models" / "encoder" / "1" / "model.py", (16,), "int64", (64,)),
        ThroughputModel("encoder_big", "encoder d512 x6, seq 128 (eager)",
                        BIG_ENCODER_SOURCE, (128,), "int64", (512,)),
        ThroughputModel("resnet50", "ResNet-50 (torchvision, random weights)",
                        RESNET50_SOURCE, (3, 224, 224), "float32", (1000,)),
    ]




@dataclasses.dataclass(frozen=True)
class ThroughputSettings:
    device: str
    precision: str  # the amp precision compared with fp32 and served by the gateway
    batch: int
    inprocess_s: float
    load_s: float
    processes: int
    concurrency: int
    warmup_s: float
    models: tuple[str, ...]


GPU_THROUGHPUT = ThroughputSettings("cuda:0", "fp16", THROUGHPUT_BATCH, INPROCESS_SECONDS,
                                    LOAD_SECONDS, LOAD_PROCESSES, LOAD_CONCURRENCY, LOAD_WARMUP_S,
                                    ("encoder", "encoder_big", "resnet50"))
# The same harness on a CPU, small enough to prove its code paths in seconds.
CPU_THROUGHPUT = ThroughputSettings("cpu", "bf16", 8, 0.3, 1.5, 2, 8, 0.3, ("encoder",))


def inprocess_rate(module: Any, model: ThroughputModel, settings: ThroughputSettings,
                   precision: str) -> dict[str, Any]:
    """Samples/s of ``module`` called back to back on one fixed batch already on the device."""
    import torch

    x = random_tensor((settings.batch, *model.input_dims), model.input_dtype, settings.device)
    with torch.inference_mode(), autocast_for(precision, settings.device):
        for _ in range(INPROCESS_WARMUP_CALLS):
            module(x)
        synchronize(settings.device)
        started = time.monotonic()  # the NVML samples' clock
        calls = 0
        while True:
            module(x)
            calls += 1
            # The host runs ahead of the device; the synchronize below settles the account.
            if calls % 4 == 0 and time.monotonic() - started >= settings.inprocess_s:
                break
        synchronize(settings.device)
        wall = time.monotonic() - started
    return {"samples_per_s": calls * settings.batch / wall, "calls": calls, "seconds": wall,
            "window": (started, started + wall)}


def inprocess_graph_rate(module: Any, model: ThroughputModel, settings: ThroughputSettings,
                         precision: str) -> dict[str, Any]:
    """Samples/s of one CUDA graph of ``module`` at the batch, replayed back to back."""
    import torch

    from batcher import precision as precisions

    amp = f"amp-{precision}"
    x = random_tensor((settings.batch, *model.input_dims), model.input_dtype, settings.device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode(), autocast_for(precision, settings.device):
        for _ in range(INPROCESS_WARMUP_CALLS):
            module(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph), \
            precisions.autocast(amp, "cuda", capturing=True):
        module(x)
    synchronize(settings.device)
    started = time.monotonic()
    calls = 0
    while True:
        graph.replay()
        calls += 1
        if calls % 4 == 0 and time.monotonic() - started >= settings.inprocess_s:
            break
    synchronize(settings.device)
    wall = time.monotonic() - started
    return {"samples_per_s": calls * settings.batch / wall, "calls": calls, "seconds": wall}


def write_model(repository: Path, model: ThroughputModel, settings: ThroughputSettings,
                graphs: bool = False) -> Path:
    """``repository/<name>/1/model.py`` and its config.pbtxt, written from a ``ModelConfig``."""
    from google.protobuf import text_format

    from protos import model_config_pb2 as mc

    folder = repository / model.name
    (folder / "1").mkdir(parents=True)
    target = folder / "1" / "model.py"
    if isinstance(model.source, Path):
        shutil.copyfile(model.source, target)
    else:
        target.write_text(model.source)
    config = mc.ModelConfig(
        name=model.name, backend="pytorch", max_batch_size=settings.batch,
        input=[mc.ModelInput(name="INPUT__0", dims=model.input_dims,
                             data_type={"int64": mc.TYPE_INT64,
                                        "float32": mc.TYPE_FP32}[model.input_dtype])],
        output=[mc.ModelOutput(name="OUTPUT__0", data_type=mc.TYPE_FP32,
                               dims=model.output_dims)],
        dynamic_batching=mc.ModelDynamicBatching(
            preferred_batch_size=[settings.batch],
            max_queue_delay_microseconds=GATEWAY_QUEUE_DELAY_US),
        instance_group=[mc.ModelInstanceGroup(
            count=1, kind=(mc.ModelInstanceGroup.KIND_GPU if settings.device.startswith("cuda")
                           else mc.ModelInstanceGroup.KIND_CPU))])
    config.parameters["precision"].string_value = settings.precision
    config.parameters["cuda_graphs"].string_value = str(graphs).lower()
    (folder / "config.pbtxt").write_text(text_format.MessageToString(config))
    return target


def section_throughput(report: Report, budget: Budget, settings: ThroughputSettings) -> None:
    import torch

    cuda = settings.device.startswith("cuda")
    nvml = NvmlSampler() if cuda else None
    if nvml is None:
        report.add("e", "NVML sampling", "no CUDA device: not sampled", SKIP)
    elif nvml.unavailable:
        report.add("e", "NVML sampling", nvml.unavailable, SKIP)

    repository = Path(tempfile.mkdtemp(prefix="gpu_check_repository_"))
    amp = f"amp-{settings.precision}"
    try:
        # (served name, check label, its in-process rate at the same precision and path)
        served: list[tuple[ThroughputModel, str, float]] = []
        for model in throughput_models():
            if model.name not in settings.models:
                continue
            problem = torchvision_problem() if model.name == "resnet50" else ""
            if problem:
                report.add("c", model.label, f"skipped: {problem}", SKIP)
                continue
            if budget.left() < 5 * settings.inprocess_s + 10:
                report.add("c", model.label, "not run: over the section's budget", SKIP)
                continue
            graphed = dataclasses.replace(model, name=f"{model.name}_graphs")
            try:
                path = write_model(repository, model, settings)
                module = build_from_source(path, settings.device)
                rates = {p: inprocess_rate(module, model, settings, p)
                         for p in ("fp32", settings.precision)}
                if cuda:
                    write_model(repository, graphed, settings, graphs=True)
                    rates["graphs"] = inprocess_graph_rate(module, model, settings,
                                                           settings.precision)
                # The amp loop again, sampled by NVML: the busy % of the in-process ceiling.
                if nvml is not None and not nvml.unavailable:
                    with nvml:
                        again = inprocess_rate(module, model, settings, settings.precision)
                    text, figures = busy_summary(nvml.between(*again["window"]))
                    report.add("e", f"{model.name} in-process loop (reference)", text, INFO,
                               **figures)
                del module
            except Exception as exc:
                sys.stderr.write(traceback.format_exc())
                report.add("c", model.label, f"in-process loop raised {chain(exc)}", ERROR)
                shutil.rmtree(repository / model.name, ignore_errors=True)
                shutil.rmtree(repository / graphed.name, ignore_errors=True)
                continue
            fp32 = rates["fp32"]["samples_per_s"]
            amp_rate = rates[settings.precision]["samples_per_s"]
            prefix = f"{model.name} in-process b{settings.batch}"
            report.add("c", f"{prefix} fp32", f"{fp32:,.0f} samples/s", INFO, samples_per_s=fp32)
            report.add("c", f"{prefix} {amp}",
                       f"{amp_rate:,.0f} samples/s ({amp_rate / fp32:.2f}x fp32)", INFO,
                       samples_per_s=amp_rate, speedup_vs_fp32=amp_rate / fp32)
            served.append((model, f"{model.name} gateway {amp} c{settings.concurrency}",
                           amp_rate))
            if "graphs" in rates:
                graph_rate = rates["graphs"]["samples_per_s"]
                report.add("c", f"{prefix} {amp}+graphs",
                           f"{graph_rate:,.0f} samples/s ({graph_rate / fp32:.2f}x fp32, "
                           f"{graph_rate / amp_rate:.2f}x eager {amp})", INFO,
                           samples_per_s=graph_rate, speedup_vs_fp32=graph_rate / fp32)
                served.append((graphed,
                               f"{model.name} gateway {amp}+graphs c{settings.concurrency}",
                               graph_rate))
            else:
                report.add("c", f"{prefix} {amp}+graphs", "needs a CUDA device", SKIP)
        if cuda:
            torch.cuda.empty_cache()
        if not served:
            return
        gateway_load(report, budget, settings, repository, served, nvml)
    finally:
        shutil.rmtree(repository, ignore_errors=True)


def gateway_load(report: Report, budget: Budget, settings: ThroughputSettings, repository: Path,
                 served: list[tuple[ThroughputModel, str, float]],
                 nvml: NvmlSampler | None) -> None:
    from tests.support.harness import start_in_thread

    # The whole server (``server.app.Gateway``) on a thread here: its models' statistics and
    # load reports are read directly, the load comes from other processes.
    running = start_in_thread(repository, timeout_s=max(budget.left(), 10), metrics_port=None,
                              gc_freeze=True)
    try:
        states = {e.name: e for e in running.gateway.repository.index()}
        for model, check, inprocess in served:
            entry = states.get(model.name)
            if entry is None or entry.state != "READY":
                reason = entry.reason if entry is not None else "not in the repository"
                report.add("c", check, f"model not READY: {reason}", ERROR)
                continue
            if budget.left() < settings.warmup_s + settings.load_s + 10:
                report.add("c", check, "not run: over the section's budget", SKIP)
                continue
            try:
                one_load(report, settings, running, model, inprocess, check, nvml)
            except Exception as exc:
                sys.stderr.write(traceback.format_exc())
                report.add("c", check, f"raised {chain(exc)}", ERROR)
    finally:
        running.stop()


def one_load(report: Report, settings: ThroughputSettings, running: RunningServer,
             model: ThroughputModel, inprocess_amp: float, check: str,
             nvml: NvmlSampler | None) -> None:
    # grpcio is needed from here on only: the other sections run without it.
    from bench.gpu_check.load import ClosedLoop, closed_loop

    served_model = running.gateway.repository.get(model.name)
    load = ClosedLoop(concurrency=settings.concurrency, processes=settings.processes,
                      seconds=settings.load_s, warmup_s=settings.warmup_s,
                      int_high=TOKEN_IDS_HIGH)
    sampling = nvml if nvml is not None and not nvml.unavailable else contextlib.nullcontext()
    before = served_model.stats.snapshot()
    with sampling:
        result = closed_loop(running.address, model.name, load)
    after = served_model.stats.snapshot()
    rate = result.samples_per_s
    errors = result.errors
    # The warm-up's batches are counted too: the mean batch is the whole load's.
    batches = after.execution_count - before.execution_count
    samples = after.inference_count - before.inference_count
    mean_batch = samples / batches if batches else 0.0
    p50, p99 = result.latency_ms("p50"), result.latency_ms("p99")
    first_error = result.first_error
    ratio = rate / inprocess_amp if inprocess_amp else 0.0
    graphs = served_model.load_report.get("cuda_graphs_status", "off")
    text = (f"{rate:,.0f} samples/s = {ratio:.2f} x in-process; mean batch {mean_batch:.1f}; "
            f"p50 {p50:.1f} ms, p99 {p99:.1f} ms; {errors} errors"
            + (f" (most: {first_error})" if first_error else "")
            + (f"; graphs {graphs}" if graphs != "off" else ""))
    report.add("c", check, text, INFO if errors == 0 else ERROR, samples_per_s=rate,
               ratio_vs_inprocess=ratio, inprocess_samples_per_s=inprocess_amp,
               requests_ok=result.ok, errors=errors, errors_by_status=result.figures["errors"],
               mean_batch=mean_batch, p50_ms=p50, p99_ms=p99, first_error=first_error,
               graphs=graphs, load_processes=settings.processes,
               concurrency=settings.concurrency, samples_per_request=1,
               seconds=settings.load_s, warmup_s=settings.warmup_s)
    if nvml is not None and not nvml.unavailable:
        text, figures = busy_summary(nvml.between(*result.window))
        report.add("e", f"{model.name} under gateway load", text, INFO, **figures)
