"""What a storage backend of the disk tier is: the operations the disk tier needs (write a
context's folder as one :class:`ContextWrite`, write and read arrays, put and get small objects
atomically, list, delete), the strategy that makes its writes atomic
(:mod:`residual_store._src.store.atomicity`: renames and the refresh of a folder's age belong to
the local folder's strategy, not to every backend), and the error a backend raises for an entry
that is not what the store puts there.

The backends: :mod:`residual_store._src.store.local_backend` (a local folder) and
:mod:`residual_store._src.store.kv_backend` (any tensorstore kvstore); :func:`residual_store._src.store.backends.open_backend`
picks one for a path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np

from residual_store._src.errors import CorruptContextError
from residual_store._src.store.atomicity import Atomicity
from residual_store._src.store.paths import DATA

__all__ = ["Backend", "ContextWrite", "DamagedFileError", "Empty", "damaged"]


class DamagedFileError(CorruptContextError, OSError):
    """An entry below a local store's root is not what the store puts there: a symbolic link, a
    FIFO, a device, a folder where a file belongs (or a file where a folder does), or a file
    larger than it can be. The store never follows such a link nor blocks on such a file: the
    read, write or removal that met it is refused, and nothing outside the root is touched.

    A :class:`~residual_store._src.errors.CorruptContextError` (the store is damaged), and an
    ``OSError`` so that a failed write cleans up as for any other I/O error."""


def damaged(err: Exception) -> DamagedFileError:
    """``err`` (an ``OSError`` of a refused entry) as a :class:`DamagedFileError`."""
    return DamagedFileError(str(err))


Empty = Callable[[Sequence[int], np.dtype], np.ndarray]
"""Gives the aligned buffer an array is read into (see :func:`serializers.read_arrays_local`)."""


Files = Mapping[str, bytes | Sequence[memoryview | bytes]]
"""Small files by key, each given whole or as parts written one after another (a bundle)."""


@dataclasses.dataclass(frozen=True)
class ContextWrite:
    """What a commit writes of its context under the write's data folder, all at once and, with
    ``fsync``, synced together before the commit: the context's own arrays (in folders of their
    own), the other ``files`` (the folder's group ``zarr.json``, the bundle), and the manifest
    under a temporary name (``manifest``), which the caller renames into place afterwards.

    Built from the write's plan by
    :meth:`~residual_store._src.store.layout.WritePlan.own_write`."""

    # by path: NumPy arrays or serializers.ChunkedArray (a sharded residual, one chunk per shard)
    arrays: Mapping[str, Any]
    attributes: Mapping[str, Mapping[str, Any]]  # the arrays' zarr attributes, by path
    files: Files
    fsync: bool
    # into a recycled folder of the write's layout, renamed to the write's name: the arrays
    # there have these shapes, dtypes and attributes (their zarr.json stay), and the folder's
    # new name is synced with the rest; otherwise a folder named for this write alone
    reuse: bool = False
    manifest: tuple[str, bytes] | None = None  # (temporary key, bytes): the caller publishes it

    @property
    def fresh(self) -> bool:
        """Whether nothing is there to replace (a folder named for this write alone)."""
        return not self.reuse

    @property
    def sync_folders(self) -> tuple[str, ...]:
        """Folders to sync with the rest, with ``fsync``: where a recycled folder was renamed."""
        return (DATA,) if self.reuse else ()

    @property
    def temporaries(self) -> dict[str, bytes]:
        """The files the caller publishes itself (the manifest), by key."""
        return dict([self.manifest]) if self.manifest is not None else {}


class Backend(Protocol):
    """The operations the disk tier runs on its medium (keys are paths below the store's root)."""

    description: str

    # each read waits on a request (an object store): reads go out together, whatever their size
    latency_bound: bool

    def write_context(self, write: ContextWrite) -> None: ...
    # values: NumPy arrays or serializers.ChunkedArray (a sharded residual, one chunk per shard);
    # write_metadata=False: chunks only, a chunked array's zarr.json left to another writer
    def write_arrays(
        self,
        arrays: Mapping[str, Any],
        *,
        fsync: bool,
        write_metadata: bool = True,
        attributes: Mapping[str, Mapping[str, Any]] | None = None,
        files: Files | None = None,  # small files written with the arrays
    ) -> None: ...
    def write_shared_arrays(
        self, arrays: Mapping[str, Any], *, fsync: bool, write_metadata: bool = True
    ) -> None: ...
    # whole arrays (path, shape, zarr dtype, checksum or None), each verified against its
    # checksum (serializers.CorruptDataError on a mismatch); empty(shape, dtype): the aligned
    # buffer to read into (None: a fresh one)
    def read_arrays(
        self, arrays: Sequence[tuple[str, tuple[int, ...], str, str | None]], *, empty: Empty | None = None
    ) -> list[np.ndarray]: ...
    def read_chunk(
        self, path: str, shape: tuple[int, ...], dtype: str, chunk_shape: tuple[int, ...], index: tuple[int, ...]
    ) -> np.ndarray: ...
    def read_file(
        self, key: str, nbytes: int, *, checksum: str | None = None, empty: Empty | None = None
    ) -> np.ndarray: ...  # a file of exactly nbytes (a bundle), as aligned uint8
    def array_exists(self, path: str) -> bool: ...
    def put_bytes(self, key: str, data: bytes, *, fsync: bool) -> None: ...
    def get_bytes(self, key: str, *, max_bytes: int | None = None) -> bytes | None: ...
    def list_dir(self, prefix: str) -> list[str]: ...
    def delete(self, key: str) -> None: ...
    def delete_tree(self, prefix: str) -> None: ...
    def age_seconds(self, prefix: str) -> float | None: ...
    def tree_bytes(self, prefix: str) -> int | None: ...  # bytes of the files under it (None: unknown)
    def version(self, key: str) -> Any | None: ...
    def exists(self, key: str) -> bool: ...
    def is_file(self) -> bool: ...
    def root_exists(self) -> bool: ...
    def is_empty(self) -> bool: ...
    def list_temporary(self, prefix: str) -> list[str]: ...
    def gc_lock(self, *, exclusive: bool) -> AbstractContextManager[None]: ...
    def sync_folder(self, prefix: str) -> None: ...  # a rename into it survives a power loss
    # how this medium makes a write atomic: a fresh strategy, held by one disk tier
    def atomicity(self) -> Atomicity: ...
