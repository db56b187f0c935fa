"""Stored backwards: once per signature and store, the backward serialized with ``jax.export``, so
a process without the model can run ``rs.backward(store.get(key))``.

Saving runs on the store's writer thread (exporting takes a few hundred milliseconds; ``put``
returns at once). Loading checks a stored backward like data (its manifest, its checksum, that
it names its signature) and matches it to this process's platform and device count. A damaged,
unreadable or unsuitable stored backward never blocks ``get``: it is registered as a backward
that raises when run, so only ``rs.backward`` in a process without a live split of that
signature ever sees it (:class:`~residual_store.errors.CorruptContextError` for damage,
:class:`~residual_store.errors.BackwardUnavailableError` otherwise). A split in the process
(``Split.backward``, or one that traced the signature) never consults it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

import serializers
from residual_store.backward import Backward, lookup_backward, register_backward
from residual_store.errors import BackwardUnavailableError, CorruptContextError, ResidualStoreError
from residual_store.export import export_backward, load_backward
from residual_store.placement import has_explicit_axes
from residual_store.signature import is_current

if TYPE_CHECKING:
    from residual_store.store.disk import DiskTier

__all__ = ["explicit_mesh", "load", "serialize"]

_MAX_LOADED = 64
_LOADED: OrderedDict[str, Backward] = OrderedDict()  # owner of loaded backwards (the registry is weak)
_LOADED_LOCK = threading.Lock()


def explicit_mesh(residuals: Sequence[Any]) -> Any:
    """The mesh of a residual sharded over a mesh with explicit axis types, if any."""
    for x in residuals:
        sharding = getattr(x, "sharding", None)
        if has_explicit_axes(sharding):
            return sharding.mesh
    return None


def serialize(bwd: Backward, avals: Sequence[Any], mesh: Any) -> tuple[bytes, bytes]:
    """The exported backward and its manifest. A backward over residuals sharded with explicit
    axis types traces only inside their mesh: if the export fails, it is tried again under
    ``jax.set_mesh(mesh)`` (the artifact is then for that mesh's device count).

    Raises:
      BackwardUnavailableError: ``jax.export`` cannot serialize it (the message says why).
    """
    try:
        data = export_backward(bwd, avals)
    except BackwardUnavailableError:
        set_mesh = getattr(jax, "set_mesh", None)
        if mesh is None or set_mesh is None:
            raise
        with set_mesh(mesh):
            data = export_backward(bwd, avals)
    manifest = serializers.encode_manifest(
        {
            "signature": bwd.signature,
            "jax_version": jax.__version__,
            "platform": jax.default_backend(),
            "checksum": serializers.checksum(np.frombuffer(data, np.uint8)),
            "nbytes": len(data),
        },
        schema=serializers.BACKWARD_SCHEMA,
    )
    return data, manifest


def _exported_device_count(data: bytes) -> int:
    """How many devices a serialized backward was exported for (``Exported.nr_devices``).

    A backward exported for one device (the usual case: ``jax.export`` of plain avals) runs on
    sharded residuals over any number of devices too; one exported for N > 1 devices (a backward
    with sharding constraints, or traced under a mesh with explicit axis types) needs N devices.
    """
    try:
        return int(jax.export.deserialize(bytearray(data)).nr_devices)
    except Exception:  # noqa: BLE001 - load_backward already accepted these bytes
        return 1


def _refusing(signature: str, error: ResidualStoreError) -> Backward:
    """A backward of ``signature`` that raises ``error`` when run."""

    def never(residuals: Any, cotangents: Any) -> Any:
        raise error

    return Backward(
        signature=signature, flat_fn=never, out_tree=None, out_avals=(), grad_tree=None, unavailable=error
    )


def _keep(bwd: Backward) -> None:
    with _LOADED_LOCK:
        _LOADED[bwd.signature] = bwd
        _LOADED.move_to_end(bwd.signature)
        while len(_LOADED) > _MAX_LOADED:
            _LOADED.popitem(last=False)
    register_backward(bwd)


def load(disk: DiskTier, signature: str) -> bool:
    """Registers the stored backward of ``signature`` for :func:`residual_store.backward`, unless
    a backward of that signature is registered already. Returns whether one is stored. Never
    raises: a stored backward that cannot be used is registered as one that raises when run."""
    if lookup_backward(signature) is not None:
        return True
    if not is_current(signature):
        return False  # residual-store 0.1's signatures could collide: its backwards are not run
    try:
        data = disk.read_backward(signature)
    except CorruptContextError as err:
        _keep(_refusing(signature, CorruptContextError(
            f"{err}. The contexts of this signature are intact, but a process without the model "
            "cannot run their backward: run it with the split that makes them (split.backward); "
            "`residual-store gc` removes the damaged backward, and the next put of that "
            "signature saves it again"
        )))
        return True
    if data is None:
        return False
    try:
        bwd = load_backward(data, signature)
    except BackwardUnavailableError as err:
        _keep(_refusing(signature, err))
        return True
    needed = _exported_device_count(data)
    if needed > jax.device_count():
        bwd = _refusing(
            signature,
            BackwardUnavailableError(
                f"the stored backward of signature {signature} was exported for {needed} devices "
                "(its avals or sharding constraints name a mesh of that size, e.g. explicit axis "
                f"types), and this process has {jax.device_count()}: run it where that many devices "
                "exist, or make the context with rs.split in this process"
            ),
        )
    _keep(bwd)
    return True
