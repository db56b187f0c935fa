"""A store's persistence side, chosen once when it opens: memory only, a disk read only, or a
disk written in the background.

``Store`` asks its side questions (does the disk hold a key, is a put written now, what are the
disk's stats) and hands it work (writes, deletes, flushes); it never asks which side it has. The
three sides, as Orbax's ``path/deleter.py`` has a protocol and one implementation per mode:

- :class:`MemoryOnly`: no disk; a put that cannot fit the budgets is refused.
- :class:`ReadOnlyDisk`: reads and inspects a store on disk; changes nothing.
- :class:`WritableDisk`: also writes puts and deletes in the background, on its writer thread,
  in call order, through its committer (see ``committer.py``); what a write leaves behind goes to
  its janitor thread, off the write path.

The per-key bookkeeping of writes (which version waits, which removal is in flight) is the
store's :class:`~residual_store._src.store.ledger.KeyLedger`'s; the writer thread reads and
changes it under the store's lock, following its rules.
"""

from __future__ import annotations

import functools
from collections.abc import Container, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from residual_store._src.backward import register_loader, unregister_loader
from residual_store._src.context import OWN_KINDS, ResidualContext
from residual_store._src.errors import ContextNotFoundError, ReadOnlyStoreError
from residual_store._src.store import backwards, gc, inspection, item_record
from residual_store._src.store.committer import Committer
from residual_store._src.store.disk.layout import StaleData
from residual_store._src.store.disk.records import StoredContext
from residual_store._src.store.disk.tier import DiskTier
from residual_store._src.store.host import HostArrays, check_dtypes_writable
from residual_store._src.store.inspection import BackwardInfo, ContextInfo, Progress, StoreUsage, VerifyReport
from residual_store._src.store.key_rules import put_key
from residual_store._src.store.ledger import KeyLedger
from residual_store._src.store.tiers import Tiers, own_nbytes
from residual_store._src.store.weights import LiveWeights
from residual_store._src.store.workers import Loader, Writer

if TYPE_CHECKING:
    from residual_store._src.store.critical import StoreLock

__all__ = ["MemoryOnly", "Persistence", "ReadOnlyDisk", "Write", "WritableDisk", "open_side"]

Write = tuple[str, ResidualContext, int]
"""A write to schedule: the key, the context, and the version it is (see ``ledger.py``)."""

_IO = ("reads", "bytes_read", "writes", "bytes_written")


class Persistence(Protocol):
    """What a store asks of the place its contexts persist (see the module docstring)."""

    description: str
    persists: bool  # a disk lies below host memory (what leaves host memory is not lost)
    writes_spills: bool  # contexts pushed out of host memory are written (else dropped)

    def check_writable(self, what: str) -> None: ...
    def key_for(self, key: str | None) -> str: ...
    def check_capacity(self, tiers: Tiers, key: str, size: int) -> None: ...
    def prepare_put(self, ctx: ResidualContext) -> Any: ...
    def writes_put(self, in_memory: bool) -> bool: ...
    def schedule(self, writes: Sequence[Write], staged: Any = None) -> None: ...
    def delete(self, key: str, version: int) -> None: ...
    def holds(self, key: str) -> bool: ...
    def keys(self) -> list[str]: ...
    def read(self, key: str, *, place: bool = True, skip: Container[str] = ()) -> tuple[StoredContext, HostArrays]: ...
    def stat(self, key: str) -> StoredContext: ...
    def backward_for(self, signature: str) -> Any: ...
    def count_read(self, nbytes: int) -> None: ...
    def flush(self, keys: Sequence[str] = ()) -> list[bool]: ...
    def emit_warnings(self) -> None: ...
    def stats(self) -> dict[str, int]: ...
    def info(self, key: str) -> ContextInfo: ...
    def backward_info(self, signature: str) -> BackwardInfo: ...
    def usage(self, progress: Progress | None) -> StoreUsage: ...
    def verify(self, keys: Sequence[str], *, every_backward: bool, progress: Progress | None) -> VerifyReport: ...
    def gc(self, older_than: float, *, dry_run: bool, progress: Progress | None) -> dict[str, int]: ...
    def close(self) -> None: ...
    def close_later(self) -> None: ...


def _not_found(key: str, where: str) -> ContextNotFoundError:
    return ContextNotFoundError(f"no context {key!r} in store {where}")


class _WritesNothing:
    """What the sides that never write share: nothing is staged, scheduled or left to flush."""

    def key_for(self, key: str | None) -> str:
        return put_key(key)

    def prepare_put(self, ctx: ResidualContext) -> Any:
        return None

    def writes_put(self, in_memory: bool) -> bool:
        return False

    def schedule(self, writes: Sequence[Write], staged: Any = None) -> None:
        assert not writes, "this store writes nothing"  # spills only where writes_spills

    def flush(self, keys: Sequence[str] = ()) -> list[bool]:
        return [False] * len(keys)

    def emit_warnings(self) -> None:
        return None

    def close_later(self) -> None:
        return None


class MemoryOnly(_WritesNothing):
    """No disk: contexts live in the memory tiers only, and a put they cannot hold is refused."""

    description = "memory only"
    persists = False
    writes_spills = False

    def __init__(self, ledger: KeyLedger, lock: StoreLock) -> None:
        self._ledger, self._lock = ledger, lock

    def check_writable(self, what: str) -> None:
        return None

    def check_capacity(self, tiers: Tiers, key: str, size: int) -> None:
        tiers.check_capacity(key, size)  # nothing below host memory to push a context to

    def delete(self, key: str, version: int) -> None:
        with self._lock:
            self._ledger.delete_done(key, version)  # nothing to remove below memory

    def holds(self, key: str) -> bool:
        return False

    def keys(self) -> list[str]:
        return []

    def read(self, key: str, *, place: bool = True, skip: Container[str] = ()) -> tuple[StoredContext, HostArrays]:
        raise ContextNotFoundError(f"no context {key!r} in this memory-only store")

    def stat(self, key: str) -> StoredContext:
        raise _not_found(key, self.description)

    def backward_for(self, signature: str) -> Any:
        return None

    def count_read(self, nbytes: int) -> None:
        return None

    def stats(self) -> dict[str, int]:
        return {**inspection.disk_bytes(None), **dict.fromkeys(_IO, 0)}

    def info(self, key: str) -> ContextInfo:
        raise _not_found(key, self.description)

    def backward_info(self, signature: str) -> BackwardInfo:
        return inspection.backward_info(None, signature)

    def usage(self, progress: Progress | None) -> StoreUsage:
        return StoreUsage(0, dict.fromkeys(inspection.USAGE_PARTS, 0), 0, {})

    def verify(self, keys: Sequence[str], *, every_backward: bool, progress: Progress | None) -> VerifyReport:
        return VerifyReport(verified=0)

    def gc(self, older_than: float, *, dry_run: bool, progress: Progress | None) -> dict[str, int]:
        return gc.nothing_removed()

    def close(self) -> None:
        return None



class ReadOnlyDisk(_WritesNothing):
    """A store on disk, read: contexts, their stored backwards, inspection; nothing changes."""

    persists = True
    writes_spills = False

    def __init__(self, disk: DiskTier, ledger: KeyLedger, lock: StoreLock) -> None:
        self.disk = disk
        self.description = disk.description
        self._ledger, self._lock = ledger, lock
        self._io = dict.fromkeys(_IO, 0)
        # loads the stored backwards rs.backward asks for while the store is open (held weakly there)
        self._stored_backwards = backwards.StoredBackwardLoader(disk)
        register_loader(self._stored_backwards)

    def check_writable(self, what: str) -> None:
        raise ReadOnlyStoreError(
            f"{what}: the store at {self.description} was opened read_only=True; open it with "
            "read_only=False to change it"
        )

    def check_capacity(self, tiers: Tiers, key: str, size: int) -> None:
        return None

    def delete(self, key: str, version: int) -> None:
        raise AssertionError("a read-only store deletes nothing")  # check_writable refused it

    def holds(self, key: str) -> bool:
        return key in self.disk

    def keys(self) -> list[str]:
        return self.disk.keys()

    def read(self, key: str, *, place: bool = True, skip: Container[str] = ()) -> tuple[StoredContext, HostArrays]:
        return self.disk.read(key, place=place, skip=skip)

    def stat(self, key: str) -> StoredContext:
        return self.disk.stat(key)

    def backward_for(self, signature: str) -> Any:
        """The stored backward of ``signature``, read and checked (deserialized on first use)."""
        return self._stored_backwards.for_context(signature)

    def count_read(self, nbytes: int) -> None:
        with self._lock:
            self._io["reads"] += 1
            self._io["bytes_read"] += nbytes

    def stats(self) -> dict[str, int]:
        with self._lock:
            io = dict(self._io)
            leaving = self._ledger.deleted_keys()  # deleted or popped: gone for every caller
        return {**inspection.disk_bytes(self.disk, leaving=leaving), **io}

    def info(self, key: str) -> ContextInfo:
        return inspection.stored_info(self.disk, key)

    def backward_info(self, signature: str) -> BackwardInfo:
        return inspection.backward_info(self.disk, signature)

    def usage(self, progress: Progress | None) -> StoreUsage:
        return inspection.measure(self.disk, progress)

    def verify(self, keys: Sequence[str], *, every_backward: bool, progress: Progress | None) -> VerifyReport:
        report = inspection.verify(self.disk, keys, every_backward=every_backward, progress=progress)
        # a sealed store (an Orbax step's item) holds what its record lists (every_backward: a
        # verify of every key, which also finds the keys it lost)
        return item_record.checked_report(self.disk, report, keys, whole=every_backward)

    def gc(self, older_than: float, *, dry_run: bool, progress: Progress | None) -> dict[str, int]:
        return gc.collect(self.disk, older_than, dry_run=dry_run, progress=progress)

    def close(self) -> None:
        unregister_loader(self._stored_backwards)
        if self.disk.buffers is not None:
            self.disk.buffers.clear()



class WritableDisk(ReadOnlyDisk):
    """A store on disk, written in the background: each put's context (or, with
    ``write_through=False``, each one the budgets push out of host memory) is committed on the
    writer thread, in call order; deletes are queued behind the writes.

    Args:
      disk: the store's files. committer: how writes and deletes reach them (collectively in a
        job of several processes). ledger, lock, tiers: the store's (a failed write leaves the
        tiers). weights: the weights the store holds, hashed once and not read back.
      write_through: every put is written, not only what the budgets push out of host memory.
      durable: writes are synced before they count as done.
      max_pending_bytes: bytes of queued writes before a put waits.
    """

    def __init__(
        self,
        disk: DiskTier,
        committer: Committer,
        *,
        ledger: KeyLedger,
        lock: StoreLock,
        tiers: Tiers,
        weights: LiveWeights,
        write_through: bool,
        durable: bool,
        max_pending_bytes: int,
    ) -> None:
        super().__init__(disk, ledger, lock)
        self._committer = committer
        self._tiers = tiers
        self._weights = weights
        self.write_through = committer.writes_through(bool(write_through))
        self.writes_spills = not self.write_through
        self._durable = bool(durable)
        # A burst of durable puts shares one sync of the manifests' folder, before flush returns.
        self.writer = Writer(max_pending_bytes, on_idle=disk.sync_commits)
        self.janitor = Loader(workers=1)  # removes replaced or deleted data off the write path
        # saves each signature's backward once, on the writer thread
        self._saver = backwards.BackwardSaver(disk, self.writer, durable=self._durable)
        self._newest: dict[str, Future[Any]] = {}  # key -> its newest scheduled write, until done

    def check_writable(self, what: str) -> None:
        return None

    def key_for(self, key: str | None) -> str:
        return self._committer.key_for(key)

    def prepare_put(self, ctx: ResidualContext) -> Any:
        """On the caller's thread: the host copies of the context's weights (a donation after
        put returns cannot break the write), and its signature's backward queued for saving.
        Refuses a context with a residual no store writes (``float0``), before the store changes."""
        check_dtypes_writable(ctx)
        self._saver.emit_warnings()  # of earlier saves, at this put's caller
        staged = self._committer.stage_shared(ctx) if self.write_through else None
        self._committer.save_backward(self._saver, ctx)
        return staged

    def writes_put(self, in_memory: bool) -> bool:
        return self.write_through or not in_memory

    # -- scheduling (no lock held) ---------------------------------------------------------------

    def schedule(self, writes: Sequence[Write], staged: Any = None) -> None:
        """Queues each write (``staged``: the first one's weights, see :meth:`prepare_put`)."""
        for i, (key, ctx, version) in enumerate(writes):
            # The job holds the context only where a superseded write lands (collectively); else
            # it takes the pending one when it runs, which by then may be a host copy.
            held = ctx if self._committer.lands(superseded=True) else None
            job = functools.partial(self._write, key, held, version, staged if i == 0 else None)
            future = self.writer.submit(job, ctx.nbytes)
            with self._lock:  # the newest write of the key: what flush(key) waits for
                self._newest[key] = future
            future.add_done_callback(functools.partial(self._forget_write, key))

    def delete(self, key: str, version: int) -> None:
        """Queues the removal of ``key`` from disk (the delete of ``version``), after any
        pending write of it."""
        self.writer.submit(functools.partial(self._delete_on_disk, key, version), 0)

    def _forget_write(self, key: str, future: Future[Any]) -> None:
        with self._lock:
            if self._newest.get(key) is future and future.exception() is None:
                del self._newest[key]

    def flush(self, keys: Sequence[str] = ()) -> list[bool]:
        """Waits for every queued write (or those of ``keys``: whether each had one) and raises
        the first error since the last flush (of those keys' writes)."""
        try:
            if not keys:
                self.writer.flush()
                return []
            with self._lock:
                futures = [self._newest.get(k) for k in keys]
            for future in futures:
                if future is not None:
                    future.result()  # its write's error, if it failed
            if any(f is not None for f in futures) and self._durable:
                self.disk.sync_commits()  # (else done once the writer runs out of work)
            return [f is not None for f in futures]
        finally:
            self._saver.emit_warnings()  # of background saves, at this flush's caller

    def emit_warnings(self) -> None:
        self._saver.emit_warnings()

    # -- on the writer thread --------------------------------------------------------------------

    def _write(self, key: str, ctx: ResidualContext | None, version: int, staged: Any = None) -> None:
        """Writes ``version`` of ``key``: ``ctx`` (held where a superseded write lands), or with
        ``None`` its pending context, none if a later put or delete superseded it (see
        ``ledger.py``, rule 4)."""
        committer = self._committer
        with self._lock:
            pending = self._ledger.write_starting(key, version)
        ctx = ctx if ctx is not None else pending
        if ctx is None:
            return  # superseded: a stale version never lands
        committed = False
        try:
            try:
                arrays, impls = committer.host_arrays(ctx, staged)
                known = self._weights.checksums(ctx, arrays)
                spec, nbytes, residuals = ctx.spec, own_nbytes(ctx), ctx.residuals
                # Only the host arrays from here on: the context's device arrays can go while the
                # commit runs (a slow, durable one most of all) once nothing else holds them.
                residuals = tuple(x if k not in OWN_KINDS else None for x, k in zip(residuals, spec.kinds))
                del ctx, pending
                stale = committer.write(key, spec, arrays, impls, fsync=self._durable, known=known)
            except BaseException:
                with self._lock:  # a put that failed is not in the store (flush raises why)
                    if self._ledger.write_starting(key, version) is not None:
                        self._tiers.forget(key)
                raise
            committed = True
            self.drop_later(stale)
            self._weights.hold(residuals, impls, known[1])
            with self._lock:
                self._io["writes"] += 1
                self._io["bytes_written"] += nbytes
        finally:
            with self._lock:
                self._ledger.write_done(key, version, committed)

    def _delete_on_disk(self, key: str, version: int) -> None:
        """After any pending write of ``key``: removes its manifest (with every process, in a
        multi-process job, even where it was put again since)."""
        try:
            with self._lock:
                current = self._ledger.is_current(key, version)
            if self._committer.lands(superseded=not current):
                self.drop_later(self._committer.delete(key)[1])
        finally:
            with self._lock:
                self._ledger.delete_done(key, version)

    def drop_later(self, stale: StaleData | None) -> None:
        """Hands data no manifest references any more to the janitor, off the write path."""
        if stale is not None:
            self.janitor.submit(functools.partial(self._committer.dispose, stale))

    def gc(self, older_than: float, *, dry_run: bool, progress: Progress | None) -> dict[str, int]:
        self.flush()
        return super().gc(older_than, dry_run=dry_run, progress=progress)

    def close(self) -> None:
        try:
            self.writer.close()
            self.janitor.close()
        finally:
            super().close()

    def close_later(self) -> None:
        """A collected store's threads stop once their queued work is done; never waits (the
        collection may run on one of them, or on a thread holding a lock their work needs)."""
        self.writer.close(wait=False)
        self.janitor.close(wait=False)


def open_side(
    disk: DiskTier | None, committer: Committer | None, *, ledger: KeyLedger, lock: StoreLock, **writing: Any
) -> Persistence:
    """The persistence side of a store, one per mode (see the module docstring): ``disk``
    ``None`` for memory only, ``committer`` ``None`` for a disk opened to read. ``writing``:
    the keyword arguments of ``WritableDisk`` (unused by the other two)."""
    if disk is None:
        return MemoryOnly(ledger, lock)
    if committer is None:
        return ReadOnlyDisk(disk, ledger, lock)
    return WritableDisk(disk, committer, ledger=ledger, lock=lock, **writing)
