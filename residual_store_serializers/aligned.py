"""Aligned host buffers: where arrays are read into.

A buffer whose data starts on a 64-byte boundary can be adopted by XLA's CPU client without a
copy, so every reader of :mod:`serializers` (local files, bundles, tensorstore) reads into one
of these.
"""

from __future__ import annotations

import math
from typing import Final

import numpy as np

from .zarr import DTypeLike, Shape

__all__ = ["ALIGNMENT", "aligned_empty"]

ALIGNMENT: Final[int] = 64
"""Byte alignment of buffers returned by :func:`aligned_empty` and the fast reader."""

def aligned_empty(shape: Shape, dtype: DTypeLike, *, align: int = ALIGNMENT) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on an ``align`` boundary.

    XLA's CPU client can adopt such a buffer without copying it. (An array with
    no elements has no data, and numpy does not keep its pointer aligned.)
    """
    d = np.dtype(dtype)
    shape = tuple(int(s) for s in shape)
    nbytes = math.prod(shape) * d.itemsize
    raw = np.empty(nbytes + align, dtype=np.uint8)
    offset = (-raw.ctypes.data) % align
    return raw[offset : offset + nbytes].view(d).reshape(shape)
