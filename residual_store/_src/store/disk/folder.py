"""A local folder as the disk tier's backend: the serializers' fast path, atomic renames (its
strategy: :class:`~residual_store._src.store.disk.folder.AtomicRenames`), fsync, and nothing below
the root followed if it is a symbolic link."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

import residual_store_serializers as serializers
from residual_store._src.errors import ReadOnlyStoreError
from residual_store._src.store.critical import StoreLock
from residual_store._src.store.disk.paths import STORE_MARKER, new_write_id, recycled_path, staging_path, trash_path
from residual_store._src.store.disk.protocol import ContextWrite, DamagedFileError, Empty, StaleData, damaged
from residual_store_serializers.local import (
    check_array_metadata_local,
    check_folders_local,
    fsync_folder_local,
    read_file_exact_local,
    read_file_local,
    sync_data,
)

__all__ = ["AtomicRenames", "LocalBackend", "check_writable"]

_MAX_FREE_PER_SHAPE = 64  # recycled folders kept per folder shape

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

_GC_LOCK = ".gc.lock"  # hidden: listings and the empty-folder check skip dot files


class LocalBackend:
    """A local folder: the serializers' fast path, atomic renames, fsync.

    Nothing below the root is followed if it is a symbolic link: every folder on the way to what
    is read, written, listed, renamed or removed is checked with ``lstat`` (the root itself may
    be a link), files are opened with ``O_NOFOLLOW | O_NONBLOCK`` and checked to be regular files
    of a plausible size, and a refusal is a :class:`DamagedFileError`."""

    latency_bound = False

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.description = self.root  # nothing is created until something is written

    def _path(self, key: str) -> str:
        path = os.path.normpath(os.path.join(self.root, *key.split("/")))
        if path != self.root and not path.startswith(self.root + os.sep):
            raise ValueError(f"refusing a path outside the store: {key!r}")
        return path

    def _parts(self, key: str) -> list[str]:
        path = self._path(key)
        return [] if path == self.root else path[len(self.root) + 1 :].split(os.sep)

    def _safe(self, key: str, *, itself: bool = False) -> str:
        """The path of ``key`` once no folder on the way to it below the root (nor ``key``
        itself, with ``itself``) is a symbolic link; :class:`DamagedFileError` otherwise."""
        parts = self._parts(key)
        try:
            check_folders_local(self.root, parts if itself else parts[:-1])
        except serializers.CorruptDataError as err:
            raise damaged(err) from None
        return os.path.join(self.root, *parts)

    def _makedirs(self, folder_key: str) -> str:
        """Makes the folder ``folder_key`` (``""``: the root) and what is missing on the way,
        one component at a time, refusing any that is a link or not a folder."""
        os.makedirs(self.root, exist_ok=True)  # the root (and above) as the user gave it
        d = self.root
        for part in self._parts(folder_key) if folder_key else []:
            d = os.path.join(d, part)
            try:
                st = os.lstat(d)
            except FileNotFoundError:
                try:
                    os.mkdir(d)
                    continue
                except FileExistsError:  # made meanwhile by another writer
                    st = os.lstat(d)
            if stat.S_ISLNK(st.st_mode):
                raise DamagedFileError(
                    f"{d} is a symbolic link: a store never makes one, and never writes through one"
                )
            if not stat.S_ISDIR(st.st_mode):
                raise DamagedFileError(f"{d} is not a folder, where the store keeps a folder")
        return d

    def _remove_entry(self, path: str) -> None:
        """Removes the entry ``path`` itself (checked below the root by the caller): a link or a
        file is unlinked (a link's target is never touched), a folder removed with everything in
        it without following any link inside (``shutil.rmtree`` works on file descriptors)."""
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            _remove_quietly(path)

    def write_context(self, write: ContextWrite) -> None:
        """A commit's folder in one batch of the serializers' fast path: into a recycled folder
        (``reuse``) each array's files are overwritten in place, its ``zarr.json`` kept. (A
        fresh folder's files cost nothing extra to replace here: ``write.fresh`` is moot.)"""
        with _refused_as_damaged():
            serializers.write_arrays_local(
                self.root, write.arrays, fsync=write.fsync, reuse=write.reuse, keep_metadata=write.reuse,
                write_metadata=write.write_metadata, attributes=write.attributes, files=write.files,
                sync_folders=write.sync_folders, temporaries=write.temporaries,
            )

    def write_arrays(self, arrays: Mapping[str, Any], *, fsync: bool, write_metadata: bool = True) -> None:
        with _refused_as_damaged():
            serializers.write_arrays_local(self.root, arrays, fsync=fsync, write_metadata=write_metadata)

    def rename(self, src: str, dst: str) -> bool:
        """Renames the entry ``src`` (a link there is renamed itself, never followed) to ``dst``;
        whether it worked. :class:`DamagedFileError` for a link on the way to either."""
        source, target = self._safe(src), self._safe(dst)
        self._makedirs(os.path.dirname(dst.rstrip("/")))
        try:
            os.rename(source, target)
            return True
        except OSError:
            return False

    def write_shared_arrays(
        self, arrays: Mapping[str, Any], *, fsync: bool, write_metadata: bool = True
    ) -> None:
        """Content-addressed arrays that committed contexts of other writers may already hold:
        each is written under a temporary name and renamed into place, never rewritten in place,
        so a concurrent or failing writer cannot tear one that is already there. Partial arrays
        (``write_metadata=False``) go to a temporary folder through :meth:`write_arrays` here.

        What is in the way and is not a complete array (a torn leftover, a planted link or file)
        is removed (a link itself, never its target) and replaced."""
        if not arrays:
            return
        if not write_metadata:
            raise ValueError("a local folder renames whole shared arrays into place")
        temps = {f"{path}.{uuid.uuid4().hex[:12]}.tmp": path for path in arrays}
        self.write_arrays({t: arrays[p] for t, p in temps.items()}, fsync=fsync)
        try:
            for temp, path in temps.items():
                source, target = self._safe(temp), self._safe(path)
                try:
                    os.rename(source, target)
                    continue
                except OSError as err:
                    if err.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                        raise
                if not self.array_exists(path):  # a torn leftover or a planted entry, not an array
                    self._remove_entry(target)
                    try:
                        os.rename(source, target)
                        continue
                    except OSError:
                        pass
                self._remove_entry(source)  # the same bytes are there
        except BaseException:
            for t in temps:
                self._remove_entry(self._path(t))
            raise
        if fsync:
            for folder in {os.path.dirname(self._path(p)) for p in arrays}:
                fsync_folder_local(folder)

    def read_arrays(
        self, arrays: Sequence[tuple[str, tuple[int, ...], str, str | None]], *, empty: Empty | None = None
    ) -> list[np.ndarray]:
        """Each whole array ``(path, shape, dtype, checksum)``, in this thread, each folder on
        the way examined once. Its ``zarr.json`` is for other readers: the manifest gives shape
        and dtype, and the checksum (verified while reading) and the chunk's size vouch for the
        data."""
        return serializers.read_arrays_local(
            self.root, arrays, check_metadata=False, empty=empty or serializers.aligned_empty
        )

    def read_file(
        self, key: str, nbytes: int, *, checksum: str | None = None, empty: Empty | None = None
    ) -> np.ndarray:
        """The file ``key`` of exactly ``nbytes`` bytes, in one read, verified against the
        whole file's ``checksum`` as it lands."""
        return read_file_exact_local(
            self.root, key, nbytes, checksum=checksum, what=f"file {key!r}", empty=empty or serializers.aligned_empty
        )

    def read_chunk(
        self, path: str, shape: tuple[int, ...], dtype: str, chunk_shape: tuple[int, ...], index: tuple[int, ...]
    ) -> np.ndarray:
        return serializers.read_chunk_local(
            self.root, path, shape, dtype, chunk_shape, index, check_metadata=False
        )

    def check_metadata(
        self, path: str, shape: tuple[int, ...], dtype: str, chunk_shape: tuple[int, ...] | None = None
    ) -> None:
        """Checks the array's ``zarr.json`` (which the store's own reads skip, but plain ``zarr``
        needs): :class:`DamagedFileError` if it is missing, not a regular file or wrong."""
        try:
            check_array_metadata_local(self.root, path, shape, dtype, chunk_shape)
        except (serializers.CorruptDataError, serializers.UnsupportedDTypeError, ValueError) as err:
            raise damaged(err) from None

    def array_exists(self, path: str) -> bool:
        """Whether ``path`` is a folder (not a link) holding a regular ``zarr.json``."""
        folder = self._safe(path)
        try:
            if not stat.S_ISDIR(os.lstat(folder).st_mode):
                return False
            return stat.S_ISREG(os.lstat(os.path.join(folder, "zarr.json")).st_mode)
        except OSError:
            return False

    def put_bytes(self, key: str, data: bytes, *, fsync: bool) -> None:
        self._safe(key)  # no link on the way
        self._makedirs(os.path.dirname(key.rstrip("/")))
        tmp_key = self.temporary_for(key)
        tmp = self._path(tmp_key)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, 0o644)
            try:
                view = memoryview(data)
                while view.nbytes:
                    view = view[os.write(fd, view) :]
                if fsync:
                    sync_data(fd)
            finally:
                os.close(fd)
        except BaseException:
            _remove_quietly(tmp)
            raise
        self.publish(tmp_key, key, fsync=fsync)

    def temporary_for(self, key: str) -> str:
        """A fresh temporary name beside ``key`` (``.<name>.<id>.tmp``, which gc knows)."""
        head, _, name = key.rstrip("/").rpartition("/")
        tmp = f".{name}.{uuid.uuid4().hex}.tmp"
        return f"{head}/{tmp}" if head else tmp

    def publish(self, temporary: str, key: str, *, fsync: bool) -> None:
        """Renames the written (and, with ``fsync``, synced) file ``temporary`` over ``key``,
        atomically; with ``fsync`` the folder too, so the new name survives a power loss.
        ``temporary`` is removed if this fails."""
        tmp, final = self._safe(temporary), self._safe(key)
        try:
            try:
                os.replace(tmp, final)  # a link or a FIFO there is replaced itself, never followed
            except IsADirectoryError:  # a folder where the file goes: removed (no link followed)
                self._remove_entry(final)
                try:
                    os.replace(tmp, final)
                except OSError as err:
                    raise DamagedFileError(f"{final} is a folder where the store keeps a file: {err}") from None
        except BaseException:
            _remove_quietly(tmp)
            raise
        if fsync:
            fsync_folder_local(os.path.dirname(final))

    def get_bytes(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        """The bytes of the file ``key`` (``None`` if there is none): a regular file of at most
        ``max_bytes`` (default: the manifest cap), never read through a link nor blocking."""
        path = self._safe(key)
        limit = serializers.MAX_MANIFEST_BYTES if max_bytes is None else max_bytes
        try:
            return read_file_local(path, max_bytes=limit)
        except serializers.CorruptDataError as err:
            raise damaged(err) from None

    def exists(self, key: str) -> bool:
        """Whether there is an entry ``key`` (whatever it is: a damaged one counts)."""
        try:
            os.lstat(self._safe(key))
            return True
        except OSError:
            return False

    def is_file(self) -> bool:
        return os.path.exists(self.root) and not os.path.isdir(self.root)

    def root_exists(self) -> bool:
        return os.path.isdir(self.root)

    def is_empty(self) -> bool:
        """No entries but hidden ones (another process's marker being written is hidden)."""
        try:
            return not any(not n.startswith(".") for n in os.listdir(self.root))
        except FileNotFoundError:
            return True

    def list_dir(self, prefix: str) -> list[str]:
        folder = self._safe(prefix, itself=True)
        try:
            return sorted(n for n in os.listdir(folder) if not n.startswith("."))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def list_temporary(self, prefix: str) -> list[str]:
        """Temporary files of :meth:`put_bytes` (``.<name>.<id>.tmp``) left by interrupted writes."""
        try:
            names = os.listdir(self._safe(prefix, itself=True)) if prefix else os.listdir(self.root)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(n for n in names if n.startswith(".") and n.endswith(".tmp"))

    def delete(self, key: str) -> None:
        """Removes the entry ``key`` itself (a link is unlinked, never followed; a folder in place
        of a file goes with what is in it); :class:`DamagedFileError` for a link on the way."""
        self._remove_entry(self._safe(key))

    def delete_tree(self, prefix: str) -> None:
        self._remove_entry(self._safe(prefix))

    def age_seconds(self, prefix: str) -> float | None:
        try:
            return time.time() - os.lstat(self._safe(prefix)).st_mtime
        except (FileNotFoundError, NotADirectoryError):
            return None

    def tree_bytes(self, prefix: str) -> int | None:
        """Bytes of the regular files at or under ``prefix`` (``""``: the whole store), links
        never followed; 0 if there is nothing."""
        top = self._safe(prefix) if prefix else self.root
        total = 0
        try:
            st = os.lstat(top)
        except (FileNotFoundError, NotADirectoryError):
            return 0
        if not stat.S_ISDIR(st.st_mode):
            return st.st_size if stat.S_ISREG(st.st_mode) else 0
        for folder, _, names in os.walk(top, followlinks=False):
            for name in names:
                try:
                    st = os.lstat(os.path.join(folder, name))
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
        return total

    def version(self, key: str) -> Any | None:
        try:
            st = os.lstat(self._safe(key))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    @contextlib.contextmanager
    def gc_lock(self, *, exclusive: bool) -> Iterator[None]:
        """The store's gc lock, across processes (``flock`` on ``.gc.lock``): shared by writers
        from checking which weights exist to committing the manifest, exclusive for gc's
        removals. Each acquisition opens its own descriptor, so threads of one process exclude
        each other too."""
        lock = os.path.join(self.root, _GC_LOCK)
        try:  # never through a link, never blocking on a FIFO planted there
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                raise DamagedFileError(f"{lock} is not a regular file: refusing to lock it ({err.strerror})") from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise DamagedFileError(f"{lock} is not a regular file: refusing to lock it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # releases the lock

    def touch(self, prefix: str) -> bool:
        """Sets ``prefix``'s modification time to now (gc's age rule then keeps it); ``False``
        if it is gone."""
        try:
            os.utime(self._safe(prefix), follow_symlinks=False)
            return True
        except (FileNotFoundError, NotADirectoryError):
            return False

    def sync_folder(self, prefix: str) -> None:
        fsync_folder_local(self._safe(prefix, itself=True))

    def atomicity(self) -> AtomicRenames:
        """Atomic renames: staged files renamed into place, replaced folders recycled."""
        return AtomicRenames(self)


def check_writable(root: str, *, create: bool) -> None:
    """Raises :class:`ReadOnlyStoreError` where a writable store at the folder ``root`` could
    not write: the folder, or where it is missing and would be made, the nearest folder above it
    that exists, is on a read-only file system or not writable by this process.

    Checked when the store opens, before anything is written, so that the refusal is the
    library's, at open, and not a raw ``OSError`` from the first write (or, for a store opened
    on a read-only mount, from the first ``flush``). Where the open itself refuses the path (a
    file in the way; ``create=False`` on a folder with no store), the open says so instead.
    Permission bits are what ``access(2)`` reports for this process's effective ids: the
    super-user passes them, but never a read-only mount.
    """
    folder = os.path.abspath(root)
    while not os.path.lexists(folder):
        parent = os.path.dirname(folder)
        if not create or parent == folder:
            return  # nothing to make (StoreNotFoundError follows), or nothing above exists
        folder = parent
    if not os.path.isdir(folder):
        return
    store_there = os.path.lexists(os.path.join(folder, STORE_MARKER))
    if _writable(folder):
        refused = None if store_there or not create else _refused_folder(folder)
        if refused is None:
            return
        why = f"a folder where none can be made (mkdir: {refused})"  # /proc, /sys: access(2) says yes
    elif folder == os.path.abspath(root) and not create and not store_there:
        return  # no store to open: StoreNotFoundError says so
    else:
        why = "on a read-only file system" if _read_only_mount(folder) else "not writable by this process"
    where = root if folder == os.path.abspath(root) else f"{root}: the folder above it, {folder},"
    error = ReadOnlyStoreError(
        f"{where} is {why}, and a store opened to write needs to write there: pass read_only=True "
        "to read a store there, or give a writable folder"
    )
    error.reason = f"{where} is {why}"
    raise error


def _refused_folder(folder: str) -> str | None:
    """Why a folder cannot be made in ``folder`` (one is made and removed at once to find out),
    or ``None``: a file system of the kernel's (``/proc``, ``/sys``) passes ``access(2)`` for
    the super-user and still refuses, with ``ENOENT`` or ``EPERM``. A full disk is left for
    the write to report (as :class:`StoreFullError`)."""
    probe = os.path.join(folder, f".residual-store-probe-{uuid.uuid4().hex[:12]}")
    try:
        os.mkdir(probe)
    except OSError as err:
        return None if serializers.is_disk_full(err) or err.errno == errno.EEXIST else err.strerror or str(err)
    with contextlib.suppress(OSError):
        os.rmdir(probe)
    return None


def _writable(folder: str) -> bool:
    """Whether this process may make and remove entries in ``folder``."""
    effective = os.access in os.supports_effective_ids
    return os.access(folder, os.W_OK | os.X_OK, effective_ids=effective)


def _read_only_mount(folder: str) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


@contextlib.contextmanager
def _refused_as_damaged() -> Iterator[None]:
    """A write the serializers refused (a link or a FIFO in the way: nothing was written) as a
    :class:`DamagedFileError`."""
    try:
        yield
    except serializers.CorruptDataError as err:
        raise damaged(err) from err


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


class AtomicRenames:
    """A medium with atomic renames (a local folder): stage and rename into place, recycle
    replaced data folders, rename into the trash before a removal.

    Holds this disk tier's recycled folders by folder shape; a folder is touched before it is claimed,
    so it is young under its new name (gc's age rule) from the moment it has one."""

    def __init__(self, backend: LocalBackend) -> None:
        self.backend = backend
        self._lock = StoreLock()
        self._free: dict[str, list[str]] = {}  # folder shape -> recycled data folders

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

    def recycle(self, stale: StaleData) -> None:
        """Keeps the folder for a later write of its folder shape, which then overwrites its files in
        place instead of creating some 50 files and folders (file creation dominates small
        writes), while the shape has room; otherwise removes it."""
        with self._lock:
            pool = self._free.setdefault(stale.folder_shape, [])
            room = len(pool) < _MAX_FREE_PER_SHAPE
        if room:
            target = recycled_path(stale.folder_shape, new_write_id())
            if self.backend.rename(stale.data_dir, target):
                with self._lock:
                    pool.append(target)
                return
        self.remove(stale)

    def remove(self, stale: StaleData) -> None:
        self.backend.delete_tree(stale.data_dir)

    def claim(self, folder_shape: str, data_dir: str) -> bool:
        while True:
            with self._lock:
                free = self._free.get(folder_shape)
                if not free:
                    return False
                candidate = free.pop()
            # a folder gc took meanwhile fails the touch or the rename
            if self.backend.touch(candidate) and self.backend.rename(candidate, data_dir):
                return True

    def collect(self, path: str) -> bool:
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

    shared_staging = staticmethod(staging_path)

    def publish_shared(self, staged: str, path: str, metadata: Mapping[str, Any], *, fsync: bool) -> None:
        """The staging folder completed and renamed into place; dropped where another writer put
        the same bytes there first."""
        self.backend.write_arrays(metadata, fsync=fsync)
        if not self.backend.rename(staged, path):
            self.backend.delete_tree(staged)

    def drop_shared_staging(self, staged: str, path: str) -> None:
        self.backend.delete_tree(staged)
