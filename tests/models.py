"""Small models shared by the tests (kept tiny: the suite runs on 2 CPU cores)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def init_mlp(key: jax.Array, sizes: tuple[int, ...] = (8, 16, 16, 4), dtype: Any = jnp.float32) -> dict:
    keys = jax.random.split(key, len(sizes) - 1)
    return {
        "ws": [
            (jax.random.normal(k, (a, b)) / jnp.sqrt(a)).astype(dtype)
            for k, a, b in zip(keys, sizes[:-1], sizes[1:])
        ],
        "bs": [jnp.zeros((b,), dtype) + 0.1 for b in sizes[1:]],
    }


def mlp(params: dict, x: jax.Array) -> jax.Array:
    h = x
    for w, b in zip(params["ws"][:-1], params["bs"][:-1]):
        h = jnp.tanh(h @ w + b)
    return h @ params["ws"][-1] + params["bs"][-1]


def mlp_loss(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((mlp(params, x).astype(jnp.float32) - y) ** 2)
