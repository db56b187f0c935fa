"""The stored backward of a signature is checked like data: a damaged one never blocks ``get`` or a
live split's backward, ``rs.backward`` without a live split refuses it, ``verify`` reports it
and ``gc`` removes it. Saving it runs on the writer thread, off the caller's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest

import residual_store as rs
from models import init_mlp, mlp_loss
from residual_store._src.store import backwards
from store_helpers import jitted_grad, run_cli_process, unbundled

TESTS = os.path.dirname(os.path.abspath(__file__))

READER = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[3])
    import numpy as np, residual_store as rs
    report = {}
    with rs.Store(sys.argv[1], read_only=True) as store:
        ctx = store.get("mb0")  # never blocked by the stored backward
        report["get"] = "ok"
        if sys.argv[2] == "with_model":
            from models import mlp_loss
            fwd = rs.split(mlp_loss)
            np.savez(sys.argv[4], *[np.asarray(g) for g in __import__("jax").tree.leaves(fwd.backward(ctx))])
            report["backward"] = "ok"
        else:
            try:
                rs.backward(ctx)
                report["backward"] = "ok"
            except rs.ResidualStoreError as err:
                report["backward"] = f"{type(err).__name__}: {err}"
    print(json.dumps(report))
    """
)


def _read(root, mode, out="") -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", READER, str(root), mode, TESTS, str(out)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def stored(tmp_path, rng):
    kp, kx, ky = jax.random.split(rng, 3)
    params = init_mlp(kp)
    x, y = jax.random.normal(kx, (3, 8)), jax.random.normal(ky, (3, 4))
    fwd = rs.split(mlp_loss)
    root = tmp_path / "store"
    with rs.Store(root) as store:
        store.put(fwd(params, x, y)[1], "mb0")
    (export,) = [root / "backwards" / n for n in os.listdir(root / "backwards") if n.endswith(".export")]
    return root, export, fwd, (params, x, y)


def _flip(path, at=None):
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0x20
    path.write_bytes(bytes(data))


@pytest.mark.subprocess
@pytest.mark.parametrize("damage", ["export_byte", "manifest_truncated", "export_missing"])
def test_a_damaged_stored_backward(stored, tmp_path, damage):
    root, export, fwd, (params, x, y) = stored
    manifest = export.with_suffix(".manifest")
    if damage == "export_byte":
        _flip(export)
    elif damage == "manifest_truncated":
        manifest.write_bytes(manifest.read_bytes()[:-7])
    else:
        export.unlink()
    want = jax.tree.leaves(jitted_grad(mlp_loss)(params, x, y))

    verify = run_cli_process("verify", root)
    assert verify.returncode == 1, verify.stdout
    assert "DAMAGED backward rs2-" in verify.stdout and "1 of 1 context verified" in verify.stdout

    # this process has a live split of the signature: get and its backward work
    with rs.Store(root, read_only=True) as store:
        ctx = store.get("mb0")
        for g, w in zip(jax.tree.leaves(fwd.backward(ctx)), want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        for g, w in zip(jax.tree.leaves(rs.backward(ctx)), want):  # the live split's, not the stored one
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)

    # a process without the model: get works, its backward is refused as corrupt
    report = _read(root, "without_model")
    assert report["get"] == "ok"
    assert report["backward"].startswith("CorruptContextError: stored backward of signature rs2-"), report
    # a new process with the model: a fresh split rebuilds the backward itself
    out = tmp_path / "grads.npz"
    assert _read(root, "with_model", out) == {"get": "ok", "backward": "ok"}
    got = np.load(out)
    for i, w in enumerate(want):
        np.testing.assert_allclose(got[f"arr_{i}"], w, rtol=1e-5, atol=1e-6)

    # gc removes the damaged backward; the next put of that signature saves it again
    with rs.Store(root) as store:
        assert store.gc(older_than=0)["backwards"] == 1
        store.put(fwd(params, x + 1, y)[1], "mb1")
    assert run_cli_process("verify", root).returncode == 0
    assert _read(root, "without_model")["backward"] == "ok"


@pytest.mark.subprocess
def test_contexts_from_residual_store_0_1_are_read_and_their_backward_never_run(stored, tmp_path):
    """An ``rs1-`` context (its signatures could name two functions) loads; no stored backward is
    run for it, and a split refuses it with the reason."""
    root, export, fwd, (params, x, y) = stored
    path = root / "contexts" / "mb0.manifest"
    m = unbundled(root, msgpack.unpackb(path.read_bytes()))  # 0.1 had no bundles
    old_sig = "rs1-" + m["signature"][4:]
    m.update(version=1, signature=old_sig)
    del m["manifest_checksum"]  # 0.1 manifests had no self checksum
    m["spec"].pop("call")
    # 0.1 called every primal input "input" and stored them all once
    for record, kind in zip(m["arrays"], m["spec"]["kinds"]):
        record["shared"] = kind != "intermediate"
    m["spec"]["kinds"] = ["intermediate" if k == "intermediate" else "input" for k in m["spec"]["kinds"]]
    path.write_bytes(msgpack.packb(m, use_bin_type=True))
    for suffix in (".export", ".manifest"):  # its stored backward, even intact, is not trusted
        (root / "backwards" / f"{old_sig}{suffix}").write_bytes(export.with_suffix(suffix).read_bytes())
    with rs.Store(root, read_only=True) as store:
        ctx = store.get("mb0")
        assert ctx.spec.signature == old_sig and ctx.spec.call is None
        assert set(ctx.spec.kinds) == {"weight", "intermediate"}  # 0.1's inputs, all held once
        with pytest.raises(rs.SignatureMismatchError, match="residual-store 0.1"):
            fwd.backward(ctx)
    assert _read(root, "without_model")["backward"].startswith("BackwardUnavailableError: context signature rs1-")


def test_internals_the_backward_is_exported_on_the_writer_thread(stored, monkeypatch, rng):
    """``put`` of a new signature returns before its backward is exported: the export waits for
    the test to release it, which a ``put`` that exported on the caller's thread would never see."""
    root, _, _, _ = stored
    started, release, where = threading.Event(), threading.Event(), []
    real = backwards.serialize

    def gated(*args, **kwargs):
        where.append(threading.current_thread().name)
        started.set()
        assert release.wait(30), "released only after put returned"
        return real(*args, **kwargs)

    monkeypatch.setattr(backwards, "serialize", gated)
    fwd = rs.split(lambda w: jnp.sum(jnp.cos(w) ** 3))  # a new signature
    _, ctx = fwd(jax.random.normal(rng, (6,)))
    with rs.Store(root) as store:
        t0 = time.perf_counter()
        store.put(ctx, "new")
        returned_after = time.perf_counter() - t0
        assert started.wait(30)
        assert where == ["residual-store-writer"]
        release.set()
        store.flush()
        assert backwards.is_stored(store._persistence.disk, ctx.spec.signature)
    print(f"put of a new signature returned after {returned_after * 1e3:.1f} ms")


def test_gc_removes_unneeded_backwards_and_old_temporary_files(stored):
    root, export, fwd, (params, x, y) = stored
    sig = export.stem
    old = time.time() - 7200
    torn = [root / "contexts" / ".mb9.manifest.0123.tmp", root / "backwards" / f".{sig}.export.4567.tmp",
            root / ".residual-store.json.89ab.tmp", root / "backwards" / "rs2-0000torn.export"]
    for path in torn:
        path.write_bytes(b"partial")
        os.utime(path, (old, old))
    fresh = root / "contexts" / ".mb8.manifest.cdef.tmp"  # a write in flight: too young to remove
    fresh.write_bytes(b"partial")
    with rs.Store(root) as store:
        removed = store.gc()  # the default age rule: an hour
        assert removed["temporary"] == 3 and removed["backwards"] == 1, removed
        assert not any(p.exists() for p in torn) and fresh.exists()
        assert export.exists()  # mb0 needs it
        store.delete("mb0")
        store.flush()
        assert store.gc(older_than=0)["backwards"] == 1  # no context of its signature is left
        assert not export.exists() and not export.with_suffix(".manifest").exists()


@pytest.mark.subprocess
def test_a_float64_context_in_a_process_without_x64_is_refused_by_name(tmp_path):
    script = textwrap.dedent(
        """
        import sys, jax
        jax.config.update("jax_enable_x64", True)
        import jax.numpy as jnp, residual_store as rs
        fwd = rs.split(lambda w, x: jnp.sum(jnp.tanh(x @ w)))
        w, x = jnp.ones((3, 2), jnp.float64), jnp.ones((4, 3), jnp.float64)
        with rs.Store(sys.argv[1]) as store:
            store.put(fwd(w, x)[1], "f64")
        """
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "s")], check=True, timeout=120)
    assert not jax.config.jax_enable_x64
    with rs.Store(tmp_path / "s", read_only=True) as store:
        with pytest.raises(rs.SignatureMismatchError, match=r"residual \d+ \(.*\) is float64.*jax_enable_x64"):
            store.get("f64")
