"""``flush_on_sigterm``: a preempted job loses nothing it put before the signal.

Schedulers and clouds end a job with ``SIGTERM``, then ``SIGKILL`` after a grace period
(Kubernetes and SLURM give 30 s by default). Python's default action for ``SIGTERM`` ends the
process at once, so the background writes of every store die with it. The handler installed
here completes them first:

- with no handler of the program's own before it, it raises ``SystemExit(143)`` in the main
  thread: the stack unwinds (``with`` blocks close their stores, locks are released) and the
  interpreter's exit drain completes every store's queued writes, as on any normal exit, within
  ``timeout`` if one is set; the exit status is 143, what a shell reports for a process ended by
  ``SIGTERM``;
- with one (a training loop's "save and stop" flag, Orbax's preemption handling), it completes
  every store's queued writes, durable where the store is, waiting at most ``timeout``, then
  calls that handler, which decides what happens next.

Python runs the handler in the main thread, between two bytecodes of whatever it was doing. Two
rules keep that safe:

- **Deferred out of critical sections.** If the signal lands while the main thread holds a
  store's lock (or any other lock the writers need: a ``StoreLock``, see ``critical.py``), the
  writer threads could not finish while the handler waits for them. The handler then only notes
  the signal, and runs when that thread releases its outermost such lock (at the end of the
  ``with`` block of ``put``, ``get``...): no wait for the writers ever waits on a lock held by
  the code it interrupted. The bound counts from the signal's arrival.
- **One at a time.** A ``SIGTERM`` that comes while an earlier one is handled (deferred, draining,
  running the program's handler, or unwinding and draining at exit after the ``SystemExit``) is
  noted on stderr and ignored: launchers that send ``SIGTERM`` twice do not cut the drain short.
  Only once the bound is past can a further ``SIGTERM`` end a process already ending (with
  status 143); with ``timeout=None`` nothing but ``SIGKILL`` does. Once the program's handler
  returns (the process goes on), the next ``SIGTERM`` is handled afresh.

A ``SystemExit`` raised from a signal handler is lost where the signal lands in code whose
exceptions Python cannot propagate (a garbage-collection callback such as JAX's, a ``__del__``,
a weakref callback): Python reports it to ``sys.unraisablehook`` as "Exception ignored" and the
interrupted code goes on. The handler's hook (:class:`_ExitNotLost`, installed when it first lets
an exit out) takes that exit back and interrupts the main thread again, so the exit is raised
anew outside that callback.
"""

from __future__ import annotations

import _thread
import atexit
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, NoReturn

from residual_store._src.errors import InvalidArgumentError
from residual_store._src.store.critical import in_critical_section, run_when_outside
from residual_store._src.store.workers import (
    AFTER_EXIT_DRAIN,
    bound_exit_drain,
    drain_within,
    draining_at_exit,
    exit_drained,
)

__all__ = ["flush_on_sigterm"]

_Handler = Callable[[int, FrameType | None], Any]

# what the handler is doing (set in the main thread only, where every handler runs)
_IDLE = "idle"  # no SIGTERM being handled
_DEFERRED = "deferred"  # one came inside a critical section: it runs when the lock is released
_HANDLING = "handling"  # draining the writes, or running the program's handler
_EXITING = "exiting"  # it ended the process (SystemExit): unwinding, then the exit drain


class _FlushThenPrevious:
    """The ``SIGTERM`` handler: completes every store's writes, then the previous handler."""

    def __init__(self, previous: Any, timeout: float | None) -> None:
        self.previous = previous
        self.timeout = timeout
        self.state = _IDLE
        self.deadline: float | None = None  # time.monotonic() bound of the current one's drain
        self.exit: SystemExit | None = None  # the exit let out, while Python may still lose it
        self.lost = False  # Python lost it (sys.unraisablehook): raise it again
        self.end_after_drain: int | None = None  # came during the exit drain: the status once it is over

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.lost:  # Python lost the exit; interrupted by _ExitNotLost (or a SIGTERM): raise it anew
            if not _ExitNotLost.running:  # (inside the hook it would be lost again: the next one)
                self.lost = False
                self._exit(SystemExit(self.exit.code if self.exit is not None else 128 + signum))
            return
        if self.state is not _IDLE:
            self._further(signum)
            return
        self.state = _DEFERRED  # at once, before any call: a SIGTERM landing now is a further one
        self.deadline = None if self.timeout is None else time.monotonic() + self.timeout
        if in_critical_section():
            # The main thread holds a lock the writers need: wait until it lets go (critical.py).
            run_when_outside(functools.partial(self._handle, signum, frame))
            return
        self._handle(signum, frame)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.state = _HANDLING
        why = f"SIGTERM (flush_on_sigterm(timeout={self.timeout}))"
        if self.previous in (signal.SIG_DFL, None):
            self.state = _EXITING
            if exit_drained():  # Python is finalizing, every write is done: nothing to unwind
                _end_now(128 + signum)
            if self.deadline is not None:
                bound_exit_drain(self.deadline, why)  # the exit drain waits until then only
            if draining_at_exit():  # already ending: the exit drain goes on, within the bound
                _say(f"residual-store: {why} came during the exit drain: the drain goes on, then the process ends (143)")
                self.end_after_drain = 128 + signum
                return
            # Unwinding first: ``with`` blocks close their stores; the exit drain runs after.
            self._exit(SystemExit(128 + signum))
        try:
            drain_within(self.deadline, why)
            if callable(self.previous):
                self.previous(signum, frame)
        except SystemExit as exc:  # the program's handler ends the process
            self.state = _EXITING
            self._exit(exc)
        finally:
            if self.state is _HANDLING:
                self.state = _IDLE  # returned (or raised to stop a loop): the process goes on

    def _further(self, signum: int) -> None:
        """A SIGTERM while one is handled: noted and ignored, unless the process is ending and
        its bound is past (then something other than the drain holds it up: it ends now)."""
        if self.state is _EXITING and self.deadline is not None and time.monotonic() >= self.deadline:
            _say("residual-store: a further SIGTERM after the flush_on_sigterm bound: the process ends now")
            self._exit(SystemExit(128 + signum))
        _say(
            "residual-store: a further SIGTERM came while the first one is handled; ignored: "
            "the stores' pending writes go on completing"
        )


    def _exit(self, exc: SystemExit) -> NoReturn:
        """Raises ``exc``, the process's exit, watched by :class:`_ExitNotLost` in case the
        signal landed where Python cannot propagate it."""
        self.exit = exc
        if not isinstance(sys.unraisablehook, _ExitNotLost):
            sys.unraisablehook = _ExitNotLost(self, sys.unraisablehook)
        raise exc


class _ExitNotLost:
    """``sys.unraisablehook`` while a handler's exit is on its way: the exit that Python could
    not propagate (the signal landed in a garbage-collection callback, a ``__del__`` or a weakref
    callback) is not printed and forgotten but raised again. A thread interrupts the main thread
    (``SIGTERM`` for its handler) every 10 ms until the handler, run outside this hook, has raised
    the exit anew. Every other unraisable exception goes to the hook that was there before."""

    running = False  # the hook is running (in the main thread): the exit waits until it returns

    def __init__(self, handler: _FlushThenPrevious, previous: Callable[[Any], Any]) -> None:
        self.handler = handler
        self.previous = previous
        self._again: threading.Thread | None = None

    def __call__(self, unraisable: Any) -> None:
        if self.handler.exit is None or unraisable.exc_value is not self.handler.exit:
            self.previous(unraisable)
            return
        _ExitNotLost.running = True
        try:
            self.handler.lost = True
            if self._again is None or not self._again.is_alive():
                self._again = threading.Thread(target=self._interrupt_while_lost, daemon=True,
                                               name="residual-store-exit-again")
                self._again.start()
        finally:
            _ExitNotLost.running = False

    def _interrupt_while_lost(self) -> None:
        while self.handler.lost:
            _thread.interrupt_main(signal.SIGTERM)
            time.sleep(0.01)


def _end_now(status: int) -> NoReturn:
    """Ends the process with ``status`` at once, its standard streams flushed: a SIGTERM while
    Python finalizes (every write done), where raising ``SystemExit`` no longer sets the status
    and, later, Python's own teardown of signal handling would let it end the process as -15."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - closed or broken: nothing left to flush
            pass
    os._exit(status)


def _after_exit_drain() -> None:
    """Once the exit drain is over: a SIGTERM that came during it ends the process now, with
    143; and none that comes later can end it as -15 (see :func:`_end_now`)."""
    handler = signal.getsignal(signal.SIGTERM)
    if isinstance(handler, _FlushThenPrevious) and handler.end_after_drain is not None:
        _end_now(handler.end_after_drain)


def _quiet_while_python_tears_down() -> None:
    """The last exit hook: Python is about to reset its signal handlers to the system's defaults
    (after which a SIGTERM would end the process as -15, mid-teardown); every write is done, so
    a SIGTERM from here on is ignored and the process ends with its own status."""
    if isinstance(signal.getsignal(signal.SIGTERM), _FlushThenPrevious):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


AFTER_EXIT_DRAIN.append(_after_exit_drain)
atexit.register(_quiet_while_python_tears_down)  # registered first, at import: runs last


def _say(line: str) -> None:
    """One line on stderr, from a signal handler: a plain write, never re-entering a buffered
    stream the interrupted code may be writing to."""
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


def flush_on_sigterm(*, timeout: float | None = 25.0) -> None:
    """Makes ``SIGTERM`` complete every open store's pending writes before the process goes on.

    Installs a handler (in the main thread, as Python requires) that waits for every store's
    queued writes, then runs the ``SIGTERM`` handler that was there before; where there was
    none (Python's default, which ends the process at once), it ends the process with status
    143 and the exit drain completes the writes, as on a normal exit. Calling it again changes
    nothing. A write that fails then is printed on stderr.

    A signal that lands while the main thread holds a store's lock (inside ``put``, ``get``...)
    is handled the moment that lock is released, so the wait never waits on the code it
    interrupted. A further ``SIGTERM`` while one is handled (a launcher that sends two) is noted
    on stderr and ignored: it never cuts the drain short.

    Args:
      timeout: at most this many seconds, from the signal, of waiting for the writes: with a
        handler of the program's own, before that handler runs; without one, for the exit
        drain (and for ``flush``/``close`` of stores on the way out). What is not done by then
        is listed on stderr (writes and bytes per store) and may be lost. ``None``: as long as
        the writes take; then nothing but ``SIGKILL`` ends the process before they are done.
        The default fits the 30 s a scheduler usually gives between ``SIGTERM`` and
        ``SIGKILL``. A normal exit, without a ``SIGTERM``, always waits for every write.

    Example:
      >>> import residual_store as rs
      >>> rs.flush_on_sigterm()        # once, at the start of a preemptible training script

    Raises:
      InvalidArgumentError: called from a thread other than the main thread, or a ``timeout``
        that is not a positive number of seconds or ``None``.
    """
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf")
    ):
        raise InvalidArgumentError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    if threading.current_thread() is not threading.main_thread():
        raise InvalidArgumentError("flush_on_sigterm installs a signal handler: call it from the main thread")
    current = signal.getsignal(signal.SIGTERM)
    if isinstance(current, _FlushThenPrevious):
        return
    signal.signal(signal.SIGTERM, _FlushThenPrevious(current, timeout))
