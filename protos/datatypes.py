"""The protocol's tensor datatypes: the one table the server, the executor, the SDK and the load
generator read (numpy only, so the SDK imports it without torch; the torch types are derived
from it in ``batcher/tensors.py``).

Datatypes are the KServe v2 strings ("FP32", "BF16", ...). On the wire every fixed-size element
is little-endian. BF16 has no numpy type: it travels, and is held on the host, as ``uint16``
holding the raw bfloat16 bits. BYTES elements are variable-length (a 4-byte little-endian length,
then the bytes); on the host a BYTES tensor is a numpy object array of ``bytes``.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence

import numpy as np

# Datatype -> numpy dtype of the host array (little-endian, as on the wire), BYTES included.
NUMPY_DTYPES: Mapping[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BF16": np.dtype("<u2"),  # raw bfloat16 bits
    "BYTES": np.dtype(object),
}

# The datatypes of fixed-size elements (all but BYTES), with their numpy dtype.
FIXED_DTYPES: Mapping[str, np.dtype] = {
    name: dtype for name, dtype in NUMPY_DTYPES.items() if name != "BYTES"
}

# Bytes per element on the wire, for the fixed-size datatypes.
ELEMENT_SIZES: Mapping[str, int] = {name: dtype.itemsize for name, dtype in FIXED_DTYPES.items()}

# A numpy dtype's name -> its datatype: by name, so byte order does not matter and ml_dtypes'
# ``bfloat16`` is recognised without importing ml_dtypes (a plain ``uint16`` array is UINT16).
DATATYPE_BY_DTYPE_NAME: Mapping[str, str] = {
    **{dtype.name: name for name, dtype in FIXED_DTYPES.items() if name != "BF16"},
    "bfloat16": "BF16",
}

# The typed ``contents`` field of a datatype, and the numpy dtype that repeated field holds: the
# narrow integers travel widened; FP16, BF16 have none (raw only), BYTES has ``bytes_contents``.
CONTENTS_FIELDS: Mapping[str, tuple[str, np.dtype]] = {
    "BOOL": ("bool_contents", np.dtype(np.bool_)),
    "INT8": ("int_contents", np.dtype(np.int32)),
    "INT16": ("int_contents", np.dtype(np.int32)),
    "INT32": ("int_contents", np.dtype(np.int32)),
    "INT64": ("int64_contents", np.dtype(np.int64)),
    "UINT8": ("uint_contents", np.dtype(np.uint32)),
    "UINT16": ("uint_contents", np.dtype(np.uint32)),
    "UINT32": ("uint_contents", np.dtype(np.uint32)),
    "UINT64": ("uint64_contents", np.dtype(np.uint64)),
    "FP32": ("fp32_contents", np.dtype(np.float32)),
    "FP64": ("fp64_contents", np.dtype(np.float64)),
}

# BYTES tensors' typed contents field (repeated bytes, one element each).
BYTES_CONTENTS_FIELD = "bytes_contents"

# The length before each BYTES element on the wire.
BYTES_LENGTH = struct.Struct("<I")


def bytes_encoding(elements: np.ndarray | Sequence[bytes]) -> bytes:
    """A BYTES tensor's encoding on the wire: per element (of an array, in row-major order), a
    4-byte little-endian length, then that many bytes (``str`` elements as UTF-8)."""
    if isinstance(elements, np.ndarray):
        elements = elements.reshape(-1)
    pack = BYTES_LENGTH.pack
    parts = []
    for item in elements:
        data = item if isinstance(item, bytes) else str(item).encode()
        parts.append(pack(len(data)))
        parts.append(data)
    return b"".join(parts)
