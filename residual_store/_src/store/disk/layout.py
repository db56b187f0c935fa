"""The store's tree, pure (no I/O): where each thing lives, and what a write puts where.

The paths come from :mod:`residual_store._src.store.disk.paths`, which spells every one; they are
re-exported here.

:func:`plan_write` turns a :class:`HostWrite` (a context's host arrays, the one record of a write
from the writer thread to the bytes) into a :class:`WritePlan`: every array's path
and bytes (each residual planned in its form, bundled, chunked or whole, by
:mod:`residual_store._src.store.disk.forms`), its manifest record, the manifest itself and
the write's group metadata. The plan is
committed by one process (:meth:`~residual_store._src.store.disk.tier.DiskTier.commit`) or by all the
processes of a job (:mod:`residual_store._src.store.collective`); both write the same bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import jax
import numpy as np

import residual_store_serializers as serializers
from residual_store._src.context import SHARED_KINDS, ResidualSpec
from residual_store._src.errors import CorruptContextError
from residual_store._src.store.critical import StoreLock
from residual_store._src.store.disk import forms
from residual_store._src.store.disk.host_arrays import HostArrays, ShardedHost
from residual_store._src.store.disk.paths import (
    CONTEXTS,
    DATA,
    STORE_FORMAT,
    STORE_MARKER,
    STORE_VERSION,
    WEIGHTS,
    bundle_path,
    data_dir,
    group_metadata_path,
    in_bundle_name,
    manifest_path,
    own_array_path,
    weight_path,
)
from residual_store._src.store.disk.protocol import ContextWrite, StaleData
from residual_store._src.store.disk.records import StoredContext, note_residual_count, spec_to_map
from residual_store_serializers import bundle as bundles

__all__ = [
    "ArrayWrite",
    "HostWrite",
    "WritePlan",
    "data_of",
    "folder_shape",
    "marker_version",
    "plan_write",
    "root_group",
]



def root_group() -> dict[str, bytes]:
    """The ``zarr.json`` of every group a store has from the start, by path."""
    root = serializers.encode_group_metadata(
        {"residual_store": {"format": "residual-store", "version": STORE_VERSION,
                            "contexts": "the msgpack manifests under contexts/ are the commits"}}
    )
    return {
        group_metadata_path(""): root,
        group_metadata_path(DATA): serializers.encode_group_metadata({}),
        group_metadata_path(WEIGHTS): serializers.encode_group_metadata({}),
    }


# what to do about a damaged marker: the contexts are not in it, and the marker is one fixed line
_REWRITE_MARKER = (
    f"write the file {STORE_MARKER} again with the one line {STORE_FORMAT.decode().strip()} (nothing "
    "else reads it), then verify the store"
)
_WAY_BACK = f"the contexts are not in it: where this is a residual store, {_REWRITE_MARKER}"


def lost_marker(where: str) -> str:
    """What to do about a store whose marker is missing, its contexts still there."""
    return f"{where} holds a residual store's contexts ({CONTEXTS}/) but not its marker {STORE_MARKER}: {_REWRITE_MARKER}"


def marker_version(data: bytes, what: str) -> int:
    """The format version the store marker ``data`` records (``what``: the marker, for errors).

    Raises:
      CorruptContextError: the marker is damaged, its version is invalid, or newer than
        :data:`STORE_VERSION` (a later residual-store's store: nothing may be read or written).
    """
    try:
        marker = json.loads(data[: 1 << 16].decode("utf-8")) if len(data) <= 1 << 16 else None
    except (UnicodeDecodeError, ValueError):
        marker = None
    if not isinstance(marker, dict) or marker.get("format") != "residual-store":
        raise CorruptContextError(f"{what} is damaged (not a residual-store marker): {data[:80]!r}; {_WAY_BACK}")
    version = marker.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CorruptContextError(f"{what} has an invalid format version {version!r}; {_WAY_BACK}")
    if version > STORE_VERSION:
        raise CorruptContextError(
            f"{what} has format version {version}, newer than the version {STORE_VERSION} this "
            f"residual-store reads: upgrade residual-store to open it (nothing was read or "
            "written)"
        )
    return version


def folder_shape(
    spec: ResidualSpec, arrays: Iterable[tuple[int, str, tuple[int, ...], str, tuple[int, ...] | None]]
) -> str:
    """A digest of (name, shape, dtype, chunk shape, zarr attributes) of each own array, given as
    ``(residual index, name in the folder, shape, dtype, chunk shape or None)``, the attributes
    those of ``spec``'s residual: a folder of equal shape can take another write's arrays in
    place, each ``zarr.json`` unchanged. Remembered per spec and arrays (every write of one
    signature has the same folder shape)."""
    own = tuple((i, name, tuple(int(d) for d in shape), dtype, None if chunks is None else tuple(int(c) for c in chunks))
                for i, name, shape, dtype, chunks in arrays)
    try:
        return _folder_shape(spec, own)
    except TypeError:  # a spec holding an unhashable value
        return _folder_shape.__wrapped__(spec, own)


@functools.lru_cache(maxsize=64)
def _folder_shape(spec: ResidualSpec, own: tuple[tuple[int, str, tuple[int, ...], str, tuple[int, ...] | None], ...]) -> str:
    h = hashlib.sha256()
    for i, name, shape, dtype, chunks in sorted(own, key=lambda t: (t[1], str(t[2:]))):
        grid = "" if chunks is None else f"|{chunks}"
        attrs = json.dumps(forms.array_attributes(spec, i), sort_keys=True)
        h.update(f"{name}|{shape}|{dtype}{grid}|{attrs};".encode())
    return h.hexdigest()[:16]


def data_of(stored: StoredContext) -> StaleData:
    """The data folder of a committed context and its shape (see :func:`folder_shape`)."""
    if stored.folder_shape is not None:
        return StaleData(stored.data_dir, stored.folder_shape)
    prefix = stored.data_dir + "/"
    return StaleData(stored.data_dir, folder_shape(stored.spec, (
        (i, in_bundle_name(i) if r.bundled else r.path[len(prefix):], r.shape, r.dtype, r.chunk_shape)
        for i, r in enumerate(stored.records)
        if r.path.startswith(prefix)
    )))


@dataclasses.dataclass(frozen=True)
class HostWrite:
    """One write of a context, its residuals on the host: made once on the writer thread, when
    its host arrays are taken, and carried from there to the bytes (the committer, the plan)
    and to the live weights it stored.

    ``whole_sums`` and ``digests`` are the checksums and content digests of whole arrays already
    computed (the weights', remembered across writes), by residual index; the plan computes the
    others."""

    key: str
    spec: ResidualSpec
    arrays: HostArrays  # one per residual, in leaf order
    impls: tuple[str | None, ...]  # each typed key's impl (None: not a key)
    fsync: bool  # durable: synced before the commit
    whole_sums: Mapping[int, str] = dataclasses.field(default_factory=dict)
    digests: Mapping[int, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ArrayWrite:
    """One residual's array in a :class:`WritePlan`.

    ``data`` is a NumPy array or a :class:`serializers.ChunkedArray` (this process's chunks of a
    sharded residual); ``whole`` says it is a whole array (so, in a job of several processes,
    process 0 alone writes it).
    """

    index: int  # of the residual (the first one, for a weight held twice)
    path: str
    data: Any
    shared: bool
    whole: bool
    attributes: Mapping[str, Any] | None = None  # zarr attributes (own arrays)


@dataclasses.dataclass(frozen=True)
class WritePlan:
    """Everything one write of a context puts on disk, in the order it must land: the arrays
    (``arrays``, one per residual in leaf order; a weight held twice is written once), the
    group metadata of ``data_dir``, then ``manifest``, whose presence is the commit."""

    key: str
    data_dir: str
    folder_shape: str  # of the own arrays: a recycled folder of this shape can take the write
    arrays: tuple[ArrayWrite, ...]
    records: tuple[serializers.ArrayRecord, ...]
    manifest: bytes
    group: bytes  # data_dir's zarr.json
    stored: StoredContext  # what parsing ``manifest`` gives
    bundle: forms.BundleWrite | None = None  # the own arrays not in ``arrays``

    @property
    def own(self) -> dict[str, Any]:
        """The arrays under ``data_dir`` in folders of their own, by path."""
        return {a.path: a.data for a in self.arrays if not a.shared}

    @property
    def files(self) -> dict[str, bytes | tuple[memoryview | bytes, ...]]:
        """The other files under ``data_dir``: its group's ``zarr.json``, and its bundle."""
        out: dict[str, bytes | tuple[memoryview | bytes, ...]] = {group_metadata_path(self.data_dir): self.group}
        if self.bundle is not None:
            out[self.bundle.ref.path] = self.bundle.parts
        return out

    def own_write(self, *, fsync: bool, reuse: bool, staged: str | None = None) -> ContextWrite:
        """What a commit of this plan writes under ``data_dir`` before its weights (a
        :meth:`~residual_store._src.store.disk.protocol.Backend.write_context`): the own
        arrays and :attr:`files`, and with ``staged`` the manifest under that temporary name;
        ``reuse``: into a recycled folder of :attr:`folder_shape`, renamed to ``data_dir``."""
        return ContextWrite(
            self.own, self.attributes, self.files, fsync=fsync, reuse=reuse,
            manifest=(staged, self.manifest) if staged is not None else None,
        )

    @property
    def shared(self) -> dict[str, Any]:
        """The weights and constants, by content address (each once)."""
        return {a.path: a.data for a in self.arrays if a.shared}

    @property
    def attributes(self) -> dict[str, Mapping[str, Any]]:
        """The zarr attributes of the own arrays, by path."""
        return {a.path: a.attributes for a in self.arrays if a.attributes is not None}

    @property
    def nbytes(self) -> int:
        arrays = sum(int(getattr(d, "nbytes", 0)) for d in {**self.own, **self.shared}.values())
        return arrays + (self.bundle.ref.nbytes if self.bundle is not None else 0)


def plan_write(write: HostWrite, *, write_id: str, sums: forms.ChunkSums | None = None) -> WritePlan:
    """The :class:`WritePlan` of ``write`` in the data folder of ``write_id``.

    ``sums`` gives the chunks' checksums and digests (every process's, in a collective write;
    computed here from the write's arrays when ``None``).
    """
    key, spec, arrays, impls = write.key, write.spec, write.arrays, write.impls
    folder = data_dir(key, write_id)
    note_residual_count(spec.signature, len(arrays))  # (what a reader of this signature may expect)
    if sums is None:
        template = _template_for(spec, arrays, impls)
        if template is not None:
            # a template exists only for contexts of whole NumPy arrays (_template_for)
            return _plan_from_template(template, write, cast(list[np.ndarray], arrays), folder)
    sums = forms.chunk_sums(spec, arrays) if sums is None else sums
    writes: list[ArrayWrite] = []
    weights: set[str] = set()  # the paths of the weights in writes (a weight held twice is written once)
    records = []
    shardings: list[dict[str, Any] | None] = []
    bundle, in_bundle = forms.plan_bundle(spec, arrays, folder)
    for i, (x, kind) in enumerate(zip(arrays, spec.kinds)):
        shared = kind in SHARED_KINDS
        shardings.append(x.sharding if isinstance(x, ShardedHost) else None)
        if i in in_bundle:
            offset, checksum = in_bundle[i]
            records.append(serializers.ArrayRecord.for_writing(
                name=spec.names[i], path=own_array_path(folder, i), shape=x.shape,
                dtype=serializers.zarr_dtype_name(x.dtype), nbytes=int(x.nbytes), checksum=checksum,
                input_path=spec.input_paths[i], shared=False, offset=offset,
            ))
            continue
        if forms.is_chunked(x):
            planned = forms.plan_chunked(key, spec, i, x, sums.get(i, {}), shared=shared)
        else:
            planned = forms.plan_whole(i, x, shared=shared, whole_sums=write.whole_sums, digests=write.digests)
        digest = planned.digest
        path = weight_path(digest) if digest is not None else own_array_path(folder, i)  # (a digest: shared)
        if not (shared and path in weights):
            attributes = None if shared else forms.array_attributes(spec, i)
            writes.append(ArrayWrite(i, path, planned.data, shared, planned.whole, attributes))
            if shared:
                weights.add(path)
        records.append(serializers.ArrayRecord.for_writing(
            name=spec.names[i], path=path, shape=x.shape, dtype=serializers.zarr_dtype_name(x.dtype),
            nbytes=int(x.nbytes), checksum=planned.checksum, input_path=spec.input_paths[i], shared=shared,
            **planned.chunk_fields,
        ))
    group = serializers.encode_group_metadata({"residual_store": {
        "key": key,
        "signature": spec.signature,
        "manifest": manifest_path(key),
        # a bundled array is the group <i> inside the zip file "bundle" names (zarr's ZipStore)
        "arrays": [
            {"path": r.path, "name": r.name, "kind": k}
            | ({"bundle": bundle.ref.path, "in_bundle": str(i)} if bundle is not None and r.bundled else {})
            for i, (r, k) in enumerate(zip(records, spec.kinds))
        ],
    }}, no_members=all(a.shared for a in writes))  # the folder holds no array: zarr skips bundle.zip
    shape = folder_shape(spec, [
        *((a.index, a.path[len(folder) + 1:], a.data.shape, serializers.zarr_dtype_name(a.data.dtype),
           getattr(a.data, "chunk_shape", None) if not a.whole else None)
          for a in writes if not a.shared),
        *((i, in_bundle_name(i), records[i].shape, records[i].dtype, None) for i in in_bundle),
    ])
    return _sealed(
        write, folder, shape, tuple(writes), tuple(records), group, bundle,
        spec_map=spec_to_map(spec, impls, shardings), shardings=tuple(shardings),
    )


def _sealed(
    write: HostWrite,
    folder: str,
    shape: str,
    writes: tuple[ArrayWrite, ...],
    records: tuple[serializers.ArrayRecord, ...],
    group: bytes,
    bundle: forms.BundleWrite | None,
    *,
    spec_map: Mapping[str, Any],
    shardings: tuple[dict[str, Any] | None, ...],
    record_maps: Sequence[Mapping[str, Any]] | None = None,
) -> WritePlan:
    """The plan of ``write`` with its manifest, built here for both ways of planning (each
    residual on its own, or from its signature's template): the manifest's fields in one
    order, sealed, and the :class:`StoredContext` parsing it gives. ``record_maps``: the
    records' manifest maps, each of a record already checked (the template's), else the
    records themselves are checked as they are encoded."""
    created = time.time()
    fields: dict[str, Any] = {
        "key": write.key,
        "signature": write.spec.signature,
        "created": created,
        "jax_version": jax.__version__,
        "spec": spec_map,
        "data_dir": folder,
        "arrays": records if record_maps is None else record_maps,
    }
    if bundle is not None:
        fields["bundle"] = bundle.ref.to_map()
    manifest = serializers.encode_manifest(fields, records_checked=record_maps is not None)
    stored = StoredContext(
        write.key, write.spec, records, tuple(write.impls), created, jax.__version__, folder, shardings,
        bundle.ref if bundle is not None else None, shape,
    )
    return WritePlan(write.key, folder, shape, writes, records, manifest, group, stored, bundle)


@dataclasses.dataclass(frozen=True, eq=False)
class _Template:
    """What every write of one signature shares, worked out at its first write: the host
    arrays' shapes and dtypes it holds for, each residual's record but for its path and checksum
    (checked once), the spec's map, the bundle's layout, the group's ``zarr.json`` split where
    the paths go, and the folder shape. For a context whose own arrays all go in its bundle
    and whose residuals are all NumPy arrays: a write of it then costs a few operations per
    residual (its checksum, its path), not a record built and checked."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    bundled: tuple[int, ...]
    bundle: bundles.BundleLayout
    records: tuple[serializers.ArrayRecord, ...]  # path and checksum placeholders
    record_maps: tuple[dict[str, Any], ...]  # the records' manifest maps
    spec_map: dict[str, Any]
    group_parts: tuple[str, ...]  # the group's JSON around the key, the manifest's path, each path
    folder_shape: str

    @functools.cached_property
    def bundled_set(self) -> frozenset[int]:
        return frozenset(self.bundled)


_TEMPLATE_PATH = "\x00"  # never in a real path, key or checksum: where the group's values go
_TEMPLATES_MAX = 16


def _template_for(spec: ResidualSpec, arrays: HostArrays, impls: Sequence[str | None]) -> _Template | None:
    """The template of writes of ``spec`` with these host arrays, or ``None`` where there is
    none (a sharded residual, own arrays past the bundle's limits)."""
    try:
        cache_key = (spec, tuple(impls), forms.BUNDLE_CAP)  # (tests change the cap)
        template = _templates.get(cache_key)
    except TypeError:  # a spec holding an unhashable value
        return None
    if template is None:
        if any(type(x) is not np.ndarray for x in arrays):
            return None
        template = _make_template(spec, cast(list[np.ndarray], arrays), impls)  # (all np.ndarray: checked)
        if template is None:
            return None
        with _templates_lock:
            _templates[cache_key] = template
            while len(_templates) > _TEMPLATES_MAX:
                del _templates[next(iter(_templates))]
    shapes, dtypes = template.shapes, template.dtypes
    for i, x in enumerate(arrays):
        if type(x) is not np.ndarray or x.shape != shapes[i] or x.dtype != dtypes[i]:
            return None
    return template


_templates: dict[tuple[ResidualSpec, tuple[str | None, ...], int], _Template] = {}
_templates_lock = StoreLock()


def _make_template(spec: ResidualSpec, arrays: Sequence[np.ndarray], impls: Sequence[str | None]) -> _Template | None:
    bundled = forms.bundled(spec, arrays)
    if len(bundled) != sum(kind not in SHARED_KINDS for kind in spec.kinds):
        return None
    dtype_names = [serializers.zarr_dtype_name(x.dtype) for x in arrays]
    bundle = forms.bundle_layout_of(spec, [(i, arrays[i].shape, dtype_names[i]) for i in bundled])
    offsets = {i: where.offset for i, where in zip(bundled, bundle.arrays)}
    placeholder = serializers.checksum(b"")
    records = tuple(
        serializers.ArrayRecord.for_writing(
            name=spec.names[i], path="p", shape=x.shape, dtype=dtype_names[i], nbytes=int(x.nbytes),
            checksum=placeholder, input_path=spec.input_paths[i], shared=kind in SHARED_KINDS,
            offset=offsets.get(i),
        ).checked()
        for i, (x, kind) in enumerate(zip(arrays, spec.kinds))
    )
    bundle_path_text = bundle_path(_TEMPLATE_PATH)[len(_TEMPLATE_PATH):]  # "/bundle.zip"
    group = serializers.encode_group_metadata({"residual_store": {
        "key": _TEMPLATE_PATH, "signature": spec.signature, "manifest": _TEMPLATE_PATH,
        "arrays": [
            {"path": _TEMPLATE_PATH, "name": r.name, "kind": k}
            | ({"bundle": _TEMPLATE_PATH + bundle_path_text, "in_bundle": str(i)} if r.bundled else {})
            for i, (r, k) in enumerate(zip(records, spec.kinds))
        ],
    }}, no_members=True).decode()  # every own array is in the bundle
    placeholder_json = json.dumps(_TEMPLATE_PATH)[1:-1]
    pieces = group.split(placeholder_json)
    if len(pieces) != len(records) + len(bundled) + 3:  # a name holding the placeholder: no template
        return None
    shape = folder_shape(spec, [(i, in_bundle_name(i), arrays[i].shape, dtype_names[i], None) for i in bundled])
    return _Template(
        tuple(x.shape for x in arrays), tuple(x.dtype for x in arrays), tuple(bundled), bundle, records,
        tuple(r.to_dict() for r in records), spec_to_map(spec, impls), tuple(pieces), shape,
    )


def _plan_from_template(template: _Template, write: HostWrite, arrays: Sequence[np.ndarray], folder: str) -> WritePlan:
    """:func:`plan_write` of a context that has a :class:`_Template` (``arrays``: its host
    arrays, all NumPy): the same plan, records and bytes, made from the template."""
    if not serializers.is_safe_relpath(folder):
        raise ValueError(f"refusing to write to {folder!r}: not a safe relative path")
    whole_sums, digests = write.whole_sums, write.digests
    data = [arrays[i] for i in template.bundled]
    bundle, crcs = forms.bundle_write(template.bundle, data, folder)
    where: list[str] = [""] * len(arrays)  # each residual's path
    checksums: list[str] = [""] * len(arrays)
    for i, crc in zip(template.bundled, crcs):
        where[i], checksums[i] = own_array_path(folder, i), bundles.crc_checksum(crc)
    writes: list[ArrayWrite] = []
    weights: set[str] = set()
    for i, x in enumerate(arrays):
        if where[i]:
            continue
        checksums[i] = whole_sums.get(i) or serializers.checksum(x)
        where[i] = weight_path(digests.get(i) or serializers.content_digest(x))
        if where[i] not in weights:
            writes.append(ArrayWrite(i, where[i], x, True, True, None))
            weights.add(where[i])
    records = tuple(r.relocated(p, c) for r, p, c in zip(template.records, where, checksums))
    maps = []
    for m, p, c in zip(template.record_maps, where, checksums):
        m = dict(m)
        m["path"], m["checksum"] = p, c
        maps.append(m)
    # the group's values where the template's JSON has them (keys sorted: each array's bundle
    # folder, if bundled, and path; then the key and the manifest's path); the paths are safe
    # relative paths, which JSON writes as they are
    values: list[str] = []
    bundled = template.bundled_set
    for i, p in enumerate(where):
        if i in bundled:
            values.append(folder)
        values.append(p)
    values += [json.dumps(write.key)[1:-1], json.dumps(manifest_path(write.key))[1:-1]]
    pieces = template.group_parts
    text = [pieces[0]]
    for v, piece in zip(values, pieces[1:]):
        text += [v, piece]
    group = "".join(text).encode()
    return _sealed(
        write, folder, template.folder_shape, tuple(writes), records, group, bundle,
        spec_map=template.spec_map, shardings=tuple(None for _ in records), record_maps=maps,
    )
