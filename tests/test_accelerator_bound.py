"""On an accelerator only: a store's device budget bounds what the chip holds (issue 49).

The pipeline step of ``benchmarks/accelerator.py`` (its model at the issue's shapes: 8 blocks,
d=1024, T=1024, B=4, bf16, 3 microbatches, all forwards then all backwards, the next context
prefetched) through ``Store(None, device_budget=k contexts)`` peaks, in the chip allocator's
``bytes_in_use`` sampled every 0.5 ms, at most at the budget, one context and the fused step's
peak (``jax.value_and_grad`` a microbatch), each measured from the bytes in use before it began
(this process may hold other tests' arrays). Gradients equal the list's. On a CPU the chip's
allocator is not there to ask: skipped, the logic runs in ``test_store_memory.py`` (a caller
that dispatches ahead). ``benchmarks/accelerator.py`` measures the same a process a row.
"""

from __future__ import annotations

import functools
import gc
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual_store as rs
from platforms import backend

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

accelerator = pytest.importorskip("accelerator")


@pytest.fixture(scope="module")
def model():
    if backend() == "cpu" or not (jax.devices()[0].memory_stats() or {}).get("bytes_in_use"):
        pytest.skip("the chip's allocator is what this measures: an accelerator only (a CPU runs the "
                    "logic in test_store_memory.py)")
    shapes = accelerator.FULL
    params = accelerator.init(shapes)
    xs = [jax.random.normal(k, (shapes.batch, shapes.seq, shapes.d), jnp.bfloat16)
          for k in jax.random.split(jax.random.key(1), shapes.microbatches)]
    calls = [(params, x) for x in xs]
    loss = accelerator.make_loss(shapes.heads)
    fwd = rs.split(loss, save="all")
    ct = jnp.float32(1.0 / shapes.microbatches)
    fused = functools.partial(accelerator.fused_step, jax.jit(jax.value_and_grad(loss)), calls)
    return fwd, calls, ct, fused


def _peak_above_start(fn) -> tuple[int, object]:  # noqa: ANN001
    """The most device bytes in use while ``fn()`` runs (its second run: the first compiles),
    beyond those in use before it; and its result."""
    device = jax.devices()[0]
    jax.block_until_ready(fn())
    gc.collect()
    with accelerator.PeakSampler(device) as sampled:
        out = fn()
    return sampled.peak - sampled.start, out


@pytest.mark.parametrize("budget_contexts", [0, 1])
def test_a_budget_bounds_the_chips_memory_on_the_benchmarks_model(model, budget_contexts):
    fwd, calls, ct, fused = model
    fused_peak, _ = _peak_above_start(fused)
    one = accelerator.held_bytes(fwd(*calls[0])[1])
    budget = budget_contexts * fwd(*calls[0])[1].spec.own_nbytes
    want = [np.asarray(g, np.float32) for g in jax.tree.leaves(accelerator.in_memory_step(fwd, calls, ct))]
    with rs.Store(None, device_budget=budget) as store:
        peak, got = _peak_above_start(functools.partial(accelerator.store_step, store, fwd, calls, ct))
    bound = budget + one + fused_peak
    assert peak <= bound, f"{peak / 2**30:.2f} GiB over a bound of {bound / 2**30:.2f} GiB"
    for g, w in zip(jax.tree.leaves(got), want):
        assert np.array_equal(np.asarray(g, np.float32), w)


def _in_use() -> int:
    """The chip allocator's bytes in use, once this process's garbage is gone."""
    gc.collect()
    return int(jax.devices()[0].memory_stats()["bytes_in_use"])


def _one_array_per_aval(ctx: rs.ResidualContext) -> rs.ResidualContext:
    """``ctx`` with its own residuals of one shape and dtype made one array each (the first):
    residuals that are one array, as a split can make them (its spec, avals and all, unchanged)."""
    first: dict[tuple, jax.Array] = {}
    leaves = [x if k == "weight" else first.setdefault((x.shape, x.dtype), x)
              for x, k in zip(ctx.residuals, ctx.spec.kinds)]
    return rs.ResidualContext.tree_unflatten(ctx.spec, leaves)


def test_stats_device_held_is_what_the_chip_holds_for_the_stores_contexts(model):
    """``stats()["device"]["held"]`` against the chip allocator's ``bytes_in_use`` (beyond what
    was in use before): a context in the device tier and others pushed to host memory by their
    puts, one popped and held by its caller, then dropped, one got from the device tier, and a
    context several of whose residuals are one array (counted, copied and brought back once)."""
    fwd, calls, _, _ = model
    one = accelerator.held_bytes(fwd(*calls[0])[1])
    slack = one // 100 + (16 << 20)  # (the allocator's rounding and the programs' small buffers)

    def agrees(store: rs.Store, base: int) -> int:
        held = store.stats()["device"]["held"]
        used = _in_use() - base
        assert abs(used - held) <= slack, f"allocator {used / 2**20:.1f} MiB, held {held / 2**20:.1f} MiB"
        return held

    jax.block_until_ready(calls)
    base = _in_use()
    with rs.Store(None, device_budget=one) as store:
        for i, call in enumerate(calls):
            store.put(fwd(*call)[1], f"mb{i}")  # (the put waits for what leaves the device)
        assert agrees(store, base) == one  # the last context on the device, the others on host
        got = jax.block_until_ready(store.pop("mb0"))  # lent: held by its caller
        assert agrees(store, base) == 2 * one
        del got
        assert agrees(store, base) == one  # dropped, no backward read it: free at once
        ctx = jax.block_until_ready(store.get(f"mb{len(calls) - 1}"))  # the device tier's own
        assert agrees(store, base) == one
        del ctx
        store.clear()
        assert agrees(store, base) == 0
        same = _one_array_per_aval(fwd(*calls[0])[1])
        distinct = {id(x): x for x, k in zip(same.residuals, same.spec.kinds) if k != "weight"}
        shared = sum(x.nbytes for x in distinct.values())
        assert shared < one
        store.put(same, "same")
        del same, distinct
        assert agrees(store, base) == shared
        store.put(fwd(*calls[1])[1], "other")  # pushes "same" to host: its arrays copied once each
        assert agrees(store, base) == one
        back = jax.block_until_ready(store.pop("same"))
        own = [x for x, k in zip(back.residuals, back.spec.kinds) if k != "weight"]
        assert len({id(x) for x in own}) == len({(x.shape, x.dtype) for x in own}) < len(own)
        assert agrees(store, base) == one + shared  # come back as one array each
        del back, own
        assert agrees(store, base) == one
    assert abs(_in_use() - base) <= slack  # a closed store holds nothing on the device
