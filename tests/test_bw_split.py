"""The B/W split of a backward (``split.backward(ctx, cotangent, now=...)``), issue 13 part 1.

B returns the gradients of the ``now`` arguments and ``later``; ``rs.backward(later)`` returns the
others. Checked here with real numbers: B then W equals ``jax.vjp`` of the function on fresh
random inputs and cotangents; W repeats no matrix product B ran (counted in the jaxprs the two
halves run); ``later`` holds no residual only B read; each half compiles once per signature;
``later`` goes through a store into processes with and without the model.
"""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import residual_store as rs
from store_helpers import run_python, write_script

D, F, T, B, HEADS, LAYERS = 8, 16, 4, 2, 2, 3


def _normal(key, shape, scale=0.5):
    return jax.random.normal(key, shape) * scale


# -- stages: f(params, x) -> y, the shape of a pipeline stage ---------------------------------


def mlp_stage(p, x):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.tanh(h @ p["w2"] + p["b2"])


def mlp_params(key):
    k = jax.random.split(key, 4)
    return {"w1": _normal(k[0], (D, F)), "b1": _normal(k[1], (F,)), "w2": _normal(k[2], (F, D)), "b2": _normal(k[3], (D,))}


def _layernorm(x, scale):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(jnp.var(x, axis=-1, keepdims=True) + 1e-5) * scale


def block(p, x):
    """A pre-layernorm causal transformer block on ``x`` of ``[batch, seq, d]``."""
    b, t, d = x.shape
    h = _layernorm(x, p["ln1"])
    q, k, v = jnp.split(h @ p["wqkv"], 3, axis=-1)
    heads = lambda z: z.reshape(b, t, HEADS, d // HEADS)  # noqa: E731
    logits = jnp.einsum("bqhd,bkhd->bhqk", heads(q), heads(k)) / jnp.sqrt(d // HEADS)
    weights = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e9), axis=-1)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", weights, heads(v)).reshape(b, t, d) @ p["wo"]
    return x + jax.nn.gelu(_layernorm(x, p["ln2"]) @ p["w1"]) @ p["w2"]


def block_params(key):
    k = jax.random.split(key, 6)
    return {
        "ln1": 1.0 + _normal(k[0], (D,), 0.1),
        "wqkv": _normal(k[1], (D, 3 * D)),
        "wo": _normal(k[2], (D, D)),
        "ln2": 1.0 + _normal(k[3], (D,), 0.1),
        "w1": _normal(k[4], (D, F)),
        "w2": _normal(k[5], (F, D)),
    }


def scan_stage(p, x):
    """Layers under ``lax.scan`` with ``jax.checkpoint``: each layer's matmuls recomputed."""

    @jax.checkpoint
    def layer(h, w):
        return jnp.tanh(h @ w["a"]) @ w["b"] + h, None

    return jax.lax.scan(layer, x, p)[0]


def scan_params(key):
    k = jax.random.split(key, 2)
    return {"a": _normal(k[0], (LAYERS, D, F)), "b": _normal(k[1], (LAYERS, F, D))}


def no_weight_stage(p, x):
    """The input gradient needs no weight at all: ``x`` only meets the weights through a sum."""
    return jnp.sin(x) * 2.0 + jnp.sum(p["w"] ** 2)


def no_weight_params(key):
    return {"w": _normal(key, (D,))}


STAGES = {
    "mlp": (mlp_stage, mlp_params, (T, D)),
    "transformer_block": (block, block_params, (B, T, D)),
    "scan_remat": (scan_stage, scan_params, (T, D)),
    "no_weight": (no_weight_stage, no_weight_params, (T, D)),
}


def _inputs(name, seed):
    fun, make, x_shape = STAGES[name]
    k = jax.random.split(jax.random.key(seed), 3)
    params, x = make(k[0]), _normal(k[1], x_shape, 1.0)
    y = jax.eval_shape(fun, params, x)
    return fun, params, x, _normal(k[2], y.shape, 1.0)


@pytest.fixture(scope="module")
def splits():
    """One split per stage, shared by the tests (each compiles its halves once)."""
    return {name: rs.split(fun, argnums=(0, 1)) for name, (fun, _, _) in STAGES.items()}


def _close(a, b, tol=2e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def _dots(closed) -> int:
    """Matrix products a jaxpr runs: ``dot_general`` equations, inside every nested jaxpr,
    times the trip count of the scans they sit in."""

    def count(jaxpr, times):
        n = 0
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                n += times
            inner_times = times * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                n += count(sub, inner_times)
        return n

    return count(closed.jaxpr, 1)


# -- the numbers --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STAGES))
def test_b_then_w_equals_the_plain_backward_and_jax_vjp(splits, name):
    fwd = splits[name]
    for seed in (1, 2):  # two microbatches of fresh random numbers through the same executables
        fun, params, x, ct = _inputs(name, seed)
        y, ctx = fwd(params, x)
        want_p, want_x = jax.vjp(fun, params, x)[1](ct)
        assert float(jnp.max(jnp.abs(want_x))) > 0 and all(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(want_p))
        dx, later = fwd.backward(ctx, ct, now=1)
        dp = rs.backward(later)
        _close(dx, want_x)
        _close(dp, want_p)
        _close((dp, dx), fwd.backward(ctx, ct))
        assert isinstance(later, rs.ResidualContext) and later.spec.signature != ctx.spec.signature


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "transformer_block", "scan_remat"])
def test_w_repeats_no_matrix_product_that_b_ran(splits, name):
    """B runs only the products the input gradient needs (fewer than the plain backward), W runs
    the rest, and the two together run exactly the plain backward's."""
    fwd = splits[name]
    _, params, x, ct = _inputs(name, 3)
    _, ctx = fwd(params, x)
    plain = _dots(jax.make_jaxpr(lambda c: fwd.backward(c, ct))(ctx))
    b = _dots(jax.make_jaxpr(lambda c: fwd.backward(c, ct, now=1))(ctx))
    _, later = fwd.backward(ctx, ct, now=1)
    w = _dots(jax.make_jaxpr(rs.backward)(later))
    assert 0 < b < plain and 0 < w and b + w == plain, (b, w, plain)


@pytest.mark.slow  # seconds of its own: the fast tier aims at 90 s
def test_later_holds_only_what_w_reads(splits):
    """The attention weights (softmax) are read only by the input gradient: B frees them."""
    fwd = splits["transformer_block"]
    _, params, x, ct = _inputs("transformer_block", 4)
    _, ctx = fwd(params, x)
    _, later = fwd.backward(ctx, ct, now=1)
    softmax = [n for n in ctx.spec.names if "softmax" in n or n.startswith("exp") or "div" in n.split()[0]]
    assert softmax, ctx.describe()
    assert not set(softmax) & set(later.spec.names), later.describe()
    assert later.nbytes < ctx.nbytes
    own = sum(int(np.prod(a.shape)) * 4 for a, k in zip(ctx.spec.avals, ctx.spec.kinds) if k in ("input", "intermediate"))
    assert later.nbytes < own, (later.nbytes, own)
    # every residual is named: the parent's keep their names, the rest say which gradient they feed
    for name, kind, path in zip(later.spec.names, later.spec.kinds, later.spec.input_paths):
        assert name in ctx.spec.names or name.startswith("cotangent"), name
        assert kind in ("input", "intermediate", "weight", "constant")
        assert (path is not None) == (kind in ("input", "weight"))
    fed = [n for n in later.spec.names if n.startswith("cotangent for ")]
    assert any("p['w1']" in n for n in fed) and any("p['wqkv']" in n for n in fed), fed


def test_no_weight_input_gradient_leaves_later_only_the_weight_part(splits):
    fwd = splits["no_weight"]
    _, params, x, ct = _inputs("no_weight", 5)
    _, ctx = fwd(params, x)
    _, later = fwd.backward(ctx, ct, now=1)
    # W (2 w * sum(ct)) reads the cotangent and w's own residual, never x or cos(x)
    assert not any("cos" in n or n == "input x" for n in later.spec.names), later.describe()


def test_a_weight_w_reads_stays_held_by_reference():
    """W of ``x @ (w * w)`` reads ``w`` itself: ``later`` holds that very array, as a weight."""
    fwd = rs.split(lambda w, x: x @ (w * w), argnums=(0, 1))
    k = jax.random.split(jax.random.key(6), 3)
    w, x = _normal(k[0], (D, D)), _normal(k[1], (T, D))
    ct = _normal(k[2], (T, D))
    _, ctx = fwd(w, x)
    dx, later = fwd.backward(ctx, ct, now=1)
    held = [r for r, kind in zip(later.residuals, later.spec.kinds) if kind == "weight"]
    assert len(held) == 1 and held[0] is w
    want_w, want_x = jax.vjp(lambda w, x: x @ (w * w), w, x)[1](ct)
    _close(dx, want_x)
    _close(rs.backward(later), want_w)


def test_each_half_compiles_once_per_signature():
    fwd = rs.split(mlp_stage, argnums=(0, 1))
    for seed in range(3):
        _, params, x, ct = _inputs("mlp", 10 + seed)
        _, ctx = fwd(params, x)
        _, later = fwd.backward(ctx, ct, now=1)
        rs.backward(later)
    info = fwd.cache_info()
    assert (info.forward_compiles, info.backward_compiles) == (1, 2), info
    # a new shape is a new signature: one more forward, and one more of each half
    _, params, _, _ = _inputs("mlp", 20)
    x = _normal(jax.random.key(21), (2 * T, D))
    y, ctx = fwd(params, x)
    _, later = fwd.backward(ctx, jnp.ones_like(y), now=1)
    rs.backward(later)
    info = fwd.cache_info()
    assert (info.forward_compiles, info.backward_compiles) == (2, 4), info


def test_now_as_a_tuple_and_several_arguments():
    """Three differentiated arguments: B takes two of them (in argnums order), W the third."""

    def f(w, x, z):
        return jnp.tanh(x @ w) * z

    fwd = rs.split(f, argnums=(0, 1, 2))
    k = jax.random.split(jax.random.key(7), 4)
    w, x, z = _normal(k[0], (D, D)), _normal(k[1], (T, D)), _normal(k[2], (T, D))
    ct = _normal(k[3], (T, D))
    _, ctx = fwd(w, x, z)
    want = jax.vjp(f, w, x, z)[1](ct)
    (dz, dx), later = fwd.backward(ctx, ct, now=(2, 1))
    _close((dx, dz), want[1:])
    _close(rs.backward(later), want[0])  # one argument left: its gradient alone, not a tuple


def test_inside_jit_both_halves_inline():
    fwd = rs.split(mlp_stage, argnums=(0, 1))
    _, params, x, ct = _inputs("mlp", 8)
    _, ctx = fwd(params, x)

    @jax.jit
    def step(ctx, ct):
        dx, later = fwd.backward(ctx, ct, now=1)
        return dx, rs.backward(later)

    dx, dp = step(ctx, ct)
    _close((dp, dx), fwd.backward(ctx, ct))


# -- bad input ------------------------------------------------------------------------------------


def test_bad_now_and_misuse_raise_the_library_errors(splits):
    fwd = splits["mlp"]
    _, params, x, ct = _inputs("mlp", 9)
    _, ctx = fwd(params, x)
    with pytest.raises(rs.InvalidArgumentError, match="among argnums"):
        fwd.backward(ctx, ct, now=2)
    with pytest.raises(rs.InvalidArgumentError, match="every argument"):
        fwd.backward(ctx, ct, now=(0, 1))
    with pytest.raises(rs.InvalidArgumentError):
        fwd.backward(ctx, ct, now=-1)
    with pytest.raises(rs.InvalidArgumentError, match="like="):
        fwd.backward(ctx, ct, now=1, like=params)
    _, later = fwd.backward(ctx, ct, now=1)
    with pytest.raises(rs.SignatureMismatchError, match="takes no cotangent"):
        rs.backward(later, ct)
    with pytest.raises(rs.InvalidArgumentError, match="already the later half"):
        fwd.backward(later, now=1)
    with pytest.raises(rs.SignatureMismatchError):
        splits["transformer_block"].backward(later)
    with pytest.raises(rs.SignatureMismatchError):
        fwd.backward(ctx, jnp.ones((T + 1, D)), now=1)
    # none of that broke anything: the same context still splits and sums up
    dx, later = fwd.backward(ctx, ct, now=1)
    _close((rs.backward(later), dx), fwd.backward(ctx, ct))


# -- real model libraries ----------------------------------------------------------------------


def _eqx_stage():
    model = eqx.nn.MLP(D, D, F, depth=2, activation=jax.nn.gelu, key=jax.random.key(11))
    return lambda m, x: jax.vmap(m)(x), model, {"filter": rs.is_inexact}


def _nnx_stage():
    model = nnx.Sequential(nnx.Linear(D, F, rngs=nnx.Rngs(0)), nnx.LayerNorm(F, rngs=nnx.Rngs(1)),
                           nnx.Linear(F, D, rngs=nnx.Rngs(2)))
    graphdef, state = nnx.split(model)
    return lambda s, x: jax.nn.relu(nnx.merge(graphdef, s)(x)), state, {}


def _linen_stage():
    class Stage(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(D)(nn.gelu(nn.LayerNorm()(nn.Dense(F)(x))))

    module = Stage()
    params = module.init(jax.random.key(12), jnp.zeros((T, D)))
    return module.apply, params, {}


def _haiku_stage():
    model = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([F, D], activation=jnp.tanh)(x)))
    params = model.init(jax.random.key(13), jnp.zeros((T, D)))
    return model.apply, params, {}


@pytest.mark.slow
@pytest.mark.parametrize("make", [_eqx_stage, _nnx_stage, _linen_stage, _haiku_stage], ids=["equinox", "nnx", "linen", "haiku"])
def test_library_stages(make):
    fun, params, options = make()
    fwd = rs.split(fun, argnums=(0, 1), **options)
    k = jax.random.split(jax.random.key(14), 2)
    x = _normal(k[0], (T, D), 1.0)
    y, ctx = fwd(params, x)
    ct = _normal(k[1], y.shape, 1.0)
    dx, later = fwd.backward(ctx, ct, now=1)
    dp = rs.backward(later)
    want_dp, want_dx = fwd.backward(ctx, ct)
    _close(dx, want_dx)
    _close(dp, want_dp)
    assert jax.tree.structure(dp) == jax.tree.structure(want_dp)
    diff = jax.tree.map(lambda a: a, (params, x))
    if options:  # Equinox: only the arrays are differentiated
        diff = (eqx.filter(params, eqx.is_inexact_array), x)
    _, vjp = jax.vjp(lambda p, x: fun(eqx.combine(p, params) if options else p, x), *diff)
    ref_p, ref_x = vjp(ct)
    _close(dx, ref_x)
    _close(eqx.filter(dp, eqx.is_array), eqx.filter(ref_p, eqx.is_array))


# -- across processes ---------------------------------------------------------------------------

_MODEL = '''
import jax, jax.numpy as jnp

def mlp_stage(p, x):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.tanh(h @ p["w2"] + p["b2"])
'''

_RESUME = '''
import sys, numpy as np, jax, residual_store as rs
store_path, key, mode, out = sys.argv[1:5]
with rs.Store(store_path, read_only=True) as store:
    later = store.get(key)
    if mode == "model":
        from stage_model import mlp_stage
        fwd = rs.split(mlp_stage, argnums=(0, 1))
        grads = fwd.backward(later)            # the split rebuilds W from the parent's record
        assert fwd.cache_info().forward_compiles == 0
    else:
        assert "stage_model" not in sys.modules
        grads = rs.backward(later)             # the W backward the store saved
np.savez(out, **{k: np.asarray(v) for k, v in grads.items()})
print(type(grads).__name__, later.spec.names)
'''


@pytest.mark.slow
def test_later_resumes_from_a_store_in_processes_with_and_without_the_model(tmp_path):
    folder = tmp_path / "code"
    folder.mkdir()
    write_script(folder, "stage_model.py", _MODEL)
    script = write_script(folder, "resume.py", _RESUME)
    import importlib.util

    spec = importlib.util.spec_from_file_location("stage_model", folder / "stage_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fwd = rs.split(mod.mlp_stage, argnums=(0, 1))
    _, params, x, ct = _inputs("mlp", 30)
    _, ctx = fwd(params, x)
    want_p, _ = jax.vjp(mod.mlp_stage, params, x)[1](ct)
    dx, later = fwd.backward(ctx, ct, now=1)
    store_path = tmp_path / "store"
    with rs.Store(store_path) as store:
        store.put(later, "w1")
    for mode, seed in (("model", "0"), ("none", "7")):
        out = tmp_path / f"{mode}.npz"
        proc = run_python(script, str(store_path), "w1", mode, str(out), cwd=str(folder), env={"PYTHONHASHSEED": seed})
        assert proc.stdout.startswith("dict"), proc.stdout
        got = np.load(out)
        for k in want_p:
            np.testing.assert_allclose(got[k], np.asarray(want_p[k]), rtol=2e-5, atol=2e-5)


_TWO_DEVICES = '''
import sys, jax
jax.config.update("jax_num_cpu_devices", 2)
import jax.numpy as jnp, numpy as np, residual_store as rs

def stage(p, x):
    return jnp.tanh(x @ p["w"]) @ p["v"]

fwd = rs.split(stage, argnums=(0, 1))
devices = jax.devices()
k = jax.random.split(jax.random.key(0), 3)
p0 = {"w": jax.random.normal(k[0], (8, 16)), "v": jax.random.normal(k[1], (16, 8))}
for d, dev in enumerate(devices):  # one signature (single-device placements are not in it), two devices
    # each stage's store reads its contexts back onto the stage's device
    with rs.Store(f"{sys.argv[1]}-{d}", device_budget=0, host_budget=0, device=dev) as store:
        p = jax.device_put(p0, dev)
        x = jax.device_put(jax.random.normal(k[2], (4, 8)) + d, dev)
        ct = jax.device_put(jnp.ones((4, 8)), dev)
        y, ctx = fwd(p, x)
        want = jax.vjp(stage, p, x)[1](ct)
        store.put(ctx, f"c{d}")
        assert {next(iter(r.devices())) for r in store.get(f"c{d}").residuals} == {dev}
        plain = fwd.backward(store.get(f"c{d}"), ct)       # read back from disk: no live backward
        dx, later = fwd.backward(store.get(f"c{d}"), ct, now=1)
        store.put(later, f"w{d}")
        dp = rs.backward(store.get(f"w{d}"))                 # the W backward, found by signature
        for got, ref in ((plain, want), ((dp, dx), want)):
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)
        assert next(iter(dx.devices())) == dev and next(iter(jax.tree.leaves(dp)[0].devices())) == dev
info = fwd.cache_info()
print(info.forward_compiles, info.backward_compiles)
'''


@pytest.mark.slow
def test_one_signature_on_two_devices_compiles_each_half_per_device(tmp_path):
    """Pipeline stages that share a function share a signature: each device gets its own
    executables (plain backward, B, W), and contexts read back from a store find them."""
    script = write_script(tmp_path, "two_devices.py", _TWO_DEVICES)
    proc = run_python(script, str(tmp_path / "store"))
    assert proc.stdout.split() == ["2", "6"], proc.stdout  # per device: forward; plain, B and W


@pytest.mark.slow
def test_an_evicted_signature_drops_its_halves_and_compiles_them_again():
    fwd = rs.split(mlp_stage, argnums=(0, 1), cache_size=1)
    _, params, x, ct = _inputs("mlp", 40)
    x2 = _normal(jax.random.key(41), (2 * T, D))
    for xs in (x, x2, x):  # the third call brings back the first signature, evicted by the second
        y, ctx = fwd(params, xs)
        dx, later = fwd.backward(ctx, jnp.ones_like(y), now=1)
        _close((rs.backward(later), dx), fwd.backward(ctx, jnp.ones_like(y)))
    info = fwd.cache_info()
    # per call: B, W and the plain backward compile (the second shape, and the first again)
    assert (info.forward_compiles, info.backward_compiles) == (3, 9), info
