"""(a) correctness of every GPU path: the example models served through ``ServedModel.infer``
in each variant, every answer compared with the same module on the CPU in fp32."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np

from batchgate.bench.gpu_check.machine import tf32_flags
from batchgate.bench.gpu_check.report import ERROR, FAIL, PASS, Budget, Report, chain
from batchgate.bench.gpu_check.samples import ROOT, has_convolutions, random_array

EXAMPLE_MODELS = ("mlp", "cnn", "encoder")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One GPU path of (a): a precision and the ModelSpec fields that select the path."""

    label: str
    precision: str
    fields: tuple[tuple[str, Any], ...] = ()


# On a GPU a model's defaults are buckets pow2 and input_staging queue: the plain rows run the
# staged, padded path; one row turns staging off, one turns CUDA graphs on.
GPU_VARIANTS = (
    Variant("fp32", "fp32"),
    Variant("amp-fp16", "amp-fp16"),
    Variant("amp-bf16", "amp-bf16"),
    Variant("fp16-weights", "fp16-weights"),
    Variant("amp-fp16+graphs", "amp-fp16", (("cuda_graphs", True),)),
    Variant("fp32 staged-at-batch", "fp32", (("input_staging", "batch"),)),
)
# fp16 autocast on the CPU is neither fast nor served there; "pow2" means default_buckets.
CPU_VARIANTS = (
    Variant("fp32", "fp32"),
    Variant("amp-bf16", "amp-bf16"),
    Variant("fp32 buckets+staging", "fp32", (("buckets", "pow2"), ("input_staging", "queue"))),
)
TOLERANCES = {"fp32": 1e-4, "amp-fp16": 2e-2, "amp-bf16": 5e-2,  # max |err| / max |ref|
              "fp16-weights": 2e-2}
POOL_BYTES_A = 512 << 20  # the cap of the device pool the served models of (a) are admitted into
TF32_TOLERANCE = 2e-3  # fp32 where TF32 may apply: 10-bit mantissa
REQUESTS_PER_SIZE = 4  # of each size 1, 7 and max, all sent at once
AUTOCAST_INERT_BELOW = 1e-6  # an fp16/bf16 error this small means autocast did not apply
SERVE_TIMEOUT_S = 60.0


def section_correctness(report: Report, budget: Budget, device: str,
                        variants: Sequence[Variant], models: Sequence[str]) -> None:
    from batchgate.batcher.buckets import default_buckets
    from batchgate.batcher.loading import find_artifact, load_module
    from batchgate.batcher.memory import DevicePools, PoolSettings
    from batchgate.server.config.model_config import read_model_config
    from batchgate.server.config.model_spec import model_spec_from_config

    cuda = device.startswith("cuda")
    pools = DevicePools(PoolSettings(POOL_BYTES_A))
    # TF32 unknown (None) counts as on: a false FAIL would cost a GPU run to tell apart.
    tf32 = {k: v is not False for k, v in tf32_flags().items()} if cuda else {}
    rng = np.random.default_rng()  # fresh inputs every run: any valid input must pass
    for name in models:
        model_dir = ROOT / "models" / name
        try:
            config, _ = read_model_config(model_dir)
            filename = config.default_model_filename or None
            version_dir = max((d for d in model_dir.iterdir()
                               if d.name.isdigit() and find_artifact(d, filename)),
                              key=lambda d: int(d.name))
            base = model_spec_from_config(config, version_dir.name, cuda_available=cuda)
            parameters = {k: v.string_value for k, v in config.parameters.items()}
            reference = load_module(version_dir, filename=filename, parameters=parameters,
                                    device="cpu")
        except Exception as exc:
            sys.stderr.write(traceback.format_exc())
            report.add("a", name, f"could not load: {chain(exc)}", ERROR)
            continue
        max_batch = base.batching.max_batch_size
        if max_batch < 1:
            report.add("a", name, "max_batch_size 0: this check needs a batching model", ERROR)
            continue
        sizes = sorted({1, min(7, max_batch), max_batch})
        for variant in variants:
            check = f"{name} {variant.label} on {device}"
            if budget.over():
                report.add("a", check, "not run: over the section's budget", FAIL)
                continue
            fields = dict(variant.fields)
            if fields.get("buckets") == "pow2":
                fields["buckets"] = default_buckets(max_batch)
            spec = dataclasses.replace(base, device=device, precision=variant.precision,
                                       **fields)
            tolerance = TOLERANCES[variant.precision]
            if variant.precision == "fp32" and (tf32.get("matmul") or (
                    tf32.get("cudnn") and has_convolutions(reference))):
                tolerance = TF32_TOLERANCE
            try:
                # A module of its own: fp16 weights convert the module they are given.
                served_module = load_module(version_dir, filename=filename,
                                            parameters=parameters, device=device)
                row = correctness_case(spec, served_module, reference, sizes, tolerance, rng,
                                       pools)
            except Exception as exc:
                sys.stderr.write(traceback.format_exc())
                report.add("a", check, f"raised {chain(exc)}", ERROR)
                continue
            report.add("a", check, row.pop("result"), row.pop("status"), **row)


def correctness_case(spec: Any, module: Any, reference: Any, sizes: list[int], tolerance: float,
                     rng: np.random.Generator, pools: Any) -> dict[str, Any]:
    """Serve requests of ``sizes`` rows (REQUESTS_PER_SIZE of each, all at once) through a
    ServedModel of ``spec`` admitted into ``pools``; compare every answer with ``reference`` run
    on the CPU alone. CUDA graphs that were asked for but not captured fail the row."""
    import torch

    from batchgate.batcher.forward import unpack_outputs
    from batchgate.batcher.model import ServedModel
    from batchgate.batcher.request import InferenceRequest

    requests_arrays = [
        [random_array(rng, (size, *t.dims), t.numpy_dtype.name) for t in spec.inputs]
        for size in sizes * REQUESTS_PER_SIZE
    ]
    rng.shuffle(requests_arrays)

    served = ServedModel(spec, module, pools=pools)
    served.start()
    load_report = dict(served.load_report)
    try:
        async def serve_all() -> list[dict[str, np.ndarray]]:
            requests = [InferenceRequest(arrays, batch_size=arrays[0].shape[0])
                        for arrays in requests_arrays]
            return await asyncio.wait_for(
                asyncio.gather(*(served.infer(r) for r in requests)), SERVE_TIMEOUT_S)

        answers = asyncio.run(serve_all())
    finally:
        served.stop(5.0)
    batches = served.stats.snapshot().execution_count

    worst_abs = 0.0
    ref_max = 0.0
    finite = True
    for arrays, answer in zip(requests_arrays, answers):
        with torch.inference_mode():
            expected = unpack_outputs(reference(*[torch.from_numpy(a.copy()) for a in arrays]),
                                      spec.outputs, spec.name)
        for out_spec, want in zip(spec.outputs, expected):
            want = want.float().numpy()
            got = np.asarray(answer[out_spec.name], dtype=np.float32)
            if got.shape != want.shape:
                return {"result": f"output {out_spec.name} has shape {got.shape}, "
                                  f"the CPU reference {want.shape}", "status": FAIL}
            finite = finite and bool(np.isfinite(got).all())
            worst_abs = max(worst_abs, float(np.abs(got - want).max(initial=0.0)))
            ref_max = max(ref_max, float(np.abs(want).max(initial=0.0)))
    relative = worst_abs / ref_max if ref_max > 0 else float("inf")
    graphs = load_report.get("cuda_graphs_status", "off")
    captured = not spec.cuda_graphs or graphs.startswith("captured")
    ok = finite and relative <= tolerance and captured
    notes = []
    if not captured:
        notes.append(f"CUDA graphs not captured: {graphs}")
    if not finite:
        notes.append("non-finite outputs")
    if spec.precision != "fp32" and relative < AUTOCAST_INERT_BELOW:
        notes.append("error at fp32 level: did autocast apply?")
    if batches >= len(requests_arrays):
        notes.append("no two requests shared a batch")
    result = (f"max|err| {worst_abs:.2e}, rel {relative:.2e} <= {tolerance:.0e}? "
              f"{len(requests_arrays)} requests (sizes {'/'.join(map(str, sizes))}) "
              f"in {batches} batches" + ("; " + "; ".join(notes) if notes else ""))
    return {"result": result, "status": PASS if ok else FAIL, "max_abs_error": worst_abs,
            "max_relative_error": relative, "tolerance": tolerance, "max_abs_reference": ref_max,
            "requests": len(requests_arrays), "batches": batches, "sizes": sizes,
            "finite": finite, "load_report": load_report, "buckets": list(spec.buckets),
            "input_staging": spec.input_staging}


