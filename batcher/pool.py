"""Reserved device arenas, carved into tensors by the gateway's own allocator.

Memory fragmentation: when models of different sizes share a GPU, only 35-50 % of
device memory typically holds live data. ``DevicePool`` reserves one ``uint8`` buffer
(``torch.empty`` on ``cuda:N``, or on ``cpu`` where tests and CI run; the server reserves one
per model, at exactly its plan's size: ``batcher/memory.py``) and hands out typed views into
it. It does not bring an allocator of its own: it reuses ``batchgate.batcher.arena``'s
``ArenaAllocator``: best fit over an address- and size-ordered free list with immediate
coalescing, sizes rounded only to ``alignment`` (no power-of-two classes wasting up to half of
each block), and each block placed in its hole by expected lifetime. Every allocation here says
which it is: a request's staged inputs are ``"short"``-lived (freed when the batch has run), a
model's plan buffers ``"long"``-lived (held until it unloads); the trace's inputs are short and
its outputs long. A long-lived block takes the top of its hole; a short-lived one goes against
whichever neighbour will be freed later, so its leftover merges with the neighbour freed first.

Why placement matters on a mixed-size trace: with plain best fit (every block at the low end of
the smallest hole that fits) a model's large input buffers, each alive a step or two, land just
above one another, and when the older one is freed its space and the leftover above the newer
one are two holes split by it, each too small for the next: the pool must be far larger than
what is live. ``bench/gpu_check`` (section b) replays ``mixed_trace`` (four models whose
per-sample sizes differ by orders of magnitude, random batch sizes, inputs freed 1-2 steps
later, outputs 1-6, so lifetimes interleave) in the smallest pool that serves each seed without
a refusal and reports peak bytes in use / bytes reserved, mean and worst over the seeds:

- ``.venv/bin/python -m batchgate.bench.gpu_check --cpu --sections b`` (seeds 0-7): plain best fit
  84.6 % / 70.0 %, this scheme **95.2 % / 87.2 %**;
- held-out seeds (``.venv/bin/python -c "from batchgate.bench.gpu_check import pool_trace_figure as f;
  r = [f('cpu', s)['peak_in_use_fraction'] for s in range(8, 40)]; print(sum(r) / len(r),
  min(r))"``): 8-39 plain best fit 84.7 % / 68.2 %, this scheme **90.5 % / 74.4 %**; 40-231
  84.6 % / 63.1 % and **90.8 % / 73.0 %**.

These figures are of this arena alone on a synthetic trace: they do not say what the server
holds on a GPU, where weights, activations and graphs live in each model's own allocator pool
(``batcher/gpu.py``); ``bench/gpu_check``'s server trace measures that, device-wide.
Seeds 0-7 happen to favour the scheme; the held-out figures are the ones to expect. Schemes
were compared on means over whole seed sets, never tuned per seed. Others tried, in an offset
simulator, mean on seeds 0-7 / 8-39: address-ordered first fit 79.4 % / 83.5 %; large blocks
from the top 85.1 % / 83.6 %; short-lived first fit from the bottom and long-lived last fit from
the top 89.8 % / 87.0 % (88.1 % / 88.1 % with short-lived best fit); the neighbour rule for
long-lived blocks too 89.7 % / 90.2 %. Segregating lifetimes by end alone helps less than
placing each short-lived block against its longer-lived neighbour.

``tests/test_pool.py`` replays ``mixed_trace`` through a pool reserved at 1.5x the trace's peak
*live* bytes, on several seeds: no allocation is refused, and the peak bytes the allocator holds
stay within 2 % of the peak live bytes (alignment is the only overhead). ``bench/gpu_check``
compares the peak in-use / reserved ratio with PyTorch's caching allocator on the same traces
(on a GPU).

Models reserve everything they need at load (``DevicePool.admit``): an input and an output
buffer per batch bucket plus an activation pool, all or nothing. The capacity check runs on a
copy of the free list before anything is allocated, so a refused model changes nothing and the
refusal (``ResourceExhausted``) names the model, the bytes it needs and the bytes free.

``fraction_of_free`` sizes the reservation from ``torch.cuda.mem_get_info`` on a CUDA device.
On the CPU it is refused with a ValueError: host memory "free" is not a budget the gateway
owns (page cache, other processes), so a CPU pool takes an explicit ``size_bytes``.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import math
import random
import threading
from collections.abc import Callable, Iterable, Sequence

import torch

from batchgate.batcher.arena_allocator import ArenaAllocator
from batchgate.batcher.buckets import bucket_for, default_buckets  # noqa: F401 (part of this API)
from batchgate.batcher.errors import ResourceExhausted

DEFAULT_POOL_ALIGNMENT = 512


BUFFER_KINDS = ("input", "output", "batch")


@dataclasses.dataclass(frozen=True)
class PlannedBuffer:
    """One buffer of a ``MemoryPlan``: the ``index``-th input or output at batch ``bucket``.

    Kind ``batch`` is a forming batch's input buffer (``bucket`` rows, the largest batch) of
    in-flight ``slot``; ``input``/``output`` are a bucket's fixed buffers (a CUDA graph's).
    """

    kind: str  # one of BUFFER_KINDS
    bucket: int
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    slot: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What a model reserves at load: its per-bucket I/O buffers plus an activation pool."""

    buffers: tuple[PlannedBuffer, ...]
    activation_bytes: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.activation_bytes, int) or self.activation_bytes < 0:
            raise ValueError(
                f"activation_bytes must be an int >= 0, got {self.activation_bytes!r}"
            )
        for buffer in self.buffers:
            if buffer.kind not in BUFFER_KINDS:
                raise ValueError(f"buffer kind must be one of {BUFFER_KINDS}, got {buffer.kind!r}")

    @property
    def buckets(self) -> tuple[int, ...]:
        """The buckets with fixed input/output buffers."""
        return tuple(sorted({b.bucket for b in self.buffers if b.kind != "batch"}))

    @property
    def slots(self) -> int:
        return len({b.slot for b in self.buffers if b.kind == "batch"})

    @property
    def nbytes(self) -> int:
        """Bytes asked for, before rounding to the pool's alignment."""
        return sum(buffer.nbytes for buffer in self.buffers) + self.activation_bytes

    def describe(self) -> str:
        fixed = [b for b in self.buffers if b.kind != "batch"]
        batch = [b for b in self.buffers if b.kind == "batch"]
        parts = []
        if batch:
            parts.append(f"{len(batch)} batch input buffers for {self.slots} batches in flight "
                         f"({sum(b.nbytes for b in batch)} bytes)")
        if fixed or not batch:
            parts.append(f"{len(fixed)} input/output buffers over buckets {self.buckets} "
                         f"({sum(b.nbytes for b in fixed)} bytes)")
        return " + ".join(parts) + f" + {self.activation_bytes} bytes of activations"


Spec = tuple[tuple[int, ...], torch.dtype]


def plan_for(
    input_specs: Iterable[Spec],
    output_specs: Iterable[Spec],
    buckets: Sequence[int],
    activation_bytes: int,
) -> MemoryPlan:
    """A plan from per-sample ``(dims, dtype)`` specs: one buffer ``(bucket, *dims)`` each."""
    inputs, outputs = list(input_specs), list(output_specs)
    if not buckets:
        raise ValueError("buckets must not be empty")
    for bucket in buckets:
        if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1:
            raise ValueError(f"buckets must be ints >= 1, got {bucket!r}")
    for dims, dtype in inputs + outputs:
        if not isinstance(dtype, torch.dtype) or any(d < 0 for d in dims):
            raise ValueError(f"a spec is (dims >= 0, torch.dtype), got {(dims, dtype)!r}")
    buffers = []
    for bucket in sorted(set(buckets)):
        for kind, specs in (("input", inputs), ("output", outputs)):
            for index, (dims, dtype) in enumerate(specs):
                buffers.append(PlannedBuffer(kind, bucket, index, (bucket, *dims), dtype))
    return MemoryPlan(tuple(buffers), activation_bytes)


def model_plan(
    input_specs: Iterable[Spec],
    output_specs: Iterable[Spec],
    *,
    max_rows: int | None,
    slots: int,
    graph_buckets: Sequence[int] = (),
) -> MemoryPlan:
    """A served model's plan: per batch in flight (``slots``), one input buffer per input of
    ``max_rows`` rows (None: the model does not batch, a buffer is one sample), where requests'
    rows are gathered; and per CUDA-graph bucket the graph's fixed input and output buffers."""
    inputs, outputs = list(input_specs), list(output_specs)
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    lead = () if max_rows is None else (max_rows,)
    buffers = [
        PlannedBuffer("batch", max_rows or 1, index, (*lead, *dims), dtype, slot)
        for slot in range(slots)
        for index, (dims, dtype) in enumerate(inputs)
    ]
    if graph_buckets:
        buffers.extend(plan_for(inputs, outputs, graph_buckets, 0).buffers)
    return MemoryPlan(tuple(buffers), 0)


class PoolTensor:
    """A tensor handed out by ``DevicePool.allocate`` and the handle that gives it back."""

    __slots__ = ("_pool", "_released", "nbytes", "offset", "tensor")

    def __init__(self, pool: DevicePool, tensor: torch.Tensor, offset: int | None,
                 nbytes: int) -> None:
        self.tensor = tensor
        self.offset = offset  # None for a fallback tensor outside the arena
        self.nbytes = nbytes
        self._pool = pool
        self._released = False

    @property
    def in_pool(self) -> bool:
        return self.offset is not None

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Give the bytes back. Do not use ``tensor`` afterwards: the bytes will be reused."""
        self._pool.free(self)


@dataclasses.dataclass
class ModelReservation:
    """A model's admitted plan: typed buffers per bucket and the activation pool."""

    name: str
    plan: MemoryPlan
    inputs: dict[int, tuple[torch.Tensor, ...]]
    outputs: dict[int, tuple[torch.Tensor, ...]]
    activations: torch.Tensor  # uint8, activation_bytes long
    nbytes: int  # bytes taken from the pool, after alignment
    _offsets: list[int] = dataclasses.field(repr=False, default_factory=list)
    batch: dict[int, tuple[torch.Tensor, ...]] = dataclasses.field(default_factory=dict)
    fallbacks: int = 0  # buffers allocated outside the arena (a permissive pool's)

    def bucket_for(self, batch: int) -> int:
        return bucket_for(batch, self.plan.buckets)


def _reservation(name: str, plan: MemoryPlan,
                 tensor: Callable[[int, PlannedBuffer], torch.Tensor],
                 activations: torch.Tensor, nbytes: int) -> ModelReservation:
    """The typed views of ``plan``'s buffers (``tensor(index, buffer)``), grouped."""
    groups: dict[str, dict[int, list[torch.Tensor]]] = {kind: {} for kind in BUFFER_KINDS}
    order = sorted(range(len(plan.buffers)),
                   key=lambda i: (plan.buffers[i].slot, plan.buffers[i].bucket,
                                  plan.buffers[i].index))
    for i in order:
        buffer = plan.buffers[i]
        key = buffer.slot if buffer.kind == "batch" else buffer.bucket
        groups[buffer.kind].setdefault(key, []).append(tensor(i, buffer))

    def frozen(kind: str) -> dict[int, tuple[torch.Tensor, ...]]:
        return {key: tuple(ts) for key, ts in groups[kind].items()}

    return ModelReservation(name=name, plan=plan, inputs=frozen("input"),
                            outputs=frozen("output"), activations=activations, nbytes=nbytes,
                            batch=frozen("batch"))


def unpooled_reservation(name: str, plan: MemoryPlan, device: str | torch.device
                         ) -> ModelReservation:
    """``plan`` as plain tensors on ``device``: for a model served without a pool (tests and
    benchmarks that build a ``ServedModel`` themselves)."""
    return _reservation(
        name, plan, lambda _, b: torch.empty(b.shape, dtype=b.dtype, device=device),
        torch.empty(plan.activation_bytes, dtype=torch.uint8, device=device), 0)


class DevicePool:
    """One ``torch.uint8`` buffer reserved on ``device``, carved by an ``ArenaAllocator``."""

    def __init__(
        self,
        device: str | torch.device,
        size_bytes: int | None = None,
        *,
        fraction_of_free: float | None = None,
        alignment: int = DEFAULT_POOL_ALIGNMENT,
        strict: bool = True,
    ) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if (size_bytes is None) == (fraction_of_free is None):
            raise ValueError("give exactly one of size_bytes and fraction_of_free")
        if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment!r}")
        if fraction_of_free is not None:
            if device.type != "cuda":
                raise ValueError(
                    f"fraction_of_free needs a CUDA device, got {device}: give size_bytes for a "
                    "pool in host memory"
                )
            if not 0.0 < fraction_of_free <= 1.0:
                raise ValueError(f"fraction_of_free must lie in (0, 1], got {fraction_of_free!r}")
            free, _total = torch.cuda.mem_get_info(device)
            size_bytes = int(free * fraction_of_free)
        if isinstance(size_bytes, bool) or not isinstance(size_bytes, int) or \
                size_bytes < 2 * alignment:
            raise ValueError(
                f"size_bytes must be an int >= 2 * alignment ({2 * alignment}), got {size_bytes!r}"
            )
        self.device = device
        self.alignment = alignment
        self.strict = strict
        self._raw = torch.empty(size_bytes, dtype=torch.uint8, device=device)
        # The allocator aligns offsets; skip to the first aligned address so that offsets
        # aligned in the buffer are aligned in memory too (CUDA's allocator already is).
        skip = -self._raw.data_ptr() % alignment
        usable = (size_bytes - skip) // alignment * alignment
        self._buffer = self._raw[skip:skip + usable]
        self._allocator = ArenaAllocator(0, usable, alignment)
        self._lock = threading.Lock()
        self._fallbacks = 0
        self._reservations: dict[str, ModelReservation] = {}

    # --- stats -------------------------------------------------------------------------------

    @property
    def bytes_reserved(self) -> int:
        """Bytes reserved from the device (the whole buffer, alignment skip included)."""
        return self._raw.numel()

    @property
    def capacity(self) -> int:
        """Bytes the allocator carves (``bytes_reserved`` less the alignment skip)."""
        return self._allocator.size

    @property
    def bytes_in_use(self) -> int:
        return self._allocator.bytes_in_use

    @property
    def bytes_free(self) -> int:
        return self._allocator.bytes_free

    @property
    def largest_free_block(self) -> int:
        return self._allocator.largest_free_block

    @property
    def fallbacks(self) -> int:
        """Allocations served outside the arena by a plain ``torch.empty`` (``strict=False``)."""
        return self._fallbacks

    @property
    def reservations(self) -> dict[str, ModelReservation]:
        return dict(self._reservations)

    # --- tensors -----------------------------------------------------------------------------

    def allocate(self, shape: Sequence[int] | int, dtype: torch.dtype, *,
                 lifetime: str = "short",
                 outside: Callable[[], contextlib.AbstractContextManager] | None = None,
                 ) -> PoolTensor | None:
        """A ``shape``/``dtype`` tensor viewing the arena, with its handle.

        ``lifetime``: ``"short"`` for a request's buffers (freed when its batch has run),
        ``"long"`` for what is held much longer; it decides where the block goes (module
        docstring). When no free block fits: ``None`` with nothing changed (``strict``), or a plain
        ``torch.empty`` on the device, counted in ``fallbacks`` (``strict=False``), made under
        ``outside()`` when given (the model's own allocator pool).
        """
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if any(dim < 0 for dim in shape):
            raise ValueError(f"shape must not have negative dimensions, got {shape}")
        nbytes = math.prod(shape) * dtype.itemsize
        offset = self._allocator.alloc(nbytes, lifetime)
        if offset is None:
            if self.strict:
                return None
            with self._lock:
                self._fallbacks += 1
            with outside() if outside is not None else contextlib.nullcontext():
                tensor = torch.empty(shape, dtype=dtype, device=self.device)
            return PoolTensor(self, tensor, None, nbytes)
        return PoolTensor(self, self._view(offset, shape, dtype), offset, nbytes)

    def free(self, handle: PoolTensor) -> None:
        """Give ``handle``'s bytes back; ValueError on a second release or another pool's."""
        if handle._pool is not self:
            raise ValueError("this tensor was allocated by another pool")
        with self._lock:
            if handle._released:
                raise ValueError(f"tensor at offset {handle.offset} was already released")
            handle._released = True
        if handle.offset is not None:
            self._allocator.free(handle.offset)
        handle.tensor = None

    def _view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        return self._buffer[offset:offset + nbytes].view(dtype).view(shape)

    # --- models ------------------------------------------------------------------------------

    def admit(self, name: str, plan: MemoryPlan) -> ModelReservation:
        """Reserve all of ``plan`` for model ``name``, or raise ``ResourceExhausted`` having
        changed nothing."""
        with self._lock:
            if name in self._reservations:
                raise ValueError(f"model {name!r} already holds a reservation; release it first")
            # Largest first: best fit then packs the small buffers into the remainders.
            requests = [(buffer.nbytes, i) for i, buffer in enumerate(plan.buffers)]
            requests.append((plan.activation_bytes, -1))
            requests.sort(key=lambda item: -item[0])
            align = self._allocator.aligned_size
            needed = sum(align(nbytes) for nbytes, _ in requests)
            if not self._fits([align(nbytes) for nbytes, _ in requests]):
                if self.strict:
                    self._refuse(name, plan, needed)
                return self._admit_outside(name, plan)
            offsets: list[int] = []
            placed: dict[int, int] = {}  # buffer index (-1: activations) -> offset
            for nbytes, buffer in requests:  # held as long as the model: long-lived
                offset = self._allocator.alloc(nbytes, "long")
                if offset is None:  # only if someone allocated concurrently: roll back
                    for taken in reversed(offsets):
                        self._allocator.free(taken)
                    self._refuse(name, plan, needed)
                offsets.append(offset)
                placed[buffer] = offset
            reservation = _reservation(
                name, plan, lambda i, b: self._view(placed[i], b.shape, b.dtype),
                self._view(placed[-1], (plan.activation_bytes,), torch.uint8), needed)
            reservation._offsets = offsets
            self._reservations[name] = reservation
            return reservation

    def _admit_outside(self, name: str, plan: MemoryPlan) -> ModelReservation:
        """A permissive pool's answer to a plan that does not fit: every buffer a plain tensor
        on the device, each counted as a fallback (lock held)."""
        fallbacks = len(plan.buffers) + 1
        self._fallbacks += fallbacks
        reservation = _reservation(
            name, plan, lambda _, b: torch.empty(b.shape, dtype=b.dtype, device=self.device),
            torch.empty(plan.activation_bytes, dtype=torch.uint8, device=self.device), 0)
        reservation.fallbacks = fallbacks
        self._reservations[name] = reservation
        return reservation

    def release(self, name: str) -> None:
        """Free everything model ``name`` reserved; ValueError when it holds nothing."""
        with self._lock:
            reservation = self._reservations.pop(name, None)
            if reservation is None:
                raise ValueError(f"model {name!r} holds no reservation in this pool")
        for offset in reversed(reservation._offsets):
            self._allocator.free(offset)

    def _fits(self, sizes: list[int]) -> bool:
        """Whether best fit would place ``sizes`` in order, simulated on a copy of the free list."""
        if sum(sizes) > self._allocator.bytes_free:
            return False
        blocks = sorted(size for _, size in self._allocator.free_blocks())
        for need in sizes:
            index = bisect.bisect_left(blocks, need)
            if index == len(blocks):
                return False
            rest = blocks.pop(index) - need
            if rest:
                bisect.insort(blocks, rest)
        return True

    def _refuse(self, name: str, plan: MemoryPlan, needed: int) -> None:
        free = self._allocator.bytes_free
        message = (
            f"model {name!r} needs {needed} bytes of device memory (plan: {plan.describe()}); "
            f"{free} bytes are free in the pool of {self.capacity} bytes on {self.device}"
        )
        if needed <= free:
            message += (
                f", but not in blocks that fit it (largest free block "
                f"{self._allocator.largest_free_block} bytes)"
            )
        raise ResourceExhausted(message)

    def __repr__(self) -> str:
        return (
            f"DevicePool(device={str(self.device)!r}, bytes_reserved={self.bytes_reserved}, "
            f"bytes_in_use={self.bytes_in_use}, fallbacks={self.fallbacks})"
        )


# --- traces -----------------------------------------------------------------------------------

Event = tuple  # ("alloc", id, nbytes, lifetime) or ("free", id)


def mixed_trace(seed: int, models: int = 4, steps: int = 2000) -> list[Event]:
    """A multi-model allocation trace: each step one model's batch allocates its input and
    output buffers (per-sample sizes differ by model, batch sizes are random); the input is
    freed 1-2 steps later (compute done), the output 1-6 steps later (response sent), so inputs
    are allocated ``"short"``-lived and outputs ``"long"``-lived. Every allocation is freed by
    the end."""
    if models < 1 or steps < 0:
        raise ValueError(f"need models >= 1 and steps >= 0, got {models}, {steps}")
    rng = random.Random(seed)
    profiles = []
    for _ in range(models):
        scale = rng.choice([1, 4, 16, 64])  # models differ by orders of magnitude
        profiles.append((
            rng.randint(256, 4096) * scale,  # input bytes per sample
            rng.randint(16, 1024) * scale,  # output bytes per sample
            rng.choice([4, 8, 16, 32]),  # max batch
        ))
    trace: list[Event] = []
    due: dict[int, list[str]] = {}
    for step in range(steps):
        for ident in due.pop(step, []):
            trace.append(("free", ident))
        model = rng.randrange(models)
        in_per_sample, out_per_sample, max_batch = profiles[model]
        batch = rng.randint(1, max_batch)
        for kind, per_sample, steps_held, lifetime in (
                ("in", in_per_sample, rng.randint(1, 2), "short"),
                ("out", out_per_sample, rng.randint(1, 6), "long")):
            ident = f"m{model}.s{step}.{kind}"
            trace.append(("alloc", ident, batch * per_sample, lifetime))
            due.setdefault(step + steps_held, []).append(ident)
    for step in sorted(due):
        trace.extend(("free", ident) for ident in due[step])
    return trace


def peak_live_bytes(trace: Sequence[Event]) -> int:
    """The most bytes the trace holds live at once (what a perfect allocator would need)."""
    live: dict[str, int] = {}
    current = peak = 0
    for event in trace:
        if event[0] == "alloc":
            live[event[1]] = event[2]
            current += event[2]
            peak = max(peak, current)
        else:
            current -= live.pop(event[1], 0)
    return peak


def replay_trace(pool_factory: Callable[[], DevicePool], trace: Sequence[Event]) -> dict:
    """Replay ``trace`` through a fresh pool; frees of refused allocations are skipped.

    Returns ``peak_bytes_in_use`` (aligned bytes the allocator held), ``peak_live_bytes``
    (bytes the trace asked for), ``bytes_reserved``, ``peak_in_use_fraction`` (peak in use /
    reserved), ``allocations``, ``refused`` and ``fallbacks``. What the trace leaves live is
    freed at the end, and ``bytes_in_use_after`` says what the pool then holds (0).
    """
    pool = pool_factory()
    live: dict[str, PoolTensor] = {}
    live_bytes = peak_live = peak_in_use = allocations = refused = 0
    for event in trace:
        if event[0] == "alloc":
            _, ident, nbytes, lifetime = event
            allocations += 1
            handle = pool.allocate((nbytes,), torch.uint8, lifetime=lifetime)
            if handle is None:
                refused += 1
                continue
            live[ident] = handle
            live_bytes += nbytes
            peak_live = max(peak_live, live_bytes)
            peak_in_use = max(peak_in_use, pool.bytes_in_use)
        elif event[0] == "free":
            handle = live.pop(event[1], None)
            if handle is not None:
                live_bytes -= handle.nbytes
                handle.release()
        else:
            raise ValueError(f"unknown trace event {event!r}")
    for handle in live.values():
        handle.release()
    return {
        "device": str(pool.device),
        "bytes_reserved": pool.bytes_reserved,
        "peak_bytes_in_use": peak_in_use,
        "peak_live_bytes": peak_live,
        "peak_in_use_fraction": peak_in_use / pool.bytes_reserved,
        "allocations": allocations,
        "refused": refused,
        "fallbacks": pool.fallbacks,
        "bytes_in_use_after": pool.bytes_in_use,
    }
