"""How a store brings a context back to the device: from a memory tier, from a pending write's
host copy, or from disk (read and verified), and the loads ahead of need that a schedule asks
for (on the store's loader threads).

Every read follows ``ledger.py``'s rules: it notes the key's version under the lock, copies or
reads without it, and installs what it got (the device tier, "on disk") only if that version is
still current; a load in flight is taken by a ``get`` only if it loads the current version, and
its context is then held for that get even where the budgets could not keep it.
"""

from __future__ import annotations

import functools
import itertools
from typing import TYPE_CHECKING, Any

from residual_store._src.context import ResidualContext, bound_context, check_representable, describe_residual
from residual_store._src.errors import ContextNotFoundError, CorruptContextError
from residual_store._src.store.host import place, to_device
from residual_store._src.store.ledger import KeyLedger
from residual_store._src.store.moves import Moves, Owed
from residual_store._src.store.persistence import Persistence, Write
from residual_store._src.store.schedule import loads_ahead
from residual_store._src.store.tiers import Tiers, own_nbytes
from residual_store._src.store.weights import LiveWeights
from residual_store._src.store.workers import Loader

if TYPE_CHECKING:
    from residual_store._src.store.critical import StoreLock

__all__ = ["Reads"]

_AHEAD = 2  # loads a schedule keeps in flight at most
_LOOKAHEAD = 64  # keys of a schedule looked at for loading ahead


def _check_representable(key: str, spec: Any) -> None:
    """Raises if a stored dtype has no exact counterpart in this process (64-bit types without
    ``jax_enable_x64``, which JAX would silently narrow to 32 bits)."""
    check_representable(spec.avals, describe_residual(spec, f"context {key!r}"), "loading it")


class Reads:
    """The read side of a store: memory first, then disk; loads ahead by schedule.

    Args:
      lock, tiers, ledger, side, moves: the store's (a context read is promoted to the device
        tier; a promotion's spills are written through ``side``).
      weights: the weights on the device already (not read again).
      target: the device contexts are placed on (``None``: JAX's default).
      loader: the threads loads ahead run on.
    """

    def __init__(
        self,
        *,
        lock: StoreLock,
        tiers: Tiers,
        ledger: KeyLedger,
        side: Persistence,
        moves: Moves,
        weights: LiveWeights,
        target: Any,
        loader: Loader,
    ) -> None:
        self._lock = lock
        self._tiers = tiers
        self._ledger = ledger
        self._side = side
        self._moves = moves
        self._weights = weights
        self._target = target
        self._loader = loader
        self.pending_reads = 0  # gets served from a pending write's host copy (no disk read)

    def load(self, key: str) -> ResidualContext:
        """``key`` from memory or disk, on the device (:class:`ContextNotFoundError` if neither
        holds it, or it is being deleted)."""
        with self._lock:
            version = self._ledger.begin_read(key)
        return self._load_version(key, version)

    def take(self, key: str) -> ResidualContext:
        """For a ``get``: the load of ``key`` in flight if it loads the current version, else a
        load now."""
        with self._lock:
            if self._ledger.deleting(key):
                raise self._deleted(key)
            prefetched = self._ledger.take_load(key)
            self._tiers.schedule.consume(key)
            version: int | None = None
            if prefetched is None:
                on_device = self._tiers.device.get(key)  # the current version, if there
                if on_device is not None:
                    return on_device
                version = self._ledger.begin_read(key)
        # a prefetched context is kept for this get even when the budgets could not hold it
        return prefetched.result() if prefetched is not None else self._load_version(key, version)

    def _load_version(self, key: str, version: int | None) -> ResidualContext:
        """Loads ``key`` as of ``version`` (from ``begin_read``: ``None`` while it is being
        deleted); the read is ended (``end_read``) whatever happens."""
        if version is None:
            raise self._deleted(key)
        try:
            ctx = self._from_memory(key, version)
            return ctx if ctx is not None else self._from_disk(key, version)
        finally:
            with self._lock:
                self._ledger.end_read(key)

    def _deleted(self, key: str) -> ContextNotFoundError:
        return ContextNotFoundError(f"context {key!r} was deleted from store {self._side.description}")

    def start(self, key: str) -> None:
        """Under the lock: starts loading ``key`` in the background, unless a load of it runs."""
        if not self._ledger.loading(key) and not self._ledger.deleting(key):
            version = self._ledger.version(key)
            self._ledger.start_load(key, self._loader.submit(functools.partial(self.load, key)), version)

    def ahead(self) -> None:
        """Starts loading the contexts the schedule names next: the very next one, then as many
        as fit the device budget together with it, at most ``_AHEAD`` loads in flight, stopping
        at the first not yet put (its room is the put's)."""
        with self._lock:
            if not self._tiers.schedule:
                return
            upcoming = list(itertools.islice(self._tiers.schedule.upcoming(), _LOOKAHEAD))
            in_flight = self._ledger.loads_in_flight()
        device = self._tiers.device
        start = loads_ahead(upcoming, self._own_size, self._on_device_or_loading, device.budget, _AHEAD - in_flight)
        with self._lock:
            for key in start:
                if key not in device and not self._ledger.deleting(key):
                    self.start(key)

    def _finish(self, writes: list[Write], owed: Owed) -> None:
        """After a promotion, without the lock: the copies it owes (taken under the lock that
        promoted), then its spills' writes."""
        self._moves.settle(owed)
        self._side.schedule(writes)

    def _from_memory(self, key: str, version: int) -> ResidualContext | None:
        """The context from device, host or a pending write, brought to the device tier.

        A context the device budget cannot hold is served as a device copy and left where it is,
        so a get under a small budget costs one copy, not a round trip.
        """
        device, host = self._tiers.device, self._tiers.host
        with self._lock:
            ctx = device.get(key)
            if ctx is not None:
                return ctx
            in_host = key in host
            source = host.get(key) if in_host else self._ledger.pending(key)
            if source is None:
                return None
            if not in_host:
                self.pending_reads += 1
            size = own_nbytes(source)
            # a memory-only store has no tier below host: promoting must not push one out
            stays = not device.fits(size) or (
                not self._side.persists and in_host and self._tiers.would_overflow(key, size)
            )
        moved = to_device(source, self._target)  # no lock held: a copy (rule 1)
        if stays:
            return moved
        with self._lock:
            still = host.peek(key) if in_host else self._ledger.pending(key)
            if not self._ledger.is_current(key, version) or still is not source or key in device:
                return moved  # put, delete or another read meanwhile: theirs stays (rule 3)
            host.remove(key, moved=True)
            device.add(key, moved)
            writes = self._moves.rebalance(protect=key)
            owed = self._moves.owed()
        self._finish(writes, owed)
        return moved

    def _from_disk(self, key: str, version: int) -> ResidualContext:
        """``key`` read from disk, verified, placed, and promoted to the device tier if nothing
        happened to the key while it was read (rule 3)."""
        live = self._weights.on(self._target)  # kept alive until placed: not read again
        stored, arrays = self._side.read(key, skip=live)  # sharded: only this process's chunks
        self._side.count_read(
            sum(r.nbytes for r in stored.records if not (r.shared and not r.chunked and r.path in live))
        )
        _check_representable(key, stored.spec)
        paths = [r.path for r in stored.records]
        residuals = place(
            arrays, [r.shared for r in stored.records], stored.key_impls,
            functools.partial(self._weights.device_array, paths, arrays, live, self._target),
            self._target,
        )
        # the stored backward, read and checked now, deserialized only if rs.backward needs it
        ctx = bound_context(stored.spec, residuals, loader=self._side.backward_for(stored.spec.signature))
        with self._lock:
            if key in self._tiers or not self._ledger.read_from_disk(key, version):
                return ctx  # put, delete or another read while this one ran: theirs stays
            self._tiers.device.add(key, ctx)
            writes = self._moves.rebalance(protect=key)
            owed = self._moves.owed()
        self._finish(writes, owed)
        return ctx

    def _on_device_or_loading(self, key: str) -> bool:
        with self._lock:
            return key in self._tiers.device or self._ledger.loading(key)

    def _own_size(self, key: str) -> int | None:
        """The own bytes of ``key`` wherever it is, or ``None`` if the store does not hold it."""
        with self._lock:
            if self._ledger.deleting(key):
                return None
            for tier in (self._tiers.device, self._tiers.host):
                size = tier.size_of(key)
                if size is not None:
                    return size
            pending = self._ledger.pending(key)
            if pending is not None:
                return own_nbytes(pending)
        try:
            stored = self._side.stat(key)
        except (ContextNotFoundError, CorruptContextError):
            return None
        return sum(r.nbytes for r in stored.records if not r.shared)
