"""A budget bounds the device memory of the store's contexts, pending writes included: a context
that leaves the device tier before its disk write is done leaves the device at once, as a host
copy counted in ``stats()["pending"]``, measured with ``jax.live_arrays()`` while writes are held
at a gate (a slow disk), not after ``flush``."""

from __future__ import annotations

import gc
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual_store as rs
from residual_store._src.store import copies, host
from residual_store._src.store.disk import tier as disk

_D = 64


def _loss(w, x):
    h = x
    for _ in range(3):
        h = jnp.tanh(h @ w)
    return jnp.sum(h**2)


_FWD = rs.split(_loss)


@pytest.fixture(autouse=True)
def _young_garbage_only():
    """What the suite made before this test is frozen out of the collector, so each
    ``gc.collect()`` below looks at this test's objects only (a full collection in a process
    that has run hundreds of tests took most of these tests' time)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _device_bytes() -> int:
    """Bytes of live arrays in device memory (not pinned or unpinned host memory)."""
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays()
               if a.sharding.memory_kind in (None, next(iter(a.sharding.device_set)).default_memory().kind))


@pytest.fixture
def gate(monkeypatch):
    """Holds every disk commit until set: the writer stays busy, puts stay pending."""
    event = threading.Event()
    commit = disk.DiskTier.commit

    def held(self, plan, **kw):
        assert event.wait(120)
        return commit(self, plan, **kw)

    monkeypatch.setattr(disk.DiskTier, "commit", held)
    yield event
    event.set()


def _put_one(store, w, key, seed):
    """Puts a fresh context under ``key`` and keeps nothing of it on the device: the host
    values of its residuals come back, for comparing what is read later."""
    x = jax.random.normal(jax.random.key(seed), (32, _D))
    _, ctx = _FWD(w, x)
    values = [np.array(r) for r in ctx.residuals]
    size = ctx.spec.own_nbytes
    store.put(ctx, key)
    return values, size


def _landed(store: rs.Store) -> None:
    """Waits until no copy to host memory is in flight (the put returned once it started)."""
    deadline = time.monotonic() + 30
    while store.stats()["device"]["leaving"] and time.monotonic() < deadline:
        time.sleep(0.001)
    assert store.stats()["device"]["leaving"] == 0


def _settled_device_bytes(base: int, allowed: int, timeout: float = 10.0) -> int:
    """The device bytes held beyond ``base`` once they are at most ``allowed``, or after
    ``timeout`` seconds: a reference another thread holds as its task ends (the landings
    thread's, a moment after the copy it waited for counts as landed) is released, not held."""
    deadline = time.monotonic() + timeout
    while (held := _device_bytes() - base) > allowed and time.monotonic() < deadline:
        time.sleep(0.01)
    return held


def _check_puts(store, w, gate, values, budget, budget_contexts, one, pinned, base):
    """12 puts while the writer is held; the gate opens at the end, or at a failure (so that
    the store can close)."""
    try:
        for i in range(12):
            values[f"k{i}"], size = _put_one(store, w, f"k{i}", i + 1)
            assert size == one
            leaving = store.stats()["device"]["leaving"]
            assert leaving <= one  # at most the context just put is on its way to host memory
            _landed(store)
            stats = store.stats()
            allowed = budget + one + (0 if pinned else stats["pending"]["bytes"])  # CPU: views of its buffers
            held = _settled_device_bytes(base, allowed)
            assert held <= allowed, f"after put {i}: {held:,} device bytes for a budget of {budget:,}"
            assert stats["device"]["bytes"] <= budget
            if i >= budget_contexts:
                assert stats["pending"]["contexts"] >= 1 and stats["pending"]["bytes"] >= one
    finally:
        gate.set()


@pytest.mark.slow
@pytest.mark.parametrize("budget_contexts", [0, 2])
@pytest.mark.parametrize("write_through", [True, False])
@pytest.mark.parametrize("pinned", [True, False], ids=["copy-to-pinned-host", "cpu-views"])
def test_internals_device_memory_stays_within_the_budget_while_writes_are_pending(
    tmp_path, gate, monkeypatch, budget_contexts, write_through, pinned
):
    if pinned:  # what a GPU does: pending contexts become pinned_host copies, and a write's
        # host arrays are copies (on a CPU np.asarray is a view that keeps the device buffer)
        for module in (host, copies):
            monkeypatch.setattr(module, "is_host_memory", lambda device: False)
        to_host = host._to_host

        def copied(x):
            a, impl = to_host(x)
            return (np.array(a) if isinstance(a, np.ndarray) else a), impl

        monkeypatch.setattr(host, "_to_host", copied)
    w = jax.random.normal(jax.random.key(0), (_D, _D)) / np.sqrt(_D)
    _, probe = _FWD(w, jnp.ones((32, _D)))
    one = probe.spec.own_nbytes
    del probe
    budget = budget_contexts * one
    base = _device_bytes()  # the weights, and whatever else the process holds
    values = {}
    with rs.Store(tmp_path / "s", device_budget=budget, host_budget=0, write_through=write_through) as store:
        _check_puts(store, w, gate, values, budget, budget_contexts, one, pinned, base)
        store.flush()
        pending = store.stats()["pending"]
        assert (pending["bytes"], pending["contexts"]) == (0, 0)
        assert _device_bytes() - base <= budget + one
        for key, want in values.items():
            got = store.get(key)
            for a, b in zip(got.residuals, want):
                np.testing.assert_array_equal(np.asarray(a), b)
        # and another store on the path reads them from disk
    with rs.Store(tmp_path / "s", read_only=True, device_budget=0, host_budget=0) as again:
        for key, want in values.items():
            for a, b in zip(again.get(key).residuals, want):
                np.testing.assert_array_equal(np.asarray(a), b)


def test_internals_a_pending_context_is_served_from_its_host_copy(tmp_path, gate, rng):
    """A get of a context whose write is held returns it on the device, bitwise, from the host
    copy (nothing read from disk), and its gradient is the in-memory one."""
    w = jax.random.normal(rng, (_D, _D)) / np.sqrt(_D)
    x = jax.random.normal(jax.random.fold_in(rng, 1), (32, _D))
    _, ctx = _FWD(w, x)
    want = _FWD.backward(ctx)
    with rs.Store(tmp_path / "s", device_budget=0, host_budget=0) as store:
        try:
            store.put(ctx, "a")
            assert store.stats()["pending"]["contexts"] == 1
            got = store.get("a")
            assert store.stats()["disk"]["reads"] == 0 and store.stats()["pending"]["reads"] == 1
            for g, v in zip(jax.tree.leaves(_FWD.backward(got)), jax.tree.leaves(want)):
                assert np.array_equal(np.asarray(g), np.asarray(v)) and np.any(np.asarray(v) != 0)
        finally:
            gate.set()


_STEP = 6  # microbatches a pipeline step


def _pipeline_step(w, xs, store: rs.Store | None, base: int) -> tuple[list, int]:
    """All forwards, then all backwards in reverse (the get order declared to ``store``, which
    loads ahead by it); contexts in a list where ``store`` is ``None``. The weight gradients, and
    the most device bytes beyond ``base`` once each put (or append) and each pop has returned,
    the copies and loads it started in flight. (Measured by this thread alone: a second
    measuring thread's list of live arrays keeps arrays the step has dropped alive, and while
    its ``gc.collect()`` runs, this thread's returns without collecting.)"""
    if store is not None:
        store.schedule([f"mb{i}" for i in reversed(range(len(xs)))])
    held, most = [], 0
    for i, x in enumerate(xs):
        ctx = _FWD(w, x)[1]
        if store is None:
            held.append(ctx)
        else:
            store.put(ctx, f"mb{i}")
        del ctx
        most = max(most, _device_bytes() - base)
    grads = []
    for i in reversed(range(len(xs))):
        ctx = held.pop() if store is None else store.pop(f"mb{i}")
        most = max(most, _device_bytes() - base)
        grads.append(np.asarray(_FWD.backward(ctx)[0]))
        del ctx
    return grads, most


@pytest.mark.parametrize("budget_contexts", [0, 1, 2])
def test_internals_a_pipeline_step_through_a_store_needs_no_more_device_memory_than_one_in_a_list(budget_contexts):
    """Issue 44's bound, on the CPU's logic: with loads ahead by schedule and copies to host
    memory in flight, a step through ``Store(None, device_budget=k contexts)`` holds at most the
    budget, the context in use and one on its way (a copy out or a load ahead), and never more
    than the same step with its contexts in a list. Gradients are the list's, bitwise."""
    w = jax.random.normal(jax.random.key(budget_contexts), (_D, _D)) / np.sqrt(_D)
    xs = [jax.random.normal(jax.random.key(100 + i), (128, _D)) for i in range(_STEP)]
    one = _FWD(w, xs[0])[1].spec.own_nbytes
    base = _device_bytes()
    want, listed = _pipeline_step(w, xs, None, base)
    with rs.Store(None, device_budget=budget_contexts * one) as store:
        got, stored = _pipeline_step(w, xs, store, base)
        assert store.stats()["device"]["bytes"] == 0 and len(store) == 0
    for g, v in zip(got, want):
        assert np.array_equal(g, v) and np.any(v != 0)
    assert listed >= (_STEP - 1) * one  # every context at once after the last forward (their inputs are in base)
    assert stored <= listed, (stored / one, listed / one)
    assert stored <= (budget_contexts + 2) * one, stored / one


class _DispatchedAhead:
    """A caller whose backwards have not run when it calls again, as on an accelerator: the
    output of a backward on a lent context counts as not ready until the store waits for it
    (``pace.is_ready``/``pace.wait_for``); each copy to the device records the device bytes the
    store's contexts held and lent when it started (``stats()["device"]``) and whether a load
    ahead made it. ``finish()``: every backward has run."""

    def __init__(self, monkeypatch, store: rs.Store) -> None:
        from residual_store._src import pace
        from residual_store._src.store import reads

        self.waited: set[int] = set()
        self.done = False
        self.copies: list[tuple[int, int, bool]] = []
        monkeypatch.setattr(pace, "is_ready", lambda out: self.done or id(out) in self.waited)
        monkeypatch.setattr(pace, "wait_for", lambda out: self.waited.add(id(out)))
        to_device = reads.to_device

        def recorded(ctx, *args, **kw):
            ahead = threading.current_thread().name.startswith("residual-store-load")
            device = store.stats()["device"]
            self.copies.append((device["held"], device["lent"], ahead))
            return to_device(ctx, *args, **kw)

        monkeypatch.setattr(reads, "to_device", recorded)

    def finish(self) -> None:
        self.done = True


@pytest.mark.parametrize("scheduled", [False, True], ids=["pops", "schedule"])
@pytest.mark.parametrize("budget_contexts", [0, 1, 2])
def test_internals_a_caller_that_dispatches_ahead_gets_no_more_than_the_budget_and_one_context(
    monkeypatch, budget_contexts, scheduled
):
    """``for k in keys: grads.append(backward(store.pop(k)))`` with every backward still
    running when the next pop comes: each pop waits for the backwards on what was handed out
    until its context fits the budget beside the store's others (or nothing handed out is still
    read), so every copy to the device starts with room for it (a load ahead: with at most the
    budget held), the device holds at most the budget and the context in use after each pop, and
    ``stats()["device"]`` counts what is handed out until it can be freed. Gradients are the
    list's, bitwise."""
    w = jax.random.normal(jax.random.key(7), (_D, _D)) / np.sqrt(_D)
    xs = [jax.random.normal(jax.random.key(200 + i), (32, _D)) for i in range(_STEP)]
    want = [np.asarray(_FWD.backward(_FWD(w, x)[1])[0]) for x in xs]
    one = _FWD(w, xs[0])[1].spec.own_nbytes
    budget = budget_contexts * one
    keys = [f"mb{i}" for i in range(_STEP)]
    with rs.Store(None, device_budget=budget) as store:
        caller = _DispatchedAhead(monkeypatch, store)
        if scheduled:
            store.schedule(keys[::-1])
        for key, x in zip(keys, xs):
            store.put(_FWD(w, x)[1], key)
            assert store.stats()["device"]["held"] <= budget  # (the put's copy has landed)
        grads, after = {}, []
        for key in reversed(keys):
            grads[key] = _FWD.backward(store.pop(key))  # (its context dropped, its backward "running")
            after.append(store.stats()["device"]["held"])
        assert len(caller.copies) >= _STEP - budget_contexts
        for held, lent, ahead in caller.copies:
            if ahead:
                assert held <= budget + one, (held / one, ahead)
            else:  # room for it, or nothing handed out is still read
                assert held + one <= budget or lent == 0, (held / one, lent / one)
        assert max(after) <= budget + one, [h / one for h in after]
        assert after[0] >= one  # the first pop's context counts until its backward is waited for
        caller.finish()
        assert store.stats()["device"]["held"] == store.stats()["device"]["lent"] == 0
    for key, v in zip(keys, want):
        assert np.array_equal(np.asarray(grads[key][0]), v) and np.any(v != 0)


_LINEAR = rs.split(lambda w, x: jnp.sum(x @ w), argnums=(0, 1), weight_argnums=(0, 1))  # no own residual


@pytest.mark.parametrize("own", [True, False], ids=["own-bytes", "nothing-on-device"])
def test_internals_a_caller_that_dispatches_ahead_has_at_most_two_backwards_running(monkeypatch, own):
    """Every backward's outputs and working memory are allocated when it is dispatched: under a
    device budget each pop waits until at most one backward on what was handed out is still
    running (the running one and the one dispatched next), whether or not the contexts hold
    device memory (here a budget that holds them all, and contexts of weights alone at budget
    0: no room is ever waited for). Gradients are ``jax.grad``'s."""
    fwd = _FWD if own else _LINEAR
    w = jax.random.normal(jax.random.key(9), (_D, _D)) / np.sqrt(_D)
    xs = [jax.random.normal(jax.random.key(300 + i), (32, _D)) for i in range(_STEP)]
    one = fwd(w, xs[0])[1].spec.own_nbytes
    assert (one > 0) == own
    keys = [f"mb{i}" for i in range(_STEP)]
    with rs.Store(None, device_budget=_STEP * one) as store:
        caller = _DispatchedAhead(monkeypatch, store)
        for key, x in zip(keys, xs):
            store.put(fwd(w, x)[1], key)
        grads, running = {}, []
        for key in reversed(keys):
            ctx = store.pop(key)
            running.append(len(grads) - len(caller.waited))  # backwards dispatched, not waited for
            grads[key] = fwd.backward(ctx)
            del ctx
        assert running == [0, 1] + [1] * (_STEP - 2), running
        caller.finish()
        assert store.stats()["device"]["lent"] == 0
    for key, x in zip(keys, xs):
        want = jax.grad(lambda w: _loss(w, x) if own else jnp.sum(x @ w))(w)  # noqa: B023 - called at once
        got = grads[key] if own else grads[key][0]  # (argnums=(0, 1): a pair)
        want = np.asarray(want)
        assert np.any(want != 0)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_internals_a_context_held_by_its_caller_counts_until_dropped_and_its_backward_has_run(monkeypatch):
    """A popped context counts in ``stats()["device"]`` (``lent``, ``held``) while its caller
    holds it, and after its backward until that has run; a context dropped without a backward
    of the library's counts no more (the store cannot see what read it). Residuals that are one
    array come back as one array and count once."""
    w = jax.random.normal(jax.random.key(8), (_D, _D)) / np.sqrt(_D)
    _, ctx = _FWD(w, jnp.ones((32, _D)))
    first = next(x for x, kind in zip(ctx.residuals, ctx.spec.kinds) if kind != "weight")
    same = rs.ResidualContext.tree_unflatten(  # every own residual one array: what a split can make
        ctx.spec, [x if kind == "weight" else first for x, kind in zip(ctx.residuals, ctx.spec.kinds)])
    with rs.Store(None, device_budget=0) as store:
        caller = _DispatchedAhead(monkeypatch, store)
        store.put(ctx, "a")
        store.put(same, "b")
        assert store.stats()["host"]["bytes"] == ctx.spec.own_nbytes + first.nbytes  # b's one array counted once
        got = store.pop("a")
        size = sum(x.nbytes for x, kind in zip(got.residuals, got.spec.kinds) if kind != "weight")
        assert store.stats()["device"]["lent"] == size == store.stats()["device"]["held"]
        _FWD.backward(got)  # (its outputs dropped: the store keeps one to wait on)
        del got
        assert store.stats()["device"]["lent"] == size  # dropped, its backward still "running"
        caller.finish()
        assert store.stats()["device"]["lent"] == 0
        both = store.pop("b")
        own = {id(x): x for x, kind in zip(both.residuals, both.spec.kinds) if kind != "weight"}
        assert len(own) == 1 and not any(x is first for x in own.values())  # one copy, come back as one
        assert store.stats()["device"]["lent"] == first.nbytes
        del both
        assert store.stats()["device"]["lent"] == 0


def test_internals_a_bw_split_backward_tells_the_store_its_b_half(monkeypatch):
    """``fwd.backward(ctx, ct, now=...)`` (a zero-bubble pipeline's B) on a popped context: the
    context counts until its B half has run, as with a whole backward."""
    fwd = rs.split(lambda x, w: jnp.tanh(x @ w), argnums=(0, 1))
    x, w = jnp.ones((32, _D)), jnp.ones((_D, _D)) / _D
    y, ctx = fwd(x, w)
    with rs.Store(None, device_budget=0) as store:
        caller = _DispatchedAhead(monkeypatch, store)
        store.put(ctx, "a")
        del ctx
        got = store.pop("a")
        size = store.stats()["device"]["lent"]
        assert size > 0
        dx, later = fwd.backward(got, jnp.ones_like(y), now=0)
        del got
        assert store.stats()["device"]["lent"] == size  # its B half still "running"
        caller.finish()
        assert store.stats()["device"]["lent"] == 0
        assert dx.shape == x.shape and later is not None


@pytest.mark.parametrize("on_disk", [False, True], ids=["host", "disk"])
def test_internals_a_pop_never_pushes_out_a_context_the_device_tier_keeps(tmp_path, on_disk):
    """A ``pop`` of a context in host memory or on disk reads it for its caller alone: the
    context the device tier keeps stays there (no copy out and back for one that leaves the
    store), and the popped one counts as lent until dropped. Gradients are the list's."""
    w = jax.random.normal(jax.random.key(11), (_D, _D)) / np.sqrt(_D)
    xs = [jax.random.normal(jax.random.key(300 + i), (16, _D)) for i in range(3)]
    want = [np.asarray(_FWD.backward(_FWD(w, x)[1])[0]) for x in xs]
    one = _FWD(w, xs[0])[1].spec.own_nbytes
    path, host = (tmp_path / "s", 0) if on_disk else (None, None)
    with rs.Store(path, device_budget=one, host_budget=host) as store:
        for i, x in enumerate(xs):
            store.put(_FWD(w, x)[1], f"mb{i}")
        store.flush()
        before = store.stats()
        got = store.pop("mb0")
        after = store.stats()
        assert after["device"]["bytes_out"] == before["device"]["bytes_out"]  # nothing pushed out
        assert after["device"]["contexts"] == 1 and after["device"]["lent"] == one
        kept = store.get("mb2")
        assert store.stats()["device"]["bytes_in"] == after["device"]["bytes_in"]  # mb2 was still there
        assert np.array_equal(np.asarray(_FWD.backward(got)[0]), want[0]) and np.any(want[0] != 0)
        assert np.array_equal(np.asarray(_FWD.backward(kept)[0]), want[2])


@pytest.mark.parametrize("budget_contexts", [None, 1])
def test_internals_a_closed_store_holds_no_memory_while_it_is_still_referenced(tmp_path, budget_contexts):
    """``close()`` lets go of every context the store held in memory (it answers no call
    afterwards): a ``with rs.Store(...) as store:`` block leaves no device memory behind while
    ``store`` stays in scope, and what a path store was given is on disk."""
    w = jax.random.normal(jax.random.key(12), (_D, _D)) / np.sqrt(_D)
    xs = [jax.random.normal(jax.random.key(400 + i), (64, _D)) for i in range(3)]
    one = _FWD(w, xs[0])[1].spec.own_nbytes
    base = _device_bytes()
    budget = None if budget_contexts is None else budget_contexts * one
    with rs.Store(tmp_path / "s", device_budget=budget) as store:
        for i, x in enumerate(xs):
            store.put(_FWD(w, x)[1], f"mb{i}")
        assert _device_bytes() - base >= one // 2  # (its input is the caller's, in base)
    assert _device_bytes() == base
    with pytest.raises(rs.InvalidArgumentError, match="closed"):
        store.get("mb0")
    with rs.Store(tmp_path / "s") as again:
        assert sorted(again.keys()) == ["mb0", "mb1", "mb2"]
