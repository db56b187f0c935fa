"""Every use of JAX internals in residual-store lives here, and nowhere else.

Each function below names the assumption it makes about JAX; ``tests/test_jax_internals.py``
checks every one of them against the installed JAX, so an upgrade that breaks one fails loudly
with the assumption's name instead of producing wrong names or silent recomputation.

What is built on these shims lives beside them, without importing ``jax._src``: where a residual
came from in :mod:`residual_store._src.origins`, the signature's text of a jaxpr in
:mod:`residual_store._src.canonical`, the B/W partition in :mod:`residual_store._src.partition`, passes
over a whole jaxpr (host callbacks, ``custom_vjp`` under remat, ``jit`` calls inlined) in
:mod:`residual_store._src.jaxpr_walks`.

Assumptions (the tests refer to them by these tags):

* ``EVAL_JAXPR``: ``jax._src.core.eval_jaxpr(jaxpr, consts, *args)`` evaluates an open jaxpr,
  binding each equation with its own params and source information.
* ``EQN_SOURCE``: ``eqn.source_info.traceback`` is ``None`` or has ``raw_frames()``, the code
  objects and last instructions of the frames that bound the equation, innermost first;
  ``jax._src.source_info_util.is_user_filename`` is false for JAX's and the standard library's
  files and ``raw_frame_to_frame(code, lasti)`` gives a frame's ``file_name`` and ``start_line``.
* ``NAME_STACK``: ``eqn.source_info.name_stack.stack`` is a tuple of
  ``source_info_util.Scope`` (a ``jax.named_scope``, ``jax.named_call``, a Flax linen module)
  and ``source_info_util.Transform`` (``jvp``, ``vmap``...) entries, each with a ``name``; the
  equations of an inner jaxpr (``scan``, ``jit``, ``checkpoint`` bodies) carry name stacks
  relative to the equation that holds them.
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
  ``params``; extended dtypes (typed PRNG keys) are ``jax._src.dtypes.ExtendedDType``. Tracing
  a ``custom_vjp``/``custom_jvp`` rule under ``jax.vjp`` inlines the rule's computation
  (closed-over values included) into the traced jaxprs.
* ``DEBUG_INFO``: ``jax._src.linear_util.DebugInfo`` (a named tuple) holds what error messages
  name: the traced function's name and source location (``func_src_info``, ``"name at
  file:line"``), its argument names and result paths; JAX keeps one in the transformations of
  the Python functions an equation holds (a ``custom_vjp_call``'s ``bwd`` and fwd thunk, where
  a ``custom_vjp`` is applied to a value not differentiated). ``source_info_util.SourceInfo``
  and ``source_info_util.Traceback`` are where an equation was bound. None of them is part of
  what is computed.
* ``BIND_EQUATION``: an equation runs again on new inputs as
  ``eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))``, inside ``source_info_util.user_context`` and
  ``eqn.ctx.manager`` (as ``jax._src.core.eval_jaxpr`` does); ``primitive.multiple_results``
  says whether it returns a list. A ``scan`` equation's params are ``jaxpr`` (a ``ClosedJaxpr``
  over consts, carries, then per-iteration inputs, giving carries then per-iteration outputs),
  ``num_consts``, ``num_carry``, ``length``, ``reverse`` and ``unroll``, and ``jax.lax.scan`` with
  those arguments computes it. A ``jit`` equation's body is the ``ClosedJaxpr`` ``params["jaxpr"]``
  and a ``checkpoint``/``remat2`` equation's the open ``Jaxpr`` ``params["jaxpr"]``, fed by the
  equation's inputs in order; evaluating the body in place of the equation computes the same
  values.
* ``HOST_CALLBACK``: host callbacks bind primitives named in ``HOST_CALLBACK_PRIMITIVES``.
* ``HOST_TO_DEVICE``: ``jax._src.lib.xla_client.batched_device_put(aval, sharding, [x], [device],
  committed)`` with ``aval`` a ``jax._src.core.ShapedArray`` of a C-contiguous NumPy array's
  shape and (canonical) dtype makes the ``jax.Array`` that ``jax.device_put(x, device)`` makes
  (same aval, sharding, commitment and values; on CPU it aliases an aligned buffer as
  ``jax.device_put`` does), without ``jax.device_put``'s per-array Python work.
* ``HOST_AVAL``: ``jax._src.core.ShapedArray(shape, dtype, memory_space=MemorySpace.Host)`` traced
  as a ``jax.jit`` argument (given a ``pinned_host`` sharding in ``in_shardings``) is a host
  buffer in the jaxpr (``aval.memory_space == jax.memory.Space.Host``), which
  ``dynamic_update_slice`` of a value moved to host memory can write into, donated and aliased.
* ``TRACER_KINDS``: a value being staged out (``jax.jit``, ``lax.scan`` bodies, ``eval_shape``)
  is a ``partial_eval.DynamicJaxprTracer``; under ``jax.vmap`` a ``batching.BatchTracer``; under
  ``jax.grad``/``jax.jvp``/``jax.linearize`` an ``ad.JVPTracer`` or ``ad.LinearizeTracer``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import numpy as np
from jax._src import core as _core
from jax._src import distributed as _distributed
from jax._src import dtypes as _dtypes
from jax._src import linear_util as _lu
from jax._src import source_info_util as _source_info_util
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import batching as _batching
from jax._src.interpreters import partial_eval as _pe
from jax._src.lib import xla_client as _xc

__all__: list[str] = []  # private module

REMAT_PRIMITIVE_NAMES = frozenset({"checkpoint", "remat2", "remat"})
NAME_PRIMITIVE = "name"
CUSTOM_VJP_PRIMITIVE = "custom_vjp_call"
REMAT_OPT_PRIMITIVE = "remat_opt"

def eval_jaxpr(jaxpr: Any, consts: Sequence[Any], *args: Any) -> list[Any]:
    """Evaluates an open jaxpr on ``consts`` and ``args`` (assumption ``EVAL_JAXPR``)."""
    return _core.eval_jaxpr(jaxpr, list(consts), *args)


# --------------------------------------------------------------------------------------------
# Equations, one at a time (the B/W partition of a backward, ``residual_store._src.partition``)


def is_literal(v: Any) -> bool:
    """Whether an equation input is a literal (``v.val`` holds it) rather than a variable."""
    return isinstance(v, _core.Literal)


def is_dropped(v: Any) -> bool:
    """Whether an equation output is a ``DropVar`` (never read)."""
    return isinstance(v, _core.DropVar)


@contextlib.contextmanager
def equation_context(eqn: Any, caller: Any = None) -> Iterator[None]:
    """What is bound inside is attributed to ``eqn``'s source line and name stack, under its
    context (assumption ``BIND_EQUATION``): a computation made again keeps its names. An
    equation of a ``jit`` body records only the frames inside the body (a ``jnp`` function's
    own, say): when it has no user line, it takes that of ``caller``, the equation that called
    the body, if given."""
    traceback = eqn.source_info.traceback
    if caller is not None and equation_line(eqn) == (None, None):
        traceback = caller.source_info.traceback
    name_stack = _source_info_util.current_name_stack() + eqn.source_info.name_stack
    with _source_info_util.user_context(traceback, name_stack=name_stack), eqn.ctx.manager:
        yield


def bind_equation(eqn: Any, invals: Sequence[Any], caller: Any = None) -> list[Any]:
    """Runs one equation on ``invals`` in the current trace; its outputs as a list (assumption
    ``BIND_EQUATION``); ``caller`` as in :func:`equation_context`."""
    params = eqn.primitive.get_bind_params(eqn.params)
    with equation_context(eqn, caller):
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


@dataclasses.dataclass(frozen=True)
class ScanParts:
    """A ``scan`` equation's body and options (assumption ``BIND_EQUATION``)."""

    body: Any  # open Jaxpr: consts, carries, per-iteration inputs -> carries, per-iteration outputs
    consts: tuple[Any, ...]  # the body's own constants (its ClosedJaxpr's)
    num_consts: int
    num_carry: int
    length: int
    reverse: bool
    unroll: Any


def scan_parts(eqn: Any) -> ScanParts | None:
    """The parts of a ``scan`` equation, or ``None`` for any other equation."""
    if eqn.primitive.name != "scan":
        return None
    p = eqn.params
    closed = p["jaxpr"]
    return ScanParts(closed.jaxpr, tuple(closed.consts), int(p["num_consts"]), int(p["num_carry"]),
                     int(p["length"]), bool(p["reverse"]), p["unroll"])


_CALL_PRIMITIVES = frozenset({"jit", "pjit", "closed_call", "core_call"}) | REMAT_PRIMITIVE_NAMES


def call_body(eqn: Any) -> tuple[Any, tuple[Any, ...]] | None:
    """``(open body jaxpr, its constants)`` of a ``jit`` or ``checkpoint`` equation, fed by the
    equation's inputs in order; ``None`` for any other equation (assumption ``BIND_EQUATION``)."""
    if eqn.primitive.name not in _CALL_PRIMITIVES:
        return None
    body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if isinstance(body, _core.ClosedJaxpr):
        return body.jaxpr, tuple(body.consts)
    if isinstance(body, _core.Jaxpr) and not body.constvars:
        return body, ()
    return None


def has_inner_jaxprs(eqn: Any) -> bool:
    """Whether an equation holds jaxprs in its params (``jit``, ``scan``, ``checkpoint``, custom
    derivative calls): a higher-order primitive (assumption ``JAXPR_TEXT``)."""
    return bool(inner_jaxprs(eqn)) or any(
        callable(getattr(v, "call_wrapped", None)) for v in eqn.params.values()
    )


# --------------------------------------------------------------------------------------------
# Where an equation was bound: the user's line, the name stack


# Packages whose frames are not "the user's line": model and utility libraries, whose files say
# nothing about where in a model a value was computed. Only those already imported are looked
# at (their folders come from ``__file__``/``__path__``); none is ever imported here.
LIBRARY_PACKAGES: tuple[str, ...] = (
    "flax",
    "equinox",
    "haiku",
    "penzai",
    "optax",
    "chex",
    "jaxtyping",
    "typeguard",
    "beartype",
    "treescope",
    "einops",
    "numpy",
    "ml_dtypes",
    "residual_store",
)
# Models that live inside a library's folder (residual-store's demo transformer): their lines
# are the user's.
_MODEL_MODULES = ("residual_store.demo",)
# The module whose frame calls the traced function: frames outside it (the caller of the split)
# are never a residual's line.
_TRACING_MODULE = "residual_store._src.split"
_PACKAGE_DIRS: dict[str, tuple[str, ...]] = {}


def _package_dirs(name: str) -> tuple[str, ...]:
    found = _PACKAGE_DIRS.get(name)
    if found is not None:
        return found
    module = sys.modules.get(name)
    if module is None:
        return ()
    file = getattr(module, "__file__", None)
    folders = [os.path.dirname(file)] if file else list(getattr(module, "__path__", None) or ())
    found = tuple(os.path.join(folder, "") for folder in folders if folder)
    _PACKAGE_DIRS[name] = found
    return found


def _library_dirs() -> tuple[str, ...]:
    return tuple(d for name in LIBRARY_PACKAGES for d in _package_dirs(name))


def _module_files(names: Sequence[str]) -> frozenset[str]:
    files = (getattr(sys.modules.get(name), "__file__", None) for name in names)
    return frozenset(f for f in files if f)


@functools.lru_cache(maxsize=4096)
def _user_line_of(
    traceback: Any, libraries: tuple[str, ...], models: frozenset[str], boundary: frozenset[str]
) -> tuple[str | None, int | None]:
    codes, lastis = traceback.raw_frames()
    chosen = fallback = None
    for code, lasti in zip(codes, lastis):  # innermost first
        file = code.co_filename
        if file in boundary:
            break
        if not _source_info_util.is_user_filename(file):  # JAX's own files, the standard library
            continue
        if fallback is None:
            fallback = (code, lasti)
        if not file.startswith(libraries) or file in models:
            chosen = (code, lasti)
            break
    chosen = chosen or fallback
    if chosen is None:
        return None, None
    frame = _source_info_util.raw_frame_to_frame(*chosen)
    return os.path.basename(frame.file_name), frame.start_line


def user_line(traceback: Any) -> tuple[str | None, int | None]:
    """The (file basename, line) of the innermost frame of the user's code in a traceback
    (assumption ``EQN_SOURCE``), or ``(None, None)``.

    Skipped: JAX's and the standard library's frames, and those in the folders of the
    :data:`LIBRARY_PACKAGES` already imported (Flax, Equinox, Haiku, ..., residual-store
    itself); frames outside residual-store's call of the traced function (the caller of the
    split) are never looked at. Where every frame inside is a library's, the innermost of those
    (so ``_mlp.py:25`` rather than nothing).
    """
    if traceback is None:
        return None, None
    try:
        return _user_line_of(traceback, _library_dirs(), _module_files(_MODEL_MODULES), _module_files((_TRACING_MODULE,)))
    except Exception:  # noqa: BLE001 - a missing frame only costs a less precise name.
        return None, None


def equation_line(eqn: Any) -> tuple[str | None, int | None]:
    """The user's (file basename, line) that bound ``eqn`` (assumption ``EQN_SOURCE``; see
    :func:`user_line`)."""
    return user_line(getattr(eqn.source_info, "traceback", None))


def name_scopes(eqn: Any) -> tuple[str, ...]:
    """The scope names of an equation's own name stack, transformations left out (``NAME_STACK``)."""
    try:
        stack = eqn.source_info.name_stack.stack
    except AttributeError:
        return ()
    return tuple(str(e.name) for e in stack if isinstance(e, _source_info_util.Scope))


def inner_jaxprs(eqn: Any) -> list[Any]:
    """Open jaxprs in an equation's params (``ClosedJaxpr`` unwrapped), in param order
    (assumptions ``SUBJAXPR_OUTVARS``, ``JAXPR_TEXT``)."""
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, _core.ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, _core.Jaxpr):
                found.append(item)
    return found


def body_for_outputs(eqn: Any) -> Any | None:
    """The inner jaxpr whose outputs are the equation's outputs, output *i* for output *i*
    (``SUBJAXPR_OUTVARS``): a ``while``'s body, a ``cond``'s last branch, else the first inner
    jaxpr with as many outputs; ``None`` if none has."""
    name = eqn.primitive.name
    params = eqn.params
    if name == "while":
        body = params.get("body_jaxpr")
        return body.jaxpr if body is not None else None
    if name == "cond":
        branches = params.get("branches") or ()
        return branches[-1].jaxpr if branches else None
    for inner in inner_jaxprs(eqn):
        if len(inner.outvars) == len(eqn.outvars):
            return inner
    return None


# --------------------------------------------------------------------------------------------
# custom_vjp rules (under remat, upstream jax issue 21303: ``residual_store._src.jaxpr_walks``)


def custom_vjp_fwd_jaxpr(eqn: Any) -> Any:
    """The open jaxpr of a ``custom_vjp_call``'s fwd rule, every non-constant input differentiated
    (``CUSTOM_VJP_THUNK``): a single ``remat_opt`` equation when the rule was defined with
    ``optimize_remat=True``.

    The thunk is memoized by JAX and is the one JAX itself calls when differentiating, so asking
    for it here does not trace the user's fwd a second time.
    """
    thunk = eqn.params["fwd_jaxpr_thunk"]
    n_args = len(eqn.invars) - eqn.params.get("num_consts", 0)
    fwd_jaxpr, _ = thunk.call_wrapped(*([True] * n_args))
    return fwd_jaxpr


def custom_vjp_name(eqn: Any) -> str:
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
# JAX's internal types, for the canonical text of a jaxpr (``residual_store._src.canonical``)


_DEBUG_TYPES = (_lu.DebugInfo, _source_info_util.SourceInfo, _source_info_util.Traceback)
"""What JAX records for messages, never for computing (``DEBUG_INFO``): a comment line moves
them, a renamed file changes them, so no text of a computation may hold them."""


JaxKind = Literal["closed_jaxpr", "jaxpr", "aval", "primitive", "extended_dtype", "debug", "wrapped_fun"]


def internal_kind(v: Any) -> JaxKind | None:
    """Which of JAX's internal types ``v`` is, for the canonical text of a jaxpr
    (:func:`residual_store._src.canonical.jaxpr_text`; ``JAXPR_TEXT``, ``DEBUG_INFO``): a
    ``ClosedJaxpr`` (``jaxpr``, ``consts``), an open ``Jaxpr``, an abstract value, a
    ``Primitive`` (``name``), an extended dtype (typed PRNG keys), debug info (never part of a
    computation) or a ``WrappedFun`` (``f``, ``transforms``, ``params``); ``None`` for any other
    value."""
    if isinstance(v, _core.ClosedJaxpr):
        return "closed_jaxpr"
    if isinstance(v, _core.Jaxpr):
        return "jaxpr"
    if isinstance(v, _core.AbstractValue):
        return "aval"
    if isinstance(v, _core.Primitive):
        return "primitive"
    if isinstance(v, _dtypes.ExtendedDType):
        return "extended_dtype"
    if isinstance(v, _DEBUG_TYPES):
        return "debug"
    if isinstance(v, _lu.WrappedFun):
        return "wrapped_fun"
    return None


# --------------------------------------------------------------------------------------------
# Host callbacks (what ``jax.export`` cannot serialize; found by ``residual_store._src.jaxpr_walks``)


HOST_CALLBACK_PRIMITIVES = frozenset(
    {"pure_callback", "io_callback", "debug_callback", "debug_print", "callback"}
)


# --------------------------------------------------------------------------------------------
# The distributed runtime's key-value store (multi-process stores)


def distributed_client() -> Any | None:
    """The coordination client of ``jax.distributed`` (``DISTRIBUTED_CLIENT``), or ``None``."""
    return _distributed.global_state.client


# --------------------------------------------------------------------------------------------
# An abstract value in host memory


def host_aval(aval: Any) -> Any:
    """An abstract value of ``aval``'s shape and dtype in host memory (``HOST_AVAL``), to trace a
    program that takes a host buffer (``jax.ShapeDtypeStruct`` keeps no memory space)."""
    return _core.ShapedArray(tuple(aval.shape), aval.dtype, memory_space=_core.MemorySpace.Host)


# --------------------------------------------------------------------------------------------
# Host arrays onto a device, many at a time


@functools.lru_cache(maxsize=1024)
def _aval(shape: tuple[int, ...], dtype: np.dtype) -> Any:
    return _core.ShapedArray(shape, dtype)


@functools.lru_cache(maxsize=64)
def _single_device(device: Any) -> Any:
    import jax

    return jax.sharding.SingleDeviceSharding(device)


def device_put_many(arrays: Sequence[np.ndarray], device: Any, committed: bool) -> list[Any]:
    """``[jax.device_put(x, device) for x in arrays]`` (``HOST_TO_DEVICE``) at a few
    microseconds an array instead of about twenty: a context read back holds hundreds of small
    residuals. ``committed``: as ``jax.device_put`` with (``True``) or without (``False``) a
    device. Arrays must be C-contiguous in a canonical dtype (the caller checks)."""
    sharding = _single_device(device)
    put = _xc.batched_device_put
    return [put(_aval(x.shape, x.dtype), sharding, [x], [device], committed) for x in arrays]


# --------------------------------------------------------------------------------------------
# Which transformation a value is under


def any_tracer(xs: Sequence[Any]) -> bool:
    """Whether any of ``xs`` is being transformed (``TRACER_KINDS``): one pass over a context's
    hundreds of residuals."""
    tracer = _core.Tracer
    return any(isinstance(x, tracer) for x in xs)


def transformation(x: Any) -> str | None:
    """``None`` for a concrete value, ``"jit"`` for one being staged out (``TRACER_KINDS``), else
    the name of the transformation it is under (``"jax.vmap"``, ``"jax.grad"``...)."""
    if not isinstance(x, _core.Tracer):
        return None
    if isinstance(x, _pe.DynamicJaxprTracer):
        return "jit"
    if isinstance(x, _batching.BatchTracer):
        return "jax.vmap"
    if isinstance(x, (_ad.JVPTracer, _ad.LinearizeTracer)):
        return "jax.grad (or jax.jvp, jax.linearize)"
    return f"a {type(x).__name__} transformation"


# --------------------------------------------------------------------------------------------
# Commitment of an array to its devices
#
# ``COMMITMENT``: a ``jax.Array`` is a ``jax._src.array.ArrayImpl`` whose constructor
# ``ArrayImpl(aval, sharding, arrays, committed, _skip_checks)`` over another array's ``aval``,
# ``sharding`` and per-device buffers ``_arrays`` makes the same array (same buffers, no copy)
# committed or not as asked; compiled code (``jax.jit(...).lower(...).compile()``) takes an
# uncommitted sub-byte array (``int4``...) on the device it was compiled for. (On CPU, JAX 0.10
# refuses the committed one: its buffer reports a layout of 0 bits per element, the executable
# 4, and only committed arguments are compared.)


def with_commitment(x: Any, committed: bool) -> Any:
    """``x``, a ``jax.Array``, committed to its devices or not (``COMMITMENT``): the same
    buffers, aval and sharding, no copy. ``x`` itself where it already is."""
    if x.committed == committed:
        return x
    return type(x)(x.aval, x.sharding, x._arrays, committed=committed, _skip_checks=True)
