"""The per-signature shortcuts of a put and a get give exactly what the general paths give:
a write planned from a signature's template (records, spec map, group metadata and layout worked
out once) has the same manifest, group metadata, records, layout and bundle bytes as one planned
residual by residual; a read's host arrays placed hundreds at a time are the arrays
``jax.device_put`` makes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual_store as rs
import residual_store_serializers as serializers
from residual_store._src.store import host
from residual_store._src.store.disk import forms as residual_forms
from residual_store._src.store.disk import layout
from residual_store_serializers import manifest
from store_helpers import mixed_inputs, mixed_loss


def _many_loss(w, x, keys, n):
    """``mixed_loss``'s residuals (float32, float16, bfloat16, int32, bool, typed PRNG keys),
    and a 0-d and a zero-size one."""
    h = jnp.sum(x.astype(jnp.float32) @ w, axis=0)
    for _ in range(4):
        h = jnp.tanh(h.astype(jnp.bfloat16)).astype(jnp.float32) * jnp.sin(h)
    empty = jnp.sin(x[:0].astype(jnp.float32) @ w)
    return mixed_loss(w, x, keys, n) + jnp.sum(h**2) + jnp.sin(jnp.sum(h)) + jnp.sum(empty)


@pytest.fixture
def context(rng):
    fwd = rs.split(_many_loss)
    return fwd(*mixed_inputs(rng))[1]


def _plan(ctx, key, write_id, monkeypatch, *, template: bool):
    arrays, impls = host.host_arrays(ctx)
    with monkeypatch.context() as m:
        m.setattr(layout.time, "time", lambda: 1234.5)
        if not template:
            m.setattr(layout, "_template_for", lambda *a: None)
        return layout.plan_write(layout.HostWrite(key, ctx.spec, arrays, tuple(impls), fsync=False), write_id=write_id)


def _parts(plan):
    return b"".join(bytes(p) for p in plan.bundle.parts)


@pytest.mark.slow
@pytest.mark.parametrize("key", ["a", "run-7.mb-3_x"])
def test_internals_a_write_planned_from_its_template_is_the_write_planned_in_full(context, key, monkeypatch):
    layout._templates.clear()
    first = _plan(context, "warm", "0" * 12, monkeypatch, template=True)  # makes the template
    fast = _plan(context, key, "abcdef012345", monkeypatch, template=True)
    full = _plan(context, key, "abcdef012345", monkeypatch, template=False)
    assert fast.manifest == full.manifest
    assert fast.group == full.group
    assert fast.records == full.records
    assert fast.folder_shape == full.folder_shape == first.folder_shape
    assert fast.bundle.ref == full.bundle.ref
    assert _parts(fast) == _parts(full)
    assert [(w.index, w.path, w.shared, w.whole) for w in fast.arrays] == [
        (w.index, w.path, w.shared, w.whole) for w in full.arrays
    ]
    assert fast.stored == full.stored
    # what a reader makes of the bytes is what the plan says
    from residual_store._src.store.disk.records import parse_context_manifest

    assert parse_context_manifest(key, fast.manifest).records == full.records


@pytest.mark.slow
def test_internals_a_template_holds_only_for_arrays_of_its_shapes_and_dtypes(context, monkeypatch):
    layout._templates.clear()
    arrays, impls = host.host_arrays(context)
    layout.plan_write(layout.HostWrite("k", context.spec, arrays, tuple(impls), fsync=False), write_id="0" * 12)
    assert layout._template_for(context.spec, arrays, impls) is not None
    own = next(i for i, k in enumerate(context.spec.kinds) if k == "intermediate" and arrays[i].ndim)
    for changed in (arrays[own].astype(np.float64), arrays[own][None], list(arrays[own])):
        other = list(arrays)
        other[own] = changed
        assert layout._template_for(context.spec, other, impls) is None, type(changed)


@pytest.mark.slow
def test_internals_records_checked_skips_only_the_records(context, monkeypatch):
    plan = _plan(context, "a", "0" * 12, monkeypatch, template=True)
    fields = serializers.decode_manifest(plan.manifest, what="test")
    fields.pop(manifest.SELF_CHECKSUM_FIELD, None)
    # a wrong top-level field is refused with or without checked records
    for checked in (False, True):
        with pytest.raises(ValueError, match="created"):
            serializers.encode_manifest({**fields, "created": "yesterday"}, records_checked=checked)
    # a record is checked once, where it is made
    record = serializers.ArrayRecord.for_writing(
        name="n", path="/abs", shape=(2,), dtype="float32", nbytes=8, checksum="xxh3_64:0",
    )
    with pytest.raises(ValueError, match="path"):
        record.checked()
    moved = plan.records[0].relocated("data/b.000000000000/0", "crc32:00000000")
    assert (moved.path, moved.checksum) == ("data/b.000000000000/0", "crc32:00000000")
    assert moved.shape == plan.records[0].shape and moved.name == plan.records[0].name


_DTYPES = [np.float32, np.float16, jnp.bfloat16, np.int32, np.uint8, np.bool_, np.int8, np.uint32]


def test_internals_host_arrays_placed_many_at_a_time_are_what_device_put_makes(rng):
    """``host.device_put_all`` (``_jax_internals.device_put_many`` past a few arrays) gives
    the aval, sharding, commitment and values ``jax.device_put`` gives, aliasing an aligned CPU
    buffer as it does; arrays it cannot take (not contiguous, a dtype JAX narrows) go through
    ``jax.device_put``."""
    rs_np = np.random.default_rng(int(jax.random.randint(rng, (), 0, 2**30)))
    arrays = [
        (rs_np.standard_normal(shape) * 3).astype(dtype)
        for shape in [(), (0, 3), (4,), (2, 3, 5)] for dtype in _DTYPES
    ]
    arrays.append(rs_np.standard_normal((6, 4)).astype(np.float32)[:, ::2])  # not contiguous
    arrays.append(serializers.aligned_empty((16, 16), np.float32))
    arrays[-1][...] = rs_np.standard_normal((16, 16))
    device = jax.devices()[0]
    for target in (None, device):
        got = host.device_put_all(arrays, target)
        want = jax.device_put(arrays, target)
        for g, w, a in zip(got, want, arrays):
            assert isinstance(g, jax.Array)
            assert (g.shape, g.dtype, g.weak_type) == (w.shape, w.dtype, w.weak_type)
            assert g.sharding == w.sharding and g.committed == w.committed
            np.testing.assert_array_equal(np.asarray(g), a)
        if device.platform == "cpu":  # JAX adopts an aligned buffer; so must the fast path
            assert np.shares_memory(np.asarray(got[-1]), arrays[-1]) == np.shares_memory(
                np.asarray(want[-1]), arrays[-1]
            )


@pytest.mark.slow
def test_a_get_of_many_residuals_gives_arrays_that_compute(context, tmp_path):
    """The arrays a get makes hundreds at a time feed a backward like any others: its gradient
    equals the in-memory backward's, bit for bit."""
    with rs.Store(tmp_path / "s", device_budget=0, host_budget=0) as store:
        store.put(context, "a")
        store.flush()
        got = store.get("a")
        for x, y in zip(got.residuals, context.residuals):
            assert x.dtype == y.dtype and x.shape == y.shape
            if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
                x, y = jax.random.key_data(x), jax.random.key_data(y)
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        g_store, g_mem = rs.backward(got), rs.backward(context)
        for a, b in zip(jax.tree.leaves(g_store), jax.tree.leaves(g_mem)):
            assert np.array_equal(np.asarray(a), np.asarray(b))
            assert np.any(np.asarray(a) != 0) or a.size == 0 or not jnp.issubdtype(a.dtype, jnp.floating)


@pytest.mark.slow
@pytest.mark.parametrize("bundle", [True, False])
@pytest.mark.parametrize("template", [True, False])
def test_internals_the_layout_a_writer_knows_is_the_one_its_manifest_gives(context, monkeypatch, bundle, template):
    """A replaced context's folder is recycled by layout: the layout its writer remembered
    (``StoredContext.folder_shape``) is the one any process computes from the manifest."""
    from residual_store._src.store.disk.records import parse_context_manifest

    layout._templates.clear()
    if not bundle:
        monkeypatch.setattr(residual_forms, "BUNDLE_CAP", -1)
    plan = _plan(context, "a", "0" * 12, monkeypatch, template=template)
    assert (plan.bundle is not None) == bundle
    parsed = parse_context_manifest("a", plan.manifest)
    assert parsed.folder_shape is None
    assert layout.data_of(parsed) == layout.data_of(plan.stored) == (plan.data_dir, plan.folder_shape)


@pytest.mark.slow
def test_internals_a_name_holding_the_templates_placeholder_is_planned_in_full(context):
    """The template's group metadata is split where a placeholder stands; a residual named with
    that character (free text) gets no template, and its group metadata is still right."""
    import dataclasses
    import json

    spec = context.spec
    spec = dataclasses.replace(spec, names=(spec.names[0] + layout._TEMPLATE_PATH, *spec.names[1:]))
    arrays, impls = host.host_arrays(context)
    assert layout._make_template(spec, arrays, impls) is None
    plan = layout.plan_write(layout.HostWrite("a", spec, arrays, tuple(impls), fsync=False), write_id="0" * 12)
    entries = json.loads(plan.group)["attributes"]["residual_store"]["arrays"]
    assert [e["name"] for e in entries] == list(spec.names)
    assert [e["path"] for e in entries] == [r.path for r in plan.records]
