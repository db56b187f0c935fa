"""The memory tiers' budgeted LRUs (``residual_store/_src/store/tiers.py``): budgets, bytes in and
out, recency, the order keys move down in (``spill_order``) and what a rebalance moves (``spills``), with and
without a schedule.
Pure bookkeeping of sizes: no context, no thread, no device."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import residual_store as rs
from residual_store._src.store.schedule import Schedule
from residual_store._src.store.tiers import MemoryTier, Spills, spill_order, spills

_SIZE = 24  # the own bytes of one small context


def _tier(name: str, budget: int | None, *keys: str) -> MemoryTier:
    tier = MemoryTier(name, budget)
    for key in keys:
        tier.add(key, _SIZE)
    return tier


def _scheduled(keys: list[str]) -> Schedule:
    schedule = Schedule()
    schedule.declare(keys)
    return schedule



@pytest.mark.parametrize("budget", [-1, 1.5, True, np.bool_(False), "10", 10.0])
def test_internals_a_tier_refuses_a_budget_that_is_not_a_non_negative_int(budget: Any):
    with pytest.raises(rs.InvalidArgumentError, match="host_budget"):
        MemoryTier("host", budget)


def test_internals_a_tier_takes_an_int_budget_of_any_integral_type_or_none():
    assert MemoryTier("device", np.int64(7)).budget == 7 and type(MemoryTier("device", np.int64(7)).budget) is int
    assert MemoryTier("device", 0).budget == 0
    assert MemoryTier("device", None).budget is None


def test_internals_a_tier_counts_each_keys_bytes():
    tier = MemoryTier("host", None)
    small, big = 12, 48
    tier.add("s", small)
    tier.add("b", big)
    assert tier.size_of("s") == small and tier.size_of("b") == big
    assert tier.size_of("missing") is None
    assert tier.nbytes == tier.bytes_in == small + big
    assert len(tier) == 2 and "s" in tier and "missing" not in tier
    # added again under the same key: counted once in what it holds, twice in what came in
    tier.add("s", small)
    assert tier.nbytes == small + big
    assert tier.bytes_in == 2 * small + big
    assert tier.bytes_out == 0


def test_internals_a_tier_counts_bytes_out_only_for_what_moved_to_another_tier():
    tier = MemoryTier("device", None)
    a, b = 12, 24
    tier.add("a", a)
    tier.add("b", b)
    assert tier.remove("a", moved=True) == a
    assert (tier.nbytes, tier.bytes_out) == (b, a)
    assert tier.remove("b") == b  # dropped (deleted), not moved
    assert (tier.nbytes, tier.bytes_out) == (0, a)
    assert tier.remove("b", moved=True) is None and tier.bytes_out == a
    assert tier.bytes_in == a + b


def test_internals_fits_asks_the_budget_not_what_the_tier_holds():
    size = _SIZE
    tier = _tier("device", 2 * size, "a", "b")  # full
    assert tier.fits(2 * size) and tier.fits(0)
    assert not tier.fits(2 * size + 1)
    assert MemoryTier("device", None).fits(10**15)
    assert not MemoryTier("device", 0).fits(1)


def test_internals_over_budget_is_over_the_budget_or_a_tighter_limit():
    size = _SIZE
    tier = _tier("device", 2 * size, "a", "b")
    assert tier.nbytes == 2 * size and not tier.over_budget()
    assert tier.over_budget(limit=2 * size - 1)
    assert not tier.over_budget(limit=10 * size)  # a limit never loosens the budget
    tier.add("c", _SIZE)
    assert tier.over_budget() and tier.over_budget(limit=10 * size)
    unbounded = _tier("device", None, "a", "b")
    assert not unbounded.over_budget()
    assert unbounded.over_budget(limit=size) and not unbounded.over_budget(limit=2 * size)


def test_internals_a_tier_is_least_recently_used_first_and_size_of_does_not_touch():
    tier = _tier("device", None, "a", "b", "c")
    assert tier.keys() == ["a", "b", "c"]
    tier.touch("a")
    assert tier.size_of("b") == _SIZE
    assert tier.keys() == ["b", "c", "a"]
    tier.add("b", _SIZE)  # added again: the most recently used
    assert tier.keys() == ["c", "a", "b"]
    assert spill_order(tier.keys(), Schedule()) == ["c", "a", "b"]


def test_internals_without_a_schedule_the_least_recently_used_leaves_first_and_protect_last():
    tier = _tier("device", None, "a", "b", "c")
    tier.touch("a")
    assert spill_order(tier.keys(), Schedule(), protect="b") == ["c", "a", "b"]
    assert spill_order(tier.keys(), Schedule(), protect="c") == ["b", "a", "c"]
    assert spill_order(tier.keys(), Schedule(), protect="absent") == ["b", "c", "a"]


def test_internals_with_a_schedule_the_context_needed_last_leaves_first():
    tier = _tier("device", None, "a", "b", "c")  # a least recently used
    schedule = _scheduled(["a", "c", "b", "a"])  # next uses: a 0, c 1, b 2
    assert spill_order(tier.keys(), schedule) == ["b", "c", "a"]
    schedule.consume("a")  # a's next use is now the last one
    assert spill_order(tier.keys(), schedule) == ["a", "b", "c"]
    assert spill_order(tier.keys(), schedule, protect="a") == ["b", "c", "a"]


def test_internals_unscheduled_contexts_leave_before_scheduled_ones_least_recently_used_first():
    tier = _tier("device", None, "s1", "u1", "s2", "u2", "u3")
    tier.touch("u1")  # LRU order now: s1, s2, u2, u3, u1
    schedule = _scheduled(["s1", "s2"])
    assert spill_order(tier.keys(), schedule) == ["u2", "u3", "u1", "s2", "s1"]
    assert spill_order(tier.keys(), schedule, protect="u2") == ["u3", "u1", "s2", "s1", "u2"]
    # the order is spill_order's on the tier's keys, least recently used first
    assert spill_order(tier.keys(), schedule, "s2") == ["u2", "u3", "u1", "s1", "s2"]


def test_internals_spills_bring_each_tier_within_budget_without_changing_them():
    """The rebalance's decision, alone: the device tier's least recently used move down to host
    memory until it fits its budget (or the tighter limit), the host tier's leave memory until
    it fits its own, those just moved down included; ``protect`` moves last. Nothing changes."""
    device = _tier("device", 2 * _SIZE, "a", "b", "c", "d")
    host = _tier("host", 3 * _SIZE, "h")
    assert spills(device, host, Schedule()) == Spills(down=("a", "b"), out=())
    assert spills(device, host, Schedule(), limit=_SIZE) == Spills(down=("a", "b", "c"), out=("h",))
    assert spills(device, host, Schedule(), protect="a") == Spills(down=("b", "c"), out=())
    assert device.keys() == ["a", "b", "c", "d"] and host.keys() == ["h"] and device.nbytes == 4 * _SIZE
    small = _tier("host", _SIZE // 2)  # could never hold one: the device's leave memory
    assert spills(device, small, Schedule()) == Spills(down=(), out=("a", "b"))
    tight = _tier("host", _SIZE, "h")  # holds one: the oldest leaves, the one moved down stays
    assert spills(device, tight, Schedule()) == Spills(down=("a", "b"), out=("h", "a"))


def test_internals_spills_follow_the_schedule_both_tiers():
    """With a schedule the context needed last moves first, from the device tier and from host
    memory alike (Belady); unscheduled ones go before any it names."""
    device = _tier("device", _SIZE, "a", "b", "c")
    host = _tier("host", _SIZE, "h")
    got = spills(device, host, _scheduled(["c", "a", "b", "h"]))
    assert got == Spills(down=("b", "a"), out=("h", "b"))
    assert spills(device, _tier("host", None), _scheduled(["c", "a", "b"])) == Spills(down=("b", "a"), out=())
