"""How a store's writes and deletes reach its disk: the :class:`Committer` protocol, and the
:class:`SingleProcessCommitter` of a store used by one process.

A store with a path commits through one :class:`Committer`, chosen once when it opens
(:func:`residual_store._src.store.collective.committer_for`, the one place that asks whether the job
has several processes): a :class:`SingleProcessCommitter` in a single process, a
:class:`~residual_store._src.store.collective.CollectiveCommitter` in a job of several processes
(``jax.process_count() > 1``). Where the two differ (which key a put gets, whether a put is
written through, whether a superseded write lands, which arrays a process stages, who saves the
backwards, what becomes of replaced data), the store calls the committer's method, which does
it; it never asks which committer it has, nor reads a flag to decide for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import numpy as np

from residual_store._src.context import ResidualContext
from residual_store._src.store.disk import layout, paths
from residual_store._src.store.disk.host_arrays import HostArrays, ShardedHost
from residual_store._src.store.disk.layout import HostWrite
from residual_store._src.store.disk.paths import put_key
from residual_store._src.store.disk.protocol import StaleData
from residual_store._src.store.disk.tier import DiskTier
from residual_store._src.store.host import host_arrays, stage_shared

if TYPE_CHECKING:
    from residual_store._src.store.backwards import BackwardSaver

__all__ = ["Committer", "SingleProcessCommitter", "Staged"]

Staged = Mapping[int, tuple[np.ndarray | ShardedHost, str | None]]
"""A context's weights on the host, taken at its put (see :func:`~residual_store._src.store.host.stage_shared`)."""


class Committer(Protocol):
    """Writes and deletes contexts on a store's disk tier, and decides what differs between a
    single process and a job of several (see the module docstring)."""

    def key_for(self, key: str | None) -> str:
        """The key a put of ``key`` stores its context under: ``key`` checked, and for ``None``
        a fresh one where that is possible (:class:`InvalidKeyError`,
        :class:`InvalidArgumentError`)."""
        ...

    def writes_through(self, asked: bool) -> bool:
        """Whether every put is written at once (not only what the budgets push out of host
        memory); ``asked``: the store's ``write_through``."""
        ...

    def lands(self, *, superseded: bool) -> bool:
        """Whether a write or delete runs when its turn comes; ``superseded``: a later put or
        delete of its key came first."""
        ...

    def stage_shared(self, ctx: ResidualContext) -> Staged:
        """The host copies of ``ctx``'s weights, taken at its put (on the caller's thread)."""
        ...

    def host_arrays(self, ctx: ResidualContext, staged: Staged | None) -> tuple[HostArrays, list[str | None]]:
        """The residuals of ``ctx`` this process writes, on the host, and each key's impl
        (``staged``: its weights as :meth:`stage_shared` took them)."""
        ...

    def save_backward(self, saver: BackwardSaver, ctx: ResidualContext) -> None:
        """Hands ``ctx``'s backward to the store's ``saver`` where this process saves it."""
        ...

    def write(self, write: HostWrite) -> StaleData | None:
        """Commits ``write`` (a context's residuals on the host); returns the data it replaced,
        unreferenced now, for the store to :meth:`dispose` of off the write path."""
        ...

    def delete(self, key: str) -> tuple[bool, StaleData | None]:
        """Removes ``key``'s manifest (the context vanishes at once); whether it was there, and
        its data."""
        ...

    def dispose(self, stale: StaleData) -> None:
        """Disposes of data no manifest references any more (what a write replaced or a delete
        removed), on the store's janitor thread."""
        ...


class SingleProcessCommitter:
    """The :class:`Committer` of a store that one process writes: it plans each write and
    commits it on its :class:`DiskTier`."""

    def __init__(self, disk: DiskTier) -> None:
        self.disk = disk

    key_for = staticmethod(put_key)  # a fresh key is this process's own

    def writes_through(self, asked: bool) -> bool:
        return asked

    def lands(self, *, superseded: bool) -> bool:
        return not superseded  # a stale version never lands

    stage_shared = staticmethod(stage_shared)  # one process addresses every device: each array whole
    host_arrays = staticmethod(host_arrays)

    def save_backward(self, saver: BackwardSaver, ctx: ResidualContext) -> None:
        saver.save(ctx)

    def write(self, write: HostWrite) -> StaleData | None:
        """Plans ``write`` and commits it (:meth:`DiskTier.commit`)."""
        return self.disk.commit(layout.plan_write(write, write_id=paths.new_write_id()), fsync=write.fsync)

    def delete(self, key: str) -> tuple[bool, StaleData | None]:
        return self.disk.delete(key)

    def dispose(self, stale: StaleData) -> None:
        # kept for a later write of its layout where the medium can (a local folder)
        self.disk.atomicity.recycle(stale)
