"""The B/W split of a backward and a store that follows the schedule: issue 13's goals.

Run: ``python benchmarks/zero_bubble.py [--runs 20] [--quick]``. One process; every time is the
median of ``--runs`` timed runs after warm-up, candidates timed round-robin, and every ratio is
measured in this one run (absolute times on shared machines are noise, ratios are not).

1. **B and W against the plain backward** of the same context, for an MLP stage (8 tanh layers of
   1024, batch 256) and a transformer block (sequence 256, d_model 512, 8 heads, batch 4), both
   ``stage(params, x) -> activations`` split with ``argnums=(0, 1)``, a random cotangent:
   ``split.backward(ctx, ct)`` (plain), ``split.backward(ctx, ct, now=1)`` (B: the input
   gradient), ``rs.backward(later)`` (W), and B then W. Also ``later``'s bytes against the
   context's (all of them, weights held by reference included) and against its own.
2. **Schedule-aware spill**: F1..F8 then B8..B1 (and then B1..B8) of the MLP stage (at
   ``--quick`` sizes, whatever the flag) into ``rs.Store(path, device_budget=<two contexts>,
   host_budget=0)``: disk reads with ``store.schedule`` declared (it loads ahead as deep as the
   budget holds), against LRU with loads ahead by hand (``store.prefetch`` of the next two, and of
   the next one).
3. **Peak device bytes** of ZB-H1 with ``later`` offloaded against 1F1B: the table of
   ``examples/zero_bubble.py`` (four stages on four CPU devices).

Goals (issue 13), printed as one table with a verdict per goal:

- B + W <= 1.05x the plain backward; B alone <= 0.6x of it; for both models;
- ``later.nbytes < ctx.nbytes`` where B-only residuals exist (the ratio per model);
- schedule-aware spill: disk reads <= the contexts that cannot fit, and fewer than LRU on the
  same order (both orders above, and ZB-H1 over four stages with 1F1B's budget, part 3).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys
import tempfile
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 4)  # part 3 runs four stages on four devices

import jax.numpy as jnp  # noqa: E402
from split_overhead import interleaved_medians, mlp_stage_case, parse_args, table, transformer_stage_case  # noqa: E402

import residual_store as rs  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _own(ctx: rs.ResidualContext) -> int:
    return ctx.spec.own_nbytes


def measure_halves(name: str, stage: Any, args: tuple[Any, ...], runs: int) -> dict[str, Any]:
    fwd = rs.split(stage, argnums=(0, 1))
    y, ctx = fwd(*args)
    ct = jax.random.normal(jax.random.key(7), y.shape, y.dtype)
    _, later = fwd.backward(ctx, ct, now=1)

    def b_then_w() -> Any:
        g_x, lat = fwd.backward(ctx, ct, now=1)
        return g_x, rs.backward(lat)

    t = interleaved_medians(
        {
            "plain": lambda: fwd.backward(ctx, ct),
            "B": lambda: fwd.backward(ctx, ct, now=1)[0],
            "W": lambda: rs.backward(later),
            "B+W": b_then_w,
        },
        runs,
    )
    return {
        "model": name,
        "plain ms": 1e3 * t["plain"],
        "B ms": 1e3 * t["B"],
        "W ms": 1e3 * t["W"],
        "B / plain": t["B"] / t["plain"],
        "B+W / plain": t["B+W"] / t["plain"],
        "ctx MiB": ctx.nbytes / 2**20,
        "ctx own MiB": _own(ctx) / 2**20,
        "later MiB": later.nbytes / 2**20,
        "later / ctx": later.nbytes / ctx.nbytes,
        "later / ctx own": _own(later) / _own(ctx),
    }


def spill_reads(folder: str, backwards_reversed: bool) -> dict[str, Any]:
    """Disk reads of F1..F8 then B8..B1 (or B1..B8) under a device budget of two contexts, no
    host tier."""
    stage, (params, x0) = mlp_stage_case(True)
    fwd = rs.split(stage, argnums=(0, 1))
    keys = [f"mb{i}" for i in range(8)]
    contexts = [fwd(params, x0 + 0.01 * i)[1] for i in range(8)]
    size = _own(contexts[0])
    order = keys[::-1] if backwards_reversed else keys
    out: dict[str, Any] = {"order": "F1..F8, B8..B1" if backwards_reversed else "F1..F8, B1..B8", "cannot fit": 6}
    for mode, ahead in (("schedule", 0), ("LRU, two ahead", 2), ("LRU, one ahead", 1)):
        path = os.path.join(folder, f"{mode.replace(' ', '_').replace(',', '')}{backwards_reversed}")
        with rs.Store(path, device_budget=2 * size, host_budget=0) as store:
            if mode == "schedule":
                store.schedule(order)
            for key, ctx in zip(keys, contexts):
                store.put(ctx, key)
            store.flush()
            for i, key in enumerate(order):
                for nxt in order[i + 1 : i + 1 + ahead]:
                    store.prefetch(nxt)
                jax.block_until_ready(rs.backward(store.get(key), jnp.ones_like(x0)))
            out[mode] = store.stats()["disk"]["reads"]
    return out


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("zero_bubble_example", ROOT / "examples" / "zero_bubble.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    args = parse_args(__doc__)
    halves = [
        measure_halves("MLP stage 8x1024 tanh, batch 256" if not args.quick else "MLP stage (quick)",
                       *mlp_stage_case(args.quick), args.runs),
        measure_halves("transformer block s256 d512 h8" if not args.quick else "block (quick)",
                       *transformer_stage_case(args.quick), args.runs),
    ]
    print("1. B (input gradient) and W (weight gradients) against the plain backward of the same context")
    print(table(halves))

    with tempfile.TemporaryDirectory(prefix="rs-zero-bubble-") as folder:
        spills = [spill_reads(folder, True), spill_reads(folder, False)]
    print("\n2. eight contexts, device budget two contexts, no host tier: contexts read back from disk")
    print(table(spills))

    print("\n3. four stages, eight microbatches: examples/zero_bubble.py")
    example = _example()
    zb: dict[str, int] = {}
    code = example.main(["--small"] if args.quick else [], report=zb)

    goals = []
    for r in halves:
        goals.append((f"{r['model']}: B+W / plain", f"{r['B+W / plain']:.2f}x", "<= 1.05x", r["B+W / plain"] <= 1.05))
        goals.append((f"{r['model']}: B / plain", f"{r['B / plain']:.2f}x", "<= 0.60x", r["B / plain"] <= 0.60))
        goals.append((f"{r['model']}: later.nbytes / ctx.nbytes", f"{r['later / ctx']:.2f} (own {r['later / ctx own']:.2f})",
                      "< 1", r["later / ctx"] < 1))
    for r in spills:
        lru = min(r["LRU, two ahead"], r["LRU, one ahead"])
        goals.append((f"{r['order']}: disk reads", f"{r['schedule']}", f"<= {r['cannot fit']}", r["schedule"] <= r["cannot fit"]))
        goals.append((f"{r['order']}: disk reads against LRU", f"{r['schedule']} vs {lru}", "< LRU", r["schedule"] < lru))
    declared, lru = zb["ZB-H1, offloaded, schedule declared"], zb["ZB-H1, offloaded, LRU (no schedule)"]
    goals.append(("ZB-H1, 4 stages, 1F1B's budget: disk reads against LRU", f"{declared} vs {lru}", "< LRU", declared < lru))
    print("\ngoals (issue 13); LRU: the better of one and two loads ahead by hand:")
    print(table([{"goal": g, "measured": m, "target": t, "verdict": "PASS" if ok else "MISS"} for g, m, t, ok in goals]))
    return code


if __name__ == "__main__":
    sys.exit(main())
