"""Keyword arguments, as ``jax.grad`` and ``jax.jit`` take them: never differentiated, traced
unless named in ``static_argnames``, part of the signature and of the context's record, so a
context made with keywords resumes here and in another process, with the model and without it.

The model-free reader never imports this module; the reader with the model imports it for
``FWD`` and ``FWD_AUTO`` (the splits below), and rebuilds their backwards from the records.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual_store as rs
from store_helpers import F32_TOL, assert_trees_close, flat_tree, run_python, write_script

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def _kw_loss(params, x, *, mask, scale, train=False):
    """A loss with a traced array keyword (``mask``), a traced pytree keyword (``scale``) and a
    Python flag (``train``) that changes what is computed."""
    h = jnp.tanh(x @ params["w1"] + params["b"])
    h = h * (1.0 + 0.5 * mask) if train else h * mask
    out = jnp.sin(h @ params["w2"]) * scale["a"]
    return jnp.mean(out**2)


FWD = rs.split(_kw_loss, argnums=(0, 1), static_argnames="train")
FWD_AUTO = rs.split(_kw_loss, argnums=(0, 1), static_argnames=("train",), save="auto", weight_argnums=0)


def _inputs(key):
    k1, k2, k3, k4, k5, k6 = jax.random.split(key, 6)
    params = {
        "w1": jax.random.normal(k1, (5, 6)) / 2,
        "b": jax.random.normal(k2, (6,)) * 0.1,
        "w2": jax.random.normal(k3, (6, 3)) / 2,
    }
    x = jax.random.normal(k4, (4, 5))
    mask = (jax.random.uniform(k5, (4, 6)) > 0.4).astype(jnp.float32)
    scale = {"a": 1.0 + jax.random.uniform(k6, ())}
    return params, x, mask, scale


# jax.grad's gradients, compiled once per ``train`` (run eagerly, each operation compiles anew)
_GRAD = jax.jit(jax.grad(_kw_loss, argnums=(0, 1)), static_argnames="train")


def _want(params, x, mask, scale, train):
    return _GRAD(params, x, mask=mask, scale=scale, train=train)


# ----------------------------------------------------------------------------------------------
# Gradients


@pytest.mark.parametrize("train", [True, False])
def test_traced_and_static_keywords_give_jax_grads_gradients(rng, train):
    params, x, mask, scale = _inputs(rng)
    fwd = rs.split(_kw_loss, argnums=(0, 1), static_argnames="train")
    value, ctx = fwd(params, x, train=train, mask=mask, scale=scale)
    np.testing.assert_allclose(value, _kw_loss(params, x, mask=mask, scale=scale, train=train), **F32_TOL)
    assert_trees_close(fwd.backward(ctx), _want(params, x, mask, scale, train), **F32_TOL)
    assert_trees_close(rs.backward(ctx), _want(params, x, mask, scale, train), **F32_TOL)
    # the keywords' arrays are the context's own inputs, named by keyword; the weights are shared
    kinds = dict(zip(ctx.spec.input_paths, ctx.spec.kinds))
    assert kinds["scale['a']"] == "input" and kinds.get("mask", "input") == "input"
    assert kinds["params['w2']"] == "weight"
    assert ctx.spec.call.kwnames == ("mask", "scale")
    assert ctx.spec.call.static_kwargs == (("train", train),)


def test_a_keyword_inside_jax_jit_is_traced_and_the_backward_inlined(rng):
    params, x, mask, scale = _inputs(rng)

    @jax.jit
    def step(p, x, m, s):
        _, ctx = FWD(p, x, mask=m, scale=s, train=True)
        return FWD.backward(ctx)

    assert_trees_close(step(params, x, mask, scale), _want(params, x, mask, scale, True), **F32_TOL)


def test_keywords_of_a_function_taking_any_keywords_are_named_in_the_signature(rng):
    def f(w, **kw):
        return jnp.sum(jnp.tanh(w) * kw["a"]) + sum(jnp.sum(w * v) for k, v in sorted(kw.items()) if k != "a")

    ka, kb, kw = jax.random.split(rng, 3)
    a, b, w = (jax.random.normal(k, (3,)) for k in (ka, kb, kw))
    fwd = rs.split(f)
    _, ctx_ab = fwd(w, a=a, b=b)
    _, ctx_ba = fwd(w, b=b, a=a)  # the order a caller writes keywords in is not a new signature
    _, ctx_ac = fwd(w, a=a, c=b)  # another name with the same avals is
    _, ctx_a64 = fwd(w, a=a, b=b[:1])  # another aval is
    assert ctx_ab.spec.signature == ctx_ba.spec.signature
    assert len({ctx_ab.spec.signature, ctx_ac.spec.signature, ctx_a64.spec.signature}) == 3
    assert fwd.cache_info().forward_compiles == 3 and fwd.cache_info().hits == 1
    assert_trees_close(fwd.backward(ctx_ba), jax.grad(f)(w, a=a, b=b), **F32_TOL)
    assert_trees_close(fwd.backward(ctx_ac), jax.grad(f)(w, a=a, c=b), **F32_TOL)


def test_each_static_value_is_its_own_signature_and_compiles_once(rng):
    params, x, mask, scale = _inputs(rng)
    fwd = rs.split(_kw_loss, argnums=(0, 1), static_argnames="train")
    signatures: dict[object, set[str]] = {}
    for train in (True, False, 1, True, False, 1):  # True == 1, yet not the same static value
        _, ctx = fwd(params, x, mask=mask, scale=scale, train=train)
        signatures.setdefault((type(train), train), set()).add(ctx.spec.signature)
        assert_trees_close(fwd.backward(ctx), _want(params, x, mask, scale, train), **F32_TOL)
    assert all(len(s) == 1 for s in signatures.values())
    assert len(set.union(*signatures.values())) == 3
    info = fwd.cache_info()
    assert (info.forward_compiles, info.backward_compiles, info.hits) == (3, 3, 3)
    _, ctx = fwd(params, x, mask=mask, scale=scale)  # not passed: fun's default, as jax.jit does
    assert_trees_close(fwd.backward(ctx), _want(params, x, mask, scale, False), **F32_TOL)
    assert ctx.spec.call.static_kwargs == () and fwd.cache_info().forward_compiles == 4


def test_save_auto_the_bw_split_and_weight_argnums_with_keywords(rng):
    params, x, mask, scale = _inputs(rng)
    want = _want(params, x, mask, scale, True)
    _, ctx = FWD_AUTO(params, x, mask=mask, scale=scale, train=True)
    assert_trees_close(FWD_AUTO.backward(ctx), want, **F32_TOL)
    dx, later = FWD_AUTO.backward(ctx, now=1)
    assert_trees_close(dx, want[1], **F32_TOL)
    assert_trees_close(rs.backward(later), want[0], **F32_TOL)
    assert later.spec.call.kwnames == ("mask", "scale") and later.spec.call.static_kwargs == (("train", True),)
    assert {k for k, p in zip(ctx.spec.kinds, ctx.spec.input_paths) if p and p.startswith("params")} == {"weight"}


def test_a_context_with_keywords_resumes_through_a_store_with_a_fresh_split(rng, tmp_path):
    params, x, mask, scale = _inputs(rng)
    with rs.Store(tmp_path / "store") as store:
        store.put(FWD(params, x, mask=mask, scale=scale, train=False)[1], "plain")
        _, later = FWD.backward(FWD(params, x, mask=mask, scale=scale, train=True)[1], now=1)
        store.put(later, "later")
    with rs.Store(tmp_path / "store", read_only=True) as store:
        fresh = rs.split(_kw_loss, argnums=(0, 1), static_argnames="train")  # never ran a forward
        assert_trees_close(fresh.backward(store.get("plain")), _want(params, x, mask, scale, False), **F32_TOL)
        assert_trees_close(fresh.backward(store.get("later")), _want(params, x, mask, scale, True)[0], **F32_TOL)
        assert fresh.cache_info().forward_compiles == 0
        # a split that would trace train, or that is given other static names, does not make them
        for other in (rs.split(_kw_loss, argnums=(0, 1)), rs.split(_kw_loss, argnums=(0, 1), static_argnames="scale")):
            with pytest.raises(rs.SignatureMismatchError, match="static_argnames"):
                other.backward(store.get("plain"))


# ----------------------------------------------------------------------------------------------
# Libraries: Flax linen's deterministic=, Equinox's key=


@pytest.mark.slow  # imports Flax
def test_a_flax_linen_module_with_deterministic_static_and_its_dropout_key_traced(rng):
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, *, deterministic):
            h = nn.Dropout(0.5)(jnp.tanh(nn.Dense(8)(x)), deterministic=deterministic)
            return nn.Dense(2)(h)

    net = Net()
    k_init, kx, ky, k_drop = jax.random.split(rng, 4)
    variables = net.init(k_init, jnp.zeros((1, 5)), deterministic=True)
    x, y = jax.random.normal(kx, (4, 5)), jax.random.normal(ky, (4, 2))

    def loss(v, x, y, *, deterministic, dropout_key):
        pred = net.apply(v, x, deterministic=deterministic, rngs={"dropout": dropout_key})
        return jnp.mean((pred - y) ** 2)

    fwd = rs.split(loss, static_argnames="deterministic")
    grads = {}
    for det in (True, False):
        _, ctx = fwd(variables, x, y, deterministic=det, dropout_key=k_drop)
        grads[det] = fwd.backward(ctx)
        assert_trees_close(grads[det], jax.grad(loss)(variables, x, y, deterministic=det, dropout_key=k_drop), **F32_TOL)
    assert not np.allclose(grads[True]["params"]["Dense_0"]["kernel"], grads[False]["params"]["Dense_0"]["kernel"])
    assert fwd.cache_info().forward_compiles == 2


@pytest.mark.slow  # imports Equinox
def test_an_equinox_module_called_with_key(rng):
    import equinox as eqx

    k1, k2, kx, ky, k_drop = jax.random.split(rng, 5)
    model = (eqx.nn.Linear(5, 8, key=k1), eqx.nn.Dropout(0.4), eqx.nn.Linear(8, 2, key=k2))
    x, y = jax.random.normal(kx, (4, 5)), jax.random.normal(ky, (4, 2))

    def loss(model, x, y, *, key, inference=False):
        lin1, drop, lin2 = model
        keys = jax.random.split(key, x.shape[0])
        pred = jax.vmap(lambda xi, ki: lin2(drop(jnp.tanh(lin1(xi)), key=ki, inference=inference)))(x, keys)
        return jnp.mean((pred - y) ** 2)

    fwd = rs.split(loss, filter=rs.is_inexact, static_argnames="inference")
    _, ctx = fwd(model, x, y, key=k_drop)
    got = fwd.backward(ctx)
    want = eqx.filter_grad(loss)(model, x, y, key=k_drop)
    assert_trees_close(eqx.filter(got, eqx.is_array), eqx.filter(want, eqx.is_array), **F32_TOL)
    assert "key" in ctx.spec.call.kwnames
    _, ctx_inf = fwd(model, x, y, key=k_drop, inference=True)
    want_inf = eqx.filter_grad(loss)(model, x, y, key=k_drop, inference=True)
    assert_trees_close(eqx.filter(fwd.backward(ctx_inf), eqx.is_array), eqx.filter(want_inf, eqx.is_array), **F32_TOL)
    assert ctx_inf.spec.signature != ctx.spec.signature


# ----------------------------------------------------------------------------------------------
# Bad keywords


def _needs(params, x, *, mask, train):
    return jnp.sum(jnp.tanh(x @ params["w1"]) * mask[:, :1]) * (2.0 if train else 1.0)


def _positional_train(params, x, mask, train=False):
    return _needs(params, x, mask=mask, train=train)


@pytest.mark.parametrize(
    "make, call, match",
    [
        (lambda: rs.split(_needs, static_argnames="train"), lambda f, p, x, m: f(p, x, mask=m, train=[1]),
         r"keyword train \(list\)"),
        (lambda: rs.split(_needs, static_argnames="train"), lambda f, p, x, m: f(p, x, mask=m),
         "'train', which this call does not pass"),
        (lambda: rs.split(_positional_train, static_argnames="train"), lambda f, p, x, m: f(p, x, m, True),
         "train is in static_argnames but passed positionally"),
        (lambda: rs.split(_positional_train), lambda f, p, x, m: f(p, x, m, train=True, mask=m),
         "mask is passed both positionally"),
        (lambda: rs.split(_needs, argnums=(0, 1)), lambda f, p, x, m: f(p, x=x, mask=m, train=True),
         r"x \(argument 1\) is in argnums"),
        (lambda: rs.split(_needs), lambda f, p, x, m: f(p, x, mask=m, train=True),
         "static_argnames for a keyword|a keyword in static_argnames"),
        (lambda: rs.split(_needs, static_argnames="train"), lambda f, p, x, m: f(p, x, mask="ones", train=True),
         "argument mask is a builtins.str.*static_argnames"),
    ],
    ids=["unhashable-static", "static-not-passed", "static-passed-positionally", "twice", "differentiated-keyword",
         "python-flag-traced", "string-traced"],
)
def test_bad_keywords_are_refused_naming_the_argument(rng, make, call, match):
    params, x, mask, _ = _inputs(rng)
    fwd = make()
    with pytest.raises(rs.InvalidArgumentError, match=match):
        call(fwd, params, x, mask)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"static_argnames": "nope"}, "'nope', which _needs does not take"),
        ({"static_argnames": 3}, "static_argnames must hold parameter names"),
        ({"static_argnames": ("train", "train")}, "repeated"),
        ({"static_argnames": "params"}, "'params', argument 0, which argnums differentiates"),
    ],
)
def test_bad_static_argnames_are_refused_when_the_split_is_made(options, match):
    with pytest.raises(rs.InvalidArgumentError, match=match):
        rs.split(_needs, **options)


# ----------------------------------------------------------------------------------------------
# Another process: with the model (a split rebuilds the backward from the record), without it


READER = """
import json, os, sys
import numpy as np, jax, residual_store as rs
root, out, mode, tests = sys.argv[1:5]
if mode == "model":
    sys.path.insert(0, tests)
    import test_split_keywords as t
    splits = {"plain": t.FWD, "auto": t.FWD_AUTO}
with rs.Store(root, read_only=True) as store:
    for key in store.keys():
        ctx = store.get(key)
        grads = splits[key.split("-")[0]].backward(ctx) if mode == "model" else rs.backward(ctx)
        leaves = jax.tree_util.tree_flatten_with_path(grads)[0]
        np.savez(f"{out}/{mode}-{key}.npz", **{jax.tree_util.keystr(p): np.asarray(g) for p, g in leaves})
report = {"seed": os.environ.get("PYTHONHASHSEED"), "imported": "test_split_keywords" in sys.modules}
if mode == "model":
    report["forward_compiles"] = t.FWD.cache_info().forward_compiles + t.FWD_AUTO.cache_info().forward_compiles
print(json.dumps(report))
"""


@pytest.mark.subprocess
def test_a_context_made_with_keywords_resumes_in_other_processes_with_and_without_the_model(rng, tmp_path):
    params, x, mask, scale = _inputs(rng)
    want = {
        "plain-t": _want(params, x, mask, scale, True),
        "plain-f": _want(params, x, mask, scale, False),
        "auto-t": _want(params, x, mask, scale, True),
        "plain-later": _want(params, x, mask, scale, True)[0],
    }
    root, out = tmp_path / "store", tmp_path / "out"
    out.mkdir()
    with rs.Store(root) as store:
        store.put(FWD(params, x, mask=mask, scale=scale, train=True)[1], "plain-t")
        store.put(FWD(params, x, scale=scale, mask=mask, train=False)[1], "plain-f")
        store.put(FWD_AUTO(params, x, mask=mask, scale=scale, train=True)[1], "auto-t")
        store.put(FWD.backward(FWD(params, x, mask=mask, scale=scale, train=True)[1], now=1)[1], "plain-later")
    script = write_script(tmp_path, "reader.py", READER)
    for mode, seed in (("model", "1"), ("free", "2")):
        proc = run_python(script, str(root), str(out), mode, TESTS_DIR, env={"PYTHONHASHSEED": seed})
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        assert report["seed"] == seed and report["imported"] == (mode == "model")
        if mode == "model":
            assert report["forward_compiles"] == 0  # rebuilt from the records, nothing run
        for key, grads in want.items():
            got = dict(np.load(out / f"{mode}-{key}.npz"))
            ref = flat_tree(grads)
            assert got.keys() == ref.keys(), (mode, key)
            for k in ref:
                np.testing.assert_allclose(got[k], ref[k], **F32_TOL, err_msg=f"{mode} {key} {k}")
