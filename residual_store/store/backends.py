"""Storage backends of the disk tier: a local folder, or any tensorstore kvstore.

The disk tier needs a handful of operations (write and read arrays, put and get small objects
atomically, list, delete, rename); each backend implements them over its medium. A local folder
uses the serializers' fast path, atomic renames and fsync; any other kvstore (``memory``,
``file`` with options, ``gcs``, ``s3``) goes through tensorstore.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
import uuid
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import tensorstore as ts

import serializers

__all__ = ["Backend", "open_backend"]



class Backend(Protocol):
    description: str

    can_rename: bool

    # values: NumPy arrays or serializers.ChunkedArray (a sharded residual, one chunk per shard)
    def write_arrays(
        self, arrays: Mapping[str, Any], *, fsync: bool, reuse: bool = False, write_metadata: bool = True
    ) -> None: ...
    def rename(self, src: str, dst: str) -> bool: ...
    def write_shared_arrays(
        self, arrays: Mapping[str, Any], *, fsync: bool, write_metadata: bool = True
    ) -> None: ...
    def read_array(self, path: str, shape: tuple[int, ...], dtype: str) -> np.ndarray: ...
    def read_chunk(
        self, path: str, shape: tuple[int, ...], dtype: str, chunk_shape: tuple[int, ...], index: tuple[int, ...]
    ) -> np.ndarray: ...
    def array_exists(self, path: str) -> bool: ...
    def put_bytes(self, key: str, data: bytes, *, fsync: bool) -> None: ...
    def get_bytes(self, key: str) -> bytes | None: ...
    def list_dir(self, prefix: str) -> list[str]: ...
    def delete(self, key: str) -> None: ...
    def delete_tree(self, prefix: str) -> None: ...
    def age_seconds(self, prefix: str) -> float | None: ...
    def version(self, key: str) -> Any | None: ...
    def exists(self, key: str) -> bool: ...
    def is_file(self) -> bool: ...
    def root_exists(self) -> bool: ...
    def is_empty(self) -> bool: ...
    def list_temporary(self, prefix: str) -> list[str]: ...


class _LocalBackend:
    """A local folder: the serializers' fast path, atomic renames, fsync."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.description = self.root  # nothing is created until something is written

    def _path(self, key: str) -> str:
        path = os.path.normpath(os.path.join(self.root, *key.split("/")))
        if path != self.root and not path.startswith(self.root + os.sep):
            raise ValueError(f"refusing a path outside the store: {key!r}")
        return path

    can_rename = True

    def write_arrays(
        self, arrays: Mapping[str, Any], *, fsync: bool, reuse: bool = False, write_metadata: bool = True
    ) -> None:
        serializers.write_arrays_local(self.root, arrays, fsync=fsync, reuse=reuse, write_metadata=write_metadata)

    def rename(self, src: str, dst: str) -> bool:
        try:
            os.makedirs(os.path.dirname(self._path(dst)), exist_ok=True)
            os.rename(self._path(src), self._path(dst))
            return True
        except OSError:
            return False

    def write_shared_arrays(
        self, arrays: Mapping[str, Any], *, fsync: bool, write_metadata: bool = True
    ) -> None:
        """Content-addressed arrays that committed contexts of other writers may already hold:
        each is written under a temporary name and renamed into place, never rewritten in place,
        so a concurrent or failing writer cannot tear one that is already there. Partial arrays
        (``write_metadata=False``) go to a temporary folder through :meth:`write_arrays` here."""
        if not arrays:
            return
        if not write_metadata:
            raise ValueError("a local folder renames whole shared arrays into place")
        temps = {f"{path}.{uuid.uuid4().hex[:12]}.tmp": path for path in arrays}
        serializers.write_arrays_local(self.root, {t: arrays[p] for t, p in temps.items()}, fsync=fsync)
        for temp, path in temps.items():
            try:
                os.rename(self._path(temp), self._path(path))
            except OSError as err:
                if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    for t in temps:
                        shutil.rmtree(self._path(t), ignore_errors=True)
                    raise
                if not self.array_exists(path):  # a torn leftover, not a committed array
                    shutil.rmtree(self._path(path), ignore_errors=True)
                    try:
                        os.rename(self._path(temp), self._path(path))
                        continue
                    except OSError:
                        pass
                shutil.rmtree(self._path(temp), ignore_errors=True)  # the same bytes are there
        if fsync:
            for folder in {os.path.dirname(self._path(p)) for p in arrays}:
                _fsync_dir(folder)

    def read_array(self, path: str, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        # zarr.json is for other readers: the manifest gives shape and dtype, and the checksum
        # (verified by the caller) and the chunk's size vouch for the data.
        return serializers.read_array_local(self.root, path, shape, dtype, check_metadata=False)

    def read_chunk(
        self, path: str, shape: tuple[int, ...], dtype: str, chunk_shape: tuple[int, ...], index: tuple[int, ...]
    ) -> np.ndarray:
        return serializers.read_chunk_local(
            self.root, path, shape, dtype, chunk_shape, index, check_metadata=False
        )

    def array_exists(self, path: str) -> bool:
        return os.path.exists(os.path.join(self._path(path), "zarr.json"))

    def put_bytes(self, key: str, data: bytes, *, fsync: bool) -> None:
        final = self._path(key)
        folder = os.path.dirname(final)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{os.path.basename(final)}.{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            _remove_quietly(tmp)
            raise
        if fsync:
            _fsync_dir(folder)

    def get_bytes(self, key: str) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def exists(self, key: str) -> bool:
        return os.path.exists(self._path(key))

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
        try:
            return sorted(n for n in os.listdir(self._path(prefix)) if not n.startswith("."))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def list_temporary(self, prefix: str) -> list[str]:
        """Temporary files of :meth:`put_bytes` (``.<name>.<id>.tmp``) left by interrupted writes."""
        try:
            names = os.listdir(self._path(prefix)) if prefix else os.listdir(self.root)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(n for n in names if n.startswith(".") and n.endswith(".tmp"))

    def delete(self, key: str) -> None:
        _remove_quietly(self._path(key))

    def delete_tree(self, prefix: str) -> None:
        shutil.rmtree(self._path(prefix), ignore_errors=True)

    def age_seconds(self, prefix: str) -> float | None:
        try:
            return time.time() - os.stat(self._path(prefix)).st_mtime
        except FileNotFoundError:
            return None

    def version(self, key: str) -> Any | None:
        try:
            st = os.stat(self._path(key))
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)


class _KvBackend:
    """Any tensorstore kvstore spec (``memory``, ``file`` with options, ``gcs``, ``s3``)."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        self.spec = dict(spec)
        self.description = repr(self.spec)
        self.context = serializers.default_context()
        self.kv = ts.KvStore.open(self._with_slash(self.spec), context=self.context).result()

    @staticmethod
    def _with_slash(spec: dict[str, Any]) -> dict[str, Any]:
        path = spec.get("path", "")
        if path and not path.endswith("/"):
            spec = {**spec, "path": path + "/"}
        return spec

    can_rename = False

    def write_arrays(
        self, arrays: Mapping[str, Any], *, fsync: bool, reuse: bool = False, write_metadata: bool = True
    ) -> None:
        """Chunks first and ``zarr.json`` last, so :meth:`array_exists` means complete; with
        ``write_metadata=False`` the ``zarr.json`` of chunked arrays is left to another writer."""
        serializers.write_arrays_kv(
            self.spec, arrays, context=self.context, write_metadata=write_metadata
        )

    def rename(self, src: str, dst: str) -> bool:
        return False  # kvstores have no atomic rename of a prefix

    def write_shared_arrays(
        self, arrays: Mapping[str, Any], *, fsync: bool, write_metadata: bool = True
    ) -> None:
        """Content-addressed arrays written in place (no rename on kvstores): every writer puts
        the same bytes, ``zarr.json`` last, and nothing is deleted, not even on failure, so a
        writer cannot tear an array another one completed. ``write_metadata=False``: each of
        several writers puts its chunks, and one puts the ``zarr.json`` after all are done."""
        serializers.write_arrays_kv(
            self.spec, arrays, context=self.context, write_metadata=write_metadata, content_addressed=True
        )

    def read_array(self, path: str, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.asarray(serializers.read_array(self.spec, path, shape, dtype, context=self.context))

    def read_chunk(
        self, path: str, shape: tuple[int, ...], dtype: str, chunk_shape: tuple[int, ...], index: tuple[int, ...]
    ) -> np.ndarray:
        return serializers.read_chunk(
            self.spec, path, shape, dtype, chunk_shape, index, context=self.context
        )

    def array_exists(self, path: str) -> bool:
        return self.get_bytes(f"{path}/zarr.json") is not None

    def put_bytes(self, key: str, data: bytes, *, fsync: bool) -> None:
        self.kv.write(key, data).result()

    def get_bytes(self, key: str) -> bytes | None:
        result = self.kv.read(key).result()
        return bytes(result.value) if result.state == "value" else None

    def list_dir(self, prefix: str) -> list[str]:
        prefix = prefix.rstrip("/") + "/"
        end = prefix[:-1] + chr(ord("/") + 1)
        keys = self.kv.list(ts.KvStore.KeyRange(prefix, end)).result()
        names = {k.decode()[len(prefix) :].split("/", 1)[0] for k in keys}
        return sorted(n for n in names if n and not n.startswith("."))

    def delete(self, key: str) -> None:
        self.kv.delete_range(ts.KvStore.KeyRange(key, key + "\x00")).result()

    def delete_tree(self, prefix: str) -> None:
        serializers.delete_prefix(self.spec, prefix.rstrip("/"), context=self.context)

    def age_seconds(self, prefix: str) -> float | None:
        return None  # kvstores have no portable mtime: gc only removes with older_than=0

    def exists(self, key: str) -> bool:
        return self.get_bytes(key) is not None

    def is_file(self) -> bool:
        return False

    def root_exists(self) -> bool:
        return True  # a kvstore prefix exists as soon as anything is under it

    def is_empty(self) -> bool:
        prefix = ts.KvStore.KeyRange("", "")
        return not self.kv.list(prefix).result()

    def list_temporary(self, prefix: str) -> list[str]:
        return []  # every object is written in one put: nothing temporary is left behind

    def version(self, key: str) -> Any | None:
        return None  # no cheap version: manifests are read each time


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_backend(path: str | os.PathLike[str] | Mapping[str, Any]) -> Backend:
    """A backend for a folder path or a tensorstore kvstore spec."""
    if isinstance(path, Mapping):
        root = serializers.local_root(path)
        return _LocalBackend(root) if root is not None else _KvBackend(path)
    return _LocalBackend(os.fspath(path))

