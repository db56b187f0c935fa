"""Background writes with backpressure, and background loads.

``Writer.submit`` returns at once unless the bytes already queued exceed ``max_pending_bytes``,
in which case it waits for the worker to catch up: memory held by pending writes stays bounded.
One worker thread keeps writes in submission order, so the last ``put`` of a key is the one
that lands.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["Writer", "Loader"]


class Writer:
    """A single background worker running write jobs in order under a byte bound."""

    def __init__(self, max_pending_bytes: int) -> None:
        self._max = max_pending_bytes
        self._cv = threading.Condition()
        self._queue: deque[tuple[Callable[[], Any], int, Future[Any]]] = deque()
        self._pending_bytes = 0
        self._errors: list[BaseException] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="residual-store-writer", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], Any], nbytes: int) -> Future[Any]:
        """Queues ``job``; waits while more than ``max_pending_bytes`` are queued (backpressure)."""
        future: Future[Any] = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the store is closed")
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
                    return
                job, nbytes, future = self._queue[0]
            try:
                future.set_result(job())
            except BaseException as err:  # noqa: BLE001 - reported through flush()
                future.set_exception(err)
                with self._cv:
                    self._errors.append(err)
            with self._cv:
                self._queue.popleft()
                self._pending_bytes -= nbytes
                self._cv.notify_all()

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def flush(self) -> None:
        """Waits until every queued job has run; raises the first error since the last flush."""
        with self._cv:
            while self._queue:
                self._cv.wait()
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()


class Loader:
    """A small thread pool for prefetches; one future per key in flight."""

    def __init__(self, workers: int = 2) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="residual-store-loader")

    def submit(self, job: Callable[[], Any]) -> Future[Any]:
        return self._pool.submit(job)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
