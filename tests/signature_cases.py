"""Functions that old signatures confused, in pairs that compute different things.

Imported by ``tests/test_signature.py`` here and by subprocesses under other ``PYTHONHASHSEED``s
(the signature of each must be the same there). Kept tiny: each case is traced, never compiled,
to compute its signature (``signature_of``)."""

from __future__ import annotations

import json
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

import residual_store as rs

W_SHAPE, X_SHAPE = (4, 2), (3, 4)


def _scaled_grad_loss(scale):
    @jax.custom_vjp
    def scaled_grad(x):
        return x

    scaled_grad.defvjp(lambda x: (x, None), lambda _, g: (g * scale,))
    return lambda w, x: jnp.sum(scaled_grad(x @ w))


def _bwd_code_loss(double):
    @jax.custom_vjp
    def k(x):
        return jnp.sin(x)

    if double:
        k.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (2 * g * c,))
    else:
        k.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (g * c,))
    return lambda w, x: jnp.sum(k(x @ w))


def _clip_loss(bound):
    @partial(jax.custom_vjp, nondiff_argnums=(0,))
    def clip_gradient(b, x):
        return x

    clip_gradient.defvjp(lambda b, x: (x, None), lambda b, _, g: (jnp.clip(g, -b, b),))
    return lambda w, x: jnp.sum(clip_gradient(bound, x @ w))


def _jvp_rule_loss(with_exp):
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    def rule(primals, tangents):
        (p,), (t,) = primals, tangents
        scale = jnp.cos(p) * jnp.exp(p) if with_exp else jnp.cos(p)  # saves 2 residuals vs 1
        return jnp.sin(p), scale * t

    f.defjvp(rule)
    return lambda w, x: jnp.sum(f(x @ w))


def _rule_constant_loss(seed):
    const = jnp.asarray(np.random.default_rng(seed).standard_normal(2), jnp.float32)

    @jax.custom_vjp
    def k(x):
        return x * 2.0

    k.defvjp(lambda x: (x * 2.0, None), lambda _, g: (g * const,))  # a closed-over array in a rule
    return lambda w, x: jnp.sum(k(x @ w))


def _remat_loss(*names):
    policy = jax.checkpoint_policies.save_only_these_names(*names)

    def body(w, x):
        h = checkpoint_name(jnp.tanh(x @ w), "a")
        g = checkpoint_name(jnp.sin(h), "b")
        return jnp.sum(checkpoint_name(jnp.cos(g), "c") ** 2)

    return jax.checkpoint(body, policy=policy)


def set_constant_loss(w, x):
    h = x @ w
    for name in sorted({"tanh", "sin", "exp"}):  # a set constant in the code
        h = getattr(jnp, name)(h)
    return jnp.sum(h)


def set_constant_loss_other(w, x):
    h = x @ w
    for name in sorted({"tanh", "cos", "exp"}):
        h = getattr(jnp, name)(h)
    return jnp.sum(h)


def _host(fn):
    def callback(v):
        if fn in frozenset({"sin", "cos", "tan"}):  # a frozenset constant in the callback's code
            return getattr(np, fn)(v)
        return v

    def loss(w, x):
        h = x @ w
        y = jax.pure_callback(callback, jax.ShapeDtypeStruct(h.shape, h.dtype), jax.lax.stop_gradient(h))
        return jnp.sum(y * h)

    return loss


# name -> (function, split options); pairs that must differ are listed in DISTINCT
CASES = {
    "bwd_closure_0.5": (_scaled_grad_loss(0.5), {}),
    "bwd_closure_2.0": (_scaled_grad_loss(2.0), {}),
    "bwd_code_g": (_bwd_code_loss(False), {}),
    "bwd_code_2g": (_bwd_code_loss(True), {}),
    "nondiff_0.05": (_clip_loss(0.05), {}),
    "nondiff_1.0": (_clip_loss(1.0), {}),
    "jvp_rule_1": (_jvp_rule_loss(False), {}),
    "jvp_rule_2": (_jvp_rule_loss(True), {}),
    "rule_constant_0": (_rule_constant_loss(0), {}),
    "rule_constant_1": (_rule_constant_loss(1), {}),
    "remat_ab": (_remat_loss("a", "b"), {}),
    "remat_abc": (_remat_loss("a", "b", "c"), {}),
    "remat_cba": (_remat_loss("c", "b", "a"), {}),
    "set_constant": (set_constant_loss, {}),
    "set_constant_other": (set_constant_loss_other, {}),
    "callback_sin": (_host("sin"), {}),
    "callback_cos": (_host("cos"), {}),
    "weights_0": (_scaled_grad_loss(0.5), {"argnums": (0, 1)}),
    "weights_01": (_scaled_grad_loss(0.5), {"argnums": (0, 1), "weight_argnums": (0, 1)}),
}
DISTINCT = [
    ("bwd_closure_0.5", "bwd_closure_2.0"),
    ("bwd_code_g", "bwd_code_2g"),
    ("nondiff_0.05", "nondiff_1.0"),
    ("jvp_rule_1", "jvp_rule_2"),
    ("rule_constant_0", "rule_constant_1"),
    ("remat_ab", "remat_abc"),
    ("set_constant", "set_constant_other"),
    ("callback_sin", "callback_cos"),
    ("weights_0", "weights_01"),
]
SAME = [("remat_abc", "remat_cba")]  # one policy: the same set of names


def inputs(seed: int = 0) -> tuple[jax.Array, jax.Array]:
    kw, kx = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kw, W_SHAPE), jax.random.normal(kx, X_SHAPE)


def signature_of(name: str) -> str:
    fun, options = CASES[name]
    return rs.split(fun, **options)(*inputs())[1].spec.signature


if __name__ == "__main__":  # prints {name: signature} for a subprocess
    print(json.dumps({name: signature_of(name) for name in (sys.argv[1:] or CASES)}))
