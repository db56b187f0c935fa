"""A zero-bubble pipeline: each backward split into B (now) and W (later), W through a store.

What it shows: a model cut into four stages, each on its own CPU device (``jax_num_cpu_devices``)
and its own ``rs.split`` (``argnums=(0, 1)``: the stage's parameters and its input activations).
The same eight microbatches run in two orders (``residual_store.pipeline.timeline``):

- **1F1B**: each stage runs its backward whole, two time units;
- **ZB-H1**: each backward is split. **B**, ``g_x, later = split.backward(ctx, g_y, now=1)``,
  gives the previous stage its cotangent at once; **W**, ``rs.backward(later)``, the weight
  gradient, waits for a bubble. ``later`` holds only what W reads.

In the third run, ZB-H1's contexts and ``later`` contexts go through one ``rs.Store`` per stage
whose device budget is what that stage holds under 1F1B, with no host tier: what does not fit
spills to disk. Each stage declares its order of gets (``store.schedule``), so its store spills
the context needed last and loads the next ones ahead; the fourth run does the same without the
schedule (least recently used spills first), for comparison. The script prints each order as a chart
(one row per stage, one column per time unit), then a table: time units, the bubble (idle
fraction), the peak bytes of contexts on a stage's device, disk reads. Every run's summed
gradients must equal ``jax.grad`` of the composed model over all microbatches (relative 1e-5),
and the offloaded run must stay within its budgets; the script exits non-zero otherwise.

Run: ``python examples/zero_bubble.py`` (``--small`` for the quick sizes the tests use).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import jax

jax.config.update("jax_num_cpu_devices", 4)  # before any computation: one device per stage

import jax.numpy as jnp  # noqa: E402

import residual_store as rs  # noqa: E402
from residual_store.pipeline import makespan, timeline  # noqa: E402

RTOL = 1e-5


def init_stage(key, d, f):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (d, f)) / jnp.sqrt(d), "w2": jax.random.normal(k2, (f, d)) / jnp.sqrt(f)}


def stage(params, x):
    """One residual MLP block: the activations for the next stage."""
    return x + jnp.tanh(x @ params["w1"]) @ params["w2"]


def last_stage(params, x, target):
    """The last block and the loss of one microbatch (a scalar: its cotangent is 1)."""
    return jnp.mean((stage(params, x) - target) ** 2)


def full_loss(all_params, xs, targets):
    """The composed model's loss summed over the microbatches: what the pipeline differentiates."""

    def one(x, t):
        for p in all_params[:-1]:
            x = stage(p, x)
        return last_stage(all_params[-1], x, t)

    return jnp.sum(jax.vmap(one)(xs, targets))


def chart(steps, stages):
    width = makespan(steps)
    rows = []
    for s in range(stages):
        row = ["."] * width
        for st in steps:
            if st.stage == s:
                row[st.start : st.end] = [st.op[0]] + ["b"] * (st.duration - 1)
        rows.append(f"  stage {s + 1}  {''.join(row)}")
    return "\n".join(rows)


def run(steps, params, xs, targets, devices, stores):
    """Runs ``steps`` in time order; returns the summed gradients per stage, the peak own bytes of
    contexts on each stage's device tier, and the disk reads."""
    n = len(params)
    fwds = [rs.split(stage, argnums=(0, 1)) for _ in range(n - 1)] + [rs.split(last_stage, argnums=(0, 1))]
    acts, cts = {}, {}
    grads = [jax.tree.map(jnp.zeros_like, p) for p in params]
    peak = [0] * n
    for st in steps:
        s, m = st.stage, st.microbatch
        store = stores[s]
        if st.op == "F":
            x = xs[m] if s == 0 else acts.pop((s, m))
            if s == n - 1:
                _, ctx = fwds[s](params[s], x, targets[m])
            else:
                y, ctx = fwds[s](params[s], x)
                acts[(s + 1, m)] = jax.device_put(y, devices[s + 1])
            store.put(ctx, f"f{m}")
        else:
            ct = None if s == n - 1 or st.op == "W" else cts.pop((s, m))
            if st.op == "BW":
                g_p, g_x = fwds[s].backward(store.pop(f"f{m}"), ct)
            elif st.op == "B":
                g_x, later = fwds[s].backward(store.pop(f"f{m}"), ct, now=1)
                store.put(later, f"w{m}")
                g_p = None
            else:  # W
                g_p, g_x = rs.backward(store.pop(f"w{m}")), None
            if g_x is not None and s > 0:
                cts[(s - 1, m)] = jax.device_put(g_x, devices[s - 1])
            if g_p is not None:
                grads[s] = jax.tree.map(jnp.add, grads[s], g_p)
        peak[s] = max(peak[s], store.stats()["device"]["bytes"])
    reads = sum(store.stats()["disk"]["reads"] for store in stores)
    return grads, peak, reads


def own_mib(ctx):
    return sum(x.nbytes for x, k in zip(ctx.residuals, ctx.spec.kinds) if k in ("input", "intermediate")) / 2**20


def gets_of(steps, s):
    """The keys stage ``s`` will get, in order: its context at B (or BW), its later at W."""
    return [f"{'w' if st.op == 'W' else 'f'}{st.microbatch}" for st in steps if st.stage == s and st.op != "F"]


def main(argv=None, report=None):
    """Runs the four orders and prints their table; ``report`` (a dict), if given, receives each
    run's disk reads by name."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rows", type=int, default=64, help="rows per microbatch")
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--f", type=int, default=512)
    parser.add_argument("--small", action="store_true", help="tiny sizes (for the tests)")
    args = parser.parse_args(argv)
    if args.small:
        args.rows, args.d, args.f = 8, 16, 32
    devices = jax.devices()
    n, m = min(4, len(devices)), args.microbatches
    keys = jax.random.split(jax.random.key(0), n + 2)
    params = [jax.device_put(init_stage(keys[s], args.d, args.f), devices[s]) for s in range(n)]
    xs = jax.device_put(jax.random.normal(keys[n], (m, args.rows, args.d)), devices[0])
    targets = jax.device_put(jax.random.normal(keys[n + 1], (m, args.rows, args.d)), devices[n - 1])
    want = jax.grad(full_loss)([jax.device_put(p, devices[0]) for p in params], jax.device_put(xs, devices[0]),
                               jax.device_put(targets, devices[0]))

    one_f = timeline(n, m, split_backward=False)
    zb = timeline(n, m, split_backward=True)
    print(f"{n} stages on {n} {devices[0].platform} devices, {m} microbatches of {args.rows}x{args.d}")
    print(f"1F1B ({makespan(one_f)} time units; F, B, W one each, b: the second unit of a whole backward):")
    print(chart(one_f, n))
    print(f"ZB-H1 ({makespan(zb)} time units):")
    print(chart(zb, n))

    fwd = rs.split(stage, argnums=(0, 1))
    y, ctx = fwd(params[0], xs[0])
    _, later = fwd.backward(ctx, jnp.ones_like(y), now=1)
    print(f"a context holds {own_mib(ctx):.3f} MiB of its own; its later {own_mib(later):.3f} MiB:")
    print("\n".join(f"  {name}" for name in later.spec.names))

    results = []
    memory = [rs.Store(None) for _ in range(n)]
    g, peak_1f1b, reads = run(one_f, params, xs, targets, devices, memory)
    results.append(("1F1B, contexts on device", one_f, g, peak_1f1b, reads))
    memory = [rs.Store(None) for _ in range(n)]
    g, peak, reads = run(zb, params, xs, targets, devices, memory)
    results.append(("ZB-H1, contexts on device", zb, g, peak, reads))
    ok = True
    for declared in (True, False):
        with tempfile.TemporaryDirectory(prefix="zero-bubble-") as folder:
            stores = [
                rs.Store(os.path.join(folder, f"stage{s}"), device_budget=peak_1f1b[s], host_budget=0,
                         write_through=False, device=devices[s])  # contexts come back on the stage's device
                for s in range(n)
            ]
            if declared:
                for s, store in enumerate(stores):
                    store.schedule(gets_of(zb, s))
            g, peak, reads = run(zb, params, xs, targets, devices, stores)
            for store in stores:
                store.close()
        name = "ZB-H1, offloaded, schedule declared" if declared else "ZB-H1, offloaded, LRU (no schedule)"
        results.append((name, zb, g, peak, reads))
        ok = ok and all(p <= b for p, b in zip(peak, peak_1f1b))

    print(f"\n{'schedule':<40} | time units | bubble | peak context MiB per stage | disk reads | max rel grad diff")
    for name, steps, grads, peak, reads in results:
        busy = sum(st.duration for st in steps)
        bubble = 1 - busy / (n * makespan(steps))
        worst = max(
            float(jnp.max(jnp.abs(jax.device_get(a) - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
            for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(jax.device_get(want)))
        )
        ok = ok and worst <= RTOL
        mib = " ".join(f"{p / 2**20:5.2f}" for p in peak)
        if report is not None:
            report[name] = reads
        print(f"{name:<40} | {makespan(steps):>10} | {bubble:6.1%} | {mib:>26} | {reads:>10} | {worst:.1e}")
    print(f"{'OK' if ok else 'FAIL'}: every order's gradients match jax.grad (tolerance {RTOL:.0e}), "
          "and the offloaded ZB-H1 stays within 1F1B's device bytes")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
