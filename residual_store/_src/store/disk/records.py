"""A context manifest <-> the context's spec and records: the spec as a msgpack-able map, and
the one reader of a manifest's bytes.

:func:`parse_context_manifest` is the one reader of a context manifest's bytes. A manifest is
untrusted input (a flipped bit, a torn or hostile file): beyond its self checksum (see
:mod:`serializers.manifest`) every field is cross-checked against the key it is read for and
against the others, so that no manifest can make the store read, keep or delete another
context's data, allocate what a file cannot hold, or hand JAX a residual it cannot take.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

import residual_store_serializers as serializers
from residual_store._src import structure
from residual_store._src.context import OWN_KINDS, SHARED_KINDS, CallSpec, InputAval, ResidualSpec, check_save_record
from residual_store._src.errors import CorruptContextError
from residual_store._src.placement import check_sharding_record, key_dtype
from residual_store._src.store.critical import StoreLock
from residual_store._src.store.disk import paths
from residual_store._src.store.disk.paths import validate_key
from residual_store_serializers.bundle import BUNDLE_ALIGNMENT, MAX_BUNDLE_BYTES, BundleArray
from residual_store_serializers.checksums import parse_checksum
from residual_store_serializers.manifest import manifest_outline

__all__ = [
    "MAX_ARRAY_BYTES",
    "MAX_CHUNKS",
    "BundleRef",
    "StoredContext",
    "check_data_dir",
    "check_signature",
    "note_residual_count",
    "parse_context_manifest",
    "spec_from_map",
    "spec_to_map",
]


MAX_ARRAY_BYTES = 1 << 40
"""The largest array (1 TiB) a manifest may declare; a larger declaration is damage."""

MAX_CHUNKS = 1 << 20
"""The most chunks a context manifest may list in all (each array: at most
:data:`serializers.manifest.MAX_CHUNKS_PER_ARRAY`)."""

_SIGNATURE = re.compile(r"rs[12]-[0-9a-f]{32}")
_CRC = re.compile(r"crc32:[0-9a-f]{8}")  # a bundled array's checksum: its CRC-32, the zip's own
_CRC_PREFIX_LEN = len("crc32:")


@dataclasses.dataclass(frozen=True)
class BundleRef:
    """A context's bundle (version 4 on): the one file holding its own single-chunk arrays, at
    ``path``, of exactly ``nbytes`` bytes whose checksum is ``checksum``; each bundled array's
    record gives its ``offset`` in it."""

    path: str
    nbytes: int
    checksum: str

    def to_map(self) -> dict[str, Any]:
        return {"path": self.path, "nbytes": self.nbytes, "checksum": self.checksum}


@dataclasses.dataclass(frozen=True)
class StoredContext:
    """A validated manifest: the context's spec and where each of its arrays is."""

    key: str
    spec: ResidualSpec
    records: tuple[serializers.ArrayRecord, ...]
    key_impls: tuple[str | None, ...]
    created: float
    jax_version: str
    data_dir: str
    shardings: tuple[dict[str, Any] | None, ...] = ()  # per residual: its sharding record, if any
    bundle: BundleRef | None = None
    # the layout digest of its own arrays, where its writer knew it (see layout.data_of)
    folder_shape: str | None = dataclasses.field(default=None, compare=False)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.records)

    def sharding(self, i: int) -> dict[str, Any] | None:
        return self.shardings[i] if i < len(self.shardings) else None

    @functools.cached_property
    def sharded(self) -> bool:
        """Whether any residual has a sharding record."""
        return any(s is not None for s in self.shardings)

    @functools.cached_property
    def bundled(self) -> tuple[int, ...]:
        """The residuals in the bundle, in order."""
        return tuple(i for i, r in enumerate(self.records) if r.bundled)

    @functools.cached_property
    def bundle_arrays(self) -> tuple[serializers.BundleArray, ...]:
        """Where each of :attr:`bundled` lies in the bundle, as its records say."""
        return tuple(BundleArray(r.shape, r.dtype, _offset(r), r.nbytes) for r in (self.records[i] for i in self.bundled))

    @functools.cached_property
    def bundle_offsets(self) -> tuple[int, ...]:
        """Where each of :attr:`bundled` starts in the bundle, as its records say."""
        return tuple(a.offset for a in self.bundle_arrays)

    @functools.cached_property
    def bundle_crcs(self) -> np.ndarray:
        """The CRC-32 each of :attr:`bundled` has in its record (uint32; every bundled record's
        checksum is one, :func:`parse_context_manifest` checks)."""
        digits = "".join([self.records[i].checksum[_CRC_PREFIX_LEN:] for i in self.bundled])
        return np.frombuffer(bytes.fromhex(digits), dtype=">u4").astype(np.uint32)


def _call_to_map(call: CallSpec) -> dict[str, Any]:
    """The call record as a msgpack map (msgpack writes its tuples as arrays, read back as lists:
    :func:`_call_from_map` freezes them); the same map for every context of a call (never
    mutated: it is only encoded)."""
    try:
        return _cached_call_map(call)
    except TypeError:  # a record holding an unhashable value
        return _cached_call_map.__wrapped__(call)


@functools.lru_cache(maxsize=64)
def _cached_call_map(call: CallSpec) -> dict[str, Any]:
    return {
        "n_args": call.n_args,
        "argnums": call.argnums,
        "weight_argnums": call.weight_argnums,
        "static_argnums": call.static_argnums,
        "has_aux": call.has_aux,
        "in_avals": [{k: v for k, v in dataclasses.asdict(a).items() if v is not None} for a in call.in_avals],
        "in_tree": call.in_tree,
        "statics": call.statics,
        "context_mesh": call.context_mesh,
        "unrecorded": call.unrecorded,
        **({} if call.differentiated is None else {"differentiated": list(call.differentiated)}),
        **({} if call.now is None else {"now": list(call.now), "parent": call.parent}),
        **({} if call.save == "all" else {"save": call.save}),
        **({} if not call.kwnames else {"kwnames": list(call.kwnames)}),
        **({} if call.static_kwargs == () else {"static_kwargs": call.static_kwargs}),
    }


def _ints(v: Any, what: str) -> tuple[int, ...]:
    if not (isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v)):
        raise ValueError(f"{what} must be a list of ints >= 0")
    return tuple(v)


def _opt_str(m: Mapping[str, Any], key: str) -> str | None:
    v = m.get(key)
    if v is not None and not isinstance(v, str):
        raise ValueError(f"{key} must be a str")
    return v


def _input_aval(m: Any) -> InputAval:
    if not isinstance(m, dict):
        raise ValueError("an input aval must be a map")
    shape, dtype, weak, where = m.get("shape"), m.get("dtype"), m.get("weak_type"), m.get("placement")
    if not (isinstance(dtype, str) and isinstance(weak, bool) and isinstance(where, str)):
        raise ValueError("an input aval needs dtype (str), weak_type (bool) and placement (str)")
    return InputAval(
        shape=_ints(shape, "input aval shape"),
        dtype=dtype,
        weak_type=weak,
        placement=where,
        sharding=_opt_str(m, "sharding"),
        memory_kind=_opt_str(m, "memory_kind"),
        key_impl=_opt_str(m, "key_impl"),
    )


def _call_from_map(m: Any) -> CallSpec:
    """Validates an untrusted call record's shape; raises ValueError. (Its tree and static value
    records are checked when a split decodes them.)"""
    if not isinstance(m, dict):
        raise ValueError("call must be a map")
    n_args, argnums, has_aux = m.get("n_args"), m.get("argnums"), m.get("has_aux")
    if not (isinstance(n_args, int) and not isinstance(n_args, bool) and n_args >= 0 and isinstance(has_aux, bool)):
        raise ValueError("call needs n_args (int >= 0) and has_aux (bool)")
    if not (isinstance(argnums, int) and not isinstance(argnums, bool)):
        argnums = _ints(argnums, "argnums")
    mesh = m.get("context_mesh")
    if mesh is not None:
        if not (isinstance(mesh, list) and len(mesh) == 3 and all(isinstance(p, list) for p in mesh)):
            raise ValueError("context_mesh must be [names, sizes, types]")
        names, sizes, types = mesh
        if not (all(isinstance(n, str) for n in names + types) and len(names) == len(sizes)):
            raise ValueError("context_mesh names and types must be str, one size per name")
        mesh = (tuple(names), _ints(sizes, "context_mesh sizes"), tuple(types))
    avals = m.get("in_avals")
    if not isinstance(avals, list):
        raise ValueError("in_avals must be a list")
    differentiated = m.get("differentiated")
    if differentiated is not None:
        if not (isinstance(differentiated, list) and len(differentiated) == len(avals)
                and all(isinstance(d, bool) for d in differentiated)):
            raise ValueError("differentiated must be a list of bools, one per input aval")
        differentiated = tuple(differentiated)
    kwnames = m.get("kwnames", [])
    if not (isinstance(kwnames, list) and all(isinstance(n, str) for n in kwnames)):
        raise ValueError("kwnames must be a list of str")
    static_kwargs = structure.freeze(m.get("static_kwargs", []))
    if static_kwargs is not None and not (
        isinstance(static_kwargs, tuple)
        and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in static_kwargs)
    ):
        raise ValueError("static_kwargs must be a list of [name, value] pairs, or nil")
    now, parent = m.get("now"), m.get("parent")
    if now is not None or parent is not None:
        if not isinstance(parent, str):
            raise ValueError("a later context's call needs its parent signature (a str)")
        now = _ints(now, "now")
    return CallSpec(
        n_args=n_args,
        argnums=argnums,
        weight_argnums=_ints(m.get("weight_argnums"), "weight_argnums"),
        static_argnums=_ints(m.get("static_argnums"), "static_argnums"),
        has_aux=has_aux,
        in_avals=tuple(_input_aval(a) for a in avals),
        in_tree=structure.freeze(m.get("in_tree")),
        statics=structure.freeze(m.get("statics")),
        kwnames=tuple(kwnames),
        static_kwargs=static_kwargs,
        context_mesh=mesh,
        unrecorded=_opt_str(m, "unrecorded"),
        differentiated=differentiated,
        now=now,
        parent=parent,
        save=check_save_record(m.get("save", "all")),
    )


@functools.lru_cache(maxsize=256)
def _dtype_text(dtype: Any) -> str:
    """``str(dtype)`` (NumPy spends microseconds on each), remembered."""
    return str(dtype)


def spec_to_map(
    spec: ResidualSpec, impls: Sequence[str | None], shardings: Sequence[dict[str, Any] | None] = ()
) -> dict[str, Any]:
    out = {
        "avals": [[list(a.shape), _dtype_text(a.dtype)] for a in spec.avals],
        "names": list(spec.names),
        "input_paths": list(spec.input_paths),
        "kinds": list(spec.kinds),
        "key_impls": list(impls),
    }
    if any(s is not None for s in shardings):  # absent when nothing is sharded
        out["shardings"] = list(shardings)
    if spec.call is not None:
        out["call"] = _call_to_map(spec.call)
    if spec.on_host:  # absent when the forward put nothing in host memory
        out["on_host"] = list(spec.on_host)
    return out


def spec_from_map(
    signature: str, m: Mapping[str, Any], records: Sequence[Any], what: str, version: int = 2
) -> tuple[ResidualSpec, tuple[str | None, ...], tuple[dict[str, Any] | None, ...]]:
    """The spec of a manifest of format ``version``. Version 1 (residual-store 0.1) called every
    primal input ``"input"`` and stored them all once: those are ``"weight"`` now."""
    try:
        n = len(records)
        avals_raw, names = m["avals"], m["names"]
        input_paths, kinds, impls = m["input_paths"], m["kinds"], m["key_impls"]
        if not all(isinstance(v, list) and len(v) == n for v in (avals_raw, names, input_paths, kinds, impls)):
            raise ValueError(f"spec lists must all have {n} entries")
        if version == 1:
            kinds = ["weight" if k == "input" else k for k in kinds]
        if any(k not in SHARED_KINDS | OWN_KINDS for k in kinds):
            raise ValueError(f"unknown residual kinds {sorted(set(map(str, kinds)))}")
        if any((k in SHARED_KINDS) != r.shared for k, r in zip(kinds, records)):
            raise ValueError("a residual's kind disagrees with whether its array is shared")
        avals = []
        for (shape, dtype), impl, record in zip(avals_raw, impls, records):
            if not (isinstance(shape, list) and isinstance(dtype, str)):
                raise ValueError("each aval must be [shape, dtype]")
            if impl is not None:
                if not isinstance(impl, str):
                    raise ValueError("a key implementation must be a str")
                try:
                    typed, trailing, data_dtype = _key_layout(impl)
                except Exception as err:  # noqa: BLE001 - JAX raises several types for an unknown impl
                    raise ValueError(f"unknown PRNG key implementation {impl[:64]!r} ({type(err).__name__})") from None
                if str(typed) != dtype:
                    raise ValueError(f"key dtype {dtype} does not match impl {impl}")
                if record.dtype != data_dtype or tuple(shape) + trailing != tuple(record.shape):
                    raise ValueError(
                        f"key aval {dtype}{shape} disagrees with its array record "
                        f"({record.dtype}{list(record.shape)}, key data {data_dtype}{list(trailing)})"
                    )
                avals.append(jax.ShapeDtypeStruct(tuple(shape), typed))
            else:
                if dtype != record.dtype or list(shape) != list(record.shape):
                    raise ValueError(f"spec aval {dtype}{shape} disagrees with its array record")
                avals.append(jax.ShapeDtypeStruct(tuple(shape), serializers.numpy_dtype(dtype)))
        shardings_raw = m.get("shardings", [None] * n)
        if not isinstance(shardings_raw, list) or len(shardings_raw) != n:
            raise ValueError(f"shardings must be a list of {n} entries")
        shardings = []
        for j, (sh, record) in enumerate(zip(shardings_raw, records)):
            try:
                shardings.append(None if sh is None else check_sharding_record(sh, len(record.shape)))
            except ValueError as err:
                raise ValueError(f"sharding of residual {j}: {err}") from None
        call = _call_from_map(m["call"]) if "call" in m else None
        spec = ResidualSpec(
            signature=signature,
            avals=tuple(avals),
            names=tuple(str(s) for s in names),
            input_paths=tuple(p if p is None else str(p) for p in input_paths),
            kinds=tuple(kinds),
            call=call,
            on_host=tuple(_ints(m.get("on_host", []), "on_host")),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise CorruptContextError(f"{what}: invalid spec in manifest ({err})") from None
    return spec, tuple(impls), tuple(shardings)


# ----------------------------------------------------------------------------------------------
# Reading a context manifest


def check_signature(signature: object, what: str) -> str:
    """``signature`` if it is one this library writes (``rs1-`` or ``rs2-`` and 32 hex digits:
    a safe file name under ``backwards/``); :class:`CorruptContextError` otherwise."""
    if not (isinstance(signature, str) and _SIGNATURE.fullmatch(signature)):
        shown = repr(signature)[:80] if isinstance(signature, str) else type(signature).__name__
        raise CorruptContextError(f"{what}: invalid signature {shown} in manifest (not rs1-/rs2- and 32 hex digits)")
    return signature


def _offset(record: serializers.ArrayRecord) -> int:
    """A bundled record's offset (every bundled record has one: checked when it was read)."""
    assert record.offset is not None
    return record.offset


def check_data_dir(key: str, data_dir: object, what: str) -> str:
    """``data_dir`` if it is a folder this store's writer makes for ``key``:
    ``data/<key>.<write id>``, the write id 12 hex digits. Two keys never have one folder (the
    key is all of the name but its last 13 characters), so no manifest can name another
    context's data. :class:`CorruptContextError` otherwise."""
    if not isinstance(data_dir, str) or not paths.is_data_dir_of(key, data_dir):
        shown = repr(data_dir)[:80] if isinstance(data_dir, str) else type(data_dir).__name__
        raise CorruptContextError(
            f"{what}: invalid data_dir {shown} in manifest (context {key!r} writes only "
            f"{paths.data_dir(key, '<12 hex digits>')})"
        )
    return data_dir


@functools.lru_cache(maxsize=16)
def _key_layout(impl: str) -> tuple[Any, tuple[int, ...], str]:
    """The typed key dtype of a PRNG implementation, and the trailing shape and zarr dtype of its
    key data; raises for a name JAX does not know."""
    typed = key_dtype(impl)
    data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl)))
    return typed, tuple(int(d) for d in data.shape), serializers.zarr_dtype_name(data.dtype)


def _check_record(
    i: int, record: serializers.ArrayRecord, data_dir: str, impl: str | None, what: str
) -> None:
    """One array record against its place in the store and its declared size."""
    own = paths.own_array_path(data_dir, i)
    if record.shared:
        if not (paths.is_weight_path(record.path) or record.path == own):
            raise ValueError(
                f"a shared array must be at {paths.weight_path('<32 hex digits>')} or {own}, not {record.path!r}"
            )
    elif record.path != own:
        raise ValueError(f"its array must be at {own} (the context's own data), not {record.path!r}")
    try:
        itemsize = serializers.numpy_dtype(record.dtype).itemsize
    except (TypeError, ValueError) as err:
        raise ValueError(f"unsupported dtype {record.dtype!r} ({err})") from None
    size = math.prod(record.shape) * itemsize
    if size > MAX_ARRAY_BYTES:
        raise ValueError(f"its shape {list(record.shape)} of {record.dtype} is {size:,} bytes, over the {MAX_ARRAY_BYTES:,} limit")
    if record.nbytes != size:
        raise ValueError(f"nbytes {record.nbytes} is not that of shape {list(record.shape)} of {record.dtype} ({size})")
    if impl is not None:
        _, trailing, data_dtype = _key_layout(impl)
        if record.dtype != data_dtype or record.shape[len(record.shape) - len(trailing) :] != trailing:
            raise ValueError(
                f"a {impl} PRNG key is stored as {data_dtype} key data with trailing shape "
                f"{list(trailing)}, not {record.dtype}{list(record.shape)}"
            )


def _bundle_ref(m: Mapping[str, Any], data_dir: str, what: str) -> BundleRef | None:
    """The manifest's ``bundle``, checked: exactly ``<data_dir>/bundle.zip``, a size a bundle
    can have, a well-formed checksum."""
    if "bundle" not in m:
        return None
    if m["version"] < 4:
        raise CorruptContextError(f"{what}: a version {m['version']} manifest names a bundle (version 4 on)")
    b = m["bundle"]
    path = paths.bundle_path(data_dir)
    if not (isinstance(b, dict) and set(b) == {"path", "nbytes", "checksum"}):
        raise CorruptContextError(f"{what}: invalid bundle in manifest (a map of path, nbytes, checksum)")
    nbytes = b["nbytes"]
    if b["path"] != path:
        raise CorruptContextError(f"{what}: invalid bundle path {str(b['path'])[:80]!r} in manifest (not {path!r})")
    if not (isinstance(nbytes, int) and not isinstance(nbytes, bool) and 0 < nbytes <= MAX_BUNDLE_BYTES):
        raise CorruptContextError(f"{what}: invalid bundle size {str(nbytes)[:40]} in manifest")
    try:
        parse_checksum(b["checksum"], what=f"{what}: bundle")
    except serializers.CorruptDataError as err:
        raise CorruptContextError(str(err)) from None
    return BundleRef(path, nbytes, b["checksum"])


def _check_bundled(records: Sequence[serializers.ArrayRecord], bundle: BundleRef | None, what: str) -> None:
    """The bundled arrays lie inside the bundle, aligned, none over another, each with its
    CRC-32 for checksum (what the zip's headers hold); without a bundle, none claims to be in
    one."""
    spans = sorted((r.offset, r.nbytes, i) for i, r in enumerate(records) if r.offset is not None)
    if spans and bundle is None:
        raise CorruptContextError(f"{what}: array {spans[0][2]} has a bundle offset, the manifest no bundle")
    for _, _, i in spans:
        if not _CRC.fullmatch(records[i].checksum):
            raise CorruptContextError(
                f"{what}: array {i}: a bundled array's checksum is its CRC-32 (crc32: and 8 hex "
                f"digits), not {records[i].checksum[:40]!r}"
            )
    end = 0
    for offset, nbytes, i in spans:
        if nbytes and (offset % BUNDLE_ALIGNMENT or offset < end or offset + nbytes > bundle.nbytes):  # type: ignore[union-attr]
            raise CorruptContextError(
                f"{what}: array {i}: its bytes at offset {offset:,} ({nbytes:,} bytes) are not an aligned, "
                "unshared part of the bundle"
            )
        end = max(end, offset + nbytes)


_OUTLINED_BYTES = 1 << 20
"""A manifest this large (some 4,000 residuals) has its lists counted before it is decoded: a
smaller one decodes in milliseconds, a larger one may take seconds and hundreds of MB."""

_RESIDUAL_COUNTS_MAX = 1024
_residual_counts: dict[str, int] = {}  # signature -> residuals, of contexts this process wrote
_residual_counts_lock = StoreLock()


def note_residual_count(signature: str, count: int) -> None:
    """Records that contexts of ``signature`` have ``count`` residuals (a writer of this process
    knows it from the split): a manifest of that signature listing another number of array
    records is refused before it is decoded. Only ``rs2-`` signatures, which name one
    computation, hence one list of residuals."""
    if not signature.startswith("rs2-") or _residual_counts.get(signature) == count:
        return
    with _residual_counts_lock:
        _residual_counts.pop(signature, None)
        while len(_residual_counts) >= _RESIDUAL_COUNTS_MAX:
            del _residual_counts[next(iter(_residual_counts))]
        _residual_counts[signature] = count


def _check_counts(what: str, signature: Any, records: Any, residuals: Any) -> None:
    """Refuses a manifest listing ``records`` array records for a spec of ``residuals`` (either
    ``None``: not known), or for a ``signature`` whose contexts this process wrote with another
    number of residuals: what the signature's layout allows bounds the records before any of
    them is built."""
    if not isinstance(records, int):
        return
    if isinstance(residuals, int) and records != residuals:
        raise CorruptContextError(
            f"{what}: the manifest lists {records:,} array records for the {residuals:,} residuals of its spec"
        )
    known = _residual_counts.get(signature) if isinstance(signature, str) else None
    if known is not None and records != known:
        raise CorruptContextError(
            f"{what}: the manifest lists {records:,} array records, where contexts of its signature "
            f"{signature} have {known:,} residuals"
        )


class _SpecMemo:
    """The specs of recent manifests, by signature and format version: every context of one
    split called alike has the same spec map, so a process parses it once, not on every get.

    A hit needs an equal map (``==`` on the decoded map, compared in C) and records of the same
    shapes, dtypes and sharing, the only parts of the records :func:`spec_from_map` reads: so a
    hit returns exactly what parsing would. Thread-safe (loader threads parse too); bounded.
    """

    _SIZE = 64

    def __init__(self) -> None:
        self._lock = StoreLock()
        self._specs: dict[tuple[str, int], tuple[Any, tuple[Any, ...], Any]] = {}

    def parse(
        self, signature: str, spec_map: Any, records: Sequence[serializers.ArrayRecord], what: str, version: int
    ) -> tuple[ResidualSpec, tuple[str | None, ...], tuple[dict[str, Any] | None, ...]]:
        layout = tuple((r.shape, r.dtype, r.shared) for r in records)
        with self._lock:
            hit = self._specs.get((signature, version))
        if hit is not None and hit[1] == layout and hit[0] == spec_map:
            return hit[2]
        parsed = spec_from_map(signature, spec_map, records, what, version=version)
        with self._lock:
            self._specs.pop((signature, version), None)
            while len(self._specs) >= self._SIZE:
                del self._specs[next(iter(self._specs))]
            self._specs[(signature, version)] = (spec_map, layout, parsed)
        return parsed


_SPECS = _SpecMemo()


def parse_context_manifest(key: str, data: bytes) -> StoredContext:
    """Decodes and cross-checks the manifest of context ``key`` (read from ``contexts/``).

    Beyond the schema and the self checksum (:func:`serializers.decode_manifest`), for every
    version: the key is a valid key and the one the manifest names; the signature is one this
    library writes; ``data_dir`` is ``data/<key>.<write id>`` (:func:`check_data_dir`); each
    array is at ``<data_dir>/<i>``, or for a shared one (weight, constant) at
    ``weights/<digest>``; a bundle (version 4 on) is ``<data_dir>/bundle.zip`` and its arrays
    lie inside it, aligned, none over another; each declared size is that of its shape and dtype, at most 1 TiB; no
    more than :data:`MAX_CHUNKS` chunks in all; a PRNG key implementation only on a key-typed
    residual whose stored key data has that implementation's dtype and trailing shape; the spec
    agrees with the records (see :func:`spec_from_map`).

    Raises:
      CorruptContextError: anything wrong, naming the context and the field.
    """
    what = f"context {key!r}"
    try:
        validate_key(key)
    except ValueError as err:  # a key listed from the store's folder, not one a user passed
        raise CorruptContextError(f"{what}: a manifest under an invalid key ({err})") from None
    if len(data) > _OUTLINED_BYTES:
        outline = manifest_outline(data, lists=[("arrays",), ("spec", "avals")], values=[("signature",)])
        _check_counts(what, outline.get(("signature",)), outline.get(("arrays",)), outline.get(("spec", "avals")))
    try:
        m = serializers.decode_manifest(data, what=f"manifest of {what}")
        if m["key"] != key:
            raise CorruptContextError(f"{what}: manifest names key {str(m['key'])[:200]!r}")
        signature = check_signature(m["signature"], what)
        data_dir = check_data_dir(key, m.get("data_dir"), what)
        arrays = m["arrays"]
        avals = m["spec"].get("avals")
        _check_counts(what, signature, len(arrays), len(avals) if isinstance(avals, list) else None)
        if sum(len(r.get("chunk_checksums") or ()) for r in arrays if isinstance(r, dict)) > MAX_CHUNKS:
            raise CorruptContextError(f"{what}: manifest lists more than {MAX_CHUNKS} chunks")
        records = tuple(
            serializers.ArrayRecord.from_dict(r, what=f"{what} array {i}", fields_checked=True)
            for i, r in enumerate(arrays)
        )
    except serializers.CorruptDataError as err:
        raise CorruptContextError(str(err)) from err
    spec_map = m["spec"]
    impls = spec_map.get("key_impls")
    if not (isinstance(impls, list) and len(impls) == len(records)):
        raise CorruptContextError(f"{what}: invalid spec in manifest (key_impls must list {len(records)} entries)")
    for i, (record, impl) in enumerate(zip(records, impls)):
        try:
            if impl is not None and not (isinstance(impl, str) and 0 < len(impl) <= 64):
                raise ValueError("its PRNG key implementation must be a short str or nil")
            _check_record(i, record, data_dir, impl, what)
        except Exception as err:  # noqa: BLE001 - JAX raises several types for an unknown key impl
            raise CorruptContextError(f"{what}: array {i} ({record.name[:80]}): {err}") from None
    bundle = _bundle_ref(m, data_dir, what)
    _check_bundled(records, bundle, what)
    spec, impls_out, shardings = _SPECS.parse(signature, spec_map, records, what, m["version"])
    return StoredContext(
        key, spec, records, impls_out, float(m["created"]), m["jax_version"], data_dir, shardings, bundle
    )
