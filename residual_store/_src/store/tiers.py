"""The in-memory tiers: device (live ``jax.Array``s) and host memory, each under a budget, and the
policy between them. The tiers decide what moves; they return what leaves host memory (an
eviction) and leave writing it to the store.

What moves down when a tier is over budget: with a :class:`~residual_store._src.store.schedule.Schedule`
declared, the context needed last (Belady's rule); contexts the schedule does not name count as
needed after all the others, least recently used first. Without one, the least recently used.

A tier counts the bytes of its contexts' own residuals (intermediates and per-context inputs such
as a stage's input activation or the batch); the weights and constants a context holds by
reference are the model's memory and stay where they are. The host tier keeps arrays in JAX's
host memory space (``pinned_host``) where the backend has one, so the same code really offloads
on a GPU; otherwise it keeps NumPy copies.
"""

from __future__ import annotations

import numbers
from collections import OrderedDict

import numpy as np

from residual_store._src.context import ResidualContext
from residual_store._src.errors import InvalidArgumentError, StoreFullError
from residual_store._src.store.schedule import Schedule

__all__ = ["MemoryTier", "Tiers", "own_nbytes", "spill_order"]


def own_nbytes(ctx: ResidualContext) -> int:
    """Bytes of a context's own residuals (intermediates and inputs): what offloading it frees.

    Weights and constants are held by reference, belong to the model, and are neither counted
    against budgets nor moved between the memory tiers.
    """
    return ctx.spec.own_nbytes


class MemoryTier:
    """An LRU of contexts with a byte budget (``None``: unbounded) on their own residuals."""

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
        self._entries: OrderedDict[str, tuple[ResidualContext, int]] = OrderedDict()
        self.nbytes = 0
        self.bytes_in = 0  # bytes that entered the tier (put, promoted or spilled into it)
        self.bytes_out = 0  # bytes that moved out of it to another tier (spilled or promoted)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[str]:
        return list(self._entries)

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more would stay within budget once the tier were emptied."""
        return self.budget is None or nbytes <= self.budget

    def over_budget(self, limit: int | None = None) -> bool:
        """Over the budget, or over ``limit`` (a tighter bound for now) where given."""
        bound = self.budget if limit is None else limit if self.budget is None else min(limit, self.budget)
        return bound is not None and self.nbytes > bound

    def size_of(self, key: str) -> int | None:
        entry = self._entries.get(key)
        return None if entry is None else entry[1]

    def add(self, key: str, ctx: ResidualContext) -> None:
        self.remove(key)
        size = own_nbytes(ctx)
        self._entries[key] = (ctx, size)
        self.nbytes += size
        self.bytes_in += size

    def peek(self, key: str) -> ResidualContext | None:
        """The context under ``key``, its recency unchanged."""
        entry = self._entries.get(key)
        return None if entry is None else entry[0]

    def get(self, key: str) -> ResidualContext | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def replace(self, key: str, old: ResidualContext, new: ResidualContext) -> bool:
        """``new`` in place of ``old`` under ``key`` (same bytes, same recency), if ``key`` still
        holds ``old``."""
        entry = self._entries.get(key)
        if entry is None or entry[0] is not old:
            return False
        self._entries[key] = (new, entry[1])
        return True

    def remove(self, key: str, *, moved: bool = False) -> ResidualContext | None:
        """Takes ``key`` out; ``moved``: to another tier (counted in ``bytes_out``), not dropped."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self.nbytes -= entry[1]
        if moved:
            self.bytes_out += entry[1]
        return entry[0]

    def eviction_order(self, schedule: Schedule, protect: str | None = None) -> list[str]:
        """The keys in the order they would move down (see :func:`spill_order`)."""
        return spill_order(list(self._entries), schedule, protect)


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


class Tiers:
    """Device over host: where a context goes, and what the budgets push down.

    The tiers never touch arrays: a context that moves down to the host tier enters it as it is
    and is *owed* a host copy (:meth:`take_owed`), which the store makes outside its lock and
    installs with :meth:`settle`. Until then the host tier counts it (its bytes are the same
    wherever they lie) and a get of it takes it as it is.
    """

    def __init__(self, device_budget: int | None, host_budget: int | None) -> None:
        self.device = MemoryTier("device", device_budget)
        self.host = MemoryTier("host", host_budget)
        self.schedule = Schedule()
        self._owed: list[tuple[str, ResidualContext]] = []

    def _demote(self, key: str, ctx: ResidualContext) -> None:
        self.host.add(key, ctx)
        self._owed.append((key, ctx))

    def take_owed(self) -> list[tuple[str, ResidualContext]]:
        """The contexts that entered the host tier since the last call, still to be copied to
        host memory (each as it entered; see :meth:`settle`)."""
        owed, self._owed = self._owed, []
        return owed

    def settle(self, key: str, entered: ResidualContext, copy: ResidualContext) -> bool:
        """Puts ``copy`` (the host copy of ``entered``) in place of ``entered`` in the host tier,
        if the host tier still holds that very context under ``key``; its recency is kept."""
        return self.host.replace(key, entered, copy)

    def __contains__(self, key: str) -> bool:
        return key in self.device or key in self.host

    def keys(self) -> list[str]:
        return self.device.keys() + self.host.keys()

    @property
    def nbytes(self) -> int:
        return self.device.nbytes + self.host.nbytes

    def forget(self, key: str) -> None:
        self.device.remove(key)
        self.host.remove(key)

    def admit(self, key: str, ctx: ResidualContext) -> bool:
        """Puts ``ctx`` in the highest tier its size fits; whether one took it."""
        size = own_nbytes(ctx)
        if self.device.fits(size):
            self.device.add(key, ctx)
        elif self.host.fits(size):
            self._demote(key, ctx)
        else:
            return False
        return True

    def rebalance(self, protect: str | None = None, device_limit: int | None = None) -> list[tuple[str, ResidualContext]]:
        """Moves contexts down (see :meth:`MemoryTier.eviction_order`; ``protect`` last) until each tier
        is within budget (the device tier also within ``device_limit``, where given); returns the
        contexts pushed out of host memory (or past it), for the store to write or drop."""
        evicted = []
        while self.device.over_budget(device_limit):
            victim = self.device.eviction_order(self.schedule, protect)[0]
            assert victim is not None
            ctx = self.device.remove(victim, moved=True)
            assert ctx is not None
            if self.host.fits(own_nbytes(ctx)):
                self._demote(victim, ctx)
            else:
                evicted.append((victim, ctx))
        while self.host.over_budget():
            victim = self.host.eviction_order(self.schedule, protect)[0]
            assert victim is not None
            ctx = self.host.remove(victim, moved=True)
            assert ctx is not None
            evicted.append((victim, ctx))
        return evicted

    def put_protects(self, key: str) -> bool:
        """Whether a put of ``key`` keeps it on the device before older contexts: without a
        schedule naming it (least recently used goes first); with one, it competes by next use
        like any other (a context needed after all the others goes down at once)."""
        return self.schedule.next_use(key) is None

    def would_overflow(self, key: str, size: int) -> bool:
        """Whether a put of ``size`` bytes under ``key`` would push anything out of host memory
        (simulated in the order :meth:`rebalance` would move contexts; nothing changes): a store
        with no disk below refuses such a put."""
        dev_budget, host_budget = self.device.budget, self.host.budget
        sizes = {k: s for k in self.device.keys() if k != key and (s := self.device.size_of(k)) is not None}
        host = sum(s for k in self.host.keys() if k != key and (s := self.host.size_of(k)) is not None)
        if dev_budget is not None and size > dev_budget:
            host += size
        else:
            sizes[key] = size  # the most recently used
        protect = key if self.put_protects(key) else None
        used = sum(sizes.values())
        for k in spill_order(list(sizes), self.schedule, protect):
            if dev_budget is None or used <= dev_budget:
                break
            used -= sizes[k]
            host += sizes[k]
        return host_budget is not None and host > host_budget

    def check_capacity(self, key: str, size: int) -> None:
        """Raises :class:`StoreFullError` if a put of ``size`` bytes under ``key`` would push
        anything out of host memory: a memory-only store refuses it before anything changes."""
        if self.would_overflow(key, size):
            raise StoreFullError(
                f"memory-only store cannot take context {key!r} ({size:,} bytes of intermediates): "
                f"device budget {self.device.budget}, host budget {self.host.budget}, "
                f"{self.nbytes:,} bytes held; give the store a path "
                "to spill to disk, raise a budget, or delete contexts"
            )
