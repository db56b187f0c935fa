"""Background writes with backpressure, and background loads.

``Writer.submit`` returns at once unless the bytes already queued exceed ``max_pending_bytes``,
in which case it waits for the worker to catch up: memory held by pending writes stays bounded.
One worker thread keeps writes in submission order, so the last ``put`` of a key is the one
that lands.

Nothing queued is lost on a normal exit: every live writer is drained when the interpreter
exits (the end of the script, ``sys.exit``, an uncaught exception), by a hook that runs when the
main thread ends, before ``concurrent.futures`` stops the thread pools the writes use and before
``atexit`` handlers (such as ``jax.distributed``'s shutdown). A writer whose owner is collected
finishes its queue, then its thread ends (a write that failed is reported on stderr); a kept
error holds no traceback frames, so it never keeps its store, and that thread, alive. A killed process (``kill -9``, an unhandled SIGTERM,
``os._exit``) loses what was queued.
"""

from __future__ import annotations

import atexit
import sys
import threading
import traceback
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["Writer", "Loader", "drain_all"]

_LIVE: weakref.WeakSet[Writer] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


class Writer:
    """A single background worker running write jobs in order under a byte bound."""

    def __init__(self, max_pending_bytes: int, on_idle: Callable[[], None] | None = None) -> None:
        """``on_idle`` runs on the worker after the last queued job, before that job counts as
        done (before ``flush`` returns): work a burst of jobs can share, such as one sync of a
        folder they all renamed files into. Its error is reported like a job's."""
        self._max = max_pending_bytes
        self._on_idle = on_idle
        self._cv = threading.Condition()
        self._queue: deque[tuple[Callable[[], Any], int, Future[Any]]] = deque()
        self._pending_bytes = 0
        self._errors: list[BaseException] = []
        self._closed = False
        self._thread: threading.Thread | None = None  # started by the first job: a store only read never has one
        with _LIVE_LOCK:
            _LIVE.add(self)

    def submit(self, job: Callable[[], Any], nbytes: int) -> Future[Any]:
        """Queues ``job``; waits while more than ``max_pending_bytes`` are queued (backpressure)."""
        future: Future[Any] = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the store is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="residual-store-writer", daemon=True)
                self._thread.start()
            while self._pending_bytes > 0 and self._pending_bytes + nbytes > self._max:
                self._cv.wait()
            self._queue.append((job, nbytes, future))
            self._pending_bytes += nbytes
            self._cv.notify_all()
        return future

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    unreported, self._errors = self._errors, []
                    break
                job, nbytes, future = self._queue[0]
            try:
                future.set_result(job())
            except BaseException as err:  # noqa: BLE001 - reported through flush()
                _release_frames(err)
                future.set_exception(err)
                with self._cv:
                    self._errors.append(err)
            # Drop the job (and the context it holds) before anyone learns it is done: a flushed
            # store must not keep the arrays of what it wrote alive.
            del job, future
            self._idle_if_last()
            with self._cv:
                self._queue.popleft()
                self._pending_bytes -= nbytes
                self._cv.notify_all()
        # Closed without a flush (its store was collected): nobody is left to raise these to.
        for err in unreported:
            _report(err, "in a store that was dropped without close()")

    def _idle_if_last(self) -> None:
        if self._on_idle is None:
            return
        with self._cv:
            last = len(self._queue) == 1
        if not last:
            return
        try:
            self._on_idle()
        except BaseException as err:  # noqa: BLE001 - reported through flush()
            _release_frames(err)
            with self._cv:
                self._errors.append(err)

    def flush(self) -> None:
        """Waits until every queued job has run; raises the first error since the last flush."""
        with self._cv:
            while self._queue:
                self._cv.wait()
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def close(self, wait: bool = True) -> None:
        """Runs what is queued, then stops the worker; with ``wait``, returns once it has
        stopped (never from the worker itself). Without ``wait`` the worker still runs its queue
        first, and the exit drain (:func:`drain_all`) still waits for it."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if wait and thread is not None and threading.current_thread() is not thread:
            thread.join()

    def drain(self) -> list[BaseException]:
        """Waits until every queued job has run; returns (and clears) the errors since the last
        flush instead of raising them."""
        with self._cv:
            while self._queue and self._thread is not None and self._thread.is_alive():
                self._cv.wait()
            errors, self._errors = self._errors, []
        return errors


def drain_all() -> None:
    """Completes the queued writes of every live writer; a failed write is reported on stderr
    (at exit nobody is left to raise it to)."""
    with _LIVE_LOCK:
        writers = list(_LIVE)
    for writer in writers:
        for err in writer.drain():
            _report(err, "at exit")


def _report(err: BaseException, when: str) -> None:
    print(f"residual-store: a background write failed {when}: {type(err).__name__}: {err}", file=sys.stderr)


def _release_frames(err: BaseException) -> None:
    """Drops the tracebacks of ``err`` and of its causes, keeping their text as a note: a kept
    error must not keep the store alive (a traceback's frames hold the job, which holds its
    store, and the writer's thread holds the writer and its errors), or a store dropped after a
    failed write would never be collected and its thread never end."""
    try:
        text = "".join(traceback.format_exception(err)).rstrip()
    except Exception:  # noqa: BLE001 - a broken __str__ must not lose the error itself
        text = ""
    seen: set[int] = set()
    todo: list[BaseException | None] = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        todo += [e.__cause__, e.__context__]
    if text:
        err.add_note(f"raised in the store's background writer:\n{text}")


# threading's own exit hooks run when the main thread ends, in reverse order of registration:
# this one (registered after concurrent.futures.thread, imported above) runs before the thread
# pools stop taking work, and all of them run before atexit handlers.
_register_exit = getattr(threading, "_register_atexit", None)
if _register_exit is not None:
    _register_exit(drain_all)
else:  # pragma: no cover - CPython has had it since 3.9
    atexit.register(drain_all)


class Loader:
    """A small thread pool for prefetches; one future per key in flight."""

    def __init__(self, workers: int = 2) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="residual-store-loader")

    def submit(self, job: Callable[[], Any]) -> Future[Any]:
        return self._pool.submit(job)

    def close(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait)
