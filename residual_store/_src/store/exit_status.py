"""The exit status of a process whose background writes failed at exit: 1, not 0.

The exit drain (:func:`~residual_store._src.store.workers.drain_all`) runs after the script has
ended, when the interpreter has already fixed the status it will return (0 at the end of a
script), and an exception raised there is ignored. So where a write failed then (it is printed
on stderr), :func:`fail_at_exit` arranges for the process to end with status 1 once everything
else of the exit has run: the ``atexit`` handlers (logging's flush, JAX's shutdown), then the
flush of every open file and of stdout and stderr; then ``os._exit(1)``. A job runner or a shell
script then sees that what was put is not all on disk.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import os
import sys

__all__ = ["fail_at_exit"]

EXIT_STATUS = 1
_armed = False


def fail_at_exit() -> None:
    """Makes the process end with status 1 after the rest of its exit (once however often)."""
    global _armed
    if not _armed:
        _armed = True
        atexit.register(_end_with_failure)  # runs first of the handlers: it runs the others itself


def _end_with_failure() -> None:
    atexit.unregister(_end_with_failure)
    atexit._run_exitfuncs()  # every other handler, as the interpreter would, then this one ends
    _flush_open_files()
    os._exit(EXIT_STATUS)


def _flush_open_files() -> None:
    """What the interpreter's own end would write: every open file's buffer, stdout, stderr."""
    for obj in [*gc.get_objects(), sys.stdout, sys.stderr]:
        if isinstance(obj, io.IOBase):
            with contextlib.suppress(Exception):  # closed, unwritable, a broken pipe: nothing to keep
                if not obj.closed and obj.writable():
                    obj.flush()
