"""Typed residuals: :class:`ResidualSpec` says what each saved array is, :class:`ResidualContext`
holds the arrays.

A context is what a split forward hands back instead of ``jax.vjp``'s opaque closure. It is a
registered pytree (leaves: the residual arrays; auxiliary data: the spec), so it passes through
``jax.jit``, ``jax.tree.map`` and ``jax.device_put`` like any other pytree.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import numpy as np

from residual_store._src.errors import InvalidArgumentError, SignatureMismatchError

__all__ = [
    "CallSpec",
    "InputAval",
    "OWN_KINDS",
    "ResidualContext",
    "ResidualKind",
    "ResidualSpec",
    "SHARED_KINDS",
    "backward_of",
    "bound_context",
    "check_representable",
    "check_save_record",
    "consumed",
    "describe_residual",
    "on_consumed",
    "own_nbytes",
]

ResidualKind = Literal["weight", "input", "constant", "intermediate"]
"""``weight``: a leaf of an argument in ``weight_argnums`` (shared by every context of the split);
``input``: any other primal argument itself (a pipeline stage's input activation, the batch);
``constant``: an array the function closes over; ``intermediate``: a value computed by the
forward."""

SHARED_KINDS: frozenset[str] = frozenset({"weight", "constant"})
"""Residuals held by reference: the model's memory, stored once per store, never counted against
budgets."""

OWN_KINDS: frozenset[str] = frozenset({"input", "intermediate"})
"""Residuals that are the context's own memory: counted against budgets, offloaded, stored with
the context."""


@dataclasses.dataclass(frozen=True)
class InputAval:
    """One leaf of the arguments a forward was called with (see :class:`CallSpec`).

    Attributes:
      shape, dtype, weak_type: the leaf's aval (``dtype`` as ``str``, e.g. ``"bfloat16"`` or
        ``"key<fry>"``).
      placement: the text the signature records of its sharding and memory kind.
      sharding: the ``NamedSharding`` record (canonical JSON) for a leaf sharded over several
        devices, so another process can place it alike; ``None`` otherwise.
      memory_kind: the memory kind of its sharding (``"device"``, ``"pinned_host"``...).
      key_impl: the PRNG implementation of a typed key leaf.
    """

    shape: tuple[int, ...]
    dtype: str
    weak_type: bool
    placement: str
    sharding: str | None = None
    memory_kind: str | None = None
    key_impl: str | None = None


@dataclasses.dataclass(frozen=True)
class CallSpec:
    """How a forward was called: what a split needs to rebuild the backward of a context from
    avals alone, without running or compiling the forward (in a process where it never ran).

    Attributes:
      n_args: the number of positional arguments.
      argnums, weight_argnums, static_argnums, has_aux: the split's options.
      in_avals: one :class:`InputAval` per leaf of the non-static arguments.
      in_tree: the structure of the non-static arguments as a record of
        :mod:`residual_store._src.structure` (nested tuples of scalars), or ``None`` when it holds
        values no record can describe (then ``unrecorded`` says which).
      statics: ``((position, value record), ...)`` of the static arguments, or ``None`` likewise.
      kwnames: the names of the traced keyword arguments, sorted: ``in_tree`` (a tuple) has one
        child per traced positional argument, then one per name here, and ``in_avals`` lists
        their leaves after the positional ones'. ``()`` for a call without them.
      static_kwargs: ``((name, value record), ...)`` of the keywords named in the split's
        ``static_argnames``, sorted by name; ``None`` when a value has no record (``unrecorded``
        says why).
      context_mesh: the abstract mesh the forward was traced under (``jax.set_mesh``), as
        ``(axis names, axis sizes, axis types)``, or ``None``.
      unrecorded: why ``in_tree``, ``statics`` or ``static_kwargs`` is ``None``.
      differentiated: with a split ``filter``, whether each leaf of ``in_avals`` is
        differentiated; ``None`` without one (every leaf of ``argnums`` is).
      save: the split's ``save`` choice: ``"all"``, ``"auto"``, ``"policy:<qualified name>"``
        for a checkpoint policy, or ``"plan:<options>"`` for ``rs.plan(...)``.
      now, parent: for the ``later`` context of a B/W split (``split.backward(ctx, ct,
        now=...)``), the arguments whose gradients B returned and the signature of the context
        it was split from (whose call this record otherwise is); ``None`` for any other.
    """

    n_args: int
    argnums: int | tuple[int, ...]
    weight_argnums: tuple[int, ...]
    static_argnums: tuple[int, ...]
    has_aux: bool
    in_avals: tuple[InputAval, ...]
    in_tree: Any = None
    statics: Any = None
    kwnames: tuple[str, ...] = ()
    static_kwargs: Any = ()
    context_mesh: tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...]] | None = None
    unrecorded: str | None = None
    differentiated: tuple[bool, ...] | None = None
    now: tuple[int, ...] | None = None
    parent: str | None = None
    save: str = "all"


SAVE_WORDS = ("all", "auto")
"""The ``save`` choices a record spells as themselves; a checkpoint policy is ``POLICY_PREFIX``
followed by its qualified name (see :class:`residual_store._src.remat.SaveChoice`)."""
POLICY_PREFIX = "policy:"
PLAN_PREFIX = "plan:"  # followed by the plan's options (residual_store._src.plan.request.PlanOptions.record)
PLAN_UNBOUNDED = f"{PLAN_PREFIX}budget=none;"  # how a plan without a device budget's record starts
_MAX_SAVE_RECORD = 300  # characters: a record read from a manifest is capped


def plan_record(device_budget: int | None, microbatches: int, offload: bool, profile: str) -> str:
    """How a context's record spells a plan's options (part of its signature; the budget and
    microbatches are read back by :func:`plan_budget`)."""
    head = PLAN_UNBOUNDED if device_budget is None else f"{PLAN_PREFIX}budget={device_budget};"
    return f"{head}microbatches={microbatches};offload={int(offload)};profile={profile}"


def plan_fields(save: str) -> dict[str, str] | None:
    """A ``save`` record's plan options by name (``budget``, ``microbatches``, ``offload``,
    ``profile``: the profile's kind and digest), or ``None`` for anything but a plan."""
    if not save.startswith(PLAN_PREFIX):
        return None
    return dict(part.partition("=")[::2] for part in save[len(PLAN_PREFIX):].split(";"))


def computed_save(save: str) -> str:
    """``save`` as far as it names what is computed: a plan's record without its device profile.
    The profile only decides the plan, and the plan is in the forward and backward a signature
    digests; so two processes whose profiles differ (one measured in each, by its noise) and
    that plan alike make one signature, and a backward rebuilt in either fits the other's contexts."""
    if not save.startswith(PLAN_PREFIX):
        return save
    return ";".join(part for part in save.split(";") if not part.startswith("profile="))


def plan_budget(save: str) -> tuple[int, int] | None:
    """The device budget and the microbatches sharing it that a ``save`` record's plan names:
    ``None`` for anything but a plan under a device budget; ``(0, 1)`` (the tightest) for one
    whose numbers cannot be read."""
    if save.startswith(PLAN_UNBOUNDED) or (fields := plan_fields(save)) is None:
        return None
    try:
        budget, microbatches = int(fields["budget"]), int(fields["microbatches"])
    except (KeyError, ValueError):
        return 0, 1
    return (budget, microbatches) if budget >= 0 and microbatches >= 1 else (0, 1)


def check_save_record(v: Any) -> str:
    """``v``, if it spells a ``save`` choice as :attr:`CallSpec.save` does.

    Raises:
      ValueError: it does not (a manifest's record is malformed).
    """
    if v in SAVE_WORDS or (
        isinstance(v, str) and v.startswith((POLICY_PREFIX, PLAN_PREFIX)) and len(v) <= _MAX_SAVE_RECORD
    ):
        return v
    raise ValueError(f"save must be 'all', 'auto', 'policy:<name>' or 'plan:<options>', got {str(v)[:40]!r}")


@dataclasses.dataclass(frozen=True)
class ResidualSpec:
    """What a context's residuals are, without the arrays: hashable, cheap, process-independent.

    Attributes:
      signature: the digest naming the forward/backward pair (see :mod:`residual_store._src.signature`).
      avals: one ``jax.ShapeDtypeStruct`` per residual leaf.
      names: where each leaf came from: ``"input params['w1']"``, ``"tanh model.py:12"``, or a
        ``checkpoint_name`` label.
      input_paths: for leaves that *are* a primal input, its key path (``"params['w1']"``);
        ``None`` for constants and intermediates.
      kinds: ``"weight"``, ``"input"``, ``"constant"`` or ``"intermediate"`` per leaf.
      call: how the forward was called (:class:`CallSpec`); ``None`` for contexts written by
        residual-store 0.1, which did not record it.
      on_host: the positions of the intermediates the forward itself put in host memory (a
        plan's offloaded values, :func:`residual_store.plan`), in order. They stay there: a
        store neither counts them against a device budget nor moves them (its device and host
        tiers move the other residuals; a read from disk puts them back in host memory), and
        the backward brings them to the device inside its own program.
    """

    signature: str
    avals: tuple[jax.ShapeDtypeStruct, ...]
    names: tuple[str, ...]
    input_paths: tuple[str | None, ...]
    kinds: tuple[ResidualKind, ...]
    call: CallSpec | None = None
    on_host: tuple[int, ...] = ()

    @functools.cached_property
    def leaf_nbytes(self) -> tuple[int, ...]:
        """Bytes of each residual (a typed key: its key data), worked out once per spec: every
        put and get of a context of hundreds of residuals asks, and its arrays match ``avals``."""
        return tuple(aval_nbytes(a) for a in self.avals)

    @functools.cached_property
    def movable(self) -> tuple[bool, ...]:
        """Per residual, whether a store moves it between its tiers: the context's own (an
        intermediate or an input, not a weight nor a constant) and not :attr:`on_host`."""
        host = frozenset(self.on_host)
        return tuple(k in OWN_KINDS and i not in host for i, k in enumerate(self.kinds))

    @functools.cached_property
    def own_nbytes(self) -> int:
        """Bytes of the context's own residuals that a store moves (:attr:`movable`): what
        offloading a context of this spec frees on the device."""
        return sum(n for n, m in zip(self.leaf_nbytes, self.movable) if m)

    @functools.cached_property
    def host_nbytes(self) -> int:
        """Bytes of the residuals the forward put in host memory itself (:attr:`on_host`)."""
        return sum(self.leaf_nbytes[i] for i in self.on_host)

    def __hash__(self) -> int:
        # the fields' hash, worked out once: specs key the caches every put and get consults,
        # and hashing hundreds of avals costs more than what those caches save
        try:
            return self.__dict__["_hash"]
        except KeyError:
            h = hash((self.signature, self.avals, self.names, self.input_paths, self.kinds, self.call, self.on_host))
            self.__dict__["_hash"] = h
            return h

    def __post_init__(self) -> None:
        n = len(self.avals)
        if not (len(self.names) == len(self.input_paths) == len(self.kinds) == n):
            raise ValueError(
                f"ResidualSpec fields disagree in length: {n} avals, {len(self.names)} names, "
                f"{len(self.input_paths)} input paths, {len(self.kinds)} kinds"
            )
        host = self.on_host
        if list(host) != sorted(set(host)) or any(not 0 <= i < n or self.kinds[i] != "intermediate" for i in host):
            raise ValueError(f"ResidualSpec.on_host must list intermediates' positions in order, got {self.on_host}")

    @property
    def nbytes(self) -> int:
        """Bytes of all residual leaves, as the avals describe them."""
        return sum(aval_nbytes(a) for a in self.avals)


@functools.lru_cache(maxsize=256)
def _narrowed(dtype: Any, x64: bool) -> np.dtype | None:
    """What JAX makes ``dtype`` now, where that is another dtype; ``x64`` (the flag now) only
    keys the cache."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return None
    canonical = jax.dtypes.canonicalize_dtype(dtype)
    return None if canonical == dtype else np.dtype(canonical)


def check_representable(avals: Sequence[Any], describe: Callable[[int], str], before: str) -> None:
    """Raises if a dtype of ``avals`` has no exact counterpart in this process: a 64-bit type
    while ``jax_enable_x64`` is off (JAX would narrow it to 32 bits, and a backward traced for
    it would be handed 32-bit values). ``describe(i)`` names aval ``i`` in the message,
    ``before`` what to turn x64 on before (``"loading it"``). A lookup per aval: it runs on
    every backward call.

    Raises:
      SignatureMismatchError: for the first such dtype, saying how to turn x64 on.
    """
    x64 = bool(jax.config.jax_enable_x64)  # type: ignore[attr-defined]  # a flag jax.config defines at runtime
    if x64:  # every dtype is its own canonical one
        return
    for i, aval in enumerate(avals):
        narrowed = _narrowed(aval.dtype, x64)
        if narrowed is not None:
            raise SignatureMismatchError(
                f"{describe(i)} is {np.dtype(aval.dtype).name}, which this process cannot represent: "
                f"jax_enable_x64 is off, and JAX would make it {narrowed.name}. Set "
                f"jax.config.update('jax_enable_x64', True) (or JAX_ENABLE_X64=1) before {before}"
            )


def describe_residual(spec: ResidualSpec, context: str) -> Callable[[int], str]:
    """Names residual ``i`` of ``spec`` for :func:`check_representable`:
    ``"<context>, residual 3 (tanh model.py:12)"``."""
    return lambda i: f"{context}, residual {i} ({spec.names[i]})"


def aval_nbytes(aval: Any) -> int:
    """The bytes of one array of ``aval`` (a PRNG key's: its key data's)."""
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key):
        size = int(np.prod(aval.shape, dtype=np.int64))
        key_shape = jax.eval_shape(lambda k: jax.random.key_data(k), aval).shape
        return size and int(np.prod(key_shape, dtype=np.int64)) * 4
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


@jax.tree_util.register_pytree_node_class
class ResidualContext:
    """The residuals of one forward call, typed and named; feed it to ``rs.backward``.

    Example:
      >>> import jax, jax.numpy as jnp, residual_store as rs
      >>> fwd = rs.split(lambda w, x: jnp.sum(jnp.tanh(x @ w)))
      >>> loss, ctx = fwd(jnp.ones((3, 2)), jnp.ones((4, 3)))
      >>> ctx.spec.names[0], ctx.spec.kinds[0]
      ('input x', 'input')
      >>> grads = rs.backward(ctx)
    """

    __slots__ = ("_residuals", "_spec", "_backward", "_loader", "_nbytes", "_own_nbytes", "_consumer", "__weakref__")

    def __init__(self, residuals: Sequence[Any], spec: ResidualSpec) -> None:
        residuals = tuple(residuals)
        if len(residuals) != len(spec.avals):
            raise ValueError(
                f"a ResidualContext for signature {spec.signature} needs {len(spec.avals)} "
                f"residual arrays, got {len(residuals)}"
            )
        self._residuals = residuals
        self._spec = spec
        self._backward: Any = None  # the backward that made it, if a split did (kept alive here)
        self._loader: Any = None  # the stored backward its store read for it, if a store gave it
        self._nbytes: int | None = None  # worked out on first use (the residuals never change)
        self._own_nbytes: int | None = None  # (likewise)
        self._consumer: Callable[[Any], None] | None = None  # told when a backward took it (on_consumed)

    @property
    def residuals(self) -> tuple[Any, ...]:
        """The residual arrays, one per ``spec.avals`` entry."""
        return self._residuals

    @property
    def spec(self) -> ResidualSpec:
        """The :class:`ResidualSpec`: signature, avals, names, input paths, kinds."""
        return self._spec

    @property
    def nbytes(self) -> int:
        """Bytes this context holds, each distinct array counted once.

        Weights and constants are held by reference, not copied; :meth:`describe` splits the
        total.
        """
        if self._nbytes is None:
            seen: set[int] = set()
            total = 0
            for x, n in zip(self._residuals, self._spec.leaf_nbytes):
                if id(x) not in seen and hasattr(x, "dtype"):
                    seen.add(id(x))
                    total += n
            self._nbytes = total
        return self._nbytes

    def _own_bytes(self) -> int:
        """See :func:`own_nbytes`."""
        if self._own_nbytes is None:
            seen: set[int] = set()
            total = 0
            for x, n, movable in zip(self._residuals, self._spec.leaf_nbytes, self._spec.movable):
                if movable and id(x) not in seen:
                    seen.add(id(x))
                    total += n
            self._own_nbytes = total
        return self._own_nbytes

    def _watch(self, callback: Callable[[Any], None]) -> bool:
        """See :func:`on_consumed`."""
        if self._consumer is not None:
            return False
        self._consumer = callback
        return True

    def describe(self) -> str:
        """A readable table: one row per residual with name, shape, dtype, bytes and kind."""
        rows = [("#", "name", "shape", "dtype", "bytes", "kind")]
        for i, (aval, name, kind) in enumerate(
            zip(self._spec.avals, self._spec.names, self._spec.kinds)
        ):
            shape = "(" + ", ".join(str(d) for d in aval.shape) + ")"
            where = " (host)" if i in self._spec.on_host else ""
            rows.append((str(i), name, shape, str(aval.dtype), f"{aval_nbytes(aval):,}", kind + where))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        held = {k: 0 for k in ("weight", "input", "constant", "intermediate")}
        for aval, kind in zip(self._spec.avals, self._spec.kinds):
            held[kind] += aval_nbytes(aval)
        host = f" ({self._spec.host_nbytes:,} of them in host memory)" if self._spec.on_host else ""
        lines.append(
            f"signature {self._spec.signature}: {self.nbytes:,} bytes held; its own "
            f"{held['intermediate'] + held['input']:,} ({held['intermediate']:,} intermediate{host}, "
            f"{held['input']:,} input), by reference {held['weight']:,} weight and "
            f"{held['constant']:,} constant bytes"
        )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"ResidualContext(signature={self._spec.signature!r}, "
            f"residuals={len(self._residuals)}, nbytes={self.nbytes})"
        )

    def tree_flatten(self) -> tuple[tuple[Any, ...], ResidualSpec]:
        return self._residuals, self._spec

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Refuses pickling (``multiprocessing`` sends arguments pickled): the residuals live on
        this process's devices and the backward is this process's compiled code, and stored data
        goes between processes only through a store, checked as it is read."""
        raise InvalidArgumentError(
            f"a ResidualContext cannot be pickled (signature {self._spec.signature}): to hand it to "
            "another process, put it in a Store there both can reach (store.put(ctx, key)) and get "
            "it in the other process (rs.Store(path).get(key))"
        )

    def __copy__(self) -> ResidualContext:
        return self._made(self._spec, self._residuals, self._backward, self._loader)

    def __deepcopy__(self, memo: dict[int, Any]) -> ResidualContext:
        residuals = copy.deepcopy(self._residuals, memo)
        return self._made(self._spec, residuals, self._backward, self._loader)

    @classmethod
    def tree_unflatten(cls, spec: ResidualSpec, residuals: Sequence[Any]) -> ResidualContext:
        return cls._made(spec, residuals, None, None)

    @classmethod
    def _made(cls, spec: ResidualSpec, residuals: Sequence[Any], backward: Any, loader: Any) -> ResidualContext:
        """A context without the checks of ``__init__`` (its residuals match ``spec``: a split,
        a store or JAX made them from it)."""
        obj = object.__new__(cls)
        obj._residuals = tuple(residuals)
        obj._spec = spec
        obj._backward = backward
        obj._loader = loader
        obj._nbytes = None
        obj._own_nbytes = None
        obj._consumer = None
        return obj


def bound_context(spec: ResidualSpec, residuals: Sequence[Any], *, backward: Any = None, loader: Any = None) -> ResidualContext:
    """A context that carries what runs its backward: ``backward``, the one of the split that
    made it (the context keeps it alive: the registry holds backwards weakly), or ``loader``,
    the stored backward its store read for it (deserialized only if ``rs.backward`` needs it).
    ``residuals`` match ``spec`` (a split or a store made them from it)."""
    return ResidualContext._made(spec, residuals, backward, loader)


def backward_of(ctx: ResidualContext) -> tuple[Any, Any]:
    """What ``ctx`` carries to run its backward: (the split's backward, the stored backward's
    loader), each ``None`` where it carries none (see :func:`bound_context`)."""
    return ctx._backward, ctx._loader



def own_nbytes(ctx: ResidualContext) -> int:
    """Bytes of ``ctx``'s own residuals (not weights or constants), each distinct array counted
    once: what a store's budgets count (two residuals that are one array are one buffer, copied
    once; ``spec.own_nbytes`` counts each). Worked out once per context."""
    return ctx._own_bytes()


def on_consumed(ctx: ResidualContext, callback: Callable[[Any], None]) -> bool:
    """Asks to be told when a backward has been dispatched on ``ctx``: ``callback`` gets its
    outputs (once those are ready, the computation that read ``ctx``'s arrays is done, so their
    device memory can be freed). A store hands out contexts so, to know when it has room again.
    Returns ``False``, changing nothing, where someone asked already."""
    return ctx._watch(callback)


def consumed(ctx: ResidualContext, outputs: Any) -> None:
    """A backward was dispatched on ``ctx`` and returned ``outputs``: whoever asked
    (:func:`on_consumed`) is told."""
    callback = ctx._consumer
    if callback is not None:
        callback(outputs)
