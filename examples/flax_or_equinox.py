"""The split with an Equinox model: arrays differentiated, the rest static.

What it shows: an Equinox model (``pip install equinox``) is a pytree that mixes arrays
(weights) with Python objects (activation functions, layer sizes). ``rs.split`` differentiates
arrays only, so the model is cut with ``eqx.partition(model, eqx.is_inexact_array)`` into

- ``params``: the same tree with only its floating arrays (the argument to differentiate), and
- ``static``: the rest (hashable), passed with ``static_argnums`` so that it is part of the
  signature; ``eqx.combine(params, static)`` rebuilds the model inside the loss.

Two ways are shown: ``static`` as a static argument, and ``static`` closed over by the loss
function (what ``eqx.filter_grad`` users often write). The forwards of four microbatches run
first, then their backwards in reverse; the gradients (an Equinox module shaped like the model,
as ``jax.grad`` and ``eqx.filter_grad`` return) are checked against ``jax.grad`` of the full
batch, and the script exits non-zero if they differ by more than the stated tolerance.

If Equinox is not installed, the script says so and exits 0.

Run: ``python examples/flax_or_equinox.py`` (``--small`` for the tiny sizes the tests use).
"""

from __future__ import annotations

import argparse
import sys

try:
    import equinox as eqx
except ImportError:
    eqx = None

RTOL = 1e-5  # max |split - jax.grad| / max |jax.grad|, per leaf (float32)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="tiny sizes (for the tests)")
    args = parser.parse_args(argv)
    if eqx is None:
        print("equinox is not installed: install equinox to run this example (pip install equinox)")
        return 0
    if args.small:
        args.batch, args.width, args.depth = 8, 16, 2

    import jax
    import jax.numpy as jnp

    import residual_store as rs

    class Model(eqx.Module):
        mlp: eqx.nn.MLP
        norm: eqx.nn.LayerNorm

        def __init__(self, d_in, width, depth, d_out, key):
            self.mlp = eqx.nn.MLP(d_in, d_out, width, depth, activation=jax.nn.gelu, key=key)
            self.norm = eqx.nn.LayerNorm(d_in)

        def __call__(self, x):
            return self.mlp(self.norm(x))

    def loss(params, static, x, y):
        model = eqx.combine(params, static)
        pred = jax.vmap(model)(x)
        return jnp.mean((pred - y) ** 2)

    km, kx, ky = jax.random.split(jax.random.key(0), 3)
    n, d_in = args.microbatches, 16
    model = Model(d_in, args.width, args.depth, 4, km)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    xs = jax.random.normal(kx, (n, args.batch, d_in))
    ys = jax.random.normal(ky, (n, args.batch, 4))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"Equinox {eqx.__version__} model: {len(jax.tree.leaves(params))} arrays, {n_params:,} parameters; "
          f"{n} microbatches of {args.batch}")

    reference = jax.grad(lambda p: jnp.mean(jax.vmap(lambda x, y: loss(p, static, x, y))(xs, ys)))(params)
    filter_ref = eqx.filter_grad(
        lambda m: jnp.mean(jax.vmap(lambda x, y: jnp.mean((jax.vmap(m)(x) - y) ** 2))(xs, ys))
    )(model)

    ways = {
        "static via static_argnums": (rs.split(loss, static_argnums=1), lambda f, x, y: f(params, static, x, y)),
        "static via closure": (
            rs.split(lambda p, x, y: loss(p, static, x, y)),
            lambda f, x, y: f(params, x, y),
        ),
    }
    worst = 0.0
    for name, (fwd, call) in ways.items():
        contexts = []
        for i in range(n):  # F1..Fn
            value, ctx = call(fwd, xs[i], ys[i])
            contexts.append(ctx)
        grads = None
        for ctx in reversed(contexts):  # Bn..B1
            g = fwd.backward(ctx, jnp.float32(1.0 / n))
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
        assert isinstance(grads, Model), type(grads)
        diffs = [
            float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
            for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(reference))
        ]
        diffs_filter = [
            float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
            for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(filter_ref))
        ]
        worst = max(worst, *diffs, *diffs_filter)
        info = fwd.cache_info()
        print(f"{name}: gradient is a {type(grads).__name__}; max rel diff vs jax.grad {max(diffs):.2e}, "
              f"vs eqx.filter_grad {max(diffs_filter):.2e}; "
              f"{info.forward_compiles} forward / {info.backward_compiles} backward compile")
    print("residuals of the last context:")
    print(contexts[-1].describe())
    ok = worst <= RTOL
    print(f"{'OK' if ok else 'FAIL'}: Equinox gradients match jax.grad (max rel diff {worst:.2e}, tolerance {RTOL:.0e})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
