"""One key, one entry, one owner of the lock: the store's key table.

A store's contexts move between threads (callers of ``put``/``get``/``delete``, the writer, the
loaders) and between places (the device and host tiers, a pending write's host copy, the disk).
Every fact about a key that more than one thread reads lives in its :class:`Entry` here: its
version, the context in memory and its tier, the version waiting for its disk write, the load in
flight, the removal in flight, whether the disk holds it, the reads in flight. The
:class:`KeyTable` owns the store's one lock; each transition a key goes through is one method
that takes the lock once, never copies, reads, writes or waits, and returns what its caller
does outside the lock (the copies owed, the writes to queue).

The rules (``tests/test_table.py`` checks them one transition at a time; the race, signal and
kill suites end to end):

1. **The lock guards bookkeeping only.** It is held to read or change entries and the tiers'
   sizes, never while an array is copied, transferred, read or written, nor while anything is
   waited for. So a signal handler that waits for the writer never waits on a lock the code it
   interrupted holds for long (it is deferred to the lock's release, see ``critical.py``). This
   module imports no disk, host-copy or worker module (a house test checks).
2. **A version per key.** Every ``put`` and every ``delete`` of a key gives it a new version, a
   number from one counter of the table that only grows; a version noted earlier is current only
   if nothing happened to the key since.
3. **Readers install only what is current.** A read notes the key's version, and takes the
   context in memory it will copy (or learns that it reads the disk), in one step. When it is
   done it may install what it got into the device tier, or note that the disk holds the
   version, only if that version is still current; otherwise it returns what it got to its own
   caller (whose call overlapped the put or delete) and caches nothing.
4. **Writes land only if current.** A background write carries the version it writes; it is
   skipped if a later put or delete took the key before its turn (unless the committer lands
   superseded writes: a multi-process job), and only a write of the current version marks the
   key as on disk.
5. **A delete hides the key at once, and its removal always lands.** From the moment ``delete``
   returns the key is in no tier, no pending write, no load, and every lookup treats it as
   absent until a later put. Its disk removal runs even when a put of the key came meanwhile
   (the removal is queued before that put's write): a failed write of the later put can never
   leave the deleted version on disk.
6. **A pending write is queued exactly once, by whoever claims it first.** The put that made it
   claims it right after its transition (:meth:`KeyTable.claim_writes`); a drain that finds a
   write no one has claimed yet (a signal landed in between) claims and queues it itself
   (:meth:`KeyTable.claim_writes` of ``None``). So a put whose transition
   is done is never lost by a drain that ran before it queued its write; ``flush`` does the same
   (a put whose copy failed on the way), and a put is a critical section from its transition to
   its queueing, so a signal handler's drain never runs between the two (``critical.py``).

7. **Device bytes count until they have left.** A context copied to host memory (pushed out of
   the device tier, or a pending write's copy) holds its device memory until the copy has
   landed: the table counts those bytes (:class:`~residual_store._src.store.leaving.Leaving`) from :meth:`KeyTable.settle` until
   :meth:`~residual_store._src.store.leaving.Leaving.landed`, and a put returns only once they have landed (a read waits for them
   before it adds more), so the device holds at most the device budget of the tier's contexts
   when a put returns. A copy that fails puts the context it copied back where it was, intact
   on the device. (What a get or pop hands out counts too, outside the table: ``lent.py``;
   :meth:`KeyTable.device_held` is the table's part.)

Together: after ``put`` or ``delete`` of a key returns, no call of this store returns an older
version of that key, and no read that overlapped them leaves an older version behind.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

from residual_store._src.context import ResidualContext, own_nbytes
from residual_store._src.errors import ContextNotFoundError
from residual_store._src.store.critical import StoreLock
from residual_store._src.store.entry import Entry, Place
from residual_store._src.store.leaving import Leaving
from residual_store._src.store.owed import NOTHING, Found, Keeping, Moves, Owed, Write
from residual_store._src.store.schedule import Schedule
from residual_store._src.store.tiers import MemoryTier, check_capacity, spills, would_overflow

__all__ = ["KeyTable"]

DEVICE, HOST = Place.DEVICE, Place.HOST


class KeyTable:
    """The store's keys, their entries, the memory tiers' sizes and the declared get order, under
    the store's one lock (see the module docstring).

    Args:
      device_budget, host_budget: bytes of own residuals each memory tier may hold (``None``:
        unbounded).
      keeping: what leaves memory (see :class:`Keeping`).
      device_limit: given the device tier's bytes, a tighter bound for now (the device's
        headroom), or ``None``; asked when the tiers rebalance.
      where: the store, as its messages name it.
    """

    def __init__(
        self,
        device_budget: int | None,
        host_budget: int | None,
        keeping: Keeping,
        device_limit: Callable[[int], int | None] | None = None,
        where: str = "",
    ) -> None:
        self.lock = StoreLock()
        self.where = where
        self.device = MemoryTier("device", device_budget)
        self.host = MemoryTier("host", host_budget)
        self.schedule = Schedule()
        self.scheduled = False  # a schedule is declared (asked without calling into it)
        self.keeping = keeping
        self._device_limit = device_limit
        self._counter = itertools.count(1)
        self._entries: dict[str, Entry] = {}
        self._owed: list[tuple[str, ResidualContext]] = []  # demoted since the last Moves
        self._unsettled: set[str] = set()  # pending contexts in no tier, not yet copied for writing
        self.leaving = Leaving(self.lock)  # the copies to host memory in flight (rule 7)
        self.io = dict.fromkeys(("reads", "bytes_read", "writes", "bytes_written", "pending_reads"), 0)

    # -- entries -------------------------------------------------------------------------------

    def _live(self, key: str) -> Entry | None:
        """The entry of ``key`` (``None``: nothing happened to it here); raises for a key being
        deleted (rule 5)."""
        entry = self._entries.get(key)
        if entry is not None and entry.deleted:
            raise ContextNotFoundError.of(key, self.where, deleted="now")
        return entry

    def _drop_if_idle(self, key: str, entry: Entry) -> None:
        if entry.idle() and self._entries.get(key) is entry:
            del self._entries[key]

    def _forget_memory(self, key: str, entry: Entry) -> None:
        """The key's context leaves its tier and its pending write and load are superseded."""
        if entry.place is not None:
            (self.device if entry.place == DEVICE else self.host).remove(key)
        entry.ctx = entry.place = None
        entry.pending = None
        entry.claimed = False
        entry.load = None
        self._unsettled.discard(key)

    def _place(self, key: str, entry: Entry, ctx: ResidualContext, place: Place, *, moved: bool = False) -> None:
        if entry.place is not None:
            (self.device if entry.place == DEVICE else self.host).remove(key, moved=moved)
        (self.device if place == DEVICE else self.host).add(key, own_nbytes(ctx))
        entry.ctx, entry.place = ctx, place
        self._unsettled.discard(key)
        if place == HOST:
            self._owed.append((key, ctx))  # entered host memory as it was: a copy is owed

    # -- put and delete ------------------------------------------------------------------------

    def put(self, key: str, ctx: ResidualContext) -> Moves:
        """A put of ``ctx`` under ``key``: a new version, in the highest tier its size fits; the
        older version's pending write, load and copies are superseded (rule 2); the tiers
        rebalanced. The put's own write (where the store writes puts, or where no tier holds it)
        is the returned ``own`` write.

        Raises:
          StoreFullError: a store with nothing below host memory whose budgets cannot take
            ``ctx`` (nothing changed).
        """
        size = own_nbytes(ctx)
        with self.lock:
            if not self.keeping.below_host:
                check_capacity(self.device, self.host, self.schedule, key, size)
            entry = self._entries.setdefault(key, Entry())
            self._forget_memory(key, entry)
            entry.on_disk = False
            version = entry.version = next(self._counter)
            if self.device.fits(size):
                self._place(key, entry, ctx, DEVICE)
            elif self.host.fits(size):
                self._place(key, entry, ctx, HOST)
            own = None
            if self.keeping.writes_puts or entry.ctx is None:
                own = self._mark_pending(key, entry, ctx, version)
            protect = key if not self.scheduled or self.schedule.next_use(key) is None else None
            return self._moves(protect, own)

    def delete(self, key: str, *, stored: bool = False) -> int | None:
        """A delete of ``key`` held in memory (or loading): a new version, every copy in flight
        superseded, the key absent from now on (rule 5). Returns the version its disk removal
        carries, or ``None`` if this store does not hold the key in memory: the caller asks the
        disk, outside the lock, and calls again with ``stored=True`` if it has it (the key is
        then deleted whatever memory holds).

        Raises:
          ContextNotFoundError: the key is being deleted already.
        """
        with self.lock:
            entry = self._entries.get(key)
            if stored:
                return self._delete(key, self._entries.setdefault(key, Entry()))
            if entry is not None and entry.deleted:
                raise ContextNotFoundError.of(key, self.where, deleted="already")
            if entry is None or not (entry.in_memory or entry.load is not None):
                return None
            return self._delete(key, entry)

    def _delete(self, key: str, entry: Entry) -> int:
        self._forget_memory(key, entry)
        entry.on_disk = False
        version = entry.version = next(self._counter)
        if self.keeping.below_host:
            entry.removing = version  # absent until its removal is done
        else:
            self._drop_if_idle(key, entry)  # nothing below memory to remove
        return version

    def delete_done(self, key: str, version: int) -> None:
        """The disk removal of ``version`` is done (or failed, and was reported)."""
        with self.lock:
            entry = self._entries.get(key)
            if entry is not None and entry.removing == version:
                entry.removing = None
                self._drop_if_idle(key, entry)

    # -- writes (the writer thread and whoever queues) ------------------------------------------

    def _mark_pending(self, key: str, entry: Entry, ctx: ResidualContext, version: int) -> Write:
        entry.pending, entry.claimed = ctx, False
        if entry.ctx is None:
            self._unsettled.add(key)
        return Write(key, ctx, version)

    def claim_writes(
        self, writes: Iterable[Write] | None, future: Callable[[], Future[Any]]
    ) -> list[tuple[Write, Future[Any]]]:
        """The writes among ``writes`` that nobody has queued yet (rule 6), now claimed by the
        caller, which queues each with the future made for it by ``future`` (from now on the
        newest write of its key: what ``flush(key)`` waits for). ``writes=None``: every pending
        write nobody has queued yet (a drain claims and queues them)."""
        claimed = []
        with self.lock:
            if writes is None:
                writes = [Write(k, e.pending, e.version) for k, e in self._entries.items() if e.pending is not None]
            for write in writes:
                entry = self._entries.get(write.key)
                if entry is not None and entry.version == write.version and entry.pending is not None \
                        and not entry.claimed:
                    entry.claimed = True
                    entry.write = future()
                    claimed.append((write, entry.write))
        return claimed

    def write_settled(self, key: str, future: Future[Any]) -> None:
        """The write ``future`` is over: ``flush(key)`` need not wait for it (a failed one is
        kept, for ``flush(key)`` to raise)."""
        with self.lock:
            entry = self._entries.get(key)
            if entry is not None and entry.write is future and future.exception() is None:
                entry.write = None
                self._drop_if_idle(key, entry)

    def newest_writes(self, keys: Sequence[str]) -> list[Future[Any] | None]:
        with self.lock:
            return [None if (e := self._entries.get(k)) is None else e.write for k in keys]

    def write_starting(self, key: str, version: int) -> ResidualContext | None:
        """The pending context of ``version`` for its write, or ``None`` if a later put or
        delete superseded it (rule 4)."""
        with self.lock:
            entry = self._entries.get(key)
            if entry is None or entry.version != version:
                return None
            return entry.pending

    def write_done(self, key: str, version: int, nbytes: int | None, *, failed: bool = False) -> None:
        """The write of ``version`` is over: committed (``nbytes`` of own residuals written), or
        skipped (``None``); ``failed``: it raised, and a put that failed is not in the store
        (``flush`` raises why; what the disk held before stays the disk's)."""
        with self.lock:
            if failed:
                entry = self._entries.get(key)
                if entry is not None and entry.version == version:
                    self._forget_memory(key, entry)
                    self._drop_if_idle(key, entry)
                return
            if nbytes is not None:
                self.io["writes"] += 1
                self.io["bytes_written"] += nbytes
            entry = self._entries.get(key)
            if entry is None or entry.version != version or entry.pending is None:
                return
            entry.pending, entry.claimed = None, False
            self._unsettled.discard(key)
            if nbytes is not None:
                entry.on_disk = True
            self._drop_if_idle(key, entry)

    # -- reads -----------------------------------------------------------------------------------

    def begin_get(self, key: str, *, taking: bool = False, ahead: bool = False) -> Found:
        """A get of ``key`` starts: the load in flight (if it loads the current version), the
        device tier's context, or a read noted (rule 3) with what it copies; the schedule's next
        use of ``key`` consumed. ``taking``: a pop's, whose read never enters the device tier
        (it would push out a context the store keeps, for one that leaves it). ``ahead``: a load
        ahead of need starts instead (nothing consumed, no load taken; what it brings enters the
        device tier only where it has room, see :class:`Found`).

        Raises:
          ContextNotFoundError: the key is being deleted (rule 5).
        """
        with self.lock:
            entry = self._live(key)
            if self.scheduled and not ahead:
                self.schedule.consume(key)
                self.scheduled = bool(self.schedule)
            if entry is not None:
                if not ahead:
                    load, entry.load = entry.load, None
                    if load is not None and entry.load_version == entry.version:
                        return Found(entry.version, load=load)
                if entry.place == DEVICE:
                    if not ahead:
                        self.device.touch(key)
                    return Found(entry.version, entry.ctx, on_device=True)
            return self._begin_read(key, entry, ahead=ahead, taking=taking)

    def _begin_read(self, key: str, entry: Entry | None, *, ahead: bool = False, taking: bool = False) -> Found:
        if entry is None:
            if not self.keeping.below_host:
                raise ContextNotFoundError.of(key, self.where)
            entry = self._entries.setdefault(key, Entry())
        source = entry.ctx if entry.place == HOST else entry.pending
        if source is None and not self.keeping.below_host:
            self._drop_if_idle(key, entry)
            raise ContextNotFoundError.of(key, self.where)
        entry.readers += 1
        if source is None:
            return Found(entry.version, stays=taking, ahead=ahead)
        if entry.place == HOST:
            self.host.touch(key)
        else:
            self.io["pending_reads"] += 1
        size = own_nbytes(source)
        # a store with nothing below host memory: a promotion must not push a context out of it
        stays = taking or not self.device.fits(size) or (
            not self.keeping.below_host and entry.place == HOST
            and would_overflow(self.device, self.host, self.schedule, key, size)
        )
        return Found(entry.version, source, stays=stays, ahead=ahead)

    def finish_read(self, key: str, found: Found, ctx: ResidualContext | None, *, nbytes_read: int | None = None) -> Moves:
        """A read of ``found`` is done with ``ctx`` on the device (copied from ``found.ctx``, or
        read from disk, ``nbytes_read`` bytes): installed in the device tier if its version is
        still current and nothing else came meanwhile (rule 3); the read ends. ``ctx=None``: the
        read failed (it installs nothing)."""
        with self.lock:
            if nbytes_read is not None:
                self.io["reads"] += 1
                self.io["bytes_read"] += nbytes_read
            entry = self._entries.get(key)
            if entry is None:
                return NOTHING
            entry.readers -= 1
            if ctx is None:  # the read failed: it installs nothing
                self._drop_if_idle(key, entry)
                return NOTHING
            install = entry.version == found.version and not found.stays and entry.place != DEVICE
            if found.ahead and self.device.budget is not None:  # only into room the tier has now
                install = install and self.device.nbytes + own_nbytes(ctx) <= self.device.budget
            if install and found.ctx is not None:  # copied from memory: the source must still be there
                install = found.ctx is (entry.ctx if entry.place == HOST else entry.pending)
            elif install:  # read from disk: only where no memory holds a newer copy, nor a removal owes
                install = entry.ctx is None and entry.pending is None and entry.removing is None
                entry.on_disk = install or entry.on_disk
            if not install:
                self._drop_if_idle(key, entry)
                return NOTHING
            self._place(key, entry, ctx, DEVICE, moved=found.ctx is not None)  # (a pending write keeps its copy)
            return self._moves(protect=key)

    def start_load(self, key: str, submit: Callable[[], Future[Any]], *, on_disk: bool = False) -> bool | None:
        """Starts a load ahead of ``key`` with ``submit`` (which only queues it), unless one runs
        or the device tier holds it. Returns whether the store holds the key, or ``None`` where
        only the disk could tell (call again with ``on_disk=True`` once it has).

        Raises:
          ContextNotFoundError: the key is being deleted.
        """
        with self.lock:
            entry = self._live(key)
            if entry is not None and (entry.place == DEVICE or (entry.load is not None and entry.load_version == entry.version)):
                return True
            if (entry is None or not entry.in_memory) and not on_disk:
                return None
            entry = self._entries.setdefault(key, Entry())
            entry.load, entry.load_version = submit(), entry.version
            return True

    # -- copies owed -------------------------------------------------------------------------------

    def settle(self, demoted: Sequence[tuple[str, ResidualContext, ResidualContext]],
               released: Sequence[tuple[str, ResidualContext, ResidualContext]],
               landing: Sequence[tuple[Future[Any], int]] = ()) -> None:
        """The copies of an :class:`Owed`, made: each host copy takes the place of the context it
        copies, where that context still is (by identity: a copy of a context that a later put or
        delete superseded meanwhile is dropped). ``landing``: the copies still in flight (a
        future that ends when each has landed) and the device bytes each holds until then
        (rule 7)."""
        with self.lock:
            self.leaving.add(landing)
            for key, ctx, copy in demoted:
                entry = self._entries.get(key)
                if entry is None:
                    continue
                if entry.ctx is ctx and entry.place == HOST:
                    entry.ctx = copy
                if entry.pending is ctx:
                    entry.pending = copy
            for key, ctx, copy in released:
                entry = self._entries.get(key)
                if entry is not None and entry.pending is ctx:
                    entry.pending = copy

    def copy_failed(self, key: str, source: ResidualContext, copy: ResidualContext) -> None:
        """The copy of ``source`` to host memory failed: where ``copy`` took its place,
        ``source`` takes it back (intact, on the device)."""
        with self.lock:
            entry = self._entries.get(key)
            if entry is not None:
                if entry.ctx is copy:
                    entry.ctx = source
                if entry.pending is copy:
                    entry.pending = source

    # -- the budgets ---------------------------------------------------------------------------------

    def _moves(self, protect: str | None, own: Write | None = None) -> Moves:
        """After a transition (``own``: a put's write): moves contexts down until each tier is
        within budget (the device tier also within the device's headroom), then takes the copies
        owed since the last call. Returns both, with the writes owed by contexts pushed out of
        host memory, already marked pending (where the store writes spills and the disk lacks
        them). A pending context that the host tier holds a copy of waits as that copy, at once;
        one that no tier holds is released (copied for writing)."""
        limit = self._device_limit(self.device.nbytes) if self._device_limit is not None else None
        moves = spills(self.device, self.host, self.schedule, protect, limit)
        for key in moves.down:
            entry = self._entries[key]
            assert entry.ctx is not None
            self._place(key, entry, entry.ctx, HOST, moved=True)
        evicted = []
        for key in moves.out:
            entry = self._entries[key]
            ctx = entry.ctx
            assert ctx is not None
            (self.device if entry.place == DEVICE else self.host).remove(key, moved=True)
            entry.ctx = entry.place = None
            evicted.append((key, entry, ctx))
        writes = []
        for key, entry, ctx in evicted:
            if entry.pending is not None:
                self._unsettled.add(key)  # in no tier now: its device memory must go
            elif self.keeping.writes_spills and not entry.on_disk:
                writes.append(self._mark_pending(key, entry, ctx, entry.version))
            else:
                self._drop_if_idle(key, entry)
        released = []
        for key in list(self._unsettled):
            unsettled = self._entries.get(key)
            if unsettled is not None and unsettled.place is None and unsettled.pending is not None:
                released.append((key, unsettled.pending))
            self._unsettled.discard(key)
        for owed in (self._entries[k] for k, _ in self._owed if k in self._entries):
            if owed.pending is not None and owed.place == HOST and owed.ctx is not owed.pending:
                owed.pending = owed.ctx  # a host copy already: no second copy
        demoted = tuple((k, c) for k, c in self._owed if (e := self._entries.get(k)) is not None and e.ctx is c)
        self._owed = []
        return Moves(Owed(demoted, tuple(released)), tuple(writes), own)

    # -- the schedule ----------------------------------------------------------------------------

    def declare(self, keys: Sequence[str]) -> None:
        """Declares the order of the coming gets (see ``Store.schedule``)."""
        with self.lock:
            self.schedule.declare(keys)
            self.scheduled = bool(keys)

    def ahead(self, lookahead: int) -> tuple[list[tuple[str, int | None, bool]], int]:
        """The schedule's next keys (at most ``lookahead``), each with its own bytes where this
        store knows them (``None``: ask the disk) and whether it is on the device or loading; and
        the loads in flight."""
        with self.lock:
            if not self.scheduled:
                return [], 0
            upcoming: list[tuple[str, int | None, bool]] = []
            for key in itertools.islice(self.schedule.upcoming(), lookahead):
                entry = self._entries.get(key)
                if entry is not None and entry.deleted:
                    upcoming.append((key, -1, False))
                    continue
                source = None if entry is None else entry.ctx if entry.ctx is not None else entry.pending
                held = entry is not None and (entry.place == DEVICE or entry.load is not None)
                upcoming.append((key, None if source is None else own_nbytes(source), held))
            loading = sum(1 for e in self._entries.values() if e.load is not None and not e.load.done())
            return upcoming, loading

    # -- questions -------------------------------------------------------------------------------

    def locate(self, key: str) -> tuple[ResidualContext | None, bool, bool]:
        """Where ``key`` is, without a read: ``(ctx, newer, deleted)``: the context in memory
        (a tier's, or a pending write's), whether that is newer than the disk's copy, and whether
        the key is being deleted."""
        with self.lock:
            entry = self._entries.get(key)
            if entry is None:
                return None, False, False
            if entry.deleted:
                return None, False, True
            ctx = entry.ctx if entry.ctx is not None else entry.pending
            return ctx, entry.pending is not None or not entry.on_disk, False

    def held(self, key: str) -> bool | None:
        """Whether the store holds ``key``: ``True`` in memory or pending, ``False`` deleted,
        ``None`` where only the disk can tell."""
        with self.lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if entry.deleted:
                return False
            return True if entry.in_memory else None

    def forget(self) -> None:
        """The store is closed, its writes done: every context it held in memory is let go (its
        memory freed once nothing else refers to it); the table answers nothing more."""
        with self.lock:
            self._entries.clear()
            self._owed.clear()
            self._unsettled.clear()
            self.device = MemoryTier("device", self.device.budget)
            self.host = MemoryTier("host", self.host.budget)

    def device_held(self) -> int:
        """Device bytes of the store's contexts that are not handed out: the device tier's, the
        copies to host memory in flight (rule 7), and the loads ahead that no tier holds, not
        yet taken by their get (as the table knows their size: not a load from disk)."""
        with self.lock:
            loading = 0
            for entry in self._entries.values():
                if entry.load is not None and entry.place != DEVICE:
                    source = entry.ctx if entry.ctx is not None else entry.pending
                    loading += 0 if source is None else own_nbytes(source)
            return self.device.nbytes + self.leaving.nbytes() + loading

    def keys(self) -> tuple[set[str], set[str]]:
        """The keys in memory or pending, and the keys being deleted."""
        with self.lock:
            live, deleted = set(), set()
            for key, entry in self._entries.items():
                if entry.deleted:
                    deleted.add(key)
                elif entry.in_memory:
                    live.add(key)
            return live, deleted

    def stats(self) -> dict[str, Any]:
        """The memory tiers' and pending copies' bytes and counts, the disk's reads and writes
        (``io``) and the keys being deleted (``deleted``; see ``Store.stats``)."""
        with self.lock:
            result: dict[str, Any] = {
                tier.name: {"bytes": tier.nbytes, "contexts": len(tier), "bytes_in": tier.bytes_in, "bytes_out": tier.bytes_out}
                for tier in (self.device, self.host)
            }
            result["device"]["leaving"] = self.leaving.nbytes()  # copies to host in flight
            waiting = [e.pending for e in self._entries.values() if e.pending is not None and e.place is None]
            result["pending"] = {
                "bytes": sum(own_nbytes(c) for c in waiting if c is not None), "contexts": len(waiting),
                "reads": self.io["pending_reads"],
            }
            result["io"] = {k: v for k, v in self.io.items() if k != "pending_reads"}
            result["deleted"] = {k for k, e in self._entries.items() if e.deleted}  # type: ignore[assignment]
            return result

