"""The declared order of a store's coming gets (``store.schedule(keys)``).

A pipeline knows its whole order before its first forward: F1..F8 then B8..B1, 1F1B, ZB-H1.
Given that order, a store knows for every context it holds when it is needed next, so it can
spill the one needed last (Belady's rule: the fewest reloads for a given memory) and load ahead
the ones needed soon. A :class:`Schedule` answers "when is this key needed next" and advances
as keys are got; a get out of the declared order consumes that key's next occurrence and
nothing else (the schedule is advice: it never changes what a get returns).

Example:
  >>> s = Schedule()
  >>> s.declare(["b2", "b1", "b2"])
  >>> s.next_use("b1"), s.next_use("b2"), s.next_use("x")
  (1, 0, None)
  >>> s.consume("b2"); list(s.upcoming())
  ['b1', 'b2']
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence

__all__ = ["Schedule", "loads_ahead"]


class Schedule:
    """Positions of the coming gets, by key (not thread-safe: the store holds its lock)."""

    def __init__(self) -> None:
        self._order: list[str] = []
        self._cursor = 0  # every position before it is consumed
        self._done: set[int] = set()  # consumed positions at or after the cursor
        self._positions: dict[str, deque[int]] = {}

    def declare(self, keys: Sequence[str]) -> None:
        """Replaces the schedule with ``keys`` (already validated), in the order they will be got."""
        self._order = list(keys)
        self._cursor = 0
        self._done = set()
        self._positions = {}
        for i, key in enumerate(self._order):
            self._positions.setdefault(key, deque()).append(i)

    def __bool__(self) -> bool:
        return bool(self._positions)

    def next_use(self, key: str) -> int | None:
        """Where ``key`` is next needed, counted in declared positions from the first one not yet
        got (0: next), or ``None`` if the schedule does not name it again. Positions got early
        (out of order) still count until the gets before them are done: the numbers order keys by
        their next use, which is what eviction needs, not a count of the gets in between."""
        q = self._positions.get(key)
        return None if not q else q[0] - self._cursor

    def consume(self, key: str) -> None:
        """Records a get of ``key``: its next occurrence is done (none: nothing changes)."""
        q = self._positions.get(key)
        if not q:
            return
        self._done.add(q.popleft())
        if not q:
            del self._positions[key]
        while self._cursor in self._done:
            self._done.discard(self._cursor)
            self._cursor += 1

    def upcoming(self) -> Iterator[str]:
        """The keys still to be got, each once, in the order of their next use."""
        seen: set[str] = set()
        for i in range(self._cursor, len(self._order)):
            key = self._order[i]
            if i not in self._done and key not in seen:
                seen.add(key)
                yield key


def loads_ahead(
    upcoming: Iterable[str],
    size_of: Callable[[str], int | None],
    held: Callable[[str], bool],
    budget: int | None,
    room: int,
) -> list[str]:
    """The keys to start loading ahead, from ``upcoming`` (the schedule's next keys, in order):
    the very next one, then as many as fit ``budget`` (the device budget; ``None``: unbounded)
    together with it, at most ``room`` new loads, stopping at the first key the store does not
    hold (``size_of`` is ``None``: its room is its put's). A key ``held`` already (on the device
    or loading) counts against the budget but is not started again."""
    used, start = 0, list[str]()
    for i, key in enumerate(upcoming):
        size = size_of(key)
        if size is None:
            break
        if i > 0 and budget is not None and used + size > budget:
            break
        used += size
        if held(key):
            continue
        if len(start) >= room:
            break
        start.append(key)
    return start
