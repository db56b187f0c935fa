"""Pinned host memory for the host tier, allocated once and reused, so copies run at the link's speed.

Why: on an accelerator a copy to ``pinned_host`` memory that pins fresh memory runs at the speed
the host pins memory, a copy into pinned memory that is already there at the link's. Measured on
one TPU v5e (JAX 0.10.2; docs/store.md has the table): ``jax.device_put`` to fresh pinned memory
0.4-1.1 GB/s; a compiled program that donates a pinned buffer of the same shape and writes its
output there 14.6 GB/s (11 GB/s for 300 arrays of 512 KiB in one program); back to the device
14 GB/s either way (a jitted identity placing them is faster for hundreds of small arrays, but
keeps each input's host memory space in its output's type: :meth:`HostPool.to_device` uses
``jax.device_put``). So :class:`HostPool` keeps the pinned buffers it copied into, and copies the
next arrays into them with one compiled program per signature (the buffers' shardings), which
donates them. A copy is asynchronous: :meth:`HostPool.to_host` returns once it is enqueued,
before the bytes have moved (``jax.Array.is_ready`` of a copy tells when they have; the source's
device memory is freed then, once nothing else holds the source).

**The reuse rule.** A buffer is donated to a copy only when nothing but the pool refers to it.
The pool keeps each host array it hands out (the buffer itself: the array a context holds) in a
list of its own and, looking for a buffer, takes only one whose reference count is the pool's
own (:func:`_only_the_pool_holds`). A context, a pending write, a read or a caller that still
holds the array keeps it from reuse; the buffer is free again when the last of them lets go,
with no call to make. A buffer being copied into is out of the lists, so two copies never take
the same one. A NumPy array made from a buffer (``np.asarray``) is a copy on an accelerator;
on a CPU it is a view that holds the buffer through an external reference, and XLA does not
donate such a buffer (it copies into new memory instead): the pool then lets the old buffer go
with the view and keeps the new one. So a reused buffer never changes a live array.

**Capacity.** The pool holds at most ``capacity_bytes`` of buffers, lent and free. A copy that
needs a buffer of a shape the pool has none free of copies into new pinned memory (the speed of
pinning), kept for the next copy if it fits; to make it fit, the pool first lets go of free
buffers, those of the signature used longest ago first. What still does not fit is copied the
same way and not kept, so a pool smaller than a context holds what fits and copies the rest as a
store without a pool does.

Threads: every method may be called from any thread; the pool's state is changed under its own
:class:`~residual_store._src.store.critical.StoreLock`, the copies are enqueued outside it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from residual_store._src.errors import InvalidArgumentError
from residual_store._src.scratch import held_only_by, pinned_memory_kind
from residual_store._src.store.critical import StoreLock

__all__ = ["DEFAULT_CAPACITY_SHARE", "HostPool", "PoolStats", "capacity_for", "copies_done", "poolable", "returnable", "wait_copies"]

PINNED = "pinned_host"

DEFAULT_CAPACITY_SHARE = 0.5
"""The share of the host's physical memory a pool holds at most when no host budget sizes it
(:func:`capacity_for`)."""

_Key = tuple[tuple[int, ...], np.dtype, Any]  # (shape, dtype, the buffer's pinned_host sharding)


@dataclasses.dataclass(frozen=True)
class PoolStats:
    """What a :class:`HostPool` holds and has done.

    Attributes:
      held_bytes: bytes of the pinned buffers the pool keeps, lent and free.
      free_bytes: of those, bytes nothing but the pool refers to (the next copies reuse them).
      buffers: how many buffers it keeps.
      hits: arrays copied into a reused buffer.
      misses: arrays copied into new pinned memory that the pool then kept.
      unpooled: arrays copied into new pinned memory not kept (over capacity).
      copied_bytes: bytes copied to the host, every array counted.
      returned_bytes: bytes copied back to the device by :meth:`HostPool.to_device`.
    """

    held_bytes: int
    free_bytes: int
    buffers: int
    hits: int
    misses: int
    unpooled: int
    copied_bytes: int
    returned_bytes: int


def capacity_for(host_budget: int | None, pending_bytes: int = 0) -> int:
    """The capacity a store's pool gets: its host budget plus the bytes of host copies waiting
    to be written (both kinds of host copies draw on the pool), or, with no host budget,
    :data:`DEFAULT_CAPACITY_SHARE` of the host's physical memory."""
    if host_budget is not None:
        return host_budget + pending_bytes
    return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * DEFAULT_CAPACITY_SHARE)


def _pinned(x: jax.Array) -> Any:
    return x.sharding.with_memory_kind(PINNED)


@functools.lru_cache(maxsize=256)
def _copyable_dtype(dtype: np.dtype) -> bool:
    """Whether a buffer of ``dtype`` can be donated and copied into as it is: whole bytes an
    element (no typed key, no sub-byte type, whose layouts XLA may pack)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return False
    return np.dtype(dtype).itemsize > 0 and jax.dtypes.itemsize_bits(dtype) >= 8


def poolable(x: Any) -> bool:
    """Whether :meth:`HostPool.to_host` takes ``x``: a live, non-empty ``jax.Array`` of whole
    bytes an element in its devices' default memory, on devices that have pinned host memory,
    all addressable here."""
    if not isinstance(x, jax.Array) or x.is_deleted() or x.size == 0 or not _copyable_dtype(x.dtype):
        return False
    sharding = x.sharding
    device: Any = next(iter(sharding.device_set))
    if sharding.memory_kind not in (None, device.default_memory().kind) or not x.is_fully_addressable:
        return False
    return pinned_memory_kind(device) is not None


def returnable(x: Any) -> bool:
    """Whether :meth:`HostPool.to_device` takes ``x``: a live, non-empty ``jax.Array`` of whole
    bytes an element in a memory other than its devices' default (a host copy)."""
    if not isinstance(x, jax.Array) or x.is_deleted() or x.size == 0 or not _copyable_dtype(x.dtype):
        return False
    return x.sharding.memory_kind not in (None, _default_kind(x))


_only_the_pool_holds = held_only_by  # the reuse rule, the one planned forwards' buffers keep


def _same(arrays: tuple[jax.Array, ...], buffers: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    return arrays


@functools.lru_cache(maxsize=64)
def _copy_program(targets: tuple[Any, ...]) -> Callable[..., tuple[jax.Array, ...]]:
    """A program that copies its first argument's arrays into the donated buffers of its second
    (XLA aliases each output with the donated input of its shape and memory kind), placed on
    ``targets``; compiled once per signature of shapes and dtypes."""
    return jax.jit(_same, donate_argnums=1, keep_unused=True, out_shardings=targets)


def copies_done(arrays: Sequence[Any]) -> bool:
    """Whether every ``jax.Array`` of ``arrays`` (the host copies a copy returned) is ready:
    its copy has finished (or failed), without waiting. Other values count as done."""
    # (jax.Array's stubs leave out is_ready, which every array JAX makes has)
    return all(x.is_ready() for x in arrays if isinstance(x, jax.Array))  # type: ignore[attr-defined]


def wait_copies(arrays: Sequence[Any]) -> None:
    """Waits until every copy of ``arrays`` has finished; raises what a failed copy raised."""
    jax.block_until_ready([x for x in arrays if isinstance(x, jax.Array)])


class HostPool:
    """Pinned host buffers reused across copies (see the module docstring for the reuse rule).

    Args:
      capacity_bytes: the most bytes of buffers the pool keeps (``None``: no bound; see
        :func:`capacity_for` for a store's).

    Raises:
      InvalidArgumentError: a negative capacity.
    """

    def __init__(self, capacity_bytes: int | None = None) -> None:
        if capacity_bytes is not None and capacity_bytes < 0:
            raise InvalidArgumentError(f"a pool's capacity is a number of bytes >= 0, not {capacity_bytes}")
        self._capacity = capacity_bytes
        self._lock = StoreLock()
        self._buffers: collections.OrderedDict[_Key, list[jax.Array]] = collections.OrderedDict()  # LRU first
        self._held = 0
        self._counts = collections.Counter[str]()

    @property
    def capacity_bytes(self) -> int | None:
        return self._capacity

    def to_host(self, arrays: Sequence[jax.Array]) -> list[jax.Array]:
        """Copies of ``arrays`` in pinned host memory, each with its sharding, in the order
        given; asynchronous (see :func:`copies_done`). The sources are left as they are.

        Raises:
          InvalidArgumentError: an array :func:`poolable` refuses.
          What JAX raises when a copy cannot be enqueued (the pool keeps the buffers it still
          has; a source deleted meanwhile, say).
        """
        for x in arrays:
            if not poolable(x):
                raise InvalidArgumentError(f"a host pool copies live arrays in device memory, not {_describe(x)}")
        keys: list[_Key] = [(tuple(x.shape), np.dtype(x.dtype), _pinned(x)) for x in arrays]
        with self._lock:
            taken = [self._take(key) for key in keys]
            fresh = [i for i, b in enumerate(taken) if b is None]
            kept = self._reserve([keys[i] for i in fresh])
        hits = [i for i, b in enumerate(taken) if b is not None]
        out: list[Any] = [None] * len(arrays)
        try:
            if hits:
                copied = _copy_program(tuple(keys[i][2] for i in hits))(
                    tuple(arrays[i] for i in hits), tuple(taken[i] for i in hits)
                )
                out = _scatter(out, hits, copied)
            if fresh:
                placed = jax.device_put([arrays[i] for i in fresh], [keys[i][2] for i in fresh], may_alias=False)
                out = _scatter(out, fresh, placed)
        except BaseException:
            with self._lock:
                self._restore(taken, keys, sum(_nbytes(keys[i]) for i, k in zip(fresh, kept) if k))
            raise
        with self._lock:
            for i in hits:  # (a buffer XLA did not donate, a view holding it, goes with the view;
                # the copy's new buffer takes its place and its bytes)
                self._buffers.setdefault(keys[i], []).append(out[i])
            for i, keep in zip(fresh, kept):
                if keep:
                    self._buffers.setdefault(keys[i], []).append(out[i])
            self._counts.update(hits=len(hits), misses=sum(kept), unpooled=len(fresh) - sum(kept),
                                copied=sum(_nbytes(k) for k in keys))
        return out

    def to_device(self, arrays: Sequence[jax.Array]) -> list[jax.Array]:
        """``arrays`` (host copies) in their devices' default memory, each with its sharding,
        at the link's speed; asynchronous. The host arrays are left as they are (a buffer is
        reused only once nothing refers to it; XLA finishes this copy before a later one writes
        there)."""
        # (one jax.device_put of them all: a jitted identity placing them instead keeps each
        # input's host memory space in its output's type, which later computations refuse)
        placed = jax.device_put(list(arrays), [x.sharding.with_memory_kind(_default_kind(x)) for x in arrays])
        with self._lock:
            self._counts.update(returned=sum(int(x.nbytes) for x in arrays))
        return placed

    def stats(self) -> PoolStats:
        """What the pool holds and has done (free bytes counted now, by the reuse rule)."""
        with self._lock:
            free = sum(_nbytes(key) for key, bufs in self._buffers.items()
                       for i in range(len(bufs)) if _only_the_pool_holds(bufs, i))
            c = self._counts
            return PoolStats(self._held, free, sum(map(len, self._buffers.values())), c["hits"], c["misses"],
                             c["unpooled"], c["copied"], c["returned"])

    def release(self) -> int:
        """Lets go of every free buffer (their pinned memory is freed); returns the bytes let go.
        Lent buffers stay the pool's until the pool is dropped."""
        with self._lock:
            return self._drop_free(None)

    # -- under the lock -------------------------------------------------------------------------

    def _take(self, key: _Key) -> jax.Array | None:
        """A free buffer for ``key``, out of the lists (the copy puts its successor back)."""
        bufs = self._buffers.get(key)
        if not bufs:
            return None
        self._buffers.move_to_end(key)
        for i in range(len(bufs)):
            if _only_the_pool_holds(bufs, i):
                return bufs.pop(i)
        return None

    def _reserve(self, keys: list[_Key]) -> list[bool]:
        """Whether each new buffer of ``keys`` is kept: counted as held now if it fits, after
        letting go of free buffers as needed."""
        kept = []
        for key in keys:
            size = _nbytes(key)
            if self._capacity is not None and self._held + size > self._capacity:
                self._drop_free(self._held + size - self._capacity)
            fits = self._capacity is None or self._held + size <= self._capacity
            if fits:
                self._held += size
            kept.append(fits)
        return kept

    def _drop_free(self, need: int | None) -> int:
        """Lets go of free buffers, least recently used signature first, until ``need`` bytes
        are let go (``None``: all of them); returns the bytes let go."""
        dropped = 0
        for key in list(self._buffers):
            bufs = self._buffers[key]
            for i in reversed(range(len(bufs))):
                if need is not None and dropped >= need:
                    return dropped
                if _only_the_pool_holds(bufs, i):
                    del bufs[i]
                    dropped += _nbytes(key)
                    self._held -= _nbytes(key)
            if not bufs:
                del self._buffers[key]
        return dropped

    def _restore(self, taken: list[jax.Array | None], keys: list[_Key], reserved: int) -> None:
        """After a copy that failed: the buffers it took go back unless they were donated."""
        self._held -= reserved
        for buf, key in zip(taken, keys):
            if buf is None:
                continue
            if buf.is_deleted():
                self._held -= _nbytes(key)
            else:
                self._buffers.setdefault(key, []).append(buf)


def _scatter(out: list[Any], where: list[int], values: Sequence[Any]) -> list[Any]:
    for i, v in zip(where, values):
        out[i] = v
    return out


def _nbytes(key: _Key) -> int:
    shape, dtype, _ = key
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def _default_kind(x: jax.Array) -> str:
    device: Any = next(iter(x.sharding.device_set))
    return str(device.default_memory().kind)


def _describe(x: Any) -> str:
    if not isinstance(x, jax.Array):
        return f"a {type(x).__name__}"
    if x.is_deleted():
        return "a deleted array"
    return f"a {x.dtype} array of shape {tuple(x.shape)} in {x.sharding.memory_kind} memory"
