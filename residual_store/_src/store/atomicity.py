"""How a medium makes a write atomic, and what follows for the folders a write replaces and gc
removes: the strategy each storage backend names (:meth:`Backend.atomicity`).

Two media, two strategies:

- :class:`AtomicRenames` (a local folder): a small object is written and synced under a
  temporary name and renamed into place, so a manifest's rename is its commit; a replaced data
  folder is renamed into ``data/.free`` and claimed (renamed again) by a later write of the same
  layout, which overwrites its files in place; a folder gc chose is renamed into ``data/.trash``
  first, so a writer claiming it at the same moment gets it whole or not at all; a sharded
  weight of a collective write is assembled in a staging folder and renamed into place.
- :class:`AtomicPuts` (a tensorstore kvstore): there is no rename of a prefix, and a
  single-object put is atomic, so a manifest's put is its commit; nothing is recycled and gc
  removes folders directly; a sharded weight's chunks go straight to its content address (the
  same bytes whoever writes them) and its ``zarr.json``, written last, makes it exist.

The disk tier, gc and the collective committer call the strategy's methods and never ask which
medium they write to.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from residual_store._src.store.critical import StoreLock
from residual_store._src.store.paths import new_write_id, recycled_path, staging_path, trash_path

if TYPE_CHECKING:
    from residual_store._src.store.backend_protocol import Backend
    from residual_store._src.store.layout import StaleData
    from residual_store._src.store.local_backend import LocalBackend

__all__ = ["AtomicPuts", "AtomicRenames", "Atomicity"]

_MAX_FREE_PER_LAYOUT = 64


class Atomicity(Protocol):
    """The writes, recycling and removals of one medium, made atomic its way.

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

    def drop(self, stale: StaleData, *, recycle: bool) -> None:
        """Disposes of a data folder no manifest references any more: with ``recycle``, kept for
        :meth:`claim` where the medium can; otherwise removed."""
        ...

    def claim(self, layout: str, data_dir: str) -> bool:
        """Gives a write the name ``data_dir`` for a kept folder of ``layout`` (same shapes and
        dtypes), to overwrite in place; whether one was found."""
        ...

    def remove(self, path: str) -> bool:
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


class AtomicRenames:
    """A medium with atomic renames (a local folder): stage and rename into place, recycle
    replaced data folders, rename into the trash before a removal.

    Holds this disk tier's recycled folders by layout; a folder is touched before it is claimed,
    so it is young under its new name (gc's age rule) from the moment it has one."""

    def __init__(self, backend: LocalBackend) -> None:
        self.backend = backend
        self._lock = StoreLock()
        self._free: dict[str, list[str]] = {}  # layout -> recycled data folders

    def stage(self, key: str) -> str:
        return self.backend.temporary_for(key)

    def commit(self, staged: str | None, key: str, data: bytes, *, fsync: bool) -> bool:
        if staged is None:  # nothing staged: written, synced and renamed now
            self.backend.put_bytes(key, data, fsync=fsync)
            return False
        self.backend.publish(staged, key, fsync=False)  # its folder: synced once for a burst
        return fsync

    def unstage(self, staged: str | None) -> None:
        if staged is not None:
            self.backend.delete(staged)

    def drop(self, stale: StaleData, *, recycle: bool) -> None:
        """Keeps the folder for a later write of its layout, which then overwrites its files in
        place instead of creating some 50 files and folders (file creation dominates small
        writes), while the layout has room; otherwise removes it."""
        if recycle:
            with self._lock:
                pool = self._free.setdefault(stale.layout, [])
                room = len(pool) < _MAX_FREE_PER_LAYOUT
            if room:
                target = recycled_path(stale.layout, new_write_id())
                if self.backend.rename(stale.data_dir, target):
                    with self._lock:
                        pool.append(target)
                    return
        self.backend.delete_tree(stale.data_dir)

    def claim(self, layout: str, data_dir: str) -> bool:
        while True:
            with self._lock:
                free = self._free.get(layout)
                if not free:
                    return False
                candidate = free.pop()
            # a folder gc took meanwhile fails the touch or the rename
            if self.backend.touch(candidate) and self.backend.rename(candidate, data_dir):
                return True

    def remove(self, path: str) -> bool:
        """Renamed into the trash first (atomic against a writer's claim), then removed."""
        with self._lock:
            for pool in self._free.values():
                if path in pool:
                    pool.remove(path)
        trash = trash_path(uuid.uuid4().hex)
        if not self.backend.rename(path, trash):
            return False
        self.backend.delete_tree(trash)
        return True

    def shared_staging(self, path: str, write_id: str) -> str:
        return staging_path(path, write_id)

    def publish_shared(self, staged: str, path: str, metadata: Mapping[str, Any], *, fsync: bool) -> None:
        """The staging folder completed and renamed into place; dropped where another writer put
        the same bytes there first."""
        self.backend.write_arrays(metadata, fsync=fsync)
        if not self.backend.rename(staged, path):
            self.backend.delete_tree(staged)

    def drop_shared_staging(self, staged: str, path: str) -> None:
        self.backend.delete_tree(staged)


class AtomicPuts:
    """A medium whose single-object puts are atomic and which has no rename of a prefix (a
    tensorstore kvstore): objects are put where they belong, a manifest's put is the commit,
    nothing is recycled, and removals are direct."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def stage(self, key: str) -> None:
        return None

    def commit(self, staged: str | None, key: str, data: bytes, *, fsync: bool) -> bool:
        self.backend.put_bytes(key, data, fsync=fsync)
        return False

    def unstage(self, staged: str | None) -> None:
        pass  # nothing staged

    def drop(self, stale: StaleData, *, recycle: bool) -> None:
        self.backend.delete_tree(stale.data_dir)

    def claim(self, layout: str, data_dir: str) -> bool:
        return False  # nothing kept

    def remove(self, path: str) -> bool:
        self.backend.delete_tree(path)
        return True

    def shared_staging(self, path: str, write_id: str) -> str:
        return path

    def publish_shared(self, staged: str, path: str, metadata: Mapping[str, Any], *, fsync: bool) -> None:
        self.backend.write_shared_arrays(metadata, fsync=fsync)

    def drop_shared_staging(self, staged: str, path: str) -> None:
        pass  # chunks without a zarr.json are no array; gc takes them with the unreferenced weight
