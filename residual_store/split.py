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

A context records how the forward was called (:class:`~residual_store.context.CallSpec`), so a
split in another process, which never ran this forward, can trace the same forward and backward
from avals alone, check that they give the context's signature, and run the backward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
import warnings
import weakref
from cachetools import LRUCache
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from residual_store import _jax_internals, filters, names, placement, remat, structure
from residual_store.backward import Backward, register_backward, staged
from residual_store.cache import DEFAULT_CACHE_SIZE, CacheInfo, ExecutableCache
from residual_store.canonical import qualified_name
from residual_store.context import CallSpec, InputAval, ResidualContext, ResidualSpec, check_representable, describe_residual
from residual_store.errors import (
    InvalidArgumentError,
    RecomputeWarning,
    ResidualStoreError,
    SignatureMismatchError,
)
from residual_store.halves import GradParts, Halves
from residual_store.keypaths import PathStructure
from residual_store.origins import output_origins
from residual_store.signature import compute_signature, is_current

__all__ = ["Split", "split"]

# Where a residual's array comes from at call time.
_FROM_CONST, _FROM_INPUT, _FROM_OUTPUT = 0, 1, 2

_WARNED_SIGNATURES: set[str] = set()
_SCALAR_TYPES = (bool, int, float, complex, np.generic)
_MAX_FOREIGN = 256  # signatures a split remembers it does not make
_SAVE_CHOICES = ("all", "auto")


@dataclasses.dataclass(frozen=True)
class _Traced:
    """One signature's forward, traced (not compiled), with its backward."""

    closed: Any  # fun's jaxpr
    traced: Any  # jax.stages.Traced of the forward executable
    jitted: Any  # jax.jit of the forward, for calls inside the caller's jax.jit
    consts: tuple[Any, ...]
    slots: tuple[tuple[int, int], ...]  # (source, index) per residual
    n_out: int
    out_tree: Any
    aux_tree: Any | None
    spec: ResidualSpec
    backward: Backward


@dataclasses.dataclass(frozen=True)
class _Forward:
    """Everything one signature needs at call time."""

    executable: Any
    consts: tuple[Any, ...]
    slots: tuple[tuple[int, int], ...]
    n_out: int
    out_tree: Any
    aux_tree: Any | None
    spec: ResidualSpec
    backward: Backward


def _normalize_argnums(argnums: int | Sequence[int], name: str) -> tuple[int, ...]:
    items = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    for a in items:
        if not isinstance(a, int) or isinstance(a, bool) or a < 0:
            raise InvalidArgumentError(f"{name} must hold non-negative ints, got {argnums!r}")
    if len(set(items)) != len(items):
        raise InvalidArgumentError(f"{name} has repeated entries: {argnums!r}")
    return items


def _parameter_names(fun: Callable[..., Any]) -> list[str] | None:
    try:
        params = inspect.signature(fun).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds]


def _as_array(x: Any, where: str) -> jax.Array:
    if isinstance(x, jax.Array):
        return x
    if isinstance(x, (np.ndarray, *_SCALAR_TYPES)):
        return jnp.asarray(x)
    raise InvalidArgumentError(
        f"{where} is a {type(x).__module__}.{type(x).__qualname__}, not an array or scalar: "
        "pass arrays (or pytrees of arrays), or make it static with static_argnums"
    )


def _context_mesh() -> tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...]] | None:
    """The abstract mesh the caller traces under (``jax.set_mesh``), as names, sizes, types."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.axis_names:
        return None
    types = tuple(getattr(t, "name", str(t)) for t in (mesh.axis_types or ()))
    return tuple(mesh.axis_names), tuple(int(n) for n in mesh.axis_sizes), types


def _enter_mesh(record: tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...]] | None) -> Any:
    """A context manager re-entering a recorded context mesh: concrete where this process has
    the devices, abstract otherwise."""
    if record is None:
        return contextlib.nullcontext()
    names, sizes, types = record
    kinds = tuple(jax.sharding.AxisType[t] for t in types) if types else None
    n = int(np.prod(sizes))
    if len(jax.devices()) >= n:
        devices = np.array(jax.devices()[:n], dtype=object).reshape(sizes)
        return jax.set_mesh(jax.sharding.Mesh(devices, names, axis_types=kinds))
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh(sizes, names, axis_types=kinds))


class Split:
    """A function split into a forward that returns residuals and a backward that consumes them.

    Made by :func:`split`; see there for the arguments. ``split(fun)(*args)`` returns
    ``(out, ctx)`` (``((out, aux), ctx)`` with ``has_aux``); ``backward(ctx, cotangent)`` returns
    gradients shaped like ``args[argnums]``.
    """

    def __init__(
        self,
        fun: Callable[..., Any],
        argnums: int | Sequence[int] = 0,
        *,
        has_aux: bool = False,
        static_argnums: int | Sequence[int] = (),
        weight_argnums: int | Sequence[int] | None = None,
        filter: Callable[[Any], bool] | None = None,  # noqa: A002 - named like eqx.filter_grad's
        cache_size: int = DEFAULT_CACHE_SIZE,
        save: str | Callable[..., Any] = "all",
    ) -> None:
        if callable(save):
            self._save_record = f"policy:{qualified_name(save)}"
        elif save in _SAVE_CHOICES:
            self._save_record = save
        else:
            raise InvalidArgumentError(
                f"save must be one of {', '.join(map(repr, _SAVE_CHOICES))} or a JAX checkpoint policy "
                f"(a callable such as jax.checkpoint_policies.dots_saveable), got {save!r}"
            )
        self.save = save
        if not callable(fun):
            raise InvalidArgumentError(f"split expects a callable, got {type(fun).__name__}")
        self.fun = fun
        self.argnums = _normalize_argnums(argnums, "argnums")
        if not self.argnums:
            raise InvalidArgumentError("argnums must name at least one argument")
        self._single = isinstance(argnums, int)
        self.static_argnums = tuple(sorted(_normalize_argnums(static_argnums, "static_argnums")))
        clash = set(self.argnums) & set(self.static_argnums)
        if clash:
            raise InvalidArgumentError(f"arguments {sorted(clash)} are in both argnums and static_argnums")
        self.weight_argnums = (
            (self.argnums[0],) if weight_argnums is None else _normalize_argnums(weight_argnums, "weight_argnums")
        )
        extra = sorted(set(self.weight_argnums) - set(self.argnums))
        if extra:
            raise InvalidArgumentError(
                f"weight_argnums {extra} are not in argnums {self.argnums}: weights are arguments "
                "the split differentiates"
            )
        self.has_aux = bool(has_aux)
        if filter is not None and not callable(filter):
            raise InvalidArgumentError(f"filter must be a predicate on leaves, got {type(filter).__name__}")
        self.filter = filter
        self._param_names = _parameter_names(fun)
        self._forward_compiles = 0
        self._backward_compiles = 0
        self._count_lock = threading.Lock()
        self._trace_lock = threading.Lock()
        self._by_signature: dict[str, Backward] = {}  # this split owns its backwards
        self._grad_parts: dict[str, GradParts] = {}  # what a B/W split of each needs
        self._halves: dict[tuple[str, tuple[int, ...], bool], Halves] = {}
        self._foreign: LRUCache[str, str] = LRUCache(_MAX_FOREIGN)  # signatures it does not make -> why
        self._cache: ExecutableCache[_Forward] = ExecutableCache(cache_size, on_evict=self._evicted)
        self.__wrapped__ = fun

    def _evicted(self, entry: _Forward) -> None:
        """The cache dropped a signature's forward: its backward's executables go too, and its
        B/W halves' (each compiles again if a context of it comes back)."""
        entry.backward.drop_compiled()
        for (signature, _, _), halves in list(self._halves.items()):
            if signature == entry.spec.signature:
                halves.drop_compiled()

    def __repr__(self) -> str:
        name = getattr(self.fun, "__qualname__", type(self.fun).__name__)
        return f"Split({name}, argnums={self._argnums_option})"

    @property
    def _argnums_option(self) -> int | tuple[int, ...]:
        return self.argnums[0] if self._single else self.argnums

    # -- calling ----------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, ResidualContext]:
        if kwargs:
            raise InvalidArgumentError(
                f"a split takes positional arguments only; got keywords {sorted(kwargs)}"
            )
        statics = tuple(args[i] for i in self.static_argnums if i < len(args))
        dyn = tuple(a for i, a in enumerate(args) if i not in self.static_argnums)
        if self.filter is not None:  # non-array leaves are static, as under eqx.filter_jit
            dyn = filters.freeze_non_arrays(dyn)
        leaves, treedef = jax.tree.flatten(dyn)
        leaves = [
            x if isinstance(x, jax.Array) else _as_array(x, self._leaf_where(treedef, leaves, i))
            for i, x in enumerate(leaves)
        ]
        inlined = staged(leaves, f"{self!r}")  # inside the caller's jax.jit
        try:
            placements = tuple((x.aval, None if inlined else x.sharding) for x in leaves)
            key = (len(args), treedef, statics, placements, inlined)
            hash(key)
        except TypeError:
            raise InvalidArgumentError(
                f"static arguments (and, under a filter, the leaves that are not arrays) must be "
                f"hashable, got {[type(s).__name__ for s in statics]}"
            ) from None
        entry = self._cache.get(key)
        if entry is None:
            entry = self._compile_forward(args, leaves, treedef, statics, key, inlined)
        outputs = entry.executable(list(entry.consts), leaves)
        residuals = tuple(
            entry.consts[i] if src == _FROM_CONST else leaves[i] if src == _FROM_INPUT else outputs[i]
            for src, i in entry.slots
        )
        out = jax.tree.unflatten(entry.out_tree, outputs[: entry.n_out])
        ctx = ResidualContext.tree_unflatten(entry.spec, residuals)
        ctx._backward = entry.backward  # the context keeps its backward alive (the registry is weak)
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
            return self._halves_of(ctx.spec, now)(ctx, cotangent)
        bwd = self._by_signature.get(ctx.spec.signature)
        if bwd is None:
            bwd = self._rebuild(ctx.spec)
        return bwd(ctx, cotangent, like=like)

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
                    spec=self._grad_parts[spec.signature].spec,
                    parts=self._grad_parts[spec.signature],
                    now=now_t,
                    now_single=single,
                    arg_name=self._arg_name,
                    on_compile=lambda: _count_backward(split_ref),
                )
                later = found.weight_backward
                self._by_signature.setdefault(later.signature, later)
                register_backward(self._by_signature[later.signature])
                self._halves[key] = found
        return found

    def cache_info(self) -> CacheInfo:
        """Compile counts and cache statistics (see :class:`CacheInfo`)."""
        return CacheInfo(
            forward_compiles=self._forward_compiles,
            backward_compiles=self._backward_compiles,
            hits=self._cache.hits,
            misses=self._cache.misses,
            currsize=len(self._cache),
            maxsize=self._cache.maxsize,
        )

    # -- rebuilding a backward from a context's record --------------------------------------

    def _rebuild(self, spec: ResidualSpec) -> Backward:
        """The backward of ``spec``'s signature, traced from the context's call record.

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
                args, leaves, treedef, statics = self._rebuilt_inputs(spec)
                try:
                    return self._retrace(spec, args, leaves, treedef, statics)
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
            halves = self._halves_of(self._grad_parts[parent].spec, call.now)
        except InvalidArgumentError as err:
            raise self._mismatch(spec, f": its record asks for a split now={call.now!r} ({err})") from None
        if halves.later_spec.signature != spec.signature or halves.later_spec.avals != spec.avals:
            raise self._mismatch(
                spec,
                f": split with now={call.now!r}, its parent {parent} gives the later signature "
                f"{halves.later_spec.signature}",
            )
        return halves.weight_backward

    def _mismatch(self, spec: ResidualSpec, why: str) -> SignatureMismatchError:
        return SignatureMismatchError(f"context signature {spec.signature} is not one {self!r} makes{why}")

    def _rebuilt_inputs(self, spec: ResidualSpec) -> tuple[tuple[Any, ...], list[Any], Any, tuple[Any, ...]]:
        """The arguments a context's call record describes, with ``ShapeDtypeStruct`` leaves."""
        call = spec.call
        if not is_current(spec.signature) or call is None:
            raise self._mismatch(
                spec,
                ": it was written by residual-store 0.1, whose signatures did not cover what is "
                "computed and recorded no input structure; run the forward again",
            )
        mine = (self._argnums_option, self.weight_argnums, self.static_argnums, self.has_aux, self._save_record)
        theirs = (call.argnums, call.weight_argnums, call.static_argnums, call.has_aux, call.save)
        if mine != theirs:
            names = ("argnums", "weight_argnums", "static_argnums", "has_aux", "save")
            diff = ", ".join(f"{n}={t!r} (this split: {m!r})" for n, m, t in zip(names, mine, theirs) if m != t)
            raise self._mismatch(spec, f": it was made by a split with {diff}")
        if (call.differentiated is None) != (self.filter is None):
            made, mine = ("without", "has one") if call.differentiated is None else ("with", "has none")
            raise self._mismatch(spec, f": it was made by a split {made} a filter, and this one {mine}")
        if call.in_tree is None or call.statics is None:
            raise self._mismatch(
                spec,
                f" from its record: its input structure could not be recorded ({call.unrecorded}); "
                "run a forward of the same shapes in this split first",
            )
        try:
            treedef = structure.decode_treedef(call.in_tree)
            statics = [(int(i), structure.decode_value(v)) for i, v in call.statics]
            leaves = [placement.abstract_input(a) for a in call.in_avals]
        except structure.UnresolvableError as err:
            raise self._mismatch(
                spec,
                f" yet: its input structure names what this process lacks ({err}). Import the "
                "model's modules before running its backward",
            ) from None
        except (ValueError, TypeError, KeyError) as err:
            raise self._mismatch(spec, f": its call record is malformed ({err})") from None
        if treedef.num_leaves != len(leaves) or [i for i, _ in statics] != list(self.static_argnums):
            raise self._mismatch(spec, ": its call record is malformed (leaf or static count)")
        args = list(jax.tree.unflatten(treedef, leaves))
        for index, value in statics:
            args.insert(index, value)
        if len(args) != call.n_args:
            raise self._mismatch(spec, ": its call record is malformed (argument count)")
        return tuple(args), leaves, treedef, tuple(v for _, v in statics)

    def _retrace(
        self, spec: ResidualSpec, args: tuple[Any, ...], leaves: list[Any], treedef: Any, statics: tuple[Any, ...]
    ) -> Backward:
        """Traces this split on a context's recorded inputs; its backward if the signature matches."""
        call = spec.call
        assert call is not None
        try:
            with _enter_mesh(call.context_mesh):
                self._check_arity(args)
                traced = self._trace_call(
                    args, leaves, treedef, statics, call.in_avals, call.context_mesh, call.differentiated
                )
        except ResidualStoreError:
            raise
        except Exception as err:  # noqa: BLE001 - whatever fun raises on these inputs
            raise self._mismatch(
                spec, f": tracing it on the context's recorded inputs failed ({type(err).__name__}: {err})"
            ) from err
        got = traced.spec.signature
        if got != spec.signature or (spec.avals and traced.spec.avals != spec.avals):
            raise self._mismatch(
                spec,
                f": on the inputs the context records, this split computes signature {got}. The "
                "context comes from another function, or from one whose code or closed-over values "
                "(weights, constants) differ in this process",
            )
        return traced.backward

    # -- tracing (once per signature) -------------------------------------------------------

    def _arg_name(self, index: int) -> str:
        names = self._param_names
        return names[index] if names is not None and index < len(names) else f"args[{index}]"

    def _dyn_positions(self, n_args: int) -> list[int]:
        return [i for i in range(n_args) if i not in self.static_argnums]

    def _leaf_paths(self, dyn: tuple[Any, ...], n_args: int) -> list[str]:
        positions = self._dyn_positions(n_args)
        paths = []
        for path, _ in jax.tree_util.tree_flatten_with_path(dyn)[0]:
            head = self._arg_name(positions[path[0].idx])
            paths.append(head + jax.tree_util.keystr(path[1:]))
        return paths

    def _leaf_where(self, treedef: Any, leaves: list[Any], index: int) -> str:
        # Only reached for a bad leaf: rebuild the paths to name it.
        dyn = jax.tree.unflatten(treedef, [0] * len(leaves))
        n_args = len(dyn) + len(self.static_argnums)
        return "argument " + self._leaf_paths(dyn, n_args)[index]

    def _check_arity(self, args: tuple[Any, ...]) -> None:
        needed = max(self.argnums + self.static_argnums) + 1
        if len(args) < needed:
            raise SignatureMismatchError(
                f"{self!r} differentiates/uses argument {needed - 1} but was called with "
                f"{len(args)} arguments"
            )
        try:
            inspect.signature(self.fun).bind(*args)
        except TypeError as err:
            raise SignatureMismatchError(f"bad arguments for {self!r}: {err}") from None
        except ValueError:
            pass  # no introspectable signature (builtins); JAX's trace will complain if needed

    def _differentiated(
        self, leaves: Sequence[Any], leaf_args: list[int], paths: list[str], recorded: Sequence[bool] | None
    ) -> list[bool]:
        """Per input leaf, whether it is differentiated: every leaf of ``argnums``, or those
        ``filter`` accepts (as recorded, when rebuilding: the predicate may not understand
        abstract leaves)."""
        if recorded is not None and self.filter is not None and len(recorded) == len(leaves):
            chosen = [bool(d) for d in recorded]
        else:
            chosen = [pos in self.argnums and (self.filter is None or bool(self.filter(x)))
                      for x, pos in zip(leaves, leaf_args)]
        for j, d in enumerate(chosen):
            if d and not jax.dtypes.issubdtype(leaves[j].dtype, np.inexact):
                hint = (
                    "the filter chose it" if self.filter is not None else
                    "pass filter=rs.is_inexact to differentiate only the floating leaves of a "
                    "model that holds others (as eqx.filter_grad and nnx.grad do), or pass integer "
                    "tokens, PRNG keys and masks as other positional arguments"
                )
                raise InvalidArgumentError(
                    f"argument {paths[j]} has dtype {leaves[j].dtype} and cannot be differentiated: {hint}"
                )
        if self.filter is not None and not any(chosen):
            raise InvalidArgumentError(f"{self!r} has no leaf to differentiate (the filter rejects them all)")
        return chosen

    def _compile_forward(
        self,
        args: tuple[Any, ...],
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
            self._check_arity(args)
            t = self._trace_call(args, leaves, treedef, statics, None, _context_mesh())
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
                backward=t.backward,
            )
            self._cache.put(key, entry)
            return entry

    def _record_call(
        self,
        n_args: int,
        treedef: Any,
        static_pairs: list[tuple[int, Any]],
        in_avals: Sequence[InputAval],
        context_mesh: Any,
        differentiated: Sequence[bool],
    ) -> CallSpec:
        try:
            tree_record = structure.encode_treedef(treedef)
            statics_record: Any = tuple((i, structure.encode_value(v)) for i, v in static_pairs)
            unrecorded = None
        except structure.UnrecordableError as err:
            tree_record = statics_record = None
            unrecorded = str(err)
        return CallSpec(
            n_args=n_args,
            argnums=self._argnums_option,
            weight_argnums=self.weight_argnums,
            static_argnums=self.static_argnums,
            has_aux=self.has_aux,
            in_avals=tuple(in_avals),
            in_tree=tree_record,
            statics=statics_record,
            context_mesh=context_mesh,
            unrecorded=unrecorded,
            differentiated=None if self.filter is None else tuple(differentiated),
            save=self._save_record,
        )

    def _trace_call(
        self,
        args: tuple[Any, ...],
        leaves: Sequence[Any],
        treedef: Any,
        statics: tuple[Any, ...],
        in_avals: Sequence[InputAval] | None,
        context_mesh: Any,
        recorded_mask: Sequence[bool] | None = None,
    ) -> _Traced:
        """Traces the forward and the backward of one signature (``leaves``: arrays, or
        ``ShapeDtypeStruct``s when rebuilding from a record, with the recorded choice of
        differentiated leaves); compiles nothing."""
        n_args = len(args)
        positions = self._dyn_positions(n_args)
        dyn = jax.tree.unflatten(treedef, list(leaves))
        paths = self._leaf_paths(dyn, n_args)
        counts = [c.num_leaves for c in treedef.children()]
        leaf_args = [pos for pos, count in zip(positions, counts) for _ in range(count)]
        differentiated = self._differentiated(leaves, leaf_args, paths, recorded_mask)
        diff_idx = [j for j, d in enumerate(differentiated) if d]
        static_pairs = list(zip(self.static_argnums, statics))

        def full_args(flat: Sequence[Any]) -> list[Any]:
            rebuilt = list(filters.thaw(jax.tree.unflatten(treedef, flat)))
            for index, value in static_pairs:
                rebuilt.insert(index, value)
            return rebuilt

        fun = self.fun
        closed, out_shape = jax.make_jaxpr(lambda *flat: fun(*full_args(flat)), return_shape=True)(*leaves)
        if self.has_aux:
            if not (isinstance(out_shape, (tuple, list)) and len(out_shape) == 2):
                raise InvalidArgumentError(
                    "has_aux=True needs the function to return a pair (out, aux), got "
                    f"{jax.tree.structure(out_shape)}"
                )
            out_tree = jax.tree.structure(out_shape[0])
            aux_tree = jax.tree.structure(out_shape[1])
            out_avals = jax.tree.leaves(out_shape[0])
        else:
            out_tree, aux_tree = jax.tree.structure(out_shape), None
            out_avals = jax.tree.leaves(out_shape)
        n_out = len(out_avals)
        n_consts = len(closed.consts)

        box: dict[str, Any] = {}

        def forward(consts: list[Any], flat: list[Any]) -> list[Any]:
            def primal(*diff: Any) -> tuple[list[Any], list[Any]]:
                merged = list(flat)
                for j, value in zip(diff_idx, diff):
                    merged[j] = value
                outs = _jax_internals.eval_jaxpr(closed.jaxpr, consts, *merged)
                return outs[:n_out], outs[n_out:]

            diff = [flat[j] for j in diff_idx]
            out, vjp_fn, aux = jax.vjp(primal, *diff, has_aux=True)
            res, box["vjp_tree"] = jax.tree.flatten(vjp_fn)
            sources = list(consts) + list(flat)
            slots, computed = [], []
            for r in res:
                hit = next((i for i, s in enumerate(sources) if s is r), None)
                if hit is None:
                    slots.append((_FROM_OUTPUT, n_out + len(aux) + len(computed)))
                    computed.append(r)
                elif hit < n_consts:
                    slots.append((_FROM_CONST, hit))
                else:
                    slots.append((_FROM_INPUT, hit - n_consts))
            box["slots"] = tuple(slots)
            return list(out) + list(aux) + computed

        consts = [jnp.asarray(c) if not isinstance(c, jax.Array) else c for c in closed.consts]
        forward_jit = jax.jit(forward)
        traced = forward_jit.trace(consts, list(leaves))
        slots: tuple[tuple[int, int], ...] = box["slots"]
        flat_bwd, grad_tree, templates = self._flat_backward(
            box["vjp_tree"], out_avals, treedef, positions, differentiated
        )
        if self.save != "all":  # keep the fewest bytes; the backward recomputes the rest
            weights = [False] * n_consts + [pos not in self.weight_argnums for pos in leaf_args]
            recomputable = remat.policy_recomputable(self.save) if callable(self.save) else remat.cheap
            forward_jit, slots, flat_bwd = _keep_fewest_bytes(traced, slots, n_consts, weights, flat_bwd, recomputable)
            traced = forward_jit.trace(consts, list(leaves))
        jaxpr_in, jaxpr_out = traced.jaxpr.in_avals, traced.jaxpr.out_avals
        residual_types = [
            jaxpr_in[i] if src == _FROM_CONST else jaxpr_in[n_consts + i] if src == _FROM_INPUT else jaxpr_out[i]
            for src, i in slots
        ]
        float_out = [i for i, a in enumerate(out_avals) if jax.dtypes.issubdtype(a.dtype, np.inexact)]
        bwd_jit = jax.jit(flat_bwd)
        parts = GradParts(
            residual_avals=tuple(placement.abstract(a) for a in residual_types),
            cotangent_avals=tuple(placement.abstract(jaxpr_out[i]) for i in float_out),
            templates=templates,
            single=self._single,
        )
        bwd_traced = bwd_jit.trace(list(parts.residual_avals), list(parts.cotangent_avals))
        if in_avals is None:
            in_avals = [placement.input_aval(x) for x in leaves]
        call = self._record_call(n_args, treedef, static_pairs, in_avals, context_mesh, differentiated)
        signature = compute_signature(
            call=call,
            in_tree=treedef,
            statics=static_pairs,
            out_tree=out_tree,
            aux_tree=aux_tree,
            forward=traced.jaxpr,
            forward_consts=consts,
            slots=slots,
            backward=bwd_traced.jaxpr,
        )
        spec = self._spec(signature, call, slots, residual_types, paths, leaf_args, n_consts, traced)
        bwd = self._by_signature.get(signature)
        if bwd is None:
            callbacks = _jax_internals.host_callbacks(bwd_traced.jaxpr)
            split_ref = weakref.ref(self)
            bwd = Backward(
                signature=signature,
                flat_fn=flat_bwd,
                out_structure=PathStructure.of(out_tree),
                out_avals=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in out_avals],
                grad_structure=PathStructure.of_template(grad_tree),
                on_compile=lambda: _count_backward(split_ref),
                jitted=bwd_jit,
                unexportable=f"its backward calls back into Python ({', '.join(sorted(set(callbacks)))})"
                if callbacks
                else None,
            )
            self._by_signature[signature] = bwd
            self._grad_parts[signature] = dataclasses.replace(parts, spec=spec)
        register_backward(bwd)
        return _Traced(
            closed=closed,
            traced=traced,
            jitted=forward_jit,
            consts=tuple(consts),
            slots=slots,
            n_out=n_out,
            out_tree=out_tree,
            aux_tree=aux_tree,
            spec=spec,
            backward=bwd,
        )

    def _spec(
        self,
        signature: str,
        call: CallSpec,
        slots: Sequence[tuple[int, int]],
        residual_types: Sequence[Any],
        paths: list[str],
        leaf_args: list[int],
        n_consts: int,
        traced: Any,
    ) -> ResidualSpec:
        output_slots = [i for src, i in slots if src == _FROM_OUTPUT]
        # Intermediates are placed after the nearest weight (else differentiated input) feeding
        # them; the forward jaxpr's inputs are the constants, then the flat input leaves.
        weights = [n_consts + j for j, pos in enumerate(leaf_args) if pos in self.weight_argnums]
        diffs = [n_consts + j for j, pos in enumerate(leaf_args) if pos in self.argnums]
        found = output_origins(traced.jaxpr, output_slots, weights=weights, inputs=diffs)
        origins = dict(zip(output_slots, found))
        labels, input_paths, kinds = [], [], []
        for src, i in slots:
            if src == _FROM_CONST:
                labels.append(names.constant_name(i))
                input_paths.append(None)
                kinds.append("constant")
            elif src == _FROM_INPUT:
                labels.append(names.input_name(paths[i]))
                input_paths.append(paths[i])
                kinds.append("weight" if leaf_args[i] in self.weight_argnums else "input")
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
        )

    def _flat_backward(
        self,
        vjp_tree: Any,
        out_avals: Sequence[Any],
        treedef: Any,
        positions: list[int],
        differentiated: Sequence[bool],
    ) -> tuple[Callable[[Sequence[Any], Sequence[Any]], list[Any]], Any, tuple[tuple[int, Any], ...]]:
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
        perm = [rank[j] for p in self.argnums for j in leaf_range[p] if differentiated[j]]
        grad_struct = tuple(by_pos[p] for p in self.argnums)
        grad_tree = grad_struct[0] if self._single else grad_struct

        def flat_backward(residuals: Sequence[Any], cts: Sequence[Any]) -> list[Any]:
            vjp_fn = jax.tree.unflatten(vjp_tree, residuals)
            given = iter(cts)
            full = [next(given) if z is None else z for z in zero_cts]
            grads = list(vjp_fn(full))
            return [grads[k] for k in perm]

        return flat_backward, grad_tree, tuple((p, by_pos[p]) for p in self.argnums)

    def _count(self, which: str) -> None:
        with self._count_lock:
            if which == "forward":
                self._forward_compiles += 1
            else:
                self._backward_compiles += 1

    def _warn_recompute(self, closed: Any, signature: str) -> None:
        if signature in _WARNED_SIGNATURES:
            return
        found = _jax_internals.unoptimized_remat_custom_vjps(closed)
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


def _keep_fewest_bytes(
    traced: Any,
    slots: tuple[tuple[int, int], ...],
    n_consts: int,
    input_cost: Sequence[bool],
    flat_bwd: Callable[[Sequence[Any], Sequence[Any]], list[Any]],
    recomputable: Callable[[Any], bool],
) -> tuple[Any, tuple[tuple[int, int], ...], Callable[[Sequence[Any], Sequence[Any]], list[Any]]]:
    """``save="auto"``: a forward that returns, in place of its computed residuals, the values of
    :func:`residual_store.remat.plan`, its slots, and a backward that recomputes the residuals
    from them before running ``flat_bwd``."""
    closed = _jax_internals.inline_calls(traced.jaxpr, [placement.abstract(a) for a in traced.jaxpr.in_avals])
    jaxpr = closed.jaxpr
    computed = [k for k, (src, _) in enumerate(slots) if src == _FROM_OUTPUT]
    n_kept_out = len(jaxpr.outvars) - len(computed)  # outputs and aux come first
    p = remat.plan(jaxpr, [jaxpr.outvars[slots[k][1]] for k in computed], input_cost, recomputable)
    kept_out = [v for v in p.kept if p.is_input(v) is None]

    def slot_of_input(j: int) -> tuple[int, int]:
        return (_FROM_CONST, j) if j < n_consts else (_FROM_INPUT, j - n_consts)

    given = [slot for slot in slots if slot[0] != _FROM_OUTPUT]
    extra = [slot_of_input(j) for v in p.kept if (j := p.is_input(v)) is not None]
    new_slots = tuple(dict.fromkeys(given + extra)) + tuple(
        (_FROM_OUTPUT, n_kept_out + k) for k in range(len(kept_out))
    )
    at = {slot: k for k, slot in enumerate(new_slots)}
    returned = list(jaxpr.outvars[:n_kept_out]) + kept_out

    def forward(consts: list[Any], flat: list[Any]) -> list[Any]:
        return p.evaluate(closed.consts, [*consts, *flat], returned)

    def backward(residuals: Sequence[Any], cts: Sequence[Any]) -> list[Any]:
        kept_values = [
            residuals[at[(_FROM_OUTPUT, n_kept_out + kept_out.index(v))]] if (j := p.is_input(v)) is None
            else residuals[at[slot_of_input(j)]]
            for v in p.kept
        ]
        again = iter(p.rebuild(kept_values, closed.consts, lazy=True))
        original = [next(again) if src == _FROM_OUTPUT else residuals[at[(src, i)]] for src, i in slots]
        if not any(map(remat.is_lazy, original)):
            return flat_bwd(original, cts)
        # a rebuilt scan's residuals are made inside the backward's scan, an iteration at a time
        plain = jax.make_jaxpr(flat_bwd)([remat.abstract(r) for r in original], [remat.abstract(c) for c in cts])
        return remat.run_backward(plain, [*original, *cts])

    return jax.jit(forward), new_slots, backward


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
    weight_argnums: int | Sequence[int] | None = None,
    filter: Callable[[Any], bool] | None = None,  # noqa: A002
    cache_size: int = DEFAULT_CACHE_SIZE,
    save: str | Callable[..., Any] = "all",
) -> Split:
    """Splits ``fun`` into a forward that returns typed residuals and a backward that uses them.

    Args:
      fun: the function to differentiate; positional arguments are arrays or pytrees of arrays.
      argnums: which positional arguments to differentiate (int or tuple), as in ``jax.grad``.
        Other positional arguments (integer tokens, PRNG keys, masks) get no gradient.
      has_aux: ``fun`` returns ``(out, aux)``; only ``out`` is differentiated.
      static_argnums: hashable Python arguments that become part of the signature.
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
        through), see :mod:`residual_store.remat`. A JAX checkpoint policy (e.g.
        ``jax.checkpoint_policies.dots_saveable``) instead lets the backward recompute what the
        policy does not save, with the same exceptions (RNG, kernels, callbacks, collectives and
        higher-order primitives but ``scan`` are never recomputed). The choice is part of the
        signature.

    Returns:
      A :class:`Split`: ``out, ctx = fwd(*args)``; ``grads = fwd.backward(ctx, cotangent)``.

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
    return Split(
        fun,
        argnums,
        has_aux=has_aux,
        static_argnums=static_argnums,
        weight_argnums=weight_argnums,
        filter=filter,
        cache_size=cache_size,
        save=save,
    )
