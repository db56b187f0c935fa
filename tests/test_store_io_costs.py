"""What a put and a get cost in system calls and reads, observed: the fsyncs of a durable put,
the manifest a get does not parse again, the weights a get does not read again, the checksum
verified while reading."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual_store as rs
import residual_store_serializers as serializers
from residual_store._src.store.disk import folder as local_backend
from residual_store._src.store.disk import records
from store_helpers import F32_TOL, assert_trees_close, data_dirs, jitted_grad


def _loss(params, x):
    h = jnp.tanh(x @ params["w1"])
    h = jnp.sin(h @ params["w2"])
    return jnp.sum(h**2)


@pytest.fixture(scope="module")
def split():
    return rs.split(_loss, argnums=(0, 1), weight_argnums=(0,))


def _inputs(seed: int):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return {"w1": jax.random.normal(k1, (16, 12)), "w2": jax.random.normal(k2, (12, 8))}, jax.random.normal(k3, (6, 16))


def _count(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


@pytest.mark.slow
def test_a_durable_put_into_a_recycled_folder_fsyncs_each_file_once_and_two_folders(tmp_path, split, monkeypatch):
    params, x = _inputs(0)
    with rs.Store(tmp_path / "s", device_budget=0) as store:
        for seed in (1, 2):  # the second replaces the first, whose folder is then recycled
            store.put(split(params, _inputs(seed)[1])[1], "k")
            store.flush()
            store._persistence.janitor.submit(lambda: None).result()
        _, ctx = split(params, x)
        fsyncs = _count(monkeypatch, os, "fsync")
        datasyncs = _count(monkeypatch, os, "fdatasync") if hasattr(os, "fdatasync") else fsyncs
        store.put(ctx, "k")
        store.flush()
        monkeypatch.undo()
        own = sum(1 for kind, a in zip(ctx.spec.kinds, ctx.spec.avals) if kind != "weight" and a.size)
        assert own >= 3
        # files (fdatasync where there is one): the bundle (every own residual), the write's
        # group zarr.json, the manifest; folders (fsync): data/ (the recycled folder's rename),
        # contexts/ (the manifest's)
        files, folders = (len(datasyncs), len(fsyncs)) if datasyncs is not fsyncs else (len(fsyncs) - 2, 2)
        assert (files, folders) == (3, 2), (len(datasyncs), len(fsyncs))
        assert_trees_close(rs.backward(store.get("k")), jitted_grad(_loss, (0, 1))(params, x), **F32_TOL)


def test_internals_a_get_after_a_put_in_one_store_neither_reads_nor_parses_the_manifest(tmp_path, split, monkeypatch):
    params, x = _inputs(3)
    _, ctx = split(params, x)
    root = tmp_path / "s"
    with rs.Store(root, device_budget=0, host_budget=0) as store:
        store.put(ctx, "k")
        store.flush()
        parses = _count(monkeypatch, records, "parse_context_manifest")
        from residual_store._src.store.disk import tier as disk
        monkeypatch.setattr(disk, "parse_context_manifest", records.parse_context_manifest)
        assert_trees_close(rs.backward(store.get("k")), jitted_grad(_loss, (0, 1))(params, x), **F32_TOL)
        assert parses == []
        # another store's write of the key changes the file: read and parsed again, the new one
        params2, x2 = _inputs(4)
        with rs.Store(root) as other:
            other.put(split(params2, x2)[1], "k")
        parses.clear()
        assert_trees_close(rs.backward(store.get("k")), jitted_grad(_loss, (0, 1))(params2, x2), **F32_TOL)
        assert len(parses) == 1


def test_internals_a_delete_after_this_stores_put_parses_nothing_and_after_anothers_drops_the_new_data(
    tmp_path, split, monkeypatch
):
    root = tmp_path / "s"
    params, x = _inputs(20)
    with rs.Store(root) as store:
        store.put(split(params, x)[1], "k")
        store.put(split(params, _inputs(21)[1])[1], "other")
        store.flush()
        from residual_store._src.store.disk import tier as disk
        parses = _count(monkeypatch, disk, "parse_context_manifest")
        (own,) = data_dirs(root, "k")
        store.delete("k")
        store.flush()
        assert parses == [] and "k" not in store
        # another store replaces "other" after this one parsed it: the delete reads the new one
        with rs.Store(root) as writer:
            writer.put(split(params, _inputs(22)[1])[1], "other")
        (replaced,) = data_dirs(root, "other")
        parses.clear()
        store.delete("other")
        store.flush()
        assert [key for key, _ in parses] == ["other"]
    # the janitor (drained by close) has taken both data folders, each the current commit's
    assert data_dirs(root, "k") == data_dirs(root, "other") == []
    assert not (root / "data" / own).exists() and not (root / "data" / replaced).exists()


def test_internals_contexts_of_one_signature_parse_their_spec_once_and_examine_each_folder_once(tmp_path, split, monkeypatch):
    """A fresh store's gets of contexts of one signature: the spec part of their manifests is
    parsed once in the process (every such manifest has the same spec map), and each get
    examines the one folder of its bundle once, whatever its number of residuals."""
    params = _inputs(10)[0]
    xs = [_inputs(s)[1] for s in (11, 12, 13)]
    root = tmp_path / "s"
    with rs.Store(root) as store:
        for i, x in enumerate(xs):
            store.put(split(params, x)[1], f"k{i}")
    monkeypatch.setattr(records, "_SPECS", records._SpecMemo())  # as in a new process
    specs = _count(monkeypatch, records, "spec_from_map")
    lstats = _count(monkeypatch, os, "lstat")
    with rs.Store(root, read_only=True, device_budget=0, host_budget=0) as store:
        lstats.clear()
        got = [store.get(f"k{i}") for i in range(len(xs))]
    assert len(specs) == 1
    examined = [str(a[0]) for a in lstats]
    data = [p for p in examined if os.sep + "data" + os.sep in p]
    assert len(data) == len(set(data)), sorted(data)  # no folder twice
    own = sum(1 for k in got[0].spec.kinds if k != "weight")
    assert own >= 3
    assert len(data) == len(xs), sorted(data)  # each get: its bundle's folder, once
    for ctx, x in zip(got, xs):
        assert_trees_close(rs.backward(ctx), jitted_grad(_loss, (0, 1))(params, x), **F32_TOL)


def test_internals_weights_a_store_holds_on_the_device_are_not_read_again(tmp_path, split, monkeypatch):
    params, _ = _inputs(5)
    xs = [_inputs(s)[1] for s in (6, 7)]
    root = tmp_path / "s"
    with rs.Store(root) as store:
        for i, x in enumerate(xs):
            store.put(split(params, x)[1], f"k{i}")
    batches = _count(monkeypatch, local_backend.LocalBackend, "read_arrays")  # every array read goes through it

    def weight_reads():
        return [path for batch in batches for path, *_ in batch[1] if path.startswith("weights/")]

    with rs.Store(root, read_only=True, device_budget=0, host_budget=0) as store:  # keeps no context
        first = store.get("k0")  # holds the weights: the next get takes them from here
        assert len(weight_reads()) == 2
        second = store.get("k1")
        assert len(weight_reads()) == 2
        assert second.residuals[ctx_weight_index(second)] is first.residuals[ctx_weight_index(first)]
        for ctx, x in zip((first, second), xs):
            assert_trees_close(rs.backward(ctx), jitted_grad(_loss, (0, 1))(params, x), **F32_TOL)
        del first, second, ctx
        third = store.get("k0")  # no context holds them now: read again
        assert len(weight_reads()) == 4
        assert_trees_close(rs.backward(third), jitted_grad(_loss, (0, 1))(params, xs[0]), **F32_TOL)


def ctx_weight_index(ctx) -> int:
    return next(i for i, k in enumerate(ctx.spec.kinds) if k == "weight")


def test_the_verifier_hashes_pieces_to_the_whole_arrays_checksum():
    data = np.random.default_rng(0).standard_normal(300_001).astype(np.float32)
    v = serializers.Verifier(serializers.checksum(data), what="x")
    raw = data.view(np.uint8)
    for start in range(0, raw.size, 65_537):
        v.update(raw[start : start + 65_537])
    v.check()
    bad = serializers.Verifier(serializers.checksum(data), what="the array")
    bad.update(raw[:-1])
    with pytest.raises(serializers.CorruptDataError, match="the array: checksum mismatch"):
        bad.check()
    with pytest.raises(serializers.CorruptDataError, match="malformed checksum"):
        serializers.Verifier("xxh3_64:zz", what="x")


def test_a_live_weight_is_hashed_once_for_every_put_that_holds_it(tmp_path, split, monkeypatch):
    params, _ = _inputs(8)
    xs = [_inputs(s)[1] for s in (9, 10, 11)]
    digests = _count(monkeypatch, serializers, "content_digest")
    with rs.Store(tmp_path / "s", device_budget=0) as store:
        for i, x in enumerate(xs):
            store.put(split(params, x)[1], f"k{i}")
        store.flush()
        assert len(digests) == len(params)  # once per weight, not once per weight per put
        new = jax.tree.map(lambda w: w + 1.0, params)  # other arrays: hashed (and stored) anew
        store.put(split(new, xs[0])[1], "k3")
        store.flush()
        assert len(digests) == 2 * len(params)
        for i, (p, x) in enumerate([(params, xs[0]), (params, xs[1]), (params, xs[2]), (new, xs[0])]):
            assert_trees_close(rs.backward(store.get(f"k{i}")), jitted_grad(_loss, (0, 1))(p, x), **F32_TOL)
    with rs.Store(tmp_path / "s", read_only=True) as fresh:  # what was written is what a reader checks
        assert_trees_close(rs.backward(fresh.get("k3")), jitted_grad(_loss, (0, 1))(new, xs[0]), **F32_TOL)


def test_internals_a_burst_of_durable_puts_shares_one_sync_of_the_manifests_folder(tmp_path, split, monkeypatch):
    import threading

    params, _ = _inputs(12)
    xs = [_inputs(s)[1] for s in range(13, 18)]
    synced = _count(monkeypatch, local_backend, "fsync_folder_local")
    with rs.Store(tmp_path / "s") as store:
        go = threading.Event()
        store._persistence.writer.submit(lambda: go.wait(30), 0)  # the puts below queue up behind this
        for i, x in enumerate(xs):
            store.put(split(params, x)[1], f"k{i}")
        go.set()
        store.flush()
        contexts = [a for a in synced if a[0].endswith(os.sep + "contexts")]
        assert len(contexts) == 1  # once for the five commits, before flush returned
        for i, x in enumerate(xs):
            assert_trees_close(rs.backward(store.get(f"k{i}")), jitted_grad(_loss, (0, 1))(params, x), **F32_TOL)
