"""Nothing acknowledged is lost, nothing half-done is shown (issue 48), each case with its timing
fixed by a gate or a signal raised at a chosen step:

- a put in progress when ``close()`` is called completes and is on disk when ``close`` returns;
  a call that starts after raises the library's error and changes nothing;
- a signal (Ctrl-C, ``SIGTERM`` with or without a handler of the program's own) landing between
  a put's key-table transition and the queueing of its write waits until the put is whole;
- a daemon thread's put in progress when the interpreter exits is drained with the rest, and its
  next put raises the library's error (in a subprocess);
- a put whose copy to host memory fails to start is whole: flushed, closed and listed alike;
- a store dropped without ``close()`` never reports as failed a write that committed;
- ``popitem`` passes over a key another thread removes; a mapping's key is a str; ``update``
  refuses what ``dict.update`` refuses with the library's errors.
"""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

import residual_store as rs
from residual_store._src.store import copies
from store_helpers import TESTS_DIR, own_bytes, popen_python, tiny_context, wait_for, write_script

TIMEOUT = 30


def _arrays(ctx: rs.ResidualContext) -> list[np.ndarray]:
    return [np.asarray(x) for x in ctx.residuals]


def _assert_on_disk(root: object, key: str, ctx: rs.ResidualContext) -> None:
    """A fresh read-only store on ``root`` (as another process would open it) holds ``ctx``
    under ``key``, every array equal."""
    with rs.Store(root, read_only=True) as reader:
        assert key in reader.keys()
        for got, want in zip(reader.arrays(key), _arrays(ctx), strict=True):
            np.testing.assert_array_equal(got, want)


def _in_thread(fn, *args):  # noqa: ANN001, ANN202
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn(*args))
        except BaseException as err:  # noqa: BLE001 - handed to the test
            out.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


# -- a put racing close() ------------------------------------------------------------------------


def test_a_put_in_progress_when_close_is_called_is_on_disk_when_close_returns(tmp_path, monkeypatch):
    store = rs.Store(tmp_path)
    inside, release = threading.Event(), threading.Event()
    real = store._persistence.prepare_put

    def gated(ctx, key):  # noqa: ANN001, ANN202 - the put waits here, inside the store's call
        inside.set()
        assert release.wait(TIMEOUT)
        return real(ctx, key)

    monkeypatch.setattr(store._persistence, "prepare_put", gated)
    late = tiny_context(seed=1)
    putter, put_out = _in_thread(store.put, late, "late")
    assert inside.wait(TIMEOUT)
    closer, close_out = _in_thread(store.close)
    wait_for(lambda: store._calls.stopped, "close to refuse new calls")
    with pytest.raises(rs.InvalidArgumentError, match="closed"):  # a call after close began
        store.put(tiny_context(seed=2), "refused")
    with pytest.raises(rs.InvalidArgumentError, match="closed"):
        store.delete("late")
    closer.join(0.2)
    assert closer.is_alive(), "close returned while a put was in progress"
    release.set()
    putter.join(TIMEOUT)
    closer.join(TIMEOUT)
    assert put_out == ["late"] and close_out == [None]
    _assert_on_disk(tmp_path, "late", late)
    with rs.Store(tmp_path, read_only=True) as reader:
        assert reader.keys() == ["late"]


def test_a_second_close_waits_for_the_first_and_calls_after_it_raise(tmp_path):
    store = rs.Store(tmp_path)
    ctx = tiny_context(seed=3)
    store.put(ctx, "a")
    threads = [_in_thread(store.close) for _ in range(3)]
    for thread, out in threads:
        thread.join(TIMEOUT)
        assert out == [None]
    _assert_on_disk(tmp_path, "a", ctx)
    for call in (lambda: store.get("a"), lambda: store.keys(), lambda: store.flush(), lambda: store.stats()):
        with pytest.raises(rs.InvalidArgumentError, match="closed"):
            call()


# -- a put that raised -------------------------------------------------------------------------


def test_internals_a_put_whose_copy_to_host_fails_to_start_is_whole_flushed_and_closed(tmp_path, monkeypatch):
    a, b = tiny_context(rows=2, seed=4), tiny_context(rows=2, seed=5)

    def broken(ctx, pool=None):  # noqa: ANN001, ANN202
        raise RuntimeError("pinned host memory exhausted")

    store = rs.Store(tmp_path, device_budget=own_bytes(a))
    store.put(a, "a")
    monkeypatch.setattr(copies, "to_host", broken)  # pushing "a" out of the device tier fails
    with pytest.raises(RuntimeError, match="exhausted"):
        store.put(b, "b")
    monkeypatch.undo()
    assert store.keys() == ["a", "b"]
    store.flush()
    _assert_on_disk(tmp_path, "b", b)  # flushed as listed
    store.close()
    _assert_on_disk(tmp_path, "a", a)


# -- a store dropped without close() -------------------------------------------------------------


def test_a_store_dropped_without_close_never_reports_a_committed_replacement_as_failed(tmp_path, monkeypatch, capfd):
    store = rs.Store(tmp_path)
    old, new = tiny_context(seed=6), tiny_context(seed=7)
    store.put(old, "k")
    store.flush()
    gate = threading.Event()
    committer = store._persistence._committer
    real = committer.write

    def held(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the replacement waits until the store is gone
        assert gate.wait(TIMEOUT)
        return real(*args, **kwargs)

    monkeypatch.setattr(committer, "write", held)
    store.put(new, "k")  # replaces "old": its data goes to the janitor once the write commits
    writer = store._persistence.writer
    del store
    gc.collect()  # the finalizer stops the janitor (without waiting); the writer finishes its queue
    gate.set()
    writer._thread.join(TIMEOUT)
    assert not writer._thread.is_alive()
    assert "failed" not in capfd.readouterr().err
    _assert_on_disk(tmp_path, "k", new)


# -- the mapping ---------------------------------------------------------------------------------


class _RacingStore(rs.Store):
    """Deletes ``"a"`` just before popitem's pop removes it the first time (its read done):
    another thread's delete landing between popitem's read and its removal."""

    raced = False

    def delete(self, key):  # noqa: ANN001, ANN204
        if key == "a" and not self.raced:
            self.raced = True
            super().delete("a")  # (the other thread's)
        return super().delete(key)


def test_popitem_passes_over_a_key_another_thread_removes_meanwhile():
    b = tiny_context(seed=9)
    with _RacingStore(None) as store:
        store.put(tiny_context(seed=8), "a")
        store.put(b, "b")
        key, ctx = store.popitem()
        assert key == "b" and store.raced
        for got, want in zip(_arrays(ctx), _arrays(b), strict=True):
            np.testing.assert_array_equal(got, want)
        assert store.keys() == []
        with pytest.raises(rs.ContextNotFoundError, match="empty"):
            store.popitem()


def test_a_mapping_key_is_a_str_and_update_refuses_with_the_librarys_errors():
    ctx = tiny_context(seed=10)
    with rs.Store(None) as store:
        with pytest.raises(rs.InvalidKeyError, match="str"):
            store[None] = ctx  # type: ignore[index]
        with pytest.raises(rs.InvalidKeyError, match="str"):
            store.update({None: ctx})  # type: ignore[dict-item]
        with pytest.raises(rs.InvalidArgumentError, match="mapping") as not_iterable:
            store.update(1)  # type: ignore[arg-type]
        assert isinstance(not_iterable.value, TypeError)  # as dict.update(1)
        for pairs in ([("b",)], "ab", [("a", ctx, ctx)]):
            with pytest.raises(rs.InvalidKeyError, match="pair") as not_a_pair:
                store.update(pairs)  # type: ignore[arg-type]
            assert isinstance(not_a_pair.value, ValueError)  # as dict.update
        with pytest.raises(rs.InvalidArgumentError, match="pair"):
            store.update([1])  # type: ignore[list-item]
        assert store.keys() == []
        store.update({"a": ctx}, b=ctx)
        store.update([("c", ctx)])
        assert store.keys() == ["a", "b", "c"]


# -- signals and the exit, in other processes ----------------------------------------------------

SIGNAL_SCRIPT = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # (a background job starts with it ignored)
sys.path.insert(0, sys.argv[2])
import residual_store as rs
from residual_store._src.store.table import KeyTable
from store_helpers import tiny_context
root, how = sys.argv[1], sys.argv[3]
real = KeyTable.claim_writes
armed = []

def claim(self, writes, future):  # the signal lands after the write is claimed, before it is queued
    out = real(self, writes, future)
    if armed and out:
        signal.raise_signal(armed.pop())
    return out

KeyTable.claim_writes = claim

def on_disk(key):
    with rs.Store(root, read_only=True) as reader:
        return reader.arrays(key)[-1].ravel().tolist() if key in reader.keys() else None

store = rs.Store(root)
if how == "int":
    store.put(tiny_context(seed=1), "k")
    store.flush()
    armed.append(signal.SIGINT)
    try:
        store.put(tiny_context(seed=2), "k")
        print("put returned", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    store.flush()
    print("int", on_disk("k"), flush=True)
    def own(signum, frame):
        print("own handler", on_disk("j"), flush=True)
    signal.signal(signal.SIGTERM, own)
    rs.flush_on_sigterm(timeout=None)
    armed.append(signal.SIGTERM)
    store.put(tiny_context(seed=3), "j")
    print("own returned", flush=True)
else:
    rs.flush_on_sigterm()
    store.put(tiny_context(seed=1), "k")
    store.flush()
    armed.append(signal.SIGTERM)
    store.put(tiny_context(seed=2), "k")
    print("put returned", flush=True)
"""


BACKPRESSURE_SCRIPT = """
import os, signal, sys, threading
sys.path.insert(0, sys.argv[2])
import residual_store as rs
from store_helpers import tiny_context
root = sys.argv[1]
first, second = tiny_context(rows=4, seed=1), tiny_context(rows=4, seed=2)
store = rs.Store(root, max_pending_bytes=first.nbytes)  # a second pending put waits for the first
gate = threading.Event()
committer = store._persistence._committer
real = committer.write
def held(*args, **kwargs):  # the writer is behind: the first write waits at the gate
    gate.wait()
    return real(*args, **kwargs)
committer.write = held

def on_disk(key):
    with rs.Store(root, read_only=True) as reader:
        return reader.arrays(key)[-1].ravel().tolist() if key in reader.keys() else None

def own(signum, frame):
    print("own handler", on_disk("b"), flush=True)
signal.signal(signal.SIGTERM, own)
rs.flush_on_sigterm(timeout=None)
store.put(first, "a")

def signal_then_open_the_gate():  # the signal lands while the put of "b" waits for room
    while not store._persistence.writer._cv._waiters:
        pass
    os.kill(os.getpid(), signal.SIGTERM)
    threading.Timer(0.3, gate.set).start()
threading.Thread(target=signal_then_open_the_gate).start()
store.put(second, "b")
print("put returned", flush=True)
store.close()
"""


@pytest.mark.slow
def test_internals_sigterm_while_a_put_waits_for_room_runs_the_programs_handler_once_that_put_is_written(tmp_path):
    script = write_script(tmp_path, "backpressure.py", BACKPRESSURE_SCRIPT)
    code, out, err = _run(script, str(tmp_path / "store"), str(TESTS_DIR))
    assert code == 0, err
    assert out.splitlines() == [f"own handler {_last(tiny_context(rows=4, seed=2))}", "put returned"], out


def _last(ctx: rs.ResidualContext) -> list[float]:
    return np.asarray(ctx.residuals[-1]).ravel().tolist()


def _run(script: str, *args: str) -> tuple[int, str, str]:
    proc = popen_python(script, *args)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


@pytest.mark.slow
def test_internals_ctrl_c_or_sigterm_between_a_puts_transition_and_its_write_waits_until_the_put_is_whole(tmp_path):
    script = write_script(tmp_path, "signals.py", SIGNAL_SCRIPT)
    code, out, err = _run(script, str(tmp_path / "store"), str(TESTS_DIR), "int")
    assert code == 0, err
    lines = out.splitlines()
    # the KeyboardInterrupt is raised once the put is whole: its version is the one on disk
    assert lines[0] == "interrupted"
    assert lines[1] == f"int {_last(tiny_context(seed=2))}"
    # the program's own handler runs once the put it interrupted is written
    assert lines[2] == f"own handler {_last(tiny_context(seed=3))}"
    assert lines[3] == "own returned"


@pytest.mark.slow
def test_internals_sigterm_without_a_handler_between_a_puts_transition_and_its_write_exits_with_the_put_written(tmp_path):
    script = write_script(tmp_path, "signals.py", SIGNAL_SCRIPT)
    root = tmp_path / "store"
    code, out, err = _run(script, str(root), str(TESTS_DIR), "term")
    assert code == 143, err
    assert "put returned" not in out  # the exit is raised once the put is whole
    with rs.Store(root, read_only=True) as reader:
        assert reader.arrays("k")[-1].ravel().tolist() == _last(tiny_context(seed=2))


DAEMON_SCRIPT = """
import sys, threading
sys.path.insert(0, sys.argv[2])
import residual_store as rs
from store_helpers import tiny_context
store = rs.Store(sys.argv[1])
inside, release = threading.Event(), threading.Event()
real = store._persistence.prepare_put

def gated(ctx, key):  # the daemon's put of "k3" is in progress when the main thread ends
    if key == "k3":
        inside.set()
        release.wait()
    return real(ctx, key)

store._persistence.prepare_put = gated

def puts():
    for i in range(5):
        try:
            store.put(tiny_context(seed=i), f"k{i}")
        except rs.InvalidArgumentError as err:
            print(f"refused k{i}: {err}", flush=True)
            return
        print(f"acked k{i}", flush=True)

threading.Thread(target=puts, daemon=True).start()
inside.wait()
release_later = threading.Timer(0.3, release.set)  # the put goes on once the exit has begun
release_later.daemon = True
release_later.start()
print("main returns", flush=True)
"""


@pytest.mark.slow
def test_a_daemon_threads_put_in_progress_at_exit_is_written_and_its_next_put_raises(tmp_path):
    script = write_script(tmp_path, "daemon.py", DAEMON_SCRIPT)
    root = tmp_path / "store"
    code, out, err = _run(script, str(root), str(TESTS_DIR))
    assert code == 0, err
    assert "Traceback" not in err and "failed" not in err, err
    lines = out.splitlines()
    assert lines[:5] == ["acked k0", "acked k1", "acked k2", "main returns", "acked k3"], out
    assert lines[5].startswith("refused k4: the interpreter is exiting"), out
    with rs.Store(root, read_only=True) as reader:
        assert reader.keys() == ["k0", "k1", "k2", "k3"]
    for i in range(4):
        _assert_on_disk(root, f"k{i}", tiny_context(seed=i))

