"""A traced split forward rewritten to keep what its ``save`` choice keeps.

``save="auto"``, a checkpoint policy and ``rs.plan`` each choose the values the forward keeps
(:mod:`residual_store._src.remat`, :mod:`residual_store._src.plan`); :func:`keep_fewest_bytes`
carries the choice out: the forward returns those values in place of the residuals ``jax.vjp``
keeps (moving the ones a plan offloads to host memory inside the program), and the backward
brings the offloaded ones back, makes the residuals again from what is kept, and runs the
original backward on them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from residual_store._src import jaxpr_walks, placement, slots
from residual_store._src.lazy import abstract, is_lazy, run_backward, to_device, to_host
from residual_store._src.remat import Chosen, SaveChoice, Stacked, plan

__all__ = ["Kept", "keep_fewest_bytes"]


@dataclasses.dataclass(frozen=True)
class Kept:
    """A split forward rewritten by :func:`keep_fewest_bytes`.

    Attributes:
      forward: ``forward(consts, flat, scratch)``, to jit donating ``scratch``: one host buffer
        per offloaded value (of ``offloaded``' shapes; ``[]``: the forward makes its own, at the
        speed the host pins memory) that it writes the value into and returns.
      slots: where each residual comes from.
      backward: ``backward(residuals, cotangents)``: recomputes what the forward did not keep.
      report: the planner's report (``None`` without a planner).
      offloaded: the offloaded values' shapes and dtypes, in the order ``scratch`` takes them.
      offloaded_outputs: their positions among the forward's outputs, in that order.
    """

    forward: Any
    slots: tuple[slots.Slot, ...]
    backward: Callable[[Sequence[Any], Sequence[Any]], list[Any]]
    report: Any
    offloaded: tuple[jax.ShapeDtypeStruct, ...] = ()
    offloaded_outputs: tuple[int, ...] = ()


def _whole_aval(v: Any) -> jax.ShapeDtypeStruct:
    """A kept value's shape and dtype: a scan's stack whole (iterations first)."""
    if isinstance(v, Stacked):
        return jax.ShapeDtypeStruct((v.length, *v.aval.shape), v.aval.dtype)
    return jax.ShapeDtypeStruct(tuple(v.aval.shape), v.aval.dtype)


def _into(buffer: Any | None, x: Any) -> Any:
    """``x`` in host memory: written into ``buffer`` (donated) where there is one."""
    if buffer is None:
        return to_host(x)
    return jax.lax.dynamic_update_slice(buffer, to_host(x), (np.int32(0),) * x.ndim)


def keep_fewest_bytes(
    traced: Any,
    old_slots: tuple[slots.Slot, ...],
    n_consts: int,
    input_cost: Sequence[bool],
    flat_bwd: Callable[[Sequence[Any], Sequence[Any]], list[Any]],
    save: SaveChoice,
) -> Kept:
    """Rewrites a traced split forward (``jax.stages.Traced``) to keep the values of :func:`plan`
    (or of ``save``'s planner) in place of its computed residuals (see :class:`Kept`). Values
    the planner offloads leave the device inside the forward (a scan's stacks an iteration at
    a time, behind the next iterations' compute) and come back inside the backward (a scan's
    stacks a slice at a time, the next one while the current one is used)."""
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
    # a scan's offloaded stacks move an iteration at a time, inside the scans; the rest whole
    stacks_away = frozenset(p.kept[i] for i in chosen.offloaded if isinstance(p.kept[i], Stacked))
    whole_away = away - {id(v) for v in stacks_away}
    away_out = [k for k, v in enumerate(kept_out) if id(v) in away]  # the scratch buffers' order
    extra = [slots.of_input(j, n_consts) for v in p.kept if (j := p.is_input(v)) is not None]
    new_slots = tuple(dict.fromkeys(given + extra)) + tuple(
        (slots.FROM_OUTPUT, n_kept_out + k) for k in range(len(kept_out))
    )
    at = {slot: k for k, slot in enumerate(new_slots)}
    returned = list(jaxpr.outvars[:n_kept_out]) + kept_out

    def forward(consts: list[Any], flat: list[Any], scratch: list[Any]) -> list[Any]:
        buffers = {id(kept_out[k]): b for k, b in zip(away_out, scratch)}
        into = {v: buffers.get(id(v)) for v in stacks_away}
        values = p.evaluate(closed.consts, [*consts, *flat], returned, into)
        return values[:n_kept_out] + [_into(buffers.get(id(v)), x) if id(v) in whole_away else x
                                      for v, x in zip(kept_out, values[n_kept_out:])]

    def backward(residuals: Sequence[Any], cts: Sequence[Any]) -> list[Any]:
        kept_values = [
            residuals[at[(slots.FROM_OUTPUT, n_kept_out + kept_out.index(v))]] if (j := p.is_input(v)) is None
            else residuals[at[slots.of_input(j, n_consts)]]
            for v in p.kept
        ]
        kept_values = [to_device(x) if id(v) in whole_away else x for v, x in zip(p.kept, kept_values)]
        again = iter(p.rebuild(kept_values, closed.consts, lazy=True, on_host=stacks_away))
        original = [next(again) if src == slots.FROM_OUTPUT else residuals[at[(src, i)]] for src, i in old_slots]
        if not any(map(is_lazy, original)):
            return flat_bwd(original, cts)
        # a rebuilt scan's residuals are made inside the backward's scan, an iteration at a time
        plain = jax.make_jaxpr(flat_bwd)([abstract(r) for r in original], [abstract(c) for c in cts])
        return run_backward(plain, [*original, *cts])

    return Kept(
        forward=forward,
        slots=new_slots,
        backward=backward,
        report=chosen.report,
        offloaded=tuple(_whole_aval(kept_out[k]) for k in away_out),
        offloaded_outputs=tuple(n_kept_out + k for k in away_out),
    )
