"""``store.schedule(keys)``: spill the context needed last, load ahead of need (issue 13 part 2).

Orders are checked by hand: which key goes to disk, how many contexts are read back, with the
store's counters (``stats()``) and a fresh ``Store`` on the same folder that sees what was written.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual_store as rs
from residual_store._src.store.schedule import Schedule

N = 64


def _fwd():
    return rs.split(lambda w, x: jnp.sum(jnp.tanh(x @ w)), argnums=(0, 1))


@pytest.fixture(scope="module")
def contexts():
    """Eight contexts of one signature (own bytes: the input and one intermediate), their
    reference gradients, and their size."""
    fwd = _fwd()
    w = jax.random.normal(jax.random.key(0), (16, 16)) / 4
    out = []
    for i in range(8):
        x = jax.random.normal(jax.random.key(i + 1), (N, 16))
        _, ctx = fwd(w, x)
        out.append((ctx, jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w)), argnums=(0, 1))(w, x)))
    return fwd, out, out[0][0].spec.own_nbytes


def _check(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def _on_disk(path):
    with rs.Store(path, read_only=True) as reader:
        return set(reader.keys())


@pytest.mark.slow
def test_internals_a_put_spills_the_context_needed_last(tmp_path, contexts):
    fwd, ctxs, size = contexts
    for declared, expect_spilled in ((["mb1", "mb0", "mb2"], "mb2"), (None, "mb0"), (["mb2", "mb1"], "mb0")):
        path = tmp_path / f"s{expect_spilled}{declared is None}"
        with rs.Store(path, device_budget=2 * size, host_budget=0, write_through=False) as store:
            if declared is not None:
                store.schedule(declared)
            for i in range(3):
                store.put(ctxs[i][0], f"mb{i}")
            store.flush()
            assert _on_disk(path) == {expect_spilled}, declared  # mb0: LRU, or not named
            stats = store.stats()
            assert stats["disk"]["writes"] == 1 and stats["device"]["contexts"] == 2
            assert stats["device"]["bytes_out"] == size and stats["disk"]["bytes_written"] == size
            for i in range(3):
                _check(fwd.backward(store.get(f"mb{i}")), ctxs[i][1])


def test_internals_fifo_order_reads_only_what_cannot_fit_and_lru_reads_more(tmp_path, contexts):
    """F0..F3 then B0..B3 under a device budget of two contexts: the schedule keeps mb0 and mb1
    on the device and reads mb2 and mb3 once each (2 = 4 - 2); LRU keeps mb2 and mb3, which are
    needed last, and reads all four."""
    fwd, ctxs, size = contexts
    order = [f"mb{i}" for i in range(4)]
    reads = {}
    for mode in ("schedule", "lru"):
        with rs.Store(tmp_path / mode, device_budget=2 * size, host_budget=0) as store:
            if mode == "schedule":
                store.schedule(order)
            for i, key in enumerate(order):
                store.put(ctxs[i][0], key)
            store.flush()  # the spilled ones are on disk only
            for i, key in enumerate(order):
                _check(fwd.backward(store.get(key)), ctxs[i][1])
            reads[mode] = store.stats()["disk"]["reads"]
    assert reads == {"schedule": 2, "lru": 4}


@pytest.mark.parametrize("held", [True, False], ids=["writes-held", "writes-done"])
def test_internals_contexts_brought_back_count_the_same_with_writes_held_or_done(tmp_path, contexts, monkeypatch, held):
    """docs/store.md's count without ``flush``: F0..F7 then B0..B7 under a device budget of two
    contexts brings back the six that could not fit (LRU: all eight), from the host copies of
    writes still held at a gate (a slow disk: no disk read at all) or from disk once written."""
    import threading

    from residual_store._src.store.disk import tier as disk

    gates: list[threading.Event] = []
    commit = disk.DiskTier.commit

    def gated(self, plan, **kw):
        assert gates[-1].wait(120)
        return commit(self, plan, **kw)

    monkeypatch.setattr(disk.DiskTier, "commit", gated)
    fwd, ctxs, size = contexts
    order = [f"mb{i}" for i in range(8)]
    counts = {}
    for mode in ("schedule", "lru"):
        gates.append(threading.Event())
        try:
            with rs.Store(tmp_path / mode, device_budget=2 * size, host_budget=0) as store:
                store.schedule(order if mode == "schedule" else [])
                for i, key in enumerate(order):
                    store.put(ctxs[i][0], key)
                if not held:
                    gates[-1].set()
                    store.flush()
                for i, key in enumerate(order):
                    _check(fwd.backward(store.get(key)), ctxs[i][1])
                stats = store.stats()
                counts[mode] = (stats["disk"]["reads"], stats["pending"]["reads"])
                gates[-1].set()
        finally:
            gates[-1].set()
    if held:
        assert counts == {"schedule": (0, 6), "lru": (0, 8)}
    else:
        assert counts == {"schedule": (6, 0), "lru": (8, 0)}


def test_internals_f_then_b_loads_each_spilled_context_once(tmp_path, contexts):
    """F1..F8 then B8..B1, device budget two contexts, no host tier: six contexts cannot fit,
    and each is read back exactly once, loaded ahead while the previous backward runs."""
    fwd, ctxs, size = contexts
    keys = [f"mb{i}" for i in range(8)]
    with rs.Store(tmp_path / "s", device_budget=2 * size, host_budget=0) as store:
        store.schedule(keys[::-1])
        for key, (ctx, _) in zip(keys, ctxs):
            store.put(ctx, key)
        store.flush()
        for key in keys[::-1]:
            i = keys.index(key)
            _check(fwd.backward(store.get(key)), ctxs[i][1])
        stats = store.stats()
    assert stats["disk"]["reads"] == 6, stats
    assert stats["disk"]["bytes_read"] >= 6 * size


def test_internals_a_get_out_of_order_and_keys_not_named_still_work(tmp_path, contexts):
    fwd, ctxs, size = contexts
    with rs.Store(tmp_path / "s", device_budget=2 * size, host_budget=0) as store:
        store.schedule(["mb0", "mb1", "later-key"])  # a key not put yet is fine
        for i in range(4):
            store.put(ctxs[i][0], f"mb{i}")
        for i in (3, 1, 2, 0, 1):  # out of order, mb3 never named, mb1 twice
            _check(fwd.backward(store.get(f"mb{i}")), ctxs[i][1])
        store.schedule([])  # forgets it: LRU again
        _check(fwd.backward(store.get("mb2")), ctxs[2][1])


def test_internals_bad_schedules_raise_and_change_nothing(tmp_path, contexts):
    _, ctxs, size = contexts
    with rs.Store(tmp_path / "s", device_budget=2 * size, host_budget=0, write_through=False) as store:
        store.schedule(["mb1", "mb0", "mb2"])
        for bad in (["mb0", "../evil"], ["mb0", 3], ["mb0", ".hidden"]):
            with pytest.raises(rs.InvalidKeyError):
                store.schedule(bad)
        for bad in ("mb0", None, {"mb0": 1}):
            with pytest.raises(rs.InvalidArgumentError):
                store.schedule(bad)
        for i in range(3):  # the first schedule still holds: mb2 is the one spilled
            store.put(ctxs[i][0], f"mb{i}")
        store.flush()
        assert _on_disk(tmp_path / "s") == {"mb2"}
    with pytest.raises(rs.InvalidArgumentError, match="closed"):
        store.schedule(["mb0"])


def test_internals_memory_only_store_with_a_schedule_refuses_what_it_cannot_hold(contexts):
    """The capacity check simulates the schedule's order: nothing put is ever dropped."""
    fwd, ctxs, size = contexts
    with rs.Store(None, device_budget=size, host_budget=size) as store:
        store.schedule(["mb2", "mb1", "mb0"])
        store.put(ctxs[0][0], "mb0")
        store.put(ctxs[1][0], "mb1")  # mb0 (needed last) goes to host
        with pytest.raises(rs.StoreFullError):
            store.put(ctxs[2][0], "mb2")
        assert sorted(store.keys()) == ["mb0", "mb1"]
        for i in (1, 0):
            _check(fwd.backward(store.get(f"mb{i}")), ctxs[i][1])


def test_internals_schedule_positions():
    s = Schedule()
    assert not s and s.next_use("a") is None
    s.declare(["a", "b", "a", "c"])
    assert [s.next_use(k) for k in "abcd"] == [0, 1, 3, None]
    s.consume("b")  # out of order: a is still next
    assert [s.next_use(k) for k in "abc"] == [0, None, 3] and list(s.upcoming()) == ["a", "c"]
    s.consume("a")
    assert [s.next_use(k) for k in "ac"] == [0, 1] and list(s.upcoming()) == ["a", "c"]
    s.consume("x")  # not named: nothing changes
    s.consume("a"), s.consume("c")
    assert not s and list(s.upcoming()) == []
