"""``rs.split``: run the forward now, the backward later, from typed residuals.

Calling a :class:`Split` runs the forward once, through an executable compiled ahead of time
and cached per signature, and returns the output with a :class:`ResidualContext`. The backward
(:meth:`Split.backward` or :func:`residual_store.backward`) runs from the context alone, through
a second executable compiled once per signature; it never re-evaluates the forward beyond what
the function's own ``jax.checkpoint`` policies ask to recompute.

How it works, per new signature: ``fun`` is traced once to a jaxpr; the forward executable
evaluates that jaxpr under ``jax.vjp`` and returns the output and the *computed* residuals.
Residuals that are the inputs themselves (weights, the batch) or closed-over constants are not
returned by the executable: the context takes the live arrays, so weights are never copied. The
backward is traced too (not compiled) so that the signature covers what both compute.

A context records how the forward was called (:class:`~residual_store._src.context.CallSpec`), so a
split in another process, which never ran this forward, can trace the same forward and backward
from avals alone, check that they give the context's signature, and run the backward.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from cachetools import LRUCache

from residual_store._src import filters, jaxpr_walks, rebuild, slots
from residual_store._src.backward import Backward, register_backward, staged
from residual_store._src.cache import DEFAULT_CACHE_SIZE, CacheInfo, ExecutableCache
from residual_store._src.context import (
    CallSpec,
    ResidualContext,
    ResidualSpec,
    bound_context,
    check_representable,
    consumed,
    describe_residual,
)
from residual_store._src.errors import InvalidArgumentError, RecomputeWarning, SignatureMismatchError
from residual_store._src.halves import GradParts, Halves
from residual_store._src.keypaths import PathStructure
from residual_store._src.plan.request import PlanOptions
from residual_store._src.plan.request import remember as remember_plan
from residual_store._src.remat import SaveChoice
from residual_store._src.scratch import Scratch
from residual_store._src.trace import NO_KEYWORDS, Keywords, Options, Traced, checked_argnames, trace

__all__ = ["Split", "split"]

_WARNED_SIGNATURES: set[str] = set()
_SCALAR_TYPES = (bool, int, float, complex, np.generic)
_MAX_FOREIGN = 256  # signatures a split remembers it does not make


@dataclasses.dataclass(frozen=True)
class _Forward:
    """Everything one signature needs at call time."""

    executable: Any
    consts: tuple[Any, ...]
    slots: tuple[slots.Slot, ...]
    n_out: int
    out_tree: Any
    aux_tree: Any | None
    spec: ResidualSpec
    backward: Backward
    # the pinned buffers its offloaded values go into (None: it offloads nothing), and their
    # positions among its outputs
    scratch: Scratch | None = None
    scratch_outputs: tuple[int, ...] = ()

    def run(self, leaves: list[Any], inlined: bool) -> list[Any]:
        """The forward's outputs on ``leaves``: handed the pinned buffers its offloaded values go
        into (donated), and keeping them again as outputs; none where it runs inlined in the
        caller's trace (it makes its own there)."""
        if self.scratch is None or inlined:
            return self.executable(list(self.consts), leaves, [])
        outputs = self.executable(list(self.consts), leaves, self.scratch.lend())
        self.scratch.keep([outputs[i] for i in self.scratch_outputs])
        return outputs


def _normalize_argnums(argnums: int | Sequence[int], name: str) -> tuple[int, ...]:
    items = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    for a in items:
        if not isinstance(a, int) or isinstance(a, bool) or a < 0:
            raise InvalidArgumentError(f"{name} must hold non-negative ints, got {argnums!r}")
    if len(set(items)) != len(items):
        raise InvalidArgumentError(f"{name} has repeated entries: {argnums!r}")
    return items


def _parameter_names(fun: Callable[..., Any]) -> tuple[str, ...] | None:
    try:
        params = inspect.signature(fun).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)


def _as_array(x: Any, where: str) -> jax.Array:
    if isinstance(x, jax.Array):
        return x
    if isinstance(x, (np.ndarray, *_SCALAR_TYPES)):
        return jnp.asarray(x)
    raise InvalidArgumentError(
        f"{where} is a {type(x).__module__}.{type(x).__qualname__}, not an array or scalar: "
        "pass arrays (or pytrees of arrays), or make it static: static_argnums for a positional "
        "argument, static_argnames for a keyword"
    )


def _context_mesh() -> tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...]] | None:
    """The abstract mesh the caller traces under (``jax.set_mesh``), as names, sizes, types."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.axis_names:
        return None
    types = tuple(getattr(t, "name", str(t)) for t in (mesh.axis_types or ()))
    return tuple(mesh.axis_names), tuple(int(n) for n in mesh.axis_sizes), types


def _checked_options(
    fun: Callable[..., Any],
    argnums: int | Sequence[int],
    has_aux: bool,
    static_argnums: int | Sequence[int],
    static_argnames: str | Sequence[str],
    weight_argnums: int | Sequence[int] | None,
    filter: Callable[[Any], bool] | None,  # noqa: A002
    save: str | Callable[..., Any] | PlanOptions,
) -> Options:
    """:func:`split`'s arguments, checked, as the frozen options a trace reads.

    Raises:
      InvalidArgumentError: an argument is of the wrong kind, or they contradict each other.
    """
    save_choice = SaveChoice.parse(save)
    if not callable(fun):
        raise InvalidArgumentError(f"split expects a callable, got {type(fun).__name__}")
    diff = _normalize_argnums(argnums, "argnums")
    if not diff:
        raise InvalidArgumentError("argnums must name at least one argument")
    statics = tuple(sorted(_normalize_argnums(static_argnums, "static_argnums")))
    clash = set(diff) & set(statics)
    if clash:
        raise InvalidArgumentError(f"arguments {sorted(clash)} are in both argnums and static_argnums")
    weights = (diff[0],) if weight_argnums is None else _normalize_argnums(weight_argnums, "weight_argnums")
    extra = sorted(set(weights) - set(diff))
    if extra:
        raise InvalidArgumentError(
            f"weight_argnums {extra} are not in argnums {diff}: weights are arguments the split differentiates"
        )
    if filter is not None and not callable(filter):
        raise InvalidArgumentError(f"filter must be a predicate on leaves, got {type(filter).__name__}")
    names = checked_argnames(fun, static_argnames, diff)
    return Options(
        fun=fun,
        argnums=diff,
        single=isinstance(argnums, int),
        static_argnums=statics,
        weight_argnums=weights,
        has_aux=bool(has_aux),
        filter=filter,
        save=save_choice,
        param_names=_parameter_names(fun),
        static_argnames=names,
    )


class Split:
    """A function split into a forward that returns residuals and a backward that consumes them.

    Made by :func:`split`, which checks the arguments (see there). ``split(fun)(*args, **kwargs)`` returns
    ``(out, ctx)`` (``((out, aux), ctx)`` with ``has_aux``); ``backward(ctx, cotangent)`` returns
    gradients shaped like ``args[argnums]``.
    """

    def __init__(self, options: Options, *, save: str | Callable[..., Any] | PlanOptions, cache_size: int) -> None:
        self.save = save  # as given; self._opts.save is it parsed
        self._opts = options
        self._forward_compiles = 0
        self._backward_compiles = 0
        self._count_lock = threading.Lock()
        self._trace_lock = threading.Lock()
        self._by_signature: dict[str, Backward] = {}  # this split owns its backwards
        self._grad_parts: dict[str, GradParts] = {}  # what a B/W split of each needs
        self._halves: dict[tuple[str, tuple[int, ...], bool], Halves] = {}
        self._foreign: LRUCache[str, str] = LRUCache(_MAX_FOREIGN)  # signatures it does not make -> why
        self._cache: ExecutableCache[_Forward] = ExecutableCache(cache_size, on_evict=self._evicted)
        self.__wrapped__ = options.fun

    fun = property(lambda self: self._opts.fun, doc="The function split.")
    argnums = property(lambda self: self._opts.argnums, doc="The differentiated arguments, a tuple.")
    static_argnums = property(lambda self: self._opts.static_argnums, doc="The static arguments, sorted.")
    static_argnames = property(lambda self: self._opts.static_argnames, doc="The static keywords, sorted.")
    weight_argnums = property(lambda self: self._opts.weight_argnums, doc="The arguments that hold weights.")
    has_aux = property(lambda self: self._opts.has_aux, doc="Whether ``fun`` returns ``(out, aux)``.")
    filter = property(lambda self: self._opts.filter, doc="The predicate choosing differentiated leaves, or None.")

    def _evicted(self, entry: _Forward) -> None:
        """The cache dropped a signature's forward: its backward's executables go too, and its
        B/W halves' (each compiles again if a context of it comes back)."""
        entry.backward.drop_compiled()
        for (signature, _, _), halves in list(self._halves.items()):
            if signature == entry.spec.signature:
                halves.drop_compiled()

    def __repr__(self) -> str:
        return self._opts.label

    @property
    def _argnums_option(self) -> int | tuple[int, ...]:
        return self._opts.argnums_option

    # -- calling ----------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, ResidualContext]:
        keywords, kw_values = self._keywords(kwargs) if kwargs else (NO_KEYWORDS, ())
        statics = tuple(args[i] for i in self.static_argnums if i < len(args))
        # the traced tuple: the traced positional arguments, then the traced keywords by name
        dyn = tuple(a for i, a in enumerate(args) if i not in self.static_argnums) + kw_values
        if self.filter is not None:  # non-array leaves are static, as under eqx.filter_jit
            dyn = filters.freeze_non_arrays(dyn)
        leaves, treedef = jax.tree.flatten(dyn)
        leaves = [
            x if isinstance(x, jax.Array) else _as_array(x, self._leaf_where(len(args), keywords, treedef, leaves, i))
            for i, x in enumerate(leaves)
        ]
        inlined = staged(leaves, f"{self!r}")  # inside the caller's jax.jit
        try:
            placements = tuple((x.aval, None if inlined else x.sharding) for x in leaves)
            # the static values' types too: True == 1, and the two are different signatures
            types = tuple(map(type, statics)) + tuple(type(v) for _, v in keywords.static)
            key = (len(args), keywords, types, treedef, statics, placements, inlined)
            hash(key)
        except TypeError:
            raise InvalidArgumentError(self._unhashable(statics, keywords)) from None
        entry = self._cache.get(key)
        if entry is None:
            entry = self._compile_forward(args, keywords, leaves, treedef, statics, key, inlined)
        outputs = entry.run(leaves, inlined)
        residuals = tuple(slots.gather(entry.slots, entry.consts, leaves, outputs))
        out = jax.tree.unflatten(entry.out_tree, outputs[: entry.n_out])
        ctx = bound_context(entry.spec, residuals, backward=entry.backward)
        if entry.aux_tree is not None:
            n_aux = entry.aux_tree.num_leaves
            aux = jax.tree.unflatten(entry.aux_tree, outputs[entry.n_out : entry.n_out + n_aux])
            return (out, aux), ctx
        return out, ctx

    def backward(
        self,
        ctx: ResidualContext,
        cotangent: Any = None,
        *,
        like: Any = None,
        now: int | Sequence[int] | None = None,
    ) -> Any:
        """Gradients from a context of a signature this split makes; never re-runs the forward.

        The context may come from a store, written by another process: a signature this split
        has not traced yet is rebuilt from the avals the context records (the forward and the
        backward are traced, nothing is run or compiled but the backward), checked against the
        context's signature, and kept for later contexts of that signature.

        ``cotangent`` matches the output (not aux); ``None`` means 1 for a scalar float output.
        ``like``: a tree to rebuild the gradients on (see :func:`residual_store.backward`).
        May be called any number of times on one context; inside ``jax.jit`` it is inlined.

        ``now`` (an int or a tuple, a subset of ``argnums`` leaving at least one out) splits the
        backward in two, as zero-bubble pipeline schedules do: it returns ``(g_now, later)``,
        the gradients of the ``now`` arguments (an int gives one gradient, a tuple a tuple),
        computed at once (**B**), and ``later``, a :class:`ResidualContext` holding only what
        the remaining gradients need: the cotangents arriving at the operations that consume
        the other arguments, and the residuals only those read. ``rs.backward(later)`` (no
        cotangent) returns the remaining gradients (**W**), in ``argnums`` order: one gradient
        when one argument remains, else a tuple. Together they equal the plain backward within
        float rounding; W never repeats an operation B ran. ``later`` has its own signature
        and compiled backward, and can be put in a store and resumed like any context.

        Example:
          >>> import jax, jax.numpy as jnp, residual_store as rs
          >>> def stage(w, x):
          ...     return jnp.tanh(x @ w)
          >>> fwd = rs.split(stage, argnums=(0, 1))
          >>> w, x = jnp.ones((3, 2)), jnp.ones((4, 3))
          >>> y, ctx = fwd(w, x)
          >>> dx, later = fwd.backward(ctx, jnp.ones_like(y), now=1)   # B: for the previous stage
          >>> dw = rs.backward(later)                                  # W: when a bubble comes
          >>> bool(jnp.allclose(dw, fwd.backward(ctx, jnp.ones_like(y))[0]))
          True

        Raises:
          SignatureMismatchError: the context was made by another function, with other options,
            or from closed-over values that differ from this process's; or the cotangent does
            not match the output.
          InvalidArgumentError: ``now`` is not a proper subset of ``argnums``, or the context is
            already a ``later`` one.
        """
        if not isinstance(ctx, ResidualContext):
            raise InvalidArgumentError(f"backward expects a rs.ResidualContext, got {type(ctx).__name__}")
        # before any trace: a 64-bit context traced again under x64 off gets another signature
        check_representable(ctx.spec.avals, describe_residual(ctx.spec, "this context"), "running its backward")
        if now is not None:
            if like is not None:
                raise InvalidArgumentError("like= rebuilds a backward's gradients without a split: not with now=")
            halves = self._halves_of(ctx.spec, now)(ctx, cotangent)
            consumed(ctx, halves[0])  # (a store that handed ``ctx`` out waits on the B half for room)
            return halves
        bwd = self._by_signature.get(ctx.spec.signature)
        if bwd is None:
            bwd = self._rebuild(ctx.spec)
        return bwd(ctx, cotangent, like=like)

    def _traced_spec(self, signature: str) -> ResidualSpec:
        """The spec of the contexts of ``signature``, a signature this split traced."""
        spec = self._grad_parts[signature].spec
        assert spec is not None, "a traced signature's parts carry its spec"
        return spec

    def _halves_of(self, spec: ResidualSpec, now: int | Sequence[int]) -> Halves:
        """The B/W halves of ``spec``'s signature for ``now``, made once per pair."""
        now_t = _normalize_argnums(now, "now")
        single = isinstance(now, int)
        if not now_t or set(now_t) - set(self.argnums):
            raise InvalidArgumentError(f"now={now!r} must name arguments among argnums {self._argnums_option!r}")
        if set(now_t) == set(self.argnums):
            raise InvalidArgumentError(
                f"now={now!r} names every argument in argnums {self._argnums_option!r}: nothing "
                "would be left for later; call backward without now"
            )
        if spec.call is not None and spec.call.now is not None:
            raise InvalidArgumentError(
                "this context is already the later half of a B/W split: run it with rs.backward(later)"
            )
        key = (spec.signature, now_t, single)
        found = self._halves.get(key)
        if found is not None:
            return found
        parent = self._by_signature.get(spec.signature) or self._rebuild(spec)
        with self._trace_lock:
            found = self._halves.get(key)
            if found is None:
                split_ref = weakref.ref(self)
                found = Halves(
                    parent=parent,
                    spec=self._traced_spec(spec.signature),
                    parts=self._grad_parts[spec.signature],
                    now=now_t,
                    now_single=single,
                    arg_name=self._opts.arg_name,
                    on_compile=lambda: _count_backward(split_ref),
                )
                later = found.weight_backward
                self._by_signature.setdefault(later.signature, later)
                register_backward(self._by_signature[later.signature])
                self._halves[key] = found
        return found

    def cache_info(self) -> CacheInfo:
        """Compile counts and cache statistics (see :class:`CacheInfo`)."""
        forwards = {entry.spec.signature for entry in self._cache.values()}
        with self._trace_lock:
            resumed = sum(sig not in forwards and bwd.holds_compiled for sig, bwd in self._by_signature.items())
        return CacheInfo(
            forward_compiles=self._forward_compiles,
            backward_compiles=self._backward_compiles,
            hits=self._cache.hits,
            misses=self._cache.misses,
            currsize=len(self._cache) + resumed,
            maxsize=self._cache.maxsize,
        )

    # -- rebuilding a backward from a context's record --------------------------------------

    def _rebuild(self, spec: ResidualSpec) -> Backward:
        """The backward of ``spec``'s signature, traced from the context's call record
        (:mod:`residual_store._src.rebuild`).

        A trace whose signature differs is remembered (tracing again would give the same); a
        record this process cannot read yet (a module not imported) is not: importing it fixes
        that. A ``later`` context's backward is the W half of its parent's, rebuilt likewise."""
        call = spec.call
        if call is not None and call.now is not None:
            return self._rebuild_later(spec, call)
        sig = spec.signature
        with self._trace_lock:
            bwd = self._by_signature.get(sig)
            if bwd is not None:
                return bwd
            why = self._foreign.get(sig)
            if why is None:
                inputs = rebuild.inputs_of(self._opts, spec)
                try:
                    traced = rebuild.trace_record(self._opts, spec, inputs)
                    bwd = self._own(traced)
                    rebuild.check_signature(self._opts, spec, traced)
                    return bwd
                except SignatureMismatchError as err:
                    why = self._foreign[sig] = str(err)
        raise SignatureMismatchError(why)

    def _rebuild_later(self, spec: ResidualSpec, call: CallSpec) -> Backward:
        """The W half for a ``later`` context: its parent's backward rebuilt from the call record
        (which is the parent's), split for the same ``now``, and checked to compute the
        context's signature."""
        assert call.now is not None and call.parent is not None
        parent = call.parent
        if parent not in self._grad_parts:
            stub = ResidualSpec(
                signature=parent, avals=(), names=(), input_paths=(), kinds=(),
                call=dataclasses.replace(call, now=None, parent=None),
            )
            self._rebuild(stub)
        try:
            halves = self._halves_of(self._traced_spec(parent), call.now)
        except InvalidArgumentError as err:
            raise rebuild.mismatch(self._opts, spec, f": its record asks for a split now={call.now!r} ({err})") from None
        if halves.later_spec.signature != spec.signature or halves.later_spec.avals != spec.avals:
            raise rebuild.mismatch(
                self._opts,
                spec,
                f": split with now={call.now!r}, its parent {parent} gives the later signature "
                f"{halves.later_spec.signature}",
            )
        return halves.weight_backward

    # -- tracing (once per signature) -------------------------------------------------------

    def _keywords(self, kwargs: dict[str, Any]) -> tuple[Keywords, tuple[Any, ...]]:
        """The call's keywords, sorted by name: those in ``static_argnames`` static, the others
        traced (their values returned, in that order)."""
        named = self._opts.static_argnames
        dynamic = tuple(sorted(n for n in kwargs if n not in named))
        static = tuple(sorted(((n, v) for n, v in kwargs.items() if n in named), key=lambda p: p[0]))
        return Keywords(dynamic, static), tuple(kwargs[n] for n in dynamic)

    def _unhashable(self, statics: tuple[Any, ...], keywords: Keywords) -> str:
        """Why a call's cache key could not be hashed, naming the arguments."""
        positions = self.static_argnums[: len(statics)]  # sorted: the ones this call passed
        named = [(f"argument {self._opts.arg_name(i)}", v) for i, v in zip(positions, statics)]
        named += [(f"keyword {n}", v) for n, v in keywords.static]
        bad = [f"{where} ({type(v).__name__})" for where, v in named if not _hashable(v)]
        if bad:
            return f"static arguments must be hashable, as jax.jit's are: {', '.join(bad)} is not"
        return "under a filter, the leaves that are not arrays are static and must be hashable"

    def _leaf_where(self, n_args: int, keywords: Keywords, treedef: Any, leaves: list[Any], index: int) -> str:
        # Only reached for a bad leaf: rebuild the paths to name it.
        dyn = jax.tree.unflatten(treedef, [0] * len(leaves))
        return "argument " + self._opts.leaf_paths(dyn, n_args, keywords)[index]

    def _compile_forward(
        self,
        args: tuple[Any, ...],
        keywords: Keywords,
        leaves: list[jax.Array],
        treedef: Any,
        statics: tuple[Any, ...],
        key: Any,
        inlined: bool,
    ) -> _Forward:
        """The forward of a new signature: compiled ahead of time, or (``inlined``: called
        inside the caller's ``jax.jit``) a jitted function the caller's trace inlines."""
        with self._trace_lock:
            entry = self._cache.peek(key)
            if entry is not None:
                return entry
            self._opts.check_keywords(len(args), keywords)
            self._opts.check_arity(args, keywords)
            t = trace(self._opts, args, leaves, treedef, statics, None, _context_mesh(), keywords=keywords)
            backward = self._own(t)
            self._warn_recompute(t.closed, t.spec.signature)
            if inlined:
                executable = t.jitted
            else:
                executable = t.traced.lower().compile()
                self._count("forward")
            entry = _Forward(
                executable=executable,
                consts=t.consts,
                slots=t.slots,
                n_out=t.n_out,
                out_tree=t.out_tree,
                aux_tree=t.aux_tree,
                spec=t.spec,
                backward=backward,
                scratch=Scratch(t.scratch) if t.scratch else None,
                scratch_outputs=t.scratch_outputs,
            )
            self._cache.put(key, entry)
            return entry

    def _own(self, t: Traced) -> Backward:
        """The backward of ``t``'s signature: this split's if it has one, else made from ``t``
        and kept (with what a B/W split of it needs); registered either way."""
        signature = t.spec.signature
        bwd = self._by_signature.get(signature)
        if bwd is None:
            callbacks = jaxpr_walks.host_callbacks(t.backward_jaxpr)
            split_ref = weakref.ref(self)
            bwd = Backward(
                signature=signature,
                flat_fn=t.flat_backward,
                out_structure=PathStructure.of(t.out_tree),
                out_avals=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in t.out_avals],
                grad_structure=PathStructure.of_template(t.grad_tree),
                on_compile=lambda: _count_backward(split_ref),
                jitted=t.backward_jit,
                unexportable=f"its backward calls back into Python ({', '.join(sorted(set(callbacks)))})"
                if callbacks
                else None,
            )
            self._by_signature[signature] = bwd
            self._grad_parts[signature] = t.parts
        if t.plan is not None:  # save=rs.plan(...): rs.explain finds it by signature
            remember_plan(signature, t.plan)
        register_backward(bwd)
        return bwd

    def _count(self, which: str) -> None:
        with self._count_lock:
            if which == "forward":
                self._forward_compiles += 1
            else:
                self._backward_compiles += 1

    def _warn_recompute(self, closed: Any, signature: str) -> None:
        if signature in _WARNED_SIGNATURES:
            return
        found = jaxpr_walks.unoptimized_remat_custom_vjps(closed)
        if found:
            _WARNED_SIGNATURES.add(signature)
            warnings.warn(
                f"{len(found)} jax.custom_vjp call(s) under jax.checkpoint/remat without "
                f"optimize_remat ({', '.join(found)}): each one's fwd will run twice, once in the "
                "forward and again in the backward (upstream jax issue 21303). Define the rule "
                "with `f.defvjp(fwd, bwd, optimize_remat=True)` so the forward runs f and the "
                "backward runs fwd and bwd once each.",
                RecomputeWarning,
                stacklevel=4,
            )


def _hashable(v: Any) -> bool:
    try:
        hash(v)
    except TypeError:
        return False
    return True


def _count_backward(split_ref: weakref.ref[Split]) -> None:
    """Counts a backward compile on its split, if the split is still alive (a backward does not
    keep its split alive: contexts may outlive it)."""
    split_obj = split_ref()
    if split_obj is not None:
        split_obj._count("backward")


def split(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    has_aux: bool = False,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    weight_argnums: int | Sequence[int] | None = None,
    filter: Callable[[Any], bool] | None = None,  # noqa: A002
    cache_size: int = DEFAULT_CACHE_SIZE,
    save: str | Callable[..., Any] | PlanOptions = "all",
) -> Split:
    """Splits ``fun`` into a forward that returns typed residuals and a backward that uses them.

    Args:
      fun: the function to differentiate; its arguments are arrays or pytrees of arrays, but
        those named static.
      argnums: which positional arguments to differentiate (int or tuple), as in ``jax.grad``.
        Other positional arguments (integer tokens, PRNG keys, masks) get no gradient.
        Keyword arguments (``mask=``, ``key=``, ``deterministic=``) pass through as in
        ``jax.grad``: never differentiated, traced as in ``jax.jit`` (a Python scalar becomes
        an array) unless named in ``static_argnames``. Their names, avals and static values are
        part of the signature and of the context's record.
      has_aux: ``fun`` returns ``(out, aux)``; only ``out`` is differentiated.
      static_argnums: hashable Python arguments that become part of the signature.
      static_argnames: keyword arguments (a name or names) whose hashable Python values (a
        ``train`` flag) become part of the signature, as ``jax.jit``'s; each must be a
        parameter ``fun`` takes by keyword, passed by keyword (or named in
        ``static_argnums`` too).
      weight_argnums: the arguments (a subset of ``argnums``; ``None``: the first of
        ``argnums``) that hold weights: shared by every context, held by reference, stored once
        per store and never counted against a store's budgets. Every other input residual (a
        pipeline stage's input activation, the data batch) is the context's own memory:
        counted, offloaded and stored with the context.
      filter: a predicate on the leaves of the ``argnums`` arguments choosing which to
        differentiate (e.g. :func:`residual_store.is_inexact`, as ``eqx.filter_grad`` and
        ``nnx.grad`` do); the others are passed through and get ``None`` gradients. ``None``
        (the default): every leaf is differentiated, and must be floating. The choice per
        leaf is part of the signature.
      cache_size: how many signatures keep their compiled executables (least recently used
        dropped first).
      save: ``"all"`` (the default) keeps every residual ``jax.vjp`` keeps; ``"auto"`` keeps the
        values with the fewest bytes from which the backward recomputes the rest using only
        cheap, pure operations (elementwise, layout, reductions, indexing; never matrix
        products, convolutions, custom_vjp / custom_jvp calls, custom calls, callbacks, RNG
        operations, collectives, ``checkpoint_name``'d values, or inside the function's own
        ``checkpoint``, ``while`` and ``cond`` bodies; ``jit`` and ``scan`` bodies are planned
        through), see :mod:`residual_store._src.remat`. A JAX checkpoint policy (e.g.
        ``jax.checkpoint_policies.dots_saveable``) instead lets the backward recompute what the
        policy does not save, with the same exceptions (RNG, kernels, callbacks, collectives and
        higher-order primitives but ``scan`` are never recomputed). :func:`residual_store.plan`
        (``save=rs.plan(device_budget=...)``) chooses per residual to keep it, offload it to
        host memory or recompute it, the fastest step whose contexts fit the budget
        (:func:`residual_store.explain` shows the choice). The choice is part of the signature.

    Returns:
      A :class:`Split`: ``out, ctx = fwd(*args, **kwargs)``; ``grads = fwd.backward(ctx, cotangent)``.

    Example:
      >>> import jax, jax.numpy as jnp, residual_store as rs
      >>> def loss(params, x):
      ...     return jnp.mean(jnp.tanh(x @ params["w"]) ** 2)
      >>> fwd = rs.split(loss)
      >>> params = {"w": jax.random.normal(jax.random.key(0), (4, 3))}
      >>> x = jax.random.normal(jax.random.key(1), (8, 4))
      >>> value, ctx = fwd(params, x)       # forward now ...
      >>> grads = fwd.backward(ctx)         # ... backward later, no forward re-run
      >>> bool(jnp.allclose(grads["w"], jax.grad(loss)(params, x)["w"], atol=1e-6))
      True
    """
    options = _checked_options(
        fun, argnums, has_aux, static_argnums, static_argnames, weight_argnums, filter, save
    )
    return Split(options, save=save, cache_size=cache_size)
