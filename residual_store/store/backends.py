"""Storage backends of the disk tier: a local folder, or any tensorstore kvstore.

The disk tier needs a handful of operations (write and read arrays, put and get small objects
atomically, list, delete, rename); each backend implements them over its medium. A local folder
uses the serializers' fast path, atomic renames and fsync; any other kvstore (``memory``,
``file`` with options, ``gcs``, ``s3``) goes through tensorstore.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np
import tensorstore as ts

import serializers
from residual_store.errors import CorruptContextError, InvalidArgumentError, StoreUnavailableError
from serializers.local import (
    check_array_metadata_local,
    check_folders_local,
    fsync_folder_local,
    read_file_exact_local,
    read_file_local,
    sync_data,
)

__all__ = ["Backend", "DamagedFileError", "check_path", "open_backend"]

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class DamagedFileError(CorruptContextError, OSError):
    """An entry below a local store's root is not what the store puts there: a symbolic link, a
    FIFO, a device, a folder where a file belongs (or a file where a folder does), or a file
    larger than it can be. The store never follows such a link nor blocks on such a file: the
    read, write or removal that met it is refused, and nothing outside the root is touched.

    A :class:`~residual_store.errors.CorruptContextError` (the store is damaged), and an
    ``OSError`` so that a failed write cleans up as for any other I/O error."""


def _damaged(err: Exception) -> DamagedFileError:
    return DamagedFileError(str(err))


Empty = Callable[[tuple[int, ...], np.dtype], np.ndarray]
"""Gives the aligned buffer an array is read into (see :func:`serializers.read_arrays_local`)."""

_GC_LOCK = ".gc.lock"  # hidden: listings and the empty-folder check skip dot files


class Backend(Protocol):
    description: str

    can_rename: bool
    # each read waits on a request (an object store): reads go out together, whatever their size
    latency_bound: bool

    # values: NumPy arrays or serializers.ChunkedArray (a sharded residual, one chunk per shard)
    def write_arrays(
        self,
        arrays: Mapping[str, Any],
        *,
        fsync: bool,
        reuse: bool = False,
        write_metadata: bool = True,
        attributes: Mapping[str, Mapping[str, Any]] | None = None,
        files: Mapping[str, bytes] | None = None,  # small files written with the arrays
        keep_metadata: bool = False,  # with reuse: the arrays there have these attributes too
        sync_folders: Sequence[str] = (),  # with fsync: folders to sync with the rest
        temporaries: Mapping[str, bytes] | None = None,  # files the caller will publish
        fresh: bool = False,  # the paths are new (a write's own folder): nothing there to replace
    ) -> None: ...
    def rename(self, src: str, dst: str) -> bool: ...
    def write_shared_arrays(
        self, arrays: Mapping[str, Any], *, fsync: bool, write_metadata: bool = True
    ) -> None: ...
    # with a checksum, verified (serializers.CorruptDataError on a mismatch)
    # empty(shape, dtype): the aligned buffer to read into (None: a fresh one)
    def read_array(
        self, path: str, shape: tuple[int, ...], dtype: str, checksum: str | None = None, *, empty: Empty | None = None
    ) -> np.ndarray: ...
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
    def touch(self, prefix: str) -> bool: ...
    def sync_folder(self, prefix: str) -> None: ...  # a rename into it survives a power loss
    # where a write of ``key`` may stage its bytes first (None: no renames, put_bytes it)
    def temporary_for(self, key: str) -> str | None: ...
    def publish(self, temporary: str, key: str, *, fsync: bool) -> None: ...  # rename it into place


class _LocalBackend:
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
            raise _damaged(err) from None
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

    can_rename = True

    def write_arrays(
        self,
        arrays: Mapping[str, Any],
        *,
        fsync: bool,
        reuse: bool = False,
        write_metadata: bool = True,
        attributes: Mapping[str, Mapping[str, Any]] | None = None,
        files: Mapping[str, bytes] | None = None,
        keep_metadata: bool = False,
        sync_folders: Sequence[str] = (),
        temporaries: Mapping[str, bytes] | None = None,
        fresh: bool = False,  # a folder's replacement costs nothing extra here
    ) -> None:
        try:
            serializers.write_arrays_local(
                self.root, arrays, fsync=fsync, reuse=reuse, write_metadata=write_metadata,
                attributes=attributes, files=files, keep_metadata=keep_metadata, sync_folders=sync_folders,
                temporaries=temporaries,
            )
        except serializers.CorruptDataError as err:  # a link or a FIFO in the way: nothing written
            raise _damaged(err) from err

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

    def read_array(
        self, path: str, shape: tuple[int, ...], dtype: str, checksum: str | None = None, *, empty: Empty | None = None
    ) -> np.ndarray:
        # zarr.json is for other readers: the manifest gives shape and dtype, and the checksum
        # (verified while reading) and the chunk's size vouch for the data.
        return self.read_arrays([(path, shape, dtype, checksum)], empty=empty)[0]

    def read_arrays(
        self, arrays: Sequence[tuple[str, tuple[int, ...], str, str | None]], *, empty: Empty | None = None
    ) -> list[np.ndarray]:
        """``read_array`` of each ``(path, shape, dtype, checksum)``, in this thread, each folder
        on the way examined once."""
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
            raise _damaged(err) from None

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
            raise _damaged(err) from None

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


def _requests(method: Callable[..., Any]) -> Callable[..., Any]:
    """A :class:`_KvBackend` method whose requests to a store that does not answer, or that
    refuses them, raise :class:`StoreUnavailableError` (one line, saying what to do)."""

    @functools.wraps(method)
    def wrapper(self: _KvBackend, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except StoreUnavailableError:
            raise
        except Exception as err:  # noqa: BLE001 - tensorstore raises ValueError and others
            if not (serializers.is_unavailable(err) or (self.remote and _refused(err))):
                raise
            raise self.unavailable(err) from err

    return wrapper


def _refused(err: BaseException) -> bool:
    """A request the store refused (credentials or permissions): an answer, but no data."""
    return isinstance(err, PermissionError) or str(err).startswith(("PERMISSION_DENIED", "UNAUTHENTICATED"))


# tensorstore's context resource for the retries of each networked driver (all three take
# max_retries, initial_delay and max_delay)
_RETRY_RESOURCES = {"s3": "s3_request_retries", "gcs": "gcs_request_retries", "http": "http_request_retries"}
_LOCAL_DRIVERS = ("file", "memory")


def _with_timeout(spec: dict[str, Any], timeout: float | None) -> dict[str, Any]:
    """``spec`` whose retries fit in ``timeout`` seconds: tensorstore retries a failed request
    up to 32 times, waiting up to 32 s between tries (minutes before an unreachable store is
    reported); with a timeout, 3 tries, 1/10 then 1/5 of it apart, so a refused connection is
    reported well within it and no request goes on retrying after the store gave up on it. A
    spec that names its own retries keeps them."""
    name = _RETRY_RESOURCES.get(spec.get("driver"))  # type: ignore[arg-type]
    context = spec.get("context")
    if timeout is None or name is None or name in spec or (isinstance(context, Mapping) and name in context):
        return spec
    if context is not None and not isinstance(context, Mapping):
        return spec  # tensorstore says what is wrong with it
    retries = {"max_retries": 3, "initial_delay": f"{max(1, round(timeout * 100))}ms",
               "max_delay": f"{max(1, round(timeout * 250))}ms"}
    return {**spec, "context": {**(context or {}), name: retries}}


class _KvBackend:
    """Any tensorstore kvstore spec (``memory``, ``file`` with options, ``gcs``, ``s3``).

    With a ``timeout``, every request waits at most that many seconds and tensorstore's
    retries are fitted into it (:func:`_with_timeout`); a request that outlives it, or that
    the store refuses or gives up on, raises :class:`StoreUnavailableError`. A spec tensorstore
    refuses raises :class:`InvalidArgumentError`."""

    def __init__(self, spec: Mapping[str, Any], timeout: float | None = None) -> None:
        self.description = repr(dict(spec))
        self.timeout = timeout
        self.remote = spec.get("driver") not in _LOCAL_DRIVERS
        self.spec = _with_timeout(_with_quiet_credentials(dict(spec)), timeout)
        self.context = serializers.default_context()
        try:
            opened = ts.KvStore.open(self._with_slash(self.spec), context=self.context)
            self.kv = serializers.wait_request(opened, timeout, "opening the kvstore")
        except Exception as err:  # noqa: BLE001 - tensorstore raises ValueError and others
            if serializers.is_unavailable(err):
                raise self.unavailable(err) from err
            message = str(err).split(" [tensorstore_spec=", 1)[0].strip().splitlines()
            raise InvalidArgumentError(
                f"tensorstore refuses the kvstore spec {self.description}: "
                f"{message[0] if message else type(err).__name__}; see "
                "https://google.github.io/tensorstore/kvstore/index.html for the drivers and their options"
            ) from None

    def unavailable(self, err: BaseException) -> StoreUnavailableError:
        """The :class:`StoreUnavailableError` of a request that met ``err``."""
        text = err.strerror if isinstance(err, OSError) and isinstance(err.strerror, str) else str(err)
        why = (text.strip().splitlines() or [type(err).__name__])[0]
        limit = (f"within the timeout of {self.timeout:g} s" if self.timeout is not None
                 else "(no timeout: give rs.Store(..., timeout=SECONDS) to bound each request)")
        return StoreUnavailableError(
            f"{self.description}: the object store did not answer {limit}, or refused the "
            f"request: {why}. Check the endpoint, the network and the credentials, or give a "
            "longer timeout"
        )

    @staticmethod
    def _with_slash(spec: dict[str, Any]) -> dict[str, Any]:
        path = spec.get("path", "")
        if path and not path.endswith("/"):
            spec = {**spec, "path": path + "/"}
        return spec

    can_rename = False
    latency_bound = True

    @_requests
    def write_arrays(
        self,
        arrays: Mapping[str, Any],
        *,
        fsync: bool,
        reuse: bool = False,
        write_metadata: bool = True,
        attributes: Mapping[str, Mapping[str, Any]] | None = None,
        files: Mapping[str, bytes] | None = None,
        keep_metadata: bool = False,
        sync_folders: Sequence[str] = (),
        temporaries: Mapping[str, bytes] | None = None,
        fresh: bool = False,
    ) -> None:
        """Chunks first and ``zarr.json`` last, so :meth:`array_exists` means complete; with
        ``write_metadata=False`` the ``zarr.json`` of chunked arrays is left to another writer;
        with ``fresh``, no listing to clear the paths first."""
        serializers.write_arrays_kv(
            self.spec, arrays, context=self.context, write_metadata=write_metadata, attributes=attributes,
            fresh=fresh, timeout=self.timeout,
        )
        for key, data in (files or {}).items():  # a bundle's parts go out as one object
            self.put_bytes(key, data if isinstance(data, bytes) else b"".join(data), fsync=fsync)

    def rename(self, src: str, dst: str) -> bool:
        return False  # kvstores have no atomic rename of a prefix

    @_requests
    def write_shared_arrays(
        self, arrays: Mapping[str, Any], *, fsync: bool, write_metadata: bool = True
    ) -> None:
        """Content-addressed arrays written in place (no rename on kvstores): every writer puts
        the same bytes, ``zarr.json`` last, and nothing is deleted, not even on failure, so a
        writer cannot tear an array another one completed. ``write_metadata=False``: each of
        several writers puts its chunks, and one puts the ``zarr.json`` after all are done."""
        serializers.write_arrays_kv(
            self.spec, arrays, context=self.context, write_metadata=write_metadata, content_addressed=True,
            timeout=self.timeout,
        )

    @_requests
    def read_array(
        self, path: str, shape: tuple[int, ...], dtype: str, checksum: str | None = None, *, empty: Empty | None = None
    ) -> np.ndarray:
        # one request for the chunk object: zarr.json is for other readers (see check_metadata)
        x = serializers.read_raw(
            self.kv, path, shape, dtype, empty=empty or serializers.aligned_empty, timeout=self.timeout
        )
        if checksum is not None:
            serializers.verify(x, checksum, what=f"array {path!r}")
        return x

    def read_arrays(
        self, arrays: Sequence[tuple[str, tuple[int, ...], str, str | None]], *, empty: Empty | None = None
    ) -> list[np.ndarray]:
        return [self.read_array(*a, empty=empty) for a in arrays]

    @_requests
    def read_chunk(
        self, path: str, shape: tuple[int, ...], dtype: str, chunk_shape: tuple[int, ...], index: tuple[int, ...]
    ) -> np.ndarray:
        return serializers.read_raw(
            self.kv, path, shape, dtype, chunk_shape=chunk_shape, chunk_index=index, timeout=self.timeout
        )

    @_requests
    def read_file(
        self, key: str, nbytes: int, *, checksum: str | None = None, empty: Empty | None = None
    ) -> np.ndarray:
        """The object ``key`` of exactly ``nbytes`` bytes (one request), verified against its
        ``checksum``."""
        result = self._wait(self.kv.read(key), f"reading {key}")
        what = f"file {key!r}"
        if result.state != "value":
            raise serializers.CorruptDataError(f"{what} is missing")
        if len(result.value) != nbytes:
            kind = "truncated" if len(result.value) < nbytes else "too long"
            raise serializers.CorruptDataError(f"{what} is {kind}: {len(result.value)} bytes, expected {nbytes}")
        out = (empty or serializers.aligned_empty)((nbytes,), np.dtype(np.uint8))
        out[:] = np.frombuffer(result.value, dtype=np.uint8)
        if checksum is not None:
            serializers.verify(out, checksum, what=what)
        return out

    @_requests
    def check_metadata(
        self, path: str, shape: tuple[int, ...], dtype: str, chunk_shape: tuple[int, ...] | None = None
    ) -> None:
        """Checks the array's ``zarr.json`` (which the store's own reads skip, but plain ``zarr``
        needs): :class:`DamagedFileError` if it is missing or wrong."""
        try:
            serializers.check_array_metadata(self.kv, path, shape, dtype, chunk_shape, timeout=self.timeout)
        except (serializers.CorruptDataError, serializers.UnsupportedDTypeError, ValueError) as err:
            raise _damaged(err) from None

    def array_exists(self, path: str) -> bool:
        return self.get_bytes(f"{path}/zarr.json") is not None

    @_requests
    def put_bytes(self, key: str, data: bytes, *, fsync: bool) -> None:
        self._wait(self.kv.write(key, data), f"writing {key}")

    def _wait(self, future: Any, what: str) -> Any:
        return serializers.wait_request(future, self.timeout, what)

    @_requests
    def get_bytes(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        result = self._wait(self.kv.read(key), f"reading {key}")
        if result.state != "value":
            return None
        limit = serializers.MAX_MANIFEST_BYTES if max_bytes is None else max_bytes
        if len(result.value) > limit:
            raise CorruptContextError(
                f"{self.description}: {key} is {len(result.value):,} bytes, over the {limit:,} allowed"
            )
        return bytes(result.value)

    @_requests
    def list_dir(self, prefix: str) -> list[str]:
        prefix = prefix.rstrip("/") + "/"
        end = prefix[:-1] + chr(ord("/") + 1)
        keys = self._wait(self.kv.list(ts.KvStore.KeyRange(prefix, end)), f"listing {prefix}")
        names = {k.decode()[len(prefix) :].split("/", 1)[0] for k in keys}
        return sorted(n for n in names if n and not n.startswith("."))

    @_requests
    def delete(self, key: str) -> None:
        self._wait(self.kv.delete_range(ts.KvStore.KeyRange(key, key + "\x00")), f"deleting {key}")

    @_requests
    def delete_tree(self, prefix: str) -> None:
        serializers.delete_prefix(self.spec, prefix.rstrip("/"), context=self.context, timeout=self.timeout)

    def age_seconds(self, prefix: str) -> float | None:
        return None  # kvstores have no portable mtime: gc only removes with older_than=0

    def tree_bytes(self, prefix: str) -> int | None:
        return None  # listing a kvstore gives keys, not sizes: unknown without reading everything

    def exists(self, key: str) -> bool:
        return self.get_bytes(key) is not None

    def is_file(self) -> bool:
        return False

    def root_exists(self) -> bool:
        return True  # a kvstore prefix exists as soon as anything is under it

    @_requests
    def is_empty(self) -> bool:
        prefix = ts.KvStore.KeyRange("", "")
        return not self._wait(self.kv.list(prefix), "listing the store")

    def list_temporary(self, prefix: str) -> list[str]:
        return []  # every object is written in one put: nothing temporary is left behind

    def version(self, key: str) -> Any | None:
        return None  # no cheap version: manifests are read each time

    def gc_lock(self, *, exclusive: bool) -> AbstractContextManager[None]:
        return contextlib.nullcontext()  # no cross-process lock: gc needs older_than=0 (see age_seconds)

    def touch(self, prefix: str) -> bool:
        return True  # nothing to refresh: gc on a kvstore has no age rule

    def sync_folder(self, prefix: str) -> None:
        pass  # no renames on kvstores

    def temporary_for(self, key: str) -> None:
        return None  # no renames: a single-object put is atomic

    def publish(self, temporary: str, key: str, *, fsync: bool) -> None:
        raise NotImplementedError("kvstores have no renames; put_bytes instead")


_ENVIRONMENT_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


def _with_quiet_credentials(spec: dict[str, Any]) -> dict[str, Any]:
    """An ``s3`` spec that names no credentials, opened where the environment holds them: the
    same credentials (the AWS default chain reads the environment first) through tensorstore's
    ``environment`` provider, so the SDK does not also look for ``~/.aws/config`` and print an
    error line for each file it cannot open. Any other spec as it is."""
    named = "aws_credentials" in spec or "aws_credentials" in (spec.get("context") or {})
    if spec.get("driver") != "s3" or named or not all(os.environ.get(k) for k in _ENVIRONMENT_CREDENTIALS):
        return spec
    return {**spec, "aws_credentials": {"type": "environment"}}


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def check_path(path: Any) -> None:
    """Raises :class:`InvalidArgumentError` unless ``path`` is one a store takes: a folder (a
    non-empty ``str`` or ``os.PathLike``), a kvstore spec (a mapping) or ``None``."""
    if path is None or isinstance(path, Mapping):
        return
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentError(
            f"Store path must be a folder (str or os.PathLike), a tensorstore kvstore spec (dict) or "
            f"None for memory only, got {type(path).__name__}: {path!r}"
        )
    if isinstance(os.fspath(path), bytes):
        raise InvalidArgumentError(f"Store path must be a str path, not bytes: {path!r}")
    if not os.fspath(path):
        raise InvalidArgumentError("Store path is empty: give a folder, or None for memory only")


def open_backend(path: str | os.PathLike[str] | Mapping[str, Any], *, timeout: float | None = None) -> Backend:
    """A backend for a folder path or a tensorstore kvstore spec; ``timeout``: seconds each
    request to an object store may take (a local folder has no requests to bound)."""
    if isinstance(path, Mapping):
        root = serializers.local_root(path)
        return _LocalBackend(root) if root is not None else _KvBackend(path, timeout)
    return _LocalBackend(os.fspath(path))

