"""CUDA memory a client shares by IPC handle (CudaSharedMemoryRegister), as a torch tensor.

The handle (a serialized ``cudaIpcMemHandle_t``, 64 bytes) is opened with the CUDA runtime's
``cudaIpcOpenMemHandle`` on the device the client names, and the pointer is wrapped as a
``uint8`` tensor through ``__cuda_array_interface__``: inputs are slices of it, viewed as their
datatype, which the batch copies device to device; outputs are copied into it. The handle is
closed when the region is unregistered and the last tensor viewing it has gone.

Imported only by a server asked to register CUDA memory (it needs torch with CUDA).
"""

from __future__ import annotations

import ctypes
import weakref

import numpy as np
import torch

from batchgate.batcher.errors import InvalidRequest, quoted
from batchgate.batcher.tensors import TORCH_DTYPES
from batchgate.server.rules.status import Code, StatusError

HANDLE_BYTES = 64
_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


_runtime: ctypes.CDLL | None = None


def available() -> bool:
    return torch.cuda.is_available()


def runtime_soname(cuda_version: str | None) -> str:
    """The soname of the CUDA runtime of ``cuda_version`` (``torch.version.cuda``): one
    per major version from CUDA 12 on (``libcudart.so.13``), ``libcudart.so.11.0`` before."""
    if not cuda_version:
        raise StatusError(Code.FAILED_PRECONDITION,
                          f"this torch ({torch.__version__}) is not built with CUDA")
    major = int(cuda_version.split(".")[0])
    return f"libcudart.so.{major}" if major >= 12 else f"libcudart.so.{major}.0"


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime torch already loaded: dlopen of its soname finds the library torch's
    CUDA module was linked against, not another version's."""
    global _runtime
    if _runtime is None:
        name = runtime_soname(torch.version.cuda)
        try:
            library = ctypes.CDLL(name)
        except OSError:
            raise StatusError(Code.FAILED_PRECONDITION,
                              f"the CUDA runtime library {name} (torch's CUDA "
                              f"{torch.version.cuda}) cannot be loaded") from None
        library.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _Handle,
                                                 ctypes.c_uint]
        library.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
        library.cudaGetErrorString.restype = ctypes.c_char_p
        _runtime = library
    return _runtime


class _Memory:
    """The opened pointer, as ``__cuda_array_interface__``; closes the handle when collected
    (torch keeps this object alive as long as a tensor views the memory)."""

    def __init__(self, pointer: int, nbytes: int, device_id: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (pointer, False), "version": 3}
        weakref.finalize(self, _close, pointer, device_id)


def _close(pointer: int, device_id: int) -> None:
    try:
        with torch.cuda.device(device_id):
            _cudart().cudaIpcCloseMemHandle(ctypes.c_void_p(pointer))
    except Exception:  # the process is exiting and CUDA is gone: nothing left to close
        pass


class CudaRegion:
    def __init__(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        if len(raw_handle) != HANDLE_BYTES:
            raise InvalidRequest(f"CUDA shared-memory region {quoted(name)}: raw_handle must be "
                                 f"a cudaIpcMemHandle_t ({HANDLE_BYTES} bytes), got "
                                 f"{len(raw_handle)} bytes")
        if not 0 <= device_id < torch.cuda.device_count():
            raise InvalidRequest(f"CUDA shared-memory region {quoted(name)}: device_id must lie "
                                 f"in 0..{torch.cuda.device_count() - 1}, got {device_id}")
        runtime = _cudart()
        pointer = ctypes.c_void_p()
        with torch.cuda.device(device_id):
            status = runtime.cudaIpcOpenMemHandle(ctypes.byref(pointer),
                                                  _Handle.from_buffer_copy(raw_handle),
                                                  _LAZY_ENABLE_PEER_ACCESS)
        if status != 0:
            raise InvalidRequest(
                f"CUDA shared-memory region {quoted(name)}: the IPC handle cannot be opened on "
                f"device {device_id} ({runtime.cudaGetErrorString(status).decode()})")
        self.name, self.device_id, self.byte_size = name, device_id, byte_size
        memory = _Memory(pointer.value, byte_size, device_id)
        self.bytes = torch.as_tensor(memory, device=f"cuda:{device_id}")

    def tensor(self, offset: int, nbytes: int, shape: tuple[int, ...], datatype: str):
        """The input's bytes as a tensor of its datatype and shape, on the region's device."""
        if datatype == "BYTES":
            raise InvalidRequest(f"BYTES tensors cannot be read from CUDA shared-memory region "
                                 f"{quoted(self.name)}; use system shared memory")
        dtype = TORCH_DTYPES[datatype]
        itemsize = torch.empty((), dtype=dtype).element_size()
        if offset % itemsize:
            raise InvalidRequest(f"an input of {datatype} in CUDA shared-memory region "
                                 f"{quoted(self.name)} must start at an offset that is a "
                                 f"multiple of {itemsize}, got {offset}")
        return self.bytes[offset:offset + nbytes].view(dtype).view(shape)

    def write(self, offset: int, data: memoryview) -> None:
        """Copy an output's host bytes into the region."""
        if not data.nbytes:
            return
        # A copy the size of the output: torch takes read-only host memory only with a warning.
        source = torch.from_numpy(np.frombuffer(data, np.uint8).copy())
        self.bytes[offset:offset + source.numel()].copy_(source)
        # Written before the reply says so.
        torch.cuda.current_stream(self.device_id).synchronize()

    def release(self) -> None:
        self.bytes = None  # the handle closes once no tensor views it
