"""A small transformer: scan over layers with jax.checkpoint and a names policy, dropout from a
typed PRNG key argument, integer tokens, has_aux."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual_store as rs
from store_helpers import jitted_value_and_grad
from transformer_model import SEQ, VOCAB, init
from transformer_model import loss as loss_fn


@pytest.fixture(scope="module")
def fwd():
    return rs.split(loss_fn, has_aux=True)


_init = jax.jit(init)  # one compile for every test, where run eagerly each op compiles on its own


def _batch(rng, batch=3):
    kp, kt, kd = jax.random.split(rng, 3)
    params = _init(kp)
    tokens = jax.random.randint(kt, (batch, SEQ + 1), 0, VOCAB)
    return params, tokens, kd


@pytest.mark.slow
def test_gradients_match_jax_grad(fwd, rng):
    params, tokens, key = _batch(rng)
    (loss, aux), ctx = fwd(params, tokens, key)
    (ref_loss, ref_aux), ref = jitted_value_and_grad(loss_fn, has_aux=True)(params, tokens, key)  # (eagerly: a minute)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(aux["accuracy"], ref_aux["accuracy"])
    grads = fwd.backward(ctx)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)
        assert float(jnp.abs(r).max()) > 0


@pytest.mark.slow
def test_dropout_key_changes_output_and_gradients(fwd, rng):
    params, tokens, key = _batch(rng)
    (l1, _), c1 = fwd(params, tokens, key)
    (l2, _), c2 = fwd(params, tokens, jax.random.fold_in(key, 1))
    assert float(l1) != float(l2)
    assert c1.spec.signature == c2.spec.signature
    g1, g2 = fwd.backward(c1), fwd.backward(c2)
    assert not np.allclose(g1["layers"]["w1"], g2["layers"]["w1"])


@pytest.mark.slow  # seconds of its own: the fast tier aims at 90 s
def test_residual_names_follow_checkpoint_policy(fwd, rng):
    params, tokens, key = _batch(rng)
    _, ctx = fwd(params, tokens, key)
    names = ctx.spec.names
    assert any(n.startswith("attn_out") for n in names), names
    assert any(n.startswith("mlp_hidden") for n in names), names
    # Weights the backward needs are inputs, named by their path, and not copied.
    w1 = names.index("input params['layers']['w1']")
    assert ctx.spec.input_paths[w1] == "params['layers']['w1']"
    assert ctx.residuals[w1] is params["layers"]["w1"]
    # Every intermediate has a primitive or label, and most carry a source line.
    intermediates = [n for n, k in zip(names, ctx.spec.kinds) if k == "intermediate"]
    with_line = [n for n in intermediates if ".py:" in n]
    assert len(with_line) >= len(intermediates) // 2, intermediates
    # The typed key survives as a residual dtype.
    key_avals = [a for a in ctx.spec.avals if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)]
    assert key_avals and str(key_avals[0].dtype) == "key<fry>"


def test_integer_tokens_cannot_be_differentiated(rng):
    params, tokens, key = _batch(rng)
    fwd = rs.split(loss_fn, argnums=(0, 1), has_aux=True)
    with pytest.raises(rs.InvalidArgumentError, match=r"argument tokens has dtype int32"):
        fwd(params, tokens, key)
