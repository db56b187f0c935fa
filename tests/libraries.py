"""One small model per library, built the same way in every process (fixed seeds).

Each ``make_<library>()`` returns ``(loss, params, batch)``: ``loss(params, x, y)`` is what a
user splits, ``params`` the library's own parameter pytree (a dict, a partitioned Equinox
module, a Flax NNX ``State``, linen or Haiku variable dicts), ``batch(i)`` gives microbatch ``i``.
Imported by the tests and by the subprocesses that resume their contexts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

IN, HIDDEN, OUT, BATCH = 6, 8, 3, 4


def batch(i: int) -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(jax.random.fold_in(jax.random.key(7), i))
    return jax.random.normal(kx, (BATCH, IN)), jax.random.normal(ky, (BATCH, OUT))


def _mse(pred: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((pred - y) ** 2)


def make_plain() -> tuple[Callable[..., Any], Any]:
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"w1": jax.random.normal(k1, (IN, HIDDEN)) * 0.5, "w2": jax.random.normal(k2, (HIDDEN, OUT)) * 0.5}

    def loss(p, x, y):
        return _mse(jnp.tanh(x @ p["w1"]) @ p["w2"], y)

    return loss, params


def make_equinox() -> tuple[Callable[..., Any], Any]:
    import equinox as eqx

    model = eqx.nn.MLP(IN, OUT, HIDDEN, depth=2, activation=jax.nn.tanh, key=jax.random.key(1))
    params, static = eqx.partition(model, eqx.is_array)

    def loss(p, x, y):
        return _mse(jax.vmap(eqx.combine(p, static))(x), y)

    return loss, params


def make_nnx() -> tuple[Callable[..., Any], Any]:
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.l1 = nnx.Linear(IN, HIDDEN, rngs=rngs)
            self.norm = nnx.LayerNorm(HIDDEN, rngs=rngs)
            self.l2 = nnx.Linear(HIDDEN, OUT, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.l2(jnp.tanh(self.norm(self.l1(x))))

    graphdef, state = nnx.split(Net(nnx.Rngs(2)))

    def loss(s, x, y):
        return _mse(nnx.merge(graphdef, s)(x), y)

    return loss, state


def make_linen() -> tuple[Callable[..., Any], Any]:
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return nn.Dense(OUT)(jnp.tanh(nn.Dense(HIDDEN)(x)))

    net = Net()
    variables = net.init(jax.random.key(3), jnp.zeros((1, IN)))

    def loss(v, x, y):
        return _mse(net.apply(v, x), y)

    return loss, variables


def make_haiku() -> tuple[Callable[..., Any], Any]:
    import haiku as hk

    net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([HIDDEN, OUT], activation=jnp.tanh)(x)))
    params = net.init(jax.random.key(4), jnp.zeros((1, IN)))

    def loss(p, x, y):
        return _mse(net.apply(p, x), y)

    return loss, params


MAKERS = {
    "plain": make_plain,
    "equinox": make_equinox,
    "nnx": make_nnx,
    "linen": make_linen,
    "haiku": make_haiku,
}


def flat(tree: Any) -> dict[str, Any]:
    """A gradient tree as ``{key path: array}`` (comparable across processes and libraries)."""
    return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
