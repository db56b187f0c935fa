"""The disk tier: where contexts live on disk, how a write becomes visible, and garbage collection.

Layout under the store root (a local folder or any tensorstore kvstore)::

    residual-store.json                 store marker: {"format": "residual-store", "version": 1}
    contexts/<key>.manifest             msgpack manifest; its presence is the commit
    data/<key>.<write id>/<i>/          zarr v3 arrays: the context's intermediates
    weights/<content digest>/           zarr v3 arrays: inputs and constants, stored once
    backwards/<signature>.export        serialized backward (jax.export), once per signature
    backwards/<signature>.manifest      its manifest (checksum, JAX version, platforms)

A write puts every array first (intermediates under a fresh ``data/<key>.<write id>/``, weights
under their content digest, skipped when already there; in a local folder a new weight is written
as ``weights/<digest>.<id>.tmp/`` and renamed into place, so a weight other contexts hold is never
rewritten), then the manifest, atomically (write to a temporary name, fsync, rename; a
single-object put on other kvstores). A crash at any point before the rename leaves no manifest,
so the context is either whole or absent; what it left behind is unreferenced and removed by
:meth:`DiskTier.gc`. Two writers of one key: each commit replaces the manifest whole, so readers
see one complete context or the other (last rename wins; a read that loses the race to a commit
reads the new manifest again).

Sharded residuals: a ``jax.Array`` with a :class:`~jax.sharding.NamedSharding` over several
devices is written shard by shard, never gathered: one zarr chunk per distinct shard (the shards
with ``replica_id == 0``), so the array's chunk shape is the shard shape. Its record lists a
checksum per chunk, and the context's spec records the sharding (mesh axis names, sizes and
types, the ``PartitionSpec``, the mesh's device ids). A reader with as many devices as the mesh
rebuilds the mesh and the sharding, and reads each of its devices' chunks; a reader with fewer
devices reads the whole array (see :meth:`DiskTier.read`). Fully replicated, uneven and empty
shardings are stored as one chunk (the whole array, from one replica where there is one) with
the same sharding record.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import hashlib
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, Protocol

import jax
import numpy as np
import tensorstore as ts
import xxhash
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import serializers
from residual_store.context import ResidualContext, ResidualSpec
from residual_store.errors import (
    ContextNotFoundError,
    CorruptContextError,
    InvalidArgumentError,
    StoreFullError,
)

__all__ = ["DiskTier", "StoredContext", "StaleData", "HostArrays", "ShardedHost", "to_device_sharded"]

STORE_MARKER = "residual-store.json"
STORE_FORMAT = b'{"format": "residual-store", "version": 1}\n'
_KEY_DTYPE_PREFIX = "key<"

HostArrays = list["np.ndarray | ShardedHost"]

_FREE_DIR = "data/.free"
_MAX_FREE_PER_LAYOUT = 64
_READ_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="residual-store-read")
_DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", 122)})
_READ_ATTEMPTS = 8


# ----------------------------------------------------------------------------------------------
# Backends: the few byte- and array-level operations the tier needs, on a folder or a kvstore.


class _Backend(Protocol):
    description: str

    can_recycle: bool

    # values: NumPy arrays or serializers.ChunkedArray (a sharded residual, one chunk per shard)
    def write_arrays(self, arrays: Mapping[str, Any], *, fsync: bool, reuse: bool = False) -> None: ...
    def rename(self, src: str, dst: str) -> bool: ...
    def write_shared_arrays(self, arrays: Mapping[str, Any], *, fsync: bool) -> None: ...
    def read_array(self, path: str, shape: tuple[int, ...], dtype: str) -> np.ndarray: ...
    def read_chunk(
        self, path: str, shape: tuple[int, ...], dtype: str, chunk_shape: tuple[int, ...], index: tuple[int, ...]
    ) -> np.ndarray: ...
    def array_exists(self, path: str) -> bool: ...
    def put_bytes(self, key: str, data: bytes, *, fsync: bool) -> None: ...
    def get_bytes(self, key: str) -> bytes | None: ...
    def list_dir(self, prefix: str) -> list[str]: ...
    def delete(self, key: str) -> None: ...
    def delete_tree(self, prefix: str) -> None: ...
    def age_seconds(self, prefix: str) -> float | None: ...
    def version(self, key: str) -> Any | None: ...


class _LocalBackend:
    """A local folder: the serializers' fast path, atomic renames, fsync."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.description = self.root
        os.makedirs(self.root, exist_ok=True)

    def _path(self, key: str) -> str:
        path = os.path.normpath(os.path.join(self.root, *key.split("/")))
        if path != self.root and not path.startswith(self.root + os.sep):
            raise ValueError(f"refusing a path outside the store: {key!r}")
        return path

    can_recycle = True

    def write_arrays(self, arrays: Mapping[str, Any], *, fsync: bool, reuse: bool = False) -> None:
        serializers.write_arrays_local(self.root, arrays, fsync=fsync, reuse=reuse)

    def rename(self, src: str, dst: str) -> bool:
        try:
            os.makedirs(os.path.dirname(self._path(dst)), exist_ok=True)
            os.rename(self._path(src), self._path(dst))
            return True
        except OSError:
            return False

    def write_shared_arrays(self, arrays: Mapping[str, Any], *, fsync: bool) -> None:
        """Content-addressed arrays that committed contexts of other writers may already hold:
        each is written under a temporary name and renamed into place, never rewritten in place,
        so a concurrent or failing writer cannot tear one that is already there."""
        if not arrays:
            return
        temps = {f"{path}.{uuid.uuid4().hex[:12]}.tmp": path for path in arrays}
        serializers.write_arrays_local(self.root, {t: arrays[p] for t, p in temps.items()}, fsync=fsync)
        for temp, path in temps.items():
            try:
                os.rename(self._path(temp), self._path(path))
            except OSError as err:
                if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    for t in temps:
                        shutil.rmtree(self._path(t), ignore_errors=True)
                    raise
                if not self.array_exists(path):  # a torn leftover, not a committed array
                    shutil.rmtree(self._path(path), ignore_errors=True)
                    try:
                        os.rename(self._path(temp), self._path(path))
                        continue
                    except OSError:
                        pass
                shutil.rmtree(self._path(temp), ignore_errors=True)  # the same bytes are there
        if fsync:
            for folder in {os.path.dirname(self._path(p)) for p in arrays}:
                _fsync_dir(folder)

    def read_array(self, path: str, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        # zarr.json is for other readers: the manifest gives shape and dtype, and the checksum
        # (verified by the caller) and the chunk's size vouch for the data.
        return serializers.read_array_local(self.root, path, shape, dtype, check_metadata=False)

    def read_chunk(
        self, path: str, shape: tuple[int, ...], dtype: str, chunk_shape: tuple[int, ...], index: tuple[int, ...]
    ) -> np.ndarray:
        return serializers.read_chunk_local(
            self.root, path, shape, dtype, chunk_shape, index, check_metadata=False
        )

    def array_exists(self, path: str) -> bool:
        return os.path.exists(os.path.join(self._path(path), "zarr.json"))

    def put_bytes(self, key: str, data: bytes, *, fsync: bool) -> None:
        final = self._path(key)
        folder = os.path.dirname(final)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{os.path.basename(final)}.{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            _remove_quietly(tmp)
            raise
        if fsync:
            _fsync_dir(folder)

    def get_bytes(self, key: str) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def list_dir(self, prefix: str) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self._path(prefix)) if not n.startswith("."))
        except FileNotFoundError:
            return []

    def delete(self, key: str) -> None:
        _remove_quietly(self._path(key))

    def delete_tree(self, prefix: str) -> None:
        shutil.rmtree(self._path(prefix), ignore_errors=True)

    def age_seconds(self, prefix: str) -> float | None:
        try:
            return time.time() - os.stat(self._path(prefix)).st_mtime
        except FileNotFoundError:
            return None

    def version(self, key: str) -> Any | None:
        try:
            st = os.stat(self._path(key))
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)


class _KvBackend:
    """Any tensorstore kvstore spec (``memory``, ``file`` with options, ``gcs``, ``s3``)."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        self.spec = dict(spec)
        self.description = repr(self.spec)
        self.context = serializers.default_context()
        self.kv = ts.KvStore.open(self._with_slash(self.spec), context=self.context).result()

    @staticmethod
    def _with_slash(spec: dict[str, Any]) -> dict[str, Any]:
        path = spec.get("path", "")
        if path and not path.endswith("/"):
            spec = {**spec, "path": path + "/"}
        return spec

    can_recycle = False

    def write_arrays(self, arrays: Mapping[str, Any], *, fsync: bool, reuse: bool = False) -> None:
        serializers.write_arrays(self.spec, arrays, context=self.context)

    def rename(self, src: str, dst: str) -> bool:
        return False  # kvstores have no atomic rename of a prefix

    write_shared_arrays = write_arrays  # no rename on kvstores; content-addressed, same bytes

    def read_array(self, path: str, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.asarray(serializers.read_array(self.spec, path, shape, dtype, context=self.context))

    def read_chunk(
        self, path: str, shape: tuple[int, ...], dtype: str, chunk_shape: tuple[int, ...], index: tuple[int, ...]
    ) -> np.ndarray:
        return serializers.read_chunk(
            self.spec, path, shape, dtype, chunk_shape, index, context=self.context
        )

    def array_exists(self, path: str) -> bool:
        return self.get_bytes(f"{path}/zarr.json") is not None

    def put_bytes(self, key: str, data: bytes, *, fsync: bool) -> None:
        self.kv.write(key, data).result()

    def get_bytes(self, key: str) -> bytes | None:
        result = self.kv.read(key).result()
        return bytes(result.value) if result.state == "value" else None

    def list_dir(self, prefix: str) -> list[str]:
        prefix = prefix.rstrip("/") + "/"
        end = prefix[:-1] + chr(ord("/") + 1)
        keys = self.kv.list(ts.KvStore.KeyRange(prefix, end)).result()
        names = {k.decode()[len(prefix) :].split("/", 1)[0] for k in keys}
        return sorted(n for n in names if n and not n.startswith("."))

    def delete(self, key: str) -> None:
        self.kv.delete_range(ts.KvStore.KeyRange(key, key + "\x00")).result()

    def delete_tree(self, prefix: str) -> None:
        prefix = prefix.rstrip("/") + "/"
        self.kv.delete_range(ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord("/") + 1))).result()

    def age_seconds(self, prefix: str) -> float | None:
        return None  # kvstores have no portable mtime: gc only removes with older_than=0

    def version(self, key: str) -> Any | None:
        return None  # no cheap version: manifests are read each time


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_backend(path: str | os.PathLike[str] | Mapping[str, Any]) -> _Backend:
    """A backend for a folder path or a tensorstore kvstore spec."""
    if isinstance(path, Mapping):
        root = serializers.local_root(path)
        return _LocalBackend(root) if root is not None else _KvBackend(path)
    return _LocalBackend(os.fspath(path))


# ----------------------------------------------------------------------------------------------
# Contexts <-> records


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


def _chunk_index(region: Sequence[slice] | None, chunk_shape: Sequence[int]) -> tuple[int, ...]:
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
        else:
            whole = np.asarray(x)  # uneven or empty shards: no grid of blocks to write
        return ShardedHost(record, shape, dtype, None, {}, whole)
    if not x.is_fully_addressable:
        raise InvalidArgumentError(
            "a store cannot yet write an array sharded over devices of several processes"
        )
    chunks: dict[tuple[int, ...], np.ndarray] = {}
    for shard in x.addressable_shards:
        if shard.replica_id == 0:
            chunks[_chunk_index(shard.index, shard_shape)] = np.asarray(shard.data)
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
    blocks = [host.chunks[_chunk_index(index_map[d], host.chunk_shape)] for d in devices]
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


def _chunked_digest(host: ShardedHost) -> str:
    """The content address of a chunked weight: a digest of its chunks' digests (and of its
    dtype, shape and chunk shape), so equal weights sharded alike are stored once."""
    assert host.chunk_shape is not None
    h = xxhash.xxh3_128()
    h.update(f"{host.dtype.str}{host.shape}{host.chunk_shape};".encode())
    for idx in sorted(host.chunks):
        h.update(f"{idx}={serializers.content_digest(host.chunks[idx])};".encode())
    return h.hexdigest()


class StaleData(NamedTuple):
    """A data folder no manifest references any more, and its layout (for reuse)."""

    data_dir: str
    layout: str


def _layout(items: Iterable[tuple[str, tuple[int, ...], str, tuple[int, ...] | None]]) -> str:
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


def _spec_to_map(
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


def _spec_from_map(
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


# ----------------------------------------------------------------------------------------------
# The tier


class DiskTier:
    """Contexts on disk: write (arrays, then an atomic manifest), read and verify, delete, gc."""

    def __init__(self, path: str | os.PathLike[str] | Mapping[str, Any]) -> None:
        self.backend = open_backend(path)
        self._lock = threading.Lock()
        self._stat_cache: dict[str, tuple[Any, StoredContext]] = {}
        self._free: dict[str, list[str]] = {}  # layout -> recycled data folders
        marker = self.backend.get_bytes(STORE_MARKER)
        if marker is None:
            self.backend.put_bytes(STORE_MARKER, STORE_FORMAT, fsync=False)

    @property
    def description(self) -> str:
        return self.backend.description

    # -- writing ------------------------------------------------------------------------------

    def write(
        self,
        key: str,
        spec: ResidualSpec,
        arrays: HostArrays,
        impls: Sequence[str | None],
        *,
        fsync: bool,
    ) -> StaleData | None:
        """Writes a context and commits it; raises :class:`StoreFullError` leaving nothing behind.

        Returns the data of the context this write replaced, if any: it is unreferenced now, and
        the caller hands it to :meth:`drop_data` off the write path.
        """
        data_dir = f"data/{key}.{uuid.uuid4().hex[:12]}"
        previous = self._read_manifest_bytes(key)
        layout = _layout(
            (str(i), x.shape, serializers.zarr_dtype_name(x.dtype), getattr(x, "chunk_shape", None))
            for i, (x, kind) in enumerate(zip(arrays, spec.kinds))
            if kind == "intermediate"
        )
        reuse = self._claim_free(layout, data_dir)
        to_write: dict[str, Any] = {}
        records = []
        shardings: list[dict[str, Any] | None] = []
        for i, (x, kind) in enumerate(zip(arrays, spec.kinds)):
            shared = kind != "intermediate"
            chunk_fields: dict[str, Any] = {}
            checksum: str | None = None
            if isinstance(x, ShardedHost):
                shardings.append(x.sharding)
                if x.chunk_shape is not None:
                    chunk_sums = [(idx, serializers.checksum(c)) for idx, c in sorted(x.chunks.items())]
                    chunk_fields = {"chunk_shape": x.chunk_shape, "chunk_checksums": chunk_sums}
                    checksum = serializers.chunked_checksum(chunk_sums)
                    data: Any = serializers.ChunkedArray(x.shape, x.dtype, x.chunk_shape, x.chunks)
                    digest = _chunked_digest(x) if shared else None
                else:
                    assert x.whole is not None
                    data = x.whole
                    digest = serializers.content_digest(data) if shared else None
            else:
                shardings.append(None)
                data = x
                digest = serializers.content_digest(x) if shared else None
            if shared:
                path = f"weights/{digest}"
                # Checked on every write (one stat locally): gc in another process may have
                # removed a weight that no context referenced a moment ago.
                if path not in to_write and not self.backend.array_exists(path):
                    to_write[path] = data
            else:
                path = f"{data_dir}/{i}"
                to_write[path] = data
            records.append(
                serializers.ArrayRecord(
                    name=spec.names[i],
                    path=path,
                    shape=x.shape,
                    dtype=serializers.zarr_dtype_name(x.dtype),
                    nbytes=int(x.nbytes),
                    checksum=checksum if checksum is not None else serializers.checksum(data),
                    input_path=spec.input_paths[i],
                    shared=shared,
                    **chunk_fields,
                )
            )
        manifest = serializers.encode_manifest(
            {
                "key": key,
                "signature": spec.signature,
                "created": time.time(),
                "jax_version": jax.__version__,
                "spec": _spec_to_map(spec, impls, shardings),
                "data_dir": data_dir,
                "arrays": records,
            }
        )
        shared_arrays = {p: x for p, x in to_write.items() if p.startswith("weights/")}
        try:
            self.backend.write_arrays(
                {p: x for p, x in to_write.items() if p not in shared_arrays}, fsync=fsync, reuse=reuse
            )
            self.backend.write_shared_arrays(shared_arrays, fsync=fsync)
            self.backend.put_bytes(f"contexts/{key}.manifest", manifest, fsync=fsync)
        except (serializers.DiskFullError, OSError) as err:
            self.backend.delete_tree(data_dir)
            if isinstance(err, serializers.DiskFullError) or getattr(err, "errno", None) in _DISK_FULL_ERRNOS:
                raise StoreFullError(
                    f"the disk cannot take context {key!r} ({sum(a.nbytes for a in to_write.values()):,} "
                    f"bytes to write under {self.description}): {err}"
                ) from err
            raise
        return self._data_of(previous) if previous is not None else None

    def write_blob(self, name: str, data: bytes, *, fsync: bool) -> None:
        try:
            self.backend.put_bytes(name, data, fsync=fsync)
        except OSError as err:  # put_bytes leaves nothing behind on failure
            if isinstance(err, serializers.DiskFullError) or err.errno in _DISK_FULL_ERRNOS:
                raise StoreFullError(
                    f"the disk cannot take {name} ({len(data):,} bytes under {self.description}): {err}"
                ) from err
            raise

    def read_blob(self, name: str) -> bytes | None:
        return self.backend.get_bytes(name)

    # -- reading ------------------------------------------------------------------------------

    def _read_manifest_bytes(self, key: str) -> bytes | None:
        return self.backend.get_bytes(f"contexts/{key}.manifest")

    def parse_manifest(self, key: str, data: bytes) -> StoredContext:
        what = f"context {key!r}"
        try:
            m = serializers.decode_manifest(data, what=f"manifest of {what}")
            records = tuple(
                serializers.ArrayRecord.from_dict(r, what=f"{what} array {i}") for i, r in enumerate(m["arrays"])
            )
        except serializers.CorruptDataError as err:
            raise CorruptContextError(str(err)) from err
        if m["key"] != key:
            raise CorruptContextError(f"{what}: manifest names key {m['key']!r}")
        spec, impls, shardings = _spec_from_map(m["signature"], m["spec"], records, what)
        data_dir = m.get("data_dir")
        if not isinstance(data_dir, str) or not serializers.is_safe_relpath(data_dir):
            raise CorruptContextError(f"{what}: invalid data_dir in manifest")
        return StoredContext(
            key, spec, records, impls, float(m["created"]), m["jax_version"], data_dir, shardings
        )

    def stat(self, key: str) -> StoredContext:
        """The validated manifest of ``key``; :class:`ContextNotFoundError` if not committed.

        Parsed manifests are cached while the file's version (inode, size, mtime) is unchanged,
        so listing a large store again costs one ``stat`` per context.
        """
        version = self.backend.version(f"contexts/{key}.manifest")
        if version is not None:
            with self._lock:
                cached = self._stat_cache.get(key)
            if cached is not None and cached[0] == version:
                return cached[1]
        data = self._read_manifest_bytes(key)
        if data is None:
            raise ContextNotFoundError(f"no context {key!r} in store {self.description}")
        stored = self.parse_manifest(key, data)
        if version is not None:
            with self._lock:
                self._stat_cache[key] = (version, stored)
        return stored

    def read(self, key: str, *, place: bool = True) -> tuple[StoredContext, HostArrays]:
        """Reads and verifies every array of ``key``; :class:`CorruptContextError` names the bad one.

        Arrays come back as NumPy arrays, except, with ``place`` (the default), a sharded
        residual whose mesh this process has the devices for (at least as many as the mesh has):
        that one comes back as a :class:`ShardedHost` with its rebuilt ``placement``, holding only
        the chunks this process's devices need (:func:`to_device_sharded` puts them on the
        devices). On a process with fewer devices, or with ``place=False``, it comes back whole
        (every chunk read and verified) as a NumPy array, to be loaded on the default device.

        A context replaced by another writer while it is read (its commit removes the data this
        read was reading) is read again from its new manifest: only a manifest that stays the
        same makes a failed read corruption.
        """
        for _ in range(_READ_ATTEMPTS):
            data = self._read_manifest_bytes(key)
            if data is None:
                raise ContextNotFoundError(f"no context {key!r} in store {self.description}")
            stored = self.parse_manifest(key, data)
            try:
                return stored, self._read_arrays(key, stored, place=place)
            except CorruptContextError:
                if self._read_manifest_bytes(key) == data:
                    raise
        raise CorruptContextError(
            f"context {key!r} was replaced {_READ_ATTEMPTS} times while being read; try again"
        )

    def _read_arrays(self, key: str, stored: StoredContext, *, place: bool = False) -> HostArrays:
        """Reads and verifies the arrays (chunk by chunk for chunked ones), two reads at a time:
        file reads and checksums release the GIL, so one read's checksum overlaps the next."""
        placements: list[NamedSharding | None] = []
        by_shard: list[bool] = []  # read only the chunks of this process's devices
        tasks: list[tuple[int, tuple[int, ...] | None, str]] = []  # (residual, chunk, checksum)
        for i, record in enumerate(stored.records):
            sharding = stored.sharding(i)
            placement = self._placement(key, i, record, sharding) if place and sharding else None
            placements.append(placement)
            if not record.chunked:
                by_shard.append(False)
                tasks.append((i, None, record.checksum))
                continue
            assert record.chunk_shape is not None and record.chunk_checksums is not None
            sums = dict(record.chunk_checksums)
            # The recorded mesh and spec give shards of the chunk shape; anything else is read whole.
            shards = placement is not None and tuple(placement.shard_shape(record.shape)) == record.chunk_shape
            by_shard.append(shards)
            if shards:
                assert placement is not None
                index_map = placement.addressable_devices_indices_map(record.shape)
                wanted = sorted({_chunk_index(r, record.chunk_shape) for r in index_map.values()})
            else:
                wanted = list(sums)
            tasks += [(i, idx, sums[idx]) for idx in wanted]
        results = list(_READ_POOL.map(lambda t: self._read_one(key, t[0], stored.records[t[0]], *t[1:]), tasks))
        pieces: dict[int, dict[tuple[int, ...] | None, np.ndarray]] = {}
        for (i, idx, _), x in zip(tasks, results):
            pieces.setdefault(i, {})[idx] = x
        out: HostArrays = []
        for i, record in enumerate(stored.records):
            got, placement, sharding = pieces.get(i, {}), placements[i], stored.sharding(i)
            dtype = serializers.numpy_dtype(record.dtype)
            if by_shard[i]:
                assert sharding is not None and record.chunk_shape is not None
                out.append(ShardedHost(sharding, record.shape, dtype, record.chunk_shape, got, None, placement))
                continue
            if record.chunked:  # every chunk, into one array
                assert record.chunk_shape is not None
                whole = serializers.aligned_empty(record.shape, dtype)
                for idx, chunk in got.items():
                    assert idx is not None
                    whole[serializers.chunk_region(idx, record.chunk_shape)] = chunk
            else:
                whole = got[None]
            if placement is None:
                out.append(whole)
            else:
                assert sharding is not None
                out.append(ShardedHost(sharding, record.shape, dtype, None, {}, whole, placement))
        return out

    @staticmethod
    def _placement(
        key: str, i: int, record: serializers.ArrayRecord, sharding: Mapping[str, Any]
    ) -> NamedSharding | None:
        try:
            return rebuild_sharding(sharding)
        except Exception as err:  # JAX raises several types for a bad mesh or spec
            raise CorruptContextError(
                f"context {key!r}, residual {i} ({record.name}): cannot rebuild its sharding "
                f"{sharding} on this process's devices ({type(err).__name__}: {err})"
            ) from err

    def _read_one(
        self,
        key: str,
        i: int,
        record: serializers.ArrayRecord,
        chunk: tuple[int, ...] | None = None,
        expected: str | None = None,
    ) -> np.ndarray:
        what = f"context {key!r}, residual {i} ({record.name}) at {record.path}"
        if chunk is not None:
            what += f", chunk {serializers.chunk_index_key(chunk)}"
        try:
            if chunk is None:
                x = self.backend.read_array(record.path, record.shape, record.dtype)
            else:
                assert record.chunk_shape is not None
                x = self.backend.read_chunk(record.path, record.shape, record.dtype, record.chunk_shape, chunk)
        except (serializers.CorruptDataError, serializers.UnsupportedDTypeError) as err:
            # the serializers name only the array: say which context and residual it is
            raise CorruptContextError(f"{what}: {err}") from err
        except (OSError, ValueError) as err:
            raise CorruptContextError(f"{what}: unreadable ({err})") from err
        if expected is None:
            expected = record.checksum if chunk is None else dict(record.chunk_checksums or ())[chunk]
        try:
            serializers.verify(x, expected, what=what)
        except serializers.CorruptDataError as err:
            raise CorruptContextError(str(err)) from err
        return x

    def keys(self) -> list[str]:
        suffix = ".manifest"
        return [n[: -len(suffix)] for n in self.backend.list_dir("contexts") if n.endswith(suffix)]

    def __contains__(self, key: str) -> bool:
        return self._read_manifest_bytes(key) is not None

    # -- deleting -----------------------------------------------------------------------------

    @staticmethod
    def _data_of(manifest: bytes) -> StaleData | None:
        try:
            m = serializers.decode_manifest(manifest, what="previous manifest")
            records = [serializers.ArrayRecord.from_dict(r) for r in m["arrays"]]
        except serializers.CorruptDataError:
            return None  # unreadable: gc will find its data unreferenced
        data_dir = m.get("data_dir")
        if not (isinstance(data_dir, str) and serializers.is_safe_relpath(data_dir) and data_dir.startswith("data/")):
            return None
        prefix = data_dir + "/"
        layout = _layout(
            (r.path[len(prefix) :], tuple(r.shape), r.dtype, r.chunk_shape)
            for r in records
            if r.path.startswith(prefix)
        )
        return StaleData(data_dir, layout)

    def _claim_free(self, layout: str, data_dir: str) -> bool:
        """Renames a recycled folder of this layout to ``data_dir``; whether one was found."""
        if not self.backend.can_recycle:
            return False
        while True:
            with self._lock:
                free = self._free.get(layout)
                if not free:
                    return False
                candidate = free.pop()
            if self.backend.rename(candidate, data_dir):
                return True

    def drop_data(self, stale: StaleData) -> None:
        """Disposes of a data folder that no manifest references any more.

        In a local folder it is kept for reuse by a later write of the same layout (same shapes
        and dtypes), which then overwrites its files in place instead of creating some
        50 files and folders (file creation dominates small writes); otherwise it is removed.
        """
        if self.backend.can_recycle:
            with self._lock:
                pool = self._free.setdefault(stale.layout, [])
                room = len(pool) < _MAX_FREE_PER_LAYOUT
            if room:
                target = f"{_FREE_DIR}/{stale.layout}.{uuid.uuid4().hex[:12]}"
                if self.backend.rename(stale.data_dir, target):
                    with self._lock:
                        pool.append(target)
                    return
        self.backend.delete_tree(stale.data_dir)

    def delete(self, key: str) -> tuple[bool, StaleData | None]:
        """Removes ``key``'s manifest, so it vanishes atomically.

        Returns whether it was there and its data, for the caller to :meth:`drop_data`.
        """
        data = self._read_manifest_bytes(key)
        if data is None:
            return False, None
        self.backend.delete(f"contexts/{key}.manifest")
        return True, self._data_of(data)

    def iter_manifests(self) -> Iterator[tuple[str, StoredContext | CorruptContextError]]:
        for key in self.keys():
            try:
                yield key, self.stat(key)
            except ContextNotFoundError:
                continue  # deleted meanwhile
            except CorruptContextError as err:
                yield key, err

    def gc(self, older_than: float = 3600.0) -> dict[str, int]:
        """Removes weights no manifest references and data folders of no committed context.

        Only items at least ``older_than`` seconds old are removed, so writes in flight in other
        processes are left alone (on kvstores without modification times, nothing is removed
        unless ``older_than`` is 0). Returns counts of what was removed.
        """
        referenced: set[str] = set()
        for _, stored in self.iter_manifests():
            if isinstance(stored, StoredContext):
                referenced.add(stored.data_dir)
                referenced.update(r.path for r in stored.records if r.shared)
            else:
                return {"weights": 0, "data": 0, "recycled": 0, "skipped_corrupt": 1}
        removed = {"weights": 0, "data": 0, "recycled": 0}
        for kind, prefix in (("weights", "weights"), ("data", "data")):
            for name in self.backend.list_dir(prefix):
                path = f"{prefix}/{name}"
                if path in referenced:
                    continue
                age = self.backend.age_seconds(path)
                if older_than > 0 and (age is None or age < older_than):
                    continue
                self.backend.delete_tree(path)
                removed[kind] += 1
        for name in self.backend.list_dir(_FREE_DIR):  # recycled folders kept for reuse
            path = f"{_FREE_DIR}/{name}"
            age = self.backend.age_seconds(path)
            if older_than > 0 and (age is None or age < older_than):
                continue
            with self._lock:
                for pool in self._free.values():
                    if path in pool:
                        pool.remove(path)
            self.backend.delete_tree(path)
            removed["recycled"] += 1
        return removed
