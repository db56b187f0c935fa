"""A context's own residuals as one bundle: contexts of 1, 50 and 1000 residuals of every dtype
round trip bit for bit through a folder and an S3 server, and resume in new processes with and
without the model; plain zarr and tensorstore read them by name; damage anywhere in a bundle is
found by ``get`` and ``verify``; a put costs a few files whatever the residual count."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual_store as rs
import s3_server
from store_helpers import (
    assert_contexts_identical,
    mixed_inputs,
    mixed_loss,
    python_env,
    raw,
    read_manifest,
    tree_files,
)

TESTS = Path(__file__).parent


def many_loss(w, x, keys, n, blocks):
    """``mixed_loss``'s residuals (float32, float16, bfloat16, int32, bool, typed PRNG keys), a
    0-d and a zero-size residual, and ``blocks`` smooth blocks of about four small residuals
    each (float32, bfloat16, float16): a context of about ``4 * blocks + 16`` residuals."""
    total = mixed_loss(w, x, keys, n)
    h = jnp.sum(x.astype(jnp.float32) @ w, axis=0)
    for _ in range(blocks):
        a = jnp.sin(h)
        b = jnp.cos(a.astype(jnp.bfloat16) * 2)
        c = jnp.tanh(b.astype(jnp.float16)).astype(jnp.float32)
        h = c * jnp.exp(-(h**2)) + h * 0.5
    s = jnp.sum(h)
    empty = jnp.sin(x[:0].astype(jnp.float32) @ w)
    return total + jnp.sum(h**2) + jnp.sin(s) + jnp.sum(empty)


def wide_loss(w, x, keys, n, xs):
    """``mixed_loss``'s residuals and two more per array of ``xs`` (float32, bfloat16, float16,
    0-d and zero-size): the array itself and the cosine of its product with a weight."""
    total = mixed_loss(w, x, keys, n)
    s = w[0, 0]
    for a in xs:
        total = total + jnp.sum(jnp.sin(a * s.astype(a.dtype)).astype(jnp.float32))
    return total


def _wide_context(rng: jax.Array) -> tuple[rs.Split, tuple, rs.ResidualContext]:
    dtypes = (jnp.float32, jnp.bfloat16, jnp.float16)
    keys = jax.random.split(rng, 500)
    shapes = [(), (0, 3)] + [(3,)] * 498
    xs = tuple(jax.random.normal(k, shape).astype(dtypes[i % 3]) for i, (k, shape) in enumerate(zip(keys, shapes)))
    fwd = rs.split(wide_loss)
    args = (*mixed_inputs(keys[0]), xs)
    return fwd, args, fwd(*args)[1]


def _split(blocks: int) -> rs.Split:
    return rs.split(many_loss, argnums=0, static_argnums=(4,))


def _context(blocks: int, rng: jax.Array) -> tuple[rs.Split, tuple, rs.ResidualContext]:
    fwd = _split(blocks)
    args = (*mixed_inputs(rng), blocks)
    return fwd, args, fwd(*args)[1]


def _check_kinds(ctx: rs.ResidualContext) -> None:
    dtypes = {str(a.dtype) for a in ctx.spec.avals}
    assert {"float32", "float16", "bfloat16", "int32", "bool", "key<fry>"} <= dtypes, dtypes
    assert any(a.shape == () for a in ctx.spec.avals) and any(0 in a.shape for a in ctx.spec.avals)


@pytest.mark.slow
@pytest.mark.parametrize("residuals", [10, 50, pytest.param(1000, marks=pytest.mark.slow)])
def test_contexts_of_many_residuals_round_trip_bitwise_in_one_bundle(tmp_path, residuals, rng):
    if residuals == 1000:
        fwd, args, ctx = _wide_context(rng)
        grad = jax.jit(jax.grad(wide_loss))
    else:
        fwd, args, ctx = _context({10: 0, 50: 9}[residuals], rng)
        grad = jax.jit(jax.grad(many_loss), static_argnums=4)
    own = sum(k != "weight" for k in ctx.spec.kinds)
    _check_kinds(ctx)
    assert own >= residuals, own
    root = tmp_path / "store"
    with rs.Store(root) as store:
        before = set(tree_files(root))
        store.put(ctx, "k")
        store.flush()
        added = set(tree_files(root)) - before
    # the bundle, its folder's zarr.json, the manifest, the weight, the stored backward's two files
    assert sorted(f.rsplit("/", 1)[-1] for f in added if f.startswith("data/")) == ["bundle.zip", "zarr.json"]
    assert len(added) <= 7, sorted(added)
    manifest = read_manifest(root, "k")
    assert sum("offset" in r for r in manifest["arrays"]) == own
    with rs.Store(root, read_only=True, device_budget=0, host_budget=0) as store:
        got = store.get("k")
    assert_contexts_identical(got, ctx)
    want = fwd.backward(ctx)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(rs.backward(got)), jax.tree.leaves(want)))
    # compiled, as the split's backward is (eager jax.grad rounds the float16/bfloat16 chain
    # otherwise, past 2e-2 for a few draws in a hundred); another fusion still rounds otherwise
    ref = np.asarray(grad(*args))
    scale = float(np.abs(ref).max())
    assert scale > 0
    np.testing.assert_allclose(np.asarray(want), ref, rtol=2e-2, atol=2e-2 * scale)


def test_a_one_residual_context_is_one_bundle(tmp_path, rng):
    fwd = rs.split(lambda x: jnp.sum(jnp.sin(x)))
    x = jax.random.normal(rng, (3, 5))
    _, ctx = fwd(x)
    assert len(ctx.residuals) == 1
    with rs.Store(tmp_path / "s") as store:
        store.put(ctx, "one")
    with rs.Store(tmp_path / "s", read_only=True) as store:
        got = store.get("one")
    assert_contexts_identical(got, ctx)
    np.testing.assert_allclose(rs.backward(got), jnp.cos(x), rtol=1e-6)
    assert "bundle" in read_manifest(tmp_path / "s", "one")


_RESUME = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    import residual_store as rs
    spec, out, with_model = json.loads(sys.argv[2]), sys.argv[3], sys.argv[4] == "model"
    with rs.Store(spec, read_only=True) as store:
        ctx = store.get("k")
        if with_model:
            from test_bundles import _split
            fwd = _split(0)
            grads = fwd.backward(ctx)
            assert fwd.cache_info().forward_compiles == 0
        else:
            assert "test_bundles" not in sys.modules and "store_helpers" not in sys.modules
            grads = rs.backward(ctx)
    np.save(out, np.asarray(grads))
    """
)


def _resume(tmp_path: Path, spec, with_model: bool, seed: int) -> np.ndarray:
    script = tmp_path / "resume.py"
    script.write_text(_RESUME)
    out = tmp_path / f"grads-{with_model}-{seed}.npy"
    env = {**python_env(), "PYTHONHASHSEED": str(seed)}
    args = [sys.executable, str(script), str(TESTS), json.dumps(spec), str(out), "model" if with_model else "none"]
    res = subprocess.run(args, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return np.load(out)


def _stores(tmp_path: Path, server_spec):
    yield "folder", str(tmp_path / "folder")
    if server_spec is not None:
        yield "s3", server_spec


@pytest.fixture(scope="module")
def server():
    if not s3_server.available():
        yield None
        return
    with s3_server.serving("bundles") as s:
        yield s


@pytest.mark.subprocess
@pytest.mark.parametrize("where", ["folder", "s3"])
def test_new_processes_resume_a_bundled_context_with_and_without_the_model(tmp_path, where, server, rng):
    if where == "s3" and server is None:
        pytest.skip("moto[s3] and flask are in the test extra")
    spec = str(tmp_path / "folder") if where == "folder" else server.spec("bundles", f"run-{uuid.uuid4().hex[:8]}/")
    fwd, args, ctx = _context(9, rng)
    # compiled, as the split's backward is: eager jax.grad rounds the bfloat16 and float16 chain
    # of nine blocks otherwise, and for about 1 draw in 75 that moves a gradient past 2e-2
    want = np.asarray(jax.jit(jax.grad(many_loss), static_argnums=4)(*args))
    with rs.Store(spec) as store:
        store.put(ctx, "k")
    for with_model, seed in ((False, 3), (True, 11)):
        got = _resume(tmp_path, spec, with_model, seed)
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * float(np.abs(want).max()))
        np.testing.assert_array_equal(got, np.asarray(fwd.backward(ctx)))  # the same program's bits


@pytest.mark.subprocess
def test_plain_zarr_and_tensorstore_read_a_stored_bundle_by_name(tmp_path, rng):
    _, _, ctx = _context(2, rng)
    root = tmp_path / "store"
    with rs.Store(root) as store:
        store.put(ctx, "k")
    manifest = read_manifest(root, "k")
    entries = {r["path"].rsplit("/", 1)[1]: r["dtype"] for r in manifest["arrays"] if "offset" in r}
    code = textwrap.dedent(
        """
        import json, sys, zipfile, numpy as np, tensorstore as ts, zarr
        from zarr.storage import ZipStore
        path, entries = sys.argv[1], json.loads(sys.argv[2])
        assert "residual_store" not in sys.modules and "residual_store_serializers" not in sys.modules
        g = zarr.open_group(ZipStore(path, mode="r"), mode="r")
        out = {}
        for name, dtype in entries.items():
            spec = {"driver": "zarr3", "kvstore": {"driver": "zip", "base": {"driver": "file", "path": path}, "path": name + "/"}}
            a = ts.open(spec, open=True).result().read().result()
            if not dtype.startswith(("bfloat", "float8", "float4")):  # zarr's own dtypes
                z = g[name]
                assert np.array_equal(z[...], a) and z.dtype == a.dtype, name
            meta = json.loads(zipfile.ZipFile(path).read(name + "/zarr.json"))
            out[name] = [meta["attributes"]["residual_store"]["name"], list(a.shape), a.tobytes().hex()]
        print(json.dumps(out))
        """
    )
    res = subprocess.run([sys.executable, "-c", code, str(root / manifest["bundle"]["path"]), json.dumps(entries)],
                         capture_output=True, text=True, env=python_env(), cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout)
    seen = 0
    for i, (x, name, kind) in enumerate(zip(ctx.residuals, ctx.spec.names, ctx.spec.kinds)):
        if kind == "weight":
            continue
        label, shape, data = got[str(i)]
        assert label == name and shape == list(raw(x).shape) and bytes.fromhex(data) == raw(x).tobytes(), name
        seen += 1
    assert seen == len(entries) >= 10  # every own residual, by name


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x04
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_damage_anywhere_in_a_bundle_is_found_by_get_and_verify(tmp_path, rng, capsys):
    """A flipped bit in a residual's bytes names the residual; one in the zip's headers (which
    plain zarr reads) is damage too; a truncated bundle is refused before it is read."""
    from residual_store import cli

    _, _, ctx = _context(2, rng)
    root = tmp_path / "store"
    with rs.Store(root) as store:
        store.put(ctx, "k")
        store.put(ctx, "intact")
    manifest = read_manifest(root, "k")
    bundle = root / manifest["bundle"]["path"]
    good = bundle.read_bytes()
    i, record = next((i, r) for i, r in enumerate(manifest["arrays"]) if "offset" in r and r["nbytes"] > 8)
    headers = 0 if record["offset"] > 40 else len(good) - 10  # the first local header, or the end record
    cases = {
        "residual": (lambda: _flip(bundle, record["offset"] + 3), [f"residual {i}", record["name"], "checksum mismatch"]),
        "headers": (lambda: _flip(bundle, headers), ["zip headers", "checksum mismatch"]),
        "truncated": (lambda: bundle.write_bytes(good[: len(good) // 2]), ["bundle", "truncated"]),
        "longer": (lambda: bundle.write_bytes(good + b"\0"), ["bundle", "too long"]),
    }
    for name, (damage, words) in cases.items():
        bundle.write_bytes(good)
        damage()
        with rs.Store(root, read_only=True, device_budget=0, host_budget=0) as store:
            with pytest.raises(rs.CorruptContextError) as info:
                store.get("k")
            for word in words:
                assert word in str(info.value), (name, word, str(info.value))
            assert_contexts_identical(store.get("intact"), ctx)
        capsys.readouterr()
        assert cli.main(["verify", str(root)]) == 1, name
        out = capsys.readouterr().out
        assert "DAMAGED k:" in out and "DAMAGED intact" not in out, out
    bundle.write_bytes(good)
    assert cli.main(["verify", str(root)]) == 0
    assert zipfile.ZipFile(bundle).testzip() is None
