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
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_model import add_trees  # noqa: E402
from timing import Case, interleaved_medians, timed  # noqa: E402

import residual_store as rs  # noqa: E402
from residual_store_serializers import aligned_empty  # noqa: E402


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
        t = {"put": timed(put, lambda: None, repeats), "raw put": timed(raw_put, lambda: None, repeats),
             "get": timed(get, lambda: None, repeats), "raw get": timed(raw_get, lambda: None, repeats)}
    return {"blocks": blocks, "residuals": len(own), "bytes": len(raw), "files": created,
            "identical": identical, "t": t}


def in_memory_step(fwd: rs.Split, calls: list[tuple], ct: Any) -> Any:
    """A pipeline step with the contexts in a list: every forward (``fwd(*call)``), then every
    backward in reverse; the gradients summed."""
    contexts = [fwd(*call)[1] for call in calls]
    grads = None
    for ctx in reversed(contexts):
        grads = add_trees(grads, fwd.backward(ctx, ct))
    return jax.block_until_ready(grads)


def spilled_step(store: rs.Store, fwd: rs.Split, calls: list[tuple], ct: Any) -> Any:
    """The same step with every context ``put`` into ``store`` after its forward, prefetched one
    backward ahead and got for its backward; ends with ``flush``, so the writer's work counts."""
    keys = [f"mb{i}" for i in range(len(calls))]
    for key, call in zip(keys, calls):
        store.put(fwd(*call)[1], key)
    store.prefetch(keys[-1])
    grads = None
    for i in reversed(range(len(calls))):
        if i > 0:
            store.prefetch(keys[i - 1])
        grads = add_trees(grads, fwd.backward(store.get(keys[i]), ct))
    grads = jax.block_until_ready(grads)
    store.flush()
    return grads


def measure_pipeline(base: Path, repeats: int, *, blocks: int = 24, d: int = 256, batch: int = 128, n: int = 8) -> dict[str, Any]:
    params = init_stack(blocks, d)
    xs = [jax.random.normal(k, (batch, d)) for k in jax.random.split(jax.random.key(2), n)]
    splits = {save: rs.split(stack_loss, save=save) for save in ("all", "auto")}
    ct = jnp.float32(1.0 / n)

    calls = [(params, x) for x in xs]

    def in_memory(save: str) -> Any:
        return in_memory_step(splits[save], calls, ct)

    def via_store(store: rs.Store, save: str) -> Any:
        return spilled_step(store, splits[save], calls, ct)

    ctx = splits["all"](params, xs[0])[1]
    own = _own(ctx)
    stores = {save: rs.Store(base / f"pipeline-{save}", device_budget=0, host_budget=0) for save in splits}
    try:
        identical = {}
        for save, store in stores.items():
            want = jax.tree.leaves(in_memory(save))
            got = jax.tree.leaves(via_store(store, save))
            identical[save] = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, want))
        cases = {
            "in memory, all": Case(lambda: in_memory("all")),
            "store, all": Case(lambda: via_store(stores["all"], "all")),
            "store, auto": Case(lambda: via_store(stores["auto"], "auto")),
        }
        t = interleaved_medians(cases, repeats)
    finally:
        for s in stores.values():
            s.close()
    return {"residuals": len(own), "bytes": sum(a.nbytes for a in own), "identical": identical,
            "t": t}


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
