"""``save="auto"``: keep the fewest residual bytes, recompute the rest with cheap, pure operations.

A split's forward computes the residuals its backward reads. Many of them are cheap functions of
others: ``tanh(z)`` and ``1 - tanh(z)**2`` of the pre-activation ``z``, a layer norm's
normalized input of its input. :func:`plan` chooses, over the forward's computation, the set of
values to keep with the fewest bytes such that every residual the backward reads can be computed
again from them and the forward's inputs using only cheap, pure operations (:data:`CHEAP`); the
backward then recomputes the rest before it runs. Matrix products, convolutions, custom_vjp /
custom_jvp calls, custom calls and kernels, callbacks, RNG operations, collectives and every
higher-order primitive (``jit``, ``scan``, ``checkpoint``: their bodies are kept whole) are
never recomputed: what they produce is kept when something needs it.

The choice is a minimum cut (as PyTorch's compiler partitions its joint graph): every value ``v``
of the forward is an edge ``v_in -> v_out`` costing its bytes (keeping it); a cheap operation
links its inputs' ``out`` nodes to its output's ``in`` node; anything else's outputs, and the
forward's inputs, hang from the source (they exist only in the forward); the residuals the
backward reads hang on the sink. The cut's edges are the values to keep; the values on the sink
side are recomputed. Weights and closed-over constants cost nothing (held by reference); the
other inputs (a stage's input activation, the batch) cost their bytes.

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
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from residual_store import _jax_internals
from residual_store.errors import InvalidArgumentError

__all__ = ["CHEAP", "RematPlan", "cheap", "plan", "policy_recomputable"]

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


def _protected(eqn: Any) -> bool:
    """Never recomputed: effects, higher-order primitives (their bodies stay whole), :data:`_NEVER`."""
    return bool(eqn.effects) or _jax_internals.has_inner_jaxprs(eqn) or eqn.primitive.name in _NEVER


def cheap(eqn: Any) -> bool:
    """Whether ``save="auto"`` lets the backward run ``eqn`` again: in :data:`CHEAP`, and pure."""
    return eqn.primitive.name in CHEAP and not _protected(eqn)


def policy_recomputable(policy: Callable[..., Any]) -> Callable[[Any], bool]:
    """What a JAX checkpoint policy (``policy(prim, *avals, **params) -> saveable``) lets the
    backward recompute: what it does not save, except what is never recomputed.

    Raises:
      InvalidArgumentError: the policy raised (the message names the primitive).
    """

    def recomputable(eqn: Any) -> bool:
        if _protected(eqn):
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


def _nbytes(aval: Any) -> int:
    try:
        return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize
    except TypeError:  # an extended dtype (a PRNG key): never recomputed through, kept whole
        return int(np.prod(aval.shape, dtype=np.int64)) * 8


class _Flow:
    """Max flow by shortest augmenting paths (Edmonds-Karp) on a small graph."""

    def __init__(self) -> None:
        self.cap: dict[int, dict[int, int]] = collections.defaultdict(dict)

    def edge(self, a: int, b: int, c: int) -> None:
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


@dataclasses.dataclass(frozen=True)
class RematPlan:
    """What a forward keeps and what its backward recomputes.

    Attributes:
      kept: the forward's values to keep, in the order of the forward's equations: invars (by
        index among the jaxpr's inputs) or equation outputs.
      recompute: indices of the forward's equations the backward runs again, in order.
      residuals: the forward's outvars that are the residuals the backward reads.
    """

    jaxpr: Any
    kept: tuple[Any, ...]
    recompute: tuple[int, ...]
    residuals: tuple[Any, ...]

    def is_input(self, v: Any) -> int | None:
        """The index of ``v`` among the jaxpr's inputs, or ``None``."""
        try:
            return list(self.jaxpr.invars).index(v)
        except ValueError:
            return None

    def rebuild(self, kept_values: Sequence[Any], consts: Sequence[Any] = ()) -> list[Any]:
        """The residuals, from the kept values (in ``kept``'s order) and the jaxpr's own
        constants: the recomputed ones again."""
        env = dict(zip(self.jaxpr.constvars, consts))
        env.update(zip(self.kept, kept_values))
        eqns = self.jaxpr.eqns
        for i in self.recompute:
            eqn = eqns[i]
            ins = [v.val if _jax_internals.is_literal(v) else env[v] for v in eqn.invars]
            env.update(zip(eqn.outvars, _jax_internals.bind_equation(eqn, ins)))
        return [v.val if _jax_internals.is_literal(v) else env[v] for v in self.residuals]


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
    index: dict[Any, int] = {}

    def node(v: Any) -> int:
        if v not in index:
            index[v] = len(index)
        return index[v]

    flow = _Flow()
    source, sink = -1, -2
    infinite = 1 + sum(_nbytes(v.aval) for v in jaxpr.invars) + sum(
        _nbytes(v.aval) for e in jaxpr.eqns for v in e.outvars
    )
    # node 2k: v_in, 2k + 1: v_out
    for v, costs in zip(jaxpr.invars, input_cost):
        k = node(v)
        flow.edge(source, 2 * k, infinite)
        flow.edge(2 * k, 2 * k + 1, _nbytes(v.aval) if costs else 0)
    producer: dict[Any, int] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        cheap = recomputable(eqn)
        for o in eqn.outvars:
            if _jax_internals.is_dropped(o):
                continue
            producer[o] = i
            k = node(o)
            flow.edge(2 * k, 2 * k + 1, _nbytes(o.aval))
            if not cheap:
                flow.edge(source, 2 * k, infinite)  # exists only in the forward
            else:
                for a in eqn.invars:
                    if not _jax_internals.is_literal(a) and a in index:
                        flow.edge(2 * index[a] + 1, 2 * k, infinite)
    for r in residuals:
        flow.edge(2 * node(r) + 1, sink, infinite)
    reach = flow.source_side(source, sink)
    kept = {v for v, k in index.items() if 2 * k in reach and 2 * k + 1 not in reach}
    # the equations that make the residuals again from what is kept (and only those)
    recompute: set[int] = set()
    todo = [r for r in residuals if not _jax_internals.is_literal(r)]
    seen: set[Any] = set()
    while todo:
        v = todo.pop()
        if v in seen or v in kept:
            continue
        seen.add(v)
        i = producer.get(v)
        if i is None or not recomputable(jaxpr.eqns[i]):
            raise AssertionError(f"remat plan: {v} is neither kept nor recomputable")  # a cut is a cover
        recompute.add(i)
        todo.extend(a for a in jaxpr.eqns[i].invars if not _jax_internals.is_literal(a))
    # only what is read: a value of no cost (a weight) may sit on the cut without being needed
    read = set(residuals) | {a for i in recompute for a in jaxpr.eqns[i].invars if not _jax_internals.is_literal(a)}
    order = {v: i for i, v in enumerate(index)}
    kept_read = sorted((v for v in kept if v in read), key=order.__getitem__)
    return RematPlan(jaxpr, tuple(kept_read), tuple(sorted(recompute)), tuple(residuals))
