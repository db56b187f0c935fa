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
