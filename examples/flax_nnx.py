"""Flax NNX: forwards now, backwards later, and a backward in a process without the model.

What it shows, in the idiom of Flax NNX (``flax.nnx``):

- an ``nnx.Module`` with ``nnx.BatchNorm`` and ``nnx.Dropout``, cut functionally with
  ``graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)`` and rebuilt inside the
  loss with ``nnx.merge``;
- ``rs.split(loss, has_aux=True)``: ``params`` (argument 0) is differentiated and is the weight
  argument; the BatchNorm statistics the forward updates come back as the aux output; the dropout
  key is a plain, non-differentiated argument (a typed PRNG key);
- four microbatches in the pipeline order of every library example (``_resume.py``): F1..F4
  ``put`` each context in an ``rs.Store``, B4..B1 run later from ``store.get``, then one
  ``optax.adamw`` step in ``jax.jit``, and ``nnx.merge`` rebuilds the trained model;
- the new process (``python -c``: no model, not this file) imports ``flax.nnx``, the library, so
  the gradients of ``rs.backward(store.get(key))`` come back as the ``nnx.State`` they were.
  Without that import they would be a ``dict`` from key path to array;
  ``rs.backward(ctx, like=params)`` rebuilds them on a template.

Run: ``python examples/flax_nnx.py`` (``--store DIR`` keeps the store for
``residual-store ls DIR``).
"""

from __future__ import annotations

import sys
import time

import _resume  # examples/_resume.py: the new process, the comparison with jax.grad, PASS or FAIL

N_MICROBATCHES, BATCH, D_IN, HIDDEN, D_OUT = 4, 8, 6, 16, 3

# The new process: no model, no loss function, not even this file. Only the store (and _resume).
CHILD = r"""
import flax.nnx  # the library (registers nnx.State), not the model
import _resume

total, keys = _resume.backwards_from_store()
print(f"  [new process] {len(keys)} backwards from the store, no model code; "
      f"gradients are a {type(total).__module__}.{type(total).__name__}")
_resume.save(_resume.flat(total))
"""


def main(argv=None) -> int:
    args = _resume.parse_args(__doc__, argv)
    start = time.perf_counter()

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import residual_store as rs

    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.l1 = nnx.Linear(D_IN, HIDDEN, rngs=rngs)
            self.bn = nnx.BatchNorm(HIDDEN, rngs=rngs)
            self.drop = nnx.Dropout(0.2)  # no stored RNG: the key comes with each call
            self.l2 = nnx.Linear(HIDDEN, D_OUT, rngs=rngs)

        def __call__(self, x, *, rngs=None):
            h = jax.nn.relu(self.bn(self.l1(x)))
            return self.l2(self.drop(h, rngs=rngs))

    model = nnx.jit(lambda: Net(nnx.Rngs(0)))()  # initialised in one compiled call
    graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)

    def loss(params, stats, x, y, key):
        model = nnx.merge(graphdef, params, stats, copy=True)
        pred = model(x, rngs=nnx.Rngs(dropout=key))
        return jnp.mean((pred - y) ** 2), nnx.state(model, nnx.BatchStat)  # as BatchNorm updated them

    xs, ys, dropout_keys = _resume.microbatches(N_MICROBATCHES, BATCH, D_IN, D_OUT)  # typed PRNG keys
    keys = [f"nnx-mb{i}" for i in range(N_MICROBATCHES)]
    store_path = _resume.store_path(args.store, prefix="flax-nnx-example-")

    fwd = rs.split(loss, has_aux=True)  # argnums=0: params; weight_argnums defaults to it
    opt = optax.adamw(1e-2)
    opt_state = opt.init(params)
    with rs.Store(store_path) as store:
        stats_in = [stats]  # the statistics each microbatch's forward started from
        for i, key in enumerate(keys):  # F1..F4
            (value, stats), ctx = fwd(params, stats, xs[i], ys[i], dropout_keys[i])
            stats_in.append(stats)
            store.put(ctx, key)
            print(f"forward {key}: loss {float(value):.4f}, {ctx.nbytes:,} bytes of residuals")
        # B4..B1: fwd.backward(store.get(key), 1/4) in reverse, summed
        grads = _resume.sum_backwards(store, keys, fwd.backward)
        store.flush()

    @jax.jit
    def update(grads, opt_state, params):
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    # the mean loss of the same microbatches, dropout masks and statistics; its jax.grad is the reference
    mean_loss = _resume.mean_loss(
        lambda p, i: loss(p, stats_in[i], xs[i], ys[i], dropout_keys[i])[0], N_MICROBATCHES)

    new_params, opt_state = update(grads, opt_state, params)
    print(f"optax.adamw step: mean loss {float(mean_loss(params)):.4f} -> {float(mean_loss(new_params)):.4f}; "
          f"{fwd.cache_info()}")
    model = nnx.merge(graphdef, new_params, stats)  # the trained model, its BatchNorm statistics updated
    print("residuals of the last context:\n" + ctx.describe())

    ref = _resume.flat(jax.grad(mean_loss)(params))  # the reference: jax.grad of the mean loss
    here = _resume.max_rel_diff(_resume.flat(grads), ref)
    there = _resume.compare_in_new_process(CHILD, store_path, keys, __file__, ref)
    return _resume.report("Flax NNX", here, there, grads_ok=isinstance(grads, nnx.State), start=start)


if __name__ == "__main__":
    sys.exit(main())
