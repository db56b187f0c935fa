"""Bad input gets a clear error from the library's own hierarchy, never a JAX internal traceback."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import residual_store as rs


def f(w, x):
    return {"y": jnp.tanh(x @ w), "s": jnp.sum(x @ w)}


def scalar(w, x):
    return jnp.sum(jnp.tanh(x @ w))


@pytest.fixture(scope="module")
def fwd():
    return rs.split(f)


@pytest.fixture(scope="module")
def data():
    k1, k2 = jax.random.split(jax.random.key(11))
    return jax.random.normal(k1, (3, 2)), jax.random.normal(k2, (4, 3))


def _ct(out):
    return jax.tree.map(jnp.ones_like, out)


def test_hierarchy():
    pairs = [
        (rs.SignatureMismatchError, ValueError),
        (rs.InvalidArgumentError, TypeError),
        (rs.ContextNotFoundError, KeyError),
        (rs.InvalidKeyError, ValueError),
        (rs.CorruptContextError, rs.ResidualStoreError),
        (rs.StoreFullError, rs.ResidualStoreError),
        (rs.BackwardUnavailableError, rs.ResidualStoreError),
    ]
    for cls, base in pairs:
        assert issubclass(cls, rs.ResidualStoreError) and issubclass(cls, base)
    assert issubclass(rs.RecomputeWarning, rs.ResidualStoreWarning)
    assert issubclass(rs.ResidualStoreWarning, UserWarning)


def test_errors_are_named_where_users_find_them(tmp_path):
    import pickle
    import traceback

    for name in ("ContextNotFoundError", "CorruptContextError", "RecomputeWarning", "ResidualStoreError"):
        cls = getattr(rs, name)
        assert f"{cls.__module__}.{cls.__qualname__}" == f"residual_store.{name}"
    with rs.Store(tmp_path / "s") as store:
        with pytest.raises(rs.ContextNotFoundError) as err:
            store.get("k")
        missing = f"no context 'k' in store {tmp_path / 's'}"  # one form: the store's place, as its own parts say it
        assert str(err.value) == missing
        assert traceback.format_exception_only(err.value)[-1] == f"residual_store.ContextNotFoundError: {missing}\n"
        again = pickle.loads(pickle.dumps(err.value))  # (multiprocessing sends errors pickled)
        assert type(again) is rs.ContextNotFoundError and str(again) == missing


def test_context_from_another_split(fwd, data):
    w, x = data
    _, other = rs.split(scalar)(w, x)
    with pytest.raises(rs.SignatureMismatchError, match="is not one Split.* makes"):
        fwd.backward(other, None)


def test_context_with_unknown_signature():
    aval = jax.ShapeDtypeStruct((2,), jnp.float32)
    spec = rs.ResidualSpec("rs1-unknown", (aval,), ("x",), (None,), ("intermediate",))
    ctx = rs.ResidualContext([jnp.ones(2)], spec)
    with pytest.raises(rs.BackwardUnavailableError, match="rs1-unknown"):
        rs.backward(ctx)


@pytest.mark.parametrize(
    "make_ct, message",
    [
        (lambda out: None, "only for a scalar floating output"),
        (lambda out: out["y"], "structure does not match"),
        (lambda out: {"y": out["y"], "s": out["s"], "z": 1.0}, "structure does not match"),
        (lambda out: {"y": jnp.ones((4, 3)), "s": out["s"]}, r"must be float32\[4, 2\].*got float32\[4, 3\]"),
        (lambda out: {"y": out["y"].astype(jnp.bfloat16), "s": out["s"]}, r"got bfloat16\[4, 2\]"),
        (lambda out: {"y": "nope", "s": out["s"]}, "got str"),
    ],
)
def test_bad_cotangents(fwd, data, make_ct, message):
    w, x = data
    out, ctx = fwd(w, x)
    with pytest.raises(rs.SignatureMismatchError, match=message):
        fwd.backward(ctx, make_ct(out))
    # The context is still good afterwards.
    grads = fwd.backward(ctx, _ct(out))
    _, vjp = jax.vjp(f, w, x)
    assert jnp.allclose(grads, vjp(_ct(out))[0], atol=1e-6)


def test_wrong_number_of_arguments(data):
    w, x = data
    with pytest.raises(rs.SignatureMismatchError, match="called with 1 arguments"):
        rs.split(scalar, argnums=1)(w)
    with pytest.raises(rs.SignatureMismatchError, match="too many positional arguments"):
        rs.split(scalar)(w, x, x)


def test_python_object_where_an_array_must_be(data):
    w, x = data
    with pytest.raises(rs.InvalidArgumentError, match=r"argument x\['bad'\] is a builtins.object"):
        rs.split(lambda w, x: jnp.sum(w))(w, {"bad": object()})


def test_keyword_arguments_unhashable_statics_and_bad_aux(data):
    w, x = data
    with pytest.raises(rs.InvalidArgumentError, match="is in argnums: the arguments a split differentiates are passed positionally"):
        rs.split(scalar)(x=x, w=w)
    with pytest.raises(rs.InvalidArgumentError, match="passed both positionally"):
        rs.split(scalar)(w, w=w)
    with pytest.raises(rs.InvalidArgumentError, match="hashable"):
        rs.split(lambda w, n: jnp.sum(w), static_argnums=1)(w, [1, 2])
    with pytest.raises(rs.InvalidArgumentError, match="has_aux=True needs"):
        rs.split(scalar, has_aux=True)(w, x)


def test_bad_split_arguments():
    with pytest.raises(rs.InvalidArgumentError, match="callable"):
        rs.split(3)
    with pytest.raises(rs.InvalidArgumentError, match="argnums"):
        rs.split(scalar, argnums=-1)
    with pytest.raises(rs.InvalidArgumentError, match="both argnums and static_argnums"):
        rs.split(scalar, argnums=0, static_argnums=0)
    for size in (0, -1, 1.5, True):  # the library's error (a TypeError), as for every argument
        with pytest.raises(rs.InvalidArgumentError, match="cache_size must be a positive int"):
            rs.split(scalar, cache_size=size)


def test_backward_of_something_else(fwd):
    with pytest.raises(rs.InvalidArgumentError, match="ResidualContext"):
        fwd.backward({"not": "a context"})
    with pytest.raises(rs.InvalidArgumentError, match="ResidualContext"):
        rs.backward([1, 2])


def test_tampered_residuals(fwd, data):
    w, x = data
    out, ctx = fwd(w, x)
    bad = jax.tree.map(lambda r: jnp.zeros((1,) + r.shape, r.dtype), ctx)
    with pytest.raises(rs.SignatureMismatchError, match=r"residual \d+ .* must be"):
        fwd.backward(bad, _ct(out))
