"""A bounded least-recently-used cache of compiled executables, and its statistics.

One :class:`ExecutableCache` belongs to each :class:`~residual_store.Split`; it maps an input
signature to the compiled forward and (once asked for) backward. Compiles are counted here so
that ``Split.cache_info()`` can report them without reading JAX internals.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, NamedTuple, TypeVar

__all__ = ["CacheInfo", "ExecutableCache", "DEFAULT_CACHE_SIZE"]

DEFAULT_CACHE_SIZE = 64

V = TypeVar("V")


class CacheInfo(NamedTuple):
    """Statistics of a split's executable cache.

    Attributes:
      forward_compiles: forward executables compiled (one per new signature, again after eviction).
      backward_compiles: backward executables compiled.
      hits: forward calls served by a cached executable.
      misses: forward calls that had to trace and compile.
      currsize: signatures now cached.
      maxsize: the most signatures kept; the least recently used is dropped beyond it.
    """

    forward_compiles: int
    backward_compiles: int
    hits: int
    misses: int
    currsize: int
    maxsize: int


class ExecutableCache(Generic[V]):
    """A thread-safe LRU map with hit/miss counters; ``on_evict`` sees each dropped value."""

    def __init__(self, maxsize: int, on_evict: Callable[[V], None] | None = None) -> None:
        if not isinstance(maxsize, int) or isinstance(maxsize, bool) or maxsize < 1:
            raise ValueError(f"cache_size must be a positive int, got {maxsize!r}")
        self._maxsize = maxsize
        self._data: OrderedDict[Hashable, V] = OrderedDict()
        self._lock = threading.Lock()
        self._on_evict = on_evict
        self.hits = 0
        self.misses = 0

    @property
    def maxsize(self) -> int:
        return self._maxsize

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: Hashable) -> V | None:
        """The cached value (marked most recently used), or ``None``; counts a hit or a miss."""
        with self._lock:
            value = self._data.get(key)
            if value is None:
                self.misses += 1
                return None
            self._data.move_to_end(key)
            self.hits += 1
            return value

    def peek(self, key: Hashable) -> V | None:
        """The cached value or ``None``, without counting or reordering."""
        with self._lock:
            return self._data.get(key)

    def put(self, key: Hashable, value: V) -> None:
        """Inserts ``value``, evicting the least recently used entries beyond ``maxsize``."""
        evicted = []
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self._maxsize:
                evicted.append(self._data.popitem(last=False)[1])
        if self._on_evict is not None:
            for value in evicted:
                self._on_evict(value)

    def values(self) -> list[V]:
        with self._lock:
            return list(self._data.values())
