"""Live weights: the weights (model parameters) that contexts hold by reference, while the caller
holds them.

A step's contexts all reference the same weights. A store hashes each live weight once, not once
per put (its checksum and content digest, by the array's identity), and a context read back takes
the live device array of each of its weights (by the weight's path) instead of reading it and
placing a copy: one device array per stored weight while anything holds it. Both caches are weak:
an entry goes when its array does, so the store never keeps the model's memory alive.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import jax

import residual_store_serializers as serializers
from residual_store._src.context import SHARED_KINDS, ResidualContext
from residual_store._src.store.critical import StoreLock
from residual_store._src.store.disk.host_arrays import HostArrays, ShardedHost
from residual_store._src.store.disk.paths import weight_path
from residual_store._src.store.host import is_whole_on, read_device, to_device_sharded

__all__ = ["LiveWeights"]

Digests = dict[int, str]  # residual index -> checksum or content digest


class LiveWeights:
    """The live weights of one store: their checksums by identity, their device arrays by path.

    Thread-safe: writer, loader and caller threads all use it.
    """

    def __init__(self) -> None:
        # id(array) -> (weak reference to it, checksum, content digest); an entry goes with its array
        self._sums_lock = StoreLock()  # (weakref callbacks take it: never held around other work)
        self._sums: dict[int, tuple[weakref.ref[Any], str, str]] = {}
        # path, or (path, placement) for a sharded weight -> its device array, while it lives
        self._lock = StoreLock()
        self._arrays: weakref.WeakValueDictionary[Any, jax.Array] = weakref.WeakValueDictionary()

    def __len__(self) -> int:
        """How many device arrays of weights are held (weakly)."""
        return len(self._arrays)

    def checksums(self, ctx: ResidualContext, arrays: HostArrays) -> tuple[Digests, Digests]:
        """Checksums and content digests of ``ctx``'s whole shared residuals, by index
        (``arrays``: its host arrays, hashed where not known yet). Only ``jax.Array`` weights are
        remembered (immutable)."""
        sums: Digests = {}
        digests: Digests = {}
        for i, (x, kind, host) in enumerate(zip(ctx.residuals, ctx.spec.kinds, arrays)):
            if kind not in SHARED_KINDS or isinstance(host, ShardedHost) or not isinstance(x, jax.Array):
                continue
            with self._sums_lock:
                entry = self._sums.get(id(x))
            if entry is None or entry[0]() is not x:
                entry = (weakref.ref(x, functools.partial(self._forget_sums, id(x))),
                         serializers.checksum(host), serializers.content_digest(host))
                with self._sums_lock:
                    self._sums[id(x)] = entry
            sums[i], digests[i] = entry[1], entry[2]
        return sums, digests

    def _forget_sums(self, key: int, ref: weakref.ref[Any]) -> None:
        with self._sums_lock:
            if key in self._sums and self._sums[key][0] is ref:
                del self._sums[key]

    def hold(self, residuals: Sequence[Any], impls: Sequence[str | None], digests: Mapping[int, str]) -> None:
        """Remembers the live weights a write stored, by path: while the caller holds them, a
        context read back takes these very arrays (read from nowhere, copied nowhere) as the one
        put did, where a read would place them (see :meth:`on`)."""
        for i, digest in digests.items():
            x = residuals[i]
            if impls[i] is None and isinstance(x, jax.Array) and not x.is_deleted():
                path = weight_path(digest)
                with self._lock:
                    held = self._arrays.get(path)
                    if held is None or held.is_deleted():
                        self._arrays[path] = x

    def on(self, target: jax.Device | None) -> dict[str, jax.Array]:
        """The weights a read need not read, by path: live arrays whole on the device a read
        places its arrays on (``target``, or JAX's default); a weight the caller donated since,
        or one elsewhere, is read."""
        device = read_device(target)
        with self._lock:
            return {k: v for k, v in self._arrays.items() if isinstance(k, str) and is_whole_on(v, device)}

    def device_array(
        self,
        paths: Sequence[str],
        arrays: Sequence[Any],
        live: Mapping[str, jax.Array],
        target: jax.Device | None,
        i: int,
    ) -> jax.Array:
        """The device array of the weight ``i`` of a read (``paths``: each residual's stored
        path; ``arrays``: what the read returned, ``None`` for a weight in ``live``, the ones held
        when the read began, not read again): one per stored weight (and sharding) while any
        loaded context holds it."""
        path, x = paths[i], arrays[i]
        if x is None:
            return live[path]
        sharded = isinstance(x, ShardedHost)
        cache_key: Any = (path, x.placement) if sharded else path
        with self._lock:
            held = self._arrays.get(cache_key)
            if held is None or held.is_deleted() or not (sharded or is_whole_on(held, read_device(target))):
                held = to_device_sharded(x) if sharded else jax.device_put(x, target)
                self._arrays[cache_key] = held
            return held
