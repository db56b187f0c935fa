"""Input structures as records: exact round trips for the trees of real model libraries, clear
refusals for what no record describes, and hostile records that never import or call anything."""

from __future__ import annotations

import collections
import dataclasses
import enum
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual_store as rs
from libraries import MAKERS
from residual_store._src import structure

Point = collections.namedtuple("Point", "x y")


class Mode(enum.Enum):
    TRAIN = "train"
    EVAL = "eval"


@dataclasses.dataclass(frozen=True)
class Config:
    width: int = 8
    mode: Mode = Mode.TRAIN
    activation: object = jax.nn.gelu
    names: frozenset = frozenset({"b", "a"})
    dtype: object = np.dtype("float32")


def _round_trip_tree(tree):
    td = jax.tree.structure(tree)
    record = structure.encode_treedef(td)
    hash(record)  # records are hashable: they live in a ResidualSpec, a pytree's aux data
    assert structure.decode_treedef(structure.freeze(_as_msgpack(record))) == td


def _as_msgpack(record):
    """What a manifest gives back: tuples as lists."""
    import msgpack

    return msgpack.unpackb(msgpack.packb(record, use_bin_type=True), raw=False)


@pytest.mark.parametrize("library", sorted(MAKERS))
def test_internals_parameter_trees_of_every_library_round_trip(library):
    _, params = MAKERS[library]()
    _round_trip_tree(params)


def test_internals_builtin_and_named_nodes_round_trip():
    _round_trip_tree({"a": [1, (2, None)], "b": Point(1, 2), "c": collections.OrderedDict(z=1, a=2)})
    _round_trip_tree(collections.defaultdict(list, {"k": 1}))
    _round_trip_tree(())


def test_internals_static_values_round_trip_without_calling_constructors(monkeypatch):
    value = (Config(), Point(1, "two"), 2**80, b"raw", np.float32(1.5), jnp.bfloat16, None, 3.25, Mode.EVAL,
             collections.OrderedDict(b=1, a=("x", 2)))  # OrderedDict: e.g. Penzai's NamedArray axes
    record = structure.encode_value(value)
    calls = []
    monkeypatch.setattr(Config, "__post_init__", lambda self: calls.append(self), raising=False)
    back = structure.decode_value(structure.freeze(_as_msgpack(record)))
    assert back == value and calls == []  # rebuilt field by field, no __init__ ran
    assert back[0].activation is jax.nn.gelu and back[-2] is Mode.EVAL
    assert type(back[-1]) is collections.OrderedDict and list(back[-1]) == ["b", "a"]


@pytest.mark.parametrize(
    "value, message",
    [
        (lambda x: x, "not a module-level name"),
        (jnp.ones(3), "an array"),
        ({"f": object()}, "not a module-level name"),
    ],
)
def test_internals_what_no_record_describes_is_refused_by_name(value, message):
    with pytest.raises(structure.UnrecordableError, match=message):
        structure.encode_value(value)


def test_internals_a_class_defined_inside_a_function_is_unrecordable():
    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Local:
        w: jax.Array

    with pytest.raises(structure.UnrecordableError, match="not reachable by name"):
        structure.encode_treedef(jax.tree.structure(Local(jnp.ones(2))))


@pytest.mark.parametrize(
    "record, message",
    [
        (("node", ("not_imported_module_xyz", "Thing"), None, ()), "is not imported"),
        (("node", ("os", "system"), None, ()), "is not a type"),
        (("node", ("builtins", "type"), None, ()), "is not a pytree node type"),
        (("node", ("os", "path.__class__"), None, ()), "not a module-level name"),
    ],
)
def test_internals_hostile_tree_records_are_refused(record, message):
    before = set(sys.modules)
    with pytest.raises(structure.UnresolvableError, match=message):
        structure.decode_treedef(record)
    assert set(sys.modules) == before  # nothing imported


@pytest.mark.parametrize(
    "record",
    [
        ("dataclass", "subprocess", "Popen", (("args", "echo"),)),  # not a dataclass: never called
        ("namedtuple", "os", "system", ()),
        ("enum", "os", "system", "x"),
        ("ref", "importlib", "nonexistent"),
    ],
)
def test_internals_hostile_value_records_never_call_anything(record):
    with pytest.raises(structure.UnresolvableError):
        structure.decode_value(record)


@pytest.mark.parametrize("record", [("nope", 1), (1, 2), ["list"], ("tuple",), ("int", "x1")])
def test_internals_malformed_records_are_value_errors(record):
    with pytest.raises(ValueError):
        structure.decode_value(record)


@pytest.mark.slow
def test_importing_the_model_later_lets_the_split_rebuild(rng):
    """A record naming a module this process has not imported fails with the reason, is not
    remembered as a mismatch, and works once the module is there."""
    module = types.ModuleType("late_model_module")

    @jax.tree_util.register_pytree_node_class
    class Params:
        def __init__(self, w):
            self.w = w

        def tree_flatten(self):
            return (self.w,), None

        @classmethod
        def tree_unflatten(cls, aux, children):
            return cls(*children)

    Params.__module__, Params.__qualname__ = module.__name__, "Params"
    module.Params = Params
    sys.modules[module.__name__] = module
    loss = lambda p, x: jnp.sum(jnp.tanh(x @ p.w) ** 2)
    w, x = jax.random.normal(rng, (4, 3)), jax.random.normal(jax.random.fold_in(rng, 1), (2, 4))
    _, ctx = rs.split(loss)(Params(w), x)
    fresh = rs.split(loss)
    del sys.modules[module.__name__]
    try:
        with pytest.raises(rs.SignatureMismatchError, match="late_model_module' is not imported.*Import the model"):
            fresh.backward(ctx)
    finally:
        sys.modules[module.__name__] = module
    try:
        np.testing.assert_allclose(fresh.backward(ctx).w, jax.grad(loss)(Params(w), x).w, rtol=1e-5, atol=1e-6)
        assert fresh.cache_info().forward_compiles == 0
    finally:
        del sys.modules[module.__name__]
