"""How a store's writes and deletes reach its disk: the :class:`Committer` protocol.

A store with a path commits through one :class:`Committer`, chosen once when it opens
(:func:`residual_store._src.store.collective.committer_for`, the one place that asks whether the job
has several processes): the :class:`~residual_store._src.store.disk.DiskTier` itself in a single
process, a :class:`~residual_store._src.store.collective.CollectiveCommitter` in a job of several
processes (``jax.process_count() > 1``). What the two do differently, the store asks the
committer (its attributes below) instead of asking which one it has.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from residual_store._src.context import ResidualSpec
from residual_store._src.store.host import HostArrays
from residual_store._src.store.layout import StaleData

__all__ = ["Committer"]


class Committer(Protocol):
    """Writes and deletes contexts on a store's disk tier.

    Attributes:
      every_version: every put is written, even one a later put of its key superseded before
        its turn (the processes of a job take part in each write, in put order).
      recycles: a replaced context's data folder is kept for a later write of its layout.
      needs_keys: ``put`` needs a key (a fresh one would differ between processes).
      writes_through: every put is written at once (a spill depends on one process's budgets).
      saves_backwards: this process writes the stored backwards.
      partial_arrays: a residual may be sharded over devices of other processes too (each
        process writes the shards of its own devices); else every array must be addressable.
    """

    every_version: bool
    recycles: bool
    needs_keys: bool
    writes_through: bool
    saves_backwards: bool
    partial_arrays: bool

    def write(
        self,
        key: str,
        spec: ResidualSpec,
        arrays: HostArrays,
        impls: Sequence[str | None],
        *,
        fsync: bool,
        known: tuple[Mapping[int, str], Mapping[int, str]] = ({}, {}),
    ) -> StaleData | None:
        """Commits ``key``'s context (its residuals ``arrays`` on the host); returns the data it
        replaced, unreferenced now, for the store to drop off the write path."""
        ...

    def delete(self, key: str) -> tuple[bool, StaleData | None]:
        """Removes ``key``'s manifest (the context vanishes at once); whether it was there, and
        its data."""
        ...

