"""Direct, fast tests of the store's parts (issue 28, item 6): the memory tiers and the policy
between them (``tiers.py``), the background writer and loader (``workers.py``), the declared
order of gets (``schedule.py``) and what a write puts where (``layout.plan_write``).

The rest of the suite reaches these parts through ``rs.Store``, end to end: a failure there
says that something is wrong, not which part. These tests call each part by itself with small
real contexts (made by one compiled split, a few floats each) and real byte counts
(``ctx.spec.own_nbytes``), so a regression names its part, and the whole file runs in a second
or two. Threads are synchronised with events and bounded by timeouts: a failing test fails, it
never hangs.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual_store as rs
import residual_store_serializers as serializers
from residual_store._src.context import ResidualContext
from residual_store._src.store import host
from residual_store._src.store.disk import layout, paths
from residual_store._src.store.schedule import Schedule, loads_ahead
from residual_store._src.store.tiers import MemoryTier, Tiers, spill_order
from residual_store._src.store.workers import Loader, Writer

TIMEOUT = 10.0  # seconds any wait on another thread may take before the test fails
BLOCKED = 0.05  # how long a thread that must be blocked is watched to stay so


# ----------------------------------------------------------------------------------------------
# Contexts: one split, compiled once per row count for the whole module


def _loss(w: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.sum(jnp.tanh(x @ w))


@functools.cache
def _forward() -> rs.Split:
    # w is a weight (held by reference, never counted); x and the intermediates are the
    # context's own residuals
    return rs.split(_loss, argnums=(0, 1), weight_argnums=0)


def _ctx(rows: int = 1, seed: int = 0) -> ResidualContext:
    """A real context whose own residuals grow with ``rows`` (one compile per row count)."""
    w = jnp.arange(6.0, dtype=jnp.float32).reshape(3, 2) / 7
    x = jnp.arange(rows * 3.0, dtype=jnp.float32).reshape(rows, 3) + seed
    return _forward()(w, x)[1]


def _size(rows: int = 1) -> int:
    return _ctx(rows).spec.own_nbytes


def _tier(name: str, budget: int | None, *keys: str) -> MemoryTier:
    tier = MemoryTier(name, budget)
    for key in keys:
        tier.add(key, _ctx())
    return tier


class _Demote:
    """What :class:`Tiers` moved to the host tier (its owed copies, :meth:`Tiers.take_owed`),
    each settled with its host copy as the store does outside its lock."""

    def __init__(self, tiers: Tiers) -> None:
        self._tiers = tiers
        self._moved: list[ResidualContext] = []

    @property
    def moved(self) -> list[ResidualContext]:
        for key, ctx in self._tiers.take_owed():
            assert self._tiers.settle(key, ctx, host.to_host(ctx))
            self._moved.append(ctx)
        return self._moved


def _tiers(device: int | None, host_budget: int | None) -> tuple[Tiers, _Demote]:
    tiers = Tiers(device, host_budget)
    return tiers, _Demote(tiers)


def test_internals_the_contexts_have_weights_that_are_not_their_own():
    ctx = _ctx(2)
    assert ctx.spec.kinds[0] == "weight"
    own = sum(int(np.asarray(r).nbytes) for r, k in zip(ctx.residuals, ctx.spec.kinds) if k != "weight")
    assert ctx.spec.own_nbytes == own > 0
    assert _size(2) == 2 * _size(1)  # rows scale every own residual, the weight stays out


# ----------------------------------------------------------------------------------------------
# MemoryTier


@pytest.mark.parametrize("budget", [-1, 1.5, True, np.bool_(False), "10", 10.0])
def test_internals_a_tier_refuses_a_budget_that_is_not_a_non_negative_int(budget: Any):
    with pytest.raises(rs.InvalidArgumentError, match="host_budget"):
        MemoryTier("host", budget)


def test_internals_a_tier_takes_an_int_budget_of_any_integral_type_or_none():
    assert MemoryTier("device", np.int64(7)).budget == 7 and type(MemoryTier("device", np.int64(7)).budget) is int
    assert MemoryTier("device", 0).budget == 0
    assert MemoryTier("device", None).budget is None


def test_internals_a_tier_counts_each_contexts_own_bytes():
    tier = MemoryTier("host", None)
    small, big = _ctx(1), _ctx(4)
    tier.add("s", small)
    tier.add("b", big)
    assert tier.size_of("s") == small.spec.own_nbytes and tier.size_of("b") == big.spec.own_nbytes
    assert tier.size_of("missing") is None
    assert tier.nbytes == tier.bytes_in == small.spec.own_nbytes + big.spec.own_nbytes
    assert len(tier) == 2 and "s" in tier and "missing" not in tier
    # put again under the same key: counted once in what it holds, twice in what came in
    tier.add("s", small)
    assert tier.nbytes == small.spec.own_nbytes + big.spec.own_nbytes
    assert tier.bytes_in == 2 * small.spec.own_nbytes + big.spec.own_nbytes
    assert tier.bytes_out == 0


def test_internals_a_tier_counts_bytes_out_only_for_what_moved_to_another_tier():
    tier = MemoryTier("device", None)
    a, b = _ctx(1), _ctx(2)
    tier.add("a", a)
    tier.add("b", b)
    assert tier.remove("a", moved=True) is a
    assert (tier.nbytes, tier.bytes_out) == (b.spec.own_nbytes, a.spec.own_nbytes)
    assert tier.remove("b") is b  # dropped (deleted), not moved
    assert (tier.nbytes, tier.bytes_out) == (0, a.spec.own_nbytes)
    assert tier.remove("b", moved=True) is None and tier.bytes_out == a.spec.own_nbytes
    assert tier.bytes_in == a.spec.own_nbytes + b.spec.own_nbytes


def test_internals_fits_asks_the_budget_not_what_the_tier_holds():
    size = _size()
    tier = _tier("device", 2 * size, "a", "b")  # full
    assert tier.fits(2 * size) and tier.fits(0)
    assert not tier.fits(2 * size + 1)
    assert MemoryTier("device", None).fits(10**15)
    assert not MemoryTier("device", 0).fits(1)


def test_internals_over_budget_is_over_the_budget_or_a_tighter_limit():
    size = _size()
    tier = _tier("device", 2 * size, "a", "b")
    assert tier.nbytes == 2 * size and not tier.over_budget()
    assert tier.over_budget(limit=2 * size - 1)
    assert not tier.over_budget(limit=10 * size)  # a limit never loosens the budget
    tier.add("c", _ctx())
    assert tier.over_budget() and tier.over_budget(limit=10 * size)
    unbounded = _tier("device", None, "a", "b")
    assert not unbounded.over_budget()
    assert unbounded.over_budget(limit=size) and not unbounded.over_budget(limit=2 * size)


def test_internals_a_tier_is_least_recently_used_first_and_peek_does_not_touch():
    tier = _tier("device", None, "a", "b", "c")
    assert tier.keys() == ["a", "b", "c"]
    assert tier.get("a") is not None
    assert tier.peek("b") is not None
    assert tier.get("missing") is None and tier.peek("missing") is None
    assert tier.keys() == ["b", "c", "a"]
    tier.add("b", _ctx())  # put again: the most recently used
    assert tier.keys() == ["c", "a", "b"]
    assert tier.eviction_order(Schedule()) == ["c", "a", "b"]


def test_internals_without_a_schedule_the_least_recently_used_leaves_first_and_protect_last():
    tier = _tier("device", None, "a", "b", "c")
    tier.get("a")
    assert tier.eviction_order(Schedule(), protect="b") == ["c", "a", "b"]
    assert tier.eviction_order(Schedule(), protect="c") == ["b", "a", "c"]
    assert tier.eviction_order(Schedule(), protect="absent") == ["b", "c", "a"]


def _scheduled(keys: list[str]) -> Schedule:
    schedule = Schedule()
    schedule.declare(keys)
    return schedule


def test_internals_with_a_schedule_the_context_needed_last_leaves_first():
    tier = _tier("device", None, "a", "b", "c")  # a least recently used
    schedule = _scheduled(["a", "c", "b", "a"])  # next uses: a 0, c 1, b 2
    assert tier.eviction_order(schedule) == ["b", "c", "a"]
    schedule.consume("a")  # a's next use is now the last one
    assert tier.eviction_order(schedule) == ["a", "b", "c"]
    assert tier.eviction_order(schedule, protect="a") == ["b", "c", "a"]


def test_internals_unscheduled_contexts_leave_before_scheduled_ones_least_recently_used_first():
    tier = _tier("device", None, "s1", "u1", "s2", "u2", "u3")
    tier.get("u1")  # LRU order now: s1, s2, u2, u3, u1
    schedule = _scheduled(["s1", "s2"])
    assert tier.eviction_order(schedule) == ["u2", "u3", "u1", "s2", "s1"]
    assert tier.eviction_order(schedule, protect="u2") == ["u3", "u1", "s2", "s1", "u2"]
    # the order is spill_order's on the tier's keys, least recently used first
    assert spill_order(tier.keys(), schedule, "s2") == ["u2", "u3", "u1", "s1", "s2"]


# ----------------------------------------------------------------------------------------------
# Tiers


def test_internals_admit_puts_a_context_in_the_highest_tier_its_size_fits():
    size = _size(1)
    tiers, demote = _tiers(device=size, host_budget=2 * size)
    assert tiers.admit("small", _ctx(1))
    assert tiers.device.keys() == ["small"] and demote.moved == []
    big = _ctx(2)
    assert tiers.admit("big", big)
    assert tiers.host.keys() == ["big"] and demote.moved == [big]
    assert tiers.host.size_of("big") == big.spec.own_nbytes
    assert not tiers.admit("huge", _ctx(4))  # fits neither
    assert "huge" not in tiers and tiers.keys() == ["small", "big"]
    assert tiers.nbytes == size + big.spec.own_nbytes
    tiers.forget("big")
    assert tiers.keys() == ["small"] and tiers.nbytes == size


def test_internals_rebalance_spills_the_least_recently_used_to_host_memory():
    size = _size()
    tiers, demote = _tiers(device=2 * size, host_budget=None)
    ctxs = {k: _ctx(seed=i) for i, k in enumerate("abc")}
    for k, ctx in ctxs.items():
        tiers.admit(k, ctx)
    tiers.device.get("a")  # b is now the least recently used
    assert tiers.device.over_budget()
    assert tiers.rebalance() == []  # nothing left host memory
    assert tiers.device.keys() == ["c", "a"] and tiers.host.keys() == ["b"]
    assert demote.moved == [ctxs["b"]]
    assert tiers.device.bytes_out == tiers.host.bytes_in == size
    assert tiers.device.nbytes == 2 * size and tiers.host.nbytes == size


def test_internals_rebalance_returns_what_leaves_host_memory_as_evictions():
    size = _size()
    tiers, _ = _tiers(device=size, host_budget=size)
    for k in "abc":
        tiers.admit(k, _ctx())
    evicted = tiers.rebalance(protect="c")
    # a and b spill to the host in turn; the host keeps one: a leaves it
    assert [k for k, _ in evicted] == ["a"]
    assert all(isinstance(ctx, ResidualContext) and ctx.spec.own_nbytes == size for _, ctx in evicted)
    assert tiers.device.keys() == ["c"] and tiers.host.keys() == ["b"]
    assert tiers.host.bytes_in == 2 * size and tiers.host.bytes_out == size
    assert not tiers.device.over_budget() and not tiers.host.over_budget()


def test_internals_a_context_too_big_for_host_memory_leaves_the_device_as_an_eviction():
    small, big = _ctx(1), _ctx(4)
    tiers, demote = _tiers(device=None, host_budget=small.spec.own_nbytes)
    tiers.admit("big", big)
    tiers.admit("small", small)
    evicted = tiers.rebalance(device_limit=small.spec.own_nbytes)
    assert evicted == [("big", big)]  # the device's own context: it was never demoted
    assert demote.moved == [] and tiers.keys() == ["small"]


def test_internals_rebalance_keeps_the_device_within_a_tighter_limit():
    size = _size()
    tiers, _ = _tiers(device=None, host_budget=None)
    for k in "abcd":
        tiers.admit(k, _ctx())
    assert tiers.rebalance() == [] and tiers.host.keys() == []  # unbounded: nothing moves
    assert tiers.rebalance(device_limit=size) == []
    assert tiers.device.keys() == ["d"] and tiers.host.keys() == ["a", "b", "c"]
    assert tiers.device.nbytes == size and tiers.nbytes == 4 * size


def test_internals_rebalance_moves_protect_last_and_follows_the_schedule():
    size = _size()
    tiers, _ = _tiers(device=2 * size, host_budget=None)
    for k in "abc":
        tiers.admit(k, _ctx())
    tiers.rebalance(protect="a")  # a is the least recently used, but protected
    assert tiers.host.keys() == ["b"]

    tiers, _ = _tiers(device=2 * size, host_budget=None)
    tiers.schedule.declare(["a", "c", "b"])
    for k in "abc":
        tiers.admit(k, _ctx())
    tiers.rebalance()
    assert tiers.host.keys() == ["b"]  # needed last
    tiers.admit("d", _ctx())  # not scheduled: needed after all the others
    tiers.rebalance()
    assert tiers.host.keys() == ["b", "d"] and tiers.device.keys() == ["a", "c"]


def test_internals_a_put_protects_its_key_unless_the_schedule_names_it():
    tiers, _ = _tiers(device=None, host_budget=None)
    assert tiers.put_protects("a")
    tiers.schedule.declare(["a", "b"])
    assert not tiers.put_protects("a") and tiers.put_protects("c")
    tiers.schedule.consume("a")
    assert tiers.put_protects("a")  # no longer named again


def _put_evicts(tiers: Tiers, key: str, ctx: ResidualContext) -> bool:
    """What the store does on a put (``Store.put``): forget, admit, rebalance; whether anything
    left host memory."""
    tiers.forget(key)
    if not tiers.admit(key, ctx):
        return True
    return bool(tiers.rebalance(protect=key if tiers.put_protects(key) else None))


def test_internals_would_overflow_says_what_a_put_would_push_out_of_host_memory_and_changes_nothing():
    size = _size()
    tiers, _ = _tiers(device=2 * size, host_budget=2 * size)
    for k in "ab":
        assert not tiers.would_overflow(k, size)
        assert not _put_evicts(tiers, k, _ctx())
    assert not tiers.would_overflow("c", size)  # a moves to the host
    assert not tiers.would_overflow("c", 2 * size)  # a and b do
    assert tiers.would_overflow("c", 2 * size + 1)  # past the device: straight to the host
    assert not tiers.would_overflow("a", size)  # a replaced, not added
    assert (tiers.device.keys(), tiers.host.keys(), tiers.nbytes) == (["a", "b"], [], 2 * size)
    for k in "cd":
        assert not _put_evicts(tiers, k, _ctx())
    assert tiers.nbytes == 4 * size
    assert tiers.would_overflow("e", size)
    assert tiers.would_overflow("e", 0) is False  # a context with no own bytes moves nothing
    with pytest.raises(rs.StoreFullError, match="'e'"):
        tiers.check_capacity("e", size)
    tiers.check_capacity("a", size)  # replacing a held context of the same size
    assert (tiers.device.keys(), tiers.host.keys(), tiers.nbytes) == (["c", "d"], ["a", "b"], 4 * size)
    assert not _tiers(device=0, host_budget=None)[0].would_overflow("a", 10**12)


def test_internals_would_overflow_keeps_an_unscheduled_put_on_the_device_as_the_put_does():
    size = _size()
    tiers, _ = _tiers(device=3 * size, host_budget=size + size // 2)
    tiers.schedule.declare(["a", "b"])
    for k in "ab":
        tiers.admit(k, _ctx())
    big = _ctx(2)
    # the put protects z (the schedule does not name it): a scheduled context moves down, not z
    assert not tiers.would_overflow("z", big.spec.own_nbytes)
    assert not _put_evicts(tiers, "z", big)
    assert tiers.device.keys() == ["a", "z"] and tiers.host.keys() == ["b"]


@pytest.mark.parametrize("schedule", [None, ["c", "a", "e", "b"], ["e", "d", "c", "b", "a"]])
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_internals_would_overflow_agrees_with_the_put_it_simulates(schedule: list[str] | None, rows: int):
    size = _size()
    tiers, _ = _tiers(device=3 * size, host_budget=3 * size)
    if schedule is not None:
        tiers.schedule.declare(schedule)
    for k in "abcd":
        tiers.admit(k, _ctx())
    tiers.rebalance()
    assert tiers.nbytes == 4 * size
    for key in ("a", "e", "z"):  # one held, one new (named by the schedules), one never named
        ctx = _ctx(rows)
        predicted = tiers.would_overflow(key, ctx.spec.own_nbytes)
        trial, _ = _tiers(device=3 * size, host_budget=3 * size)
        trial.schedule = tiers.schedule
        for tier, copy in ((tiers.device, trial.device), (tiers.host, trial.host)):
            held = tier.keys()  # least recently used first: the copy keeps the order
            for k in held:
                ctx_k = tier.peek(k)
                assert ctx_k is not None
                copy.add(k, ctx_k)
        assert _put_evicts(trial, key, ctx) == predicted, (key, rows)


# ----------------------------------------------------------------------------------------------
# Writer and Loader


def _wait(event: threading.Event) -> None:
    assert event.wait(TIMEOUT), "timed out waiting on another thread"


def _gate_job(gate: threading.Event, log: list[str], name: str) -> Callable[[], str]:
    def job() -> str:
        _wait(gate)
        log.append(name)
        return name
    return job


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, threading.Event, list[Any]]:
    """Runs ``fn`` on a daemon thread; the event is set (and the list holds its result or its
    error) when it returns."""
    done, out = threading.Event(), []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as err:  # noqa: BLE001 - handed to the test
            out.append(err)
        done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, done, out


MakeWriter = Callable[..., Writer]


@pytest.fixture
def writer() -> Iterator[MakeWriter]:
    """Makes writers (``max_pending_bytes``, ``on_idle``); each is closed after the test."""
    writers: list[Writer] = []

    def make(max_pending_bytes: int = 1 << 20, on_idle: Callable[[], None] | None = None) -> Writer:
        writers.append(Writer(max_pending_bytes, on_idle))
        return writers[-1]

    yield make
    for w in writers:
        w.close(wait=False)


def test_internals_the_writer_runs_jobs_in_submit_order_on_one_thread(writer: MakeWriter):
    w, ran = writer(), []
    futures = [w.submit(lambda i=i: ran.append((i, threading.get_ident())) or i, 1) for i in range(20)]
    w.flush()
    assert [i for i, _ in ran] == list(range(20))
    assert len({t for _, t in ran}) == 1 and ran[0][1] != threading.get_ident()
    assert [f.result(timeout=0) for f in futures] == list(range(20))


def test_internals_submit_blocks_while_more_than_its_byte_bound_is_pending(writer: MakeWriter):
    w, gate, log = writer(max_pending_bytes=100), threading.Event(), []
    try:
        first = w.submit(_gate_job(gate, log, "first"), 60)  # an empty queue takes any job
        _, fits, _ = _in_thread(lambda: w.submit(_gate_job(gate, log, "fits"), 40))
        assert fits.wait(TIMEOUT), "submit blocked at the byte bound"  # 100 pending: not past it
        _, submitted, out = _in_thread(lambda: (w.submit(_gate_job(gate, log, "third"), 1), log.append("submitted")))
        assert not submitted.wait(BLOCKED), "submit returned past the byte bound"
        assert not first.done()
    finally:
        gate.set()
    _wait(submitted)
    assert not isinstance(out[0], BaseException)
    w.flush()
    # the third job was queued only once the first had run and its bytes were freed
    assert log.index("first") < log.index("submitted")
    assert [x for x in log if x != "submitted"] == ["first", "fits", "third"]


def test_internals_a_job_bigger_than_the_bound_is_taken_when_nothing_is_pending(writer: MakeWriter):
    w = writer(max_pending_bytes=10)
    assert w.submit(lambda: "big", 1000).result(timeout=TIMEOUT) == "big"
    w.flush()
    assert w.submit(lambda: "again", 1000).result(timeout=TIMEOUT) == "again"


def test_internals_flush_waits_for_every_queued_job(writer: MakeWriter):
    w, gate, log = writer(), threading.Event(), []
    futures = [w.submit(_gate_job(gate, log, str(i)), 1) for i in range(3)]
    _, flushed, out = _in_thread(w.flush)
    try:
        assert not flushed.wait(BLOCKED), "flush returned before its jobs ran"
    finally:
        gate.set()
    _wait(flushed)
    assert out == [None] and log == ["0", "1", "2"] and all(f.done() for f in futures)


def test_internals_a_failed_job_is_reported_by_its_future_and_by_drain(writer: MakeWriter):
    w = writer()

    def fail() -> None:
        raise ValueError("disk on fire")

    failed = w.submit(fail, 1)
    after = w.submit(lambda: "still runs", 1)
    assert after.result(timeout=TIMEOUT) == "still runs"
    err = failed.exception(timeout=TIMEOUT)
    assert isinstance(err, ValueError) and "disk on fire" in str(err)
    assert err.__traceback__ is None  # a kept error holds no frames (nor its store)
    assert any("disk on fire" in n and "background writer" in n for n in getattr(err, "__notes__", []))
    assert w.drain() == [err]
    assert w.drain() == []  # reported once
    w.flush()  # nothing left to raise


def test_internals_flush_raises_the_first_error_since_the_last_flush(writer: MakeWriter):
    w = writer()
    for msg in ("first", "second"):
        w.submit(functools.partial(_raise, msg), 1)
    with pytest.raises(KeyError, match="first"):
        w.flush()
    w.flush()  # cleared by the flush that raised it
    w.submit(functools.partial(_raise, "third"), 1)
    with pytest.raises(KeyError, match="third"):
        w.flush()


def _raise(msg: str) -> None:
    raise KeyError(msg)


def test_internals_on_idle_runs_once_after_the_last_queued_job_before_flush_returns(writer: MakeWriter):
    log: list[str] = []
    w, gate = writer(on_idle=lambda: log.append("idle")), threading.Event()
    w.submit(_gate_job(gate, log, "a"), 1)
    w.submit(_gate_job(gate, log, "b"), 1)
    w.submit(_gate_job(gate, log, "c"), 1)
    gate.set()
    w.flush()
    assert log == ["a", "b", "c", "idle"]


def test_internals_close_runs_what_is_queued_then_stops_the_worker(writer: MakeWriter):
    w, gate, log = writer(), threading.Event(), []
    threads: list[threading.Thread] = []
    w.submit(lambda: threads.append(threading.current_thread()), 1)
    for i in range(3):
        w.submit(_gate_job(gate, log, str(i)), 1)
    _, closed, out = _in_thread(w.close)
    try:
        assert not closed.wait(BLOCKED), "close returned before its queue ran"
    finally:
        gate.set()
    _wait(closed)
    assert out == [None] and log == ["0", "1", "2"]
    assert not threads[0].is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        w.submit(lambda: None, 1)
    assert w.drain() == []


def test_internals_a_writer_never_used_starts_no_thread_and_closes(writer: MakeWriter):
    before = set(threading.enumerate())
    w = writer()
    assert set(threading.enumerate()) - before == set()  # (others' threads may end meanwhile)
    w.close()
    assert w.drain() == []


def test_internals_the_loader_runs_jobs_side_by_side_and_close_waits_for_them():
    loader = Loader(workers=2)
    a_started, b_release, names = threading.Event(), threading.Event(), []
    try:
        def a() -> str:
            a_started.set()
            _wait(b_release)  # only a second worker can release it
            names.append(threading.current_thread().name)
            return "a"

        def b() -> str:
            _wait(a_started)
            b_release.set()
            names.append(threading.current_thread().name)
            return "b"

        fa, fb = loader.submit(a), loader.submit(b)
        assert isinstance(fa, Future)
        assert (fa.result(timeout=TIMEOUT), fb.result(timeout=TIMEOUT)) == ("a", "b")
        assert all(n.startswith("residual-store-loader") for n in names) and len(set(names)) == 2
        gate = threading.Event()
        slow = loader.submit(lambda: _wait(gate) or "done")
    finally:
        b_release.set()
    _, closed, _ = _in_thread(loader.close)
    try:
        assert not closed.wait(BLOCKED), "close returned before its running job ended"
    finally:
        gate.set()
    _wait(closed)
    assert slow.result(timeout=0) == "done"
    with pytest.raises(RuntimeError):
        loader.submit(lambda: None)


# ----------------------------------------------------------------------------------------------
# Schedule


def test_internals_a_schedule_says_how_far_ahead_each_key_is_needed():
    s = Schedule()
    assert not s and s.next_use("a") is None and list(s.upcoming()) == []
    s.declare(["b2", "b1", "b2", "b0"])
    assert s
    assert [s.next_use(k) for k in ("b2", "b1", "b0", "x")] == [0, 1, 3, None]
    assert list(s.upcoming()) == ["b2", "b1", "b0"]
    s.consume("b2")
    assert [s.next_use(k) for k in ("b1", "b2", "b0")] == [0, 1, 2]
    assert list(s.upcoming()) == ["b1", "b2", "b0"]
    s.consume("x")  # not named: nothing changes
    assert [s.next_use(k) for k in ("b1", "b2", "b0")] == [0, 1, 2]
    for k in ("b1", "b2", "b0"):
        s.consume(k)
    assert not s and s.next_use("b2") is None and list(s.upcoming()) == []


def test_internals_a_get_out_of_order_consumes_that_keys_next_use_only():
    s = _scheduled(["a", "b", "c", "b"])
    s.consume("b")  # early: its first use is done, a is still next
    assert s.next_use("a") == 0
    assert s.next_use("a") < s.next_use("c") < s.next_use("b")
    assert list(s.upcoming()) == ["a", "c", "b"]
    s.consume("a")  # the cursor moves past the b already done
    assert (s.next_use("c"), s.next_use("b")) == (0, 1)
    assert list(s.upcoming()) == ["c", "b"]


def test_internals_declaring_a_schedule_replaces_the_last_one():
    s = _scheduled(["a", "b"])
    s.consume("a")
    s.declare(["c", "a"])
    assert (s.next_use("c"), s.next_use("a"), s.next_use("b")) == (0, 1, None)
    assert list(s.upcoming()) == ["c", "a"]
    s.declare([])
    assert not s


def _never(key: str) -> bool:
    return False


def test_internals_loads_ahead_starts_the_next_keys_that_fit_the_device_budget():
    size = _size()
    sizes = {k: size for k in "abcd"}
    assert loads_ahead("abcd", sizes.get, _never, 2 * size + size // 2, room=8) == ["a", "b"]
    assert loads_ahead("abcd", sizes.get, _never, None, room=8) == ["a", "b", "c", "d"]
    assert loads_ahead("abcd", sizes.get, _never, None, room=3) == ["a", "b", "c"]
    assert loads_ahead("abcd", sizes.get, _never, 0, room=8) == ["a"]  # the next one, always
    assert loads_ahead("abxd", sizes.get, _never, None, room=8) == ["a", "b"]  # x: not held
    # a key on the device already counts against the budget, and is not started again
    assert loads_ahead("abcd", sizes.get, lambda k: k == "a", 2 * size, room=8) == ["b"]


# ----------------------------------------------------------------------------------------------
# plan_write


_WRITE_ID = "0123456789ab"


@pytest.fixture(params=["template", "in full"])
def plan_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Plans made from a signature's template (what a store does after its first write of a
    signature) and residual by residual (the general path)."""
    if request.param == "in full":
        monkeypatch.setattr(layout, "_template_for", lambda *a: None)
    return request.param


def _plan(key: str, ctx: ResidualContext, write_id: str = _WRITE_ID) -> layout.WritePlan:
    arrays, impls = host.host_arrays(ctx)
    return layout.plan_write(key, ctx.spec, arrays, impls, write_id=write_id)


def _bundle_bytes(plan: layout.WritePlan) -> bytes:
    assert plan.bundle is not None
    return b"".join(bytes(p) for p in plan.bundle.parts)


def test_internals_a_plan_puts_the_own_residuals_in_one_bundle_under_the_keys_folder(plan_path: str):
    ctx = _ctx(2, seed=3)
    plan = _plan("run-1.mb_2", ctx)
    folder = paths.data_dir("run-1.mb_2", _WRITE_ID)
    assert plan.key == "run-1.mb_2" and plan.data_dir == folder
    assert paths.is_data_dir_of("run-1.mb_2", folder) and not paths.is_data_dir_of("run-1", folder)
    assert plan.bundle is not None and plan.bundle.ref.path == paths.bundle_path(folder)
    assert plan.files.keys() == {paths.group_metadata_path(folder), paths.bundle_path(folder)}
    assert plan.own == {}  # every own residual is in the bundle, none in a folder of its own
    own = [i for i, k in enumerate(ctx.spec.kinds) if k != "weight"]
    arrays, _ = host.host_arrays(ctx)
    for i, r in enumerate(plan.records):
        assert r.shape == arrays[i].shape and r.nbytes == arrays[i].nbytes
        if i in own:
            assert r.bundled and not r.shared and r.path == paths.own_array_path(folder, i)
            assert r.path.startswith(folder + "/")
        else:  # the weight: by content address, outside the folder, written once for all
            assert not r.bundled and r.shared
            assert r.path == paths.weight_path(serializers.content_digest(arrays[i]))
            assert paths.is_weight_path(r.path)
    assert set(plan.shared) == {plan.records[0].path}
    assert sum(plan.records[i].nbytes for i in own) == ctx.spec.own_nbytes
    assert plan.stored.records == plan.records and plan.stored.data_dir == folder
    assert plan.stored.bundle == plan.bundle.ref


def test_internals_a_plans_bundle_records_are_aligned_apart_and_hold_the_arrays_bytes(plan_path: str):
    ctx = _ctx(4, seed=1)
    plan = _plan("k", ctx)
    data = _bundle_bytes(plan)
    assert len(data) == plan.bundle.ref.nbytes
    arrays, _ = host.host_arrays(ctx)
    spans = sorted((r.offset, r.offset + r.nbytes, i) for i, r in enumerate(plan.records) if r.bundled)
    assert len(spans) == 3
    for (start, stop, i), nxt in zip(spans, [*spans[1:], None]):
        assert start % 64 == 0, (i, start)
        assert nxt is None or stop <= nxt[0], "bundled arrays overlap"
        assert stop <= len(data)
        assert data[start:stop] == np.ascontiguousarray(arrays[i]).tobytes()


def test_internals_the_plans_of_two_keys_differ_only_in_their_paths(plan_path: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(layout.time, "time", lambda: 1234.5)
    ctx = _ctx(2, seed=5)
    one, two = _plan("alpha", ctx), _plan("omega-2", ctx, write_id="ba9876543210")
    d1, d2 = one.data_dir, two.data_dir
    assert d1 != d2

    def moved(path: str) -> str:
        return d2 + path[len(d1):] if path.startswith(d1 + "/") else path

    assert [moved(r.path) for r in one.records] == [r.path for r in two.records]
    assert [r.relocated("p", r.checksum) for r in one.records] == [r.relocated("p", r.checksum) for r in two.records]
    assert one.layout == two.layout
    assert _bundle_bytes(one) == _bundle_bytes(two) and one.bundle.ref.checksum == two.bundle.ref.checksum
    assert [(a.index, moved(a.path), a.shared) for a in one.arrays] == [(a.index, a.path, a.shared) for a in two.arrays]
    m1 = serializers.decode_manifest(one.manifest, what="one")
    m2 = serializers.decode_manifest(two.manifest, what="two")
    for m in (m1, m2):
        m.pop(serializers.manifest.SELF_CHECKSUM_FIELD, None)
    assert (m1.pop("key"), m2.pop("key")) == ("alpha", "omega-2")
    assert (m1.pop("data_dir"), m2.pop("data_dir")) == (d1, d2)
    b1, b2 = m1.pop("bundle"), m2.pop("bundle")
    assert (b1["path"], b2["path"]) == (paths.bundle_path(d1), paths.bundle_path(d2))
    assert {**b1, "path": ""} == {**b2, "path": ""}
    a1, a2 = m1.pop("arrays"), m2.pop("arrays")
    assert [{**a, "path": moved(a["path"])} for a in a1] == a2
    assert m1 == m2
    g1, g2 = json.loads(one.group), json.loads(two.group)
    r1, r2 = g1["attributes"]["residual_store"], g2["attributes"]["residual_store"]
    assert (r1.pop("key"), r1.pop("manifest")) == ("alpha", paths.manifest_path("alpha"))
    assert (r2.pop("key"), r2.pop("manifest")) == ("omega-2", paths.manifest_path("omega-2"))
    assert [{k: moved(v) if k in ("path", "bundle") else v for k, v in e.items()} for e in r1.pop("arrays")] == r2.pop("arrays")
    assert g1 == g2


def test_internals_a_new_write_id_makes_a_new_folder_for_the_same_key():
    ctx = _ctx(1)
    ids = {paths.new_write_id() for _ in range(4)}
    assert len(ids) == 4
    folders = {_plan("k", ctx, write_id=i).data_dir for i in ids}
    assert len(folders) == 4 and all(paths.is_data_dir_of("k", f) for f in folders)
