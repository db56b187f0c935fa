"""The calls in progress on a store, and the moment it stops taking new ones.

A store ends while other threads may still call it: ``close()`` from one thread while others
put, or the interpreter's exit while a thread the main thread did not join keeps putting. So that
no call is half done when the store's writes are flushed for the last time, and no put returns
and is then lost, every public call of a store is counted (:func:`store_call`), and the end of
a store is two steps:

1. :meth:`Calls.stop` refuses every call that starts from then on with the library's error
   (:class:`~residual_store.InvalidArgumentError`, saying why), and waits until the calls in
   progress in other threads have returned;
2. only then the store flushes (``close``) or the exit drain runs.

So a call racing the end either raises, changing nothing, or completes before the last flush,
and a put that returned is on disk when ``close()`` returns or the process ends.

The invariants:

- **Counted before checked.** A call counts itself (per thread, so nested calls of one thread,
  ``pop`` calling ``get``, count once and are never refused half-way) *before* it looks whether
  the store still takes calls, and :meth:`Calls.stop` marks the store stopped *before* it counts
  the calls in progress: a call that was let in is always seen by the stop that refused the next.
- **No lock on the way in.** Counting and checking are a dict write and an attribute read of the
  calling thread, so a call costs no lock; the condition is taken only once a stop waits.
- **A stop never waits for its own thread** (a call that closes the store from inside a
  callback), nor for a thread that has ended.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from _thread import get_ident
from collections.abc import Callable
from typing import Any, TypeVar

from residual_store._src.errors import InvalidArgumentError
from residual_store._src.store.critical import StoreLock, store_condition

__all__ = ["Calls", "stop_all", "store_call"]

F = TypeVar("F", bound=Callable[..., Any])

_OPEN: weakref.WeakSet[Calls] = weakref.WeakSet()  # the calls of every store not stopped yet
_RECHECK_S = 0.1  # how often a stop's wait looks again (a thread may have ended meanwhile)


class Calls:
    """The public calls in progress on one store (see the module docstring)."""

    __slots__ = ("_depth", "_refusal", "_cv", "_ending", "__weakref__")

    def __init__(self) -> None:
        self._depth: dict[int, int] = {}  # thread ident -> its calls in progress (nested ones counted)
        self._refusal: str | None = None  # why calls are refused; None: taken
        self._cv = store_condition()  # a stop waits on it; the last call to end notifies it
        self._ending = StoreLock()  # held by the one who ends the store (close)
        _OPEN.add(self)

    def _end(self, me: int, count: int) -> None:
        """The call of thread ``me`` counted ``count`` (nested ones included) has returned."""
        if count > 1:
            self._depth[me] = count - 1
            return
        self._depth.pop(me, None)
        if self._refusal is not None:  # a stop may be waiting for this call
            with self._cv:
                self._cv.notify_all()

    def check(self) -> None:
        """Raises the refusal if the store takes no new calls (``with store:``)."""
        if self._refusal is not None:
            raise InvalidArgumentError(self._refusal)

    @property
    def stopped(self) -> bool:
        return self._refusal is not None

    def ending(self) -> StoreLock:
        """Held by whoever ends the store (``with calls.ending():``): a second one waits there
        until the first is done."""
        return self._ending

    def stop(self, why: str, limit: Callable[[], float | None] = lambda: None) -> bool:
        """Refuses every call from now on with ``why``, then waits until the calls in progress in
        other threads (alive ones) have returned, at most until ``limit()`` (a
        ``time.monotonic()`` deadline, asked again while it waits: a ``SIGTERM`` may set one;
        ``None``: no bound). Returns whether they all did."""
        self._refusal = why  # before counting: a call let in is one this stop sees
        _OPEN.discard(self)
        me = threading.get_ident()
        with self._cv:
            while True:
                alive = {t.ident for t in threading.enumerate()}
                if not any(count and ident != me and ident in alive for ident, count in list(self._depth.items())):
                    return True
                deadline = limit()
                left = _RECHECK_S if deadline is None else min(_RECHECK_S, deadline - time.monotonic())
                if left <= 0:
                    return False
                self._cv.wait(left)


def stop_all(why: str, limit: Callable[[], float | None]) -> None:
    """Stops every store that still takes calls (the interpreter exits): see :meth:`Calls.stop`."""
    for calls in list(_OPEN):
        calls.stop(why, limit)


def store_call(method: F) -> F:
    """Runs ``method`` (of a store, whose ``_calls`` counts it) as one call of its store:
    refused once the store is stopped, and waited for by the stop (the counting inlined:
    every public call of a store passes here)."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls = self._calls
        depth = calls._depth
        me = get_ident()
        count = depth.get(me, 0) + 1
        depth[me] = count  # counted before checked
        if count == 1 and calls._refusal is not None:
            calls._end(me, 1)
            raise InvalidArgumentError(calls._refusal)
        try:
            return method(self, *args, **kwargs)
        finally:
            if count == 1 and calls._refusal is None:
                depth.pop(me, None)  # (a stop that begins now sees it gone at its next look)
            else:
                calls._end(me, count)

    return call  # type: ignore[return-value]
