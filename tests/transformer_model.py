"""The tests' own small transformer (the demo keeps its own): token embedding, layers stacked
on a leading axis under ``lax.scan``, each under ``jax.checkpoint`` saving only the named
attention and MLP outputs, dropout from a typed PRNG key, next-token loss with an accuracy aux.

It exists to exercise what real models do to a split (scan, remat with a names policy, integer
tokens, typed keys, ``has_aux``), not to be a good model: one attention head, no biases.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

VOCAB, WIDTH, HIDDEN, LAYERS, SEQ = 32, 32, 64, 2, 8
DROPOUT = 0.1


def init(key: jax.Array) -> dict[str, Any]:
    """Parameters: ``embed``, and ``layers`` (``wq, wk, wv, wo, w1, w2``, each ``[LAYERS, ...]``)."""
    shapes = {"wq": (WIDTH, WIDTH), "wk": (WIDTH, WIDTH), "wv": (WIDTH, WIDTH), "wo": (WIDTH, WIDTH),
              "w1": (WIDTH, HIDDEN), "w2": (HIDDEN, WIDTH)}
    keys = dict(zip(shapes, jax.random.split(key, len(shapes))))
    layers = {name: jax.random.normal(keys[name], (LAYERS, *shape)) / shape[0] ** 0.5 for name, shape in shapes.items()}
    return {"embed": jax.random.normal(jax.random.fold_in(key, 99), (VOCAB, WIDTH)) * 0.3, "layers": layers}


def _norm(x: jax.Array) -> jax.Array:
    return (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)


def _layer(x: jax.Array, inputs: tuple[dict[str, jax.Array], jax.Array]) -> tuple[jax.Array, None]:
    w, key = inputs
    h = _norm(x)
    scores = (h @ w["wq"]) @ jnp.swapaxes(h @ w["wk"], -1, -2) / WIDTH ** 0.5
    mask = jnp.tril(jnp.ones(scores.shape[-2:], bool))
    attended = jax.nn.softmax(jnp.where(mask, scores, -1e9)) @ (h @ w["wv"])
    attn = checkpoint_name(attended @ w["wo"], "attn_out")
    attn = jnp.where(jax.random.bernoulli(key, 1 - DROPOUT, attn.shape), attn / (1 - DROPOUT), 0.0)
    x = x + attn
    hidden = checkpoint_name(jax.nn.relu(_norm(x) @ w["w1"]), "mlp_hidden")
    return x + hidden @ w["w2"], None


_POLICY = jax.checkpoint_policies.save_only_these_names("attn_out", "mlp_hidden")


def loss(params: dict[str, Any], tokens: jax.Array, key: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean next-token cross entropy of int ``tokens`` ``[batch, SEQ + 1]``, and its accuracy."""
    x = params["embed"][tokens[:, :-1]]
    x, _ = jax.lax.scan(jax.checkpoint(_layer, policy=_POLICY), x, (params["layers"], jax.random.split(key, LAYERS)))
    logits = _norm(x) @ params["embed"].T
    targets = tokens[:, 1:]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)
    return nll.mean(), {"accuracy": (logits.argmax(-1) == targets).mean()}
