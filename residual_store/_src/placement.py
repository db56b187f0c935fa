"""Where arrays live, as plain records: shardings, memory kinds, and the avals of a split's inputs.

A ``NamedSharding`` over several devices is recorded as a msgpack-able map (mesh axis names,
sizes and types, the ``PartitionSpec``, the mesh's device ids) that a store writes into manifests
and a split writes into a context's :class:`~residual_store._src.context.CallSpec`; it is rebuilt on
this process's devices by :func:`rebuild_sharding`. :func:`input_aval` records one input leaf
(shape, dtype, weak type, sharding, memory kind) and :func:`abstract_input` turns the record
back into a ``jax.ShapeDtypeStruct`` to trace with, so that a split in a new process can rebuild
a backward without the arrays.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from residual_store._src.canonical import Canonicalizer
from residual_store._src.context import InputAval

__all__ = [
    "abstract_input",
    "has_explicit_axes",
    "check_sharding_record",
    "input_aval",
    "key_dtype",
    "placement_text",
    "rebuild_sharding",
    "sharding_record",
]


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
    unconstrained dimensions): those arrays are stored and loaded on the default device."""
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


def check_sharding_record(m: Any, ndim: int) -> dict[str, Any]:
    """Validates an untrusted sharding record for an array of ``ndim`` dimensions; raises
    ValueError naming what is wrong."""
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


def _axis_types(names: Any) -> dict[str, Any]:
    axis_type = getattr(jax.sharding, "AxisType", None)
    if names is None or axis_type is None:
        return {}
    try:
        return {"axis_types": tuple(axis_type[t] for t in names)}
    except KeyError:
        return {}  # a type this JAX does not know: its default


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
    mesh = Mesh(np.array(chosen, dtype=object).reshape(sizes), names, **_axis_types(record.get("mesh_axis_types")))
    spec = PartitionSpec(*[tuple(e) if isinstance(e, list) else e for e in record["spec"]])
    return NamedSharding(mesh, spec)


def abstract(aval: Any) -> jax.ShapeDtypeStruct:
    """A ``ShapeDtypeStruct`` of a jaxpr aval, keeping a sharding only where it is part of the
    type (meshes with explicit axes)."""
    sharding = aval.sharding if has_explicit_axes(getattr(aval, "sharding", None)) else None
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type, sharding=sharding)


def has_explicit_axes(sharding: Any) -> bool:
    """Whether ``sharding`` is a ``NamedSharding`` over a mesh (concrete or abstract) with an
    axis of type ``Explicit``: then the sharding is part of an array's type, in jaxprs too."""
    explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
    mesh = getattr(sharding, "mesh", None) if isinstance(sharding, NamedSharding) else None
    return explicit is not None and explicit in tuple(getattr(mesh, "axis_types", None) or ())


def placement_text(sharding: Any) -> str:
    """What the signature records of an input's placement: the canonical text of its sharding
    (for a ``NamedSharding`` the mesh axis names, sizes and types and the partition spec, not
    device ids, since another process may number its devices differently; for one device
    ``single``; the memory kind), or the type and device count of other shardings."""
    if sharding is None:
        return "none"
    if isinstance(sharding, (NamedSharding, SingleDeviceSharding)):
        return Canonicalizer().value(sharding)
    return f"{type(sharding).__name__}({len(sharding.device_set)});{getattr(sharding, 'memory_kind', None)}"


@functools.cache
def key_dtype(impl: str) -> Any:
    """The typed key dtype of a PRNG implementation, by tracing only (no device dispatch)."""
    return jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def input_aval(x: jax.Array) -> InputAval:
    """The record of one input leaf: shape, dtype, weak type, placement (and its sharding record
    where one can be rebuilt elsewhere), memory kind, key implementation for typed keys."""
    sharding = getattr(x, "sharding", None)
    record = sharding_record(x)
    return InputAval(
        shape=tuple(int(d) for d in x.shape),
        dtype=str(x.dtype),
        weak_type=bool(x.aval.weak_type),
        placement=placement_text(sharding),
        sharding=json.dumps(record, sort_keys=True) if record is not None else None,
        memory_kind=getattr(sharding, "memory_kind", None),
        key_impl=str(jax.random.key_impl(x)) if _is_key(x) else None,
    )


def _dtype_of(aval: InputAval) -> Any:
    if aval.key_impl is not None:
        dtype = key_dtype(aval.key_impl)
        if str(dtype) != aval.dtype:
            raise ValueError(f"key dtype {aval.dtype} does not match its implementation {aval.key_impl}")
        return dtype
    return jax.numpy.dtype(aval.dtype)


def abstract_input(aval: InputAval) -> jax.ShapeDtypeStruct:
    """A ``ShapeDtypeStruct`` for a recorded input leaf, placed like the recorded one where this
    process has the devices (else with no sharding: a process with fewer devices traces it
    unsharded). Raises ValueError for a record this process cannot represent."""
    sharding: Any = None
    if aval.sharding is not None:
        record = check_sharding_record(json.loads(aval.sharding), len(aval.shape))
        sharding = rebuild_sharding(record)
    elif aval.memory_kind is not None:  # one device (or no record): its memory kind still counts
        device = jax.devices()[0]
        if aval.memory_kind != device.default_memory().kind:
            sharding = SingleDeviceSharding(device, memory_kind=aval.memory_kind)
    if sharding is not None and aval.memory_kind is not None and sharding.memory_kind != aval.memory_kind:
        sharding = sharding.with_memory_kind(aval.memory_kind)
    return jax.ShapeDtypeStruct(aval.shape, _dtype_of(aval), sharding=sharding, weak_type=aval.weak_type)
