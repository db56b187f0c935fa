"""The declared order of a store's coming gets (``residual_store/_src/store/schedule.py``): how far
ahead each key is needed, gets out of order, and which keys to load ahead within the budget."""

from __future__ import annotations

from residual_store._src.store.schedule import Schedule, loads_ahead

_SIZE = 24  # the own bytes of one small context


def _scheduled(keys: list[str]) -> Schedule:
    schedule = Schedule()
    schedule.declare(keys)
    return schedule


def test_internals_a_schedule_says_how_far_ahead_each_key_is_needed():
    s = Schedule()
    assert not s and s.next_use("a") is None and list(s.upcoming()) == []
    s.declare(["b2", "b1", "b2", "b0"])
    assert s
    assert [s.next_use(k) for k in ("b2", "b1", "b0", "x")] == [0, 1, 3, None]
    assert list(s.upcoming()) == ["b2", "b1", "b0"]
    s.consume("b2")
    assert [s.next_use(k) for k in ("b1", "b2", "b0")] == [0, 1, 2]
    assert list(s.upcoming()) == ["b1", "b2", "b0"]
    s.consume("x")  # not named: nothing changes
    assert [s.next_use(k) for k in ("b1", "b2", "b0")] == [0, 1, 2]
    for k in ("b1", "b2", "b0"):
        s.consume(k)
    assert not s and s.next_use("b2") is None and list(s.upcoming()) == []


def test_internals_a_get_out_of_order_consumes_that_keys_next_use_only():
    s = _scheduled(["a", "b", "c", "b"])
    s.consume("b")  # early: its first use is done, a is still next
    assert s.next_use("a") == 0
    assert s.next_use("a") < s.next_use("c") < s.next_use("b")
    assert list(s.upcoming()) == ["a", "c", "b"]
    s.consume("a")  # the cursor moves past the b already done
    assert (s.next_use("c"), s.next_use("b")) == (0, 1)
    assert list(s.upcoming()) == ["c", "b"]


def test_internals_declaring_a_schedule_replaces_the_last_one():
    s = _scheduled(["a", "b"])
    s.consume("a")
    s.declare(["c", "a"])
    assert (s.next_use("c"), s.next_use("a"), s.next_use("b")) == (0, 1, None)
    assert list(s.upcoming()) == ["c", "a"]
    s.declare([])
    assert not s


def _never(key: str) -> bool:
    return False


def test_internals_loads_ahead_starts_the_next_keys_that_fit_the_device_budget():
    size = _SIZE
    sizes = {k: size for k in "abcd"}
    assert loads_ahead("abcd", sizes.get, _never, 2 * size + size // 2, room=8) == ["a", "b"]
    assert loads_ahead("abcd", sizes.get, _never, None, room=8) == ["a", "b", "c", "d"]
    assert loads_ahead("abcd", sizes.get, _never, None, room=3) == ["a", "b", "c"]
    assert loads_ahead("abcd", sizes.get, _never, 0, room=8) == ["a"]  # the next one, always
    assert loads_ahead("abxd", sizes.get, _never, None, room=8) == ["a", "b"]  # x: not held
    # a key on the device already counts against the budget, and is not started again
    assert loads_ahead("abcd", sizes.get, lambda k: k == "a", 2 * size, room=8) == ["b"]
