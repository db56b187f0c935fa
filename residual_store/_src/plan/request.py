"""``rs.plan``: the ``save`` option that plans, and ``rs.explain``: what it chose.

``rs.split(f, save=rs.plan(device_budget=..., microbatches=...))`` makes a split whose forward,
per signature, keeps on the device, offloads to host memory or recomputes each value its
backward needs (:mod:`residual_store._src.plan.choose`), the fastest choice whose contexts fit
the budget together. The options (the budget in bytes, the microbatches, whether to offload, the
device profile's kind and digest) are the split's ``save`` record, in every context's record; the
signature digests the options but the profile, and the plan itself, which is in the forward and
backward: a context resumes in a split planned the same way from any profile that plans alike.
"""

from __future__ import annotations

import dataclasses
import functools
import threading

from cachetools import LRUCache

from residual_store._src import remat
from residual_store._src.context import ResidualContext, plan_record
from residual_store._src.errors import InvalidArgumentError
from residual_store._src.plan import choose as choose_module
from residual_store._src.plan import cost
from residual_store._src.plan.choose import Plan
from residual_store._src.plan.profile import DeviceProfile, device_profile
from residual_store._src.store.budgets import parse_budget

__all__ = ["PlanOptions", "explain", "plan", "plan_of", "remember"]

_PLANS: LRUCache[str, Plan] = LRUCache(1024)  # signature -> its plan, made in this process
_PLANS_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """What a planned split is asked (made by :func:`plan`; see there).

    Attributes:
      device_budget: device bytes the contexts of ``microbatches`` microbatches may hold
        together, or ``None`` (unbounded: keep what is fastest).
      microbatches: how many contexts of the split are held at once.
      profile: the device profile the plan's costs are read from.
      offload: whether values may go to host memory (only where the profile has a link).
    """

    device_budget: int | None
    microbatches: int
    profile: DeviceProfile
    offload: bool = True

    @property
    def context_budget(self) -> int | None:
        """The device bytes one context may hold: its share of ``device_budget``."""
        return None if self.device_budget is None else self.device_budget // self.microbatches

    @property
    def record(self) -> str:
        """How a context's record spells these options (all but the profile part of the signature)."""
        kind = "".join(c if c.isalnum() else "-" for c in self.profile.kind)[:40]
        return plan_record(self.device_budget, self.microbatches, self.offload, f"{kind}.{self.profile.digest}")

    def save_choice(self) -> remat.SaveChoice:
        """The split's ``save`` choice for these options (read by ``SaveChoice.parse``)."""
        planner = functools.partial(
            choose_module.choose, budget=self.context_budget, profile=self.profile, offload=self.offload
        )
        return remat.SaveChoice(self.record, cost.recomputable, choose=planner)


def plan(
    device_budget: int | str | None = None,
    *,
    microbatches: int = 1,
    profile: DeviceProfile | None = None,
    offload: bool = True,
) -> PlanOptions:
    """A ``save`` option that plans each residual: keep it on the device, offload it to host
    memory inside the forward (back inside the backward), or recompute it in the backward,
    whichever makes the step fastest while the contexts fit the budget.

    Pass it as ``rs.split(f, save=rs.plan(...))``. Per signature, the forward keeps what
    ``save="auto"`` would (the fewest bytes from which cheap, pure operations make the rest),
    and then, within ``device_budget``, trades bytes for time: a matrix product's output is
    recomputed where its FLOPs cost less than moving its bytes, offloaded where the link is
    cheaper, kept where there is room. RNG, custom_vjp / custom_jvp calls, custom calls and
    kernels, callbacks, collectives and ``checkpoint_name``'d values are never recomputed.
    Weights never count (held by reference); a context's other inputs (a stage's input
    activation, the batch) count and are kept. On a CPU there is no link, so a plan keeps or
    recomputes. :func:`explain` shows the choice and its predicted cost.

    Args:
      device_budget: device bytes that ``microbatches`` contexts of the split may hold together
        (an ``int``, a string with a unit such as ``"512MiB"``, or a share of the default
        device's memory such as ``"50%"``); ``None``: unbounded.
      microbatches: how many contexts a pipeline holds at once (they share the budget).
      profile: the device's speeds (:class:`DeviceProfile`); ``None``: the default device's
        (:func:`device_profile`), built in for CPUs and TPU v5e, else measured once.
      offload: whether the plan may move values to host memory.

    Returns:
      A :class:`PlanOptions`, hashable; its options but the profile are part of the split's signature.

    Example:
      >>> import jax, jax.numpy as jnp, residual_store as rs
      >>> def loss(w, x):
      ...     return jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w))
      >>> w, x = jnp.ones((64, 64)) / 64, jnp.ones((32, 64))
      >>> fwd = rs.split(loss, save=rs.plan(device_budget=0))
      >>> y, ctx = fwd(w, x)
      >>> bool(jnp.allclose(fwd.backward(ctx), jax.grad(loss)(w, x), rtol=1e-6))
      True
      >>> print(rs.explain(ctx).splitlines()[0])  # doctest: +ELLIPSIS
      plan for cpu: ...

    Raises:
      InvalidArgumentError: a budget, microbatch count, profile or flag the planner cannot use.
    """
    import jax

    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise InvalidArgumentError(f"microbatches must be an int >= 1, got {microbatches!r}")
    if not isinstance(offload, bool):
        raise InvalidArgumentError(f"offload must be True or False, got {offload!r}")
    if profile is None:
        profile = device_profile()
    elif not isinstance(profile, DeviceProfile):
        raise InvalidArgumentError(f"profile must be a rs.DeviceProfile, got {type(profile).__name__}")
    budget = parse_budget(device_budget, "device_budget", jax.devices()[0])
    return PlanOptions(budget, microbatches, profile, offload)


def remember(signature: str, report: Plan) -> None:
    """Keeps the plan of a signature this process traced, for :func:`explain`."""
    with _PLANS_LOCK:
        _PLANS[signature] = report


def _size(n: int) -> str:
    """``n`` bytes for people: in the largest binary unit it reaches."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"


def plan_of(ctx: ResidualContext) -> Plan:
    """The :class:`Plan` of a planned context, found by its signature among the plans this
    process made (a forward, or a backward resumed from a store by a split made with the same
    ``rs.plan``).

    Raises:
      InvalidArgumentError: ``ctx`` is not a context, or this process has no plan for its
        signature (it was not planned, or its split has not traced it here).
    """
    if not isinstance(ctx, ResidualContext):
        raise InvalidArgumentError(f"plan_of takes a rs.ResidualContext, got {type(ctx).__name__}")
    with _PLANS_LOCK:
        found = _PLANS.get(ctx.spec.signature)
    if found is None:
        save = ctx.spec.call.save if ctx.spec.call is not None else "all"
        raise InvalidArgumentError(
            f"no plan for signature {ctx.spec.signature} in this process (its save is {save!r}): "
            "ask about a context of a split made with save=rs.plan(...), after its forward ran here "
            "or its backward was resumed by such a split"
        )
    return found


def explain(what: ResidualContext | Plan) -> str:
    """The plan of a planned context (:func:`plan_of`) or a :class:`Plan`, as a table: per value
    its choice, bytes and predicted seconds, after a line of totals against the budget.

    Raises:
      InvalidArgumentError: ``what`` is neither, or a context this process has no plan for.
    """
    if isinstance(what, ResidualContext):
        what = plan_of(what)
    if not isinstance(what, Plan):
        raise InvalidArgumentError(f"explain takes a rs.ResidualContext or a rs.Plan, got {type(what).__name__}")
    return _table(what)


def _table(p: Plan) -> str:
    budget = "unbounded" if p.budget is None else _size(p.budget)
    lines = [
        f"plan for {p.profile.kind}: {p.count('keep')} kept, {p.count('spill')} spilled, {p.count('offload')} "
        f"offloaded, {p.count('recompute')} recomputed; device {_size(p.device_bytes)} of {budget} a context"
        f"{'' if p.fits else ' (nothing fits: the fewest bytes)'}, spilled {_size(p.spill_bytes)}, "
        f"host {_size(p.host_bytes)}; "
        f"+{p.seconds * 1e3:.3f} ms a step predicted ({'exact' if p.exact else 'greedy'})",
    ]
    width = max([len(d.name) for d in p.decisions] + [4])
    for d in p.decisions:
        shape = f"{d.dtype}{list(d.shape)}"
        lines.append(f"  {d.choice:<9} {d.name:<{width}}  {shape:<24} {_size(d.nbytes):>14}  {d.seconds * 1e3:9.3f} ms")
    return "\n".join(lines)
