"""``flush_on_sigterm`` while Python finalizes (``residual_store/_src/store/preemption.py``): a
``SIGTERM`` after the exit drain, while exit hooks run, ends the process with 143 at once; one that
came during the exit drain ends it with 143 once the drain is over; and one that comes while
Python tears its modules down (after it reset its signal handlers, where it would end the process
as -15) is ignored: the writes are done, and the process ends with its own status. Each in a
process of its own, signalled once it says it reached the moment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

import residual_store as rs

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

_SCRIPT = textwrap.dedent(
    """
    import atexit, sys, time
    import jax.numpy as jnp
    import residual_store as rs

    root, moment = sys.argv[1], sys.argv[2]
    rs.flush_on_sigterm(timeout=None)
    fwd = rs.split(lambda w: jnp.sum(jnp.sin(w) ** 2))
    store = rs.Store(root)
    store.put(fwd(jnp.arange(4.0))[1], "k")

    def announce_and_wait():
        print("ready", flush=True)
        time.sleep(20)

    if moment == "atexit":
        atexit.register(announce_and_wait)  # runs after the exit drain, before Python's teardown
    elif moment == "teardown":
        class SlowToGo:
            def __del__(self, _print=print, _sleep=time.sleep, _out=sys.stdout):
                _print("ready", file=_out, flush=True)  # (its module's names may be gone by now)
                _sleep(20)
        keep = SlowToGo()  # collected while Python tears __main__ down
    elif moment == "drain":
        from residual_store._src.store import persistence
        real = persistence.WritablePersistence._write
        def slow(self, *args, **kwargs):
            print("ready", flush=True)
            time.sleep(3)
            return real(self, *args, **kwargs)
        persistence.WritablePersistence._write = slow
        store.put(fwd(jnp.arange(5.0))[1], "k2")
        store._persistence.writer.submit(lambda: None, 0)
        store = None  # collected: only the exit drain completes the write
    """
)


def _run(tmp_path, moment: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "finalize.py"
    script.write_text(_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "s"), moment],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", (line, proc.stderr.read() if proc.stderr else "")
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_internals_a_sigterm_while_exit_hooks_run_ends_the_process_with_143_at_once(tmp_path):
    done = _run(tmp_path, "atexit")
    assert done.returncode == 143, done.stderr
    with rs.Store(tmp_path / "s", read_only=True) as other:
        assert other.keys() == ["k"]


def test_internals_a_sigterm_during_the_exit_drain_ends_the_process_with_143_once_the_drain_is_done(tmp_path):
    done = _run(tmp_path, "drain")
    assert done.returncode == 143, done.stderr
    assert "came during the exit drain" in done.stderr
    with rs.Store(tmp_path / "s", read_only=True) as other:
        assert other.keys() == ["k", "k2"]


def test_internals_a_sigterm_while_python_tears_down_its_modules_is_ignored_not_a_kill(tmp_path):
    done = _run(tmp_path, "teardown")
    assert done.returncode == 0, (done.returncode, done.stderr)  # before: -15, killed mid-teardown
    with rs.Store(tmp_path / "s", read_only=True) as other:
        assert other.keys() == ["k"]
