"""The B/W split of a backward: which operations run now, which later, and what passes between.

Zero-bubble pipeline schedules run each stage's backward in two parts: **B**, the gradient with
respect to the stage's input, which the previous stage waits for, and **W**, the weight
gradients, deferred to fill bubbles. Given the jaxpr of a backward and which of its outputs B
returns, :func:`partition` splits its equations:

- B runs every equation that a B output depends on, and nothing else;
- W runs every other equation that a W output depends on, never one that B ran;
- the *cut*: the values W reads that B has (the backward's own inputs, and values B computed:
  the cotangents arriving at weight products) are handed from B to W.

Residuals only B reads are not in the cut, so B frees them. Higher-order equations whose outputs
both parts need are split recursively: ``jit`` and ``checkpoint`` bodies in place, and ``scan``
bodies (a ``lax.scan`` over layers) into a B scan that also emits, per iteration, the values its
W scan reads, and a W scan over those. Every other equation is indivisible: it runs in B when B
needs any of its outputs. Equations with effects that no output needs run in B.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from residual_store._src.partition import partition
  >>> def bwd(w, x, ct):                       # the backward of x @ w: dx now, dw later
  ...     return ct @ w.T, x.T @ ct
  >>> args = (jnp.ones((3, 2)), jnp.ones((4, 3)), jnp.ones((4, 2)))
  >>> p = partition(jax.make_jaxpr(bwd)(*args), b_outputs=(True, False))
  >>> [p.inputs_of_w, p.n_computed]            # W reads x and ct; B computes nothing for it
  [(1, 2), 0]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from residual_store._src import _jax_internals

__all__ = ["Partition", "partition"]

_B, _W, _SPLIT, _DEAD = "b", "w", "split", "dead"


@dataclasses.dataclass(frozen=True)
class _Level:
    """The partition of one (open) jaxpr.

    ``where`` says per equation which part runs it; ``subs`` holds the partition of each split
    equation; ``cut`` lists, in order, the values B computes at this level that W reads;
    ``b_in``/``w_in`` say per input of the jaxpr whether B/W reads it.
    """

    jaxpr: Any
    where: tuple[str, ...]
    subs: dict[int, _Sub]
    cut: tuple[Any, ...]
    b_in: tuple[bool, ...]
    w_in: tuple[bool, ...]
    w_out_mask: tuple[bool, ...]

    @property
    def n_cut(self) -> int:
        """How many values B hands to W from this level and the levels inside it."""
        return len(self.cut) + sum(s.n_cut for s in self.subs.values())


@dataclasses.dataclass(frozen=True)
class _Sub:
    """A split higher-order equation: its body's partition and which outputs each part gives."""

    level: _Level
    b_out: tuple[bool, ...]  # outputs of the equation B computes
    w_out: tuple[bool, ...]  # outputs W computes
    consts: tuple[Any, ...]  # the body's own constants
    scan: _jax_internals.ScanParts | None  # None: a call (jit, checkpoint) evaluated in place
    b_carry: tuple[bool, ...] = ()  # scan: carries B runs
    w_carry: tuple[bool, ...] = ()  # scan: carries W runs
    carry_cut: tuple[int, ...] = ()  # scan: B carries whose per-iteration value W reads

    @property
    def n_cut(self) -> int:
        return len(self.carry_cut) + self.level.n_cut

    def reads_b(self) -> list[bool]:
        """Per input of the equation, whether B reads it."""
        if self.scan is None:
            return list(self.level.b_in)
        nc, nk = self.scan.num_consts, self.scan.num_carry
        return list(self.level.b_in[:nc]) + list(self.b_carry) + list(self.level.b_in[nc + nk :])

    def reads_w(self) -> list[bool]:
        """Per input of the equation, whether W reads it: a W carry's initial value included;
        a B carry's values reach W through the cut."""
        if self.scan is None:
            return list(self.level.w_in)
        nc, nk = self.scan.num_consts, self.scan.num_carry
        return list(self.level.w_in[:nc]) + list(self.w_carry) + list(self.level.w_in[nc + nk :])


def _vars(values: Sequence[Any]) -> list[Any]:
    return [v for v in values if not _jax_internals.is_literal(v)]


def _plan(jaxpr: Any, b_out: Sequence[bool], w_out: Sequence[bool]) -> _Level:
    """Partitions ``jaxpr`` so that B computes the outputs marked ``b_out`` and W those marked
    ``w_out``, walking the equations backwards (what is needed is known before its producer)."""
    need_b: set[Any] = set()
    need_w: set[Any] = set()
    for v, b, w in zip(jaxpr.outvars, b_out, w_out):
        if not _jax_internals.is_literal(v):
            if b:
                need_b.add(v)
            if w:
                need_w.add(v)
    where: list[str] = [_DEAD] * len(jaxpr.eqns)
    subs: dict[int, _Sub] = {}
    from_b: set[Any] = set()  # values B computes
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        ob = tuple(v in need_b for v in eqn.outvars)
        ow = tuple(v in need_w and v not in need_b for v in eqn.outvars)
        sub = _plan_sub(eqn, ob, ow) if any(ob) and any(ow) else None
        if sub is not None:
            where[i] = _SPLIT
            subs[i] = sub
            need_b.update(_vars([v for v, r in zip(eqn.invars, sub.reads_b()) if r]))
            need_w.update(_vars([v for v, r in zip(eqn.invars, sub.reads_w()) if r]))
            from_b.update(v for v, b in zip(eqn.outvars, sub.b_out) if b)
        elif any(ob) or (not any(ow) and eqn.effects):
            where[i] = _B
            need_b.update(_vars(eqn.invars))
            from_b.update(eqn.outvars)
        elif any(ow):
            where[i] = _W
            need_w.update(_vars(eqn.invars))
    cut = tuple(v for eqn, w in zip(jaxpr.eqns, where) if w in (_B, _SPLIT)
                for v in eqn.outvars if v in from_b and v in need_w)
    return _Level(
        jaxpr=jaxpr,
        where=tuple(where),
        subs=subs,
        cut=tuple(dict.fromkeys(cut)),
        b_in=tuple(v in need_b for v in jaxpr.invars),
        w_in=tuple(v in need_w for v in jaxpr.invars),
        w_out_mask=tuple(bool(w) for w in w_out),
    )


def _plan_sub(eqn: Any, ob: tuple[bool, ...], ow: tuple[bool, ...]) -> _Sub | None:
    scan = _jax_internals.scan_parts(eqn)
    if scan is not None:
        return _plan_scan(scan, ob, ow)
    body = _jax_internals.call_body(eqn)
    if body is None:
        return None
    jaxpr, consts = body
    level = _plan(jaxpr, ob, ow)
    return _Sub(level, ob, ow, consts, None)


def _plan_scan(scan: _jax_internals.ScanParts, ob: tuple[bool, ...], ow: tuple[bool, ...]) -> _Sub:
    """A scan's partition: the carries each part runs are closed under what its body reads (a
    carry B's body reads is a B carry; one only W reads is a W carry), found by iterating."""
    nc, nk = scan.num_consts, scan.num_carry
    b_carry = list(ob[:nk])
    w_carry = [w and not b for w, b in zip(ow[:nk], b_carry)]
    while True:
        level = _plan(scan.body, b_carry + list(ob[nk:]), w_carry + list(ow[nk:]))
        reads_b = level.b_in[nc : nc + nk]
        reads_w = level.w_in[nc : nc + nk]
        new_b = [b or r for b, r in zip(b_carry, reads_b)]
        new_w = [(w or r) and not b for w, r, b in zip(w_carry, reads_w, new_b)]
        if new_b == b_carry and new_w == w_carry:
            break
        b_carry, w_carry = new_b, new_w
    carry_cut = tuple(k for k in range(nk) if b_carry[k] and level.w_in[nc + k])
    b_out = tuple(b_carry) + ob[nk:]
    w_out = tuple(w_carry) + tuple(w and not b for w, b in zip(ow[nk:], ob[nk:]))
    return _Sub(level, b_out, w_out, scan.consts, scan, tuple(b_carry), tuple(w_carry), carry_cut)


# ----------------------------------------------------------------------------------------------
# Running the parts


def _read(env: dict[Any, Any], v: Any) -> Any:
    return v.val if _jax_internals.is_literal(v) else env[v]


def _placed(n: int, *parts: tuple[Sequence[int], Sequence[Any]]) -> list[Any]:
    """A list of ``n`` with each part's values at its indices, ``None`` elsewhere."""
    out: list[Any] = [None] * n
    for indices, values in parts:
        for i, value in zip(indices, values):
            out[i] = value
    return out


def _run(
    level: _Level,
    part: str,
    consts: Sequence[Any],
    args: Sequence[Any],
    split: Callable[[_Sub, Any, dict[Any, Any]], None],
    bound: dict[Any, Any] | None = None,
) -> dict[Any, Any]:
    """Runs the equations of ``level`` that ``part`` (B or W) runs, on the inputs it reads
    (``args``: anything for the others) and the values ``bound`` already (W: what B cut at this
    level), handing each split equation to ``split(sub, eqn, env)``; the environment."""
    reads = level.b_in if part == _B else level.w_in
    env: dict[Any, Any] = dict(zip(level.jaxpr.constvars, consts))
    env.update((v, x) for v, x, r in zip(level.jaxpr.invars, args, reads) if r)
    env.update(bound or {})
    for i, (eqn, where) in enumerate(zip(level.jaxpr.eqns, level.where)):
        if where == part:
            env.update(zip(eqn.outvars, _jax_internals.bind_equation(eqn, [_read(env, v) for v in eqn.invars])))
        elif where == _SPLIT:
            split(level.subs[i], eqn, env)
    return env


def _run_b(level: _Level, consts: Sequence[Any], args: Sequence[Any]) -> tuple[dict[Any, Any], list[Any]]:
    """Runs B's equations of ``level``; the environment and the cut values, this level's then
    each split equation's."""
    nested: list[Any] = []

    def split(sub: _Sub, eqn: Any, env: dict[Any, Any]) -> None:
        invals = [_read(env, v) if r else None for v, r in zip(eqn.invars, sub.reads_b())]
        outs, cut = _run_b_sub(sub, invals)
        env.update((v, x) for v, x, b in zip(eqn.outvars, outs, sub.b_out) if b)
        nested.extend(cut)

    env = _run(level, _B, consts, args, split)
    return env, [env[v] for v in level.cut] + nested


def _run_b_sub(sub: _Sub, invals: list[Any]) -> tuple[list[Any], list[Any]]:
    """B's part of a split equation: its outputs (``None`` where W computes them) and its cut."""
    level = sub.level
    if sub.scan is None:
        env, cut = _run_b(level, sub.consts, invals)
        return [_read(env, v) if b else None for v, b in zip(level.jaxpr.outvars, sub.b_out)], cut
    s = sub.scan
    nc, nk = s.num_consts, s.num_carry
    consts, init, xs = invals[:nc], invals[nc : nc + nk], invals[nc + nk :]
    carries = [k for k in range(nk) if sub.b_carry[k]]
    ys_b = [j for j, b in enumerate(sub.b_out[nk:]) if b]

    def body(carry: list[Any], x: list[Any]) -> tuple[list[Any], tuple[list[Any], list[Any]]]:
        full_carry = _placed(nk, (carries, carry))
        env, cut = _run_b(level, s.consts, consts + full_carry + x)
        out = level.jaxpr.outvars
        new_carry = [_read(env, out[k]) for k in carries]
        ys = [_read(env, out[nk + j]) for j in ys_b]
        return new_carry, (ys, [full_carry[k] for k in sub.carry_cut] + cut)

    final, (ys, cut) = jax.lax.scan(
        body, [init[k] for k in carries], xs, length=s.length, reverse=s.reverse, unroll=s.unroll
    )
    return _placed(len(sub.b_out), (carries, final), ([nk + j for j in ys_b], ys)), cut


def _run_w(level: _Level, consts: Sequence[Any], args: Sequence[Any], cut: Iterator[Any]) -> dict[Any, Any]:
    """Runs W's equations of ``level`` on the inputs W reads (``args``) and the values B cut
    (taken from ``cut`` in the order :func:`_run_b` gave them); the environment."""
    own = [next(cut) for _ in level.cut]

    def split(sub: _Sub, eqn: Any, env: dict[Any, Any]) -> None:
        invals = [_read(env, v) if r else None for v, r in zip(eqn.invars, sub.reads_w())]
        outs = _run_w_sub(sub, invals, [next(cut) for _ in range(sub.n_cut)])
        env.update((v, x) for v, x, w in zip(eqn.outvars, outs, sub.w_out) if w)

    return _run(level, _W, consts, args, split, bound=dict(zip(level.cut, own)))


def _run_w_sub(sub: _Sub, invals: list[Any], cut: list[Any]) -> list[Any]:
    level = sub.level
    if sub.scan is None:
        env = _run_w(level, sub.consts, invals, iter(cut))
        return [_read(env, v) if w else None for v, w in zip(level.jaxpr.outvars, sub.w_out)]
    s = sub.scan
    nc, nk = s.num_consts, s.num_carry
    consts, init, xs = invals[:nc], invals[nc : nc + nk], invals[nc + nk :]
    carries = [k for k in range(nk) if sub.w_carry[k]]
    ys_w = [j for j, w in enumerate(sub.w_out[nk:]) if w]
    n_carry_cut = len(sub.carry_cut)

    def body(carry: list[Any], x: tuple[list[Any], list[Any]]) -> tuple[list[Any], list[Any]]:
        xs_here, cut_here = x
        full_carry = _placed(nk, (carries, carry), (sub.carry_cut, cut_here[:n_carry_cut]))
        env = _run_w(level, s.consts, consts + full_carry + xs_here, iter(cut_here[n_carry_cut:]))
        out = level.jaxpr.outvars
        return [_read(env, out[k]) for k in carries], [_read(env, out[nk + j]) for j in ys_w]

    final, ys = jax.lax.scan(
        body, [init[k] for k in carries], (xs, cut), length=s.length, reverse=s.reverse, unroll=s.unroll
    )
    return _placed(len(sub.w_out), (carries, final), ([nk + j for j in ys_w], ys))


# ----------------------------------------------------------------------------------------------
# The public face


@dataclasses.dataclass(frozen=True)
class Partition:
    """A backward's jaxpr split into B and W (see the module docstring).

    Attributes:
      b_outputs: per output of the backward, whether B returns it (W returns the others).
      inputs_of_w: the backward's inputs W reads, by index: handed over as they are.
      n_computed: how many values B computes for W (they follow ``inputs_of_w`` in the cut).
      computed_names: a name per computed value: its primitive and the user's line, e.g.
        ``"dot_general model.py:12"``, with ``" (per scan iteration)"`` for stacked ones.
      computed_feeds: per computed value, the W outputs (indices among W's outputs) that are
        computed from it.
    """

    level: _Level
    consts: tuple[Any, ...]
    b_outputs: tuple[bool, ...]
    inputs_of_w: tuple[int, ...]
    n_computed: int
    computed_names: tuple[str, ...]
    computed_feeds: tuple[frozenset[int], ...]

    def run_b(self, *args: Any) -> tuple[list[Any], list[Any]]:
        """B on the backward's inputs: ``(B's outputs, the values B computed for W)``."""
        env, cut = _run_b(self.level, self.consts, args)
        outs = [_read(env, v) for v, b in zip(self.level.jaxpr.outvars, self.b_outputs) if b]
        return outs, cut

    def run_w(self, given: Sequence[Any], computed: Sequence[Any]) -> list[Any]:
        """W on the inputs it reads (in ``inputs_of_w`` order) and B's computed values: W's
        outputs, in the backward's output order."""
        args: list[Any] = [None] * len(self.level.jaxpr.invars)
        for i, x in zip(self.inputs_of_w, given):
            args[i] = x
        env = _run_w(self.level, self.consts, args, iter(computed))
        return [_read(env, v) for v, b in zip(self.level.jaxpr.outvars, self.b_outputs) if not b]


def _names(level: _Level, suffix: str = "") -> list[str]:
    """A name per cut value of ``level``, in the cut's order: the primitive that made it and the
    user's line it traces back to."""
    producer = {v: eqn for eqn in level.jaxpr.eqns for v in eqn.outvars}
    out = []
    for v in level.cut:
        eqn = producer[v]
        file, line = _jax_internals.equation_line(eqn)
        where = f" {file}:{line}" if file else ""
        out.append(f"{eqn.primitive.name}{where}{suffix}")
    for i in sorted(level.subs):
        sub = level.subs[i]
        inner = suffix if sub.scan is None else " (per scan iteration)"
        out += [f"scan carry {k}{inner}" for k in sub.carry_cut]
        out += _names(sub.level, inner)
    return out


def _feeds(level: _Level) -> list[frozenset[int]]:
    """Per cut value of the top ``level`` (in the cut's order), the W outputs (indices among
    them) computed from it; a value cut inside a split equation feeds what that equation feeds."""
    jaxpr = level.jaxpr
    w_outs = [v for v, r in zip(jaxpr.outvars, level.w_out_mask) if r]
    reach: dict[Any, set[int]] = {}
    for j, v in enumerate(w_outs):
        if not _jax_internals.is_literal(v):
            reach.setdefault(v, set()).add(j)
    nested: dict[int, set[int]] = {}
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn, where = jaxpr.eqns[i], level.where[i]
        if where not in (_W, _SPLIT):
            continue
        found: set[int] = set().union(*(reach.get(v, set()) for v in eqn.outvars))
        if where == _SPLIT:
            nested[i] = found
        for v in _vars(eqn.invars):
            reach.setdefault(v, set()).update(found)
    out = [frozenset(reach.get(v, ())) for v in level.cut]
    for i in sorted(level.subs):
        out += [frozenset(nested.get(i, ()))] * level.subs[i].n_cut
    return out


def partition(closed_jaxpr: Any, b_outputs: Sequence[bool]) -> Partition:
    """Splits the backward ``closed_jaxpr`` (a ``ClosedJaxpr``) into B, computing the outputs
    marked in ``b_outputs``, and W, computing the others from what B hands it."""
    jaxpr = closed_jaxpr.jaxpr
    b_out = tuple(bool(b) for b in b_outputs)
    if len(b_out) != len(jaxpr.outvars):
        raise ValueError(f"b_outputs has {len(b_out)} entries for {len(jaxpr.outvars)} outputs")
    level = _plan(jaxpr, b_out, tuple(not b for b in b_out))
    return Partition(
        level=level,
        consts=tuple(closed_jaxpr.consts),
        b_outputs=b_out,
        inputs_of_w=tuple(i for i, r in enumerate(level.w_in) if r),
        n_computed=level.n_cut,
        computed_names=tuple(_names(level)),
        computed_feeds=tuple(_feeds(level)),
    )
