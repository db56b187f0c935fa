"""The cheapest choices under a byte budget: a multiple-choice knapsack.

Each item (a residual) has a few options, each ``(bytes, seconds)``; :func:`solve` picks one per
item to minimize the total seconds with the total bytes within the budget. Exactly, by dynamic
programming over the Pareto frontier of partial choices (the states no other state beats in
both bytes and seconds), which stays small for the few hundred items of a forward (items of one
layer repeat the same options, and equal states merge); past ``max_states`` states it falls back
to a greedy pass (:func:`greedy`): cheapest bytes saved per second lost first. Both are pure and
deterministic: the same items give the same choices in every process.

Items whose costs are not separate (copies that share the compute they hide behind) are first
combined into one item (:func:`combined`): its options are their combinations' frontier, each
combination costed whole.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable, Sequence

from residual_store._src.errors import InvalidArgumentError

__all__ = ["Solution", "combined", "greedy", "solve"]

Option = tuple[int, float]  # (bytes, seconds)
Linked = tuple[int, float, int]  # (bytes, seconds of its own, bytes that share a cost)

DEFAULT_MAX_STATES = 20_000


@dataclasses.dataclass(frozen=True)
class Solution:
    """The options chosen, one per item.

    Attributes:
      choices: per item, the index of its chosen option.
      nbytes: the chosen options' bytes, summed.
      seconds: their seconds, summed.
      fits: whether ``nbytes`` is within the budget. When no choice fits, the solution is the
        one with the fewest bytes (then the fewest seconds).
      exact: whether it is proven the fastest that fits (the dynamic program), not greedy's.
    """

    choices: tuple[int, ...]
    nbytes: int
    seconds: float
    fits: bool
    exact: bool


def _checked(items: Sequence[Sequence[Option]]) -> list[list[Option]]:
    out = []
    for k, options in enumerate(items):
        opts = [(int(b), float(s)) for b, s in options]
        if not opts or any(b < 0 or not math.isfinite(s) or s < 0 for b, s in opts):
            raise InvalidArgumentError(f"item {k} needs at least one option of bytes >= 0 and finite seconds >= 0")
        out.append(opts)
    return out


def _summed(items: list[list[Option]], choices: Sequence[int], budget: int | None, exact: bool) -> Solution:
    size = sum(items[k][c][0] for k, c in enumerate(choices))
    secs = math.fsum(items[k][c][1] for k, c in enumerate(choices))
    return Solution(tuple(choices), size, secs, budget is None or size <= budget, exact)


def _pick(options: list[Option], key: int) -> int:
    """The option with the fewest seconds (``key`` 1) or bytes (``key`` 0), the other breaking ties."""
    return min(range(len(options)), key=lambda i: (options[i][key], options[i][1 - key], i))


def solve(items: Sequence[Sequence[Option]], budget: int | None, *, max_states: int = DEFAULT_MAX_STATES) -> Solution:
    """One option per item, the fewest total seconds with total bytes within ``budget``
    (``None``: unbounded). Exact where the frontier stays under ``max_states`` states, else
    :func:`greedy`'s.

    Raises:
      InvalidArgumentError: an item without options, or an option with negative bytes or
        seconds.
    """
    opts = _checked(items)
    if budget is None:
        return _summed(opts, [_pick(o, 1) for o in opts], None, True)
    fewest = [_pick(o, 0) for o in opts]
    if sum(o[c][0] for o, c in zip(opts, fewest)) > budget:
        return _summed(opts, fewest, budget, True)  # nothing fits: the fewest bytes, exactly
    # a state: (bytes, seconds, choices as a linked list (option, parent) read back at the end)
    frontier: list[tuple[int, float, tuple | None]] = [(0, 0.0, None)]
    for options in opts:
        grown = [(b + ob, s + os_, (i, chain)) for b, s, chain in frontier
                 for i, (ob, os_) in enumerate(options) if b + ob <= budget]
        grown.sort(key=lambda st: (st[0], st[1]))
        frontier = []
        for st in grown:  # keep what no state of fewer (or as many) bytes beats in seconds
            if not frontier or st[1] < frontier[-1][1]:
                frontier.append(st)
        if len(frontier) > max_states:
            return greedy(opts, budget)
    best = min(frontier, key=lambda st: (st[1], st[0]))
    return _summed(opts, _choices(best[2]), budget, True)


def greedy(items: Sequence[Sequence[Option]], budget: int | None) -> Solution:
    """A fast choice: every item's fastest option, then, while over ``budget``, the change that
    saves bytes at the fewest seconds per byte; then faster options again where they still fit."""
    opts = _checked(items)
    choices = [_pick(o, 1) for o in opts]
    if budget is None:
        return _summed(opts, choices, None, False)
    size = sum(o[c][0] for o, c in zip(opts, choices))
    while size > budget:
        moves = [((s - opts[k][c][1]) / (opts[k][c][0] - b), k, i) for k, c in enumerate(choices)
                 for i, (b, s) in enumerate(opts[k]) if b < opts[k][c][0]]
        if not moves:
            break
        _, k, i = min(moves)
        size -= opts[k][choices[k]][0] - opts[k][i][0]
        choices[k] = i
    improved = True
    while improved:  # room left: take back the best speed per byte that still fits
        improved = False
        moves = [((opts[k][c][1] - s) / max(b - opts[k][c][0], 1), k, i) for k, c in enumerate(choices)
                 for i, (b, s) in enumerate(opts[k]) if s < opts[k][c][1] and size + b - opts[k][c][0] <= budget]
        if moves:
            _, k, i = max(moves)
            size += opts[k][i][0] - opts[k][choices[k]][0]
            choices[k] = i
            improved = True
    return _summed(opts, choices, budget, False)


def combined(
    items: Sequence[Sequence[Linked]], shared: Callable[[int], float], *, max_states: int = 2_000
) -> list[tuple[int, float, tuple[int, ...]]] | None:
    """Items whose options' third numbers add into one cost, ``shared(total)`` seconds (which
    must not fall as the total grows), as one item: per combination of their options no other
    beats in bytes and seconds, ``(bytes, seconds + shared(total), choices)``, fewest bytes
    first. Exact (a frontier in bytes, seconds and shared total); ``None`` past ``max_states``.

    Example:
      >>> combined([[(8, 0.0, 0), (0, 0.0, 8)]] * 2, lambda n: max(0.0, n - 8.0))
      [(0, 8.0, (1, 1)), (8, 0.0, (1, 0))]
    """
    states: list[tuple[int, float, int, tuple | None]] = [(0, 0.0, 0, None)]
    for options in items:
        grown = sorted(((b + ob, s + os_, n + on, (i, chain)) for b, s, n, chain in states
                        for i, (ob, os_, on) in enumerate(options)), key=lambda st: st[:3])
        states, seen = [], _Staircase()
        for st in grown:  # (sorted by bytes: an earlier state beats it if no worse in the others)
            if seen.add(st[1], st[2]):
                states.append(st)
        if len(states) > max_states:
            return None
    whole = sorted(((b, s + shared(n), _choices(chain)) for b, s, n, chain in states), key=lambda w: (w[0], w[1]))
    out: list[tuple[int, float, tuple[int, ...]]] = []
    for w in whole:
        if not out or w[1] < out[-1][1]:
            out.append(w)
    return out


def _choices(chain: tuple | None) -> tuple[int, ...]:
    out: list[int] = []
    while chain is not None:
        out.append(chain[0])
        chain = chain[1]
    return tuple(out[::-1])


class _Staircase:
    """The points ``(seconds, moved)`` no other beats in both, seconds ascending (moved then
    strictly descending): whether a new point is beaten is one search."""

    def __init__(self) -> None:
        self._seconds: list[float] = []
        self._moved: list[int] = []

    def add(self, seconds: float, moved: int) -> bool:
        """Adds the point unless one no worse in both is there; whether it was added."""
        k = bisect.bisect_right(self._seconds, seconds)
        if k and self._moved[k - 1] <= moved:  # (the least moved of those no slower)
            return False
        end = k
        while end < len(self._seconds) and self._moved[end] >= moved:
            end += 1  # (slower and moving as much: beaten by the new point)
        self._seconds[k:end] = [seconds]
        self._moved[k:end] = [moved]
        return True
