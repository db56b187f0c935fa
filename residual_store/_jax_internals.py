"""Every use of JAX internals in residual-store lives here, and nowhere else.

Each function below names the assumption it makes about JAX; ``tests/test_jax_internals.py``
checks every one of them against the installed JAX, so an upgrade that breaks one fails loudly
with the assumption's name instead of producing wrong names or silent recomputation.

Assumptions (the tests refer to them by these tags):

* ``EVAL_JAXPR``: ``jax._src.core.eval_jaxpr(jaxpr, consts, *args)`` evaluates an open jaxpr,
  binding each equation with its own params and source information.
* ``EQN_SOURCE``: ``eqn.source_info`` can be summarised to a user frame (file, line) with
  ``jax.extend.source_info_util.user_frame``.
* ``SUBJAXPR_OUTVARS``: a higher-order equation (``jit``, ``scan``, ``checkpoint``/``remat``,
  ``while``, ``cond``, custom derivative calls) whose inner jaxpr has as many outputs as the
  equation has, maps output *i* of the equation to output *i* of the inner jaxpr; and, for
  ``jit``/``checkpoint``/``scan``/``custom_*`` calls, inner input *j* is fed by the equation's
  input ``j`` (after its constants, as laid out in the params).
* ``NAME_PRIMITIVE``: ``jax.ad_checkpoint.checkpoint_name`` binds a primitive named ``name``
  whose ``name`` param is the label.
* ``CUSTOM_VJP_THUNK``: a ``custom_vjp_call`` equation carries ``call_jaxpr`` (whose debug info
  names the primal function and where it is defined), ``fwd_jaxpr_thunk`` (a memoized
  ``WrappedFun`` returning ``(jaxpr, consts)`` given one "non-zero" flag per non-constant input)
  and ``num_consts``; with ``defvjp(..., optimize_remat=True)`` that jaxpr is a single
  ``remat_opt`` equation.
* ``DISTRIBUTED_CLIENT``: after ``jax.distributed.initialize``, the coordination service's
  client is ``jax._src.distributed.global_state.client`` (``None`` before), with
  ``key_value_set(key, value)`` and ``blocking_key_value_get(key, timeout_ms)``.
* ``REMAT_PRIMITIVE``: ``jax.checkpoint`` binds a primitive named ``checkpoint`` or ``remat2``
  (the name changed across versions) whose body is ``params["jaxpr"]``.
* ``JAXPR_TEXT``: a ``Jaxpr`` has ``constvars``, ``invars``, ``outvars``, ``eqns`` and
  ``effects``; an equation has ``primitive.name``, ``params``, ``invars`` (``Var`` or
  ``Literal`` with ``.val``), ``outvars`` (``Var`` or ``DropVar``), ``effects`` and ``ctx`` (a
  ``JaxprEqnContext``); a ``ClosedJaxpr`` has ``jaxpr`` and ``consts``; ``str(aval)`` writes the
  dtype, the shape, a weak type as a leading ``~`` and an explicit sharding as ``dim@axis``;
  ``jax._src.linear_util.WrappedFun`` holds a function in ``f`` with ``transforms`` and
  ``params``; extended dtypes (typed PRNG keys) are ``jax._src.dtypes.ExtendedDType``. Tracing a ``custom_vjp``/``custom_jvp`` rule under ``jax.vjp`` inlines the rule's
  computation (closed-over values included) into the traced jaxprs.
* ``HOST_CALLBACK``: host callbacks bind primitives named in ``HOST_CALLBACK_PRIMITIVES``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from jax._src import core as _core
from jax._src import distributed as _distributed
from jax._src import dtypes as _dtypes
from jax._src import linear_util as _lu
from jax._src import source_info_util as _source_info_util

from residual_store.canonical import Canonicalizer, qualified_name, scrub

__all__: list[str] = []  # private module

REMAT_PRIMITIVE_NAMES = frozenset({"checkpoint", "remat2", "remat"})
NAME_PRIMITIVE = "name"
CUSTOM_VJP_PRIMITIVE = "custom_vjp_call"
REMAT_OPT_PRIMITIVE = "remat_opt"

def eval_jaxpr(jaxpr: Any, consts: Sequence[Any], *args: Any) -> list[Any]:
    """Evaluates an open jaxpr on ``consts`` and ``args`` (assumption ``EVAL_JAXPR``)."""
    return _core.eval_jaxpr(jaxpr, list(consts), *args)


# --------------------------------------------------------------------------------------------
# Where a residual came from


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where one output of a jaxpr was produced.

    ``primitive`` is the producing primitive's name (``None`` when the output is an input of the
    outermost jaxpr or a literal), ``label`` a ``checkpoint_name`` label if one was applied,
    ``file``/``line`` the user's source line, ``scopes`` the higher-order primitives it sits in
    (outermost first), ``invar`` the index of the outer input it forwards, if it does;
    ``per_iteration`` marks a loop's inputs stacked over its iterations (e.g. a scan carry).
    """

    primitive: str | None
    label: str | None = None
    file: str | None = None
    line: int | None = None
    scopes: tuple[str, ...] = ()
    invar: int | None = None
    per_iteration: bool = False


def _user_frame(eqn: Any) -> tuple[str | None, int | None]:
    """The user's (file basename, line) for an equation (assumption ``EQN_SOURCE``)."""
    try:
        frame = _source_info_util.user_frame(eqn.source_info.traceback)
    except Exception:  # noqa: BLE001 - a missing frame only costs a less precise name.
        return None, None
    if frame is None:
        return None, None
    return os.path.basename(frame.file_name), frame.start_line


def _inner_jaxprs(eqn: Any) -> list[Any]:
    """Open jaxprs in an equation's params (``ClosedJaxpr`` unwrapped), in param order."""
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, _core.ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, _core.Jaxpr):
                found.append(item)
    return found


def _body_for_outputs(eqn: Any) -> Any | None:
    """The inner jaxpr whose outputs are the equation's outputs (``SUBJAXPR_OUTVARS``)."""
    name = eqn.primitive.name
    params = eqn.params
    if name == "while":
        body = params.get("body_jaxpr")
        return body.jaxpr if body is not None else None
    if name == "cond":
        branches = params.get("branches") or ()
        return branches[-1].jaxpr if branches else None
    for inner in _inner_jaxprs(eqn):
        if len(inner.outvars) == len(eqn.outvars):
            return inner
    return None


# Value-preserving ops that remat and partial evaluation insert around saved values: a residual
# produced by one of them is named after its operand (e.g. the checkpoint_name label).
_TRANSPARENT_PRIMITIVES = frozenset({"reduce_precision", "optimization_barrier", "copy", "copy_p"})
_LOOP_PRIMITIVES = frozenset({"scan", "while", "fori_loop"})


def _inputs_map_one_to_one(eqn: Any, body: Any) -> bool:
    name = eqn.primitive.name
    return name not in _LOOP_PRIMITIVES and name != "cond" and len(body.invars) == len(eqn.invars)


def _producers(jaxpr: Any) -> dict[Any, Any]:
    return {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}


def _origin_of(jaxpr: Any, atom: Any, scopes: tuple[str, ...], depth: int = 0) -> Origin:
    if isinstance(atom, _core.Literal):
        return Origin(primitive="literal", scopes=scopes)
    if depth > 64:
        return Origin(primitive=None, scopes=scopes)
    eqn = _producers(jaxpr).get(atom)
    if eqn is None:
        index = next((i for i, v in enumerate(jaxpr.invars) if v is atom), None)
        return Origin(primitive=None, scopes=scopes, invar=index)
    name = eqn.primitive.name
    if name == NAME_PRIMITIVE:
        file, line = _user_frame(eqn)
        return Origin(name, label=str(eqn.params.get("name")), file=file, line=line, scopes=scopes)
    if name in _TRANSPARENT_PRIMITIVES and len(eqn.invars) == len(eqn.outvars):
        return _origin_of(jaxpr, eqn.invars[eqn.outvars.index(atom)], scopes, depth + 1)
    body = _body_for_outputs(eqn)
    if body is not None:
        inner = _origin_of(body, body.outvars[eqn.outvars.index(atom)], scopes + (name,), depth + 1)
        if inner.invar is not None and _inputs_map_one_to_one(eqn, body):
            return _origin_of(jaxpr, eqn.invars[inner.invar], scopes, depth + 1)
        if inner.primitive is not None:
            if inner.file is None:  # e.g. inside jnp's own jitted helpers: use the call site
                file, line = _user_frame(eqn)
                inner = dataclasses.replace(inner, file=file, line=line)
            return inner
        if inner.invar is not None and name in _LOOP_PRIMITIVES:
            file, line = _user_frame(eqn)
            return Origin(name, label=None, file=file, line=line, scopes=scopes, per_iteration=True)
    file, line = _user_frame(eqn)
    return Origin(name, file=file, line=line, scopes=scopes)


def output_origins(closed_jaxpr: Any, indices: Sequence[int]) -> list[Origin]:
    """The :class:`Origin` of each listed output of ``closed_jaxpr``, looking inside nested jaxprs."""
    jaxpr = closed_jaxpr.jaxpr
    return [_origin_of(jaxpr, jaxpr.outvars[i], ()) for i in indices]


# --------------------------------------------------------------------------------------------
# custom_vjp under remat (upstream jax issue 21303)


def _walk(jaxpr: Any, under_remat: bool) -> Iterator[tuple[Any, bool]]:
    for eqn in jaxpr.eqns:
        yield eqn, under_remat
        inner_remat = under_remat or eqn.primitive.name in REMAT_PRIMITIVE_NAMES
        for inner in _inner_jaxprs(eqn):
            yield from _walk(inner, inner_remat)


def _custom_vjp_is_remat_optimized(eqn: Any) -> bool:
    """Whether a ``custom_vjp_call``'s fwd was wrapped by ``optimize_remat`` (``CUSTOM_VJP_THUNK``).

    The thunk is memoized by JAX and is the one JAX itself calls when differentiating, so asking
    for it here does not trace the user's fwd a second time.
    """
    thunk = eqn.params["fwd_jaxpr_thunk"]
    n_args = len(eqn.invars) - eqn.params.get("num_consts", 0)
    fwd_jaxpr, _ = thunk.call_wrapped(*([True] * n_args))
    return any(e.primitive.name == REMAT_OPT_PRIMITIVE for e in fwd_jaxpr.eqns)


def unoptimized_remat_custom_vjps(closed_jaxpr: Any) -> list[str]:
    """Descriptions (``"name at file:line"``) of ``custom_vjp`` calls under remat whose fwd is
    not remat-optimized, in the order they appear."""
    found = []
    for eqn, under_remat in _walk(closed_jaxpr.jaxpr, False):
        if under_remat and eqn.primitive.name == CUSTOM_VJP_PRIMITIVE:
            if not _custom_vjp_is_remat_optimized(eqn):
                file, line = _user_frame(eqn)
                where = f" called at {file}:{line}" if file else ""
                found.append(f"{_custom_vjp_name(eqn)}{where}")
    return found


def _custom_vjp_name(eqn: Any) -> str:
    """``"kernel (defined at model.py:3)"`` from the primal's debug info (``CUSTOM_VJP_THUNK``)."""
    try:
        info = eqn.params["call_jaxpr"].jaxpr.debug_info.func_src_info
    except (KeyError, AttributeError):
        info = None
    if not info:
        return str(eqn.params.get("name", "custom_vjp"))
    name, _, where = info.partition(" at ")
    return f"{name} (defined at {os.path.basename(where)})" if where else name


# --------------------------------------------------------------------------------------------
# A process-independent text of a jaxpr (what the signature hashes)


def _aval_text(aval: Any) -> str:
    """``str(aval)`` (weak types as ``~``, explicit shardings as ``@axis``, ``JAXPR_TEXT``) plus
    the memory space where it is not the device's."""
    text = str(aval)
    space = getattr(aval, "memory_space", None)
    name = getattr(space, "name", None)
    if name is not None and name != "Device":
        text += f"<{name}>"
    return text


def _effects_text(effects: Any) -> str:
    return "{" + ",".join(sorted(qualified_name(type(e)) + ":" + scrub(repr(e)) for e in effects)) + "}"


_EQN_CONTEXT_FIELDS = (
    "compute_type",
    "threefry_partitionable",
    "cur_abstract_mesh",
    "remove_size_one_mesh_axis",
    "xla_metadata",
)


def _open_jaxpr_text(jaxpr: Any, canon: Canonicalizer) -> str:
    names: dict[Any, str] = {}
    contexts: dict[int, str] = {}  # equations mostly share a few context objects

    def context(ctx: Any) -> str:
        text = contexts.get(id(ctx))
        if text is None:
            text = contexts[id(ctx)] = ",".join(canon.value(getattr(ctx, f, None)) for f in _EQN_CONTEXT_FIELDS)
        return text

    def define(v: Any) -> str:
        if isinstance(v, _core.DropVar):
            return f"_:{_aval_text(v.aval)}"
        names[v] = f"%{len(names)}"
        return f"{names[v]}:{_aval_text(v.aval)}"

    def use(v: Any) -> str:
        if isinstance(v, _core.Literal):
            return f"lit({canon.value(np.asarray(v.val))}:{_aval_text(v.aval)})"
        return names.get(v, "%free")

    lines = [
        "const " + " ".join(define(v) for v in jaxpr.constvars),
        "in " + " ".join(define(v) for v in jaxpr.invars),
    ]
    for eqn in jaxpr.eqns:
        ins = " ".join(use(v) for v in eqn.invars)
        params = ",".join(f"{k}={canon.value(eqn.params[k])}" for k in sorted(eqn.params))
        ctx = context(eqn.ctx)
        outs = " ".join(define(v) for v in eqn.outvars)
        lines.append(f"{outs} = {eqn.primitive.name}[{params}] {ins} {_effects_text(eqn.effects)} ctx({ctx})")
    lines.append("out " + " ".join(use(v) for v in jaxpr.outvars))
    lines.append("effects " + _effects_text(jaxpr.effects))
    return "{" + "\n".join(lines) + "}"


def _canonical_hook(v: Any, canon: Canonicalizer) -> str | None:
    """Text for JAX's internal types inside jaxprs (``JAXPR_TEXT``); ``None`` for anything else."""
    if isinstance(v, _core.ClosedJaxpr):
        consts = ",".join(canon.value(c) for c in v.consts)
        return f"closed({_open_jaxpr_text(v.jaxpr, canon)};consts({consts}))"
    if isinstance(v, _core.Jaxpr):
        return _open_jaxpr_text(v, canon)
    if isinstance(v, _core.AbstractValue):
        return f"aval {_aval_text(v)}"
    if isinstance(v, _core.Primitive):
        return f"primitive {v.name}"
    if isinstance(v, _dtypes.ExtendedDType):  # typed PRNG keys' dtypes
        return f"dtype {v}"
    if isinstance(v, _lu.WrappedFun):  # a function JAX holds with its pending transformations
        return f"wrapped({canon.value(v.f)};{canon.value(v.transforms)};{canon.value(v.params)})"
    return None


def canonicalizer() -> Canonicalizer:
    """A :class:`~residual_store.canonical.Canonicalizer` that also writes jaxprs, avals,
    primitives and JAX's wrapped functions."""
    return Canonicalizer(hook=_canonical_hook)


def jaxpr_text(closed_jaxpr: Any, canon: Canonicalizer | None = None) -> str:
    """The computation of a (closed) jaxpr as process-independent text (``JAXPR_TEXT``).

    Variables are numbered in order of definition, per jaxpr; every equation is written as its
    primitive, its params (sorted by name, each canonical: nested jaxprs, dtypes, shardings,
    callbacks by their code and closure values), its inputs, outputs with avals, effects and
    context (compute type, PRNG partitionability, mesh); the values of a closed jaxpr's
    constants are included. Source locations and debug names are not.
    """
    return (canon or canonicalizer()).value(closed_jaxpr)


HOST_CALLBACK_PRIMITIVES = frozenset(
    {"pure_callback", "io_callback", "debug_callback", "debug_print", "callback"}
)


def host_callbacks(closed_jaxpr: Any) -> list[str]:
    """Names of the host-callback primitives in a jaxpr and its nested jaxprs (``HOST_CALLBACK``):
    ``jax.export`` cannot serialize them."""
    return [eqn.primitive.name for eqn, _ in _walk(closed_jaxpr.jaxpr, False)
            if eqn.primitive.name in HOST_CALLBACK_PRIMITIVES]


# --------------------------------------------------------------------------------------------
# The distributed runtime's key-value store (multi-process stores)


def distributed_client() -> Any | None:
    """The coordination client of ``jax.distributed`` (``DISTRIBUTED_CLIENT``), or ``None``."""
    return _distributed.global_state.client
