"""The interoperability reference: arrays written by tensorstore's own zarr3 driver.

The store writes its arrays with its own writers (``write_arrays_local``, ``write_arrays_kv``),
which produce zarr v3 arrays byte for byte; what proves that they are plain zarr v3, and that the
store's readers (``read_array_local``, ``read_chunk_local``, ``read_array``, ``read_chunk``) read
any zarr v3 array of the raw layout and not only their own output, is an independent writer:
tensorstore's zarr3 driver. These writers open the array through that driver (``ts.open`` with
the ``zarr3`` driver, ``create=True``) and let it write the metadata and chunks.

No library code calls them, so they live here, next to the tests that compare their output with
the store's and read it back with the store's readers, instead of in ``serializers``. The batch
form (``serializers.write_arrays``, which ``benchmarks/serializer_io.py`` times) and the async
single-array writer it is built on stay in ``serializers.kv``; these are thin forms of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from residual_store_serializers import ChunkedArray, KvStoreSpec, chunk_grid, write_array_async
from residual_store_serializers.kv import _write_chunked_async
from residual_store_serializers.zarr import DTypeLike, Shape

__all__ = ["write_array", "write_chunks"]


def write_array(
    kvstore: KvStoreSpec, path: str, arr: Any, *, context: ts.Context | None = None
) -> None:
    """Writes ``arr`` as the zarr v3 array ``path`` under ``kvstore`` through tensorstore's zarr3
    driver and waits; see :func:`serializers.write_array_async`."""
    write_array_async(kvstore, path, arr, context=context).result()


def write_chunks(
    kvstore: KvStoreSpec,
    path: str,
    shape: Shape,
    dtype: DTypeLike,
    chunk_shape: Shape,
    chunks: Mapping[Sequence[int], Any],
    *,
    context: ts.Context | None = None,
) -> None:
    """Writes some chunks of the chunked zarr v3 array ``path`` under ``kvstore`` through
    tensorstore's zarr3 driver and waits.

    The array (its ``zarr.json``) is created if missing, or opened if it exists with the same
    shape, dtype and chunk shape; the chunks given are written, the array's other chunks are left
    alone (several writers may each write theirs). ``chunks`` maps a chunk index to an array of
    ``chunk_shape``; see :class:`serializers.ChunkedArray`. On failure, the chunks of this call
    are deleted and ``DiskFullError`` (or tensorstore's error) is raised.

    Raises:
      ValueError: for a chunk shape that does not divide ``shape``, an index outside the grid or
        a chunk of the wrong shape or dtype, before anything is written.
    """
    arr = ChunkedArray(shape, dtype, chunk_shape, chunks)
    _write_chunked_async(kvstore, path, arr, context=context, delete_array_on_error=False).result()


def chunk_indices(shape: Shape, chunk_shape: Shape | None = None) -> list[tuple[int, ...]]:
    """Every chunk index of the grid, in C order (``[()]`` for a 0-d array, ``[]`` if empty):
    what the tests walk to compare chunks (the library writes and reads whole grids)."""
    return [tuple(int(i) for i in idx) for idx in np.ndindex(*chunk_grid(shape, chunk_shape))]
