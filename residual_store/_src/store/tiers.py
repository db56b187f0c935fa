"""The memory tiers' budgeted LRUs: which keys a tier holds, their own bytes, their recency, and
the order in which they move down when the tier is over budget. Pure bookkeeping of sizes: the
contexts themselves are the key table's (``table.py``), which decides what moves.

What moves down when a tier is over budget: with a :class:`~residual_store._src.store.schedule.Schedule`
declared, the context needed last (Belady's rule); contexts the schedule does not name count as
needed after all the others, least recently used first. Without one, the least recently used.

A tier counts the bytes of its contexts' own residuals (intermediates and per-context inputs such
as a stage's input activation or the batch); the weights and constants a context holds by
reference are the model's memory and stay where they are.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections import OrderedDict

import numpy as np

from residual_store._src.errors import InvalidArgumentError, StoreFullError
from residual_store._src.store.schedule import Schedule

__all__ = ["MemoryTier", "Spills", "check_capacity", "spill_order", "spills", "would_overflow"]


class MemoryTier:
    """An LRU of keys with their own bytes, under a byte budget (``None``: unbounded).

    Example:
      >>> tier = MemoryTier("device", 100)
      >>> tier.add("a", 60); tier.add("b", 60); tier.touch("a")
      >>> tier.over_budget(), tier.keys()
      (True, ['b', 'a'])
    """

    def __init__(self, name: str, budget: int | None) -> None:
        if budget is not None and (
            not isinstance(budget, numbers.Integral) or isinstance(budget, (bool, np.bool_)) or budget < 0
        ):
            raise InvalidArgumentError(
                f"{name}_budget must be a non-negative int (bytes) or None (unbounded), got "
                f"{type(budget).__name__} {budget!r}"
            )
        self.name = name
        self.budget = None if budget is None else int(budget)
        self._sizes: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.bytes_in = 0  # bytes that entered the tier (put, promoted or spilled into it)
        self.bytes_out = 0  # bytes that moved out of it to another tier (spilled or promoted)

    def __contains__(self, key: str) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def keys(self) -> list[str]:
        """The keys, least recently used first."""
        return list(self._sizes)

    def sizes(self) -> dict[str, int]:
        """Each key's own bytes, least recently used first (a copy)."""
        return dict(self._sizes)

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more would stay within budget once the tier were emptied."""
        return self.budget is None or nbytes <= self.budget

    def bound(self, limit: int | None = None) -> int | None:
        """The bytes the tier may hold: its budget, or ``limit`` (a tighter bound for now) where
        given and tighter; ``None``: unbounded."""
        return self.budget if limit is None else limit if self.budget is None else min(limit, self.budget)

    def over_budget(self, limit: int | None = None) -> bool:
        """Over the budget, or over ``limit`` (a tighter bound for now) where given."""
        bound = self.bound(limit)
        return bound is not None and self.nbytes > bound

    def size_of(self, key: str) -> int | None:
        return self._sizes.get(key)

    def add(self, key: str, nbytes: int) -> None:
        """``key`` enters the tier (the most recently used), holding ``nbytes``."""
        if key in self._sizes:
            self.remove(key)
        self._sizes[key] = nbytes
        self.nbytes += nbytes
        self.bytes_in += nbytes

    def touch(self, key: str) -> None:
        """``key`` was used: the most recently used now."""
        self._sizes.move_to_end(key)

    def remove(self, key: str, *, moved: bool = False) -> int | None:
        """Takes ``key`` out (its bytes, or ``None`` if absent); ``moved``: to another tier
        (counted in ``bytes_out``), not dropped."""
        nbytes = self._sizes.pop(key, None)
        if nbytes is None:
            return None
        self.nbytes -= nbytes
        if moved:
            self.bytes_out += nbytes
        return nbytes


def spill_order(keys: list[str], schedule: Schedule, protect: str | None = None) -> list[str]:
    """``keys`` (least recently used first) in the order they move down, ``protect`` last:
    without a schedule, least recently used first; with one, the least recently used that the
    schedule does not name, then the rest from the one it names furthest ahead."""
    order = [k for k in keys if k != protect]
    if schedule:
        lru = {k: i for i, k in enumerate(order)}

        def rank(k: str) -> tuple[int, int, int]:
            use = schedule.next_use(k)
            return (0, 0, lru[k]) if use is None else (1, -use, lru[k])

        order.sort(key=rank)
    if protect is not None and protect in keys:
        order.append(protect)
    return order


@dataclasses.dataclass(frozen=True)
class Spills:
    """What a rebalance moves, in order: ``down``, keys the device tier moves to host memory;
    ``out``, keys that leave memory (the device tier's where host memory could never hold them,
    and the host tier's, those just moved down included)."""

    down: tuple[str, ...] = ()
    out: tuple[str, ...] = ()


_NO_SPILLS = Spills()


def spills(device: MemoryTier, host: MemoryTier, schedule: Schedule, protect: str | None = None,
           limit: int | None = None) -> Spills:
    """The moves that bring each tier within budget: the device tier's contexts, in
    :func:`spill_order`, move down while it is over its budget (or ``limit``, the device's
    headroom now), each to host memory where its budget could hold it at all, else out of
    memory; then the host tier's leave memory, in the same order, while it is over budget;
    ``protect`` last in each. Pure: the tiers are not changed (the key table applies it).

    Example:
      >>> device, host = MemoryTier("device", 100), MemoryTier("host", 100)
      >>> device.add("a", 60); device.add("b", 60); host.add("c", 60)
      >>> spills(device, host, Schedule())
      Spills(down=('a',), out=('c',))
    """
    used, bound = device.nbytes, device.bound(limit)
    if bound is None or used <= bound:
        if host.budget is None or host.nbytes <= host.budget:
            return _NO_SPILLS  # (the common case: nothing to move)
    on_device, on_host = device.sizes(), host.sizes()  # least recently used first
    down, out = [], []
    while bound is not None and used > bound and on_device:
        victim = spill_order(list(on_device), schedule, protect)[0]
        size = on_device.pop(victim)
        used -= size
        if host.fits(size):
            on_host[victim] = size  # (the most recently used there)
            down.append(victim)
        else:
            out.append(victim)
    used, bound = sum(on_host.values()), host.budget
    while bound is not None and used > bound and on_host:
        victim = spill_order(list(on_host), schedule, protect)[0]
        used -= on_host.pop(victim)
        out.append(victim)
    return Spills(tuple(down), tuple(out))


def would_overflow(device: MemoryTier, host: MemoryTier, schedule: Schedule, key: str, size: int) -> bool:
    """Whether a put of ``size`` bytes under ``key`` would push anything out of host memory,
    simulated in the order the key table's rebalance moves contexts (the put's key last where the
    schedule does not name it); nothing changes."""
    dev_budget, host_budget = device.budget, host.budget
    sizes = {k: s for k in device.keys() if k != key and (s := device.size_of(k)) is not None}
    on_host = sum(s for k in host.keys() if k != key and (s := host.size_of(k)) is not None)
    if dev_budget is not None and size > dev_budget:
        on_host += size
    else:
        sizes[key] = size  # the most recently used
    protect = key if schedule.next_use(key) is None else None
    used = sum(sizes.values())
    for k in spill_order(list(sizes), schedule, protect):
        if dev_budget is None or used <= dev_budget:
            break
        used -= sizes[k]
        on_host += sizes[k]
    return host_budget is not None and on_host > host_budget


def check_capacity(device: MemoryTier, host: MemoryTier, schedule: Schedule, key: str, size: int) -> None:
    """Raises :class:`StoreFullError` if a put of ``size`` bytes under ``key`` would push
    anything out of host memory: a memory-only store refuses it before anything changes."""
    if would_overflow(device, host, schedule, key, size):
        raise StoreFullError(
            f"memory-only store cannot take context {key!r} ({size:,} bytes of intermediates): "
            f"device budget {device.budget}, host budget {host.budget}, "
            f"{device.nbytes + host.nbytes:,} bytes held; give the store a path "
            "to spill to disk, raise a budget, or delete contexts"
        )
