"""zarr v3 arrays through tensorstore: any kvstore (``file``, ``memory``, cloud drivers).

Two writers, one set of readers, all of the bytes of :mod:`serializers.zarr`:

* The zarr3 driver path (:func:`write_arrays`, :func:`read_array` and their
  ``_async`` / batch forms) opens each array through tensorstore's ``zarr3``
  driver. It writes chunks equal to the fill value too
  (``store_data_equal_to_fill_value``) and reads with ``fill_missing_data_reads``
  off, so a missing chunk is an error, never zeros. Its one-array and
  chunk-by-chunk writers, which no library code calls, live in the tests
  (``tests/zarr3_reference.py``) as the interoperability reference.
* The raw kvstore path (:func:`write_arrays_kv`) writes the bytes of the local
  fast path (:mod:`serializers.local`) through any kvstore, one key put per chunk,
  every chunk before any ``zarr.json``: an array whose ``zarr.json`` exists has all
  the chunks of that write (the zarr3 driver writes ``zarr.json`` first, when it
  creates the array).

Chunked arrays (:class:`~serializers.zarr.ChunkedArray`) are written chunk by chunk,
possibly by several writers that each hold some chunks, and read chunk by chunk
(:func:`read_chunk`). A ``memory`` kvstore lives in a tensorstore
:class:`~tensorstore.Context`: pass the same ``context`` to write and read, or rely on
:func:`default_context`, one context shared per process.

Errors: a missing, truncated or oversized chunk, missing or mismatching metadata ->
:class:`~serializers.errors.CorruptDataError`. ``ENOSPC``/``EFBIG``/``EDQUOT`` while
writing -> :class:`~serializers.errors.DiskFullError`, after removing what that write
had created. A store that does not answer (a request that outlives the ``timeout`` of the
functions that take one, or tensorstore giving up after its retries: ``ABORTED``,
``UNAVAILABLE``, ``DEADLINE_EXCEEDED``) -> :class:`~serializers.errors.UnavailableError`
(the mapping is :mod:`serializers.kv_errors`; the chaining of tensorstore futures,
:mod:`serializers.kv_futures`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from .aligned import aligned_empty
from .errors import DISK_FULL_ERRNOS, CorruptDataError, DiskFullError
from .kv_errors import (
    convert_read_error,
    convert_write_error,
    is_unavailable,
    ts_errno,
    wait_request,
)
from .kv_futures import all_done, raise_error, then
from .zarr import (
    MAX_METADATA_BYTES,
    METADATA_KEY,
    ArrayRead,
    ChunkedArray,
    DTypeLike,
    PathLike,
    Shape,
    byte_view,
    check_attributes,
    check_relpath,
    check_zarr_metadata,
    chunk_index_key,
    chunk_region,
    describe_arrays,
    disk_array,
    disk_chunks,
    disk_metadata,
    zarr_dtype_name,
    zarr_metadata,
)

__all__ = [
    "KvStoreSpec",
    "default_context",
    "local_root",
    "is_unavailable",
    "wait_request",
    "write_array_async",
    "write_arrays",
    "write_arrays_kv",
    "read_array",
    "read_array_async",
    "read_arrays",
    "read_chunk",
    "read_chunk_async",
    "read_raw",
    "check_array_metadata",
    "delete_prefix",
]

KvStoreSpec = Mapping[str, Any]
"""A tensorstore kvstore spec, e.g. ``{"driver": "file", "path": "/data/store"}``."""

_default_context: ts.Context | None = None
_default_context_lock = threading.Lock()


def default_context() -> ts.Context:
    """The tensorstore context used when none is passed, one per process.

    Shared so that a ``memory`` kvstore written by one call is readable by the
    next; tensorstore's default ``file_io_sync`` (fsync on write) applies.
    """
    global _default_context
    with _default_context_lock:
        if _default_context is None:
            _default_context = ts.Context()
        return _default_context


def local_root(kvstore: KvStoreSpec | PathLike) -> str | None:
    """The folder of a plain local ``file`` kvstore (or a path), else ``None``.

    A caller uses it to decide whether the fast path applies: only for a spec with
    nothing but ``driver: "file"`` and ``path``.
    """
    if isinstance(kvstore, (str, os.PathLike)):
        return os.fspath(kvstore)
    if (
        isinstance(kvstore, Mapping)
        and kvstore.get("driver") == "file"
        and set(kvstore) <= {"driver", "path"}
    ):
        path = kvstore.get("path")
        if isinstance(path, str) and path:
            return path
    return None


def _kv_root(kvstore: KvStoreSpec) -> dict[str, Any]:
    """``kvstore`` with its path ending in ``/`` (or empty), so that keys append as names."""
    spec = dict(kvstore)
    base = spec.get("path", "")
    if not isinstance(base, str):
        raise ValueError(f"kvstore path must be a str, got {base!r}")
    spec["path"] = base if not base or base.endswith("/") else base + "/"
    return spec


def _array_kvstore(kvstore: KvStoreSpec, path: str) -> dict[str, Any]:
    """The kvstore spec of the array folder ``path`` under ``kvstore``."""
    check_relpath(path)
    spec = _kv_root(kvstore)
    spec["path"] = f"{spec['path']}{path}/"
    return spec


def _ts_spec(
    kv: dict[str, Any],
    shape: tuple[int, ...],
    name: str,
    *,
    write: bool,
    chunks: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"driver": "zarr3", "kvstore": kv}
    if write:
        spec["metadata"] = zarr_metadata(shape, name, chunks)
        spec["store_data_equal_to_fill_value"] = True
    else:
        spec["metadata"] = {"shape": list(shape), "data_type": name}
        if chunks is not None:  # also a constraint: the array must have this chunk grid
            spec["metadata"]["chunk_grid"] = {
                "name": "regular",
                "configuration": {"chunk_shape": list(chunks)},
            }
        spec["fill_missing_data_reads"] = False
    return spec


def _delete_array_async(kv: dict[str, Any], context: ts.Context) -> ts.Future:
    """Removes every key under the array folder ``kv`` (and, locally, its empty folders)."""
    opened = ts.KvStore.open(kv, context=context)
    deleted = then(opened, lambda store: store.delete_range(ts.KvStore.KeyRange()))
    return then(deleted, lambda _: _prune_empty_dirs(_file_folder(kv)))


def delete_prefix(
    kvstore: KvStoreSpec, prefix: str, *, context: ts.Context | None = None, timeout: float | None = None
) -> None:
    """Removes every key under the folder ``prefix`` of ``kvstore`` and waits (at most
    ``timeout`` seconds: :class:`UnavailableError`); with the ``file`` driver, also the folders
    it leaves empty (it deletes files, not folders)."""
    ctx = context if context is not None else default_context()
    wait_request(_delete_array_async(_array_kvstore(kvstore, prefix), ctx), timeout, f"deleting {prefix!r}")


def _file_folder(kv: Mapping[str, Any]) -> str | None:
    """The local folder of a ``file`` kvstore spec (with or without options), else ``None``:
    the file driver deletes keys but leaves their folders."""
    path = kv.get("path")
    return path if kv.get("driver") == "file" and isinstance(path, str) and path else None


def _prune_empty_dirs(folder: str | None) -> None:
    if not folder or not os.path.isdir(folder):
        return
    for dirpath, _, _ in os.walk(folder, topdown=False):
        try:
            os.rmdir(dirpath)
        except OSError:
            pass


def write_array_async(
    kvstore: KvStoreSpec,
    path: str,
    arr: Any,
    *,
    context: ts.Context | None = None,
) -> ts.Future:
    """Starts writing ``arr`` as the zarr v3 array ``path`` under ``kvstore``.

    Any existing array at ``path`` is replaced. ``arr`` must not be modified until
    the returned future is done. The future's result is ``None``; on failure it
    raises :class:`DiskFullError` (after deleting what was written) or
    tensorstore's error.
    """
    a = disk_array(arr)
    name = zarr_dtype_name(a.dtype)
    kv = _array_kvstore(kvstore, path)
    ctx = context if context is not None else default_context()
    what = f"array {path!r}"
    opened = ts.open(
        _ts_spec(kv, a.shape, name, write=True), create=True, delete_existing=True, context=ctx
    )
    written = then(opened, lambda store: store.write(a))

    def on_error(e: BaseException) -> Any:
        err = convert_write_error(e, what)
        return then(_delete_array_async(kv, ctx), lambda _: raise_error(err), lambda _: raise_error(err))

    return then(written, lambda _: None, on_error)


def _wait_all(
    futures: Mapping[str, ts.Future], timeout: float | None = None
) -> tuple[dict[str, Any], list[BaseException]]:
    """Every future's result or error, each waited for at most ``timeout`` seconds (the
    requests run at once: a store that does not answer costs about one ``timeout``)."""
    results: dict[str, Any] = {}
    errors: list[BaseException] = []
    for key, f in futures.items():
        try:
            results[key] = wait_request(f, timeout, repr(key))
        except Exception as e:  # noqa: BLE001 - collected, re-raised below
            errors.append(e)
    return results, errors


def write_arrays(
    kvstore: KvStoreSpec,
    arrays: Mapping[str, Any],
    *,
    context: ts.Context | None = None,
) -> None:
    """Writes many arrays concurrently (``{path: array}``) and waits for all.

    A value may be a :class:`ChunkedArray`: its chunks are written into the array (created if
    missing) and the array's other chunks are left alone.
    If any write fails, every array of the batch is deleted again, and the first
    :class:`DiskFullError` (else the first error) is raised.
    """
    ctx = context if context is not None else default_context()
    for p, a in arrays.items():  # refuse a bad path or dtype before starting any write
        check_relpath(p)
        zarr_dtype_name(a.dtype if isinstance(a, ChunkedArray) else np.asarray(a).dtype)
    futures = {
        p: (
            _write_chunked_async(kvstore, p, a, context=ctx)
            if isinstance(a, ChunkedArray)
            else write_array_async(kvstore, p, a, context=ctx)
        )
        for p, a in arrays.items()
    }
    _, errors = _wait_all(futures)
    if errors:
        for p in arrays:
            try:
                _delete_array_async(_array_kvstore(kvstore, p), ctx).result()
            except Exception:  # noqa: BLE001 - best effort; the write error matters
                pass
        raise next((e for e in errors if isinstance(e, DiskFullError)), errors[0])


def write_arrays_kv(
    kvstore: KvStoreSpec,
    arrays: Mapping[str, Any],
    *,
    context: ts.Context | None = None,
    write_metadata: bool = True,
    content_addressed: bool = False,
    attributes: Mapping[str, Mapping[str, Any]] | None = None,
    fresh: bool = False,
    timeout: float | None = None,
) -> None:
    """Writes ``{path: array}`` under any tensorstore kvstore, byte for byte as
    :func:`write_arrays_local` does, and waits.

    Each chunk is one key put, all of them at once, and every ``zarr.json`` is put only after
    every chunk of the batch is written: an array whose ``zarr.json`` exists is complete, even
    after a crash mid-write (:func:`write_arrays`, through the zarr3 driver, puts ``zarr.json``
    first). An existing plain array at a path is replaced: its keys are deleted first. The
    chunks of a :class:`ChunkedArray` are put and the array's other chunks left alone (other
    writers hold them), then its ``zarr.json``.

    Args:
      kvstore: the store's kvstore spec; ``context`` as for :func:`write_arrays`.
      arrays: relative array path -> array or :class:`ChunkedArray`.
      write_metadata: put the ``zarr.json`` of :class:`ChunkedArray` values (a writer of some
        chunks of an array whose metadata another writer puts last passes ``False``). Plain
        arrays always get theirs.
      content_addressed: any array already at a path holds these very bytes (its path names
        its content, and other writers may put it at the same time). Then nothing is deleted,
        before or after a failure, since a delete could tear another writer's complete array;
        each put replaces a key whole, with the same bytes. A failed call may leave chunks
        without ``zarr.json``: to readers no array, and the next writer's puts replace them.
      attributes: array path (a key of ``arrays``) -> its zarr attributes, as for
        :func:`~serializers.local.write_arrays_local`.
      fresh: the paths are new (under a folder named for this write alone): no array is there
        to replace, so nothing is cleared first (on an object store, one listing per array
        fewer).
      timeout: seconds each request may take (``None``: as long as it takes).

    Raises:
      ValueError, UnsupportedDTypeError: an unsafe path, an unsupported dtype or bad attributes,
        before any write.
      DiskFullError: on ``ENOSPC``/``EFBIG``/``EDQUOT``, after deleting every key this call put
        (``zarr.json`` first; of a :class:`ChunkedArray`, only its own chunks), unless
        ``content_addressed``. Any other error deletes them too, and is raised as it is.
      UnavailableError: the store did not answer (see :func:`wait_request`); what this call put is
        deleted as far as the store answers.
    """
    disk: dict[str, np.ndarray | ChunkedArray] = {}
    for p, a in arrays.items():
        check_relpath(p)
        disk[p] = a if isinstance(a, ChunkedArray) else disk_array(a)
    check_attributes(arrays, attributes)
    if not disk:
        return
    attrs = attributes or {}
    ctx = context if context is not None else default_context()
    root = _kv_root(kvstore)
    kv = wait_request(ts.KvStore.open(root, context=ctx), timeout, "opening the kvstore")
    chunks = {f"{p}/{key}": view for p, a in disk.items() for key, view in disk_chunks(a)}
    metadata = {
        f"{p}/{METADATA_KEY}": disk_metadata(a, attrs.get(p))
        for p, a in disk.items()
        if write_metadata or not isinstance(a, ChunkedArray)
    }
    replaced = [] if content_addressed or fresh else [p for p, a in disk.items() if not isinstance(a, ChunkedArray)]
    put: list[str] = []
    try:
        deleted = {p: kv.delete_range(ts.KvStore.KeyRange(f"{p}/", f"{p}0")) for p in replaced}
        _raise_first(_wait_all(deleted, timeout)[1])
        _put_all(kv, chunks, put, timeout)
        _put_all(kv, metadata, put, timeout)
    except BaseException as e:
        if not content_addressed and put:
            _wait_all({k: kv.write(k, None) for k in put if k in metadata}, timeout)  # best effort
            _wait_all({k: kv.write(k, None) for k in put if k in chunks}, timeout)
            for p in disk:
                _prune_empty_dirs(_file_folder(_array_kvstore(root, p)))
        err = convert_write_error(e, describe_arrays(list(disk)))
        if err is e:
            raise
        raise err from e


def _put_all(
    kv: ts.KvStore, items: Mapping[str, bytes | memoryview], started: list[str], timeout: float | None = None
) -> None:
    """Puts every key of ``items`` at once, appending each to ``started`` as its put starts;
    waits for all that started, then raises the first disk-full error among them, else the first."""
    futures: dict[str, ts.Future] = {}
    try:
        for key, value in items.items():
            futures[key] = kv.write(key, bytes(value))  # (takes str or bytes only: one copy)
            started.append(key)
    finally:
        _, errors = _wait_all(futures, timeout)
    _raise_first(errors)


def _raise_first(errors: Sequence[BaseException]) -> None:
    """Raises the first disk-full error of ``errors``, else the first unavailable one, else the
    first, if any."""
    if errors:
        raise next((e for e in errors if ts_errno(e) in DISK_FULL_ERRNOS),
                   next((e for e in errors if is_unavailable(e)), errors[0]))


def read_array_async(
    kvstore: KvStoreSpec,
    path: str,
    shape: Shape,
    dtype: DTypeLike,
    *,
    context: ts.Context | None = None,
) -> ts.Future:
    """Starts reading the zarr v3 array ``path`` under ``kvstore``.

    The future's result is a numpy array of ``shape`` and ``dtype``. It raises
    :class:`CorruptDataError` if the metadata is missing or does not match, or
    the chunk is missing, truncated or oversized.
    """
    asked = ArrayRead.of(path, shape, dtype)
    kv = _array_kvstore(kvstore, path)
    ctx = context if context is not None else default_context()
    opened = ts.open(_ts_spec(kv, asked.shape, asked.name, write=False), open=True, context=ctx)
    read = then(opened, lambda store: store.read())
    return then(read, lambda a: a, lambda e: raise_error(convert_read_error(e, asked.what)))


def read_array(
    kvstore: KvStoreSpec,
    path: str,
    shape: Shape,
    dtype: DTypeLike,
    *,
    context: ts.Context | None = None,
) -> np.ndarray:
    """Reads the zarr v3 array ``path`` under ``kvstore``; see :func:`read_array_async`."""
    return read_array_async(kvstore, path, shape, dtype, context=context).result()


def read_arrays(
    kvstore: KvStoreSpec,
    arrays: Mapping[str, tuple[Shape, DTypeLike]],
    *,
    context: ts.Context | None = None,
) -> dict[str, np.ndarray]:
    """Reads many arrays concurrently (``{path: (shape, dtype)}``); raises the first error."""
    ctx = context if context is not None else default_context()
    futures = {
        p: read_array_async(kvstore, p, shape, dtype, context=ctx)
        for p, (shape, dtype) in arrays.items()
    }
    results, errors = _wait_all(futures)
    if errors:
        raise errors[0]
    return results


def _write_chunked_async(
    kvstore: KvStoreSpec,
    path: str,
    arr: ChunkedArray,
    *,
    context: ts.Context | None = None,
    delete_array_on_error: bool = True,
) -> ts.Future:
    name = zarr_dtype_name(arr.dtype)
    kv = _array_kvstore(kvstore, path)
    ctx = context if context is not None else default_context()
    what = f"array {path!r}"
    # open or create: other writers may hold other chunks of the same array (no delete_existing)
    opened = ts.open(
        _ts_spec(kv, arr.shape, name, write=True, chunks=arr.chunk_shape),
        open=True,
        create=True,
        context=ctx,
    )

    def write_all(store: Any) -> Any:
        commits = [
            store[chunk_region(idx, arr.chunk_shape)].write(a).commit for idx, a in arr.chunks.items()
        ]
        return then(all_done(commits), lambda _: None)

    written = then(opened, write_all)

    def on_error(e: BaseException) -> Any:
        err = convert_write_error(e, what)
        if not delete_array_on_error:
            return then(
                _delete_keys_async(kv, list(arr.chunks), ctx), lambda _: raise_error(err), lambda _: raise_error(err)
            )
        return then(_delete_array_async(kv, ctx), lambda _: raise_error(err), lambda _: raise_error(err))

    return then(written, lambda _: None, on_error)

def _delete_keys_async(kv: dict[str, Any], indices: Sequence[tuple[int, ...]], context: ts.Context) -> ts.Future:
    """Removes the chunk keys of ``indices`` under the array folder ``kv`` (not the others)."""
    opened = ts.KvStore.open(kv, context=context)
    return then(opened, lambda store: all_done([store.write(chunk_index_key(i), None) for i in indices]))


def read_chunk_async(
    kvstore: KvStoreSpec,
    path: str,
    shape: Shape,
    dtype: DTypeLike,
    chunk_shape: Shape,
    chunk_index: Sequence[int],
    *,
    context: ts.Context | None = None,
) -> ts.Future:
    """Starts reading chunk ``chunk_index`` of the chunked zarr v3 array ``path``.

    The future's result is a numpy array of ``chunk_shape``. The array's metadata must have
    this shape, dtype and chunk shape; a missing, truncated or oversized chunk or mismatching
    metadata raise :class:`CorruptDataError`.
    """
    asked = ArrayRead.of(path, shape, dtype, chunk_shape, chunk_index)
    kv = _array_kvstore(kvstore, path)
    ctx = context if context is not None else default_context()
    what = f"{asked.what}, chunk {asked.key}"
    opened = ts.open(_ts_spec(kv, asked.shape, asked.name, write=False, chunks=asked.chunk_shape), open=True, context=ctx)
    read = then(opened, lambda store: store[asked.region].read())
    return then(read, lambda a: a, lambda e: raise_error(convert_read_error(e, what)))


def read_chunk(
    kvstore: KvStoreSpec,
    path: str,
    shape: Shape,
    dtype: DTypeLike,
    chunk_shape: Shape,
    chunk_index: Sequence[int],
    *,
    context: ts.Context | None = None,
) -> np.ndarray:
    """Reads one chunk of a chunked array; see :func:`read_chunk_async`."""
    return np.asarray(
        read_chunk_async(kvstore, path, shape, dtype, chunk_shape, chunk_index, context=context).result()
    )


def read_raw(
    kv: ts.KvStore,
    path: str,
    shape: Shape,
    dtype: DTypeLike,
    *,
    chunk_shape: Shape | None = None,
    chunk_index: Sequence[int] | None = None,
    empty: Callable[[Shape, np.dtype], np.ndarray] = aligned_empty,
    timeout: float | None = None,
) -> np.ndarray:
    """Reads one chunk object of the raw layout every writer stores (:mod:`serializers.zarr`)
    straight from the open kvstore ``kv``: the single chunk of the array ``path``, or chunk
    ``chunk_index`` of a chunked one. One request, no ``zarr.json`` (the caller's manifest gives
    shape and dtype, its checksum vouches for the bytes, as on the local fast path).

    Returns a fresh, writable, 64-byte aligned array of ``shape`` (of ``chunk_shape`` for a
    chunk), from ``empty(shape, dtype)`` (see :func:`serializers.read_arrays_local`).

    Raises:
      CorruptDataError: the object is missing, or not exactly as many bytes as the shape needs.
      ValueError: a chunk shape that does not divide ``shape``, an index outside the grid.
      UnavailableError: no answer within ``timeout`` seconds, or the store gave up.
    """
    asked = ArrayRead.of(path, shape, dtype, chunk_shape, chunk_index)
    dt, what, key, piece = asked.dtype, asked.what, asked.key, asked.piece
    if not asked.stored:  # no elements: nothing is stored (and no chunk index is inside the grid)
        return aligned_empty(asked.shape, dt)
    try:
        result = wait_request(kv.read(f"{path}/{key}"), timeout, what)
    except Exception as e:  # noqa: BLE001 - tensorstore raises ValueError and others
        raise convert_read_error(e, what) from None
    if result.state != "value":
        raise CorruptDataError(f"{what}: chunk {path}/{key} is missing")
    expected = int(np.prod(piece, dtype=np.int64)) * dt.itemsize
    if len(result.value) != expected:
        kind = "truncated" if len(result.value) < expected else "too long"
        raise CorruptDataError(f"{what}: chunk {path}/{key} is {kind}: {len(result.value)} bytes, expected {expected}")
    out = empty(piece, dt)
    byte_view(out)[:] = result.value
    return out


def check_array_metadata(
    kv: ts.KvStore,
    path: str,
    shape: Shape,
    dtype: DTypeLike,
    chunk_shape: Shape | None = None,
    *,
    timeout: float | None = None,
) -> None:
    """Checks that the ``zarr.json`` of the array ``path`` in the open kvstore ``kv`` describes
    ``shape``, ``dtype`` and ``chunk_shape`` (default: one chunk) in the raw layout: what plain
    ``zarr`` needs (:func:`read_raw` does not read it).

    Raises:
      CorruptDataError: it is missing, oversized, or describes another array.
    """
    asked = ArrayRead.of(path, shape, dtype, chunk_shape)
    what = asked.what
    key = f"{path}/{METADATA_KEY}"
    result = wait_request(kv.read(key), timeout, what)
    if result.state != "value":
        raise CorruptDataError(f"{what}: metadata object {key} is missing")
    if len(result.value) > MAX_METADATA_BYTES:
        raise CorruptDataError(f"{what}: metadata object {key} is {len(result.value):,} bytes, over the {MAX_METADATA_BYTES:,} allowed")
    check_zarr_metadata(bytes(result.value), asked.shape, asked.name, f"{what} ({key})", asked.chunk_shape)
