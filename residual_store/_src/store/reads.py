"""How a store brings a context back to the device: from a memory tier, from a pending write's
host copy, or from disk (read and verified), and the loads ahead of need that a schedule asks
for (on the store's loader threads).

Invariant (under the store's lock, which :class:`Reads` shares): ``loading[key]`` is the one
load of ``key`` in flight; a ``get`` of it takes that load's context, held for it even where
the budgets could not keep it.
"""

from __future__ import annotations

import functools
import itertools
import threading
from concurrent.futures import Future
from typing import Any

from residual_store._src.context import ResidualContext, check_representable, describe_residual
from residual_store._src.errors import ContextNotFoundError, CorruptContextError
from residual_store._src.store.backwards import StoredBackwards
from residual_store._src.store.disk import DiskTier
from residual_store._src.store.host import place, to_device
from residual_store._src.store.pending import PendingWork, Write
from residual_store._src.store.schedule import loads_ahead
from residual_store._src.store.tiers import Tiers, own_nbytes
from residual_store._src.store.weights import LiveWeights
from residual_store._src.store.workers import Loader

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
      lock: the store's lock.
      tiers: the store's memory tiers (a context read is promoted to the device tier).
      work: the store's pending work (a pending write's host copy serves a get; a promotion's
        spills are written through it).
      disk: the disk tier, or ``None`` for a memory-only store.
      weights: the weights on the device already (not read again).
      target: the device contexts are placed on (``None``: JAX's default).
      loader: the threads loads ahead run on.
      stored_backwards: the store's stored backwards, each context read from disk gets its own.
    """

    def __init__(
        self,
        *,
        lock: threading.RLock,
        tiers: Tiers,
        work: PendingWork,
        disk: DiskTier | None,
        weights: LiveWeights,
        target: Any,
        loader: Loader,
        stored_backwards: StoredBackwards | None,
    ) -> None:
        self._lock = lock
        self._tiers = tiers
        self._work = work
        self._disk = disk
        self._weights = weights
        self._target = target
        self._loader = loader
        self._stored_backwards = stored_backwards
        self.loading: dict[str, Future[ResidualContext]] = {}
        self.pending_reads = 0  # gets served from a pending write's host copy (no disk read)

    def load(self, key: str) -> ResidualContext:
        """``key`` from memory or disk, on the device (:class:`ContextNotFoundError` if neither
        holds it)."""
        ctx, spills = self._from_memory(key)
        self._schedule(spills)
        return ctx if ctx is not None else self._from_disk(key)

    def start(self, key: str) -> None:
        """Under the lock: starts loading ``key`` in the background, unless a load of it runs."""
        if key not in self.loading:
            self.loading[key] = self._loader.submit(functools.partial(self.load, key))

    def ahead(self) -> None:
        """Starts loading the contexts the schedule names next: the very next one, then as many
        as fit the device budget together with it, at most ``_AHEAD`` loads in flight, stopping
        at the first not yet put (its room is the put's)."""
        with self._lock:
            if not self._tiers.schedule:
                return
            upcoming = list(itertools.islice(self._tiers.schedule.upcoming(), _LOOKAHEAD))
            in_flight = sum(1 for f in self.loading.values() if not f.done())
        device = self._tiers.device
        start = loads_ahead(upcoming, self._own_size, self._on_device_or_loading, device.budget, _AHEAD - in_flight)
        with self._lock:
            for key in start:
                if key not in device and key not in self._work.deleting:
                    self.start(key)

    def _schedule(self, spills: list[Write]) -> None:
        for write in spills:
            self._work.schedule(*write)

    def _from_memory(self, key: str) -> tuple[ResidualContext | None, list[Write]]:
        """The context from device, host or a pending write, brought to the device tier.

        A context the device budget cannot hold is served as a device copy and left where it is,
        so a get under a small budget costs one copy, not a round trip.
        """
        device, host = self._tiers.device, self._tiers.host
        with self._lock:
            ctx = device.get(key)
            if ctx is not None:
                return ctx, []
            in_host = key in host
            source = host.get(key) if in_host else self._work.pending.get(key, (None, None))[0]
            if source is None:
                return None, []
            if not in_host:
                self.pending_reads += 1
            size = own_nbytes(source)
            # a memory-only store has no tier below host: promoting must not push one out
            stays = not device.fits(size) or (self._disk is None and in_host and self._tiers.would_overflow(key, size))
            if stays:
                return to_device(source, self._target), []
            if in_host:
                host.remove(key, moved=True)
            ctx = to_device(source, self._target)
            device.add(key, ctx)
            return ctx, self._work.rebalance(protect=key)

    def _from_disk(self, key: str) -> ResidualContext:
        """``key`` read from disk, verified, placed, and promoted to the device tier."""
        if self._disk is None:
            raise ContextNotFoundError(f"no context {key!r} in this memory-only store")
        live = self._weights.on(self._target)  # kept alive until placed: not read again
        stored, arrays = self._disk.read(key, skip=live)  # sharded: only this process's chunks
        with self._lock:
            self._work.io["reads"] += 1
            self._work.io["bytes_read"] += sum(
                r.nbytes for r in stored.records if not (r.shared and not r.chunked and r.path in live)
            )
        _check_representable(key, stored.spec)
        paths = [r.path for r in stored.records]
        residuals = place(
            arrays, [r.shared for r in stored.records], stored.key_impls,
            functools.partial(self._weights.device_array, paths, arrays, live, self._target),
            self._target,
        )
        ctx = ResidualContext(residuals, stored.spec)
        if self._stored_backwards is not None:
            # read and checked now, deserialized only if rs.backward needs it (see store.backwards)
            ctx._loader = self._stored_backwards.for_context(stored.spec.signature)
        work, device = self._work, self._tiers.device
        with self._lock:
            if key in device or key in self._tiers.host or key in work.pending or key in work.deleting:
                return ctx  # put, delete or another load while this read ran: keep theirs
            work.on_disk.add(key)
            device.add(key, ctx)
            spills = work.rebalance(protect=key)
        self._schedule(spills)
        return ctx

    def _on_device_or_loading(self, key: str) -> bool:
        with self._lock:
            return key in self._tiers.device or key in self.loading

    def _own_size(self, key: str) -> int | None:
        """The own bytes of ``key`` wherever it is, or ``None`` if the store does not hold it."""
        with self._lock:
            if key in self._work.deleting:
                return None
            for tier in (self._tiers.device, self._tiers.host):
                size = tier.size_of(key)
                if size is not None:
                    return size
            pending = self._work.pending.get(key)
            if pending is not None:
                return own_nbytes(pending[0])
        if self._disk is None:
            return None
        try:
            stored = self._disk.stat(key)
        except (ContextNotFoundError, CorruptContextError):
            return None
        return sum(r.nbytes for r in stored.records if not r.shared)
