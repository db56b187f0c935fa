"""Versioned msgpack manifests, and strict validation of untrusted manifest bytes.

A manifest is one msgpack map. Two keys identify it and come first in every check:
``"format"`` (what kind of document: a context, or a serialized backward) and
``"version"`` (an int, :data:`FORMAT_VERSION` for what this library writes). The
rest is described by a :class:`ManifestSchema` (:mod:`serializers.manifest_schema`): the
format name and a frozen ``msgspec.Struct`` of the fields (:class:`ContextFields`,
:class:`BackwardFields`, and :class:`ArrayRecordFields` for each array), whose annotated
types say each field's type, range and length. msgspec checks a decoded map against the
struct in one pass; the struct is the one description that the format documentation, the
writer and the validator share. Rules across fields that a type cannot state (the chunk
rules of :class:`ArrayRecord`) are small checks after it.

What callers receive is unchanged by the structs: :func:`decode_manifest` returns the
decoded map itself (its records plain maps), checked against the struct, so the store keeps
reading fields by name and keeps extra keys.

Why so strict: a manifest is read from disk written by another process, maybe
another version, maybe torn by a crash. :func:`decode_manifest` therefore raises
nothing but :class:`~serializers.errors.CorruptDataError` (or its subclass
:class:`~serializers.errors.UnsupportedVersionError`) for any input bytes at all:
sizes are capped before and during decoding, map keys must be strings, ext types
(including msgpack timestamps) and duplicate keys are refused, and every required
field is checked for presence and type. Unknown extra keys are kept (no struct forbids
them): a minor addition by a later writer must not break an older reader. A version newer than
:data:`FORMAT_VERSION` is refused before the fields are looked at, since a future
version may have changed them.

A manifest protects itself (version 3 on): its last field, ``"manifest_checksum"``, holds
:func:`~serializers.checksums.checksum` of every byte of the encoding before that field's
value, so a flipped bit anywhere in it (a field name, a value, the map header, the version
itself) is :class:`~serializers.errors.CorruptDataError` before any field is trusted. See
:func:`seal_manifest`. Versions 1 and 2 had no such field; they are still read (the store
cross-checks their fields instead), and a manifest of any version that carries the field must
match it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, NoReturn, TypeGuard

import msgpack

from .checksums import checksum, verify
from .errors import CorruptDataError, UnsupportedVersionError
from .manifest_schema import (
    ARRAY_RECORD_FIELDS,
    BACKWARD_FORMAT,
    BACKWARD_SCHEMA,
    CONTEXT_FORMAT,
    CONTEXT_SCHEMA,
    MAX_ARRAY_ELEMENTS,
    MAX_CHUNKS_PER_ARRAY,
    RELPATH_PATTERN,
    ArrayRecordFields,
    BackwardFields,
    ContextFields,
    Field,
    InvalidFields,
    ManifestSchema,
    is_safe_relpath,
    type_name,
    validate_fields,
)

__all__ = [
    "FORMAT_VERSION",
    "CONTEXT_FORMAT",
    "BACKWARD_FORMAT",
    "MAX_MANIFEST_BYTES",
    "Field",
    "ManifestSchema",
    "CONTEXT_SCHEMA",
    "BACKWARD_SCHEMA",
    "ARRAY_RECORD_FIELDS",
    "ArrayRecordFields",
    "ContextFields",
    "BackwardFields",
    "RELPATH_PATTERN",
    "ArrayRecord",
    "chunked_checksum",
    "encode_manifest",
    "decode_manifest",
    "is_safe_relpath",
    "manifest_outline",
    "seal_manifest",
    "SELF_CHECKSUM_FIELD",
    "SEALED_SINCE",
    "MAX_ARRAY_ELEMENTS",
    "MAX_CHUNKS_PER_ARRAY",
]
# (the schema's names are serializers.manifest_schema's, named here too: one place to import
# everything about manifests from)

FORMAT_VERSION: Final[int] = 4
"""The manifest version this library writes, and the newest it reads (every earlier one is
read). History, dated by the commit that introduced each:

- 1 (2026-11-29): the first manifests.
- 2 (2026-12-01): the call record a fresh split resumes from (``spec.call``), and signatures
  from what is computed (``rs2-``).
- 3 (2026-12-01): the manifest's checksum of its own bytes (``manifest_checksum``, see
  :data:`SEALED_SINCE`) and the cross-checks against the signature's layout.
- 4 (2026-12-03): bundles (a context's own arrays in one file: the context's ``bundle`` and its
  records' ``offset``).
"""

MAX_MANIFEST_BYTES: Final[int] = 64 << 20
"""Default cap on the size of a manifest :func:`decode_manifest` accepts."""

SELF_CHECKSUM_FIELD: Final[str] = "manifest_checksum"
"""The field that holds a manifest's checksum of its own bytes (see :func:`seal_manifest`)."""

SEALED_SINCE: Final[int] = 3
"""The first version whose manifests must carry :data:`SELF_CHECKSUM_FIELD`."""

# elements of one msgpack array or map: a hostile manifest's huge list is refused while it is
# decoded, before it is built (a context's residual list, a record's chunk list, a call
# record's input list all stay far below)
_MAX_CONTAINER_LEN: Final[int] = 1 << 18


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class ArrayRecord:
    """One array of a stored context, as listed in its manifest.

    Attributes:
      name: where the residual came from (``"tanh model.py:12"``); free text.
      path: the array's folder, relative to the store root (a zarr v3 array).
      shape: the array's shape.
      dtype: a zarr v3 data type name (``"float32"``, ``"bfloat16"``) or a
        caller-defined name such as ``"key<fry>"``; this module does not parse it.
      nbytes: the size of the array's data in bytes.
      checksum: :func:`serializers.checksums.checksum` of the data.
      input_path: the key path of the primal input this array is, or ``None``.
      shared: whether the array is stored once for many contexts (an input).
      chunk_shape: for an array stored as a grid of chunks (a sharded array, one chunk per
        shard), the chunk shape, which divides ``shape``; ``None`` for one chunk.
      chunk_checksums: with ``chunk_shape``: ``(chunk index, checksum)`` for every chunk of
        the grid, in C order of the index; ``checksum`` is then
        :func:`chunked_checksum` of them.
      offset: for an array in its context's bundle, where its bytes start in the bundle file;
        ``None`` for an array in a folder of its own.
    """

    name: str
    path: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    checksum: str
    input_path: str | None = None
    shared: bool = False
    chunk_shape: tuple[int, ...] | None = None
    chunk_checksums: tuple[tuple[tuple[int, ...], str], ...] | None = None
    offset: int | None = None

    def __post_init__(self) -> None:
        self._normalize()
        try:
            validate_fields(self.to_dict(), ArrayRecordFields)
            self._check_chunks()
        except InvalidFields as e:
            raise ValueError(f"invalid ArrayRecord: {e}") from None

    def _normalize(self) -> None:
        """Shapes as tuples of ints, chunk checksums as sorted tuples."""
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.chunk_shape is not None:
            object.__setattr__(self, "chunk_shape", tuple(int(d) for d in self.chunk_shape))
        if self.chunk_checksums is not None:
            try:
                pairs = tuple(
                    sorted((tuple(int(i) for i in idx), cs) for idx, cs in self.chunk_checksums)
                )
            except (TypeError, ValueError):
                raise ValueError(
                    "invalid ArrayRecord: chunk_checksums must be (chunk index, checksum) pairs"
                ) from None
            object.__setattr__(self, "chunk_checksums", pairs)

    @property
    def chunked(self) -> bool:
        """Whether the array is stored as a grid of chunks (``chunk_shape`` is set)."""
        return self.chunk_shape is not None

    @property
    def bundled(self) -> bool:
        """Whether the array lies in its context's bundle (``offset`` is set)."""
        return self.offset is not None

    def _check_chunks(self) -> None:
        if self.offset is not None and (self.chunk_shape is not None or self.shared):
            raise InvalidFields("field 'offset' is only for a context's own single-chunk arrays")
        if (self.chunk_shape is None) != (self.chunk_checksums is None):
            raise InvalidFields("'chunk_shape' and 'chunk_checksums' must be given together")
        if self.chunk_shape is None or self.chunk_checksums is None:
            return
        cs, shape = self.chunk_shape, self.shape
        if len(cs) != len(shape) or any(c < 1 or d % c for d, c in zip(shape, cs)):
            raise InvalidFields(f"field 'chunk_shape' {list(cs)} does not divide 'shape' {list(shape)}")
        grid = tuple(d // c for d, c in zip(shape, cs))
        indices = [idx for idx, _ in self.chunk_checksums]
        if len(set(indices)) != len(indices):
            raise InvalidFields("field 'chunk_checksums' lists a chunk twice")
        if any(len(idx) != len(grid) or any(i >= n for i, n in zip(idx, grid)) for idx in indices):
            raise InvalidFields(f"field 'chunk_checksums' has a chunk index outside the grid {list(grid)}")
        if len(indices) != math.prod(grid):
            raise InvalidFields(
                f"field 'chunk_checksums' lists {len(indices)} chunks, the grid has {math.prod(grid)}"
            )
        if self.checksum != chunked_checksum(self.chunk_checksums):
            raise InvalidFields("field 'checksum' is not the checksum of 'chunk_checksums'")

    def to_dict(self) -> dict[str, Any]:
        """Returns the msgpack-able map stored in a manifest."""
        out: dict[str, Any] = {
            "name": self.name,
            "path": self.path,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "nbytes": self.nbytes,
            "checksum": self.checksum,
            "input_path": self.input_path,
            "shared": self.shared,
        }
        if self.chunk_shape is not None:  # absent for single-chunk arrays: same bytes as before
            out["chunk_shape"] = list(self.chunk_shape)
            out["chunk_checksums"] = [[list(idx), cs] for idx, cs in self.chunk_checksums or ()]
        if self.offset is not None:  # absent for an array of its own: same bytes as before
            out["offset"] = self.offset
        return out

    @classmethod
    def from_dict(
        cls, d: Mapping[str, Any], *, what: str = "array record", fields_checked: bool = False
    ) -> ArrayRecord:
        """Builds a record from an (untrusted) map; extra keys are ignored.

        ``fields_checked``: the map is an entry of a manifest's ``arrays`` that
        :func:`decode_manifest` returned, which has checked its fields already (the chunk
        rules are checked here either way).

        Raises:
          CorruptDataError: naming ``what`` and the field, if ``d`` does not match
            :class:`ArrayRecordFields`.
        """
        try:
            if not fields_checked:
                validate_fields(dict(d) if isinstance(d, Mapping) else d, ArrayRecordFields)
        except InvalidFields as e:
            raise CorruptDataError(f"{what}: {e}") from None
        # The map's fields are checked: build the record without checking them a second time
        # through __post_init__ (manifests are read on every get); the chunk rules still apply.
        try:
            return cls._built(d)
        except ValueError as e:
            raise CorruptDataError(f"{what}: {e}") from None
        except InvalidFields as e:
            raise CorruptDataError(f"{what}: invalid ArrayRecord: {e}") from None

    @classmethod
    def for_writing(cls, **fields: Any) -> ArrayRecord:
        """A record a writer puts in a manifest: its fields are checked by
        :func:`encode_manifest` when the manifest is encoded, not here as well (a writer makes
        one per array per write); the chunk rules are checked here.

        Raises:
          ValueError: chunk fields that disagree with the shape or the checksum.
        """
        try:
            return cls._built(fields)
        except InvalidFields as e:
            raise ValueError(f"invalid ArrayRecord: {e}") from None

    def checked(self) -> ArrayRecord:
        """This record, its fields checked against :class:`ArrayRecordFields` (what
        :func:`encode_manifest` checks of each record).

        Raises:
          ValueError: a field of the wrong kind, naming it.
        """
        try:
            validate_fields(self.to_dict(), ArrayRecordFields)
        except InvalidFields as e:
            raise ValueError(f"invalid ArrayRecord: {e}") from None
        return self

    def relocated(self, path: str, checksum: str) -> ArrayRecord:
        """This record at ``path`` with ``checksum``, not checked again: for a writer that
        checked a record once per signature and gives each write its own folder and bytes
        (``path`` must be a safe relative path, ``checksum`` a checksum string)."""
        record = object.__new__(type(self))
        record.__dict__.update(self.__dict__)
        record.__dict__["path"] = path
        record.__dict__["checksum"] = checksum
        return record

    @classmethod
    def _built(cls, d: Mapping[str, Any]) -> ArrayRecord:
        record = object.__new__(cls)
        # a frozen dataclass's fields live in its __dict__: filled at once, as __init__ would
        record.__dict__.update({name: d.get(name, default) for name, default in _record_defaults()})
        record._normalize()
        record._check_chunks()
        return record


@functools.cache
def _record_defaults() -> tuple[tuple[str, Any], ...]:
    """``(field name, default)`` of every :class:`ArrayRecord` field, in order."""
    return tuple((f.name, f.default) for f in dataclasses.fields(ArrayRecord))


def chunked_checksum(chunk_checksums: Sequence[tuple[Sequence[int], str]]) -> str:
    """The checksum of a chunked array: over its chunks' checksums, not its bytes.

    :func:`serializers.checksums.checksum` of the UTF-8 lines ``"<i>.<j> <checksum>\\n"`` (the
    chunk index joined by dots, a space, its checksum), one per chunk in C order of the index,
    concatenated. Any change to any chunk changes it, and it needs only the chunks' checksums,
    not the whole array in one place.
    """
    lines = "".join(
        f"{'.'.join(str(int(i)) for i in idx)} {cs}\n"
        for idx, cs in sorted((tuple(int(i) for i in idx), cs) for idx, cs in chunk_checksums)
    )
    return checksum(lines.encode())


# --------------------------------------------------------------------------- codec


def _is_int(v: object) -> TypeGuard[int]:
    """Whether ``v`` is an int and not a bool (msgpack keeps them apart; Python does not)."""
    return isinstance(v, int) and not isinstance(v, bool)



def _plain(v: Any) -> Any:
    """Turns :class:`ArrayRecord` values (and tuples of them) into plain maps."""
    if isinstance(v, ArrayRecord):
        return v.to_dict()
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


_SEAL_PLACEHOLDER: Final[str] = checksum(b"")  # same length as every checksum of this algorithm


def _pack(d: Mapping[str, Any]) -> bytes:
    return msgpack.packb(d, use_bin_type=True, datetime=False)


def seal_manifest(d: Mapping[str, Any]) -> bytes:
    """Encodes the map ``d`` as msgpack with its self checksum as the last field.

    The map is ``d`` (any ``"manifest_checksum"`` it has dropped) followed by
    ``"manifest_checksum": "xxh3_64:<16 hex digits>"``, whose value is
    :func:`~serializers.checksums.checksum` of every byte of the encoding before that value (the
    map header, every other field, the key ``"manifest_checksum"``). The value is a 24-character
    str, so its encoding is the manifest's last 25 bytes (``0xb8`` and the 24 characters), and
    ``checksum(data[:-25]) == data[-24:].decode()`` checks a manifest by hand.

    Nothing is validated: :func:`encode_manifest` checks the schema first. Tools and tests use
    this to write a deliberately odd manifest that still passes the self check.

    Raises:
      ValueError: ``d`` is not msgpack-able.
    """
    out = {k: v for k, v in d.items() if k != SELF_CHECKSUM_FIELD}
    out[SELF_CHECKSUM_FIELD] = _SEAL_PLACEHOLDER
    try:
        data = _pack(out)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"manifest is not msgpack-able: {e}") from None
    body = data[: -len(_pack_str(_SEAL_PLACEHOLDER))]
    return body + _pack_str(checksum(body))


def _pack_str(s: str) -> bytes:
    return msgpack.packb(s, use_bin_type=True)


def _check_seal(data: bytes | bytearray | memoryview, doc: dict[str, Any], what: str) -> None:
    """Raises :class:`CorruptDataError` unless ``doc`` (decoded from ``data``) ends with a
    ``"manifest_checksum"`` that matches the bytes before its value."""
    value = doc.get(SELF_CHECKSUM_FIELD)
    if value is None and SELF_CHECKSUM_FIELD not in doc:
        raise CorruptDataError(f"{what}: missing required field {SELF_CHECKSUM_FIELD!r}")
    if not isinstance(value, str) or next(reversed(doc)) != SELF_CHECKSUM_FIELD:
        raise CorruptDataError(f"{what}: field {SELF_CHECKSUM_FIELD!r} must be a str, the last field")
    tail = _pack_str(value)
    view = memoryview(data).cast("B")
    if len(view) <= len(tail) or view[-len(tail) :] != tail:  # a str of this value, at the very end
        raise CorruptDataError(f"{what}: field {SELF_CHECKSUM_FIELD!r} must be the last field")
    verify(view[: -len(tail)], value, what=f"{what}: manifest")


def encode_manifest(
    d: Mapping[str, Any], *, schema: ManifestSchema = CONTEXT_SCHEMA, records_checked: bool = False
) -> bytes:
    """Encodes a manifest map as msgpack, after checking it against ``schema``.

    ``"format"`` and ``"version"`` are filled in when absent. Values of the
    ``"arrays"`` list may be :class:`ArrayRecord`\\ s; tuples become lists. The
    result is sealed with its self checksum (:func:`seal_manifest`).

    ``records_checked``: every entry of ``"arrays"`` is the map of a record the caller checked
    (:meth:`ArrayRecord.checked`, or :meth:`ArrayRecord.relocated` from one), so entries are
    not checked one by one again; every other field still is. A context of hundreds of
    residuals is written many times with the same records but for their paths and checksums.

    Raises:
      ValueError: if ``d`` does not match ``schema`` or cannot be encoded (a bug
        in the caller: nothing invalid is ever written).
    """
    out = {k: _plain(v) for k, v in d.items() if k != SELF_CHECKSUM_FIELD}
    out.setdefault("format", schema.format)
    out.setdefault("version", FORMAT_VERSION)
    if out["format"] != schema.format or out["version"] != FORMAT_VERSION:
        raise ValueError(
            f"refusing to encode format {out['format']!r} version {out['version']!r}; "
            f"this schema writes {schema.format!r} version {FORMAT_VERSION}"
        )
    try:
        records = out.get("arrays")
        checked = records_checked and isinstance(records, list) and all(type(r) is dict for r in records)
        validate_fields({**out, "arrays": []} if checked else out, schema.struct)
    except InvalidFields as e:
        raise ValueError(f"refusing to encode an invalid manifest: {e}") from None
    return seal_manifest(out)


def _reject_ext(code: int, data: bytes) -> NoReturn:
    raise ValueError(f"msgpack ext type {code} is not allowed in a manifest")


def _unique_keys(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate key in a msgpack map")
    return out


def decode_manifest(
    data: bytes,
    *,
    what: str,
    schema: ManifestSchema = CONTEXT_SCHEMA,
    max_bytes: int = MAX_MANIFEST_BYTES,
) -> dict[str, Any]:
    """Decodes and validates untrusted manifest bytes.

    Args:
      data: the bytes read from storage.
      what: names the manifest (file or key) in error messages.
      schema: the kind of manifest expected (:data:`CONTEXT_SCHEMA` or
        :data:`BACKWARD_SCHEMA`, or an extension of one).
      max_bytes: refuse larger inputs without decoding them.

    Returns:
      The manifest map, with all of ``schema``'s required fields present and well
      typed, plus whatever extra keys it had; its ``"manifest_checksum"``, checked,
      is left out.

    Raises:
      UnsupportedVersionError: ``version`` is newer than :data:`FORMAT_VERSION`.
      CorruptDataError: anything else wrong, naming ``what`` and the field. For a
        manifest of version 3 or later (or any that has a ``"manifest_checksum"``),
        a self checksum that is missing or does not match its bytes comes first,
        before any field other than ``format`` and ``version`` is looked at.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CorruptDataError(f"{what}: manifest must be bytes, got {type_name(data)}")
    if len(data) > max_bytes:
        raise CorruptDataError(f"{what}: manifest is {len(data)} bytes, over the {max_bytes} limit")
    limit = min(len(data), max_bytes)
    try:
        doc = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            timestamp=0,
            ext_hook=_reject_ext,
            object_pairs_hook=_unique_keys,
            max_str_len=limit,
            max_bin_len=limit,
            max_array_len=min(limit, _MAX_CONTAINER_LEN),
            max_map_len=min(limit, _MAX_CONTAINER_LEN),
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises many types for bad bytes: all mean corrupt
        raise CorruptDataError(f"{what}: unreadable manifest ({type(e).__name__}: {e})") from None
    if not isinstance(doc, dict):
        raise CorruptDataError(f"{what}: manifest must be a map, got {type_name(doc)}")
    fmt = doc.get("format")
    if fmt != schema.format:
        shown = repr(fmt)[:80] if isinstance(fmt, str) else type_name(fmt)
        raise CorruptDataError(f"{what}: field 'format' must be {schema.format!r}, got {shown}")
    version = doc.get("version")
    if not _is_int(version) or version < 1:
        shown = repr(version) if _is_int(version) else type_name(version)
        raise CorruptDataError(f"{what}: field 'version' must be an int >= 1, got {shown}")
    if version > FORMAT_VERSION:
        raise UnsupportedVersionError(
            f"{what}: manifest version {version} is newer than this library reads "
            f"(versions 1 to {FORMAT_VERSION}); upgrade residual-store to read it"
        )
    if version >= SEALED_SINCE or SELF_CHECKSUM_FIELD in doc:  # a flipped version bit is caught too
        _check_seal(data, doc, what)
        del doc[SELF_CHECKSUM_FIELD]
    try:
        validate_fields(doc, schema.struct)
    except InvalidFields as e:
        raise CorruptDataError(f"{what}: {e}") from None
    return doc


def manifest_outline(
    data: bytes | bytearray | memoryview,
    *,
    lists: Sequence[tuple[str, ...]] = (),
    values: Sequence[tuple[str, ...]] = (),
) -> dict[tuple[str, ...], Any]:
    """A few fields of a manifest, read without decoding the rest (the values around them are
    skipped, not built): for each path in ``lists`` (a field, or a field of a map field, such as
    ``("spec", "avals")``) the number of entries of the list there, for each in ``values`` the
    (scalar) value there. For refusing a manifest whose lists cannot be right before decoding it
    costs seconds and hundreds of MB (a list may hold 2^18 maps).

    Best effort, and never raises: a path it does not find (absent, not a list, the bytes
    damaged, over the size caps) is left out, and :func:`decode_manifest` says what is wrong.
    Nothing it returns is checked (not even the self checksum): a bound to refuse by, not data.
    """
    counted, kept = {tuple(p) for p in lists}, {tuple(p) for p in values}
    wanted = counted | kept
    prefixes = {p[:k] for p in wanted for k in range(1, len(p))}
    found: dict[tuple[str, ...], Any] = {}
    if len(data) > MAX_MANIFEST_BYTES:
        return found
    limit = min(len(data), _MAX_CONTAINER_LEN)
    unpacker = msgpack.Unpacker(
        raw=False, max_buffer_size=max(len(data), 1), max_str_len=len(data), max_bin_len=len(data),
        max_array_len=limit, max_map_len=limit, max_ext_len=0,
    )
    unpacker.feed(data)

    def walk(prefix: tuple[str, ...]) -> None:
        for _ in range(unpacker.read_map_header()):
            name = unpacker.unpack()
            path = (*prefix, name) if isinstance(name, str) else None
            if path in counted:
                found[path] = n = unpacker.read_array_header()
                if len(found) < len(wanted):
                    for _ in range(n):
                        unpacker.skip()
            elif path in kept:
                found[path] = unpacker.unpack()
            elif path in prefixes:
                walk(path)
            else:
                unpacker.skip()
            if len(found) == len(wanted):
                return

    try:
        walk(())
    except Exception:  # noqa: BLE001 - msgpack raises many types for bad bytes: decode names them
        pass
    return found
