"""Where a residual came from: the equation that produced each output of a jaxpr.

:func:`output_origins` follows an output of the forward's jaxpr back to the equation that
computed it, looking inside the jaxprs that higher-order equations hold (``jit``, ``scan``,
``checkpoint``, ``cond``, ``while``, custom derivative calls), and records an :class:`Origin`:
the primitive, a ``checkpoint_name`` label, the user's source line, the higher-order primitives
around it, the equation's name stack and the nearest weight (or other differentiated input)
feeding it. :mod:`residual_store._src.names` turns an ``Origin`` into words.

What it reads of a jaxpr (source lines, name stacks, which inner jaxpr gives an equation's
outputs) is JAX's, through the shims of :mod:`residual_store._src._jax_internals` and their
assumptions (``EQN_SOURCE``, ``NAME_STACK``, ``SUBJAXPR_OUTVARS``, ``NAME_PRIMITIVE``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import Any

from residual_store._src._jax_internals import (
    NAME_PRIMITIVE,
    body_for_outputs,
    equation_line,
    is_dropped,
    is_literal,
    name_scopes,
)

__all__ = ["Origin", "output_origins"]


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where one output of a jaxpr was produced.

    ``primitive`` is the producing primitive's name (``None`` when the output is an input of the
    outermost jaxpr or a literal), ``label`` a ``checkpoint_name`` label if one was applied,
    ``file``/``line`` the user's source line (see :func:`residual_store._src._jax_internals.user_line`), ``scopes`` the higher-order
    primitives it sits in (outermost first), ``invar`` the index of the outer input it forwards,
    if it does; ``per_iteration`` marks a loop's inputs stacked over its iterations (e.g. a scan
    carry). ``name_stack`` is the producing equation's name stack from the outermost jaxpr down
    (only its scopes: ``jax.named_scope``/``named_call`` names, Flax linen module names, never
    transformations such as ``jvp``); ``nearest_input`` the index of the outermost jaxpr's input,
    among the ones :func:`output_origins` was asked to look for, that feeds the value in the
    fewest equations (``None`` if none does).
    """

    primitive: str | None
    label: str | None = None
    file: str | None = None
    line: int | None = None
    scopes: tuple[str, ...] = ()
    invar: int | None = None
    per_iteration: bool = False
    name_stack: tuple[str, ...] = ()
    nearest_input: int | None = None


# Value-preserving ops that remat and partial evaluation insert around saved values: a residual
# produced by one of them is named after its operand (e.g. the checkpoint_name label).
_TRANSPARENT_PRIMITIVES = frozenset({"reduce_precision", "optimization_barrier", "copy", "copy_p", "device_put"})
_LOOP_PRIMITIVES = frozenset({"scan", "while", "fori_loop"})


def _inputs_map_one_to_one(eqn: Any, body: Any) -> bool:
    """Whether input *j* of ``body`` is the equation's input *j* (``SUBJAXPR_OUTVARS``): a call,
    not a loop or a branch, whose body takes every input."""
    name = eqn.primitive.name
    return name not in _LOOP_PRIMITIVES and name != "cond" and len(body.invars) == len(eqn.invars)


# The nearest input of a value: (rank, equations away, index of the outermost jaxpr's input);
# rank 0 inputs (weights) win over rank 1 (other differentiated inputs) at any distance.
_Nearest = tuple[int, int, int]


class _Frame:
    """One jaxpr as reached from the outermost: its producers, the nearest inputs of its
    variables (from ``seeds``, one per invar) and the scopes of the equations holding it."""

    def __init__(self, jaxpr: Any, seeds: Sequence[_Nearest | None], prefix: tuple[str, ...]) -> None:
        self.jaxpr = jaxpr
        self.seeds = tuple(seeds)
        self.prefix = prefix
        self._producers: dict[Any, Any] | None = None
        self._nearest: dict[Any, _Nearest] | None = None

    def producer(self, var: Any) -> Any | None:
        if self._producers is None:
            self._producers = {v: eqn for eqn in self.jaxpr.eqns for v in eqn.outvars}
        return self._producers.get(var)

    def nearest(self, atom: Any) -> _Nearest | None:
        """The nearest seeded input feeding ``atom``: one pass over the equations in order, each
        output taking its closest operand's (ties: the first operand), one equation further."""
        if is_literal(atom):
            return None
        if self._nearest is None:
            best: dict[Any, _Nearest] = {v: s for v, s in zip(self.jaxpr.invars, self.seeds) if s is not None}
            for eqn in self.jaxpr.eqns:
                found = None
                for v in eqn.invars:
                    if is_literal(v):
                        continue
                    c = best.get(v)
                    if c is not None and (found is None or c[:2] < found[:2]):
                        found = c
                if found is not None:
                    step = (found[0], found[1] + 1, found[2])
                    for v in eqn.outvars:
                        if not is_dropped(v):
                            best[v] = step
            self._nearest = best
        return self._nearest.get(atom)

    def nearest_index(self, atom: Any) -> int | None:
        found = self.nearest(atom)
        return None if found is None else found[2]


def _inner_frame(frames: dict[tuple[Any, ...], _Frame], outer: _Frame, eqn: Any, body: Any) -> _Frame:
    """The frame of ``body`` held by ``eqn``: its invars fed by the equation's last inputs
    (``SUBJAXPR_OUTVARS``: after the loop's or branch's own leading operands)."""
    n = len(body.invars)
    feeding = list(eqn.invars[len(eqn.invars) - n :]) if n <= len(eqn.invars) else []
    seeds = tuple(outer.nearest(v) for v in feeding) if feeding else (None,) * n
    prefix = outer.prefix + name_scopes(eqn)
    key = (id(body), seeds, prefix)
    frame = frames.get(key)
    if frame is None:
        frame = frames[key] = _Frame(body, seeds, prefix)
    return frame


def _origin_of(
    frames: dict[tuple[Any, ...], _Frame],
    frame: _Frame,
    atom: Any,
    scopes: tuple[str, ...],
    depth: int = 0,
) -> Origin:
    """The :class:`Origin` of ``atom`` in ``frame``: its producing equation, followed through
    value-preserving ops, into the inner jaxpr that gives a higher-order equation's outputs and,
    where that forwards an input, back out to what feeds it; ``scopes`` are the higher-order
    primitives passed on the way in."""
    if is_literal(atom):
        return Origin(primitive="literal", scopes=scopes)
    if depth > 64:
        return Origin(primitive=None, scopes=scopes)
    eqn = frame.producer(atom)
    if eqn is None:
        index = next((i for i, v in enumerate(frame.jaxpr.invars) if v is atom), None)
        return Origin(primitive=None, scopes=scopes, invar=index)
    name = eqn.primitive.name
    here: dict[str, Any] = {"name_stack": frame.prefix + name_scopes(eqn), "nearest_input": frame.nearest_index(atom)}
    if name == NAME_PRIMITIVE:
        file, line = equation_line(eqn)
        return Origin(name, label=str(eqn.params.get("name")), file=file, line=line, scopes=scopes, **here)
    if name in _TRANSPARENT_PRIMITIVES and len(eqn.invars) == len(eqn.outvars):
        return _origin_of(frames, frame, eqn.invars[eqn.outvars.index(atom)], scopes, depth + 1)
    body = body_for_outputs(eqn)
    if body is not None:
        inner_frame = _inner_frame(frames, frame, eqn, body)
        inner = _origin_of(frames, inner_frame, body.outvars[eqn.outvars.index(atom)], scopes + (name,), depth + 1)
        if inner.invar is not None and _inputs_map_one_to_one(eqn, body):
            return _origin_of(frames, frame, eqn.invars[inner.invar], scopes, depth + 1)
        if inner.primitive is not None:
            if inner.file is None:  # e.g. inside jnp's own jitted helpers: use the call site
                file, line = equation_line(eqn)
                inner = dataclasses.replace(inner, file=file, line=line)
            return inner
        if inner.invar is not None and name in _LOOP_PRIMITIVES:
            file, line = equation_line(eqn)
            return Origin(name, label=None, file=file, line=line, scopes=scopes, per_iteration=True, **here)
    file, line = equation_line(eqn)
    return Origin(name, file=file, line=line, scopes=scopes, **here)


def output_origins(
    closed_jaxpr: Any,
    indices: Sequence[int],
    weights: Collection[int] = (),
    inputs: Collection[int] = (),
) -> list[Origin]:
    """The :class:`Origin` of each listed output of ``closed_jaxpr``, looking inside nested jaxprs.

    ``weights`` and ``inputs`` are indices of ``closed_jaxpr``'s inputs that
    :attr:`Origin.nearest_input` may name: the nearest weight feeding a value, or, where no
    weight does, the nearest of ``inputs``.
    """
    jaxpr = closed_jaxpr.jaxpr
    weights, inputs = frozenset(weights), frozenset(inputs)
    seeds = [
        (0, 0, i) if i in weights else (1, 0, i) if i in inputs else None for i in range(len(jaxpr.invars))
    ]
    frames: dict[tuple[Any, ...], _Frame] = {}
    top = _Frame(jaxpr, seeds, ())
    return [_origin_of(frames, top, jaxpr.outvars[i], ()) for i in indices]
