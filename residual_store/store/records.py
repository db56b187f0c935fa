"""Contexts as stored records: host arrays, sharding records, the manifest's spec map.

What the disk tier writes for a context and how it is read back, independent of where the bytes
go: residuals as host NumPy arrays (typed PRNG keys as their key data, sharded arrays shard by
shard), the sharding of each residual, the spec as a msgpack-able map, and the layout digest
that lets a data folder be recycled by a write of the same shapes and dtypes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import xxhash
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import serializers
from residual_store.context import ResidualContext, ResidualSpec
from residual_store.errors import CorruptContextError, InvalidArgumentError

__all__ = [
    "HostArrays",
    "ShardedHost",
    "StaleData",
    "StoredContext",
    "chunk_index",
    "chunked_digest",
    "chunked_digest_of",
    "host_arrays",
    "layout_digest",
    "rebuild_sharding",
    "sharding_record",
    "spec_from_map",
    "spec_to_map",
    "to_device_sharded",
]

HostArrays = list["np.ndarray | ShardedHost"]
"""A context's residuals on the host: whole arrays, or shards of a sharded one."""


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

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.records)

    def sharding(self, i: int) -> dict[str, Any] | None:
        return self.shardings[i] if i < len(self.shardings) else None


def _is_key_dtype(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


@dataclasses.dataclass(frozen=True, eq=False)
class ShardedHost:
    """A residual sharded over a mesh, on the host.

    Written and read as chunks of a regular grid whose chunk shape is the shard shape (``chunks``:
    chunk index -> block; a writer holds one per distinct shard, a reader those its devices
    need), or, for a sharding whose shards are no such grid (fully replicated, uneven, empty),
    as the ``whole`` array (``chunk_shape`` is then ``None``).

    Attributes:
      sharding: the manifest's record of the ``NamedSharding`` (see :func:`sharding_record`).
      placement: on a read that could rebuild the sharding here, the ``NamedSharding`` to place
        the array with (:func:`to_device_sharded`).
    """

    sharding: dict[str, Any]
    shape: tuple[int, ...]
    dtype: np.dtype
    chunk_shape: tuple[int, ...] | None
    chunks: Mapping[Any, np.ndarray]  # chunk index (tuple of ints) -> block
    whole: np.ndarray | None = None
    placement: NamedSharding | None = None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def _spec_entry(entry: Any) -> Any:
    """One dimension of a PartitionSpec as msgpack: None, an axis name, or a list of names."""
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, tuple) and all(isinstance(a, str) for a in entry):
        return list(entry)
    raise ValueError(f"unsupported PartitionSpec entry {entry!r}")


def sharding_record(x: Any) -> dict[str, Any] | None:
    """The msgpack-able record of ``x``'s sharding, if it is a ``NamedSharding`` over more than
    one device; ``None`` otherwise (single device, other sharding types, specs with unreduced or
    unconstrained dimensions): those arrays are stored and loaded as before."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(x, jax.Array) or not isinstance(sharding, NamedSharding):
        return None
    if len(sharding.device_set) <= 1:
        return None
    mesh, spec = sharding.mesh, sharding.spec
    if not isinstance(mesh, Mesh) or getattr(spec, "unreduced", None) or getattr(spec, "reduced", None):
        return None
    try:
        entries = [_spec_entry(e) for e in spec]
    except ValueError:
        return None
    record: dict[str, Any] = {
        "mesh_axis_names": [str(n) for n in mesh.axis_names],
        "mesh_axis_sizes": [int(n) for n in mesh.devices.shape],
        "spec": entries,
        "device_ids": [int(d.id) for d in mesh.devices.flat],
    }
    axis_types = getattr(mesh, "axis_types", None)
    if axis_types is not None:
        record["mesh_axis_types"] = [getattr(t, "name", str(t)) for t in axis_types]
    return record


def _check_sharding_map(m: Any, ndim: int) -> dict[str, Any]:
    """Validates an untrusted sharding record; raises ValueError."""
    if not isinstance(m, dict):
        raise ValueError("a sharding must be a map")  # noqa: TRY004 - callers catch ValueError
    names, sizes, entries = m.get("mesh_axis_names"), m.get("mesh_axis_sizes"), m.get("spec")
    if not (isinstance(names, list) and names and all(isinstance(n, str) and n for n in names)):
        raise ValueError("mesh_axis_names must be a non-empty list of str")
    if len(set(names)) != len(names):
        raise ValueError("mesh_axis_names has duplicates")
    if not (
        isinstance(sizes, list)
        and len(sizes) == len(names)
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes)
    ):
        raise ValueError("mesh_axis_sizes must be one int >= 1 per axis")
    if not isinstance(entries, list) or len(entries) > ndim:
        raise ValueError(f"spec must be a list of at most {ndim} entries")
    used: list[str] = []
    for e in entries:
        axes = [] if e is None else [e] if isinstance(e, str) else e
        if not isinstance(axes, list) or not all(isinstance(a, str) and a in names for a in axes):
            raise ValueError(f"spec entry {e!r} names no axis of the mesh")
        used += axes
    if len(set(used)) != len(used):
        raise ValueError("spec uses a mesh axis twice")
    ids = m.get("device_ids")
    if ids is not None and not (
        isinstance(ids, list)
        and len(ids) == int(np.prod(sizes))
        and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    ):
        raise ValueError("device_ids must be one int per mesh device")
    types = m.get("mesh_axis_types")
    if types is not None and not (
        isinstance(types, list) and len(types) == len(names) and all(isinstance(t, str) for t in types)
    ):
        raise ValueError("mesh_axis_types must be one str per axis")
    return m


def rebuild_sharding(record: Mapping[str, Any]) -> NamedSharding | None:
    """The ``NamedSharding`` of a sharding record on this process's devices, or ``None`` when
    the process has fewer devices than the mesh.

    The mesh gets the recorded axis names, sizes and types. Its devices are the recorded device
    ids when this process has all of them (the same mesh as the writer's), else the first
    devices of ``jax.devices()`` in order.
    """
    names = tuple(record["mesh_axis_names"])
    sizes = tuple(int(n) for n in record["mesh_axis_sizes"])
    n = int(np.prod(sizes))
    devices = jax.devices()
    if len(devices) < n:
        return None
    by_id = {d.id: d for d in devices}
    ids = record.get("device_ids")
    if ids is not None and len(set(ids)) == n and all(i in by_id for i in ids):
        chosen = [by_id[i] for i in ids]
    else:
        chosen = list(devices[:n])
    kwargs: dict[str, Any] = {}
    types = record.get("mesh_axis_types")
    axis_type = getattr(jax.sharding, "AxisType", None)
    if types is not None and axis_type is not None:
        try:
            kwargs["axis_types"] = tuple(axis_type[t] for t in types)
        except KeyError:
            pass  # a type this JAX does not know: its default
    mesh = Mesh(np.array(chosen, dtype=object).reshape(sizes), names, **kwargs)
    spec = PartitionSpec(*[tuple(e) if isinstance(e, list) else e for e in record["spec"]])
    return NamedSharding(mesh, spec)


def chunk_index(region: Sequence[slice] | None, chunk_shape: Sequence[int]) -> tuple[int, ...]:
    """The index of the chunk that starts where ``region`` (a shard's slices) starts."""
    assert region is not None
    return tuple((s.start or 0) // c for s, c in zip(region, chunk_shape))


def _sharded_host(x: jax.Array, record: dict[str, Any]) -> ShardedHost:
    """``x`` (sharded) on the host: the block of each distinct shard, copied shard by shard."""
    shape = tuple(int(d) for d in x.shape)
    dtype = np.dtype(x.dtype)
    shard_shape = tuple(int(d) for d in x.sharding.shard_shape(x.shape))
    if x.size == 0 or shard_shape == shape or any(d % c for d, c in zip(shape, shard_shape)):
        if x.sharding.is_fully_replicated:  # any one replica is the whole array
            whole = np.asarray(x.addressable_shards[0].data)
        elif not x.is_fully_addressable:
            raise InvalidArgumentError(
                f"a store cannot write an array of shape {shape} sharded unevenly over the devices "
                "of several processes; shard it evenly (every dimension divisible by its shards)"
            )
        else:
            whole = np.asarray(x)  # uneven or empty shards: no grid of blocks to write
        return ShardedHost(record, shape, dtype, None, {}, whole)
    if not x.is_fully_addressable and jax.process_count() == 1:
        raise InvalidArgumentError(
            "a store cannot write an array sharded over devices it cannot address"
        )
    # Several processes: each holds the distinct shards (replica_id == 0) of its own devices;
    # the disk tier's collective write puts each process's chunks in one array.
    chunks: dict[tuple[int, ...], np.ndarray] = {}
    for shard in x.addressable_shards:
        if shard.replica_id == 0:
            chunks[chunk_index(shard.index, shard_shape)] = np.asarray(shard.data)
    return ShardedHost(record, shape, dtype, shard_shape, chunks)


def to_device_sharded(host: ShardedHost) -> jax.Array:
    """Places a :class:`ShardedHost` read with a ``placement``: each device gets its chunk
    (``device_put`` per device, no whole array on any one device), assembled with
    ``jax.make_array_from_single_device_arrays``."""
    sharding = host.placement
    assert sharding is not None
    if host.chunk_shape is None:
        return jax.device_put(host.whole, sharding)
    index_map = sharding.addressable_devices_indices_map(host.shape)
    devices = list(index_map)
    blocks = [host.chunks[chunk_index(index_map[d], host.chunk_shape)] for d in devices]
    singles = jax.device_put(blocks, devices)
    return jax.make_array_from_single_device_arrays(host.shape, sharding, singles)


def host_arrays(ctx: ResidualContext) -> tuple[HostArrays, list[str | None]]:
    """The residuals on the host (typed keys as their key data) and each key's impl.

    A residual sharded over several devices with a ``NamedSharding`` becomes a
    :class:`ShardedHost` (its shards' blocks, never the gathered array); the others become NumPy
    arrays.
    """
    arrays: HostArrays = []
    impls: list[str | None] = []
    for x in ctx.residuals:
        if _is_key_dtype(x.dtype):
            impls.append(str(jax.random.key_impl(x)))
            x = jax.random.key_data(x)
        else:
            impls.append(None)
        record = sharding_record(x)
        arrays.append(_sharded_host(x, record) if record is not None else np.asarray(x))
    return arrays, impls


def chunked_digest(host: ShardedHost) -> str:
    """The content address of a chunked weight: a digest of its chunks' digests (and of its
    dtype, shape and chunk shape), so equal weights sharded alike are stored once."""
    assert host.chunk_shape is not None
    digests = {idx: serializers.content_digest(c) for idx, c in host.chunks.items()}
    return chunked_digest_of(host.dtype, host.shape, host.chunk_shape, digests)


def chunked_digest_of(
    dtype: np.dtype, shape: tuple[int, ...], chunk_shape: tuple[int, ...], digests: Mapping[Any, str]
) -> str:
    """:func:`chunked_digest` from every chunk's content digest (chunk index -> digest), which
    several processes that each hold some chunks can gather."""
    h = xxhash.xxh3_128()
    h.update(f"{np.dtype(dtype).str}{tuple(shape)}{tuple(chunk_shape)};".encode())
    for idx in sorted(digests):
        h.update(f"{tuple(idx)}={digests[idx]};".encode())
    return h.hexdigest()


class StaleData(NamedTuple):
    """A data folder no manifest references any more, and its layout (for reuse)."""

    data_dir: str
    layout: str


def layout_digest(items: Iterable[tuple[str, tuple[int, ...], str, tuple[int, ...] | None]]) -> str:
    """A digest of (name, shape, dtype, chunk shape) of each intermediate array: folders of equal
    layout can be reused for each other's writes."""
    h = hashlib.sha256()
    for name, shape, dtype, chunks in sorted(items, key=lambda t: (t[0], str(t[1:]))):
        grid = "" if chunks is None else f"|{tuple(int(c) for c in chunks)}"
        h.update(f"{name}|{tuple(int(d) for d in shape)}|{dtype}{grid};".encode())
    return h.hexdigest()[:16]


@functools.cache
def _key_dtype(impl: str) -> Any:
    """The typed key dtype of a PRNG implementation, by tracing only (no device dispatch)."""
    return jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype


def spec_to_map(
    spec: ResidualSpec, impls: Sequence[str | None], shardings: Sequence[dict[str, Any] | None] = ()
) -> dict[str, Any]:
    out = {
        "avals": [[list(a.shape), str(a.dtype)] for a in spec.avals],
        "names": list(spec.names),
        "input_paths": list(spec.input_paths),
        "kinds": list(spec.kinds),
        "key_impls": list(impls),
    }
    if any(s is not None for s in shardings):  # absent when nothing is sharded: same bytes as before
        out["shardings"] = list(shardings)
    return out


def spec_from_map(
    signature: str, m: Mapping[str, Any], records: Sequence[Any], what: str
) -> tuple[ResidualSpec, tuple[str | None, ...], tuple[dict[str, Any] | None, ...]]:
    try:
        n = len(records)
        avals_raw, names = m["avals"], m["names"]
        input_paths, kinds, impls = m["input_paths"], m["kinds"], m["key_impls"]
        if not all(isinstance(v, list) and len(v) == n for v in (avals_raw, names, input_paths, kinds, impls)):
            raise ValueError(f"spec lists must all have {n} entries")
        if any(k not in ("input", "constant", "intermediate") for k in kinds):
            raise ValueError(f"unknown residual kinds {sorted(set(kinds))}")
        avals = []
        for (shape, dtype), impl, record in zip(avals_raw, impls, records):
            if impl is not None:
                key_dtype = _key_dtype(impl)
                if str(key_dtype) != dtype:
                    raise ValueError(f"key dtype {dtype} does not match impl {impl}")
                avals.append(jax.ShapeDtypeStruct(tuple(shape), key_dtype))
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
                shardings.append(None if sh is None else _check_sharding_map(sh, len(record.shape)))
            except ValueError as err:
                raise ValueError(f"sharding of residual {j}: {err}") from None
        spec = ResidualSpec(
            signature=signature,
            avals=tuple(avals),
            names=tuple(str(s) for s in names),
            input_paths=tuple(p if p is None else str(p) for p in input_paths),
            kinds=tuple(kinds),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise CorruptContextError(f"{what}: invalid spec in manifest ({err})") from None
    return spec, tuple(impls), tuple(shardings)

