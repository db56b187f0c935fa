"""One key, one state: the key table's rules for one key (``residual_store/_src/store/table.py``),
each raced end to end through ``rs.Store``.

- A get that overlaps ``delete`` + ``flush`` never brings the deleted context back.
- A get that overlaps a replacement (``put`` of a new version, ``flush``, the new version pushed
  out of memory) never leaves the old version cached: every later get gives the new one.
- Threads racing get, put, delete, prefetch and ``flush(key)`` on one key, hundreds of times
  with a tiny switch interval: no call returns a version older than the last put or delete that
  returned before it started, and every context got gives ``jax.grad``'s gradients.
- Nothing slow runs under the store's lock: a thread that waits for the lock while another
  puts or gets a large context waits for bookkeeping only.

The deterministic tests hold a disk read at a gate (``DiskTier.read`` wrapped), so the overlap
happens every time; against the code before one state per key (the store's first form) they
fail (the resurrected key, v1's gradients).
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

import residual_store as rs
from store_helpers import graded_version, graded_versions, which_version


@pytest.fixture(scope="module")
def versions() -> list[tuple[rs.ResidualContext, np.ndarray]]:
    return graded_versions(8)


_which = which_version



@pytest.fixture
def small_switch_interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


class _HeldReads:
    """Wraps ``DiskTier.read`` so a read of ``key`` waits at a gate after reading (what it read
    is then the old version, whatever happens meanwhile)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, key: str) -> None:
        from residual_store._src.store.disk.tier import DiskTier

        self.read_done = threading.Event()
        self.release = threading.Event()
        original = DiskTier.read
        held = self

        def read(disk, k, **kwargs):  # noqa: ANN001 - a method wrapper
            result = original(disk, k, **kwargs)
            if k == key and not held.read_done.is_set():
                held.read_done.set()
                assert held.release.wait(30), "the test never released the read"
            return result

        monkeypatch.setattr(DiskTier, "read", read)


def _on_disk_only(root, key: str, ctx: rs.ResidualContext) -> None:
    with rs.Store(root) as writer:
        writer.put(ctx, key)


def test_internals_a_get_overlapping_delete_and_flush_does_not_bring_the_key_back(tmp_path, versions, monkeypatch):
    _on_disk_only(tmp_path, "k", versions[0][0])
    held = _HeldReads(monkeypatch, "k")
    with rs.Store(tmp_path) as st:
        got: list[object] = []
        reader = threading.Thread(target=lambda: got.append(st.get("k")))
        reader.start()
        assert held.read_done.wait(30)
        st.delete("k")
        st.flush()
        held.release.set()
        reader.join(30)
        assert _which(got[0], versions) == 0  # the get began before the delete: it may see v0
        assert "k" not in st and st.keys() == []
        with pytest.raises(rs.ContextNotFoundError):
            st.get("k")
        assert st.stats()["device"]["contexts"] == 0
    with rs.Store(tmp_path, read_only=True) as other:
        assert other.keys() == []


def test_internals_a_get_overlapping_a_replacement_leaves_no_old_version(tmp_path, versions, monkeypatch):
    _on_disk_only(tmp_path, "k", versions[0][0])
    held = _HeldReads(monkeypatch, "k")
    size = versions[0][0].spec.own_nbytes
    with rs.Store(tmp_path, device_budget=size, host_budget=0) as st:
        got: list[object] = []
        reader = threading.Thread(target=lambda: got.append(st.get("k")))
        reader.start()
        assert held.read_done.wait(30)
        st.put(versions[1][0], "k")
        st.flush("k")
        st.put(versions[2][0], "other")  # pushes v1 of "k" out of memory: only the disk holds it
        assert st._table.locate("k")[0] is None  # in no memory tier, no pending write
        held.release.set()
        reader.join(30)
        assert _which(got[0], versions) == 0  # overlapped the put: the old version, to itself only
        for _ in range(2):  # from disk, then from the device tier
            assert _which(st.get("k"), versions) == 1
    with rs.Store(tmp_path, read_only=True) as other:
        assert _which(other.get("k"), versions) == 1


def test_internals_a_prefetch_of_the_old_version_is_not_taken_by_a_later_get(tmp_path, versions, monkeypatch):
    _on_disk_only(tmp_path, "k", versions[0][0])
    held = _HeldReads(monkeypatch, "k")
    with rs.Store(tmp_path) as st:
        st.prefetch("k")  # reads v0 on a loader thread, held at the gate
        assert held.read_done.wait(30)
        st.put(versions[1][0], "k")
        held.release.set()
        assert _which(st.get("k"), versions) == 1
        st.flush()
        assert _which(st.get("k"), versions) == 1


@pytest.mark.parametrize(
    "budgets, rounds", [("memory", 150), ("disk", 150), pytest.param("disk", 600, marks=pytest.mark.slow)]
)
def test_threads_racing_on_one_key_never_see_an_older_version(tmp_path, versions, small_switch_interval, budgets, rounds):
    """A writer thread puts versions 1, 2, 3, ... of one key (deleting it between some), with
    ``flush("k")`` now and then; reader threads get, prefetch and test ``in``. A reader notes
    the last operation that returned before its call began; what its call gives must be that
    one or a later one (a delete: not found, or a later put)."""
    size = versions[0][0].spec.own_nbytes
    opts = {"device_budget": None} if budgets == "memory" else {"device_budget": size, "host_budget": 0}
    ops: list[tuple[str, int]] = []  # (kind, version) in the order they began
    returned = [0]  # how many of them have returned
    done = threading.Event()
    failures: list[str] = []
    seen = {"got": 0, "missing": 0}
    lock = threading.Lock()
    rng = random.Random(0)

    def check(before: int, result: int | None) -> None:
        later = ops[before:]  # began after, or before and still running when this call began
        kind, version = ops[before - 1]
        if result is None:
            if kind == "put" and not any(k == "delete" for k, _ in later):
                failures.append(f"not found after put of v{version} returned")
            return
        if kind == "put" and result != version and not any(v == result for k, v in later if k == "put"):
            failures.append(f"v{result} after put of v{version} returned")
        if kind == "delete" and not any(v == result for k, v in later if k == "put"):
            failures.append(f"v{result} after its delete returned")

    def reader(store: rs.Store, seed: int) -> None:
        r = random.Random(seed)
        while not done.is_set():
            with lock:
                before = returned[0]
            try:
                if r.random() < 0.2:
                    store.prefetch("k")
                ctx = store.get("k")
                result = _which(ctx, versions)
            except rs.ContextNotFoundError:
                result = None
            with lock:
                seen["got" if result is not None else "missing"] += 1
                check(before, result)

    filler = graded_version(99)[0]
    with rs.Store(tmp_path / "s", **opts) as st:
        st.put(versions[0][0], "k")
        ops.append(("put", 0))
        returned[0] = 1
        threads = [threading.Thread(target=reader, args=(st, i)) for i in range(2)]
        for t in threads:
            t.start()
        try:
            for _ in range(rounds):
                if rng.random() < 0.25 and ops[-1][0] == "put":
                    op = ("delete", ops[-1][1])
                else:
                    op = ("put", (ops[-1][1] + 1 + rng.randrange(len(versions) - 1)) % len(versions))
                with lock:
                    ops.append(op)
                if op[0] == "delete":
                    st.delete("k")
                else:
                    st.put(versions[op[1]][0], "k")
                with lock:
                    returned[0] += 1
                if budgets == "disk" and op[0] == "put" and rng.random() < 0.5:
                    st.flush("k")  # then pushed out of memory: the next get reads the disk
                    st.put(filler, "other")
                if rng.random() < 0.3:
                    try:
                        st.flush("k")
                    except rs.ContextNotFoundError:
                        assert op[0] == "delete"
                time.sleep(rng.random() * 1e-3)
        finally:
            done.set()
            for t in threads:
                t.join(60)
        assert not failures, failures[:5]
        assert seen["got"] > 50, seen
        if budgets == "disk":
            assert st.stats()["disk"]["reads"] > 10  # gets that read the disk raced the writer
        last = ops[-1]
        st.flush()
        if last[0] == "put":
            assert _which(st.get("k"), versions) == last[1]
        else:
            assert "k" not in st
    if budgets == "disk":
        with rs.Store(tmp_path / "s", read_only=True) as other:
            if last[0] == "put":
                assert _which(other.get("k"), versions) == last[1]
            else:
                assert "k" not in other.keys()


def test_internals_no_copy_runs_under_the_store_lock(tmp_path, monkeypatch):
    """While a put copies a context to host memory (device budget 0) and a get copies it back,
    the store's lock is free: another thread takes it at once."""
    from residual_store._src.store import copies, reads

    ctx, _ = graded_version(0)
    entered, release = threading.Event(), threading.Event()

    def slow(copy):  # noqa: ANN001
        def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003
            entered.set()
            assert release.wait(30)
            return copy(*args, **kwargs)
        return wrapped

    for module, name in ((copies, "to_host"), (reads, "to_device")):
        monkeypatch.setattr(module, name, slow(getattr(copies, name)))
    with rs.Store(None, device_budget=0) as st:
        for call in (lambda: st.put(ctx, "k"), lambda: st.get("k")):
            entered.clear()
            release.clear()
            worker = threading.Thread(target=call)
            worker.start()
            assert entered.wait(30)
            assert st._table.lock.acquire(timeout=5), "the copy runs under the store's lock"
            st._table.lock.release()
            release.set()
            worker.join(30)
        assert _which(st.get("k"), [(ctx, graded_version(0)[1])]) == 0
