"""``residual_store.pipeline.timeline``: 1F1B and the ZB-H1-style order, checked step by step."""

from __future__ import annotations

import pytest

from residual_store.pipeline import makespan, timeline


@pytest.mark.parametrize("stages,microbatches", [(1, 3), (2, 3), (4, 8), (4, 16), (3, 2)])
@pytest.mark.parametrize("split", [False, True])
def test_every_step_once_after_what_it_needs(stages, microbatches, split):
    steps = timeline(stages, microbatches, split_backward=split)
    ops = ("F", "B", "W") if split else ("F", "BW")
    assert sorted((s.op, s.stage, s.microbatch) for s in steps) == sorted(
        (op, st, mb) for op in ops for st in range(stages) for mb in range(microbatches)
    )
    end = {("B" if s.op == "BW" else s.op, s.stage, s.microbatch): s.end for s in steps}
    for s in steps:
        needs = []
        if s.op == "F" and s.stage > 0:
            needs.append(("F", s.stage - 1, s.microbatch))
        if s.op in ("B", "BW"):
            needs.append(("F", s.stage, s.microbatch))
            if s.stage < stages - 1:
                needs.append(("B", s.stage + 1, s.microbatch))
        if s.op == "W":
            needs.append(("B", s.stage, s.microbatch))
        assert all(end[n] <= s.start for n in needs), (s, needs)
    for st in range(stages):  # one step at a time per stage, and at most stages - s in flight
        mine = sorted((s for s in steps if s.stage == st), key=lambda s: s.start)
        assert all(a.end <= b.start for a, b in zip(mine, mine[1:]))
        in_flight = 0
        for s in mine:
            in_flight += {"F": 1, "B": -1, "BW": -1, "W": 0}[s.op]
            assert in_flight <= stages - st
    starts = [(s.start, s.stage) for s in steps]
    assert starts == sorted(starts)  # in an order one process can run them in


def test_the_zero_bubble_order_shrinks_the_bubble():
    # 1F1B: m (F + B + W) + (p - 1)(F + B + W); ZB-H1: (p - 1)(F + B - W) of bubble
    for p, m in ((2, 3), (4, 8), (4, 16)):
        assert makespan(timeline(p, m, split_backward=False)) == 3 * m + 3 * (p - 1)
        assert makespan(timeline(p, m, split_backward=True)) == 3 * m + (p - 1)


def test_bad_sizes():
    with pytest.raises(ValueError):
        timeline(0, 4, split_backward=True)
    with pytest.raises(ValueError):
        timeline(2, 0, split_backward=False)
