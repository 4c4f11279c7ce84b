"""(c) throughput: in-process loops (fp32, amp, amp replayed as one CUDA graph) against the whole
gateway under load, and (e) the GPU busy % while each runs."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import sys
import tempfile
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from batchgate.bench.gpu_check.inprocess import inprocess_graph_rate, inprocess_rate
from batchgate.bench.gpu_check.machine import torchvision_problem
from batchgate.bench.gpu_check.nvml import NvmlSampler, busy_summary
from batchgate.bench.gpu_check.report import ERROR, INFO, SKIP, Budget, Report, chain
from batchgate.bench.gpu_check.samples import TOKEN_IDS_HIGH, build_from_source
from batchgate.bench.gpu_check.workloads import (ThroughputModel, ThroughputSettings,
                                                 throughput_models, write_model)

if TYPE_CHECKING:
    from batchgate.bench.harness.server import RunningServer


def section_throughput(report: Report, budget: Budget, settings: ThroughputSettings) -> None:
    import torch

    cuda = settings.device.startswith("cuda")
    nvml = NvmlSampler() if cuda else None
    if nvml is None:
        report.add("e", "NVML sampling", "no CUDA device: not sampled", SKIP)
    elif nvml.unavailable:
        report.add("e", "NVML sampling", nvml.unavailable, SKIP)
        report.unmeasured("busy", nvml.unavailable)

    repository = Path(tempfile.mkdtemp(prefix="gpu_check_repository_"))
    amp = f"amp-{settings.precision}"
    try:
        # (served name, check label, its in-process rate at the same precision and path)
        served: list[tuple[ThroughputModel, str, float]] = []
        for model in throughput_models():
            if model.name not in settings.models:
                continue
            problem = torchvision_problem() if model.name == "resnet50" else ""
            if not problem and budget.left() < 5 * settings.inprocess_s + 10:
                problem = "not run: over the section's budget"
            if problem:
                report.add("c", model.label, f"skipped: {problem}", SKIP)
                if model.name == "resnet50":
                    for target in ("amp", "gateway", "busy"):
                        report.unmeasured(target, f"ResNet-50 {problem}")
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
                if model.name == "resnet50":
                    for target in ("amp", "gateway", "busy"):
                        report.unmeasured(target, f"ResNet-50's in-process loop raised "
                                          f"{chain(exc)}")
                shutil.rmtree(repository / model.name, ignore_errors=True)
                shutil.rmtree(repository / graphed.name, ignore_errors=True)
                continue
            fp32 = rates["fp32"]["samples_per_s"]
            amp_rate = rates[settings.precision]["samples_per_s"]
            prefix = f"{model.name} in-process b{settings.batch}"
            report.add("c", f"{prefix} fp32", f"{fp32:,.0f} samples/s", INFO, samples_per_s=fp32)
            report.add("c", f"{prefix} {amp}",
                       f"{amp_rate:,.0f} samples/s ({amp_rate / fp32:.2f}x fp32)", INFO,
                       samples_per_s=amp_rate, speedup_vs_fp32=amp_rate / fp32,
                       target="amp" if model.name == "resnet50" else None, model=model.name)
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
                report.unmeasured("gateway", f"{model.name}: CUDA graphs need a CUDA device")
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
    from batchgate.bench.harness.server import start_in_thread

    # The whole server (``batchgate.server.frontend.app.Gateway``) on a thread here: its models'
    # statistics and load reports are read directly, the load comes from other processes.
    running = start_in_thread(repository, timeout_s=max(budget.left(), 10), metrics_port=None,
                              gc_freeze=True)
    try:
        states = {e.name: e for e in running.gateway.repository.index()}
        for model, check, inprocess in served:
            entry = states.get(model.name)
            if entry is None or entry.state != "READY":
                reason = entry.reason if entry is not None else "not in the repository"
                report.add("c", check, f"model not READY: {reason}", ERROR)
                gateway_unmeasured(report, model, f"{model.name} not READY: {reason}")
                continue
            if budget.left() < settings.warmup_s + settings.load_s + 10:
                report.add("c", check, "not run: over the section's budget", SKIP)
                gateway_unmeasured(report, model, f"{check}: over (c)'s budget")
                continue
            try:
                one_load(report, settings, running, model, inprocess, check, nvml)
            except Exception as exc:
                sys.stderr.write(traceback.format_exc())
                report.add("c", check, f"raised {chain(exc)}", ERROR)
                gateway_unmeasured(report, model, f"{check} raised {chain(exc)}")
    finally:
        running.stop()


def gateway_unmeasured(report: Report, model: ThroughputModel, reason: str) -> None:
    """The targets a gateway load would have measured, said unmeasured and why."""
    if model.name.endswith("_graphs"):
        report.unmeasured("gateway", reason)
    if model.name.startswith("resnet50"):
        report.unmeasured("busy", reason)


def one_load(report: Report, settings: ThroughputSettings, running: RunningServer,
             model: ThroughputModel, inprocess_amp: float, check: str,
             nvml: NvmlSampler | None) -> None:
    # grpcio is needed from here on only: the other sections run without it.
    from batchgate.bench.gpu_check.load import ClosedLoop, closed_loop

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
    graphed = model.name.endswith("_graphs")
    report.add("c", check, text, INFO if errors == 0 else ERROR, samples_per_s=rate,
               target="gateway" if graphed else None, model=model.name,
               ratio_vs_inprocess=ratio, inprocess_samples_per_s=inprocess_amp,
               requests_ok=result.ok, errors=errors, errors_by_status=result.figures["errors"],
               mean_batch=mean_batch, p50_ms=p50, p99_ms=p99, first_error=first_error,
               graphs=graphs, load_processes=settings.processes,
               concurrency=settings.concurrency, samples_per_request=1,
               seconds=settings.load_s, warmup_s=settings.warmup_s)
    if nvml is not None and not nvml.unavailable:
        text, figures = busy_summary(nvml.between(*result.window))
        report.add("e", f"{model.name} under gateway load", text, INFO, model=model.name,
                   target="busy" if model.name.startswith("resnet50") else None, **figures)
