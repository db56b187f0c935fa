"""The five races the key table closes (``residual_store/_src/store/table.py``), end to end through
``rs.Store``, each with its timing fixed so that it happens every time (a gate on the writer, a
read held at a copy, a signal raised between two steps), and repeated:

1. a deleted context comes back when the next put of its key fails;
2. a signal between a put's bookkeeping and the queueing of its write loses the key;
3. a get overlapping a delete returns an older version than the one put before it began;
4. ``verify`` racing a replacement calls a healthy context damaged;
5. ``flush``, ``close`` and the drains wait for an empty queue, not for what was acknowledged
   when they began.

Each failed before the table (the numbers in the docstrings are the trials that failed then).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

import residual_store as rs
from store_helpers import graded_version, graded_versions, tanh_split, which_version


@pytest.fixture(scope="module")
def versions() -> list[tuple[rs.ResidualContext, np.ndarray]]:
    return graded_versions(3, rows=16, seed=11)


_which = which_version



class _Gate:
    """A job that holds the store's writer until released: what is queued behind it waits."""

    def __init__(self, store: rs.Store) -> None:
        self.entered, self.open = threading.Event(), threading.Event()
        store._persistence.writer.submit(self._hold, 0)
        assert self.entered.wait(30)

    def _hold(self) -> None:
        self.entered.set()
        assert self.open.wait(30), "the test never opened the gate"


# -- 1 ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cycles", [1, 1, 1, 2])
def test_internals_a_delete_is_never_undone_by_a_failed_put_of_its_key(tmp_path, versions, cycles):
    """delete(k), then put(k) before the writer reaches the removal (``cycles`` times), then
    that put's write fails (a residual donated before the write): the deleted version stays
    deleted, here and in a fresh store (4 of 4 trials brought it back before)."""
    root = tmp_path / "s"
    with rs.Store(root) as store:
        store.put(versions[0][0], "k")
        store.flush()
        gate = _Gate(store)
        doomed, _ = graded_version(100 + cycles, rows=16, seed=11)
        for _ in range(cycles):
            store.delete("k")
            store.put(doomed, "k")
        doomed.residuals[-1].delete()  # donated after the put, before its write
        gate.open.set()
        with pytest.raises(rs.InvalidArgumentError, match="deleted"):
            store.flush()
        assert "k" not in store and store.keys() == []
        with pytest.raises(rs.ContextNotFoundError):
            store.get("k")
    with rs.Store(root, read_only=True) as other:
        assert other.keys() == []


# -- 2 ---------------------------------------------------------------------------------------------


_SIGNAL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    import jax, jax.numpy as jnp
    import residual_store as rs
    from residual_store._src.store import copies

    root, mode = sys.argv[1], sys.argv[2]
    fwd = rs.split(lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2))
    w = jnp.linspace(-1.0, 1.0, 64).reshape(8, 8)
    ctxs = [fwd(w, jnp.full((16, 8), float(i)))[1] for i in range(2)]
    seen = []
    if mode == "handler":
        def stop(signum, frame):
            with rs.Store(root, read_only=True) as other:
                seen.append("k" in other)
        signal.signal(signal.SIGTERM, stop)
    rs.flush_on_sigterm(timeout=None)
    store = rs.Store(root)
    store._persistence.writer.submit(lambda: time.sleep(0.3), 0)  # v0 is not written yet
    store.put(ctxs[0], "k")  # returns: acknowledged
    settle = copies.BudgetCopies.settle
    def signal_here(self, moves):  # between the put's transition and the queueing of its write
        copies.BudgetCopies.settle = settle
        os.kill(os.getpid(), signal.SIGTERM)
        settle(self, moves)
    copies.BudgetCopies.settle = signal_here
    store.put(ctxs[1], "k")
    print("handler saw k on disk:", seen, flush=True)
    sys.exit(0 if seen == [True] else 3)
    """
)


@pytest.mark.subprocess
@pytest.mark.parametrize("mode", ["handler", "exit"])
def test_internals_a_signal_between_a_puts_bookkeeping_and_its_queueing_loses_nothing(tmp_path, mode):
    """A SIGTERM lands after a re-put's transition, before it queued its write (the older
    version's write, queued, is superseded): with the program's own handler the key is on disk
    when the handler runs; without one the exit drain writes it before the 143 exit (1-2 of 8
    trials lost it before)."""
    root = tmp_path / "s"
    script = tmp_path / "signal_race.py"
    script.write_text(_SIGNAL_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(root), mode], capture_output=True, text=True, timeout=120)
    if mode == "handler":
        assert proc.returncode == 0, proc.stdout + proc.stderr
    else:
        assert proc.returncode == 143, proc.stdout + proc.stderr
    w = jnp.linspace(-1.0, 1.0, 64).reshape(8, 8)
    newer = tanh_split()[0](w, jnp.full((16, 8), 1.0))[1]  # the script's second version
    with rs.Store(root, read_only=True) as other:
        assert other.keys() == ["k"]
        for got, want in zip(other.arrays("k"), newer.residuals, strict=True):
            np.testing.assert_array_equal(got, np.asarray(want))


# -- 3 ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("trial", range(3))
def test_internals_a_get_overlapping_a_delete_returns_the_version_it_began_with(tmp_path, versions, monkeypatch, trial):
    """v0 is on disk; v1 is put and waits for its write (the writer held), in no memory tier; a
    get of it is held right after it noted v1; a delete then drops v1's pending write. The get
    returns v1 (what it noted it would copy, taken in the same step), never v0 from the disk (3
    of 3 returned v0 before, where the get looked for the pending write again after noting)."""
    from residual_store._src.store import reads

    noted, release = threading.Event(), threading.Event()
    real = reads.Reads._read

    def held(self, key, found):  # noqa: ANN001
        noted.set()
        assert release.wait(30)
        return real(self, key, found)

    with rs.Store(tmp_path / "s", device_budget=0, host_budget=0) as store:
        store.put(versions[0][0], "k")
        store.flush()
        gate = _Gate(store)
        store.put(versions[1][0], "k")
        monkeypatch.setattr(reads.Reads, "_read", held)
        got: list[object] = []
        reader = threading.Thread(target=lambda: got.append(store.get("k")))
        reader.start()
        assert noted.wait(30)
        store.delete("k")
        release.set()
        reader.join(30)
        gate.open.set()
        store.flush()
        assert _which(got[0], versions) == 1
        assert "k" not in store


# -- 4 ---------------------------------------------------------------------------------------------


def test_internals_verify_racing_a_replacement_reads_again_and_never_calls_it_damaged(tmp_path, versions, monkeypatch):
    """While ``verify`` checks a context's bundle, another store replaces the context (its old
    data folder recycled): the check fails on the old files, the manifest changed, so verify
    reads the new one and reports it healthy (1 in 280 called it damaged before)."""
    from residual_store._src.store.disk import forms

    root = tmp_path / "s"
    writer = rs.Store(root)
    try:
        writer.put(versions[0][0], "k")
        writer.flush()
        real = forms.check_bundle
        replaced = []

        def racing(backend, key, stored, buffer=None):  # noqa: ANN001
            if not replaced:
                replaced.append(True)
                writer.put(versions[1][0], "k")  # same folder shape: the old folder is recycled
                writer.flush()
                writer._persistence.janitor.submit(lambda: None).result()
            return real(backend, key, stored, buffer)

        monkeypatch.setattr(forms, "check_bundle", racing)
        with rs.Store(root, read_only=True) as reader:
            report = reader.verify(["k"])
        assert replaced and report.ok and report.verified == 1, report
    finally:
        writer.close()


def test_internals_verify_still_reports_damage_that_stays(tmp_path, versions):
    root = tmp_path / "s"
    with rs.Store(root) as store:
        store.put(versions[0][0], "k")
    bundle = next(root.glob("data/k.*/bundle.zip"))
    data = bytearray(bundle.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bundle.write_bytes(bytes(data))
    with rs.Store(root, read_only=True) as reader:
        report = reader.verify(["k"])
    assert not report.ok and "k" in report.damaged


# -- 5 ---------------------------------------------------------------------------------------------


class _Putter:
    """A thread that keeps putting (and flushing nothing) until stopped."""

    def __init__(self, store: rs.Store, ctx: rs.ResidualContext) -> None:
        self.stop, self.count = threading.Event(), 0
        self.thread = threading.Thread(target=self._run, args=(store, ctx), daemon=True)
        self.thread.start()
        while self.count < 3:
            time.sleep(0.001)

    def _run(self, store: rs.Store, ctx: rs.ResidualContext) -> None:
        i = 0
        while not self.stop.is_set():
            try:
                store.put(ctx, f"busy{i % 4}")
            except rs.InvalidArgumentError:
                return  # closed under it
            self.count += 1
            i += 1
            time.sleep(0.001)


def test_internals_flush_and_close_return_while_another_thread_keeps_putting(tmp_path, versions, monkeypatch):
    """Each write takes a while (the writer is slowed), and another thread keeps putting: flush
    returns once what was acknowledged before it began is written, close too (both waited for
    an empty queue before, and never returned)."""
    from residual_store._src.store import persistence

    real = persistence.WritablePersistence._write

    def slow(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        time.sleep(0.01)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(persistence.WritablePersistence, "_write", slow)
    store = rs.Store(tmp_path / "s")
    store.put(versions[0][0], "mine")
    putter = _Putter(store, versions[1][0])
    try:
        t0 = time.monotonic()
        store.flush()
        assert time.monotonic() - t0 < 20
        with rs.Store(tmp_path / "s", read_only=True) as other:
            assert "mine" in other
        closer = threading.Thread(target=store.close, daemon=True)
        closer.start()
        closer.join(30)
        assert not closer.is_alive(), "close waited for the other thread's later puts"
    finally:
        putter.stop.set()
        putter.thread.join(30)
        store.close()


_BUSY_EXIT = textwrap.dedent(
    """
    import signal, sys, threading, time
    import jax.numpy as jnp
    import residual_store as rs
    from residual_store._src.store import persistence

    root, mode = sys.argv[1], sys.argv[2]
    real = persistence.WritablePersistence._write
    def slow(self, *a, **k):
        time.sleep(0.01)
        return real(self, *a, **k)
    persistence.WritablePersistence._write = slow
    fwd = rs.split(lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2))
    w = jnp.linspace(-1.0, 1.0, 64).reshape(8, 8)
    ctx = fwd(w, jnp.ones((16, 8)))[1]
    store = rs.Store(root)
    store.put(ctx, "mine")
    def keep_putting():
        i = 0
        while True:
            try:
                store.put(ctx, f"busy{i % 4}")
            except rs.InvalidArgumentError:
                return
            i += 1
            time.sleep(0.001)
    threading.Thread(target=keep_putting, daemon=True).start()
    time.sleep(0.2)
    if mode == "handler":
        stopped = []
        signal.signal(signal.SIGTERM, lambda s, f: stopped.append(time.monotonic()))
        rs.flush_on_sigterm(timeout=None)
        t0 = time.monotonic()
        signal.raise_signal(signal.SIGTERM)
        print("handler ran after", stopped[0] - t0 if stopped else None, flush=True)
        sys.exit(0 if stopped else 3)
    print("main ends", flush=True)
    """
)


@pytest.mark.subprocess
@pytest.mark.parametrize("mode", ["handler", "exit"])
def test_internals_the_signal_and_exit_drains_end_while_a_daemon_thread_keeps_putting(tmp_path, mode):
    """With a thread that keeps putting: a SIGTERM's drain lets the program's own handler run
    (timeout=None: it never ran before), and a normal exit ends (it never ended before); what
    was put before the drain began is on disk."""
    script = tmp_path / "busy.py"
    script.write_text(_BUSY_EXIT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "s"), mode], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with rs.Store(tmp_path / "s", read_only=True) as other:
        assert "mine" in other


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs signals")
def test_internals_a_writer_flush_waits_for_its_mark_not_for_later_jobs():
    from residual_store._src.store.workers import Writer

    writer = Writer(1 << 20)
    try:
        ran = []
        first = writer.submit(lambda: (time.sleep(0.05), ran.append("first")), 1)
        gate = threading.Event()
        flushed = threading.Event()

        def flush() -> None:
            writer.flush()
            flushed.set()

        threading.Thread(target=flush, daemon=True).start()
        time.sleep(0.01)
        later = writer.submit(lambda: (gate.wait(30), ran.append("later")), 1)  # queued after the flush began
        assert flushed.wait(10), "flush waited for a job queued after it began"
        assert first.done() and not later.done() and ran == ["first"]
        gate.set()
        writer.flush()
        assert ran == ["first", "later"]
    finally:
        writer.close()


def test_internals_a_drain_claims_a_write_no_put_queued(tmp_path, versions):
    """The drain's hook queues what the table holds pending and nobody queued (race 2 by hand)."""
    store = rs.Store(tmp_path / "s")
    try:
        moves = store._table.put("k", versions[0][0])  # a transition whose writes were never queued
        assert moves.own is not None
        assert store._persistence.writer.drain() == ([], True)
        with rs.Store(tmp_path / "s", read_only=True) as other:
            assert "k" in other
    finally:
        store.close()

