"""Byte ranges inside one arena region: ``ArenaAllocator``, for a region of the shared arena
(``batchgate.server.ipc.arena``) and for a model's device arena (``batchgate.batcher.pool``).

The scheme: **best fit over a free list kept in two sorted lists** — free blocks by address
(``_free_starts`` plus a size per start) and by ``(size, address)`` (``_by_size``) — with
**immediate coalescing** of address neighbours on free, every size rounded up to
``alignment`` (256 by default: a multiple of the cache line and of what CUDA copies and kernels
want), and **placement inside the chosen hole by expected lifetime**: each ``alloc`` says
whether the block is ``"short"``-lived (a request's inputs, freed when its batch has run) or
``"long"``-lived (a model's buffers, freed when it unloads).

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

The figures that chose it: docs/decisions/0012-arena-blocks-placed-by-lifetime.md.

Cost per ``alloc``/``free``: a few ``bisect`` searches (O(log n) in the number of free blocks),
dict lookups for the allocation and for the hole's two neighbours (``_ends`` maps an
allocation's end to its start), and list inserts/deletes (a C ``memmove`` of pointers). No
per-byte work, no scan over the live allocations. ``check_invariants`` is the O(n) exception,
for tests.
"""

from __future__ import annotations

import bisect
import threading

DEFAULT_ALIGNMENT = 256
LIFETIMES = ("short", "long")  # what ``ArenaAllocator.alloc`` is told about a block
_REGION_END = (2, 0)  # release order of a region's ends: after every block's (never freed)


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
