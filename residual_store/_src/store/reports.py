"""A store's reports: what it holds, as records and arrays, the disk it takes, its stored
backwards, and a check of every byte. The facade's part that reads and reports (``info``,
``arrays``, ``backward_info``, ``usage``, ``verify``), asking ``inspection.py`` with the store's
disk (``None``: memory only) and its key table for what memory holds; it changes nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from residual_store._src.context import ResidualContext
from residual_store._src.errors import ContextNotFoundError, InvalidArgumentError
from residual_store._src.store import inspection, item_record
from residual_store._src.store.calls import Calls, store_call
from residual_store._src.store.disk.paths import validate_key
from residual_store._src.store.host import to_numpy
from residual_store._src.store.inspection import BackwardInfo, ContextInfo, Progress, StoreUsage, VerifyReport

if TYPE_CHECKING:
    from residual_store._src.store.disk.tier import DiskTier
    from residual_store._src.store.table import KeyTable

__all__ = ["StoreReports"]


class _Listing(Protocol):
    def keys(self) -> list[str]: ...


class _Facade(Protocol):
    """What the reports read of the store they are a part of."""

    @property
    def _calls(self) -> Calls: ...
    @property
    def _table(self) -> KeyTable: ...
    @property
    def _disk(self) -> DiskTier | None: ...
    @property
    def _persistence(self) -> _Listing: ...  # (the keys the disk holds)
    @property
    def _description(self) -> str: ...

    def flush(self, *keys: str) -> None: ...
    def keys(self) -> list[str]: ...
    def __contains__(self, key: object) -> bool: ...
    def _find(self, key: str) -> tuple[ResidualContext | None, bool]: ...


class StoreReports:
    """The reports of a :class:`~residual_store.Store` (mixed into it, as
    :class:`~residual_store._src.store.mapping.StoreMapping` is)."""

    def _find(self: _Facade, key: str) -> tuple[ResidualContext | None, bool]:
        """The context under ``key`` in memory (a memory tier's, or a put's waiting for its write)
        and whether that is newer than the disk's copy; :class:`ContextNotFoundError` for a key
        being deleted."""
        key = validate_key(key)
        ctx, newer, deleted = self._table.locate(key)
        if deleted:
            raise ContextNotFoundError.of(key, self._description, deleted="now")
        return ctx, newer

    @store_call
    def info(self: _Facade, key: str) -> ContextInfo:
        """The record of the context under ``key``: its signature and, per residual, name,
        shape, dtype, bytes, kind and where it lies; no array is read.

        Example:
          >>> import jax.numpy as jnp, residual_store as rs, tempfile
          >>> _, ctx = rs.split(lambda w: jnp.sum(jnp.sin(w)))(jnp.ones(3))
          >>> with tempfile.TemporaryDirectory() as path, rs.Store(path) as store:
          ...     info = store.info(store.put(ctx, "mb0"))
          >>> info.key, [(r.name, r.kind, r.shape, r.dtype) for r in info.residuals]
          ('mb0', [('cos ...', 'intermediate', (3,), 'float32')])

        Raises:
          ContextNotFoundError: no such key. InvalidKeyError: a key outside the key rules.
          CorruptContextError: its manifest is damaged.
        """
        ctx, newer = self._find(key)
        if ctx is not None and (newer or not self._table.keeping.below_host):
            return inspection.memory_info(key, ctx.spec)
        return inspection.stored_info(self._disk, key)

    @store_call
    def arrays(self: _Facade, key: str) -> tuple[np.ndarray, ...]:
        """The residuals of ``key`` as NumPy arrays in host memory, verified, in the order of
        :meth:`info`'s ``residuals`` (a typed PRNG key as its key data); nothing is placed on
        a device and the store's tiers are left as they were.

        Example:
          >>> import jax.numpy as jnp, residual_store as rs
          >>> _, ctx = rs.split(lambda w: jnp.sum(jnp.sin(w)))(jnp.zeros(3))
          >>> with rs.Store(None) as store:
          ...     [a.tolist() for a in store.arrays(store.put(ctx, "mb0"))]   # cos(w)
          [[1.0, 1.0, 1.0]]

        Raises:
          ContextNotFoundError: no such key. CorruptContextError: stored data failed
          verification (the message names the residual).
        """
        ctx, _ = self._find(key)
        if ctx is not None:
            return tuple(to_numpy(x) for x in ctx.residuals)
        return inspection.stored_arrays(self._disk, key)

    @store_call
    def backward_info(self: _Facade, signature: str) -> BackwardInfo:
        """Whether a backward of ``signature`` is stored (processes without the model can run
        it), for which platforms and JAX version, or why not; reads its manifest only.

        Raises:
          InvalidArgumentError: ``signature`` is not a signature (``info(key).signature`` is one).
        """
        return inspection.backward_info(self._disk, signature)

    @store_call
    def usage(self: _Facade, *, progress: Progress | None = None) -> StoreUsage:
        """Bytes the store takes on disk, per part of its tree and per signature (a memory-only
        store: none; see :meth:`stats` for memory). ``progress``: as in :meth:`verify`.

        Example:
          >>> import jax.numpy as jnp, residual_store as rs, tempfile
          >>> _, ctx = rs.split(lambda w: jnp.sum(jnp.sin(w)))(jnp.ones(3))
          >>> with tempfile.TemporaryDirectory() as path, rs.Store(path) as store:
          ...     _ = store.put(ctx, "mb0")
          ...     usage = store.usage()
          >>> usage.total > 0, [u.contexts for u in usage.signatures.values()]
          (True, [1])
        """
        self.flush()  # what was put is on disk
        return inspection.measure(self._disk, progress)

    @store_call
    def verify(self: _Facade, keys: Sequence[str] | None = None, *, progress: Progress | None = None) -> VerifyReport:
        """Reads and checks every byte of every context (or of ``keys``) against its checksums,
        and the stored backwards (of those contexts' signatures), changing nothing: damage is
        reported, never raised. Pending writes complete first; a context held in memory only
        has nothing on disk to check and counts as verified.

        ``progress``, if given, is called after each context with the bytes read so far and
        in all (for a progress bar).

        Example:
          >>> import jax.numpy as jnp, residual_store as rs, tempfile
          >>> _, ctx = rs.split(lambda w: jnp.sum(jnp.sin(w)))(jnp.ones(3))
          >>> with tempfile.TemporaryDirectory() as path:
          ...     with rs.Store(path) as store:
          ...         _ = store.put(ctx, "mb0")
          ...     with rs.Store(path, read_only=True) as reader:   # as another process would
          ...         report = reader.verify(["mb0"])
          >>> report.ok, report.verified, report.damaged
          (True, 1, {})

        Raises:
          ContextNotFoundError: a key the store does not hold (before anything is read).
          InvalidKeyError: a key outside the key rules. InvalidArgumentError: ``keys`` is not a
          sequence of keys.
        """
        if keys is not None and (isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence)):
            raise InvalidArgumentError(
                f"verify expects a sequence of keys (or None for all), got {type(keys).__name__}: {keys!r:.60}"
            )
        given = None if keys is None else [validate_key(k) for k in keys]
        self.flush()  # what was put is on disk, to be checked
        chosen = self.keys() if given is None else given
        missing = [] if given is None else [k for k in given if k not in self]
        if missing:
            raise ContextNotFoundError.of(missing, self._description)
        on_disk = set(self._persistence.keys())
        checked, disk = [k for k in chosen if k in on_disk], self._disk
        report = inspection.verify(disk, checked, every_backward=keys is None, progress=progress)
        # a sealed store (an Orbax step's item) holds what its record lists (a verify of every
        # key also finds the keys it lost)
        report = inspection.with_damage(report, item_record.findings(disk, checked, whole=keys is None), checked)
        in_memory = sum(k not in on_disk for k in chosen)  # written with write_through=False, not spilled
        return dataclasses.replace(report, verified=report.verified + in_memory) if in_memory else report
