"""The signature: a digest that names one compiled forward/backward pair in every process.

A signature is the SHA-256 (first 128 bits, hex, prefixed ``rs1-``) of a canonical byte string
made of, in order:

1. the format tag ``residual-store/signature/1``, the JAX and jaxlib versions;
2. the function's code: bytecode, names and constants of ``fun`` (following ``functools.partial``,
   ``__wrapped__`` and closures over functions), never memory addresses;
3. the traced primal jaxpr, printed, with addresses scrubbed, plus a code digest of every
   callable that its equations carry (custom_vjp rules, host callbacks);
4. the *values* of the arrays the function closes over (the jaxpr's constants), each hashed;
5. the input tree (node types and their static data, not ``str(treedef)``, which holds memory
   addresses), and per input leaf its shape, dtype, weak type and sharding (mesh axis names and
   sizes plus partition spec; not device ids);
6. the output tree, ``argnums``, ``has_aux`` and the ``repr`` of each static argument.

Two processes running the same code on inputs of the same structure and avals get the same
signature; two closures over different weights get different ones.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any

import jax
import jaxlib
import numpy as np

from residual_store import _jax_internals

__all__ = ["compute_signature", "treedef_fingerprint", "sharding_fingerprint", "array_digest"]

_FORMAT_TAG = b"residual-store/signature/1"
_HEX_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def _type_name(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def treedef_fingerprint(treedef: Any) -> str:
    """A canonical text for a ``PyTreeDef``: node types and static node data, recursively."""
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:
        return "*"
    node = treedef.node_data()
    if node is None:
        return "*" if treedef.num_leaves == 1 else "None"
    node_type, aux = node
    children = ",".join(treedef_fingerprint(c) for c in treedef.children())
    aux_text = _HEX_ADDRESS.sub("0x?", repr(aux))
    return f"{_type_name(node_type)}[{aux_text}]({children})"


def sharding_fingerprint(sharding: Any) -> str:
    """Mesh axis names/sizes and partition spec for a ``NamedSharding``; a kind name otherwise."""
    if sharding is None:
        return "none"
    if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = sharding.mesh
        axes = ",".join(f"{n}={s}" for n, s in zip(mesh.axis_names, mesh.axis_sizes))
        return f"named({axes};{sharding.spec})"
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return "single"
    return f"{type(sharding).__name__}({len(sharding.device_set)})"


def _is_key_array(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def array_digest(x: Any) -> str:
    """SHA-256 of an array's dtype, shape and bytes (typed PRNG keys: impl and key data)."""
    h = hashlib.sha256()
    if _is_key_array(x):
        h.update(str(x.dtype).encode())
        x = jax.random.key_data(x)
    data = np.ascontiguousarray(np.asarray(x))
    h.update(f"{data.dtype.str}{data.shape}".encode())
    h.update(memoryview(data).cast("B"))
    return h.hexdigest()


def compute_signature(
    *,
    fun: Any,
    closed_jaxpr: Any,
    in_tree: Any,
    in_avals: Sequence[tuple[Any, ...]],
    out_tree: Any,
    argnums: int | tuple[int, ...],
    has_aux: bool,
    statics: Sequence[tuple[int, Any]],
) -> str:
    """The signature string for one traced forward (see the module docstring for what goes in).

    ``in_avals`` holds ``(shape, dtype, weak_type, sharding)`` per input leaf.
    """
    h = hashlib.sha256()

    def add(label: str, data: bytes | str) -> None:
        data = data.encode() if isinstance(data, str) else data
        h.update(f"{label}:{len(data)}:".encode())
        h.update(data)

    add("format", _FORMAT_TAG)
    add("jax", jax.__version__)
    add("jaxlib", jaxlib.__version__)
    add("code", _jax_internals.callable_fingerprint(fun))
    add("jaxpr", _jax_internals.jaxpr_fingerprint(closed_jaxpr))
    for const in closed_jaxpr.consts:
        add("const", array_digest(const))
    add("in_tree", treedef_fingerprint(in_tree))
    for shape, dtype, weak_type, sharding in in_avals:
        add("aval", f"{tuple(shape)}|{dtype}|{bool(weak_type)}|{sharding_fingerprint(sharding)}")
    add("out_tree", treedef_fingerprint(out_tree))
    add("argnums", repr(argnums))  # an int and a 1-tuple return differently shaped gradients
    add("has_aux", repr(bool(has_aux)))
    for index, value in statics:
        add("static", f"{index}={_HEX_ADDRESS.sub('0x?', repr(value))}")
    return "rs1-" + h.hexdigest()[:32]
