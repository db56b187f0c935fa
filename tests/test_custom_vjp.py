"""Custom kernels (upstream jax issue 21303): fwd once in the forward, bwd once in the backward,
and a RecomputeWarning when remat without optimize_remat makes fwd run twice."""

from __future__ import annotations

import warnings
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual_store as rs

CALLS: Counter = Counter()


def _kernel(name, x):
    """An opaque "kernel": a host callback that counts its executions."""

    def host(v):
        CALLS[name] += 1
        return np.asarray(v)

    return jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def make_kernel(optimize_remat: bool):
    @jax.custom_vjp
    def k(x):
        return _kernel("f", jnp.sin(x))

    def k_fwd(x):
        return _kernel("fwd", jnp.sin(x)), jnp.cos(x)

    def k_bwd(cos_x, g):
        return (_kernel("bwd", g * cos_x),)

    k.defvjp(k_fwd, k_bwd, optimize_remat=optimize_remat)
    return k


def _run(f, x):
    fwd = rs.split(f)
    CALLS.clear()
    out, ctx = fwd(x)
    jax.block_until_ready((out, ctx.residuals))
    after_forward = dict(CALLS)
    CALLS.clear()
    grads = jax.block_until_ready(fwd.backward(ctx))
    return after_forward, dict(CALLS), grads


@pytest.mark.parametrize("optimize_remat", [False, True])
def test_without_remat_fwd_once_bwd_once(optimize_remat, rng):
    k = make_kernel(optimize_remat)
    x = jax.random.normal(rng, (5,))
    f = lambda x: jnp.sum(k(x) ** 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", rs.RecomputeWarning)
        forward, backward, grads = _run(f, x)
    assert forward == {"fwd": 1}
    assert backward == {"bwd": 1}
    np.testing.assert_allclose(grads, 2 * jnp.sin(x) * jnp.cos(x), rtol=1e-5, atol=1e-6)


def test_remat_with_optimize_remat_runs_f_then_fwd_and_bwd(rng):
    k = make_kernel(True)
    x = jax.random.normal(rng, (5,))
    f = jax.checkpoint(lambda x: jnp.sum(k(x) ** 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", rs.RecomputeWarning)
        forward, backward, grads = _run(f, x)
    assert forward == {"f": 1}
    assert backward == {"fwd": 1, "bwd": 1}
    np.testing.assert_allclose(grads, 2 * jnp.sin(x) * jnp.cos(x), rtol=1e-5, atol=1e-6)


def test_remat_without_optimize_remat_warns_once(rng):
    k = make_kernel(False)
    x = jax.random.normal(rng, (5,))
    f = jax.checkpoint(lambda x: jnp.sum(k(x) ** 2))
    with pytest.warns(rs.RecomputeWarning, match=r"k \(defined at test_custom_vjp.py:\d+\) called at") as record:
        forward, backward, grads = _run(f, x)
    assert len([w for w in record if w.category is rs.RecomputeWarning]) == 1
    # This is stock JAX behaviour that the warning explains: fwd runs in both passes.
    assert forward == {"fwd": 1}
    assert backward == {"fwd": 1, "bwd": 1}
    np.testing.assert_allclose(grads, 2 * jnp.sin(x) * jnp.cos(x), rtol=1e-5, atol=1e-6)
    # The same signature does not warn again, even from a new split.
    with warnings.catch_warnings():
        warnings.simplefilter("error", rs.RecomputeWarning)
        rs.split(f)(x)


def test_warning_found_inside_scan(rng):
    k = make_kernel(False)
    xs = jax.random.normal(rng, (3, 4))

    def f(xs):
        body = jax.checkpoint(lambda c, x: (c + jnp.sum(k(x)), None))
        return jax.lax.scan(body, 0.0, xs)[0]

    with pytest.warns(rs.RecomputeWarning, match="1 jax.custom_vjp call"):
        rs.split(f)(xs)
