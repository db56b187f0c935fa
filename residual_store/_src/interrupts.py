"""Ctrl-C in the command line: said on a line of its own, status 130, never a crash.

A ``KeyboardInterrupt`` may land where it leaves things half done: inside the import of JAX, NumPy
and jaxlib (deferred to the import's end, :func:`interrupt_deferred`), inside a callback whose
exceptions Python only prints (raised again, :func:`interrupts_kept`), inside a function C code
called (which comes back as a ``SystemError``, :func:`from_interrupt`), or while XLA still compiles
on its own threads (the process ends without the interpreter's finalization, :func:`interrupted`).
Standard library only: ``cli.py`` imports it before anything of the library.
"""

from __future__ import annotations

import _thread
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any, NoReturn

from residual_store._src.cli_text import status_line

__all__ = ["from_interrupt", "interrupt_deferred", "interrupted", "interrupts_kept"]


def from_interrupt(err: BaseException) -> bool:
    """Whether a ``KeyboardInterrupt`` caused ``err``: one raised inside a function that C code
    called (NumPy asking a JAX dtype for its hash) comes back as that code's ``SystemError``."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


@contextlib.contextmanager
def interrupts_kept() -> Iterator[None]:
    """While a command runs, a Ctrl-C that lands inside a callback whose exceptions Python only
    prints (JAX's garbage-collection callback: "Exception ignored in ...") is raised again in the
    main thread instead of being lost (a moment later, from another thread: raised in the hook
    itself, it would be lost the same way)."""
    previous = sys.unraisablehook
    owed: list[int] = []  # interrupts taken by the hook and not raised again yet

    def again() -> None:
        # (where SIGINT has no Python handler, ignored as a background job's is, interrupt_main
        # does nothing: the interrupt stays owed, raised as the block ends)
        if owed and callable(signal.getsignal(signal.SIGINT)):
            owed.pop()
            _thread.interrupt_main()

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            owed.append(signal.SIGINT)
            threading.Timer(0.05, again).start()
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous
    if owed:  # the command ended before the timer: raised here, not in its caller
        owed.clear()
        raise KeyboardInterrupt


@contextlib.contextmanager
def interrupt_deferred() -> Iterator[None]:
    """A Ctrl-C while the block runs is raised as it ends: the import of JAX, NumPy and jaxlib
    (a few seconds), which a ``KeyboardInterrupt`` inside leaves half done (an ``ImportError``
    at the next import, or jaxlib's C++ ending the process with SIGABRT). Only in the main
    thread, under Python's own SIGINT handler; elsewhere the block runs as it is."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    caught: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if caught:
        raise KeyboardInterrupt


def interrupted(said: str, as_program: bool) -> int:
    """Says ``said`` (that the command was interrupted) on a line of its own, the status line
    erased first, and returns 130; run ``as_program`` once JAX is imported, ends the process
    here with that status instead.

    A Ctrl-C ends only the Python side's wait: a compile (or a computation) that JAX handed to
    XLA's threads runs on, and the interpreter's finalization would free the XLA client under it
    (jaxlib 0.10: a segmentation fault, status 139, after the message). Every store the command
    opened was closed on the way here (in ``with`` and ``finally`` blocks), so all that is left
    is to flush what was printed and end without that finalization."""
    if sys.stderr.isatty():
        status_line("")
    print(said, file=sys.stderr)
    if as_program and "jax" in sys.modules:
        end_now(130)
    return 130


def end_now(status: int) -> NoReturn:
    """Ends the process with ``status`` now, the log handlers and standard streams flushed."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # closed or a broken pipe: nothing left to flush
            stream.flush()
    os._exit(status)
