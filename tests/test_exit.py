"""Nothing put is lost on a normal exit: a script that puts contexts and never calls ``flush``.

Each subprocess puts six contexts (about a megabyte each, fsynced) and ends at once, in one of
the ways a script ends: falling off its end, ``sys.exit(0)``, an uncaught exception, ``del
store``; one deletes its store and keeps running. Without the exit drain the writer thread (a
daemon) dies with the interpreter and most of the six are lost. Here every context is on disk
afterwards, whole, and gives the right gradients.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import jax
import numpy as np
import pytest

import residual_store as rs
from models import init_mlp, mlp_loss

pytestmark = pytest.mark.subprocess

TESTS = os.path.dirname(os.path.abspath(__file__))
N = 6
BATCH = 8192  # ~1.3 MB of residuals per context: the writes outlast the script

WRITER = textwrap.dedent(
    """
    import gc, sys, time
    sys.path.insert(0, sys.argv[4])
    import jax, residual_store as rs
    from models import init_mlp, mlp_loss
    root, how, prefix = sys.argv[1], sys.argv[2], sys.argv[3]
    if how == "previous_handler":  # the program's own handler, which ends the process at once
        import os, signal
        def previous(signum, frame):
            with rs.Store(root, read_only=True) as reader:  # what another process sees now
                print(f"visible to the previous handler: {{len(reader.keys())}}", flush=True)
            os._exit(7)  # no exit drain: only what flush_on_sigterm completed is there
        signal.signal(signal.SIGTERM, previous)
    if how in ("flush_on_sigterm", "previous_handler"):
        rs.flush_on_sigterm()
        rs.flush_on_sigterm()  # twice changes nothing
    params = init_mlp(jax.random.key(0))
    fwd = rs.split(mlp_loss)
    store = rs.Store(root)
    for i in range({n}):
        kx, ky = jax.random.split(jax.random.fold_in(jax.random.key(1), i))
        x, y = jax.random.normal(kx, ({batch}, 8)), jax.random.normal(ky, ({batch}, 4))
        store.put(fwd(params, x, y)[1], f"{{prefix}}{{i}}")
    if how == "sigterm":
        import signal
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    print("put all", flush=True)
    if how == "exit":
        sys.exit(0)
    if how == "raise":
        raise RuntimeError("the training script failed after its puts")
    if how in ("del", "del_and_wait"):
        del store
        gc.collect()
    if how in ("sigterm", "flush_on_sigterm", "previous_handler"):  # the test sends SIGTERM now
        time.sleep(120)
    if how == "del_and_wait":  # the process goes on: the collected store's writes still land
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with rs.Store(root, read_only=True) as reader:
                if len(reader.keys()) == {n}:
                    break
            time.sleep(0.05)
        print("landed while running", flush=True)
    """
).format(n=N, batch=BATCH)


def _writer(root: str, how: str, prefix: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, root, how, prefix, TESTS],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _batch(i: int) -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(jax.random.fold_in(jax.random.key(1), i))
    return jax.random.normal(kx, (BATCH, 8)), jax.random.normal(ky, (BATCH, 4))


@pytest.fixture(scope="module")
def ended(tmp_path_factory):
    """Every way of ending, run at once: {how: (returncode, stdout, stderr, store root)}."""
    base = tmp_path_factory.mktemp("exit")
    runs = {}
    for how in ("end", "exit", "raise", "del", "del_and_wait"):
        root = str(base / how)
        runs[how] = (root, [_writer(root, how, "mb")])
    signalled = ("sigterm", "flush_on_sigterm", "previous_handler")
    for how in signalled:
        root = str(base / how)
        runs[how] = (root, [_writer(root, how, "mb")])
    shared = str(base / "two")
    runs["two_writers"] = (shared, [_writer(shared, "end", "a"), _writer(shared, "end", "b")])
    for how in signalled:
        term = runs[how][1][0]
        assert term.stdout.readline().strip() == "put all"
        term.send_signal(signal.SIGTERM)
    results = {}
    for how, (root, procs) in runs.items():
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=300)
            outs.append((p.returncode, out, err))
        results[how] = (root, outs)
    return results


def _check_store(root: str, keys: list[str]) -> None:
    params = init_mlp(jax.random.key(0))
    fwd = rs.split(mlp_loss)
    with rs.Store(root, read_only=True) as store:
        assert sorted(store.keys()) == sorted(keys)
        for key in keys:
            i = int(key[-1])
            got = fwd.backward(store.get(key))
            want = jax.grad(mlp_loss)(params, *_batch(i))
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["end", "exit", "raise", "del", "del_and_wait"])
def test_every_context_put_before_a_normal_exit_is_on_disk(ended, how):
    root, [(code, out, err)] = ended[how]
    assert "put all" in out, err
    assert code == (1 if how == "raise" else 0), err
    if how == "raise":
        assert "RuntimeError: the training script failed" in err
    if how == "del_and_wait":
        assert "landed while running" in out
    assert "background write failed" not in err
    _check_store(root, [f"mb{i}" for i in range(N)])


def test_sigterm_turned_into_a_normal_exit_keeps_every_context(ended):
    """A handler of the program's own that turns SIGTERM into ``sys.exit``: the writes drain."""
    root, [(code, out, err)] = ended["sigterm"]
    assert code == 128 + signal.SIGTERM, err
    _check_store(root, [f"mb{i}" for i in range(N)])


def test_flush_on_sigterm_completes_the_writes_then_exits_143(ended):
    """``rs.flush_on_sigterm()`` with no handler before it: the writes of six contexts that
    outlast the script complete, then the process ends with status 143."""
    root, [(code, out, err)] = ended["flush_on_sigterm"]
    assert code == 128 + signal.SIGTERM, err
    assert "background write failed" not in err
    _check_store(root, [f"mb{i}" for i in range(N)])


def test_flush_on_sigterm_completes_the_writes_before_the_previous_handler_runs(ended):
    """The program's own handler runs after the writes completed: another store on the path
    already sees all six contexts from inside it, and it ends the process with ``os._exit``
    (no exit drain), so every context there was written by the SIGTERM handler."""
    root, [(code, out, err)] = ended["previous_handler"]
    assert code == 7, err
    assert f"visible to the previous handler: {N}" in out, (out, err)
    _check_store(root, [f"mb{i}" for i in range(N)])


def test_flush_on_sigterm_is_installed_from_the_main_thread_only():
    import signal as signals

    before = signals.getsignal(signals.SIGTERM)
    errors = []
    worker = threading.Thread(target=lambda: errors.append(_raises(rs.flush_on_sigterm)))
    worker.start()
    worker.join()
    assert isinstance(errors[0], rs.InvalidArgumentError) and "main thread" in str(errors[0])
    for bad in (0, -1.0, float("inf"), True, "30"):
        assert isinstance(_raises(lambda: rs.flush_on_sigterm(timeout=bad)), rs.InvalidArgumentError)
    assert signals.getsignal(signals.SIGTERM) is before  # nothing installed by a refused call


def _raises(fn):
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test inspects it
        return err
    return None


def test_two_writer_processes_that_just_end_keep_all_of_their_contexts(ended):
    root, outs = ended["two_writers"]
    for code, out, err in outs:
        assert code == 0 and "put all" in out, err
    _check_store(root, [f"{p}{i}" for p in "ab" for i in range(N)])


def test_internals_the_exit_hook_runs_before_the_thread_pools_stop():
    """The drain is registered with ``threading._register_atexit`` (CPython's hook for this, also
    used by ``concurrent.futures``): it runs in reverse order of registration, so ours, registered
    after ``concurrent.futures.thread`` is imported, runs before the pools refuse work."""
    assert callable(getattr(threading, "_register_atexit", None)), "threading._register_atexit is gone"
    from concurrent.futures import thread as futures_thread

    from residual_store._src.store import workers as io

    hooks = [getattr(h, "func", h) for h in getattr(threading, "_threading_atexits", [])]
    assert io.drain_all in hooks
    assert hooks.index(io.drain_all) > hooks.index(futures_thread._python_exit)


FAILING_WRITER = textwrap.dedent(
    """
    import atexit, os, shutil, sys
    import jax.numpy as jnp, residual_store as rs
    root, log = sys.argv[1], sys.argv[2]
    store = rs.Store(root)
    shutil.rmtree(os.path.join(root, "data"))
    open(os.path.join(root, "data"), "w").close()  # a file where the writes need a folder
    atexit.register(lambda: print("the script's own atexit handler ran", flush=True))
    notes = open(log, "w")
    notes.write("buffered, never flushed by the script")
    store.put(rs.split(lambda w: jnp.sum(jnp.sin(w)))(jnp.ones(3))[1], "mb0")
    print("put", flush=True)
    """
)


@pytest.mark.slow
def test_a_write_that_fails_at_exit_ends_the_process_with_status_1(tmp_path):
    """A script that ends normally while its put cannot be written: the failure is printed, and
    the exit status is 1, not 0, once the rest of the exit has run (the script's atexit handler,
    its open file's buffer written)."""
    log = tmp_path / "notes.txt"
    done = subprocess.run(
        [sys.executable, "-c", FAILING_WRITER, str(tmp_path / "store"), str(log)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    assert "put" in done.stdout and "the script's own atexit handler ran" in done.stdout
    assert "residual-store: a background write failed at exit" in done.stderr
    assert log.read_text() == "buffered, never flushed by the script"
