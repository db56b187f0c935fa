"""Offloading residual contexts that do not fit: device -> host memory -> disk, within budgets.

What it shows: the forwards of many microbatches make more residuals than the device and host
budgets allow. An ``rs.Store(path, device_budget=..., host_budget=..., write_through=False)``
keeps the most recent contexts on the device, pushes the least recently used ones to host memory
and then to disk (only those: ``write_through=False`` makes it a pure offloader), and brings them
back for the backwards, which run in reverse order with the next context prefetched one ahead
(``store.prefetch``), so that reading from disk overlaps the current backward.

The script polls ``store.stats()`` after every ``put`` and ``get`` and reports the peak bytes
(intermediates and inputs; the weights are the model's memory, held by reference and not counted) per
tier; it checks that the device and host tiers stay within their budgets (plus at most one
context in flight), that contexts really went to disk, and that the summed gradients equal those
of the same forwards and backwards with every context kept in memory (and ``jax.grad``). It
exits non-zero otherwise.

Why: a pipeline schedule or gradient accumulation over long sequences keeps many forwards'
residuals alive at once; a byte budget per tier bounds the memory they take.

Run: ``python examples/offload_under_budget.py`` (``--small`` for the tiny sizes the tests use).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

import residual_store as rs


def init_params(key, width, depth, d_in):
    keys = jax.random.split(key, depth + 1)
    layers = [jax.random.normal(keys[0], (d_in, width)) / jnp.sqrt(d_in)]
    layers += [jax.random.normal(k, (width, width)) / jnp.sqrt(width) for k in keys[1:-1]]
    return {"layers": layers, "head": jax.random.normal(keys[-1], (width, 1)) / jnp.sqrt(width)}


def loss(params, x, y):
    h = x
    for w in params["layers"]:
        h = jnp.tanh(h @ w)
    return jnp.mean((h @ params["head"] - y) ** 2)


def own_bytes(ctx):
    """What a budget counts: the context's own intermediates and inputs (its weights are held by
    reference)."""
    return sum(int(x.nbytes) for x, k in zip(ctx.residuals, ctx.spec.kinds) if k in ("input", "intermediate"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--device-contexts", type=int, default=2, help="device budget, in contexts")
    parser.add_argument("--host-contexts", type=int, default=3, help="host budget, in contexts")
    parser.add_argument("--small", action="store_true", help="tiny sizes (for the tests)")
    args = parser.parse_args(argv)
    if args.small:
        args.microbatches, args.batch, args.width, args.depth = 10, 32, 64, 3
    n = args.microbatches

    kp, kx, ky = jax.random.split(jax.random.key(0), 3)
    params = init_params(kp, args.width, args.depth, 32)
    xs = jax.random.normal(kx, (n, args.batch, 32))
    ys = jax.random.normal(ky, (n, args.batch, 1))
    fwd = rs.split(loss)
    cotangent = jnp.float32(1.0 / n)

    # Reference: every context kept in memory.
    contexts = [fwd(params, xs[i], ys[i])[1] for i in range(n)]
    per_ctx = own_bytes(contexts[0])
    in_memory = None
    for ctx in reversed(contexts):
        g = fwd.backward(ctx, cotangent)
        in_memory = g if in_memory is None else jax.tree.map(jnp.add, in_memory, g)
    del contexts, ctx

    device_budget = args.device_contexts * per_ctx
    host_budget = args.host_contexts * per_ctx
    print(f"{n} microbatches, {per_ctx:,} bytes of its own per context, "
          f"{n * per_ctx:,} bytes in all")
    print(f"budgets: device {device_budget:,} bytes ({args.device_contexts} contexts), "
          f"host {host_budget:,} bytes ({args.host_contexts} contexts), the rest to disk")

    peak = {"device": 0, "host": 0, "disk": 0}

    def poll(store):
        stats = store.stats()
        for tier in peak:
            peak[tier] = max(peak[tier], stats[tier]["bytes"] if tier != "disk" else stats[tier]["contexts"])
        return stats

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="offload-example-") as folder:
        with rs.Store(folder, device_budget=device_budget, host_budget=host_budget,
                      write_through=False) as store:
            keys = []
            for i in range(n):  # F1..Fn
                _, ctx = fwd(params, xs[i], ys[i])
                keys.append(store.put(ctx, f"mb{i:03d}"))
                del ctx
                poll(store)
            store.flush()
            after = poll(store)
            print("after the forwards: " + ", ".join(
                f"{tier} {after[tier]['contexts']} contexts ({after[tier]['bytes']:,} bytes)"
                for tier in ("device", "host", "disk")))
            grads = None
            for i in reversed(range(n)):  # Bn..B1, loading one ahead
                if i > 0:
                    store.prefetch(keys[i - 1])
                ctx = store.get(keys[i])
                poll(store)
                g = fwd.backward(ctx, cotangent)
                grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
                store.delete(keys[i])
                del ctx
            grads = jax.block_until_ready(grads)
            left = len(store)
    elapsed = time.perf_counter() - t0

    reference = jax.grad(lambda p: jnp.mean(jax.vmap(lambda x, y: loss(p, x, y))(xs, ys)))(params)
    diff_mem = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(in_memory)))
    diff_ref = max(
        float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(reference))
    )
    print(f"peak bytes per tier (polled after every put/get): device {peak['device']:,} "
          f"(budget {device_budget:,}), host {peak['host']:,} (budget {host_budget:,}); "
          f"at most {peak['disk']} contexts on disk")
    print(f"gradients: max |store - in memory| = {diff_mem:.2e}; "
          f"max rel |store - jax.grad| = {diff_ref:.2e}; store round trip took {elapsed:.2f} s")

    checks = {
        "device within budget (+1 context)": peak["device"] <= device_budget + per_ctx,
        "host within budget (+1 context)": peak["host"] <= host_budget + per_ctx,
        "contexts went to disk": peak["disk"] >= n - args.device_contexts - args.host_contexts,
        "gradients equal the in-memory run": diff_mem <= 1e-6 * max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(in_memory)),
        "gradients match jax.grad (rel 1e-5)": diff_ref <= 1e-5,
        "store empty at the end": left == 0,
    }
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAILED'}] {name}")
    ok = all(checks.values())
    print(f"{'OK' if ok else 'FAIL'}: offloaded under budget, gradients unchanged")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
