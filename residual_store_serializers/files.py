"""Local files a store reads and writes safely: no link followed, nothing outside the root.

Every primitive of the local fast path that touches a file or a folder, and nothing about
arrays: :func:`read_file_local` and :func:`read_file_exact_local` (a small file, or one of an
exact size, read with a bound), :func:`write_file` and :func:`overwrite_file_in_place` (one
file, written from buffers with ``writev``), :class:`Undo` (what one write created, removed
when it fails), :class:`Folders` (the folders below a root, each checked once), and the
``fsync`` helpers. :mod:`serializers.local` builds zarr arrays on them; the store's backends
use them for manifests, markers and bundles.

Why one module: the rules below hold for every file the library touches, so they are written
once, here.
"""

from __future__ import annotations

import errno
import math
import os
import stat
import threading
from collections.abc import Callable, Sequence
from typing import Final

import numpy as np

from .aligned import aligned_empty
from .checksums import Verifier
from .errors import DISK_FULL_ERRNOS, CorruptDataError, raise_if_disk_full
from .zarr import PathLike, Shape, byte_view, check_relpath

__all__ = [
    "Folders",
    "Undo",
    "check_folders_local",
    "fsync_file",
    "fsync_folder_local",
    "is_regular",
    "overwrite_file_in_place",
    "read_file_exact_local",
    "read_file_local",
    "read_sized_file",
    "sync_data",
    "write_file",
    "write_file_local",
]

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


def is_regular(p: str) -> bool:
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
    return Folders(root).path(tuple(parts))


class Folders:
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


class Undo:
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

    def dirty_folders(self) -> list[str]:
        """The folders whose entries this write changed, deepest first: each is synced before
        the folder that holds it."""
        return sorted(self.dirty_dirs, key=len, reverse=True)

    def fail(self, err: BaseException, writing: str) -> None:
        """Removes what this write created after it failed with ``err``; a full disk is raised
        as :class:`~serializers.errors.DiskFullError` naming ``writing`` (else this returns and
        the caller re-raises ``err``)."""
        self.remove()
        raise_if_disk_full(err, writing)

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
def sync_data(fd: int) -> None:
    """Makes a file's bytes (and the metadata needed to read them back, such as its size)
    survive a power loss: ``fdatasync`` where the platform has it, which skips flushing
    timestamps (for a file overwritten in place, no journal commit), else ``fsync``."""
    (getattr(os, "fdatasync", None) or os.fsync)(fd)


def fsync_file(p: str) -> None:
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
def write_file(
    p: str,
    data: memoryview | Sequence[memoryview | bytes],
    undo: Undo,
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
        _write_and_sync(fd, parts, p, undo, fsync=fsync)
    finally:
        os.close(fd)


def _write_and_sync(fd: int, parts: list[memoryview], p: str, undo: Undo, *, fsync: bool) -> None:
    """Writes ``parts`` to ``fd`` (the file ``p``); with ``fsync``, syncs it on this descriptor
    and records that in ``undo`` (no second sync of it by path)."""
    _write_all(fd, parts, p)
    if fsync:
        sync_data(fd)
        undo.add_synced(p)


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


def overwrite_file_in_place(
    chunk: str, data: memoryview | Sequence[memoryview | bytes], undo: Undo, *, fsync: bool
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
        _write_and_sync(fd, parts, chunk, undo, fsync=fsync)
    finally:
        os.close(fd)
    return True


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


def read_sized_file(
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
        _read_exact(fd, byte_view(out), p, what, verifier)
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
    check_relpath(path)
    root = os.path.normpath(os.fspath(root))
    undo = Undo(root)
    p = os.path.join(root, *path.split("/"))
    try:
        undo.makedirs(os.path.dirname(p))
        write_file(p, parts, undo, fsync=fsync)
        if fsync:
            for folder in undo.dirty_folders():
                fsync_folder_local(folder)
    except BaseException as e:
        undo.fail(e, f"{path!r} under {root!r}")
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
    check_relpath(path)
    *folders, name = path.split("/")
    p = os.path.join(check_folders_local(root, folders), name)  # the file: opened O_NOFOLLOW
    label = what or f"file {path!r}"
    verifier = Verifier(checksum, what=label) if checksum is not None else None
    return read_sized_file(p, (int(nbytes),), np.dtype(np.uint8), label, verifier, empty)
