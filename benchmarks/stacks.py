"""The store on the contexts users make: a stack of blocks unrolled in Python (no ``lax.scan``).

Each block is ``z = h @ w + b``, a layer norm, a gelu and a residual add, so a context holds
about 13 small residuals per block. Two measurements, ratios in one run:

1. **put and get of one context** (16 and 64 blocks, d=64, batch 8), in a store in use
   (``Store(path, device_budget=0, host_budget=0)``, durable; each run puts a new key, flushes,
   gets it back and deletes it, so the store recycles folders as in training): ``put`` +
   ``flush`` against the same own bytes written as one file with one ``fdatasync`` (and its
   folder's ``fsync``); ``get`` (until the arrays are ready) against one ``readinto`` of that file
   and one ``jax.device_put`` of the buffer; the files one put creates.
2. **a pipeline step** of the 24-block stack (d=256, batch 128, 8 microbatches: F1..F8, then
   B8..B1) with every context through a store with budgets 0 (put after its forward, prefetched
   one backward ahead, got for its backward; ``flush`` at the end of the step), against the step
   with contexts kept in a list with ``save="all"``; with ``save="all"`` and ``save="auto"``.
   Gradients must be bit-identical to the in-memory ones of the same ``save``.

Run: ``python benchmarks/stacks.py [--repeats N] [--dir DIR]``, or as ``--part stacks`` of
``store_throughput.py``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import residual_store as rs  # noqa: E402
from serializers import aligned_empty  # noqa: E402


def init_stack(blocks: int, d: int, seed: int = 0) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(jax.random.key(seed), blocks)
    return [
        {"w": jax.random.normal(k, (d, d), jnp.float32) / np.sqrt(d), "b": jnp.zeros((d,)),
         "g": jnp.ones((d,)), "beta": jnp.zeros((d,))}
        for k in keys
    ]


def stack_loss(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    """The unrolled stack: a Python loop over blocks, as Flax, Equinox and Haiku models are."""
    h = x
    for p in params:
        z = h @ p["w"] + p["b"]
        mu = jnp.mean(z, axis=-1, keepdims=True)
        var = jnp.mean((z - mu) ** 2, axis=-1, keepdims=True)
        n = (z - mu) * jax.lax.rsqrt(var + 1e-5) * p["g"] + p["beta"]
        h = h + jax.nn.gelu(n)
    return jnp.mean(h**2)


def _own(ctx: rs.ResidualContext) -> list[np.ndarray]:
    return [np.asarray(x) for x, k in zip(ctx.residuals, ctx.spec.kinds) if k in ("intermediate", "input")]


def _median(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _files(root: Path) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}


def measure_put_get(base: Path, blocks: int, repeats: int) -> dict[str, Any]:
    params = init_stack(blocks, 64)
    fwd = rs.split(stack_loss)
    _, ctx = fwd(params, jax.random.normal(jax.random.key(1), (8, 64)))
    own = _own(ctx)
    raw = b"".join(a.tobytes() for a in own)
    folder = base / f"raw-{blocks}"
    folder.mkdir(parents=True, exist_ok=True)
    buf = aligned_empty((len(raw),), np.uint8)

    def raw_put() -> None:
        fd = os.open(folder / "ctx", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, raw)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        dfd = os.open(folder, os.O_RDONLY)
        os.fsync(dfd)
        os.close(dfd)

    def raw_get() -> jax.Array:
        with open(folder / "ctx", "rb", buffering=0) as f:
            f.readinto(buf)
        return jax.device_put(buf)

    root = base / f"store-{blocks}"
    counter = iter(range(10**9))
    with rs.Store(root, device_budget=0, host_budget=0) as store:
        store.put(ctx, "warm")
        store.flush()
        before = _files(root)
        store.put(ctx, "count")
        store.flush()
        created = len(_files(root) - before)
        store.delete("count")

        def put() -> None:
            key = f"k{next(counter)}"
            store.put(ctx, key)
            store.flush()
            store.delete(key)

        store.put(ctx, "held")
        store.flush()

        def get() -> Any:
            return store.get("held").residuals

        got = store.get("held")
        identical = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got.residuals, ctx.residuals))
        t = {"put": _median(put, repeats), "raw put": _median(raw_put, repeats),
             "get": _median(get, repeats), "raw get": _median(raw_get, repeats)}
    return {"blocks": blocks, "residuals": len(own), "bytes": len(raw), "files": created,
            "identical": identical, "t": t}


def measure_pipeline(base: Path, repeats: int, *, blocks: int = 24, d: int = 256, batch: int = 128, n: int = 8) -> dict[str, Any]:
    params = init_stack(blocks, d)
    xs = [jax.random.normal(k, (batch, d)) for k in jax.random.split(jax.random.key(2), n)]
    splits = {save: rs.split(stack_loss, save=save) for save in ("all", "auto")}
    ct = jnp.float32(1.0 / n)

    def add(a: Any, b: Any) -> Any:
        return b if a is None else jax.tree.map(jnp.add, a, b)

    def in_memory(save: str) -> Any:
        fwd = splits[save]
        contexts = [fwd(params, x)[1] for x in xs]
        grads = None
        for ctx in reversed(contexts):
            grads = add(grads, fwd.backward(ctx, ct))
        return grads

    def via_store(store: rs.Store, save: str) -> Any:
        fwd = splits[save]
        keys = [f"mb{i}" for i in range(n)]
        for i in range(n):
            store.put(fwd(params, xs[i])[1], keys[i])
        store.prefetch(keys[-1])
        grads = None
        for i in reversed(range(n)):
            if i > 0:
                store.prefetch(keys[i - 1])
            grads = add(grads, fwd.backward(store.get(keys[i]), ct))
        grads = jax.block_until_ready(grads)
        store.flush()
        return grads

    ctx = splits["all"](params, xs[0])[1]
    own = _own(ctx)
    stores = {save: rs.Store(base / f"pipeline-{save}", device_budget=0, host_budget=0) for save in splits}
    try:
        identical = {}
        for save, store in stores.items():
            want = jax.tree.leaves(in_memory(save))
            got = jax.tree.leaves(via_store(store, save))
            identical[save] = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, want))
        cases: dict[str, Callable[[], Any]] = {
            "in memory, all": lambda: in_memory("all"),
            "store, all": lambda: via_store(stores["all"], "all"),
            "store, auto": lambda: via_store(stores["auto"], "auto"),
        }
        times: dict[str, list[float]] = {k: [] for k in cases}
        for fn in cases.values():
            jax.block_until_ready(fn())
        names = list(cases)
        for r in range(repeats):  # round-robin, each round starting one later
            for name in names[r % len(names):] + names[: r % len(names)]:
                t0 = time.perf_counter()
                jax.block_until_ready(cases[name]())
                times[name].append(time.perf_counter() - t0)
    finally:
        for s in stores.values():
            s.close()
    return {"residuals": len(own), "bytes": sum(a.nbytes for a in own), "identical": identical,
            "t": {k: statistics.median(v) for k, v in times.items()}}


def report(base: Path, repeats: int) -> list[tuple[str, float, float, str]]:
    """Prints both tables; returns the goals as (name, measured, target, "<=" or ">=")."""
    goals = []
    print("\nunrolled stacks, one context in a store in use (budgets 0, durable)")
    print(f"{'context':28} {'own residuals':>13} {'MiB':>6} | {'put+flush / raw':>15} {'get / raw':>10} "
          f"{'files per put':>13} | bitwise")
    for blocks in (16, 64):
        m = measure_put_get(base, blocks, repeats)
        t = m["t"]
        put, get = t["put"] / t["raw put"], t["get"] / t["raw get"]
        print(f"{f'{blocks} blocks (d=64, batch 8)':28} {m['residuals']:>13} {m['bytes'] / 2**20:>6.2f} | "
              f"{put:>14.1f}x {get:>9.1f}x {m['files']:>13} | {m['identical']}"
              f"   (raw put {t['raw put'] * 1e3:.2f} ms, raw get {t['raw get'] * 1e3:.2f} ms)")
        goals += [(f"{blocks} blocks: put+flush / one file+fsync", put, 5.0, "<="),
                  (f"{blocks} blocks: get / one file read+device_put", get, 10.0, "<="),
                  (f"{blocks} blocks: files per put", m["files"], 4, "<=")]
    p = measure_pipeline(base, max(3, repeats // 2))
    t = p["t"]
    base_t = t["in memory, all"]
    print(f"\npipeline step, 24 unrolled blocks (d=256, batch 128), 8 microbatches F1..F8 B8..B1: "
          f"{p['residuals']} own residuals, {p['bytes'] / 2**20:.1f} MiB a context")
    for name, v in t.items():
        print(f"  {name:16} {v * 1e3:8.1f} ms  {v / base_t:5.2f}x")
    print(f"  gradients bit-identical to in memory: {p['identical']}")
    goals += [("24-block pipeline, store all / in memory all", t["store, all"] / base_t, 1.25, "<="),
              ("24-block pipeline, store auto / in memory all", t["store, auto"] / base_t, 1.15, "<=")]
    return goals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="rs-bench-stacks-", dir=args.dir))
    try:
        goals = report(base, args.repeats)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print("\ngoal | measured | target | verdict")
    for name, got, target, op in goals:
        ok = got <= target if op == "<=" else got >= target
        print(f"{name} | {got:.2f} | {op} {target} | {'PASS' if ok else 'MISS'}")


if __name__ == "__main__":
    main()
