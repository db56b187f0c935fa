"""Long runs and misuse: no leaked threads, bounded caches, the library's own errors.

A store dropped without ``close`` stops its threads once its writes are done (also after a
failed write, whose kept error must not keep the store alive); the per-store weight cache and
the disk's stat cache stay small over many put/delete steps; plain misuse (a bad path, bad
budgets, a deleted or tampered context, a store marker of a future version, a closed store)
raises a ``rs.ResidualStoreError`` naming what is wrong.
"""

from __future__ import annotations

import gc
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual_store as rs
from residual_store._src.context import ResidualContext
from residual_store._src.store import committer as committer_module
from residual_store._src.store.disk import tier as disk_module


def _loss(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


@pytest.fixture(scope="module")
def fwd():
    return rs.split(_loss)


def _ctx(fwd, i: int = 0):
    w = jnp.full((4, 3), 0.01 * (i + 1), jnp.float32)  # new values each step: a new stored weight
    x = jnp.arange(8.0, dtype=jnp.float32).reshape(2, 4) + i
    return fwd(w, x)[1]


# Process-wide pools every store shares (threads start on demand, up to a bound, and stay): a
# dropped store must end its own threads, not these.
_SHARED_POOLS = ("residual-store-read", "residual-store-request", "serializers-io")


def _own_threads() -> int:
    return sum(1 for t in threading.enumerate() if not t.name.startswith(_SHARED_POOLS))


def _threads_settle(limit: int, timeout: float = 10.0) -> int:
    """The number of threads outside the shared pools, once it is at most ``limit`` (or at the
    deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        count = _own_threads()
        if count <= limit or time.monotonic() > deadline:
            return count
        time.sleep(0.05)


def _warm_up(fwd, root) -> None:
    """Starts the process-wide pools (array I/O, reads) that every store shares."""
    with rs.Store(root) as store:
        store.put(_ctx(fwd), "warm")
        store.flush()
        store.get("warm")
        store.delete("warm")


# ----------------------------------------------------------------------------------------------
# Threads


@pytest.mark.slow
def test_dropped_stores_leave_no_threads(tmp_path, fwd):
    _warm_up(fwd, tmp_path / "warm")
    before = _threads_settle(0, timeout=0)
    for i in range(10):
        store = rs.Store(tmp_path / f"s{i}", durable=False)
        store.put(_ctx(fwd, i), "a")
        if i % 2:
            store.prefetch("a")  # the loader's threads too
        del store
        gc.collect()
    assert _threads_settle(before) <= before, [t.name for t in threading.enumerate()]
    for i in range(10):  # and nothing put was lost
        with rs.Store(tmp_path / f"s{i}", read_only=True) as reader:
            assert reader.keys() == ["a"]


@pytest.mark.slow
def test_internals_a_store_dropped_after_a_failed_write_leaves_no_threads(tmp_path, fwd, monkeypatch, capfd):
    _warm_up(fwd, tmp_path / "warm")
    before = _threads_settle(0, timeout=0)

    def failing_write(self, write):
        raise OSError(5, f"injected failure writing {write.key}")

    monkeypatch.setattr(committer_module.SingleProcessCommitter, "write", failing_write)
    for i in range(5):
        store = rs.Store(tmp_path / f"s{i}")
        store.put(_ctx(fwd, i), f"k{i}")
        del store
        gc.collect()
    assert _threads_settle(before) <= before, [t.name for t in threading.enumerate()]
    err = capfd.readouterr().err
    assert "injected failure writing k0" in err and "without close()" in err


def test_internals_a_failed_write_still_raises_from_flush_with_its_traceback_text(tmp_path, fwd, monkeypatch):
    def failing_write(self, write):
        raise OSError(5, "injected")

    monkeypatch.setattr(committer_module.SingleProcessCommitter, "write", failing_write)
    store = rs.Store(tmp_path / "s")
    store.put(_ctx(fwd), "a")
    with pytest.raises(OSError, match="injected") as info:
        store.flush()
    assert any("failing_write" in note for note in getattr(info.value, "__notes__", []))
    store.close()


# ----------------------------------------------------------------------------------------------
# Caches


@pytest.mark.slow
def test_caches_stay_small_over_many_put_delete_steps(tmp_path, fwd):
    with rs.Store(tmp_path / "s", device_budget=0, host_budget=0, durable=False) as store:
        for i in range(300):
            key = f"k{i}"
            store.put(_ctx(fwd, i), key)
            store.flush()
            ctx = store.get(key)  # from disk: its weight goes through the weight cache
            if i % 10 == 0:
                assert store.stats()["disk"]["contexts"] == 1  # fills the stat cache
            store.delete(key)
            del ctx
        store.flush()
        store.stats()
        gc.collect()
        assert len(store._weights) <= 2
        assert len(store._persistence.disk._stat_cache) <= 2


def test_the_stat_cache_forgets_contexts_deleted_by_another_store(tmp_path, fwd):
    root = tmp_path / "s"
    with rs.Store(root, durable=False) as writer, rs.Store(root, read_only=True) as reader:
        for i in range(20):
            writer.put(_ctx(fwd, i), f"k{i}")
        writer.flush()
        assert reader.stats()["disk"]["contexts"] == 20
        assert len(reader._persistence.disk._stat_cache) == 20
        for i in range(20):
            writer.delete(f"k{i}")
        writer.flush()
        assert reader.stats()["disk"]["contexts"] == 0
        assert len(reader._persistence.disk._stat_cache) == 0


def test_internals_the_stat_cache_is_bounded(tmp_path, fwd, monkeypatch):
    monkeypatch.setattr(disk_module, "_STAT_CACHE_MAX", 5)
    with rs.Store(tmp_path / "s", durable=False) as store:
        for i in range(12):
            store.put(_ctx(fwd, i), f"k{i}")
        store.flush()
        assert store.stats()["disk"]["contexts"] == 12
        assert len(store._persistence.disk._stat_cache) == 5


# ----------------------------------------------------------------------------------------------
# Misuse


def test_bad_paths_are_invalid_arguments(tmp_path):
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    for path in (afile, afile / "sub", afile / "sub" / "deeper"):
        with pytest.raises(rs.InvalidArgumentError, match="file"):
            rs.Store(path)
    for path in (afile / "sub", str(afile / "sub" / "deeper")):
        with pytest.raises(rs.StoreNotFoundError):
            rs.Store(path, create=False)
        with pytest.raises(rs.StoreNotFoundError):
            rs.Store(path, read_only=True)
    assert afile.read_text() == "mine"
    for path in (123, 1.5, b"/tmp/x", ["a"], ""):
        with pytest.raises(rs.InvalidArgumentError, match="path"):
            rs.Store(path)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"device_budget": -1},
        {"host_budget": -1},
        {"host_budget": "10"},
        {"device_budget": 1.5},
        {"device_budget": True},
        {"max_pending_bytes": -1},
        {"max_pending_bytes": "1"},
    ],
)
def test_bad_budgets_are_invalid_arguments_and_create_nothing(tmp_path, kwargs):
    name = next(iter(kwargs))
    with pytest.raises(rs.InvalidArgumentError, match=name):
        rs.Store(None, **kwargs)
    root = tmp_path / "new"
    with pytest.raises(rs.InvalidArgumentError, match=name):
        rs.Store(root, **kwargs)
    assert not root.exists()


def test_integer_like_budgets_are_accepted(tmp_path):
    import numpy as np

    with rs.Store(None, device_budget=np.int64(0), host_budget=10) as store:
        assert store.stats()["device"]["bytes"] == 0


def test_a_backward_on_deleted_arrays_names_the_residual(fwd):
    for warm in (False, True):  # before and after the backward is compiled
        split = rs.split(lambda w, x: jnp.sum(jnp.sin(x @ w) ** 2))
        w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
        if warm:
            rs.backward(split(w, x)[1])
        ctx = split(w + 1.0, x + 1.0)[1]
        victim = next(i for i, r in enumerate(ctx.residuals) if isinstance(r, jax.Array))
        ctx.residuals[victim].delete()
        with pytest.raises(rs.InvalidArgumentError, match=rf"residual {victim} .*deleted"):
            rs.backward(ctx)


def test_a_residual_deleted_before_the_put_is_said_so_at_the_put(tmp_path):
    split = rs.split(lambda w, x: jnp.sum(jnp.sin(x @ w) ** 2))
    ctx = split(jnp.ones((4, 3)), jnp.ones((2, 4)) + 1.0)[1]
    victim = next(i for i, k in enumerate(ctx.spec.kinds) if k == "intermediate")
    ctx.residuals[victim].delete()
    with rs.Store(tmp_path / "s") as store:
        with pytest.raises(rs.InvalidArgumentError, match=rf"residual {victim}\b.*deleted .*before it was put"):
            store.put(ctx, "k")
        assert "k" not in store and len(store) == 0


@pytest.mark.parametrize("change", ["shape", "dtype"])
def test_internals_a_tampered_context_on_the_first_backward_names_the_residual(change):
    split = rs.split(lambda w, x: jnp.sum(jnp.sin(x @ w) ** 2))  # fresh: nothing compiled yet
    _, ctx = split(jnp.ones((4, 3)), jnp.ones((2, 4)))
    leaves, spec = list(ctx.residuals), ctx.spec
    i = len(leaves) - 1
    old = leaves[i]
    leaves[i] = jnp.ones((7, *old.shape), old.dtype) if change == "shape" else old.astype(jnp.int32)
    tampered = ResidualContext.tree_unflatten(spec, leaves)
    with pytest.raises(rs.SignatureMismatchError, match=rf"residual {i} \("):
        rs.backward(tampered)
    rs.backward(ctx)  # the intact context still runs


def test_internals_a_store_marker_of_a_future_version_is_refused_and_left_alone(tmp_path, fwd):
    root = tmp_path / "s"
    with rs.Store(root) as store:
        store.put(_ctx(fwd), "a")
    marker = root / disk_module.STORE_MARKER
    marker.write_bytes(b'{"format": "residual-store", "version": 99}\n')
    os.utime(marker, ns=(1_000_000_000, 1_000_000_000))
    before = marker.read_bytes(), marker.stat().st_mtime_ns
    files = sorted(p.relative_to(root) for p in root.rglob("*"))
    for kwargs in ({}, {"create": False}, {"read_only": True}):
        with pytest.raises(rs.CorruptContextError, match="version 99"):
            rs.Store(root, **kwargs)
    assert (marker.read_bytes(), marker.stat().st_mtime_ns) == before
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == files


@pytest.mark.parametrize(
    "content", [b"", b"garbage", b'{"format": "other", "version": 1}', b'{"format": "residual-store"}']
)
def test_internals_a_damaged_store_marker_is_refused(tmp_path, content):
    root = tmp_path / "s"
    rs.Store(root).close()
    (root / disk_module.STORE_MARKER).write_bytes(content)
    with pytest.raises(rs.CorruptContextError, match="store marker"):
        rs.Store(root)
    assert (root / disk_module.STORE_MARKER).read_bytes() == content


def _operations(key: str):
    return {
        "put": lambda s, ctx: s.put(ctx, "b"),
        "get": lambda s, ctx: s.get(key),
        "pop": lambda s, ctx: s.pop(key),
        "prefetch": lambda s, ctx: s.prefetch(key),
        "delete": lambda s, ctx: s.delete(key),
        "keys": lambda s, ctx: s.keys(),
        "contains": lambda s, ctx: key in s,
        "len": lambda s, ctx: len(s),
        "flush": lambda s, ctx: s.flush(),
        "stats": lambda s, ctx: s.stats(),
        "gc": lambda s, ctx: s.gc(older_than=0),
        "schedule": lambda s, ctx: s.schedule([key]),
        "get with a default": lambda s, ctx: s.get(key, None),
        "items": lambda s, ctx: list(s.items()),
        "enter": lambda s, ctx: s.__enter__(),
    }


@pytest.mark.parametrize("with_path", [True, False])
def test_a_closed_store_refuses_every_operation(tmp_path, fwd, with_path):
    ctx = _ctx(fwd)
    store = rs.Store(tmp_path / "s" if with_path else None)
    store.put(ctx, "a")
    store.close()
    store.close()  # twice is fine
    for name, op in _operations("a").items():
        with pytest.raises(rs.InvalidArgumentError, match="closed"):
            op(store, ctx)
    assert "closed" in repr(store)
    with pytest.raises(rs.InvalidArgumentError, match="closed"):
        with store:  # not entered: its body would fail at its first call
            pass
    if with_path:
        with rs.Store(tmp_path / "s", read_only=True) as reader:
            assert reader.keys() == ["a"]


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True, "30", None])
def test_a_collective_timeout_that_is_not_a_positive_number_is_refused(tmp_path, bad):
    with pytest.raises(rs.InvalidArgumentError, match="collective_timeout"):
        rs.Store(tmp_path / "s", collective_timeout=bad)
    assert not (tmp_path / "s").exists()  # refused before anything is created


@pytest.mark.parametrize("empty", [True, False], ids=["empty", "with a context"])
def test_gc_takes_the_durations_the_command_line_takes_and_refuses_the_rest(tmp_path, fwd, empty):
    with rs.Store(tmp_path / "s") as store:
        if not empty:
            store.put(_ctx(fwd), "a")
            store.flush()
            store.delete("a")  # its data folder and stored backward: unneeded, and young
            store.flush()
        hour = store.gc(older_than=3600, dry_run=True)
        assert (hour["young"] == 0) == empty and hour["bytes"] == 0  # all of it young: kept
        for given in (3600.0, "1h", "60m", " 1H ", "3600", "3600s", np.float32(3600)):
            assert store.gc(older_than=given, dry_run=True) == hour, given
        now = store.gc(older_than="0", dry_run=True)
        assert now["young"] == 0 and (now["bytes"] == 0) == empty
        for bad, message in ((-1, "at least 0"), ("-1h", "at least 0"), ("1x", "not a duration"),
                             ("", "not a duration"), (float("nan"), "at least 0"), (True, "must be a duration"),
                             (None, "must be a duration"), ([1], "must be a duration")):
            with pytest.raises(rs.InvalidArgumentError, match=f"older_than.*{message}"):
                store.gc(older_than=bad)
        with pytest.raises(rs.InvalidArgumentError, match="dry_run must be True or False"):
            store.gc(older_than=0, dry_run="yes")
        assert store.gc(older_than="0s") == now  # as the dry run said
