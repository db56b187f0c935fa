"""Background writes with backpressure, and background loads.

``Writer.submit`` returns at once unless the bytes already queued exceed ``max_pending_bytes``,
in which case it waits for the worker to catch up: memory held by pending writes stays bounded.
One worker thread keeps writes in submission order, so the last ``put`` of a key is the one
that lands.

**A wait for the writer waits for a mark.** ``flush``, ``close``, the SIGTERM drain and the exit
drain note the number of jobs submitted when they begin and return once the worker has done that
many: writes queued after they began (another thread that keeps putting) never hold them up. The
``on_idle`` work (one sync of the manifests' folder for a burst of durable commits) runs after the
job a waiter's mark names as well as after the last queued job, so a flush that returns is
durable however busy the queue stays.

Nothing queued is lost on a normal exit: every live writer is drained when the interpreter
exits (the end of the script, ``sys.exit``, an uncaught exception), by a hook that runs when the
main thread ends, before ``concurrent.futures`` stops the thread pools the writes use and before
``atexit`` handlers (such as ``jax.distributed``'s shutdown). After a ``SIGTERM`` that ends the
process with a bound (``flush_on_sigterm(timeout=...)``, see :func:`bound_exit_drain`), that
drain, and ``flush``/``close`` on the way out, wait only until the bound, then say what is left.
A writer whose owner is collected finishes its queue, then its thread ends (a write that failed
is reported on stderr); a kept error holds no traceback frames, so it never keeps its store, and
that thread, alive. A killed process (``kill -9``, an unhandled SIGTERM, ``os._exit``) loses
what was queued.

Every lock here is a :class:`~residual_store._src.store.critical.StoreLock`: the main thread
may hold one when a ``SIGTERM`` lands, and the handler's drain needs them all, so the handler
waits until it is released (see ``critical.py``).
"""

from __future__ import annotations

import atexit
import functools
import sys
import threading
import time
import traceback
import weakref
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from residual_store._src.errors import InvalidArgumentError
from residual_store._src.store.calls import stop_all
from residual_store._src.store.critical import StoreLock, store_condition
from residual_store._src.store.exit_status import fail_at_exit

__all__ = [
    "Writer", "bound_exit_drain", "drain_all", "drain_within", "draining_at_exit", "exit_drained", "exit_limit",
    "janitor", "request_pool",
]

_LIVE: weakref.WeakSet[Writer] = weakref.WeakSet()
_LIVE_LOCK = StoreLock()

# After a SIGTERM that ends the process: (monotonic deadline, what set it) bounding the exit
# drain and the flushes and closes on the way out; None: wait for every write (a normal exit).
_EXIT_BOUND: tuple[float, str] | None = None
_AT_EXIT = False  # the exit drain is running
_EXIT_DRAINED = False  # the exit drain is over: the interpreter is finalizing, nothing of ours is left to write


class _Future(Future):  # type: ignore[type-arg]
    """A write's future whose lock is a StoreLock: the main thread holds it for a moment in
    ``add_done_callback`` or ``result``, and the writer thread needs it to finish the job."""

    def __init__(self) -> None:
        super().__init__()
        self._condition = store_condition()


class Writer:
    """A single background worker running write jobs in order under a byte bound."""

    def __init__(
        self, max_pending_bytes: int, on_idle: Callable[[], None] | None = None, *, label: str | None = None,
    ) -> None:
        """``on_idle`` runs on the worker after the last queued job, before that job counts as
        done (before ``flush`` returns): work a burst of jobs can share, such as one sync of a
        folder they all renamed files into. Its error is reported like a job's. ``label``: what
        a message about this writer's queue calls it (default: the ``description`` of the
        object ``on_idle`` is a method of, if any: a store's disk)."""
        self._max = max_pending_bytes
        self._on_idle = on_idle
        if label is None:
            label = getattr(getattr(on_idle, "__self__", None), "description", None)
        self.label = label if isinstance(label, str) else None
        self._cv = store_condition()
        self._queue: deque[tuple[Callable[[], Any], int, Future[Any]]] = deque()
        self._pending_bytes = 0
        self._submitted = 0  # jobs submitted so far: a waiter's mark
        self._done = 0  # jobs done so far (in order: the first _done submitted ones)
        self._marks: Counter[int] = Counter()  # marks waiters wait for: on_idle runs after those jobs too
        self._errors: list[BaseException] = []
        self._closed = False
        self._thread: threading.Thread | None = None  # started by the first job: a store only read never has one
        # asked (a weak method, or None) before a drain takes its mark: queues what is owed
        self.before_drain: Callable[[], Callable[[], None] | None] | None = None
        with _LIVE_LOCK:
            _LIVE.add(self)

    @staticmethod
    def future() -> Future[Any]:
        """A future for a job submitted later (:meth:`submit`): handed out first, so that whoever
        waits for the job can find it before it is queued."""
        return _Future()

    def submit(self, job: Callable[[], Any], nbytes: int, future: Future[Any] | None = None) -> Future[Any]:
        """Queues ``job`` (its result or error goes to ``future``, from :meth:`future`, or a new
        one); waits while more than ``max_pending_bytes`` are queued (backpressure).

        Raises:
          InvalidArgumentError: the writer is closed (``future`` then holds that error too).
        """
        future = _Future() if future is None else future
        with self._cv:
            if self._closed:
                err = InvalidArgumentError("this store is closed: open a new rs.Store to use it again")
                future.set_exception(err)
                raise err
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="residual-store-writer", daemon=True)
                self._thread.start()
            while self._pending_bytes > 0 and self._pending_bytes + nbytes > self._max:
                self._cv.wait()
            self._queue.append((job, nbytes, future))
            self._pending_bytes += nbytes
            self._submitted += 1
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
            self._idle_if_due()
            with self._cv:
                self._queue.popleft()
                self._pending_bytes -= nbytes
                self._done += 1
                self._cv.notify_all()
        # Closed without a flush (its store was collected): nobody is left to raise these to.
        for lost in unreported:
            _report(lost, "in a store that was dropped without close()")

    def _idle_if_due(self) -> None:
        """Runs ``on_idle`` after the last queued job, or after a job a waiter's mark names."""
        if self._on_idle is None:
            return
        with self._cv:
            due = len(self._queue) == 1 or any(m <= self._done + 1 for m in self._marks)
        if not due:
            return
        try:
            self._on_idle()
        except BaseException as err:  # noqa: BLE001 - reported through flush()
            _release_frames(err)
            with self._cv:
                self._errors.append(err)

    def backlog(self) -> tuple[int, int]:
        """``(jobs, bytes)`` not done yet: queued or running."""
        with self._cv:
            return len(self._queue), self._pending_bytes

    def _wait_until_done(self, deadline: float | None = None) -> bool:
        """Under ``_cv``: waits until the jobs submitted so far are done (its mark; or the worker
        is gone); ``False`` if ``deadline`` (``time.monotonic()``), or the exit bound
        (:func:`bound_exit_drain`), came first. Wakes now and then to notice an exit bound set
        while it waits."""
        mark = self._submitted
        self._marks[mark] += 1
        try:
            while self._done < mark and self._thread is not None and self._thread.is_alive():
                limit = _limit(deadline)
                if limit is None:
                    self._cv.wait(_RECHECK_S)
                    continue
                left = limit - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, _RECHECK_S))
            return True
        finally:
            self._marks[mark] -= 1
            if self._marks[mark] <= 0:
                del self._marks[mark]

    def flush(self) -> None:
        """Waits until every job queued before the call has run; raises the first error since
        the last flush.

        Raises:
          TimeoutError: the process is ending after a SIGTERM whose bound
            (:func:`bound_exit_drain`) passed before the jobs were done.
        """
        with self._cv:
            if not self._wait_until_done():
                bound = _EXIT_BOUND
                assert bound is not None
                raise TimeoutError(
                    f"residual-store: {bound[1]}: {len(self._queue)} writes ({_size(self._pending_bytes)}) "
                    f"of {self._name()} were not done within the bound"
                )
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def close(self, wait: bool = True) -> None:
        """Runs what is queued, then stops the worker; with ``wait``, returns once it has
        stopped (never from the worker itself), or, as the process ends after a SIGTERM, once
        the bound is past (:func:`bound_exit_drain`). Without ``wait`` the worker still runs its
        queue first, and the exit drain (:func:`drain_all`) still waits for it."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if wait and thread is not None and threading.current_thread() is not thread:
            while thread.is_alive():
                limit = _limit(None)
                left = _RECHECK_S if limit is None else limit - time.monotonic()
                if left <= 0:
                    return
                thread.join(min(left, _RECHECK_S))

    def drain(self, deadline: float | None = None) -> tuple[list[BaseException], bool]:
        """Queues what its owner owes (``before_drain``; a closed writer's owner owes nothing:
        its close flushed), then waits until every job queued by then has run (at most until
        ``deadline``, a ``time.monotonic()`` time). Returns (and clears) the errors since the
        last flush instead of raising them, and whether those jobs are all done."""
        owed = self.before_drain() if self.before_drain is not None and not self._closed else None
        if owed is not None:
            try:
                owed()
            except Exception as err:  # noqa: BLE001 - reported with the writes' errors
                _release_frames(err)
                with self._cv:
                    self._errors.append(err)
        with self._cv:
            mark = self._submitted  # (the mark _wait_until_done takes: the lock is held)
            done = self._wait_until_done(deadline) and self._done >= mark
            errors, self._errors = self._errors, []
        return errors, done

    def _name(self) -> str:
        return f"store {self.label}" if self.label else "a store"


_EXITING = (
    "the interpreter is exiting (its main thread has ended): a store takes no new calls once its "
    "writes are drained at exit; join the threads that use a store before the main thread ends"
)

# How often a wait with no bound looks again whether a SIGTERM set one meanwhile.
_RECHECK_S = 0.5


def _limit(deadline: float | None) -> float | None:
    """The earlier of ``deadline`` and the exit bound, if any."""
    bound = _EXIT_BOUND
    if bound is None:
        return deadline
    return bound[0] if deadline is None else min(deadline, bound[0])


def bound_exit_drain(deadline: float, why: str) -> None:
    """The process is ending after a signal: the exit drain, and ``flush``/``close`` on the way
    out, wait for the writes only until ``deadline`` (``time.monotonic()``), then say what is
    left, naming ``why`` (a normal exit, without this, waits for every write). An earlier
    deadline set before stays."""
    global _EXIT_BOUND
    if _EXIT_BOUND is None or deadline < _EXIT_BOUND[0]:
        _EXIT_BOUND = (deadline, why)


def exit_limit() -> float | None:
    """The exit bound's deadline (``time.monotonic()``) once a ``SIGTERM`` set one, else ``None``."""
    return _limit(None)


def exit_drained() -> bool:
    """Whether the interpreter's exit drain is over (the process is finalizing)."""
    return _EXIT_DRAINED


def draining_at_exit() -> bool:
    """Whether the interpreter's exit drain is running (in this thread's wait, for a handler)."""
    return _AT_EXIT


def drain_within(deadline: float | None, why: str) -> bool:
    """Completes every live writer's queued writes, waiting until ``deadline`` at most
    (``time.monotonic()``; ``None``: as long as they take); a failed write is reported on
    stderr. Past the deadline, prints what is left (naming ``why``) and returns ``False``."""
    with _LIVE_LOCK:
        writers = list(_LIVE)
    unfinished = []
    for writer in writers:
        errors, done = writer.drain(deadline)
        for err in errors:
            _report(err, "at exit" if _AT_EXIT else f"after {why}")
        if not done:
            unfinished.append(writer)
    left = [(w, *w.backlog()) for w in unfinished]
    left = [(w, jobs, nbytes) for w, jobs, nbytes in left if jobs]
    if not left:
        return True
    bound = _EXIT_BOUND
    if bound is not None and (deadline is None or bound[0] <= deadline):
        why = bound[1]  # the exit bound cut this drain short
    jobs, nbytes = sum(j for _, j, _ in left), sum(b for _, _, b in left)
    where = "; ".join(f"{j} ({_size(b)}) in {w._name()}" for w, j, b in left)
    cause = "within the bound" if _limit(deadline) is not None else "(their writer thread is gone)"
    print(
        f"residual-store: {why}: {jobs} writes ({_size(nbytes)}) are not done {cause}: {where}; "
        "contexts put since the last flush may be lost",
        file=sys.stderr,
        flush=True,
    )
    return False


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def drain_all() -> None:
    """The exit drain: completes the queued writes of every live writer; a failed write is
    reported on stderr (at exit nobody is left to raise it to). After a SIGTERM that set a bound
    (:func:`bound_exit_drain`), before the drain or while it runs, waits only until then and
    prints what is left."""
    global _AT_EXIT, _EXIT_DRAINED
    _AT_EXIT = True
    try:
        # No store takes a call from here on; the calls in progress in threads still running
        # (daemon threads, or threads not joined) complete first, and their writes are drained.
        stop_all(_EXITING, exit_limit)
        drain_within(None, "exit")
    finally:
        _AT_EXIT = False
        _EXIT_DRAINED = True
        for hook in AFTER_EXIT_DRAIN:
            hook()


AFTER_EXIT_DRAIN: list[Callable[[], None]] = []  # run once the exit drain is over (flush_on_sigterm's)


def _report(err: BaseException, when: str) -> None:
    print(f"residual-store: a background write failed {when}: {type(err).__name__}: {err}", file=sys.stderr)
    if _AT_EXIT:
        fail_at_exit()  # the process's exit status says it too (exit_status.py)


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


@functools.cache
def request_pool() -> ThreadPoolExecutor:
    """The threads of an object store's requests (reads of a context's files, of many manifests),
    each waiting on its answer: this many go out at once (made on first use)."""
    return ThreadPoolExecutor(max_workers=16, thread_name_prefix="residual-store-request")


def janitor() -> ThreadPoolExecutor:
    """The one thread that removes replaced or deleted data, off the write path (one a store)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="residual-store-janitor")
