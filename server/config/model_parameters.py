"""A model's ``parameters`` keys: their one definition, and how their values are read.

``parameters: { key: "K" value: { string_value: "V" } }`` entries that batchgate reads are the
:data:`PARAMETERS` (batchgate's own) and :data:`TRITON_PARAMETERS` (Triton's PyTorch backend
keys it honours); each entry says the values the key takes, its default and what it sets, and
the manual's table of parameters is tested against them. Every entry, known or not, is also
handed to a ``model.py``'s ``build_model(parameters)``.

:class:`ModelParameters` reads one model's values, a key left unset or empty taking its default
from the table, and refuses a bad value with a ``LoadError`` that names the key and the value.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from batchgate.batcher.buckets import default_buckets
from batchgate.batcher.errors import LoadError
from batchgate.batcher.spec import BATCH_POLICIES, INPUT_STAGING, PRECISION_ALIASES, PRECISIONS


@dataclasses.dataclass(frozen=True)
class Parameter:
    """One ``parameters`` key."""

    key: str
    type: str
    """The values it takes, as a config writes them."""
    default: str | None
    """Its value when unset, as a config writes it; None where it depends on the device or on
    other settings (``description`` says how)."""
    description: str
    """What it sets, in one line."""
    choices: tuple[str, ...] = ()
    """The accepted values of a key that takes one of a few words."""


def _table(*parameters: Parameter) -> Mapping[str, Parameter]:
    return {parameter.key: parameter for parameter in parameters}


PARAMETERS: Mapping[str, Parameter] = _table(
    Parameter(
        "precision", " | ".join(PRECISIONS), "fp32",
        "autocast to fp16 or bf16, or the weights converted to fp16 (fp16 and bf16 are "
        "accepted for amp-fp16 and amp-bf16)",
        choices=(*PRECISIONS, *PRECISION_ALIASES),
    ),
    Parameter(
        "buckets", "a list (1,4,16,64) | pow2 | none", None,
        "batch sizes a batch is padded up to (pow2: 1, 2, 4, ... up to max_batch_size); "
        "default pow2 on a GPU, none on the CPU",
    ),
    Parameter("cuda_graphs", "true | false", "false", "capture a CUDA graph per bucket at load"),
    Parameter(
        "input_staging", " | ".join(INPUT_STAGING), None,
        "copy a request's inputs to the device as soon as it is queued, or when its batch is "
        "assembled; default queue on a GPU, batch on the CPU",
        choices=INPUT_STAGING,
    ),
    Parameter(
        "min_batch_size", "integer >= 0", None,
        "MIN_BATCH: with a queue delay, dispatch once this many samples wait; default the "
        "largest preferred_batch_size, else max_batch_size",
    ),
    Parameter(
        "max_inflight_batches", "integer >= 1", None,
        "batches in flight per instance, one assembling while one computes; default 2 on a "
        "GPU, 1 on the CPU; always 1 under batch_policy deadline",
    ),
    Parameter("warmup", "true | false", "true", "run the model before reporting it ready"),
    Parameter(
        "execution_timeout_ms", "integer >= 0", "0",
        "a batch still running after this long fails (INTERNAL) and the instance goes on on a "
        "fresh thread; 0 = no limit (costs one thread hand-off per batch)",
    ),
    Parameter(
        "batch_policy", " | ".join(BATCH_POLICIES), "fifo",
        "arrival order, or earliest deadline first with batches sized from the latency profile",
        choices=BATCH_POLICIES,
    ),
    Parameter(
        "slo_ms", "number >= 0", "0",
        "the model's latency objective in ms: target of the SLO attainment metric and, under "
        "the deadline policy, the scheduling deadline of requests without an earlier one "
        "(0: none)",
    ),
    Parameter(
        "response_margin_ms", "number >= 0", "5",
        "ms kept free before every deadline (deadline policy, admission control) for an answer "
        "to reach its client, on top of the delivery measured inside the server",
    ),
    Parameter(
        "admission", "true | false", "true",
        "refuse at once (RESOURCE_EXHAUSTED) a request whose estimated queue wait exceeds its "
        "deadline",
    ),
    Parameter(
        "device_share_weight", "number >= 0", "0",
        "> 0: run batches in weighted turns with the other models on the device that set one "
        "(0: no turns)",
    ),
)

# Keys of Triton's PyTorch backend that batchgate honours.
TRITON_PARAMETERS: Mapping[str, Parameter] = _table(
    Parameter(
        "INTRA_OP_THREAD_COUNT", "integer >= 0", "0",
        "threads inside one operator, set in each executor thread (0: torch's default)",
    ),
    Parameter(
        "INTER_OP_THREAD_COUNT", "integer >= 0", "0",
        "threads across independent operators (0: torch's default)",
    ),
)

# Keys of Triton's PyTorch backend that batchgate reads but does not act on: a config that sets
# one is told so at load.
IGNORED_TRITON_PARAMETERS = frozenset(
    {
        "DISABLE_OPTIMIZED_EXECUTION",
        "INFERENCE_MODE",
        "DISABLE_CUDNN",
        "ENABLE_NVFUSER",
        "ENABLE_JIT_EXECUTOR",
        "ENABLE_JIT_PROFILING",
        "ENABLE_TENSOR_FUSER",
        "ENABLE_WEIGHT_SHARING",
        "ENABLE_CACHE_CLEANING",
        "NUM_THREADS",
    }
)


class ModelParameters:
    """One model's ``parameters`` values, read by type. A key unset or empty takes ``default``
    when one is given (the keys whose default depends on the device), else its table default."""

    __slots__ = ("_model", "_values")

    def __init__(self, model: str, values: Mapping[str, str]) -> None:
        self._model = model
        self._values = values

    def _raw(self, key: str) -> str | None:
        """The config's value of ``key``; None when unset or empty."""
        raw = self._values.get(key)
        return None if raw is None or raw.strip() == "" else raw

    def _default(self, key: str) -> str:
        known = PARAMETERS.get(key) or TRITON_PARAMETERS[key]
        assert known.default is not None, f"parameter {key}: its default depends; pass it"
        return known.default

    def _refuse(self, key: str, expected: str) -> LoadError:
        return LoadError(
            f"model {self._model!r}: parameter {key} must be {expected}, "
            f"got {self._values.get(key)!r}"
        )

    def integer(self, key: str, *, minimum: int, default: int | None = None) -> int:
        raw = self._raw(key)
        if raw is None:
            if default is not None:
                return default
            raw = self._default(key)
        try:
            value = int(raw.strip())
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise self._refuse(key, f"an integer >= {minimum}")
        return value

    def number(self, key: str) -> float:
        """A finite number >= 0."""
        raw = self._raw(key) or self._default(key)
        try:
            value = float(raw.strip())
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0:
            raise self._refuse(key, "a number >= 0")
        return value

    def flag(self, key: str) -> bool:
        value = (self._raw(key) or self._default(key)).strip().lower()
        if value not in ("true", "false"):
            raise self._refuse(key, "true or false")
        return value == "true"

    def choice(self, key: str, *, default: str | None = None) -> str:
        raw = self._raw(key)
        if raw is None:
            return default if default is not None else self._default(key)
        value = raw.strip().lower()
        choices = PARAMETERS[key].choices
        if value not in choices:
            raise self._refuse(key, f"one of {' | '.join(choices)}")
        return value

    def buckets(self, max_batch: int, *, on_gpu: bool) -> tuple[int, ...]:
        """The batch sizes of ``buckets``; every list ends at ``max_batch``."""
        value = (self._raw("buckets") or ("pow2" if on_gpu else "none")).strip().lower()
        if max_batch == 0 or value == "none":
            return ()
        if value == "pow2":
            return default_buckets(max_batch)
        try:
            sizes = sorted({int(part) for part in value.split(",") if part.strip()})
        except ValueError:
            sizes = []
        if not sizes or sizes[0] < 1 or sizes[-1] > max_batch:
            raise self._refuse(
                "buckets", "pow2, none, or a comma-separated list of batch sizes in "
                f"1..max_batch_size ({max_batch})")
        if sizes[-1] != max_batch:
            sizes.append(max_batch)  # every batch needs a bucket that holds it
        return tuple(sizes)

    def value(self, key: str) -> str | None:
        """The config's own value of ``key`` (None when unset)."""
        return self._values.get(key)
