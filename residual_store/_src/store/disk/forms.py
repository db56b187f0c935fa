"""The three forms a residual's array takes on disk, and for each, how a write plans it beside
how a read gets it back (as ``jax.export``'s serialization keeps each ``_serialize_X`` beside its
``_deserialize_X``):

- **bundled**: the context's own whole arrays, in order, in its one zip file (``bundle.zip``, see
  :mod:`serializers.bundle`), as long as the bundle stays within a classic zip's limits
  (:func:`plan_bundle`); read back in one read of the whole file, checked as it lands
  (:func:`read_bundle`; :func:`check_bundle` checks every byte, naming what is damaged).
- **chunked**: a sharded residual, one zarr chunk per distinct shard, never gathered
  (:func:`plan_chunked`); read back chunk by chunk, each verified, only the chunks this process's
  devices need where the read places it (:func:`chunk_tasks`, :func:`read_chunk`).
- **whole**: a zarr array of one chunk in a folder of its own: a weight or a constant (under its
  content digest), or an own array past the bundle's limits (:func:`plan_whole`); read back
  with its checksum verified while it is read (:func:`read_whole`, :func:`read_wholes`).

:func:`~residual_store._src.store.disk.layout.plan_write` picks each residual's form and plans it
here; :meth:`~residual_store._src.store.disk.tier.DiskTier.read` schedules the reads here. Every read
error names the context, the residual and the file (:class:`CorruptContextError`); a store that
does not answer raises :class:`StoreUnavailableError`, which is no damage.

What a bundle's read checks is what the manifest's per-residual checksums and the signature's
layout say, not the manifest's word for the whole file: a manifest can be resealed by anyone who
can write the store (its self checksum guards against damage, not against edits), so the
bundle's own checksum in it vouches for nothing its residuals' do not. The residuals' offsets
must be where the layout of the context's residuals puts them (worked out once per layout), and
the CRC-32 of the whole file must be the one those residuals' CRC-32s and the layout's headers
imply (:func:`serializers.bundle.bundle_crc`): one CRC-32 pass as the file lands checks each
residual against its own checksum and every other byte against the headers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple, TypeGuard

import numpy as np
import xxhash
from jax.sharding import NamedSharding

import residual_store_serializers as serializers
from residual_store._src.context import SHARED_KINDS, ResidualSpec
from residual_store._src.errors import CorruptContextError, ResidualStoreError, StoreUnavailableError
from residual_store._src.placement import rebuild_sharding
from residual_store._src.store.critical import StoreLock
from residual_store._src.store.disk.host_arrays import HostArrays, ShardedHost, chunk_index
from residual_store._src.store.disk.paths import bundle_path
from residual_store._src.store.disk.protocol import Backend, Empty
from residual_store._src.store.disk.records import BundleRef, StoredContext
from residual_store_serializers import bundle as bundles
from residual_store_serializers.checksums import checksum_parts

__all__ = [
    "BUNDLE_CAP",
    "BundleWrite",
    "ChunkSums",
    "Planned",
    "Task",
    "array_attributes",
    "bundle_layout_of",
    "bundle_write",
    "bundled",
    "check_bundle",
    "chunk_sums",
    "chunk_tasks",
    "chunked_digest_of",
    "is_chunked",
    "joined_chunks",
    "placement_of",
    "plan_bundle",
    "plan_chunked",
    "plan_whole",
    "read_bundle",
    "read_chunk",
    "read_whole",
    "read_wholes",
]


def array_attributes(spec: ResidualSpec, i: int) -> dict[str, Any]:
    """The zarr attributes of an own array: what plain zarr shows of it (the manifest decides)."""
    return {"residual_store": {
        "index": i, "name": spec.names[i], "kind": spec.kinds[i], "input_path": spec.input_paths[i],
    }}


def is_chunked(x: np.ndarray | ShardedHost) -> TypeGuard[ShardedHost]:
    """Whether a host residual is written chunked: a sharded one held as chunks of a regular
    grid (a fully replicated, uneven or empty sharding is held whole)."""
    return isinstance(x, ShardedHost) and x.chunk_shape is not None


@dataclasses.dataclass(frozen=True)
class Planned:
    """A residual's array as a write puts it in a folder of its own (chunked or whole)."""

    data: Any  # a NumPy array, or a serializers.ChunkedArray of this process's chunks
    checksum: str  # the record's
    digest: str | None  # its content address (weights and constants alone)
    whole: bool  # a whole array: in a job of several processes, process 0 alone writes it
    chunk_fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # the record's


Task = tuple[int, tuple[int, ...] | None, str]
"""One read of a context's arrays: (residual index, chunk index or ``None`` for the whole
array, the checksum to verify)."""


def placement_of(key: str, i: int, record: serializers.ArrayRecord, sharding: Mapping[str, Any]) -> NamedSharding | None:
    """Where a read puts a sharded residual: its recorded sharding rebuilt on this process's
    devices (``None``: too few of them); :class:`CorruptContextError` for a record that
    rebuilds no sharding."""
    try:
        return rebuild_sharding(sharding)
    except Exception as err:  # JAX raises several types for a bad mesh or spec
        raise CorruptContextError(
            f"context {key!r}, residual {i} ({record.name}): cannot rebuild its sharding "
            f"{sharding} on this process's devices ({type(err).__name__}: {err})"
        ) from err


@contextlib.contextmanager
def _naming(what: str) -> Iterator[None]:
    """A failed read of one array or chunk as a :class:`CorruptContextError` naming ``what``
    (the serializers name only the array); a store that does not answer as it is."""
    try:
        yield
    except (serializers.CorruptDataError, serializers.UnsupportedDTypeError) as err:
        raise CorruptContextError(f"{what}: {err}") from err
    except StoreUnavailableError:
        raise  # no answer is no damage
    except (OSError, ValueError) as err:
        raise CorruptContextError(f"{what}: unreadable ({err})") from err


def _residual(key: str, i: int, record: serializers.ArrayRecord) -> str:
    return f"context {key!r}, residual {i} ({record.name}) at {record.path}"


# -- bundled ----------------------------------------------------------------------------------

BUNDLE_CAP = 1 << 31
"""Bytes of arrays one bundle takes at most (a classic zip holds 4 GiB): the rest keep folders."""


@dataclasses.dataclass(frozen=True)
class BundleWrite:
    """A write's bundle: the file at ``ref.path`` written from ``parts`` one after another (its
    headers and its arrays' own buffers), ``ref`` what the manifest says of it."""

    ref: BundleRef
    parts: tuple[memoryview | bytes, ...]


def bundled(spec: ResidualSpec, arrays: Sequence[np.ndarray | ShardedHost]) -> list[int]:
    """The residuals that go into the write's bundle: the context's own whole arrays, in order,
    as long as the bundle stays within a classic zip's limits."""
    out: list[int] = []
    entries, nbytes = 1, 0
    for i, (x, kind) in enumerate(zip(arrays, spec.kinds)):
        if kind in SHARED_KINDS or is_chunked(x):
            continue
        size = int(x.nbytes)
        if entries + 2 > bundles.MAX_BUNDLE_ENTRIES or nbytes + size > BUNDLE_CAP:
            break
        out.append(i)
        entries, nbytes = entries + 2, nbytes + size
    return out


def bundle_layout_of(spec: ResidualSpec, arrays: Sequence[tuple[int, tuple[int, ...], str]]) -> bundles.BundleLayout:
    """The bundle layout of ``spec``'s residuals given as ``(index, shape, zarr dtype)``: each at
    ``<i>/`` with the attributes its own folder would have, the group's naming the signature.
    A pure function of its arguments, remembered per spec (every write of one signature has the
    same layout), so a reader (``verify``) rebuilds exactly what the writer wrote."""
    own = tuple((int(i), tuple(int(d) for d in shape), str(dtype)) for i, shape, dtype in arrays)
    try:
        return _bundle_layout_of(spec, own)
    except TypeError:  # a spec holding an unhashable value
        return _bundle_layout_of.__wrapped__(spec, own)


@functools.lru_cache(maxsize=32)
def _bundle_layout_of(spec: ResidualSpec, own: tuple[tuple[int, tuple[int, ...], str], ...]) -> bundles.BundleLayout:
    return bundles.bundle_layout(
        [(str(i), shape, dtype) for i, shape, dtype in own],
        [array_attributes(spec, i) for i, _, _ in own],
        {"residual_store": {"signature": spec.signature,
                            "bundle": "the own arrays of one write of a context, by residual index"}},
    )


def bundle_write(layout: bundles.BundleLayout, data: Sequence[np.ndarray], folder: str) -> tuple[BundleWrite, list[int]]:
    """The bundle of the data folder ``folder`` holding ``data`` laid out as ``layout``, and
    each array's CRC-32 (the zip's own, computed once: the array's checksum)."""
    parts, crcs = bundles.bundle_parts(layout, data)
    ref = BundleRef(bundle_path(folder), layout.nbytes, checksum_parts(parts))
    return BundleWrite(ref, tuple(parts)), list(crcs)


def _whole(x: np.ndarray | ShardedHost) -> np.ndarray:
    """A residual held whole (a sharded one on a sharding of no regular grid: its ``whole``)."""
    data = x.whole if isinstance(x, ShardedHost) else x
    assert data is not None
    return data


def plan_bundle(
    spec: ResidualSpec, arrays: HostArrays, folder: str
) -> tuple[BundleWrite | None, dict[int, tuple[int, str]]]:
    """The write's bundle (``None`` if it has no own whole array), and for each residual in it
    its offset and checksum (its CRC-32: the zip's own, computed once)."""
    indices = bundled(spec, arrays)
    if not indices:
        return None, {}
    data = [_whole(arrays[i]) for i in indices]
    layout = bundle_layout_of(spec, [(i, d.shape, serializers.zarr_dtype_name(d.dtype)) for i, d in zip(indices, data)])
    bundle, crcs = bundle_write(layout, data, folder)
    placed = {
        i: (where.offset, bundles.crc_checksum(crc)) for i, where, crc in zip(indices, layout.arrays, crcs)
    }
    return bundle, placed


class _Layout(NamedTuple):
    """The bundle layout of one spec's bundled residuals, and their offsets in it."""

    spec: ResidualSpec  # held, so that its id names no other spec while this is cached
    bundle: bundles.BundleLayout
    offsets: tuple[int, ...]


_LAYOUTS_MAX = 64
_layouts: dict[tuple[int, tuple[int, ...]], _Layout] = {}
_layouts_lock = StoreLock()


def _layout_of(stored: StoredContext) -> _Layout:
    """The bundle layout of ``stored``'s bundled residuals, from :func:`bundle_layout_of` (the
    writer's), remembered per spec object and residuals: a get finds it in one look-up of its
    spec's identity (comparing two equal specs of hundreds of residuals costs more than the
    rest of the check)."""
    spec = stored.spec
    key = (id(spec), stored.bundled)
    found = _layouts.get(key)
    if found is not None and found.spec is spec:
        return found
    records = stored.records
    try:
        made = bundle_layout_of(spec, [(i, records[i].shape, records[i].dtype) for i in stored.bundled])
    except (ValueError, serializers.SerializationError) as err:  # past a zip's limits: no writer's
        raise CorruptContextError(f"context {stored.key!r}: its bundled residuals fit no bundle ({err})") from None
    found = _Layout(spec, made, tuple(a.offset for a in made.arrays))
    with _layouts_lock:
        _layouts.pop(key, None)
        while len(_layouts) >= _LAYOUTS_MAX:
            del _layouts[next(iter(_layouts))]
        _layouts[key] = found
    return found


def _check_offsets(key: str, stored: StoredContext, expected: _Layout) -> None:
    """:class:`CorruptContextError` naming the residual unless the bundle is of the layout's size
    and each bundled residual at the layout's offset for it."""
    ref = stored.bundle
    assert ref is not None
    what = f"context {key!r}, bundle {ref.path}"
    if ref.nbytes != expected.bundle.nbytes:
        raise CorruptContextError(
            f"{what}: the manifest gives it {ref.nbytes:,} bytes, the layout of its residuals "
            f"{expected.bundle.nbytes:,}"
        )
    got = stored.bundle_offsets
    if got != expected.offsets:
        j = next(j for j, (a, b) in enumerate(zip(got, expected.offsets)) if a != b)
        i = stored.bundled[j]
        raise CorruptContextError(
            f"{what}: residual {i} ({stored.records[i].name}) is at byte {got[j]:,} of it in the "
            f"manifest, where the layout of its residuals puts it at byte {expected.offsets[j]:,} "
            "(its arrays' offsets are not where this layout puts them)"
        )


def _expected_crc(key: str, stored: StoredContext) -> str:
    """The checksum the whole bundle of ``stored`` must have (``"crc32:..."``): the CRC-32 its
    residuals' CRC-32s and its layout imply, after its offsets are checked against the layout."""
    expected = _layout_of(stored)
    _check_offsets(key, stored, expected)
    return bundles.crc_checksum(bundles.bundle_crc(expected.bundle, stored.bundle_crcs))


def read_bundle(backend: Backend, key: str, stored: StoredContext, *, empty: Empty | None = None) -> dict[int, np.ndarray]:
    """The bundled residuals of ``key``, as views into one buffer: the bundle read in one call
    and checked as it lands against the CRC-32 of the whole file that the residuals' own
    CRC-32s and the layout imply (no work per residual but its view); the offsets the views
    are taken at are the layout's. On a mismatch the file is checked residual by residual, so
    that the error names the damaged one."""
    ref = stored.bundle
    assert ref is not None
    what = f"context {key!r}, bundle {ref.path}"
    expected = _expected_crc(key, stored)
    try:
        buffer = backend.read_file(ref.path, ref.nbytes, checksum=expected, empty=empty)
    except StoreUnavailableError:
        raise  # no answer is no damage
    except serializers.ChecksumMismatchError as err:
        # Which part: a residual (named), or the headers. The file is read again for that, and
        # may be gone by now (its context replaced or deleted meanwhile): check says so too.
        whole = f"checksum mismatch of the whole file: its CRC-32 is not the {expected} that its residuals' and its layout imply"
        try:
            check_bundle(backend, key, stored)
        except CorruptContextError as found:
            raise CorruptContextError(f"{found} ({whole})") from err
        raise CorruptContextError(f"{what}: {whole}") from err
    except serializers.CorruptDataError as err:  # missing, truncated, not a regular file
        raise CorruptContextError(f"{what}: {err}") from err
    except OSError as err:
        raise CorruptContextError(f"{what}: unreadable ({err})") from err
    return dict(zip(stored.bundled, bundles.bundle_views(stored.bundle_arrays, buffer)))


def check_bundle(backend: Backend, key: str, stored: StoredContext, buffer: np.ndarray | None = None) -> None:
    """Checks every byte of ``key``'s bundle (read here unless given): the offsets against the
    layout, each residual's bytes against its checksum, every other byte against the headers its
    writer wrote (which plain zip readers check): :class:`CorruptContextError` naming the
    residual or the headers."""
    ref = stored.bundle
    if ref is None:
        return
    indices = stored.bundled
    records = [stored.records[i] for i in indices]
    what = f"context {key!r}, bundle {ref.path}"
    expected = _layout_of(stored)
    _check_offsets(key, stored, expected)
    try:
        if buffer is None:
            buffer = backend.read_file(ref.path, ref.nbytes)
        sums: list[Any] = [r.checksum if r.nbytes else None for r in records]
        names = [f"residual {i} ({r.name})" for i, r in zip(indices, records)]
        bundles.check_bundle(expected.bundle, buffer, sums, what=what, names=names)
    except StoreUnavailableError:
        raise  # no answer is no damage
    except (serializers.SerializationError, ValueError) as err:  # missing, of another size, damaged
        raise CorruptContextError(str(err) if str(err).startswith(what) else f"{what}: {err}") from err
    except OSError as err:
        raise CorruptContextError(f"{what}: unreadable ({err})") from err


# -- chunked ----------------------------------------------------------------------------------

ChunkSums = Mapping[int, Mapping[tuple[int, ...], tuple[str, str | None]]]
"""Per chunked residual: chunk index -> (checksum, content digest or ``None``); the digest only
for weights, which are stored under a digest of their chunks' digests."""


def chunk_sums(spec: ResidualSpec, arrays: HostArrays) -> dict[int, dict[tuple[int, ...], tuple[str, str | None]]]:
    """The :data:`ChunkSums` of the chunks this process holds."""
    out: dict[int, dict[tuple[int, ...], tuple[str, str | None]]] = {}
    for i, (x, kind) in enumerate(zip(arrays, spec.kinds)):
        if is_chunked(x):
            shared = kind in SHARED_KINDS
            out[i] = {
                idx: (serializers.checksum(c), serializers.content_digest(c) if shared else None)
                for idx, c in sorted(x.chunks.items())
            }
    return out


def chunked_digest_of(
    dtype: np.dtype, shape: tuple[int, ...], chunk_shape: tuple[int, ...], digests: Mapping[Any, str]
) -> str:
    """The content address of a chunked weight from every chunk's content digest (chunk index ->
    digest; several processes that each hold some chunks can gather them): a digest of those and
    of its dtype, shape and chunk shape, so equal weights sharded alike are stored once."""
    h = xxhash.xxh3_128()
    h.update(f"{np.dtype(dtype).str}{tuple(shape)}{tuple(chunk_shape)};".encode())
    for idx in sorted(digests):
        h.update(f"{tuple(idx)}={digests[idx]};".encode())
    return h.hexdigest()


def plan_chunked(
    key: str, spec: ResidualSpec, i: int, x: ShardedHost, sums: Mapping[tuple[int, ...], tuple[str, str | None]],
    *, shared: bool,
) -> Planned:
    """Residual ``i`` held as chunks: this process's chunks to write, and from ``sums`` (every
    chunk's checksum and digest, from every process in a collective write) the record's chunk
    checksums, the array's checksum and, ``shared``, its content address.
    :class:`ResidualStoreError` if ``sums`` lacks a chunk of the grid."""
    assert x.chunk_shape is not None
    table = sorted(sums.items())
    grid = serializers.chunk_grid(x.shape, x.chunk_shape)
    if len(table) != int(np.prod(grid)):
        raise ResidualStoreError(
            f"collective write of context {key!r}: residual {i} ({spec.names[i]}) has {len(table)} of its "
            f"{int(np.prod(grid))} shards among all processes"
        )
    checksums = [(idx, chk) for idx, (chk, _) in table]
    digest = chunked_digest_of(x.dtype, x.shape, x.chunk_shape, {idx: str(d) for idx, (_, d) in table}) if shared else None
    return Planned(
        serializers.ChunkedArray(x.shape, x.dtype, x.chunk_shape, x.chunks), serializers.chunked_checksum(checksums),
        digest, False, {"chunk_shape": x.chunk_shape, "chunk_checksums": checksums},
    )


def chunk_tasks(i: int, record: serializers.ArrayRecord, placement: NamedSharding | None) -> tuple[bool, list[Task]]:
    """The chunks a read of the chunked residual ``i`` wants, and whether they are only those
    of this process's devices (read by shard): so where ``placement`` (the rebuilt sharding)
    gives shards of the record's chunk shape; every chunk otherwise (read whole)."""
    assert record.chunk_shape is not None and record.chunk_checksums is not None
    sums = dict(record.chunk_checksums)
    # The recorded mesh and spec give shards of the chunk shape; anything else is read whole.
    shards = placement is not None and tuple(placement.shard_shape(record.shape)) == record.chunk_shape
    if shards:
        assert placement is not None
        index_map = placement.addressable_devices_indices_map(record.shape)
        wanted = sorted({chunk_index(r, record.chunk_shape) for r in index_map.values()})
    else:
        wanted = list(sums)
    return shards, [(i, idx, sums[idx]) for idx in wanted]


def read_chunk(
    backend: Backend, key: str, i: int, record: serializers.ArrayRecord, chunk: tuple[int, ...], expected: str
) -> np.ndarray:
    """One chunk of the chunked residual ``i``, verified against its checksum ``expected`` once
    read."""
    what = f"{_residual(key, i, record)}, chunk {serializers.chunk_index_key(chunk)}"
    with _naming(what):
        assert record.chunk_shape is not None
        x = backend.read_chunk(record.path, record.shape, record.dtype, record.chunk_shape, chunk)
        serializers.verify(x, expected, what=what)
        return x


def joined_chunks(record: serializers.ArrayRecord, chunks: Mapping[Any, np.ndarray]) -> np.ndarray:
    """A chunked residual read whole: every chunk (chunk index -> block) into one array."""
    assert record.chunk_shape is not None
    whole = serializers.aligned_empty(record.shape, serializers.numpy_dtype(record.dtype))
    for idx, chunk in chunks.items():
        assert idx is not None
        whole[serializers.chunk_region(idx, record.chunk_shape)] = chunk
    return whole


# -- whole ------------------------------------------------------------------------------------

def plan_whole(
    i: int, x: np.ndarray | ShardedHost, *, shared: bool, whole_sums: Mapping[int, str] | None,
    digests: Mapping[int, str] | None,
) -> Planned:
    """Residual ``i`` held whole, in a folder of its own: its checksum and, ``shared``, its
    content address (each taken from ``whole_sums`` and ``digests`` where computed already)."""
    data = _whole(x)
    checksum = (whole_sums or {}).get(i) or serializers.checksum(data)
    digest = ((digests or {}).get(i) or serializers.content_digest(data)) if shared else None
    return Planned(data, checksum, digest, True)


def read_whole(
    backend: Backend, key: str, i: int, record: serializers.ArrayRecord, expected: str, *, empty: Empty | None = None
) -> np.ndarray:
    """The whole array of residual ``i``, verified against its checksum ``expected`` while it is
    read."""
    with _naming(_residual(key, i, record)):
        return backend.read_arrays([(record.path, record.shape, record.dtype, expected)], empty=empty)[0]


def check_stored(backend: Backend, key: str, i: int, record: serializers.ArrayRecord) -> None:
    """Reads residual ``i``'s stored array (every chunk of a chunked one) against its checksums;
    :class:`CorruptContextError` names the damage."""
    if record.chunked:
        assert record.chunk_checksums is not None
        for idx, expected in dict(record.chunk_checksums).items():
            read_chunk(backend, key, i, record, idx, expected)
    else:
        read_whole(backend, key, i, record, record.checksum)


def read_wholes(
    backend: Backend, key: str, records: Sequence[serializers.ArrayRecord], tasks: Sequence[Task], *,
    empty: Empty | None = None,
) -> list[np.ndarray]:
    """The whole arrays of ``tasks``, in one call of the backend (which examines each folder on
    the way once); after a failure there, one array at a time again, so that the error names
    the context and the residual."""
    try:
        return backend.read_arrays(
            [(records[i].path, records[i].shape, records[i].dtype, expected) for i, _, expected in tasks],
            empty=empty,
        )
    except StoreUnavailableError:
        raise  # the store did not answer: asking again, array by array, would not help
    except (serializers.CorruptDataError, serializers.UnsupportedDTypeError, OSError, ValueError):
        return [read_whole(backend, key, i, records[i], expected, empty=empty) for i, _, expected in tasks]
