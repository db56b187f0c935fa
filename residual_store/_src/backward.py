"""Backward executables: one per signature, compiled ahead of time, found by signature.

A :class:`Backward` turns ``(residuals, cotangent)`` into gradients. It validates the cotangent
against the output avals it was made for, compiles its flat function once
(``jax.jit(...).lower(...).compile()``) and reuses the executable for every later context of its
signature. Backwards register themselves by signature, so :func:`backward` works on any context
this process can find a backward for: one made by ``rs.split`` here, or (with a store) one whose
serialized backward was loaded.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from residual_store._src import _jax_internals
from residual_store._src.context import (
    ResidualContext,
    aval_nbytes,
    backward_of,
    check_representable,
    consumed,
    describe_residual,
    plan_budget,
)
from residual_store._src.errors import (
    BackwardUnavailableError,
    InvalidArgumentError,
    SignatureMismatchError,
    StoreUnavailableError,
)
from residual_store._src.keypaths import PathStructure
from residual_store._src.pace import Pace, drain
from residual_store._src.signature import is_current

__all__ = [
    "Backward", "BackwardLoader", "Executables", "backward", "find_backward", "loaders", "lookup_backward",
    "register_backward", "register_loader", "staged", "unregister_loader",
]

FlatBackward = Callable[[Sequence[Any], Sequence[Any]], Sequence[Any]]


def _is_float(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, np.inexact)


def _describe_aval(x: Any) -> str:
    dtype = getattr(x, "dtype", None)
    shape = getattr(x, "shape", None)
    if dtype is None or shape is None:
        return type(x).__name__
    return f"{dtype}{list(shape)}"


def _placement_key(values: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(getattr(x, "sharding", None) for x in values)


_PLANNED = Pace()
"""The backwards of contexts planned under a device budget, per device (``pace.py``: otherwise a
loop allocates every backward's gradients at once)."""


@dataclasses.dataclass(frozen=True)
class _Paced:
    """Where a backward on a planned context is paced, and the device bytes its plan's budget
    leaves beside its contexts (each holding what this one holds): room for the gradients of a
    backward dispatched while an earlier one runs, or not."""

    devices: frozenset[Any]
    room: int


def _paced_on(ctx: ResidualContext) -> _Paced | None:
    """How a backward on ``ctx`` is paced: on the devices of its first array, for a context
    planned under a device budget and not inside a trace; ``None`` otherwise."""
    call = ctx.spec.call
    bounded = None if call is None else plan_budget(call.save)
    if bounded is None:
        return None
    first = next((x for x in ctx.residuals if isinstance(x, jax.Array)), None)
    if first is None or _jax_internals.any_tracer(ctx.residuals):
        return None
    budget, microbatches = bounded
    return _Paced(frozenset(first.sharding.device_set), budget - microbatches * ctx.spec.own_nbytes)


def _out_nbytes(compiled: Any) -> int:
    """The bytes of a compiled program's outputs."""
    return sum(aval_nbytes(a) for a in jax.tree.leaves(compiled.out_info))


class Executables:
    """A jitted flat function compiled ahead of time, once per placement of its inputs.

    One signature covers every device a context can sit on (single-device placements are not in
    it), so a pipeline whose stages share a function runs contexts of one signature on several
    devices: each placement gets its own executable, compiled at its first call and counted.

    Args:
      jitted: ``jax.jit`` of the function; called as ``jitted(*args)``, each arg a list.
      on_compile: called after each compile.
    """

    def __init__(self, jitted: Any, on_compile: Callable[[], None] | None = None) -> None:
        self._jitted = jitted
        self._on_compile = on_compile
        self._by_placement: dict[tuple[Any, ...], Any] = {}
        self._lock = threading.Lock()
        self.compiles = 0

    def find(self, *args: Sequence[Any]) -> Any | None:
        """The executable for these inputs' placements (``None`` for a NumPy input), if compiled."""
        if not self._by_placement:
            return None
        return self._by_placement.get(_placement_key([x for group in args for x in group]))

    def compile(self, *args: Sequence[Any]) -> Any:
        """The executable for these inputs' placements, compiled now if it is not yet."""
        key = _placement_key([x for group in args for x in group])
        with self._lock:
            found = self._by_placement.get(key)
            if found is None:
                found = self._by_placement[key] = self._jitted.lower(*(list(a) for a in args)).compile()
                self.compiles += 1
                if self._on_compile is not None:
                    self._on_compile()
            return found

    def clear(self) -> None:
        with self._lock:
            self._by_placement.clear()

    def __len__(self) -> int:
        """Executables held now (compiled, not dropped since)."""
        return len(self._by_placement)

    def executable(self, residuals: list[Any], cts: list[Any], check: Callable[[], None]) -> Any:
        """The executable for these inputs' placements, compiled now if it is not yet (``check()``
        first: it names a bad residual before anything is compiled for it)."""
        compiled = self.find(residuals, cts)
        if compiled is None:
            check()
            compiled = self.compile(residuals, cts)
        return compiled

    def run(self, residuals: list[Any], cts: list[Any], check: Callable[[], None], compiled: Any = None) -> Any:
        """``fn(residuals, cts)``: inlined into the caller's trace under ``jax.jit``, else
        through ``compiled`` (:meth:`executable`'s for these placements, found now if not given).
        ``check()`` names a bad residual (a wrong shape, a deleted array) before anything is
        traced or compiled for it, and after a call the executable rejected
        (:class:`SignatureMismatchError` if it passes)."""
        if staged(residuals + cts, "the backward"):
            check()  # at trace time only: named here, not deep inside JAX
            return self._jitted(residuals, cts)
        if compiled is None:
            compiled = self.executable(residuals, cts, check)
        try:
            return compiled(residuals, cts)
        except (TypeError, ValueError, RuntimeError) as err:
            check()
            if not isinstance(err, (TypeError, ValueError)):
                raise  # a failure of the computation itself, not of its inputs
            raise SignatureMismatchError(f"the backward rejected its inputs: {err}") from err


class Backward:
    """The backward of one signature: cotangent checks, a lazily compiled flat executable.

    Args:
      signature: the signature it serves.
      flat_fn: ``flat_fn(residuals, float_cotangents) -> gradient leaves``; traceable by JAX.
      out_structure: the structure of the forward's differentiated output (the cotangent's).
      out_avals: one ``ShapeDtypeStruct`` per output leaf; non-float leaves take no cotangent.
      grad_structure: the structure of the returned gradients.
      on_compile: called after each compile (used to count compiles per split).
      jitted: ``jax.jit(flat_fn)``, if the caller already traced it (its trace is reused).
      unexportable: why ``jax.export`` cannot serialize this backward, when that is known
        without trying (host callbacks); ``None`` otherwise.
      unavailable: for a backward known to exist but unusable here (a damaged stored one, one
        exported for more devices): the error every call raises.
    """

    def __init__(
        self,
        *,
        signature: str,
        flat_fn: FlatBackward,
        out_structure: PathStructure,
        out_avals: Sequence[jax.ShapeDtypeStruct],
        grad_structure: PathStructure,
        on_compile: Callable[[], None] | None = None,
        jitted: Any = None,
        unexportable: str | None = None,
        unavailable: Exception | None = None,
    ) -> None:
        self.signature = signature
        self.out_structure = out_structure
        self.out_avals = tuple(out_avals)
        self.grad_structure = grad_structure
        self.flat_fn = flat_fn
        self.float_leaves = tuple(i for i, a in enumerate(self.out_avals) if _is_float(a.dtype))
        self._on_compile = on_compile
        self._jitted = jitted if jitted is not None else jax.jit(flat_fn)
        self.unexportable = unexportable
        self.unavailable = unavailable
        self._executables = Executables(self._jitted, on_compile)

    # -- cotangents -------------------------------------------------------------------------

    def cotangent_leaves(self, cotangent: Any) -> list[Any]:
        """The float leaves of ``cotangent``, checked against the output avals (``None``: 1 for
        a scalar float output)."""
        if not self.out_avals:  # a later context: its cotangents are among its residuals
            if cotangent is not None:
                raise SignatureMismatchError(
                    "this context takes no cotangent: it is the later half of a B/W split "
                    "(split.backward(ctx, cotangent, now=...)), which holds the cotangents it "
                    "needs; call rs.backward(later)"
                )
            return []
        if cotangent is None:
            if len(self.out_avals) == 1 and self.float_leaves == (0,) and self.out_avals[0].shape == ():
                return [np.ones((), self.out_avals[0].dtype)]
            raise SignatureMismatchError(
                "cotangent=None is allowed only for a scalar floating output; this output is "
                f"{self._describe_out()}: pass a cotangent of that structure"
            )
        leaves = self.out_structure.flatten_up_to(cotangent, "the cotangent's structure")
        checked = []
        for i in self.float_leaves:
            leaf, aval = leaves[i], self.out_avals[i]
            if isinstance(leaf, (int, float)) and not isinstance(leaf, bool) and aval.shape == ():
                leaf = np.asarray(leaf, aval.dtype)
            shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
            if shape is None or tuple(shape) != tuple(aval.shape) or dtype != aval.dtype:
                raise SignatureMismatchError(
                    f"cotangent leaf {i} must be {aval.dtype}{list(aval.shape)} like the output, "
                    f"got {_describe_aval(leaf)}"
                )
            checked.append(leaf)
        return checked

    def _describe_out(self) -> str:
        leaves = ", ".join(f"{a.dtype}{list(a.shape)}" for a in self.out_avals)
        tree = self.out_structure.resolved() or f"paths {list(self.out_structure.paths)}"
        return f"{tree} with leaves [{leaves}]"

    # -- execution --------------------------------------------------------------------------

    @property
    def compiles(self) -> int:
        """Executables compiled so far (one per placement of the residuals)."""
        return self._executables.compiles

    def jaxpr(self, residual_avals: Sequence[Any], cotangent_avals: Sequence[Any]) -> Any:
        """The ``ClosedJaxpr`` of the flat function on these abstract inputs (traced, not
        compiled): what a B/W split partitions."""
        return self._jitted.trace(list(residual_avals), list(cotangent_avals)).jaxpr

    @property
    def holds_compiled(self) -> bool:
        """Whether an executable of it is compiled and kept (for ``cache_info().currsize``)."""
        return len(self._executables) > 0

    def drop_compiled(self) -> None:
        """Forgets the executables (the split's cache evicted them); the next call compiles again."""
        self._executables.clear()

    def __call__(self, ctx: ResidualContext, cotangent: Any = None, *, like: Any = None) -> Any:
        """Gradients for ``ctx`` and ``cotangent``, shaped like the differentiated arguments
        (on ``like``'s structure when given). Inside ``jax.jit`` the backward is inlined into
        the caller's computation instead of running its own executable."""
        if not isinstance(ctx, ResidualContext):
            raise InvalidArgumentError(
                f"backward expects a rs.ResidualContext, got {type(ctx).__name__}"
            )
        if ctx.spec.signature != self.signature:
            raise SignatureMismatchError(
                f"context has signature {ctx.spec.signature}, this backward is for "
                f"{self.signature}: the context comes from another function or other input avals"
            )
        if self.unavailable is not None:
            raise type(self.unavailable)(*self.unavailable.args)
        self.check_representable(ctx)
        cts = self.cotangent_leaves(cotangent)
        paced = _paced_on(ctx)
        residuals, check = list(ctx.residuals), functools.partial(self.check_residuals, ctx)
        compiled = None
        if paced is not None:  # a plan's budget bounds the device: so do its backwards in flight
            compiled = self._executables.executable(residuals, cts, check)
            ahead = paced.room >= _out_nbytes(compiled)  # (this one's gradients, allocated at dispatch)
            _PLANNED.wait(paced.devices, running=1 if ahead else 0)
            if not ahead:  # (and what the caller made of the last gradients has freed its inputs)
                drain(paced.devices)
        grads = self._executables.run(residuals, cts, check, compiled)
        if paced is not None:
            _PLANNED.ran(paced.devices, grads)
        consumed(ctx, grads)  # a store that handed ``ctx`` out waits on these for room
        return self.grad_structure.unflatten(grads, like=like)

    def check_representable(self, ctx: ResidualContext) -> None:
        """Raises :class:`SignatureMismatchError`, saying to turn ``jax_enable_x64`` on, if a
        residual's or an output's dtype is 64-bit while x64 is off in this process now (it was
        on when the context was made): JAX would hand the traced backward 32-bit values."""
        residuals, n = describe_residual(ctx.spec, "this context"), len(ctx.spec.avals)

        def describe(i: int) -> str:
            return residuals(i) if i < n else f"output leaf {i - n} of this context's forward"

        check_representable([*ctx.spec.avals, *self.out_avals], describe, "running its backward")

    def check_residuals(self, ctx: ResidualContext) -> None:
        """Raises, naming the residual, if one is not what the signature says: another shape
        or dtype (:class:`SignatureMismatchError`), or a deleted array
        (:class:`InvalidArgumentError`)."""
        if len(ctx.residuals) != len(ctx.spec.avals):
            raise SignatureMismatchError(
                f"the context holds {len(ctx.residuals)} residuals, its signature "
                f"{ctx.spec.signature} has {len(ctx.spec.avals)}"
            )
        for i, (x, aval) in enumerate(zip(ctx.residuals, ctx.spec.avals)):
            is_deleted = getattr(x, "is_deleted", None)
            if callable(is_deleted) and _jax_internals.transformation(x) is None and is_deleted():
                raise InvalidArgumentError(
                    f"residual {i} ({ctx.spec.names[i]}) of this context was deleted (by "
                    "x.delete() or a donation to a jitted function): run the forward again, or "
                    "get the context from its store again"
                )
            if getattr(x, "shape", None) != tuple(aval.shape) or getattr(x, "dtype", None) != aval.dtype:
                raise SignatureMismatchError(
                    f"residual {i} ({ctx.spec.names[i]}) must be {aval.dtype}{list(aval.shape)}, "
                    f"got {_describe_aval(x)}"
                )


def staged(values: Sequence[Any], what: str) -> bool:
    """Whether ``values`` are being staged out by ``jax.jit`` (then ``what`` runs inlined into
    the caller's trace); ``False`` for concrete arrays.

    Raises:
      InvalidArgumentError: a value is under ``jax.vmap``, ``jax.grad`` or another
        transformation, which a split's forward and backward do not support.
    """
    found = False
    for x in values:
        kind = _jax_internals.transformation(x)
        if kind is None:
            continue
        if kind != "jit":
            raise InvalidArgumentError(
                f"{what} cannot run under {kind}: call it outside the transformation (batch "
                "inside the function with jax.vmap there; differentiate with the split's "
                "backward, not through it). Inside jax.jit it works"
            )
        found = True
    return found


# Weak: a backward lives as long as an owner holds it (the split that traced it, the contexts it
# made, the store that loaded it), so a deleted split and its executables can be collected.
_REGISTRY: weakref.WeakValueDictionary[str, Backward] = weakref.WeakValueDictionary()
_REGISTRY_LOCK = threading.Lock()


def register_backward(bwd: Backward) -> None:
    """Makes ``bwd`` the backward that :func:`backward` uses for its signature in this process,
    for as long as something else holds it."""
    with _REGISTRY_LOCK:
        _REGISTRY[bwd.signature] = bwd


def lookup_backward(signature: str) -> Backward | None:
    """The registered backward for ``signature``, or ``None``."""
    with _REGISTRY_LOCK:
        return _REGISTRY.get(signature)


class BackwardLoader(Protocol):
    """Something that can load a stored backward: an open store, or the stored backward a
    context was read with."""

    def load_backward(self, signature: str) -> Backward | None:
        """The backward of ``signature``, loaded and registered now if it was not; ``None`` if
        this loader has none of that signature."""
        ...


# Weak: a loader is asked while its owner (an open store) holds it; a closed or collected store
# is not asked, and nothing here keeps a store, its disk tier or its bytes alive.
_LOADERS: weakref.WeakSet[BackwardLoader] = weakref.WeakSet()


def register_loader(loader: BackwardLoader) -> None:
    """Makes :func:`find_backward` ask ``loader`` for the backwards it has no live one of, for as
    long as something else holds ``loader`` (or until :func:`unregister_loader`)."""
    with _REGISTRY_LOCK:
        _LOADERS.add(loader)


def unregister_loader(loader: BackwardLoader) -> None:
    """Stops :func:`find_backward` asking ``loader`` (a store being closed)."""
    with _REGISTRY_LOCK:
        _LOADERS.discard(loader)


def loaders() -> tuple[BackwardLoader, ...]:
    """The loaders :func:`find_backward` asks now."""
    with _REGISTRY_LOCK:
        return tuple(_LOADERS)


def find_backward(signature: str, loader: BackwardLoader | None = None) -> Backward | None:
    """The registered backward of ``signature``; else the one ``loader`` loads (the stored
    backward a context was read with); else the first a registered loader loads; else ``None``.
    A stored backward is deserialized only here, when no live one exists. A store that cannot
    be reached does not hide the others: its error is raised only if no other store has it."""
    found = lookup_backward(signature)
    if found is not None:
        return found
    unreachable: StoreUnavailableError | None = None
    for candidate in ((loader,) if loader is not None else ()) + loaders():
        try:
            found = candidate.load_backward(signature)
        except StoreUnavailableError as err:
            unreachable = unreachable or err
            continue
        if found is not None:
            return found
    if unreachable is not None:
        raise unreachable
    return None


def backward(ctx: ResidualContext, cotangent: Any = None, *, like: Any = None) -> Any:
    """Runs the backward of any context this process has a backward for.

    Gradients come back shaped like the differentiated arguments (a tuple when ``argnums`` was a
    tuple). ``cotangent`` matches the forward's output (not its aux); ``None`` means 1 for a
    scalar floating output.

    A backward loaded from a store, in a process without the model, rebuilds the gradients'
    structure where every node type is a JAX container or registered in this process (nothing
    is imported for it); otherwise pass ``like=``, a tree of that structure (the parameters, a
    previous step's gradients), or get a mapping (a ``collections.OrderedDict``) from key path
    (``jax.tree_util.keystr``) to array whose leaves keep the model's leaf order:
    ``jax.tree.leaves(grads)`` lists them as ``jax.tree.leaves(params)`` would, so they can be
    ``jax.tree.unflatten``-ed on the parameters' treedef. ``like`` of another structure raises
    :class:`SignatureMismatchError` naming the path.

    Example:
      >>> import jax.numpy as jnp, residual_store as rs
      >>> fwd = rs.split(lambda w: jnp.sum(w ** 2))
      >>> loss, ctx = fwd(jnp.arange(3.0))
      >>> rs.backward(ctx)
      Array([0., 2., 4.], dtype=float32)
    """
    if not isinstance(ctx, ResidualContext):
        raise InvalidArgumentError(f"backward expects a rs.ResidualContext, got {type(ctx).__name__}")
    own, loader = backward_of(ctx)
    bwd = own or find_backward(ctx.spec.signature, loader)
    if bwd is None:
        sig = ctx.spec.signature
        if not is_current(sig):
            raise BackwardUnavailableError(
                f"context signature {sig} was written by residual-store 0.1, whose signatures could "
                "name two different functions: its stored backward is not trusted. Run its forward "
                "again with this version"
            )
        raise BackwardUnavailableError(
            f"no backward for signature {sig} in this process: make the context with rs.split "
            "here, run it with the split that makes it (split.backward rebuilds it from the "
            "context), or load it from a rs.Store that saved its backward"
        )
    return bwd(ctx, cotangent, like=like)
