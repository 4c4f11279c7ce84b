"""Reserved device arenas, carved into tensors by the gateway's own allocator.

When models of different sizes share a GPU, fragmentation leaves much of device memory holding
no live data. ``DevicePool`` reserves one ``uint8`` buffer (``torch.empty`` on ``cuda:N``, or on
``cpu`` where tests and CI run; the server reserves one per model, at exactly its plan's size:
``batcher/memory.py``) and hands out typed views into it. It brings no allocator of its own: it
reuses ``batchgate.batcher.arena_allocator``'s ``ArenaAllocator`` (best fit with immediate
coalescing, sizes rounded only to ``alignment``, each block placed in its hole by expected
lifetime). Every allocation here says which it is: a request's staged inputs are
``"short"``-lived (freed when the batch has run), a model's plan buffers ``"long"``-lived (held
until it unloads). Why placement matters, and the figures on a mixed-size trace
(``batchgate.batcher.allocation_trace``): docs/decisions/0012-arena-blocks-placed-by-lifetime.md.

Models reserve everything they need at load (``DevicePool.admit``): what their
``MemoryPlan`` (``batchgate.batcher.memory_plan``) lists plus an activation pool, all or
nothing. The capacity check runs on a copy of the free list before anything is allocated, so a
refused model changes nothing and the refusal (``ResourceExhausted``) names the model, the bytes
it needs and the bytes free.

``fraction_of_free`` sizes the reservation from ``torch.cuda.mem_get_info`` on a CUDA device.
On the CPU it is refused with a ValueError: host memory "free" is not a budget the gateway
owns (page cache, other processes), so a CPU pool takes an explicit ``size_bytes``.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import math
import threading
from collections.abc import Callable, Sequence

import torch

from batchgate.batcher.arena_allocator import ArenaAllocator
from batchgate.batcher.buckets import bucket_for, default_buckets  # noqa: F401 (part of this API)
from batchgate.batcher.errors import ResourceExhausted
from batchgate.batcher.memory_plan import BUFFER_KINDS, MemoryPlan, PlannedBuffer

DEFAULT_POOL_ALIGNMENT = 512


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
