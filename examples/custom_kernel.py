"""A custom kernel (``jax.custom_vjp``) under ``jax.checkpoint``: who runs how often.

What it shows: a "kernel" written as a ``jax.custom_vjp`` whose primal ``f``, ``fwd`` and
``bwd`` are opaque calls; here ``jax.pure_callback``s that count their executions stand in for
Pallas, FFI or Triton kernels. The script splits a small model around the kernel with
``rs.split`` and counts the kernel calls in the forward (``fwd(x)``) and in the backward
(``fwd.backward(ctx)``) for three ways of writing it:

1. no remat: the forward runs ``fwd`` once (it saves the kernel's residuals), the backward runs
   ``bwd`` once;
2. the kernel under ``jax.checkpoint`` with a plain ``defvjp(fwd, bwd)``: stock JAX runs ``fwd``
   in the forward and **again** in the backward (the remat recompute; upstream jax issue 21303).
   residual-store sees this while tracing and emits an ``rs.RecomputeWarning``, caught and
   printed here;
3. the kernel under ``jax.checkpoint`` with ``defvjp(fwd, bwd, optimize_remat=True)``: the
   forward runs the primal ``f`` once (nothing of the kernel is saved), the backward runs ``fwd``
   once and ``bwd`` once, and there is no warning.

The script asserts these counts and that every variant's gradient equals ``jax.grad``; it exits
non-zero otherwise.

Why: an expensive kernel's fwd running twice per step is easy to miss; the warning names the
``custom_vjp`` and says how to fix it.

Run: ``python examples/custom_kernel.py`` (``--small`` is accepted and changes nothing much: it
is already small).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np

import residual_store as rs

CALLS: Counter = Counter()


def opaque(name, fn, *args, n_out=1):
    """A stand-in for a compiled kernel: ``fn`` run as one host call that counts its runs.

    Like a real fused kernel, one call makes all of its outputs (e.g. fwd's output and its
    residual), so XLA cannot drop the call when only some outputs are needed.
    """

    def host(*vs):
        CALLS[name] += 1
        outs = fn(*(np.asarray(v) for v in vs))
        return tuple(np.asarray(o, np.float32) for o in outs)

    shapes = tuple(jax.ShapeDtypeStruct(args[0].shape, jnp.float32) for _ in range(n_out))
    outs = jax.pure_callback(host, shapes, *args)
    return outs if n_out > 1 else outs[0]


def make_kernel(optimize_remat):
    """``y = sin(x)`` as a custom_vjp: its residual is ``cos(x)``, made by the fwd kernel."""

    @jax.custom_vjp
    def sin_kernel(x):
        return opaque("f", lambda x: (np.sin(x),), x)

    def sin_kernel_fwd(x):
        y, cos_x = opaque("fwd", lambda x: (np.sin(x), np.cos(x)), x, n_out=2)
        return y, cos_x

    def sin_kernel_bwd(cos_x, g):
        return (opaque("bwd", lambda c, g: (g * c,), cos_x, g),)

    sin_kernel.defvjp(sin_kernel_fwd, sin_kernel_bwd, optimize_remat=optimize_remat)
    return sin_kernel


def make_model(kernel, remat):
    def layer(w, x):
        return kernel(x @ w)

    if remat:
        layer = jax.checkpoint(layer)

    def loss(w, x):
        return jnp.mean(layer(w, x) ** 2)

    return loss


VARIANTS = {
    # name: (remat, optimize_remat, expected forward counts, expected backward counts, warns)
    "no remat": (False, False, {"fwd": 1}, {"bwd": 1}, False),
    "remat, plain defvjp": (True, False, {"fwd": 1}, {"fwd": 1, "bwd": 1}, True),
    "remat, optimize_remat=True": (True, True, {"f": 1}, {"fwd": 1, "bwd": 1}, False),
}


def fmt(counts):
    return ", ".join(f"{k} x{counts.get(k, 0)}" for k in ("f", "fwd", "bwd"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--small", action="store_true", help="tiny sizes (for the tests)")
    args = parser.parse_args(argv)
    if args.small:
        args.batch, args.width = 4, 8
    kw, kx = jax.random.split(jax.random.key(0))
    w = jax.random.normal(kw, (args.width, args.width)) / jnp.sqrt(args.width)
    x = jax.random.normal(kx, (args.batch, args.width))

    ok = True
    print(f"{'variant':<28} {'forward pass runs':<22} {'backward pass runs':<22} warning")
    for name, (remat, optimize, want_fwd, want_bwd, want_warning) in VARIANTS.items():
        loss = make_model(make_kernel(optimize), remat)
        fwd = rs.split(loss)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            CALLS.clear()
            value, ctx = fwd(w, x)
            jax.block_until_ready((value, ctx.residuals))
            forward_counts = dict(CALLS)
            CALLS.clear()
            grads = jax.block_until_ready(fwd.backward(ctx))
            backward_counts = dict(CALLS)
        recompute = [c for c in caught if issubclass(c.category, rs.RecomputeWarning)]
        reference = jax.grad(loss)(w, x)
        grad_diff = float(jnp.max(jnp.abs(grads - reference)) / jnp.max(jnp.abs(reference)))
        print(f"{name:<28} {fmt(forward_counts):<22} {fmt(backward_counts):<22} "
              f"{'RecomputeWarning' if recompute else '-'}")
        if recompute:
            print(f"    rs.RecomputeWarning: {recompute[0].message}")
        good = (
            forward_counts == want_fwd
            and backward_counts == want_bwd
            and bool(recompute) == want_warning
            and grad_diff <= 1e-5
        )
        if not good:
            print(f"    FAILED: expected forward {fmt(want_fwd)}, backward {fmt(want_bwd)}, "
                  f"warning {want_warning}; grad rel diff vs jax.grad {grad_diff:.2e}")
        ok = ok and good
    print(f"{'OK' if ok else 'FAIL'}: kernel call counts as documented, gradients match jax.grad")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
