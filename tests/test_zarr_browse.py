"""The store as a zarr v3 hierarchy: plain zarr (in a process without residual-store) finds every
array of every committed context from the groups' attributes; a version 1 store is read as it
is and upgraded by its first write."""

from __future__ import annotations

import json
import os
import textwrap
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual_store as rs
from store_helpers import F32_TOL, assert_trees_close, run_python

pytestmark = pytest.mark.subprocess


def _loss(params, x):
    h = jnp.tanh(x @ params["w1"])
    return jnp.sum(jnp.sin(h @ params["w2"]) ** 2)


@pytest.fixture(scope="module")
def split():
    return rs.split(_loss, argnums=(0, 1), weight_argnums=(0,))


def _inputs(seed: int):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    params = {"w1": jax.random.normal(k1, (6, 5)), "w2": jax.random.normal(k2, (5, 3))}
    return params, jax.random.normal(k3, (4, 6))


# Imports zarr, numpy and json only: what a user with neither residual-store nor its manifests
# in mind does. Prints, per key, its arrays in leaf order: path, name, kind, shape, values.
_BROWSE = textwrap.dedent(
    """
    import json, sys
    import numpy as np, zarr
    from zarr.storage import ZipStore
    assert not any(m.split(".")[0] in ("residual_store_serializers", "residual_store", "jax") for m in sys.modules)
    root = zarr.open_group(sys.argv[1], mode="r")
    out = {"root": dict(root.attrs), "contexts": {}}
    for name, write in root["data"].groups():
        info = write.attrs["residual_store"]
        assert name.startswith(info["key"] + ".")
        arrays = []
        for entry in info["arrays"]:
            if "bundle" in entry:  # the context's own arrays: a zarr group in one zip file
                bundle = zarr.open_group(ZipStore(sys.argv[1] + "/" + entry["bundle"], mode="r"), mode="r")
                a = bundle[entry["in_bundle"]]
            else:
                a = root[entry["path"]]
            arrays.append([entry["path"], entry["name"], entry["kind"], list(a.shape),
                           np.asarray(a[...], dtype=np.float64).ravel().tolist(), dict(a.attrs)])
        out["contexts"][info["key"]] = {"signature": info["signature"], "manifest": info["manifest"],
                                         "arrays": arrays}
    print(json.dumps(out))
    """
)


def test_plain_zarr_finds_every_array_of_every_context(tmp_path, split):
    root = tmp_path / "store"
    contexts = {}
    with rs.Store(root, device_budget=0) as store:
        for i, key in enumerate(["a", "b", "again", "again"]):  # "again": a recycled folder
            _, contexts[key] = split(*_inputs(i))
            store.put(contexts[key], key)
            store.flush()
        store.delete("b")  # gone from the manifests, so from the groups too (its folder recycled)
        store.flush()
        del contexts["b"]
    script = tmp_path / "browse.py"
    script.write_text(_BROWSE)
    out = json.loads(run_python(str(script), str(root)).stdout)
    assert out["root"]["residual_store"]["version"] == 2
    assert sorted(out["contexts"]) == ["a", "again"]  # hidden folders (.free) are no groups
    for key, ctx in contexts.items():
        got = out["contexts"][key]
        assert got["signature"] == ctx.spec.signature
        assert os.path.exists(root / got["manifest"])
        assert [a[1] for a in got["arrays"]] == list(ctx.spec.names)
        assert [a[2] for a in got["arrays"]] == list(ctx.spec.kinds)
        assert {"weight", "intermediate"} <= set(ctx.spec.kinds)
        for (path, _, kind, shape, values, attrs), x, name in zip(got["arrays"], ctx.residuals, ctx.spec.names):
            assert shape == list(x.shape)
            np.testing.assert_array_equal(np.asarray(values), np.asarray(x, np.float64).ravel())
            if kind == "weight":
                assert path.startswith("weights/") and attrs == {}
            else:
                assert path.startswith(f"data/{key}.")
                assert attrs["residual_store"]["name"] == name and attrs["residual_store"]["kind"] == kind


def _make_version_1(root):
    """What residual-store wrote before the groups: marker version 1, no zarr.json of a group,
    arrays without attributes."""
    (root / "residual-store.json").write_bytes(b'{"format": "residual-store", "version": 1}\n')
    for dirpath, _, files in os.walk(root):
        if "zarr.json" not in files:
            continue
        p = os.path.join(dirpath, "zarr.json")
        meta = json.loads(open(p, "rb").read())
        if meta["node_type"] == "group":
            os.remove(p)
        else:
            meta.pop("attributes", None)
            open(p, "w").write(json.dumps(meta))


def _files(root):
    return sorted((str(p.relative_to(root)), p.read_bytes()) for p in root.rglob("*") if p.is_file())


def test_internals_a_version_1_store_is_read_and_upgraded_by_its_first_write(tmp_path, split, monkeypatch):
    from residual_store._src.store.disk import forms as residual_forms

    root = tmp_path / "store"
    params, x = _inputs(7)
    _, ctx = split(params, x)
    with monkeypatch.context() as m:  # version 1 had no bundles: a folder per residual
        m.setattr(residual_forms, "BUNDLE_CAP", -1)
        with rs.Store(root) as store:
            store.put(ctx, "old")
    _make_version_1(root)
    before = _files(root)
    expected = jax.grad(_loss, argnums=(0, 1))(params, x)

    with rs.Store(root, read_only=True) as store:  # read as it is, nothing changed
        assert_trees_close(rs.backward(store.get("old")), expected, **F32_TOL)
    with rs.Store(root) as store:  # opening alone changes nothing either
        assert store.keys() == ["old"]
    assert _files(root) == before

    params2, x2 = _inputs(8)
    _, ctx2 = split(params2, x2)
    with rs.Store(root) as store:
        store.put(ctx2, "new")
    marker = json.loads((root / "residual-store.json").read_bytes())
    assert marker == {"format": "residual-store", "version": 2}
    for group in ("zarr.json", "data/zarr.json", "weights/zarr.json"):
        assert json.loads((root / group).read_bytes())["node_type"] == "group"
    with rs.Store(root, read_only=True) as store:
        assert store.keys() == ["new", "old"]
        assert_trees_close(rs.backward(store.get("old")), expected, **F32_TOL)
        assert_trees_close(
            rs.backward(store.get("new")), jax.grad(_loss, argnums=(0, 1))(params2, x2), **F32_TOL
        )


def test_a_recycled_folder_keeps_no_attributes_of_another_function(tmp_path):
    """A folder is recycled only by a write of the same layout and attributes: a function with
    the same shapes but other names gets fresh zarr.json files, never the old ones."""
    def first(w, x):
        return jnp.sum(jnp.sin(x @ w) ** 2)

    def second(w, x):  # the same shapes; its intermediates are named at these other lines
        return jnp.sum(jnp.sin(x @ w) ** 2)

    w, x = jax.random.normal(jax.random.key(0), (4, 3)), jax.random.normal(jax.random.key(1), (5, 4))
    root = tmp_path / "store"
    with rs.Store(root) as store:
        store.put(rs.split(first)(w, x)[1], "a")
        store.flush()
        store.delete("a")  # its folder goes to data/.free
        store.flush()
        store._persistence.janitor.submit(lambda: None).result()
        _, ctx = rs.split(second)(w, x)
        store.put(ctx, "b")
    names = set()
    for dirpath, _, files in os.walk(root / "data"):
        if "bundle.zip" in files and ".free" not in dirpath:  # the arrays' zarr.json are in it
            with zipfile.ZipFile(os.path.join(dirpath, "bundle.zip")) as bundle:
                for entry in bundle.namelist():
                    meta = json.loads(bundle.read(entry)) if entry.endswith("/zarr.json") else None
                    if meta is not None and meta["node_type"] == "array":
                        names.add(meta["attributes"]["residual_store"]["name"])
    _, old = rs.split(first)(w, x)
    assert set(old.spec.names) != set(ctx.spec.names)  # the same layout but for the names
    assert names == set(ctx.spec.names)


def _low_precision_loss(w, x):
    h = jnp.tanh((x @ w).astype(jnp.bfloat16))  # bfloat16 residuals
    q = jnp.tanh(h.astype(jnp.float8_e4m3fn))  # float8_e4m3fn residuals
    return jnp.sum(jnp.sin(q.astype(jnp.float32)) ** 2)


# Imports zarr, numpy and ml_dtypes only, and turns every warning into an error: opens the store's
# root group, finds each context's arrays from the attributes and prints their raw bytes by name.
_READ_BITS = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.simplefilter("error")
    import ml_dtypes, numpy as np, zarr
    from zarr.storage import ZipStore
    assert not any(m.split(".")[0] in ("residual_store_serializers", "residual_store", "jax") for m in sys.modules)
    root = zarr.open_group(sys.argv[1], mode="r")
    out = {}
    for _, write in root["data"].groups():
        info = write.attrs["residual_store"]
        assert list(write.members()) == []  # all its own arrays are in bundle.zip
        for entry in info["arrays"]:
            if "bundle" in entry:
                a = zarr.open_group(ZipStore(sys.argv[1] + "/" + entry["bundle"], mode="r"), mode="r")[entry["in_bundle"]]
            else:
                a = root[entry["path"]]
            out[info["key"] + "/" + entry["name"]] = [str(a.dtype), list(a.shape), np.asarray(a[...]).tobytes().hex()]
    print(json.dumps(out))
    """
)


def test_plain_zarr_reads_bfloat16_and_float8_residuals_by_name_with_no_warning(tmp_path):
    """A process that imports zarr and nothing of residual-store reads a store's bfloat16 and
    float8 residuals by name, bit for bit, with no call to register them and no warning."""
    w = jax.random.normal(jax.random.key(0), (6, 5))
    x = jax.random.normal(jax.random.key(1), (4, 6))
    _, ctx = rs.split(_low_precision_loss, weight_argnums=0)(w, x)
    dtypes = {str(np.asarray(r).dtype) for r in ctx.residuals}
    assert {"bfloat16", "float8_e4m3fn"} <= dtypes
    root = tmp_path / "store"
    with rs.Store(root, device_budget=0) as store:
        store.put(ctx, "low")
    script = tmp_path / "read_bits.py"
    script.write_text(_READ_BITS)
    got = json.loads(run_python(str(script), str(root)).stdout)
    assert sorted(got) == sorted(f"low/{name}" for name in ctx.spec.names)
    for name, r in zip(ctx.spec.names, ctx.residuals):
        r = np.asarray(r)
        assert got[f"low/{name}"] == [str(r.dtype), list(r.shape), r.tobytes().hex()], name


# Imports zarr only; prints, per listing, the names zarr-python warns are no zarr node.
_LISTING_WARNINGS = textwrap.dedent(
    """
    import json, re, sys, warnings
    import zarr
    root = zarr.open_group(sys.argv[1], mode="r")
    out = {}
    for what, listing in [("root", lambda: list(root.members())), ("data", lambda: list(root["data"].groups())),
                          ("tree", lambda: list(root.members(max_depth=None)))]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            listing()
        out[what] = sorted(re.search(r"'?([^' ]+)'? (is not recognized|not found)", str(w.message)).group(1)
                           for w in caught)
    print(json.dumps(out))
    """
)


def test_which_entries_plain_zarr_warns_about(tmp_path, split):
    """zarr-python warns once for each entry of a folder it lists that is no zarr node. A write
    whose own arrays are all in its bundle says it has no member (its zarr.json's consolidated
    metadata), so listing it is silent; what still warns is the store's own files at the root
    (the marker, the gc lock, contexts/, backwards/: moving them would break every older
    residual-store), the recycled data folders, and, in a traversal of the whole tree, each
    bundle.zip (see docs/format.md)."""
    root = tmp_path / "store"
    with rs.Store(root, device_budget=0) as store:
        store.put(split(*_inputs(0))[1], "a")
        store.flush()
        store.put(split(*_inputs(1))[1], "a")  # replaces: the first write's folder is recycled
        store.flush()
    assert (root / "data" / ".free").is_dir()
    script = tmp_path / "listing_warnings.py"
    script.write_text(_LISTING_WARNINGS)
    got = json.loads(run_python(str(script), str(root)).stdout)
    own = [".gc.lock", "backwards", "contexts", "residual-store.json"]
    assert got == {"root": own, "data": [".free"], "tree": sorted([*own, ".free", "bundle.zip"])}


def test_internals_a_write_with_arrays_of_its_own_folder_lists_them(tmp_path, split, monkeypatch):
    """Only a write whose folder holds no array says it has no member: one whose residuals have
    folders of their own (here: no bundle) is an ordinary group, and zarr lists its arrays."""
    import zarr

    from residual_store._src.store.disk import forms as residual_forms

    monkeypatch.setattr(residual_forms, "BUNDLE_CAP", -1)
    root = tmp_path / "store"
    _, ctx = split(*_inputs(3))
    with rs.Store(root, device_budget=0) as store:
        store.put(ctx, "folders")
    (folder,) = [p for p in (root / "data").iterdir() if p.name.startswith("folders.")]
    assert "consolidated_metadata" not in json.loads((folder / "zarr.json").read_bytes())
    own = [str(i) for i, kind in enumerate(ctx.spec.kinds) if kind != "weight"]
    assert sorted(zarr.open_group(str(folder), mode="r").array_keys()) == sorted(own)
