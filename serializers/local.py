"""The local-file fast path: zarr v3 arrays in a plain local folder, with ``os`` calls only.

It writes each chunk with ``os.write`` straight from the array's buffer (no copy),
``zarr.json`` after it, and fsyncs files and folders when asked; it reads a chunk
with one ``readv`` into a 64-byte aligned buffer (:func:`aligned_empty`), so a later
``jax.device_put`` on CPU can use the memory in place. Sizes are checked against the
expected shape before reading. The bytes are those of :mod:`serializers.zarr`, the
same as :mod:`serializers.kv` writes and reads.

Chunked arrays (:class:`~serializers.zarr.ChunkedArray`) are written chunk by chunk,
possibly by several writers that each hold some chunks (:func:`write_chunks_local`),
and read chunk by chunk (:func:`read_chunk_local`). A chunk write never removes the
array's other chunks, so write into a fresh folder or one holding an array of the
same layout.

Safety: every file is opened without following a symbolic link and without blocking,
and every folder below the store's root is checked not to be a link (see below), so a
damaged or hostile store is refused, never followed outside its root.

Errors: a missing, truncated or oversized chunk, missing or mismatching metadata ->
:class:`~serializers.errors.CorruptDataError` naming the file. ``ENOSPC``/``EFBIG``/
``EDQUOT`` while writing -> :class:`~serializers.errors.DiskFullError`, after removing
what that write had created.
"""

from __future__ import annotations

import errno
import functools
import math
import os
import shutil
import stat
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

import numpy as np

from serializers.checksums import Verifier
from serializers.errors import DISK_FULL_ERRNOS, CorruptDataError, DiskFullError
from serializers.zarr import (
    _METADATA_KEY,
    CHUNK_KEY_SEPARATOR,
    SUPPORTED_DTYPES,
    ChunkedArray,
    DTypeLike,
    PathLike,
    Shape,
    _byte_view,
    _check_attributes,
    _check_chunk_index,
    _check_relpath,
    _check_zarr_metadata,
    _describe,
    _disk_array,
    _disk_chunks,
    _disk_metadata,
    check_chunk_shape,
    chunk_grid,
    chunk_index_key,
    chunk_key,
    numpy_dtype,
    zarr_dtype_name,
)

__all__ = [
    "ALIGNMENT",
    "aligned_empty",
    "write_arrays_local",
    "write_array_local",
    "read_array_local",
    "read_arrays_local",
    "write_chunks_local",
    "read_chunk_local",
    "read_file_local",
    "check_folders_local",
    "check_array_metadata_local",
    "fsync_folder_local",
    "sync_data",
    "write_file_local",
    "read_file_exact_local",
]

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


# Every file of a local store is opened without following a symbolic link (``O_NOFOLLOW``) and
# without blocking (``O_NONBLOCK``: a FIFO opens at once), then ``fstat``-checked to be a regular
# file of a plausible size before a byte is read; every folder below the store's root is checked
# with ``lstat`` not to be a symbolic link before anything is read, written or created in it. A
# store never makes a link, a FIFO or a device, so any such entry is damage (CorruptDataError),
# and nothing outside the root is ever read, written or removed through one. The root itself may
# be a symbolic link (the user's choice of path).
_O_CLOEXEC: Final[int] = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW: Final[int] = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK: Final[int] = getattr(os, "O_NONBLOCK", 0)
_O_DIRECTORY: Final[int] = getattr(os, "O_DIRECTORY", 0)
_READ_FLAGS: Final[int] = os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC
_MAX_METADATA_BYTES: Final[int] = 1 << 20  # a zarr.json is a few hundred bytes


def _kind(mode: int) -> str:
    """What a file of this ``st_mode`` is, for messages."""
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _open_error(p: str, e: OSError, doing: str) -> CorruptDataError:
    """The CorruptDataError for an ``os.open`` of ``p`` that failed with ``e``."""
    if e.errno == errno.ELOOP:
        why = "is a symbolic link (a store never makes one, and never follows one)"
    elif e.errno == errno.EISDIR:
        why = "is a folder, not a file"
    elif e.errno == errno.ENXIO:
        why = "is a FIFO or socket, not a regular file"
    else:
        why = f"cannot be opened ({e.strerror or e})"
    return CorruptDataError(f"{p} {why}: refusing to {doing} it")


def _not_regular(p: str, st: os.stat_result, doing: str) -> CorruptDataError:
    return CorruptDataError(f"{p} is {_kind(st.st_mode)}, not a regular file: refusing to {doing} it")


def _is_regular(p: str) -> bool:
    """Whether ``p`` is a regular file itself (not through a symbolic link)."""
    try:
        return stat.S_ISREG(os.lstat(p).st_mode)
    except OSError:
        return False


def check_folders_local(root: PathLike, parts: Sequence[str]) -> str:
    """The path ``root/parts[0]/.../parts[-1]``, after checking with ``lstat`` that none of these
    folders below ``root`` is a symbolic link (nor something else that would be followed: a
    store never holds one).

    The walk stops at the first missing component or one that is not a folder: what the caller
    then opens, lists or creates there fails as missing (or as not a folder).

    Raises:
      CorruptDataError: a component is a symbolic link, or cannot be examined.
    """
    return _Folders(root).path(tuple(parts))


class _Folders:
    """:func:`check_folders_local` for many paths below one root: each folder is examined once
    (the arrays of one context share every folder but their own)."""

    def __init__(self, root: PathLike) -> None:
        # relative parts -> (absolute path, whether the walk goes on below it)
        self._seen: dict[tuple[str, ...], tuple[str, bool]] = {(): (os.fspath(root), True)}

    def path(self, parts: tuple[str, ...]) -> str:
        return self._walk(parts)[0]

    def _walk(self, parts: tuple[str, ...]) -> tuple[str, bool]:
        hit = self._seen.get(parts)
        if hit is not None:
            return hit
        above, walking = self._walk(parts[:-1])
        p = os.path.join(above, parts[-1])
        if walking:
            try:
                st = os.lstat(p)
            except (FileNotFoundError, NotADirectoryError):
                walking = False
            except OSError as e:
                raise CorruptDataError(f"{p} cannot be examined ({e.strerror or e})") from None
            else:
                if stat.S_ISLNK(st.st_mode):
                    raise CorruptDataError(
                        f"{p} is a symbolic link: a store never makes one, and never reads, writes or "
                        "removes anything through one"
                    )
                walking = stat.S_ISDIR(st.st_mode)
        self._seen[parts] = (p, walking)
        return p, walking


def read_file_local(p: str, *, max_bytes: int, what: str | None = None) -> bytes | None:
    """The bytes of the small file ``p`` (a manifest, a marker, metadata), or ``None`` if there
    is no such file (or a folder on the way is missing or a file).

    Opened without following a symbolic link and without blocking, checked to be a regular
    file of at most ``max_bytes`` before anything is read, and read with that bound: a FIFO, a
    folder, a device, a link (a loop, one to ``/dev/zero``) or a sparse giant in its place is
    refused at once, with memory bounded. The caller has checked the folders on the way
    (:func:`check_folders_local`).

    Raises:
      CorruptDataError: not a regular file, larger than ``max_bytes``, or unreadable.
    """
    label = f"{what}: " if what else ""
    try:
        fd = os.open(p, _READ_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise CorruptDataError(label + str(_open_error(p, e, "read"))) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptDataError(label + str(_not_regular(p, st, "read")))
        if st.st_size > max_bytes:
            raise CorruptDataError(
                f"{label}{p} is {st.st_size:,} bytes, over the {max_bytes:,} allowed: refusing to read it"
            )
        buf = bytearray(st.st_size)
        view = memoryview(buf)
        got = 0
        try:
            while got < st.st_size:
                n = os.readv(fd, [view[got:]])
                if n == 0:
                    break  # shrank meanwhile: the caller's decoding finds it truncated
                got += n
        except OSError as e:
            raise CorruptDataError(f"{label}{p} cannot be read ({e.strerror or e})") from None
        finally:
            view.release()
        if got < len(buf):
            del buf[got:]
        return bytes(buf)
    finally:
        os.close(fd)


class _Undo:
    """The files and folders one local write created, to remove them on failure.

    Folders below ``root`` are made (or found) one component at a time with ``lstat``, refusing
    one that is a symbolic link; ``root`` itself and its parents are taken as they are."""

    def __init__(self, root: str | None = None) -> None:
        self.root = root
        self.created: list[tuple[str, bool]] = []  # (path, is_dir), in creation order
        self.dirty_dirs: set[str] = set()  # folders whose entries changed
        self.synced: set[str] = set()  # files fsynced on the descriptor that wrote them
        self._lock = threading.Lock()  # arrays are written from several threads
        self._checked: set[str] = set()  # folders below root found or made safe by this write

    def add_file(self, path: str, *, new_name: bool = True) -> None:
        """Records a file this write wrote (removed if it fails); ``new_name=False``: one
        overwritten in place, whose folder's entries did not change (no folder fsync for it)."""
        with self._lock:
            self.created.append((path, False))
            if new_name:
                self.dirty_dirs.add(os.path.dirname(path))

    def add_synced(self, path: str) -> None:
        with self._lock:
            self.synced.add(path)

    def makedirs(self, folder: str) -> bool:
        """Creates ``folder`` and missing parents; whether this call created ``folder`` itself.

        Raises:
          CorruptDataError: a folder on the way below ``root`` is a symbolic link or not a folder.
        """
        if folder in self._checked:  # found or made by this write already
            return False
        root = self.root
        if root is not None and folder.startswith(root + os.sep):
            return self._makedirs_below(root, folder[len(root) + 1 :].split(os.sep))
        missing = []
        d = folder
        while not os.path.isdir(d):
            missing.append(d)
            parent = os.path.dirname(d)
            if parent == d:
                break
            d = parent
        created = False
        for d in reversed(missing):
            try:
                os.mkdir(d)
            except FileExistsError:
                continue  # made concurrently by someone else: not ours to remove
            with self._lock:
                self.created.append((d, True))
                self.dirty_dirs.add(os.path.dirname(d) or ".")
            created = d == folder
        return created

    def _makedirs_below(self, root: str, parts: Sequence[str]) -> bool:
        d = root
        created = False
        for part in parts:
            d = os.path.join(d, part)
            created = False
            if d in self._checked:
                continue
            try:
                st = os.lstat(d)
            except FileNotFoundError:
                try:
                    os.mkdir(d)
                except FileExistsError:  # made concurrently by someone else: not ours to remove
                    st = os.lstat(d)
                else:
                    with self._lock:
                        self.created.append((d, True))
                        self.dirty_dirs.add(os.path.dirname(d))
                    self._checked.add(d)
                    created = True
                    continue
            if stat.S_ISLNK(st.st_mode):
                raise CorruptDataError(
                    f"{d} is a symbolic link: a store never makes one, and never writes through one"
                )
            if not stat.S_ISDIR(st.st_mode):
                raise CorruptDataError(f"{d} is {_kind(st.st_mode)} where the store needs a folder")
            self._checked.add(d)
        return created

    def remove(self) -> None:
        for p, is_dir in reversed(self.created):
            try:
                if is_dir:
                    os.rmdir(p)
                else:
                    os.unlink(p)
            except OSError:
                pass  # a folder someone else also wrote into stays


_PREALLOCATE_BYTES: Final[int] = 1 << 20
_IO_THREADS: Final[int] = 4
_io_pool: ThreadPoolExecutor | None = None
_io_pool_lock = threading.Lock()


def _in_parallel(fn: Callable[[Any], None], items: Sequence[Any], *, parallel: bool = True) -> None:
    """Runs ``fn`` over ``items`` on a few threads (in this one unless ``parallel``), waits for
    all, raises the first error.

    File creation, writes and fsyncs release the GIL and the filesystem overlaps them
    (measured here: 25 small arrays 23 ms -> 11 ms; 62 fsyncs 121 ms -> 14 ms).
    """
    global _io_pool
    if len(items) <= 1 or not parallel:
        for item in items:
            fn(item)
        return
    with _io_pool_lock:
        if _io_pool is None:
            _io_pool = ThreadPoolExecutor(_IO_THREADS, thread_name_prefix="serializers-io")
    futures = [_io_pool.submit(fn, item) for item in items]
    errors = [f.exception() for f in futures]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first


def sync_data(fd: int) -> None:
    """Makes a file's bytes (and the metadata needed to read them back, such as its size)
    survive a power loss: ``fdatasync`` where the platform has it, which skips flushing
    timestamps (for a file overwritten in place, no journal commit), else ``fsync``."""
    (getattr(os, "fdatasync", None) or os.fsync)(fd)


def _fsync_path(p: str) -> None:
    """Syncs a file this write made (never through a link)."""
    fd = os.open(p, _READ_FLAGS)
    try:
        sync_data(fd)
    finally:
        os.close(fd)


def fsync_folder_local(p: str) -> None:
    """fsyncs a folder (the root, or one checked below it), so the entries it gained survive a
    power loss."""
    fd = os.open(p, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(
    p: str,
    data: memoryview | Sequence[memoryview | bytes],
    undo: _Undo,
    *,
    fsync: bool,
    fresh: bool = False,
    new_name: bool = True,
) -> None:
    """Creates (or truncates) the regular file ``p`` and writes ``data`` (one buffer, or buffers
    written one after another); never through a link, never blocking on a FIFO; ``fresh``:
    ``p``'s folder was just made, so ``p`` must be new.

    Raises:
      CorruptDataError: ``p`` is a symbolic link, a folder, a FIFO or anything but a regular file.
    """
    flags = os.O_WRONLY | os.O_CREAT | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC
    fd = _open_for_write(p, flags | os.O_EXCL if fresh else flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(p, st, "write")
        if st.st_nlink > 1:  # its bytes are shared with another name, maybe outside the store
            os.close(fd)
            fd = -1
            os.unlink(p)  # replaced, never written into
            fd = _open_for_write(p, flags | os.O_EXCL)
        elif st.st_size:
            os.ftruncate(fd, 0)  # truncated only once known to be a regular file of its own
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    undo.add_file(p, new_name=new_name)
    parts = [data] if isinstance(data, memoryview) else [memoryview(b) for b in data]
    try:
        total = sum(v.nbytes for v in parts)
        if total >= _PREALLOCATE_BYTES and hasattr(os, "posix_fallocate"):
            try:  # faster large writes, and a full disk is reported before any byte is written
                os.posix_fallocate(fd, 0, total)
            except OSError as e:
                if e.errno in DISK_FULL_ERRNOS:
                    raise
        _write_all(fd, parts, p)
        if fsync:
            sync_data(fd)
            undo.add_synced(p)
    finally:
        os.close(fd)


_IOV_MAX: Final[int] = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


def _write_all(fd: int, parts: list[memoryview], p: str) -> None:
    """Writes ``parts`` one after another with as few ``writev`` calls as the kernel allows,
    resuming after a short write (one buffer: plain ``write`` calls)."""
    if len(parts) == 1:
        (view,) = parts
        while view.nbytes:
            n = os.write(fd, view)
            if n <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), p)
            view = view[n:]
        return
    i = 0
    while i < len(parts):
        batch = parts[i : i + _IOV_MAX]
        n = os.writev(fd, batch)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), p)
        for view in batch:  # skip what was written; a partly written buffer continues next call
            if n >= view.nbytes:
                n -= view.nbytes
                i += 1
                continue
            parts[i] = view[n:]
            break


def _open_for_write(p: str, flags: int) -> int:
    try:
        return os.open(p, flags, 0o644)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EEXIST):
            raise _open_error(p, e, "write") from None
        raise


def _overwrite_in_place(
    folder: str, a: np.ndarray, meta: Callable[[], bytes] | None, undo: _Undo, *, fsync: bool
) -> bool:
    """Writes ``a`` over the chunk of an existing array of the same shape and dtype, creating no
    file or folder (creations dominate small writes here); ``False`` if there is no such chunk.

    The caller vouches that the folder holds an array of ``a``'s shape and dtype; the chunk's
    size is checked, and ``zarr.json`` is rewritten only if it differs from ``meta()`` (other
    attributes); ``meta`` ``None``: the caller vouches for its attributes too, and it is kept.
    """
    chunks = _disk_chunks(a)
    if chunks:
        ((key, view),) = chunks
        if not _overwrite_file_in_place(os.path.join(folder, key), view, undo, fsync=fsync):
            return False
    elif not _is_regular(os.path.join(folder, _METADATA_KEY)):
        return False
    if meta is not None:
        _write_metadata_local(folder, meta(), undo, reuse=True, fsync=fsync)
    return True


def _overwrite_file_in_place(
    chunk: str, data: memoryview | Sequence[memoryview | bytes], undo: _Undo, *, fsync: bool
) -> bool:
    """Writes ``data`` (one buffer, or buffers one after another) over the existing file
    ``chunk`` of exactly that size; ``False`` if there is no such file (then nothing was written).

    Raises:
      CorruptDataError: ``chunk`` is a symbolic link, a folder, a FIFO or anything but a regular
        file (a recycled folder is never written through a link planted in it).
    """
    parts = [data] if isinstance(data, memoryview) else [memoryview(b) for b in data]
    try:
        fd = os.open(chunk, os.O_WRONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as e:
        raise _open_error(chunk, e, "write") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(chunk, st, "write")
        if st.st_size != sum(v.nbytes for v in parts) or st.st_nlink > 1:  # a hard link: replaced, not written into
            return False
        undo.add_file(chunk, new_name=False)  # removed if the write fails
        _write_all(fd, parts, chunk)
        if fsync:
            sync_data(fd)
            undo.add_synced(chunk)
    finally:
        os.close(fd)
    return True


def _write_chunk_local(folder: str, key: str, view: memoryview, undo: _Undo, *, reuse: bool, fsync: bool) -> None:
    p = os.path.join(folder, key)
    if reuse and _overwrite_file_in_place(p, view, undo, fsync=fsync):
        return
    _write_file(p, view, undo, fsync=fsync)


def _write_metadata_local(folder: str, meta: bytes, undo: _Undo, *, reuse: bool, fsync: bool) -> None:
    """Writes ``meta`` as the folder's ``zarr.json``; with ``reuse``, one already holding exactly
    these bytes (a recycled folder of the same layout and attributes) is kept as it is."""
    p = os.path.join(folder, _METADATA_KEY)
    if reuse and _holds(p, meta):
        return
    _write_file(p, memoryview(meta), undo, fsync=fsync)


def _holds(p: str, data: bytes) -> bool:
    """Whether ``p`` is a regular file itself (not through a link) holding exactly ``data``."""
    if not _is_regular(p):
        return False
    try:
        return read_file_local(p, max_bytes=len(data)) == data
    except CorruptDataError:  # larger, or swapped for something else meanwhile: rewritten
        return False


def _call(task: Callable[[], None]) -> None:
    task()


def _write_small_file(
    root: str,
    path: str,
    data: bytes | Sequence[memoryview | bytes],
    undo: _Undo,
    *,
    fsync: bool,
    temporary: bool,
    reuse: bool = False,
) -> None:
    """Writes ``data`` (bytes, or buffers one after another: a bundle) as the file ``path`` (its
    folder made by the caller); overwriting one that is there changes no folder's entries, nor
    does a ``temporary`` one (its caller renames it and syncs the folder then). With ``reuse``, a
    file of exactly this size there (a recycled folder's) is overwritten in place."""
    p = os.path.join(root, *path.split("/"))
    view = memoryview(data) if isinstance(data, bytes | bytearray | memoryview) else data
    if reuse and _overwrite_file_in_place(p, view, undo, fsync=fsync):
        return
    _write_file(p, view, undo, fsync=fsync, new_name=not temporary and not _is_regular(p))


def _write_one_local(
    root: str,
    path: str,
    arr: Any,
    undo: _Undo,
    *,
    fsync: bool,
    reuse: bool = False,
    keep_metadata: bool = False,
    attributes: Mapping[str, Any] | None = None,
) -> None:
    a = _disk_array(arr)  # path: checked by the caller
    folder = os.path.join(root, *path.split("/"))
    fresh = undo.makedirs(folder)  # a folder this call made holds no stale chunks
    meta = None if keep_metadata else functools.partial(_disk_metadata, a, attributes)
    if reuse and not fresh and _overwrite_in_place(folder, a, meta, undo, fsync=fsync):
        return
    meta_bytes = _disk_metadata(a, attributes)
    for name in [] if fresh else os.listdir(folder):  # chunks of an array this one replaces
        if name == "c" or name.startswith("c" + CHUNK_KEY_SEPARATOR):
            stale = os.path.join(folder, name)
            if os.path.isdir(stale) and not os.path.islink(stale):
                shutil.rmtree(stale)
            else:
                os.unlink(stale)
    for key, view in _disk_chunks(a):
        _write_file(os.path.join(folder, key), view, undo, fsync=fsync, fresh=fresh)
    _write_file(os.path.join(folder, _METADATA_KEY), memoryview(meta_bytes), undo, fsync=fsync, fresh=fresh)


def write_arrays_local(
    root: PathLike,
    arrays: Mapping[str, Any],
    *,
    fsync: bool = False,
    reuse: bool = False,
    write_metadata: bool = True,
    attributes: Mapping[str, Mapping[str, Any]] | None = None,
    files: Mapping[str, bytes | Sequence[memoryview | bytes]] | None = None,
    keep_metadata: bool = False,
    sync_folders: Sequence[str] = (),
    temporaries: Mapping[str, bytes] | None = None,
) -> None:
    """Writes ``{path: array}`` as zarr v3 arrays under the local folder ``root``.

    The fast path: plain ``os.write`` of each array's own buffer (no copy for a
    C-contiguous little-endian array), the chunk first and ``zarr.json`` last.
    Existing arrays at these paths are replaced.

    Args:
      root: the store folder; created if missing.
      arrays: relative array path -> array.
      fsync: fsync every file written and every folder that gained an entry, so
        the arrays survive a power loss once this returns.
      reuse: the paths hold arrays of the same shapes and dtypes that nobody
        reads any more (a recycled folder): overwrite their chunks in place, and
        their ``zarr.json`` only where its bytes differ (other attributes).
      write_metadata: write the ``zarr.json`` of :class:`ChunkedArray` values (a
        writer of some chunks of an array whose metadata another writer writes
        passes ``False``). Plain arrays always get theirs.
      attributes: array path (a key of ``arrays``) -> the zarr attributes of that
        array, a JSON-able mapping written into its ``zarr.json`` (none for a path
        not given).
      keep_metadata: with ``reuse``, the caller vouches that the arrays there have
        these very attributes too (its record of the folder's layout says so): their
        ``zarr.json`` is kept without being read (one open and read less per array).
      sync_folders: relative paths of other folders to fsync with the rest (with
        ``fsync``): ones the caller renamed something into.
      temporaries: like ``files``, for files the caller renames into place itself
        (and then syncs that folder): their own folder is not synced here.
      files: relative file path -> bytes of other files written with the arrays (a
        group's ``zarr.json``), or a sequence of buffers written one after another (a
        bundle, :mod:`serializers.bundle`), created or overwritten where they are (not
        atomically: for files that commit nothing; with ``reuse``, a file of the same size
        is overwritten in place), fsynced alike.

    A value may be a :class:`ChunkedArray`: its chunks are written as files
    ``c.i.j`` (in parallel with everything else), then its ``zarr.json``; the
    array's other chunks, if any are there, are left alone.

    Raises:
      ValueError, TypeError: an unsafe path, or attributes JSON cannot hold or for a
        path not in ``arrays``, before any array is written.
      DiskFullError: on ``ENOSPC``/``EFBIG``/``EDQUOT``; every file and folder
        this call created is removed first. Any other error removes them too.
    """
    root = os.path.normpath(os.fspath(root))
    attrs = attributes or {}
    undo = _Undo(root)
    try:
        undo.makedirs(root)
        others = {**(files or {}), **(temporaries or {})}
        for path in [*arrays, *others]:
            _check_relpath(path)
        _check_attributes(arrays, attributes)
        for parent in sorted({os.path.dirname(os.path.join(root, *p.split("/"))) for p in [*arrays, *others]}):
            undo.makedirs(parent)  # shared parents first; each array's own folder in parallel
        plain = [(p, a) for p, a in arrays.items() if not isinstance(a, ChunkedArray)]
        chunked = [(p, a) for p, a in arrays.items() if isinstance(a, ChunkedArray)]
        folders = {p: os.path.join(root, *p.split("/")) for p, _ in chunked}
        for p, _ in chunked:
            undo.makedirs(folders[p])
        # Each file is fsynced on the descriptor that wrote it, by the thread that wrote it.
        tasks: list[Callable[[], None]] = [
            functools.partial(
                _write_one_local, root, p, a, undo, fsync=fsync, reuse=reuse,
                keep_metadata=keep_metadata, attributes=attrs.get(p),
            )
            for p, a in plain
        ]
        tasks += [  # every chunk of every chunked array in parallel, then their zarr.json
            functools.partial(_write_chunk_local, folders[p], key, view, undo, reuse=reuse, fsync=fsync)
            for p, a in chunked
            for key, view in _disk_chunks(a)
        ]
        tasks += [  # other files (a group's zarr.json, a bundle), overwritten where they are
            functools.partial(
                _write_small_file, root, p, data, undo, fsync=fsync, temporary=p in (temporaries or {}), reuse=reuse
            )
            for p, data in others.items()
        ]
        # Overwriting recycled files without fsync only copies into the page cache: handing that
        # to other threads costs more than it saves (and competes with the caller's compute).
        _in_parallel(_call, tasks, parallel=fsync or not reuse)
        if write_metadata:
            _in_parallel(
                lambda item: _write_metadata_local(
                    folders[item[0]], _disk_metadata(item[1], attrs.get(item[0])), undo, reuse=reuse, fsync=fsync
                ),
                chunked,
            )
        if fsync:  # files first (any not yet), then the folders that gained an entry
            undo.dirty_dirs.update(os.path.join(root, *f.split("/")) for f in sync_folders)
            _in_parallel(_fsync_path, [p for p, is_dir in undo.created if not is_dir and p not in undo.synced])
            _in_parallel(fsync_folder_local, sorted(undo.dirty_dirs, key=len, reverse=True))
    except BaseException as e:
        undo.remove()
        if (
            isinstance(e, OSError)
            and e.errno in DISK_FULL_ERRNOS
            and not isinstance(e, DiskFullError)
        ):
            raise DiskFullError(
                e.errno,
                f"disk full while writing {_describe(list(arrays))} under {root!r}: {e.strerror}",
                e.filename,
            ) from e
        raise


def write_array_local(
    root: PathLike,
    path: str,
    arr: Any,
    *,
    fsync: bool = False,
    attributes: Mapping[str, Any] | None = None,
) -> None:
    """Writes one array under the local folder ``root`` (with zarr ``attributes``, if given);
    see :func:`write_arrays_local`."""
    write_arrays_local(root, {path: arr}, fsync=fsync, attributes=_one(path, attributes))


def _one(path: str, attributes: Mapping[str, Any] | None) -> dict[str, Mapping[str, Any]] | None:
    """The ``attributes`` argument of :func:`write_arrays_local` for the one array ``path``."""
    return None if attributes is None else {path: attributes}


_READ_PIECE: Final[int] = 1 << 20
"""Bytes read per system call when a checksum is verified while reading: a piece is hashed
while it is still in the CPU's cache."""


def _read_exact(fd: int, out: memoryview, p: str, what: str, verifier: Verifier | None = None) -> None:
    """Fills ``out`` from ``fd``; with a ``verifier``, hashes each piece as it lands and checks
    the whole at the end (:class:`CorruptDataError` on a mismatch)."""
    got = 0
    step = _READ_PIECE if verifier is not None else out.nbytes
    while got < out.nbytes:
        n = os.readv(fd, [out[got : got + step]])
        if n == 0:
            raise CorruptDataError(
                f"{what}: chunk file {p} ended after {got} of {out.nbytes} bytes"
            )
        if verifier is not None:
            verifier.update(out[got : got + n])
        got += n
    if verifier is not None:
        verifier.check()


def read_array_local(
    root: PathLike,
    path: str,
    shape: Shape,
    dtype: DTypeLike,
    *,
    check_metadata: bool = True,
    checksum: str | None = None,
) -> np.ndarray:
    """Reads a zarr v3 array written by either path from the local folder ``root``.

    The result is a fresh, writable, 64-byte aligned array of ``shape`` and
    ``dtype``.

    Args:
      root: the store folder.
      path: the array's relative path.
      shape, dtype: what the caller's manifest says the array is.
      check_metadata: also read ``zarr.json`` and check that it describes this
        shape and dtype in the single-chunk raw layout (one small extra read).
      checksum: the array's stored checksum (:func:`serializers.checksum`):
        verified while reading, piece by piece.

    Raises:
      CorruptDataError: a missing or wrong-sized chunk file, or missing or
        mismatching metadata; the message names the file.
    """
    return read_arrays_local(root, [(path, shape, dtype, checksum)], check_metadata=check_metadata)[0]


def read_arrays_local(
    root: PathLike,
    arrays: Sequence[tuple[str, Shape, DTypeLike, str | None]],
    *,
    check_metadata: bool = True,
    empty: Callable[[Shape, np.dtype], np.ndarray] = aligned_empty,
) -> list[np.ndarray]:
    """:func:`read_array_local` of each ``(path, shape, dtype, checksum)`` in order (``checksum``
    may be ``None``), in this thread, examining each folder on the way once: the arrays of one
    context share all their folders but their own, and for a small context that walk costs more
    than reading the bytes.

    ``empty(shape, dtype)`` gives the buffer each array is read into (a fresh, 64-byte aligned,
    C-contiguous array: every byte of it is read before it is returned).

    Raises:
      CorruptDataError: as :func:`read_array_local`, for the first array that fails.
    """
    folders = _Folders(root)
    return [
        _read_single_chunk(folders, path, shape, dtype, check_metadata, checksum, empty)
        for path, shape, dtype, checksum in arrays
    ]


def _read_single_chunk(
    folders: _Folders,
    path: str,
    shape: Shape,
    dtype: DTypeLike,
    check_metadata: bool,
    checksum: str | None,
    empty: Callable[[Shape, np.dtype], np.ndarray],
) -> np.ndarray:
    _check_relpath(path)
    shape = tuple(int(d) for d in shape)
    name = zarr_dtype_name(numpy_dtype(dtype))
    folder = folders.path(tuple(path.split("/")))
    what = f"array {path!r}"
    if check_metadata:
        _check_metadata_file(folder, shape, name, what, None)
    verifier = Verifier(checksum, what=what) if checksum is not None else None
    key = chunk_key(shape)
    if key is None:
        out = aligned_empty(shape, SUPPORTED_DTYPES[name])
        if verifier is not None:
            verifier.check()
        return out
    return _read_chunk_file(os.path.join(folder, key), shape, SUPPORTED_DTYPES[name], what, verifier, empty)


def write_chunks_local(
    root: PathLike,
    path: str,
    shape: Shape,
    dtype: DTypeLike,
    chunk_shape: Shape,
    chunks: Mapping[Sequence[int], Any],
    *,
    fsync: bool = False,
    write_metadata: bool = True,
    attributes: Mapping[str, Any] | None = None,
) -> None:
    """Writes some chunks of the chunked zarr v3 array ``path`` under the local folder ``root``.

    ``chunks`` maps a chunk index (``(i, j)``) to an array of exactly ``chunk_shape`` and
    ``dtype``; each is written to its own file ``c.i.j`` straight from its buffer, then
    ``zarr.json`` (unless ``write_metadata`` is false: another writer of the same array writes
    it), with the array's zarr ``attributes`` if given. Chunks not given are left as they are,
    so several writers can each write theirs.

    Raises:
      ValueError: a chunk shape that does not divide ``shape`` (no edge chunks), an index
        outside the grid, a chunk of the wrong shape or dtype.
      DiskFullError: as :func:`write_arrays_local`, after removing what this call created.
    """
    arr = ChunkedArray(shape, dtype, chunk_shape, chunks)
    write_arrays_local(
        root, {path: arr}, fsync=fsync, write_metadata=write_metadata, attributes=_one(path, attributes)
    )


def read_chunk_local(
    root: PathLike,
    path: str,
    shape: Shape,
    dtype: DTypeLike,
    chunk_shape: Shape,
    chunk_index: Sequence[int],
    *,
    check_metadata: bool = True,
) -> np.ndarray:
    """Reads chunk ``chunk_index`` of a chunked zarr v3 array from the local folder ``root``.

    The result is a fresh, writable, 64-byte aligned array of ``chunk_shape``. With
    ``check_metadata``, ``zarr.json`` must describe this shape, dtype and chunk shape.

    Raises:
      ValueError: a chunk shape that does not divide ``shape``, an index outside the grid.
      CorruptDataError: a missing or wrong-sized chunk file, missing or mismatching metadata;
        the message names the file.
    """
    _check_relpath(path)
    shape = tuple(int(d) for d in shape)
    name = zarr_dtype_name(numpy_dtype(dtype))
    cs = check_chunk_shape(shape, chunk_shape)
    idx = _check_chunk_index(chunk_index, chunk_grid(shape, cs), f"array {path!r}")
    folder = check_folders_local(root, path.split("/"))
    what = f"array {path!r}"
    if check_metadata:
        _check_metadata_file(folder, shape, name, what, cs)
    return _read_chunk_file(os.path.join(folder, chunk_index_key(idx)), cs, SUPPORTED_DTYPES[name], what)


def _check_metadata_file(
    folder: str, shape: tuple[int, ...], name: str, what: str, chunks: tuple[int, ...] | None
) -> None:
    meta_path = os.path.join(folder, _METADATA_KEY)
    raw = read_file_local(meta_path, max_bytes=_MAX_METADATA_BYTES, what=what)
    if raw is None:
        raise CorruptDataError(f"{what}: metadata file {meta_path} is missing")
    _check_zarr_metadata(raw, shape, name, f"{what} ({meta_path})", chunks)


def check_array_metadata_local(
    root: PathLike, path: str, shape: Shape, dtype: DTypeLike, chunk_shape: Shape | None = None
) -> None:
    """Checks that the ``zarr.json`` of the array ``path`` under the local folder ``root`` is a
    regular file describing ``shape``, ``dtype`` and ``chunk_shape`` (default: one chunk) in the
    raw layout: what plain ``zarr`` needs to read the array (the fast readers do not read it).

    Raises:
      CorruptDataError: it is missing, not a regular file, oversized, or describes another array.
    """
    _check_relpath(path)
    shape = tuple(int(d) for d in shape)
    name = zarr_dtype_name(numpy_dtype(dtype))
    cs = check_chunk_shape(shape, chunk_shape) if chunk_shape is not None else None
    folder = check_folders_local(root, path.split("/"))
    _check_metadata_file(folder, shape, name, f"array {path!r}", cs)


def _read_chunk_file(
    p: str,
    shape: tuple[int, ...],
    dtype: np.dtype,
    what: str,
    verifier: Verifier | None = None,
    empty: Callable[[Shape, np.dtype], np.ndarray] = aligned_empty,
) -> np.ndarray:
    """The chunk file ``p`` as a fresh aligned array of ``shape`` and ``dtype``: opened without
    following a link or blocking, and refused unless it is a regular file of exactly that many
    bytes, checked before anything is allocated (a manifest's shape is never trusted for that)."""
    expected = math.prod(shape) * dtype.itemsize
    try:
        fd = os.open(p, _READ_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        raise CorruptDataError(f"{what}: chunk file {p} is missing") from None
    except OSError as e:
        raise CorruptDataError(f"{what}: chunk file {_open_error(p, e, 'read')}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptDataError(f"{what}: chunk file {_not_regular(p, st, 'read')}")
        size = st.st_size
        if size != expected:
            kind = "truncated" if size < expected else "too long"
            raise CorruptDataError(
                f"{what}: chunk file {p} is {kind}: {size} bytes, expected {expected}"
            )
        out = empty(shape, dtype)
        _read_exact(fd, _byte_view(out), p, what, verifier)
        return out
    finally:
        os.close(fd)



def write_file_local(
    root: PathLike, path: str, parts: Sequence[memoryview | bytes], *, fsync: bool = False
) -> None:
    """Writes the file ``root/path`` (its folders made as needed, none through a link) from
    ``parts``, one after another, with ``writev``: a bundle (:mod:`serializers.bundle`) from its
    headers and its arrays' own buffers, with no copy. With ``fsync``, the file and each folder
    that gained an entry are synced before this returns. An existing file there is replaced
    (never written through a link, nor into bytes another hard link shares).

    Raises:
      ValueError: an unsafe ``path``.
      DiskFullError: on ``ENOSPC``/``EFBIG``/``EDQUOT``, after removing what this call created.
      CorruptDataError: a link, FIFO or folder where the file or a folder on its way should be.
    """
    _check_relpath(path)
    root = os.path.normpath(os.fspath(root))
    undo = _Undo(root)
    p = os.path.join(root, *path.split("/"))
    try:
        undo.makedirs(os.path.dirname(p))
        _write_file(p, parts, undo, fsync=fsync)
        if fsync:
            for folder in sorted(undo.dirty_dirs, key=len, reverse=True):
                fsync_folder_local(folder)
    except BaseException as e:
        undo.remove()
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS and not isinstance(e, DiskFullError):
            raise DiskFullError(e.errno, f"disk full while writing {path!r} under {root!r}: {e.strerror}", e.filename) from e
        raise


def read_file_exact_local(
    root: PathLike,
    path: str,
    nbytes: int,
    *,
    checksum: str | None = None,
    what: str | None = None,
    empty: Callable[[Shape, np.dtype], np.ndarray] = aligned_empty,
) -> np.ndarray:
    """The file ``root/path`` of exactly ``nbytes`` bytes (a bundle) as a fresh 64-byte aligned
    ``uint8`` array from ``empty``, read with as few calls as its size allows; with a
    ``checksum`` (of the whole file), verified piece by piece as it lands.

    Opened without following a link or blocking; refused unless it is a regular file of exactly
    ``nbytes`` bytes, checked before anything is allocated; no folder on the way is a link.

    Raises:
      CorruptDataError: missing, not a regular file, of another size, or not matching
        ``checksum``; the message names ``what`` (default: the path) and the file.
    """
    _check_relpath(path)
    *folders, name = path.split("/")
    p = os.path.join(check_folders_local(root, folders), name)  # the file: opened O_NOFOLLOW
    label = what or f"file {path!r}"
    verifier = Verifier(checksum, what=label) if checksum is not None else None
    return _read_chunk_file(p, (int(nbytes),), np.dtype(np.uint8), label, verifier, empty)
