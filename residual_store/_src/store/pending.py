"""A store's pending work: the contexts waiting for their disk write, the writes and deletes in
flight on the writer thread, and what a write leaves for the janitor.

Invariants (under the store's lock, which :class:`PendingWork` shares):

- ``pending[key]`` is the version of ``key`` to write next, with its token; a write whose token
  is no longer there was superseded (by a later put or a delete) and never lands, unless the
  committer writes every version (a multi-process job, where every process takes part).
- ``deleting[key]`` is the token of a delete queued here; a put of ``key`` drops it.
- A pending context that the device tier does not hold keeps host copies only
  (:meth:`PendingWork.release`), so the device budget bounds the device memory of the store's
  contexts, pending writes included.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from residual_store._src.context import OWN_KINDS, ResidualContext
from residual_store._src.store.budgets import Headroom
from residual_store._src.store.committer import Committer
from residual_store._src.store.disk import DiskTier
from residual_store._src.store.host import for_writing, holds_device_memory, host_arrays
from residual_store._src.store.layout import StaleData
from residual_store._src.store.tiers import Tiers, own_nbytes
from residual_store._src.store.weights import LiveWeights
from residual_store._src.store.workers import Loader, Writer

__all__ = ["PendingWork", "Write"]

Write = tuple[str, ResidualContext, object]
"""A write to schedule: the key, the context, and the token of that version (see ``pending``)."""


class PendingWork:
    """The bookkeeping of a store's background writes and deletes, and the writer thread's work.

    Args:
      lock: the store's lock (``pending``, ``deleting`` and ``on_disk`` are read under it there).
      tiers: the store's memory tiers (a failed put leaves them; spills come out of them).
      disk, committer, writer, janitor: how writes reach the disk (``None`` for a memory-only
        or read-only store: nothing is written).
      weights: the weights the store holds, hashed once and not read back.
      target: the device contexts are read back to (``None``: JAX's default).
      headroom: device memory to leave free, if any.
      write_through: every put is written, not only what the budgets push out of host memory.
      durable: writes are synced before they count as done.
    """

    def __init__(
        self,
        *,
        lock: threading.RLock,
        tiers: Tiers,
        disk: DiskTier | None,
        committer: Committer | None,
        writer: Writer | None,
        janitor: Loader,
        weights: LiveWeights,
        target: Any,
        headroom: Headroom | None,
        write_through: bool,
        durable: bool,
    ) -> None:
        self._lock = lock
        self._tiers = tiers
        self._disk = disk
        self._committer = committer
        self._writer = writer
        self._janitor = janitor
        self._weights = weights
        self._target = target
        self._headroom = headroom
        self._write_through = write_through
        self._durable = durable
        self.pending: dict[str, tuple[ResidualContext, object]] = {}
        self.deleting: dict[str, object] = {}  # keys deleted here whose disk removal is queued
        self.on_disk: set[str] = set()  # keys whose current version is committed
        self.io = {"reads": 0, "bytes_read": 0, "writes": 0, "bytes_written": 0}
        self._newest: dict[str, Future[Any]] = {}  # key -> its newest scheduled write, until done

    # -- under the lock ------------------------------------------------------------------------

    def mark(self, key: str, ctx: ResidualContext) -> Write:
        """Records that ``ctx`` is the version of ``key`` to write next."""
        token = object()
        self.pending[key] = (ctx, token)
        return key, ctx, token

    def rebalance(self, protect: str | None = None) -> list[Write]:
        """Moves least recently used contexts down until each tier is within budget.

        Returns contexts pushed out of host memory that still need a disk write, already marked
        pending (so no ``get`` finds them in no tier at all), for :meth:`schedule`.
        """
        device = self._tiers.device
        limit = self._headroom.device_limit(device.nbytes) if self._headroom is not None else None
        spills = [self.mark(k, ctx) for k, ctx in self._tiers.rebalance(protect, limit) if self._needs_write(k)]
        self.release()
        return spills

    def release(self) -> None:
        """A context waiting for its write that the device tier does not hold keeps host copies
        only (the host tier's, else :func:`for_writing`'s), so its device arrays go now."""
        for key, (ctx, token) in list(self.pending.items()):
            if key in self._tiers.device:
                continue  # the device tier holds this very context: no memory beyond its budget
            host = self._tiers.host.peek(key)
            if host is None and holds_device_memory(ctx):
                host = for_writing(ctx, self._target)
            if host is not None and host is not ctx:
                self.pending[key] = (host, token)

    def waiting(self) -> list[ResidualContext]:
        """The contexts waiting for their writes in no memory tier (host copies, see :meth:`release`)."""
        device, host = self._tiers.device, self._tiers.host
        return [c for k, (c, _) in self.pending.items() if k not in device and k not in host]

    def _needs_write(self, key: str) -> bool:
        return (
            self._writer is not None
            and not self._write_through
            and key not in self.on_disk
            and key not in self.pending
        )

    # -- scheduling ------------------------------------------------------------------------------

    def schedule(self, key: str, ctx: ResidualContext, token: object, staged: Any = None) -> None:
        """Queues the write of version ``token`` of ``key`` on the writer thread."""
        assert self._writer is not None
        assert self._committer is not None
        # The job holds the context only where every version is written (collectively); else it
        # takes the pending one when it runs, which by then may be a host copy (release()).
        held = ctx if self._committer.every_version else None
        future = self._writer.submit(functools.partial(self._write, key, held, token, staged), ctx.nbytes)
        with self._lock:  # the newest write of the key: what flush(key) waits for
            self._newest[key] = future
        future.add_done_callback(functools.partial(self._forget_write, key))

    def mark_deleting(self, key: str) -> object:
        """Under the lock: records that a delete of ``key`` is queued; its token."""
        token = object()
        self.deleting[key] = token
        return token

    def schedule_delete(self, key: str, token: object) -> None:
        """Queues the removal of ``key`` from disk (the delete ``token`` marked), after any
        pending write of it."""
        assert self._writer is not None
        self._writer.submit(functools.partial(self._delete_on_disk, key, token), 0)

    def newest(self, keys: Sequence[str]) -> list[Future[Any] | None]:
        """The newest write of each key not yet done (or failed), else ``None``."""
        with self._lock:
            return [self._newest.get(k) for k in keys]

    def _forget_write(self, key: str, future: Future[Any]) -> None:
        with self._lock:
            if self._newest.get(key) is future and future.exception() is None:
                del self._newest[key]

    # -- on the writer thread ----------------------------------------------------------------

    def _write(self, key: str, ctx: ResidualContext | None, token: object, staged: Any = None) -> None:
        """Writes the version ``token`` of ``key`` (``ctx``, or with ``None`` the pending context
        of that version), unless a later put (or delete) superseded it; a stale version never
        lands. In a multi-process job every process takes part in every collective write, in
        order. ``staged``: the host arrays of the context's weights its put took."""
        assert self._committer is not None
        with self._lock:
            pending, current = self.pending.get(key, (None, None))
            if current is not token and not self._committer.every_version:
                return
            if ctx is None:
                assert pending is not None
                ctx = pending
        try:
            try:
                arrays, impls = host_arrays(ctx, staged, partial=self._committer.partial_arrays)
                known = self._weights.checksums(ctx, arrays)
                spec, nbytes, residuals = ctx.spec, own_nbytes(ctx), ctx.residuals
                # Only the host arrays from here on: the context's device arrays can go while the
                # commit runs (a slow, durable one most of all) once nothing else holds them.
                residuals = tuple(x if k not in OWN_KINDS else None for x, k in zip(residuals, spec.kinds))
                del ctx, pending
                stale = self._committer.write(key, spec, arrays, impls, fsync=self._durable, known=known)
            except BaseException:
                with self._lock:  # a put that failed is not in the store (flush raises why)
                    if self.pending.get(key, (None, None))[1] is token:
                        self._tiers.forget(key)
                raise
            self.drop_later(stale)
            self._weights.hold(residuals, impls, known[1])
            with self._lock:
                self.io["writes"] += 1
                self.io["bytes_written"] += nbytes
                if self.pending.get(key, (None, None))[1] is token:
                    self.on_disk.add(key)
        finally:
            with self._lock:
                if self.pending.get(key, (None, None))[1] is token:
                    del self.pending[key]

    def _delete_on_disk(self, key: str, token: object) -> None:
        """After any pending write of ``key``: removes its manifest (with every process, in a
        multi-process job, even where it was put again since)."""
        assert self._committer is not None
        try:
            with self._lock:
                superseded = self.deleting.get(key) is not token  # put again since
            if self._committer.every_version or not superseded:
                self.drop_later(self._committer.delete(key)[1])
        finally:
            with self._lock:
                if self.deleting.get(key) is token:
                    del self.deleting[key]

    def drop_later(self, stale: StaleData | None) -> None:
        """Hands data no manifest references any more to the janitor, off the write path."""
        if stale is not None:
            assert self._disk is not None
            assert self._committer is not None
            self._janitor.submit(functools.partial(self._disk.drop_data, stale, recycle=self._committer.recycles))

