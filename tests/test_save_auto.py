"""``rs.split(..., save="auto")``: fewer residual bytes, the same gradients, nothing expensive or
effectful recomputed (issue 15, first step: the minimum-cut choice over the forward's top level).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual_store as rs
from store_helpers import run_python, write_script
from test_bw_split import block, block_params, mlp_params, mlp_stage


def _own(ctx):
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
               for a, k in zip(ctx.spec.avals, ctx.spec.kinds) if k in ("input", "intermediate"))


def _loss(stage):
    return lambda p, x: jnp.mean(stage(p, x) ** 2)


def _close(a, b, tol=2e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def _count(closed, names) -> int:
    def walk(jaxpr):
        n = 0
        for eqn in jaxpr.eqns:
            n += eqn.primitive.name in names
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                n += walk(sub)
        return n

    return walk(closed.jaxpr)


CASES = {
    "mlp": (mlp_stage, mlp_params, (16, 8), 0.6),
    "transformer_block": (block, block_params, (2, 8, 8), 0.4),
}


@pytest.mark.parametrize("name", list(CASES))
def test_auto_keeps_fewer_bytes_and_gives_the_same_gradients(name):
    stage, make, x_shape, most = CASES[name]
    loss = _loss(stage)
    fwd_all, fwd_auto = rs.split(loss, argnums=(0, 1)), rs.split(loss, argnums=(0, 1), save="auto")
    for seed in (1, 2):
        k = jax.random.split(jax.random.key(seed), 2)
        params, x = make(k[0]), jax.random.normal(k[1], x_shape)
        (v_all, c_all), (v_auto, c_auto) = fwd_all(params, x), fwd_auto(params, x)
        assert float(v_all) == pytest.approx(float(v_auto), rel=1e-6)
        want = jax.grad(loss, argnums=(0, 1))(params, x)
        _close(fwd_auto.backward(c_auto), want)
        _close(fwd_auto.backward(c_auto), fwd_all.backward(c_all))
        assert _own(c_auto) <= most * _own(c_all), (_own(c_auto), _own(c_all))
    assert c_auto.spec.signature != c_all.spec.signature
    info = fwd_auto.cache_info()
    assert (info.forward_compiles, info.backward_compiles) == (1, 1)
    # what the backward recomputes is cheap: it runs no more matrix products than with "all"
    dots = lambda f, c: _count(jax.make_jaxpr(lambda c: f.backward(c))(c), {"dot_general"})  # noqa: E731
    assert dots(fwd_auto, c_auto) == dots(fwd_all, c_all)


def test_a_custom_vjp_an_rng_op_and_a_callback_are_never_recomputed():
    """The fwd of a custom_vjp runs once (in the forward), a random draw and a host callback run
    once; the backward recomputes only the cheap operations around them."""
    calls = {"fwd": 0, "callback": 0}

    @jax.custom_vjp
    def kernel(x):
        return jnp.sin(x) * 2.0

    def kernel_fwd(x):
        jax.debug.callback(lambda: calls.__setitem__("fwd", calls["fwd"] + 1))
        return jnp.sin(x) * 2.0, jnp.cos(x)

    kernel.defvjp(kernel_fwd, lambda c, g: (2.0 * c * g,))

    def loss(w, x, key):
        h = jnp.tanh(x @ w)
        noise = jax.random.normal(key, h.shape)
        jax.debug.callback(lambda: calls.__setitem__("callback", calls["callback"] + 1))
        return jnp.sum(jnp.exp(kernel(h) * noise) ** 2)

    k = jax.random.split(jax.random.key(3), 3)
    w, x = jax.random.normal(k[0], (4, 4)) / 2, jax.random.normal(k[1], (3, 4))
    fwd = rs.split(loss, argnums=(0, 1), save="auto")
    _, ctx = fwd(w, x, k[2])
    jax.effects_barrier()
    assert calls == {"fwd": 1, "callback": 1}
    grads = fwd.backward(ctx)
    jax.effects_barrier()
    assert calls == {"fwd": 1, "callback": 1}, calls
    _close(grads, jax.grad(loss, argnums=(0, 1))(w, x, k[2]), tol=1e-4)
    bwd = jax.make_jaxpr(lambda c: fwd.backward(c))(ctx)
    assert _count(bwd, {"random_bits", "threefry2x32", "random_wrap", "random_seed"}) == 0
    assert _count(bwd, {"debug_callback"}) == 0


def test_bad_save_values_and_a_context_of_the_other_choice():
    with pytest.raises(rs.InvalidArgumentError, match="'all', 'auto'"):
        rs.split(lambda x: jnp.sum(x), save="some")
    loss = _loss(mlp_stage)
    params, x = mlp_params(jax.random.key(4)), jax.random.normal(jax.random.key(5), (16, 8))
    _, ctx = rs.split(loss, argnums=(0, 1), save="auto")(params, x)
    with pytest.raises(rs.SignatureMismatchError, match="save='auto'"):
        rs.split(loss, argnums=(0, 1)).backward(ctx)


_RESUME = """
import sys, numpy as np, residual_store as rs
with rs.Store(sys.argv[1], read_only=True) as store:
    grads = rs.backward(store.get("auto"))       # no model here: the stored backward recomputes
np.savez(sys.argv[2], *[np.asarray(g) for g in __import__("jax").tree.leaves(grads)])
"""


def test_an_auto_context_resumes_without_the_model(tmp_path):
    loss = _loss(block)
    params, x = block_params(jax.random.key(6)), jax.random.normal(jax.random.key(7), (2, 8, 8))
    _, ctx = rs.split(loss, argnums=(0, 1), save="auto")(params, x)
    with rs.Store(tmp_path / "store") as store:
        store.put(ctx, "auto")
    script = write_script(tmp_path, "resume.py", _RESUME)
    run_python(script, str(tmp_path / "store"), str(tmp_path / "g.npz"), env={"PYTHONHASHSEED": "5"})
    got = np.load(tmp_path / "g.npz")
    want = jax.tree.leaves(jax.grad(loss, argnums=(0, 1))(params, x))
    for i, w in enumerate(want):
        np.testing.assert_allclose(got[f"arr_{i}"], np.asarray(w), rtol=2e-5, atol=2e-5)


def test_a_checkpoint_policy_as_save():
    """A JAX policy chooses what may be recomputed (matrix products too, if it says so); RNG,
    callbacks and higher-order primitives stay protected."""
    loss = _loss(mlp_stage)
    params, x = mlp_params(jax.random.key(8)), jax.random.normal(jax.random.key(9), (16, 8))
    want = jax.grad(loss, argnums=(0, 1))(params, x)
    own = {}
    for name, save in (
        ("all", "all"),
        ("everything", jax.checkpoint_policies.everything_saveable),
        ("dots", jax.checkpoint_policies.dots_saveable),
        ("nothing", jax.checkpoint_policies.nothing_saveable),
    ):
        fwd = rs.split(loss, argnums=(0, 1), save=save)
        _, ctx = fwd(params, x)
        _close(fwd.backward(ctx), want)
        own[name] = _own(ctx)
        if name == "nothing":  # only the input x: the backward recomputes the whole forward
            assert [k for k in ctx.spec.kinds if k != "weight"] == ["input"]
            assert ctx.spec.call.save.startswith("policy:") and "nothing_saveable" in ctx.spec.call.save
    assert own["everything"] == own["all"] > own["dots"] > own["nothing"] > 0

    def broken(prim, *avals, **params):
        raise RuntimeError("no")

    with pytest.raises(rs.InvalidArgumentError, match="raised on primitive"):
        rs.split(loss, argnums=(0, 1), save=broken)(params, x)


@pytest.mark.parametrize("name", list(CASES))
def test_the_bw_split_of_an_auto_context(name):
    """Zero-bubble and save="auto" together: B recomputes what the input gradient needs, W the
    rest; the sum is still the vjp."""
    stage, make, x_shape, _ = CASES[name]
    k = jax.random.split(jax.random.key(10), 3)
    params, x = make(k[0]), jax.random.normal(k[1], x_shape)
    fwd = rs.split(stage, argnums=(0, 1), save="auto")
    y, ctx = fwd(params, x)
    ct = jax.random.normal(k[2], y.shape)
    want_p, want_x = jax.vjp(stage, params, x)[1](ct)
    dx, later = fwd.backward(ctx, ct, now=1)
    _close(dx, want_x)
    _close(rs.backward(later), want_p)
