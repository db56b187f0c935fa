"""The pool of pinned host memory (``store/pinned.py``) and the host copies routed through it
(``store/copies.py``'s ``pool=``): copies exact and in ``pinned_host`` memory, buffers reused only
when nothing but the pool holds them (threads racing copies, reads and drops over hundreds of
rounds never see a live array change), a capacity smaller than a context, a copy that fails
midway leaving its sources intact and the pool's count of bytes true. On a CPU the pool's memory
is ordinary host memory and the same code runs.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual_store as rs
from residual_store._src.store import copies, pinned
from residual_store._src.store.pinned import HostPool


def _arrays(seed: int, shapes: tuple[tuple[int, ...], ...] = ((256,), (64, 8), (300,))) -> list[jax.Array]:
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [jax.random.normal(k, s) for k, s in zip(keys, shapes)]


def _pointers(arrays: list[jax.Array]) -> list[int]:
    return [a.unsafe_buffer_pointer() for a in arrays]


def _held_in_lists(pool: HostPool) -> int:
    return sum(pinned._nbytes(key) * len(bufs) for key, bufs in pool._buffers.items())


def _model(w: jax.Array, x: jax.Array) -> jax.Array:
    h = jnp.tanh(x @ w)
    return jnp.sum(jnp.sin(h) ** 2)


_SPLIT = rs.split(_model)


def test_internals_a_copy_is_exact_in_pinned_host_memory_and_comes_back_exact():
    pool = HostPool()
    xs = _arrays(0)
    host_copies = pool.to_host(xs)
    pinned.wait_copies(host_copies)
    assert [c.sharding.memory_kind for c in host_copies] == ["pinned_host"] * 3
    for c, x in zip(host_copies, xs):
        np.testing.assert_array_equal(np.asarray(c), np.asarray(x))
    back = pool.to_device(host_copies)
    assert [b.sharding.memory_kind for b in back] == [jax.devices()[0].default_memory().kind] * 3
    for b, x in zip(back, xs):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(x))
    stats = pool.stats()
    nbytes = sum(x.nbytes for x in xs)
    assert (stats.misses, stats.hits, stats.unpooled, stats.buffers) == (3, 0, 0, 3)
    assert stats.held_bytes == nbytes and stats.free_bytes == 0  # (the copies are alive)
    assert stats.copied_bytes == stats.returned_bytes == nbytes


def test_internals_a_buffer_is_reused_once_nothing_but_the_pool_holds_it():
    pool = HostPool()
    first = pool.to_host(_arrays(0))
    where = _pointers(first)
    kept = first[1]  # one copy still held by a caller
    kept_value = np.array(kept)
    del first
    assert pool.stats().free_bytes == sum(_arrays(0)[i].nbytes for i in (0, 2))
    second = pool.to_host(_arrays(1))
    got = _pointers(second)
    assert got[0] == where[0] and got[2] == where[2], "the free buffers are reused"
    assert got[1] != where[1], "the held one is not"
    np.testing.assert_array_equal(np.asarray(kept), kept_value)
    for c, x in zip(second, _arrays(1)):
        np.testing.assert_array_equal(np.asarray(c), np.asarray(x))
    stats = pool.stats()
    assert (stats.hits, stats.misses, stats.buffers) == (2, 4, 4)
    assert stats.held_bytes == _held_in_lists(pool)


def test_internals_a_numpy_view_of_a_copy_keeps_its_bytes_after_the_copy_is_dropped():
    """On a CPU ``np.asarray`` of a host copy is a view of the pool's buffer: XLA does not donate
    a buffer a view holds, so the next copy goes elsewhere and the view keeps its values."""
    pool = HostPool()
    host_copies = pool.to_host(_arrays(0))
    views = [np.asarray(c) for c in host_copies]
    values = [v.copy() for v in views]
    del host_copies
    again = pool.to_host(_arrays(1))
    pinned.wait_copies(again)
    for v, want in zip(views, values):
        np.testing.assert_array_equal(v, want)
    assert pool.stats().held_bytes == _held_in_lists(pool)


def test_internals_the_reuse_rule_counts_every_reference_but_the_pools_own():
    bufs = [object(), object()]
    assert pinned._only_the_pool_holds(bufs, 0)
    held = {"ctx": bufs[1]}
    assert not pinned._only_the_pool_holds(bufs, 1)
    del held
    assert pinned._only_the_pool_holds(bufs, 1)
    held_elsewhere = bufs[0]
    assert not pinned._only_the_pool_holds(bufs, 0), held_elsewhere


def _race(pool: HostPool, rounds: int, threads: int) -> list[str]:
    """Threads that copy contexts to the host (``copies.to_host`` through ``pool``), keep some in
    a shared table, and take others out (read back through ``copies.to_device`` and compared with
    the values they were made from, or dropped); returns what went wrong."""
    table: dict[int, tuple[rs.ResidualContext, list[np.ndarray]]] = {}
    lock = threading.Lock()
    errors: list[str] = []
    w = jax.random.normal(jax.random.key(7), (16, 16))

    def check(entry: tuple[rs.ResidualContext, list[np.ndarray]], how: str) -> None:
        ctx, want = entry
        try:
            got = copies.to_device(ctx, pool=pool) if how == "read" else ctx
            for i, (a, b) in enumerate(zip(got.residuals, want)):
                if not np.array_equal(np.asarray(a), b):
                    errors.append(f"{how}: residual {i} of a live context changed")
        except Exception as err:  # noqa: BLE001 - a donated (deleted) live array is a failure too
            errors.append(f"{how}: {type(err).__name__}: {err}")

    def worker(seed: int) -> None:
        rnd = random.Random(seed)
        for n in range(rounds):
            x = jax.random.normal(jax.random.key(seed * 100_000 + n), (4, 16))
            ctx = _SPLIT(w, x)[1]
            want = [np.array(r) for r in ctx.residuals]
            moved = copies.to_host(ctx, pool=pool)
            with lock:
                table[seed * 100_000 + n] = (moved, want)
                victims = [table.pop(k) for k in rnd.sample(sorted(table), min(len(table), rnd.randint(0, 2)))]
            for entry in victims:
                check(entry, rnd.choice(["read", "drop"]))
        with lock:
            rest = list(table.values())
        for entry in rest:
            check(entry, "read")

    workers = [threading.Thread(target=worker, args=(i + 1,)) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return errors


def test_internals_threads_racing_copies_reads_and_drops_never_see_a_live_context_change():
    pool = HostPool()
    assert _race(pool, rounds=120, threads=4) == []
    stats = pool.stats()
    assert stats.hits > 100, stats  # (buffers were reused: the race exercised the rule)
    assert stats.held_bytes == _held_in_lists(pool)


def test_internals_the_race_finds_a_pool_that_reuses_buffers_still_held(monkeypatch):
    """The race above can fail: with the reuse rule broken (every buffer counts as free), it
    sees live contexts change or lose their arrays."""
    monkeypatch.setattr(pinned, "_only_the_pool_holds", lambda buffers, i: True)
    assert _race(HostPool(), rounds=30, threads=2) != []


def test_internals_a_pool_smaller_than_a_context_keeps_what_fits_and_copies_the_rest():
    pool = HostPool(capacity_bytes=1536)  # a context of four arrays of 1 KiB: one fits
    for seed in range(4):
        xs = _arrays(seed, ((256,), (256,), (256,), (256,)))
        copies = pool.to_host(xs)
        for c, x in zip(copies, xs):
            np.testing.assert_array_equal(np.asarray(c), np.asarray(x))
        assert pool.stats().held_bytes <= 1536
        del copies
    stats = pool.stats()
    assert (stats.held_bytes, stats.buffers) == (1024, 1)
    assert (stats.misses, stats.hits, stats.unpooled) == (1, 3, 12)


def test_internals_a_new_signature_lets_go_of_free_buffers_the_oldest_first():
    pool = HostPool(capacity_bytes=3 * 1024)
    a, b = pool.to_host(_arrays(0, ((256,),))), pool.to_host(_arrays(1, ((16, 16),)))
    c = pool.to_host(_arrays(2, ((8, 32),)))
    del a, c  # free: (256,) used first, (8, 32) last; (16, 16) held
    pool.to_host(_arrays(3, ((32, 8),)))
    keys = {shape for shape, _, _ in pool._buffers}
    assert keys == {(16, 16), (8, 32), (32, 8)} and pool.stats().held_bytes == 3 * 1024
    assert b[0].sharding.memory_kind == "pinned_host"
    assert pool.release() == 2 * 1024 and pool.stats().held_bytes == 1024  # (b is still held)


def test_internals_a_copy_that_fails_midway_leaves_its_sources_and_the_pool_intact(monkeypatch):
    pool = HostPool()
    pool.to_host(_arrays(0))  # three free buffers
    real = pinned._copy_program

    def failing(targets: tuple[Any, ...]) -> Callable[..., Any]:
        def run(arrays: tuple[jax.Array, ...], buffers: tuple[jax.Array, ...]) -> Any:
            real(targets[:1])(arrays[:1], buffers[:1])  # one buffer donated, then the failure
            raise RuntimeError("the link went down")

        return run

    monkeypatch.setattr(pinned, "_copy_program", failing)
    ctx = _SPLIT(jax.random.normal(jax.random.key(1), (8, 8)), jnp.ones((2, 8)))[1]
    pool.to_host([r for r, k in zip(ctx.residuals, ctx.spec.kinds) if k != "weight"])
    want = [np.array(r) for r in ctx.residuals]
    with pytest.raises(RuntimeError, match="the link went down"):
        copies.to_host(ctx, pool=pool)
    assert not any(r.is_deleted() for r in ctx.residuals)
    for r, v in zip(ctx.residuals, want):
        np.testing.assert_array_equal(np.asarray(r), v)
    assert pool.stats().held_bytes == _held_in_lists(pool)
    monkeypatch.setattr(pinned, "_copy_program", real)
    moved = copies.to_host(ctx, pool=pool)
    for r, v in zip(copies.to_device(moved, pool=pool).residuals, want):
        np.testing.assert_array_equal(np.asarray(r), v)


def test_internals_a_deleted_source_is_refused_before_any_buffer_is_taken():
    pool = HostPool()
    pool.to_host(_arrays(0))
    xs = _arrays(1)
    xs[2].delete()
    with pytest.raises(rs.InvalidArgumentError, match="deleted"):
        pool.to_host(xs)
    stats = pool.stats()
    assert stats.free_bytes == stats.held_bytes == sum(x.nbytes for x in _arrays(0))


def test_internals_host_copies_through_a_pool_are_those_without_one():
    """``pool=`` changes where the bytes go, not what comes back: the same memory kinds, values,
    shared arrays; typed keys stay on the device, sub-byte arrays are copied as before."""
    w = jax.random.normal(jax.random.key(3), (8, 8))

    def f(w: jax.Array, x: jax.Array, key: jax.Array) -> jax.Array:
        h = jnp.tanh(x @ w)
        kept = (h > 0).astype(jnp.int4)
        return jnp.sum(h * jax.random.uniform(key, h.shape) * kept.astype(jnp.float32))

    ctx = rs.split(f)(w, jnp.ones((4, 8)), jax.random.key(0))[1]
    pool = HostPool()
    plain, pooled = copies.to_host(ctx), copies.to_host(ctx, pool=pool)
    copies.wait_copied(pooled)
    assert copies.copy_done(pooled)
    for a, b in zip(plain.residuals, pooled.residuals):
        assert (a.sharding.memory_kind, a.dtype) == (b.sharding.memory_kind, b.dtype)
    for a, b in zip(copies.to_device(plain).residuals, copies.to_device(pooled, pool=pool).residuals):
        assert a.sharding.memory_kind == b.sharding.memory_kind
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert pool.stats().hits + pool.stats().misses == sum(pinned.poolable(r) for r, k in zip(
        ctx.residuals, ctx.spec.kinds) if k != "weight")
    np.testing.assert_allclose(rs.backward(copies.to_device(pooled, pool=pool)), rs.backward(ctx), rtol=0)


def test_internals_for_writing_on_a_cpu_takes_views_and_nothing_from_the_pool():
    if jax.default_backend() != "cpu":
        pytest.skip("device memory is host memory on a CPU only")
    ctx = _SPLIT(jax.random.normal(jax.random.key(1), (8, 8)), jnp.ones((2, 8)))[1]
    pool = HostPool()
    written = copies.for_writing(ctx, pool=pool)
    own = [(a, b) for a, b, k in zip(ctx.residuals, written.residuals, ctx.spec.kinds) if k != "weight"]
    assert own and all(isinstance(b, np.ndarray) and np.shares_memory(b, np.asarray(a)) for a, b in own)
    assert pool.stats().copied_bytes == 0
    assert copies.copy_done(written)


def test_internals_what_the_pool_takes():
    x = jnp.ones((4,))
    assert pinned.poolable(x) and not pinned.returnable(x)
    h = pinned.HostPool().to_host([x])[0]
    assert pinned.returnable(h) and not pinned.poolable(h)
    assert not pinned.poolable(jnp.ones((0,))) and not pinned.poolable(np.ones(4))
    assert not pinned.poolable(jnp.ones((4,), jnp.int4)) and not pinned.poolable(jax.random.key(0))
    y = jnp.ones((4,))
    y.delete()
    assert not pinned.poolable(y)
    with pytest.raises(rs.InvalidArgumentError, match="a pool's capacity"):
        HostPool(capacity_bytes=-1)


def test_internals_a_store_pool_is_sized_by_its_host_budget():
    assert pinned.capacity_for(3 << 30, 1 << 30) == 4 << 30
    assert 0 < pinned.capacity_for(None) <= pinned.capacity_for(None) * 2


def test_internals_arrays_back_from_the_pool_compute_with_device_arrays():
    """Many arrays (once placed by a jitted identity, whose outputs kept the host memory space
    in their type: ``add`` then refused them), copied out and back three times, the third
    through the reusing program: each comes back a plain device array that computes."""
    pool = HostPool()
    xs = [jnp.full((16, 8), float(i)) for i in range(9)]
    for _ in range(3):
        back = pool.to_device(pool.to_host(xs))
        for b, x in zip(back, xs):
            assert b.sharding.memory_kind == x.sharding.memory_kind
            np.testing.assert_array_equal(np.asarray(b + x), 2 * np.asarray(x))
