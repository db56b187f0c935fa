"""The model of ``accelerator.py``, and its fused step timed bare.

A ``lax.scan`` of pre-norm transformer blocks in bf16 (causal attention, a 4x MLP; three named
intermediates for JAX's remat offload). This module imports JAX alone, not ``residual_store``:
``python benchmarks/bench_model.py`` times the fused step (one compiled ``jax.value_and_grad`` a
microbatch, the gradients summed) and the forward alone, each also as a share of the fused step,
on issue 51's shapes (8 blocks, d=1024, T=1024, B=4, 3 microbatches; ``--quick`` for small
ones), with nothing of the library or the benchmark's sampler thread in the process: the floor
every row of ``accelerator.py --parts plan`` is read against.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import timed  # noqa: E402

NAMES = ("attn_out", "mlp_hidden", "mlp_out")  # the intermediates remat offload moves


def init(shapes: Any, seed: int = 0) -> dict[str, jax.Array]:
    d, L = shapes.d, shapes.blocks
    sizes = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "w1": (d, 4 * d), "w2": (4 * d, d)}
    keys = dict(zip(sizes, jax.random.split(jax.random.key(seed), len(sizes))))
    return {name: (jax.random.normal(keys[name], (L, *s)) / math.sqrt(s[0])).astype(jnp.bfloat16)
            for name, s in sizes.items()}


def _norm(x: jax.Array) -> jax.Array:
    return (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)


def block(heads: int, h: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
    """A pre-norm transformer block in bf16: causal attention of ``heads`` heads, a 4x MLP."""
    b, t, d = h.shape
    x = _norm(h)
    q, k, v = ((x @ w[n]).reshape(b, t, heads, d // heads) for n in ("wq", "wk", "wv"))
    causal = jnp.where(jnp.tril(jnp.ones((t, t), bool)), 0, -1e4).astype(h.dtype)
    probs = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(d // heads) + causal)
    attn = jnp.einsum("bhts,bshd->bthd", probs, v).reshape(b, t, d)
    h = h + checkpoint_name(attn @ w["wo"], "attn_out")
    hidden = checkpoint_name(jax.nn.gelu(_norm(h) @ w["w1"], approximate=False), "mlp_hidden")
    return h + checkpoint_name(hidden @ w["w2"], "mlp_out")


def make_loss(heads: int, policy: Any = None) -> Callable[[dict[str, jax.Array], jax.Array], jax.Array]:
    step = functools.partial(block, heads)
    if policy is not None:
        step = jax.checkpoint(step, policy=policy)

    def loss(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        h, _ = jax.lax.scan(lambda h, w: (step(h, w), None), x, params)
        return jnp.mean(h.astype(jnp.float32) ** 2)

    return loss


def add_trees(a: Any, b: Any) -> Any:
    """``a + b`` leaf by leaf; ``b`` where ``a`` is ``None`` (the first microbatch's)."""
    return b if a is None else jax.tree.map(jnp.add, a, b)


def fused_step(value_and_grad: Callable[..., Any], calls: list[tuple]) -> Any:
    """One compiled ``value_and_grad`` a microbatch, the gradients summed."""
    grads = None
    for call in calls:
        grads = add_trees(grads, value_and_grad(*call)[1])
    return jax.block_until_ready(grads)


def forward_step(forward: Callable[..., Any], calls: list[tuple]) -> Any:
    """The compiled forward alone a microbatch: the only program a budget-0 plan's copies to
    host can ride in."""
    return jax.block_until_ready([forward(*call) for call in calls])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (a CPU, in seconds)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--microbatches", type=int, default=3)
    shapes = parser.parse_args(argv)
    for name, full, quick in (("blocks", 8, 2), ("d", 1024, 64), ("seq", 1024, 32), ("batch", 4, 2), ("heads", 8, 2)):
        setattr(shapes, name, quick if shapes.quick else full)
    params = init(shapes)
    keys = jax.random.split(jax.random.key(1), shapes.microbatches)
    calls = [(params, jax.random.normal(k, (shapes.batch, shapes.seq, shapes.d), jnp.bfloat16)) for k in keys]
    loss = make_loss(shapes.heads)
    steps = {"fused jax.value_and_grad": functools.partial(fused_step, jax.jit(jax.value_and_grad(loss)), calls),
             "the forward alone": functools.partial(forward_step, jax.jit(loss), calls)}
    print(f"# {jax.devices()[0].device_kind} ({jax.default_backend()}), JAX {jax.__version__}; {shapes.blocks} blocks, "
          f"d={shapes.d}, T={shapes.seq}, B={shapes.batch}, {shapes.heads} heads, {shapes.microbatches} microbatches")
    fused = None
    for name, step in steps.items():
        step()  # (it compiles; timed runs one more untimed)
        seconds = timed(step, lambda: None, shapes.repeats)
        fused = fused or seconds
        print(f"{name:<28} {seconds / shapes.microbatches * 1e3:8.2f} ms a microbatch (median of {shapes.repeats}), "
              f"{seconds / fused:.3f}x the fused step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
