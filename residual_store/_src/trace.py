"""Tracing one call of a split: its forward and its backward, as a frozen :class:`Traced` record.

A split traces ``fun`` once per signature to a jaxpr; the forward evaluates that jaxpr under
``jax.vjp`` and returns the output, aux and the residuals it *computes* (inputs and closed-over
constants are taken live by the context: see :mod:`residual_store._src.slots`). The backward is traced
too, not compiled, so that the signature covers what both compute. ``save`` other than ``"all"``
rewrites the forward to keep fewer bytes (:func:`residual_store._src.keep.keep_fewest_bytes`).

Nothing here compiles, runs, or keeps state: the split owns the compiled executables and the
registry of backwards.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from residual_store._src import _jax_internals, filters, keep, names, placement, remat, slots, structure
from residual_store._src.context import CallSpec, InputAval, ResidualKind, ResidualSpec
from residual_store._src.errors import InvalidArgumentError, SignatureMismatchError
from residual_store._src.halves import GradParts
from residual_store._src.origins import output_origins
from residual_store._src.scratch import pinned_like
from residual_store._src.signature import compute_signature

__all__ = ["NO_KEYWORDS", "Keywords", "Options", "Traced", "checked_argnames", "trace"]

FlatBackward = Callable[[Sequence[Any], Sequence[Any]], list[Any]]


@dataclasses.dataclass(frozen=True)
class Keywords:
    """A call's keyword arguments as a trace reads them (as ``jax.jit`` does: never
    differentiated; traced unless named in ``static_argnames``).

    Attributes:
      dynamic: the names of the traced keywords, sorted (a canonical order, whatever order the
        caller wrote them in): their values follow the positional arguments in the traced
        tuple, one child each.
      static: ``(name, value)`` of the static keywords, sorted by name: folded into the traced
        function and into the signature.
    """

    dynamic: tuple[str, ...] = ()
    static: tuple[tuple[str, Any], ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """Every keyword passed, sorted."""
        return tuple(sorted(self.dynamic + tuple(n for n, _ in self.static)))

    def call(self, values: Sequence[Any]) -> dict[str, Any]:
        """The keyword arguments of ``fun``: the traced ones' ``values`` and the static ones."""
        return {**dict(zip(self.dynamic, values)), **dict(self.static)}


NO_KEYWORDS = Keywords()


@dataclasses.dataclass(frozen=True)
class Options:
    """What a split was made with, as a trace reads it (checked by :class:`~residual_store._src.split.Split`)."""

    fun: Callable[..., Any]
    argnums: tuple[int, ...]
    single: bool  # argnums was an int: one gradient, not a tuple of them
    static_argnums: tuple[int, ...]  # sorted
    weight_argnums: tuple[int, ...]  # a subset of argnums
    has_aux: bool
    filter: Callable[[Any], bool] | None
    save: remat.SaveChoice
    param_names: tuple[str, ...] | None  # fun's positional parameters, when introspectable
    static_argnames: tuple[str, ...] = ()  # sorted

    @property
    def argnums_option(self) -> int | tuple[int, ...]:
        """``argnums`` as the user passed it (an int or a tuple): how records spell it."""
        return self.argnums[0] if self.single else self.argnums

    @property
    def label(self) -> str:
        """How messages name the split."""
        name = getattr(self.fun, "__qualname__", type(self.fun).__name__)
        return f"Split({name}, argnums={self.argnums_option})"

    def arg_name(self, index: int | str) -> str:
        """The name of positional argument ``index`` (its parameter's, else ``args[index]``),
        or of a keyword (``index`` is its name)."""
        if isinstance(index, str):
            return index
        known = self.param_names
        return known[index] if known is not None and index < len(known) else f"args[{index}]"

    def dyn_positions(self, n_args: int, keywords: Keywords = NO_KEYWORDS) -> list[int | str]:
        """Per child of the traced tuple, the argument it is: the positions of the positional
        arguments that are traced (not static), then the names of the traced keywords."""
        return [i for i in range(n_args) if i not in self.static_argnums] + list(keywords.dynamic)

    def leaf_paths(self, dyn: tuple[Any, ...], n_args: int, keywords: Keywords = NO_KEYWORDS) -> list[str]:
        """Per leaf of the traced arguments ``dyn``, its path (``params['w']``, ``mask``)."""
        positions = self.dyn_positions(n_args, keywords)
        return [
            self.arg_name(positions[path[0].idx]) + jax.tree_util.keystr(path[1:])
            for path, _ in jax.tree_util.tree_flatten_with_path(dyn)[0]
        ]

    def check_keywords(self, n_args: int, keywords: Keywords) -> None:
        """Raises :class:`InvalidArgumentError` for keywords a split cannot take as given (once
        per new signature): a keyword that is also passed positionally, or that names a
        differentiated or static positional argument; a name in ``static_argnames`` passed
        positionally, or not passed where ``fun`` has no default for it."""
        names = self.param_names or ()
        for name in keywords.names:
            i = names.index(name) if name in names else None
            if i is None:
                continue
            if i < n_args:
                raise InvalidArgumentError(f"{name} is passed both positionally (argument {i}) and as a keyword")
            if i in self.argnums:
                raise InvalidArgumentError(
                    f"{name} (argument {i}) is in argnums: the arguments a split differentiates are "
                    "passed positionally, as jax.grad's"
                )
            if i in self.static_argnums and name not in self.static_argnames:
                raise InvalidArgumentError(
                    f"{name} (argument {i}) is in static_argnums: pass it positionally, or name it in static_argnames"
                )
        params = _parameters(self.fun) or {}
        for name in self.static_argnames:
            i = names.index(name) if name in names else None
            if i is not None and i < n_args:
                if i not in self.static_argnums:
                    raise InvalidArgumentError(
                        f"{name} is in static_argnames but passed positionally (argument {i}): pass it as "
                        f"{name}=..., or name its position in static_argnums"
                    )
            elif name not in keywords.names:
                p = params.get(name)
                if p is not None and p.default is inspect.Parameter.empty:
                    raise InvalidArgumentError(
                        f"static_argnames names {name!r}, which this call does not pass, and {self.label} "
                        "has no default for it"
                    )

    def check_arity(self, args: tuple[Any, ...], keywords: Keywords = NO_KEYWORDS) -> None:
        """Raises :class:`SignatureMismatchError` if ``fun`` cannot take ``args`` and these
        keywords."""
        needed = max(self.argnums + self.static_argnums) + 1
        if len(args) < needed:
            raise SignatureMismatchError(
                f"{self.label} differentiates/uses argument {needed - 1} but was called with "
                f"{len(args)} arguments"
            )
        try:
            inspect.signature(self.fun).bind(*args, **dict.fromkeys(keywords.names))
        except TypeError as err:
            raise SignatureMismatchError(f"bad arguments for {self.label}: {err}") from None
        except ValueError:
            pass  # no introspectable signature (builtins); JAX's trace will complain if needed


def checked_argnames(fun: Callable[..., Any], argnames: str | Sequence[str], argnums: tuple[int, ...]) -> tuple[str, ...]:
    """``static_argnames`` (a name or a sequence of names) as a sorted tuple, checked against
    ``fun`` (:func:`_check_argnames`).

    Raises:
      InvalidArgumentError: a name is not a str, is repeated, or is one ``fun`` cannot take.
    """
    items: tuple[Any, ...]
    try:
        items = (argnames,) if isinstance(argnames, str) else tuple(argnames)
    except TypeError:
        items = (argnames,)  # refused below, by its type
    for name in items:
        if not isinstance(name, str) or not name.isidentifier():
            raise InvalidArgumentError(f"static_argnames must hold parameter names (str), got {argnames!r}")
    if len(set(items)) != len(items):
        raise InvalidArgumentError(f"static_argnames has repeated entries: {argnames!r}")
    names = tuple(sorted(items))
    _check_argnames(fun, names, argnums)
    return names


def _parameters(fun: Callable[..., Any]) -> Any:
    """``fun``'s parameters (``inspect.Parameter`` by name), or ``None`` where it has no
    introspectable signature (a builtin): then JAX's trace is the check."""
    try:
        return inspect.signature(fun).parameters
    except (TypeError, ValueError):
        return None


def _check_argnames(fun: Callable[..., Any], names: tuple[str, ...], argnums: tuple[int, ...]) -> None:
    """Raises :class:`InvalidArgumentError` for a name in ``static_argnames`` that ``fun`` cannot
    take by keyword (as ``jax.jit`` refuses it), or that is a differentiated argument."""
    params = _parameters(fun)
    if params is None:
        return
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    positional = [n for n, p in params.items() if p.kind in _POSITIONAL]
    for name in names:
        p = params.get(name)
        if p is not None and p.kind is inspect.Parameter.POSITIONAL_ONLY:
            raise InvalidArgumentError(
                f"static_argnames names {name!r}, a positional-only parameter: name its position in static_argnums"
            )
        if (p is None or p.kind not in _KEYWORD) and not takes_any:
            raise InvalidArgumentError(f"static_argnames names {name!r}, which {_name(fun)} does not take")
        if name in positional and positional.index(name) in argnums:
            raise InvalidArgumentError(
                f"static_argnames names {name!r}, argument {positional.index(name)}, which argnums differentiates"
            )


def _name(fun: Callable[..., Any]) -> str:
    return getattr(fun, "__qualname__", type(fun).__name__)


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


@dataclasses.dataclass(frozen=True)
class Traced:
    """One signature's forward, traced (not compiled), with its backward's parts."""

    closed: Any  # fun's jaxpr
    traced: Any  # jax.stages.Traced of the forward executable
    jitted: Any  # jax.jit of the forward, for calls inside the caller's jax.jit
    consts: tuple[Any, ...]
    slots: tuple[slots.Slot, ...]  # per residual, in the spec's order
    n_out: int
    out_tree: Any
    aux_tree: Any | None
    out_avals: tuple[Any, ...]
    spec: ResidualSpec
    parts: GradParts  # its spec is ``spec``
    flat_backward: FlatBackward  # (residuals, float cotangents) -> gradient leaves in argnums order
    backward_jit: Any  # jax.jit of flat_backward
    backward_jaxpr: Any  # flat_backward's jaxpr on parts' avals
    grad_tree: Any  # the gradients' template
    plan: Any = None  # with save=rs.plan(...): its choice for this signature (a plan.choose.Plan)
    # the host buffers the forward writes its offloaded values into (its third argument,
    # donated: pinned, on the inputs' device), and their positions among its outputs
    scratch: tuple[jax.ShapeDtypeStruct, ...] = ()
    scratch_outputs: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class _VjpFound:
    """What the forward's trace finds inside ``jax.vjp``: the residuals' tree and their slots."""

    vjp_tree: Any
    slots: tuple[slots.Slot, ...]


def trace(
    opts: Options,
    args: tuple[Any, ...],
    leaves: Sequence[Any],
    treedef: Any,
    statics: tuple[Any, ...],
    in_avals: Sequence[InputAval] | None,
    context_mesh: Any,
    recorded_mask: Sequence[bool] | None = None,
    keywords: Keywords = NO_KEYWORDS,
) -> Traced:
    """Traces the forward and the backward of one signature (``leaves``: arrays, or
    ``ShapeDtypeStruct``s when rebuilding from a record, with the recorded choice of
    differentiated leaves); compiles nothing. ``treedef`` is the traced tuple's: the traced
    positional arguments, then the values of ``keywords.dynamic``.

    Raises:
      InvalidArgumentError: ``fun`` needs a concrete Python value where it got a traced one.
    """
    n_args = len(args)
    positions = opts.dyn_positions(n_args, keywords)
    paths = opts.leaf_paths(jax.tree.unflatten(treedef, list(leaves)), n_args, keywords)
    counts = [c.num_leaves for c in treedef.children()]
    leaf_args = [pos for pos, count in zip(positions, counts) for _ in range(count)]
    differentiated = _differentiated(opts, leaves, leaf_args, paths, recorded_mask)
    diff_idx = [j for j, d in enumerate(differentiated) if d]
    static_pairs = list(zip(opts.static_argnums, statics))

    n_kw = len(keywords.dynamic)

    def call_fun(*flat: Any) -> Any:
        rebuilt = list(filters.thaw(jax.tree.unflatten(treedef, flat)))
        positional, kw_values = rebuilt[: len(rebuilt) - n_kw], rebuilt[len(rebuilt) - n_kw :]
        for index, value in static_pairs:
            positional.insert(index, value)
        return opts.fun(*positional, **keywords.call(kw_values))

    try:
        closed, out_shape = jax.make_jaxpr(call_fun, return_shape=True)(*leaves)
    except jax.errors.ConcretizationTypeError as err:
        raise InvalidArgumentError(
            f"{opts.label} needs a concrete Python value where it got a traced one "
            f"({str(err).splitlines()[0]}). A Python value that decides what is computed (a "
            "train flag, a size) must be static: name a positional argument in static_argnums, a "
            "keyword in static_argnames"
        ) from err
    out_tree, aux_tree, out_avals = _out_trees(opts, out_shape)
    n_out = len(out_avals)
    n_consts = len(closed.consts)
    found: list[_VjpFound] = []  # invariant: the forward is traced once, so this gets one record

    def forward(consts: list[Any], flat: list[Any], scratch: list[Any]) -> list[Any]:
        def primal(*diff: Any) -> tuple[list[Any], list[Any]]:
            merged = list(flat)
            for j, value in zip(diff_idx, diff):
                merged[j] = value
            outs = _jax_internals.eval_jaxpr(closed.jaxpr, consts, *merged)
            return outs[:n_out], outs[n_out:]

        out, vjp_fn, aux = jax.vjp(primal, *[flat[j] for j in diff_idx], has_aux=True)
        res, vjp_tree = jax.tree.flatten(vjp_fn)
        sources = list(consts) + list(flat)
        found_slots: list[tuple[int, int]] = []
        computed: list[Any] = []
        for r in res:  # a residual that *is* a constant or an input is taken live, not returned
            hit = next((i for i, s in enumerate(sources) if s is r), None)
            if hit is None:
                found_slots.append((slots.FROM_OUTPUT, n_out + len(aux) + len(computed)))
                computed.append(r)
            else:
                found_slots.append(slots.of_input(hit, n_consts))
        found.append(_VjpFound(vjp_tree, tuple(found_slots)))
        return list(out) + list(aux) + computed

    consts = [jnp.asarray(c) if not isinstance(c, jax.Array) else c for c in closed.consts]
    forward_jit = jax.jit(forward)
    traced = forward_jit.trace(consts, list(leaves), [])
    (vjp,) = found
    res_slots = vjp.slots
    flat_bwd, grad_tree, templates = _flat_backward(opts, vjp.vjp_tree, out_avals, treedef, positions, differentiated)
    planned = None  # the planner's report, with save=rs.plan(...)
    scratch: tuple[jax.ShapeDtypeStruct, ...] = ()
    scratch_outputs: tuple[int, ...] = ()
    if opts.save.recomputable is not None:  # keep the fewest bytes (or plan); the backward recomputes the rest
        weights = [False] * n_consts + [pos not in opts.weight_argnums for pos in leaf_args]
        kept = keep.keep_fewest_bytes(traced, res_slots, n_consts, weights, flat_bwd, opts.save)
        res_slots, flat_bwd, planned = kept.slots, kept.backward, kept.report
        forward_jit = jax.jit(kept.forward)  # inside a caller's jax.jit: no buffers to donate
        traced = forward_jit.trace(consts, list(leaves), [])  # what is computed (the signature's)
        pinned = pinned_like(kept.offloaded, [*consts, *leaves]) if kept.offloaded else None
        if pinned is not None:  # called on its own: writes its offloaded values into donated buffers
            scratch, scratch_outputs = pinned, kept.offloaded_outputs
    jaxpr_in, jaxpr_out = traced.jaxpr.in_avals, traced.jaxpr.out_avals
    residual_types = slots.gather(res_slots, jaxpr_in[:n_consts], jaxpr_in[n_consts:], jaxpr_out)
    float_out = [i for i, a in enumerate(out_avals) if jax.dtypes.issubdtype(a.dtype, np.inexact)]
    bwd_jit = jax.jit(flat_bwd)
    parts = GradParts(
        residual_avals=tuple(placement.abstract(a) for a in residual_types),
        cotangent_avals=tuple(placement.abstract(jaxpr_out[i]) for i in float_out),
        templates=templates,
        single=opts.single,
    )
    bwd_traced = bwd_jit.trace(list(parts.residual_avals), list(parts.cotangent_avals))
    if in_avals is None:
        in_avals = [placement.input_aval(x) for x in leaves]
    call = _record_call(opts, n_args, treedef, static_pairs, keywords, in_avals, context_mesh, differentiated)
    signature = compute_signature(
        call=call,
        in_tree=treedef,
        statics=static_pairs,
        static_kwargs=keywords.static,
        out_tree=out_tree,
        aux_tree=aux_tree,
        forward=traced.jaxpr,
        forward_consts=consts,
        slots=res_slots,
        backward=bwd_traced.jaxpr,
    )
    spec = _spec(opts, signature, call, res_slots, residual_types, paths, leaf_args, n_consts, traced)
    if scratch:
        traced = _donating(kept.forward, traced, consts, leaves, scratch)
    return Traced(
        closed=closed,
        traced=traced,
        jitted=forward_jit,
        consts=tuple(consts),
        slots=res_slots,
        n_out=n_out,
        out_tree=out_tree,
        aux_tree=aux_tree,
        out_avals=tuple(out_avals),
        spec=spec,
        parts=dataclasses.replace(parts, spec=spec),
        flat_backward=flat_bwd,
        backward_jit=bwd_jit,
        backward_jaxpr=bwd_traced.jaxpr,
        grad_tree=grad_tree,
        plan=planned,
        scratch=scratch,
        scratch_outputs=scratch_outputs,
    )


def _donating(
    forward: Any, plain: Any, consts: Sequence[Any], leaves: Sequence[Any], scratch: Sequence[jax.ShapeDtypeStruct]
) -> Any:
    """The forward traced to take ``scratch`` (pinned buffers, donated) and write its offloaded
    values into them: the program a call runs (``plain``, the same forward making its own host
    buffers, is what the signature digests). Every input's and output's placement is given (the
    outputs' memory kinds as ``plain``'s), since JAX pairs a donated buffer with an output of
    the same shape *and memory kind* only when it knows them all; otherwise it may give the
    pinned buffer to a device output of that shape, and the call aborts the process."""
    device = next(iter(scratch[0].sharding.device_set))
    here = jax.sharding.SingleDeviceSharding(device, memory_kind=device.default_memory().kind)
    host = scratch[0].sharding
    ins = ([c.sharding if isinstance(c, jax.Array) else here for c in consts],
           [x.sharding if isinstance(x, jax.Array) else here for x in leaves],
           [a.sharding for a in scratch])
    outs = [host if getattr(a, "memory_space", None) == jax.memory.Space.Host else here for a in plain.jaxpr.out_avals]
    jitted = jax.jit(forward, donate_argnums=2, in_shardings=ins, out_shardings=outs)
    return jitted.trace(list(consts), list(leaves), [_jax_internals.host_aval(a) for a in scratch])


def _out_trees(opts: Options, out_shape: Any) -> tuple[Any, Any | None, list[Any]]:
    """The output's tree, aux's tree (``None`` without ``has_aux``) and the output's avals."""
    if not opts.has_aux:
        return jax.tree.structure(out_shape), None, jax.tree.leaves(out_shape)
    if not (isinstance(out_shape, (tuple, list)) and len(out_shape) == 2):
        raise InvalidArgumentError(
            "has_aux=True needs the function to return a pair (out, aux), got "
            f"{jax.tree.structure(out_shape)}"
        )
    return jax.tree.structure(out_shape[0]), jax.tree.structure(out_shape[1]), jax.tree.leaves(out_shape[0])


def _differentiated(
    opts: Options, leaves: Sequence[Any], leaf_args: list[int | str], paths: list[str], recorded: Sequence[bool] | None
) -> list[bool]:
    """Per input leaf, whether it is differentiated: every leaf of ``argnums``, or those
    ``filter`` accepts (as recorded, when rebuilding: the predicate may not understand
    abstract leaves)."""
    if recorded is not None and opts.filter is not None and len(recorded) == len(leaves):
        chosen = [bool(d) for d in recorded]
    else:
        chosen = [pos in opts.argnums and (opts.filter is None or bool(opts.filter(x)))
                  for x, pos in zip(leaves, leaf_args)]
    for j, d in enumerate(chosen):
        if d and not jax.dtypes.issubdtype(leaves[j].dtype, np.inexact):
            hint = (
                "the filter chose it" if opts.filter is not None else
                "pass filter=rs.is_inexact to differentiate only the floating leaves of a "
                "model that holds others (as eqx.filter_grad and nnx.grad do), or pass integer "
                "tokens, PRNG keys and masks as other positional arguments or as keywords"
            )
            raise InvalidArgumentError(
                f"argument {paths[j]} has dtype {leaves[j].dtype} and cannot be differentiated: {hint}"
            )
    if opts.filter is not None and not any(chosen):
        raise InvalidArgumentError(f"{opts.label} has no leaf to differentiate (the filter rejects them all)")
    return chosen


def _record_call(
    opts: Options,
    n_args: int,
    treedef: Any,
    static_pairs: list[tuple[int, Any]],
    keywords: Keywords,
    in_avals: Sequence[InputAval],
    context_mesh: Any,
    differentiated: Sequence[bool],
) -> CallSpec:
    """How the forward was called, for a split in another process to trace it again."""
    try:
        tree_record = structure.encode_treedef(treedef)
        statics_record: Any = tuple((i, structure.encode_value(v)) for i, v in static_pairs)
        kw_record: Any = tuple((n, structure.encode_value(v)) for n, v in keywords.static)
        unrecorded = None
    except structure.UnrecordableError as err:
        tree_record = statics_record = None
        kw_record = None if keywords.static else ()  # () where no keyword is static: no record owed
        unrecorded = str(err)
    return CallSpec(
        n_args=n_args,
        argnums=opts.argnums_option,
        weight_argnums=opts.weight_argnums,
        static_argnums=opts.static_argnums,
        has_aux=opts.has_aux,
        in_avals=tuple(in_avals),
        in_tree=tree_record,
        statics=statics_record,
        kwnames=keywords.dynamic,
        static_kwargs=kw_record,
        context_mesh=context_mesh,
        unrecorded=unrecorded,
        differentiated=None if opts.filter is None else tuple(differentiated),
        save=opts.save.record,
    )


def _spec(
    opts: Options,
    signature: str,
    call: CallSpec,
    res_slots: Sequence[slots.Slot],
    residual_types: Sequence[Any],
    paths: list[str],
    leaf_args: list[int | str],
    n_consts: int,
    traced: Any,
) -> ResidualSpec:
    """The residuals' spec: their avals, names, input paths and kinds, and which the forward
    put in host memory."""
    output_slots = [i for src, i in res_slots if src == slots.FROM_OUTPUT]
    # Intermediates are placed after the nearest weight (else differentiated input) feeding
    # them; the forward jaxpr's inputs are the constants, then the flat input leaves.
    weights = [n_consts + j for j, pos in enumerate(leaf_args) if pos in opts.weight_argnums]
    diffs = [n_consts + j for j, pos in enumerate(leaf_args) if pos in opts.argnums]
    found = output_origins(traced.jaxpr, output_slots, weights=weights, inputs=diffs)
    origins = dict(zip(output_slots, found))
    labels: list[str] = []
    input_paths: list[str | None] = []
    kinds: list[ResidualKind] = []
    for src, i in res_slots:
        if src == slots.FROM_CONST:
            labels.append(names.constant_name(i))
            input_paths.append(None)
            kinds.append("constant")
        elif src == slots.FROM_INPUT:
            labels.append(names.input_name(paths[i]))
            input_paths.append(paths[i])
            kinds.append("weight" if leaf_args[i] in opts.weight_argnums else "input")
        else:
            labels.append(names.origin_name(origins[i], paths, n_consts))
            input_paths.append(None)
            kinds.append("intermediate")
    return ResidualSpec(
        signature=signature,
        avals=tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in residual_types),
        names=tuple(labels),
        input_paths=tuple(input_paths),
        kinds=tuple(kinds),
        call=call,
        on_host=tuple(i for i, (k, a) in enumerate(zip(kinds, residual_types))
                      if k == "intermediate" and getattr(a, "memory_space", None) == jax.memory.Space.Host),
    )


def _flat_backward(
    opts: Options,
    vjp_tree: Any,
    out_avals: Sequence[Any],
    treedef: Any,
    positions: list[int | str],
    differentiated: Sequence[bool],
) -> tuple[FlatBackward, Any, tuple[tuple[int, Any], ...]]:
    """``(residuals, float cotangents) -> gradient leaves in argnums order``, a template of
    the gradients (the differentiated arguments with ``0`` leaves, ``None`` where a leaf is
    passed through; a tuple when argnums is a tuple), and each argument's template by
    position, in argnums order."""
    float_out = [jax.dtypes.issubdtype(a.dtype, np.inexact) for a in out_avals]
    zero_cts = [
        None if is_float else np.zeros(a.shape, jax.dtypes.float0)
        for a, is_float in zip(out_avals, float_out)
    ]
    # vjp_fn returns one gradient per differentiated leaf, in flat-input order; the result
    # follows argnums, each argument's leaves in its own order.
    marks = list(filters.thaw(jax.tree.unflatten(treedef, [0 if d else None for d in differentiated]), None))
    by_pos = {p: marks[k] for k, p in enumerate(positions)}
    starts = np.cumsum([0] + [c.num_leaves for c in treedef.children()])
    leaf_range = {p: range(int(starts[k]), int(starts[k + 1])) for k, p in enumerate(positions)}
    rank = {j: r for r, j in enumerate(j for j, d in enumerate(differentiated) if d)}
    perm = [rank[j] for p in opts.argnums for j in leaf_range[p] if differentiated[j]]
    grad_struct = tuple(by_pos[p] for p in opts.argnums)
    grad_tree = grad_struct[0] if opts.single else grad_struct

    def flat_backward(residuals: Sequence[Any], cts: Sequence[Any]) -> list[Any]:
        vjp_fn = jax.tree.unflatten(vjp_tree, residuals)
        given = iter(cts)
        full = [next(given) if z is None else z for z in zero_cts]
        grads = list(vjp_fn(full))
        return [grads[k] for k in perm]

    return flat_backward, grad_tree, tuple((p, by_pos[p]) for p in opts.argnums)
