"""Inspection without running anything: ``Store.verify`` on intact and damaged stores, and the
records ``info``, ``arrays``, ``backward_info`` and ``usage`` give, against the contexts put and
the files on disk."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual_store as rs
from store_helpers import disk_usage, raw, read_manifest


def _model() -> rs.Split:
    """Residuals: a weight (w[1]), an input (x) and intermediates."""
    return rs.split(lambda w, x: jnp.sum(jnp.tanh(x @ w[0]) @ w[1]))


def _weights() -> tuple[jax.Array, jax.Array]:
    return jax.random.normal(jax.random.key(0), (3, 2)), jax.random.normal(jax.random.key(9), (2, 2))


def _fill(path: str, keys=("good", "bad", "other")) -> dict[str, rs.ResidualContext]:
    """A store at ``path`` with one context per key, of one signature, flushed."""
    fwd, w = _model(), _weights()
    contexts = {k: fwd(w, jax.random.normal(jax.random.key(i + 1), (4, 3)))[1] for i, k in enumerate(keys)}
    with rs.Store(path) as store:
        for key, ctx in contexts.items():
            store.put(ctx, key)
    return contexts


def _snapshot(root: str) -> dict[str, bytes]:
    """relative path -> bytes of every file under ``root``."""
    out = {}
    for folder, _, files in os.walk(root):
        for f in files:
            p = os.path.join(folder, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = fh.read()
    return out


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def _own_intermediate(root: str, key: str) -> tuple[str, int, str]:
    """The bundle file of ``key``, and the offset and name of its first intermediate."""
    manifest = read_manifest(root, key)
    record = next(r for r in manifest["arrays"] if "offset" in r and r.get("input_path") is None)
    return os.path.join(root, manifest["bundle"]["path"]), record["offset"], record["name"]


def test_verify_an_intact_store(tmp_path):
    path = str(tmp_path / "store")
    _fill(path)
    with rs.Store(path, read_only=True) as store:
        report = store.verify()
    assert isinstance(report, rs.VerifyReport)
    assert report.ok and report.verified == 3 and report.damaged == {}
    assert report.backwards_verified == 1 and report.damaged_backwards == {}


def _damage_flip(root: str) -> str:
    bundle, offset, name = _own_intermediate(root, "bad")
    _flip(bundle, offset)
    return name  # the reason names the residual


def _damage_truncate(root: str) -> str:
    bundle, _, _ = _own_intermediate(root, "bad")
    with open(bundle, "r+b") as f:
        f.truncate(os.path.getsize(bundle) // 2)
    return "bundle"


def _damage_manifest(root: str) -> str:
    with open(os.path.join(root, "contexts", "bad.manifest"), "r+b") as f:
        f.truncate(20)
    return "manifest"


@pytest.mark.parametrize("damage", [_damage_flip, _damage_truncate, _damage_manifest], ids=lambda f: f.__name__[8:])
def test_verify_reports_damage_and_changes_nothing(tmp_path, damage):
    path = str(tmp_path / "store")
    _fill(path)
    named = damage(path)
    before = _snapshot(path)
    with rs.Store(path, read_only=True) as store:
        report = store.verify()
        assert not report.ok and report.verified == 2  # the others are still checked
        assert list(report.damaged) == ["bad"] and named in report.damaged["bad"], report.damaged
        assert report.damaged_backwards == {}
        with pytest.raises(rs.CorruptContextError):  # get refuses what verify reported
            store.get("bad")
        only_good = store.verify(["good", "other"])
        assert only_good.ok and only_good.verified == 2
    with rs.Store(path) as store:  # a writable store changes nothing either
        assert list(store.verify().damaged) == ["bad"]
    assert _snapshot(path) == before


@pytest.mark.slow  # 0.6 s
def test_a_damaged_shared_weight_is_said_as_one_and_the_next_put_heals_it(tmp_path):
    """Content-addressed, a weight is stored once: one flipped byte damaged every context holding
    it, and a put reused the damaged file, so even a new context was born damaged."""
    path = str(tmp_path / "store")
    contexts = _fill(path)
    weight = next(r["path"] for r in read_manifest(path, "good")["arrays"] if r["shared"])
    chunk = next(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(path, weight)) for f in fs if f != "zarr.json")
    intact = open(chunk, "rb").read()
    _flip(chunk, len(intact) - 1)
    with rs.Store(path) as store:
        report = store.verify()
        assert sorted(report.damaged) == ["bad", "good", "other"]
        for why in report.damaged.values():
            assert f"the damage is one shared weight, {weight}, held by 3 contexts here" in why, why
        fwd, w = _model(), _weights()
        store.put(fwd(w, jnp.ones((4, 3)))[1], "new")  # the same weights: written again
        store.flush()
    assert open(chunk, "rb").read() == intact
    with rs.Store(path, read_only=True) as store:
        assert store.verify().ok and store.verify().verified == 4
        for key, ctx in contexts.items():  # every context holding it whole again
            for got, want in zip(store.get(key).residuals, ctx.residuals):
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_verify_a_damaged_stored_backward(tmp_path):
    path = str(tmp_path / "store")
    contexts = _fill(path, keys=("mb0",))
    folder = os.path.join(path, "backwards")
    (export,) = [
        os.path.join(folder, f) for f in os.listdir(folder)
        if not f.endswith(".manifest") and not f.startswith(".") and f != "zarr.json"
    ]
    _flip(export, os.path.getsize(export) // 2)
    with rs.Store(path, read_only=True) as store:
        report = store.verify()
    signature = contexts["mb0"].spec.signature
    assert not report.ok and report.verified == 1 and report.damaged == {}
    assert list(report.damaged_backwards) == [signature] and "checksum" in report.damaged_backwards[signature]


def test_verify_refuses_unknown_and_invalid_keys(tmp_path):
    path = str(tmp_path / "store")
    _fill(path, keys=("mb0",))
    with rs.Store(path, read_only=True) as store:
        with pytest.raises(rs.ContextNotFoundError, match="'nope'"):
            store.verify(["mb0", "nope"])
        with pytest.raises(rs.InvalidKeyError):
            store.verify(["../escape"])
        with pytest.raises(rs.InvalidArgumentError, match="sequence of keys"):
            store.verify("mb0")
        with pytest.raises(rs.ContextNotFoundError):
            store.info("nope")
        with pytest.raises(rs.ContextNotFoundError):
            store.arrays("nope")
        for bad in ("../../escape", 3, "rs2-xyz"):
            with pytest.raises(rs.InvalidArgumentError, match="expects a context's signature"):
                store.backward_info(bad)
        with pytest.raises(rs.InvalidKeyError):
            store.info(3)


def test_verify_progress_counts_bytes(tmp_path):
    path = str(tmp_path / "store")
    _fill(path)
    calls = []
    with rs.Store(path, read_only=True) as store:
        store.verify(progress=lambda done, total: calls.append((done, total)))
        total = sum(store.info(k).nbytes for k in store.keys())
    assert len(calls) == 3 and calls[-1] == (total, total)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_info_and_arrays_match_the_context_put(tmp_path):
    path = str(tmp_path / "store")
    contexts = _fill(path, keys=("mb0", "mb1"))
    with rs.Store(path, read_only=True) as store:
        info = store.info("mb1")
        arrays = store.arrays("mb1")
    ctx = contexts["mb1"]
    assert isinstance(info, rs.ContextInfo) and info.key == "mb1" and info.signature == ctx.spec.signature
    assert [r.name for r in info.residuals] == list(ctx.spec.names)
    assert [r.kind for r in info.residuals] == list(ctx.spec.kinds)
    assert [(r.shape, r.dtype) for r in info.residuals] == [(a.shape, str(a.dtype)) for a in ctx.spec.avals]
    assert [r.nbytes for r in info.residuals] == [raw(x).nbytes for x in ctx.residuals]
    assert info.created is not None and info.jax_version == jax.__version__
    weight = next(r for r in info.residuals if r.kind == "weight")
    assert weight.shared and weight.path.startswith("weights/") and weight.checksum
    assert info.own_nbytes == info.nbytes - weight.nbytes
    for got, want in zip(arrays, ctx.residuals):
        assert isinstance(got, np.ndarray) and got.tobytes() == raw(want).tobytes()


def test_info_of_a_context_in_memory_only(tmp_path):
    _, ctx = _model()(_weights(), jnp.ones((4, 3)))
    with rs.Store(None) as store:
        store.put(ctx, "mb0")
        info = store.info("mb0")
        arrays = store.arrays("mb0")
        assert store.verify() == rs.VerifyReport(verified=1)
        assert not store.backward_info(ctx.spec.signature).stored
        assert store.usage().total == 0
    assert info.created is None and info.residuals[0].path is None
    assert [r.kind for r in info.residuals] == list(ctx.spec.kinds)
    assert [a.tobytes() for a in arrays] == [raw(x).tobytes() for x in ctx.residuals]


def test_backward_info_and_usage(tmp_path):
    path = str(tmp_path / "store")
    contexts = _fill(path)
    signature = contexts["good"].spec.signature
    with rs.Store(path, read_only=True) as store:
        backward = store.backward_info(signature)
        unknown = store.backward_info("rs2-" + "0" * 32)
        usage = store.usage()
    assert backward.stored and "cpu" in backward.platforms and backward.jax_version == jax.__version__
    assert not unknown.stored and "no backward stored" in unknown.reason
    assert usage.measured and usage.total == disk_usage(path) and usage.unreadable == 0
    assert usage.parts["data"] + usage.parts["weights"] + usage.parts["contexts"] + usage.parts["backwards"] <= usage.total
    (entry,) = usage.signatures.values()
    assert entry.contexts == 3 and entry.inputs == 3 * 4 * 3 * 4  # each context's x, float32[4, 3]
    assert entry.weights == 2 * 2 * 4  # w[1], float32[2, 2], counted once
