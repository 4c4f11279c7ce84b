"""batchgate.server.ipc.arena and batchgate.batcher.arena_allocator on the CPU: the allocator as a data structure, the
shared mapping across real processes, the layout, and (on a machine with CUDA) pinning."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from batchgate.server.ipc.arena import PAGE_SIZE, ArenaLayout, SharedArena
from batchgate.batcher.arena_allocator import LIFETIMES, ArenaAllocator
from tests.support.regions import servers_leftovers

REPO = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
KIB, MIB = 1024, 1024 * 1024


def arena_mappings() -> int:
    """How many of this process's mappings are arena memfds."""
    return Path("/proc/self/maps").read_text().count("batchgate-arena")


# ----------------------------------------------------------------------------- allocator


class AllocatorMachine(RuleBasedStateMachine):
    """Random alloc/free sequences, short- and long-lived interleaved, against a model of the
    live allocations and of where each block belongs."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}  # offset -> aligned size
        self.release_order: dict[int, tuple[bool, int]] = {}  # offset -> (long-lived, number)
        self.allocated = 0
        self.freed: set[int] = set()

    @initialize(
        size_units=st.integers(1 * MIB // 256, 4 * MIB // 256),
        base_units=st.integers(0, 64),
        alignment=st.sampled_from([64, 256, 4096]),
    )
    def make(self, size_units: int, base_units: int, alignment: int) -> None:
        # size and base in 256-byte units, then made multiples of the alignment
        size = max(size_units * 256 // alignment, 1) * alignment
        self.allocator = ArenaAllocator(base_units * alignment, size, alignment=alignment)

    def _later_freed(self, below: int | None, above: int | None) -> bool:
        """Whether the block at ``above`` is expected to outlive the one at ``below`` (None: a
        region end, never freed)."""
        never = (True, float("inf"))
        rank_below = never if below is None else self.release_order[below]
        rank_above = never if above is None else self.release_order[above]
        return rank_above > rank_below

    def _alloc_and_check(self, nbytes: int, lifetime: str) -> int | None:
        allocator = self.allocator
        need = allocator.aligned_size(nbytes)
        assert need >= max(nbytes, 1) and need % allocator.alignment == 0
        largest, blocks = allocator.largest_free_block, allocator.free_blocks()
        in_use = allocator.bytes_in_use
        offset = allocator.alloc(nbytes, lifetime)
        if offset is None:
            assert need > largest, f"alloc({nbytes}) refused with a free block of {largest}"
            assert allocator.free_blocks() == blocks and allocator.bytes_in_use == in_use
            return None
        assert need <= largest
        assert allocator.base <= offset and offset + need <= allocator.base + allocator.size
        assert offset % allocator.alignment == 0
        for other, other_size in self.live.items():
            assert offset + need <= other or other + other_size <= offset, (
                f"[{offset}, +{need}) overlaps live [{other}, +{other_size})"
            )
        assert allocator.bytes_in_use == in_use + need
        # Best fit picks the hole; the lifetime picks the end of it.
        hole, hole_size = next((start, size) for start, size in blocks
                               if start <= offset < start + size)
        assert hole_size == min(size for _, size in blocks if size >= need), "not the best fit"
        equal_holes = [start for start, size in blocks if size == hole_size]
        top = hole + hole_size - need
        if lifetime == "long":
            assert hole == max(equal_holes) and offset == top, "long-lived: not the top"
        else:
            assert hole == min(equal_holes)
            below = next((start for start, size in self.live.items() if start + size == hole),
                         None)
            above = hole + hole_size if hole + hole_size in self.live else None
            expected = top if self._later_freed(below, above) else hole
            assert offset == expected, "short-lived: not against the neighbour freed later"
        self.allocated += 1
        self.live[offset] = need
        self.release_order[offset] = (lifetime == "long", self.allocated)
        self.freed.discard(offset)
        return offset

    @rule(nbytes=st.integers(0, 64 * KIB), lifetime=st.sampled_from(LIFETIMES))
    def alloc(self, nbytes: int, lifetime: str) -> None:
        self._alloc_and_check(nbytes, lifetime)

    @rule(lifetime=st.sampled_from(LIFETIMES))
    def alloc_the_largest_free_block(self, lifetime: str) -> None:
        largest = self.allocator.largest_free_block
        offset = self._alloc_and_check(largest, lifetime)
        assert (offset is None) == (largest == 0)

    @rule(lifetime=st.sampled_from(LIFETIMES))
    def alloc_one_byte_more_than_fits(self, lifetime: str) -> None:
        assert self._alloc_and_check(self.allocator.largest_free_block + 1, lifetime) is None

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data) -> None:
        offset = data.draw(st.sampled_from(sorted(self.live)))
        in_use = self.allocator.bytes_in_use
        self.allocator.free(offset)
        assert self.allocator.bytes_in_use == in_use - self.live.pop(offset)
        del self.release_order[offset]
        self.freed.add(offset)

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def free_again(self, data) -> None:
        offset = data.draw(st.sampled_from(sorted(self.freed)))
        blocks = self.allocator.free_blocks()
        with pytest.raises(ValueError, match=str(offset)):
            self.allocator.free(offset)
        assert self.allocator.free_blocks() == blocks

    @invariant()
    def consistent(self) -> None:
        allocator = self.allocator
        allocator.check_invariants()
        assert allocator.allocations == len(self.live)
        assert allocator.bytes_in_use == sum(self.live.values())
        assert allocator.bytes_free == allocator.size - allocator.bytes_in_use
        assert allocator.largest_free_block == max(
            (size for _, size in allocator.free_blocks()), default=0)

    def teardown(self) -> None:
        allocator = getattr(self, "allocator", None)
        if allocator is None:
            return
        for offset in list(self.live):
            allocator.free(offset)
        allocator.check_invariants()
        assert allocator.free_blocks() == [(allocator.base, allocator.size)]
        assert allocator.bytes_in_use == 0 and allocator.allocations == 0


AllocatorMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=80, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_allocator_random_sequences = AllocatorMachine.TestCase


def test_zero_byte_allocations_take_one_unit_each():
    allocator = ArenaAllocator(4096, 4 * 256)

    offsets = [allocator.alloc(0) for _ in range(4)]

    assert sorted(offsets) == [4096, 4096 + 256, 4096 + 512, 4096 + 768]
    assert allocator.bytes_in_use == 4 * 256
    assert allocator.alloc(0) is None
    allocator.free(offsets[2])
    assert allocator.alloc(0) == offsets[2]


def test_best_fit_takes_the_smallest_hole_that_fits():
    allocator = ArenaAllocator(0, 16 * 256)
    a, _, c, _ = (allocator.alloc(n * 256) for n in (4, 1, 2, 9))
    allocator.free(a)  # a 4-unit hole
    allocator.free(c)  # a 2-unit hole
    assert sorted(size for _, size in allocator.free_blocks()) == [512, 1024]

    # first fit would cut the 4-unit hole at 0; best fit keeps it whole for a larger request
    assert allocator.alloc(2 * 256) == c
    assert allocator.alloc(4 * 256) == a
    assert allocator.alloc(0) is None


def test_a_long_lived_block_takes_the_top_and_a_short_lived_one_the_bottom():
    allocator = ArenaAllocator(4096, 16 * 256)

    long_lived = allocator.alloc(3 * 256, "long")
    short_lived = allocator.alloc(2 * 256, "short")

    assert long_lived == 4096 + 13 * 256  # ignoring the hint would put it at the bottom
    assert short_lived == 4096
    assert allocator.free_blocks() == [(4096 + 2 * 256, 11 * 256)]
    allocator.free(long_lived)
    allocator.free(short_lived)
    assert allocator.free_blocks() == [(4096, 16 * 256)]


def test_equal_holes_go_to_the_lowest_short_lived_and_the_highest_long_lived():
    allocator = ArenaAllocator(0, 12 * 256)
    blocks = sorted(allocator.alloc(2 * 256, "long") for _ in range(6))
    for hole in blocks[0], blocks[2], blocks[4]:  # three 2-unit holes, none adjacent
        allocator.free(hole)

    assert allocator.alloc(2 * 256, "short") == blocks[0]
    assert allocator.alloc(2 * 256, "long") == blocks[4]
    assert allocator.free_blocks() == [(blocks[2], 2 * 256)]


def test_a_short_lived_block_goes_against_the_neighbour_freed_later():
    # The pattern that fragments plain best fit: a big short-lived buffer while the previous
    # one is still live. Against the region's end, the new one leaves its leftover next to
    # the old one, so freeing the old one makes one hole large enough for the next.
    allocator = ArenaAllocator(0, 10 * 256)
    older = allocator.alloc(4 * 256)
    newer = allocator.alloc(4 * 256)
    assert (older, newer) == (0, 6 * 256)  # plain best fit: 4 * 256, leaving 2 + 4 units apart

    allocator.free(older)

    assert allocator.free_blocks() == [(0, 6 * 256)]
    assert allocator.alloc(5 * 256) == 0  # against the older neighbour: freed sooner
    # Between a long-lived block above and a short-lived one below, it goes against the
    # long-lived one.
    allocator = ArenaAllocator(0, 10 * 256)
    top = allocator.alloc(2 * 256, "long")
    bottom = allocator.alloc(2 * 256)
    assert (bottom, top) == (0, 8 * 256)
    assert allocator.alloc(256) == 7 * 256
    allocator.check_invariants()


def test_reserve_takes_exactly_the_bytes_asked_for_and_only_free_ones():
    """What a restarted front end does with its predecessor's blocks the executor still reads:
    they are taken where they are, out of free space only, and freed as any other."""
    allocator = ArenaAllocator(4096, 256 * 16)
    assert allocator.reserve(4096 + 256 * 5, 300)  # two units
    assert not allocator.reserve(4096 + 256 * 6, 1)  # its second unit
    assert not allocator.reserve(4096 + 256 * 4, 512)  # runs into it
    assert not allocator.reserve(4096 + 100, 1)  # not aligned
    assert not allocator.reserve(4096 + 256 * 15, 512)  # past the end
    assert not allocator.reserve(0, 1)  # before the region
    assert allocator.bytes_in_use == 512
    allocator.check_invariants()
    assert allocator.alloc(256 * 11) is None  # the free space is cut in two: 5 and 9 units
    assert allocator.alloc(256 * 9) is not None
    allocator.free(4096 + 256 * 5)
    allocator.check_invariants()


def test_alloc_refuses_an_unknown_lifetime():
    allocator = ArenaAllocator(0, 1024)
    with pytest.raises(ValueError, match="lifetime must be one of .*got 'forever'"):
        allocator.alloc(256, "forever")
    assert allocator.bytes_in_use == 0 and allocator.free_blocks() == [(0, 1024)]


def test_freeing_between_two_holes_coalesces_all_three():
    allocator = ArenaAllocator(0, 8 * 256)
    a, b, c, d = sorted(allocator.alloc(2 * 256) for _ in range(4))
    allocator.free(a)
    allocator.free(c)
    assert allocator.free_blocks() == [(a, 512), (c, 512)]

    allocator.free(b)

    assert allocator.free_blocks() == [(a, 3 * 512)]
    assert allocator.largest_free_block == 3 * 512
    allocator.free(d)
    assert allocator.free_blocks() == [(0, 8 * 256)]


def test_free_refuses_what_is_not_a_live_allocation():
    allocator = ArenaAllocator(0, 8 * 256)
    a = allocator.alloc(512)
    allocator.alloc(256)
    allocator.free(a)

    with pytest.raises(ValueError, match="offset 0 lies in free space: a double free"):
        allocator.free(a)
    with pytest.raises(ValueError, match="offset 1024 lies in free space"):
        allocator.free(1024)  # never allocated
    with pytest.raises(ValueError, match="offset 100000 is not the start of an allocation"):
        allocator.free(100000)
    assert allocator.allocations == 1
    allocator.check_invariants()


def test_free_refuses_an_offset_inside_an_allocation():
    allocator = ArenaAllocator(0, 8 * 256)
    a = allocator.alloc(1024)

    with pytest.raises(ValueError, match=f"offset {a + 256} is not the start"):
        allocator.free(a + 256)
    assert allocator.allocations == 1


@pytest.mark.parametrize("kwargs, text", [
    ({"base": 0, "size": 1024, "alignment": 3}, "alignment must be a power of two, got 3"),
    ({"base": 0, "size": 1024, "alignment": 0}, "alignment must be a power of two, got 0"),
    ({"base": 100, "size": 1024}, "multiple of 256, got 100"),
    ({"base": -256, "size": 1024}, "got -256"),
    ({"base": 0, "size": 1000}, "size must be a positive multiple of 256, got 1000"),
    ({"base": 0, "size": 0}, "got 0"),
])
def test_allocator_refuses_bad_regions(kwargs, text):
    with pytest.raises(ValueError, match=text):
        ArenaAllocator(**kwargs)


def test_alloc_refuses_a_negative_size():
    with pytest.raises(ValueError, match="got -1"):
        ArenaAllocator(0, 1024).alloc(-1)


def _adjacent_free_blocks(allocator: ArenaAllocator) -> None:
    allocator._remove_free(0)
    allocator._add_free(0, 512)
    allocator._add_free(512, 512)


def _misaligned_allocation(allocator: ArenaAllocator) -> None:
    allocator.alloc(256)
    del allocator._allocated[0]
    allocator._allocated[1] = 256


def _overlapping_allocations(allocator: ArenaAllocator) -> None:
    for _ in range(4):
        allocator.alloc(256)  # the whole region
    del allocator._allocated[256]
    allocator._allocated[512] = 512  # also covers the allocation at 768


def _lost_free_bytes(allocator: ArenaAllocator) -> None:
    allocator._remove_free(0)
    allocator._add_free(0, 768)


def _stale_end_index(allocator: ArenaAllocator) -> None:
    offset = allocator.alloc(256)
    allocator._ends[offset + 512] = allocator._ends.pop(offset + 256)


@pytest.mark.parametrize("corrupt, text", [
    (_adjacent_free_blocks, "adjacent"),
    (_misaligned_allocation, "not 256-aligned"),
    (_overlapping_allocations, "overlaps"),
    (_lost_free_bytes, r"free \+ used"),
    (_stale_end_index, "end index out of step"),
])
def test_check_invariants_catches_a_corrupted_state(corrupt, text):
    allocator = ArenaAllocator(0, 1024)
    allocator.check_invariants()
    corrupt(allocator)

    with pytest.raises(AssertionError, match=text):
        allocator.check_invariants()


# ----------------------------------------------------------------------------- layout


@given(
    size_bytes=st.integers(1, 64 * MIB),
    slots=st.integers(1, 32),
    output_fraction=st.floats(0.01, 0.99),
)
@settings(max_examples=200, deadline=None)
def test_layout_regions_are_disjoint_whole_pages_inside_the_arena(
        size_bytes, slots, output_fraction):
    pages = size_bytes // PAGE_SIZE
    output_pages = int(pages * output_fraction)
    fits = output_pages >= 1 and (pages - output_pages) // slots >= 1
    if not fits:
        with pytest.raises(ValueError, match=f"got size_bytes {size_bytes}"):
            ArenaLayout(size_bytes, slots, output_fraction)
        return

    layout = ArenaLayout(size_bytes, slots, output_fraction)

    regions = [layout.input_region(slot) for slot in range(slots)] + [layout.output_region()]
    for offset, size in regions:
        assert offset % PAGE_SIZE == 0 and size % PAGE_SIZE == 0 and size >= PAGE_SIZE
    ordered = sorted(regions)
    for (offset, size), (next_offset, _) in zip(ordered, ordered[1:]):
        assert offset + size <= next_offset
    assert ordered[-1][0] + ordered[-1][1] <= size_bytes
    assert sum(size for _, size in regions) == pages * PAGE_SIZE  # every whole page is used
    assert len({size for _, size in regions[:-1]}) == 1
    assert layout.output_region()[1] >= output_pages * PAGE_SIZE


@pytest.mark.parametrize("args, text", [
    ((0, 1), "size_bytes must be a positive int, got 0"),
    ((-PAGE_SIZE, 1), "got -"),
    ((float(16 * PAGE_SIZE), 1), "size_bytes must be a positive int, got 65536.0"
     if PAGE_SIZE == 4096 else "got"),
    ((16 * PAGE_SIZE, 0), "slots must be an int >= 1, got 0"),
    ((16 * PAGE_SIZE, 1.5), "got 1.5"),
    ((16 * PAGE_SIZE, 1, 0.0), "output_fraction must lie strictly between 0 and 1, got 0.0"),
    ((16 * PAGE_SIZE, 1, 1.0), "got 1.0"),
    ((16 * PAGE_SIZE, 1, -0.5), "got -0.5"),
    ((PAGE_SIZE, 1), f"got size_bytes {PAGE_SIZE} \\(1 pages\\)"),
    ((8 * PAGE_SIZE, 8), "needs at least one page"),
])
def test_layout_refuses_bad_arguments(args, text):
    with pytest.raises(ValueError, match=text):
        ArenaLayout(*args)


def test_layout_refuses_an_unknown_slot():
    layout = ArenaLayout(64 * PAGE_SIZE, 4)
    for slot in (-1, 4):
        with pytest.raises(ValueError, match=f"slot must lie in 0..3, got {slot}"):
            layout.input_region(slot)


def test_regions_of_one_arena_do_not_disturb_each_other():
    layout = ArenaLayout(64 * PAGE_SIZE, slots=2)
    with SharedArena.create(layout.size_bytes) as arena:
        allocators = [ArenaAllocator(*layout.input_region(slot)) for slot in range(2)]
        allocators.append(ArenaAllocator(*layout.output_region()))
        views = []
        for value, allocator in enumerate(allocators, start=1):
            nbytes = allocator.largest_free_block  # fill the region to its last byte
            offset = allocator.alloc(nbytes)
            views.append(arena.array(offset, np.uint8, nbytes))
            views[-1][:] = value
        assert [int(view.min()) for view in views] == [int(view.max()) for view in views] \
            == [1, 2, 3]
        del views


# ----------------------------------------------------------------------------- shared arena


def test_two_views_of_the_same_bytes_see_each_others_writes():
    with SharedArena.create(64 * KIB) as arena:
        floats = arena.array(4096, np.float32, (2, 3))
        raw = arena.array(4096, np.uint8, 24)
        floats[:] = [[1, 2, 3], [4, 5, 6]]

        assert raw.tobytes() == np.arange(1, 7, dtype=np.float32).tobytes()
        raw[:4] = np.frombuffer(np.float32(-1).tobytes(), np.uint8)
        assert floats[0, 0] == -1
        assert floats.flags.writeable and floats.flags.c_contiguous
        with arena.read(4096, 24) as view:
            assert view.readonly
            assert np.frombuffer(view, np.float32).tolist() == [-1, 2, 3, 4, 5, 6]
        del floats, raw


def test_write_copies_bytes_buffers_and_arrays():
    with SharedArena.create(64 * KIB) as arena:
        arena.write(0, b"batch")
        arena.write(8, memoryview(bytearray(b"gate")))
        strided = np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::2]  # not contiguous
        arena.write(256, strided)

        assert bytes(arena.read(0, 5)) == b"batch"
        assert bytes(arena.read(8, 4)) == b"gate"
        assert arena.array(256, np.int32, (3, 2)).tolist() == strided.tolist()
        with pytest.raises(ValueError, match="got dtype object"):
            arena.write(256, strided.astype(object))


@pytest.mark.parametrize("offset, shape, dtype", [
    (-1, (1,), np.uint8),
    (64 * KIB - 3, (1,), np.float32),
    (0, (64 * KIB + 1,), np.uint8),
    (64 * KIB + 1, (0,), np.uint8),
])
def test_an_array_outside_the_arena_is_refused(offset, shape, dtype):
    with SharedArena.create(64 * KIB) as arena:
        with pytest.raises(ValueError, match=f"at offset {offset} do not fit in the arena of "
                                             f"{64 * KIB} bytes"):
            arena.array(offset, dtype, shape)


def test_the_last_bytes_of_the_arena_are_reachable_and_writes_past_them_are_refused():
    with SharedArena.create(64 * KIB) as arena:
        arena.array(64 * KIB - 4, np.float32, 1)[0] = 7
        assert arena.array(64 * KIB, np.uint8, 0).size == 0
        with pytest.raises(ValueError, match=f"5 bytes at offset {64 * KIB - 4}"):
            arena.write(64 * KIB - 4, b"12345")
        assert arena.array(64 * KIB - 4, np.float32, 1)[0] == 7
        with pytest.raises(ValueError, match="got dtype object"):
            arena.array(0, object, 1)


@pytest.mark.parametrize("size", [0, -1, 1.5])
def test_create_refuses_a_bad_size(size):
    with pytest.raises(ValueError, match=f"got {size}"):
        SharedArena.create(size)


# In a child: if close() ever unmapped pages under a live view, touching the view would
# segfault, and that should fail this test, not the whole test run.
CLOSE_WITH_A_LIVE_VIEW = """
import os
from pathlib import Path

import numpy as np

from batchgate.server.ipc.arena import SharedArena


def arena_mappings():
    return Path("/proc/self/maps").read_text().count("batchgate-arena")


arena = SharedArena.create(64 * 1024)
fd = arena.fd
view = arena.array(0, np.int64, 4)
view[:] = 41

arena.close()
arena.close()

assert arena.closed and arena.fd == -1
try:
    os.fstat(fd)
    raise AssertionError("the descriptor is still open")
except OSError:
    pass
try:
    arena.array(0, np.uint8, 1)
    raise AssertionError("a closed arena handed out a view")
except ValueError as exc:
    assert "closed" in str(exc), exc
view += 1  # the view keeps its pages mapped
assert view.tolist() == [42] * 4
assert arena_mappings() == 1
del view
assert arena_mappings() == 0
print("ok")
"""


def test_close_with_a_live_view_keeps_the_view_valid_and_unmaps_after_it():
    child = subprocess.run([sys.executable, "-c", CLOSE_WITH_A_LIVE_VIEW], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, f"exit status {child.returncode}: {child.stderr}"
    assert child.stdout.strip() == "ok"


def test_close_unmaps_when_no_view_is_left():
    before = arena_mappings()
    arena = SharedArena.create(64 * KIB)
    assert arena_mappings() == before + 1
    arena.array(0, np.uint8, 10)[:] = 1  # a temporary view, gone by the next line
    arena.read(0, 10).release()

    arena.close()

    assert arena_mappings() == before


def test_attach_refuses_more_bytes_than_the_descriptor_holds():
    with SharedArena.create(64 * KIB) as arena:
        with pytest.raises(ValueError, match=f"holds {64 * KIB} bytes, fewer than the"):
            SharedArena.attach(arena.fd, 64 * KIB + 1)


CHILD_REPLIES = """
import sys
import numpy as np
from batchgate.server.ipc.arena import SharedArena

arena = SharedArena.attach(int(sys.argv[1]), int(sys.argv[2]))
request = arena.array(0, np.float32, (4, 4))
arena.write(4096, request * 2 + 1)
print(float(request.sum()))
del request
arena.close()
"""


def test_a_child_attaches_by_descriptor_reads_and_replies():
    with SharedArena.create(64 * KIB) as arena:
        request = np.arange(16, dtype=np.float32).reshape(4, 4)
        arena.write(0, request)

        child = subprocess.run(
            [sys.executable, "-c", CHILD_REPLIES, str(arena.fd), str(arena.size)],
            cwd=REPO, pass_fds=[arena.fd], capture_output=True, text=True, timeout=60)

        assert child.returncode == 0, child.stderr
        assert float(child.stdout) == float(request.sum())
        assert arena.array(4096, np.float32, (4, 4)).tolist() == (request * 2 + 1).tolist()


def test_the_descriptor_does_not_leak_into_children_not_given_it():
    check = ("import os, sys\n"
             "try:\n    print(os.readlink(f'/proc/self/fd/{sys.argv[1]}'))\n"
             "except OSError:\n    print('absent')\n")
    with SharedArena.create(64 * KIB) as arena:
        child = subprocess.run([sys.executable, "-c", check, str(arena.fd)], close_fds=False,
                               capture_output=True, text=True, timeout=60)
        assert child.returncode == 0, child.stderr
        assert "batchgate-arena" not in child.stdout
        assert "batchgate-arena" in os.readlink(f"/proc/self/fd/{arena.fd}")


CHILD_WAITS = """
import sys, time
from batchgate.server.ipc.arena import SharedArena

arena = SharedArena.attach(int(sys.argv[1]), int(sys.argv[2]))
arena.write(100, b"child was here")
print("ready", flush=True)
time.sleep(60)
"""


def test_nothing_is_left_in_dev_shm_after_close_or_a_killed_child():
    shm_before = servers_leftovers(os.listdir("/dev/shm"))
    mappings_before = arena_mappings()
    arena = SharedArena.create(1 * MIB)
    assert arena_mappings() == mappings_before + 1
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD_WAITS, str(arena.fd), str(arena.size)],
        cwd=REPO, pass_fds=[arena.fd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
        child.stdout.close()
        child.stderr.close()

    assert bytes(arena.read(100, 14)) == b"child was here"
    assert servers_leftovers(os.listdir("/dev/shm")) == shm_before
    arena.close()
    assert servers_leftovers(os.listdir("/dev/shm")) == shm_before
    assert arena_mappings() == mappings_before


IMPORT_WITHOUT_TORCH = """
import importlib.abc
import sys


class Forbid(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "torch":
            raise ImportError("torch is forbidden in this test")
        return None


sys.meta_path.insert(0, Forbid())
from batchgate.server.ipc.arena import ArenaLayout, SharedArena
from batchgate.batcher.arena_allocator import ArenaAllocator

with SharedArena.create(1 << 20) as arena:
    layout = ArenaLayout(arena.size, slots=2)
    allocator = ArenaAllocator(*layout.input_region(1))
    arena.write(allocator.alloc(3), b"ok\\n")
print("imported without torch")
"""


def test_front_ends_use_the_arena_without_torch():
    child = subprocess.run([sys.executable, "-c", IMPORT_WITHOUT_TORCH], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "imported without torch"


@pytest.mark.skipif(CUDA, reason="a CUDA device is present: test_pin_registers_with_cuda covers it")
def test_pin_without_cuda_says_no():
    with SharedArena.create(64 * KIB) as arena:
        assert arena.pin() is False
        assert not arena.pinned
        arena.unpin()


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device; this machine has none")
def test_pin_registers_with_cuda():
    with SharedArena.create(4 * MIB) as arena:
        host = torch.from_numpy(arena.array(0, np.float32, 1024))
        host.copy_(torch.arange(1024, dtype=torch.float32))
        assert not host.is_pinned()

        assert arena.pin() is True
        assert arena.pin() is True
        assert arena.pinned and host.is_pinned()
        on_device = host.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(on_device.cpu(), host)

        arena.unpin()
        assert not arena.pinned and not host.is_pinned()
        assert arena.pin() is True
        del host, on_device
    assert not arena.pinned  # close() unregistered it
