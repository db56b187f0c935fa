"""A store's persistence, chosen once when it opens: memory only, a disk read only, or a disk
written in the background.

``Store`` hands its persistence what differs by mode (writes, deletes, flushes, gc, which keys
the disk holds, the stored backwards) and never asks which one it has; what it reports of its
disk is the same in every mode, and it asks :mod:`~residual_store._src.store.inspection` for
that itself. One class per mode, as Orbax's ``path/deleter.py`` has a protocol and one
implementation per mode:

- :class:`MemoryOnlyPersistence`: no disk; a put that cannot fit the budgets is refused (its
  :class:`~residual_store._src.store.table.Keeping` says so to the key table).
- :class:`ReadOnlyPersistence`: a store on disk, read; changes nothing.
- :class:`WritablePersistence`: also writes puts and deletes in the background, on its writer
  thread, in call order, through its committer (see ``committer.py``); what a write leaves
  behind goes to its janitor, off the write path.

The per-key bookkeeping of writes (which version waits, which removal is in flight) is the
store's :class:`~residual_store._src.store.table.KeyTable`'s; the writer thread asks it through
its transitions and takes no lock of its own.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from residual_store._src.backward import register_loader, unregister_loader
from residual_store._src.context import OWN_KINDS, ResidualContext
from residual_store._src.errors import ReadOnlyStoreError
from residual_store._src.store import backwards, gc
from residual_store._src.store.committer import Committer
from residual_store._src.store.disk.layout import HostWrite
from residual_store._src.store.disk.paths import put_key
from residual_store._src.store.disk.protocol import StaleData
from residual_store._src.store.disk.tier import DiskTier
from residual_store._src.store.host import check_dtypes_writable
from residual_store._src.store.inspection import MEMORY_ONLY, Progress
from residual_store._src.store.owed import Keeping, Write
from residual_store._src.store.table import KeyTable
from residual_store._src.store.weights import LiveWeights
from residual_store._src.store.workers import Writer, janitor

__all__ = [
    "MemoryOnlyPersistence", "Persistence", "ReadOnlyPersistence", "WritablePersistence", "keeping_for",
    "persistence_for",
]


class Persistence(Protocol):
    """What differs between a store's modes (see the module docstring): how a put is prepared
    and its write queued, what a delete, a flush, gc and closing do, which keys the disk holds,
    and its stored backwards. What a store reports of its disk (``stats``, ``info``,
    ``arrays``, ``usage``, ``verify``, ``backward_info``) does not differ: the store asks
    :mod:`~residual_store._src.store.inspection` itself, of its disk (``None``: memory only)."""

    description: str
    keeping: Keeping  # what leaves memory: written, dropped, or refused
    backward_for: Callable[[str], Any]  # the stored backward of a signature, or None

    def prepare_put(self, ctx: ResidualContext, key: str | None) -> tuple[str, Any]: ...
    def schedule(self, writes: Sequence[Write] | None = None, staged: Any = None) -> None: ...
    def delete(self, key: str, version: int) -> None: ...
    def holds(self, key: str) -> bool: ...
    def keys(self) -> list[str]: ...
    def flush(self, keys: Sequence[str] = ()) -> list[bool]: ...
    def gc(self, older_than: float, *, dry_run: bool, progress: Progress | None) -> dict[str, int]: ...
    def check_writable(self, what: str) -> None: ...
    def close(self) -> None: ...
    def close_later(self) -> None: ...


class _WritesNothing:
    """What the two modes that write nothing share: no write is ever queued, a delete has
    nothing below memory to remove (a read-only store refused it before: ``check_writable``),
    a flush waits for nothing, and a collected store leaves no thread behind."""

    def schedule(self, writes: Sequence[Write] | None = None, staged: Any = None) -> None:
        assert not writes, "a store that writes nothing queues no write"

    def delete(self, key: str, version: int) -> None:
        return None

    def flush(self, keys: Sequence[str] = ()) -> list[bool]:
        return [False] * len(keys)

    def close_later(self) -> None:
        return None


class MemoryOnlyPersistence(_WritesNothing):
    """No disk: contexts live in the memory tiers only, and a put they cannot hold is refused."""

    description = MEMORY_ONLY
    keeping = Keeping(below_host=False)
    backward_for: Callable[[str], Any] = staticmethod(lambda signature: None)  # nothing stored

    def prepare_put(self, ctx: ResidualContext, key: str | None) -> tuple[str, Any]:
        return put_key(key), None

    def holds(self, key: str) -> bool:
        return False

    def keys(self) -> list[str]:
        return []

    def gc(self, older_than: float, *, dry_run: bool, progress: Progress | None) -> dict[str, int]:
        return gc.nothing_removed()

    def check_writable(self, what: str) -> None:
        return None

    def close(self) -> None:
        return None


class ReadOnlyPersistence(_WritesNothing):
    """A store on disk, read: its keys and the stored backwards; nothing changes."""

    keeping = Keeping(below_host=True)

    def __init__(self, disk: DiskTier) -> None:
        self.disk = disk
        self.description = disk.description
        # loads the stored backwards rs.backward asks for while the store is open (held weakly there)
        self._stored_backwards = backwards.StoredBackwardLoader(disk)
        register_loader(self._stored_backwards)
        # the stored backward of a signature, read and checked (deserialized on first use)
        self.backward_for: Callable[[str], Any] = self._stored_backwards.for_context

    def check_writable(self, what: str) -> None:
        raise ReadOnlyStoreError(
            f"{what}: the store at {self.description} was opened read_only=True; open it with "
            "read_only=False to change it"
        )

    def prepare_put(self, ctx: ResidualContext, key: str | None) -> tuple[str, Any]:
        self.check_writable("put")
        raise AssertionError("unreachable: check_writable raises")

    def holds(self, key: str) -> bool:
        return key in self.disk

    def keys(self) -> list[str]:
        return self.disk.keys()

    def gc(self, older_than: float, *, dry_run: bool, progress: Progress | None) -> dict[str, int]:
        return gc.collect(self.disk, older_than, dry_run=dry_run, progress=progress)

    def close(self) -> None:
        unregister_loader(self._stored_backwards)
        if self.disk.buffers is not None:
            self.disk.buffers.clear()


class WritablePersistence(ReadOnlyPersistence):
    """A store on disk, written in the background: each put's context (or, with
    ``write_through=False``, each one the budgets push out of host memory) is committed on the
    writer thread, in call order; deletes are queued behind the writes.

    Args:
      disk: the store's files. committer: how writes and deletes reach them (collectively in a
        job of several processes). table: the store's key table, made with
        :func:`keeping_for` (a write asks it whether its version is current, and tells it when
        it is done). weights: the weights the store holds, hashed once and not read back.
      durable: writes are synced before they count as done.
      max_pending_bytes: bytes of queued writes before a put waits.
    """

    def __init__(
        self,
        disk: DiskTier,
        committer: Committer,
        *,
        table: KeyTable,
        weights: LiveWeights,
        durable: bool,
        max_pending_bytes: int,
    ) -> None:
        super().__init__(disk)
        self._committer = committer
        self._table = table
        self._weights = weights
        self.keeping = table.keeping
        # the job holds the context only where a superseded write lands (collectively); else it
        # takes the pending one when it runs, which by then may be a host copy
        self._jobs_hold = committer.lands(superseded=True)
        self._durable = bool(durable)
        # A burst of durable puts shares one sync of the manifests' folder, before flush returns.
        self.writer = Writer(max_pending_bytes, on_idle=disk.sync_commits)
        # a drain (SIGTERM, exit) first queues the writes a put made but had not queued yet
        self.writer.before_drain = weakref.WeakMethod(self.schedule)
        self.janitor = janitor()  # removes replaced or deleted data off the write path
        # saves each signature's backward once, on the writer thread
        self._saver = backwards.BackwardSaver(disk, self.writer, durable=self._durable)

    def check_writable(self, what: str) -> None:
        return None

    def prepare_put(self, ctx: ResidualContext, key: str | None) -> tuple[str, Any]:
        """On the caller's thread: the key (checked; for ``None`` a fresh one where this job
        makes keys), the host copies of the context's weights (a donation after put returns
        cannot break the write), and its signature's backward queued for saving. Refuses a
        context with a residual no store writes (``float0``), before the store changes."""
        key = self._committer.key_for(key)
        check_dtypes_writable(ctx)
        self._saver.emit_warnings()  # of earlier saves, at this put's caller
        staged = self._committer.stage_shared(ctx) if self.keeping.writes_puts else None
        self._committer.save_backward(self._saver, ctx)
        return key, staged

    # -- scheduling (no lock held) ---------------------------------------------------------------

    def schedule(self, writes: Sequence[Write] | None = None, staged: Any = None) -> None:
        """Queues each of ``writes`` that nobody queued yet (``staged``: the first one's weights,
        see :meth:`prepare_put`); with ``None``, every write the table holds pending that nobody
        queued (a signal landed between a put's transition and its queueing), so that a drain
        writes what the table holds pending (rule 6)."""
        for write, future in self._table.claim_writes(writes, self.writer.future):
            held = write.ctx if self._jobs_hold else None
            first = staged if writes is not None and write is writes[0] else None
            job = functools.partial(self._write, write.key, held, write.version, first)
            self.writer.submit(job, write.ctx.nbytes, future)
            future.add_done_callback(functools.partial(self._table.write_settled, write.key))

    def delete(self, key: str, version: int) -> None:
        """Queues the removal of ``key`` from disk (the delete of ``version``), after any
        pending write of it."""
        self.writer.submit(functools.partial(self._delete_on_disk, key, version), 0)

    def flush(self, keys: Sequence[str] = ()) -> list[bool]:
        """Waits for every write queued when it was called (or those of ``keys``: whether each
        had one) and raises the first error since the last flush (of those keys' writes). A
        write the table holds pending and nobody queued (a put whose copy failed on the way) is
        queued first, as the exit drain would (rule 6): flush, close and the exit agree."""
        self.schedule()  # what no put queued
        try:
            if not keys:
                self.writer.flush()
                return []
            futures = self._table.newest_writes(keys)
            for future in futures:
                if future is not None:
                    future.result()  # its write's error, if it failed
            if any(f is not None for f in futures) and self._durable:
                self.disk.sync_commits()  # (else done once the writer runs out of work)
            return [f is not None for f in futures]
        finally:
            self._saver.emit_warnings()  # of background saves, at this flush's caller

    # -- on the writer thread --------------------------------------------------------------------

    def _write(self, key: str, ctx: ResidualContext | None, version: int, staged: Any = None) -> None:
        """Writes ``version`` of ``key``: ``ctx`` (held where a superseded write lands), or with
        ``None`` its pending context, none if a later put or delete superseded it (rule 4)."""
        committer = self._committer
        pending = self._table.write_starting(key, version)
        ctx = ctx if ctx is not None else pending
        if ctx is None:
            return  # superseded: a stale version never lands
        try:
            arrays, impls = committer.host_arrays(ctx, staged)
            sums, digests = self._weights.checksums(ctx, arrays)
            write = HostWrite(key, ctx.spec, arrays, tuple(impls), self._durable, sums, digests)
            nbytes = ctx.spec.own_nbytes + ctx.spec.host_nbytes
            # Only the host arrays from here on: the context's device arrays can go while the
            # commit runs (a slow, durable one most of all) once nothing else holds them.
            residuals = tuple(x if k not in OWN_KINDS else None for x, k in zip(ctx.residuals, ctx.spec.kinds))
            del ctx, pending
            stale = committer.write(write)
        except BaseException:
            self._table.write_done(key, version, None, failed=True)  # a put that failed is not in the store (flush raises why)
            raise
        self.drop_later(stale)
        self._weights.hold(residuals, write.impls, write.digests)
        self._table.write_done(key, version, nbytes)

    def _delete_on_disk(self, key: str, version: int) -> None:
        """After any pending write of ``key``: removes its manifest, also where the key was put
        again since (that put's write is queued after this removal: a failure of it then leaves
        nothing deleted behind, rule 5)."""
        try:
            self.drop_later(self._committer.delete(key)[1])
        finally:
            self._table.delete_done(key, version)

    def drop_later(self, stale: StaleData | None) -> None:
        """Hands data no manifest references any more to the janitor, off the write path. Where
        the janitor takes no more work (the store was dropped without ``close()``, its
        finalizer stopped it), the write that replaced the data is done all the same: the data
        is left for ``gc``, never reported as the write's failure."""
        if stale is None:
            return
        try:
            self.janitor.submit(functools.partial(self._committer.dispose, stale))
        except RuntimeError:  # "cannot schedule new futures after shutdown"
            pass

    def gc(self, older_than: float, *, dry_run: bool, progress: Progress | None) -> dict[str, int]:
        """Counts (or removes) after every write queued so far and every disposal of what they
        replaced: a folder the janitor is recycling would else be counted twice, or not at all."""
        self.flush()
        self.disposed()
        return super().gc(older_than, dry_run=dry_run, progress=progress)

    def disposed(self) -> None:
        """Waits until the janitor has disposed of what was handed to it so far (one thread: a
        job queued now runs after them)."""
        self.janitor.submit(_nothing).result()

    def close(self) -> None:
        try:
            self.writer.close()
            self.janitor.shutdown(wait=True)
        finally:
            super().close()

    def close_later(self) -> None:
        """A collected store's threads stop once their queued work is done; never waits (the
        collection may run on one of them, or on a thread holding a lock their work needs)."""
        self.writer.close(wait=False)
        self.janitor.shutdown(wait=False)


def keeping_for(disk: DiskTier | None, committer: Committer | None, write_through: bool) -> Keeping:
    """What a store with this ``disk`` (``None``: memory only) and ``committer`` (``None``: read
    only) does with what leaves memory: the key table's policy (see :class:`Keeping`)."""
    if disk is None:
        return MemoryOnlyPersistence.keeping
    if committer is None:
        return ReadOnlyPersistence.keeping
    writes_puts = committer.writes_through(bool(write_through))
    return Keeping(below_host=True, writes_puts=writes_puts, writes_spills=not writes_puts)


def persistence_for(disk: DiskTier | None, committer: Committer | None, **writing: Any) -> Persistence:
    """The persistence of a store, one per mode (see the module docstring): ``disk`` ``None``
    for memory only, ``committer`` ``None`` for a disk opened to read. ``writing``: the keyword
    arguments of :class:`WritablePersistence` (unused by the other two)."""
    if disk is None:
        return MemoryOnlyPersistence()
    if committer is None:
        return ReadOnlyPersistence(disk)
    return WritablePersistence(disk, committer, **writing)


def _nothing() -> None:
    """A janitor job that marks where the disposals queued before it end."""
