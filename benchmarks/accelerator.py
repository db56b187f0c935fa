"""Offloading on an accelerator: the copy paths, a put's time until its device bytes are free, and
a pipeline step through a store at several budgets, each against the serial floor.

Prints, in one run (docs/store.md records a TPU v5e's output):

1. **Copy paths** (GB/s, medians): device -> host by ``jax.device_put`` to fresh ``pinned_host``
   memory, by ``np.asarray`` (unpinned host memory), and through the host pool
   (``store/pinned.py``: reused, donated pinned buffers) for one large array, two, and 300 small
   ones; host -> device by ``jax.device_put`` and by the pool. The best of each direction is what
   the serial floor uses.
2. **A put's time until its device bytes are free**: one context (about 2.8 GiB of own residuals
   at the default shapes) put into ``rs.Store(None, device_budget=0)``, the source dropped, device
   bytes in use polled every 0.5 ms until they fell by the context's size; and the pool's copy of
   the same arrays; each against bytes / best D2H. Then a warm ``pop`` of it until its arrays are
   on the device, against the best H2D.
3. **The pipeline step** (F1..Fn, then Bn..B1) of a ``lax.scan`` of transformer blocks (bf16):
   the contexts in a list; each put into ``rs.Store(None, device_budget=k contexts)`` after its
   forward and popped for its backward, the next one prefetched (k = 0, 1, 2); JAX's own remat
   offload of the blocks' named intermediates (``save_and_offload_only_these_names``, one fused
   ``value_and_grad`` a microbatch); the planned step (``--parts plan``: ``save=rs.plan(...)`` at
   each of ``--budgets`` (contexts of ``save="all"``) and at 12 microbatches, the store at the
   same budget, beside the same budget's ``save="all"``, ``"auto"``, and
   ``jax.checkpoint(block, nothing_saveable)`` and ``dots_with_no_batch_dims_saveable`` written
   by hand, each put into a store at that budget, and a line a budget: the plan against the
   fastest of those and JAX's remat offload, and the two peaks); and the pressure case (contexts 1.5x the device's memory,
   ``device_budget="25%"``), for ``save="all"`` and ``"auto"``, and the fused step
   (``jax.value_and_grad`` a microbatch) and, in the plan part, the forward alone (the only
   program in which a budget-0 plan's copies to host can ride). **Each row runs in a process of its own** (the chip
   serves one process at a time; a process's allocator peak is its own). Each row: ms a
   microbatch, the ratio to the list, the ratio to the **serial floor**, peak device GiB (the chip
   allocator's ``peak_bytes_in_use`` and ``bytes_in_use`` sampled every 0.5 ms by a thread) beside
   the row's **bound** (its budget, one context and the fused step's peak: what issue 49 holds a
   store to), the GiB in use when the row began, and whether the gradients equal the list's.

The serial floor of a row is the list's compute plus the bytes that must leave the device under
its budget (``(n - k)`` contexts' own bytes) times ``1/D2H + 1/H2D`` at the best paths measured in
the same run: what a store that copies exactly what the budget forces, at the link's speed and
beside nothing, would take. The store rows use the public ``rs.Store`` API only.

Run: ``python benchmarks/accelerator.py`` on the accelerator (the issue's shapes: 8 blocks,
d=1024, T=1024, B=4, 3 microbatches); ``--quick`` for small shapes on a CPU (the logic, its rows
in this one process); ``--parts`` to run some parts only (the pressure row moves 1.5x the chip's
memory each step: minutes on a TPU v5e; ``curve``, the plan's predicted time and memory over
budgets on a TPU v5e's profile, is traced only and runs on a CPU too). Each row's result is printed on stderr as it comes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import io
import json
import math
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_model import NAMES, add_trees, forward_step, fused_step, init, make_loss  # noqa: E402
from stacks import in_memory_step  # noqa: E402
from timing import Case, interleaved_medians  # noqa: E402

import residual_store as rs  # noqa: E402
from residual_store._src.store.pinned import HostPool  # noqa: E402

PARTS = ("copies", "free", "pipeline", "remat", "pressure", "plan", "curve")


@dataclasses.dataclass(frozen=True)
class Shapes:
    blocks: int
    d: int
    seq: int
    batch: int
    heads: int
    microbatches: int
    copy_bytes: int  # one large array of the copy paths
    small_count: int  # the many small arrays of the copy paths
    small_bytes: int


FULL = Shapes(blocks=8, d=1024, seq=1024, batch=4, heads=8, microbatches=3, copy_bytes=1 << 30,
              small_count=300, small_bytes=256 << 10)
WIDE = dataclasses.replace(FULL, d=4096, heads=32)
"""``--wide``: the model 4x wider (matrix products of K=4,096: 4x the FLOPs a byte of FULL's, where
offloading should beat recomputing)."""
QUICK = Shapes(blocks=2, d=64, seq=32, batch=2, heads=2, microbatches=3, copy_bytes=4 << 20,
               small_count=300, small_bytes=4 << 10)


# -- device memory ---------------------------------------------------------------------------------


def _in_use(device: Any) -> int | None:
    stats = device.memory_stats()
    return None if not stats or "bytes_in_use" not in stats else int(stats["bytes_in_use"])


def _limit(device: Any) -> int | None:
    stats = device.memory_stats()
    return None if not stats or "bytes_limit" not in stats else int(stats["bytes_limit"])


class PeakSampler:
    """The most device bytes in use while the ``with`` block runs, polled by a thread every
    ``every`` seconds (``peak`` is ``None`` where the backend reports none)."""

    def __init__(self, device: Any, every: float = 0.0005) -> None:
        self._device, self._every = device, every
        self._stop = threading.Event()
        self.start: int | None = _in_use(device)  # in use before the block: what earlier work left
        self.peak: int | None = self.start
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set() and self.peak is not None:
            self.peak = max(self.peak, _in_use(self._device) or 0)
            time.sleep(self._every)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _wait_freed(device: Any, below: int, start: float, timeout: float = 30.0) -> float | None:
    """Seconds from ``start`` until device bytes in use fell to ``below`` (``None``: not
    reported, or not within ``timeout``)."""
    while time.perf_counter() - start < timeout:
        now = _in_use(device)
        if now is None:
            return None
        if now <= below:
            return time.perf_counter() - start
        time.sleep(0.0005)
    return None


# -- 1. copy paths ---------------------------------------------------------------------------------


def _filled(nbytes: int, count: int, seed: float) -> list[jax.Array]:
    """``count`` bf16 arrays of ``nbytes`` each, computed on the default device."""
    shape = (max(nbytes // 2 // 1024, 1), 1024)
    make = jax.jit(lambda s: jnp.full(shape, s, jnp.bfloat16))
    return jax.block_until_ready([make(jnp.float32(seed + i)) for i in range(count)])


def _pinned(xs: list[jax.Array]) -> list[jax.Array]:
    return jax.block_until_ready(jax.device_put(xs, [x.sharding.with_memory_kind("pinned_host") for x in xs]))


def copy_paths(shapes: Shapes, repeats: int) -> dict[str, dict[str, float]]:
    """GB/s of each path, by direction. Each is timed after two untimed runs: the pool's first
    copy goes into new buffers, its second compiles the program that reuses them."""
    one = _filled(shapes.copy_bytes, 1, 1.0)
    two = _filled(shapes.copy_bytes, 2, 2.0)
    small = _filled(shapes.small_bytes, shapes.small_count, 3.0)
    pool = HostPool()
    fresh: list[jax.Array] = []

    def refill() -> None:  # (np.asarray keeps the host copy it made on the array: a new one each run)
        fresh[:] = jax.block_until_ready([x + 0 for x in one])

    def rate(xs: list[jax.Array], fn: Callable[[], Any], setup: Callable[[], Any] | None = None) -> float:
        seconds = interleaved_medians({"path": Case(fn, setup)}, repeats, warmup=2)["path"]
        return sum(x.nbytes for x in xs) / seconds / 1e9

    d2h = {
        "jax.device_put to fresh pinned_host, 1 array": rate(one, lambda: _pinned(one)),
        "np.asarray (unpinned host), 1 array": rate(one, lambda: [np.asarray(x) for x in fresh], refill),
        "pool (reused pinned buffer), 1 array": rate(one, lambda: pool.to_host(one)),
        "pool, 2 arrays": rate(two, lambda: pool.to_host(two)),
        f"pool, {shapes.small_count} small arrays": rate(small, lambda: pool.to_host(small)),
    }
    host_one, host_small = pool.to_host(one), pool.to_host(small)
    device = [x.sharding for x in one]
    h2d = {
        "jax.device_put from pinned_host, 1 array": rate(one, lambda: jax.device_put(host_one, device)),
        "pool.to_device, 1 array": rate(one, lambda: pool.to_device(host_one)),
        f"pool.to_device, {shapes.small_count} small arrays": rate(small, lambda: pool.to_device(host_small)),
    }
    return {"d2h": d2h, "h2d": h2d}


def own_bytes(ctx: rs.ResidualContext) -> int:
    return int(ctx.spec.own_nbytes)


# -- 2. a put until its device bytes are free -------------------------------------------------------


def put_until_free(fwd: rs.Split, params: Any, x: jax.Array) -> dict[str, Any]:
    """A context's put into ``Store(None, device_budget=0)`` and the pool's copy of its arrays
    (the second of two, the first compiles): seconds until the call returned and until device
    bytes in use fell by the context's own bytes."""
    pool = HostPool()
    with rs.Store(None, device_budget=0) as store:
        puts: dict[str, Callable[[rs.ResidualContext], Any]] = {
            "store": lambda ctx: store.put(ctx, "k"), "pool": lambda ctx: pool.to_host(_own(ctx))}
        out = {}
        for path, put in puts.items():
            for _ in range(2):  # (the first into new buffers, the second compiles the reusing copy)
                _until_free(fwd(params, x)[1], put)
            out[path] = _until_free(fwd(params, x)[1], put)
        out["pop"] = _pop_until_ready(store, "k")
    return out


def _pop_until_ready(store: rs.Store, key: str) -> dict[str, Any]:
    """A warm ``pop`` of ``key`` (in host memory under ``device_budget=0``) until its arrays are
    on the device: the third of three, put back after the first two (the first compiles)."""
    for _ in range(2):
        ctx = jax.block_until_ready(store.pop(key))
        store.put(ctx, key)
        del ctx
    start = time.perf_counter()
    ctx = store.pop(key)
    returned = time.perf_counter() - start
    jax.block_until_ready(ctx)
    return {"bytes": held_bytes(ctx), "returned_s": returned, "ready_s": time.perf_counter() - start}


def _own(ctx: rs.ResidualContext) -> list[jax.Array]:
    return [r for r, kind in zip(ctx.residuals, ctx.spec.kinds) if kind != "weight"]


def _until_free(ctx: rs.ResidualContext, put: Callable[[rs.ResidualContext], Any]) -> dict[str, Any]:
    device = jax.devices()[0]
    jax.block_until_ready(ctx)
    size, base = own_bytes(ctx), _in_use(device)
    start = time.perf_counter()
    kept = put(ctx)
    returned = time.perf_counter() - start
    del ctx  # (the only reference left is the put's)
    freed = _wait_freed(device, base - int(0.95 * size), start) if base is not None else None
    jax.block_until_ready(kept)
    return {"bytes": size, "returned_s": returned, "freed_s": freed}


# -- 3. the pipeline step, a row a process ----------------------------------------------------------


def store_step(store: rs.Store, fwd: rs.Split, calls: list[tuple], ct: Any) -> Any:
    """Every context put into ``store`` after its forward, popped for its backward in reverse
    with the next one prefetched: a pipeline stage's step with its contexts offloaded. The loop
    dispatches as it likes: the store's budget bounds what the chip holds."""
    keys = [f"mb{i}" for i in range(len(calls))]
    for key, call in zip(keys, calls):
        store.put(fwd(*call)[1], key)
    grads = None
    for i in reversed(range(len(calls))):
        if i > 0:
            store.prefetch(keys[i - 1])
        grads = add_trees(grads, fwd.backward(store.pop(keys[i]), ct))
    return jax.block_until_ready(grads)


def held_bytes(ctx: rs.ResidualContext) -> int:
    """Device bytes a context's own residuals hold: each buffer once (two residuals may be one
    buffer, which ``spec.own_nbytes`` counts twice)."""
    buffers: dict[Any, int] = {}
    for x, kind in zip(ctx.residuals, ctx.spec.kinds):
        if kind != "weight" and isinstance(x, jax.Array):
            try:
                where: Any = x.unsafe_buffer_pointer()
            except Exception:  # noqa: BLE001 - sharded: one array, one entry
                where = id(x)
            buffers[where] = int(x.nbytes)
    return sum(buffers.values())


@dataclasses.dataclass
class Row:
    name: str
    microbatches: int
    seconds: float | None  # a step
    moved: int  # bytes that must leave the device (and come back) under the row's budget
    peak: int | None  # the most device bytes in use: the allocator's peak and the sampler's
    budget: int | None = None  # device bytes the row's store may keep (None: not a store row)
    identical: bool | None = None
    note: str = ""
    max_rel: float | None = None  # the largest gradient difference from the list's, over that leaf's largest value
    row: str = ""  # the row asked for (``kind:k``, ``@save`` where not "all")
    start: int | None = None  # device bytes in use when the row's first step began
    context: int | None = None  # device bytes one context holds
    device: str = ""  # the chip, as the row's process saw it


def _rows_of(shapes: Shapes, parts: set[str], budgets: list[int]) -> list[str]:
    """The rows a save runs, in order: the fused step first (its peak is in every bound), then
    the list (its gradients are what the others must equal), then the stores."""
    rows = ["fused", "list"] if parts & {"pipeline", "pressure"} else []
    if "pipeline" in parts:
        rows += [f"budget:{k}" for k in budgets]
    if "pressure" in parts:
        rows.append("pressure")
    return rows


HAND = {"hand-nothing": jax.checkpoint_policies.nothing_saveable,
        "hand-dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}
BASELINES = ("store:{k}@all", "store:{k}@auto", "hand-nothing:{k}", "hand-dots:{k}")
"""Issue 51's baselines at a budget of ``k`` contexts of ``save="all"`` (``@save``: the row's
``save``; ``store:k``, unlike the pipeline part's ``budget:k``, counts ``save="all"``'s contexts
whatever the row's ``save``), beside JAX's remat offload (``remat``, fused: no budget)."""


def plan_rows(budgets: list[int]) -> list[str]:
    """The plan part's rows, each ``kind:k`` a store at a device budget of ``k`` contexts of
    ``save="all"``: the fused step, the forward alone and the list, then per budget the baselines and ``plan:k``;
    then ``plan12:0`` (12 microbatches) and ``plankeep:0`` (a plan that never offloads)."""
    rows = ["fused", "forward", "list"]
    for k in budgets:
        rows += [b.format(k=k) for b in BASELINES] + [f"plan:{k}"]
    return [*rows, "plan12:0", "plankeep:0"]


def plan_budgets(rows: list[Row]) -> list[int]:
    """The budgets the plan part's rows ran the plan at (its ``plan:k`` rows), ascending."""
    return sorted({int(r.row.split(":")[1]) for r in rows if r.row.startswith("plan:")})


def verdicts(rows: list[Row], remat: Row | None, budgets: list[int]) -> list[str]:
    """Per budget, issue 51's check (no slower by 2% than the best baseline of the same run, at
    no higher peak) read both ways: the plan against the fastest baseline, and against the
    fastest whose peak is no higher than the plan's; each with both peaks."""
    by_row = {r.row: r for r in rows if r.row}
    lines = []
    for k in budgets:
        plan = by_row.get(f"plan:{k}")
        base = [by_row.get(b.format(k=k)) for b in BASELINES] + [remat]
        timed = [b for b in base if b is not None and b.seconds is not None]
        if plan is None or plan.seconds is None or not timed:
            lines.append(f"budget {k}: not run")
            continue
        lines.append(f"budget {k}: plan {_against(plan, timed, 'the fastest baseline')}")
        lower = [b for b in timed if b.peak is not None and plan.peak is not None and b.peak <= plan.peak]
        lines.append(f"budget {k}: plan {_against(plan, lower, 'the fastest at no higher peak')}")
    return lines


def _against(plan: Row, baselines: list[Row], what: str) -> str:
    """The plan's time a microbatch against the fastest of ``baselines``, and both peaks."""
    if not baselines:
        return f"against {what}: none"
    best = min(baselines, key=lambda b: b.seconds / b.microbatches)
    ratio = (plan.seconds / plan.microbatches) / (best.seconds / best.microbatches)
    return f"{ratio:.3f}x {what} ({best.name}), peak {_gib(plan.peak)} GiB against {_gib(best.peak)}"


@dataclasses.dataclass(frozen=True)
class Planned:
    """A plan part's row set up: its split, its calls, its store's budget, its name."""

    fwd: rs.Split
    calls: list[tuple]
    budget: int
    name: str


def all_bytes(shapes: Shapes, params: Any, x: Any) -> int:
    """A ``save="all"`` context's own bytes, traced, not run (a run would leave its peak in the
    row's allocator statistics)."""
    fwd = rs.split(make_loss(shapes.heads))
    ctx = jax.eval_shape(lambda p, x: fwd(p, x)[1], params, x)
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
               for a, kind in zip(ctx.residuals, ctx.spec.kinds) if kind != "weight")


def planned_row(shapes: Shapes, row: str, params: Any, xs: list[jax.Array]) -> Planned:
    """A hand-written policy's row (``hand-nothing:k``, ``hand-dots:k``) or a planned one
    (``plan:k``, ``plankeep:k``; ``plan12:k``, ``plan12keep:k`` at 12 microbatches), its budget
    ``k`` contexts of ``save="all"``."""
    kind, _, k = row.partition(":")
    size = all_bytes(shapes, params, xs[0])
    budget = int(k) * size
    count = 12 if kind.startswith("plan12") else shapes.microbatches
    calls = [(params, xs[i % len(xs)]) for i in range(count)]
    if kind in HAND:
        fwd = rs.split(make_loss(shapes.heads, HAND[kind]))
        name = f"jax.checkpoint({kind.split('-')[1]}), store at {k} contexts"
    else:
        offload = not kind.endswith("keep")
        profile = rs.device_profile()
        if kind.endswith("inprog"):  # in-program copies priced at the pool's rate
            profile = dataclasses.replace(profile, program_d2h_bytes=None)
        fwd = rs.split(make_loss(shapes.heads),
                       save=rs.plan(device_budget=budget, microbatches=count, offload=offload, profile=profile))
        where = " in-program" if kind.endswith("inprog") else ""
        name = f"rs.plan{'' if offload else '(offload=False)'}{where}, {count} mb, store at {k} contexts"
    return Planned(fwd, calls, budget, name)


CURVE = (0, 0.25, 0.5, 0.75, 1, 1.5, 2, 3)  # budgets, in contexts of save="all"


def curve(shapes: Shapes) -> list[tuple[float, Any]]:
    """The plan per budget (contexts of ``save="all"``, :data:`CURVE`) on a TPU v5e's built-in
    profile, traced only (``--parts curve`` runs anywhere, a CPU too)."""
    from residual_store._src.plan.profile import TPU_V5E

    params = jax.eval_shape(lambda: init(shapes))
    x = jax.ShapeDtypeStruct((shapes.batch, shapes.seq, shapes.d), jnp.bfloat16)
    size, n = all_bytes(shapes, params, x), shapes.microbatches
    plans = []
    for k in CURVE:
        fwd = rs.split(make_loss(shapes.heads), save=rs.plan(device_budget=int(k * size), microbatches=n, profile=TPU_V5E))
        plans.append((k, rs.plan_of(jax.eval_shape(lambda p, x: fwd(p, x)[1], params, x))))  # noqa: B023 - called at once
    return plans


def curve_table(plans: list[tuple[float, Any]]) -> list[str]:
    """Per budget: what one context keeps on the device and spills, and the time the plan adds
    to a microbatch."""
    lines = [f"{'budget (contexts)':>17} {'device MiB/ctx':>14} {'spilled MiB/ctx':>15} {'+ms/mb':>7}  choices",]
    for k, p in plans:
        lines.append(f"{k:>17} {p.device_bytes / 2**20:>14.0f} {p.spill_bytes / 2**20:>15.0f} {p.seconds * 1e3:>7.1f}  "
                     f"{p.count('keep')} kept, {p.count('spill')} spilled, {p.count('offload')} offloaded, "
                     f"{p.count('recompute')} recomputed")
    return lines


def curve_svg(plans: list[tuple[float, Any]], shapes: Shapes) -> str:
    """The same curve drawn: predicted time added a microbatch, and device MiB a context."""
    from svg_chart import Panel, chart

    title = (f"rs.plan on a TPU v5e's profile: {shapes.blocks} blocks, d={shapes.d}, T={shapes.seq}, "
             f"B={shapes.batch}, {shapes.microbatches} microbatches (predicted)")
    return chart(title, 'device budget (contexts of save="all", shared by the microbatches)', [k for k, _ in plans], [
        Panel("+ms a microbatch", [p.seconds * 1e3 for _, p in plans]),
        Panel("device MiB a context", [p.device_bytes / 2**20 for _, p in plans]),
    ])


MEASURED_LINES = (("rs.plan", "plan:{k}"), ("nothing_saveable", "hand-nothing:{k}"), ("dots", "hand-dots:{k}"),
                  ('save="auto"', "store:{k}@auto"), ('save="all"', "store:{k}@all"))
"""The measured chart's lines a budget: a name, and the plan part's row at budget ``k``."""


def measured_svg(rows: list[Row], remat: Row | None, budgets: list[int], about: str) -> str:
    """The plan part's rows drawn over budgets: ms a microbatch (log axis) and the chip's peak,
    the plan beside each baseline; JAX's remat offload and the fused step, which have no budget,
    as flat lines. A row not run, or failed, is a gap."""
    from svg_chart import Line, Panel, chart

    by_row = {r.row: r for r in rows if r.row}
    flat = [("JAX remat offload", remat), ("fused value_and_grad", by_row.get("fused"))]

    def lines(value: Callable[[Row], float | None]) -> list[Line]:
        def at(row: Row | None) -> float | None:
            return None if row is None or row.seconds is None else value(row)

        drawn = [Line(name, [at(by_row.get(pattern.format(k=k))) for k in budgets]) for name, pattern in MEASURED_LINES]
        drawn += [Line(name, [at(row)] * len(budgets)) for name, row in flat if at(row) is not None]
        return [line for line in drawn if any(y is not None for y in line.ys)]

    return chart(f"Measured, each row in a process of its own: {about}", 'device budget (contexts of save="all")',
                 budgets, [Panel("ms a microbatch (log)", lines=lines(lambda r: r.seconds / r.microbatches * 1e3), log=True),
                           Panel("peak GiB (the chip's allocator)",
                                 lines=lines(lambda r: None if r.peak is None else r.peak / 2**30))])


def draw_measured(saved: Path, svg: Path) -> None:
    """Draws a run's ``--json`` (its plan part) into ``svg``."""
    got = json.loads(saved.read_text())["rows"]
    rows = [Row(**r) for r in got.get("plan", [])]
    remat = next((Row(**r) for r in got.get("remat", [])), None)
    budgets = plan_budgets(rows)
    about = next((r.device for r in rows if r.device), "")
    svg.write_text(measured_svg(rows, remat, budgets, about))


def run_row(shapes: Shapes, save: str, row: str, repeats: int, grads: Path) -> Row:
    """One row, in this process alone: two untimed steps (the first compiles and fills a store's
    pool, the second compiles its reusing copies), then ``repeats`` timed; the peak is the chip
    allocator's over the whole process (``peak_bytes_in_use``) and a 0.5 ms sampler's while
    timed. The list row saves its gradients to ``grads``; the store rows compare theirs."""
    params = init(shapes)
    n = shapes.microbatches
    xs = [jax.random.normal(k, (shapes.batch, shapes.seq, shapes.d), jnp.bfloat16)
          for k in jax.random.split(jax.random.key(1), n)]
    calls = [(params, x) for x in xs]
    ct = jnp.float32(1.0 / n)
    loss = make_loss(shapes.heads)
    device = jax.devices()[0]
    planned = planned_row(shapes, row, params, xs) if row.startswith(("plan", "hand-")) else None
    fwd = rs.split(loss, save=save) if planned is None else planned.fwd
    # A context's own bytes: run for the rows that hold contexts (dropped at once; a planned one
    # is small), traced for the fused rows, which hold none (a run would leave a save="all"
    # context in their allocator's peak).
    fused = row in ("fused", "forward", "remat")
    size = all_bytes(shapes, params, xs[0]) if fused else own_bytes(fwd(*calls[0])[1])
    store: rs.Store | None = None
    budget: int | None = None
    moved, count, name, note = 0, n, row, ""
    if planned is not None:
        budget, count, name = planned.budget, len(planned.calls), planned.name
        store = rs.Store(None, device_budget=budget)
        fn: Callable[[], Any] = functools.partial(store_step, store, fwd, planned.calls, ct)
        moved = max(count * size - budget, 0)
        if row.startswith("plan"):
            report = rs.plan_of(fwd(*calls[0])[1])
            note = (f"{report.count('keep')} kept, {report.count('spill')} spilled, {report.count('offload')} offloaded, "
                    f"{report.count('recompute')} recomputed, +{report.seconds * 1e3:.1f} ms predicted")
    elif row == "fused":
        vg = jax.jit(jax.value_and_grad(loss))
        fn = functools.partial(fused_step, vg, calls)
        name = "fused jax.value_and_grad a microbatch"
    elif row == "forward":
        fn = functools.partial(forward_step, jax.jit(loss), calls)
        name = "the forward alone (jitted loss), a microbatch"
    elif row == "remat":
        policy = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=list(NAMES),
            offload_src="device", offload_dst="pinned_host")
        fn = functools.partial(fused_step, jax.jit(jax.value_and_grad(make_loss(shapes.heads, policy))), calls)
        name = "JAX remat offload of the named residuals (fused)"
    elif row == "list":
        fn = functools.partial(in_memory_step, fwd, calls, ct)
        name = f"{n} contexts in a list"
    elif row.startswith(("budget:", "store:")):  # k contexts of this save / of save="all"
        k = int(row.split(":")[1])
        unit = size if row.startswith("budget:") else all_bytes(shapes, params, xs[0])
        budget = k * unit
        store = rs.Store(None, device_budget=budget)
        fn = functools.partial(store_step, store, fwd, calls, ct)
        moved = (n - min(n, budget // size)) * size
        name = (f"save={save!r}, Store(None, device_budget={k} contexts)" if unit == size
                else f"save={save!r}, store at {k} contexts of 'all'")
    elif row == "pressure":
        limit = _limit(device)
        count = math.ceil(1.5 * limit / size) if limit else 2 * n
        budget = int(0.25 * limit) if limit else 2 * size
        store = rs.Store(None, device_budget="25%" if limit else budget)
        many = [(params, xs[i % n]) for i in range(count)]
        fn = functools.partial(store_step, store, fwd, many, ct)
        moved = (count - budget // size) * size
        name = f"pressure: {count} contexts, device_budget={'25%' if limit else '2 contexts'}"
    else:
        raise ValueError(f"unknown row {row!r}")
    try:
        gc.collect()
        start = _in_use(device)
        got = [np.asarray(x, np.float32) for x in jax.tree.leaves(fn())]  # (bf16 exactly; npz keeps no bf16)
        jax.block_until_ready(fn())
        with PeakSampler(device) as sampled:
            seconds = interleaved_medians({name: Case(fn)}, repeats, warmup=0)[name]
        stats = device.memory_stats() or {}
        peak = max(filter(None, (stats.get("peak_bytes_in_use"), sampled.peak)), default=None)
        identical = max_rel = None
        if row == "list":
            np.savez(grads, *got)
        elif row.startswith(("budget:", "plan", "hand-")) and grads.exists() and count == n:
            with np.load(grads) as want:
                wants = [want[f"arr_{i}"] for i in range(len(got))]
            identical = all(np.array_equal(a, w) for a, w in zip(got, wants))
            max_rel = max(float(np.max(np.abs(a - w)) / max(float(np.max(np.abs(w))), 1e-30))
                          for a, w in zip(got, wants))
        if store is not None:
            store.close()
        context = None if fused else held_bytes(fwd(*calls[0])[1])
        return Row(name, count, seconds, moved, peak, budget, identical, note, start=start, context=context,
                   device=_about(), max_rel=max_rel)
    except Exception as err:  # noqa: BLE001 - a row that cannot run says why (out of memory, say)
        return Row(name, count, None, moved, None, budget, None, f"{type(err).__name__}: {str(err).splitlines()[0][:120]}")


_RESULT = "ROW-RESULT "


def _child(argv: list[str], here: bool = False) -> Any:
    """Runs ``argv`` (this script's own arguments) in a process of its own and returns what it
    printed after :data:`_RESULT` (the chip serves one process at a time: the parent never
    touches it); ``here``: in this process (``--quick``: the logic, in seconds, on a CPU)."""
    if here:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            main(argv)
        return _child_result(out.getvalue(), "")
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv], capture_output=True, text=True)
    return _child_result(done.stdout, done.stderr, done.returncode)


def _child_result(stdout: str, stderr: str, returncode: int = 0) -> Any:
    for line in stdout.splitlines():
        if line.startswith(_RESULT):
            return json.loads(line[len(_RESULT):])
    tail = (stderr or stdout).strip().splitlines()[-1:] or ["no output"]
    return {"error": f"exit {returncode}: {tail[0][:160]}"}


def _common(args: argparse.Namespace, scratch: Path) -> list[str]:
    """The arguments every child shares: the shapes, the repeats, and one compilation cache for
    the run (``--compile-cache``, else in ``scratch``): a child loads what an earlier one
    compiled (the list's and the ``store:k`` rows' programs are the same), which takes a row on
    a TPU v5e from about 78 s to 14-36 s; compiling is never timed."""
    cache = args.compile_cache or scratch / "compiled"
    return (["--repeats", str(args.repeats), "--compile-cache", str(cache)] + (["--quick"] if args.quick else [])
            + (["--wide"] if args.wide else []))


def pipeline(args: argparse.Namespace, parts: set[str], budgets: list[int], scratch: Path) -> dict[str, Any]:
    """Every row of every save, each in its own process (see :func:`run_row`)."""
    out: dict[str, Any] = {}
    common = _common(args, scratch)
    for save in args.saves.split(","):
        rows = []
        for row in _rows_of(QUICK if args.quick else FULL, parts, budgets):
            got = _child(["--row", row, "--save", save, "--grads", str(scratch / f"list-{save}.npz"), *common],
                         here=args.quick)
            rows.append(Row(**got) if "error" not in got else Row(row, 0, None, 0, None, note=got["error"]))
            print(f"  {save} {row}: {rows[-1]}", file=sys.stderr, flush=True)
        out[save] = rows
    if "plan" in parts:
        rows = []
        for row in plan_rows(budgets):
            name, _, save = row.partition("@")
            got = _child(["--row", name, "--save", save or "all", "--grads", str(scratch / "list-plan.npz"), *common],
                         here=args.quick)
            rows.append(Row(**{**got, "row": row}) if "error" not in got else Row(row, 0, None, 0, None, note=got["error"], row=row))
            print(f"  plan {row}: {rows[-1]}", file=sys.stderr, flush=True)
        out["plan"] = rows
    if parts & {"remat", "plan"}:
        got = _child(["--row", "remat", "--save", "all", "--grads", str(scratch / "none.npz"), *common], here=args.quick)
        out["remat"] = Row(**got) if "error" not in got else Row("remat", 0, None, 0, None, note=got["error"])
    return out


# -- the report -------------------------------------------------------------------------------------


def _about() -> str:
    return f"{jax.devices()[0].device_kind} ({jax.default_backend()}), JAX {jax.__version__}"


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f}"


def report(copies: dict[str, dict[str, float]] | None, free: dict[str, Any] | None,
           pipe: dict[str, Any] | None, about: str = "") -> list[str]:
    """The run's tables, as text lines (``about``: the chip, as a child process saw it; the
    parent never touches it)."""
    about = about or next((r.device for rows in (pipe or {}).values()
                           for r in (rows if isinstance(rows, list) else [rows]) if r.device), "")
    lines = [f"# benchmarks/accelerator.py, {datetime.date.today()}, {about}; each pipeline row in its own process"]
    d2h = h2d = None
    if copies is not None:
        lines.append("\n## Copy paths (GB/s, medians)")
        for direction, paths in copies.items():
            for name, gbps in paths.items():
                lines.append(f"{direction}  {name:<52} {gbps:8.2f}")
        d2h, h2d = (max(v for k, v in copies[d].items() if "np.asarray" not in k) for d in ("d2h", "h2d"))
        lines.append(f"best into or out of pinned host memory: D2H {d2h:.2f} GB/s, H2D {h2d:.2f} GB/s "
                     "(the serial floor uses these; np.asarray's unpinned copy is no host tier's, and a view on a CPU)")
    if free is not None:
        lines.append("\n## A put until its device bytes are free (device_budget=0)")
        for path, r in free.items():
            if path == "pop":
                continue
            ideal = f"{r['freed_s'] / (r['bytes'] / (d2h * 1e9)):.2f}x bytes/best D2H" if d2h and r["freed_s"] else ""
            freed = "n/a (no bytes in use reported)" if r["freed_s"] is None else f"{r['freed_s'] * 1e3:9.1f} ms"
            lines.append(f"{path:<6} {r['bytes'] / 2**20:.1f} MiB: returned in {r['returned_s'] * 1e3:8.1f} ms, "
                         f"device bytes free after {freed} {ideal}")
        if "pop" in free:
            r = free["pop"]
            rate = r["bytes"] / r["ready_s"] / 1e9
            link = f", {rate / h2d:.2f}x best H2D" if h2d else ""
            lines.append(f"pop    {r['bytes'] / 2**20:.1f} MiB: returned in {r['returned_s'] * 1e3:8.1f} ms, "
                         f"on the device after {r['ready_s'] * 1e3:9.1f} ms ({rate:.2f} GB/s{link})")
    for save, rows in (pipe or {}).items():
        if save == "remat" or not rows:
            continue
        if save == "plan":
            lines.append("\n## Planned: rs.plan beside hand-written policies, each put into a store at the same budget")
            lines.extend(_rows(rows, d2h, h2d))
            lines.extend(verdicts(rows, (pipe or {}).get("remat"), plan_budgets(rows)))
            continue
        context = next((r.context for r in rows if r.context), None)
        held = "" if context is None else f", {context / 2**20:.1f} MiB held on the device"
        lines.append(f"\n## Pipeline step, save={save!r} (own residuals a context{held})")
        lines.extend(_rows(rows, d2h, h2d))
    if pipe and "remat" in pipe:
        lines.append("\n## JAX's own offload")
        lines.extend(_rows([pipe["remat"]], d2h, h2d, base=_list_row(pipe)))
    return lines


def _list_row(pipe: dict[str, Any]) -> Row | None:
    rows = pipe.get("all") or next((p for k, p in pipe.items() if k != "remat"), None)
    return next((r for r in rows or [] if r.name.endswith("in a list")), None)


def bound(row: Row, fused: Row | None) -> int | None:
    """What a store row may peak at: its budget, one context and the fused step's peak."""
    if row.budget is None or fused is None or fused.peak is None or row.context is None:
        return None
    return row.budget + row.context + fused.peak


def _rows(rows: list[Row], d2h: float | None, h2d: float | None, base: Row | None = None) -> list[str]:
    """One line a row: ms a microbatch, against the list's (``base``, else the list row) and
    against the serial floor (see the module docstring); the peak beside the row's bound."""
    base = base or next((r for r in rows if r.name.endswith("in a list")), None)
    fused = next((r for r in rows if r.name.startswith("fused")), None)
    per_mb = base.seconds / base.microbatches if base is not None and base.seconds else None
    out = [f"{'case':<52} {'ms/mb':>9} {'vs list':>8} {'vs floor':>9} {'peak GiB':>9} {'bound':>7} "
           f"{'at start':>9} {'same grads':>10}"]
    for row in rows:
        count = row.microbatches
        ms = None if row.seconds is None else row.seconds / count * 1e3
        floor = None
        if per_mb is not None and d2h and h2d:
            floor = per_mb * count + row.moved * (1 / (d2h * 1e9) + 1 / (h2d * 1e9))
        vs_list = "" if ms is None or per_mb is None else f"{ms / (per_mb * 1e3):.2f}"
        vs_floor = "" if row.seconds is None or floor is None else f"{row.seconds / floor:.2f}"
        same = "" if row.identical is None else "True" if row.identical else f"{row.max_rel:.0e} rel"
        shown = "failed" if ms is None else f"{ms:.1f}"
        limit = bound(row, fused)
        out.append(f"{row.name:<52} {shown:>9} {vs_list:>8} {vs_floor:>9} {_gib(row.peak):>9} "
                   f"{'-' if limit is None else _gib(limit):>7} {_gib(row.start):>9} {same:>10} {row.note}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (a CPU, in seconds)")
    parser.add_argument("--wide", action="store_true", help="the model 4x wider (d=4096, 32 heads)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"some of {','.join(PARTS)}")
    parser.add_argument("--saves", default="all,auto")
    parser.add_argument("--budgets", default="0,1,2", help="device budgets of the store rows, in contexts")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    parser.add_argument("--svg", type=Path, help="with --parts curve: also draw the curve here; with --draw: the chart")
    parser.add_argument("--draw", type=Path, help="draw the plan part of a run's --json into --svg, and stop")
    parser.add_argument("--compile-cache", type=Path,
                        help="JAX's persistent compilation cache for the children (default: one for this run only)")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # (a child: one row, see run_row)
    parser.add_argument("--save", default="all", help=argparse.SUPPRESS)
    parser.add_argument("--grads", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--part", help=argparse.SUPPRESS)  # (a child: copies or free)
    args = parser.parse_args(argv)
    shapes = QUICK if args.quick else WIDE if args.wide else FULL
    if args.compile_cache is not None and not args.quick:  # (--quick runs its children here)
        rs.enable_compilation_cache(args.compile_cache)
    if args.row is not None:
        print(_RESULT + json.dumps(dataclasses.asdict(run_row(shapes, args.save, args.row, args.repeats, args.grads))))
        return 0
    if args.part == "copies":
        print(_RESULT + json.dumps({"about": _about(), "result": copy_paths(shapes, args.repeats)}))
        return 0
    if args.part == "free":
        params = init(shapes)
        x = jax.random.normal(jax.random.key(9), (shapes.batch, shapes.seq, shapes.d), jnp.bfloat16)
        free = put_until_free(rs.split(make_loss(shapes.heads), save="all"), params, x)
        print(_RESULT + json.dumps({"about": _about(), "result": free}))
        return 0
    if args.draw is not None:
        if args.svg is None:
            parser.error("--draw needs --svg")
        draw_measured(args.draw, args.svg)
        return 0
    parts = set(args.parts.split(","))
    unknown = parts - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    if "curve" in parts:
        print(f"## The plan's predicted time and memory over budgets (TPU v5e profile, {shapes.microbatches} microbatches)")
        plans = curve(shapes)
        print("\n".join(curve_table(plans)), flush=True)
        if args.svg is not None:
            args.svg.write_text(curve_svg(plans, shapes))
        if parts == {"curve"}:
            return 0
    with tempfile.TemporaryDirectory() as scratch:
        return _run(args, parts, Path(scratch))


def _run(args: argparse.Namespace, parts: set[str], scratch: Path) -> int:
    """The parts asked for, each child in a process of its own, then the report."""
    common = _common(args, scratch)
    copies = _child(["--part", "copies", *common], here=args.quick) if "copies" in parts else None
    print(f"  copies: {copies}", file=sys.stderr, flush=True)
    free = _child(["--part", "free", *common], here=args.quick) if "free" in parts else None
    print(f"  free: {free}", file=sys.stderr, flush=True)
    for name, got in (("copies", copies), ("free", free)):
        if got is not None and "error" in got:
            print(f"{name}: {got['error']}", file=sys.stderr)
    about = next((got["about"] for got in (copies, free) if got is not None and "about" in got), "")
    copies = None if copies is None or "error" in copies else copies["result"]
    free = None if free is None or "error" in free else free["result"]
    pipe = None
    if parts & {"pipeline", "remat", "pressure", "plan"}:
        pipe = pipeline(args, parts, [int(k) for k in args.budgets.split(",")], scratch)
    lines = report(copies, free, pipe, about)
    print("\n".join(lines), flush=True)
    if args.json is not None:
        rows = {k: [dataclasses.asdict(r) for r in (v if isinstance(v, list) else [v])] for k, v in (pipe or {}).items()}
        args.json.write_text(json.dumps({"copies": copies, "free": free, "rows": rows, "report": lines}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
