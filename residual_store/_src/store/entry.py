"""One key's entry in the key table (``table.py``): its version, the context memory holds and the
tier it is in, its pending write, newest write, load ahead, removal and readers. Plain data,
changed only under the table's lock.
"""

from __future__ import annotations

import dataclasses
import enum
from concurrent.futures import Future
from typing import Any

from residual_store._src.context import ResidualContext

__all__ = ["Entry", "Place"]


class Place(enum.Enum):
    """The memory tier an entry's context is in."""

    DEVICE = "device"
    HOST = "host"



@dataclasses.dataclass(eq=False)
class Entry:
    """Everything about one key (changed only under the table's lock)."""

    version: int = 0  # 0: nothing happened to the key here (the disk is the truth)
    ctx: ResidualContext | None = None  # in memory: in the tier ``place`` names
    place: Place | None = None  # None: in no memory tier
    pending: ResidualContext | None = None  # this version, waiting for its disk write
    claimed: bool = False  # the pending write is (being) queued
    write: Future[Any] | None = None  # the newest write scheduled: what flush(key) waits for
    load: Future[Any] | None = None  # a load ahead in flight ...
    load_version: int = 0  # ... of this version
    removing: int | None = None  # the version of a delete whose disk removal is in flight
    on_disk: bool = False  # the current version is committed on disk (as far as this store knows)
    readers: int = 0  # reads in flight (each holds the version it noted)

    @property
    def deleted(self) -> bool:
        """Deleted and not put again: absent for every lookup (rule 5)."""
        return self.removing is not None and self.removing == self.version

    @property
    def in_memory(self) -> bool:
        return self.ctx is not None or self.pending is not None

    def idle(self) -> bool:
        """Nothing of the key is held here: the entry can go (its version is then 0 again)."""
        return not (self.in_memory or self.load is not None or self.removing is not None or self.readers
                    or self.write is not None)
