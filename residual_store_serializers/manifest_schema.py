"""The fields of a manifest as msgspec types: what each kind of manifest holds, checked in one pass.

A manifest's fields are described once, as frozen ``msgspec.Struct`` types whose annotations
carry every type, range and length rule (:class:`ContextFields`, :class:`BackwardFields`, and
:class:`ArrayRecordFields` for each array); a :class:`ManifestSchema` pairs one of them with
its ``"format"``. :func:`validate_fields` checks a decoded map against a struct with
``msgspec.convert`` and raises :class:`InvalidFields` naming the field, so that
:mod:`serializers.manifest` (the encoding, the seal, the versions) raises the library's error
types. A rule across fields that a type cannot state (a shape's element count) is a
``__post_init__``, which msgspec reports like any other field error.

No struct forbids unknown fields: a later writer's addition must not break an older reader.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Final

import msgspec
from msgspec import UNSET, Meta, UnsetType

__all__ = [
    "CONTEXT_FORMAT",
    "BACKWARD_FORMAT",
    "MAX_ARRAY_ELEMENTS",
    "MAX_CHUNKS_PER_ARRAY",
    "RELPATH_PATTERN",
    "is_safe_relpath",
    "UInt",
    "Finite",
    "RelPath",
    "DType",
    "Shape",
    "ChunkChecksums",
    "ArrayRecordFields",
    "ARRAY_RECORD_FIELDS",
    "ContextFields",
    "BackwardFields",
    "Field",
    "ManifestSchema",
    "CONTEXT_SCHEMA",
    "BACKWARD_SCHEMA",
    "InvalidFields",
    "validate_fields",
    "type_name",
]

CONTEXT_FORMAT: Final[str] = "residual-store/context"
BACKWARD_FORMAT: Final[str] = "residual-store/backward"

MAX_ARRAY_ELEMENTS: Final[int] = 1 << 40
"""The most elements (and the largest dimension) a shape or chunk shape may declare."""

MAX_CHUNKS_PER_ARRAY: Final[int] = 1 << 16
"""The most chunks one array record may list (one per shard: a mesh of 65,536 devices)."""

_MAX_RELPATH_LEN: Final[int] = 1024
_MAX_NDIM: Final[int] = 64
_MAX_DTYPE_LEN: Final[int] = 64


# --------------------------------------------------------------------------- paths


# A safe path: components of [A-Za-z0-9._-], none empty, "." or ".."; \Z, not $, so that a
# trailing newline is refused (msgspec matches a Meta pattern with re.search).
_COMPONENT: Final[str] = r"(?!\.\.?(?:/|\Z))[A-Za-z0-9._-]+"
RELPATH_PATTERN: Final[str] = rf"^{_COMPONENT}(?:/{_COMPONENT})*\Z"
_RELPATH: Final = re.compile(RELPATH_PATTERN)


def is_safe_relpath(p: object) -> bool:
    """Whether ``p`` is a safe path inside a store.

    Safe means: a non-empty ``str`` of at most 1024 characters from
    ``[A-Za-z0-9._/-]``, relative (no leading ``/``), with no empty, ``.`` or
    ``..`` component (so no ``//`` and no trailing ``/``). Such a path can be
    joined to a store root, a kvstore prefix or a URL without escaping it.
    """
    return isinstance(p, str) and 0 < len(p) <= _MAX_RELPATH_LEN and _RELPATH.search(p) is not None


# --------------------------------------------------------------------------- typed fields

# The field types of a manifest, as msgspec types: msgspec checks a decoded map against them
# (types, ranges, lengths, the path pattern) in one pass. A bool is never an int here, and an
# int is accepted for a float field (a writer may store ``1700000000`` for ``1700000000.0``).
UInt = Annotated[int, Meta(ge=0)]
Finite = Annotated[float, Meta(ge=-sys.float_info.max, le=sys.float_info.max)]  # NaN fails both
RelPath = Annotated[str, Meta(min_length=1, max_length=_MAX_RELPATH_LEN, pattern=RELPATH_PATTERN)]
DType = Annotated[str, Meta(min_length=1, max_length=_MAX_DTYPE_LEN)]
Dim = Annotated[int, Meta(ge=0, le=MAX_ARRAY_ELEMENTS)]
Shape = Annotated[list[Dim], Meta(max_length=_MAX_NDIM)]  # and at most 2**40 elements in all
ChunkIndex = Annotated[list[UInt], Meta(max_length=_MAX_NDIM)]
ChunkChecksums = Annotated[list[tuple[ChunkIndex, str]], Meta(max_length=MAX_CHUNKS_PER_ARRAY)]


def _check_elements(shape: Sequence[int] | UnsetType, name: str) -> None:
    """Raises ValueError if ``shape`` declares more than 2**40 elements (each dimension is
    bounded by its type; the product is a rule across them)."""
    if shape is not UNSET and math.prod(shape) > MAX_ARRAY_ELEMENTS:
        raise ValueError(f"field {name!r} declares more than 2**40 elements")


class ArrayRecordFields(msgspec.Struct, frozen=True):
    """The fields of one entry of a context manifest's ``"arrays"`` list (see
    :class:`~serializers.manifest.ArrayRecord`, the record a caller uses; this is its stored form, checked).

    ``offset`` (version 4 on) is present only for an array in its context's bundle: where its
    bytes start in the bundle file (see :mod:`serializers.bundle`). ``chunk_shape`` and
    ``chunk_checksums`` are present together, only for an array stored on a grid of several
    chunks; records without them are single-chunk arrays, as written before chunked arrays
    existed. Unknown keys are ignored (a later writer's addition)."""

    name: str
    path: RelPath
    shape: Shape
    dtype: DType
    nbytes: UInt
    checksum: str
    input_path: str | None
    shared: bool
    chunk_shape: Shape | UnsetType = UNSET
    chunk_checksums: ChunkChecksums | UnsetType = UNSET
    offset: UInt | UnsetType = UNSET

    def __post_init__(self) -> None:
        _check_elements(self.shape, "shape")
        _check_elements(self.chunk_shape, "chunk_shape")


ARRAY_RECORD_FIELDS: Final[tuple[str, ...]] = ArrayRecordFields.__struct_fields__
"""The keys of one array record, in the order a record is written."""


class ContextFields(msgspec.Struct, frozen=True):
    """A stored residual context: its key, signature, spec and one record per array."""

    key: str
    signature: str
    created: Finite  # unix time, seconds
    jax_version: str
    spec: dict[str, Any]  # the residual spec / treedef: opaque to this module
    arrays: list[ArrayRecordFields]


class BackwardFields(msgspec.Struct, frozen=True):
    """A serialized backward (``jax.export``) artifact, stored once per signature.

    ``available`` is false (and ``reason`` says why) for a backward that could not be exported:
    the manifest is then stored alone. Otherwise ``interface`` names how the artifact is called
    (``"flat"``: lists of residuals and floating cotangents in, gradient leaves out),
    ``platforms`` lists those it was lowered for and ``left_out`` maps the others to why, and
    ``cotangent`` and ``gradients`` describe the structures around the flat artifact (key paths,
    a structure record, and for the cotangent one ``[shape, dtype]`` per output leaf)."""

    signature: str
    jax_version: str
    available: bool | UnsetType = UNSET
    reason: str | None | UnsetType = UNSET
    interface: str | UnsetType = UNSET
    platforms: list[str] | UnsetType = UNSET
    left_out: dict[str, Any] | UnsetType = UNSET
    cotangent: dict[str, Any] | UnsetType = UNSET
    gradients: dict[str, Any] | UnsetType = UNSET


# --------------------------------------------------------------------------- schemas


_KINDS: Final[dict[str, Any]] = {
    "str": str,
    "optional_str": str | None,
    "int": int,
    "uint": UInt,
    "float": Finite,
    "bool": bool,
    "map": dict[str, Any],
    "relpath": RelPath,
    "shape": Shape,
    "dtype": DType,
    "str_list": list[str],
    "array_records": list[ArrayRecordFields],
    "chunk_checksums": ChunkChecksums,
}


@dataclass(frozen=True)
class Field:
    """One key a caller adds to a manifest kind (:meth:`ManifestSchema.extend`).

    Attributes:
      name: the map key.
      kind: the name of one of the field types above: ``"str"``, ``"optional_str"``,
        ``"int"``, ``"uint"``, ``"float"`` (an int or finite float), ``"bool"``, ``"map"``,
        ``"relpath"`` (see :func:`is_safe_relpath`), ``"shape"``, ``"dtype"``,
        ``"str_list"``, ``"array_records"``, ``"chunk_checksums"``.
      required: whether the key must be present; an optional key, when present, must still
        have the right kind.
    """

    name: str
    kind: str
    required: bool = True


@dataclass(frozen=True)
class ManifestSchema:
    """One kind of manifest: its ``"format"`` and the msgspec struct of its other fields."""

    format: str
    struct: type[msgspec.Struct]

    def extend(self, *fields: Field) -> ManifestSchema:
        """Returns a schema with ``fields`` added (for a caller's own extra fields).

        Raises:
          ValueError: a field of an unknown kind.
        """
        spec: list[tuple[Any, ...]] = []
        for f in fields:
            if f.kind not in _KINDS:
                raise ValueError(f"schema field {f.name!r} has unknown kind {f.kind!r}")
            kind = _KINDS[f.kind]
            spec.append((f.name, kind) if f.required else (f.name, kind | UnsetType, UNSET))
        shapes = tuple(f.name for f in fields if f.kind == "shape")
        struct = msgspec.defstruct(
            f"{self.struct.__name__}Extended",
            spec,
            bases=(self.struct,),
            kw_only=True,
            frozen=True,
            namespace={"__post_init__": _elements_checked(shapes)} if shapes else None,
        )
        return ManifestSchema(self.format, struct)


def _elements_checked(names: tuple[str, ...]) -> Callable[[Any], None]:
    """A ``__post_init__`` that checks the element counts of the shape fields ``names``."""

    def __post_init__(self: Any) -> None:
        for name in names:
            _check_elements(getattr(self, name), name)

    return __post_init__


CONTEXT_SCHEMA: Final[ManifestSchema] = ManifestSchema(CONTEXT_FORMAT, ContextFields)
"""A stored residual context (:class:`ContextFields`)."""

BACKWARD_SCHEMA: Final[ManifestSchema] = ManifestSchema(BACKWARD_FORMAT, BackwardFields)
"""A serialized backward artifact (:class:`BackwardFields`)."""


# --------------------------------------------------------------------------- validation


class InvalidFields(Exception):
    """A value does not match the schema; the message says where and why (the caller adds
    which manifest or record, and raises its own error type)."""


def type_name(v: object) -> str:
    """``v``'s type as msgpack calls it, for messages."""
    return "nil" if v is None else type(v).__name__


def validate_fields(d: object, struct: type[msgspec.Struct]) -> None:
    """Raises :class:`InvalidFields`, naming the field, unless the map ``d`` holds ``struct``'s
    fields well typed (extra keys are allowed). ``d`` itself is what callers keep: the struct
    built here only checks it."""
    if not isinstance(d, dict):
        raise InvalidFields(f"manifest must be a map, got {type_name(d)}")
    try:
        msgspec.convert(d, struct)
    except msgspec.ValidationError as e:
        raise InvalidFields(_message(str(e))) from None


# msgspec's "<what> - at `$.arrays[1].shape`", and its names for msgpack's types
_AT: Final = re.compile(r"(?s)(.*?)(?: - at `\$\.?(.*)`)?")
_MISSING: Final = re.compile(r"Object missing required field `(.*)`")
_ITEM: Final = re.compile(r"(?s)(.*?)((?:\[\d+\])*)")  # a field, then the item of it at fault
_TYPE_NAMES: Final[tuple[tuple[str, str], ...]] = (
    ("`object`", "`map`"),
    ("`array`", "`list`"),
    ("`null`", "`nil`"),
    (f"matching regex '{RELPATH_PATTERN}'", "that is a safe relative path ([A-Za-z0-9._/-], no '..')"),
)


def _message(text: str) -> str:
    """A msgspec validation message in this library's words: the field as a path from the
    manifest's top (``'arrays[1].shape'``), what is wrong with it, and which item of it (a
    list's) when that is where."""
    match = _AT.fullmatch(text)
    what, at = (match.group(1), match.group(2) or "") if match else (text, "")
    missing = _MISSING.fullmatch(what)
    if missing:
        return f"missing required field {(f'{at}.' if at else '') + missing.group(1)!r}"
    for theirs, ours in _TYPE_NAMES:
        what = what.replace(theirs, ours)
    what = what[:1].lower() + what[1:]
    field, item = _ITEM.fullmatch(at).groups()  # type: ignore[union-attr]
    return f"field {field!r}: {what}" + (f" at {item}" if item else "") if field else what
