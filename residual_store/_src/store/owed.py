"""What the key table's transitions (``table.py``) hand their callers, to do outside the lock:
the copies owed (:class:`Owed`), the writes to queue (:class:`Write`, in :class:`Moves`), where a
read finds a key (:class:`Found`); and the policy a table is told at open (:class:`Keeping`).
Frozen values: a caller reads them, never changes them.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Any, NamedTuple

from residual_store._src.context import ResidualContext

__all__ = ["NOTHING", "Found", "Keeping", "Moves", "Owed", "Write"]


class Write(NamedTuple):
    """A write to queue: the key, the context, and the version it is."""

    key: str
    ctx: ResidualContext
    version: int


@dataclasses.dataclass(frozen=True)
class Keeping:
    """What the store's persistence does with what leaves memory, chosen when it opens.

    Attributes:
      below_host: a disk lies below host memory (what a promotion pushes out of host memory is
        not lost); without one a put the budgets cannot hold is refused.
      writes_puts: every put is written (write-through).
      writes_spills: a context pushed out of host memory is written (else dropped).
    """

    below_host: bool
    writes_puts: bool = False
    writes_spills: bool = False


@dataclasses.dataclass(frozen=True)
class Owed:
    """Copies a transition owes, made by its caller outside the lock: ``demoted``, contexts that
    entered the host tier in device memory (to copy to host memory); ``released``, pending
    writes' contexts that no tier holds (to copy for writing, so their device memory goes)."""

    demoted: tuple[tuple[str, ResidualContext], ...] = ()
    released: tuple[tuple[str, ResidualContext], ...] = ()

    @property
    def due(self) -> bool:
        """Whether any copy is owed."""
        return bool(self.demoted or self.released)


@dataclasses.dataclass(frozen=True)
class Moves:
    """What a transition owes its caller, done outside the lock: the copies (:class:`Owed`),
    then the writes to claim and queue: a put's own write (``own``), then the writes of contexts
    the budgets pushed out of host memory (``spills``)."""

    owed: Owed = Owed()
    spills: tuple[Write, ...] = ()
    own: Write | None = None


NOTHING = Moves()


@dataclasses.dataclass(frozen=True)
class Found:
    """Where a read finds a key (:meth:`KeyTable.begin_get`, for a get or a load ahead).

    Attributes:
      version: the key's version, noted for the install (rule 3).
      ctx: the context to return as it is (``on_device``), or to copy to the device (a host
        tier's context or a pending write's), or ``None``: read the disk.
      on_device: ``ctx`` is the device tier's: nothing to copy, no read to finish.
      load: a load in flight of the current version, taken for this get: its result.
      stays: a copy of ``ctx`` is returned without entering the device tier (its budget, or a
        memory-only store's, could not keep it; or a ``pop`` takes it out of the store).
      ahead: a load ahead of need: what it brings enters the device tier only where the tier
        has room for it as it is (never pushing out a context it holds, which may be needed
        sooner); else it is held for its get alone.
    """

    version: int
    ctx: ResidualContext | None = None
    on_device: bool = False
    load: Future[Any] | None = None
    stays: bool = False
    ahead: bool = False
