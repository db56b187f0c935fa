"""The disk tier: contexts' files. Committing a write in one process, reading and verifying,
deleting and recycling (garbage collection is :mod:`residual_store._src.store.gc`; the stored
backwards' files are :mod:`residual_store._src.store.backwards`; each form a residual takes on
disk, bundled, chunked or whole, is written and read back by
:mod:`residual_store._src.store.disk.forms`). Where everything lives is
:mod:`residual_store._src.store.disk.layout`.

A commit (:meth:`DiskTier.commit` of a :class:`~residual_store._src.store.disk.layout.WritePlan`) puts
every array first (the context's own under a fresh ``data/<key>.<write id>/``, or a recycled
folder of the same layout renamed to that name; weights under their content digest, skipped when
already there, a new one written under a temporary name and renamed into place, so a weight other
contexts hold is never rewritten) and the manifest under a temporary name beside its final one,
all synced with ``durable=True``; then it renames the manifest into place, which is the commit
(a single-object put on kvstores). A crash at any point before the rename leaves no manifest, so
the context is either whole or absent; what it left behind is unreferenced and removed by
:func:`residual_store._src.store.gc.collect`. The folder the manifests are renamed into is synced once for a burst of
commits (:meth:`DiskTier.sync_commits`, before the store's ``flush`` returns). Two writers of
one key: each commit replaces the manifest whole, so readers see one complete context or the
other (last rename wins; a read that loses the race to a commit reads the new manifest again).
How the medium makes each step atomic (a rename into place or a put; which replaced folders are
recycled, and how) is the strategy its backend names, :class:`~residual_store._src.store.disk.protocol.Atomicity`:
this module never asks which medium it writes to.

Sharded residuals: a ``jax.Array`` with a :class:`~jax.sharding.NamedSharding` over several
devices is written shard by shard, never gathered: one zarr chunk per distinct shard (the shards
with ``replica_id == 0``), so the array's chunk shape is the shard shape. Its record lists a
checksum per chunk, and the context's spec records the sharding (mesh axis names, sizes and
types, the ``PartitionSpec``, the mesh's device ids). A reader with as many devices as the mesh
rebuilds the mesh and the sharding, and reads each of its devices' chunks; a reader with fewer
devices reads the whole array (see :meth:`DiskTier.read`). Fully replicated, uneven and empty
shardings are stored as one chunk (the whole array, from one replica where there is one) with
the same sharding record.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from cachetools import LRUCache
from jax.sharding import NamedSharding

import residual_store_serializers as serializers
from residual_store._src.errors import (
    ContextNotFoundError,
    CorruptContextError,
    InvalidArgumentError,
    ReadOnlyStoreError,
    StoreFullError,
    StoreNotFoundError,
    StoreUnavailableError,
)
from residual_store._src.logs import event
from residual_store._src.store.critical import StoreLock
from residual_store._src.store.disk import forms, layout, paths
from residual_store._src.store.disk.backends import open_backend, opening
from residual_store._src.store.disk.buffers import ReadBuffers
from residual_store._src.store.disk.damage import damaged_context, manifest_damage, size_damage, without_key
from residual_store._src.store.disk.host_arrays import HostArrays, ShardedHost
from residual_store._src.store.disk.paths import STORE_FORMAT, STORE_MARKER, STORE_VERSION
from residual_store._src.store.disk.protocol import DamagedFileError, StaleData
from residual_store._src.store.disk.records import StoredContext, parse_context_manifest
from residual_store._src.store.workers import request_pool

__all__ = ["DiskTier", "STORE_MARKER"]

_STAT_CACHE_MAX = 4096  # parsed manifests kept for listing (least recently used dropped)
_PARALLEL_READ_BYTES = 16 << 20  # a context this large is read two arrays at a time
_SMALL_READ_BYTES = 64 << 10  # what one more file costs to open and read, counted as bytes
_READ_ATTEMPTS = 8


@functools.cache
def _read_pool() -> ThreadPoolExecutor:
    """The threads that read a large context two arrays at a time (made on first use)."""
    return ThreadPoolExecutor(max_workers=2, thread_name_prefix="residual-store-read")


def _same_data(a: StoredContext, b: StoredContext) -> bool:
    """Whether two manifests send a read to the same bytes (data folder, bundle, checksums)."""
    return a is b or (a.data_dir, a.bundle, a.records, a.shardings) == (b.data_dir, b.bundle, b.records, b.shardings)


class DiskTier:
    """Contexts on disk: commit a write plan (arrays, then an atomic manifest), read and
    verify, delete."""

    def __init__(
        self,
        path: str | os.PathLike[str] | Mapping[str, Any],
        *,
        create: bool = True,
        read_only: bool = False,
        read_buffer_bytes: int = 0,
        timeout: float | None = None,
    ) -> None:
        with opening(path):  # the opening requests: one window for an object store's SDK lines
            self.backend = open_backend(path, timeout=timeout)
            self._open(create=create, read_only=read_only, read_buffer_bytes=read_buffer_bytes)

    def _open(self, *, create: bool, read_only: bool, read_buffer_bytes: int) -> None:
        """The tier's state, and the store's marker read (or written, making a new store)."""
        # how the medium makes writes atomic; holds this tier's recycled folders
        self.atomicity = self.backend.atomicity()
        self.read_only = bool(read_only)
        # the host buffers reads fill, reused once their arrays are gone (0: always fresh ones)
        self.buffers = ReadBuffers(read_buffer_bytes) if read_buffer_bytes > 0 else None
        self._empty = self.buffers.empty if self.buffers is not None else None
        self._lock = StoreLock()
        # key -> (manifest version, parsed manifest), least recently used first
        self._stat_cache: LRUCache[str, tuple[Any, StoredContext]] = LRUCache(_STAT_CACHE_MAX)
        self._version = STORE_VERSION  # of the store's marker (an older store is upgraded by a write)
        self._groups_checked = False  # whether this store's root zarr groups are known to exist
        self._unsynced: set[str] = set()  # folders commits renamed manifests into, not synced yet
        self._whole_weights: set[str] = set()  # weights read whole or written by this tier (see _damaged_weights)
        if self._has_marker():
            return
        where = self.backend.description
        if self._holds_contexts():  # a store that lost its marker: neither a new store nor none
            raise CorruptContextError(layout.lost_marker(where))
        if self.read_only or not create:
            what = "no such folder" if not self.backend.root_exists() else f"not a residual store (no {STORE_MARKER})"
            raise StoreNotFoundError(
                f"{where}: {what}; check the path, or open it with create=True (and "
                "read_only=False) to make a new store"
            )
        if self.backend.is_file():
            raise InvalidArgumentError(f"{where} is a file, not a folder: a store needs a folder")
        try:
            if not self.backend.is_empty():
                if self._has_marker():
                    return  # another process of the job made the store meanwhile
                # gc removes what no context references under data/ and weights/: never in a
                # folder of someone else's files
                raise InvalidArgumentError(
                    f"{where} holds files but no residual store (no {STORE_MARKER}); give the "
                    "store an empty or new folder"
                )
            self.backend.put_bytes(STORE_MARKER, STORE_FORMAT, fsync=False)
            self.ensure_groups()
        except (NotADirectoryError, FileExistsError) as err:  # a part of the path is a file
            raise InvalidArgumentError(
                f"{where}: a part of this path is a file, not a folder ({err}); a store needs a folder"
            ) from err

    def _holds_contexts(self) -> bool:
        """Whether the root holds contexts' manifests (though no marker)."""
        return any(n.endswith(paths.MANIFEST_SUFFIX) for n in self.backend.list_dir(paths.CONTEXTS))

    def _has_marker(self) -> bool:
        """Whether the root holds a store marker this version can open; a marker of a later
        format version, or a damaged one, is refused (:class:`CorruptContextError`) before
        anything is read or written."""
        try:
            data = self.backend.get_bytes(STORE_MARKER)
        except IsADirectoryError as err:
            raise CorruptContextError(
                f"{self.backend.description}: the store marker {STORE_MARKER} is not a file"
            ) from err
        if data is None:
            return False
        self._version = layout.marker_version(data, f"{self.backend.description}: store marker {STORE_MARKER}")
        return True

    def ensure_groups(self) -> None:
        """Makes the store's zarr groups (the root, ``data``, ``weights``) where they are
        missing, and a version 1 store's marker version 2, once per tier, before its first write.
        Each is one atomic put of the same bytes, so processes that do it at once agree."""
        if self._groups_checked:
            return
        for path, data in layout.root_group().items():
            if not self.backend.exists(path):
                self.backend.put_bytes(path, data, fsync=False)
        if self._version < STORE_VERSION:
            self.backend.put_bytes(STORE_MARKER, STORE_FORMAT, fsync=False)
            event(logging.INFO, "upgraded", store=self.description, version=STORE_VERSION)
            self._version = STORE_VERSION
        self._groups_checked = True

    def check_writable(self, what: str) -> None:
        if self.read_only:
            raise ReadOnlyStoreError(f"{what}: the store at {self.description} was opened read_only=True")

    @property
    def description(self) -> str:
        return self.backend.description

    # -- writing ------------------------------------------------------------------------------

    def commit(self, plan: layout.WritePlan, *, fsync: bool) -> StaleData | None:
        """Writes ``plan``'s arrays, then its manifest (the commit); raises
        :class:`StoreFullError` leaving nothing behind.

        Returns the data of the context this write replaced, if any: it is unreferenced now, and
        the caller hands it to the strategy (:attr:`atomicity`) off the write path.
        """
        key = plan.key
        self.check_writable(f"put {key!r}")
        self.ensure_groups()
        previous = self._committed_data(key)
        reuse = self.atomicity.claim(plan.folder_shape, plan.data_dir)
        shared = plan.shared
        created: list[str] = []  # weights this write added: removed again if it fails
        manifest_path = paths.manifest_path(key)
        # Where the medium renames: the manifest is written (and synced) with the arrays under a
        # temporary name, and only renamed into place, its commit, once they and the weights are
        # there. Elsewhere its put, after them, is the commit.
        staged = self.atomicity.stage(manifest_path)
        committing = False  # whether the manifest's put (or rename) has been asked for
        try:
            try:
                self._write_own(plan, staged, fsync=fsync, reuse=reuse)
            except DamagedFileError as err:
                if not reuse:
                    raise
                # The recycled folder was tampered with (a link planted in it): nothing was
                # written through it. It goes (links unlinked, never followed), and the write
                # takes a fresh folder: a planted link must not stop the put, nor every later one.
                event(logging.WARNING, "recycled folder damaged", key=key, data_dir=plan.data_dir, error=str(err))
                self.backend.delete_tree(plan.data_dir)
                reuse = False
                self._write_own(plan, staged, fsync=fsync, reuse=False)
            # Under the shared gc lock from "which weights exist" to the commit: gc (which takes
            # it exclusively) cannot remove a weight between this check and the manifest that
            # references it.
            with self.backend.gc_lock(exclusive=False):
                created = [p for p in shared if not self.backend.array_exists(p)]
                for path in self._damaged_weights(plan, skip=created):  # written again: healed
                    self.backend.delete_tree(path)
                    created.append(path)
                self.backend.write_shared_arrays({p: shared[p] for p in created}, fsync=fsync)
                self._whole_weights.update(created)
                committing = True
                if self.atomicity.commit(staged, manifest_path, plan.manifest, fsync=fsync):
                    with self._lock:  # its folder is synced by sync_commits, once for a burst
                        self._unsynced.add(paths.CONTEXTS)
        except StoreUnavailableError as err:
            # The store does not answer: asking it to remove what this write put would only wait
            # again. What is there is unreferenced (gc removes it), unless the manifest's put was
            # under way: it may still land, and then finds every array of its context there.
            event(logging.WARNING, "put failed", key=key, error=f"{type(err).__name__}: {err}",
                  commit_unknown=committing)
            raise
        except (serializers.DiskFullError, OSError) as err:
            event(logging.WARNING, "put failed", key=key, error=f"{type(err).__name__}: {err}")
            self.atomicity.unstage(staged)
            self._undo_write(plan.data_dir, created)
            if serializers.is_disk_full(err):
                raise StoreFullError(
                    f"the disk cannot take context {key!r} ({plan.nbytes:,} bytes to write under "
                    f"{self.description}): {err}"
                ) from err
            raise
        self._remember_commit(plan)
        event(logging.DEBUG, "commit", key=key, data_dir=plan.data_dir, new_weights=len(created),
              bytes=plan.nbytes)
        return previous

    def _damaged_weights(self, plan: layout.WritePlan, skip: Container[str]) -> list[str]:
        """The weights of ``plan`` stored already (not in ``skip``) whose bytes fail their
        checksums. Content-addressed, a weight is written once and every later put reuses it: a
        damaged one (a flipped byte) made every context holding it damaged, a new put's too, and
        only a write of it heals them. Each is read once per tier; then it is known whole."""
        damaged = []
        for i, record in enumerate(plan.stored.records):
            path = record.path
            if not record.shared or path in skip or path in self._whole_weights or path in damaged:
                continue
            try:
                forms.check_stored(self.backend, plan.key, i, record)
            except StoreUnavailableError:
                raise
            except (CorruptContextError, serializers.SerializationError, OSError, ValueError) as err:
                event(logging.WARNING, "damaged weight written again", key=plan.key, path=path, error=str(err))
                damaged.append(path)
                continue
            self._whole_weights.add(path)
        return damaged

    def _write_own(self, plan: layout.WritePlan, staged: str | None, *, fsync: bool, reuse: bool) -> None:
        """The context's own arrays, its group's ``zarr.json`` and (with ``staged``) its
        manifest under that temporary name: into the recycled folder now named ``data_dir``
        (``reuse``), else into a fresh one."""
        self.backend.write_context(plan.own_write(fsync=fsync, reuse=reuse, staged=staged))

    def sync_commits(self) -> None:
        """Makes the commits since the last call survive a power loss: one sync of the folder
        their manifests were renamed into (their arrays and manifests are synced already, before
        each rename). The store calls it when its writer runs out of work, before ``flush``
        returns."""
        with self._lock:
            folders, self._unsynced = self._unsynced, set()
        try:
            for folder in sorted(folders):
                self.backend.sync_folder(folder)
        except BaseException:
            with self._lock:
                self._unsynced |= folders
            raise

    def _committed_data(self, key: str) -> StaleData | None:
        """The data of ``key``'s committed context (which a write of ``key`` replaces), if any:
        from its manifest, which this tier's own last commit of it left parsed in the stat cache
        (``None`` for a damaged one, a FIFO, a folder: it is replaced, gc takes its data)."""
        try:
            return layout.data_of(self.stat(key))
        except (ContextNotFoundError, CorruptContextError):
            return None

    def _remember_commit(self, plan: layout.WritePlan) -> None:
        """Caches this commit's parsed manifest under the manifest file's version: a ``get`` or
        the next ``put`` of the key in this process neither reads nor parses it while the file
        is unchanged."""
        version = self.backend.version(paths.manifest_path(plan.key))
        if version is not None:
            self._cache_stat(plan.key, version, plan.stored)

    def _cache_stat(self, key: str, version: Any, stored: StoredContext) -> None:
        with self._lock:
            self._stat_cache[key] = (version, stored)

    def _undo_write(self, data_dir: str, weights: Sequence[str]) -> None:
        """Removes what a failed write left: its data folder, and the weights it added that no
        committed manifest references (another writer may have committed one meanwhile)."""
        self.backend.delete_tree(data_dir)
        if not weights:
            return
        with self.backend.gc_lock(exclusive=True):
            found = self.references()
            for path in weights:
                if found is not None and path not in found[0]:
                    self.backend.delete_tree(path)

    def references(self) -> tuple[set[str], set[str]] | None:
        """Every data folder and shared array a committed manifest references, and their
        signatures; ``None`` if a manifest is unreadable (it may reference anything)."""
        referenced: set[str] = set()
        signatures: set[str] = set()
        for _, stored in self.iter_manifests():
            if not isinstance(stored, StoredContext):
                return None
            referenced.add(stored.data_dir)
            referenced.update(r.path for r in stored.records if r.shared)
            signatures.add(stored.spec.signature)
        return referenced, signatures

    def write_blob(self, name: str, data: bytes, *, fsync: bool) -> None:
        self.check_writable(f"write {name}")
        try:
            self.backend.put_bytes(name, data, fsync=fsync)
        except OSError as err:  # put_bytes leaves nothing behind on failure
            if serializers.is_disk_full(err):
                raise StoreFullError(
                    f"the disk cannot take {name} ({len(data):,} bytes under {self.description}): {err}"
                ) from err
            raise

    # -- reading ------------------------------------------------------------------------------

    def read_manifest_bytes(self, key: str) -> bytes | None:
        return self.backend.get_bytes(paths.manifest_path(key))

    def stat(self, key: str) -> StoredContext:
        """The validated manifest of ``key``; :class:`ContextNotFoundError` if not committed
        (or deleted between the look-up of its version and its read), :class:`CorruptContextError`
        if it is damaged.

        Parsed manifests are cached while the file's version (inode, size, mtime) is unchanged,
        so listing a large store again costs one ``stat`` per context. A version can come back
        for another file (a reused inode, a coarse clock): :meth:`read` never trusts the cache
        to judge a failed read.
        """
        manifest = paths.manifest_path(key)
        version = self.backend.version(manifest)
        with self._lock:
            cached = self._stat_cache.pop(key, None) if version is None else self._stat_cache.get(key)
            if cached is not None and cached[0] == version:
                return cached[1]  # (marked recently used)
        data = self.backend.get_bytes(manifest)
        if data is None:
            raise ContextNotFoundError.of(key, self.description)
        try:
            stored = parse_context_manifest(key, data)  # self checksum and every field checked
        except CorruptContextError as err:  # in the store's words (damage.py)
            raise damaged_context(key, manifest_damage(key, err)) from err
        if version is not None:
            self._cache_stat(key, version, stored)
        return stored

    def forget_stat(self, key: str) -> None:
        with self._lock:
            self._stat_cache.pop(key, None)

    def read(
        self, key: str, *, place: bool = True, skip: Container[str] = (),
        check: tuple[Callable[[StoredContext], None], Callable[[StoredContext], None]] | None = None,
    ) -> tuple[StoredContext, HostArrays]:
        """Reads and verifies every array of ``key``; :class:`CorruptContextError` names the bad one.

        While ``key`` is replaced or deleted under it (in this process or another, in a folder or
        on a kvstore), a read returns one whole, verified context (the one it began with or a
        later one, never a mix) or raises :class:`ContextNotFoundError` (deleted) or
        :class:`CorruptContextError` (damaged: the manifest stayed the same across a failed
        read); no :mod:`serializers` error or ``OSError`` escapes (but
        :class:`StoreUnavailableError`). A commit removes or recycles (overwrites in place) the
        data it replaces, so a read may find it gone or torn: after any failure the manifest is
        read again, and a new one is read from the start.

        Arrays come back as NumPy arrays, except, with ``place`` (the default), a sharded
        residual whose mesh this process has the devices for (at least as many as the mesh has):
        that one comes back as a :class:`ShardedHost` with its rebuilt ``placement``, holding only
        the chunks this process's devices need (:func:`to_device_sharded` puts them on the
        devices). On a process with fewer devices, or with ``place=False``, it comes back whole
        (every chunk read and verified) as a NumPy array, to be loaded on the default device.

        Shared arrays (weights) stored whole at a path in ``skip`` are not read: the caller holds
        them already, and they come back as ``None``.

        ``check``, if given, checks more of each manifest read, before its arrays are read and
        after (``verify``: the files' sizes first, then their zarr metadata and the bundle's
        headers), inside the same retry: what it finds is damage only where the manifest
        stayed the same.
        """
        failed: tuple[StoredContext, CorruptContextError] | None = None  # the last failed read
        for attempt in range(_READ_ATTEMPTS + 1):
            stored = self.stat(key)  # after a failure, read again (forgotten below); not found: deleted
            if failed is not None and _same_data(stored, failed[0]):  # the manifest stayed the same:
                why = size_damage(self.backend, stored) or without_key(key, str(failed[1]))
                raise damaged_context(key, why) from failed[1]  # the data is damaged
            if attempt == _READ_ATTEMPTS:
                break
            try:
                if check is not None:
                    check[0](stored)
                arrays = self._read_arrays(key, stored, place=place, skip=skip)
                if check is not None:
                    check[1](stored)
                return stored, arrays
            except StoreUnavailableError:
                raise  # no answer is no damage, and asking again would wait again
            except CorruptContextError as err:
                failed = (stored, err)
            except (serializers.SerializationError, OSError, ValueError) as err:  # none known: all the same
                found = CorruptContextError(f"context {key!r}: unreadable ({type(err).__name__}: {err})")
                found.__cause__ = err
                failed = (stored, found)
            self.forget_stat(key)  # a version may come back for another file (inode reused, coarse mtime)
        raise CorruptContextError(f"context {key!r} was replaced {_READ_ATTEMPTS} times while being read; try again")

    def _read_arrays(
        self, key: str, stored: StoredContext, *, place: bool = False, skip: Container[str] = ()
    ) -> HostArrays:
        """Reads and verifies the arrays, each in its form (:mod:`~residual_store._src.store.disk.forms`): from a
        folder, a small context in this thread (handing a few reads to other threads costs more
        than they take), a large one two reads at a time (file reads and checksums release the
        GIL); from an object store, up to 16 requests at a time."""
        n = len(stored.records)
        placements: list[NamedSharding | None] = [None] * n
        by_shard = [False] * n  # read only the chunks of this process's devices
        tasks: list[forms.Task] = []
        for i, record in enumerate(stored.records):
            sharding = stored.sharding(i) if stored.sharded else None
            if place and sharding:
                placements[i] = placement = forms.placement_of(key, i, record, sharding)
            else:
                placement = None
            if record.bundled:  # read with the whole bundle below
                continue
            if record.shared and not record.chunked and sharding is None and record.path in skip:
                continue
            if not record.chunked:
                tasks.append((i, None, record.checksum))
                continue
            by_shard[i], wanted = forms.chunk_tasks(i, record, placement)
            tasks += wanted
        read = functools.partial(self._read_task, key, stored)
        nbytes = sum(stored.records[i].nbytes for i, chunk, _ in tasks if chunk is None)
        if self.backend.latency_bound:
            pool, parallel = request_pool(), len(tasks) > 1
        else:
            pool, parallel = _read_pool(), len(tasks) > 1 and nbytes + len(tasks) * _SMALL_READ_BYTES >= _PARALLEL_READ_BYTES
        results = list(pool.map(read, tasks)) if parallel else self._read_in_turn(key, stored, tasks)
        pieces: dict[int, dict[tuple[int, ...] | None, np.ndarray]] = {}
        for (i, idx, _), x in zip(tasks, results):
            pieces.setdefault(i, {})[idx] = x
        bundled = forms.read_bundle(self.backend, key, stored, empty=self._empty) if stored.bundle is not None else {}
        out: HostArrays = []
        for i, record in enumerate(stored.records):
            placement = placements[i]
            if i in bundled and placement is None:  # the common case: a view of the bundle
                out.append(bundled[i])
                continue
            got, sharding = ({None: bundled[i]} if i in bundled else pieces.get(i, {})), stored.sharding(i)
            dtype = serializers.numpy_dtype(record.dtype)
            if by_shard[i]:
                assert sharding is not None and record.chunk_shape is not None
                out.append(ShardedHost(sharding, record.shape, dtype, record.chunk_shape, got, None, placement))
                continue
            if record.chunked:  # every chunk, into one array
                whole = forms.joined_chunks(record, got)
            elif None not in got:  # skipped: the caller holds it
                out.append(None)  # type: ignore[arg-type]  # (HostArrays: None where skipped)
                continue
            else:
                whole = got[None]
            if placement is None:
                out.append(whole)
            else:
                assert sharding is not None
                out.append(ShardedHost(sharding, record.shape, dtype, None, {}, whole, placement))
        return out

    def _read_in_turn(self, key: str, stored: StoredContext, tasks: Sequence[forms.Task]) -> list[np.ndarray]:
        """Every task in this thread: whole arrays in one call of the backend
        (:func:`~residual_store._src.store.disk.forms.read_wholes`)."""
        if any(chunk is not None for _, chunk, _ in tasks):
            return [self._read_task(key, stored, task) for task in tasks]
        return forms.read_wholes(self.backend, key, stored.records, tasks, empty=self._empty)

    def _read_task(self, key: str, stored: StoredContext, task: forms.Task) -> np.ndarray:
        i, chunk, expected = task
        if chunk is None:
            return forms.read_whole(self.backend, key, i, stored.records[i], expected, empty=self._empty)
        return forms.read_chunk(self.backend, key, i, stored.records[i], chunk, expected)

    def keys(self) -> list[str]:
        suffix = paths.MANIFEST_SUFFIX
        return [n[: -len(suffix)] for n in self.backend.list_dir(paths.CONTEXTS) if n.endswith(suffix)]

    def __contains__(self, key: str) -> bool:
        try:
            return self.read_manifest_bytes(key) is not None
        except CorruptContextError:  # there but damaged (a FIFO, a folder): get refuses it, delete removes it
            return True

    # -- deleting -----------------------------------------------------------------------------

    @staticmethod
    def data_of(manifest: bytes, key: str) -> StaleData | None:
        """The data folder of ``key``'s (replaced or deleted) manifest, for the strategy to recycle or remove;
        ``None`` unless the manifest passes every check (its data_dir is then ``key``'s own):
        a damaged or hostile manifest never gets a folder removed, gc finds its data later."""
        try:
            stored = parse_context_manifest(key, manifest)
        except CorruptContextError:
            return None
        return layout.data_of(stored)

    def delete(self, key: str) -> tuple[bool, StaleData | None]:
        """Removes ``key``'s manifest, so it vanishes atomically.

        Returns whether it was there and its data, for the caller to recycle or remove.
        """
        self.check_writable(f"delete {key!r}")
        manifest = paths.manifest_path(key)
        version = self.backend.version(manifest)
        with self._lock:
            cached = self._stat_cache.pop(key, None)
        stale: StaleData | None
        if version is not None and cached is not None and cached[0] == version:
            stale = layout.data_of(cached[1])  # the file parsed before, unchanged since
        else:
            try:
                data = self.read_manifest_bytes(key)
            except CorruptContextError:  # not a regular file, oversized: removed all the same
                data = b""
            if data is None:
                return False, None
            stale = self.data_of(data, key)
        self.backend.delete(manifest)
        return True, stale

    def iter_manifests(self) -> Iterator[tuple[str, StoredContext | CorruptContextError]]:
        keys = self.keys()
        for key in keys:
            try:
                yield key, self.stat(key)
            except ContextNotFoundError:
                continue  # deleted meanwhile
            except CorruptContextError as err:
                yield key, err
        listed = set(keys)  # a whole listing: forget the contexts gone (deleted by any process)
        with self._lock:
            for key in [k for k in self._stat_cache if k not in listed]:
                del self._stat_cache[key]
