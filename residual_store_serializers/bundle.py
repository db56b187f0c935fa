"""The bundle: many small zarr v3 arrays as one file, a zip archive of stored (uncompressed) entries.

A context of hundreds of small residuals written as one folder per array costs a file, a
``zarr.json`` and an fsync per residual. A bundle holds them all in one file that plain zarr
(``zarr.storage.ZipStore``) and tensorstore (the ``zip`` kvstore) open as a zarr v3 group, every
array still reachable by name::

    zarr.json                 the group; its attributes are the caller's
    <name>/zarr.json          each array's metadata, with its attributes (name, kind, ...)
    <name>/c.0.0              each array's single chunk: its raw bytes (none when it is empty)

Entries are stored, never compressed, so each chunk is a byte range of the file: a reader takes
one read of the whole file and slices the arrays out as views. Every chunk's data starts on a
64-byte boundary (a padding extra field in its local header, as Android's ``zipalign`` does), so
the views can be handed to XLA's CPU client without a copy.

The metadata entries come first, then the chunks, then the central directory. Everything but the
chunks' bytes and their CRC-32s is a pure function of the arrays' shapes, dtypes and attributes
(:func:`bundle_layout`, made once per layout and reused for every write of it); a write computes
one CRC-32 per chunk (the zip's own checksum, which is also the array's checksum in the caller's
manifest: one pass over the bytes serves both) and patches it into a copy of the prebuilt headers.
A read checks every byte it does not checksum against those headers, so damage anywhere in the
file is found (:func:`check_bundle`). Those headers being a function of the chunks' CRC-32s, so
is the CRC-32 of the whole file (:func:`bundle_crc`, a few array operations): a reader that
checks it as the file lands checks both in one pass over the bytes.

This module is the format only: it computes bytes and views and does no I/O
(:mod:`serializers.local` writes and reads bundles in a folder, :mod:`serializers.kv` as one
object).

Limits: the classic zip format, so at most :data:`MAX_BUNDLE_ENTRIES` entries and
:data:`MAX_BUNDLE_BYTES` bytes in one bundle (a caller puts what does not fit in arrays of their
own); no zip64.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import struct
from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np

from .checksums import (
    crc32_bytes,
    crc32_extend,
    crc32_extended_sum,
    crc32_extension_map,
    crc32_zeros,
    parse_checksum,
    verify,
)
from .errors import ChecksumMismatchError, CorruptDataError
from .zarr import (
    Shape,
    byte_view,
    chunk_key,
    disk_array,
    encode_group_metadata,
    encode_zarr_metadata,
    numpy_dtype,
    zarr_dtype_name,
)

__all__ = [
    "BUNDLE_ALIGNMENT",
    "BUNDLE_FILE",
    "MAX_BUNDLE_BYTES",
    "MAX_BUNDLE_ENTRIES",
    "BundleArray",
    "BundleLayout",
    "bundle_crc",
    "bundle_layout",
    "bundle_parts",
    "bundle_views",
    "check_bundle",
    "crc_checksum",
]

BUNDLE_FILE: Final[str] = "bundle.zip"
"""The name of a bundle in the folder of the write it belongs to."""

BUNDLE_ALIGNMENT: Final[int] = 64
"""Every chunk's bytes start at a multiple of this offset in the file."""

MAX_BUNDLE_ENTRIES: Final[int] = 0xFFFF
"""Entries one classic zip holds: the group's ``zarr.json``, then two per non-empty array."""

MAX_BUNDLE_BYTES: Final[int] = 0xFFFFFFFF
"""Bytes one classic zip holds: its offsets are 32-bit."""

_LOCAL: Final = struct.Struct("<IHHHHHIIIHH")  # local file header, 30 bytes, then name and extra
_CENTRAL: Final = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory header, 46 bytes, then name
_END: Final = struct.Struct("<IHHHHIIH")  # end of central directory, 22 bytes
_LOCAL_SIG, _CENTRAL_SIG, _END_SIG = 0x04034B50, 0x02014B50, 0x06054B50
_VERSION: Final[int] = 20  # zip 2.0: stored entries, folders in names
_DOS_DATE: Final[int] = 0x21  # 1980-01-01: a fixed time, so equal layouts give equal bytes
_PAD_ID: Final[int] = 0xD935  # the extra field zipalign pads with; readers skip unknown ids
_CRC_AT_LOCAL: Final[int] = 14  # offset of the CRC-32 in a local header
_CRC_AT_CENTRAL: Final[int] = 16  # ... and in a central directory header
_NAME: Final = re.compile(r"[A-Za-z0-9._-]{1,255}")


@dataclasses.dataclass(frozen=True)
class BundleArray:
    """Where array ``i`` of a bundle lies: its ``shape``, zarr ``dtype`` name, and its bytes at
    ``[offset, offset + nbytes)`` of the file (``nbytes`` 0, no chunk, for an empty array)."""

    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True, eq=False)
class BundleLayout:
    """Everything of a bundle but its chunks' bytes and CRC-32s (:func:`bundle_layout`).

    ``text`` is every byte of the file that is not a chunk's (the metadata entries, each chunk's
    local header, the central directory and its end), in file order, with the chunks' CRC-32s
    set to 0; ``spans[k]`` is the ``(start, stop)`` of text piece ``k`` in ``text``: piece 0 runs
    up to the first chunk, piece ``k`` follows chunk ``k - 1``. ``crc_at[k]`` are the two
    offsets in ``text`` where chunk ``k``'s CRC-32 goes (its local header, the central
    directory). ``chunked`` lists the arrays that have a chunk, in file order.
    """

    arrays: tuple[BundleArray, ...]
    nbytes: int
    text: bytes
    spans: tuple[tuple[int, int], ...]
    chunked: tuple[int, ...]
    crc_at: np.ndarray  # int64 (chunks, 2)

    @functools.cached_property
    def _crc_terms(self) -> tuple[int, np.ndarray, np.ndarray]:
        """What :func:`bundle_crc` needs, worked out once: the file's CRC-32 is ``constant``
        XOR the chunks' CRC-32s each extended by the bytes after its two copies in the headers
        (the 4 bytes of each, as raw CRC-32s, are the value extended by 4) and after its bytes
        (``table``, see :func:`~serializers.checksums.crc32_extension_map`); ``chunked`` indexes
        the chunks' arrays."""
        n = self.nbytes
        chunks = [self.arrays[i] for i in self.chunked]
        # text piece 0 starts the file, piece k follows chunk k - 1
        starts = np.array([0] + [a.offset + a.nbytes for a in chunks], dtype=np.int64)
        spans = np.array(self.spans, dtype=np.int64).reshape(-1, 2)
        lengths = spans[:, 1] - spans[:, 0]
        text = memoryview(self.text)
        pieces = np.array([crc32_bytes(text[a:b]) for a, b in self.spans], dtype=np.uint32)
        offsets = np.array([a.offset for a in chunks], dtype=np.int64)
        sizes = np.array([a.nbytes for a in chunks], dtype=np.int64)
        after_chunk = n - offsets - sizes
        constant = int(crc32_zeros(n))
        for raw, after in ((pieces ^ crc32_zeros(lengths), n - starts - lengths), (crc32_zeros(sizes), after_chunk)):
            constant ^= int(np.bitwise_xor.reduce(crc32_extend(raw, after), axis=None)) if raw.size else 0
        # chunk k's CRC-32 in the headers: in its local header (text piece k) and in the central
        # directory (the last piece), each from text offset to file offset
        k = np.arange(len(chunks))
        local = starts[k] + self.crc_at[:, 0] - spans[k, 0]
        central = starts[-1] + self.crc_at[:, 1] - spans[-1, 0]
        table = crc32_extension_map(np.stack([n - local, n - central, after_chunk], axis=1))
        return constant, table, np.array(self.chunked, dtype=np.int64)


class _Zip:
    """Builds a classic zip of stored entries whose bytes are partly left to the caller."""

    def __init__(self) -> None:
        self.parts: list[bytearray | int] = [bytearray()]  # bytes, or a hole of that many bytes
        self.offset = 0
        self.central = bytearray()
        self.count = 0

    def _emit(self, data: bytes) -> None:
        tail = self.parts[-1]
        assert isinstance(tail, bytearray)
        tail += data
        self.offset += len(data)

    def entry(self, name: str, size: int, crc: int, *, align: int = 1) -> tuple[int, int]:
        """Writes a local header for ``name`` (the data start padded to ``align``); returns where
        its CRC-32 lies in the current part and where in the central directory."""
        encoded = name.encode("ascii")
        start = self.offset + _LOCAL.size + len(encoded)
        pad = -start % align
        if 0 < pad <= 4:  # an extra field is its 4-byte header and (tensorstore: not empty) data
            pad += align
        extra = struct.pack("<HH", _PAD_ID, pad - 4) + bytes(pad - 4) if pad else b""
        header_at, tail = self.offset, self.parts[-1]
        assert isinstance(tail, bytearray)
        local_crc = len(tail) + _CRC_AT_LOCAL
        self._emit(
            _LOCAL.pack(_LOCAL_SIG, _VERSION, 0, 0, 0, _DOS_DATE, crc, size, size, len(encoded), len(extra))
            + encoded
            + extra
        )
        central_crc = len(self.central) + _CRC_AT_CENTRAL
        self.central += _CENTRAL.pack(
            _CENTRAL_SIG, _VERSION, _VERSION, 0, 0, 0, _DOS_DATE, crc, size, size, len(encoded), 0, 0, 0, 0, 0,
            header_at,
        ) + encoded
        self.count += 1
        return local_crc, central_crc

    def data(self, payload: bytes) -> None:
        self._emit(payload)

    def hole(self, size: int) -> None:
        """Leaves ``size`` bytes for the caller (a chunk), then starts a new part."""
        self.parts.append(size)
        self.parts.append(bytearray())
        self.offset += size

    def finish(self) -> tuple[int, int]:
        """Writes the central directory and its end; returns where the central directory starts
        in the last part, and the file's size."""
        tail = self.parts[-1]
        assert isinstance(tail, bytearray)
        central_in_tail = len(tail)
        central_at = self.offset
        self._emit(bytes(self.central))
        self._emit(_END.pack(_END_SIG, 0, 0, self.count, self.count, len(self.central), central_at, 0))
        return central_in_tail, self.offset


def bundle_layout(
    arrays: Sequence[tuple[str, Shape, Any]],
    attributes: Sequence[Mapping[str, Any] | None] | None = None,
    group_attributes: Mapping[str, Any] | None = None,
) -> BundleLayout:
    """The layout of a bundle of arrays given as ``(name, shape, dtype)``: array ``i`` at
    ``<name>/`` in the group (a name of ``[A-Za-z0-9._-]``), with zarr ``attributes[i]``
    (JSON-able), and the group's ``group_attributes``.

    A pure function of its arguments: make it once per layout, reuse it for every write and read.

    Raises:
      ValueError: the arrays do not fit one classic zip (:data:`MAX_BUNDLE_ENTRIES`,
        :data:`MAX_BUNDLE_BYTES`).
      UnsupportedDTypeError: a dtype no zarr v3 array here stores.
    """
    attrs = list(attributes) if attributes is not None else [None] * len(arrays)
    if len(attrs) != len(arrays):
        raise ValueError(f"{len(attrs)} attribute maps for {len(arrays)} arrays")
    paths = [name for name, _, _ in arrays]
    if len(set(paths)) != len(paths) or not all(_NAME.fullmatch(p) and p not in (".", "..") for p in paths):
        raise ValueError(f"bundle array names must be distinct and of [A-Za-z0-9._-]: {paths[:8]}")
    shapes = [tuple(int(d) for d in shape) for _, shape, _ in arrays]
    names = [zarr_dtype_name(numpy_dtype(dtype)) for _, _, dtype in arrays]
    sizes = [int(np.prod(s, dtype=np.int64)) * numpy_dtype(n).itemsize for s, n in zip(shapes, names)]
    keys = [chunk_key(s) for s in shapes]
    entries = 1 + len(arrays) + sum(k is not None for k in keys)
    if entries > MAX_BUNDLE_ENTRIES:
        raise ValueError(f"{len(arrays)} arrays make {entries} zip entries, over the {MAX_BUNDLE_ENTRIES} of one bundle")

    z = _Zip()
    for name, payload in [("zarr.json", encode_group_metadata(group_attributes))] + [
        (f"{path}/zarr.json", encode_zarr_metadata(shape, dtype, None, a))
        for path, shape, dtype, a in zip(paths, shapes, names, attrs)
    ]:
        z.entry(name, len(payload), crc32_bytes(payload))
        z.data(payload)
    placed: dict[int, int] = {}
    crc_spots: list[tuple[int, int]] = []  # (part index of the local header, offset), central offset
    central_spots: list[int] = []
    for i, key in enumerate(keys):
        if key is None:
            continue
        local, central = z.entry(f"{paths[i]}/{key}", sizes[i], 0, align=BUNDLE_ALIGNMENT)
        crc_spots.append((len(z.parts) - 1, local))
        central_spots.append(central)
        placed[i] = z.offset
        z.hole(sizes[i])
    central_in_tail, nbytes = z.finish()
    if nbytes > MAX_BUNDLE_BYTES:
        raise ValueError(f"a bundle of {nbytes:,} bytes is over the {MAX_BUNDLE_BYTES:,} of a classic zip")
    texts = [bytes(p) for p in z.parts if not isinstance(p, int)]
    starts = np.cumsum([0] + [len(t) for t in texts])
    # parts alternate bytes, hole, bytes, ...: the local header of chunk k lies in text k
    crc_at = np.array(
        [[starts[part // 2] + local, starts[-2] + central_in_tail + central]
         for (part, local), central in zip(crc_spots, central_spots)],
        dtype=np.int64,
    ).reshape(-1, 2)
    return BundleLayout(
        arrays=tuple(
            BundleArray(shape, name, placed.get(i, 0), sizes[i] if i in placed else 0)
            for i, (shape, name) in enumerate(zip(shapes, names))
        ),
        nbytes=nbytes,
        text=b"".join(texts),
        spans=tuple((int(starts[k]), int(starts[k + 1])) for k in range(len(texts))),
        chunked=tuple(placed),
        crc_at=crc_at,
    )


_BYTE: Final = np.arange(4, dtype=np.int64)


def _patched(layout: BundleLayout, crcs: Sequence[int]) -> memoryview:
    """``layout.text`` with chunk ``k``'s CRC-32 ``crcs[k]`` in place (little endian)."""
    text = np.frombuffer(layout.text, dtype=np.uint8).copy()
    if len(crcs):
        values = np.asarray(crcs, dtype="<u4").view(np.uint8).reshape(-1, 1, 4)
        text[layout.crc_at[:, :, None] + _BYTE] = values
    return text.data


def bundle_parts(layout: BundleLayout, arrays: Sequence[Any]) -> tuple[list[memoryview | bytes], list[int]]:
    """The bytes of the bundle of ``arrays`` (array ``i`` as ``layout.arrays[i]`` says), as a
    list of buffers to write one after another (the arrays' own buffers, not copied, between the
    headers), and the CRC-32 of each array's bytes (0 for an empty one).

    Raises:
      ValueError: an array whose shape or dtype is not the layout's.
    """
    if len(arrays) != len(layout.arrays):
        raise ValueError(f"{len(arrays)} arrays for a bundle layout of {len(layout.arrays)}")
    views: dict[int, memoryview] = {}
    crcs = [0] * len(arrays)
    for i, (arr, where) in enumerate(zip(arrays, layout.arrays)):
        a = disk_array(arr)
        if a.shape != where.shape or zarr_dtype_name(a.dtype) != where.dtype:
            raise ValueError(
                f"array {i} is {a.dtype}{list(a.shape)}, the bundle layout has {where.dtype}{list(where.shape)}"
            )
        if where.nbytes:
            views[i] = byte_view(a)
            crcs[i] = crc32_bytes(views[i])
    text = _patched(layout, [crcs[i] for i in layout.chunked])
    (start, stop), *rest = layout.spans
    parts: list[memoryview | bytes] = [text[start:stop]]
    for i, (start, stop) in zip(layout.chunked, rest):
        parts += [views[i], text[start:stop]]
    return parts, crcs


def bundle_crc(layout: BundleLayout, crcs: Any) -> int:
    """The CRC-32 of the whole bundle whose arrays' CRC-32s are ``crcs`` (one per array of
    ``layout``, in order: a uint32 array, or ints; an empty array's is not used), worked out
    without its bytes: every byte that is not an array's is the layout's, the CRC-32s in place.

    So a reader that checks the file's CRC-32 as it lands against this value checks each
    array's bytes against its CRC-32 and every other byte against the headers, in one pass
    over the bytes. Made once per layout, each use is a few array operations.

    Raises:
      ValueError: not one CRC-32 per array.
    """
    values = np.asarray(crcs, dtype=np.uint32)
    if values.shape != (len(layout.arrays),):
        raise ValueError(f"{values.size} CRC-32s for a bundle layout of {len(layout.arrays)} arrays")
    constant, table, chunked = layout._crc_terms
    return constant ^ crc32_extended_sum(table, values[chunked])


def crc_checksum(crc: int) -> str:
    """An array's CRC-32 as a checksum string (``"crc32:<8 hex digits>"``) that
    :func:`serializers.checksums.verify` checks."""
    return f"crc32:{crc:08x}"


def _file_bytes(buffer: np.ndarray | memoryview) -> np.ndarray:
    """A bundle's bytes (an array of any dtype, or a buffer) as one flat ``uint8`` array."""
    if isinstance(buffer, np.ndarray):
        return buffer.reshape(-1).view(np.uint8)
    return np.frombuffer(buffer, dtype=np.uint8)


def bundle_views(arrays: Sequence[BundleArray], buffer: np.ndarray | memoryview) -> list[np.ndarray]:
    """Each of ``arrays`` (a layout's ``arrays``, or as a manifest records them) of the bundle
    whose bytes are ``buffer`` (the whole file), as a view into it (a fresh empty array for an
    empty one). The caller checks the bytes (a whole-file checksum, or :func:`check_bundle`).

    Raises:
      CorruptDataError: an array that does not lie inside ``buffer``.
    """
    raw = _file_bytes(buffer)
    size = raw.size
    out = []
    for where in arrays:
        offset, nbytes = where.offset, where.nbytes
        if offset < 0 or offset + nbytes > size:
            raise CorruptDataError(f"an array at bytes {offset:,}+{nbytes:,} of a bundle of {size:,}")
        dtype = numpy_dtype(where.dtype)
        if nbytes != math.prod(where.shape) * dtype.itemsize:
            raise CorruptDataError(f"an array of {nbytes:,} bytes recorded as {where.dtype}{list(where.shape)}")
        # one constructor call: a C-ordered view of exactly those bytes, its base the buffer
        out.append(np.ndarray(where.shape, dtype, raw, offset) if nbytes else np.empty(where.shape, dtype))
    return out


def check_bundle(
    layout: BundleLayout,
    buffer: np.ndarray | memoryview,
    checksums: Sequence[str | None],
    *,
    what: str,
    names: Sequence[str] | None = None,
) -> None:
    """Checks every byte of a bundle read back: each array's bytes against its checksum
    (``checksums[i]``, from the caller's manifest; ``None`` skips that array), every other byte
    against the layout's headers with the arrays' CRC-32s in place (so plain zip readers, which
    check those, read what this library reads). ``names[i]`` names array ``i`` in messages
    (default ``"array <i>"``).

    Raises:
      CorruptDataError: a mismatch, naming ``what`` and the array or the part of the file.
    """
    raw = _file_bytes(buffer)
    if raw.size != layout.nbytes:
        raise CorruptDataError(f"{what}: bundle of {raw.size:,} bytes where {layout.nbytes:,} were written")
    file = raw.data
    crcs = []
    for i in layout.chunked:
        where = layout.arrays[i]
        data = file[where.offset : where.offset + where.nbytes]
        crc = crc32_bytes(data)
        expected = checksums[i]
        if expected is not None:
            label = f"{what}: {names[i] if names is not None else f'array {i}'}"
            algorithm, digest = parse_checksum(expected, what=label)
            if algorithm != "crc32":
                verify(data, expected, what=label)
            elif int(digest, 16) != crc:
                raise ChecksumMismatchError(f"{label}: checksum mismatch (stored {expected}, computed {crc_checksum(crc)})")
        crcs.append(crc)
    text = _patched(layout, crcs)
    at = 0
    for k, (start, stop) in enumerate(layout.spans):
        if k:
            where = layout.arrays[layout.chunked[k - 1]]
            at = where.offset + where.nbytes
        if file[at : at + stop - start] != text[start:stop]:
            raise CorruptDataError(f"{what}: the bundle's zip headers at byte {at:,} differ from what was written")
