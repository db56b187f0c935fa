"""Chaining tensorstore futures: a future of what follows another, and of many at once.

The asynchronous writers and readers of :mod:`serializers.kv` return one
:class:`tensorstore.Future` for a whole operation (open, write, commit, clean up on failure),
so that a caller can start many and wait once. These helpers build such futures from
tensorstore's promises, without a thread of their own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import tensorstore as ts

__all__ = ["all_done", "raise_error", "then"]

def _settle(promise: Any, fn: Callable[..., Any], *args: Any) -> None:
    """Settles ``promise`` with ``fn(*args)``, following a returned future."""
    try:
        result = fn(*args)
    except BaseException as e:  # noqa: BLE001 - every outcome must reach the promise
        promise.set_exception(e)
        return
    if isinstance(result, ts.WriteFutures):
        result = result.commit
    if isinstance(result, ts.Future):
        result.add_done_callback(lambda f: _settle(promise, f.result))
    else:
        promise.set_result(result)


def then(
    future: Any,
    on_ok: Callable[[Any], Any],
    on_error: Callable[[BaseException], Any] | None = None,
) -> ts.Future:
    """A future of ``on_ok(result)`` (or ``on_error(exc)``); either may return a future."""
    promise: Any
    out: ts.Future
    promise, out = ts.Promise.new()

    def done(f: ts.Future) -> None:
        try:
            value = f.result()
        except BaseException as e:  # noqa: BLE001
            if on_error is None:
                promise.set_exception(e)
            else:
                _settle(promise, on_error, e)
            return
        _settle(promise, on_ok, value)

    future.add_done_callback(done)
    return out


def raise_error(e: BaseException) -> Any:
    """Raises ``e``: for a callback of :func:`then` that must fail (a lambda cannot raise)."""
    raise e


def all_done(futures: Sequence[ts.Future]) -> ts.Future:
    """A future done when all of ``futures`` are; it raises the first error among them."""
    promise: Any
    out: ts.Future
    promise, out = ts.Promise.new()
    if not futures:
        promise.set_result(None)
        return out
    remaining = [len(futures)]
    lock = threading.Lock()

    def done(_: ts.Future) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            for f in futures:
                try:
                    f.result()
                except BaseException as e:  # noqa: BLE001
                    promise.set_exception(e)
                    return
            promise.set_result(None)

    for f in futures:
        f.add_done_callback(done)
    return out
