"""One key, one state: the per-key bookkeeping of a store, and the concurrency rules it keeps.

A store's contexts move between threads (callers of ``put``/``get``/``delete``, the writer, the
loaders, the janitor) and between places (the device and host tiers, a pending write's host copy,
the disk). Every fact about one key that more than one thread reads is kept here, by one
:class:`KeyLedger`, and changed only through its methods, each named for what happens.

The rules (each checked by ``tests/test_key_races.py``):

1. **The lock guards bookkeeping only.** The store's one lock (a
   :class:`~residual_store._src.store.critical.StoreLock`) is held to read or change the ledger
   and the tiers' maps, never while an array is copied, transferred, read or written, nor while
   anything is waited for. So a thread (or a signal handler) that waits for the writer never
   waits on a lock that the code it interrupted holds for long; and the handler is deferred to
   the moment the lock is released (see ``critical.py``).
2. **A version per key.** Every ``put`` and every ``delete`` of a key gives it a new version, a
   number from one counter of the store that only grows. Versions are never reused, so a version
   noted earlier is current only if nothing happened to the key since.
3. **Readers install only what is current.** A read (``get``, ``prefetch``, a load ahead) notes
   the key's version under the lock before it copies or reads anything. When it is done it may
   put what it read into a tier, or note that the disk holds the current version, only if the
   key's version is still the one it noted; otherwise it returns what it read to its own caller
   (whose call overlapped the put or delete) and caches nothing.
4. **Writes land only if current.** A background write carries the version it writes; it is
   skipped if a later put or delete took the key before its turn (unless the committer lands
   superseded writes: a multi-process job, where every process takes part in each write in order),
   and only a write of the current version marks the key as on disk.
5. **A delete hides the key at once.** From the moment ``delete`` returns, the key is in no tier,
   no pending write, no load; until its disk removal is done the ledger answers "being deleted",
   and every lookup of the store (``get``, ``in``, ``keys``) treats it as absent.

Together: after ``put`` or ``delete`` of a key returns, no call of this store returns an older
version of that key, and no read that overlapped them leaves an older version behind.

Every method is called with the store's lock held.
"""

from __future__ import annotations

import itertools
from collections import Counter
from concurrent.futures import Future
from typing import Any

from residual_store._src.context import ResidualContext

__all__ = ["KeyLedger"]


class KeyLedger:
    """Per key: its version, the version waiting for its disk write, a disk removal in flight,
    whether its current version is on disk, and the load of it in flight."""

    def __init__(self) -> None:
        self._counter = itertools.count(1)
        self._version: dict[str, int] = {}  # absent: nothing happened to the key here (version 0)
        self._pending: dict[str, tuple[ResidualContext, int]] = {}
        self._deleting: dict[str, int] = {}
        self._on_disk: set[str] = set()
        self._loading: dict[str, tuple[Future[Any], int]] = {}
        self._readers: Counter[str] = Counter()  # reads in flight per key (they hold its version)

    # -- versions ------------------------------------------------------------------------------

    def version(self, key: str) -> int:
        return self._version.get(key, 0)

    def is_current(self, key: str, version: int) -> bool:
        return self._version.get(key, 0) == version

    def _bump(self, key: str) -> int:
        version = next(self._counter)
        self._version[key] = version
        return version

    # -- transitions ---------------------------------------------------------------------------

    def begin_put(self, key: str) -> int:
        """A put of ``key``: a new version; the older version's pending write, load and removal
        are superseded (rule 2). Returns the new version."""
        self._pending.pop(key, None)
        self._loading.pop(key, None)
        self._deleting.pop(key, None)
        self._on_disk.discard(key)
        return self._bump(key)

    def mark_pending(self, key: str, ctx: ResidualContext, version: int) -> None:
        """``ctx`` (of ``version``) waits for its disk write."""
        self._pending[key] = (ctx, version)

    def swap_pending(self, key: str, old: ResidualContext, new: ResidualContext) -> bool:
        """Replaces the pending context ``old`` by its host copy ``new``, if ``old`` still waits."""
        entry = self._pending.get(key)
        if entry is None or entry[0] is not old:
            return False
        self._pending[key] = (new, entry[1])
        return True

    def begin_delete(self, key: str) -> int:
        """A delete of ``key``: a new version, every copy in flight superseded, the key absent
        from now on (rule 5) until its removal is done. Returns the new version."""
        self._pending.pop(key, None)
        self._loading.pop(key, None)
        self._on_disk.discard(key)
        version = self._bump(key)
        self._deleting[key] = version
        return version

    def delete_done(self, key: str, version: int) -> None:
        """The disk removal of ``version`` is done (or failed, and was reported)."""
        if self._deleting.get(key) == version:
            del self._deleting[key]
            if not self._readers[key]:
                self._version.pop(key, None)  # nothing holds this version: the key is gone
                self._readers.pop(key, None)

    def write_starting(self, key: str, version: int) -> ResidualContext | None:
        """The pending context of ``version`` for its write, or ``None`` if a later put or
        delete superseded it (rule 4)."""
        entry = self._pending.get(key)
        return entry[0] if entry is not None and entry[1] == version else None

    def write_done(self, key: str, version: int, committed: bool) -> None:
        """The write of ``version`` is over; ``committed``: it landed."""
        if self._pending.get(key, (None, None))[1] == version:
            del self._pending[key]
            if committed:
                self._on_disk.add(key)

    def begin_read(self, key: str) -> int | None:
        """A read of ``key`` starts: the version it may install (rule 3), or ``None`` if the key
        is being deleted (rule 5: what the disk holds until the removal is done is not there)."""
        if key in self._deleting:
            return None
        self._readers[key] += 1
        return self.version(key)

    def end_read(self, key: str) -> None:
        self._readers[key] -= 1
        if self._readers[key] <= 0:
            del self._readers[key]

    def read_from_disk(self, key: str, version: int) -> bool:
        """A read of ``version`` from disk is done: whether it may be installed (and the key noted
        as on disk)."""
        if not self.is_current(key, version) or key in self._deleting or key in self._pending:
            return False
        self._on_disk.add(key)
        return True

    def start_load(self, key: str, future: Future[Any], version: int) -> None:
        """A load of ``key`` in flight, of ``version`` (never of a key being deleted)."""
        assert key not in self._deleting
        self._loading[key] = (future, version)

    def take_load(self, key: str) -> Future[Any] | None:
        """The load of ``key`` in flight, taken for a get, if it loads the current version."""
        entry = self._loading.pop(key, None)
        if entry is None or not self.is_current(key, entry[1]):
            return None
        return entry[0]

    # -- questions -----------------------------------------------------------------------------

    def deleting(self, key: str) -> bool:
        return key in self._deleting

    def deleted_keys(self) -> set[str]:
        return set(self._deleting)

    def pending(self, key: str) -> ResidualContext | None:
        entry = self._pending.get(key)
        return None if entry is None else entry[0]

    def has_pending(self, key: str) -> bool:
        return key in self._pending

    def pending_items(self) -> list[tuple[str, ResidualContext]]:
        return [(k, c) for k, (c, _) in self._pending.items()]

    def pending_keys(self) -> set[str]:
        return set(self._pending)

    def on_disk(self, key: str) -> bool:
        """Whether the current version of ``key`` is committed on disk (as far as this store knows)."""
        return key in self._on_disk

    def loading(self, key: str) -> bool:
        return key in self._loading

    def loads_in_flight(self) -> int:
        return sum(1 for f, _ in self._loading.values() if not f.done())
