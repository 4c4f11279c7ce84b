"""Shared-memory regions clients register (Triton's system and CUDA shared-memory extensions).

A client on the same host puts a tensor in a region it created (``shm_open``, or a CUDA IPC
handle), registers the region under a name, and then names (region, offset, byte size) in a
request's ``shared_memory_*`` parameters instead of sending the bytes. ``SharedMemoryRegistry``
lives in the process that holds the models (the executor process, or the single-process
server): front ends only check the parameters and forward them (``protos/wire.proto``,
``Placement``).

Inputs are read from the region's file with ``pread``, never through a mapping: a client that
truncates its file while the server reads a mapping would make the read fault (SIGBUS) and kill
the process, where ``pread`` just comes back short. A tensor of a fixed-size datatype is read
right before its batch reads it (the request's ``check_inputs``), into a buffer of its own that
the batch copies from; until then the request holds a read-only placeholder of its shape and
datatype (no memory behind it). BOOL and BYTES tensors are read when the request arrives, as
their bytes are checked then. A request whose region shrank fails alone with INVALID_ARGUMENT.
Outputs are written with ``os.pwrite`` once the batch is done. Nothing maps a client's file.
Registrations belong to the server, not to a connection; unregister-all and ``close`` (at exit)
release every one. A region's descriptor is closed once nothing refers to it: its
registration, or requests in flight that still read it.

A region whose key was unlinked while registered is refused (its pages would otherwise keep
being served while nobody else can see them). Bytes the client changes while its request is in
flight are the client's business: the request reads whatever is there when it is read. The
extension is still for trusted local clients (the same user, or a container sharing
``/dev/shm`` on purpose): the registration RPCs open files with the server's permissions.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import stat
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import structlog

from batchgate.batcher.errors import InvalidRequest, NotSupported, quoted
from batchgate.batcher.spec import NUMPY_DTYPES
from batchgate.protos import inference_pb2 as pb
from batchgate.server.rules import messages
from batchgate.server.rules.status import Code, StatusError

log = structlog.get_logger(__name__)

SHM_ROOT = "/dev/shm"
OFF_MESSAGE = messages.SHARED_MEMORY_OFF.text
NO_CUDA_MESSAGE = "this server has no CUDA device; CUDA shared memory needs one"


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """Bytes of a registered region named by a request: ``offset`` from the registration's
    start. ``shape`` is the tensor's (inputs), or () for an output (the model decides it)."""

    region: str
    offset: int
    nbytes: int
    shape: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Placed:
    """An output written into the client's region: the reply carries its shape, no bytes."""

    shape: tuple[int, ...]
    nbytes: int = 0


class _SystemRegion:
    """One registration of a ``/dev/shm`` file: its descriptor, kept open to read and write it
    and to check the file's size and identity at use."""

    __slots__ = ("name", "key", "offset", "byte_size", "fd", "inode", "__weakref__")

    def __init__(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self.name, self.key, self.offset, self.byte_size = name, key, offset, byte_size
        path = _key_path(key)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            code = Code.NOT_FOUND if exc.errno == errno.ENOENT else Code.INVALID_ARGUMENT
            raise StatusError(code, f"cannot open shared-memory key {quoted(key)} for region "
                                    f"{quoted(name)}: {exc.strerror}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise StatusError(Code.INVALID_ARGUMENT,
                                  f"shared-memory key {quoted(key)} is not a regular file")
            if offset + byte_size > info.st_size:
                raise StatusError(Code.INVALID_ARGUMENT, (
                    f"shared-memory region {quoted(name)}: offset {offset} + byte_size "
                    f"{byte_size} is past the end of key {quoted(key)} ({info.st_size} bytes)"))
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.inode = (info.st_dev, info.st_ino)
        # The descriptor outlives an unregister while requests in flight still read it.
        weakref.finalize(self, os.close, fd)

    def check(self, what: str) -> None:
        """InvalidRequest when the file shrank below the registration. Requests in flight
        when their region is unregistered still read it: the descriptor stays open while
        anything refers to this registration."""
        size = os.fstat(self.fd).st_size
        if size < self.offset + self.byte_size:
            raise InvalidRequest(
                f"{what}: shared-memory region {quoted(self.name)} shrank: key "
                f"{quoted(self.key)} has {size} bytes, its registration needs "
                f"{self.offset + self.byte_size}; register it again")

    def read_into(self, out, offset: int, what: str) -> None:
        """Fill ``out`` (a writable buffer) with the bytes at ``offset`` of the registration,
        by ``pread``: InvalidRequest when the file shrank under them (never a fault)."""
        view = memoryview(out).cast("B")
        done, size = 0, len(view)
        while done < size:
            read = os.preadv(self.fd, [view[done:]], self.offset + offset + done)
            if read == 0:
                self.check(what)  # says by how much it shrank
                raise InvalidRequest(f"{what}: shared-memory region {quoted(self.name)} "
                                     f"ended {size - done} bytes early; register it again")
            done += read

    def check_key(self, what: str) -> None:
        """InvalidRequest when the key was unlinked (or replaced) since registration."""
        try:
            info = os.stat(_key_path(self.key), follow_symlinks=False)
            same = (info.st_dev, info.st_ino) == self.inode
        except OSError:
            same = False
        if not same:
            raise InvalidRequest(
                f"{what}: shared-memory key {quoted(self.key)} of region {quoted(self.name)} "
                "was removed (unlinked) by its owner while registered; unregister the region "
                "and register it again")


class SharedMemoryRegistry:
    """Every registration of one server, answering the registration RPCs' messages."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._system: dict[str, _SystemRegion] = {}
        self._cuda: dict[str, object] = {}  # name -> batchgate.server.executor.cuda_ipc.CudaRegion
        self._cuda_ipc = None  # batchgate.server.executor.cuda_ipc, imported on the first CUDA registration

    def handlers(self) -> dict[type, Callable[[Any], Awaitable[Any]]]:
        """Each registration RPC's request message type, and what answers it."""
        return {pb.SystemSharedMemoryStatusRequest: self.system_status,
                pb.SystemSharedMemoryRegisterRequest: self.system_register,
                pb.SystemSharedMemoryUnregisterRequest: self.system_unregister,
                pb.CudaSharedMemoryStatusRequest: self.cuda_status,
                pb.CudaSharedMemoryRegisterRequest: self.cuda_register,
                pb.CudaSharedMemoryUnregisterRequest: self.cuda_unregister}

    # -- the registration RPCs -----------------------------------------------------------------

    async def system_status(self, request: pb.SystemSharedMemoryStatusRequest
                            ) -> pb.SystemSharedMemoryStatusResponse:
        self._check_enabled()
        response = pb.SystemSharedMemoryStatusResponse()
        if request.name:
            if request.name not in self._system:
                raise StatusError(Code.NOT_FOUND, (
                    f"no system shared-memory region {quoted(request.name)} is registered"))
            chosen = [self._system[request.name]]
        else:
            chosen = list(self._system.values())
        for region in chosen:
            response.regions[region.name].CopyFrom(
                pb.SystemSharedMemoryStatusResponse.RegionStatus(
                    name=region.name, key=region.key, offset=region.offset,
                    byte_size=region.byte_size))
        return response

    async def system_register(self, request: pb.SystemSharedMemoryRegisterRequest
                              ) -> pb.SystemSharedMemoryRegisterResponse:
        self._check_enabled()
        self._check_new_name(request.name)
        if request.byte_size == 0:
            raise StatusError(Code.INVALID_ARGUMENT, (
                f"shared-memory region {quoted(request.name)}: byte_size must be > 0"))
        _key_path(request.key)
        region = _SystemRegion(request.name, request.key, request.offset, request.byte_size)
        self._system[request.name] = region
        log.info("shared_memory_registered", kind="system", region=request.name,
                 key=request.key, offset=request.offset, byte_size=request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    async def system_unregister(self, request: pb.SystemSharedMemoryUnregisterRequest
                                ) -> pb.SystemSharedMemoryUnregisterResponse:
        """An unknown name is not an error (Triton's behaviour): the region is not there."""
        self._check_enabled()
        names = [request.name] if request.name else list(self._system)
        for name in names:
            # Its descriptor closes once requests in flight that still read it have gone.
            if self._system.pop(name, None) is not None:
                log.info("shared_memory_unregistered", kind="system", region=name)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def cuda_status(self, request: pb.CudaSharedMemoryStatusRequest
                          ) -> pb.CudaSharedMemoryStatusResponse:
        self._check_cuda()
        response = pb.CudaSharedMemoryStatusResponse()
        if request.name:
            if request.name not in self._cuda:
                raise StatusError(Code.NOT_FOUND, (
                    f"no CUDA shared-memory region {quoted(request.name)} is registered"))
            chosen = [self._cuda[request.name]]
        else:
            chosen = list(self._cuda.values())
        for region in chosen:
            response.regions[region.name].CopyFrom(
                pb.CudaSharedMemoryStatusResponse.RegionStatus(
                    name=region.name, device_id=region.device_id, byte_size=region.byte_size))
        return response

    async def cuda_register(self, request: pb.CudaSharedMemoryRegisterRequest
                            ) -> pb.CudaSharedMemoryRegisterResponse:
        cuda_ipc = self._check_cuda()
        self._check_new_name(request.name)
        if request.byte_size == 0:
            raise StatusError(Code.INVALID_ARGUMENT, (
                f"shared-memory region {quoted(request.name)}: byte_size must be > 0"))
        self._cuda[request.name] = cuda_ipc.CudaRegion(
            request.name, request.raw_handle, request.device_id, request.byte_size)
        log.info("shared_memory_registered", kind="cuda", region=request.name,
                 device_id=request.device_id, byte_size=request.byte_size)
        return pb.CudaSharedMemoryRegisterResponse()

    async def cuda_unregister(self, request: pb.CudaSharedMemoryUnregisterRequest
                              ) -> pb.CudaSharedMemoryUnregisterResponse:
        self._check_cuda()
        names = [request.name] if request.name else list(self._cuda)
        for name in names:
            region = self._cuda.pop(name, None)
            if region is not None:
                region.release()
                log.info("shared_memory_unregistered", kind="cuda", region=name)
        return pb.CudaSharedMemoryUnregisterResponse()

    def close(self) -> None:
        """Release every registration (the server is stopping)."""
        for region in self._cuda.values():
            region.release()
        self._system.clear()
        self._cuda.clear()

    # -- requests ------------------------------------------------------------------------------

    def attach(self, request, spec) -> None:
        """Put each placed input's array into a ``PlacedRequest`` (single-process server)."""
        named = []
        for index, (placement, tspec) in enumerate(zip(request.input_placements, spec.inputs)):
            if placement is not None:
                request.inputs[index] = self.input_array(placement, tspec.name, tspec.datatype)
                named.append((index, tspec.name, placement))
        request.check_inputs = self.checker(named)

    def place_outputs(self, request, spec, outputs: dict) -> dict:
        """Write a ``PlacedRequest``'s placed outputs into their regions: ``outputs`` with
        those entries ``Placed`` (single-process server)."""
        placed = dict(outputs)
        for name, placement in zip(request.requested_outputs or (), request.output_placements):
            if placement is not None:
                placed[name] = self.write_output(placement, name, spec.output(name).datatype,
                                                 outputs[name])
        return placed

    def input_array(self, placement: Placement, name: str, datatype: str):
        """The input's array: for a system region, a read-only placeholder of its shape and
        dtype until ``checker``'s check reads it (BOOL and BYTES: read now); a tensor on the
        device of a CUDA region. InvalidRequest / NOT_FOUND saying why not."""
        what = f"input {quoted(name)}"
        region = self._region(placement, what)
        if not isinstance(region, _SystemRegion):
            return region.tensor(placement.offset, placement.nbytes, placement.shape,
                                 datatype)
        region.check(what)
        region.check_key(what)
        if datatype == "BYTES":
            from batchgate.server.frontend.codec import bytes_array

            data = bytearray(placement.nbytes)
            region.read_into(data, placement.offset, what)
            try:
                return bytes_array(data, placement.shape)
            except ValueError:
                raise InvalidRequest(
                    f"{what}: the {placement.nbytes} bytes in shared-memory region "
                    f"{quoted(region.name)} are not a BYTES tensor of shape "
                    f"{list(placement.shape)} (per element, a 4-byte little-endian length, "
                    "then that many bytes)") from None
        dtype = NUMPY_DTYPES[datatype]
        if datatype == "BOOL":  # its bytes are checked now: read now
            array = np.empty(placement.shape, dtype)
            region.read_into(array, placement.offset, what)
            if array.size and array.view(np.uint8).max() > 1:
                raise InvalidRequest(f"{what}: a BOOL tensor must hold bytes 0 and 1 only")
            return array
        # One element broadcast to the shape: read-only, and no memory behind it.
        return np.broadcast_to(np.zeros((), dtype), placement.shape)

    def checker(self, placements) -> object:
        """A request's ``check_inputs`` (``placements``: its placed inputs' (index, name,
        Placement)): right before its batch reads them, the inputs still standing for a system
        region are read from it into buffers of their own (None when none is left to read)."""
        unread = []
        for index, name, placement in placements:
            region = self._system.get(placement.region)
            if region is not None:
                unread.append((index, f"input {quoted(name)}", region, placement.offset))
        if not unread:
            return None

        def check_inputs(request) -> None:
            inputs = request.inputs
            for index, what, region, offset in unread:
                standing = inputs[index]
                if standing.flags.writeable:  # read already (BOOL, BYTES, a second batch)
                    continue
                array = np.empty(standing.shape, standing.dtype)
                region.read_into(array, offset, what)
                inputs[index] = array
        return check_inputs

    def write_output(self, placement: Placement, name: str, datatype: str,
                     array: np.ndarray) -> Placed:
        """Write an output into its region (BYTES in the KServe encoding); InvalidRequest
        when it does not fit the bytes the request gave it."""
        what = f"output {quoted(name)}"
        region = self._region(placement, what)
        if datatype == "BYTES":
            from batchgate.server.frontend.codec import bytes_encoding

            data = memoryview(bytes_encoding(array))
        else:
            if datatype == "BF16" or array.dtype != NUMPY_DTYPES[datatype]:
                array = array.astype(NUMPY_DTYPES[datatype], copy=False)
            data = memoryview(np.ascontiguousarray(array)).cast("B")
        if data.nbytes > placement.nbytes:
            raise InvalidRequest(
                f"{what} needs {data.nbytes} bytes; shared_memory_byte_size gives it "
                f"{placement.nbytes} in region {quoted(region.name)}")
        placed = Placed(tuple(array.shape), data.nbytes)
        if not isinstance(region, _SystemRegion):
            region.write(placement.offset, data)
            return placed
        region.check(what)
        region.check_key(what)
        # pwrite: a file that shrank meanwhile cannot fault the process.
        at = region.offset + placement.offset
        while data:
            written = os.pwrite(region.fd, data, at)
            data, at = data[written:], at + written
        return placed

    # -- helpers -------------------------------------------------------------------------------

    def _region(self, placement: Placement, what: str):
        region = self._system.get(placement.region) or self._cuda.get(placement.region)
        if region is None:
            raise StatusError(Code.NOT_FOUND, (
                f"{what}: no shared-memory region {quoted(placement.region)} is registered"))
        end = placement.offset + placement.nbytes
        if end > region.byte_size:
            raise InvalidRequest(
                f"{what}: {placement.nbytes} bytes at offset {placement.offset} lie past the "
                f"end of shared-memory region {quoted(region.name)} ({region.byte_size} "
                "bytes registered)")
        return region

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise NotSupported(OFF_MESSAGE)

    def cuda_available(self) -> bool:
        """Whether CUDA regions can be registered here: on, and a CUDA device in this process."""
        if not self.enabled:
            return False
        from batchgate.server.executor import cuda_ipc

        return cuda_ipc.available()

    def _check_cuda(self):
        self._check_enabled()
        if self._cuda_ipc is None:
            from batchgate.server.executor import cuda_ipc

            if not cuda_ipc.available():
                raise StatusError(Code.FAILED_PRECONDITION, NO_CUDA_MESSAGE)
            self._cuda_ipc = cuda_ipc
        return self._cuda_ipc

    def _check_new_name(self, name: str) -> None:
        if not name:
            raise StatusError(Code.INVALID_ARGUMENT, "a shared-memory region needs a name")
        if name in self._system or name in self._cuda:
            raise StatusError(Code.ALREADY_EXISTS, (
                f"a shared-memory region named {quoted(name)} is already registered"))


def _key_path(key: str) -> str:
    """The file of a ``shm_open`` key: one name in /dev/shm, never a path out of it."""
    name = key[1:] if key.startswith("/") else key
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise StatusError(Code.INVALID_ARGUMENT, (
            f"shared-memory key {quoted(key)} must be one name in {SHM_ROOT} (as shm_open "
            "takes it: an optional leading '/', no other '/')"))
    return f"{SHM_ROOT}/{name}"
