"""Hostile and damaged manifests: a flipped bit anywhere, fields pointing at other contexts' data,
path-like signatures, huge shapes and chunk lists, PRNG key impls on float residuals.

Every one is ``rs.CorruptContextError``, quickly and in bounded memory; none makes ``delete`` or
``gc`` remove data of another context (or, for a damaged manifest, of its own). Manifests of the
earlier versions 1 and 2 (no self checksum) still read, and get the same cross-checks.
"""

from __future__ import annotations

import os
import random
import resource
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest

import residual_store as rs
from residual_store._src.store import backwards
from residual_store._src.store.disk.tier import DiskTier
from residual_store_serializers.manifest import SELF_CHECKSUM_FIELD, seal_manifest
from store_helpers import assert_contexts_identical, raw, read_manifest, tree_files


def _dropout_sin(g: jax.Array, key: jax.Array) -> jax.Array:
    return jnp.where(jax.random.bernoulli(key, 0.5, g.shape), jnp.sin(g), 0.0)


def _loss(w: jax.Array, x: jax.Array, key: jax.Array) -> jax.Array:
    """Residuals: a weight (shared), float and bool intermediates, the PRNG key (an input)."""
    h = jnp.tanh(x @ w)
    drop = jax.checkpoint(_dropout_sin, policy=jax.checkpoint_policies.nothing_saveable)
    return jnp.sum(drop(h, key) ** 2)


def _inputs(seed: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    kw, kx = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kw, (4, 3)), jax.random.normal(kx, (5, 4)), jax.random.key(seed)


@pytest.fixture(scope="module")
def split():
    return rs.split(_loss, argnums=(0, 1), weight_argnums=0)


def _stored(tmp_path: Path, split) -> tuple[Path, dict[str, Any]]:
    """A store holding contexts ``a`` and ``b`` (and a stored backward of their signature)."""
    root = tmp_path / "store"
    ctxs = {k: split(*_inputs(seed))[1] for k, seed in (("a", 1), ("b", 2))}
    with rs.Store(root) as store:
        for k, ctx in ctxs.items():
            store.put(ctx, k)
    return root, ctxs


@pytest.fixture
def stored(tmp_path: Path, split) -> tuple[Path, dict[str, Any]]:
    return _stored(tmp_path, split)


@pytest.fixture
def stored_in_folders(tmp_path: Path, split, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, dict[str, Any]]:
    """``stored``, each own residual in a folder of its own (no bundle: what the manifests of
    versions 1 to 3 describe), so that a manifest relabelled as an older version is one."""
    from residual_store._src.store.disk import forms as residual_forms

    monkeypatch.setattr(residual_forms, "BUNDLE_CAP", -1)  # no residual fits a bundle
    root, ctxs = _stored(tmp_path, split)
    assert "bundle" not in read_manifest(root, "a")
    return root, ctxs


def _path(root: Path, key: str) -> Path:
    return root / "contexts" / f"{key}.manifest"


def _replace(path: Path, data: bytes) -> None:
    """Writes ``data`` under a new inode, so no cached parse of the old file can stand in."""
    tmp = path.with_name(f".{path.name}.test")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _write(root: Path, key: str, m: dict[str, Any]) -> None:
    """Writes ``m`` as ``key``'s manifest with a valid self checksum: an attacker who can
    compute checksums, so only the cross-checks stand in the way."""
    _replace(_path(root, key), seal_manifest(m))


def _own(m: dict[str, Any]) -> int:
    """The index of the first float intermediate of a manifest."""
    return next(
        i
        for i, r in enumerate(m["arrays"])
        if not r["shared"] and r["dtype"] == "float32" and m["spec"]["kinds"][i] == "intermediate"
    )


def _data_files(root: Path, key: str) -> dict[str, int]:
    """Files (and sizes) of ``key``'s data folder."""
    m = read_manifest(root, key)
    return {p: n for p, n in tree_files(root).items() if p.startswith(m["data_dir"] + os.sep)}


def _get_refused(root: Path, key: str, match: str | None = None, *, within: float = 1.0) -> str:
    t0 = time.perf_counter()
    with rs.Store(root, read_only=True) as store, pytest.raises(rs.CorruptContextError, match=match) as info:
        store.get(key)
    assert time.perf_counter() - t0 < within, "refused, but slowly"
    return str(info.value)


# ----------------------------------------------------------------------------------------------
# The manifest protects itself


@pytest.mark.slow
def test_a_flipped_bit_anywhere_in_a_context_manifest_is_corruption_and_gc_keeps_its_data(stored):
    root, _ = stored
    path = _path(root, "a")
    good = path.read_bytes()
    m = read_manifest(root, "a")
    assert m["version"] == 4 and list(m)[-1] == SELF_CHECKSUM_FIELD
    before = tree_files(root)
    # 200 random offsets, and every byte of the fields whose damage used to be trusted
    rnd = random.Random(11)
    offsets = set(rnd.sample(range(len(good)), min(200, len(good))))
    for field in (m["data_dir"], m["signature"]):
        start = good.index(field.encode())
        offsets.update(range(start, start + len(field)))
    offsets.update({0, len(good) - 1, good.index(b"\xa7version") + 8})  # the version value
    with rs.Store(root) as store:
        for offset in sorted(offsets):
            bad = bytearray(good)
            bad[offset] ^= 1 << rnd.randrange(8)
            _replace(path, bytes(bad))
            with pytest.raises(rs.CorruptContextError):
                store.get("a")
            store.gc(older_than=0)
            assert tree_files(root).keys() >= {p for p in before if not p.startswith("contexts")}, offset
        _replace(path, good)
        store.get("a")  # intact again: nothing of it was removed


def test_a_flipped_signature_character_is_corruption_not_a_missing_backward(stored):
    root, _ = stored
    m = read_manifest(root, "a")
    data = _path(root, "a").read_bytes()
    sig = m["signature"]
    flipped = sig[:-1] + ("0" if sig[-1] != "0" else "1")
    _replace(_path(root, "a"), data.replace(sig.encode(), flipped.encode()))
    assert "checksum mismatch" in _get_refused(root, "a")


def test_internals_a_flipped_bit_in_a_stored_backward_manifest_is_corruption(stored):
    root, _ = stored
    sig = read_manifest(root, "a")["signature"]
    path = root / "backwards" / f"{sig}.manifest"
    good = path.read_bytes()
    disk = DiskTier(root, read_only=True)
    assert backwards.read_manifest(disk, sig)["signature"] == sig
    rnd = random.Random(12)
    start = good.index(sig.encode())
    for offset in sorted(set(rnd.sample(range(len(good)), min(100, len(good)))) | set(range(start, start + len(sig)))):
        bad = bytearray(good)
        bad[offset] ^= 1 << rnd.randrange(8)
        _replace(path, bytes(bad))
        with pytest.raises(rs.CorruptContextError):
            backwards.read_manifest(disk, sig)


# ----------------------------------------------------------------------------------------------
# Every field cross-checked (manifests with a valid self checksum)


def test_a_data_dir_naming_another_context_is_refused_and_deleting_it_keeps_the_other(stored):
    root, ctxs = stored
    a, b = read_manifest(root, "a"), read_manifest(root, "b")
    b_files = _data_files(root, "b")
    assert b_files
    own_a = a["data_dir"]
    # a's data_dir (and, as a careful attacker would, its own arrays' paths) at b's folder
    for move_paths in (False, True):
        m = {**a, "data_dir": b["data_dir"]}
        if move_paths:
            m["arrays"] = [
                {**r, "path": r["path"].replace(own_a, b["data_dir"])} for r in a["arrays"]
            ]
        _write(root, "a", m)
        assert "invalid data_dir" in _get_refused(root, "a")
    # an array path into b's folder under a's own data_dir
    i = _own(a)
    arrays = [dict(r) for r in a["arrays"]]
    arrays[i]["path"] = f"{b['data_dir']}/{i}"
    _write(root, "a", {**a, "arrays": arrays})
    assert f"array {i}" in _get_refused(root, "a")
    # deleting a (manifest still naming b's folder) and gc leave b whole and readable
    _write(root, "a", {**a, "data_dir": b["data_dir"]})
    with rs.Store(root) as store:
        store.delete("a")
        store.flush()
        store.gc(older_than=0)
        assert "a" not in store
    assert _data_files(root, "b") == b_files
    assert not os.path.exists(root / own_a)  # a's own data, unreferenced now, is gone
    with rs.Store(root, read_only=True) as store:
        assert_contexts_identical(store.get("b"), ctxs["b"])


@pytest.mark.parametrize(
    "data_dir",
    ["data/b.0123456789ab", "data/a", "data/a.0123456789abc", "data/a.0123456789AB", "weights/a.0123456789ab",
     "data/a.0123456789ab/..", "data/.free/a.0123456789ab", None, 7],
)
def test_a_data_dir_not_of_this_key_is_refused(stored, data_dir):
    root, _ = stored
    _write(root, "a", {**read_manifest(root, "a"), "data_dir": data_dir})
    _get_refused(root, "a")


def test_a_shared_array_outside_weights_is_refused(stored):
    root, _ = stored
    m = read_manifest(root, "a")
    i = next(i for i, r in enumerate(m["arrays"]) if r["shared"])
    arrays = [dict(r) for r in m["arrays"]]
    arrays[i]["path"] = read_manifest(root, "b")["data_dir"] + "/0"
    _write(root, "a", {**m, "arrays": arrays})
    assert "shared array" in _get_refused(root, "a")


def test_a_spec_parsed_before_never_stands_in_for_a_changed_one(stored):
    """Specs are parsed once per signature in a process: a manifest of that signature whose
    spec differs (here its weights' names, then an aval that disagrees with its array) is parsed
    as it is. (The bundle's headers hold its own residuals' names: renaming those makes the spec
    disagree with the bundle, refused, see test_resealed_manifests.py.)"""
    root, ctxs = stored
    with rs.Store(root, read_only=True) as store:
        assert store.get("a").spec == ctxs["a"].spec
    m = read_manifest(root, "b")
    names = [f"renamed {i}" if r["shared"] else n for i, (n, r) in enumerate(zip(m["spec"]["names"], m["arrays"]))]
    assert names != m["spec"]["names"]
    _write(root, "b", {**m, "spec": {**m["spec"], "names": names}})
    with rs.Store(root, read_only=True) as store:
        assert list(store.get("b").spec.names) == names
        assert store.get("a").spec == ctxs["a"].spec
    i = _own(m)
    avals = list(m["spec"]["avals"])
    avals[i] = [[*avals[i][0][:-1], avals[i][0][-1] + 1], avals[i][1]]
    _write(root, "b", {**m, "spec": {**m["spec"], "avals": avals}})
    assert "disagrees with its array record" in _get_refused(root, "b")


@pytest.mark.parametrize(
    "signature",
    ["../../x", "rs2-" + "0" * 31 + "\x00", "rs2-\x00" + "0" * 31, "rs3-" + "0" * 32, "rs2-" + "A" * 32,
     "rs2-" + "0" * 33, "", "rs2-" + "0" * 32 + "/../../x"],
)
def test_a_path_like_or_malformed_signature_is_refused(stored, signature):
    root, _ = stored
    _write(root, "a", {**read_manifest(root, "a"), "signature": signature})
    assert "invalid signature" in _get_refused(root, "a")


def test_a_key_impl_on_a_float_residual_is_refused(stored):
    root, _ = stored
    m = read_manifest(root, "a")
    i = _own(m)
    for dtype in ("float32", "key<fry>"):  # the aval left as it was, or made a key to match
        spec = {**m["spec"], "key_impls": list(m["spec"]["key_impls"]), "avals": list(m["spec"]["avals"])}
        spec["key_impls"][i] = "threefry2x32"
        spec["avals"][i] = [spec["avals"][i][0], dtype]
        _write(root, "a", {**m, "spec": spec})
        assert "key" in _get_refused(root, "a")
    # an unknown impl, and a key whose key data has the wrong trailing shape
    k = next(j for j, impl in enumerate(m["spec"]["key_impls"]) if impl is not None)
    spec = {**m["spec"], "key_impls": list(m["spec"]["key_impls"])}
    spec["key_impls"][k] = "no-such-prng"
    _write(root, "a", {**m, "spec": spec})
    _get_refused(root, "a")
    spec["key_impls"][k] = "rbg"  # 4 words of key data, not threefry's 2
    spec["avals"] = list(m["spec"]["avals"])
    spec["avals"][k] = [spec["avals"][k][0], "key<rbg>"]
    _write(root, "a", {**m, "spec": spec})
    _get_refused(root, "a")


def _resize(m: dict[str, Any], i: int, shape: list[int], nbytes: int) -> dict[str, Any]:
    arrays = [dict(r) for r in m["arrays"]]
    arrays[i].update(shape=shape, nbytes=nbytes)
    avals = list(m["spec"]["avals"])
    avals[i] = [shape, avals[i][1]]
    return {**m, "arrays": arrays, "spec": {**m["spec"], "avals": avals}}


def test_a_huge_declared_shape_is_refused_quickly_without_allocating(stored):
    root, _ = stored
    m = read_manifest(root, "a")
    i = _own(m)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    for shape, nbytes in (
        ([1 << 40], 4 << 40),  # 4 TiB, declared consistently
        ([1 << 40], 16),  # size disagreeing with the shape
        ([1 << 20, 1 << 20, 1 << 20], 4 << 60),
        ([1 << 62], (1 << 64) - 1),
        ([5, 3], 16),  # a plausible shape, the wrong size
    ):
        _write(root, "a", _resize(m, i, shape, nbytes))
        _get_refused(root, "a")
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak
    assert grown < 256 << 10, f"peak memory grew by {grown} KiB"


@pytest.mark.slow
def test_a_huge_chunk_list_is_refused_quickly(stored):
    root, _ = stored
    m = read_manifest(root, "a")
    i = _own(m)
    n = 1 << 20
    record = dict(m["arrays"][i])
    pairs = [[[j], "xxh3_64:0000000000000000"] for j in range(n)]
    record.update(shape=[n], nbytes=4 * n, chunk_shape=[1], chunk_checksums=pairs)
    hostile = _resize(m, i, [n], 4 * n)
    hostile["arrays"][i] = record
    _write(root, "a", hostile)
    del pairs, record, hostile
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _get_refused(root, "a", within=2.0)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak
    assert grown < 512 << 10, f"peak memory grew by {grown} KiB"
    # a short list that does not cover its grid is refused too
    record = dict(m["arrays"][i])
    shape = record["shape"]
    record.update(chunk_shape=[1] * len(shape), chunk_checksums=[[[0] * len(shape), record["checksum"]]])
    arrays = [dict(r) for r in m["arrays"]]
    arrays[i] = record
    _write(root, "a", {**m, "arrays": arrays})
    assert "chunk" in _get_refused(root, "a")


def test_a_manifest_naming_another_key_or_under_an_invalid_key_is_refused(stored):
    root, _ = stored
    _write(root, "a", {**read_manifest(root, "a"), "key": "b"})
    assert "names key 'b'" in _get_refused(root, "a")
    shutil.copy(_path(root, "b"), root / "contexts" / "bad key!.manifest")
    with rs.Store(root) as store:
        with pytest.raises(rs.InvalidKeyError):
            store.get("bad key!")
        assert store.gc(older_than=0).get("skipped_corrupt") == 1  # listed, unreadable: nothing removed
    assert (root / read_manifest(root, "b")["data_dir"]).is_dir()


# ----------------------------------------------------------------------------------------------
# Versions 1 and 2: no self checksum, the same cross-checks


def _unsealed(m: dict[str, Any], version: int) -> bytes:
    """``m`` as the previous code paths wrote it: plain msgpack, no self checksum."""
    m = {k: v for k, v in m.items() if k != SELF_CHECKSUM_FIELD}
    m["version"] = version
    return msgpack.packb(m, use_bin_type=True)


def test_internals_version_2_manifests_still_read_and_are_cross_checked(stored_in_folders):
    root, ctxs = stored_in_folders
    a, b = read_manifest(root, "a"), read_manifest(root, "b")
    _replace(_path(root, "a"), _unsealed(a, 2))
    with rs.Store(root, read_only=True) as store:
        assert_contexts_identical(store.get("a"), ctxs["a"])
    # a version 2 manifest whose data_dir names b's folder: refused, and deleting it keeps b
    b_files = _data_files(root, "b")
    _replace(_path(root, "a"), _unsealed({**a, "data_dir": b["data_dir"]}, 2))
    _get_refused(root, "a", "invalid data_dir")
    _replace(_path(root, "a"), _unsealed({**a, "signature": "../../x"}, 2))
    _get_refused(root, "a", "invalid signature")
    # one flipped character of data_dir alone no longer agrees with the arrays' paths
    d = a["data_dir"]
    _replace(_path(root, "a"), _unsealed({**a, "data_dir": d[:-1] + ("0" if d[-1] != "0" else "1")}, 2))
    _get_refused(root, "a")
    # a stale self checksum on an older version is checked, not ignored (a flipped version bit)
    _replace(_path(root, "a"), _path(root, "a").read_bytes())
    sealed = bytearray(seal_manifest(a))
    sealed[sealed.index(b"\xa7version") + 8] = 2
    _replace(_path(root, "a"), bytes(sealed))
    _get_refused(root, "a", "checksum mismatch")
    _replace(_path(root, "a"), _unsealed({**a, "data_dir": b["data_dir"]}, 2))
    with rs.Store(root) as store:
        store.delete("a")
        store.flush()
        store.gc(older_than=0)
    assert _data_files(root, "b") == b_files
    with rs.Store(root, read_only=True) as store:
        assert_contexts_identical(store.get("b"), ctxs["b"])


def test_internals_version_1_manifests_still_read(stored_in_folders):
    """A residual-store 0.1 manifest: rs1- signature, no call record, every primal input stored
    once and called "input"."""
    root, ctxs = stored_in_folders
    m = read_manifest(root, "a")
    m["signature"] = "rs1-" + m["signature"][4:]
    m["spec"].pop("call")
    for record, kind in zip(m["arrays"], m["spec"]["kinds"]):
        record["shared"] = kind != "intermediate"
    m["spec"]["kinds"] = ["intermediate" if k == "intermediate" else "input" for k in m["spec"]["kinds"]]
    _replace(_path(root, "a"), _unsealed(m, 1))
    with rs.Store(root, read_only=True) as store:
        got = store.get("a")
    assert got.spec.signature == m["signature"] and got.spec.call is None
    assert [raw(x).tobytes() for x in got.residuals] == [raw(x).tobytes() for x in ctxs["a"].residuals]
    assert set(got.spec.kinds) <= {"weight", "intermediate"}
    # the cross-checks hold for version 1 too
    _replace(_path(root, "a"), _unsealed({**m, "data_dir": read_manifest(root, "b")["data_dir"]}, 1))
    _get_refused(root, "a", "invalid data_dir")
    np.testing.assert_equal(len(got.residuals), len(ctxs["a"].residuals))


# ----------------------------------------------------------------------------------------------
# The seal itself (serializers)


def test_the_seal_is_the_last_25_bytes_and_is_checked_before_the_fields():
    import xxhash

    from residual_store_serializers import (
        BACKWARD_SCHEMA,
        CorruptDataError,
        decode_manifest,
        encode_manifest,
    )

    data = encode_manifest({"signature": "rs2-" + "0" * 32, "jax_version": "xx"}, schema=BACKWARD_SCHEMA)
    m = msgpack.unpackb(data)
    assert list(m)[-1] == SELF_CHECKSUM_FIELD and data[-25] == 0xB8
    assert m[SELF_CHECKSUM_FIELD] == "xxh3_64:" + xxhash.xxh3_64_hexdigest(data[:-25])
    assert SELF_CHECKSUM_FIELD not in decode_manifest(data, what="b", schema=BACKWARD_SCHEMA)
    unsealed = {k: v for k, v in m.items() if k != SELF_CHECKSUM_FIELD}
    with pytest.raises(CorruptDataError, match="missing required field 'manifest_checksum'"):
        decode_manifest(msgpack.packb(unsealed), what="b", schema=BACKWARD_SCHEMA)
    decode_manifest(msgpack.packb({**unsealed, "version": 2}), what="b", schema=BACKWARD_SCHEMA)  # older: none
    # not the last field, or not a str: refused, whatever its value
    moved = {SELF_CHECKSUM_FIELD: m[SELF_CHECKSUM_FIELD], **unsealed}
    for bad in (moved, {**unsealed, SELF_CHECKSUM_FIELD: 7}, {**unsealed, SELF_CHECKSUM_FIELD: None}):
        with pytest.raises(CorruptDataError, match="manifest_checksum"):
            decode_manifest(msgpack.packb(bad), what="b", schema=BACKWARD_SCHEMA)
    # a damaged field is reported as a checksum mismatch, before its own (wrong) type is seen
    bad = data.replace(b"\xa2xx", b"\xcd\x00\x07")  # jax_version: the int 7, same length
    assert len(bad) == len(data) and msgpack.unpackb(bad)["jax_version"] == 7
    with pytest.raises(CorruptDataError, match="checksum mismatch"):
        decode_manifest(bad, what="b", schema=BACKWARD_SCHEMA)
