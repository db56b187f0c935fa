"""``rs.split(..., save="auto")``: fewer residual bytes, the same gradients, nothing expensive or
effectful recomputed: the minimum-cut choice over the forward, scan bodies included (their
rebuild made inside the backward's own scan), on hand-written and library models.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import library_models as lm
import residual_store as rs
from residual_store._src import remat
from store_helpers import run_python, write_script
from test_bw_split import block, block_params, mlp_params, mlp_stage
from test_libraries import assert_close_by_path

LAYERS, D, F = 3, 8, 16


def scan_stage(p, x):
    """Layers under a plain ``lax.scan``: ``jax.vjp`` keeps every layer's intermediates."""

    def layer(h, w):
        z = jnp.tanh(h @ w["a"] + w["c"])
        return jnp.tanh(z @ w["b"]) * 0.5 + h, None

    return jax.lax.scan(layer, x, p)[0]


def scan_params(key):
    k = jax.random.split(key, 3)
    return {"a": jax.random.normal(k[0], (LAYERS, D, F)) / 3, "b": jax.random.normal(k[1], (LAYERS, F, D)) / 4,
            "c": jax.random.normal(k[2], (LAYERS, F)) / 5}


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
    "scan": (scan_stage, scan_params, (4, D), 0.6),
}


@pytest.mark.slow
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
    # what the backward recomputes is cheap: it runs no more matrix products than with "all",
    # and a scan's rebuild happens inside the backward's own scan (no loop of its own)
    count = lambda f, c, names: _count(jax.make_jaxpr(lambda c: f.backward(c))(c), names)  # noqa: E731
    assert count(fwd_auto, c_auto, {"dot_general"}) == count(fwd_all, c_all, {"dot_general"})
    assert count(fwd_auto, c_auto, {"scan", "while"}) == count(fwd_all, c_all, {"scan", "while"})


@pytest.mark.slow
def test_an_opaque_kernel_an_rng_op_and_callbacks_are_never_recomputed():
    """An opaque custom_vjp kernel (host callbacks counting its fwd and bwd runs), a random draw
    and a ``jax.debug.callback``, at the top level and in a scan body: the forward runs each once,
    the backward runs the kernel's bwd once and nothing else of them; only the cheap operations
    around them are recomputed."""
    calls = {"fwd": 0, "bwd": 0, "callback": 0}

    def counted(name, fn):
        def host(*args):
            calls[name] += 1
            return fn(*args)

        return host

    @jax.custom_vjp
    def kernel(x):
        return jnp.sin(x) * 2.0

    def kernel_fwd(x):
        shapes = (jax.ShapeDtypeStruct(x.shape, x.dtype),) * 2
        y, c = jax.pure_callback(counted("fwd", lambda x: (np.sin(x) * 2.0, np.cos(x))), shapes, x)
        return y, c

    def kernel_bwd(c, g):
        out = jax.ShapeDtypeStruct(g.shape, g.dtype)
        return (jax.pure_callback(counted("bwd", lambda c, g: (2.0 * c * g).astype(g.dtype)), out, c, g),)

    kernel.defvjp(kernel_fwd, kernel_bwd)
    tick = counted("callback", lambda: None)

    def loss(w, x, key):
        h = jnp.tanh(x @ w)
        noise = jax.random.normal(key, h.shape)
        jax.debug.callback(tick)

        def layer(a, _):
            jax.debug.callback(tick)
            return jnp.tanh(a) * 1.5, None

        h = jax.lax.scan(layer, h, length=2)[0]
        return jnp.sum(jnp.exp(kernel(h) * noise) ** 2)

    k = jax.random.split(jax.random.key(3), 3)
    w, x = jax.random.normal(k[0], (4, 4)) / 2, jax.random.normal(k[1], (3, 4))
    jax.vjp(lambda w, x: loss(w, x, k[2]), w, x)  # what a forward of jax.vjp runs: the reference
    jax.effects_barrier()
    forward_calls = dict(calls)
    assert forward_calls["fwd"] == 1 and forward_calls["callback"] >= 2, forward_calls
    calls.update(fwd=0, bwd=0, callback=0)
    fwd = rs.split(loss, argnums=(0, 1), save="auto")
    _, ctx = fwd(w, x, k[2])
    jax.effects_barrier()
    assert calls == forward_calls, calls
    grads = fwd.backward(ctx)
    jax.block_until_ready(grads)
    jax.effects_barrier()
    assert calls == {**forward_calls, "bwd": 1}, calls
    want = jax.grad(loss, argnums=(0, 1))(w, x, k[2])
    _close(grads, want, tol=1e-4)
    bwd = jax.make_jaxpr(lambda c: fwd.backward(c))(ctx)
    assert _count(bwd, {"random_bits", "threefry2x32", "random_wrap", "random_seed"}) == 0
    assert _count(bwd, {"debug_callback"}) == 0 and _count(bwd, {"pure_callback"}) == 1
    assert _own(ctx) < _own(rs.split(loss, argnums=(0, 1))(w, x, k[2])[1])


@pytest.mark.slow
def test_scans_reversed_nested_and_under_the_users_policy():
    """A reversed scan, a scan in a scan, and a scan whose body is under the user's own
    ``jax.checkpoint`` policy: the gradients of ``jax.grad``, never more bytes than ``"all"``."""

    def reversed_scan(p, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w["a"] + w["c"]) @ w["b"], None), x, p, reverse=True)[0]

    def nested(p, x):
        def outer(h, w):
            def inner(g, i):
                return jnp.sin(g @ w["a"] * (1.0 + 0.1 * i)) @ w["b"], None

            return jax.lax.scan(inner, h, jnp.arange(2.0))[0] + h, None

        return jax.lax.scan(outer, x, p)[0]

    def user_policy(p, x):
        body = jax.checkpoint(lambda h, w: (jnp.tanh(jnp.tanh(h @ w["a"]) @ w["b"]) + h, None),
                              policy=jax.checkpoint_policies.checkpoint_dots)
        return jax.lax.scan(body, x, p)[0]

    k = jax.random.split(jax.random.key(20), 2)
    params, x = scan_params(k[0]), jax.random.normal(k[1], (4, D))
    for stage in (reversed_scan, nested, user_policy):
        loss = _loss(stage)
        fwd_all, fwd_auto = rs.split(loss, argnums=(0, 1)), rs.split(loss, argnums=(0, 1), save="auto")
        c_all, c_auto = fwd_all(params, x)[1], fwd_auto(params, x)[1]
        _close(fwd_auto.backward(c_auto), jax.grad(loss, argnums=(0, 1))(params, x))
        assert _own(c_auto) <= _own(c_all), stage.__name__
        if stage is not user_policy:
            assert _own(c_auto) < _own(c_all), stage.__name__


@pytest.mark.slow
def test_bf16():
    """bf16 activations: the recomputation runs in bf16 as the forward did, giving what the
    backward of ``"all"`` gives; fewer bytes."""
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), mlp_params(jax.random.key(21)))
    x = jax.random.normal(jax.random.key(22), (16, 8)).astype(jnp.bfloat16)
    loss = lambda p, x: jnp.mean(mlp_stage(p, x).astype(jnp.float32) ** 2)  # noqa: E731
    fwd_all, fwd_auto = rs.split(loss, argnums=(0, 1)), rs.split(loss, argnums=(0, 1), save="auto")
    c_all, c_auto = fwd_all(params, x)[1], fwd_auto(params, x)[1]
    assert {a.dtype for a, k in zip(c_auto.spec.avals, c_auto.spec.kinds) if k == "intermediate"} == {np.dtype(jnp.bfloat16)}
    got = fwd_auto.backward(c_auto)
    _close(jax.tree.map(lambda a: a.astype(jnp.float32), got),
           jax.tree.map(lambda a: a.astype(jnp.float32), fwd_all.backward(c_all)), tol=1e-2)
    _close(jax.tree.map(lambda a: a.astype(jnp.float32), got),
           jax.tree.map(lambda a: a.astype(jnp.float32), jax.grad(loss, argnums=(0, 1))(params, x)), tol=2e-2)
    assert _own(c_auto) <= 0.6 * _own(c_all)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(lm.MAKERS))
def test_library_models(name):
    """Flax NNX and linen, Equinox, Haiku (the library test matrix): ``jax.grad``'s gradients,
    never more bytes than ``"all"``, fewer unless the model's own remat already chose."""
    case = lm.MAKERS[name]()
    args = case.args(jax.random.key(23))
    fwd_all, fwd_auto = case.split(), rs.split(case.fun, save="auto", **case.options)
    c_all, (got, c_auto) = fwd_all(*args)[1], fwd_auto(*args)
    want_out, _, want_grads = lm.reference(case)(*args)
    np.testing.assert_allclose(got[0] if case.has_aux else got, want_out, rtol=1e-5, atol=1e-6)
    assert_close_by_path(fwd_auto.backward(c_auto), want_grads, f"{name} save='auto'")
    if name == "linen_scan":  # nn.scan(nn.remat(Block)): its own remat keeps only the carries
        assert _own(c_auto) <= _own(c_all)
    else:
        assert _own(c_auto) <= 0.65 * _own(c_all), (_own(c_auto), _own(c_all))  # measured 0.24-0.60


def test_bad_save_values_and_a_context_of_the_other_choice():
    with pytest.raises(rs.InvalidArgumentError, match="'all', 'auto'"):
        rs.split(lambda x: jnp.sum(x), save="some")
    loss = _loss(mlp_stage)
    params, x = mlp_params(jax.random.key(4)), jax.random.normal(jax.random.key(5), (16, 8))
    _, ctx = rs.split(loss, argnums=(0, 1), save="auto")(params, x)
    with pytest.raises(rs.SignatureMismatchError, match="save='auto'"):
        rs.split(loss, argnums=(0, 1)).backward(ctx)


_RESUME = """
import sys, jax, numpy as np, residual_store as rs
assert "test_bw_split" not in sys.modules and "test_save_auto" not in sys.modules
with rs.Store(sys.argv[1], read_only=True) as store:
    for key in ("block", "scan"):  # no model here: the stored backward recomputes
        grads = rs.backward(store.get(key))
        np.savez(f"{sys.argv[2]}/{key}.npz", *[np.asarray(g) for g in jax.tree.leaves(grads)])
"""


@pytest.mark.slow
def test_an_auto_context_resumes_without_the_model(tmp_path):
    """A transformer block's and a scan's ``"auto"`` contexts through a store into a process
    without the model (another ``PYTHONHASHSEED``): the gradients of ``jax.grad``."""
    wants = {}
    with rs.Store(tmp_path / "store") as store:
        for key, stage, make, shape in (("block", block, block_params, (2, 8, 8)), ("scan", scan_stage, scan_params, (4, D))):
            loss = _loss(stage)
            params, x = make(jax.random.key(6)), jax.random.normal(jax.random.key(7), shape)
            store.put(rs.split(loss, argnums=(0, 1), save="auto")(params, x)[1], key)
            wants[key] = jax.tree.leaves(jax.grad(loss, argnums=(0, 1))(params, x))
    script = write_script(tmp_path, "resume.py", _RESUME)
    run_python(script, str(tmp_path / "store"), str(tmp_path), env={"PYTHONHASHSEED": "5"})
    for key, want in wants.items():
        got = np.load(tmp_path / f"{key}.npz")
        assert len(got.files) == len(want)
        for i, w in enumerate(want):
            np.testing.assert_allclose(got[f"arr_{i}"], np.asarray(w), rtol=2e-5, atol=2e-5)


@pytest.mark.slow
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


@pytest.mark.slow
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


_C = jnp.arange(1.0, 4.0)


@jax.custom_jvp
def _jvp_closing(x):
    return jnp.sin(x) * _C


_jvp_closing.defjvp(lambda p, t: (jnp.sin(p[0]) * _C, jnp.cos(p[0]) * t[0] * _C))


@jax.custom_vjp
def _fwd_closing(x):
    return jnp.sin(x) * _C


_fwd_closing.defvjp(lambda x: (jnp.sin(x) * _C, (jnp.cos(x) * _C, _C)), lambda r, g: (g * r[0] * r[1] / _C,))


@jax.custom_vjp
def _bwd_closing(x):
    return jnp.sin(x)


_bwd_closing.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda r, g: (g * r * _C,))


def _in_scan(rule):
    return lambda x: jax.lax.scan(lambda h, _: (rule(h) * 0.5 + h, None), x, length=2)[0]


_CLOSING = {"custom_jvp": _jvp_closing, "custom_vjp fwd": _fwd_closing, "custom_vjp bwd": _bwd_closing,
            "custom_jvp in a scan": _in_scan(_jvp_closing)}


@pytest.mark.parametrize("save", ["auto", jax.checkpoint_policies.dots_saveable], ids=["auto", "dots_saveable"])
@pytest.mark.parametrize("name", list(_CLOSING))
def test_custom_rules_closing_over_an_array(name, save, rng):
    """A custom rule whose jvp, fwd or bwd closes over an array: the array is a constant of the
    forward (the backward holds it, the context does not), planned as free to keep; the
    gradients of ``jax.grad``, never more of the context's own bytes than ``"all"``."""
    loss = lambda x: jnp.sum(_CLOSING[name](x) ** 2)  # noqa: E731
    x = jax.random.normal(rng, (3,))
    fwd = rs.split(loss, save=save)
    _, ctx = fwd(x)
    _close(fwd.backward(ctx), jax.grad(loss)(x), tol=1e-5)
    assert _own(ctx) <= _own(rs.split(loss)(x)[1])


def test_internals_a_constant_residual_is_neither_kept_nor_recomputed(rng):
    """A residual that is a constant of the forward's jaxpr: nothing kept, nothing recomputed;
    the rebuild reads it from the constants."""
    c = jax.random.normal(rng, (3,))
    closed = jax.make_jaxpr(lambda x: (x * c, c))(jnp.ones(3))
    assert len(closed.jaxpr.constvars) == 1  # the test's premise: make_jaxpr hoists ``c``
    p = remat.plan(closed.jaxpr, [closed.jaxpr.outvars[1]], [True])
    assert p.kept == () and p.recompute == ()
    np.testing.assert_array_equal(p.rebuild([], closed.consts)[0], c)
