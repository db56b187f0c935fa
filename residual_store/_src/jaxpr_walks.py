"""Passes over a whole traced jaxpr, built on the shims of :mod:`residual_store._src._jax_internals`.

Three questions the split asks of a computation before it keeps it, each a walk over every
equation at every depth (``jit``, ``scan``, ``checkpoint`` bodies, custom derivative rules):

* :func:`host_callbacks`: the host callbacks in it, which ``jax.export`` cannot serialize (a
  stored backward that holds one runs in the process that made it only);
* :func:`unoptimized_remat_custom_vjps`: the ``jax.custom_vjp`` calls under ``jax.checkpoint``
  whose fwd JAX runs twice (upstream jax issue 21303), for the split's ``RecomputeWarning``;
* :func:`inline_calls`: the same computation with every ``jit`` call's body in its place, so
  that one pass over a level sees every operation (``save="auto"`` plans over it).

None of this imports ``jax._src``: what each step assumes about JAX is named in
``_jax_internals`` and checked by ``tests/test_jax_internals.py``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import jax

from residual_store._src import _jax_internals as ji

__all__ = ["equations", "host_callbacks", "inline_calls", "unoptimized_remat_custom_vjps"]


def equations(jaxpr: Any, under_remat: bool = False) -> Iterator[tuple[Any, bool]]:
    """Every equation of an open ``jaxpr`` and of the jaxprs it holds, outer before inner, each
    with whether a ``checkpoint``/``remat`` equation holds it (at any depth)."""
    for eqn in jaxpr.eqns:
        yield eqn, under_remat
        inner_remat = under_remat or eqn.primitive.name in ji.REMAT_PRIMITIVE_NAMES
        for inner in ji.inner_jaxprs(eqn):
            yield from equations(inner, inner_remat)


def host_callbacks(closed_jaxpr: Any) -> list[str]:
    """Names of the host-callback primitives in a jaxpr and its nested jaxprs, in order: what
    ``jax.export`` cannot serialize."""
    return [eqn.primitive.name for eqn, _ in equations(closed_jaxpr.jaxpr)
            if eqn.primitive.name in ji.HOST_CALLBACK_PRIMITIVES]


def _is_remat_optimized(eqn: Any) -> bool:
    """Whether a ``custom_vjp_call``'s fwd was defined with ``optimize_remat=True``."""
    return any(e.primitive.name == ji.REMAT_OPT_PRIMITIVE for e in ji.custom_vjp_fwd_jaxpr(eqn).eqns)


def unoptimized_remat_custom_vjps(closed_jaxpr: Any) -> list[str]:
    """Descriptions (``"kernel (defined at model.py:3) called at model.py:9"``) of the
    ``custom_vjp`` calls under remat whose fwd is not remat-optimized, in the order they appear."""
    found = []
    for eqn, under_remat in equations(closed_jaxpr.jaxpr):
        if under_remat and eqn.primitive.name == ji.CUSTOM_VJP_PRIMITIVE and not _is_remat_optimized(eqn):
            file, line = ji.equation_line(eqn)
            where = f" called at {file}:{line}" if file else ""
            found.append(f"{ji.custom_vjp_name(eqn)}{where}")
    return found


_INLINED = frozenset({"jit", "pjit", "closed_call", "core_call"})


def _holds_calls(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` calls a ``jit`` body, itself or in a scan body."""
    return any(
        eqn.primitive.name in _INLINED or ((scan := ji.scan_parts(eqn)) is not None and _holds_calls(scan.body))
        for eqn in jaxpr.eqns
    )


def inline_calls(closed_jaxpr: Any, in_avals: Sequence[Any]) -> Any:
    """``closed_jaxpr`` traced again with every ``jit`` call's body in place of the call, at the
    top level and in scan bodies (``checkpoint`` bodies and custom derivative rules stay whole):
    the same computation, whose every operation a pass over a level sees. Each equation keeps
    its source line and name stack; one of a ``jit`` body that has no user line of its own takes
    its caller's."""

    def run(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], caller: Any = None) -> list[Any]:
        env = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        read = lambda v: v.val if ji.is_literal(v) else env[v]  # noqa: E731
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            body = ji.call_body(eqn) if eqn.primitive.name in _INLINED else None
            scan = ji.scan_parts(eqn)
            inner_caller = caller if caller is not None and ji.equation_line(eqn) == (None, None) else eqn
            if body is not None:
                outs = run(body[0], body[1], ins, inner_caller)
            elif scan is not None and _holds_calls(scan.body):
                outs = run_scan(eqn, scan, ins, caller, inner_caller)
            else:
                outs = ji.bind_equation(eqn, ins, caller)
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    def run_scan(eqn: Any, scan: ji.ScanParts, ins: Sequence[Any], caller: Any, inner_caller: Any) -> list[Any]:
        nc, nk = scan.num_consts, scan.num_carry

        def step(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
            outs = run(scan.body, scan.consts, [*ins[:nc], *carry, *x], inner_caller)
            return outs[:nk], outs[nk:]

        with ji.equation_context(eqn, caller):
            final, ys = jax.lax.scan(step, list(ins[nc : nc + nk]), list(ins[nc + nk :]), length=scan.length,
                                     reverse=scan.reverse, unroll=scan.unroll)
        return [*final, *ys]

    return jax.make_jaxpr(lambda *args: run(closed_jaxpr.jaxpr, closed_jaxpr.consts, args))(*in_avals)
