"""rs.Store: bitwise round trips, the on-disk format read by plain zarr, weights stored once,
corruption detected, key rules, tiers and budgets, management, and other processes."""

from __future__ import annotations

import json
import os
import uuid
import warnings

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest

import residual_store as rs
import residual_store_serializers as serializers
from store_helpers import (
    F32_TOL,
    assert_contexts_identical,
    assert_trees_close,
    assert_trees_equal,
    children,
    committed_keys,
    data_dirs,
    disk_usage,
    flat_tree,
    init_params,
    mixed_inputs,
    mixed_loss,
    mlp_batch,
    mlp_loss,
    open_stored_array,
    own_bytes,
    raw,
    read_manifest,
    run_python,
    tree_files,
    write_script,
)

BIG = (64, 128, 128, 16)  # weights dominate the residuals of a batch of 8


def _counts(removed: dict) -> dict:
    """What gc removed, by kind (without its "young" and "bytes" totals)."""
    return {k: v for k, v in removed.items() if k not in ("young", "bytes")}


@pytest.fixture(scope="module")
def mixed_split():
    return rs.split(mixed_loss)


@pytest.fixture(scope="module")
def mixed_grad_ref():
    return jax.jit(jax.grad(mixed_loss))


@pytest.fixture(scope="module")
def mlp_split():
    return rs.split(mlp_loss)


def _mlp_contexts(split, rng, n, batch=5, sizes=(8, 16, 16, 4)):
    """``n`` contexts of one set of weights, with their inputs."""
    kp, kb = jax.random.split(rng)
    params = init_params(kp, sizes)
    batches = [mlp_batch(k, batch, sizes) for k in jax.random.split(kb, n)]
    return params, batches, [split(params, x, y)[1] for x, y in batches]


def _check_mlp_grads(ctx, params, x, y):
    """Gradients of a (reloaded) context equal jax.grad of the model within float32 rounding."""
    grads = rs.backward(ctx)
    ref = jax.grad(mlp_loss)(params, x, y)
    assert_trees_close(grads, ref, **F32_TOL)
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(ref))


def _store_path(kind, tmp_path):
    folder = str(tmp_path / "store")
    if kind == "folder":
        return tmp_path / "store"  # an os.PathLike
    if kind == "file_spec":
        return {"driver": "file", "path": folder}
    if (
        kind == "file_spec_tensorstore"
    ):  # an extra option: written through tensorstore, not the fast path
        return {"driver": "file", "path": folder, "file_io_sync": True}
    if kind == "memory_spec":
        return {"driver": "memory", "path": f"rs-test-{uuid.uuid4().hex}/"}
    raise AssertionError(kind)


# ----------------------------------------------------------------------------------------------
# 1. Round trips


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["folder", "file_spec", "file_spec_tensorstore", "memory_spec"])
def test_round_trip_of_every_dtype_is_bitwise(kind, tmp_path, mixed_split, mixed_grad_ref, rng):
    args = mixed_inputs(rng)
    _, ctx = mixed_split(*args)
    dtypes = {str(a.dtype) for a in ctx.spec.avals}
    assert {"float32", "float16", "bfloat16", "int32", "bool", "key<fry>", "key<rbg>"} <= dtypes
    assert any(
        k == "intermediate" and str(a.dtype) == "key<fry>"
        for a, k in zip(ctx.spec.avals, ctx.spec.kinds)
    )
    path = _store_path(kind, tmp_path)

    with rs.Store(path) as store:
        assert store.put(ctx, "ctx-0") == "ctx-0"
        store.flush()
    if kind != "memory_spec":  # really on disk, as zarr arrays and a manifest
        files = tree_files(tmp_path / "store")
        assert "contexts/ctx-0.manifest" in files
        # the groups (the root, data/, weights/ and this write's folder), one per weight, and the
        # context's own residuals in one bundle, whatever their number
        weights = sum(k in ("weight", "constant") for k in ctx.spec.kinds)
        assert sum(1 for f in files if f.endswith("zarr.json")) == 4 + weights
        assert sum(1 for f in files if f.endswith("/bundle.zip")) == 1

    with rs.Store(path) as other:  # a new store has nothing in memory: this reads the disk
        assert other.keys() == ["ctx-0"] and "ctx-0" in other and len(other) == 1
        got = other.get("ctx-0")
    assert_contexts_identical(got, ctx)
    assert all(isinstance(r, jax.Array) for r in got.residuals)
    for r, a in zip(got.residuals, ctx.spec.avals):
        assert r.dtype == a.dtype  # typed keys come back typed: key<fry>, key<rbg>

    grads = rs.backward(got)
    assert_trees_equal(grads, mixed_split.backward(ctx))
    ref = mixed_grad_ref(*args)
    # bf16/f16 paths: two differently fused programs differ by ~1% of the largest gradient.
    scale = float(jnp.abs(ref).max())
    assert scale > 0
    np.testing.assert_allclose(grads, ref, rtol=2e-2, atol=2e-2 * scale)


def test_reloaded_float32_gradients_equal_jax_grad(tmp_path, mlp_split, rng):
    params, batches, ctxs = _mlp_contexts(mlp_split, rng, 2)
    with rs.Store(tmp_path / "s") as store:
        keys = [store.put(c) for c in ctxs]
    assert len(set(keys)) == 2 and all(len(k) == 32 for k in keys)  # None makes unique keys
    with rs.Store(tmp_path / "s") as store:
        for key, ctx, (x, y) in zip(keys, ctxs, batches):
            got = store.get(key)
            assert_contexts_identical(got, ctx)
            _check_mlp_grads(got, params, x, y)
            g3 = rs.backward(got, jnp.float32(3.0))
            assert_trees_close(
                g3, jax.tree.map(lambda g: 3 * g, jax.grad(mlp_loss)(params, x, y)), **F32_TOL
            )


# ----------------------------------------------------------------------------------------------
# 2. Plain zarr reads the arrays


def test_plain_zarr_reads_every_residual_array(tmp_path, mixed_split, rng):

    serializers.register_zarr_dtypes()
    _, ctx = mixed_split(*mixed_inputs(rng))
    root = tmp_path / "store"
    with rs.Store(root) as store:
        store.put(ctx, "z")
    manifest = read_manifest(root, "z")
    assert manifest["format"] == "residual-store/context" and manifest["version"] == 4
    assert len(manifest["arrays"]) == len(ctx.residuals)
    for i, (record, x) in enumerate(zip(manifest["arrays"], ctx.residuals)):
        want = raw(x)
        arr = open_stored_array(root, manifest, i)
        got = np.asarray(arr[...])
        assert got.dtype == want.dtype, (record["name"], got.dtype, want.dtype)
        assert got.shape == want.shape == tuple(record["shape"])
        assert got.tobytes() == want.tobytes(), record["name"]
        assert record["dtype"] == str(want.dtype) and record["nbytes"] == want.nbytes
    assert sum(1 for r in manifest["arrays"] if r["dtype"] == "bfloat16") >= 1


# ----------------------------------------------------------------------------------------------
# 3. Weights stored once


@pytest.mark.slow
def test_contexts_sharing_weights_store_them_once(tmp_path, rng):
    split = rs.split(mlp_loss)
    _, _, ctxs = _mlp_contexts(split, rng, 8, batch=8, sizes=BIG)
    ctx = ctxs[0]
    is_weight = [p is not None and p.startswith("params") for p in ctx.spec.input_paths]
    weights = sum(raw(x).nbytes for x, w in zip(ctx.residuals, is_weight) if w)
    per_ctx = [sum(raw(x).nbytes for x, w in zip(c.residuals, is_weight) if not w) for c in ctxs]
    assert len(set(per_ctx)) == 1 and weights > 3 * per_ctx[0]
    acts = per_ctx[0]

    root = tmp_path / "store"
    with rs.Store(root) as store:
        for i, c in enumerate(ctxs):
            store.put(c, f"mb{i}")
        store.flush()
        assert store.stats()["disk"] == {
            "bytes": weights + 8 * acts, "contexts": 8, "own_bytes": 8 * acts,
            "reads": 0, "bytes_read": 0, "writes": 8, "bytes_written": 8 * acts,
        }
    total = disk_usage(root)
    # weights once (eight copies would be 8 x 73 KiB); each context's own bytes, with its
    # metadata (manifest, group zarr.json, the bundle's zip headers and per-array zarr.json:
    # about 9 KiB beside these contexts' 19 KiB of residuals)
    assert 8 * acts <= total < 1.5 * weights + 1.6 * 8 * acts, (total, weights, acts)
    assert [k == "weight" for k in ctx.spec.kinds] == is_weight  # weight_argnums: params
    assert "input" in ctx.spec.kinds  # the batch: each context's own, stored with it
    assert len(children(root / "weights")) == sum(is_weight)
    with rs.Store(root) as store:
        assert store.stats()["disk"] == {
            "bytes": weights + 8 * acts, "contexts": 8, "own_bytes": 8 * acts,
            "reads": 0, "bytes_read": 0, "writes": 0, "bytes_written": 0,
        }
        a, b = store.get("mb0"), store.get("mb7")
        # one device array per stored weight, shared by every loaded context
        for i, w in enumerate(is_weight):
            if w:
                assert a.residuals[i] is b.residuals[i]


# ----------------------------------------------------------------------------------------------
# 4. Corruption


@pytest.fixture
def three_stored(tmp_path, mlp_split, rng):
    params, batches, ctxs = _mlp_contexts(mlp_split, rng, 3)
    root = tmp_path / "store"
    with rs.Store(root) as store:
        for i, c in enumerate(ctxs):
            store.put(c, f"c{i}")
    return root, params, batches, ctxs


def _chunk_file(root, record):
    folder = root / record["path"]
    chunks = [str(folder / f) for f in os.listdir(folder) if f == "c" or f.startswith("c.")]
    assert len(chunks) == 1
    return chunks[0]


def _flip_bit(path, rng, start=0, nbytes=None):
    """Flips one random bit of the file ``path`` (of its bytes ``[start, start + nbytes)``)."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    n = len(data) - start if nbytes is None else nbytes
    bit = start * 8 + int(jax.random.randint(rng, (), 0, n * 8))
    data[bit // 8] ^= 1 << (bit % 8)
    with open(path, "wb") as f:
        f.write(data)


def _corrupt(root, key, kind, rng):
    """Damages ``key``; returns what the error message must mention."""
    manifest_path = root / "contexts" / f"{key}.manifest"
    manifest = read_manifest(root, key)
    i, record = next((i, r) for i, r in enumerate(manifest["arrays"]) if not r["shared"] and r["nbytes"])
    bundle = root / manifest["bundle"]["path"]  # the context's own arrays are in its bundle
    assert "offset" in record
    if kind == "flip_bit":  # in the residual's bytes: found by the bundle's checksum, named
        _flip_bit(bundle, rng, record["offset"], record["nbytes"])
    elif kind == "truncate":
        os.truncate(bundle, os.path.getsize(bundle) // 2)
        return ["bundle", "truncated"]
    elif kind == "delete_array":
        os.unlink(bundle)
        return ["bundle", "missing"]
    elif kind == "garbled_manifest":
        data = manifest_path.read_bytes()
        manifest_path.write_bytes(data[: len(data) // 2] + b"\xc1garbage")
        return ["manifest"]
    elif kind == "future_manifest":
        manifest["version"] = 99
        manifest_path.write_bytes(msgpack.packb(manifest, use_bin_type=True))
        return ["manifest", "99"]
    else:
        raise AssertionError(kind)
    return [f"residual {i}", record["name"]]


@pytest.mark.parametrize(
    "kind", ["flip_bit", "truncate", "delete_array", "garbled_manifest", "future_manifest"]
)
def test_corruption_raises_corrupt_context_error(kind, three_stored, rng):
    root, params, batches, ctxs = three_stored
    mentions = _corrupt(root, "c1", kind, rng)
    with rs.Store(root) as store:
        with pytest.raises(rs.CorruptContextError) as info:
            store.get("c1")
        message = str(info.value)
        assert "'c1'" in message, message
        for word in mentions:
            assert word in message, (word, message)
        assert isinstance(info.value, rs.ResidualStoreError)
        store.prefetch("c1")  # a failed background load surfaces from get
        with pytest.raises(rs.CorruptContextError):
            store.get("c1")
        assert "c1" in store.keys() and "c1" in store  # noqa: SIM118 - both listings
        for key in ("c0", "c2"):  # the rest of the store is fine
            i = int(key[1])
            got = store.get(key)
            assert_contexts_identical(got, ctxs[i])
            _check_mlp_grads(got, params, *batches[i])
        stats = store.stats()["disk"]
        assert stats["contexts"] == (2 if "manifest" in kind else 3)
        with pytest.raises(rs.CorruptContextError):  # still corrupt: nothing was cached
            store.get("c1")


def test_corrupt_shared_weight_fails_every_context_that_holds_it(three_stored, rng):
    root, *_ = three_stored
    manifest = read_manifest(root, "c0")
    record = next(r for r in manifest["arrays"] if r["input_path"] == "params['ws'][1]")
    _flip_bit(_chunk_file(root, record), rng)
    with rs.Store(root) as store:
        for key in ("c0", "c1", "c2"):
            with pytest.raises(
                rs.CorruptContextError, match=r"residual \d+ \(input params\['ws'\]\[1\]\)"
            ) as info:
                store.get(key)
            assert repr(key) in str(info.value)


def test_manifest_bit_flips_never_give_wrong_data(three_stored, rng):
    """A flipped bit anywhere in a manifest: either an error, or exactly the stored context."""
    root, _, _, ctxs = three_stored
    path = root / "contexts" / "c0.manifest"
    original = path.read_bytes()
    n_bits = len(original) * 8
    bits = np.random.default_rng(int(jax.random.randint(rng, (), 0, 2**31 - 1))).choice(
        n_bits, 120, replace=False
    )
    want = rs.backward(ctxs[0])
    outcomes = {"corrupt": 0, "intact": 0}
    with rs.Store(root, device_budget=0, host_budget=0) as store:  # every get reads the disk
        for bit in bits:
            data = bytearray(original)
            data[bit // 8] ^= 1 << (bit % 8)
            path.write_bytes(bytes(data))
            try:
                got = store.get("c0")
            except rs.CorruptContextError:
                outcomes["corrupt"] += 1
                continue
            outcomes["intact"] += 1
            assert len(got.residuals) == len(ctxs[0].residuals)
            for a, b in zip(got.residuals, ctxs[0].residuals):
                assert a.dtype == b.dtype and raw(a).tobytes() == raw(b).tobytes(), int(bit)
            try:
                grads = rs.backward(got)
            except (rs.BackwardUnavailableError, rs.SignatureMismatchError):
                continue  # the signature string was hit: no backward, never a wrong one
            assert_trees_equal(grads, want)
    path.write_bytes(original)
    assert outcomes["corrupt"] > 0


# ----------------------------------------------------------------------------------------------
# 5. Keys

BAD_KEYS = [
    "../x",
    "a/b",
    ".x",
    "",
    "k" * 129,
    "/abs/path",
    "..",
    "a\\b",
    "a b",
    "é",
    "x\n",
    7,
    None,
    b"bytes",
]


@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
def test_invalid_keys_are_refused_everywhere(key, tmp_path, mlp_split, rng):
    _, _, (ctx,) = _mlp_contexts(mlp_split, rng, 1)
    root = tmp_path / "inner" / "store"
    with rs.Store(root) as store:
        store.put(ctx, "fine")
        store.flush()
        before = tree_files(tmp_path)
        ops = {
            "put": lambda: store.put(ctx, key),
            "get": lambda: store.get(key),
            "delete": lambda: store.delete(key),
            "prefetch": lambda: store.prefetch(key),
            "pop": lambda: store.pop(key),
        }
        for name, op in ops.items():
            if key is None and name == "put":
                continue  # put(ctx, None) makes a unique key
            with pytest.raises(rs.InvalidKeyError) as info:
                op()
            assert isinstance(info.value, ValueError) and isinstance(
                info.value, rs.ResidualStoreError
            ), name
        assert key not in store
        store.flush()
        assert store.keys() == ["fine"]
    assert tree_files(tmp_path) == before  # nothing written, inside the store or outside it
    assert not os.path.exists("/abs")


@pytest.mark.parametrize("key", ["k" * 128, "-x", "_", "a.b..c", "A-Z_0.9", "x.manifest"])
def test_valid_edge_keys_round_trip(key, tmp_path, mlp_split, rng):
    _, _, (ctx,) = _mlp_contexts(mlp_split, rng, 1)
    with rs.Store(tmp_path / "s") as store:
        assert store.put(ctx, key) == key
    with rs.Store(tmp_path / "s") as store:
        assert store.keys() == [key]
        assert_contexts_identical(store.get(key), ctx)


@pytest.mark.parametrize("where", ["disk", "memory"])
def test_unknown_key_is_context_not_found(where, tmp_path, mlp_split, rng):
    _, _, (ctx,) = _mlp_contexts(mlp_split, rng, 1)
    with rs.Store(tmp_path / "s" if where == "disk" else None) as store:
        store.put(ctx, "there")
        for op in (store.get, store.delete, store.prefetch, store.pop):
            with pytest.raises(rs.ContextNotFoundError) as info:
                op("missing")
            assert isinstance(info.value, KeyError) and "missing" in str(info.value)
        assert "missing" not in store and store.keys() == ["there"]


# ----------------------------------------------------------------------------------------------
# 6. Tiers and budgets


def test_contexts_move_down_the_tiers_and_come_back(tmp_path, mlp_split, rng):
    params, batches, ctxs = _mlp_contexts(mlp_split, rng, 4)
    size = own_bytes(ctxs[0])
    assert size > 0
    with rs.Store(tmp_path / "s", device_budget=size, host_budget=size) as store:
        for i, c in enumerate(ctxs):
            store.put(c, f"k{i}")
        store.flush()
        stats = store.stats()
        # four puts: each entered the device, three moved on to host, two of those past it
        assert stats["device"] == {"bytes": size, "contexts": 1, "bytes_in": 4 * size, "bytes_out": 3 * size, "leaving": 0,
                                  "lent": 0, "held": size}
        assert stats["host"] == {"bytes": size, "contexts": 1, "bytes_in": 3 * size, "bytes_out": 2 * size}
        assert stats["disk"]["contexts"] == 4  # write-through: every context is on disk
        for i in (0, 3, 1, 2, 0):  # from disk, from host, from device
            got = store.get(f"k{i}")
            assert_contexts_identical(got, ctxs[i])
            assert all(r.sharding.memory_kind in (None, "device") for r in got.residuals)
            _check_mlp_grads(got, params, *batches[i])
            stats = store.stats()
            assert stats["device"]["bytes"] <= size and stats["host"]["bytes"] <= size
            assert stats["device"]["contexts"] == 1 and stats["host"]["contexts"] == 1
        assert len(store) == 4


def test_prefetch_then_get(tmp_path, mlp_split, rng):
    params, batches, ctxs = _mlp_contexts(mlp_split, rng, 3)
    with rs.Store(tmp_path / "s", device_budget=0, host_budget=0) as store:
        for i, c in enumerate(ctxs):
            store.put(c, f"k{i}")
        store.flush()
        assert store.stats()["device"]["contexts"] == store.stats()["host"]["contexts"] == 0
    with rs.Store(tmp_path / "s", device_budget=3 * own_bytes(ctxs[0])) as store:
        for i in range(3):
            store.prefetch(f"k{i}")
            store.prefetch(f"k{i}")  # twice: one load
        for i in (2, 0, 1):
            got = store.get(f"k{i}")
            assert_contexts_identical(got, ctxs[i])
            _check_mlp_grads(got, params, *batches[i])
        assert store.stats()["device"]["contexts"] == 3
        store.prefetch("k1")  # already on device: nothing to do
        assert_contexts_identical(store.get("k1"), ctxs[1])


def test_write_through_false_writes_only_what_budgets_push_out(tmp_path, mlp_split, rng):
    params, batches, ctxs = _mlp_contexts(mlp_split, rng, 4)
    size = own_bytes(ctxs[0])
    root = tmp_path / "s"
    with rs.Store(root, device_budget=size, host_budget=size, write_through=False) as store:
        for i, c in enumerate(ctxs):
            store.put(c, f"k{i}")
        store.flush()
        assert committed_keys(root) == ["k0", "k1"]  # k2 on host, k3 on device
        assert data_dirs(root, "k2") == data_dirs(root, "k3") == []
        assert store.stats()["disk"]["contexts"] == 2
        got = store.get("k0")  # k3 -> host, k2 pushed out of host -> disk
        assert_contexts_identical(got, ctxs[0])
        store.flush()
        assert committed_keys(root) == ["k0", "k1", "k2"]
        for i in range(4):
            got = store.get(f"k{i}")
            assert_contexts_identical(got, ctxs[i])
            _check_mlp_grads(got, params, *batches[i])
        store.flush()
        assert committed_keys(root) == [
            "k0",
            "k1",
            "k2",
            "k3",
        ]  # each written exactly when pushed out
    with rs.Store(root) as other:
        for i in range(4):
            assert_contexts_identical(other.get(f"k{i}"), ctxs[i])


def test_write_through_false_replacing_a_key_being_written(tmp_path, mlp_split, rng):
    """put(k) while an older k is still being spilled: the newer one must win, in memory and on disk."""
    _, _, ctxs = _mlp_contexts(mlp_split, rng, 3)
    _, _, (newer,) = _mlp_contexts(mlp_split, jax.random.fold_in(rng, 1), 1)
    size = own_bytes(ctxs[0])
    root = tmp_path / "s"
    for attempt in range(3):
        with rs.Store(
            root / str(attempt), device_budget=size, host_budget=0, write_through=False
        ) as store:
            store.put(ctxs[0], "k")
            store.put(ctxs[1], "b")  # pushes the old "k" to disk (background)
            store.put(newer, "k")  # replaces it while that write may be in flight
            store.put(ctxs[2], "c")  # pushes the new "k" out
            assert_contexts_identical(store.get("k"), newer)
            store.flush()
        with rs.Store(root / str(attempt)) as other:
            assert_contexts_identical(other.get("k"), newer)


def test_memory_only_store_over_budget_raises_and_stays_intact(mlp_split, rng):
    params, batches, ctxs = _mlp_contexts(mlp_split, rng, 3)
    size = own_bytes(ctxs[0])
    with rs.Store(None, device_budget=size, host_budget=size) as store:
        store.put(ctxs[0], "a")
        store.put(ctxs[1], "b")
        before = store.stats()
        assert before["device"]["contexts"] == before["host"]["contexts"] == 1
        assert before["disk"] == {
            "bytes": 0, "contexts": 0, "own_bytes": 0, "reads": 0, "bytes_read": 0, "writes": 0, "bytes_written": 0
        }
        before["device"].pop("leaving")  # (the copy of a to host memory may be in flight still)
        with pytest.raises(rs.StoreFullError):
            store.put(ctxs[2], "c")
        after = store.stats()
        assert after["device"].pop("leaving") == 0  # the put waited for the copy to land
        assert after == before
        assert store.keys() == ["a", "b"] and "c" not in store
        with pytest.raises(rs.StoreFullError):  # and again: nothing changed in between
            store.put(ctxs[2], "z")
        after = store.stats()
        after["device"].pop("leaving")
        assert after == before
        for key, i in (("a", 0), ("b", 1), ("a", 0)):
            got = store.get(key)
            assert_contexts_identical(got, ctxs[i])
            _check_mlp_grads(got, params, *batches[i])
        with pytest.raises(rs.ContextNotFoundError):
            store.get("c")
        store.put(ctxs[2], "b")  # replacing fits: the old b makes room
        assert_contexts_identical(store.get("b"), ctxs[2])


def test_memory_only_get_never_drops_a_context(mlp_split, rng):
    """Bringing a big context up from host memory may not push another one out of existence."""
    split = mlp_split
    params = init_params(rng)
    sizes = {}
    ctxs = {}
    for key, batch, salt in (("x", 5, 0), ("a", 5, 1), ("b", 6, 2), ("c", 4, 3)):
        x, y = mlp_batch(jax.random.fold_in(rng, salt), batch)
        ctxs[key] = split(params, x, y)[1]
        sizes[key] = own_bytes(ctxs[key])
    assert sizes["a"] + sizes["b"] > sizes["b"] + sizes["c"]
    budget = sizes["b"] + sizes["c"]
    with rs.Store(None, device_budget=budget, host_budget=sizes["x"] + sizes["a"]) as store:
        for key in ("x", "a", "b", "c"):
            store.put(ctxs[key], key)
        assert store.stats()["host"]["contexts"] == 2  # x and a
        for key in ("a", "x", "b", "c", "a"):
            try:
                got = store.get(key)
            except rs.StoreFullError:
                continue  # refusing is allowed; losing a context is not
            assert_contexts_identical(got, ctxs[key])
        assert store.keys() == ["a", "b", "c", "x"]
        for key in ("x", "a", "b", "c"):
            assert_contexts_identical(store.get(key), ctxs[key])
        stats = store.stats()
        assert (
            stats["device"]["bytes"] <= budget and stats["host"]["bytes"] <= sizes["x"] + sizes["a"]
        )


# ----------------------------------------------------------------------------------------------
# 7. Management


def test_internals_stats_leave_out_contexts_popped_or_deleted_while_their_removal_waits(tmp_path, mlp_split, rng, monkeypatch):
    """``stats()["disk"]`` agrees with ``len(store)`` and ``keys()`` from the moment ``pop`` or
    ``delete`` returns, not only once the writer has removed the files (held here until later)."""
    import threading

    from residual_store._src.store import committer as committer_module

    _, _, ctxs = _mlp_contexts(mlp_split, rng, 3)
    release = threading.Event()
    removals = []
    real_delete = committer_module.SingleProcessCommitter.delete

    def held_delete(self, key):
        removals.append(key)
        assert release.wait(60)
        return real_delete(self, key)

    with rs.Store(tmp_path / "s", device_budget=0, host_budget=0) as store:
        for i, c in enumerate(ctxs):
            store.put(c, f"k{i}")
        store.flush()
        one = store.stats()["disk"]["own_bytes"] // 3
        assert store.stats()["disk"]["contexts"] == 3 and one > 0
        monkeypatch.setattr(committer_module.SingleProcessCommitter, "delete", held_delete)
        store.pop("k0")
        store.delete("k1")
        assert committed_keys(tmp_path / "s") == ["k0", "k1", "k2"]  # nothing removed yet
        disk = store.stats()["disk"]
        assert disk["contexts"] == len(store) == 1 and store.keys() == ["k2"]
        assert disk["own_bytes"] == one
        release.set()
        store.flush()
        assert sorted(removals) == ["k0", "k1"] and committed_keys(tmp_path / "s") == ["k2"]
        assert store.stats()["disk"]["contexts"] == 1


def test_pop_delete_keys_contains_len(tmp_path, mlp_split, rng):
    params, batches, ctxs = _mlp_contexts(mlp_split, rng, 3)
    root = tmp_path / "s"
    with rs.Store(root) as store:
        assert len(store) == 0 and store.keys() == []
        for i, c in enumerate(ctxs):
            store.put(c, f"k{i}")
        assert store.keys() == ["k0", "k1", "k2"] and len(store) == 3
        assert "k1" in store and "k9" not in store and 1 not in store and "../k1" not in store
        got = store.pop("k0")
        assert_contexts_identical(got, ctxs[0])
        _check_mlp_grads(got, params, *batches[0])
        assert "k0" not in store and store.keys() == ["k1", "k2"]
        with pytest.raises(rs.ContextNotFoundError):
            store.get("k0")
        store.delete("k1")
        with pytest.raises(rs.ContextNotFoundError):
            store.delete("k1")
        with pytest.raises(rs.ContextNotFoundError):
            store.pop("k1")
        assert store.keys() == ["k2"] and len(store) == 1
        store.flush()
        assert store.stats()["disk"]["contexts"] == 1
    assert committed_keys(root) == ["k2"]
    assert data_dirs(root, "k0") == data_dirs(root, "k1") == []
    with rs.Store(root) as other:
        assert other.keys() == ["k2"]
        removed = other.gc(
            older_than=0
        )  # at most the deleted contexts' x (if written before the delete)
        assert removed["data"] == 0 and removed["weights"] <= 2, removed
        assert_contexts_identical(other.get("k2"), ctxs[2])
        _check_mlp_grads(other.get("k2"), params, *batches[2])


def test_put_of_an_existing_key_replaces_it(tmp_path, mlp_split, rng):
    params, batches, ctxs = _mlp_contexts(mlp_split, rng, 2)
    root = tmp_path / "s"
    with rs.Store(root) as store:
        store.put(ctxs[0], "k")
        store.put(ctxs[1], "k")
        assert store.keys() == ["k"] and len(store) == 1
        assert_contexts_identical(store.get("k"), ctxs[1])
        store.flush()
        store.put(ctxs[0], "k")  # and again, after the first two are on disk
        store.flush()
        assert store.stats()["disk"]["contexts"] == 1
    assert len(data_dirs(root, "k")) == 1  # the replaced contexts' data is gone
    with rs.Store(root) as other:
        got = other.get("k")
        assert_contexts_identical(got, ctxs[0])
        _check_mlp_grads(got, params, *batches[0])


def test_another_store_sees_a_context_after_flush(tmp_path, mlp_split, rng):
    params, batches, ctxs = _mlp_contexts(mlp_split, rng, 2)
    root = tmp_path / "s"
    writer = rs.Store(root)
    try:
        writer.put(ctxs[0], "a")
        writer.flush()
        reader = rs.Store(root)
        assert reader.keys() == ["a"] and "a" in reader and len(reader) == 1
        assert_contexts_identical(reader.get("a"), ctxs[0])
        writer.put(ctxs[1], "b")
        writer.flush()
        assert reader.keys() == ["a", "b"]
        got = reader.get("b")
        assert_contexts_identical(got, ctxs[1])
        _check_mlp_grads(got, params, *batches[1])
        stats = reader.stats()["disk"]
        shared = sum(
            raw(x).nbytes
            for x, p in zip(ctxs[0].residuals, ctxs[0].spec.input_paths)
            if p and p.startswith("params")
        )
        total = ctxs[0].nbytes + ctxs[1].nbytes - shared
        # the reader read both contexts, the weights only once (still live for the second get)
        own = sum(raw(x).nbytes for c in ctxs[:2] for x, k in zip(c.residuals, c.spec.kinds) if k in ("input", "intermediate"))
        assert stats == {
            "contexts": 2, "bytes": total, "own_bytes": own, "reads": 2, "bytes_read": total, "writes": 0, "bytes_written": 0
        }
        reader.close()
    finally:
        writer.close()
    with pytest.raises(rs.ResidualStoreError):
        writer.put(ctxs[0], "c")  # closed


def test_put_after_another_store_collected_the_weights(tmp_path, mlp_split, rng):
    params, batches, ctxs = _mlp_contexts(mlp_split, rng, 2)
    root = tmp_path / "s"
    with rs.Store(root) as trainer:
        trainer.put(ctxs[0], "a")
        trainer.flush()
        trainer.delete("a")  # nothing references the weights now
        trainer.flush()  # deletes reach the disk in the background, like writes
        with rs.Store(root) as other:
            assert other.gc(older_than=0)["weights"] >= 2
        trainer.put(ctxs[1], "b")  # the same weights again
        trainer.flush()
    with rs.Store(root) as reader:
        got = reader.get("b")
        assert_contexts_identical(got, ctxs[1])
        _check_mlp_grads(got, params, *batches[1])


# ----------------------------------------------------------------------------------------------
# 8. Other processes

READER = """
import json, sys
import numpy as np
import jax
import residual_store as rs

root, out = sys.argv[1], sys.argv[2]
result = {"modules": sorted(m for m in ("models", "store_helpers", "test_store") if m in sys.modules)}
with rs.Store(root) as store:
    result["keys"] = store.keys()
    for key in store.keys():
        ctx = store.get(key)
        result["dtypes:" + key] = [str(r.dtype) for r in ctx.residuals]
        try:
            if key.startswith("vec"):
                cot = jax.numpy.asarray(np.load(f"{out}/{key}.cotangent.npy"))
                grads = rs.backward(ctx, cot)
            else:
                grads = rs.backward(ctx)
        except rs.BackwardUnavailableError as err:
            result[key] = "unavailable: " + str(err)
            continue
        leaves = jax.tree_util.tree_flatten_with_path(grads)[0]
        np.savez(f"{out}/{key}.npz", **{jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves})
        result[key] = "ok"
print(json.dumps(result))
"""


def _vec_loss(params, x):
    return jnp.tanh(x @ params["ws"][0]) @ params["ws"][1]


@jax.custom_vjp
def _host_sin(x):
    return jnp.sin(x)


def _host_sin_fwd(x):
    return jnp.sin(x), jnp.cos(x)


def _host_sin_bwd(c, g):
    grad = jax.pure_callback(
        lambda c, g: np.asarray(c * g), jax.ShapeDtypeStruct(g.shape, g.dtype), c, g
    )
    return (grad,)


_host_sin.defvjp(_host_sin_fwd, _host_sin_bwd)


def _callback_loss(x):
    return jnp.sum(_host_sin(x) ** 2)


@pytest.mark.subprocess
def test_process_without_the_model_computes_the_same_gradients(
    tmp_path, mlp_split, mixed_split, rng
):
    params, batches, ctxs = _mlp_contexts(mlp_split, rng, 2)
    _, mixed_ctx = mixed_split(*mixed_inputs(jax.random.fold_in(rng, 6)))
    vec_split = rs.split(_vec_loss)
    xv = jax.random.normal(jax.random.fold_in(rng, 7), (3, 8))
    out_v, vctx = vec_split(params, xv)
    assert out_v.shape == (3, 16)
    cot = jax.random.normal(jax.random.fold_in(rng, 8), out_v.shape)
    cb_split = rs.split(_callback_loss)
    xs = [jax.random.normal(jax.random.fold_in(rng, 9 + i), (6,)) for i in range(2)]
    cb_ctxs = [cb_split(x)[1] for x in xs]

    root, out = tmp_path / "store", tmp_path / "out"
    out.mkdir()
    np.save(out / "vec0.cotangent.npy", np.asarray(cot))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with rs.Store(root) as store:
            store.put(ctxs[0], "mlp0")
            store.put(ctxs[1], "mlp1")
            store.put(vctx, "vec0")
            store.put(mixed_ctx, "mixed0")
            store.put(cb_ctxs[0], "cb0")
            store.put(cb_ctxs[1], "cb1")
            store.flush()
            assert_contexts_identical(store.get("cb1"), cb_ctxs[1])  # stored all the same
    mine = [w for w in caught if issubclass(w.category, rs.ResidualStoreWarning)]
    assert len(mine) == 1, [str(w.message) for w in mine]  # once per signature
    assert cb_ctxs[0].spec.signature in str(mine[0].message)
    assert mine[0].filename == __file__  # points at the put that triggered it
    assert committed_keys(root) == ["cb0", "cb1", "mixed0", "mlp0", "mlp1", "vec0"]

    script = write_script(tmp_path, "reader.py", READER)
    result = json.loads(run_python(script, str(root), str(out)).stdout.strip().splitlines()[-1])
    assert result["modules"] == []
    assert result["keys"] == ["cb0", "cb1", "mixed0", "mlp0", "mlp1", "vec0"]
    for key in result["keys"]:  # typed keys came back typed in the other process
        want = {"mixed0": mixed_ctx, "vec0": vctx, "mlp0": ctxs[0], "mlp1": ctxs[1]}.get(
            key, cb_ctxs[0]
        )
        assert result["dtypes:" + key] == [str(a.dtype) for a in want.spec.avals]
    for key in ("cb0", "cb1"):
        assert result[key].startswith("unavailable"), result[key]
    for i in range(2):
        assert result[f"mlp{i}"] == "ok"
        got = dict(np.load(out / f"mlp{i}.npz"))
        ref = flat_tree(jax.grad(mlp_loss)(params, *batches[i]))
        assert got.keys() == ref.keys()
        for k in ref:
            np.testing.assert_allclose(got[k], ref[k], **F32_TOL)
    assert result["vec0"] == "ok"
    _, vjp = jax.vjp(lambda p: _vec_loss(p, xv), params)
    ref = flat_tree(vjp(cot)[0])
    got = dict(np.load(out / "vec0.npz"))
    assert got.keys() == ref.keys()
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], **F32_TOL)
        if k in ("['ws'][0]", "['ws'][1]"):  # _vec_loss uses only these
            assert np.abs(ref[k]).max() > 0
    assert result["mixed0"] == "ok"
    got = np.load(out / "mixed0.npz")[""]
    want = np.asarray(mixed_split.backward(mixed_ctx))
    scale = float(np.abs(want).max())
    assert scale > 0
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * scale)  # bf16/f16 paths
    # this process, which has the function, still runs the callback backward from the store
    with rs.Store(root) as store:
        assert_trees_close(
            rs.backward(store.get("cb0")), jax.grad(_callback_loss)(xs[0]), **F32_TOL
        )


# ----------------------------------------------------------------------------------------------
# Recycled data folders


def test_replaced_data_is_recycled_and_rewritten_exactly(tmp_path, mlp_split, rng):
    """A replaced context's folder is reused by the next write of the same layout (renamed, its
    chunks overwritten in place), holds exactly the new context, and gc removes unused ones."""
    params, batches, ctxs = _mlp_contexts(mlp_split, rng, 3)
    root = tmp_path / "s"
    free = root / "data" / ".free"
    with rs.Store(root) as store:
        store.put(ctxs[0], "k")
        store.flush()
        store.put(ctxs[1], "k")  # replaces: ctxs[0]'s folder goes to data/.free
        store.flush()
        store._persistence.janitor.submit(lambda: None).result()  # recycling runs off the write path
        (recycled,) = os.listdir(free)
        recycled_inode = os.stat(free / recycled).st_ino
        store.put(ctxs[2], "other")  # same layout: takes the recycled folder
        store.flush()
        (reused,) = data_dirs(root, "other")
        assert os.stat(root / "data" / reused).st_ino == recycled_inode
        assert os.listdir(free) == []
    with rs.Store(root) as reader:
        for key, i in (("k", 1), ("other", 2)):
            got = reader.get(key)
            assert_contexts_identical(got, ctxs[i])
            _check_mlp_grads(got, params, *batches[i])
        reader.delete("k")
        reader.flush()
        reader._persistence.janitor.submit(lambda: None).result()
        assert len(os.listdir(free)) == 1
        # the recycled data folder of "k" (its batch was stored with it: inputs are its own)
        assert _counts(reader.gc(older_than=0)) == {"weights": 0, "data": 0, "recycled": 1, "backwards": 0, "temporary": 0}
        assert not os.listdir(free)
        assert_contexts_identical(reader.get("other"), ctxs[2])
