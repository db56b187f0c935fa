"""A split's ``save`` choice (:class:`SaveChoice`); ``save="auto"``: keep the fewest residual
bytes, recompute the rest with cheap, pure operations.

A split's forward computes the residuals its backward reads. Many of them are cheap functions of
others: ``tanh(z)`` and ``1 - tanh(z)**2`` of the pre-activation ``z``, a layer norm's
normalized input of its input. :func:`plan` chooses, over the forward's computation, the set of
values to keep with the fewest bytes such that every residual the backward reads can be computed
again from them and the forward's inputs using only cheap, pure operations (:data:`CHEAP`); the
backward then recomputes the rest before it runs. Matrix products, convolutions, custom_vjp /
custom_jvp calls, custom calls and kernels, callbacks, RNG operations, collectives,
``checkpoint_name``'d values and the bodies of ``checkpoint``, ``while`` and ``cond`` are never
recomputed: what they produce is kept when something needs it.

The choice is a minimum cut (as PyTorch's compiler partitions its joint graph): every value ``v``
of the forward is an edge ``v_in -> v_out`` costing its bytes (keeping it); a cheap operation
links its inputs' ``out`` nodes to its output's ``in`` node; anything else's outputs, and the
forward's inputs, hang from the source (they exist only in the forward); the residuals the
backward reads hang on the sink. The cut's edges are the values to keep; the values on the sink
side are recomputed. Weights and closed-over constants cost nothing (held by reference); the
other inputs (a stage's input activation, the batch) cost their bytes.

Scans (layers under ``lax.scan``) are planned inside: their body gets its own cut over one
iteration, whose kept values the forward stacks over the iterations (:class:`Stacked`); in the
top-level graph the scan's per-iteration residuals then come from a *rebuild* that reads every
stacked value, so the top-level cut weighs keeping the residuals against keeping the stacks. A
rebuild never runs as a loop of its own when it can be helped: :func:`~residual_store._src.lazy.run_backward` makes each
iteration's residuals inside the backward's scan that reads them, where XLA fuses the
recomputation into its uses, so the whole residual stacks are never written to memory.

Reductions (``reduce_sum``, ``reduce_max``...) count as cheap: like elementwise operations they
read each element once, and a layer norm's statistics are one; so do indexing (``gather``,
``dynamic_slice``: an embedding lookup is made again from its table and the token ids) and
``stop_gradient``. ``jit`` calls are looked through (their bodies planned as if written in
place); ``checkpoint`` bodies are not, so the function's own remat policies and
``checkpoint_name`` choices hold.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from residual_store._src import _jax_internals
from residual_store._src.canonical import qualified_name
from residual_store._src.context import POLICY_PREFIX, SAVE_WORDS
from residual_store._src.errors import InvalidArgumentError
from residual_store._src.lazy import Lazy, PendingRebuild, force, read, to_host

__all__ = [
    "CHEAP", "Chosen", "RematPlan", "SaveChoice", "Stacked", "cheap", "plan", "policy_recomputable", "protected",
    "recomputed",
]

CHEAP: frozenset[str] = frozenset(
    {
        # elementwise arithmetic and math
        "add", "add_any", "sub", "mul", "div", "neg", "max", "min", "abs", "sign", "floor", "ceil", "round",
        "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "sqrt", "rsqrt",
        "cbrt", "pow", "integer_pow", "square", "erf", "erfc", "erf_inv", "atan2", "rem", "clamp",
        "is_finite", "nextafter", "reduce_precision",
        # comparisons, logic, selection
        "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor", "select_n",
        # layout and type
        "convert_element_type", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose",
        "rev", "slice", "split", "concatenate", "pad", "copy", "copy_p", "iota", "stop_gradient",
        "dynamic_slice", "gather",
        # reductions: one read of each element
        "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "argmax", "argmin",
    }
)
"""Primitives a backward may run again: pure, and costing about one pass over their inputs."""


_NEVER: frozenset[str] = frozenset(
    {
        "random_bits", "random_seed", "random_wrap", "random_unwrap", "random_fold_in", "random_split",
        "threefry2x32", "rng_bit_generator", "rng_uniform", "custom_call", "pallas_call", "ffi_call",
        "psum", "pmax", "pmin", "all_gather", "all_to_all", "ppermute", "reduce_scatter", "psum_scatter",
        "axis_index", "pure_callback", "io_callback", "debug_callback",
    }
)
"""Primitives never run again, whatever a policy says: RNG, kernels, collectives, callbacks."""


def protected(eqn: Any) -> bool:
    """Never recomputed: effects, higher-order primitives (their bodies stay whole), :data:`_NEVER`."""
    return bool(eqn.effects) or _jax_internals.has_inner_jaxprs(eqn) or eqn.primitive.name in _NEVER


def cheap(eqn: Any) -> bool:
    """Whether ``save="auto"`` lets the backward run ``eqn`` again: in :data:`CHEAP`, and pure."""
    return eqn.primitive.name in CHEAP and not protected(eqn)


def policy_recomputable(policy: Callable[..., Any]) -> Callable[[Any], bool]:
    """What a JAX checkpoint policy (``policy(prim, *avals, **params) -> saveable``) lets the
    backward recompute: what it does not save, except what is never recomputed.

    Raises:
      InvalidArgumentError: the policy raised (the message names the primitive).
    """

    def recomputable(eqn: Any) -> bool:
        if protected(eqn):
            return False
        try:
            saveable = policy(eqn.primitive, *[v.aval for v in eqn.invars], **eqn.params)
        except Exception as err:  # noqa: BLE001 - whatever the user's policy raises
            raise InvalidArgumentError(
                f"the save policy {getattr(policy, '__qualname__', policy)!r} raised on primitive "
                f"{eqn.primitive.name} ({type(err).__name__}: {err})"
            ) from err
        return not saveable

    return recomputable


@dataclasses.dataclass(frozen=True)
class SaveChoice:
    """A split's ``save`` option, parsed once: how its records spell it and what it lets the
    backward recompute.

    Invariant: ``recomputable`` is ``None`` exactly when ``record == "all"`` (keep every
    residual ``jax.vjp`` keeps).
    """

    record: str  # "all", "auto", "policy:<qualified name>" or "plan:<options>": part of the signature
    recomputable: Callable[[Any], bool] | None = dataclasses.field(default=None, compare=False)
    # a planner (rs.plan): (jaxpr, residuals, input_cost, inputs held) -> Chosen, for the fewest bytes
    choose: Callable[[Any, Sequence[Any], Sequence[bool], Sequence[Any]], Chosen] | None = dataclasses.field(default=None, compare=False)

    @classmethod
    def parse(cls, save: Any) -> SaveChoice:
        """``save`` as :func:`residual_store.split` takes it.

        Raises:
          InvalidArgumentError: ``save`` is neither callable, a plan (``rs.plan``), nor one of
            :data:`~residual_store._src.context.SAVE_WORDS`.
        """
        as_choice = getattr(type(save), "save_choice", None)  # rs.plan(...): it makes its own
        if as_choice is not None:
            choice = as_choice(save)
            assert isinstance(choice, SaveChoice)
            return choice
        if callable(save):
            return cls(f"{POLICY_PREFIX}{qualified_name(save)}", policy_recomputable(save))
        if save == "all":
            return cls("all")
        if save == "auto":
            return cls("auto", cheap)
        raise InvalidArgumentError(
            f"save must be one of {', '.join(map(repr, SAVE_WORDS))}, a JAX checkpoint policy "
            f"(a callable such as jax.checkpoint_policies.dots_saveable) or a plan (rs.plan(...)), got {save!r}"
        )


@dataclasses.dataclass(frozen=True)
class Chosen:
    """A planner's choice (``rs.plan``): the plan the backward's rebuild carries out, the
    positions in its ``kept`` of the values the forward moves to host memory (and the backward
    back), and the planner's report (what ``rs.explain`` shows)."""

    remat: RematPlan
    offloaded: frozenset[int] = frozenset()
    report: Any = None


def recomputed(p: RematPlan) -> Iterator[tuple[Any, int]]:
    """Every equation the backward of ``p`` runs again, with how many times a backward runs it
    (a planned scan's body equations: once per iteration)."""
    for i in p.recompute:
        scan = p.scans.get(i)
        if scan is None:
            yield p.jaxpr.eqns[i], 1
            continue
        for eqn, times in recomputed(scan.body):
            yield eqn, times * max(scan.parts.length, 1)


_NONE_ON_HOST: Mapping[Any, Any] = types.MappingProxyType({})  # no stack in host memory


def _nbytes(aval: Any) -> int:
    try:
        return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize
    except TypeError:  # an extended dtype (a PRNG key): never recomputed through, kept whole
        return int(np.prod(aval.shape, dtype=np.int64)) * 8


class _Flow:
    """Max flow by shortest augmenting paths (Edmonds-Karp) on a small graph."""

    def __init__(self) -> None:
        self.cap: dict[int, dict[int, float]] = collections.defaultdict(dict)

    def edge(self, a: int, b: int, c: float) -> None:
        self.cap[a][b] = self.cap[a].get(b, 0) + c
        self.cap[b].setdefault(a, 0)

    def source_side(self, s: int, t: int) -> set[int]:
        """Saturates the graph from ``s`` to ``t``; the nodes still reachable from ``s``."""
        while True:
            parent = {s: s}
            queue = collections.deque([s])
            while queue and t not in parent:
                a = queue.popleft()
                for b, c in self.cap[a].items():
                    if c > 0 and b not in parent:
                        parent[b] = a
                        queue.append(b)
            if t not in parent:
                return set(parent)
            path, b = [], t
            while b != s:
                path.append((parent[b], b))
                b = parent[b]
            push = min(self.cap[a][b] for a, b in path)
            for a, b in path:
                self.cap[a][b] -= push
                self.cap[b][a] += push


@dataclasses.dataclass(frozen=True, eq=False)
class Stacked:
    """A value of a scan's body kept once per iteration: the body's ``value`` (a body variable
    or a deeper :class:`Stacked`) stacked over the iterations of the scan equation ``eqn``.
    Compared by identity: one object per kept value."""

    eqn: int
    value: Any
    aval: Any  # one iteration's
    length: int

    @property
    def nbytes(self) -> int:
        return _nbytes(self.aval) * self.length


@dataclasses.dataclass(frozen=True, eq=False)
class _Rebuild:
    """The node of a scan's rebuild in the cut's graph: it needs all of the scan's kept values."""

    eqn: int


@dataclasses.dataclass(frozen=True)
class RematPlan:
    """What a forward keeps and what its backward recomputes.

    Attributes:
      jaxpr: the forward (an open jaxpr).
      kept: what to keep, in the order of the forward's equations: its variables (inputs by
        their index among the jaxpr's inputs, or equation outputs) and :class:`Stacked` values
        of the scans in ``scans``.
      recompute: indices of the forward's equations the backward runs again, in order; a scan in
        ``scans`` runs as its rebuild (the cheap part of its body, once per iteration).
      residuals: the forward's variables that are the residuals the backward reads.
      scans: the scans whose bodies are planned too, by equation index.
    """

    jaxpr: Any
    kept: tuple[Any, ...]
    recompute: tuple[int, ...]
    residuals: tuple[Any, ...]
    scans: dict[int, _ScanPlan] = dataclasses.field(default_factory=dict)

    def is_input(self, v: Any) -> int | None:
        """The index of ``v`` among the jaxpr's inputs, or ``None``."""
        if isinstance(v, Stacked):
            return None
        try:
            return list(self.jaxpr.invars).index(v)
        except ValueError:
            return None

    def evaluate(
        self, consts: Sequence[Any], args: Sequence[Any], want: Sequence[Any], on_host: Mapping[Any, Any] | None = None
    ) -> list[Any]:
        """Runs the forward on its constants and ``args``, each planned scan also stacking the
        values it keeps; the values of ``want`` (variables of the jaxpr, :class:`Stacked`).

        The :class:`Stacked` values that key ``on_host`` are stacked in host memory, each
        iteration's slice copied as the iteration makes it (the copy overlaps the next
        iterations' work), into the host buffer of the stack's shape they map to (donated by
        the caller: a program output in fresh pinned memory costs the time the host takes to
        pin it), or into a new one where they map to ``None``."""
        env = self._forward(consts, args, _NONE_ON_HOST if on_host is None else on_host)
        return [read(env, v) for v in want]

    def _forward(
        self, consts: Sequence[Any], args: Sequence[Any], on_host: Mapping[Any, Any] = _NONE_ON_HOST
    ) -> dict[Any, Any]:
        env: dict[Any, Any] = dict(zip(self.jaxpr.constvars, consts))
        env.update(zip(self.jaxpr.invars, args))
        for i, eqn in enumerate(self.jaxpr.eqns):
            ins = [read(env, v) for v in eqn.invars]
            scan = self.scans.get(i)
            if scan is None:
                outs = _jax_internals.bind_equation(eqn, ins)
            else:
                outs, stacks = scan.forward(eqn, ins, on_host)
                env.update(zip(scan.stacked, stacks))
            env.update(zip(eqn.outvars, outs))
        return env

    def rebuild(
        self,
        kept_values: Sequence[Any],
        consts: Sequence[Any] = (),
        lazy: bool = False,
        on_host: frozenset[Any] = frozenset(),
    ) -> list[Any]:
        """The residuals, from the kept values (in ``kept``'s order) and the jaxpr's own
        constants: the recomputed ones again. With ``lazy``, a planned scan's outputs come as
        placeholders that :func:`run_backward` rebuilds inside the backward's own scan, one
        iteration at a time (never the whole stack at once). The :class:`Stacked` values in
        ``on_host`` are in host memory: each iteration of a rebuild moves its slice to the
        device (a scan reading them copies the next slice while it computes)."""
        env = dict(zip(self.jaxpr.constvars, consts))
        env.update(zip(self.kept, kept_values))
        self._recompute(env, lazy, on_host)
        return [read(env, v) for v in self.residuals]

    def _recompute(self, env: dict[Any, Any], lazy: bool = False, on_host: frozenset[Any] = frozenset()) -> None:
        eqns = self.jaxpr.eqns
        for i in self.recompute:
            eqn, scan = eqns[i], self.scans.get(i)
            if scan is None:
                ins = [force(read(env, v)) for v in eqn.invars]
                env.update(zip(eqn.outvars, _jax_internals.bind_equation(eqn, ins)))
                continue
            pending = scan.pending(eqn, env, on_host)
            outs = [Lazy(pending, k) for k in range(len(scan.planned))] if lazy else pending.outputs()
            env.update(zip((eqn.outvars[k] for k in scan.planned), outs))


@dataclasses.dataclass(frozen=True)
class _ScanPlan:
    """A scan whose body is planned: the forward runs it stacking ``stacked`` besides its own
    outputs; the backward's rebuild scans ``stacked`` (and the kept per-iteration inputs) to
    make the outputs at ``planned`` (per-iteration outputs the backward needs) again."""

    parts: _jax_internals.ScanParts
    body: RematPlan  # over parts.body; its residuals are the body outputs at ``planned``
    planned: tuple[int, ...]  # positions among the scan equation's outputs
    stacked: tuple[Stacked, ...]  # the body's kept per-iteration values: carries, computed
    consts: tuple[int, ...]  # positions among the equation's inputs of kept loop constants
    xs: tuple[int, ...]  # positions among the equation's inputs of kept per-iteration inputs

    def forward(
        self, eqn: Any, ins: Sequence[Any], on_host: Mapping[Any, Any] = _NONE_ON_HOST
    ) -> tuple[list[Any], list[Any]]:
        """The scan equation ``eqn`` run on ``ins``: its outputs and the stacks of ``stacked``
        (those keying ``on_host`` in host memory: see :meth:`RematPlan.evaluate`)."""
        p, nc, nk = self.parts, self.parts.num_consts, self.parts.num_carry
        consts, init, xs = list(ins[:nc]), list(ins[nc : nc + nk]), list(ins[nc + nk :])
        out = p.body.outvars
        into = {k: on_host[s] for k, s in enumerate(self.stacked) if on_host.get(s) is not None}
        last = max(p.length, 1) - 1

        def step(
            carry: tuple[list[Any], Any, dict[int, Any]], x: list[Any]
        ) -> tuple[tuple[list[Any], Any, dict[int, Any]], tuple[list[Any], list[Any]]]:
            values, n, buffers = carry
            env = self.body._forward(p.consts, consts + values + x)
            ys = [read(env, v) for v in out[nk:]]
            at = last - n if p.reverse else n  # where the scan stacks this iteration's values
            buffers = {k: jax.lax.dynamic_update_index_in_dim(b, to_host(env[self.stacked[k].value]), at, 0)
                       for k, b in buffers.items()}
            stacks = [None if k in into else to_host(env[s.value]) if s in on_host else env[s.value]
                      for k, s in enumerate(self.stacked)]
            return ([read(env, v) for v in out[:nk]], n + 1, buffers), (ys, stacks)

        with _jax_internals.equation_context(eqn):
            (final, _, filled), (ys, stacks) = jax.lax.scan(
                step, (init, 0, into), xs, length=p.length, reverse=p.reverse, unroll=p.unroll
            )
        return list(final) + list(ys), [filled[k] if k in filled else s for k, s in enumerate(stacks)]

    def pending(self, eqn: Any, env: dict[Any, Any], on_host: frozenset[Any] = frozenset()) -> PendingRebuild:
        """The rebuild of the outputs at ``planned``, reading the kept values in ``env`` (those
        of ``on_host`` in host memory)."""
        return PendingRebuild(
            self,
            eqn,
            {self.parts.body.invars[j]: force(read(env, eqn.invars[j])) for j in self.consts},
            [force(read(env, eqn.invars[j])) for j in self.xs],
            [env[s] for s in self.stacked],
            tuple(s in on_host for s in self.stacked),
        )


def plan(
    jaxpr: Any,
    residuals: Sequence[Any],
    input_cost: Sequence[bool],
    recomputable: Callable[[Any], bool] = cheap,
) -> RematPlan:
    """The cheapest set of values of the open ``jaxpr`` (a forward) to keep for ``residuals``
    (some of its vars), see the module docstring. ``input_cost[i]``: whether keeping input ``i``
    costs its bytes (a per-context input) or nothing (a weight, a constant). ``recomputable``:
    which equations the backward may run again (default: the cheap ones)."""
    costs = [_nbytes(v.aval) if c else 0 for v, c in zip(jaxpr.invars, input_cost)]
    return _plan(jaxpr, residuals, costs, recomputable)


def _wanted(jaxpr: Any, residuals: Sequence[Any], recomputable: Callable[[Any], bool]) -> set[Any]:
    """The variables a backward might read or recompute from: the residuals and, through every
    recomputable equation or scan that makes one, its inputs (an over-approximation)."""
    wanted = {v for v in residuals if not _jax_internals.is_literal(v)}
    for eqn in reversed(jaxpr.eqns):
        if any(o in wanted for o in eqn.outvars) and (recomputable(eqn) or eqn.primitive.name == "scan"):
            wanted.update(v for v in eqn.invars if not _jax_internals.is_literal(v))
    return wanted


def _plan_scan(
    i: int, eqn: Any, wanted: set[Any], free: set[Any], recomputable: Callable[[Any], bool]
) -> _ScanPlan | None:
    """The plan of a scan's body for its per-iteration outputs in ``wanted``, or ``None`` when
    planning gains nothing (no output wanted, nothing recomputed)."""
    parts = _jax_internals.scan_parts(eqn)
    if parts is None:
        return None
    nc, nk = parts.num_consts, parts.num_carry
    planned = tuple(k for k in range(nk, len(eqn.outvars)) if eqn.outvars[k] in wanted)
    if not planned:
        return None
    body = parts.body
    length = max(parts.length, 1)

    def cost(j: int) -> int:
        bv, outer = body.invars[j], eqn.invars[j]
        if j < nc:  # a loop constant: kept once, its bytes shared by the iterations
            return 0 if _jax_internals.is_literal(outer) or outer in free else -(-_nbytes(bv.aval) // length)
        if j < nc + nk:  # a carry: kept by stacking it
            return _nbytes(bv.aval)
        return 0 if _jax_internals.is_literal(outer) or outer in free else _nbytes(bv.aval)

    inner = _plan(body, [body.outvars[k] for k in planned], [cost(j) for j in range(len(body.invars))], recomputable)
    if not inner.recompute:
        return None
    position = {v: j for j, v in enumerate(body.invars)}
    stacked, consts, xs = [], [], []
    for v in inner.kept:
        j = position.get(v)  # None: a body value or a deeper scan's stack
        if j is None or nc <= j < nc + nk:
            aval = v.aval if not isinstance(v, Stacked) else jax.ShapeDtypeStruct((v.length, *v.aval.shape), v.aval.dtype)
            stacked.append(Stacked(i, v, aval, parts.length))
        elif j < nc:
            consts.append(j)
        else:
            xs.append(j)
    return _ScanPlan(parts, inner, planned, tuple(stacked), tuple(consts), tuple(xs))


def _plan(
    jaxpr: Any, residuals: Sequence[Any], input_bytes: Sequence[int], recomputable: Callable[[Any], bool]
) -> RematPlan:
    index: dict[Any, int] = {}

    def node(v: Any) -> int:
        if v not in index:
            index[v] = len(index)
        return index[v]

    flow = _Flow()
    source, sink = -1, -2
    wanted = _wanted(jaxpr, residuals, recomputable)
    free = {v for v, b in zip(jaxpr.invars, input_bytes) if b == 0} | set(jaxpr.constvars)
    infinite = math.inf  # every source-sink path crosses a value's finite edge: pushes stay finite

    def value(v: Any, nbytes: int, made_in_forward: bool) -> int:
        """The node pair of a value (2k: v_in, 2k + 1: v_out); keeping it costs ``nbytes``."""
        k = node(v)
        flow.edge(2 * k, 2 * k + 1, nbytes)
        if made_in_forward:
            flow.edge(source, 2 * k, infinite)
        return k

    def feed(inputs: Sequence[Any], to: int) -> None:
        for a in inputs:
            if not _jax_internals.is_literal(a) and a in index:
                flow.edge(2 * index[a] + 1, to, infinite)

    for v, nbytes in zip(jaxpr.invars, input_bytes):
        value(v, nbytes, made_in_forward=True)
    producer: dict[Any, int] = {}
    scans: dict[int, _ScanPlan] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        is_cheap = recomputable(eqn)
        scan = None if is_cheap else _plan_scan(i, eqn, wanted, free, recomputable)
        rebuilt: dict[Any, int] = {}  # a planned scan's outputs -> its rebuild's node
        if scan is not None:
            scans[i] = scan
            rebuild = 2 * node(_Rebuild(i))  # one node: a rebuild reads every stacked value
            for s in scan.stacked:
                flow.edge(2 * value(s, s.nbytes, made_in_forward=True) + 1, rebuild, infinite)
            feed([eqn.invars[j] for j in scan.consts + scan.xs], rebuild)
            rebuilt = {eqn.outvars[k]: rebuild for k in scan.planned}
        for o in eqn.outvars:
            if _jax_internals.is_dropped(o):
                continue
            producer[o] = i
            k = value(o, _nbytes(o.aval), made_in_forward=not is_cheap and o not in rebuilt)
            if is_cheap:
                feed(eqn.invars, 2 * k)
            elif o in rebuilt:
                flow.edge(rebuilt[o], 2 * k, infinite)
    for r in residuals:
        if not _jax_internals.is_literal(r):
            flow.edge(2 * node(r) + 1, sink, infinite)
    reach = flow.source_side(source, sink)
    kept = {v for v, k in index.items() if 2 * k in reach and 2 * k + 1 not in reach and not isinstance(v, _Rebuild)}
    recompute = _recompute_set(jaxpr, residuals, kept, producer, scans, recomputable)
    # only what is read: a value of no cost (a weight) may sit on the cut without being needed
    order = {v: i for i, v in enumerate(index)}
    kept_read = sorted((v for v in recompute.kept if v in recompute.read), key=order.__getitem__)
    used = {i: s for i, s in scans.items() if i in recompute.equations}
    return RematPlan(jaxpr, tuple(kept_read), tuple(sorted(recompute.equations)), tuple(residuals), used)


@dataclasses.dataclass
class _Recompute:
    """The equations a backward runs again (``equations``), every value they or the residuals
    read (``read``), and the values kept (``kept``: the cut's, see :func:`_recompute_set`)."""

    equations: set[int]
    read: set[Any]
    kept: set[Any]


def _recompute_set(
    jaxpr: Any,
    residuals: Sequence[Any],
    kept: set[Any],
    producer: dict[Any, int],
    scans: dict[int, _ScanPlan],
    recomputable: Callable[[Any], bool],
) -> _Recompute:
    """The equations that make the residuals again from what is kept (and only those).

    The backward has, besides the kept values, the jaxpr's own constants (:meth:`RematPlan.rebuild`
    takes them: a constant a custom rule or a closure captured is held by the backward, not the
    context), so a constvar is never recomputed nor kept. Invariant: the cut separates every
    residual from whatever only the forward makes, so a value reached here that is neither kept,
    a constant, nor made by a recomputable equation is a bug of the cut, never of the function;
    it is then kept (anything the forward makes can be), which costs bytes but stays correct.
    """
    constants, kept = set(jaxpr.constvars), set(kept)
    equations: set[int] = set()
    read: set[Any] = {r for r in residuals if not _jax_internals.is_literal(r)}
    todo = list(read)
    seen: set[Any] = set()
    while todo:
        v = todo.pop()
        if v in seen or v in kept or v in constants:
            continue
        seen.add(v)
        i = producer.get(v)
        scan = scans.get(i) if i is not None else None
        if scan is not None and v in {jaxpr.eqns[i].outvars[k] for k in scan.planned}:
            needs = list(scan.stacked) + [jaxpr.eqns[i].invars[j] for j in scan.consts + scan.xs]
        elif i is not None and recomputable(jaxpr.eqns[i]):
            needs = list(jaxpr.eqns[i].invars)
        else:
            kept.add(v)
            continue
        assert i is not None  # both branches above that reach here had a producer
        equations.add(i)
        needs = [a for a in needs if not _jax_internals.is_literal(a)]
        read.update(needs)
        todo.extend(needs)
    return _Recompute(equations, read, kept)
