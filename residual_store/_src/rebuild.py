"""A backward from a context's record: trace the forward again on the avals it records.

A context records how its forward was called (:class:`~residual_store._src.context.CallSpec`): the
split's options, the input tree and avals, the static arguments, the keywords (the traced ones'
names, the static ones' values), the caller's mesh. A split in
another process, which never ran this forward, reads that record back into abstract arguments
(:func:`inputs_of`), traces them (:func:`trace_record`; nothing runs or compiles) and checks that
the trace gives the context's signature (:func:`check_signature`) before it trusts the backward.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax
import numpy as np

from residual_store._src import placement, structure
from residual_store._src.context import ResidualSpec, computed_save, plan_fields
from residual_store._src.errors import ResidualStoreError, SignatureMismatchError
from residual_store._src.signature import is_current
from residual_store._src.trace import Keywords, Options, Traced, trace

__all__ = ["RecordedInputs", "check_signature", "inputs_of", "mismatch", "trace_record"]

_OPTIONS = ("argnums", "weight_argnums", "static_argnums", "has_aux", "save")


@dataclasses.dataclass(frozen=True)
class RecordedInputs:
    """The arguments a call record describes, with ``ShapeDtypeStruct`` leaves: the positional
    ``args``, the flat ``leaves`` of the traced tuple (the traced positional arguments, then
    the traced keywords) and its ``treedef``, the static positional values, the keywords."""

    args: tuple[Any, ...]
    leaves: tuple[Any, ...]
    treedef: Any
    statics: tuple[Any, ...]
    keywords: Keywords = Keywords()


def mismatch(opts: Options, spec: ResidualSpec, why: str) -> SignatureMismatchError:
    """The error for a context this split does not make (``why`` continues the sentence)."""
    return SignatureMismatchError(f"context signature {spec.signature} is not one {opts.label} makes{why}")


def inputs_of(opts: Options, spec: ResidualSpec) -> RecordedInputs:
    """The arguments ``spec``'s call record describes.

    Raises:
      SignatureMismatchError: the record is of another split's options, of a version without
        records, malformed, or names types this process has not imported (yet).
    """
    call = spec.call
    if not is_current(spec.signature) or call is None:
        raise mismatch(
            opts,
            spec,
            ": it was written by residual-store 0.1, whose signatures did not cover what is "
            "computed and recorded no input structure; run the forward again",
        )
    # a plan's device profile aside: a split that plans alike from another profile rebuilds it
    mine = (opts.argnums_option, opts.weight_argnums, opts.static_argnums, opts.has_aux, opts.save.record)
    theirs = (call.argnums, call.weight_argnums, call.static_argnums, call.has_aux, call.save)
    if mine[:-1] != theirs[:-1] or computed_save(mine[-1]) != computed_save(theirs[-1]):
        diff = ", ".join(f"{n}={t!r} (this split: {m!r})" for n, m, t in zip(_OPTIONS, mine, theirs) if m != t)
        raise mismatch(opts, spec, f": it was made by a split with {diff}")
    if (call.differentiated is None) != (opts.filter is None):
        made, has = ("without", "has one") if call.differentiated is None else ("with", "has none")
        raise mismatch(opts, spec, f": it was made by a split {made} a filter, and this one {has}")
    if call.in_tree is None or call.statics is None or call.static_kwargs is None:
        raise mismatch(
            opts,
            spec,
            f" from its record: its input structure could not be recorded ({call.unrecorded}); "
            "run a forward of the same shapes in this split first",
        )
    try:
        treedef = structure.decode_treedef(call.in_tree)
        statics = [(int(i), structure.decode_value(v)) for i, v in call.statics]
        keywords = Keywords(
            dynamic=tuple(str(n) for n in call.kwnames),
            static=tuple((str(n), structure.decode_value(v)) for n, v in call.static_kwargs),
        )
        leaves = [placement.abstract_input(a) for a in call.in_avals]
    except structure.UnresolvableError as err:
        raise mismatch(
            opts,
            spec,
            f" yet: its input structure names what this process lacks ({err}). Import the "
            "model's modules before running its backward",
        ) from None
    except (ValueError, TypeError, KeyError) as err:
        raise mismatch(opts, spec, f": its call record is malformed ({err})") from None
    if treedef.num_leaves != len(leaves) or [i for i, _ in statics] != list(opts.static_argnums):
        raise mismatch(opts, spec, ": its call record is malformed (leaf or static count)")
    _check_keywords(opts, spec, keywords)
    node, n_kw = treedef.node_data(), len(keywords.dynamic)
    if node is None or node[0] is not tuple or len(treedef.children()) < n_kw:
        raise mismatch(opts, spec, ": its call record is malformed (not a tuple of arguments)")
    children = list(jax.tree.unflatten(treedef, leaves))
    args = children[: len(children) - n_kw]
    for index, value in statics:
        args.insert(index, value)
    if len(args) != call.n_args:
        raise mismatch(opts, spec, ": its call record is malformed (argument count)")
    return RecordedInputs(tuple(args), tuple(leaves), treedef, tuple(v for _, v in statics), keywords)


def _check_keywords(opts: Options, spec: ResidualSpec, keywords: Keywords) -> None:
    """Raises :class:`SignatureMismatchError` unless the recorded keywords are ones this split
    would have traced (not in ``static_argnames``) or kept static (in it), each named once."""
    static_names = [n for n, _ in keywords.static]
    for names in (keywords.dynamic, tuple(static_names)):
        if list(names) != sorted(set(names)):
            raise mismatch(opts, spec, ": its call record is malformed (keyword names not sorted and unique)")
    if set(keywords.dynamic) & set(static_names):
        raise mismatch(opts, spec, ": its call record is malformed (a keyword both traced and static)")
    not_static = sorted(set(static_names) - set(opts.static_argnames))
    if not_static:
        raise mismatch(
            opts, spec, f": its keywords {not_static} were static (static_argnames), this split's "
            f"static_argnames are {list(opts.static_argnames)}"
        )
    now_static = sorted(set(keywords.dynamic) & set(opts.static_argnames))
    if now_static:
        raise mismatch(
            opts, spec, f": its keywords {now_static} were traced, and this split names them in static_argnames"
        )


def trace_record(opts: Options, spec: ResidualSpec, inputs: RecordedInputs) -> Traced:
    """Traces the split on a context's recorded inputs, under its recorded mesh.

    Raises:
      SignatureMismatchError: ``fun`` does not take these arguments, or raised tracing them.
      ResidualStoreError: the trace found a misuse of the split (as a forward would).
    """
    call = spec.call
    assert call is not None  # inputs_of checked
    try:
        with _enter_mesh(call.context_mesh):
            opts.check_arity(inputs.args, inputs.keywords)
            return trace(
                opts,
                inputs.args,
                list(inputs.leaves),
                inputs.treedef,
                inputs.statics,
                call.in_avals,
                call.context_mesh,
                call.differentiated,
                inputs.keywords,
            )
    except ResidualStoreError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever fun raises on these inputs
        raise mismatch(
            opts, spec, f": tracing it on the context's recorded inputs failed ({type(err).__name__}: {err})"
        ) from err


def check_signature(opts: Options, spec: ResidualSpec, traced: Traced) -> None:
    """Raises :class:`SignatureMismatchError` unless ``traced`` computes ``spec``'s signature
    (and its residual avals, where the spec records them)."""
    got = traced.spec.signature
    if got != spec.signature or (spec.avals and traced.spec.avals != spec.avals):
        if spec.call is not None and (hint := _profiles_differ(opts.save.record, spec.call.save)):
            raise mismatch(opts, spec, f": on the inputs the context records, this split plans otherwise{hint}")
        raise mismatch(
            opts,
            spec,
            f": on the inputs the context records, this split computes signature {got}. The "
            "context comes from another function, or from one whose code or closed-over values "
            "(weights, constants) differ in this process",
        )


def _enter_mesh(record: tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...]] | None) -> Any:
    """A context manager re-entering a recorded context mesh: concrete where this process has
    the devices, abstract otherwise."""
    if record is None:
        return contextlib.nullcontext()
    axis_names, sizes, types = record
    kinds = tuple(jax.sharding.AxisType[t] for t in types) if types else None
    n = int(np.prod(sizes))
    if len(jax.devices()) >= n:
        devices = np.array(jax.devices()[:n], dtype=object).reshape(sizes)
        return jax.set_mesh(jax.sharding.Mesh(devices, axis_names, axis_types=kinds))
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh(sizes, axis_names, axis_types=kinds))


def _profiles_differ(mine: str, theirs: str) -> str:
    """Where two plans' records differ in their device profiles alone (a profile measured in
    each process differs by the measurement's noise), why they planned otherwise and what to
    do; else nothing."""
    a, b = plan_fields(mine), plan_fields(theirs)
    if a is None or b is None:
        return ""
    ours, made = a.pop("profile", ""), b.pop("profile", "")
    if ours == made or a != b:
        return ""
    return (
        f" (the device profiles the two plans read differ: the context's {made!r}, this split's "
        f"{ours!r}): plan both with one rs.DeviceProfile, e.g. rs.plan(..., "
        "profile=rs.device_profile(cache_dir=DIR)) with DIR shared by the processes, or run the "
        "context's stored backward (rs.backward: no model needed)"
    )
