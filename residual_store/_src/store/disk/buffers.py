"""Host buffers for reads, reused once nothing refers to them any more.

A read fills a fresh 64-byte aligned buffer that ``jax.device_put`` on CPU adopts without a copy
(on an accelerator it copies from it). Fresh memory from the operating system costs a page fault
and the kernel zeroing each page on first touch: measured 2026-12-01 on the 2-core development
machine (CPU, jax 0.10), a third of a warm 64 MiB get and of a 2 MiB one when the process's
allocator hands out new pages. In a training loop the contexts got one step are dropped by the
next, so their buffers can take the next reads instead.

A buffer is reused only once this pool holds the last reference to it: every array that aliases
its memory (the view a read returned, a ``jax.Array`` that adopted it, a NumPy view of that array)
holds a reference, so none is alive when it is handed out again, and a read fills every byte it
returns before returning it. Buffers are kept per size (rounded up to a page); at most
``max_bytes`` in all, the least recently used free ones given back first to make room.

Example:
  >>> pool = ReadBuffers(1 << 20)
  >>> a = pool.empty((256, 256), "float32")
  >>> address = a.ctypes.data
  >>> del a
  >>> pool.empty((256, 256), "float32").ctypes.data == address
  True
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import numpy as np
from numpy.typing import DTypeLike

import residual_store_serializers as serializers
from residual_store._src.store.critical import StoreLock
from residual_store_serializers.local import ALIGNMENT as _ALIGN  # XLA's CPU client adopts such buffers

__all__ = ["DEFAULT_READ_BUFFER_BYTES", "ReadBuffers"]

DEFAULT_READ_BUFFER_BYTES = 256 << 20
"""Host memory a store keeps for its reads by default (see :class:`ReadBuffers`)."""

_PAGE = 4096


def _refs(buffers: list[np.ndarray], j: int) -> int:
    """References to ``buffers[j]``, as :func:`sys.getrefcount` counts them from here."""
    return sys.getrefcount(buffers[j])


# What _refs gives for a buffer that only its list refers to, measured rather than assumed (an
# interpreter may count the references of the call itself differently): a buffer any array
# aliases has more.
_UNUSED_REFS = _refs([np.empty(1, dtype=np.uint8)], 0)


class ReadBuffers:
    """Aligned host buffers for reads, each reused once the pool holds its last reference."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)
        self._lock = StoreLock()
        # size -> buffers of that many bytes, least recently handed out first
        self._buffers: dict[int, list[np.ndarray]] = {}
        self._nbytes = 0
        self.reused = 0  # buffers handed out again (for tests and benchmarks)

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers the pool holds, in use or free."""
        return self._nbytes

    def empty(self, shape: Sequence[int], dtype: DTypeLike) -> np.ndarray:
        """An uninitialized C-contiguous array whose data starts on a 64-byte boundary, in a
        free buffer of the pool when there is one of its size, else in a new one (kept in the
        pool if it fits in ``max_bytes``)."""
        d = np.dtype(dtype)
        shape = tuple(int(s) for s in shape)
        nbytes = math.prod(shape) * d.itemsize
        size = -(-(nbytes + _ALIGN) // _PAGE) * _PAGE
        if nbytes == 0 or size > self.max_bytes:
            return serializers.aligned_empty(shape, d)
        with self._lock:  # a buffer is in use from the moment its view exists: made under the lock
            same = self._buffers.setdefault(size, [])
            for j in range(len(same)):
                if _refs(same, j) <= _UNUSED_REFS:
                    buffer = same.pop(j)
                    same.append(buffer)
                    self.reused += 1
                    return _aligned_view(buffer, shape, d, nbytes)
            if not self._make_room(size):
                return serializers.aligned_empty(shape, d)
            buffer = np.empty(size, dtype=np.uint8)
            same.append(buffer)
            self._nbytes += size
            return _aligned_view(buffer, shape, d, nbytes)

    def _make_room(self, size: int) -> bool:
        """Gives back free buffers, least recently used first within each size, until ``size``
        more bytes fit; whether they do."""
        for same in self._buffers.values():
            j = 0
            while self._nbytes + size > self.max_bytes and j < len(same):
                if _refs(same, j) <= _UNUSED_REFS:
                    self._nbytes -= same.pop(j).nbytes
                else:
                    j += 1
        return self._nbytes + size <= self.max_bytes

    def clear(self) -> None:
        """Forgets every buffer (those in use stay alive as long as their arrays do)."""
        with self._lock:
            self._buffers.clear()
            self._nbytes = 0


def _aligned_view(buffer: np.ndarray, shape: tuple[int, ...], dtype: np.dtype, nbytes: int) -> np.ndarray:
    offset = (-buffer.ctypes.data) % _ALIGN
    return buffer[offset : offset + nbytes].view(dtype).reshape(shape)
