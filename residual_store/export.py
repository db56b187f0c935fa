"""The serialized backward: a ``jax.export`` artifact per signature, for processes without ``fun``.

A store saves, once per signature, the backward of that signature exported with ``jax.export``
over ``(residuals, cotangent) -> gradients``: the residuals as a flat list, the cotangent with the
output's pytree structure, the gradients with the differentiated arguments' structure. Both
structures travel inside the artifact (``Exported.in_tree`` / ``out_tree``), so a process that
never imported the model can validate a cotangent and return gradients of the right shape.

Exporting fails for backwards that call back into Python (``jax.pure_callback`` and friends):
their context is still stored, and a process without ``fun`` gets
:class:`~residual_store.errors.BackwardUnavailableError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jax_export

from residual_store.backward import Backward
from residual_store.errors import BackwardUnavailableError

__all__ = ["export_backward", "load_backward"]


def _plain_aval(aval: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(aval.shape), aval.dtype)


def export_backward(bwd: Backward, residual_avals: Sequence[Any]) -> bytes:
    """Serializes ``bwd`` for residuals of ``residual_avals``; raises on unexportable backwards.

    Raises:
      BackwardUnavailableError: the backward cannot be exported (host callbacks, custom pytree
        nodes without export serialization); the message says why.
    """
    out_tree, float_leaves = bwd.out_tree, bwd.float_leaves

    def exported(residuals: list[Any], cotangent: Any) -> Any:
        leaves = out_tree.flatten_up_to(cotangent)
        grads = bwd.flat_fn(residuals, [leaves[i] for i in float_leaves])
        return jax.tree.unflatten(bwd.grad_tree, grads)

    cotangent_avals = jax.tree.unflatten(out_tree, [_plain_aval(a) for a in bwd.out_avals])
    try:
        artifact = jax_export.export(jax.jit(exported))(
            [_plain_aval(a) for a in residual_avals], cotangent_avals
        )
        return bytes(artifact.serialize())
    except Exception as err:  # noqa: BLE001 - JAX raises several types; all mean "cannot export".
        raise BackwardUnavailableError(
            f"the backward of signature {bwd.signature} cannot be serialized with jax.export "
            f"({type(err).__name__}: {err}); processes without the model cannot run it"
        ) from err


def load_backward(data: bytes, signature: str) -> Backward:
    """Rebuilds a :class:`Backward` from :func:`export_backward` bytes.

    Raises:
      BackwardUnavailableError: the bytes are not an artifact this JAX can read, or it was
        exported for another platform than this process's default backend.
    """
    try:
        artifact = jax_export.deserialize(bytearray(data))
    except Exception as err:  # noqa: BLE001
        raise BackwardUnavailableError(
            f"the stored backward of signature {signature} cannot be read by jax "
            f"{jax.__version__} ({type(err).__name__}: {err})"
        ) from err
    platform = jax.default_backend()
    if platform not in artifact.platforms:
        raise BackwardUnavailableError(
            f"the stored backward of signature {signature} was exported for "
            f"{', '.join(artifact.platforms)}, and this process runs on {platform}"
        )
    args_tree = artifact.in_tree.children()[0]
    residuals_tree, out_tree = args_tree.children()
    n_res = residuals_tree.num_leaves
    out_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in artifact.in_avals[n_res:]]
    is_float = [jax.dtypes.issubdtype(a.dtype, np.inexact) for a in out_avals]

    def flat_fn(residuals: Sequence[Any], float_cts: Sequence[Any]) -> list[Any]:
        given = iter(float_cts)
        full = [next(given) if f else jnp.zeros(a.shape, a.dtype) for a, f in zip(out_avals, is_float)]
        grads = artifact.call(list(residuals), jax.tree.unflatten(out_tree, full))
        return jax.tree.leaves(grads)

    return Backward(
        signature=signature,
        flat_fn=flat_fn,
        out_tree=out_tree,
        out_avals=out_avals,
        grad_tree=artifact.out_tree,
    )
