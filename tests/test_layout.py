"""What a write puts where (``residual_store/_src/store/disk/layout.py``'s ``plan_write``): the own
residuals in one aligned bundle under the key's folder, the plans of two keys differing only in
their paths, a fresh folder per write."""

from __future__ import annotations

import json

import numpy as np
import pytest

import residual_store_serializers as serializers
from residual_store._src.context import ResidualContext
from residual_store._src.store import host
from residual_store._src.store.disk import layout, paths
from store_helpers import tiny_context

_ctx = tiny_context


def _size(rows: int = 1) -> int:
    return _ctx(rows).spec.own_nbytes


def test_internals_the_contexts_have_weights_that_are_not_their_own():
    ctx = _ctx(2)
    assert ctx.spec.kinds[0] == "weight"
    own = sum(int(np.asarray(r).nbytes) for r, k in zip(ctx.residuals, ctx.spec.kinds) if k != "weight")
    assert ctx.spec.own_nbytes == own > 0
    assert _size(2) == 2 * _size(1)  # rows scale every own residual, the weight stays out


_WRITE_ID = "0123456789ab"


@pytest.fixture(params=["template", "in full"])
def plan_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Plans made from a signature's template (what a store does after its first write of a
    signature) and residual by residual (the general path)."""
    if request.param == "in full":
        monkeypatch.setattr(layout, "_template_for", lambda *a: None)
    return request.param


def _plan(key: str, ctx: ResidualContext, write_id: str = _WRITE_ID) -> layout.WritePlan:
    arrays, impls = host.host_arrays(ctx)
    return layout.plan_write(layout.HostWrite(key, ctx.spec, arrays, tuple(impls), fsync=False), write_id=write_id)


def _bundle_bytes(plan: layout.WritePlan) -> bytes:
    assert plan.bundle is not None
    return b"".join(bytes(p) for p in plan.bundle.parts)


def test_internals_a_plan_puts_the_own_residuals_in_one_bundle_under_the_keys_folder(plan_path: str):
    ctx = _ctx(2, seed=3)
    plan = _plan("run-1.mb_2", ctx)
    folder = paths.data_dir("run-1.mb_2", _WRITE_ID)
    assert plan.key == "run-1.mb_2" and plan.data_dir == folder
    assert paths.is_data_dir_of("run-1.mb_2", folder) and not paths.is_data_dir_of("run-1", folder)
    assert plan.bundle is not None and plan.bundle.ref.path == paths.bundle_path(folder)
    assert plan.files.keys() == {paths.group_metadata_path(folder), paths.bundle_path(folder)}
    assert plan.own == {}  # every own residual is in the bundle, none in a folder of its own
    own = [i for i, k in enumerate(ctx.spec.kinds) if k != "weight"]
    arrays, _ = host.host_arrays(ctx)
    for i, r in enumerate(plan.records):
        assert r.shape == arrays[i].shape and r.nbytes == arrays[i].nbytes
        if i in own:
            assert r.bundled and not r.shared and r.path == paths.own_array_path(folder, i)
            assert r.path.startswith(folder + "/")
        else:  # the weight: by content address, outside the folder, written once for all
            assert not r.bundled and r.shared
            assert r.path == paths.weight_path(serializers.content_digest(arrays[i]))
            assert paths.is_weight_path(r.path)
    assert set(plan.shared) == {plan.records[0].path}
    assert sum(plan.records[i].nbytes for i in own) == ctx.spec.own_nbytes
    assert plan.stored.records == plan.records and plan.stored.data_dir == folder
    assert plan.stored.bundle == plan.bundle.ref


def test_internals_a_plans_bundle_records_are_aligned_apart_and_hold_the_arrays_bytes(plan_path: str):
    ctx = _ctx(4, seed=1)
    plan = _plan("k", ctx)
    data = _bundle_bytes(plan)
    assert len(data) == plan.bundle.ref.nbytes
    arrays, _ = host.host_arrays(ctx)
    spans = sorted((r.offset, r.offset + r.nbytes, i) for i, r in enumerate(plan.records) if r.bundled)
    assert len(spans) == 3
    for (start, stop, i), nxt in zip(spans, [*spans[1:], None]):
        assert start % 64 == 0, (i, start)
        assert nxt is None or stop <= nxt[0], "bundled arrays overlap"
        assert stop <= len(data)
        assert data[start:stop] == np.ascontiguousarray(arrays[i]).tobytes()


def test_internals_the_plans_of_two_keys_differ_only_in_their_paths(plan_path: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(layout.time, "time", lambda: 1234.5)
    ctx = _ctx(2, seed=5)
    one, two = _plan("alpha", ctx), _plan("omega-2", ctx, write_id="ba9876543210")
    d1, d2 = one.data_dir, two.data_dir
    assert d1 != d2

    def moved(path: str) -> str:
        return d2 + path[len(d1):] if path.startswith(d1 + "/") else path

    assert [moved(r.path) for r in one.records] == [r.path for r in two.records]
    assert [r.relocated("p", r.checksum) for r in one.records] == [r.relocated("p", r.checksum) for r in two.records]
    assert one.folder_shape == two.folder_shape
    assert _bundle_bytes(one) == _bundle_bytes(two) and one.bundle.ref.checksum == two.bundle.ref.checksum
    assert [(a.index, moved(a.path), a.shared) for a in one.arrays] == [(a.index, a.path, a.shared) for a in two.arrays]
    m1 = serializers.decode_manifest(one.manifest, what="one")
    m2 = serializers.decode_manifest(two.manifest, what="two")
    for m in (m1, m2):
        m.pop(serializers.manifest.SELF_CHECKSUM_FIELD, None)
    assert (m1.pop("key"), m2.pop("key")) == ("alpha", "omega-2")
    assert (m1.pop("data_dir"), m2.pop("data_dir")) == (d1, d2)
    b1, b2 = m1.pop("bundle"), m2.pop("bundle")
    assert (b1["path"], b2["path"]) == (paths.bundle_path(d1), paths.bundle_path(d2))
    assert {**b1, "path": ""} == {**b2, "path": ""}
    a1, a2 = m1.pop("arrays"), m2.pop("arrays")
    assert [{**a, "path": moved(a["path"])} for a in a1] == a2
    assert m1 == m2
    g1, g2 = json.loads(one.group), json.loads(two.group)
    r1, r2 = g1["attributes"]["residual_store"], g2["attributes"]["residual_store"]
    assert (r1.pop("key"), r1.pop("manifest")) == ("alpha", paths.manifest_path("alpha"))
    assert (r2.pop("key"), r2.pop("manifest")) == ("omega-2", paths.manifest_path("omega-2"))
    assert [{k: moved(v) if k in ("path", "bundle") else v for k, v in e.items()} for e in r1.pop("arrays")] == r2.pop("arrays")
    assert g1 == g2


def test_internals_a_new_write_id_makes_a_new_folder_for_the_same_key():
    ctx = _ctx(1)
    ids = {paths.new_write_id() for _ in range(4)}
    assert len(ids) == 4
    folders = {_plan("k", ctx, write_id=i).data_dir for i in ids}
    assert len(folders) == 4 and all(paths.is_data_dir_of("k", f) for f in folders)
