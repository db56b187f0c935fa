"""Haiku: forwards now, backwards later, and a backward in a process without the model.

What it shows, in the idiom of Haiku (``dm-haiku``):

- a network written as a function of ``hk.Linear``, ``hk.BatchNorm`` and ``hk.dropout``,
  turned into a pure pair with ``hk.transform_with_state``: ``params, state = net.init(...)``,
  ``out, new_state = net.apply(params, state, rng, x, is_training)``;
- ``rs.split(loss, has_aux=True)`` on ``loss(params, state, x, y, rng)``: ``params`` (argument
  0) is differentiated and is the weight argument; the BatchNorm moving averages ``apply``
  returns leave through the aux output; the dropout ``rng`` is a plain, non-differentiated
  argument (a typed PRNG key);
- as in every library example (``_resume.py``), four microbatches in pipeline order: forwards
  first, each context ``put`` in an ``rs.Store``, backwards afterwards in reverse from
  ``store.get``, then one jitted ``optax.adamw`` step on ``params``;
- the new process, which runs ``rs.backward`` without this file or the model, never imports
  Haiku: Haiku's parameters are nested ``dict``s, so the gradients keep their structure there.

Run: ``python examples/haiku_model.py`` (``--store DIR`` keeps the store for
``residual-store ls DIR``).
"""

from __future__ import annotations

import sys
import time

import _resume  # examples/_resume.py: the new process, the comparison with jax.grad, PASS or FAIL

N_MICROBATCHES, BATCH, D_IN, HIDDEN, D_OUT = 4, 8, 6, 16, 3

# The new process: no model, no loss function, no Haiku, not even this file. Only the store (and _resume).
CHILD = r"""
import sys
import _resume

total, keys = _resume.backwards_from_store()
assert "haiku" not in sys.modules
print(f"  [new process] {len(keys)} backwards from the store, no model code, no haiku; "
      f"gradients are a {type(total).__name__} of {sorted(total)}")
_resume.save(_resume.flat(total))
"""


def main(argv=None) -> int:
    args = _resume.parse_args(__doc__, argv)
    start = time.perf_counter()

    import haiku as hk
    import jax
    import jax.numpy as jnp
    import optax

    import residual_store as rs

    def forward(x, is_training: bool):
        h = hk.Linear(HIDDEN)(x)
        h = hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.9)(h, is_training)
        h = jax.nn.relu(h)
        if is_training:
            h = hk.dropout(hk.next_rng_key(), 0.2, h)
        return hk.Linear(D_OUT)(h)

    net = hk.transform_with_state(forward)
    params, state = jax.jit(net.init, static_argnums=2)(jax.random.key(0), jnp.zeros((1, D_IN)), True)

    def loss(params, state, x, y, rng):
        pred, new_state = net.apply(params, state, rng, x, True)
        return jnp.mean((pred - y) ** 2), new_state

    xs, ys, dropout_keys = _resume.microbatches(N_MICROBATCHES, BATCH, D_IN, D_OUT)  # typed PRNG keys
    keys = [f"haiku-mb{i}" for i in range(N_MICROBATCHES)]
    store_path = _resume.store_path(args.store, prefix="haiku-example-")

    fwd = rs.split(loss, has_aux=True)  # argnums=0: params; weight_argnums defaults to it
    opt = optax.adamw(1e-2)
    opt_state = opt.init(params)
    state_in = [state]  # the state each microbatch's forward started from
    with rs.Store(store_path) as store:
        for i, key in enumerate(keys):  # F1..F4
            (value, state), ctx = fwd(params, state, xs[i], ys[i], dropout_keys[i])
            state_in.append(state)
            store.put(ctx, key)
            print(f"forward {key}: loss {float(value):.4f}, {ctx.nbytes:,} bytes of residuals")
        # B4..B1: fwd.backward(store.get(key), 1/4) in reverse, summed
        grads = _resume.sum_backwards(store, keys, fwd.backward)
        store.flush()

    @jax.jit
    def update(grads, opt_state, params):
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    # the mean loss of the same microbatches, dropout masks and state; its jax.grad is the reference
    mean_loss = _resume.mean_loss(
        lambda p, i: loss(p, state_in[i], xs[i], ys[i], dropout_keys[i])[0], N_MICROBATCHES)

    new_params, opt_state = update(grads, opt_state, params)
    print(f"optax.adamw step: mean loss {float(mean_loss(params)):.4f} -> {float(mean_loss(new_params)):.4f}; "
          f"{fwd.cache_info()}")
    print("residuals of the last context:\n" + ctx.describe())

    ref = _resume.flat(jax.grad(mean_loss)(params))  # the reference: jax.grad of the mean loss
    here = _resume.max_rel_diff(_resume.flat(grads), ref)
    there = _resume.compare_in_new_process(CHILD, store_path, keys, __file__, ref)
    return _resume.report("Haiku", here, there, grads_ok=type(grads) is dict, start=start)


if __name__ == "__main__":
    sys.exit(main())
