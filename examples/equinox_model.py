"""Equinox: forwards now, backwards later, and a backward in a process without the model.

What it shows, in the idiom of Equinox (``equinox``):

- an ``eqx.Module`` (``eqx.nn.Linear``, ``eqx.nn.LayerNorm``, ``eqx.nn.Dropout``, and an integer
  step counter), cut with ``params, static = eqx.partition(model, eqx.is_array)``: ``params``
  holds every array, floating or not, ``static`` the rest (the dropout rate and its ``inference``
  flag, which Python ``if``s read, and the activation function). The loss closes over ``static``
  and rebuilds the model with ``eqx.combine``;
- ``rs.split(loss, filter=rs.is_inexact)``: like ``eqx.filter_grad``, only the floating leaves
  of ``params`` are differentiated; the integer step passes through and its gradient is ``None``.
  The dropout key is a plain, non-differentiated argument (a typed PRNG key);
- four microbatches in the pipeline order the library examples share (``_resume.py``): forwards
  F1..F4 into an ``rs.Store``, backwards B4..B1 from it later, then ``optax.adamw`` in an
  ``eqx.filter_jit`` step with ``eqx.apply_updates``;
- the new process (``python -c``) has no ``Net`` class (importing ``equinox`` would not define
  this script's class), so ``rs.backward`` gives it a mapping (an ``OrderedDict``) from key path
  (``jax.tree_util.keystr``) to array, whose leaves keep the module's leaf order (``jax.tree.leaves``
  lists them as it lists the module's); ``rs.backward(ctx, like=params)`` would rebuild the module
  where a template exists. The reference gradients differentiate the floating leaves, as
  ``eqx.filter_grad`` does.

Run: ``python examples/equinox_model.py`` (``--store DIR`` keeps the store for
``residual-store ls DIR``).
"""

from __future__ import annotations

import sys
import time

import _resume  # examples/_resume.py: the new process, the comparison with jax.grad, PASS or FAIL

N_MICROBATCHES, BATCH, D_IN, HIDDEN, D_OUT = 4, 8, 6, 16, 3

# The new process: no model, no loss function, not even this file. Only the store (and _resume).
CHILD = r"""
import _resume

total, keys = _resume.backwards_from_store()  # no Net class here: keystr path -> array, in Net's leaf order
print(f"  [new process] {len(keys)} backwards from the store, no model code; "
      f"gradients are a {type(total).__name__} keyed by path: {list(total)}")
_resume.save({path: x for path, x in total.items() if x is not None})  # the step's gradient is None
"""


def main(argv=None) -> int:
    args = _resume.parse_args(__doc__, argv)
    start = time.perf_counter()

    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import residual_store as rs

    class Net(eqx.Module):
        l1: eqx.nn.Linear
        norm: eqx.nn.LayerNorm
        drop: eqx.nn.Dropout
        l2: eqx.nn.Linear
        step: jax.Array  # an integer leaf: no gradient

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.l1 = eqx.nn.Linear(D_IN, HIDDEN, key=k1)
            self.norm = eqx.nn.LayerNorm(HIDDEN)
            self.drop = eqx.nn.Dropout(0.2)
            self.l2 = eqx.nn.Linear(HIDDEN, D_OUT, key=k2)
            self.step = jnp.zeros((), jnp.int32)

        def __call__(self, x, key):
            return self.l2(self.drop(jax.nn.gelu(self.norm(self.l1(x))), key=key))

    model = eqx.filter_jit(Net)(jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)

    def loss(params, x, y, key):
        model = eqx.combine(params, static)
        pred = jax.vmap(model)(x, jax.random.split(key, x.shape[0]))
        return jnp.mean((pred - y) ** 2)

    xs, ys, dropout_keys = _resume.microbatches(N_MICROBATCHES, BATCH, D_IN, D_OUT)  # typed PRNG keys
    keys = [f"eqx-mb{i}" for i in range(N_MICROBATCHES)]
    store_path = _resume.store_path(args.store, prefix="equinox-example-")

    fwd = rs.split(loss, filter=rs.is_inexact)  # argnums=0: params; weight_argnums defaults to it
    opt = optax.adamw(1e-2)
    opt_state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    with rs.Store(store_path) as store:
        for i, key in enumerate(keys):  # F1..F4
            value, ctx = fwd(params, xs[i], ys[i], dropout_keys[i])
            store.put(ctx, key)
            print(f"forward {key}: loss {float(value):.4f}, {ctx.nbytes:,} bytes of residuals")
        # B4..B1: fwd.backward(store.get(key), 1/4) in reverse, summed
        grads = _resume.sum_backwards(store, keys, fwd.backward)
        store.flush()
    print(f"gradients: a {type(grads).__name__}, step gradient {grads.step}")

    @eqx.filter_jit
    def update(model, grads, opt_state):
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state

    # the mean loss of the same microbatches and dropout masks; its jax.grad is the reference
    mean_loss = _resume.mean_loss(
        lambda p, i: loss(p, xs[i], ys[i], dropout_keys[i]), N_MICROBATCHES)
    new_model, opt_state = update(model, grads, opt_state)
    new_params = eqx.filter(new_model, eqx.is_array)
    print(f"optax.adamw step: mean loss {float(mean_loss(params)):.4f} -> {float(mean_loss(new_params)):.4f}; "
          f"{fwd.cache_info()}")
    print("residuals of the last context:\n" + ctx.describe())

    floats, others = eqx.partition(params, eqx.is_inexact_array)  # the reference differentiates the floats,
    ref = _resume.flat(jax.grad(lambda f: mean_loss(eqx.combine(f, others)))(floats))  # as eqx.filter_grad
    here = _resume.max_rel_diff(_resume.flat(grads), ref)
    there = _resume.compare_in_new_process(CHILD, store_path, keys, __file__, ref)
    grads_ok = isinstance(grads, Net) and grads.step is None
    return _resume.report("Equinox", here, there, grads_ok=grads_ok, start=start)


if __name__ == "__main__":
    sys.exit(main())
