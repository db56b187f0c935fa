"""A pytree structure known by its leaves' key paths, and by its ``PyTreeDef`` where this process
can rebuild one.

A stored backward returns gradients shaped like the differentiated arguments: a Flax NNX
``State``, an Equinox module, a dict of Haiku parameters. A process that runs it without the
model may lack those types (nothing is ever imported for stored data), so the structure is
stored twice over: as a :mod:`residual_store._src.structure` record, decoded where every node type
is a JAX container or already imported, and as the ``jax.tree_util.keystr`` of every leaf, which
always works. Gradients then come back in their original structure where the types allow, on a
template given with ``like=``, or else as a mapping from key path to array whose leaves keep the
model's leaf order: a ``collections.OrderedDict``, which JAX flattens in insertion order (a plain
``dict`` flattens in sorted key order, so ``jax.tree.leaves`` would list the gradients of an
Equinox module or a dataclass with fields out of alphabetical order in another order than its
parameters', and ``jax.tree.unflatten`` on the parameters' treedef would swap two weights of one
shape without a word).

Example:
  >>> import jax, jax.numpy as jnp
  >>> s = PathStructure.of(jax.tree.structure({"w": 0, "b": [0, 0]}))
  >>> s.paths
  ("['b'][0]", "['b'][1]", "['w']")
  >>> s.unflatten([1, 2, 3])
  {'b': [1, 2], 'w': 3}
  >>> grads = PathStructure(paths=(".w", ".b")).unflatten([1, 2])  # no treedef here
  >>> list(grads.items()), jax.tree.leaves(grads)
  ([('.w', 1), ('.b', 2)], [1, 2])
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

from residual_store._src import structure
from residual_store._src.errors import CorruptContextError, SignatureMismatchError

__all__ = ["PathStructure", "by_path", "leaf_paths"]


def leaf_paths(tree: Any, is_leaf: Any = None) -> tuple[str, ...]:
    """The ``jax.tree_util.keystr`` of every leaf of ``tree``, in flattening order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return tuple(jax.tree_util.keystr(path) for path, _ in flat)


def _first_difference(expected: Sequence[str], got: Sequence[str]) -> str:
    missing = [p for p in expected if p not in set(got)]
    extra = [p for p in got if p not in set(expected)]
    if missing or extra:
        parts = ([f"missing {missing[0]!r}"] if missing else []) + ([f"unexpected {extra[0]!r}"] if extra else [])
        return ", ".join(parts)
    i = next(i for i, (a, b) in enumerate(zip(expected, got)) if a != b)
    return f"leaf {i} is {got[i]!r}, expected {expected[i]!r}"


@dataclasses.dataclass(frozen=True)
class PathStructure:
    """A tree structure: the key path of every leaf, and its treedef when this process has one.

    Attributes:
      paths: ``jax.tree_util.keystr`` of each leaf, in flattening order.
      treedef: the ``PyTreeDef``, or ``None`` where a node type is not available here.
      missing: why ``treedef`` is ``None`` (e.g. a module this process has not imported).
      passed: key paths of ``None`` entries (leaves a split's filter passed through): a ``like``
        template may hold leaves there, and gets ``None`` back in their place.
      pending: the structure record, while it names a type this process has not imported: it
        is decoded again when the gradients are built, so an import after the backward was
        loaded still gives the original structure.
    """

    paths: tuple[str, ...]
    treedef: Any = None
    missing: str | None = None
    passed: tuple[str, ...] = ()
    pending: Any = None
    _decoded: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def resolved(self) -> Any:
        """The treedef: the one given, or the pending record's once its types are imported
        (``None`` until then)."""
        if self.treedef is not None or self.pending is None:
            return self.treedef
        if "treedef" not in self._decoded:
            try:
                treedef = structure.decode_treedef(self.pending)
            except (structure.UnresolvableError, ValueError, TypeError):
                return None
            if treedef.num_leaves != len(self.paths):
                return None
            self._decoded["treedef"] = treedef
        return self._decoded["treedef"]

    @property
    def num_leaves(self) -> int:
        return len(self.paths)

    @classmethod
    def of(cls, treedef: Any) -> PathStructure:
        """The structure of a live ``PyTreeDef``."""
        return cls(paths=leaf_paths(jax.tree.unflatten(treedef, [0] * treedef.num_leaves)), treedef=treedef)

    @classmethod
    def of_template(cls, template: Any) -> PathStructure:
        """The structure of a tree whose ``None`` entries stand for passed-through leaves."""
        nones = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_flatten_with_path(
            template, is_leaf=lambda x: x is None)[0] if x is None]
        treedef = jax.tree.structure(template)
        return dataclasses.replace(cls.of(treedef), passed=tuple(nones))

    # -- records --------------------------------------------------------------------------------

    def record(self) -> dict[str, Any]:
        """A msgpack-able record: the key paths, and the treedef's structure record when one
        describes it exactly (``"unrecorded"`` says why not)."""
        out: dict[str, Any] = {"paths": list(self.paths), "passed": list(self.passed)}
        try:
            out["tree"] = structure.encode_treedef(self.treedef)
        except structure.UnrecordableError as err:
            out["unrecorded"] = str(err)
        return out

    @classmethod
    def from_record(cls, record: Any, what: str) -> PathStructure:
        """Reads :meth:`record` output. Node types are looked up among the modules this process
        has imported (nothing is imported); one it lacks leaves ``treedef`` ``None``.

        Raises:
          CorruptContextError: the record is malformed, names an unknown kind of node, or its
            treedef does not have the recorded leaves.
        """
        if not isinstance(record, dict) or not isinstance(record.get("paths"), (list, tuple)):
            raise CorruptContextError(f"{what}: its structure record is malformed")
        paths, passed = tuple(record["paths"]), tuple(record.get("passed") or ())
        if not all(isinstance(p, str) for p in paths + passed):
            raise CorruptContextError(f"{what}: its structure record has non-text key paths")
        tree = record.get("tree")
        if tree is None:
            return cls(paths=paths, missing=str(record.get("unrecorded") or "no structure record"), passed=passed)
        tree = structure.freeze(tree)
        try:
            treedef = structure.decode_treedef(tree)
        except structure.UnresolvableError as err:
            return cls(paths=paths, missing=str(err), passed=passed, pending=tree)
        except (ValueError, TypeError) as err:
            raise CorruptContextError(f"{what}: its structure record is damaged ({err})") from None
        if treedef.num_leaves != len(paths):
            raise CorruptContextError(
                f"{what}: its structure record has {treedef.num_leaves} leaves and {len(paths)} key paths"
            )
        return cls(paths=paths, treedef=treedef, passed=passed)

    # -- flattening -----------------------------------------------------------------------------

    def on_like(self, leaves: Sequence[Any], like: Any, what: str) -> Any:
        """``leaves`` on the structure of ``like``, whose leaves must have these key paths, or
        be at a passed-through path (they come back ``None``).

        Raises:
          SignatureMismatchError: naming the first path that differs.
        """
        flat, treedef = jax.tree_util.tree_flatten_with_path(like)
        passed = set(self.passed)
        kept = [jax.tree_util.keystr(p) for p, _ in flat]
        mine = [k for k in kept if k not in passed]
        if tuple(mine) != self.paths:
            raise SignatureMismatchError(
                f"like= does not have the structure of {what}: {_first_difference(self.paths, mine)} "
                f"({len(mine)} leaves, expected {len(self.paths)})"
            )
        given = iter(leaves)
        return jax.tree.unflatten(treedef, [None if k in passed else next(given) for k in kept])

    def flatten_up_to(self, tree: Any, what: str) -> list[Any]:
        """The leaves of ``tree`` at these paths: through the treedef when there is one, else by
        matching key paths.

        Raises:
          SignatureMismatchError: ``tree`` has another structure (the message says how).
        """
        treedef = self.resolved()
        if treedef is not None:
            try:
                return treedef.flatten_up_to(tree)
            except (ValueError, TypeError) as err:
                raise SignatureMismatchError(
                    f"{what} does not match: expected {treedef}, got {jax.tree.structure(tree)} ({err})"
                ) from None
        leaves, _ = self._match(tree, f"{what} does not match")
        return leaves

    def _match(self, tree: Any, problem: str) -> tuple[list[Any], Any]:
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        got = tuple(jax.tree_util.keystr(p) for p, _ in flat)
        if got != self.paths:
            raise SignatureMismatchError(
                f"{problem}: {_first_difference(self.paths, got)} ({len(got)} leaves, expected "
                f"{len(self.paths)})"
            )
        return [leaf for _, leaf in flat], treedef

    def unflatten(self, leaves: Sequence[Any], like: Any = None, what: str = "the gradients") -> Any:
        """``leaves`` in this structure: on ``like``'s structure when given (checked path by
        path), else through the treedef, else as a key-path mapping (:func:`by_path`)."""
        if like is not None:
            return self.on_like(leaves, like, what)
        treedef = self.resolved()
        if treedef is not None:
            return jax.tree.unflatten(treedef, list(leaves))
        return by_path(self.paths, leaves)


def by_path(paths: Sequence[str], leaves: Sequence[Any]) -> collections.OrderedDict[str, Any]:
    """``{path: leaf}`` whose ``jax.tree.leaves`` are ``leaves`` in the order given.

    Invariant: ``paths`` are in the model's flattening order, so the result flattens as the
    model's own tree would and ``jax.tree.unflatten(jax.tree.structure(params), jax.tree.leaves(
    grads))`` puts every gradient on its parameter. An ``OrderedDict`` because JAX flattens it
    in insertion order; a ``dict`` would flatten in sorted key order.
    """
    if len(paths) != len(leaves):
        raise ValueError(f"{len(leaves)} leaves for {len(paths)} key paths")
    return collections.OrderedDict(zip(paths, leaves))
