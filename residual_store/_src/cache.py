"""A bounded least-recently-used cache of compiled executables, and its statistics.

One :class:`ExecutableCache` belongs to each :class:`~residual_store.Split`; it maps an input
signature to the compiled forward and (once asked for) backward. Compiles are counted here so
that ``Split.cache_info()`` can report them without reading JAX internals.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any, Generic, NamedTuple, TypeVar

from cachetools import Cache, LRUCache

from residual_store._src.errors import InvalidArgumentError

__all__ = ["CacheInfo", "ExecutableCache", "DEFAULT_CACHE_SIZE"]

DEFAULT_CACHE_SIZE = 64

V = TypeVar("V")


class CacheInfo(NamedTuple):
    """Statistics of a split's executable cache.

    Attributes:
      forward_compiles: forward executables compiled (one per new signature, again after eviction).
      backward_compiles: backward executables compiled, resumed contexts' included.
      hits: forward calls served by a cached executable (calls of the split, as
        ``functools.lru_cache`` counts calls of the function it caches; backwards are counted
        in ``backward_compiles``).
      misses: forward calls that had to trace and compile.
      currsize: signatures whose compiled executables the split keeps now: those its cache
        holds, and those whose backward it rebuilt and compiled for a context it never ran the
        forward of (a resumed context, :meth:`Split.backward`).
      maxsize: the most signatures the cache keeps; the least recently used is dropped beyond it
        (with its backward's executables). A resumed context's backward is kept outside this
        bound, one per signature.
    """

    forward_compiles: int
    backward_compiles: int
    hits: int
    misses: int
    currsize: int
    maxsize: int


class _EvictionsSeen(LRUCache):
    """An LRU map that keeps what it evicts, for the caller to hand on outside its lock."""

    def __init__(self, maxsize: int) -> None:
        super().__init__(maxsize)
        self.evicted: list[Any] = []

    def peek(self, key: Hashable) -> Any:
        """The value of ``key`` (``None`` if absent) without marking it recently used."""
        return Cache.__getitem__(self, key) if key in self else None

    def popitem(self) -> tuple[Hashable, Any]:
        key, value = super().popitem()
        self.evicted.append(value)
        return key, value


class ExecutableCache(Generic[V]):
    """A thread-safe LRU map with hit/miss counters; ``on_evict`` sees each dropped value."""

    def __init__(self, maxsize: int, on_evict: Callable[[V], None] | None = None) -> None:
        if not isinstance(maxsize, int) or isinstance(maxsize, bool) or maxsize < 1:
            raise InvalidArgumentError(f"cache_size must be a positive int, got {maxsize!r}")
        self._data = _EvictionsSeen(maxsize)
        self._lock = threading.Lock()
        self._on_evict = on_evict
        self.hits = 0
        self.misses = 0

    @property
    def maxsize(self) -> int:
        return int(self._data.maxsize)

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: Hashable) -> V | None:
        """The cached value (marked most recently used), or ``None``; counts a hit or a miss."""
        with self._lock:
            value = self._data.get(key)
            if value is None:
                self.misses += 1
                return None
            self.hits += 1
            return value

    def peek(self, key: Hashable) -> V | None:
        """The cached value or ``None``, without counting or reordering."""
        with self._lock:
            return self._data.peek(key)

    def put(self, key: Hashable, value: V) -> None:
        """Inserts ``value``, evicting the least recently used entries beyond ``maxsize``."""
        with self._lock:
            self._data[key] = value
            evicted, self._data.evicted = self._data.evicted, []
        if self._on_evict is not None:
            for old in evicted:
                self._on_evict(old)

    def values(self) -> list[V]:
        with self._lock:
            return list(self._data.values())
