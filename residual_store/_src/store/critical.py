"""Critical sections that a signal handler waits out.

Python runs a signal handler in the main thread, between two bytecodes of whatever that thread
was doing. ``flush_on_sigterm``'s handler waits for the stores' writer threads; if the signal
lands while the main thread holds a lock those threads need (a store's lock, a writer's
condition), the handler would wait for a thread that waits for it: a deadlock, or a drain cut
short by its timeout. So those locks are :class:`StoreLock`\\ s, and the handler defers itself
while the main thread holds one.

The rules:

1. **Inside.** A thread is *inside a critical section* while it holds at least one
   :class:`StoreLock` (any of them, each re-entry counted), and also while it is acquiring one
   (from the call of ``acquire`` to its return) and releasing one (from the call of ``release``
   until the count is updated). Counting starts before the underlying lock is taken and ends
   after it is given back, so there is no instant at which the thread holds a StoreLock but
   does not count as inside; the price is a handler deferred for a lock not yet (or no longer)
   held, which costs nothing.
2. **Waiting is outside.** ``threading.Condition(StoreLock()).wait`` releases the lock through
   :meth:`StoreLock._release_save`, which takes this lock's share out of the count for the wait,
   and :meth:`StoreLock._acquire_restore` puts it back once the lock is held again. A thread
   blocked in such a wait (backpressure in ``Writer.submit``, ``flush``) holding no other
   StoreLock is outside: a signal landing there is handled at once.
3. **When a deferred function runs.** :func:`run_when_outside` called inside queues its
   function; the thread runs the queued functions, in order, when it releases its outermost
   StoreLock: from that ``release`` (so from the end of the ``with`` block), after the lock is
   given back. An exception one raises (``SystemExit`` from a handler that ends the process)
   propagates from there, as if raised right after the block; the functions still queued run
   at the next outermost release. Leaving through a condition's wait does not run them (the
   wait's caller still expects to hold the lock afterwards); they run when the thread leaves
   for good after the wait.
4. **Which thread.** The count is per thread. Signal handlers run in the main thread, so it is
   the main thread's count they look at; other threads are never interrupted by a handler and
   take the locks as they would a ``threading.RLock``.

5. **A change that must be whole.** :func:`critical_section` counts the thread as inside without
   a lock, around a change that spans several locks' sections and must not be cut in two by a
   signal: a ``put`` from its key table transition until its write is queued. A signal handler
   that lands there runs once the change is whole.
6. **Ctrl-C waits too.** :func:`defer_keyboard_interrupt` (a store opened in the main thread
   calls it) replaces Python's default ``SIGINT`` handler by one that raises the same
   ``KeyboardInterrupt``, at once outside a critical section, else when the thread leaves it
   (once, however many times Ctrl-C was pressed meanwhile). A handler of the program's own is
   left alone.

What must hold for no wait to deadlock: every lock that the main thread can hold at a point
where a signal lands and that a writer thread (or the drain itself) needs is a StoreLock. So
every lock of the store package is one (a test of the house checks it): the store's, the
writer's, the disk tier's, the read buffers', the weights', the caches of layouts and records.
The locks outside it (a split's tracing, a backward's compilation) are never taken by a writer.
"""

from __future__ import annotations

import signal
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = [
    "StoreLock", "critical_section", "defer_keyboard_interrupt", "in_critical_section", "run_when_outside",
    "store_condition",
]


class _ThreadState(threading.local):
    """Each thread's own (class attributes are the defaults a new thread starts from)."""

    depth = 0  # StoreLock holds (re-entries counted) of this thread, see rule 1
    deferred: deque[Callable[[], Any]] | None = None  # made on first deferral


_STATE = _ThreadState()


def _leave(state: _ThreadState, count: int = 1) -> None:
    """Takes ``count`` holds off the count; outside now, runs what was deferred (rule 3)."""
    state.depth -= count
    if state.depth == 0 and state.deferred:
        _run_deferred(state)


def _run_deferred(state: _ThreadState) -> None:
    deferred = state.deferred
    while state.depth == 0 and deferred:
        deferred.popleft()()


def in_critical_section() -> bool:
    """Whether the calling thread holds (or is taking or giving back) a :class:`StoreLock`."""
    return _STATE.depth > 0


def run_when_outside(fn: Callable[[], Any]) -> None:
    """Runs ``fn`` now if the calling thread is outside every critical section; else when it
    releases its outermost :class:`StoreLock` (from that ``release``, which raises what ``fn``
    raises)."""
    state = _STATE
    if state.depth > 0:
        if state.deferred is None:
            state.deferred = deque()
        state.deferred.append(fn)
    else:
        fn()


class StoreLock:
    """A reentrant lock (a ``threading.RLock``) that counts its holder as inside a critical
    section (see the module docstring); usable with ``with`` and as a ``threading.Condition``'s
    lock."""

    __slots__ = ("_lock", "__weakref__")

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        state = _STATE
        state.depth += 1  # before the lock is held: rule 1
        try:
            got = self._lock.acquire(blocking, timeout)
        except BaseException:  # an exception from another handler while blocked: not taken
            _leave(state)
            raise
        if not got:
            _leave(state)
        return got

    def release(self) -> None:
        self._lock.release()  # RuntimeError if not held: the count is left alone
        _leave(_STATE)  # after the lock is given back: rule 1

    # ``with`` is the hot path (every store call takes a few): the same steps, inlined.
    def __enter__(self) -> bool:
        state = _STATE
        state.depth += 1
        try:
            self._lock.acquire()
        except BaseException:
            _leave(state)
            raise
        return True

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
        state = _STATE
        state.depth -= 1
        if state.deferred and not state.depth:
            _run_deferred(state)

    # -- what threading.Condition uses (rule 2) --------------------------------------------------

    def _is_owned(self) -> bool:
        return self._lock._is_owned()  # type: ignore[attr-defined]

    def _release_save(self) -> tuple[Any, int]:
        saved = self._lock._release_save()  # type: ignore[attr-defined]  # (count, owner)
        count = saved[0]
        state = _STATE
        state.depth -= count  # after the lock is given back; deferred work waits (rule 3)
        return saved, count

    def _acquire_restore(self, saved: tuple[Any, int]) -> None:
        lock_state, count = saved
        _STATE.depth += count  # before the lock is held again
        self._lock._acquire_restore(lock_state)  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"<StoreLock {'held' if self._is_owned() else 'not held by this thread'}>"


def store_condition() -> threading.Condition:
    """A ``threading.Condition`` whose lock is a new :class:`StoreLock` (rule 2: a wait on it is
    outside every critical section)."""
    return threading.Condition(StoreLock())  # type: ignore[arg-type]  # the RLock methods Condition uses


class _CriticalSection:
    """``with critical_section():`` counts the thread as inside, holding no lock (rule 5)."""

    __slots__ = ()

    def __enter__(self) -> None:
        _STATE.depth += 1

    def __exit__(self, *exc: object) -> None:
        _leave(_STATE)


_CRITICAL = _CriticalSection()


def critical_section() -> _CriticalSection:
    """A change a signal handler must not cut in two (rule 5): it runs once the change is whole."""
    return _CRITICAL


def _raise_keyboard_interrupt() -> None:
    _DeferredInterrupt.pending = False
    raise KeyboardInterrupt


class _DeferredInterrupt:
    """Python's ``SIGINT`` handler, but waiting out critical sections (rule 6)."""

    pending = False  # one deferred already: a further Ctrl-C meanwhile adds none

    def __call__(self, signum: int, frame: Any) -> None:
        if not in_critical_section():
            raise KeyboardInterrupt
        if not _DeferredInterrupt.pending:
            _DeferredInterrupt.pending = True
            run_when_outside(_raise_keyboard_interrupt)

    def __repr__(self) -> str:
        return "<residual-store's default_int_handler: raises KeyboardInterrupt outside a store's critical sections>"


def defer_keyboard_interrupt() -> None:
    """Makes Ctrl-C wait out the store's critical sections (rule 6), where ``SIGINT`` has
    Python's default handler and this is the main thread; else changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _DeferredInterrupt())
    except (ValueError, OSError):  # no signals here (an embedded interpreter): nothing to defer
        pass
