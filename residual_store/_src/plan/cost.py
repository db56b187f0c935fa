"""What each choice for one residual costs on a :class:`~.profile.DeviceProfile`.

A residual the backward reads can be **kept** on the device (its bytes count against the
budget, no time), **spilled** (kept in the context, which a store at the budget moves to host
memory and back through its pool: no device bytes between forward and backward, both copies'
time, unhidden: a TPU runs copies and compute one after the other), **offloaded** to host memory
inside the forward and brought back inside the backward (no device bytes; the copies' time at
the in-program rate, less what hides behind the compute beside them: the values offloaded from
one scan body share its compute, :func:`copy_seconds`; a value outside the scans, copied whole,
hides by the profile's shares, :func:`move_seconds`), or
**recomputed** in the backward from what is kept (no bytes; the time of the matrix products
that make it, through cheap operations). Only pure operations are recomputed: never RNG,
custom_vjp / custom_jvp calls, custom calls or kernels, callbacks or collectives (the
protections of ``save="auto"``, :func:`residual_store._src.remat.cheap`), nor a value made inside
a nested scan or the function's own ``jax.checkpoint``. Unlike ``save="auto"``, a plan looks
through ``checkpoint_name`` labels: a name is there for a policy to read, and a plan is the
policy. An operation's time is its FLOPs at the matmul rate or the bytes it reads and writes at
the memory's rate, whichever is longer (a roofline): a matrix product of contraction ``K``
costs ``2 K`` FLOP per output element, an elementwise operation about one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np

from residual_store._src import _jax_internals, remat
from residual_store._src.plan.profile import DeviceProfile

__all__ = [
    "Candidate", "Choice", "Option", "candidates", "copy_seconds", "flops", "move_seconds", "nbytes", "placements",
    "product_seconds", "recomputable", "recomputed_seconds", "relabels", "seconds", "spill_seconds", "value_bytes",
]

Choice = Literal["keep", "spill", "offload", "recompute"]

# pure operations worth recomputing beyond the cheap ones (whose cost is one pass over memory)
_PRODUCTS = frozenset({"dot_general", "conv_general_dilated"})


@dataclasses.dataclass(frozen=True)
class Option:
    """One choice for a residual: the device bytes it holds per context, the seconds it adds to
    a step on its own, and the bytes it copies to host memory inside the forward and back inside
    the backward (an offload's). The copies' time is not in ``seconds``: a scan body's values
    share it (:func:`copy_seconds`); a value outside the scans pays :func:`move_seconds`."""

    choice: Choice
    nbytes: int
    seconds: float
    moved: int = 0


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A value the forward keeps for its backward, with what each choice would cost.

    Attributes:
      value: the kept value (a variable of the forward's jaxpr, or a scan's
        :class:`~residual_store._src.remat.Stacked` value).
      name: where it comes from, for people (``"dot_general model.py:12 (x8)"``).
      nbytes: its bytes in one context.
      options: ``keep`` first, then ``spill`` and ``offload`` where the device has a link, then
        ``recompute`` where products make it (through cheap operations and labels only).
      products: those products (jaxpr equations), which recomputing it runs again.
      group: the values whose copies run beside the same compute: the scan equation (its index)
        a stacked value comes from; ``None`` for a value outside the scans, copied whole wherever
        the program puts the copy and costed apart (:func:`move_seconds`).
      beside: a scan's compute, forward seconds in one context (its body's products times its
        length), shared by its stacks' copies; 0 outside the scans.
    """

    value: Any
    name: str
    nbytes: int
    options: tuple[Option, ...]
    products: tuple[Any, ...] = dataclasses.field(default=(), compare=False)
    group: int | None = None
    beside: float = 0.0


def nbytes(aval: Any) -> int:
    """The bytes of one array of ``aval`` (an extended dtype, a PRNG key, counted as 8 a key)."""
    size = int(np.prod(aval.shape, dtype=np.int64))
    try:
        return size * np.dtype(aval.dtype).itemsize
    except TypeError:
        return size * 8


def value_bytes(value: Any) -> int:
    """The bytes of a kept value in one context: a variable's, or a scan's whole stack."""
    return value.nbytes if isinstance(value, remat.Stacked) else nbytes(value.aval)


def flops(eqn: Any) -> float:
    """The FLOPs of one equation: ``2 * out * K`` for a matrix product or convolution (``K``
    its contraction, a kernel window's size times its input features per group), else one per
    output element."""
    out = sum(int(np.prod(v.aval.shape, dtype=np.int64)) for v in eqn.outvars)
    name = eqn.primitive.name
    if name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        k = int(np.prod([eqn.invars[0].aval.shape[d] for d in lhs_contract], dtype=np.int64))
        return 2.0 * out * k
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        spec = eqn.params["dimension_numbers"].rhs_spec  # (out features, in features, *window)
        k = int(np.prod([rhs[d] for d in spec[1:]], dtype=np.int64))
        return 2.0 * out * k
    return float(out)


def seconds(eqn: Any, profile: DeviceProfile) -> float:
    """One equation's time on ``profile``: its FLOPs or its memory traffic, the longer. A
    product reads its operands and writes its output; a cheap operation is counted by what it
    writes (XLA fuses chains of them, which read their inputs once)."""
    if eqn.primitive.name in _PRODUCTS:
        traffic = sum(nbytes(v.aval) for v in (*eqn.invars, *eqn.outvars) if hasattr(v.aval, "shape"))
        return max(flops(eqn) / profile.matmul_flops, traffic / profile.memory_bytes)
    return sum(nbytes(v.aval) for v in eqn.outvars) / profile.memory_bytes


def spill_seconds(size: int, profile: DeviceProfile) -> float | None:
    """The time a store takes to move ``size`` bytes to host memory and back through its pool,
    unhidden; ``None`` where the device has no link."""
    if profile.d2h_bytes is None or profile.h2d_bytes is None:
        return None
    return size / profile.d2h_bytes + size / profile.h2d_bytes


def copy_seconds(moved: int, profile: DeviceProfile, beside: float) -> float | None:
    """The time in-program copies of ``moved`` bytes add to a step, to host memory in a forward
    whose compute beside them takes ``beside`` seconds and back in its backward (twice the
    forward's compute): each direction's copy less what hides, at most ``hidden_forward``
    (``hidden_backward``) seconds of copy per second of compute. ``None`` where the device has
    no link.

    At equal compute a copy hides by the profile's share; behind ``r`` times its time, by
    ``min(1, r * share)``. Copies that share compute (one scan body's) share what it hides."""
    d2h = profile.program_d2h
    if d2h is None or profile.h2d_bytes is None:
        return None
    out = max(0.0, moved / d2h - profile.hidden_forward * beside)
    back = max(0.0, moved / profile.h2d_bytes - profile.hidden_backward * 2.0 * beside)
    return out + back


def move_seconds(size: int, profile: DeviceProfile) -> float | None:
    """The unhidden time to move ``size`` bytes to host memory inside a forward and back inside
    a backward, each copy beside compute of its own time (the profile's shares hide), or
    ``None`` where the device has no link."""
    d2h = profile.program_d2h
    if d2h is None or profile.h2d_bytes is None:
        return None
    out = size / d2h * (1.0 - profile.hidden_forward)
    back = size / profile.h2d_bytes * (1.0 - profile.hidden_backward)
    return out + back


def placements(size: int, profile: DeviceProfile, offload: bool) -> list[Option]:
    """Where a value of ``size`` bytes may live between forward and backward: kept, spilled by
    a store (where there is a link), offloaded inside the programs (there too, if ``offload``).
    Each costs writing the value to memory in the forward and reading it in the backward (what
    recomputing it, fused into its uses, saves: on a TPU v5e a kept attention matrix costs more
    than its matrix product), then its copies: a store's, unhidden; an offload's moves ``size``
    bytes, whose time its group's compute decides (:func:`copy_seconds`)."""
    stored = 2 * size / profile.memory_bytes
    options = [Option("keep", size, stored)]
    spilled = spill_seconds(size, profile)
    if spilled is not None:
        options.append(Option("spill", 0, stored + spilled))
    if offload and profile.has_link:
        options.append(Option("offload", 0, stored, moved=size))
    return options


def relabels(eqn: Any) -> bool:
    """Whether ``eqn`` makes a value again at the cost of one pass over memory: a cheap
    operation (as ``save="auto"``), or a ``checkpoint_name`` label (an identity: the name is
    for a policy to read, and a plan is the policy)."""
    return remat.cheap(eqn) or eqn.primitive.name == _jax_internals.NAME_PRIMITIVE


def recomputable(eqn: Any) -> bool:
    """Whether the planner may run ``eqn`` again in the backward: :func:`relabels`, or a pure
    matrix product or convolution (:func:`residual_store._src.remat.cheap`'s protections)."""
    return relabels(eqn) or (eqn.primitive.name in _PRODUCTS and not remat.protected(eqn))


def recomputed_seconds(plan: remat.RematPlan, profile: DeviceProfile) -> float:
    """The time a backward spends making the residuals of ``plan`` again."""
    return sum(times * seconds(eqn, profile) for eqn, times in remat.recomputed(plan))


def _products_behind(jaxpr: Any, value: Any) -> list[Any]:
    """The products a value of ``jaxpr`` is made from through operations that only relabel or
    pass over memory (:func:`relabels`): what recomputing it runs again, in the jaxpr's order.
    Empty where something else makes it (RNG, a kernel, an input)."""
    producer = {id(o): eqn for eqn in jaxpr.eqns for o in eqn.outvars}
    found: dict[int, Any] = {}
    todo, seen = [value], set()
    while todo:
        v = todo.pop()
        eqn = producer.get(id(v))
        if eqn is None or id(v) in seen:
            continue
        seen.add(id(v))
        if eqn.primitive.name in _PRODUCTS and not remat.protected(eqn):
            found[id(eqn)] = eqn
        elif relabels(eqn):
            todo.extend(a for a in eqn.invars if not _jax_internals.is_literal(a))
    order = {id(eqn): i for i, eqn in enumerate(jaxpr.eqns)}
    return sorted(found.values(), key=lambda eqn: order[id(eqn)])


def _made_by(jaxpr: Any, value: Any) -> tuple[list[Any], int]:
    """The products recomputing a kept ``value`` runs again and how many times a backward runs
    each (a scan's iterations); none for a value of a nested scan or a scan's carry."""
    if isinstance(value, remat.Stacked):
        parts = _jax_internals.scan_parts(jaxpr.eqns[value.eqn])
        if parts is None or isinstance(value.value, remat.Stacked):
            return [], 0
        return _products_behind(parts.body, value.value), value.length
    return _products_behind(jaxpr, value), 1


def _product_seconds(eqn: Any, profile: DeviceProfile) -> float:
    if (parts := _jax_internals.scan_parts(eqn)) is not None:
        return parts.length * product_seconds(parts.body, profile)
    if (body := _jax_internals.call_body(eqn)) is not None:
        return product_seconds(body[0], profile)
    return seconds(eqn, profile) if eqn.primitive.name in _PRODUCTS else 0.0


def product_seconds(jaxpr: Any, profile: DeviceProfile) -> float:
    """The time the matrix products and convolutions of ``jaxpr`` take on ``profile`` (a scan's:
    its body's times its length; a call's: its body's): the compute a copy hides behind. (The
    cheap operations between them fuse into a few passes over memory, which a copy's own
    traffic competes with: counting them apart, as :func:`seconds` does, would put a forward of
    the benchmark's transformer at 1.7 times its measured time.)"""
    return sum(_product_seconds(eqn, profile) for eqn in jaxpr.eqns)


def _beside(jaxpr: Any, profile: DeviceProfile) -> dict[int, float]:
    """Per scan of ``jaxpr`` (its equation's index), the forward seconds of the compute its
    stacks' copies run beside, an iteration at a time, inside it (:func:`product_seconds`)."""
    return {k: _product_seconds(eqn, profile) for k, eqn in enumerate(jaxpr.eqns)
            if _jax_internals.scan_parts(eqn) is not None}


def _name(products: list[Any], value: Any, times: int) -> str:
    if not products:
        what = "carry" if isinstance(value, remat.Stacked) else "value"
        return f"{what} {getattr(value, 'aval', '')}".strip()
    file, line = _jax_internals.equation_line(products[-1])
    where = f" {file.rsplit('/', 1)[-1]}:{line}" if file is not None else ""
    more = f"+{len(products) - 1}" if len(products) > 1 else ""
    return f"{products[-1].primitive.name}{more}{where}" + (f" (x{times})" if times > 1 else "")


def candidates(plan: remat.RematPlan, profile: DeviceProfile, offload: bool = True) -> Iterator[Candidate]:
    """The computed values ``plan`` keeps (not the forward's inputs), each with its options."""
    beside = _beside(plan.jaxpr, profile)
    for value in plan.kept:
        if plan.is_input(value) is not None:
            continue
        size = value_bytes(value)
        products, times = _made_by(plan.jaxpr, value)
        options = placements(size, profile, offload)
        if products:
            options.append(Option("recompute", 0, times * sum(seconds(eqn, profile) for eqn in products)))
        group = value.eqn if isinstance(value, remat.Stacked) else None
        yield Candidate(value, _name(products, value, times), size, tuple(options), tuple(products), group,
                        0.0 if group is None else beside[group])
