"""What the budgets move between a store's places, and the copies that follow.

A bookkeeping step (a put, a promotion of a context read back) decides under the store's lock
what moves: contexts pushed down a tier, contexts pushed out of host memory (written, where the
store writes spills), pending writes whose context no tier holds. The array copies that follow
(device to host memory) are made afterwards, outside the lock (``ledger.py``, rule 1), by the
thread that made the step, before its call returns; then one short step installs each copy
where the context it copies still is, by identity, so a copy of a context that a later put or
delete superseded meanwhile is dropped.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from residual_store._src.context import ResidualContext
from residual_store._src.store.budgets import Headroom
from residual_store._src.store.host import for_writing, holds_device_memory, to_host
from residual_store._src.store.ledger import KeyLedger
from residual_store._src.store.persistence import Persistence, Write
from residual_store._src.store.tiers import Tiers

if TYPE_CHECKING:
    from residual_store._src.store.critical import StoreLock

__all__ = ["Moves", "Owed"]


@dataclasses.dataclass(frozen=True)
class Owed:
    """Copies a bookkeeping step owes: contexts that entered the host tier in device memory,
    and pending writes' contexts in no tier that hold device memory."""

    demoted: tuple[tuple[str, ResidualContext], ...] = ()
    released: tuple[tuple[str, ResidualContext], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.demoted or self.released)


class Moves:
    """The budgets' moves of one store (see the module docstring).

    Args:
      lock, tiers, ledger, side: the store's.
      headroom: device memory to leave free, if any.
      target: the device contexts are read back to (``None``: JAX's default).
    """

    def __init__(
        self, *, lock: StoreLock, tiers: Tiers, ledger: KeyLedger, side: Persistence, headroom: Headroom | None,
        target: Any,
    ) -> None:
        self._lock = lock
        self._tiers = tiers
        self._ledger = ledger
        self._side = side
        self._headroom = headroom
        self._target = target

    def rebalance(self, protect: str | None = None) -> list[Write]:
        """Under the lock: moves least recently used contexts down until each tier is within
        budget. Returns the contexts pushed out of host memory that still need a disk write,
        already marked pending (so no ``get`` finds them in no place at all), to schedule."""
        device = self._tiers.device
        limit = self._headroom.device_limit(device.nbytes) if self._headroom is not None else None
        writes = []
        for key, ctx in self._tiers.rebalance(protect, limit):
            if self._side.writes_spills and not self._ledger.on_disk(key) and not self._ledger.has_pending(key):
                version = self._ledger.version(key)
                self._ledger.mark_pending(key, ctx, version)
                writes.append((key, ctx, version))
        return writes

    def owed(self) -> Owed:
        """Under the lock: the copies the steps since the last call owe (see :class:`Owed`). A
        pending context the host tier holds a copy of waits as that copy, at once."""
        device, host = self._tiers.device, self._tiers.host
        released = []
        for key, ctx in self._ledger.pending_items():
            if key in device:
                continue  # the device tier holds this very context: no memory beyond its budget
            copy = host.peek(key)
            if copy is not None:
                if copy is not ctx:
                    self._ledger.swap_pending(key, ctx, copy)
            elif holds_device_memory(ctx):
                released.append((key, ctx))
        return Owed(tuple(self._tiers.take_owed()), tuple(released))

    def settle(self, owed: Owed) -> None:
        """Without the lock: makes the copies ``owed`` lists, then installs each where its
        context still is. A pending write then holds host copies only, so the device budget
        bounds the device memory of the store's contexts, pending writes included."""
        if not owed:
            return
        demoted = [(key, ctx, to_host(ctx)) for key, ctx in owed.demoted]
        released = [(key, ctx, for_writing(ctx, self._target)) for key, ctx in owed.released]
        with self._lock:
            for key, ctx, copy in demoted:
                self._tiers.settle(key, ctx, copy)
                self._ledger.swap_pending(key, ctx, copy)
            for key, ctx, copy in released:
                self._ledger.swap_pending(key, ctx, copy)
