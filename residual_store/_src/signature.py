"""The signature: a digest of what a split computes, the same in every process.

A signature is ``"rs2-"`` and the first 128 bits (hex) of the SHA-256 of a canonical text
(:mod:`residual_store._src.canonical`) made of, in order:

1. the format tag ``residual-store/signature/2``, the JAX and jaxlib versions;
2. the call: the number of positional arguments, ``argnums`` (an ``int`` and a 1-tuple return
   differently shaped gradients), ``weight_argnums``, ``has_aux``, the ``save`` choice (a plan's
   options; not the device profile it read, which only decides the plan, and the plan is in the
   jaxprs below), the static arguments' positions
   and values, the names of the traced keyword arguments and the static ones' names and values
   (both only where a call passes keywords, so that the signatures of calls without them stay
   what they were), the abstract mesh the forward was traced under;
3. the input tree (node types and their static data) and per input leaf its shape, dtype, weak
   type, placement (mesh axis names, sizes and types and the partition spec of a
   ``NamedSharding``, or a single device; not device ids) and memory kind; the output and aux
   trees;
4. the **forward computation**: the jaxpr of the forward executable (``fun`` evaluated under
   ``jax.vjp``, returning the outputs and the residuals it computes), its constants' values, and
   which residuals are inputs or closed-over constants rather than computed;
5. the **backward computation**: the jaxpr of the backward over the residual avals and the
   cotangent, with its constants' values.

Jaxprs are written by ``canonical.jaxpr_text``: primitives, params (nested jaxprs, remat
policies, dtypes, shardings, host callbacks by their code and closure values), variables
numbered in order, literal values, effects; never memory addresses, source locations or
set/dict iteration order. ``custom_vjp``/``custom_jvp`` rules are traced into these jaxprs, so
their code and the values they close over are covered. Two functions whose forward or backward
differ get different signatures; the same computation gets the same one in every process.

Contexts written by residual-store 0.1 carry ``rs1-`` signatures, which hashed code rather than
computations and could name two different functions: they can be read, but their stored
backward is never run (see ``docs/concepts.md``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import jax
import jaxlib

from residual_store._src.canonical import canonicalizer, jaxpr_text
from residual_store._src.context import CallSpec, computed_save

__all__ = ["SIGNATURE_PREFIX", "compute_signature", "is_current"]

SIGNATURE_PREFIX = "rs2-"
_FORMAT_TAG = "residual-store/signature/2"


def is_current(signature: str) -> bool:
    """Whether ``signature`` is of the format this version computes."""
    return signature.startswith(SIGNATURE_PREFIX)


def compute_signature(
    *,
    call: CallSpec,
    in_tree: Any,
    statics: Sequence[tuple[int, Any]],
    static_kwargs: Sequence[tuple[str, Any]] = (),
    out_tree: Any,
    aux_tree: Any | None,
    forward: Any,
    forward_consts: Sequence[Any],
    slots: Sequence[tuple[int, int]],
    backward: Any,
) -> str:
    """The signature of one traced forward/backward pair (see the module docstring).

    Args:
      call: the call record (options, input avals and placements, the context mesh).
      in_tree, statics: the input structure and the static arguments' ``(position, value)``.
      static_kwargs: the static keyword arguments' ``(name, value)``, sorted by name (the
        traced keywords' names are ``call.kwnames``, their structure part of ``in_tree``).
      out_tree, aux_tree: the output's structure and the aux output's (``None`` without aux).
      forward: the forward executable's closed jaxpr; ``forward_consts`` the values passed as
        its leading arguments (the arrays ``fun`` closes over).
      slots: per residual ``(source, index)``: a constant, an input or a computed output.
      backward: the backward's closed jaxpr.
    """
    canon = canonicalizer()
    h = hashlib.sha256()

    def add(label: str, text: str) -> None:
        data = text.encode()
        h.update(f"{label}:{len(data)}:".encode())
        h.update(data)

    add("format", _FORMAT_TAG)
    add("jax", jax.__version__)
    add("jaxlib", jaxlib.__version__)
    add("n_args", str(call.n_args))
    add("argnums", repr(call.argnums))
    add("weight_argnums", repr(call.weight_argnums))
    add("has_aux", repr(call.has_aux))
    if call.differentiated is not None:
        add("differentiated", repr(call.differentiated))
    if call.save != "all":  # "all" adds nothing: the signatures of before stay
        add("save", computed_save(call.save))
    for index, value in statics:
        add("static", f"{index}={canon.value(value)}")
    if call.kwnames:
        add("kwnames", repr(tuple(call.kwnames)))
    for name, value in static_kwargs:
        add("static_kw", f"{name!r}={canon.value(value)}")
    add("context_mesh", repr(call.context_mesh))
    add("in_tree", canon.value(in_tree))
    for a in call.in_avals:
        add("in_aval", f"{a.shape}|{a.dtype}|{a.weak_type}|{a.placement}|{a.memory_kind}")
    add("out_tree", canon.value(out_tree))
    add("aux_tree", canon.value(aux_tree))
    add("forward", jaxpr_text(forward, canon))
    for const in forward_consts:
        add("forward_const", canon.value(const))
    add("slots", repr(tuple(slots)))
    add("backward", jaxpr_text(backward, canon))
    return SIGNATURE_PREFIX + h.hexdigest()[:32]


_LATER_TAG = "residual-store/later/1"


def later_signature(*, parent: str, now: Sequence[int], avals: Sequence[Any], weight_half: Any) -> str:
    """The signature of the ``later`` context of a B/W split: a digest of the parent signature
    (which covers the whole forward and backward), the arguments B differentiated (``now``), the
    avals of what ``later`` holds and the jaxpr of the W half that runs on it."""
    canon = canonicalizer()
    h = hashlib.sha256()
    for label, text in (
        ("format", _LATER_TAG),
        ("parent", parent),
        ("now", repr(tuple(now))),
        *(("aval", f"{tuple(a.shape)}|{a.dtype}") for a in avals),
        ("weight_half", jaxpr_text(weight_half, canon)),
    ):
        data = text.encode()
        h.update(f"{label}:{len(data)}:".encode())
        h.update(data)
    return SIGNATURE_PREFIX + h.hexdigest()[:32]
