"""The copies to host memory in flight: the device bytes each holds until it has landed (the key
table's rule 7), and the errors of those that failed, until a caller that waits raises them.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from residual_store._src.store.critical import StoreLock

__all__ = ["Leaving"]


class Leaving:
    """The copies to host memory in flight (rule 7): each one's future and the device bytes it
    holds until it has landed, and the errors of those that failed, not yet raised. Changed under
    the key table's lock; ``count`` (copies in flight and failures to raise) is read without it
    by whoever waits."""

    def __init__(self, lock: StoreLock) -> None:
        self._lock = lock
        self._bytes: dict[Future[Any], int] = {}
        self._errors: list[BaseException] = []
        self.count = 0

    def add(self, landing: Sequence[tuple[Future[Any], int]]) -> None:
        """Under the lock: copies that started, and the device bytes each holds."""
        for future, nbytes in landing:
            self._bytes[future] = nbytes
        self.count = len(self._bytes) + len(self._errors)

    def nbytes(self) -> int:
        """Under the lock: the device bytes the copies in flight hold."""
        return sum(self._bytes.values())

    def landed(self, future: Future[Any]) -> None:
        """The copy ``future`` waited for has landed (or failed, kept to raise): its device bytes
        are free."""
        with self._lock:
            if self._bytes.pop(future, None) is not None and future.exception() is not None:
                self._errors.append(future.exception())  # type: ignore[arg-type]
            self.count = len(self._bytes) + len(self._errors)

    def take(self, *, take_errors: bool = True) -> tuple[list[Future[Any]], list[BaseException]]:
        """The copies in flight, and the errors of those that failed since the errors were last
        taken (``take_errors=False``: none, kept for the next)."""
        with self._lock:
            if not take_errors:
                return list(self._bytes), []
            errors, self._errors = self._errors, []
            self.count = len(self._bytes)
            return list(self._bytes), errors
