"""A forward's residuals planned: per value the backward needs, keep, offload or recompute.

:func:`choose` runs in two passes over the forward's jaxpr, both carried out by the min-cut of
``save="auto"`` (:func:`residual_store._src.remat.plan`):

1. The values ``save="auto"`` keeps (the fewest bytes from which cheap, pure operations make
   every residual again) are the candidates; each may be kept, offloaded (where the device has
   a link) or, where a matrix product or convolution makes it, recomputed
   (:mod:`~residual_store._src.plan.cost`). :func:`~residual_store._src.plan.solve.solve` picks the
   fastest choices within the budget.
2. The products chosen for recomputing are let into the cut, which finds the fewest bytes to
   keep for them (it may keep a product after all where its inputs cost more); the values it
   keeps are then chosen between keep and offload, exactly, under the same budget.

The budget is the device bytes a pipeline's contexts may hold together: ``microbatches``
contexts of a signature share it. The inputs a context holds (a stage's input activation, the
batch; never weights) count against it: kept, or spilled. A spilled value stays in the context
as a kept one does: the store the pipeline puts contexts in, at the same budget, moves it. The report, :class:`Plan`, is what
``rs.explain`` prints: every choice with its bytes and seconds, and the predicted totals.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Sequence
from typing import Any

from residual_store._src import remat
from residual_store._src.plan import cost, solve
from residual_store._src.plan.profile import DeviceProfile

__all__ = ["Decision", "Plan", "choose"]


@dataclasses.dataclass(frozen=True)
class Decision:
    """What a plan does with one value its backward needs.

    Attributes:
      name: where the value comes from (an operation and its line; an input's position).
      shape: its shape (a scan's stacked value: iterations first).
      dtype: its dtype's name.
      nbytes: its bytes in one context.
      choice: ``"keep"`` (on the device), ``"spill"`` (in the context, which a store at the
        budget moves to host memory and back), ``"offload"`` (to host memory inside the forward,
        back inside the backward) or ``"recompute"`` (in the backward).
      seconds: the time the choice adds to a step, predicted (0 for ``"keep"``).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    choice: cost.Choice
    seconds: float


@dataclasses.dataclass(frozen=True)
class Plan:
    """A split's plan for one signature (``rs.explain`` prints it).

    Attributes:
      decisions: one per value the planner weighed, kept inputs first.
      device_bytes: the bytes one context keeps on the device (its kept values and inputs).
      spill_bytes: the bytes one context holds on the device after its forward that a store at
        the budget moves to host memory and back (its spilled values and inputs).
      host_bytes: the bytes one context holds in host memory (its offloaded values).
      seconds: the time the plan adds to a microbatch's step, predicted: recomputing (cheap
        operations included), the store's copies of what is spilled and the in-program copies'
        unhidden part.
      budget: the device bytes one context may hold (the plan's ``device_budget`` shared by its
        ``microbatches``), or ``None`` (unbounded).
      fits: whether ``device_bytes`` is within ``budget``; when nothing fits, the plan holds
        the fewest device bytes it can.
      exact: whether the solver proved its choice the fastest that fits (else greedy's).
      profile: the device profile it was planned for.
    """

    decisions: tuple[Decision, ...]
    device_bytes: int
    spill_bytes: int
    host_bytes: int
    seconds: float
    budget: int | None
    fits: bool
    exact: bool
    profile: DeviceProfile

    def count(self, choice: cost.Choice) -> int:
        """How many decisions are ``choice``."""
        return sum(d.choice == choice for d in self.decisions)


def _key(v: Any) -> Any:
    """One kept value's identity across two plans of one jaxpr (a scan's stacked values are
    new objects in each plan; the body value and the scan they stack are not)."""
    return ("stacked", v.eqn, _key(v.value)) if isinstance(v, remat.Stacked) else v


def _shape_dtype(v: Any) -> tuple[tuple[int, ...], str]:
    aval = v.aval
    shape = tuple(int(n) for n in aval.shape)
    if isinstance(v, remat.Stacked):
        shape = (v.length, *shape)
    return shape, str(aval.dtype)


def _own_inputs(jaxpr: Any, base: remat.RematPlan, input_cost: Sequence[bool], held: Sequence[Any]) -> list[Any]:
    """The inputs a context holds as its own (weights and constants aside): those it holds
    whatever the plan, and those the cut keeps; once each, in order."""
    position = {v: j for j, v in enumerate(jaxpr.invars)}
    found = dict.fromkeys([*held, *(v for v in base.kept if base.is_input(v) is not None)])
    return [v for v in found if input_cost[position[v]]]


def _solved(
    held: Sequence[Sequence[cost.Option]], candidates: Sequence[cost.Candidate], budget: int | None,
    profile: DeviceProfile,
) -> tuple[bool, list[cost.Option]]:
    """The fastest options within ``budget``, one per input (``held``: each input's placements)
    then one per candidate, each with its share of its copies' time in its seconds; and whether
    the solver proved them the fastest. The candidates of one scan body are one item of the
    knapsack: their copies share the compute they hide behind (:func:`cost.copy_seconds`). A
    value outside the scans is an item of its own, its copies beside compute of their own time
    (:func:`cost.move_seconds`): it is copied whole, wherever the program puts the copy."""
    units: list[tuple[list[int], list[tuple[int, float, tuple[int, ...]]]]] = []
    exact = True
    for group, members in _groups(candidates).items():
        if group is None:
            units += [([k], _alone(candidates[k], profile)) for k in members]
            continue
        beside = candidates[members[0]].beside
        linked = [[(o.nbytes, o.seconds, o.moved) for o in candidates[k].options] for k in members]
        frontier = solve.combined(linked, functools.partial(_copies, profile=profile, beside=beside))
        if frontier is None:  # too many combinations: each its share of the compute, separately
            exact = False
            frontier = _apart(candidates, members, profile)
        units.append((members, frontier))
    items = [[(o.nbytes, o.seconds) for o in options] for options in held]
    solution = solve.solve([*items, *([(b, s) for b, s, _ in frontier] for _, frontier in units)], budget)
    chosen: list[cost.Option | None] = [None] * len(candidates)
    for (members, frontier), pick in zip(units, solution.choices[len(held):]):
        picked = [candidates[k].options[i] for k, i in zip(members, frontier[pick][2])]
        first = candidates[members[0]]
        timed = ([dataclasses.replace(picked[0], seconds=picked[0].seconds + _moved_apart(picked[0], profile))]
                 if first.group is None else _with_copies(picked, profile, first.beside))
        for k, option in zip(members, timed):
            chosen[k] = option
    placed = [options[i] for options, i in zip(held, solution.choices)]
    return exact and solution.exact, [*placed, *(o for o in chosen if o is not None)]


def _groups(candidates: Sequence[cost.Candidate]) -> dict[int | None, list[int]]:
    """The candidates' positions by :attr:`cost.Candidate.group`, in order."""
    out: dict[int | None, list[int]] = {}
    for k, c in enumerate(candidates):
        out.setdefault(c.group, []).append(k)
    return out


def _moved_apart(option: cost.Option, profile: DeviceProfile) -> float:
    return (cost.move_seconds(option.moved, profile) or 0.0) if option.moved else 0.0


def _alone(candidate: cost.Candidate, profile: DeviceProfile) -> list[tuple[int, float, tuple[int, ...]]]:
    """A value outside the scans as an item of its own: its options, an offload's copies
    costed apart."""
    return [(o.nbytes, o.seconds + _moved_apart(o, profile), (i,)) for i, o in enumerate(candidate.options)]


def _copies(moved: int, profile: DeviceProfile, beside: float) -> float:
    return (cost.copy_seconds(moved, profile, beside) or 0.0) if moved else 0.0


def _apart(
    candidates: Sequence[cost.Candidate], members: Sequence[int], profile: DeviceProfile
) -> list[tuple[int, float, tuple[int, ...]]]:
    """A group's candidates costed apart, each beside its share (by bytes) of the compute, as
    the group's options: the greedy pass's choices at five budgets from the fewest bytes to the
    most, a frontier (fewest bytes first)."""
    total = sum(candidates[k].nbytes for k in members) or 1
    items = [[(o.nbytes, o.seconds + _copies(o.moved, profile, c.beside * c.nbytes / total)) for o in c.options]
             for c in (candidates[k] for k in members)]
    least = sum(min(b for b, _ in options) for options in items)
    most = sum(max(b for b, _ in options) for options in items)
    found = [solve.greedy(items, least + (most - least) * q // 4) for q in range(5)]
    out: list[tuple[int, float, tuple[int, ...]]] = []
    for f in sorted(found, key=lambda f: (f.nbytes, f.seconds)):
        if not out or f.seconds < out[-1][1]:
            out.append((f.nbytes, f.seconds, f.choices))
    return out


def _with_copies(options: Sequence[cost.Option], profile: DeviceProfile, beside: float) -> list[cost.Option]:
    """``options`` of one group, each offload's seconds with its share (by bytes) of the
    group's copy time."""
    moved = sum(o.moved for o in options)
    copies = _copies(moved, profile, beside)
    return [dataclasses.replace(o, seconds=o.seconds + copies * o.moved / moved) if o.moved else o for o in options]


def _placed_only(candidates: Iterable[cost.Candidate]) -> list[cost.Candidate]:
    """The candidates with their placements only (the recomputing is decided)."""
    return [dataclasses.replace(c, options=tuple(o for o in c.options if o.choice != "recompute")) for c in candidates]


def choose(
    jaxpr: Any,
    residuals: Sequence[Any],
    input_cost: Sequence[bool],
    held: Sequence[Any] = (),
    *,
    budget: int | None,
    profile: DeviceProfile,
    offload: bool = True,
) -> remat.Chosen:
    """The plan of the open ``jaxpr`` (a forward) for ``residuals`` (some of its variables)
    under ``budget`` device bytes per context; ``input_cost[i]``: whether input ``i`` is the
    context's own (else a weight or a constant, held by reference); ``held``: inputs (variables)
    the context holds whatever the plan chooses. See the module docstring."""
    base = remat.plan(jaxpr, residuals, input_cost, cost.relabels)
    inputs = _own_inputs(jaxpr, base, input_cost, held)
    placements = [cost.placements(cost.nbytes(v.aval), profile, offload=False) for v in inputs]
    first = list(cost.candidates(base, profile, offload))
    exact_first, options = _solved(placements, first, budget, profile)
    again = {id(eqn) for c, o in zip(first, options[len(inputs):]) if o.choice == "recompute" for eqn in c.products}
    planned = base
    if again:  # the cut, with the chosen products let in
        planned = remat.plan(jaxpr, residuals, input_cost, lambda eqn: cost.relabels(eqn) or id(eqn) in again)
    second = _placed_only(cost.candidates(planned, profile, offload))
    exact_second, placed = _solved(placements, second, budget, profile)
    choice = {_key(c.value): o for c, o in zip(second, placed[len(inputs):])}
    offloaded = frozenset(i for i, v in enumerate(planned.kept) if (o := choice.get(_key(v))) and o.choice == "offload")
    sizes = [cost.nbytes(v.aval) for v in inputs] + [c.nbytes for c in second]
    device = sum(o.nbytes for o in placed)
    report = Plan(
        decisions=_decisions(jaxpr, inputs, first, second, placed),
        device_bytes=device,
        spill_bytes=sum(n for n, o in zip(sizes, placed) if o.choice == "spill"),
        host_bytes=sum(n for n, o in zip(sizes, placed) if o.choice == "offload"),
        seconds=cost.recomputed_seconds(planned, profile) + sum(o.seconds for o in placed),
        budget=budget,
        fits=budget is None or device <= budget,
        exact=exact_first and exact_second,
        profile=profile,
    )
    return remat.Chosen(planned, offloaded, report)


def _decisions(
    jaxpr: Any,
    inputs: Sequence[Any],
    first: Sequence[cost.Candidate],
    second: Sequence[cost.Candidate],
    placed: Sequence[cost.Option],
) -> tuple[Decision, ...]:
    """One decision per own input, per value kept (placed), per value made again."""
    position = {v: j for j, v in enumerate(jaxpr.invars)}
    out = [Decision(f"input {position[v]}", *_shape_dtype(v), cost.nbytes(v.aval), o.choice, o.seconds)
           for v, o in zip(inputs, placed)]
    out += [Decision(c.name, *_shape_dtype(c.value), c.nbytes, o.choice, o.seconds)
            for c, o in zip(second, placed[len(inputs):])]
    kept = {_key(c.value) for c in second}
    for c in first:  # made again: its share of the recompute time is its products'
        if _key(c.value) not in kept:
            again = next((o for o in c.options if o.choice == "recompute"), cost.Option("recompute", 0, 0.0))
            out.append(Decision(c.name, *_shape_dtype(c.value), c.nbytes, "recompute", again.seconds))
    return tuple(out)
