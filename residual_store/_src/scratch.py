"""Pinned host buffers a planned forward writes its offloaded values into, reused.

Why: a compiled program whose output lands in *fresh* pinned host memory runs at the speed the
host pins memory (on a TPU v5e about 0.7 GB/s, 20x slower than the link), while one that writes
into a pinned buffer it is handed, donated, runs at the link's speed, inside the program, behind
its compute. So a split whose plan offloads (``rs.plan``) hands its forward one donated buffer
per offloaded value (:class:`Scratch`), and the forward writes each value into it (a scan's
stack an iteration at a time). The buffers come back as the context's residuals; once nothing
but the :class:`Scratch` holds one (the context's backward ran and the context was dropped), the
next forward takes it again.

**The reuse rule** (the store's pool keeps the same one, :mod:`residual_store._src.store.pinned`):
a buffer is donated only when nothing but the list that keeps it refers to it
(:func:`held_only_by`). A context, a store, a pending write or a caller that still holds the
array keeps it from reuse; JAX keeps the buffer alive for a computation still reading it.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

__all__ = ["Scratch", "held_only_by", "pinned_like", "pinned_memory_kind", "pinned_sharding"]

_PINNED = "pinned_host"


def _references(items: list[Any], i: int) -> int:
    return sys.getrefcount(items[i])


_ALONE = _references([object()], 0)  # what _references counts for an object only a list holds


def held_only_by(items: list[Any], i: int) -> bool:
    """Whether nothing but the list ``items`` refers to ``items[i]`` (the reuse rule)."""
    return _references(items, i) <= _ALONE


@functools.lru_cache(maxsize=256)
def pinned_memory_kind(device: Any) -> str | None:
    """``"pinned_host"`` where ``device`` has that memory space, else ``None`` (a backend
    without memory spaces too)."""
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except Exception:  # noqa: BLE001 - backends without memory spaces
        return None
    return _PINNED if _PINNED in kinds else None


@functools.lru_cache(maxsize=256)
def pinned_sharding(device: Any) -> jax.sharding.SingleDeviceSharding | None:
    """``device``'s pinned host memory as a sharding, or ``None`` where it has none."""
    kind = pinned_memory_kind(device)
    return None if kind is None else jax.sharding.SingleDeviceSharding(device, memory_kind=kind)


def pinned_like(avals: Sequence[Any], leaves: Sequence[Any]) -> tuple[jax.ShapeDtypeStruct, ...] | None:
    """``avals`` (shapes and dtypes) as buffers in the pinned host memory of the one device
    every array of ``leaves`` is on (JAX's first device where none is an array), or ``None``
    where the leaves span several devices, one is being traced (a call inside the caller's
    ``jax.jit``: nothing to donate there) or the device has no pinned host memory (then the
    forward makes its host buffers itself)."""
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return None
    devices = {d for x in leaves if isinstance(x, jax.Array) for d in x.sharding.device_set}
    if len(devices) > 1:
        return None
    sharding = pinned_sharding(next(iter(devices)) if devices else jax.devices()[0])
    if sharding is None:
        return None
    return tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in avals)


class Scratch:
    """The pinned buffers of one forward (one per offloaded value, of ``avals``): lent to each
    call, donated to it, and kept again as the call's outputs (the context's residuals).

    Threads: :meth:`lend` and :meth:`keep` may be called from any thread.

    Args:
      avals: the buffers' shapes, dtypes and pinned shardings (:func:`pinned_like`).
    """

    def __init__(self, avals: Sequence[jax.ShapeDtypeStruct]) -> None:
        self.avals = tuple(avals)
        self._held: list[list[jax.Array]] = [[] for _ in self.avals]
        self._lock = threading.Lock()
        self.made = 0  # buffers pinned anew, for tests and reports

    def lend(self) -> list[jax.Array]:
        """A buffer of each aval for one call to donate: one that nothing else holds, taken out
        of the kept ones, or a new one."""
        out: list[jax.Array | None] = [None] * len(self.avals)
        with self._lock:
            for k, held in enumerate(self._held):
                free = next((i for i in range(len(held)) if held_only_by(held, i)), None)
                if free is not None:
                    out[k] = held.pop(free)
            fresh = [k for k, x in enumerate(out) if x is None]
            self.made += len(fresh)
        if fresh:
            made = jax.device_put([np.zeros(self.avals[k].shape, self.avals[k].dtype) for k in fresh],
                                  [self.avals[k].sharding for k in fresh])
            for k, x in zip(fresh, made):
                out[k] = x
        return out  # type: ignore[return-value]

    def keep(self, outputs: Sequence[jax.Array]) -> None:
        """Keeps a call's outputs written into the buffers it was lent (in ``avals``' order)."""
        with self._lock:
            for held, x in zip(self._held, outputs):
                held.append(x)

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers kept."""
        with self._lock:
            return sum(int(x.nbytes) for held in self._held for x in held)
