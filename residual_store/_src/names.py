"""The names of residuals (``ctx.spec.names``): where each residual came from, in words.

Pure functions over what :func:`residual_store._src.origins.output_origins` found (an
``Origin``: the producing primitive, a ``checkpoint_name`` label, the user's source line, the
equation's name stack, the nearest weight feeding it) and the inputs' key paths. Names are for
people: they are not part of the signature, and they hold nothing that changes between processes
(no addresses, nothing in hash order).

An intermediate's name is

* its ``checkpoint_name`` label or else its primitive, then the user's line
  (``tanh model.py:31``: the innermost frame outside JAX and the model libraries, see
  :data:`residual_store._src._jax_internals.LIBRARY_PACKAGES`);
* then where in the model: ``in Net/Block_1/mlp`` where the library records a name stack (Flax
  linen modules, Haiku modules, ``jax.named_scope``), else ``after p.layers[1]``, the key path of
  the nearest weight that feeds it, less the parameter's own name (:func:`parameter_owner`);
* then notes in parentheses: ``inputs per iteration`` for a loop's stacked inputs, and the
  higher-order primitives it sits in (``under scan/checkpoint``).

Example:
  >>> parameter_owner("s['blocks'][0]['mlp']['kernel'].value")
  "s['blocks'][0]['mlp']"
  >>> parameter_owner("p.layers[1].weight")
  'p.layers[1]'
  >>> parameter_owner("params['w']")   # nothing would be left but the argument
  "params['w']"
  >>> module_path(("Net", "Block_1", "mlp"))
  'Net/Block_1/mlp'
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from residual_store._src.origins import Origin

__all__ = [
    "constant_name",
    "input_name",
    "module_path",
    "origin_name",
    "parameter_owner",
]

# One component of a ``jax.tree_util.keystr``: ``.attr``, ``[0]``, ``['key']`` or ``["key"]``.
_COMPONENT = re.compile(r"""\.[A-Za-z_]\w*|\[-?\d+\]|\['(?:[^'\\]|\\.)*'\]|\["(?:[^"\\]|\\.)*"\]""")
_HEAD = re.compile(r"[A-Za-z_]\w*")
_INDEX = re.compile(r"\[-?\d+\]")
# Scopes that are qualified class names (Equinox's ``eqx.nn.Linear``): they name a kind of
# layer, not which one, so they are left out of a module path.
_CLASS_SCOPE = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
# Higher-order primitives not worth a note: a jitted helper's line is already the call site's.
_QUIET_SCOPES = frozenset({"jit", "pjit", "closed_call", "core_call"})
# Primitive names as users know them (``jax.checkpoint`` binds ``remat2``).
_SCOPE_NAMES = {
    "remat2": "checkpoint",
    "remat": "checkpoint",
    "custom_vjp_call": "custom_vjp",
    "custom_jvp_call": "custom_jvp",
}


def input_name(path: str) -> str:
    """The name of a residual that is a primal input: ``"input params['w1']"``."""
    return f"input {path}"


def constant_name(index: int, copy: bool = False) -> str:
    """The name of a residual that is an array the function closes over (``copy``: a copy of
    one): ``"constant #0 (closed over)"``."""
    return f"constant #{index} (copy)" if copy else f"constant #{index} (closed over)"


def _split_path(path: str) -> tuple[str, list[str]] | None:
    head = _HEAD.match(path)
    if head is None:
        return None
    components, at = [], head.end()
    while at < len(path):
        match = _COMPONENT.match(path, at)
        if match is None:
            return None
        components.append(match.group())
        at = match.end()
    return head.group(), components


def parameter_owner(path: str) -> str:
    """The key path of what holds a parameter: ``path`` less its trailing name (an attribute or
    string key, after dropping Flax NNX's trailing ``.value``), as long as something is left
    besides the argument's name; an integer index is kept (it says which layer).

    ``"s['l1']['kernel'].value"`` -> ``"s['l1']"``, ``"p.layers[1].weight"`` -> ``"p.layers[1]"``,
    ``"params['mlp/~/linear_1']['w']"`` -> ``"params['mlp/~/linear_1']"``, ``"params['w']"`` and
    ``"ws[2]"`` unchanged. A path it cannot parse is returned unchanged.
    """
    split = _split_path(path)
    if split is None:
        return path
    head, components = split
    if len(components) > 1 and components[-1] == ".value":
        components = components[:-1]
    if len(components) > 1 and not _INDEX.fullmatch(components[-1]):
        components = components[:-1]
    return head + "".join(components)


def module_path(scopes: Sequence[str]) -> str:
    """The module path of a name stack's scopes, joined with ``/``; scopes that are qualified
    class names (``eqx.nn.Linear``) are left out. ``""`` when nothing is left."""
    return "/".join(s for s in scopes if s and not _CLASS_SCOPE.fullmatch(s))


def origin_name(origin: Origin, paths: Sequence[str], n_consts: int) -> str:
    """The name of a computed residual from its ``Origin`` (see the module docstring).

    ``paths`` are the key paths of the forward's flat inputs, which follow its ``n_consts``
    closed-over constants: ``origin.invar`` and ``origin.nearest_input`` index both together.
    """
    if origin.invar is not None and origin.primitive is None:
        i = origin.invar - n_consts
        return f"input {paths[i]} (copy)" if i >= 0 else constant_name(origin.invar, copy=True)
    base = origin.label if origin.label is not None else origin.primitive or "value"
    if origin.file is not None:
        base = f"{base} {origin.file}:{origin.line}"
    where = module_path(origin.name_stack)
    if where:
        base = f"{base} in {where}"
    elif origin.nearest_input is not None and origin.nearest_input >= n_consts:
        base = f"{base} after {parameter_owner(paths[origin.nearest_input - n_consts])}"
    scopes = [_SCOPE_NAMES.get(s, s) for s in origin.scopes if s not in _QUIET_SCOPES]
    notes = (["inputs per iteration"] if origin.per_iteration else []) + (
        [f"under {'/'.join(scopes)}"] if scopes else []
    )
    return f"{base} ({', '.join(notes)})" if notes else base
