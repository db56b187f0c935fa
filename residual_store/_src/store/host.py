"""Residuals between JAX and the host: ``jax.Array`` <-> host arrays, shard by shard.

What the disk tier writes is host memory: each residual as a NumPy array (a typed PRNG key as
its key data), or, sharded over several devices with a ``NamedSharding``, as the blocks of its
distinct shards (:class:`~residual_store._src.store.disk.host_arrays.ShardedHost`), never
gathered. What it reads comes back the same way and is placed on the devices here, each device
given its own block. (The memory tiers' copies between device memory and ``pinned_host`` are
``copies.py``'s.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

import residual_store_serializers as serializers
from residual_store._src import _jax_internals
from residual_store._src.context import SHARED_KINDS, ResidualContext, ResidualSpec, describe_residual
from residual_store._src.errors import InvalidArgumentError
from residual_store._src.placement import sharding_record
from residual_store._src.scratch import pinned_memory_kind, pinned_sharding
from residual_store._src.store.disk.host_arrays import HostArrays, ShardedHost, chunk_index

__all__ = [
    "check_live",
    "check_dtypes_writable",
    "default_memory_kind",
    "device_put_all",
    "host_arrays",
    "is_host_memory",
    "is_key_dtype",
    "is_whole_on",
    "place",
    "read_device",
    "stage_shared",
    "to_device_sharded",
    "to_numpy",
    "uncommitted_if_sub_byte",
]


def is_key_dtype(dtype: Any) -> bool:
    try:
        return _is_key_dtype_cached(dtype)
    except TypeError:  # an unhashable dtype-like
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))


@functools.lru_cache(maxsize=256)
def _is_key_dtype_cached(dtype: Any) -> bool:
    return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))


@functools.lru_cache(maxsize=256)
def _is_sub_byte(dtype: np.dtype) -> bool:
    """Whether ``dtype`` holds fewer than 8 bits an element (``int4``, ``uint2``,
    ``float4_e2m1fn``...): one element a byte on the host, and placed uncommitted (see
    :func:`uncommitted_if_sub_byte`)."""
    return np.dtype(dtype).itemsize == 1 and jax.dtypes.itemsize_bits(dtype) < 8  # (float0: 0 bytes)


def _numpy(x: Any) -> np.ndarray:
    """``x`` in host memory as a NumPy array of ``x``'s own dtype.

    ``np.asarray`` gives an ``int1`` array computed by XLA as ``bool`` (the same bytes: 0 or 1
    an element), which is viewed as ``int1`` again: the dtype a write records and a read gives
    back is the residual's, never another one of the same bytes.
    """
    host = np.asarray(x)
    want = np.dtype(x.dtype)
    if host.dtype != want:
        if host.dtype.itemsize != want.itemsize:
            raise InvalidArgumentError(
                f"JAX copied a {want} array to the host as {host.dtype}, which is not the same bytes"
            )
        host = host.view(want)
    return host


_INT1: np.dtype | None = np.dtype(jax.numpy.int1) if hasattr(jax.numpy, "int1") else None


def _placeable(host: np.ndarray) -> np.ndarray:
    """What ``jax.device_put`` is given for the host array ``host``: an ``int1`` array as its
    bytes viewed as ``bool``. (XLA computes ``int1`` as ``pred``, a byte an element; a host
    ``int1`` array would become a packed ``s1`` buffer that compiled code refuses.)"""
    return host.view(np.bool_) if host.dtype == _INT1 else host


def _placed(x: jax.Array, dtype: np.dtype) -> jax.Array:
    """The device array of a host array of ``dtype`` placed as :func:`_placeable` gave it:
    ``int1`` again (the same bytes), a sub-byte one uncommitted."""
    if dtype == _INT1 and x.dtype != dtype:
        x = _convert_to(dtype)(x)
    return uncommitted_if_sub_byte(x)


@functools.lru_cache(maxsize=8)
def _convert_to(dtype: np.dtype) -> Callable[[jax.Array], jax.Array]:
    """A compiled ``convert_element_type`` to ``dtype`` (``bool`` -> ``int1`` keeps each
    byte: both are ``pred`` to XLA)."""
    return jax.jit(functools.partial(jax.lax.convert_element_type, new_dtype=dtype))


def uncommitted_if_sub_byte(x: jax.Array) -> jax.Array:
    """``x``, uncommitted where it is a sub-byte array on one device.

    Compiled code (a backward is compiled ahead of time) compares a committed argument's layout
    with its own, and on CPU (JAX 0.10) a sub-byte buffer reports 0 bits an element where the
    executable says 4: a committed ``int4`` residual is refused whichever way it was placed.
    An uncommitted one, as a forward on uncommitted inputs makes it, is taken
    (``COMMITMENT`` in :mod:`residual_store._src._jax_internals`); it stays on its device.
    """
    if x.committed and _is_sub_byte(x.dtype) and isinstance(x.sharding, SingleDeviceSharding):
        return _jax_internals.with_commitment(x, False)
    return x


def _sharded_host(x: jax.Array, record: dict[str, Any]) -> ShardedHost:
    """``x`` (sharded) on the host: the block of each distinct shard, copied shard by shard."""
    shape = tuple(int(d) for d in x.shape)
    dtype = np.dtype(x.dtype)
    shard_shape = tuple(int(d) for d in x.sharding.shard_shape(x.shape))
    if x.size == 0 or shard_shape == shape or any(d % c for d, c in zip(shape, shard_shape)):
        if x.sharding.is_fully_replicated:  # any one replica is the whole array
            whole = _numpy(x.addressable_shards[0].data)
        elif not x.is_fully_addressable:
            raise InvalidArgumentError(
                f"a store cannot write an array of shape {shape} sharded unevenly over the devices "
                "of several processes; shard it evenly (every dimension divisible by its shards)"
            )
        else:
            whole = _numpy(x)  # uneven or empty shards: no grid of blocks to write
        return ShardedHost(record, shape, dtype, None, {}, whole)
    # Several processes: each holds the distinct shards (replica_id == 0) of its own devices;
    # the disk tier's collective write puts each process's chunks in one array.
    chunks: dict[tuple[int, ...], np.ndarray] = {}
    for shard in x.addressable_shards:
        if shard.replica_id == 0:
            chunks[chunk_index(shard.index, shard_shape)] = _numpy(shard.data)
    return ShardedHost(record, shape, dtype, shard_shape, chunks)


def to_device_sharded(host: ShardedHost, memory_kind: str | None = None) -> jax.Array:
    """Places a :class:`ShardedHost` read with a ``placement``: each device gets its chunk
    (``device_put`` per device, no whole array on any one device), assembled with
    ``jax.make_array_from_single_device_arrays``; into the devices' ``memory_kind`` where given
    (their pinned host memory, for a value the forward put there)."""
    sharding = host.placement
    assert sharding is not None
    if memory_kind is not None:
        sharding = sharding.with_memory_kind(memory_kind)
    if host.chunk_shape is None:
        assert host.whole is not None
        return _placed(jax.device_put(_placeable(host.whole), sharding), host.dtype)
    index_map = sharding.addressable_devices_indices_map(host.shape)
    devices = list(index_map)
    blocks = [_placeable(host.chunks[chunk_index(index_map[d], host.chunk_shape)]) for d in devices]
    singles = jax.device_put(blocks, [SingleDeviceSharding(d, memory_kind=memory_kind) for d in devices])
    return _placed(jax.make_array_from_single_device_arrays(host.shape, sharding, singles), host.dtype)


def _pinned_kind(host: ShardedHost) -> str | None:
    """The pinned host memory kind of every device of ``host``'s placement, or ``None`` where
    one lacks it."""
    kinds = {pinned_memory_kind(d) for d in host.placement.device_set} if host.placement is not None else {None}
    return kinds.pop() if len(kinds) == 1 else None


def _deleted(ctx: ResidualContext, i: int, when: str) -> InvalidArgumentError:
    spec = ctx.spec
    what = "weight" if spec.kinds[i] in SHARED_KINDS else "residual"
    where = f" ({spec.input_paths[i]})" if spec.input_paths[i] else ""
    return InvalidArgumentError(
        f"the context's {what} {i}{where}, {spec.names[i]!r}, was deleted (donated to a jit with "
        f"donate_argnums, or .delete()) {when}: the store cannot write it. Put the context "
        "before donating the arrays it holds (a put takes its weights at once), and call "
        "store.flush() before donating its other arrays"
    )


def _to_host(x: Any) -> tuple[np.ndarray | ShardedHost, str | None]:
    """One residual on the host (a typed key as its key data), and its key's impl."""
    impl = None
    if is_key_dtype(x.dtype):
        impl = str(jax.random.key_impl(x))
        x = jax.random.key_data(x)
    if isinstance(x, jax.Array) and isinstance(x.sharding, SingleDeviceSharding):
        return _numpy(x), impl  # (the common case: one device, no sharding to record)
    record = sharding_record(x)
    return (_sharded_host(x, record) if record is not None else _numpy(x)), impl


def _check_addressable(x: Any, partial: bool) -> None:
    """Raises unless ``x`` is addressable here whole, or ``partial`` (each process of a job
    writes the shards of its own devices)."""
    if not partial and isinstance(x, jax.Array) and not x.is_fully_addressable:
        raise InvalidArgumentError("a store cannot write an array sharded over devices it cannot address")


def _on_cpu(x: jax.Array) -> bool:
    return all(is_host_memory(d) for d in x.sharding.device_set)


def to_numpy(x: Any) -> np.ndarray:
    """One residual as a whole NumPy array in host memory (a typed key as its key data)."""
    return _numpy(jax.random.key_data(x) if is_key_dtype(x.dtype) else x)


def stage_shared(
    ctx: ResidualContext, *, partial: bool = False
) -> dict[int, tuple[np.ndarray | ShardedHost, str | None]]:
    """The host arrays of ``ctx``'s weights and constants (by residual index), taken by ``put``
    on the caller's thread, so that donating the weights after the put (the optimizer's jit
    with ``donate_argnums``) cannot break the write that follows in the background.

    This is the copy the write needs anyway, taken earlier, never an extra one: on a CPU
    ``np.asarray`` is a view of the device buffer (which then stays valid: XLA copies instead
    of reusing a buffer a view holds), elsewhere the device-to-host copy that JAX caches on the
    array (``copy_to_host_async`` first, so that the weights' copies overlap), made once per
    array however many contexts hold it.

    ``partial``: as in :func:`host_arrays`.

    Raises:
      InvalidArgumentError: a residual was deleted (donated) before the put; it names it.
    """
    shared = [i for i, kind in enumerate(ctx.spec.kinds) if kind in SHARED_KINDS]
    arrays = [ctx.residuals[i] for i in shared]
    for i, x in enumerate(ctx.residuals):  # every one: the writer would say "after it was put"
        if isinstance(x, jax.Array) and x.is_deleted():
            raise _deleted(ctx, i, "before it was put")
    for x in arrays:
        # (on a CPU the host copy is a view of the buffer: nothing to start)
        if isinstance(x, jax.Array) and not _on_cpu(x) and not is_key_dtype(x.dtype):
            try:
                x.copy_to_host_async()
            except Exception:  # noqa: BLE001 - a hint: the copy below is what counts
                pass
    staged = {}
    for i, x in zip(shared, arrays):
        _check_addressable(x, partial)
        try:
            staged[i] = _to_host(x)
        except RuntimeError as err:
            if isinstance(x, jax.Array) and x.is_deleted():  # donated by another thread just now
                raise _deleted(ctx, i, "while it was put") from err
            raise
    return staged


def host_arrays(
    ctx: ResidualContext,
    staged: Mapping[int, tuple[np.ndarray | ShardedHost, str | None]] | None = None,
    *,
    partial: bool = False,
) -> tuple[HostArrays, list[str | None]]:
    """The residuals on the host (typed keys as their key data) and each key's impl; those in
    ``staged`` (see :func:`stage_shared`) as they were taken then.

    A residual sharded over several devices with a ``NamedSharding`` becomes a
    :class:`ShardedHost` (its shards' blocks, never the gathered array); the others become NumPy
    arrays. ``partial``: a residual may be sharded over other processes' devices too (a job of
    several processes: each writes its own shards); else one that is not addressable here whole
    is refused.

    Raises:
      InvalidArgumentError: a residual was deleted (donated) since the put; it names it.
    """
    arrays: HostArrays = []
    impls: list[str | None] = []
    for i, x in enumerate(ctx.residuals):
        if staged is not None and i in staged:
            host, impl = staged[i]
        else:
            if isinstance(x, jax.Array) and x.is_deleted():
                raise _deleted(ctx, i, "after it was put, before the store wrote it")
            _check_addressable(x, partial)
            try:
                host, impl = _to_host(x)
            except RuntimeError as err:
                if isinstance(x, jax.Array) and x.is_deleted():
                    raise _deleted(ctx, i, "while the store wrote it") from err
                raise
        arrays.append(host)
        impls.append(impl)
    return arrays, impls


def check_dtypes_writable(ctx: ResidualContext) -> None:
    """Raises unless a store can write every residual of ``ctx`` to disk: what ``put`` checks
    on a store with a path, before the store changes, instead of a write that fails later.

    Every dtype JAX computes with is written (``serializers.SUPPORTED_DTYPES``; a typed key as
    its ``uint32`` key data). ``float0``, the tangent type of integers, has no bytes to write.

    Raises:
      InvalidArgumentError: naming the first such residual and its dtype.
    """
    bad = _unwritable(ctx.spec)
    if bad is not None:
        i, why = bad
        raise InvalidArgumentError(
            f"{describe_residual(ctx.spec, 'this context')(i)} is {_dtype_name(ctx.spec.avals[i].dtype)}, which a "
            f"store cannot write to disk ({why}); keep such a context in a store without a path "
            "(rs.Store()), or keep the residual as a dtype a store writes"
        )


def _dtype_name(dtype: Any) -> str:
    """``dtype`` as JAX names it (``float0``, not NumPy's ``[('float0', 'V')]``)."""
    return "float0" if dtype == jax.dtypes.float0 else str(dtype)


@functools.lru_cache(maxsize=256)
def _unwritable(spec: ResidualSpec) -> tuple[int, str] | None:
    """The first residual of ``spec`` whose dtype no store writes, and why; once per spec."""
    for i, aval in enumerate(spec.avals):
        if is_key_dtype(aval.dtype):
            continue  # written as its key data
        try:
            serializers.zarr_dtype_name(aval.dtype)
        except serializers.UnsupportedDTypeError:
            return i, "it has no bytes to write" if np.dtype(aval.dtype).itemsize == 0 else (
                "no zarr v3 data type of docs/format.md is it"
            )
    return None


def check_live(ctx: ResidualContext, when: str) -> None:
    """Raises :class:`InvalidArgumentError` naming the first array of ``ctx`` that was deleted
    (donated), ``when`` saying when (``"before it was saved"``)."""
    for i, x in enumerate(ctx.residuals):
        if isinstance(x, jax.Array) and x.is_deleted():
            raise _deleted(ctx, i, when)


def is_host_memory(device: jax.Device) -> bool:
    """Whether ``device``'s memory is the host's (a CPU)."""
    return device.platform == "cpu"


def default_memory_kind(sharding: Any) -> str:
    """The memory kind arrays on ``sharding``'s devices get by default (``"device"`` on a GPU)."""
    device: Any = next(iter(sharding.device_set))  # (jax.Device's stubs leave out default_memory)
    return device.default_memory().kind


def read_device(device: jax.Device | None) -> jax.Device:
    """Where a read's host arrays go: ``device``, or where ``jax.device_put`` puts a host array
    given no device in this thread (``jax.default_device``, else this process's first device)."""
    if device is not None:
        return device
    default = jax.config.jax_default_device  # type: ignore[attr-defined]  # a runtime-defined flag
    if isinstance(default, jax.Device):
        return default
    return jax.local_devices(backend=default)[0] if isinstance(default, str) else jax.local_devices()[0]


def is_whole_on(x: Any, device: jax.Device) -> bool:
    """Whether ``x`` is a live ``jax.Array`` held whole on ``device`` in its default memory:
    what a read of its bytes placed on ``device`` would be."""
    if not isinstance(x, jax.Array) or x.is_deleted():
        return False
    sharding = x.sharding
    return (
        isinstance(sharding, SingleDeviceSharding)
        and sharding.device_set == {device}
        and sharding.memory_kind in (None, device.default_memory().kind)
    )


def device_put_all(arrays: Sequence[np.ndarray], device: jax.Device | None = None) -> list[jax.Array]:
    """``jax.device_put(arrays, device)`` for a read's host arrays, hundreds at a time: the
    C-contiguous ones in a canonical dtype (all a read makes, but for x64 values with x64 off,
    which the store refuses before placing) without ``jax.device_put``'s per-array work.

    Each comes back in its own dtype, as compiled code takes it (sub-byte ones: see
    :func:`_placed`)."""
    if any(_is_sub_byte(d) for d in {x.dtype for x in arrays}):
        placed = _device_put_all([_placeable(x) for x in arrays], device)
        return [_placed(y, np.dtype(x.dtype)) for y, x in zip(placed, arrays)]
    return _device_put_all(arrays, device)


def _device_put_all(arrays: Sequence[np.ndarray], device: jax.Device | None) -> list[jax.Array]:
    if len(arrays) < _MANY:
        return jax.device_put(list(arrays), device)
    fast = [i for i, x in enumerate(arrays)
            if type(x) is np.ndarray and x.flags.c_contiguous and x.dtype == _canonical_dtype(x.dtype)]
    out: list[Any] = [None] * len(arrays)
    target = read_device(device)
    for i, y in zip(fast, _jax_internals.device_put_many([arrays[i] for i in fast], target, device is not None)):
        out[i] = y
    rest = [i for i in range(len(arrays)) if out[i] is None]
    for i, y in zip(rest, jax.device_put([arrays[i] for i in rest], device)):
        out[i] = y
    return out


_MANY = 8  # below this many arrays, jax.device_put's fixed cost is what there is


@functools.lru_cache(maxsize=256)
def _canonical_dtype(dtype: np.dtype) -> np.dtype:
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def place(
    arrays: HostArrays,
    shared: Sequence[bool],
    key_impls: Sequence[str | None],
    shared_array: Callable[[int], jax.Array],
    device: jax.Device | None = None,
    on_host: Sequence[int] = (),
) -> list[jax.Array]:
    """The residuals of a read context on the devices: the context's own arrays in one
    ``device_put`` onto ``device`` (``None``: the default one; on CPU it aliases a suitably
    aligned NumPy buffer instead of copying), a
    sharded one block by block onto its devices, a shared one (a weight) from ``shared_array(i)``,
    which keeps one device array per stored weight; typed PRNG keys wrapped again. Those at
    ``on_host`` (arrays the forward put in host memory) go to the pinned host memory of their
    devices where they have one, sharded ones as they were sharded."""
    own = [i for i, s in enumerate(shared) if not s]
    pinned = pinned_sharding(read_device(device)) if on_host else None
    hosted = [i for i in on_host if pinned is not None and not isinstance(arrays[i], ShardedHost)]
    plain = [i for i in own if not isinstance(arrays[i], ShardedHost) and i not in hosted]
    placed = dict(zip(plain, device_put_all(cast(list[np.ndarray], [arrays[i] for i in plain]), device)))
    if hosted:
        placed.update(zip(hosted, jax.device_put([_placeable(cast(np.ndarray, arrays[i])) for i in hosted], pinned)))
    for i in own:
        host = arrays[i]
        if isinstance(host, ShardedHost):
            placed[i] = to_device_sharded(host, _pinned_kind(host) if i in on_host else None)
    out = []
    for i, impl in enumerate(key_impls):
        x = placed[i] if i in placed else shared_array(i)
        out.append(jax.random.wrap_key_data(x, impl=impl) if impl is not None else x)
    return out
