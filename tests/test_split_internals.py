"""The split side's internal modules, tested directly: ``SaveChoice`` (the ``save`` option
parsed once), ``trace.trace`` (one call -> a frozen record) and ``rebuild`` (a context's
record read back into abstract inputs, traced and checked)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import residual_store as rs
from residual_store._src import rebuild, remat, trace
from residual_store._src.context import check_save_record


def _stage(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


def _args():
    return jnp.ones((3, 2)), jnp.ones((4, 3))


@pytest.mark.parametrize(
    ("save", "record", "recomputes"),
    [("all", "all", False), ("auto", "auto", True), (jax.checkpoint_policies.dots_saveable, "policy:", True)],
)
def test_save_is_parsed_once_into_its_record_and_what_it_recomputes(save, record, recomputes):
    choice = remat.SaveChoice.parse(save)
    assert choice.record.startswith(record) and (choice.recomputable is not None) == recomputes
    assert check_save_record(choice.record) == choice.record  # what a split records, a manifest may hold
    with pytest.raises(dataclasses.FrozenInstanceError):
        choice.record = "all"


def test_a_save_that_is_no_choice_is_refused_where_it_is_given_and_where_it_is_read():
    with pytest.raises(rs.InvalidArgumentError, match="save must be one of 'all', 'auto'"):
        remat.SaveChoice.parse("some")
    with pytest.raises(ValueError, match="save must be"):
        check_save_record("some")


def test_a_trace_is_a_frozen_record_of_the_signature_a_call_makes():
    fwd = rs.split(_stage)
    args = _args()
    leaves, treedef = jax.tree.flatten(args)
    traced = trace.trace(fwd._opts, args, leaves, treedef, (), None, None)
    _, ctx = fwd(*args)
    assert traced.spec == ctx.spec and traced.parts.spec == ctx.spec
    assert len(traced.slots) == len(ctx.spec.avals)
    with pytest.raises(dataclasses.FrozenInstanceError):
        traced.spec = None


def test_a_record_is_read_back_into_abstract_inputs_that_trace_to_its_signature():
    fwd = rs.split(_stage)
    _, ctx = fwd(*_args())
    other = rs.split(_stage)
    inputs = rebuild.inputs_of(other._opts, ctx.spec)
    assert [(x.shape, x.dtype) for x in inputs.leaves] == [((3, 2), jnp.float32), ((4, 3), jnp.float32)]
    traced = rebuild.trace_record(other._opts, ctx.spec, inputs)
    rebuild.check_signature(other._opts, ctx.spec, traced)  # no error: the same signature
    auto = rs.split(_stage, save="auto")
    with pytest.raises(rs.SignatureMismatchError, match="save='all' \\(this split: 'auto'\\)"):
        rebuild.inputs_of(auto._opts, ctx.spec)
