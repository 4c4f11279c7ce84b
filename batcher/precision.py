"""How a model runs in its precision, and the check at load that the precision is safe to serve.

Precisions (``batchgate.batcher.spec.PRECISIONS``):

- ``fp32``: as built;
- ``amp-fp16`` / ``amp-bf16``: the forward under ``torch.autocast`` (weights stay fp32, matmuls
  and convolutions run in the reduced type). bf16 autocast works on the CPU too;
- ``fp16-weights``: the module converted with ``.half()`` and floating inputs cast to fp16 — half
  the weight memory, no per-op casts. On the CPU it works where torch has fp16 kernels (torch
  2.13: linear, convolution, layer norm, attention) and is slow; a model with an op that has
  none fails its load with that op's error, not at serving time.

Outputs always go back in their configured datatype. ``check`` runs at load: the model in fp32
and in its precision on the same seeded inputs, the max relative error (max |out - ref| / max
|ref| over every output) is logged and reported in the model's config parameters. The load fails
when a reduced precision produces non-finite outputs where fp32 does not (an overflow), or an
error above its mode's bound (``TOLERANCES``: fp16 has 10 mantissa bits, bf16 7, so bf16's bound
is the looser). The fp32 reference runs with TF32 off (``fp32_exact``): on Ampere and later a
matmul in TF32 carries bf16-like error itself, and the reference would hide part of the error
it is there to measure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import structlog
import torch

from batchgate.batcher.errors import LoadError, exception_summary
from batchgate.batcher.spec import ModelSpec

log = structlog.get_logger(__name__)

AUTOCAST_DTYPES = {"amp-fp16": torch.float16, "amp-bf16": torch.bfloat16}
CHECK_SEED = 0
CHECK_ROWS = 4
# The largest max relative error against fp32 a precision may show at load.
TOLERANCES = {"amp-fp16": 2e-2, "fp16-weights": 2e-2, "amp-bf16": 5e-2}


@contextlib.contextmanager
def fp32_exact() -> Any:
    """TF32 off for matmuls and cuDNN convolutions while the fp32 reference runs."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = cudnn


def autocast(precision: str, device_type: str, *, capturing: bool = False
             ) -> contextlib.AbstractContextManager:
    """The autocast context of ``precision`` (a null context for fp32 and fp16 weights).

    Under CUDA-graph capture the cast cache must be off: cached casts are freed when the
    context exits, while the graph would keep reading them.
    """
    dtype = AUTOCAST_DTYPES.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype, cache_enabled=not capturing)


def cast_inputs(tensors: Sequence[Any], precision: str) -> list[Any]:
    """Floating inputs as fp16 for ``fp16-weights``; unchanged otherwise."""
    if precision != "fp16-weights":
        return list(tensors)
    return [t.half() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            for t in tensors]


def convert(module: Any, precision: str) -> Any:
    """The module to serve: converted to fp16 for ``fp16-weights``, else as it is."""
    if precision == "fp16-weights":
        if not isinstance(module, torch.nn.Module):
            raise LoadError("precision fp16-weights needs a torch.nn.Module, got "
                            f"{type(module).__name__}")
        return module.half()
    return module


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """What ``check`` found: the error against fp32, or why it was not measured."""

    precision: str
    max_relative_error: float | None
    note: str = ""

    def parameter(self) -> str:
        """The value reported as the config parameter ``precision_max_relative_error``."""
        if self.max_relative_error is None:
            return f"not measured: {self.note}"
        return f"{self.max_relative_error:.3e}"


def seeded_inputs(spec: ModelSpec) -> list[np.ndarray] | None:
    """Inputs for the check: normal floats, 0/1 integers (valid indices), random booleans; a
    few rows. None when an input has variable dims or is BYTES."""
    if not all(t.fixed() and t.datatype != "BYTES" for t in spec.inputs):
        return None
    rng = np.random.default_rng(CHECK_SEED)
    lead = (min(CHECK_ROWS, spec.max_batch_size),) if spec.max_batch_size else ()
    arrays = []
    for tensor in spec.inputs:
        shape = (*lead, *tensor.dims)
        if tensor.datatype in ("FP16", "FP32", "FP64"):
            array = rng.standard_normal(shape).astype(tensor.numpy_dtype)
        elif tensor.datatype == "BF16":  # raw bits: the top half of float32's
            array = (rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16
                     ).astype(np.uint16)
        elif tensor.datatype == "BOOL":
            array = rng.integers(0, 2, shape).astype(bool)
        else:
            array = rng.integers(0, 2, shape).astype(tensor.numpy_dtype)
        arrays.append(array)
    return arrays


def check(spec: ModelSpec, module: Any, inputs: list[np.ndarray] | None,
          run: Callable[[Any, list[np.ndarray], str], list[torch.Tensor]],
          unmeasured: str | None = None,
          converter: Callable[[Any, str], Any] | None = None) -> tuple[Any, PrecisionReport]:
    """Compare ``module`` in ``spec.precision`` with fp32 on ``inputs``; returns the module to
    serve (converted for fp16 weights) and the report. ``run(module, inputs, precision)`` runs
    one forward on the model's device and returns its outputs; ``unmeasured`` says why, when
    ``inputs`` is None; ``converter(module, precision)`` makes the module to serve (default:
    ``convert``; the server's makes fp16 weights in the model's weights pool)."""
    make = converter if converter is not None else convert
    precision = spec.precision
    if precision == "fp32":
        return module, PrecisionReport(precision, 0.0, "fp32 is the reference")
    if inputs is None:
        report = PrecisionReport(
            precision, None,
            unmeasured or "inputs with variable dims or BYTES, and no model_warmup")
        log.info("precision_not_checked", model=spec.name, precision=precision,
                 reason=report.note)
        return make(module, precision), report
    try:
        with fp32_exact():
            reference = [t.float().cpu() for t in run(module, inputs, "fp32")]
    except Exception as exc:
        raise LoadError(f"model {spec.name!r}: the fp32 reference run of the precision check "
                        f"raised {exception_summary(exc)}") from exc
    module = make(module, precision)
    try:
        outputs = [t.float().cpu() for t in run(module, inputs, precision)]
    except Exception as exc:
        raise LoadError(
            f"model {spec.name!r}: precision {precision} does not run on {spec.device}: "
            f"{exception_summary(exc)}; use fp32 or amp-bf16") from exc
    error = _relative_error(reference, outputs)
    if not math.isfinite(error):
        raise LoadError(
            f"model {spec.name!r}: precision {precision} gives non-finite outputs on seeded "
            "inputs where fp32 does not (an overflow); use amp-bf16 or fp32")
    bound = TOLERANCES[precision]
    if error > bound:
        raise LoadError(
            f"model {spec.name!r}: precision {precision} differs from fp32 by a max relative "
            f"error of {error:.3e} on seeded inputs, above its bound of {bound:.0e}; use fp32 "
            "or another precision")
    log.info("precision_checked", model=spec.name, precision=precision, device=spec.device,
             max_relative_error=error, bound=bound)
    return module, PrecisionReport(precision, error)


def _relative_error(reference: list[torch.Tensor], outputs: list[torch.Tensor]) -> float:
    """max |out - ref| / max |ref| over every output; inf when an output is non-finite where
    the reference is finite; 0 when the reference is all zeros and so are the outputs."""
    worst = scale = 0.0
    for ref, out in zip(reference, outputs):
        if ref.shape != out.shape:
            raise LoadError(f"the precision check's outputs have shape {tuple(out.shape)}, "
                            f"fp32's {tuple(ref.shape)}")
        finite = torch.isfinite(ref)
        if not bool(torch.isfinite(out)[finite].all()):
            return math.inf
        if bool(finite.any()):
            worst = max(worst, float((out - ref)[finite].abs().max()))
            scale = max(scale, float(ref[finite].abs().max()))
    if scale == 0.0:
        return 0.0 if worst == 0.0 else math.inf
    return worst / scale

