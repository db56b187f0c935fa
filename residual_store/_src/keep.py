"""A traced split forward rewritten to keep what its ``save`` choice keeps.

``save="auto"``, a checkpoint policy and ``rs.plan`` each choose the values the forward keeps
(:mod:`residual_store._src.remat`, :mod:`residual_store._src.plan`); :func:`keep_fewest_bytes`
carries the choice out: the forward returns those values in place of the residuals ``jax.vjp``
keeps (moving the ones a plan offloads to host memory inside the program), and the backward
brings the offloaded ones back, makes the residuals again from what is kept, and runs the
original backward on them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from residual_store._src import jaxpr_walks, placement, slots
from residual_store._src.remat import Chosen, SaveChoice, abstract, is_lazy, plan, run_backward

__all__ = ["keep_fewest_bytes", "to_device", "to_host"]


def to_host(x: Any) -> Any:
    """``x`` moved to the host memory its device pins, inside a traced program."""
    return jax.device_put(x, jax.memory.Space.Host)


def to_device(x: Any) -> Any:
    """``x`` in its device's own memory, inside a traced program (nothing where it is there)."""
    return jax.device_put(x, jax.memory.Space.Device)


def keep_fewest_bytes(
    traced: Any,
    old_slots: tuple[slots.Slot, ...],
    n_consts: int,
    input_cost: Sequence[bool],
    flat_bwd: Callable[[Sequence[Any], Sequence[Any]], list[Any]],
    save: SaveChoice,
) -> tuple[Any, tuple[slots.Slot, ...], Callable[[Sequence[Any], Sequence[Any]], list[Any]], Any]:
    """Rewrites a traced split forward (``jax.stages.Traced``) to keep the values of :func:`plan`
    (or of ``save``'s planner) in place of its computed residuals: the new forward (jitted),
    its slots, a backward that recomputes the residuals from them before running ``flat_bwd``,
    and the planner's report (``None`` without one). Values the planner offloads leave the
    device inside the forward and come back inside the backward."""
    assert save.recomputable is not None
    closed = jaxpr_walks.inline_calls(traced.jaxpr, [placement.abstract(a) for a in traced.jaxpr.in_avals])
    jaxpr = closed.jaxpr
    computed = [k for k, (src, _) in enumerate(old_slots) if src == slots.FROM_OUTPUT]
    n_kept_out = len(jaxpr.outvars) - len(computed)  # outputs and aux come first
    residuals = [jaxpr.outvars[old_slots[k][1]] for k in computed]
    given = [slot for slot in old_slots if slot[0] != slots.FROM_OUTPUT]
    if save.choose is None:
        chosen = Chosen(plan(jaxpr, residuals, input_cost, save.recomputable))
    else:  # the planner also counts the inputs the context holds whatever it chooses
        held = [jaxpr.invars[n_consts + i] for src, i in given if src == slots.FROM_INPUT]
        chosen = save.choose(jaxpr, residuals, input_cost, held)
    p = chosen.remat
    kept_out = [v for v in p.kept if p.is_input(v) is None]
    away = {id(p.kept[i]) for i in chosen.offloaded}  # invariant: offloaded values are computed
    extra = [slots.of_input(j, n_consts) for v in p.kept if (j := p.is_input(v)) is not None]
    new_slots = tuple(dict.fromkeys(given + extra)) + tuple(
        (slots.FROM_OUTPUT, n_kept_out + k) for k in range(len(kept_out))
    )
    at = {slot: k for k, slot in enumerate(new_slots)}
    returned = list(jaxpr.outvars[:n_kept_out]) + kept_out

    def forward(consts: list[Any], flat: list[Any]) -> list[Any]:
        values = p.evaluate(closed.consts, [*consts, *flat], returned)
        return values[:n_kept_out] + [to_host(x) if id(v) in away else x for v, x in zip(kept_out, values[n_kept_out:])]

    def backward(residuals: Sequence[Any], cts: Sequence[Any]) -> list[Any]:
        kept_values = [
            residuals[at[(slots.FROM_OUTPUT, n_kept_out + kept_out.index(v))]] if (j := p.is_input(v)) is None
            else residuals[at[slots.of_input(j, n_consts)]]
            for v in p.kept
        ]
        kept_values = [to_device(x) if id(v) in away else x for v, x in zip(p.kept, kept_values)]
        again = iter(p.rebuild(kept_values, closed.consts, lazy=True))
        original = [next(again) if src == slots.FROM_OUTPUT else residuals[at[(src, i)]] for src, i in old_slots]
        if not any(map(is_lazy, original)):
            return flat_bwd(original, cts)
        # a rebuilt scan's residuals are made inside the backward's scan, an iteration at a time
        plain = jax.make_jaxpr(flat_bwd)([abstract(r) for r in original], [abstract(c) for c in cts])
        return run_backward(plain, [*original, *cts])

    return jax.jit(forward), new_slots, backward, chosen.report
