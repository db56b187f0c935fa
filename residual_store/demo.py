"""The README's main job: a small transformer trained with a pipeline-style schedule.

Each step splits the batch into microbatches, runs every forward first (F1..Fn, keeping only the
residual contexts), then every backward in reverse (Bn..B1), and checks the summed gradients
against ``jax.grad`` of the full batch. All microbatches share one signature, so the whole run
costs one forward and one backward compile.

The model here (:func:`init_transformer`, :func:`transformer_loss`) is also what the tests and
benchmarks use: a pre-layernorm causal transformer with its layers under ``lax.scan`` and
``jax.checkpoint`` (saving only the named attention and MLP outputs), dropout from a typed PRNG
key, integer tokens, and an accuracy ``aux`` output.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

__all__ = ["DemoConfig", "init_transformer", "transformer_loss", "run_demo"]

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Sizes and schedule of the demo; the defaults run in seconds on two CPU cores."""

    vocab: int = 64
    d_model: int = 64
    n_heads: int = 4
    d_ff: int = 128
    n_layers: int = 2
    seq_len: int = 32
    microbatch: int = 4
    n_microbatches: int = 8
    steps: int = 3
    learning_rate: float = 0.05
    dropout: float = 0.1
    seed: int = 0


def init_transformer(key: jax.Array, cfg: DemoConfig, dtype: Any = jnp.float32) -> Params:
    """Random parameters; per-layer weights are stacked on a leading ``n_layers`` axis."""
    k = jax.random.split(key, 6)
    d, f, n = cfg.d_model, cfg.d_ff, cfg.n_layers

    def normal(key: jax.Array, shape: tuple[int, ...], fan_in: int) -> jax.Array:
        return (jax.random.normal(key, shape) / jnp.sqrt(fan_in)).astype(dtype)

    return {
        "embed": normal(k[0], (cfg.vocab, d), d),
        "pos": normal(k[1], (cfg.seq_len, d), 1) * 0.1,
        "layers": {
            "ln1": jnp.ones((n, d), dtype),
            "wqkv": normal(k[2], (n, d, 3 * d), d),
            "wo": normal(k[3], (n, d, d), d),
            "ln2": jnp.ones((n, d), dtype),
            "w1": normal(k[4], (n, d, f), d),
            "w2": normal(k[5], (n, f, d), f),
        },
        "ln_f": jnp.ones((d,), dtype),
    }


def _layernorm(x: jax.Array, scale: jax.Array) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.var(x, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale


def _block(cfg: DemoConfig, train: bool) -> Callable[..., Any]:
    def block(x: jax.Array, layer: tuple[Params, jax.Array]) -> tuple[jax.Array, None]:
        p, key = layer
        b, t, d = x.shape
        h = _layernorm(x, p["ln1"])
        q, k, v = jnp.split(h @ p["wqkv"], 3, axis=-1)
        heads = lambda z: z.reshape(b, t, cfg.n_heads, d // cfg.n_heads)
        logits = jnp.einsum("bqhd,bkhd->bhqk", heads(q), heads(k)) / jnp.sqrt(d // cfg.n_heads)
        causal = jnp.tril(jnp.ones((t, t), bool))
        weights = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
        attn = jnp.einsum("bhqk,bkhd->bqhd", weights, heads(v)).reshape(b, t, d)
        attn = checkpoint_name(attn @ p["wo"], "attn_out")
        if train and cfg.dropout > 0:
            keep = jax.random.bernoulli(key, 1.0 - cfg.dropout, attn.shape)
            attn = jnp.where(keep, attn / (1.0 - cfg.dropout), 0.0)
        x = x + attn
        hidden = checkpoint_name(jax.nn.gelu(_layernorm(x, p["ln2"]) @ p["w1"]), "mlp_hidden")
        return x + hidden @ p["w2"], None

    return block


def transformer_loss(
    params: Params, tokens: jax.Array, key: jax.Array, cfg: DemoConfig = DemoConfig()
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Next-token cross entropy of ``tokens`` (int ``[batch, seq_len + 1]``) and its accuracy."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = params["embed"][inputs] + params["pos"][: inputs.shape[1]]
    policy = jax.checkpoint_policies.save_only_these_names("attn_out", "mlp_hidden")
    body = jax.checkpoint(_block(cfg, train=True), policy=policy)
    keys = jax.random.split(key, cfg.n_layers)
    x, _ = jax.lax.scan(body, x, (params["layers"], keys))
    logits = (_layernorm(x, params["ln_f"]) @ params["embed"].T).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    accuracy = jnp.mean((jnp.argmax(logits, -1) == targets).astype(jnp.float32))
    return jnp.mean(nll), {"accuracy": accuracy}


def _tree_max_rel_diff(a: Any, b: Any) -> float:
    diffs = jax.tree.map(
        lambda x, y: jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-12), a, b
    )
    return float(max(jax.tree.leaves(diffs)))


def run_demo(cfg: DemoConfig = DemoConfig(), print_fn: Callable[[str], None] = print) -> dict[str, Any]:
    """Trains ``cfg.steps`` steps with an all-forwards-then-all-backwards schedule; returns stats.

    The returned dict has ``losses``, ``max_rel_grad_diff`` (against ``jax.grad`` of the full
    batch, per step), ``cache_info`` and ``timings`` (seconds in forwards and backwards).
    """
    import residual_store as rs

    key = jax.random.key(cfg.seed)
    params = init_transformer(key, cfg)
    loss_fn = lambda p, tokens, k: transformer_loss(p, tokens, k, cfg)
    fwd = rs.split(loss_fn, argnums=0, has_aux=True)
    reference = jax.jit(jax.grad(lambda p, t, ks: _mean_loss(loss_fn, p, t, ks), argnums=0))
    n = cfg.n_microbatches
    losses, diffs = [], []
    t_fwd = t_bwd = 0.0
    print_fn(
        f"residual-store demo: {cfg.n_layers}-layer transformer, {n} microbatches of "
        f"{cfg.microbatch}x{cfg.seq_len} tokens, {cfg.steps} steps (forwards F1..F{n}, then "
        f"backwards B{n}..B1)"
    )
    for step in range(cfg.steps):
        key, data_key, drop_key = jax.random.split(key, 3)
        tokens = jax.random.randint(data_key, (n, cfg.microbatch, cfg.seq_len + 1), 0, cfg.vocab)
        drop_keys = jax.random.split(drop_key, n)
        start = time.perf_counter()
        contexts, step_loss = [], 0.0
        for i in range(n):
            (loss, _aux), ctx = fwd(params, tokens[i], drop_keys[i])
            contexts.append(ctx)
            step_loss += float(loss) / n
        t_fwd += time.perf_counter() - start
        start = time.perf_counter()
        grads = None
        for ctx in reversed(contexts):
            g = fwd.backward(ctx, jnp.float32(1.0 / n))
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
        grads = jax.block_until_ready(grads)
        t_bwd += time.perf_counter() - start
        diff = _tree_max_rel_diff(grads, reference(params, tokens, drop_keys))
        params = jax.tree.map(lambda p, g: p - cfg.learning_rate * g, params, grads)
        losses.append(step_loss)
        diffs.append(diff)
        print_fn(f"  step {step + 1}/{cfg.steps}: loss {step_loss:.4f}, max rel. grad diff vs jax.grad {diff:.2e}")
    info = fwd.cache_info()
    print_fn(
        f"compiles: {info.forward_compiles} forward, {info.backward_compiles} backward for "
        f"{cfg.steps * n} microbatches; time: forwards {t_fwd:.2f} s, backwards {t_bwd:.2f} s"
    )
    print_fn("residuals of one context:\n" + contexts[0].describe())
    return {
        "losses": losses,
        "max_rel_grad_diff": diffs,
        "cache_info": info,
        "timings": {"forward": t_fwd, "backward": t_bwd},
    }


def _mean_loss(loss_fn: Callable[..., Any], params: Params, tokens: jax.Array, keys: jax.Array) -> jax.Array:
    losses = jax.vmap(lambda t, k: loss_fn(params, t, k)[0])(tokens, keys)
    return jnp.mean(losses)
