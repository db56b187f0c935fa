"""Arrays as zarr v3 arrays: through tensorstore, and a fast path for local folders.

On-disk format (one format, two writers). Every array is a zarr v3 array folder::

    <path>/zarr.json      metadata, compact JSON with sorted keys
    <path>/c.0.0          the single chunk: the whole array, C order, little endian
    <path>/c              ... for a 0-d array
    (no chunk file)       ... for an array with a zero-length dimension

The chunk grid has one chunk that is the whole array (``chunk_shape`` = ``shape``,
with 0 replaced by 1), the chunk key encoding is zarr's ``"default"`` with
separator ``"."`` (``"c"`` followed by ``".0"`` per dimension: one folder per
array, no nested chunk folders, which saves two ``mkdir`` per array), and the
only codec is ``"bytes"`` (``"endian": "little"`` for items wider than a byte), so
the chunk file is exactly the array's raw bytes: no compression, no header. Its
checksum (:mod:`serializers.checksums`) is the checksum of the array in memory.

Three writers produce byte-identical chunk files and the same metadata, and each
reader reads what any of them wrote (the tests check this):

* The tensorstore path (:func:`write_arrays`, :func:`read_array` and their
  ``_async`` / batch forms) works on any tensorstore kvstore spec (``file``,
  ``memory``, cloud drivers). It writes chunks equal to the fill value too
  (``store_data_equal_to_fill_value``) and reads with ``fill_missing_data_reads``
  off, so a missing chunk is an error, never zeros. A ``memory`` kvstore lives in
  a tensorstore :class:`~tensorstore.Context`: pass the same ``context`` to write
  and read, or rely on :func:`default_context`, one context shared per process.
  Its one-array and chunk-by-chunk writers, which no library code calls, live in
  the tests (``tests/zarr3_reference.py``) as the interoperability reference.
* The fast path (:func:`write_array_local`, :func:`read_array_local`) is for a
  plain local folder. It writes the chunk with ``os.write`` straight from the
  array's buffer (no copy), ``zarr.json`` after it, and fsyncs files and folders
  when asked; it reads the chunk with one ``readv`` into a 64-byte aligned buffer
  (:func:`aligned_empty`), so a later ``jax.device_put`` on CPU can use the memory
  in place. Sizes are checked against the expected shape before reading.
* The raw kvstore path (:func:`write_arrays_kv`) writes the fast path's bytes
  through any tensorstore kvstore, one key put per chunk, every chunk before any
  ``zarr.json``: an array whose ``zarr.json`` exists has all the chunks of that
  write (the zarr3 driver writes ``zarr.json`` first, when it creates the array).

Chunked arrays. An array may also be stored on a regular grid of equal chunks
(``chunk_shape`` dividing ``shape`` in every dimension; edge chunks are not
supported): chunk ``(i, j)`` is the file ``c.i.j``, each holding the raw bytes of
its block, and ``zarr.json`` names the chunk shape. Such an array is written
chunk by chunk, possibly by several writers that each hold some chunks
(:class:`ChunkedArray`, :func:`write_chunks_local`, :func:`write_arrays_kv`), and
read chunk by chunk (:func:`read_chunk_local`, :func:`read_chunk`); plain
``zarr`` and tensorstore read it whole. A chunk write never removes the array's
other chunks, so write into a fresh folder or one holding an array of the same
layout. With the default ``chunk_shape`` (the whole array) everything is as
above, byte for byte.

Errors: a missing, truncated or oversized chunk, missing or mismatching
metadata -> :class:`~serializers.errors.CorruptDataError` naming the file.
``ENOSPC``/``EFBIG``/``EDQUOT`` while writing -> :class:`~serializers.errors.
DiskFullError`, after removing what that write had created.

Data types: ``bool``, ``int8``-``int64``, ``uint8``-``uint64``, ``float16``,
``float32``, ``float64``, ``complex64``, ``complex128``, and from ``ml_dtypes``
``bfloat16``, the ``float8_*`` types tensorstore knows, ``float4_e2m1fn``,
``int2`` and ``int4`` (stored one element per byte, as in memory). Plain
``zarr`` (3.1) reads the numpy types as they are; it does not know the
``ml_dtypes`` ones and refuses to open their metadata until
:func:`register_zarr_dtypes` has taught it the floating ones (``int2``/``int4``
stay tensorstore-only). The host is assumed little endian (x86, ARM).
"""

from __future__ import annotations

import errno
import functools
import json
import math
import os
import re
import shutil
import stat
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

import ml_dtypes
import numpy as np
import tensorstore as ts

from serializers.errors import CorruptDataError, DiskFullError, UnsupportedDTypeError
from serializers.manifest import is_safe_relpath

__all__ = [
    "SUPPORTED_DTYPES",
    "fsync_folder_local",
    "KvStoreSpec",
    "zarr_dtype_name",
    "numpy_dtype",
    "chunk_shape",
    "chunk_key",
    "CHUNK_KEY_SEPARATOR",
    "check_chunk_shape",
    "chunk_grid",
    "chunk_indices",
    "chunk_index_key",
    "chunk_region",
    "ChunkedArray",
    "zarr_metadata",
    "encode_zarr_metadata",
    "default_context",
    "local_root",
    "aligned_empty",
    "write_array_async",
    "write_arrays",
    "read_array",
    "read_array_async",
    "read_arrays",
    "write_array_local",
    "write_arrays_local",
    "write_arrays_kv",
    "read_array_local",
    "read_chunk",
    "read_chunk_async",
    "write_chunks_local",
    "read_chunk_local",
    "read_file_local",
    "check_folders_local",
    "check_array_metadata_local",
    "register_zarr_dtypes",
]

KvStoreSpec = Mapping[str, Any]
"""A tensorstore kvstore spec, e.g. ``{"driver": "file", "path": "/data/store"}``."""

PathLike = str | os.PathLike[str]
Shape = Sequence[int]
DTypeLike = str | np.dtype | type

ALIGNMENT: Final[int] = 64
"""Byte alignment of buffers returned by :func:`aligned_empty` and the fast reader."""

_METADATA_KEY: Final[str] = "zarr.json"
_DISK_FULL_ERRNOS: Final[frozenset[int]] = frozenset(
    {errno.ENOSPC, errno.EFBIG} | ({errno.EDQUOT} if hasattr(errno, "EDQUOT") else set())
)


# --------------------------------------------------------------------------- dtypes


def _supported_dtypes() -> dict[str, np.dtype]:
    names = [
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float16", "float32", "float64", "complex64", "complex128",
    ]  # fmt: skip
    out = {n: np.dtype(n) for n in names}
    ml_names = [
        "bfloat16", "float8_e3m4", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e4m3b11fnuz",
        "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn", "int2", "int4",
    ]  # fmt: skip
    for n in ml_names:  # the zarr3 data types tensorstore supports, where ml_dtypes has them
        if hasattr(ml_dtypes, n):
            out[n] = np.dtype(getattr(ml_dtypes, n))
    return out


SUPPORTED_DTYPES: Final[Mapping[str, np.dtype]] = _supported_dtypes()
"""zarr v3 ``data_type`` name -> numpy dtype, for every dtype this module stores."""


def zarr_dtype_name(dtype: DTypeLike) -> str:
    """Returns the zarr v3 ``data_type`` of a numpy dtype (either byte order).

    Raises:
      UnsupportedDTypeError: for a dtype with no zarr v3 name here (strings,
        objects, datetimes, structured, ``uint4``...).
    """
    try:
        d = np.dtype(dtype)
    except TypeError:  # e.g. "key<fry>", which the caller stores as its key data
        raise UnsupportedDTypeError(f"{dtype!r} is not a numpy dtype") from None
    want = SUPPORTED_DTYPES.get(d.name)
    if want is None or d.type is not want.type:
        raise UnsupportedDTypeError(
            f"dtype {d} cannot be stored as a zarr v3 array; supported: "
            f"{', '.join(SUPPORTED_DTYPES)}"
        )
    return d.name


def numpy_dtype(dtype: DTypeLike) -> np.dtype:
    """Returns the native numpy dtype for a zarr v3 name (or any dtype-like)."""
    if isinstance(dtype, str) and dtype in SUPPORTED_DTYPES:
        return SUPPORTED_DTYPES[dtype]
    return SUPPORTED_DTYPES[zarr_dtype_name(dtype)]


def _fill_value(name: str) -> Any:
    """The fill value written in metadata, spelled as tensorstore spells it."""
    if name == "bool":
        return False
    if name.startswith("complex"):
        return [0.0, 0.0]
    if "float" in name:  # float16..64, bfloat16, float8_*, float4_*
        return 0.0
    return 0


# --------------------------------------------------------------------------- format


def chunk_shape(shape: Shape) -> tuple[int, ...]:
    """The shape of the single chunk: ``shape``, with zero-length dims as 1."""
    return tuple(max(1, int(d)) for d in shape)


_single_chunk_shape = chunk_shape  # (parameters named chunk_shape shadow the function below)


CHUNK_KEY_SEPARATOR: Final[str] = "."
"""The separator of zarr v3's ``default`` chunk key encoding used here: ``c.0.0``, so each array
is one folder holding ``zarr.json`` and its chunk file, with no nested chunk folders."""


def chunk_key(shape: Shape) -> str | None:
    """The key of the single chunk inside the array folder.

    ``"c.0.0"`` for a 2-d array, ``"c"`` for a 0-d array, ``None`` when the array
    has no elements (then no chunk is stored).
    """
    if any(int(d) == 0 for d in shape):
        return None
    return "c" + f"{CHUNK_KEY_SEPARATOR}0" * len(shape)


def check_chunk_shape(shape: Shape, chunk_shape: Shape | None) -> tuple[int, ...]:
    """Validates a regular chunk grid for ``shape`` and returns ``chunk_shape`` as ints.

    ``None`` means the single chunk of :func:`chunk_shape`. Otherwise ``chunk_shape`` must have
    one entry >= 1 per dimension and divide ``shape`` exactly (edge chunks are not supported).

    Raises:
      ValueError: a chunk shape of another rank, a non-positive entry, or one that does not
        divide the array's dimension.
    """
    shape = tuple(int(d) for d in shape)
    if chunk_shape is None:
        return _single_chunk_shape(shape)
    cs = tuple(int(c) for c in chunk_shape)
    if len(cs) != len(shape):
        raise ValueError(f"chunk shape {cs} has {len(cs)} dimensions, the array {shape} has {len(shape)}")
    if any(c < 1 for c in cs):
        raise ValueError(f"chunk shape {cs} must be >= 1 in every dimension")
    if any(d % c for d, c in zip(shape, cs)):
        raise ValueError(
            f"chunk shape {cs} does not divide the array shape {shape}: edge chunks are not supported"
        )
    return cs


def chunk_grid(shape: Shape, chunk_shape: Shape | None = None) -> tuple[int, ...]:
    """The number of chunks along each dimension (0 along a zero-length dimension)."""
    cs = check_chunk_shape(shape, chunk_shape)
    return tuple(int(d) // c for d, c in zip(shape, cs))


def chunk_indices(shape: Shape, chunk_shape: Shape | None = None) -> list[tuple[int, ...]]:
    """Every chunk index of the grid, in C order (``[()]`` for a 0-d array, ``[]`` if empty)."""
    return [tuple(int(i) for i in idx) for idx in np.ndindex(*chunk_grid(shape, chunk_shape))]


def chunk_index_key(index: Sequence[int]) -> str:
    """The key of chunk ``index`` inside the array folder: ``"c.1.0"``; ``"c"`` for ``()``."""
    return "c" + "".join(f"{CHUNK_KEY_SEPARATOR}{int(i)}" for i in index)


def chunk_region(index: Sequence[int], chunk_shape: Shape) -> tuple[slice, ...]:
    """The block of the array that chunk ``index`` holds, as a tuple of slices."""
    return tuple(slice(int(i) * int(c), (int(i) + 1) * int(c)) for i, c in zip(index, chunk_shape))


def _check_chunk_index(index: Sequence[int], grid: tuple[int, ...], what: str) -> tuple[int, ...]:
    idx = tuple(int(i) for i in index)
    if len(idx) != len(grid) or any(not 0 <= i < n for i, n in zip(idx, grid)):
        raise ValueError(f"{what}: chunk index {idx} is outside the chunk grid {grid}")
    return idx


class ChunkedArray:
    """An array given as some (or all) of its chunks on a regular grid, for writing.

    Args:
      shape, dtype: the whole array's.
      chunk_shape: the chunk shape; must divide ``shape`` (see :func:`check_chunk_shape`).
      chunks: chunk index -> an array of exactly ``chunk_shape`` and ``dtype`` (any
        array-like numpy accepts; C-contiguous little-endian ones are written without a copy).

    A writer that holds only some chunks (one process of several) passes those; the array is
    complete once every chunk of the grid has been written by someone.
    """

    __slots__ = ("chunk_shape", "chunks", "dtype", "shape")

    def __init__(
        self,
        shape: Shape,
        dtype: DTypeLike,
        chunk_shape: Shape,
        chunks: Mapping[Sequence[int], Any],
    ) -> None:
        self.shape = tuple(int(d) for d in shape)
        self.dtype = numpy_dtype(dtype)
        self.chunk_shape = check_chunk_shape(self.shape, chunk_shape)
        grid = chunk_grid(self.shape, self.chunk_shape)
        out: dict[tuple[int, ...], np.ndarray] = {}
        for index, chunk in chunks.items():
            idx = _check_chunk_index(index, grid, "ChunkedArray")
            a = _disk_array(chunk)
            if a.shape != self.chunk_shape or a.dtype.type is not self.dtype.type:
                raise ValueError(
                    f"ChunkedArray: chunk {idx} is {a.dtype}{list(a.shape)}, expected "
                    f"{self.dtype}{list(self.chunk_shape)}"
                )
            out[idx] = a
        self.chunks = out

    @property
    def nbytes(self) -> int:
        """Bytes of the chunks given (not of the whole array)."""
        return sum(int(a.nbytes) for a in self.chunks.values())

    def __repr__(self) -> str:
        return (
            f"ChunkedArray({self.dtype}{list(self.shape)}, chunk_shape={list(self.chunk_shape)}, "
            f"{len(self.chunks)} chunks)"
        )


def zarr_metadata(shape: Shape, dtype: DTypeLike, chunk_shape: Shape | None = None) -> dict[str, Any]:
    """The ``zarr.json`` contents for an array of ``shape`` and ``dtype``.

    ``chunk_shape`` (default: one chunk, the whole array) sets the regular chunk grid; see
    :func:`check_chunk_shape`. Identical to what tensorstore's zarr3 driver writes for the same
    array.
    """
    name = zarr_dtype_name(dtype)
    cs = check_chunk_shape(shape, chunk_shape)
    bytes_codec: dict[str, Any] = {"name": "bytes"}
    if SUPPORTED_DTYPES[name].itemsize > 1:
        bytes_codec = {"configuration": {"endian": "little"}, "name": "bytes"}
    return {
        "chunk_grid": {
            "configuration": {"chunk_shape": list(cs)},
            "name": "regular",
        },
        "chunk_key_encoding": {"configuration": {"separator": CHUNK_KEY_SEPARATOR}, "name": "default"},
        "codecs": [bytes_codec],
        "data_type": name,
        "fill_value": _fill_value(name),
        "node_type": "array",
        "shape": [int(d) for d in shape],
        "zarr_format": 3,
    }


def encode_zarr_metadata(shape: Shape, dtype: DTypeLike, chunk_shape: Shape | None = None) -> bytes:
    """:func:`zarr_metadata` as the compact, key-sorted JSON bytes written to disk."""
    return json.dumps(
        zarr_metadata(shape, dtype, chunk_shape), sort_keys=True, separators=(",", ":")
    ).encode()


def _check_zarr_metadata(
    raw: bytes, shape: tuple[int, ...], name: str, where: str, chunks: tuple[int, ...] | None = None
) -> None:
    """Raises CorruptDataError unless ``raw`` describes our raw layout with chunk shape
    ``chunks`` (default: the single chunk)."""
    try:
        meta = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptDataError(f"{where}: unreadable zarr metadata ({e})") from None
    if not isinstance(meta, dict):
        raise CorruptDataError(f"{where}: zarr metadata is not a JSON object")

    def mismatch(field: str, want: Any) -> CorruptDataError:
        got = repr(meta.get(field))[:120]
        return CorruptDataError(f"{where}: zarr metadata {field!r} is {got}, expected {want!r}")

    if meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
        raise mismatch("zarr_format", 3)
    if meta.get("shape") != list(shape):
        raise mismatch("shape", list(shape))
    if meta.get("data_type") != name:
        raise mismatch("data_type", name)
    want_chunks = list(chunks) if chunks is not None else list(chunk_shape(shape))
    want_grid = {"configuration": {"chunk_shape": want_chunks}, "name": "regular"}
    if meta.get("chunk_grid") != want_grid:
        raise mismatch("chunk_grid", want_grid)
    encoding = meta.get("chunk_key_encoding")
    want_encoding = {"configuration": {"separator": CHUNK_KEY_SEPARATOR}, "name": "default"}
    if encoding != want_encoding:
        raise mismatch("chunk_key_encoding", want_encoding)
    codecs = meta.get("codecs")
    little = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if not (
        codecs == little or (codecs == [{"name": "bytes"}] and SUPPORTED_DTYPES[name].itemsize == 1)
    ):
        raise mismatch("codecs", little)
    if meta.get("storage_transformers", []) != []:
        raise mismatch("storage_transformers", [])


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


def _disk_array(arr: Any) -> np.ndarray:
    """``arr`` as a C-contiguous little-endian numpy array, copying only if needed."""
    a = np.asarray(arr)
    zarr_dtype_name(a.dtype)  # raises for unsupported dtypes
    if a.dtype.byteorder == ">" or (
        a.dtype.byteorder == "=" and sys.byteorder == "big" and a.dtype.itemsize > 1
    ):
        a = a.astype(a.dtype.newbyteorder("<"))
    # (np.ascontiguousarray would also turn a 0-d array into a 1-d one)
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def _byte_view(a: np.ndarray) -> memoryview:
    """A flat uint8 view of a C-contiguous array (works for bfloat16, bool, 0-d)."""
    return a.reshape(-1).view(np.uint8).data


def _disk_chunks(arr: np.ndarray | ChunkedArray) -> list[tuple[str, memoryview]]:
    """(key inside the array folder, raw bytes) of each chunk ``arr`` holds: what every
    writer stores. ``arr`` is a :func:`_disk_array` result or a :class:`ChunkedArray`."""
    if isinstance(arr, ChunkedArray):
        return [(chunk_index_key(idx), _byte_view(c)) for idx, c in arr.chunks.items()]
    key = chunk_key(arr.shape)
    return [] if key is None else [(key, _byte_view(arr))]


def _disk_metadata(arr: np.ndarray | ChunkedArray) -> bytes:
    """The ``zarr.json`` bytes of ``arr`` (a :func:`_disk_array` result or a :class:`ChunkedArray`)."""
    chunks = arr.chunk_shape if isinstance(arr, ChunkedArray) else None
    return encode_zarr_metadata(arr.shape, arr.dtype, chunks)


def _describe(paths: Sequence[str]) -> str:
    """The arrays of a batch, for error messages: their paths if few, else how many."""
    return ", ".join(repr(p) for p in paths) if len(paths) <= 4 else f"{len(paths)} arrays"


def _check_relpath(path: str) -> None:
    if not is_safe_relpath(path):
        raise ValueError(f"unsafe array path {path!r}: use [A-Za-z0-9._/-], relative, no '..'")


# --------------------------------------------------------------------------- tensorstore


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
    _check_relpath(path)
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


_OS_ERROR_CODE: Final = re.compile(r"os_error_code=\\?'?(\d+)")
_CORRUPT_STATUS: Final = (
    "NOT_FOUND",
    "FAILED_PRECONDITION",
    "DATA_LOSS",
    "OUT_OF_RANGE",
    "INVALID_ARGUMENT",
)


def _ts_message(e: BaseException) -> str:
    """tensorstore's message without the (long) echo of the full spec."""
    return str(e).split(" [tensorstore_spec=", 1)[0]


def _ts_errno(e: BaseException) -> int | None:
    m = _OS_ERROR_CODE.search(str(e))
    return int(m.group(1)) if m else None


def _convert_write_error(e: BaseException, what: str) -> BaseException:
    code = _ts_errno(e)
    if code in _DISK_FULL_ERRNOS:
        err = DiskFullError(code, f"{what}: disk full while writing: {_ts_message(e)}")
        err.__cause__ = e
        return err
    return e


def _convert_read_error(e: BaseException, what: str) -> BaseException:
    code = _ts_errno(e)
    message = _ts_message(e)
    if code in (errno.EACCES, errno.EPERM) or message.startswith("PERMISSION_DENIED"):
        err: BaseException = PermissionError(code or errno.EACCES, f"{what}: {message}")
    elif message.startswith(_CORRUPT_STATUS) or code in (errno.ENOENT, errno.ENOTDIR, errno.EISDIR):
        err = CorruptDataError(f"{what}: cannot read array ({message})")
    else:
        return e
    err.__cause__ = e
    return err


def _settle(promise: Any, fn: Callable[..., Any], *args: Any) -> None:
    """Settles ``promise`` with ``fn(*args)``, following a returned future."""
    try:
        result = fn(*args)
    except BaseException as e:  # noqa: BLE001 - every outcome must reach the promise
        promise.set_exception(e)
        return
    if isinstance(result, ts.WriteFutures):
        result = result.commit
    if isinstance(result, ts.Future):
        result.add_done_callback(lambda f: _settle(promise, f.result))
    else:
        promise.set_result(result)


def _then(
    future: Any,
    on_ok: Callable[[Any], Any],
    on_error: Callable[[BaseException], Any] | None = None,
) -> ts.Future:
    """A future of ``on_ok(result)`` (or ``on_error(exc)``); either may return a future."""
    promise: Any
    out: ts.Future
    promise, out = ts.Promise.new()

    def done(f: ts.Future) -> None:
        try:
            value = f.result()
        except BaseException as e:  # noqa: BLE001
            if on_error is None:
                promise.set_exception(e)
            else:
                _settle(promise, on_error, e)
            return
        _settle(promise, on_ok, value)

    future.add_done_callback(done)
    return out


def _raise(e: BaseException) -> Any:
    raise e


def _delete_array_async(kv: dict[str, Any], context: ts.Context) -> ts.Future:
    """Removes every key under the array folder ``kv`` (and, locally, its empty folders)."""
    opened = ts.KvStore.open(kv, context=context)
    deleted = _then(opened, lambda store: store.delete_range(ts.KvStore.KeyRange()))
    return _then(deleted, lambda _: _prune_empty_dirs(_file_folder(kv)))


def delete_prefix(kvstore: KvStoreSpec, prefix: str, *, context: ts.Context | None = None) -> None:
    """Removes every key under the folder ``prefix`` of ``kvstore`` and waits; with the ``file``
    driver, also the folders it leaves empty (it deletes files, not folders)."""
    ctx = context if context is not None else default_context()
    _delete_array_async(_array_kvstore(kvstore, prefix), ctx).result()


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
    a = _disk_array(arr)
    name = zarr_dtype_name(a.dtype)
    kv = _array_kvstore(kvstore, path)
    ctx = context if context is not None else default_context()
    what = f"array {path!r}"
    opened = ts.open(
        _ts_spec(kv, a.shape, name, write=True), create=True, delete_existing=True, context=ctx
    )
    written = _then(opened, lambda store: store.write(a))

    def on_error(e: BaseException) -> Any:
        err = _convert_write_error(e, what)
        return _then(_delete_array_async(kv, ctx), lambda _: _raise(err), lambda _: _raise(err))

    return _then(written, lambda _: None, on_error)


def _wait_all(futures: Mapping[str, ts.Future]) -> tuple[dict[str, Any], list[BaseException]]:
    results: dict[str, Any] = {}
    errors: list[BaseException] = []
    for key, f in futures.items():
        try:
            results[key] = f.result()
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
        _check_relpath(p)
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

    Raises:
      ValueError, UnsupportedDTypeError: an unsafe path or unsupported dtype, before any write.
      DiskFullError: on ``ENOSPC``/``EFBIG``/``EDQUOT``, after deleting every key this call put
        (``zarr.json`` first; of a :class:`ChunkedArray`, only its own chunks), unless
        ``content_addressed``. Any other error deletes them too, and is raised as it is.
    """
    disk: dict[str, np.ndarray | ChunkedArray] = {}
    for p, a in arrays.items():
        _check_relpath(p)
        disk[p] = a if isinstance(a, ChunkedArray) else _disk_array(a)
    if not disk:
        return
    ctx = context if context is not None else default_context()
    root = _kv_root(kvstore)
    kv = ts.KvStore.open(root, context=ctx).result()
    chunks = {f"{p}/{key}": view for p, a in disk.items() for key, view in _disk_chunks(a)}
    metadata = {
        f"{p}/{_METADATA_KEY}": _disk_metadata(a)
        for p, a in disk.items()
        if write_metadata or not isinstance(a, ChunkedArray)
    }
    replaced = [] if content_addressed else [p for p, a in disk.items() if not isinstance(a, ChunkedArray)]
    put: list[str] = []
    try:
        deleted = {p: kv.delete_range(ts.KvStore.KeyRange(f"{p}/", f"{p}0")) for p in replaced}
        _raise_first(_wait_all(deleted)[1])
        _put_all(kv, chunks, put)
        _put_all(kv, metadata, put)
    except BaseException as e:
        if not content_addressed and put:
            _wait_all({k: kv.write(k, None) for k in put if k in metadata})  # best effort
            _wait_all({k: kv.write(k, None) for k in put if k in chunks})
            for p in disk:
                _prune_empty_dirs(_file_folder(_array_kvstore(root, p)))
        err = _convert_write_error(e, _describe(list(disk)))
        if err is e:
            raise
        raise err from e


def _put_all(kv: ts.KvStore, items: Mapping[str, bytes | memoryview], started: list[str]) -> None:
    """Puts every key of ``items`` at once, appending each to ``started`` as its put starts;
    waits for all that started, then raises the first disk-full error among them, else the first."""
    futures: dict[str, ts.Future] = {}
    try:
        for key, value in items.items():
            futures[key] = kv.write(key, bytes(value))  # (takes str or bytes only: one copy)
            started.append(key)
    finally:
        _, errors = _wait_all(futures)
    _raise_first(errors)


def _raise_first(errors: Sequence[BaseException]) -> None:
    """Raises the first disk-full error of ``errors``, else the first, if any."""
    if errors:
        raise next((e for e in errors if _ts_errno(e) in _DISK_FULL_ERRNOS), errors[0])


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
    shape = tuple(int(d) for d in shape)
    name = zarr_dtype_name(numpy_dtype(dtype))
    kv = _array_kvstore(kvstore, path)
    ctx = context if context is not None else default_context()
    what = f"array {path!r}"
    opened = ts.open(_ts_spec(kv, shape, name, write=False), open=True, context=ctx)
    read = _then(opened, lambda store: store.read())
    return _then(read, lambda a: a, lambda e: _raise(_convert_read_error(e, what)))


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
        return _then(_all(commits), lambda _: None)

    written = _then(opened, write_all)

    def on_error(e: BaseException) -> Any:
        err = _convert_write_error(e, what)
        if not delete_array_on_error:
            return _then(
                _delete_keys_async(kv, list(arr.chunks), ctx), lambda _: _raise(err), lambda _: _raise(err)
            )
        return _then(_delete_array_async(kv, ctx), lambda _: _raise(err), lambda _: _raise(err))

    return _then(written, lambda _: None, on_error)


def _all(futures: Sequence[ts.Future]) -> ts.Future:
    """A future done when all of ``futures`` are; it raises the first error among them."""
    promise: Any
    out: ts.Future
    promise, out = ts.Promise.new()
    if not futures:
        promise.set_result(None)
        return out
    remaining = [len(futures)]
    lock = threading.Lock()

    def done(_: ts.Future) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            for f in futures:
                try:
                    f.result()
                except BaseException as e:  # noqa: BLE001
                    promise.set_exception(e)
                    return
            promise.set_result(None)

    for f in futures:
        f.add_done_callback(done)
    return out


def _delete_keys_async(kv: dict[str, Any], indices: Sequence[tuple[int, ...]], context: ts.Context) -> ts.Future:
    """Removes the chunk keys of ``indices`` under the array folder ``kv`` (not the others)."""
    opened = ts.KvStore.open(kv, context=context)
    return _then(opened, lambda store: _all([store.write(chunk_index_key(i), None) for i in indices]))


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
    shape = tuple(int(d) for d in shape)
    name = zarr_dtype_name(numpy_dtype(dtype))
    cs = check_chunk_shape(shape, chunk_shape)
    idx = _check_chunk_index(chunk_index, chunk_grid(shape, cs), f"array {path!r}")
    kv = _array_kvstore(kvstore, path)
    ctx = context if context is not None else default_context()
    what = f"array {path!r}, chunk {chunk_index_key(idx)}"
    opened = ts.open(_ts_spec(kv, shape, name, write=False, chunks=cs), open=True, context=ctx)
    read = _then(opened, lambda store: store[chunk_region(idx, cs)].read())
    return _then(read, lambda a: a, lambda e: _raise(_convert_read_error(e, what)))


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


# --------------------------------------------------------------------------- fast path


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
    p = os.fspath(root)
    walking = True
    for part in parts:
        p = os.path.join(p, part)
        if not walking:
            continue
        try:
            st = os.lstat(p)
        except (FileNotFoundError, NotADirectoryError):
            walking = False
            continue
        except OSError as e:
            raise CorruptDataError(f"{p} cannot be examined ({e.strerror or e})") from None
        if stat.S_ISLNK(st.st_mode):
            raise CorruptDataError(
                f"{p} is a symbolic link: a store never makes one, and never reads, writes or "
                "removes anything through one"
            )
        if not stat.S_ISDIR(st.st_mode):
            walking = False
    return p


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
        self._lock = threading.Lock()  # arrays are written from several threads
        self._checked: set[str] = set()  # folders below root found or made safe by this write

    def add_file(self, path: str) -> None:
        with self._lock:
            self.created.append((path, False))
            self.dirty_dirs.add(os.path.dirname(path))

    def makedirs(self, folder: str) -> bool:
        """Creates ``folder`` and missing parents; whether this call created ``folder`` itself.

        Raises:
          CorruptDataError: a folder on the way below ``root`` is a symbolic link or not a folder.
        """
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


def _in_parallel(fn: Callable[[Any], None], items: Sequence[Any]) -> None:
    """Runs ``fn`` over ``items`` on a few threads, waits for all, raises the first error.

    File creation, writes and fsyncs release the GIL and the filesystem overlaps them
    (measured here: 25 small arrays 23 ms -> 11 ms; 62 fsyncs 121 ms -> 14 ms).
    """
    global _io_pool
    if len(items) <= 1:
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


def _fsync_path(p: str) -> None:
    """fsyncs a file this write made (never through a link)."""
    fd = os.open(p, _READ_FLAGS)
    try:
        os.fsync(fd)
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


def _write_file(p: str, data: memoryview, undo: _Undo, *, fsync: bool, fresh: bool = False) -> None:
    """Creates (or truncates) the regular file ``p`` and writes ``data``; never through a link,
    never blocking on a FIFO; ``fresh``: ``p``'s folder was just made, so ``p`` must be new.

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
    undo.add_file(p)
    try:
        if data.nbytes >= _PREALLOCATE_BYTES and hasattr(os, "posix_fallocate"):
            try:  # faster large writes, and a full disk is reported before any byte is written
                os.posix_fallocate(fd, 0, data.nbytes)
            except OSError as e:
                if e.errno in _DISK_FULL_ERRNOS:
                    raise
        view = data
        while view.nbytes:
            n = os.write(fd, view)
            if n <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), p)
            view = view[n:]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _open_for_write(p: str, flags: int) -> int:
    try:
        return os.open(p, flags, 0o644)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EEXIST):
            raise _open_error(p, e, "write") from None
        raise


def _overwrite_in_place(folder: str, a: np.ndarray, undo: _Undo) -> bool:
    """Writes ``a`` over the chunk of an existing array of the same shape and dtype, creating no
    file or folder (creations dominate small writes here); ``False`` if there is no such chunk.

    The caller vouches that the folder holds an array of ``a``'s shape and dtype (so its
    ``zarr.json`` is already right); the chunk's size is checked.
    """
    chunks = _disk_chunks(a)
    if not chunks:
        return _is_regular(os.path.join(folder, _METADATA_KEY))
    ((key, view),) = chunks
    return _overwrite_file_in_place(os.path.join(folder, key), view, undo)


def _overwrite_file_in_place(chunk: str, view: memoryview, undo: _Undo) -> bool:
    """Writes ``view`` over the existing file ``chunk`` of exactly that size; ``False`` if there
    is no such file (then nothing was written).

    Raises:
      CorruptDataError: ``chunk`` is a symbolic link, a folder, a FIFO or anything but a regular
        file (a recycled folder is never written through a link planted in it).
    """
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
        if st.st_size != view.nbytes or st.st_nlink > 1:  # a hard link: replaced, not written into
            return False
        undo.add_file(chunk)  # fsynced with the rest; removed if the write fails
        while view.nbytes:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    return True


def _write_chunk_local(folder: str, key: str, view: memoryview, undo: _Undo, *, reuse: bool) -> None:
    p = os.path.join(folder, key)
    if reuse and _overwrite_file_in_place(p, view, undo):
        return
    _write_file(p, view, undo, fsync=False)


def _write_metadata_local(folder: str, arr: ChunkedArray, undo: _Undo, *, reuse: bool) -> None:
    p = os.path.join(folder, _METADATA_KEY)
    if reuse and _is_regular(p):
        return  # a recycled folder of the same layout: its zarr.json is already this one
    _write_file(p, memoryview(_disk_metadata(arr)), undo, fsync=False)


def _write_one_local(
    root: str, path: str, arr: Any, undo: _Undo, *, fsync: bool, reuse: bool = False
) -> None:
    _check_relpath(path)
    a = _disk_array(arr)
    folder = os.path.join(root, *path.split("/"))
    fresh = undo.makedirs(folder)  # a folder this call made holds no stale chunks
    if reuse and not fresh and _overwrite_in_place(folder, a, undo):
        return
    for name in [] if fresh else os.listdir(folder):  # chunks of an array this one replaces
        if name == "c" or name.startswith("c" + CHUNK_KEY_SEPARATOR):
            stale = os.path.join(folder, name)
            if os.path.isdir(stale) and not os.path.islink(stale):
                shutil.rmtree(stale)
            else:
                os.unlink(stale)
    for key, view in _disk_chunks(a):
        _write_file(os.path.join(folder, key), view, undo, fsync=fsync, fresh=fresh)
    meta = memoryview(_disk_metadata(a))
    _write_file(os.path.join(folder, _METADATA_KEY), meta, undo, fsync=fsync, fresh=fresh)


def write_arrays_local(
    root: PathLike,
    arrays: Mapping[str, Any],
    *,
    fsync: bool = False,
    reuse: bool = False,
    write_metadata: bool = True,
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
        reads any more (a recycled folder): overwrite their chunks in place.
      write_metadata: write the ``zarr.json`` of :class:`ChunkedArray` values (a
        writer of some chunks of an array whose metadata another writer writes
        passes ``False``). Plain arrays always get theirs.

    A value may be a :class:`ChunkedArray`: its chunks are written as files
    ``c.i.j`` (in parallel with everything else), then its ``zarr.json``; the
    array's other chunks, if any are there, are left alone.

    Raises:
      DiskFullError: on ``ENOSPC``/``EFBIG``/``EDQUOT``; every file and folder
        this call created is removed first. Any other error removes them too.
    """
    root = os.path.normpath(os.fspath(root))
    undo = _Undo(root)
    try:
        undo.makedirs(root)
        for path in arrays:
            _check_relpath(path)
        for parent in sorted({os.path.dirname(os.path.join(root, *p.split("/"))) for p in arrays}):
            undo.makedirs(parent)  # shared parents first; each array's own folder in parallel
        plain = [(p, a) for p, a in arrays.items() if not isinstance(a, ChunkedArray)]
        chunked = [(p, a) for p, a in arrays.items() if isinstance(a, ChunkedArray)]
        folders = {p: os.path.join(root, *p.split("/")) for p, _ in chunked}
        for p, _ in chunked:
            undo.makedirs(folders[p])
        tasks: list[Callable[[], None]] = [
            functools.partial(_write_one_local, root, p, a, undo, fsync=False, reuse=reuse)
            for p, a in plain
        ]
        tasks += [  # every chunk of every chunked array in parallel, then their zarr.json
            functools.partial(_write_chunk_local, folders[p], key, view, undo, reuse=reuse)
            for p, a in chunked
            for key, view in _disk_chunks(a)
        ]
        _in_parallel(lambda task: task(), tasks)
        if write_metadata:
            _in_parallel(
                lambda item: _write_metadata_local(folders[item[0]], item[1], undo, reuse=reuse),
                chunked,
            )
        if fsync:  # files first, then the folders that name them
            _in_parallel(_fsync_path, [p for p, is_dir in undo.created if not is_dir])
            _in_parallel(fsync_folder_local, sorted(undo.dirty_dirs, key=len, reverse=True))
    except BaseException as e:
        undo.remove()
        if (
            isinstance(e, OSError)
            and e.errno in _DISK_FULL_ERRNOS
            and not isinstance(e, DiskFullError)
        ):
            raise DiskFullError(
                e.errno,
                f"disk full while writing {_describe(list(arrays))} under {root!r}: {e.strerror}",
                e.filename,
            ) from e
        raise


def write_array_local(root: PathLike, path: str, arr: Any, *, fsync: bool = False) -> None:
    """Writes one array under the local folder ``root``; see :func:`write_arrays_local`."""
    write_arrays_local(root, {path: arr}, fsync=fsync)


def _read_exact(fd: int, out: memoryview, p: str, what: str) -> None:
    got = 0
    while got < out.nbytes:
        n = os.readv(fd, [out[got:]])
        if n == 0:
            raise CorruptDataError(
                f"{what}: chunk file {p} ended after {got} of {out.nbytes} bytes"
            )
        got += n


def read_array_local(
    root: PathLike,
    path: str,
    shape: Shape,
    dtype: DTypeLike,
    *,
    check_metadata: bool = True,
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

    Raises:
      CorruptDataError: a missing or wrong-sized chunk file, or missing or
        mismatching metadata; the message names the file.
    """
    _check_relpath(path)
    shape = tuple(int(d) for d in shape)
    name = zarr_dtype_name(numpy_dtype(dtype))
    folder = check_folders_local(root, path.split("/"))
    what = f"array {path!r}"
    if check_metadata:
        _check_metadata_file(folder, shape, name, what, None)
    key = chunk_key(shape)
    if key is None:
        return aligned_empty(shape, SUPPORTED_DTYPES[name])
    return _read_chunk_file(os.path.join(folder, key), shape, SUPPORTED_DTYPES[name], what)


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
) -> None:
    """Writes some chunks of the chunked zarr v3 array ``path`` under the local folder ``root``.

    ``chunks`` maps a chunk index (``(i, j)``) to an array of exactly ``chunk_shape`` and
    ``dtype``; each is written to its own file ``c.i.j`` straight from its buffer, then
    ``zarr.json`` (unless ``write_metadata`` is false: another writer of the same array writes
    it). Chunks not given are left as they are, so several writers can each write theirs.

    Raises:
      ValueError: a chunk shape that does not divide ``shape`` (no edge chunks), an index
        outside the grid, a chunk of the wrong shape or dtype.
      DiskFullError: as :func:`write_arrays_local`, after removing what this call created.
    """
    arr = ChunkedArray(shape, dtype, chunk_shape, chunks)
    write_arrays_local(root, {path: arr}, fsync=fsync, write_metadata=write_metadata)


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


def _read_chunk_file(p: str, shape: tuple[int, ...], dtype: np.dtype, what: str) -> np.ndarray:
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
        out = aligned_empty(shape, dtype)
        _read_exact(fd, _byte_view(out), p, what)
        return out
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- plain zarr


_ZARR_FLOAT_NAMES: Final[tuple[str, ...]] = tuple(
    n for n in SUPPORTED_DTYPES if n == "bfloat16" or n.startswith(("float8_", "float4_"))
)


def register_zarr_dtypes() -> tuple[str, ...]:
    """Teaches zarr-python (3.1) the ``ml_dtypes`` floating types, so plain
    ``zarr.open_array`` reads ``bfloat16`` and ``float8_*`` arrays.

    Idempotent. Imports ``zarr`` only when called. ``int2``/``int4`` are not
    registered. Returns the names registered.
    """
    from dataclasses import dataclass

    from zarr.core.dtype import data_type_registry
    from zarr.core.dtype.common import DataTypeValidationError
    from zarr.core.dtype.npy.float import BaseFloat

    def make(name: str, native: np.dtype) -> type:
        @dataclass(frozen=True, kw_only=True)
        class MlDtypesFloat(BaseFloat):  # type: ignore[type-arg]
            dtype_cls = type(native)
            _zarr_v3_name = name
            _zarr_v2_names = ()

            @classmethod
            def from_native_dtype(cls, dtype: Any) -> MlDtypesFloat:
                if np.dtype(dtype) == native:
                    return cls(endianness="little")
                raise DataTypeValidationError(f"Invalid data type: {dtype}. Expected {native}")

            def to_native_dtype(self) -> np.dtype:
                return native

            @property
            def item_size(self) -> int:
                return native.itemsize

        MlDtypesFloat.__name__ = MlDtypesFloat.__qualname__ = f"MlDtypes_{name}"
        return MlDtypesFloat

    for name in _ZARR_FLOAT_NAMES:
        if name not in data_type_registry.contents:  # never override zarr's own
            data_type_registry.register(name, make(name, SUPPORTED_DTYPES[name]))
    return _ZARR_FLOAT_NAMES
