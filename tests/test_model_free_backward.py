"""A backward without the model: the stored artifact is flat (arrays in, arrays out), the gradient
structure travels in the store's own encoding, every platform JAX can lower it for is in it, and
a process that never imported the model's code gets its gradients (original structure where the
types allow, ``like=``, or a key-path dict), or a clear error saying why not."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest

import residual_store as rs
from platforms import backend, lowered_for
from residual_store._src.backward import Backward
from residual_store._src.export import export_backward, load_backward
from residual_store._src.keypaths import PathStructure
from residual_store_serializers.manifest import seal_manifest
from store_helpers import run_cli_lines, run_cli_process

TESTS = os.path.dirname(os.path.abspath(__file__))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    """A custom pytree node: a subprocess that does not import this file lacks its type."""

    w: jax.Array
    b: jax.Array


def _loss(layers, x):
    for layer in layers:
        x = jnp.tanh(x @ layer.w + layer.b)
    return jnp.mean(x**2)


def _params(key):
    k1, k2 = jax.random.split(key)
    return [Layer(jax.random.normal(k1, (4, 5)), jnp.full((5,), 0.1)), Layer(jax.random.normal(k2, (5, 3)), jnp.zeros(3))]


FWD = rs.split(_loss)

READER = textwrap.dedent(
    """
    import json, sys
    import numpy as np, jax, residual_store as rs
    root, key, out = sys.argv[1:4]
    report = {"test_file_imported": "test_model_free_backward" in sys.modules}
    with rs.Store(root, read_only=True) as store:
        ctx = store.get(key)
        try:
            grads = rs.backward(ctx)
        except rs.ResidualStoreError as err:
            report["error"] = f"{type(err).__name__}: {err}"
        else:
            report["type"] = type(grads).__name__
            flat = {jax.tree_util.keystr(p): np.asarray(g) for p, g in jax.tree_util.tree_flatten_with_path(grads)[0]}
            if isinstance(grads, dict):
                report["keys"] = list(grads)
                flat = {k: np.asarray(v) for k, v in grads.items()}
            np.savez(out, **{str(i): v for i, v in enumerate(flat.values())})
            report["paths"] = list(flat)
    report["modules"] = sorted(m for m in ("evil_module_xyz", "flax", "equinox") if m in sys.modules)
    print(json.dumps(report))
    """
)


def _read(root, key, tmp_path, seed="0") -> tuple[dict, dict]:
    out = tmp_path / f"{key}.npz"
    env = dict(os.environ, PYTHONHASHSEED=seed)
    proc = subprocess.run(
        [sys.executable, "-c", READER, str(root), key, str(out)], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    arrays = dict(np.load(out)) if out.exists() else {}
    return report, {p: arrays[str(i)] for i, p in enumerate(report.get("paths", []))}


@pytest.fixture
def stored(tmp_path, rng):
    kp, kx = jax.random.split(rng)
    params, x = _params(kp), jax.random.normal(kx, (3, 4))
    root = tmp_path / "store"
    with rs.Store(root) as store:
        store.put(FWD(params, x)[1], "mb0")
    want = {jax.tree_util.keystr(p): g for p, g in jax.tree_util.tree_flatten_with_path(jax.grad(_loss)(params, x))[0]}
    (manifest,) = [root / "backwards" / n for n in os.listdir(root / "backwards") if n.endswith(".manifest")]
    return root, manifest, params, want


def _rewrite(manifest_path, change) -> None:
    m = msgpack.unpackb(manifest_path.read_bytes(), raw=False)
    change(m)
    manifest_path.write_bytes(seal_manifest(m))  # re-sealed: the checks behind the seal


@pytest.mark.subprocess
def test_a_custom_pytree_backward_runs_without_its_type_as_a_key_path_mapping(stored, tmp_path):
    root, _, params, want = stored
    report, got = _read(root, "mb0", tmp_path, seed="11")
    assert not report["test_file_imported"]
    assert report["type"] == "OrderedDict" and report["keys"] == list(want), report
    for path, g in want.items():
        np.testing.assert_allclose(got[path], g, rtol=1e-5, atol=1e-6)
    # here the type is registered: the original structure, and like= rebuilds it too
    with rs.Store(root, read_only=True) as store:
        ctx = store.get("mb0")
    gc.collect()  # nothing left of an earlier load: a fresh one
    grads = rs.backward(ctx)
    assert isinstance(grads[0], Layer)
    rebuilt = rs.backward(ctx, like=params)
    assert jax.tree.structure(rebuilt) == jax.tree.structure(params)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Mixer:
    """Fields declared out of alphabetical order, two of one shape: a ``dict`` keyed by key path
    flattens as ``alpha, zeta`` (sorted) where the model flattens as ``zeta, alpha``, so
    unflattening such gradients on the parameters swaps the two without a shape error."""

    zeta: jax.Array
    alpha: jax.Array


def _mixer_loss(params, x):
    h = jnp.tanh(x @ params["mixer"].zeta) @ params["mixer"].alpha
    return jnp.mean((h @ params["head"]) ** 2)


MIXER_FWD = rs.split(_mixer_loss)

LEAVES_READER = textwrap.dedent(
    """
    import collections.abc, json, sys
    import numpy as np, jax, residual_store as rs
    root, key, out = sys.argv[1:4]
    with rs.Store(root, read_only=True) as store:
        grads = rs.backward(store.get(key))
    leaves = jax.tree.leaves(grads)  # what a process hands back to the trainer, in this order
    np.savez(out, *[np.asarray(g) for g in leaves])
    print(json.dumps({
        "test_file_imported": any(m.startswith("test_model_free_backward") for m in sys.modules),
        "mapping": isinstance(grads, collections.abc.Mapping),
        "keys": list(grads) if isinstance(grads, collections.abc.Mapping) else None,
    }))
    """
)


@pytest.mark.subprocess
def test_without_the_type_the_key_path_mapping_keeps_the_models_leaf_order(tmp_path, rng):
    """``jax.tree.leaves`` of the model-free gradients lists them as ``jax.tree.leaves(params)``
    would, so a trainer can ``jax.tree.unflatten`` them on its parameters' treedef."""
    k1, k2, k3, kx = jax.random.split(rng, 4)
    params = {"mixer": Mixer(jax.random.normal(k1, (4, 4)), jax.random.normal(k2, (4, 4))),
              "head": jax.random.normal(k3, (4, 2))}
    x = jax.random.normal(kx, (3, 4))
    root = tmp_path / "store"
    with rs.Store(root) as store:
        store.put(MIXER_FWD(params, x)[1], "mb0")
    want = jax.grad(_mixer_loss)(params, x)
    out = tmp_path / "leaves.npz"
    proc = subprocess.run(  # cwd and sys.path without tests/: Mixer's module cannot be imported
        [sys.executable, "-c", LEAVES_READER, str(root), "mb0", str(out)], capture_output=True, text=True,
        timeout=120, env=dict(os.environ, PYTHONHASHSEED="23"), cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not report["test_file_imported"] and report["mapping"], report
    assert report["keys"] == ["['head']", "['mixer'].zeta", "['mixer'].alpha"], report  # the model's order
    with np.load(out) as data:
        got = [data[f"arr_{i}"] for i in range(len(data.files))]
    want_leaves = jax.tree.leaves(want)
    assert len(got) == len(want_leaves)
    for i, (g, w) in enumerate(zip(got, want_leaves)):  # leaf by leaf, in order
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"leaf {i}")
    rebuilt = jax.tree.unflatten(jax.tree.structure(params), got)  # the trainer's side
    np.testing.assert_allclose(rebuilt["mixer"].zeta, want["mixer"].zeta, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rebuilt["mixer"].alpha, want["mixer"].alpha, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rebuilt["head"], want["head"], rtol=1e-5, atol=1e-6)


def test_like_of_another_structure_names_the_first_differing_path(rng):
    params, x = _params(rng), jnp.ones((3, 4))
    _, ctx = FWD(params, x)
    wrong = [params[0], {"w": params[1].w, "b": params[1].b}]
    with pytest.raises(rs.SignatureMismatchError, match=r"like= does not have the structure.*missing '\[1\]\.w', unexpected"):
        rs.backward(ctx, like=wrong)
    with pytest.raises(rs.SignatureMismatchError, match="1 leaves, expected 4"):
        FWD.backward(ctx, like=[params[0].w])


@pytest.mark.subprocess
@pytest.mark.parametrize("damage", ["unknown_tag", "leaf_count", "unknown_module"])
def test_a_damaged_or_foreign_structure_record(stored, tmp_path, damage):
    """A malformed record is corruption; a type of a module nobody imported falls back to the
    key-path dict, and the module is never imported."""
    root, manifest, _, want = stored

    def change(m):
        if damage == "unknown_tag":
            m["gradients"]["tree"] = ["weird", "node"]
        elif damage == "leaf_count":
            m["gradients"]["paths"] = m["gradients"]["paths"][:-1]
        else:
            m["gradients"]["tree"] = ["node", ["evil_module_xyz", "Thing"], None, [["*"]] * len(want)]

    _rewrite(manifest, change)
    report, got = _read(root, "mb0", tmp_path)
    assert report["modules"] == []
    if damage == "unknown_module":
        assert report["type"] == "OrderedDict" and list(got) == list(want)
    else:
        assert report["error"].startswith("CorruptContextError: the stored backward of signature rs2-"), report


def test_internals_the_artifact_is_lowered_for_cpu_and_cuda_and_its_cpu_half_runs(rng):
    params, x = _params(rng), jax.random.normal(rng, (3, 4))
    _, ctx = FWD(params, x)
    bwd = ctx._backward
    exported = export_backward(bwd, ctx.spec.avals, platforms=("cuda", "cpu"))
    assert exported.platforms == lowered_for(("cuda", "cpu")) and exported.left_out == {}  # ("cpu", "cuda") on a CPU
    assert jax.export.deserialize(bytearray(exported.data)).platforms == lowered_for(("cuda", "cpu"))
    loaded = load_backward(
        exported.data, ctx.spec.signature, out_structure=bwd.out_structure, out_avals=bwd.out_avals,
        grad_structure=PathStructure(paths=bwd.grad_structure.paths),
    )
    got = loaded(ctx)
    want = jax.grad(_loss)(params, x)
    assert list(got) == [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(want)[0]]
    for g, w in zip(got.values(), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_internals_an_artifact_without_this_platform_names_the_platforms_it_has(rng, monkeypatch):
    params, x = _params(rng), jnp.ones((3, 4))
    _, ctx = FWD(params, x)
    bwd = ctx._backward
    other = "rocm" if backend() == "tpu" else "tpu"  # (a platform this process is not: "tpu" on a CPU)
    monkeypatch.setattr(jax.export, "default_export_platform", lambda: "cuda")
    exported = export_backward(bwd, ctx.spec.avals, platforms=(other,))
    monkeypatch.undo()
    assert exported.platforms == ("cuda", other)
    with pytest.raises(rs.BackwardUnavailableError, match=f"lowered for cuda, {other}, and this process runs on {backend()}"):
        load_backward(exported.data, ctx.spec.signature, out_structure=bwd.out_structure,
                      out_avals=bwd.out_avals, grad_structure=bwd.grad_structure)


def _cpu_only_primitive():
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    prim = Primitive("rs_test_cpu_only_double")
    prim.def_abstract_eval(lambda x: x)
    prim.def_impl(lambda x: x * 2)
    mlir.register_lowering(prim, mlir.lower_fun(lambda x: x * 2, multiple_results=False), platform="cpu")
    return prim


def test_internals_a_platform_that_cannot_lower_it_is_left_out_with_the_reason(rng):
    if backend() != "cpu":
        pytest.skip(f"the primitive lowers on a CPU only, and this process runs on {backend()}")
    prim = _cpu_only_primitive()
    aval = jax.ShapeDtypeStruct((3,), jnp.float32)
    bwd = Backward(
        signature="rs2-test",
        flat_fn=lambda residuals, cts: [prim.bind(residuals[0]) * cts[0]],
        out_structure=PathStructure.of(jax.tree.structure(0)),
        out_avals=[jax.ShapeDtypeStruct((), jnp.float32)],
        grad_structure=PathStructure.of(jax.tree.structure(0)),
    )
    exported = export_backward(bwd, [aval])
    assert exported.platforms == ("cpu",)
    assert set(exported.left_out) == {"cuda", "rocm", "tpu"}
    assert "rs_test_cpu_only_double" in exported.left_out["cuda"]
    x = jax.random.normal(rng, (3,))
    loaded = load_backward(exported.data, "rs2-test", out_structure=bwd.out_structure, out_avals=bwd.out_avals,
                           grad_structure=bwd.grad_structure)
    ctx = rs.ResidualContext.tree_unflatten(
        rs.ResidualSpec(signature="rs2-test", avals=(aval,), names=("x",), input_paths=(None,), kinds=("intermediate",)),
        (x,),
    )
    np.testing.assert_allclose(loaded(ctx, jnp.float32(3.0)), x * 6, rtol=1e-6)


@pytest.mark.subprocess
def test_ls_and_inspect_say_whether_a_backward_is_stored_and_why_not(stored, tmp_path):
    root, _, _, _ = stored

    @jax.custom_vjp
    def host_sin(x):
        return jnp.sin(x)

    def host_sin_bwd(x, g):  # the backward calls back into Python
        return (jax.pure_callback(np.cos, jax.ShapeDtypeStruct(x.shape, x.dtype), x) * g,)

    host_sin.defvjp(lambda x: (jnp.sin(x), x), host_sin_bwd)

    def with_callback(w, x):
        return jnp.sum(host_sin(x @ w))

    fwd = rs.split(with_callback)
    with rs.Store(root) as store, pytest.warns(rs.ResidualStoreWarning, match="calls back into Python"):
        store.put(fwd(jnp.ones((4, 2)), jnp.ones((3, 4)))[1], "cb")
    # (one process without the model runs the three read-only command lines)
    ls, inspect_cb, inspect_mb0 = run_cli_lines(("ls", root, "--json"), ("inspect", root, "cb"), ("inspect", root, "mb0"))
    assert ls.returncode == 0, ls.stderr
    by_key = {e["key"]: e["backward"] for e in json.loads(ls.stdout)}
    assert by_key["mb0"]["stored"] and by_key["mb0"]["platforms"][0] == "cpu" and "cuda" in by_key["mb0"]["platforms"]
    assert by_key["mb0"]["jax_version"] == jax.__version__
    assert not by_key["cb"]["stored"] and "calls back into Python" in by_key["cb"]["reason"]
    text = inspect_cb.stdout
    assert "backward: not stored: the backward of signature rs2-" in text and "pure_callback" in text
    assert "backward: stored for cpu, cuda" in inspect_mb0.stdout
    report, _ = _read(root, "cb", tmp_path)
    assert report["error"].startswith("BackwardUnavailableError: the stored backward of signature rs2-"), report
    assert "calls back into Python (pure_callback)" in report["error"]


@pytest.mark.subprocess
def test_verify_reports_a_damaged_structure_record(stored):
    root, manifest, _, _ = stored
    assert run_cli_process("verify", root).returncode == 0
    _rewrite(manifest, lambda m: m["gradients"].update(tree=["weird"]))
    verify = run_cli_process("verify", root)
    assert verify.returncode == 1 and "DAMAGED backward rs2-" in verify.stdout and "(gradients)" in verify.stdout


@pytest.mark.subprocess
def test_importing_the_types_after_the_backward_was_loaded_still_rebuilds_them(stored):
    """The structure is decoded when the gradients are built, not once at load."""
    root, _, _, _ = stored
    program = textwrap.dedent(
        """
        import sys, jax, residual_store as rs
        sys.path.insert(0, sys.argv[2])
        with rs.Store(sys.argv[1], read_only=True) as store:
            ctx = store.get("mb0")
        before = type(rs.backward(ctx)).__name__
        import test_model_free_backward  # registers Layer now
        after = rs.backward(ctx)
        print(before, type(after).__name__, type(after[0]).__name__)
        """
    )
    proc = subprocess.run([sys.executable, "-c", program, str(root), TESTS], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-3:] == ["OrderedDict", "list", "Layer"]


@pytest.mark.subprocess
def test_internals_the_stored_backward_is_deserialized_only_when_a_backward_needs_it(stored):
    """``get`` reads and checks the stored backward (deleting the store afterwards cannot take it
    away) but does not deserialize it; the first ``rs.backward`` without a live split does, once."""
    root, _, _, _ = stored
    program = textwrap.dedent(
        """
        import shutil, sys, residual_store as rs
        from residual_store._src.store import backwards
        loads = []
        real = backwards.load_backward
        backwards.load_backward = lambda *a, **k: loads.append(1) or real(*a, **k)
        with rs.Store(sys.argv[1], read_only=True) as store:
            ctx = store.get("mb0")
        after_get = len(loads)
        shutil.rmtree(sys.argv[1])  # the store is gone; its backward was read at get
        rs.backward(ctx)
        rs.backward(ctx)
        print(after_get, len(loads))
        """
    )
    proc = subprocess.run([sys.executable, "-c", program, str(root)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-2:] == ["0", "1"]
