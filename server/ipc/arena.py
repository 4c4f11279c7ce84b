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

Each region's byte ranges are handed out by ``batchgate.batcher.arena_allocator``.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os

import numpy as np

PAGE_SIZE = mmap.PAGESIZE
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
