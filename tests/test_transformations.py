"""The libraries' idioms: ``filter`` differentiates the floating leaves of a whole model and passes
the rest through; a split and its backward run inside ``jax.jit`` and refuse ``vmap``/``grad``
by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual_store as rs


def _loss(model, x):
    h = jnp.tanh(x @ model["w"] + model["b"])
    noise = jax.random.normal(model["key"], h.shape) * 0.01
    return jnp.mean((h + noise) ** 2) * model["scale"]


def _model(rng):
    kw, kk = jax.random.split(rng)
    return {
        "w": jax.random.normal(kw, (4, 3)),
        "b": jnp.linspace(-0.5, 0.5, 3),
        "key": kk,  # a typed PRNG key
        "scale": jnp.int32(3),  # an integer leaf
    }


FILTERED = rs.split(_loss, filter=rs.is_inexact)


def _float_grads(model, x):
    floats = {k: model[k] for k in ("w", "b")}
    return jax.grad(lambda f: _loss({**model, **f}, x))(floats)


@pytest.mark.slow
def test_filter_differentiates_the_floating_leaves_and_passes_the_rest_through(rng):
    model, x = _model(rng), jax.random.normal(jax.random.fold_in(rng, 1), (5, 4))
    out, ctx = FILTERED(model, x)
    np.testing.assert_allclose(out, _loss(model, x), rtol=1e-6)
    grads = FILTERED.backward(ctx)
    assert grads["key"] is None and grads["scale"] is None
    want = _float_grads(model, x)
    for k in ("w", "b"):
        np.testing.assert_allclose(grads[k], want[k], rtol=1e-5, atol=1e-7)
    kinds = dict(zip(ctx.spec.input_paths, ctx.spec.kinds))
    assert kinds.get("model['key']") in (None, "weight")  # passed through, never a gradient


def test_without_a_filter_an_integer_leaf_is_refused_with_the_option_named(rng):
    with pytest.raises(rs.InvalidArgumentError, match=r"model\['key'\] has dtype key<fry>.*filter=rs.is_inexact"):
        rs.split(_loss)(_model(rng), jnp.ones((5, 4)))


def test_a_fresh_split_uses_the_recorded_choice_of_leaves(rng, tmp_path):
    """A filter that does not understand abstract leaves (like ``eqx.is_inexact_array``) still
    rebuilds: the context records which leaves were differentiated."""

    def concrete_only(x):
        return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.inexact)

    model, x = _model(rng), jax.random.normal(rng, (5, 4))
    with rs.Store(tmp_path / "s") as store:
        store.put(rs.split(_loss, filter=concrete_only)(model, x)[1], "k")
    with rs.Store(tmp_path / "s", read_only=True) as store:
        ctx = store.get("k")
    assert ctx.spec.call.differentiated == (True, False, False, True, False)  # b, key, scale, w; x
    fresh = rs.split(_loss, filter=concrete_only)
    grads = fresh.backward(ctx)
    assert fresh.cache_info().forward_compiles == 0
    want = _float_grads(model, x)
    np.testing.assert_allclose(grads["w"], want["w"], rtol=1e-5, atol=1e-7)
    with pytest.raises(rs.SignatureMismatchError):
        rs.split(_loss).backward(ctx)  # no filter: another signature


def _mlp(params, x):
    return jnp.mean(jnp.tanh(x @ params["w1"]) @ params["w2"])


MLP = rs.split(_mlp)


@jax.jit
def _step(params, x):
    loss, ctx = MLP(params, x)
    return loss, MLP.backward(ctx)


def test_a_jitted_step_calls_the_split_and_its_backward(rng):
    k1, k2, k3 = jax.random.split(rng, 3)
    params = {"w1": jax.random.normal(k1, (4, 8)), "w2": jax.random.normal(k2, (8, 2))}
    x = jax.random.normal(k3, (3, 4))
    loss, grads = _step(params, x)
    want_loss, want = jax.value_and_grad(_mlp)(params, x)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for k in params:
        np.testing.assert_allclose(grads[k], want[k], rtol=1e-5, atol=1e-7)
    # inside jit nothing is compiled ahead of time: the caller's jit compiles it all, once
    info = MLP.cache_info()
    assert (info.forward_compiles, info.backward_compiles) == (0, 0)


def test_a_context_returned_from_jit_runs_backward_outside_and_inside(rng):
    params = {"w1": jax.random.normal(rng, (4, 8)), "w2": jnp.ones((8, 2))}
    x = jax.random.normal(jax.random.fold_in(rng, 2), (3, 4))
    _, ctx = jax.jit(MLP)(params, x)
    assert isinstance(ctx, rs.ResidualContext) and not isinstance(ctx.residuals[0], jax.core.Tracer)
    want = jax.grad(_mlp)(params, x)
    for got in (rs.backward(ctx), jax.jit(rs.backward)(ctx)):
        np.testing.assert_allclose(got["w1"], want["w1"], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "transform, name",
    [
        (lambda f, p, xs: jax.vmap(lambda x: f(p, x))(xs), "jax.vmap"),
        (lambda f, p, xs: jax.grad(lambda q: f(q, xs[0]))(p), "jax.grad"),
    ],
)
def test_vmap_and_grad_are_refused_by_name(rng, transform, name):
    params = {"w1": jax.random.normal(rng, (4, 8)), "w2": jnp.ones((8, 2))}
    xs = jnp.ones((2, 3, 4))
    with pytest.raises(rs.InvalidArgumentError, match=f"cannot run under {name}"):
        transform(lambda p, x: MLP(p, x)[0], params, xs)
    _, ctx = MLP(params, xs[0])
    with pytest.raises(rs.InvalidArgumentError, match="the backward cannot run under jax.vmap"):
        jax.vmap(lambda c: MLP.backward(ctx, c))(jnp.ones((2,)))


def test_put_inside_jit_is_refused_with_what_to_do(rng, tmp_path):
    params = {"w1": jax.random.normal(rng, (4, 8)), "w2": jnp.ones((8, 2))}
    with rs.Store(tmp_path / "s") as store:

        @jax.jit
        def step(p, x):
            _, ctx = MLP(p, x)
            store.put(ctx, "k")
            return ctx

        with pytest.raises(rs.InvalidArgumentError, match="return the context from the jitted function"):
            step(params, jnp.ones((3, 4)))
        assert "k" not in store
        store.put(jax.jit(MLP)(params, jnp.ones((3, 4)))[1], "k")  # the way to do it
    with rs.Store(tmp_path / "s", read_only=True) as store:
        got = rs.split(_mlp).backward(store.get("k"))
    np.testing.assert_allclose(got["w1"], jax.grad(_mlp)(params, jnp.ones((3, 4)))["w1"], rtol=1e-5, atol=1e-7)
