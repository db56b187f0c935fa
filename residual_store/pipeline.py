"""Pipeline schedules as timelines of steps: 1F1B and a zero-bubble ZB-H1-style order.

A pipeline of ``stages`` runs ``microbatches`` through each stage's forward (F), and back through
its backward. 1F1B runs each backward whole (B and W together, two time units); zero-bubble
schedules split it into **B**, the input gradient the previous stage waits for, and **W**, the
weight gradient, which waits for a bubble (``split.backward(ctx, ct, now=...)`` and
``rs.backward(later)``). :func:`timeline` lays the steps out in time units (F, B, W: one each),
each stage running one step at a time as soon as what it needs is done:

- ``F`` of stage ``s`` needs ``F`` of stage ``s - 1`` (same microbatch);
- ``B`` needs ``F`` of the same stage and ``B`` of stage ``s + 1``;
- ``W`` needs ``B`` of the same stage and microbatch.

A stage keeps at most ``stages - s`` microbatches between their F and their B (1F1B's memory),
prefers B over F over W, and (ZB-H1) runs a W only when nothing else is ready or when it already
holds ``stages`` pending W's: the W's fill the bubbles, and the bubble of ``(stages - 1)`` times
F + B + W of 1F1B shrinks to ``(stages - 1)`` times F + B - W. The steps come out in an order that respects every
dependency, so one process can run them one after another and get the pipeline's gradients.

Example:
  >>> steps = timeline(stages=2, microbatches=3, split_backward=True)
  >>> [s.label for s in steps if s.stage == 1]
  ['F1', 'B1', 'F2', 'B2', 'W1', 'F3', 'B3', 'W2', 'W3']
  >>> makespan(steps), makespan(timeline(2, 3, split_backward=False))
  (10, 12)
"""

from __future__ import annotations

import dataclasses
from typing import Literal

__all__ = ["Step", "makespan", "timeline"]

Op = Literal["F", "B", "W", "BW"]


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of a pipeline schedule.

    Attributes:
      op: ``"F"`` (forward), ``"B"`` (input gradient), ``"W"`` (weight gradient) or ``"BW"`` (a
        whole backward, as 1F1B runs it).
      stage: the stage that runs it (0 first).
      microbatch: which microbatch (0 first).
      start, duration: when it runs, in time units (F, B, W: 1; BW: 2).
    """

    op: Op
    stage: int
    microbatch: int
    start: int
    duration: int

    @property
    def label(self) -> str:
        """``"F3"``, ``"B2"``, ``"W1"``: the op and the microbatch counted from 1."""
        return f"{'B' if self.op == 'BW' else self.op}{self.microbatch + 1}"

    @property
    def end(self) -> int:
        return self.start + self.duration


def timeline(stages: int, microbatches: int, *, split_backward: bool) -> list[Step]:
    """The steps of 1F1B (``split_backward=False``) or of the ZB-H1-style order, by start time
    (stage order among steps that start together); see the module docstring."""
    if stages < 1 or microbatches < 1:
        raise ValueError(f"a pipeline needs at least one stage and one microbatch, got {stages} and {microbatches}")
    done: dict[tuple[str, int, int], int] = {}  # (op, stage, mb) -> end time
    next_f = [0] * stages
    next_b = [0] * stages
    pending_w: list[list[int]] = [[] for _ in range(stages)]
    busy_until = [0] * stages
    steps: list[Step] = []
    total = stages * microbatches * (3 if split_backward else 2)
    t = 0
    while len(steps) < total:
        for s in range(stages):
            if busy_until[s] > t:
                continue
            step = _choose(s, t, stages, microbatches, split_backward, done, next_f, next_b, pending_w)
            if step is None:
                continue
            steps.append(step)
            busy_until[s] = step.end
            done[("B" if step.op == "BW" else step.op, s, step.microbatch)] = step.end
            if step.op == "F":
                next_f[s] += 1
            elif step.op in ("B", "BW"):
                next_b[s] += 1
                if step.op == "B":
                    pending_w[s].append(step.microbatch)
            else:
                pending_w[s].remove(step.microbatch)
        t += 1
    return sorted(steps, key=lambda st: (st.start, st.stage))


def _ready(done: dict[tuple[str, int, int], int], key: tuple[str, int, int], t: int) -> bool:
    return key in done and done[key] <= t


def _choose(
    s: int,
    t: int,
    stages: int,
    microbatches: int,
    split: bool,
    done: dict[tuple[str, int, int], int],
    next_f: list[int],
    next_b: list[int],
    pending_w: list[list[int]],
) -> Step | None:
    in_flight = next_f[s] - next_b[s]
    limit = stages - s
    b_mb = next_b[s]
    can_b = b_mb < next_f[s] and (s == stages - 1 or _ready(done, ("B", s + 1, b_mb), t)) and _ready(done, ("F", s, b_mb), t)
    f_mb = next_f[s]
    can_f = f_mb < microbatches and in_flight < limit and (s == 0 or _ready(done, ("F", s - 1, f_mb), t))
    w_ready = [m for m in pending_w[s] if _ready(done, ("B", s, m), t)]
    if split and w_ready and len(pending_w[s]) >= stages:  # W held long enough: run the oldest
        return Step("W", s, w_ready[0], t, 1)
    if can_b:
        return Step("B", s, b_mb, t, 1) if split else Step("BW", s, b_mb, t, 2)
    if can_f:
        return Step("F", s, f_mb, t, 1)
    if split and w_ready:
        return Step("W", s, w_ready[0], t, 1)
    return None


def makespan(steps: list[Step]) -> int:
    """Time units from the first step's start to the last one's end."""
    return max(st.end for st in steps) - min(st.start for st in steps)
