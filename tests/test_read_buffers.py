"""The store's read buffers (residual_store._src.store.disk.buffers): a buffer is handed out again only
once nothing refers to it; contexts a user still holds keep their values whatever is read later."""

from __future__ import annotations

import gc
import threading
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual_store as rs
from residual_store._src.store.disk.buffers import ReadBuffers
from store_helpers import F32_TOL, assert_trees_close, assert_trees_equal


def _address(x: np.ndarray) -> int:
    return x.ctypes.data


@pytest.mark.slow
def test_internals_a_buffer_is_reused_only_once_every_array_aliasing_it_is_gone():
    pool = ReadBuffers(1 << 22)
    a = pool.empty((64, 128), np.float32)
    where = _address(a)
    assert where % 64 == 0 and a.flags.c_contiguous and a.flags.writeable
    a[...] = 3.0
    x = jax.device_put(a)  # on CPU it adopts the buffer
    view = np.asarray(x)
    del a
    assert _address(pool.empty((64, 128), np.float32)) != where  # x and view hold it
    del x
    assert _address(pool.empty((64, 128), np.float32)) != where  # view holds it
    np.testing.assert_array_equal(view, 3.0)
    del view
    gc.collect()  # np.asarray(x) leaves x's buffer in a reference cycle: it is freed by the collector
    reused_before = pool.reused
    got = [pool.empty((64, 128), np.float32) for _ in range(3)]
    assert where in {_address(g) for g in got} and pool.reused > reused_before
    assert len({_address(g) for g in got}) == 3  # never the same buffer twice at once


def test_internals_other_shapes_of_the_same_bytes_share_buffers_and_sizes_are_bounded():
    pool = ReadBuffers(4 * 4096)
    a = pool.empty((1100,), np.float32)  # 4400 bytes and room to align: two pages
    where = _address(a)
    del a
    b = pool.empty((2200,), np.int16)  # the same bytes: the same buffer
    assert _address(b) == where and b.dtype == np.int16 and b.shape == (2200,)
    c, d = pool.empty((100,), np.uint8), pool.empty((7, 9), np.float64)  # a page each: full
    assert pool.nbytes == 4 * 4096
    e = pool.empty((100,), np.uint8)  # no room while all are in use: a buffer of its own
    assert pool.nbytes == 4 * 4096 and _address(e) % 64 == 0
    del b
    f = pool.empty((100,), np.uint8)  # room made by giving b's free buffer back
    assert pool.nbytes == 3 * 4096
    assert len({_address(x) for x in (c, d, e, f)}) == 4
    assert pool.empty((0, 5), np.float32).shape == (0, 5)
    assert pool.empty((1 << 20,), np.uint8).nbytes == 1 << 20  # larger than the pool: unpooled
    assert pool.nbytes == 3 * 4096


def test_internals_threads_never_get_the_same_buffer():
    pool = ReadBuffers(64 << 20)
    held: list[list[np.ndarray]] = [[] for _ in range(4)]

    def take(i: int) -> None:
        for _ in range(200):
            x = pool.empty((256,), np.float32)
            x[...] = i
            held[i].append(x)
            if len(held[i]) > 3:
                held[i].pop(0)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    live = [x for h in held for x in h]
    assert len({_address(x) for x in live}) == len(live)
    for i, h in enumerate(held):
        for x in h:
            np.testing.assert_array_equal(x, i)
    assert pool.reused > 0


def _loss(w, x):
    return jnp.sum(jnp.tanh(jnp.sin(x @ w) * 2.0) ** 2)


@pytest.mark.slow
def test_contexts_a_user_holds_keep_their_values_while_later_gets_reuse_buffers(tmp_path):
    """Budgets 0: every get reads from disk. The contexts got and dropped give their buffers to
    the next gets; the ones still held are never overwritten, and every gradient is jax.grad's."""
    fwd = rs.split(_loss, argnums=(0, 1), weight_argnums=0)
    w = jax.random.normal(jax.random.key(0), (16, 8))
    xs = [jax.random.normal(jax.random.key(i + 1), (12, 16)) for i in range(6)]
    contexts = [fwd(w, x)[1] for x in xs]
    in_memory = [fwd.backward(ctx) for ctx in contexts]  # what every read must give, bit for bit
    for want, x in zip(in_memory, xs):
        assert_trees_close(want, jax.grad(_loss, argnums=(0, 1))(w, x), **F32_TOL)
    with rs.Store(tmp_path / "s", device_budget=0, host_budget=0) as store:
        for i, ctx in enumerate(contexts):
            store.put(ctx, f"k{i}")
        store.flush()
        held = store.get("k0")
        snapshot = [np.array(r) for r in held.residuals]
        for _ in range(3):
            for i, want in enumerate(in_memory):
                assert_trees_equal(rs.backward(store.get(f"k{i}")), want)
        # backwards dispatched without waiting: each context is dropped while its backward may
        # still read its buffers, which the next gets must then not take
        pending = [rs.backward(store.get(f"k{i % len(xs)}")) for i in range(4 * len(xs))]
        for i, grads in enumerate(pending):
            assert_trees_equal(grads, in_memory[i % len(xs)])
        assert store._persistence.disk.buffers.reused > 0
        for got, want in zip(held.residuals, snapshot):
            np.testing.assert_array_equal(np.asarray(got), want)
        assert_trees_equal(rs.backward(held), in_memory[0])
    assert store._persistence.disk.buffers.nbytes == 0  # given back at close


@pytest.mark.slow
def test_read_buffer_bytes_zero_reads_into_fresh_buffers_and_bad_values_are_refused(tmp_path):
    fwd = rs.split(_loss, argnums=(0, 1), weight_argnums=0)
    w, x = jax.random.normal(jax.random.key(0), (8, 4)), jax.random.normal(jax.random.key(1), (5, 8))
    with rs.Store(tmp_path / "s", device_budget=0, host_budget=0, read_buffer_bytes=0) as store:
        store.put(fwd(w, x)[1], "k")
        assert store._persistence.disk.buffers is None
        assert_trees_close(rs.backward(store.get("k")), jax.grad(_loss, argnums=(0, 1))(w, x), **F32_TOL)
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(rs.InvalidArgumentError, match="read_buffer_bytes"):
            rs.Store(tmp_path / "t", read_buffer_bytes=bad)
    assert not (tmp_path / "t").exists()


def test_a_kvstore_store_reads_into_recycled_buffers_too():
    fwd = rs.split(_loss, argnums=(0, 1), weight_argnums=0)
    w = jax.random.normal(jax.random.key(0), (16, 8))
    xs = [jax.random.normal(jax.random.key(i + 1), (12, 16)) for i in range(3)]
    contexts = [fwd(w, x)[1] for x in xs]
    in_memory = [fwd.backward(ctx) for ctx in contexts]
    # the kvstore path; the memory kvstore is one per process: a folder of this test's own
    spec = {"driver": "memory", "path": f"read-buffers-{uuid.uuid4().hex}/"}
    with rs.Store(spec, device_budget=0, host_budget=0) as store:
        assert type(store._persistence.disk.backend).__name__ == "KvBackend"
        for i, ctx in enumerate(contexts):
            store.put(ctx, f"k{i}")
        store.flush()
        for _ in range(3):
            for i, want in enumerate(in_memory):
                assert_trees_equal(rs.backward(store.get(f"k{i}")), want)
        assert store._persistence.disk.buffers.reused > 0
