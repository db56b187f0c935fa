"""The planner's solver (``plan/solve.py``): the fastest options within a byte budget, proven
against brute force on small random instances; the greedy fallback fits whenever anything does."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import residual_store as rs
from residual_store._src.plan import solve

option = st.tuples(st.integers(0, 50), st.floats(0, 10, allow_nan=False, allow_infinity=False))
items = st.lists(st.lists(option, min_size=1, max_size=3), min_size=0, max_size=6)


def _brute(items, budget):
    """The fewest seconds of any choice within ``budget``, or ``None`` if none fits."""
    best = None
    for choice in itertools.product(*[range(len(o)) for o in items]):
        size = sum(items[k][c][0] for k, c in enumerate(choice))
        secs = math.fsum(items[k][c][1] for k, c in enumerate(choice))
        if size <= budget and (best is None or secs < best):
            best = secs
    return best


def _consistent(items, sol):
    assert len(sol.choices) == len(items)
    assert sol.nbytes == sum(items[k][c][0] for k, c in enumerate(sol.choices))
    assert sol.seconds == pytest.approx(math.fsum(items[k][c][1] for k, c in enumerate(sol.choices)))


@settings(max_examples=300, deadline=None)
@given(items=items, budget=st.integers(0, 150))
def test_internals_the_exact_solver_finds_brute_forces_optimum(items, budget):
    sol = solve.solve(items, budget)
    _consistent(items, sol)
    best = _brute(items, budget)
    if best is None:  # nothing fits: the fewest bytes
        assert not sol.fits and sol.nbytes == sum(min(b for b, _ in o) for o in items)
    else:
        assert sol.fits and sol.exact and sol.nbytes <= budget
        assert sol.seconds == pytest.approx(best, abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(items=items, budget=st.integers(0, 150))
def test_internals_greedy_fits_whenever_anything_does_and_is_never_faster_than_exact(items, budget):
    sol, exact = solve.greedy(items, budget), solve.solve(items, budget)
    _consistent(items, sol)
    assert not sol.exact
    if exact.fits:
        assert sol.fits and sol.nbytes <= budget
        assert sol.seconds >= exact.seconds - 1e-9


def test_internals_a_state_cap_falls_back_to_greedy():
    many = [[(k + 1, 0.0), (0, float(k % 7) + 0.5)] for k in range(40)]
    capped = solve.solve(many, 300, max_states=10)
    assert not capped.exact and capped.fits
    full = solve.solve(many, 300)
    assert full.exact and full.seconds <= capped.seconds


def test_internals_hundreds_of_layer_items_solve_exactly():
    """A forward's candidates repeat per layer: equal states merge, the frontier stays small."""
    layer = [[(4096, 0.0), (0, 3e-4), (0, 1e-4)], [(1024, 0.0), (0, 8e-5)], [(16384, 0.0), (0, 1.2e-3), (0, 2e-3)]]
    many = layer * 100
    sol = solve.solve(many, 100 * 4096)
    assert sol.exact and sol.fits and sol.nbytes <= 100 * 4096
    assert sol.seconds < solve.solve(many, 0).seconds


def test_internals_unbounded_takes_the_fastest_and_bad_options_are_refused():
    sol = solve.solve([[(10, 0.0), (0, 1.0)], [(5, 2.0), (7, 2.0), (0, 3.0)]], None)
    assert sol.choices == (0, 0) and sol.fits
    for bad in ([[]], [[(-1, 0.0)]], [[(1, -0.5)]], [[(1, math.nan)]]):
        with pytest.raises(rs.InvalidArgumentError, match="item 0"):
            solve.solve(bad, 10)


linked = st.lists(st.lists(st.tuples(st.integers(0, 30), st.floats(0, 5, allow_nan=False, allow_infinity=False),
                                     st.integers(0, 30)), min_size=1, max_size=3), min_size=0, max_size=5)


@settings(max_examples=200, deadline=None)
@given(items=linked, hidden=st.integers(0, 60), budget=st.integers(0, 120))
def test_internals_items_sharing_a_cost_combine_into_one_exactly(items, hidden, budget):
    """Combined into one item, items whose third numbers add into a shared cost (copies beside
    compute that hides ``hidden`` of them) solve to brute force's optimum over their
    combinations, each costed whole."""

    def shared(n):
        return max(0.0, n - hidden) / 10

    frontier = solve.combined(items, shared)
    best = None
    for choice in itertools.product(*[range(len(o)) for o in items]):
        size = sum(items[k][c][0] for k, c in enumerate(choice))
        secs = math.fsum(items[k][c][1] for k, c in enumerate(choice)) + shared(sum(items[k][c][2] for k, c in enumerate(choice)))
        if size <= budget and (best is None or secs < best):
            best = secs
    for b, s, choice in frontier:  # each option is its combination's whole cost
        assert b == sum(items[k][c][0] for k, c in enumerate(choice))
        assert s == pytest.approx(math.fsum(items[k][c][1] for k, c in enumerate(choice))
                                  + shared(sum(items[k][c][2] for k, c in enumerate(choice))))
    assert [b for b, _, _ in frontier] == sorted({b for b, _, _ in frontier})  # a frontier: fewer bytes, more seconds
    assert all(s1 > s2 for (_, s1, _), (_, s2, _) in zip(frontier, frontier[1:]))
    fits = [s for b, s, _ in frontier if b <= budget]
    assert (min(fits) if fits else None) == (pytest.approx(best) if best is not None else None)


def test_internals_combining_gives_up_past_its_states():
    items = [[(k, float(k % 3), k), (0, 1.0 + k, 2 * k), (3 * k, 0.5, 0)] for k in range(1, 30)]
    assert solve.combined(items, lambda n: n / 7, max_states=50) is None
