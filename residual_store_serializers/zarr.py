"""The zarr v3 format of the stored arrays: data types, chunk grid, ``zarr.json`` metadata.

Every array is a zarr v3 array folder::

    <path>/zarr.json      metadata, compact JSON with sorted keys
    <path>/c.0.0          the single chunk: the whole array, C order, little endian
    <path>/c              ... for a 0-d array
    (no chunk file)       ... for an array with a zero-length dimension

The chunk grid has one chunk that is the whole array (:func:`chunk_shape` = ``shape``,
with 0 replaced by 1), the chunk key encoding is zarr's ``"default"`` with
separator ``"."`` (``"c"`` followed by ``".0"`` per dimension: one folder per
array, no nested chunk folders, which saves two ``mkdir`` per array), and the
only codec is ``"bytes"`` (``"endian": "little"`` for items wider than a byte), so
the chunk file is exactly the array's raw bytes: no compression, no header. Its
checksum (:mod:`serializers.checksums`) is the checksum of the array in memory.

Chunked arrays. An array may also be stored on a regular grid of equal chunks
(``chunk_shape`` dividing ``shape`` in every dimension; edge chunks are not
supported): chunk ``(i, j)`` is the file ``c.i.j``, each holding the raw bytes of
its block, and ``zarr.json`` names the chunk shape (:class:`ChunkedArray`). With
the default ``chunk_shape`` (the whole array) everything is as above, byte for byte.

Attributes. ``zarr.json`` may carry a JSON object of user ``attributes`` (what plain
``zarr`` shows as ``arr.attrs``); readers check the structural fields and ignore them.
A folder of arrays may be a zarr v3 group: its ``zarr.json`` is
:func:`encode_group_metadata`.

This module only describes the format; the writers and readers of the bytes are
:mod:`serializers.local` (plain local folders), :mod:`serializers.kv` (tensorstore,
any kvstore) and :mod:`serializers.bundle` (one zip), peers that produce byte-identical
files and read each other's. What they all need of the format is public here (in
``__all__``): what every writer stores (:func:`disk_array`, :func:`disk_chunks`,
:func:`disk_metadata`), the checks every reader makes (:class:`ArrayRead`, :func:`check_zarr_metadata`,
:data:`MAX_METADATA_BYTES`) and the path and attribute checks every writer makes first.

Data types: ``bool``, ``int8``-``int64``, ``uint8``-``uint64``, ``float16``,
``float32``, ``float64``, ``complex64``, ``complex128``, and from ``ml_dtypes``
``bfloat16``, the ``float8_*`` types tensorstore knows, ``float4_e2m1fn``,
``int2`` and ``int4`` (stored one element per byte, as in memory). Plain ``zarr``
reads the numpy types as they are, and the floating ``ml_dtypes`` ones once
:mod:`serializers.zarr_compat` has taught it them, which :mod:`serializers.zarr_plugin`
does when zarr loads its plugins (``int2``/``int4`` stay tensorstore-only). The host is assumed little endian (x86, ARM).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Final

import ml_dtypes
import numpy as np

from .errors import CorruptDataError, UnsupportedDTypeError
from .manifest_schema import is_safe_relpath

__all__ = [
    "SUPPORTED_DTYPES",
    "EXTENSION_DTYPES",
    "zarr_dtype_name",
    "numpy_dtype",
    "chunk_shape",
    "chunk_key",
    "CHUNK_KEY_SEPARATOR",
    "check_chunk_shape",
    "chunk_grid",
    "chunk_index_key",
    "chunk_region",
    "ChunkedArray",
    "zarr_metadata",
    "encode_zarr_metadata",
    "group_metadata",
    "encode_group_metadata",
    # what every writer stores, and the checks every reader and writer makes (for the peers
    # serializers.local, serializers.kv and serializers.bundle)
    "PathLike",
    "Shape",
    "DTypeLike",
    "METADATA_KEY",
    "MAX_METADATA_BYTES",
    "check_zarr_metadata",
    "check_chunk_index",
    "check_relpath",
    "ArrayRead",
    "check_attributes",
    "describe_arrays",
    "disk_array",
    "byte_view",
    "disk_chunks",
    "disk_metadata",
]

PathLike = str | os.PathLike[str]
Shape = Sequence[int]
DTypeLike = str | np.dtype | type

METADATA_KEY: Final[str] = "zarr.json"
"""The name of an array's (or a group's) metadata file in its folder."""

MAX_METADATA_BYTES: Final[int] = 1 << 20
"""The largest ``zarr.json`` a reader accepts (one is a few hundred bytes): a hostile or damaged
store cannot make a reader load a huge file as metadata."""
"""The metadata file of every array (and group) folder."""


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
        *EXTENSION_DTYPES,
    ]  # fmt: skip
    for n in ml_names:  # the zarr3 data types tensorstore supports, then the extensions
        if hasattr(ml_dtypes, n):
            out[n] = np.dtype(getattr(ml_dtypes, n))
    return out


EXTENSION_DTYPES: Final[tuple[str, ...]] = ("float8_e4m3", "uint2", "uint4", "int1", "uint1")
"""The ``data_type`` names stored here that tensorstore's zarr3 driver (0.1.86) does not read:
the ``ml_dtypes`` types JAX makes beyond it. ``float8_e4m3``, ``uint2`` and ``uint4`` are the
names ``zarr-extensions`` registers; ``int1`` and ``uint1`` are this format's own. Each is
one byte an element, as ``ml_dtypes`` holds it in memory (docs/format.md, "Data types")."""


SUPPORTED_DTYPES: Final[Mapping[str, np.dtype]] = _supported_dtypes()
"""zarr v3 ``data_type`` name -> numpy dtype, for every dtype this package stores."""


def zarr_dtype_name(dtype: DTypeLike) -> str:
    """Returns the zarr v3 ``data_type`` of a numpy dtype (either byte order).

    Raises:
      UnsupportedDTypeError: for a dtype with no zarr v3 name here (strings,
        objects, datetimes, structured, ``uint4``...).
    """
    try:
        return _zarr_dtype_name(dtype)
    except TypeError:  # unhashable: not a dtype a store writes, but say so the same way
        return _zarr_dtype_name.__wrapped__(dtype)


@functools.lru_cache(maxsize=256)  # called per array on every write and read
def _zarr_dtype_name(dtype: DTypeLike) -> str:
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


# --------------------------------------------------------------------------- chunk grid


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


def chunk_index_key(index: Sequence[int]) -> str:
    """The key of chunk ``index`` inside the array folder: ``"c.1.0"``; ``"c"`` for ``()``."""
    return "c" + "".join(f"{CHUNK_KEY_SEPARATOR}{int(i)}" for i in index)


def chunk_region(index: Sequence[int], chunk_shape: Shape) -> tuple[slice, ...]:
    """The block of the array that chunk ``index`` holds, as a tuple of slices."""
    return tuple(slice(int(i) * int(c), (int(i) + 1) * int(c)) for i, c in zip(index, chunk_shape))


def check_chunk_index(index: Sequence[int], grid: tuple[int, ...], what: str) -> tuple[int, ...]:
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
            idx = check_chunk_index(index, grid, "ChunkedArray")
            a = disk_array(chunk)
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


# --------------------------------------------------------------------------- metadata


def zarr_metadata(
    shape: Shape,
    dtype: DTypeLike,
    chunk_shape: Shape | None = None,
    attributes: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``zarr.json`` contents for an array of ``shape`` and ``dtype``.

    ``chunk_shape`` (default: one chunk, the whole array) sets the regular chunk grid; see
    :func:`check_chunk_shape`. ``attributes``, a JSON-able mapping, is written as zarr's
    ``"attributes"`` (absent when ``None``). Without attributes, identical to what tensorstore's
    zarr3 driver writes for the same array.
    """
    name = zarr_dtype_name(dtype)
    cs = check_chunk_shape(shape, chunk_shape)
    bytes_codec: dict[str, Any] = {"name": "bytes"}
    if SUPPORTED_DTYPES[name].itemsize > 1:
        bytes_codec = {"configuration": {"endian": "little"}, "name": "bytes"}
    meta: dict[str, Any] = {
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
    if attributes is not None:
        meta["attributes"] = _attributes(attributes)
    return meta


def encode_zarr_metadata(
    shape: Shape,
    dtype: DTypeLike,
    chunk_shape: Shape | None = None,
    attributes: Mapping[str, Any] | None = None,
) -> bytes:
    """:func:`zarr_metadata` as the compact, key-sorted JSON bytes written to disk."""
    return _encode_json(zarr_metadata(shape, dtype, chunk_shape, attributes))


# zarr-python's inline consolidated metadata of a group with no member: an extension field that
# other readers may ignore ("must_understand": false), which zarr-python trusts in place of
# listing the group's folder.
_NO_MEMBERS: Final = {"kind": "inline", "metadata": {}, "must_understand": False}


def group_metadata(attributes: Mapping[str, Any] | None = None, *, no_members: bool = False) -> dict[str, Any]:
    """The ``zarr.json`` contents of a zarr v3 group holding ``attributes`` (a JSON-able
    mapping; ``{}`` when ``None``), e.g. a folder of arrays that plain ``zarr.open_group``
    opens.

    ``no_members=True`` says the group has no zarr member whatever files its folder holds (a
    folder of manifests, or one whose arrays are all in a zip): its consolidated metadata lists
    none, so zarr-python neither lists the folder nor warns that each file there "is not
    recognized as a component of a Zarr hierarchy".
    """
    metadata: dict[str, Any] = {"attributes": _attributes(attributes or {}), "node_type": "group", "zarr_format": 3}
    if no_members:
        metadata["consolidated_metadata"] = dict(_NO_MEMBERS)
    return metadata


def encode_group_metadata(attributes: Mapping[str, Any] | None = None, *, no_members: bool = False) -> bytes:
    """:func:`group_metadata` as compact, key-sorted JSON bytes: equal attributes, equal bytes."""
    return _encode_json(group_metadata(attributes, no_members=no_members))


def _attributes(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """``attributes`` as a JSON object, refused now (not when written) unless JSON can hold it.

    Raises:
      TypeError: not a mapping with string keys.
      ValueError: a value JSON cannot hold (an object, NaN, infinity).
    """
    if not isinstance(attributes, Mapping) or not all(isinstance(k, str) for k in attributes):
        raise TypeError(f"zarr attributes must be a mapping with str keys, got {attributes!r:.120}")
    out = dict(attributes)
    try:
        _encode_json(out)
    except (TypeError, ValueError) as e:
        raise ValueError(f"zarr attributes must be JSON: {e}") from None
    return out


def _encode_json(value: Mapping[str, Any]) -> bytes:
    """Compact JSON with sorted keys (so equal metadata is equal bytes), strict about NaN."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def check_zarr_metadata(
    raw: bytes, shape: tuple[int, ...], name: str, where: str, chunks: tuple[int, ...] | None = None
) -> None:
    """Raises CorruptDataError unless ``raw`` describes our raw layout with chunk shape
    ``chunks`` (default: the single chunk). Only the structural fields are compared: any
    ``attributes`` are the writer's business."""
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


# --------------------------------------------------------------------------- what every writer stores


def disk_array(arr: Any) -> np.ndarray:
    """``arr`` as a C-contiguous little-endian numpy array, copying only if needed."""
    a = arr if type(arr) is np.ndarray else np.asarray(arr)
    zarr_dtype_name(a.dtype)  # raises for unsupported dtypes
    if a.dtype.byteorder == ">" or (
        a.dtype.byteorder == "=" and sys.byteorder == "big" and a.dtype.itemsize > 1
    ):
        a = a.astype(a.dtype.newbyteorder("<"))
    # (np.ascontiguousarray would also turn a 0-d array into a 1-d one)
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def byte_view(a: np.ndarray) -> memoryview:
    """A flat uint8 view of a C-contiguous array (works for bfloat16, bool, 0-d)."""
    if a.size and _has_buffer_format(a.dtype):
        return a.data.cast("B")  # a fraction of the cost of the NumPy views below
    return a.reshape(-1).view(np.uint8).data


@functools.lru_cache(maxsize=64)
def _has_buffer_format(dtype: np.dtype) -> bool:
    """Whether the buffer protocol describes ``dtype`` (not bfloat16 nor the float8s)."""
    try:
        memoryview(np.zeros(1, dtype)).cast("B")
    except (ValueError, TypeError):
        return False
    return True


def disk_chunks(arr: np.ndarray | ChunkedArray) -> list[tuple[str, memoryview]]:
    """(key inside the array folder, raw bytes) of each chunk ``arr`` holds: what every
    writer stores. ``arr`` is a :func:`disk_array` result or a :class:`ChunkedArray`."""
    if isinstance(arr, ChunkedArray):
        return [(chunk_index_key(idx), byte_view(c)) for idx, c in arr.chunks.items()]
    key = chunk_key(arr.shape)
    return [] if key is None else [(key, byte_view(arr))]


def disk_metadata(arr: np.ndarray | ChunkedArray, attributes: Mapping[str, Any] | None = None) -> bytes:
    """The ``zarr.json`` bytes of ``arr`` (a :func:`disk_array` result or a :class:`ChunkedArray`)."""
    chunks = arr.chunk_shape if isinstance(arr, ChunkedArray) else None
    return encode_zarr_metadata(arr.shape, arr.dtype, chunks, attributes)


def check_attributes(arrays: Mapping[str, Any], attributes: Mapping[str, Any] | None) -> None:
    """Refuses, before anything is written, ``attributes`` (array path -> that array's
    attributes) naming an array not in ``arrays``, or holding what JSON cannot.

    Raises:
      ValueError, TypeError: as :func:`zarr_metadata` for bad attributes, or a path not written.
    """
    extra = sorted(set(attributes or {}) - set(arrays))
    if extra:
        raise ValueError(f"attributes for {describe_arrays(extra)}, which are not among the arrays written")
    for value in (attributes or {}).values():
        _attributes(value)


def describe_arrays(paths: Sequence[str]) -> str:
    """The arrays of a batch, for error messages: their paths if few, else how many."""
    return ", ".join(repr(p) for p in paths) if len(paths) <= 4 else f"{len(paths)} arrays"


def check_relpath(path: str) -> None:
    """Raises ValueError unless ``path`` is a safe array path (:func:`is_safe_relpath`)."""
    if not is_safe_relpath(path):
        raise ValueError(f"unsafe array path {path!r}: use [A-Za-z0-9._/-], relative, no '..'")


@dataclasses.dataclass(frozen=True)
class ArrayRead:
    """One read of an array, or of one chunk of it, checked as every reader checks what it is
    asked (:meth:`of`) before it touches a byte.

    Attributes:
      what: the array in words, for errors (``"array 'a/b'"``).
      shape: the array's shape, as ints.
      name: the zarr v3 name of its dtype.
      chunk_shape: the chunk shape of its grid, checked (:func:`check_chunk_shape`), where one
        is asked or a chunk is read; ``None``: the single chunk.
      index: the chunk read, inside the grid; ``None``: the whole array.
    """

    what: str
    shape: tuple[int, ...]
    name: str
    chunk_shape: tuple[int, ...] | None = None
    index: tuple[int, ...] | None = None

    @classmethod
    def of(
        cls,
        path: str,
        shape: Shape,
        dtype: DTypeLike,
        chunk_shape: Shape | None = None,
        chunk_index: Sequence[int] | None = None,
    ) -> ArrayRead:
        """The read of the array ``path`` of ``shape`` and ``dtype`` on a grid of ``chunk_shape``
        (``None``: one chunk), of its chunk ``chunk_index`` (``None``: the array whole).

        Raises:
          ValueError: an unsafe path (:func:`check_relpath`), a chunk shape that does not divide
            ``shape``, an index outside the grid.
          UnsupportedDTypeError: a dtype outside the format.
        """
        check_relpath(path)
        what = f"array {path!r}"
        shape = tuple(int(d) for d in shape)
        name = zarr_dtype_name(numpy_dtype(dtype))
        if chunk_shape is None and chunk_index is None:  # (a whole array's read: the common one)
            return cls(what, shape, name)
        cs = check_chunk_shape(shape, chunk_shape)
        index = None if chunk_index is None else check_chunk_index(chunk_index, chunk_grid(shape, cs), what)
        return cls(what, shape, name, cs, index)

    @property
    def dtype(self) -> np.dtype:
        return SUPPORTED_DTYPES[self.name]

    @property
    def stored(self) -> bool:
        """Whether anything of the array is stored: one with no elements has no chunk."""
        return all(self.shape)

    @property
    def key(self) -> str:
        """The key of what is read in the array's folder: its chunk's, or the single chunk's."""
        return chunk_index_key(self.index if self.index is not None else (0,) * len(self.shape))

    @property
    def piece(self) -> tuple[int, ...]:
        """The shape of what is read: the chunk's, or the whole array's."""
        return self.shape if self.index is None or self.chunk_shape is None else self.chunk_shape

    @property
    def region(self) -> tuple[slice, ...]:
        """The block of the array that is read."""
        return chunk_region(self.index if self.index is not None else (0,) * len(self.shape), self.piece)
