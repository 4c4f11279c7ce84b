"""The shared-memory arena between front-end processes and the executor process.

Front ends decode a request's tensors straight into the arena; the executor reads them through
numpy views of the same pages (no copy) and writes outputs back into it. What crosses the
process boundary is only a descriptor naming arena offsets (``protos/wire.proto``).

``SharedArena`` is one ``memfd_create`` mapping. A memfd has no name in ``/dev/shm`` or anywhere
else: the kernel frees its pages when the last descriptor and the last mapping go, so no process
exit, clean or killed, can leave a segment behind (``multiprocessing.shared_memory`` names a file
in ``/dev/shm`` that outlives a SIGKILLed owner). Children get it by descriptor:
``subprocess.Popen(..., pass_fds=[arena.fd])``, then ``SharedArena.attach(fd, size)``. The
descriptor is created close-on-exec, so no child inherits it by accident; ``pass_fds`` clears
that flag in the child for the descriptors it names. On a GPU each process that copies to the
device registers its own mapping with ``pin()`` (``cudaHostRegister``), which makes the arena the
pinned staging area as well. torch is imported inside ``pin``/``unpin`` only: front ends import
this module without it.

``ArenaLayout`` splits the arena into one input region per front-end slot and one output region
for the executor, each a whole number of pages. Every region has exactly one writer process, and
that process alone allocates in it, so no lock crosses processes.

``ArenaAllocator`` hands out byte ranges inside one region. The scheme: **best fit over a free
list kept in two sorted lists** — free blocks by address (``_free_starts`` plus a size per start)
and by ``(size, address)`` (``_by_size``) — with **immediate coalescing** of address neighbours
on free, every size rounded up to ``alignment`` (256 by default: a multiple of the cache line
and of what CUDA copies and kernels want), and **placement inside the chosen hole by expected
lifetime**: each ``alloc`` says whether the block is ``"short"``-lived (a request's inputs,
freed when its batch has run) or ``"long"``-lived (a model's buffers, freed when it unloads).

Why this scheme:

- Request tensors come in every size (batch x shape x dtype), and fragmentation is the waste the
  design sets out to measure. A buddy or size-class scheme rounds sizes up to a power of two or
  to a class (up to ~50 % of each block wasted inside it); a free list with coalescing wastes at
  most ``alignment - 1`` bytes per allocation.
- Among free-list policies, best fit and address-ordered first fit fragment least on real
  allocation traces (Johnstone and Wilson, "The Memory Fragmentation Problem: Solved?", ISMM
  1998). With plain sorted lists best fit is the cheaper of the two: one ``bisect`` on
  ``_by_size`` finds the smallest block that fits, where first fit would scan the free blocks in
  address order.
- Which end of the hole a block takes decides what the leftover can merge with later. Plain best
  fit always takes the low end, and on a mixed trace that is where it fragments: a model's large
  input buffers live one or two steps each, so the next one is placed just above the previous
  one; when the previous one is freed, its space and the leftover above the new block are two
  holes split by the new block, each too small for the next large input. So a short-lived block
  is placed **against whichever neighbour of its hole will be freed later**, and the leftover
  borders the neighbour freed first, merging with its space when it goes. The order: a region
  end is never freed, a long-lived block outlives a short-lived one, and of two blocks of the
  same kind the younger is expected to outlive the older (request buffers are freed roughly in
  the order they were taken). A long-lived block always takes the top of its hole (ties between
  equal holes go to the highest address): long-lived blocks collect at the top ends of holes,
  away from the low ends where the short-lived churn reuses space. This is the general principle
  of segregating allocations by expected lifetime (Barrett and Zorn, "Using Lifetime Predictors
  to Improve Memory Allocation Performance", PLDI 1993; Wilson et al., "Dynamic Storage
  Allocation: A Survey and Critical Review", 1995).
- Coalescing on free finds both neighbours with one ``bisect`` on ``_free_starts``, so the free
  list never holds two adjacent blocks and a region that empties is one block again.

Measured (``batchgate.batcher.pool``'s docstring has the commands): ``batchgate.batcher.pool.mixed_trace``, each seed
replayed in the smallest pool that serves it without a refusal, peak bytes in use / bytes
reserved, mean / worst: plain best fit 84.6 % / 70.0 % on seeds 0-7, 84.7 % / 68.2 % on held-out
seeds 8-39; this scheme 95.2 % / 87.2 % and 90.5 % / 74.4 % (90.8 % / 73.0 % on seeds 40-231).
On one kind of block alone (a front end's input region, the executor's output region, which
allocate with the default ``"short"``) the neighbour rule packs a FIFO stream of request
buffers with little waste: the trace's inputs alone, 83.9 % with plain best fit, 99.7 % with it
(an offset simulator, mean over seeds 0-39).

Cost per ``alloc``/``free``: a few ``bisect`` searches (O(log n) in the number of free blocks),
dict lookups for the allocation and for the hole's two neighbours (``_ends`` maps an
allocation's end to its start), and list inserts/deletes (a C ``memmove`` of pointers, well
under a microsecond at the block counts a region sees). No per-byte work, no scan over the live
allocations. ``check_invariants`` is the O(n) exception, for tests.
"""

from __future__ import annotations

import bisect
import ctypes
import math
import mmap
import os
import threading

import numpy as np

PAGE_SIZE = mmap.PAGESIZE
DEFAULT_ALIGNMENT = 256
LIFETIMES = ("short", "long")  # what ``ArenaAllocator.alloc`` is told about a block
_REGION_END = (2, 0)  # release order of a region's ends: after every block's (never freed)
_MEMFD_NAME = "batchgate-arena"


# cudaHostRegisterPortable (CUDA runtime API): pinned for all CUDA contexts, not just the current.
CUDA_HOST_REGISTER_PORTABLE = 0x01


class SharedArena:
    """A shared, anonymous (memfd) mapping that front ends and the executor all map.

    Views handed out by ``array`` and ``read`` point into the mapping itself. Drop them before
    ``close()``: an mmap with live views cannot be unmapped, so ``close()`` then closes the
    descriptor and leaves the mapping to be unmapped when the last view is garbage-collected.
    """

    def __init__(self, fd: int, size_bytes: int, mapping: mmap.mmap) -> None:
        """Use ``create`` or ``attach``; this takes ownership of ``fd`` and ``mapping``."""
        self._fd = fd
        self._size = size_bytes
        self._mmap: mmap.mmap | None = mapping
        self._pinned_ptr: int | None = None
        self._pinned_device: int | None = None

    @classmethod
    def create(cls, size_bytes: int) -> SharedArena:
        """A new zero-filled arena of ``size_bytes``, owned by this process."""
        _check_size(size_bytes)
        create_memfd = getattr(os, "memfd_create", None)
        if create_memfd is None:
            raise OSError("SharedArena needs os.memfd_create (Linux); this platform has none")
        fd = create_memfd(_MEMFD_NAME, getattr(os, "MFD_CLOEXEC", 0))
        try:
            os.ftruncate(fd, size_bytes)
            mapping = _map(fd, size_bytes)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, size_bytes, mapping)

    @classmethod
    def attach(cls, fd: int, size_bytes: int) -> SharedArena:
        """Map the arena whose descriptor this process received (``pass_fds``); takes ``fd``."""
        _check_size(size_bytes)
        file_bytes = os.fstat(fd).st_size
        if file_bytes < size_bytes:
            # Mapping past the end of the file would SIGBUS on first touch, not fail here.
            raise ValueError(
                f"descriptor {fd} holds {file_bytes} bytes, fewer than the {size_bytes} asked for"
            )
        return cls(fd, size_bytes, _map(fd, size_bytes))

    @property
    def fd(self) -> int:
        """The memfd descriptor (pass it to children with ``pass_fds``); -1 once closed."""
        return self._fd

    @property
    def size(self) -> int:
        """Bytes mapped."""
        return self._size

    @property
    def closed(self) -> bool:
        return self._mmap is None

    @property
    def buffer(self) -> mmap.mmap:
        """The mapping itself."""
        return self._open_mapping()

    @property
    def address(self) -> int:
        """The mapping's virtual address in this process (an array's offset in the arena is
        its data address less this)."""
        return _address(self._open_mapping())

    @property
    def pinned(self) -> bool:
        """Whether ``pin()`` registered this mapping with CUDA and ``unpin()`` has not undone it."""
        return self._pinned_ptr is not None

    def array(self, offset: int, dtype, shape) -> np.ndarray:
        """A writable numpy view of the arena at ``offset``: no copy, shares the pages."""
        mapping = self._open_mapping()
        dtype = np.dtype(dtype)
        if dtype.hasobject:
            raise ValueError(f"arena arrays hold plain data, got dtype {dtype}")
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if any(dim < 0 for dim in shape):
            raise ValueError(f"shape must not have negative dimensions, got {shape}")
        count = math.prod(shape)
        self._check_range(offset, count * dtype.itemsize)
        # frombuffer keeps a memoryview as the array's base, which holds the mmap's buffer
        # export while the array lives, so close() cannot unmap pages under it.
        # np.ndarray(buffer=mapping) keeps only the mmap object: close() would succeed and
        # the array would then read unmapped memory (a segfault).
        return np.frombuffer(mapping, dtype, count, offset).reshape(shape)

    def write(self, offset: int, data: bytes | bytearray | memoryview | np.ndarray) -> None:
        """Copy ``data`` into the arena at ``offset`` (one copy; arrays keep their C order)."""
        mapping = self._open_mapping()
        if isinstance(data, np.ndarray):
            np.copyto(self.array(offset, data.dtype, data.shape), data, casting="no")
            return
        with memoryview(data) as view:
            if not view.c_contiguous:
                raise ValueError("write needs a C-contiguous buffer; pass a numpy array instead")
            with view.cast("B") as raw:
                self._check_range(offset, raw.nbytes)
                mapping[offset:offset + raw.nbytes] = raw

    def read(self, offset: int, nbytes: int) -> memoryview:
        """A read-only view of ``nbytes`` at ``offset`` (no copy); ``release()`` it when done."""
        mapping = self._open_mapping()
        self._check_range(offset, nbytes)
        with memoryview(mapping) as whole:
            return whole[offset:offset + nbytes].toreadonly()

    def close(self) -> None:
        """Unpin, unmap and close the descriptor. Idempotent.

        With views from ``array``/``read`` still alive the mapping cannot be unmapped now
        (``mmap.close`` raises BufferError): it is then left to the garbage collector, which
        unmaps it with the last view (the mmap object keeps a private duplicate of the
        descriptor until then). ``fd`` is closed either way.
        """
        mapping, self._mmap = self._mmap, None
        try:
            if mapping is not None:
                if self._pinned_ptr is not None:
                    self._unregister()
                try:
                    mapping.close()
                except BufferError:
                    pass
        finally:
            if self._fd >= 0:
                fd, self._fd = self._fd, -1
                os.close(fd)

    def __enter__(self) -> SharedArena:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_fd", -1) >= 0 or getattr(self, "_mmap", None) is not None:
            self.close()

    def pin(self, device: int = 0) -> bool:
        """Register the mapping with CUDA as pinned host memory; False when CUDA is absent.

        Registration belongs to this process's mapping: every process that copies between the
        arena and a device pins its own. It is registered portable
        (``cudaHostRegisterPortable``), so the pages count as pinned for every device's CUDA
        context, not only ``device``'s (the one current while registering): an executor
        process serving models on several GPUs copies from one arena into each at full DMA
        speed. Calling it again is harmless.
        """
        mapping = self._open_mapping()
        import torch  # only processes that drive a device need torch

        if not torch.cuda.is_available():
            return False
        if self._pinned_ptr is not None:
            return True
        ptr = _address(mapping)
        with torch.cuda.device(device):
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(
                ptr, self._size, CUDA_HOST_REGISTER_PORTABLE))
        self._pinned_ptr = ptr
        self._pinned_device = device
        return True

    def unpin(self) -> None:
        """Undo ``pin()``; does nothing when the arena is not pinned."""
        if self._pinned_ptr is not None:
            self._unregister()

    def _unregister(self) -> None:
        import torch

        ptr, self._pinned_ptr = self._pinned_ptr, None
        with torch.cuda.device(self._pinned_device):
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(ptr))

    def _open_mapping(self) -> mmap.mmap:
        if self._mmap is None:
            raise ValueError("the arena is closed")
        return self._mmap

    def _check_range(self, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self._size:
            raise ValueError(
                f"{nbytes} bytes at offset {offset} do not fit in the arena of {self._size} bytes"
            )


def _check_size(size_bytes: int) -> None:
    if not isinstance(size_bytes, int) or size_bytes <= 0:
        raise ValueError(f"size_bytes must be a positive int, got {size_bytes!r}")


def _map(fd: int, size_bytes: int) -> mmap.mmap:
    return mmap.mmap(fd, size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def _address(mapping: mmap.mmap) -> int:
    """The mapping's virtual address. The ctypes object exports the buffer only briefly."""
    first = ctypes.c_char.from_buffer(mapping)
    try:
        return ctypes.addressof(first)
    finally:
        del first


class ArenaLayout:
    """How an arena of ``size_bytes`` is split: ``slots`` input regions, then one output region.

    Every region is a whole number of pages and starts on a page. Input regions are equal;
    ``output_fraction`` of the pages (rounded down) go to the output region, which also takes
    the pages left over when the input pages do not divide evenly among the slots. Bytes past
    the last whole page are not used.
    """

    def __init__(self, size_bytes: int, slots: int, output_fraction: float = 0.5) -> None:
        if not isinstance(size_bytes, int) or size_bytes <= 0:
            raise ValueError(f"size_bytes must be a positive int, got {size_bytes!r}")
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {slots!r}")
        if not 0.0 < output_fraction < 1.0:
            raise ValueError(
                f"output_fraction must lie strictly between 0 and 1, got {output_fraction!r}"
            )
        pages = size_bytes // PAGE_SIZE
        output_pages = int(pages * output_fraction)
        input_pages = (pages - output_pages) // slots
        if output_pages < 1 or input_pages < 1:
            raise ValueError(
                f"an arena for {slots} input slots and an output region at output_fraction "
                f"{output_fraction} needs at least one page ({PAGE_SIZE} bytes) per region, "
                f"got size_bytes {size_bytes} ({pages} pages)"
            )
        self.size_bytes = size_bytes
        self.slots = slots
        self.output_fraction = output_fraction
        self.input_region_bytes = input_pages * PAGE_SIZE
        self._output_offset = slots * self.input_region_bytes
        self.output_region_bytes = pages * PAGE_SIZE - self._output_offset

    def input_region(self, slot: int) -> tuple[int, int]:
        """``(offset, size)`` of front-end slot ``slot``'s input region."""
        if not isinstance(slot, int) or not 0 <= slot < self.slots:
            raise ValueError(f"slot must lie in 0..{self.slots - 1}, got {slot!r}")
        return slot * self.input_region_bytes, self.input_region_bytes

    def output_region(self) -> tuple[int, int]:
        """``(offset, size)`` of the executor's output region."""
        return self._output_offset, self.output_region_bytes

    def __repr__(self) -> str:
        return (
            f"ArenaLayout(size_bytes={self.size_bytes}, slots={self.slots}, "
            f"output_fraction={self.output_fraction})"
        )


class ArenaAllocator:
    """Best-fit allocation of byte ranges in one arena region ``[base, base + size)``, placed in
    the hole by expected lifetime.

    Offsets are arena offsets (they go into request descriptors as they are). One process owns
    a region and is the only one to call this; the lock is for that process's own threads (a
    front end's event loop allocating while a completion callback frees, or the executor's
    threads). ``alloc`` returns None when no free block fits, having changed nothing, so the
    caller can wait, shed or split. See the module docstring for the scheme.
    """

    def __init__(self, base: int, size: int, alignment: int = DEFAULT_ALIGNMENT) -> None:
        if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment!r}")
        if not isinstance(base, int) or base < 0 or base % alignment:
            raise ValueError(
                f"base must be an int >= 0 and a multiple of {alignment}, got {base!r}"
            )
        if not isinstance(size, int) or size <= 0 or size % alignment:
            raise ValueError(f"size must be a positive multiple of {alignment}, got {size!r}")
        self.base = base
        self.size = size
        self.alignment = alignment
        self._lock = threading.Lock()
        self._allocated: dict[int, int] = {}  # offset -> rounded size
        # offset -> (long-lived, allocation number): sorts in the order blocks are expected
        # to be freed, the last last
        self._release_order: dict[int, tuple[int, int]] = {}
        self._ends: dict[int, int] = {}  # allocation end -> offset: a hole's lower neighbour
        self._serial = 0
        self._in_use = 0
        self._free_starts: list[int] = [base]  # free blocks by address
        self._free_size: dict[int, int] = {base: size}
        self._by_size: list[tuple[int, int]] = [(size, base)]  # free blocks by (size, address)

    def aligned_size(self, nbytes: int) -> int:
        """Bytes ``alloc(nbytes)`` takes: rounded up to ``alignment``, and at least that."""
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        return max(-(-nbytes // self.alignment), 1) * self.alignment

    def alloc(self, nbytes: int, lifetime: str = "short") -> int | None:
        """The arena offset of ``nbytes`` reserved here, or None when no free block fits.

        ``lifetime`` is ``"short"`` (freed soon, roughly in allocation order: request buffers)
        or ``"long"`` (held until much later: a model's buffers); it decides only where in the
        best-fitting hole the block goes.
        """
        need = self.aligned_size(nbytes)
        if lifetime not in LIFETIMES:
            raise ValueError(f"lifetime must be one of {LIFETIMES}, got {lifetime!r}")
        long_lived = lifetime == "long"
        with self._lock:
            by_size = self._by_size
            index = bisect.bisect_left(by_size, (need, -1))
            if index == len(by_size):
                return None
            if long_lived:  # the highest address among the holes of the best-fitting size
                index = bisect.bisect_left(by_size, (by_size[index][0] + 1, -1)) - 1
            hole_size, start = by_size[index]
            self._serial += 1
            order = (int(long_lived), self._serial)
            offset = start
            if long_lived or self._upper_neighbour_outlives(start, hole_size):
                offset = start + hole_size - need
            self._remove_free(start)
            if offset > start:
                self._add_free(start, offset - start)
            if offset + need < start + hole_size:
                self._add_free(offset + need, start + hole_size - offset - need)
            self._allocated[offset] = need
            self._release_order[offset] = order
            self._ends[offset + need] = offset
            self._in_use += need
            return offset

    def reserve(self, offset: int, nbytes: int) -> bool:
        """Take ``nbytes`` at exactly ``offset`` (as ``alloc`` would have given them): False,
        having changed nothing, when they are not all free. For blocks another process still
        reads that this one must not hand out (a front end that restarted while the executor's
        batch read its predecessor's inputs)."""
        need = self.aligned_size(nbytes)
        if offset % self.alignment or offset < self.base or \
                offset + need > self.base + self.size:
            return False
        with self._lock:
            start = self._free_block_holding(offset)
            if start is None:
                return False
            hole_size = self._free_size[start]
            if offset + need > start + hole_size:
                return False
            self._serial += 1
            self._remove_free(start)
            if offset > start:
                self._add_free(start, offset - start)
            if offset + need < start + hole_size:
                self._add_free(offset + need, start + hole_size - offset - need)
            self._allocated[offset] = need
            self._release_order[offset] = (0, self._serial)
            self._ends[offset + need] = offset
            self._in_use += need
            return True

    def free(self, offset: int) -> None:
        """Return an allocation; ValueError when ``offset`` is not a live allocation's offset."""
        with self._lock:
            size = self._allocated.pop(offset, None)
            if size is None:
                if self._free_block_holding(offset) is not None:
                    raise ValueError(
                        f"offset {offset} lies in free space: a double free, or never allocated"
                    )
                raise ValueError(f"offset {offset} is not the start of an allocation here")
            del self._release_order[offset]
            del self._ends[offset + size]
            self._in_use -= size
            index = bisect.bisect_left(self._free_starts, offset)
            if index > 0:
                before = self._free_starts[index - 1]
                if before + self._free_size[before] == offset:
                    size += self._free_size[before]
                    self._remove_free(before)
                    offset = before
            after = offset + size
            if after in self._free_size:
                size += self._free_size[after]
                self._remove_free(after)
            self._add_free(offset, size)

    @property
    def bytes_in_use(self) -> int:
        """Bytes held by live allocations (after rounding)."""
        return self._in_use

    @property
    def bytes_free(self) -> int:
        return self.size - self._in_use

    @property
    def largest_free_block(self) -> int:
        """The largest ``aligned_size`` that ``alloc`` can satisfy now (0 when full)."""
        by_size = self._by_size
        return by_size[-1][0] if by_size else 0

    @property
    def allocations(self) -> int:
        """Number of live allocations."""
        return len(self._allocated)

    def free_blocks(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of every free block, by address."""
        with self._lock:
            return [(start, self._free_size[start]) for start in self._free_starts]

    def check_invariants(self) -> None:
        """Assert that the allocator's state is consistent (O(n): for tests and debugging)."""
        with self._lock:
            alignment, end = self.alignment, self.base + self.size
            free = [(start, self._free_size[start]) for start in self._free_starts]
            assert len(self._free_size) == len(free), "free-block index out of step"
            assert self._by_size == sorted((size, start) for start, size in free), (
                "size index differs from the address-ordered free list"
            )
            assert self._in_use == sum(self._allocated.values()), "bytes_in_use out of step"
            assert self._in_use + sum(size for _, size in free) == self.size, (
                f"free + used != region size {self.size}"
            )
            for start, size in free:
                assert size > 0, f"empty free block at {start}"
            for start, size in self._allocated.items():
                assert start % alignment == 0, f"allocation at {start} is not {alignment}-aligned"
                assert size > 0 and size % alignment == 0, f"allocation size {size} not a unit"
            blocks = sorted([(start, size, "free") for start, size in free]
                            + [(start, size, "used") for start, size in self._allocated.items()])
            position = self.base
            for (start, size, kind), following in zip(blocks, blocks[1:] + [None]):
                assert start >= position, f"{kind} block at {start} overlaps the one before it"
                assert start + size <= end, f"{kind} block at {start} runs past the region end"
                position = start + size
                if kind == "free" and following is not None and following[2] == "free":
                    assert following[0] != position, (
                        f"free blocks at {start} and {following[0]} are adjacent (not coalesced)"
                    )
            assert self._release_order.keys() == self._allocated.keys(), (
                "release order out of step with the allocations"
            )
            ends = {start + size: start for start, size in self._allocated.items()}
            assert self._ends == ends, "end index out of step with the allocations"

    def _upper_neighbour_outlives(self, start: int, size: int) -> bool:
        """Whether the block above the hole ``[start, start + size)`` is expected to be freed
        after the block below it (a region end counts as never freed). Coalescing keeps every
        hole between two allocations or region ends, so both lookups hit. Two region ends (an
        empty region): False, the block goes low."""
        end = start + size
        below = self._release_order[self._ends[start]] if start != self.base else _REGION_END
        above = self._release_order[end] if end != self.base + self.size else _REGION_END
        return above > below

    def _free_block_holding(self, offset: int) -> int | None:
        index = bisect.bisect_right(self._free_starts, offset) - 1
        if index >= 0:
            start = self._free_starts[index]
            if offset < start + self._free_size[start]:
                return start
        return None

    def _add_free(self, start: int, size: int) -> None:
        bisect.insort(self._free_starts, start)
        self._free_size[start] = size
        bisect.insort(self._by_size, (size, start))

    def _remove_free(self, start: int) -> None:
        size = self._free_size.pop(start)
        del self._free_starts[bisect.bisect_left(self._free_starts, start)]
        del self._by_size[bisect.bisect_left(self._by_size, (size, start))]
