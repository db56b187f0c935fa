"""The critical sections a signal handler waits out (``residual_store/_src/store/critical.py``):
what is deferred inside runs at the outermost release, an exception of it comes from that
release, a failed acquire leaves the thread outside, and a condition's wait on a ``StoreLock``
is outside and restores the count. In this process (one test sends itself a signal)."""

from __future__ import annotations

import signal
import threading
import time

import pytest


def test_internals_what_is_deferred_inside_runs_at_the_outermost_release():
    from residual_store._src.store.critical import StoreLock, in_critical_section, run_when_outside

    a, b, ran = StoreLock(), StoreLock(), []
    assert not in_critical_section()
    run_when_outside(lambda: ran.append("now"))  # outside: at once
    assert ran == ["now"]
    with a:
        with b:
            with a:  # reentrant
                run_when_outside(lambda: ran.append("deferred"))
            assert in_critical_section() and ran == ["now"]
        assert ran == ["now"]
    assert ran == ["now", "deferred"] and not in_critical_section()


def test_internals_an_exception_of_a_deferred_function_comes_from_the_release_after_it():
    from residual_store._src.store.critical import StoreLock, in_critical_section, run_when_outside

    lock = StoreLock()

    def end():
        raise SystemExit(143)

    with pytest.raises(SystemExit):
        with lock:
            run_when_outside(end)
    assert not in_critical_section()
    other = []
    t = threading.Thread(target=lambda: other.append(lock.acquire(timeout=5) and lock.release() is None))
    t.start()
    t.join()
    assert other == [True]  # released before the exception came


def test_internals_a_failed_acquire_leaves_the_thread_outside():
    from residual_store._src.store.critical import StoreLock, in_critical_section

    lock, held, release = StoreLock(), threading.Event(), threading.Event()

    def hold():
        with lock:
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    assert lock.acquire(blocking=False) is False
    assert lock.acquire(timeout=0.01) is False
    assert not in_critical_section()
    release.set()
    t.join()
    with pytest.raises(RuntimeError):
        lock.release()  # not held: refused, and the count is left alone
    assert not in_critical_section()


def test_internals_a_condition_wait_on_a_store_lock_is_outside_and_restores_the_count():
    """A signal that lands while the main thread waits on a condition (backpressure, flush) is
    handled at once: the wait gave the lock back; after the wait the thread is inside again."""
    from residual_store._src.store.critical import StoreLock, in_critical_section

    cv = threading.Condition(StoreLock())
    seen = []
    before = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(in_critical_section()))
    try:
        main = threading.main_thread().ident
        with cv:
            with cv:  # held twice: the wait gives back both
                threading.Timer(0.05, signal.pthread_kill, (main, signal.SIGUSR1)).start()
                deadline = time.monotonic() + 10
                while not seen and time.monotonic() < deadline:
                    cv.wait(0.02)  # (a handler notifies nobody: look again now and then)
                assert in_critical_section() and cv._is_owned()
            assert in_critical_section()
        assert not in_critical_section()
    finally:
        signal.signal(signal.SIGUSR1, before)
    assert seen == [False]
