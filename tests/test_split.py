"""rs.split: gradients equal jax.grad, no forward re-evaluation, one compile per signature."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual_store as rs
from models import init_mlp, mlp, mlp_loss

F32_TOL = dict(rtol=1e-5, atol=1e-6)


def assert_trees_close(a, b, **tol):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), **tol)


@pytest.fixture(scope="module")
def mlp_split():
    return rs.split(mlp_loss)


def _mlp_data(rng, batch=5):
    kp, kx, ky = jax.random.split(rng, 3)
    return init_mlp(kp), jax.random.normal(kx, (batch, 8)), jax.random.normal(ky, (batch, 4))


@pytest.mark.slow
def test_mlp_gradients_match_jax_grad(mlp_split, rng):
    params, x, y = _mlp_data(rng)
    loss, ctx = mlp_split(params, x, y)
    np.testing.assert_allclose(loss, mlp_loss(params, x, y), **F32_TOL)
    grads = mlp_split.backward(ctx)
    ref = jax.grad(mlp_loss)(params, x, y)
    assert_trees_close(grads, ref, **F32_TOL)
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))
    assert_trees_close(rs.backward(ctx), ref, **F32_TOL)


def test_two_backwards_from_one_forward(mlp_split, rng):
    params, x, y = _mlp_data(rng)
    _, ctx = mlp_split(params, x, y)
    g1 = mlp_split.backward(ctx, jnp.float32(1.0))
    g3 = mlp_split.backward(ctx, jnp.float32(3.0))
    assert_trees_close(jax.tree.map(lambda g: 3 * g, g1), g3, **F32_TOL)


def test_argnums_tuple_and_nondiff_args(rng):
    params, x, y = _mlp_data(rng)
    fwd = rs.split(mlp_loss, argnums=(1, 0))
    _, ctx = fwd(params, x, y)
    gx, gp = fwd.backward(ctx)
    ref_p, ref_x = jax.grad(mlp_loss, argnums=(0, 1))(params, x, y)
    assert_trees_close(gx, ref_x, **F32_TOL)
    assert_trees_close(gp, ref_p, **F32_TOL)


def test_pytree_output_with_explicit_cotangent(rng):
    def f(params, x):
        h = mlp(params, x)
        return {"mean": jnp.mean(h, 0), "pair": (jnp.sin(h), jnp.sum(h**2))}

    params, x, _ = _mlp_data(rng)
    fwd = rs.split(f)
    out, ctx = fwd(params, x)
    ct = jax.tree.map(lambda o: jax.random.normal(jax.random.fold_in(rng, o.size), o.shape), out)
    _, vjp = jax.vjp(f, params, x)
    assert_trees_close(fwd.backward(ctx, ct), vjp(ct)[0], **F32_TOL)


@pytest.mark.slow
def test_has_aux_and_integer_output_leaves(rng):
    def f(params, x):
        h = mlp(params, x)
        return (jnp.sum(h**2), jnp.argmax(h, -1)), {"norm": jnp.linalg.norm(h)}

    params, x, _ = _mlp_data(rng)
    fwd = rs.split(f, has_aux=True)
    ((value, idx), aux), ctx = fwd(params, x)
    np.testing.assert_allclose(aux["norm"], f(params, x)[1]["norm"], **F32_TOL)
    assert idx.dtype == jnp.int32
    grads = fwd.backward(ctx, (jnp.float32(2.0), jnp.zeros(idx.shape, jnp.int32)))
    ref = jax.grad(lambda p: 2 * f(p, x)[0][0])(params)
    assert_trees_close(grads, ref, **F32_TOL)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_params(rng, dtype):
    kp, kx, ky = jax.random.split(rng, 3)
    params = init_mlp(kp, dtype=dtype)
    x = jax.random.normal(kx, (4, 8), dtype)
    y = jax.random.normal(ky, (4, 4))
    fwd = rs.split(mlp_loss)
    _, ctx = fwd(params, x, y)
    grads = fwd.backward(ctx)
    ref = jax.jit(jax.grad(mlp_loss))(params, x, y)
    assert all(g.dtype == dtype for g in jax.tree.leaves(grads))
    assert {a.dtype for a in ctx.spec.avals} >= {jnp.dtype(dtype)}
    assert_trees_close(grads, ref, rtol=2e-2, atol=2e-2)


def test_static_argnums_are_part_of_the_signature(rng):
    def f(x, power):
        return jnp.sum(x**power)

    x = jax.random.normal(rng, (6,))
    fwd = rs.split(f, static_argnums=1)
    _, c2 = fwd(x, 2)
    _, c3 = fwd(x, 3)
    assert c2.spec.signature != c3.spec.signature
    np.testing.assert_allclose(fwd.backward(c2), 2 * x, **F32_TOL)
    np.testing.assert_allclose(fwd.backward(c3), 3 * x**2, **F32_TOL)


def test_backward_never_reruns_the_forward(rng):
    calls = []

    def f(params, x, y):
        jax.debug.callback(lambda: calls.append("forward"))
        return mlp_loss(params, x, y)

    params, x, y = _mlp_data(rng)
    fwd = rs.split(f)
    contexts = [fwd(params, x * (i + 1), y)[1] for i in range(3)]
    jax.effects_barrier()
    assert calls == ["forward"] * 3
    for ctx in reversed(contexts):
        jax.block_until_ready(fwd.backward(ctx))
        jax.block_until_ready(rs.backward(ctx, jnp.float32(0.5)))
    jax.effects_barrier()
    assert calls == ["forward"] * 3


@pytest.mark.slow
def test_one_compile_per_signature(compiles, rng):
    params, x, y = _mlp_data(rng, batch=3)
    fwd = rs.split(mlp_loss)
    with compiles.counting() as c:
        contexts = [fwd(params, x + i, y)[1] for i in range(6)]
        grads = [fwd.backward(ctx) for ctx in contexts]
        jax.block_until_ready(grads)
        first = c.count
    assert fwd.cache_info().forward_compiles == 1
    assert fwd.cache_info().backward_compiles == 1
    # Exactly the two executables, plus at most the tiny helper ops the test itself runs.
    assert first >= 2
    big_x = jnp.concatenate([x, x])
    big_y = jnp.concatenate([y, y])
    with compiles.counting() as c:
        _, ctx = fwd(params, big_x, big_y)
        jax.block_until_ready(fwd.backward(ctx))
        new_batch = c.count
    assert fwd.cache_info()[:2] == (2, 2)
    assert new_batch == 2
    with compiles.counting() as c:
        for i in range(4):
            _, ctx = fwd(params, x, y)
            jax.block_until_ready(fwd.backward(ctx))
        going_back = c.count
    assert going_back == 0
    assert fwd.cache_info()[:2] == (2, 2)


def test_weights_are_not_copied(mlp_split, rng):
    params, x, y = _mlp_data(rng)
    _, ctx = mlp_split(params, x, y)
    leaves = {id(w): path for path, w in jax.tree_util.tree_flatten_with_path(params)[0]}
    inputs = [r for r, k in zip(ctx.residuals, ctx.spec.kinds) if k == "input"]
    assert inputs, "an MLP's backward needs its weights"
    for r, path in zip(inputs, [p for p, k in zip(ctx.spec.input_paths, ctx.spec.kinds) if k == "input"]):
        assert id(r) in leaves or r is x, path
    intermediate = sum(
        int(np.prod(a.shape)) * a.dtype.itemsize
        for a, k in zip(ctx.spec.avals, ctx.spec.kinds)
        if k == "intermediate"
    )
    weights = sum(w.nbytes for w in jax.tree.leaves(params) if any(w is r for r in ctx.residuals))
    assert ctx.nbytes == intermediate + weights + (x.nbytes if any(x is r for r in ctx.residuals) else 0)


def test_cache_eviction_recompiles(rng):
    fwd = rs.split(lambda x: jnp.sum(jnp.sin(x)), cache_size=1)
    _, c1 = fwd(jnp.ones(3))
    fwd.backward(c1)
    _, c2 = fwd(jnp.ones(4))  # evicts the size-3 executables
    assert fwd.cache_info().currsize == 1
    np.testing.assert_allclose(fwd.backward(c1), jnp.cos(jnp.ones(3)), **F32_TOL)
    assert fwd.cache_info().backward_compiles == 2
    _, c1b = fwd(jnp.ones(3))
    assert c1b.spec.signature == c1.spec.signature
    assert fwd.cache_info().forward_compiles == 3


def test_cache_info_counts_a_resumed_backward_it_keeps():
    """A split that never ran the forward rebuilds and compiles the backward of a context of its
    function: kept, so counted in currsize; hits and misses count calls of the split only."""
    loss = lambda x: jnp.sum(jnp.sin(x))
    _, ctx = rs.split(loss)(jnp.ones(3))
    resumed = rs.split(loss)
    np.testing.assert_allclose(resumed.backward(ctx), jnp.cos(jnp.ones(3)), **F32_TOL)
    resumed.backward(ctx)  # the executable kept: not compiled again
    info = resumed.cache_info()
    assert (info.forward_compiles, info.backward_compiles, info.currsize) == (0, 1, 1)
    assert (info.hits, info.misses) == (0, 0)
    resumed(jnp.ones(3))  # now its forward too: one signature, one entry
    resumed(jnp.ones(3))
    info = resumed.cache_info()
    assert (info.forward_compiles, info.currsize, info.hits, info.misses) == (1, 1, 1, 1)


def test_python_scalars_and_numpy_inputs(rng):
    def f(x, scale):
        return jnp.sum(jnp.sin(x) * scale)

    fwd = rs.split(f)
    x = np.linspace(0, 1, 5, dtype=np.float32)
    out, ctx = fwd(x, 2.0)
    np.testing.assert_allclose(out, f(x, 2.0), **F32_TOL)
    np.testing.assert_allclose(fwd.backward(ctx), 2 * np.cos(x), **F32_TOL)


def _x64(on: bool) -> None:
    jax.config.update("jax_enable_x64", on)


@pytest.mark.slow
def test_a_float64_context_after_x64_is_turned_off_is_refused_by_name(rng):
    """A context made under x64, its backward asked for after x64 was turned off in the same
    process: every way to run it (the split, a fresh split, rs.backward, a B/W split; a context
    whose only 64-bit aval is the output) raises the error a stored one does, saying to turn
    x64 on; with x64 on again it gives jax.grad's gradients."""
    loss = lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)  # noqa: E731
    linear = lambda w: jnp.sum(w * 3.0)  # noqa: E731 - no 64-bit residual, a 64-bit output
    assert not jax.config.jax_enable_x64
    try:
        _x64(True)
        kw, kx = jax.random.split(rng)
        w, x = jax.random.normal(kw, (3, 2), jnp.float64), jax.random.normal(kx, (4, 3), jnp.float64)
        fwd, fwd_linear = rs.split(loss, argnums=(0, 1)), rs.split(linear)
        ctx, ctx_linear = fwd(w, x)[1], fwd_linear(w)[1]
        want = jax.grad(loss, argnums=(0, 1))(w, x)
        _x64(False)
        runs = {
            "split": lambda: fwd.backward(ctx),
            "fresh split": lambda: rs.split(loss, argnums=(0, 1)).backward(ctx),
            "rs.backward": lambda: rs.backward(ctx),
            "B/W": lambda: fwd.backward(ctx, now=1),
            "output": lambda: rs.backward(ctx_linear),
        }
        for name, run in runs.items():
            with pytest.raises(rs.SignatureMismatchError, match=r"is float64.*jax_enable_x64.*running its backward"):
                run()
        _x64(True)
        assert_trees_close(fwd.backward(ctx), want, rtol=1e-12, atol=1e-12)
    finally:
        _x64(False)
