"""ResidualContext and ResidualSpec: a pytree that survives JAX transformations, typed keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual_store as rs


def f(w, x, key):
    keep = jax.random.bernoulli(key, 0.7, x.shape)
    h = jnp.where(keep, jnp.tanh(x @ w), 0.0)
    return jnp.sum(h**2)


@pytest.fixture(scope="module")
def fwd():
    return rs.split(f)


def _inputs(rng):
    kw, kx, kd = jax.random.split(rng, 3)
    return jax.random.normal(kw, (4, 4)), jax.random.normal(kx, (3, 4)), kd


@pytest.mark.slow
def test_context_is_a_pytree(fwd, rng):
    w, x, key = _inputs(rng)
    _, ctx = fwd(w, x, key)
    leaves, treedef = jax.tree.flatten(ctx)
    assert len(leaves) == len(ctx.spec.avals)
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert rebuilt.spec == ctx.spec and hash(rebuilt.spec) == hash(ctx.spec)
    copied = jax.tree.map(lambda r: r.copy(), ctx)
    moved = jax.device_put(ctx, jax.devices()[0])
    through_jit = jax.jit(lambda c: c)(ctx)
    ref = jax.grad(f)(w, x, key)
    for c in (rebuilt, copied, moved, through_jit):
        assert isinstance(c, rs.ResidualContext)
        np.testing.assert_allclose(rs.backward(c), ref, rtol=1e-5, atol=1e-6)


def test_spec_describes_each_leaf(fwd, rng):
    w, x, key = _inputs(rng)
    _, ctx = fwd(w, x, key)
    spec = ctx.spec
    assert len(spec.names) == len(spec.input_paths) == len(spec.kinds) == len(spec.avals)
    for r, aval in zip(ctx.residuals, spec.avals):
        assert isinstance(aval, jax.ShapeDtypeStruct)
        assert r.shape == aval.shape and r.dtype == aval.dtype
    assert spec.input_paths[spec.names.index("input x")] == "x"
    table = ctx.describe()
    assert "input x" in table and "intermediate" in table and spec.signature in table
    assert str(ctx.nbytes).replace(",", "") in table.replace(",", "")


@pytest.mark.slow
def test_typed_key_residual_stays_typed(rng):
    def g(x, key):
        # Under remat the key itself must be kept to recompute the mask.
        body = jax.checkpoint(lambda x, key: jnp.sum(jnp.where(jax.random.bernoulli(key, 0.5, x.shape), x**2, 0.0)))
        return body(x, key)

    x = jax.random.normal(rng, (6,))
    key = jax.random.key(3, impl="threefry2x32")
    _, ctx = rs.split(g)(x, key)
    kinds = {str(a.dtype) for a in ctx.spec.avals}
    assert "key<fry>" in kinds
    index = [str(a.dtype) for a in ctx.spec.avals].index("key<fry>")
    assert jax.dtypes.issubdtype(ctx.residuals[index].dtype, jax.dtypes.prng_key)
    assert ctx.spec.input_paths[index] == "key"
    np.testing.assert_allclose(rs.backward(ctx), jax.grad(g)(x, key), rtol=1e-6)


def test_closed_over_constants_are_held_not_copied(rng):
    weights = jax.random.normal(rng, (4, 4))
    g = lambda x: jnp.sum(jnp.tanh(x @ weights))
    _, ctx = rs.split(g)(jnp.ones((2, 4)))
    assert "constant" in ctx.spec.kinds
    const = ctx.residuals[ctx.spec.kinds.index("constant")]
    assert const is weights
    assert ctx.spec.input_paths[ctx.spec.kinds.index("constant")] is None


def test_spec_rejects_inconsistent_fields():
    aval = jax.ShapeDtypeStruct((2,), jnp.float32)
    with pytest.raises(ValueError, match="disagree in length"):
        rs.ResidualSpec("s", (aval,), ("a", "b"), (None,), ("intermediate",))
    spec = rs.ResidualSpec("s", (aval,), ("a",), (None,), ("intermediate",))
    with pytest.raises(ValueError, match="needs 1 residual arrays, got 2"):
        rs.ResidualContext([jnp.ones(2), jnp.ones(2)], spec)


def test_pickling_a_context_points_to_a_store_and_copies_still_run(fwd, rng):
    import copy
    import pickle

    w, x, key = _inputs(rng)
    _, ctx = fwd(w, x, key)
    with pytest.raises(rs.InvalidArgumentError, match=r"cannot be pickled .*put it in a Store") as err:
        pickle.dumps(ctx)
    assert isinstance(err.value, TypeError)  # what pickle raises for what it cannot pickle
    ref = rs.backward(ctx)
    for c in (copy.copy(ctx), copy.deepcopy(ctx)):  # copies still carry the backward
        assert c.spec == ctx.spec
        np.testing.assert_array_equal(rs.backward(c), ref)
