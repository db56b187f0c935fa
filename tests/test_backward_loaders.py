"""Stored backwards are found through the loaders of the open stores, held weakly: a collected
or closed store is no longer asked, and each open store loads its own signatures' backwards."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual_store as rs
from residual_store._src.backward import find_backward, loaders, lookup_backward


def _loss_a(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


def _loss_b(w, x):
    return jnp.sum(jnp.sin(x @ w))


def _stored(path, loss, w, x) -> str:
    """Puts one context of ``loss`` at ``path`` (its backward saved), closes the store, and
    drops the split: afterwards only the store holds that signature's backward."""
    fwd = rs.split(loss)
    _, ctx = fwd(w, x)
    sig = ctx.spec.signature
    with rs.Store(path) as store:
        store.put(ctx, "k")
    del fwd, ctx, store
    gc.collect()
    assert lookup_backward(sig) is None
    return sig


def _inputs(rng):
    kw, kx = jax.random.split(rng)
    return jax.random.normal(kw, (4, 3)), jax.random.normal(kx, (5, 4))


def test_internals_a_collected_store_leaves_no_loader(tmp_path):
    before = len(loaders())
    store = rs.Store(tmp_path / "s")
    assert len(loaders()) == before + 1
    del store
    gc.collect()
    assert len(loaders()) == before


def test_internals_a_closed_store_is_not_asked(tmp_path, rng):
    w, x = _inputs(rng)
    sig = _stored(tmp_path / "s", _loss_a, w, x)
    store = rs.Store(tmp_path / "s", read_only=True)
    before = len(loaders())
    store.close()
    assert len(loaders()) == before - 1
    assert find_backward(sig) is None  # the store is alive, but closed: not asked
    del store
    gc.collect()


def test_internals_two_stores_each_find_their_own_backward(tmp_path, rng):
    w, x = _inputs(rng)
    sig_a = _stored(tmp_path / "a", _loss_a, w, x)
    sig_b = _stored(tmp_path / "b", _loss_b, w, x)
    assert sig_a != sig_b
    with rs.Store(tmp_path / "a", read_only=True) as a, rs.Store(tmp_path / "b", read_only=True) as b:
        ctx_a, ctx_b = a.get("k"), b.get("k")
        for ctx, loss in ((ctx_a, _loss_a), (ctx_b, _loss_b)):
            want = jax.grad(loss)(w, x)
            np.testing.assert_allclose(rs.backward(ctx), want, rtol=1e-5, atol=1e-6)
            # a copy holds no stored backward of its own: the open stores' loaders find it
            copy = jax.tree.map(lambda v: v, ctx)
            np.testing.assert_allclose(rs.backward(copy), want, rtol=1e-5, atol=1e-6)
    del a, b, ctx_a, ctx_b, ctx, copy
    gc.collect()
    assert lookup_backward(sig_a) is None and lookup_backward(sig_b) is None


def test_internals_an_open_store_loads_a_backward_no_context_of_it_was_read_for(tmp_path, rng):
    w, x = _inputs(rng)
    sig = _stored(tmp_path / "s", _loss_b, w, x)
    with rs.Store(tmp_path / "s", read_only=True) as store:
        bwd = find_backward(sig)
        assert bwd is not None
        fresh = jax.random.normal(jax.random.fold_in(rng, 1), x.shape)
        fwd = rs.split(_loss_b)
        _, ctx = fwd(w, fresh)
        np.testing.assert_allclose(bwd(ctx), jax.grad(_loss_b)(w, fresh), rtol=1e-5, atol=1e-6)
    del store, bwd, fwd, ctx
    gc.collect()


class _Unreachable:
    """A loader whose store cannot be reached (an object store that stopped answering)."""

    calls = 0

    def load_backward(self, signature: str):
        self.calls += 1
        raise rs.StoreUnavailableError("the object store did not answer")


def test_internals_an_unreachable_store_does_not_hide_another_that_has_the_backward(tmp_path, rng):
    w, x = _inputs(rng)
    sig = _stored(tmp_path / "s", _loss_a, w, x)
    down = _Unreachable()
    with rs.Store(tmp_path / "s", read_only=True) as store:
        # the unreachable loader is asked first (as a context's own would be), then the open store
        bwd = find_backward(sig, down)
        assert bwd is not None and down.calls == 1
        fresh = jax.random.normal(jax.random.fold_in(rng, 2), x.shape)
        _, ctx = rs.split(_loss_a)(w, fresh)
        np.testing.assert_allclose(bwd(ctx), jax.grad(_loss_a)(w, fresh), rtol=1e-5, atol=1e-6)
        # no store has an unknown signature: the unreachable one's error says why
        with pytest.raises(rs.StoreUnavailableError, match="did not answer"):
            find_backward("0" * len(sig), down)
        assert find_backward("0" * len(sig)) is None
    del store, bwd, ctx
    gc.collect()
