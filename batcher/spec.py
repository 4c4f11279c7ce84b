"""What the batcher knows about a model: its tensors, its batching and queue settings, its device.

These are plain dataclasses, free of protobuf and gRPC: ``server/executor/repository.py`` builds them from a
``config.pbtxt``; tests build them directly. Datatypes use the KServe v2 strings ("FP32", "BF16",
...) of ``protos/datatypes.py``. BF16 has no numpy type, so a BF16 tensor travels through the
batcher as ``uint16`` holding the raw bfloat16 bits and becomes ``torch.bfloat16`` only at the
executor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

# The datatype table, also known here by the modules that read a spec's datatypes.
from batchgate.protos.datatypes import ELEMENT_SIZES, NUMPY_DTYPES  # noqa: F401

# How a model runs: fp32; autocast to fp16 or bf16 (weights stay fp32); or fp16 weights (the
# module converted with .half(), floating inputs cast to fp16).
PRECISIONS = ("fp32", "amp-fp16", "amp-bf16", "fp16-weights")
# The names the autocast precisions had before fp16 weights existed; still accepted.
PRECISION_ALIASES: Mapping[str, str] = {"fp16": "amp-fp16", "bf16": "amp-bf16"}
# When a request's inputs are copied into its model's pooled buffers: as soon as it is queued
# (so a batch's inputs are already on the device when it closes), or when its batch is assembled.
INPUT_STAGING = ("queue", "batch")
# ``deadline``: a batch dispatched before MIN_BATCH or the queue delay were reached, because
# waiting longer would make its earliest deadline miss (the ``deadline`` batch policy only).
DISPATCH_REASONS = ("full", "preferred", "delay", "idle", "deadline")
# ``fifo``: arrival order within a priority level; ``deadline``: earliest deadline first, batches
# sized from the model's latency profile (``batcher/profile.py``).
BATCH_POLICIES = ("fifo", "deadline")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One input or output: its name, datatype and shape without the batch dimension."""

    name: str
    datatype: str
    dims: tuple[int, ...]  # -1 means variable
    optional: bool = False

    def __post_init__(self) -> None:
        if self.datatype not in NUMPY_DTYPES:
            raise ValueError(f"tensor {self.name!r}: unknown datatype, got {self.datatype!r}")
        if any(d < -1 for d in self.dims):
            raise ValueError(f"tensor {self.name!r}: dims must be >= -1, got {self.dims}")

    @property
    def numpy_dtype(self) -> np.dtype:
        return NUMPY_DTYPES[self.datatype]

    def fixed(self) -> bool:
        return all(d >= 0 for d in self.dims)


@dataclasses.dataclass(frozen=True)
class QueuePolicy:
    """Per priority level, as Triton's ``ModelQueuePolicy``."""

    max_queue_size: int = 0  # 0 = unbounded
    default_timeout_us: int = 0  # 0 = none
    allow_timeout_override: bool = True
    timeout_action_delay: bool = False  # Triton's DELAY: an expired request still runs

    def __post_init__(self) -> None:
        if self.max_queue_size < 0:
            raise ValueError(f"max_queue_size must be >= 0, got {self.max_queue_size}")
        if self.default_timeout_us < 0:
            raise ValueError(f"default_timeout_us must be >= 0, got {self.default_timeout_us}")


@dataclasses.dataclass(frozen=True)
class BatchingConfig:
    """How one model's queue forms batches.

    ``min_batch_size`` is the design notes' MIN_BATCH: with a queue delay set, a batch is
    dispatched as soon as this many samples wait, or when the oldest request has waited
    ``max_queue_delay_us``, whichever comes first. Without a delay an idle executor takes
    whatever is queued at once (work-conserving).
    """

    max_batch_size: int = 0  # 0: the model does not batch; inputs carry no batch dimension
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int = 0
    min_batch_size: int = 0  # 0: derived (largest preferred size, else max_batch_size)
    priority_levels: int = 0  # 0: one level
    default_priority_level: int = 0  # 0: the middle level
    default_queue_policy: QueuePolicy = QueuePolicy()
    priority_queue_policy: Mapping[int, QueuePolicy] = dataclasses.field(default_factory=dict)
    # Per instance: one being assembled while one computes; 0: by device
    # (``ModelSpec.inflight_batches``).
    max_inflight_batches: int = 0
    # False: Triton's default scheduler (no dynamic_batching in config.pbtxt): every request
    # runs as a batch of its own, never combined with another; preferred sizes, delay and
    # MIN_BATCH do not apply. A request may still carry up to max_batch_size samples.
    dynamic_batching: bool = True
    policy: str = "fifo"  # one of BATCH_POLICIES
    # The model's latency objective: the SLO attainment metric's target for requests without an
    # earlier deadline, and under the deadline policy their scheduling deadline. 0 = none.
    slo_ms: float = 0.0
    # Kept free before every deadline (deadline policy, admission control) for an answer to go
    # from the server to its client, beyond the delivery the server measures inside itself.
    response_margin_ms: float = 5.0
    # Refuse at once a request whose deadline the estimated queue wait already exceeds.
    admission: bool = True
    # > 0: batches run on the device in turns shared by weight with the other models that set
    # one (``batcher/device_share.py``); 0: no turns, first come first served.
    device_share_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.max_batch_size < 0:
            raise ValueError(f"max_batch_size must be >= 0, got {self.max_batch_size}")
        for size in self.preferred_batch_sizes:
            if not 1 <= size <= max(self.max_batch_size, 1):
                raise ValueError(
                    f"preferred_batch_size must lie in 1..max_batch_size "
                    f"({self.max_batch_size}), got {size}"
                )
        if self.max_queue_delay_us < 0:
            raise ValueError(f"max_queue_delay_us must be >= 0, got {self.max_queue_delay_us}")
        if self.min_batch_size < 0 or self.min_batch_size > max(self.max_batch_size, 1):
            raise ValueError(
                f"min_batch_size must lie in 0..max_batch_size ({self.max_batch_size}), "
                f"got {self.min_batch_size}"
            )
        if self.priority_levels < 0:
            raise ValueError(f"priority_levels must be >= 0, got {self.priority_levels}")
        if self.default_priority_level < 0 or self.default_priority_level > self.levels:
            raise ValueError(
                f"default_priority_level must lie in 0..{self.levels}, "
                f"got {self.default_priority_level}"
            )
        if self.max_inflight_batches < 0:
            raise ValueError("max_inflight_batches must be >= 0 (0: by device), "
                             f"got {self.max_inflight_batches}")
        if self.policy not in BATCH_POLICIES:
            raise ValueError(f"policy must be one of {BATCH_POLICIES}, got {self.policy!r}")
        if not self.slo_ms >= 0:
            raise ValueError(f"slo_ms must be >= 0, got {self.slo_ms}")
        if not self.response_margin_ms >= 0:
            raise ValueError(f"response_margin_ms must be >= 0, got {self.response_margin_ms}")
        if not self.device_share_weight >= 0:
            raise ValueError(f"device_share_weight must be >= 0, got {self.device_share_weight}")

    @property
    def levels(self) -> int:
        return max(self.priority_levels, 1)

    @property
    def default_level(self) -> int:
        """Priority level (1 = highest) of a request that names none."""
        if self.default_priority_level:
            return self.default_priority_level
        return (self.levels + 1) // 2

    @property
    def effective_max_batch(self) -> int:
        return max(self.max_batch_size, 1)

    @property
    def effective_min_batch(self) -> int:
        if self.min_batch_size:
            return self.min_batch_size
        if self.preferred_batch_sizes:
            return max(self.preferred_batch_sizes)
        return self.effective_max_batch

    def queue_policy(self, level: int) -> QueuePolicy:
        return self.priority_queue_policy.get(level, self.default_queue_policy)

    @property
    def slo_s(self) -> float | None:
        return self.slo_ms / 1e3 if self.slo_ms else None


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Everything the batcher needs to serve one version of one model."""

    name: str
    version: str
    platform: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    batching: BatchingConfig = BatchingConfig()
    instance_count: int = 1
    device: str = "cpu"  # "cpu" or "cuda:N"
    precision: str = "fp32"  # one of PRECISIONS (or an alias of PRECISION_ALIASES)
    intra_op_threads: int = 0  # 0: torch's default (OMP_NUM_THREADS)
    inter_op_threads: int = 0
    warmup: bool = True
    # Batch sizes a batch is padded up to (zero rows, dropped from the answers); the largest is
    # max_batch_size. Empty: no padding, each batch runs at its own size.
    buckets: tuple[int, ...] = ()
    cuda_graphs: bool = False  # capture a CUDA graph per bucket (CUDA devices only)
    input_staging: str = "batch"  # one of INPUT_STAGING
    execution_timeout_ms: int = 0  # 0: none; else a batch running longer fails (batcher/watchdog.py)

    @property
    def inflight_batches(self) -> int:
        """Batches in flight per instance: ``max_inflight_batches`` when the config sets it,
        else two on a GPU (one's inputs copied while one computes) and one on the CPU.

        On the CPU nothing is asynchronous to overlap, and a second batch in flight only adds
        an assembler thread's two hand-offs (each a wait for the GIL) between batches, which
        lowered throughput and raised the p99 at c=64 (docs/decisions/0001). Under the deadline
        policy always one, on any device: a busy instance never takes a batch there (the queue
        holds the next one until the running one ends, so that a tight arrival can still join
        it), so a second slot would stand idle and its assembler only add the hand-offs between
        one batch's end and the next one's decision."""
        if self.batching.policy == "deadline":
            return 1
        if self.batching.max_inflight_batches:
            return self.batching.max_inflight_batches
        return 2 if self.device.startswith("cuda") else 1

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ValueError(f"model {self.name!r}: at least one input is required")
        if not self.outputs:
            raise ValueError(f"model {self.name!r}: at least one output is required")
        if self.instance_count < 1:
            raise ValueError(f"instance_count must be >= 1, got {self.instance_count}")
        precision = PRECISION_ALIASES.get(self.precision, self.precision)
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        object.__setattr__(self, "precision", precision)  # frozen: the canonical name
        if self.input_staging not in INPUT_STAGING:
            raise ValueError(
                f"input_staging must be one of {INPUT_STAGING}, got {self.input_staging!r}")
        self._check_buckets()
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda:N', got {self.device!r}")
        if self.intra_op_threads < 0 or self.inter_op_threads < 0:
            raise ValueError("thread counts must be >= 0")
        if self.execution_timeout_ms < 0:
            raise ValueError(f"execution_timeout_ms must be >= 0, got {self.execution_timeout_ms}")

    def _check_buckets(self) -> None:
        buckets, max_batch = self.buckets, self.batching.max_batch_size
        if not buckets:
            return
        if max_batch == 0:
            raise ValueError(f"buckets need max_batch_size >= 1, got buckets {buckets}")
        if list(buckets) != sorted(set(buckets)) or buckets[0] < 1 or buckets[-1] != max_batch:
            raise ValueError(
                f"buckets must be increasing batch sizes >= 1 ending at max_batch_size "
                f"({max_batch}), got {buckets}"
            )

    @property
    def max_batch_size(self) -> int:
        return self.batching.max_batch_size

    @property
    def autocast(self) -> bool:
        return self.precision.startswith("amp-")

    def input(self, name: str) -> TensorSpec | None:
        for spec in self.inputs:
            if spec.name == name:
                return spec
        return None

    def output(self, name: str) -> TensorSpec | None:
        for spec in self.outputs:
            if spec.name == name:
                return spec
        return None
