"""Input structures as plain records: a ``PyTreeDef`` and static argument values written as nested
tuples of scalars (msgpack-able once tuples become lists, and hashable), read back with only what
this process has already imported.

Why: a split in a new process rebuilds the backward of a stored context from its avals alone
(:meth:`residual_store.Split.backward`), and needs the structure of the arguments the forward was
called with: a dict of arrays, a Flax NNX ``State``, an Equinox module, a frozen config passed
as a static argument.

Reading a record never imports a module and never calls a function the record names: node types,
functions, enums and sentinels are looked up by module and qualified name among the modules in
``sys.modules`` (their attributes read with ``vars``, so no module ``__getattr__`` runs either),
dataclasses and named tuples are rebuilt field by field without calling ``__init__``. A record
holds only values that round-trip exactly; :func:`encode_treedef` and :func:`encode_value` raise
:class:`UnrecordableError` for anything else (an array, a lambda, an object of a class defined
inside a function), and the caller records that the structure is unavailable.

Grammar (every non-scalar is a tuple whose first item is its tag)::

    treedef := ("*",) | ("none",) | ("node", typeref, value, (treedef, ...))
    typeref := (module, qualname)
    value   := None | bool | int | float | str
             | ("int", digits)              ints outside int64
             | ("bytes", bytes)
             | ("tuple" | "list" | "set" | "frozenset", (value, ...))
             | ("dict" | "odict", ((value, value), ...))   dict, collections.OrderedDict
             | ("ref", module, qualname)    a module-level object, e.g. jax.nn.relu or a sentinel
             | ("enum", module, qualname, member)
             | ("dtype", name)
             | ("npscalar", dtype name, bytes)
             | ("namedtuple", module, qualname, (value, ...))
             | ("dataclass", module, qualname, ((field, value), ...))
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import sys
import types
from typing import Any

import jax
import numpy as np

__all__ = [
    "UnrecordableError",
    "UnresolvableError",
    "decode_treedef",
    "decode_value",
    "encode_treedef",
    "encode_value",
    "freeze",
]

_INT64 = (-(2**63), 2**63 - 1)
_MAX_DEPTH = 64


class UnrecordableError(ValueError):
    """A structure or value that no record describes exactly (the message says which part)."""


class UnresolvableError(ValueError):
    """A record names a module this process has not imported, or a name it does not define."""


# ----------------------------------------------------------------------------------------------
# Names of module-level objects


def _lookup(module: str, qualname: str) -> Any:
    """The object ``module.qualname`` among already-imported modules, without running any code."""
    if not isinstance(module, str) or not isinstance(qualname, str):
        raise UnresolvableError(f"invalid name {module!r}.{qualname!r}")
    obj: Any = sys.modules.get(module)
    if obj is None:
        raise UnresolvableError(f"module {module!r} is not imported in this process")
    for part in qualname.split("."):
        if not part.isidentifier() or part.startswith("__"):
            raise UnresolvableError(f"{module}.{qualname} is not a module-level name")
        namespace = vars(obj) if hasattr(obj, "__dict__") else {}
        if part not in namespace:
            raise UnresolvableError(f"{module} defines no {qualname}")
        obj = namespace[part]
    return obj


def _typeref(t: Any) -> tuple[str, str]:
    module, qualname = getattr(t, "__module__", None), getattr(t, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        raise UnrecordableError(f"{t!r} has no module and qualified name")
    try:
        found = _lookup(module, qualname)
    except UnresolvableError:
        found = None
    if found is not t:
        raise UnrecordableError(
            f"{module}.{qualname} is not reachable by name (defined inside a function, or renamed)"
        )
    return module, qualname


def _sentinel_ref(obj: Any) -> tuple[str, str]:
    """A module attribute that *is* ``obj`` (an instance such as Equinox's ``MISSING``), searched in
    the module of its type."""
    module = getattr(type(obj), "__module__", None)
    namespace = vars(sys.modules[module]) if isinstance(module, str) and module in sys.modules else {}
    for name, value in namespace.items():
        if value is obj and name.isidentifier():
            return module, name  # type: ignore[return-value]
    raise UnrecordableError(f"a {type(obj).__qualname__} value ({obj!r:.80}) is not a module-level name")


# ----------------------------------------------------------------------------------------------
# Values


def encode_value(v: Any, depth: int = 0) -> Any:
    """The record of ``v`` (see the module docstring); raises :class:`UnrecordableError`."""
    if depth > _MAX_DEPTH:
        raise UnrecordableError("value nested too deeply")
    if v is None or type(v) in (bool, float, str):
        return v
    if type(v) is int:
        return v if _INT64[0] <= v <= _INT64[1] else ("int", str(v))
    if type(v) is bytes:
        return ("bytes", v)

    def each(x: Any) -> Any:
        return encode_value(x, depth + 1)

    if isinstance(v, enum.Enum):
        return ("enum", *_typeref(type(v)), v.name)
    if isinstance(v, np.dtype):
        return ("dtype", str(v))
    if isinstance(v, np.generic):
        return ("npscalar", str(v.dtype), v.tobytes())
    if isinstance(v, tuple) and hasattr(type(v), "_fields"):
        return ("namedtuple", *_typeref(type(v)), tuple(map(each, v)))
    if type(v) in (tuple, list, set, frozenset):
        items = tuple(map(each, v))
        if isinstance(v, (set, frozenset)):
            items = tuple(sorted(items, key=repr))
        return (type(v).__name__, items)
    if type(v) in (dict, collections.OrderedDict):
        tag = "dict" if type(v) is dict else "odict"
        return (tag, tuple((each(k), each(x)) for k, x in v.items()))
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        fields = tuple((f.name, each(getattr(v, f.name))) for f in dataclasses.fields(v))
        return ("dataclass", *_typeref(type(v)), fields)
    if isinstance(v, (type, types.FunctionType, types.BuiltinFunctionType)) or callable(v):
        try:
            return ("ref", *_typeref(v))
        except UnrecordableError:
            pass
    if isinstance(v, (np.ndarray, jax.Array)):
        raise UnrecordableError(f"an array of shape {tuple(v.shape)} (make it a non-static argument)")
    return ("ref", *_sentinel_ref(v))


def _dataclass(cls: Any, fields: Any) -> Any:
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise UnresolvableError(f"{cls!r} is not a dataclass")
    names = [f.name for f in dataclasses.fields(cls)]
    given = [name for name, _ in fields]
    if given != names:
        raise UnresolvableError(f"{cls.__qualname__} has fields {names}, the record {given}")
    obj = object.__new__(cls)
    for name, value in fields:
        object.__setattr__(obj, name, decode_value(value))
    return obj


def decode_value(r: Any) -> Any:
    """The value a record describes; raises :class:`UnresolvableError` (a name this process lacks)
    or ``ValueError`` (a malformed record)."""
    if r is None or type(r) in (bool, int, float, str):
        return r
    if not (isinstance(r, tuple) and r and isinstance(r[0], str)):
        raise ValueError(f"malformed value record {r!r:.80}")
    tag, args = r[0], r[1:]
    try:
        if tag == "int":
            return int(args[0])
        if tag == "bytes":
            return bytes(args[0])
        if tag in ("tuple", "list", "set", "frozenset"):
            return {"tuple": tuple, "list": list, "set": set, "frozenset": frozenset}[tag](
                decode_value(x) for x in args[0]
            )
        if tag in ("dict", "odict"):
            items = ((decode_value(k), decode_value(x)) for k, x in args[0])
            return dict(items) if tag == "dict" else collections.OrderedDict(items)
        if tag == "dtype":
            return np.dtype(jax.numpy.dtype(args[0]))
        if tag == "npscalar":
            dtype = jax.numpy.dtype(args[0])
            return np.frombuffer(bytes(args[1]), dtype=dtype)[0]
        if tag == "ref":
            return _lookup(args[0], args[1])
        if tag == "enum":
            cls = _lookup(args[0], args[1])
            if not (isinstance(cls, type) and issubclass(cls, enum.Enum)):
                raise UnresolvableError(f"{args[0]}.{args[1]} is not an enum")
            return cls.__members__[args[2]]
        if tag == "namedtuple":
            cls = _lookup(args[0], args[1])
            if not (isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")):
                raise UnresolvableError(f"{args[0]}.{args[1]} is not a named tuple")
            return tuple.__new__(cls, [decode_value(x) for x in args[2]])
        if tag == "dataclass":
            return _dataclass(_lookup(args[0], args[1]), args[2])
    except (IndexError, KeyError, TypeError) as err:
        raise ValueError(f"malformed {tag!r} record ({type(err).__name__}: {err})") from None
    raise ValueError(f"unknown value record tag {tag!r}")


# ----------------------------------------------------------------------------------------------
# Tree structures


def encode_treedef(treedef: Any, depth: int = 0) -> Any:
    """The record of a ``PyTreeDef``; raises :class:`UnrecordableError`."""
    if depth > _MAX_DEPTH:
        raise UnrecordableError("tree nested too deeply")
    node = treedef.node_data()
    if node is None:
        return ("*",)
    node_type, aux = node
    if node_type is type(None):
        return ("none",)
    try:
        aux_record = encode_value(aux)
    except UnrecordableError as err:
        raise UnrecordableError(f"a {node_type.__qualname__} node's static data holds {err}") from None
    children = tuple(encode_treedef(c, depth + 1) for c in treedef.children())
    return ("node", _typeref(node_type), aux_record, children)


def decode_treedef(r: Any) -> Any:
    """The ``PyTreeDef`` a record describes; raises :class:`UnresolvableError` or ``ValueError``."""
    if not (isinstance(r, tuple) and r and isinstance(r[0], str)):
        raise ValueError(f"malformed tree record {r!r:.80}")
    if r == ("*",):
        return jax.tree.structure(0)
    if r == ("none",):
        return jax.tree.structure(None)
    if r[0] != "node" or len(r) != 4 or not isinstance(r[1], tuple) or len(r[1]) != 2:
        raise ValueError(f"malformed tree record {r!r:.80}")
    node_type = _lookup(*r[1])
    if not isinstance(node_type, type):
        raise UnresolvableError(f"{r[1][0]}.{r[1][1]} is not a type")
    aux = decode_value(r[2])
    children = [decode_treedef(c) for c in r[3]]
    try:
        return jax.tree_util.PyTreeDef.from_node_data_and_children(
            jax.tree_util.default_registry, (node_type, aux), children
        )
    except (TypeError, ValueError, RuntimeError) as err:
        raise UnresolvableError(
            f"{node_type.__module__}.{node_type.__qualname__} is not a pytree node type in this "
            f"process, or its record does not fit it ({err})"
        ) from None


def freeze(x: Any) -> Any:
    """A record read back from msgpack (lists for tuples) as the tuples it was written as."""
    if isinstance(x, list):
        return tuple([freeze(v) if isinstance(v, list) else v for v in x])  # a manifest holds many
    return x
