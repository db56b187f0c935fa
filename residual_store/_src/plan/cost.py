"""What each choice for one residual costs on a :class:`~.profile.DeviceProfile`.

A residual the backward reads can be **kept** on the device (its bytes count against the
budget, no time), **offloaded** to host memory inside the forward and brought back inside the
backward (no device bytes between them; the copies' time less what hides behind compute), or
**recomputed** in the backward from what is kept (no bytes; the time of the operation that
made it). Only a pure operation is recomputed: never RNG, custom_vjp / custom_jvp calls, custom
calls or kernels, callbacks, collectives or ``checkpoint_name``'d values (the protections of
``save="auto"``, :func:`residual_store._src.remat.cheap`), nor a value made inside a nested
scan. An operation's time is its FLOPs at the matmul rate or the bytes it reads and writes at
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

__all__ = ["Candidate", "Choice", "Option", "candidates", "flops", "move_seconds", "nbytes", "recomputed_seconds", "seconds",
           "value_bytes"]

Choice = Literal["keep", "offload", "recompute"]

# pure operations worth recomputing beyond the cheap ones (whose cost is one pass over memory)
_PRODUCTS = frozenset({"dot_general", "conv_general_dilated"})


@dataclasses.dataclass(frozen=True)
class Option:
    """One choice for a residual: the device bytes it holds per context, and the seconds it adds
    to a step."""

    choice: Choice
    nbytes: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A value the forward keeps for its backward, with what each choice would cost.

    Attributes:
      value: the kept value (a variable of the forward's jaxpr, or a scan's
        :class:`~residual_store._src.remat.Stacked` value).
      name: where it comes from, for people (``"dot_general model.py:12 (x8)"``).
      nbytes: its bytes in one context.
      options: ``keep`` first, then ``offload`` where the device has a link, then
        ``recompute`` where the operation that makes it may run again.
      producer: that operation (a jaxpr equation), or ``None``.
    """

    value: Any
    name: str
    nbytes: int
    options: tuple[Option, ...]
    producer: Any = dataclasses.field(default=None, compare=False)


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
    """One equation's time on ``profile``: its FLOPs or its memory traffic, the longer."""
    traffic = sum(nbytes(v.aval) for v in (*eqn.invars, *eqn.outvars) if hasattr(v.aval, "shape"))
    rate = profile.matmul_flops if eqn.primitive.name in _PRODUCTS else profile.memory_bytes
    return max(flops(eqn) / rate, traffic / profile.memory_bytes)


def move_seconds(size: int, profile: DeviceProfile) -> float | None:
    """The unhidden time to move ``size`` bytes to host memory in a forward and back in a
    backward, or ``None`` where the device has no link."""
    if profile.d2h_bytes is None or profile.h2d_bytes is None:
        return None
    out = size / profile.d2h_bytes * (1.0 - profile.hidden_forward)
    back = size / profile.h2d_bytes * (1.0 - profile.hidden_backward)
    return out + back


def recomputable(eqn: Any) -> bool:
    """Whether the planner may run ``eqn`` again in the backward: cheap (as ``save="auto"``), or
    a matrix product or convolution, and pure (:func:`residual_store._src.remat.cheap`'s
    protections)."""
    return remat.cheap(eqn) or (eqn.primitive.name in _PRODUCTS and not remat.protected(eqn))


def recomputed_seconds(plan: remat.RematPlan, profile: DeviceProfile) -> float:
    """The time a backward spends making the residuals of ``plan`` again."""
    return sum(times * seconds(eqn, profile) for eqn, times in remat.recomputed(plan))


def _made_by(jaxpr: Any, value: Any) -> tuple[Any, int]:
    """The equation that makes a kept ``value`` and how many times a forward runs it (a scan's
    iterations); ``(None, 0)`` for a value of a nested scan or a scan's carry."""
    if isinstance(value, remat.Stacked):
        parts = _jax_internals.scan_parts(jaxpr.eqns[value.eqn])
        if parts is None or isinstance(value.value, remat.Stacked):
            return None, 0
        eqn, _ = _made_by(parts.body, value.value)
        return eqn, value.length
    for eqn in jaxpr.eqns:
        if any(o is value for o in eqn.outvars):
            return eqn, 1
    return None, 0


def _name(eqn: Any, value: Any, times: int) -> str:
    if eqn is None:
        what = "carry" if isinstance(value, remat.Stacked) else "value"
        return f"{what} {getattr(value, 'aval', '')}".strip()
    file, line = _jax_internals.equation_line(eqn)
    where = f" {file.rsplit('/', 1)[-1]}:{line}" if file is not None else ""
    return f"{eqn.primitive.name}{where}" + (f" (x{times})" if times > 1 else "")


def candidates(plan: remat.RematPlan, profile: DeviceProfile, offload: bool = True) -> Iterator[Candidate]:
    """The computed values ``plan`` keeps (not the forward's inputs), each with its options."""
    for value in plan.kept:
        if plan.is_input(value) is not None:
            continue
        size = value_bytes(value)
        eqn, times = _made_by(plan.jaxpr, value)
        options = [Option("keep", size, 0.0)]
        moved = move_seconds(size, profile) if offload else None
        if moved is not None:
            options.append(Option("offload", 0, moved))
        if eqn is not None and recomputable(eqn):
            options.append(Option("recompute", 0, times * seconds(eqn, profile)))
        yield Candidate(value, _name(eqn, value, times), size, tuple(options), eqn)
