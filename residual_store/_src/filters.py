"""Predicates for :func:`residual_store.split`'s ``filter``: which leaves of the differentiated
arguments get gradients.

A model is often passed whole: an Equinox model (its activation functions and flags are leaves
too), a Flax NNX ``State`` holding RNG counters, a config leaf of integers. Like
``eqx.filter_grad`` and ``nnx.grad``, a split with ``filter=rs.is_inexact`` differentiates the
floating array leaves and passes the others through; their gradients are ``None``. Under a
filter, leaves that are not arrays (Python numbers, functions, strings) are static, as under
``eqx.filter_jit``: wrapped in a :class:`StaticLeaf` node, they become part of the tree
structure (and so of the signature) instead of being traced.

Example:
  >>> import jax.numpy as jnp, residual_store as rs
  >>> fwd = rs.split(lambda p: jnp.sum(p["w"] * p["n"]), filter=rs.is_inexact)
  >>> _, ctx = fwd({"w": jnp.ones(2), "n": jnp.arange(2)})
  >>> fwd.backward(ctx)
  {'n': None, 'w': Array([0., 1.], dtype=float32)}
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["StaticLeaf", "freeze_non_arrays", "is_array", "is_inexact", "thaw"]


def is_array(leaf: Any) -> bool:
    """Whether ``leaf`` is an array (JAX or NumPy, a NumPy scalar, a tracer) or an abstract one
    (``jax.ShapeDtypeStruct``), as opposed to a Python value."""
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def is_inexact(leaf: Any) -> bool:
    """Whether ``leaf`` is an array (or ``jax.ShapeDtypeStruct``) of a floating or complex dtype:
    ``eqx.is_inexact_array`` that also accepts abstract leaves. Python numbers are not arrays."""
    return is_array(leaf) and jax.dtypes.issubdtype(leaf.dtype, np.inexact)


class StaticLeaf:
    """A pytree node with no children holding a non-array leaf as its static data, so that the
    leaf is part of the tree structure (hashed, compared, recorded) rather than traced."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"StaticLeaf({self.value!r})"


jax.tree_util.register_pytree_node(StaticLeaf, lambda s: ((), s.value), lambda value, _: StaticLeaf(value))


def _is_static(x: Any) -> bool:
    return isinstance(x, StaticLeaf)


def freeze_non_arrays(tree: Any) -> Any:
    """``tree`` with each leaf that is not an array wrapped in a :class:`StaticLeaf`."""
    return jax.tree.map(lambda x: x if is_array(x) else StaticLeaf(x), tree)


def thaw(tree: Any, replacement: Any = ...) -> Any:
    """``tree`` with each :class:`StaticLeaf` unwrapped (or replaced by ``replacement``)."""
    return jax.tree.map(lambda x: (x.value if replacement is ... else replacement) if _is_static(x) else x,
                        tree, is_leaf=_is_static)
