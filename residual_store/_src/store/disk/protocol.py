"""What a storage backend of the disk tier is: the operations the disk tier needs (write a
context's folder as one :class:`ContextWrite`, write and read arrays, put and get small objects
atomically, list, delete), the strategy that makes its writes atomic (:class:`Atomicity`; each
backend's module has its own: renames and the refresh of a folder's age belong to the local
folder's strategy, not to every backend), and the error a backend raises for an entry
that is not what the store puts there.

The backends: :mod:`residual_store._src.store.disk.folder` (a local folder) and
:mod:`residual_store._src.store.disk.kvstore` (any tensorstore kvstore); :func:`residual_store._src.store.disk.backends.open_backend`
picks one for a path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Protocol

import numpy as np

from residual_store._src.errors import CorruptContextError
from residual_store._src.store.disk.paths import DATA

__all__ = ["Atomicity", "Backend", "ContextWrite", "DamagedFileError", "Empty", "StaleData", "damaged"]


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
    :meth:`~residual_store._src.store.disk.layout.WritePlan.own_write`; in a job of several
    processes, each process's part of it (``write_metadata=False``), then the ``zarr.json`` of
    its chunked arrays, by :mod:`~residual_store._src.store.collective`."""

    # by path: NumPy arrays or serializers.ChunkedArray (a sharded residual, one chunk per shard)
    arrays: Mapping[str, Any]
    attributes: Mapping[str, Mapping[str, Any]]  # the arrays' zarr attributes, by path
    files: Files
    fsync: bool
    # into a recycled folder of the write's folder shape, renamed to the write's name: the arrays
    # there have these shapes, dtypes and attributes (their zarr.json stay), and the folder's
    # new name is synced with the rest; otherwise a folder named for this write alone
    reuse: bool = False
    manifest: tuple[str, bytes] | None = None  # (temporary key, bytes): the caller publishes it
    # False: the chunks only of chunked arrays, their zarr.json left to another writer
    write_metadata: bool = True

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


class StaleData(NamedTuple):
    """A data folder no manifest references any more, and its folder shape (for reuse)."""

    data_dir: str
    folder_shape: str


class Atomicity(Protocol):
    """The writes, recycling and removals of one medium, made atomic its way: the strategy each
    backend names (:meth:`Backend.atomicity`), beside it in its module.

    - ``AtomicRenames`` (a local folder, :mod:`~residual_store._src.store.disk.folder`): a small
      object is written and synced under a temporary name and renamed into place, so a
      manifest's rename is its commit; a replaced data folder is renamed into ``data/.free`` and
      claimed (renamed again) by a later write of the same folder shape, which overwrites its files in
      place; a folder gc chose is renamed into ``data/.trash`` first, so a writer claiming it at
      the same moment gets it whole or not at all; a sharded weight of a collective write is
      assembled in a staging folder and renamed into place.
    - ``AtomicPuts`` (a tensorstore kvstore, :mod:`~residual_store._src.store.disk.kvstore`):
      there is no rename of a prefix, and a single-object put is atomic, so a manifest's put is
      its commit; nothing is recycled and gc removes folders directly; a sharded weight's chunks
      go straight to its content address (the same bytes whoever writes them) and its
      ``zarr.json``, written last, makes it exist.

    The disk tier, gc and the collective committer call the strategy's methods and never ask
    which medium they write to.

    A strategy belongs to one disk tier (it may hold the tier's recycled folders): the tier
    asks its backend for it once."""

    def stage(self, key: str) -> str | None:
        """Where the bytes of the small object ``key`` (a manifest) go with the rest of a write,
        written and synced with it before the commit; ``None``: nowhere, :meth:`commit` puts them."""
        ...

    def commit(self, staged: str | None, key: str, data: bytes, *, fsync: bool) -> bool:
        """Makes ``key`` hold ``data`` (``staged`` there already, from :meth:`stage`), atomically:
        readers see the old bytes or the new, never a mix. Returns whether the folder of ``key``
        still owes a sync for the commit to survive a power loss (the caller syncs it once for a
        burst of commits)."""
        ...

    def unstage(self, staged: str | None) -> None:
        """Removes what :meth:`stage` named, after a write that does not commit."""
        ...

    def recycle(self, stale: StaleData) -> None:
        """Disposes of a data folder no manifest references any more, kept for :meth:`claim`
        where the medium can (else removed)."""
        ...

    def remove(self, stale: StaleData) -> None:
        """Removes a data folder no manifest references any more (never kept)."""
        ...

    def claim(self, folder_shape: str, data_dir: str) -> bool:
        """Gives a write the name ``data_dir`` for a kept folder of ``folder_shape`` (same shapes and
        dtypes), to overwrite in place; whether one was found."""
        ...

    def collect(self, path: str) -> bool:
        """Removes a folder gc chose, never half under a writer that claims it at the same
        moment; ``False`` if someone else took it first. A kept folder is never claimed after."""
        ...

    def shared_staging(self, path: str, write_id: str) -> str:
        """Where the processes of collective write ``write_id`` put their chunks of the new
        shared weight ``path`` (``path`` itself: in place, content-addressed)."""
        ...

    def publish_shared(self, staged: str, path: str, metadata: Mapping[str, Any], *, fsync: bool) -> None:
        """Makes the shared weight ``path`` exist from the chunks at ``staged``: ``metadata``
        (``{staged: ChunkedArray}`` without chunks) gives its ``zarr.json``, written last."""
        ...

    def drop_shared_staging(self, staged: str, path: str) -> None:
        """Removes chunks staged for ``path`` that are not to be published (the weight is there
        already, or the write failed)."""
        ...



class Backend(Protocol):
    """The operations the disk tier runs on its medium (keys are paths below the store's root)."""

    description: str

    # each read waits on a request (an object store): reads go out together, whatever their size
    latency_bound: bool

    def write_context(self, write: ContextWrite) -> None: ...
    # bare arrays (no attributes, no files beside them): NumPy arrays or serializers.ChunkedArray
    # (a sharded residual, one chunk per shard); write_metadata=False: chunks only, a chunked
    # array's zarr.json left to another writer
    def write_arrays(self, arrays: Mapping[str, Any], *, fsync: bool, write_metadata: bool = True) -> None: ...
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
