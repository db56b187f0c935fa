"""A planned scan's residuals made again inside the backward, an iteration at a time.

:meth:`residual_store._src.remat.RematPlan.rebuild` leaves the residuals of a scan whose body
it plans as placeholders (:class:`Lazy`) over a :class:`PendingRebuild`: the kept stacks and
what the rebuild of one iteration reads. :func:`run_backward` evaluates the backward's jaxpr so
that the backward's own scan over those residuals rebuilds each iteration's slices in its body,
where XLA fuses the recomputation into their uses: the residual stacks are never made whole. A
kept stack in host memory (a plan's offload) is read a slice at a time, the next iteration's
copied to the device while the current one computes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from residual_store._src import _jax_internals

__all__ = ["Lazy", "PendingRebuild", "abstract", "force", "is_lazy", "read", "run_backward", "to_device", "to_host"]


def read(env: dict[Any, Any], v: Any) -> Any:
    """The value of ``v`` (a variable or a literal) in ``env``."""
    return v.val if _jax_internals.is_literal(v) else env[v]


def to_host(x: Any) -> Any:
    """``x`` moved to the host memory its device pins, inside a traced program."""
    return jax.device_put(x, jax.memory.Space.Host)


def to_device(x: Any) -> Any:
    """``x`` in its device's own memory, inside a traced program (nothing where it is there)."""
    return jax.device_put(x, jax.memory.Space.Device)



class PendingRebuild:
    """A planned scan's rebuild and what it reads: run whole (:meth:`outputs`, once) or one
    iteration at a time inside another scan (:meth:`iteration`)."""

    def __init__(
        self,
        scan: Any,
        eqn: Any,
        consts: dict[Any, Any],
        xs: list[Any],
        stacks: list[Any],
        on_host: tuple[bool, ...] = (),
    ) -> None:
        self.scan, self.eqn, self.consts, self.xs, self.stacks = scan, eqn, consts, xs, stacks
        self.on_host = on_host or (False,) * len(stacks)
        self._outputs: list[Any] | None = None

    def iteration(self, xs: Sequence[Any], stacks: Sequence[Any]) -> list[Any]:
        """One iteration's outputs at ``planned``, from its slices of ``xs`` and ``stacks`` (a
        slice of a stack in host memory moved to the device first)."""
        scan = self.scan
        env = dict(zip(scan.parts.body.constvars, scan.parts.consts))
        env.update(self.consts)
        env.update(zip((scan.parts.body.invars[j] for j in scan.xs), xs))
        stacks = [to_device(x) if host else x for x, host in zip(stacks, self.on_host)]
        env.update(zip((s.value for s in scan.stacked), stacks))
        scan.body._recompute(env)
        return [read(env, v) for v in scan.body.residuals]

    def outputs(self) -> list[Any]:
        """The outputs at ``planned``, every iteration stacked (made once)."""
        if self._outputs is None:
            # no carry: every iteration reads and writes index i of its stacks, whatever the direction
            with _jax_internals.equation_context(self.eqn):
                _, ys = jax.lax.scan(lambda _, x: (None, self.iteration(*x)), None, (self.xs, self.stacks),
                                     length=self.scan.parts.length)
            self._outputs = list(ys)
        return self._outputs


@dataclasses.dataclass(frozen=True, eq=False)
class Lazy:
    """Output ``k`` of a pending rebuild, not made yet."""

    pending: PendingRebuild
    k: int

    @property
    def aval(self) -> Any:
        body_aval = self.pending.scan.body.residuals[self.k].aval
        return jax.ShapeDtypeStruct((self.pending.scan.parts.length, *body_aval.shape), body_aval.dtype)


def force(x: Any) -> Any:
    return x.pending.outputs()[x.k] if isinstance(x, Lazy) else x


def is_lazy(x: Any) -> bool:
    """Whether ``x`` is a residual :meth:`RematPlan.rebuild` left to :func:`run_backward`."""
    return isinstance(x, Lazy)


def abstract(x: Any) -> Any:
    """The shape and dtype of a residual, lazy or not."""
    if isinstance(x, Lazy):
        return x.aval
    aval = jax.typeof(x)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def run_backward(closed_jaxpr: Any, args: Sequence[Any]) -> list[Any]:
    """Evaluates a backward's jaxpr on ``args``, some of them lazy residuals of
    :meth:`RematPlan.rebuild`: a scan that reads them as per-iteration inputs rebuilds each
    iteration's slices in its own body, where XLA fuses the recomputation into their uses (the
    stacks are never made whole); anything else that reads one makes it."""
    return _run(closed_jaxpr.jaxpr, closed_jaxpr.consts, args)


def _run(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        ins = [read(env, v) for v in eqn.invars]
        if not any(isinstance(x, Lazy) for x in ins):
            outs = _jax_internals.bind_equation(eqn, ins)
        elif (scan := _jax_internals.scan_parts(eqn)) is not None and not any(
            isinstance(x, Lazy) for x in ins[: scan.num_consts + scan.num_carry]
        ):
            outs = _fused_scan(eqn, scan, ins)
        elif eqn.primitive.name in ("jit", "pjit") and (body := _jax_internals.call_body(eqn)) is not None:
            outs = _run(body[0], body[1], ins)
        else:
            outs = _jax_internals.bind_equation(eqn, [force(x) for x in ins])
        env.update(zip(eqn.outvars, outs))
    return [read(env, v) for v in jaxpr.outvars]


def _fused_scan(eqn: Any, scan: _jax_internals.ScanParts, ins: Sequence[Any]) -> list[Any]:
    """A backward scan whose per-iteration inputs include lazy residuals: each iteration first
    rebuilds its slices of them (from its slices of the kept stacks), then runs the body.

    A kept stack in host memory is not scanned: each iteration copies the *next* iteration's
    slice to the device (carried to it), so the copy runs while this iteration computes."""
    nc, nk = scan.num_consts, scan.num_carry
    consts, init, xs = list(ins[:nc]), list(ins[nc : nc + nk]), list(ins[nc + nk :])
    pendings = list({id(x.pending): x.pending for x in xs if isinstance(x, Lazy)}.values())
    plain = [None if isinstance(x, Lazy) else x for x in xs]
    last = scan.length - 1
    hosted = [(p, k) for p in pendings for k, host in enumerate(p.on_host) if host] if last >= 0 else []

    def fetch(n: Any) -> list[Any]:  # the host slices of the iteration run n-th, on the device
        at = last - n if scan.reverse else n
        return [to_device(jax.lax.dynamic_index_in_dim(p.stacks[k], at, 0, keepdims=False)) for p, k in hosted]

    scanned = [(p.xs, [None if (p, k) in hosted else s for k, s in enumerate(p.stacks)]) for p in pendings]

    def step(state: tuple[list[Any], Any, list[Any]], x: tuple[list[Any], list[Any]]) -> tuple[Any, list[Any]]:
        carry, n, fetched = state
        plain_x, per_pending = x
        now = dict(zip(hosted, fetched))
        made = {id(p): p.iteration(slices, [now.get((p, k), s) for k, s in enumerate(stacks)])
                for p, (slices, stacks) in zip(pendings, per_pending)}
        full = [made[id(v.pending)][v.k] if isinstance(v, Lazy) else px for v, px in zip(xs, plain_x)]
        outs = _run(scan.body, scan.consts, [*consts, *carry, *full])
        return (outs[:nk], n + 1, fetch(jnp.minimum(n + 1, last)) if hosted else []), outs[nk:]

    with _jax_internals.equation_context(eqn):
        (final, _, _), ys = jax.lax.scan(step, (init, 0, fetch(0) if hosted else []), (plain, scanned),
                                         length=scan.length, reverse=scan.reverse, unroll=scan.unroll)
    return [*final, *ys]
