"""``flush_on_sigterm``: a preempted job loses nothing it put before the signal.

Schedulers and clouds end a job with ``SIGTERM``, then ``SIGKILL`` after a grace period
(Kubernetes and SLURM give 30 s by default). Python's default action for ``SIGTERM`` ends the
process at once, so the background writes of every store die with it. The handler installed
here completes them first:

- with no handler of the program's own before it, it raises ``SystemExit(143)`` in the main
  thread: the stack unwinds (``with`` blocks close their stores, locks are released) and the
  interpreter's exit drain completes every store's queued writes, as on any normal exit; the
  exit status is 143, what a shell reports for a process ended by ``SIGTERM``;
- with one (a training loop's "save and stop" flag, Orbax's preemption handling), it completes
  every store's queued writes, durable where the store is, then calls that handler, which
  decides what happens next.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from residual_store._src.errors import InvalidArgumentError
from residual_store._src.store.workers import drain_all

__all__ = ["flush_on_sigterm"]

_Handler = Callable[[int, FrameType | None], Any]


class _FlushThenPrevious:
    """The ``SIGTERM`` handler: completes every store's writes, then the previous handler."""

    def __init__(self, previous: Any, timeout: float | None) -> None:
        self.previous = previous
        self.timeout = timeout

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.previous in (signal.SIG_DFL, None):
            # Unwinding first matters: the signal may have landed while this thread held a
            # store's lock, which its writer needs to finish; the exit drain runs after.
            raise SystemExit(128 + signum)
        _drain_within(self.timeout)
        if callable(self.previous):
            self.previous(signum, frame)


def _drain_within(timeout: float | None) -> None:
    """Completes every live store's queued writes on a helper thread, waiting at most
    ``timeout`` seconds (a store whose lock this thread holds cannot finish while it waits)."""
    worker = threading.Thread(target=drain_all, name="residual-store-sigterm-flush", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        print(
            f"residual-store: SIGTERM: the stores' pending writes did not complete within {timeout} s; "
            "contexts put since the last flush may be lost",
            file=sys.stderr,
        )


def flush_on_sigterm(*, timeout: float | None = 25.0) -> None:
    """Makes ``SIGTERM`` complete every open store's pending writes before the process goes on.

    Installs a handler (in the main thread, as Python requires) that waits for every store's
    queued writes, then runs the ``SIGTERM`` handler that was there before; where there was
    none (Python's default, which ends the process at once), it ends the process with status
    143 after the writes complete, as an unhandled ``SIGTERM`` would. Calling it again changes
    nothing. A write that fails then is printed on stderr.

    Args:
      timeout: with a handler of the program's own, at most this many seconds of waiting for
        the writes before that handler runs (``None``: as long as they take). The default fits
        the 30 s a scheduler usually gives between ``SIGTERM`` and ``SIGKILL``.

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
