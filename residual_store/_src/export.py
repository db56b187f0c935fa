"""The serialized backward: a ``jax.export`` artifact per signature, for processes without ``fun``.

A store saves, once per signature, the backward of that signature exported with ``jax.export``
as a *flat* function: ``(residuals, float cotangents) -> gradient leaves``, lists of arrays in
and out. No pytree type of the model travels inside the artifact, so any pytree of parameters
(Flax NNX state, Equinox modules, Penzai parameters, custom nodes) exports; the structures of
the cotangent and of the gradients are stored beside it in the store's own safe encoding
(:class:`~residual_store._src.keypaths.PathStructure`).

It is lowered for every platform ``jax.export`` can lower it to (:data:`PLATFORMS`), so a
context written on a GPU runs backward on a CPU. A platform that fails to lower is left out and
the reason kept; exporting fails only when the current platform cannot lower it, e.g. for a
backward that calls back into Python (then the context is still stored, and a process without
``fun`` gets :class:`~residual_store._src.errors.BackwardUnavailableError` with the reason).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jax_export

from residual_store._src.backward import Backward
from residual_store._src.errors import BackwardUnavailableError, CorruptContextError
from residual_store._src.keypaths import PathStructure
from residual_store._src.scratch import pinned_sharding

__all__ = ["PLATFORMS", "SerializedBackward", "export_backward", "load_backward"]

PLATFORMS: tuple[str, ...] = ("cpu", "cuda", "rocm", "tpu")
"""The platforms a stored backward is lowered for (those it can be), besides the current one."""


@dataclasses.dataclass(frozen=True)
class SerializedBackward:
    """A serialized flat backward.

    Attributes:
      data: ``jax.export`` bytes.
      platforms: the platforms it was lowered for, the current one first.
      left_out: ``{platform: why}`` for each of :data:`PLATFORMS` it could not be lowered for.
    """

    data: bytes
    platforms: tuple[str, ...]
    left_out: dict[str, str]


def _plain_aval(aval: Any, on_host: bool = False) -> jax.ShapeDtypeStruct:
    """``aval``'s shape and dtype; in the pinned host memory of the default device where the
    forward put the residual there itself (the backward moves it to the device inside: given
    in device memory, XLA's host offloading refuses the program on a TPU)."""
    host = pinned_sharding(jax.devices()[0]) if on_host else None
    return jax.ShapeDtypeStruct(tuple(aval.shape), aval.dtype, sharding=host)


def _why(err: Exception) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:500]


def export_backward(
    bwd: Backward, residual_avals: Sequence[Any], platforms: Sequence[str] = PLATFORMS, *, on_host: Sequence[int] = ()
) -> SerializedBackward:
    """Serializes ``bwd``'s flat function for residuals of ``residual_avals`` (those at
    ``on_host`` in pinned host memory), lowered for the current platform and every other of
    ``platforms`` it lowers for.

    Raises:
      BackwardUnavailableError: the current platform cannot lower it (host callbacks and the
        like); the message says why.
    """
    fn = jax.jit(bwd.flat_fn)
    host = frozenset(on_host)
    args = ([_plain_aval(a, i in host) for i, a in enumerate(residual_avals)],
            [_plain_aval(bwd.out_avals[i]) for i in bwd.float_leaves])
    current = jax_export.default_export_platform()
    wanted = (current, *(p for p in platforms if p != current))

    def lower(chosen: Sequence[str]) -> bytes:
        return bytes(jax_export.export(fn, platforms=tuple(chosen))(*args).serialize())

    try:
        return SerializedBackward(lower(wanted), wanted, {})
    except Exception:  # noqa: BLE001 - JAX raises several types; find which platform fails.
        pass
    try:
        lower((current,))
    except Exception as err:  # noqa: BLE001
        raise BackwardUnavailableError(
            f"the backward of signature {bwd.signature} cannot be serialized with jax.export "
            f"({_why(err)}); processes without the model cannot run it"
        ) from err
    chosen, left_out = [current], {}
    for platform in wanted[1:]:
        try:
            lower((current, platform))
            chosen.append(platform)
        except Exception as err:  # noqa: BLE001
            left_out[platform] = _why(err)
    return SerializedBackward(lower(chosen), tuple(chosen), left_out)


def load_backward(
    data: bytes,
    signature: str,
    *,
    out_structure: PathStructure,
    out_avals: Sequence[jax.ShapeDtypeStruct],
    grad_structure: PathStructure,
) -> Backward:
    """Rebuilds a :class:`Backward` from :func:`export_backward` bytes and the structures stored
    beside them.

    Raises:
      BackwardUnavailableError: the bytes are not an artifact this JAX can read, or it was not
        lowered for this process's platform (the message names those it was).
      CorruptContextError: its arrays do not agree with the stored structures.
    """
    try:
        artifact = jax_export.deserialize(bytearray(data))
    except Exception as err:  # noqa: BLE001
        raise BackwardUnavailableError(
            f"the stored backward of signature {signature} cannot be read by jax "
            f"{jax.__version__} ({_why(err)})"
        ) from err
    platform = jax_export.default_export_platform()
    if platform not in artifact.platforms:
        raise BackwardUnavailableError(
            f"the stored backward of signature {signature} was lowered for "
            f"{', '.join(artifact.platforms)}, and this process runs on {platform}: run it where "
            "one of those is, or with the split that makes it"
        )
    float_avals = [a for a in out_avals if jax.dtypes.issubdtype(a.dtype, np.inexact)]
    expected = [tuple(a.shape) for a in float_avals]
    n_res = len(artifact.in_avals) - len(float_avals)
    if (
        n_res < 0
        or [tuple(a.shape) for a in artifact.in_avals[n_res:]] != expected
        or len(artifact.out_avals) != grad_structure.num_leaves
    ):
        raise CorruptContextError(
            f"the stored backward of signature {signature} does not take the cotangent or give the "
            "gradients its manifest describes: the two disagree"
        )

    def flat_fn(residuals: Sequence[Any], float_cts: Sequence[Any]) -> list[Any]:
        return list(artifact.call(list(residuals), [jnp.asarray(c) for c in float_cts]))

    return Backward(
        signature=signature,
        flat_fn=flat_fn,
        out_structure=out_structure,
        out_avals=out_avals,
        grad_structure=grad_structure,
    )
