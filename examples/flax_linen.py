"""Flax linen: forwards now, backwards later, and a backward in a process without the model.

What it shows, in the idiom of Flax linen (``flax.linen``):

- an ``nn.Module`` written with ``@nn.compact`` (``nn.Dense``, ``nn.BatchNorm``, ``nn.Dropout``),
  initialised with ``variables = net.init(...)`` into ``variables["params"]`` and
  ``variables["batch_stats"]``;
- ``rs.split(loss, has_aux=True)`` on ``loss(params, batch_stats, x, y, key)``: ``params``
  (argument 0) is differentiated and is the weight argument; ``net.apply(...,
  mutable=["batch_stats"])`` returns the updated BatchNorm statistics, which leave through the
  aux output; the dropout key (``rngs={"dropout": key}``) is a plain, non-differentiated argument;
- four microbatches in the pipeline order the library examples share (``_resume.py``): the
  forwards put their contexts in an ``rs.Store``, the backwards run later in reverse from
  ``store.get``, and one ``optax.adamw`` step in ``jax.jit`` updates ``variables["params"]``;
- the new process (``python -c``, without the model or this file) does not import Flax at all:
  linen's parameters are plain ``dict``s, so its gradients come back in their own structure.

Run: ``python examples/flax_linen.py`` (``--store DIR`` keeps the store for
``residual-store ls DIR``).
"""

from __future__ import annotations

import sys
import time

import _resume  # examples/_resume.py: the new process, the comparison with jax.grad, PASS or FAIL

N_MICROBATCHES, BATCH, D_IN, HIDDEN, D_OUT = 4, 8, 6, 16, 3

# The new process: no model, no loss function, no Flax, not even this file. Only the store (and _resume).
CHILD = r"""
import sys
import _resume

total, keys = _resume.backwards_from_store()
assert "flax" not in sys.modules
print(f"  [new process] {len(keys)} backwards from the store, no model code, no flax; "
      f"gradients are a {type(total).__name__} of {sorted(total)}")
_resume.save(_resume.flat(total))
"""


def main(argv=None) -> int:
    args = _resume.parse_args(__doc__, argv)
    start = time.perf_counter()

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    import residual_store as rs

    class Net(nn.Module):
        hidden: int
        out: int

        @nn.compact
        def __call__(self, x, train: bool):
            h = nn.Dense(self.hidden)(x)
            h = nn.BatchNorm(use_running_average=not train, momentum=0.9)(h)
            h = nn.Dropout(0.2, deterministic=not train)(nn.relu(h))
            return nn.Dense(self.out)(h)

    net = Net(HIDDEN, D_OUT)
    variables = jax.jit(lambda key: net.init(key, jnp.zeros((1, D_IN)), train=False))(jax.random.key(0))
    params, batch_stats = variables["params"], variables["batch_stats"]

    def loss(params, batch_stats, x, y, key):
        pred, updates = net.apply({"params": params, "batch_stats": batch_stats}, x, train=True,
                                  rngs={"dropout": key}, mutable=["batch_stats"])
        return jnp.mean((pred - y) ** 2), updates["batch_stats"]

    xs, ys, dropout_keys = _resume.microbatches(N_MICROBATCHES, BATCH, D_IN, D_OUT)  # typed PRNG keys
    keys = [f"linen-mb{i}" for i in range(N_MICROBATCHES)]
    store_path = _resume.store_path(args.store, prefix="flax-linen-example-")

    fwd = rs.split(loss, has_aux=True)  # argnums=0: params; weight_argnums defaults to it
    opt = optax.adamw(1e-2)
    opt_state = opt.init(params)
    stats_in = [batch_stats]  # the statistics each microbatch's forward started from
    with rs.Store(store_path) as store:
        for i, key in enumerate(keys):  # F1..F4
            (value, batch_stats), ctx = fwd(params, batch_stats, xs[i], ys[i], dropout_keys[i])
            stats_in.append(batch_stats)
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
    variables = {"params": new_params, "batch_stats": batch_stats}  # ready for net.apply(variables, x, train=False)
    print("residuals of the last context:\n" + ctx.describe())

    ref = _resume.flat(jax.grad(mean_loss)(params))  # the reference: jax.grad of the mean loss
    here = _resume.max_rel_diff(_resume.flat(grads), ref)
    there = _resume.compare_in_new_process(CHILD, store_path, keys, __file__, ref)
    return _resume.report("Flax linen", here, there, grads_ok=type(grads) is dict, start=start)


if __name__ == "__main__":
    sys.exit(main())
