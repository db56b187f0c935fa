"""``rs.split``: run the forward now, the backward later, from typed residuals.

Calling a :class:`Split` runs the forward once, through an executable compiled ahead of time
and cached per signature, and returns the output with a :class:`ResidualContext`. The backward
(:meth:`Split.backward` or :func:`residual_store.backward`) runs from the context alone, through
a second executable compiled once per signature; it never re-evaluates the forward beyond what
the function's own ``jax.checkpoint`` policies ask to recompute.

How it works, per new signature: ``fun`` is traced once to a jaxpr; the forward executable
evaluates that jaxpr under ``jax.vjp`` and returns the output and the *computed* residuals.
Residuals that are the inputs themselves (weights, the batch) or closed-over constants are not
returned by the executable: the context takes the live arrays, so weights are never copied.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from residual_store import _jax_internals
from residual_store.backward import Backward, register_backward
from residual_store.cache import DEFAULT_CACHE_SIZE, CacheInfo, ExecutableCache
from residual_store.context import ResidualContext, ResidualSpec
from residual_store.errors import (
    InvalidArgumentError,
    RecomputeWarning,
    SignatureMismatchError,
)
from residual_store.signature import compute_signature

__all__ = ["Split", "split"]

# Where a residual's array comes from at call time.
_FROM_CONST, _FROM_INPUT, _FROM_OUTPUT = 0, 1, 2

_WARNED_SIGNATURES: set[str] = set()
_SCALAR_TYPES = (bool, int, float, complex, np.generic)


@dataclasses.dataclass(frozen=True)
class _Forward:
    """Everything one signature needs at call time."""

    executable: Any
    consts: tuple[Any, ...]
    slots: tuple[tuple[int, int], ...]  # (source, index) per residual
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
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        if not callable(fun):
            raise InvalidArgumentError(f"split expects a callable, got {type(fun).__name__}")
        self.fun = fun
        self.argnums = _normalize_argnums(argnums, "argnums")
        self._single = isinstance(argnums, int)
        self.static_argnums = tuple(sorted(_normalize_argnums(static_argnums, "static_argnums")))
        clash = set(self.argnums) & set(self.static_argnums)
        if clash:
            raise InvalidArgumentError(f"arguments {sorted(clash)} are in both argnums and static_argnums")
        self.has_aux = bool(has_aux)
        self._param_names = _parameter_names(fun)
        self._forward_compiles = 0
        self._backward_compiles = 0
        self._count_lock = threading.Lock()
        self._trace_lock = threading.Lock()
        self._by_signature: dict[str, Backward] = {}
        self._cache: ExecutableCache[_Forward] = ExecutableCache(
            cache_size, on_evict=lambda entry: entry.backward.drop_compiled()
        )
        self.__wrapped__ = fun

    def __repr__(self) -> str:
        name = getattr(self.fun, "__qualname__", type(self.fun).__name__)
        return f"Split({name}, argnums={self.argnums if not self._single else self.argnums[0]})"

    # -- calling ----------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, ResidualContext]:
        if kwargs:
            raise InvalidArgumentError(
                f"a split takes positional arguments only; got keywords {sorted(kwargs)}"
            )
        statics = tuple(args[i] for i in self.static_argnums if i < len(args))
        dyn = tuple(a for i, a in enumerate(args) if i not in self.static_argnums)
        leaves, treedef = jax.tree.flatten(dyn)
        leaves = [
            x if isinstance(x, jax.Array) else _as_array(x, self._leaf_where(treedef, leaves, i))
            for i, x in enumerate(leaves)
        ]
        try:
            key = (len(args), treedef, statics, tuple((x.aval, x.sharding) for x in leaves))
            hash(key)
        except TypeError:
            raise InvalidArgumentError(
                f"static arguments must be hashable, got {[type(s).__name__ for s in statics]}"
            ) from None
        entry = self._cache.get(key)
        if entry is None:
            entry = self._trace(args, leaves, treedef, statics, key)
        outputs = entry.executable(list(entry.consts), leaves)
        residuals = tuple(
            entry.consts[i] if src == _FROM_CONST else leaves[i] if src == _FROM_INPUT else outputs[i]
            for src, i in entry.slots
        )
        out = jax.tree.unflatten(entry.out_tree, outputs[: entry.n_out])
        ctx = ResidualContext.tree_unflatten(entry.spec, residuals)
        if entry.aux_tree is not None:
            n_aux = entry.aux_tree.num_leaves
            aux = jax.tree.unflatten(entry.aux_tree, outputs[entry.n_out : entry.n_out + n_aux])
            return (out, aux), ctx
        return out, ctx

    def backward(self, ctx: ResidualContext, cotangent: Any = None) -> Any:
        """Gradients from a context this split made; never re-runs the forward.

        ``cotangent`` matches the output (not aux); ``None`` means 1 for a scalar float output.
        May be called any number of times on one context.
        """
        if not isinstance(ctx, ResidualContext):
            raise InvalidArgumentError(f"backward expects a rs.ResidualContext, got {type(ctx).__name__}")
        bwd = self._by_signature.get(ctx.spec.signature)
        if bwd is None:
            known = ", ".join(sorted(self._by_signature)) or "none yet"
            raise SignatureMismatchError(
                f"context signature {ctx.spec.signature} was not made by this split "
                f"({self!r}; its signatures: {known})"
            )
        return bwd(ctx, cotangent)

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

    def _trace(
        self,
        args: tuple[Any, ...],
        leaves: list[jax.Array],
        treedef: Any,
        statics: tuple[Any, ...],
        key: Any,
    ) -> _Forward:
        with self._trace_lock:
            entry = self._cache.peek(key)
            if entry is not None:
                return entry
            self._check_arity(args)
            entry = self._build(args, leaves, treedef, statics)
            self._cache.put(key, entry)
            return entry

    def _build(
        self,
        args: tuple[Any, ...],
        leaves: list[jax.Array],
        treedef: Any,
        statics: tuple[Any, ...],
    ) -> _Forward:
        n_args = len(args)
        positions = self._dyn_positions(n_args)
        dyn = jax.tree.unflatten(treedef, leaves)
        paths = self._leaf_paths(dyn, n_args)
        counts = [c.num_leaves for c in treedef.children()]
        starts = np.cumsum([0] + counts)
        diff_idx = [
            j
            for k, pos in enumerate(positions)
            if pos in self.argnums
            for j in range(starts[k], starts[k + 1])
        ]
        for j in diff_idx:
            if not jax.dtypes.issubdtype(leaves[j].dtype, np.inexact):
                raise InvalidArgumentError(
                    f"argument {paths[j]} has dtype {leaves[j].dtype} and cannot be "
                    "differentiated: only floating inputs can be in argnums (pass integer tokens, "
                    "PRNG keys and masks as other positional arguments)"
                )
        static_pairs = list(zip(self.static_argnums, statics))

        def full_args(flat: Sequence[Any]) -> list[Any]:
            rebuilt = list(jax.tree.unflatten(treedef, flat))
            for index, value in static_pairs:
                rebuilt.insert(index, value)
            return rebuilt

        closed, out_shape = jax.make_jaxpr(
            lambda *flat: self.fun(*full_args(flat)), return_shape=True
        )(*leaves)
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
        traced = jax.jit(forward).trace(consts, leaves)
        slots = box["slots"]
        signature = compute_signature(
            fun=self.fun,
            closed_jaxpr=closed,
            in_tree=treedef,
            in_avals=[(x.shape, x.dtype, x.aval.weak_type, x.sharding) for x in leaves],
            out_tree=jax.tree.structure(out_shape),
            argnums=self.argnums[0] if self._single else self.argnums,
            has_aux=self.has_aux,
            statics=static_pairs,
        )
        self._warn_recompute(closed, signature)
        executable = traced.lower().compile()
        self._count("forward")

        out_info = jax.tree.leaves(traced.out_info)
        output_slots = [i for src, i in slots if src == _FROM_OUTPUT]
        origins = dict(zip(output_slots, _jax_internals.output_origins(traced.jaxpr, output_slots)))
        avals, names, input_paths, kinds = [], [], [], []
        for src, i in slots:
            if src == _FROM_CONST:
                x = consts[i]
                avals.append(jax.ShapeDtypeStruct(x.shape, x.dtype))
                names.append(f"constant #{i} (closed over)")
                input_paths.append(None)
                kinds.append("constant")
            elif src == _FROM_INPUT:
                x = leaves[i]
                avals.append(jax.ShapeDtypeStruct(x.shape, x.dtype))
                names.append(f"input {paths[i]}")
                input_paths.append(paths[i])
                kinds.append("input")
            else:
                info = out_info[i]
                avals.append(jax.ShapeDtypeStruct(info.shape, info.dtype))
                names.append(self._origin_name(origins[i], paths, n_consts))
                input_paths.append(None)
                kinds.append("intermediate")
        spec = ResidualSpec(
            signature=signature,
            avals=tuple(avals),
            names=tuple(names),
            input_paths=tuple(input_paths),
            kinds=tuple(kinds),
        )
        bwd = self._make_backward(
            signature, box["vjp_tree"], out_tree, out_avals, diff_idx, leaves, treedef, positions
        )
        return _Forward(
            executable=executable,
            consts=tuple(consts),
            slots=slots,
            n_out=n_out,
            out_tree=out_tree,
            aux_tree=aux_tree,
            spec=spec,
            backward=bwd,
        )

    @staticmethod
    def _origin_name(origin: _jax_internals.Origin, paths: list[str], n_consts: int) -> str:
        if origin.invar is not None and origin.primitive is None:
            i = origin.invar - n_consts
            return f"input {paths[i]} (copy)" if i >= 0 else f"constant #{origin.invar} (copy)"
        base = origin.label or origin.primitive or "value"
        if origin.label is None and origin.file is not None:
            base = f"{base} {origin.file}:{origin.line}"
        notes = (["inputs per iteration"] if origin.per_iteration else []) + (
            [f"in {'/'.join(origin.scopes)}"] if origin.scopes else []
        )
        return f"{base} ({', '.join(notes)})" if notes else base

    def _make_backward(
        self,
        signature: str,
        vjp_tree: Any,
        out_tree: Any,
        out_avals: Sequence[Any],
        diff_idx: list[int],
        leaves: list[jax.Array],
        treedef: Any,
        positions: list[int],
    ) -> Backward:
        float_out = [jax.dtypes.issubdtype(a.dtype, np.inexact) for a in out_avals]
        zero_cts = [
            None if is_float else np.zeros(a.shape, jax.dtypes.float0)
            for a, is_float in zip(out_avals, float_out)
        ]

        def flat_backward(residuals: Sequence[Any], cts: Sequence[Any]) -> list[Any]:
            vjp_fn = jax.tree.unflatten(vjp_tree, residuals)
            given = iter(cts)
            full = [next(given) if z is None else z for z in zero_cts]
            return list(vjp_fn(full))

        # The gradient tree: the differentiated arguments, a tuple when argnums is a tuple.
        dyn = jax.tree.unflatten(treedef, [0] * len(leaves))
        subtrees = [jax.tree.structure(dyn[k]) for k, p in enumerate(positions) if p in self.argnums]
        order = [p for p in positions if p in self.argnums]
        by_pos = dict(zip(order, subtrees))
        grad_struct = tuple(
            jax.tree.unflatten(by_pos[p], [0] * by_pos[p].num_leaves) for p in self.argnums
        )
        # Leaves come back in flat-input order; reorder them to follow argnums.
        starts = {p: s for p, s in zip(order, np.cumsum([0] + [t.num_leaves for t in subtrees]))}
        perm = [int(starts[p]) + j for p in self.argnums for j in range(by_pos[p].num_leaves)]
        grad_tree = jax.tree.structure(grad_struct[0] if self._single else grad_struct)

        def ordered_backward(residuals: Sequence[Any], cts: Sequence[Any]) -> list[Any]:
            grads = flat_backward(residuals, cts)
            return [grads[k] for k in perm]

        bwd = Backward(
            signature=signature,
            flat_fn=ordered_backward,
            out_tree=out_tree,
            out_avals=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in out_avals],
            grad_tree=grad_tree,
            on_compile=lambda: self._count("backward"),
        )
        self._by_signature[signature] = bwd
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


def split(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    has_aux: bool = False,
    static_argnums: int | Sequence[int] = (),
    cache_size: int = DEFAULT_CACHE_SIZE,
) -> Split:
    """Splits ``fun`` into a forward that returns typed residuals and a backward that uses them.

    Args:
      fun: the function to differentiate; positional arguments are arrays or pytrees of arrays.
      argnums: which positional arguments to differentiate (int or tuple), as in ``jax.grad``.
        Other positional arguments (integer tokens, PRNG keys, masks) get no gradient.
      has_aux: ``fun`` returns ``(out, aux)``; only ``out`` is differentiated.
      static_argnums: hashable Python arguments that become part of the signature.
      cache_size: how many signatures keep their compiled executables (least recently used
        dropped first).

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
    return Split(fun, argnums, has_aux=has_aux, static_argnums=static_argnums, cache_size=cache_size)
