"""Process-independent text for Python values and code: what a signature hashes.

:class:`Canonicalizer` turns a value into a ``str`` that is equal in two processes exactly when
the values are equal, whatever ``PYTHONHASHSEED`` is and wherever objects sit in memory:

* sets and frozensets are written with their elements sorted by their text, dicts with their
  items sorted by key text (the iteration order of a set of strings changes with the hash seed);
* no memory address and no source location appears: a repr written as a last resort is
  scrubbed of addresses (``0x7f...``, ``id=140...``) and of file names with line numbers
  (``model.py:12``, ``File "model.py", line 12``), which move when a comment is added or a file
  is renamed while the code stays the same;
* arrays are written as dtype, shape and a digest of their bytes (typed PRNG keys: their
  implementation and key data);
* dataclasses (JAX's checkpoint policies, ``_FlatCallback``) by their type and fields, named
  tuples by their type and items, enums by type and member name;
* functions by their *code*, not their location: bytecode, names, constants (nested code
  included) and the values their closure cells and default arguments hold, so two closures over
  different constants differ while a comment or a moved line changes nothing;
* ``jax.sharding`` objects by mesh axis names, sizes and types and the partition spec (not
  device ids or the platform), and ``PyTreeDef`` by node types and their auxiliary data.

Anything else falls back to its type's qualified name and its (scrubbed) ``repr``. A hook lets
a caller write types of its own; :func:`canonicalizer` and :func:`jaxpr_text` use one to write
jaxprs, avals, primitives and JAX's wrapped functions (:func:`jaxpr_text` says what of a jaxpr
is written), telling JAX's internal types apart through ``_jax_internals.internal_kind``.

Example:
  >>> Canonicalizer().value(frozenset({"b", "a"}))
  "frozenset{s'a',s'b'}"
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import re
import types
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import xxhash

from residual_store._src import _jax_internals

__all__ = ["Canonicalizer", "array_text", "canonicalizer", "jaxpr_text", "qualified_name", "scrub"]

_HEX_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
_DECIMAL_ID = re.compile(r"\bid=\d+")  # JAX's Var reprs: id() in decimal
_SOURCE_LOCATION = re.compile(
    r"""[Ff]ile ["'][^"']*["'], line \d+"""  # tracebacks, code objects
    r"""|[^\s"'(),<>\[\]]*\.pyw?:\d+"""  # "name at /path/model.py:12" (JAX's debug info)
)
_SMALL_ARRAY = 16  # elements written out exactly; larger arrays by digest
_MAX_DEPTH = 24
_MAX_REPR = 4096

Hook = Callable[[Any, "Canonicalizer"], "str | None"]


def scrub(text: str) -> str:
    """A repr made process- and place-independent: memory addresses (``0x7f3a...`` -> ``0x?``,
    ``id=140...`` -> ``id=?``) and source locations (``model.py:12``, ``File "model.py", line
    12`` -> ``<src>``) taken out. Only for reprs: a string value is written whole."""
    text = _SOURCE_LOCATION.sub("<src>", text)
    return _DECIMAL_ID.sub("id=?", _HEX_ADDRESS.sub("0x?", text))


def qualified_name(t: Any) -> str:
    """``module.QualName`` of a type or function."""
    module = getattr(t, "__module__", None) or "?"
    name = getattr(t, "__qualname__", None) or getattr(t, "__name__", None) or type(t).__qualname__
    return f"{module}.{name}"


def _is_key_array(x: Any) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def array_text(x: Any) -> str:
    """An array's dtype, shape and content: exact for a few elements, else an xxh3-128 digest."""
    prefix = ""
    if _is_key_array(x):
        prefix = f"key[{jax.random.key_impl(x)}]"
        x = jax.random.key_data(x)
    data = np.ascontiguousarray(np.asarray(x))
    # dtype.name, not dtype.str: ml_dtypes' types (bfloat16, the float8s) all have str '<V1'/'<V2'
    head = f"{prefix}{data.dtype.name}{data.dtype.byteorder}{list(data.shape)}"
    raw = data.reshape(-1).view(np.uint8)
    if data.size <= _SMALL_ARRAY:
        return f"array({head}:{raw.tobytes().hex()})"
    return f"array({head}#{xxhash.xxh3_128_hexdigest(raw)})"


def _sharding_text(s: Any, c: Canonicalizer) -> str | None:
    """Mesh names, sizes, types and spec; not device ids (another process may number devices
    differently) nor the platform (a context written on a GPU may be resumed on a CPU)."""
    sharding = jax.sharding
    if isinstance(s, (sharding.Mesh, sharding.AbstractMesh)):
        types_ = getattr(s, "axis_types", None) or ()
        sizes = tuple(int(n) for n in (s.axis_sizes if hasattr(s, "axis_sizes") else s.devices.shape))
        names = tuple(str(n) for n in s.axis_names)
        kinds = ",".join(getattr(t, "name", str(t)) for t in types_)
        return f"mesh({names!r};{sizes!r};{kinds})"
    if isinstance(s, sharding.PartitionSpec):
        return f"P({scrub(repr(tuple(s)))};{c.value(getattr(s, 'unreduced', None))})"
    if isinstance(s, sharding.NamedSharding):
        return f"named({c.value(s.mesh)};{c.value(s.spec)};{s.memory_kind})"
    if isinstance(s, sharding.SingleDeviceSharding):
        return f"single({s.memory_kind})"
    return None


def _treedef_text(treedef: Any, c: Canonicalizer) -> str:
    """Node types and their static data, recursively (``str(treedef)`` holds addresses)."""
    node = treedef.node_data()
    if node is None:
        return "*"
    node_type, aux = node
    children = ",".join(_treedef_text(child, c) for child in treedef.children())
    return f"{qualified_name(node_type)}[{c.value(aux)}]({children})"


def _code_text(code: types.CodeType, c: Canonicalizer) -> str:
    """Bytecode, names and constants (nested code included); never file names or line numbers."""
    consts = ",".join(
        _code_text(k, c) if isinstance(k, types.CodeType) else c.value(k) for k in code.co_consts
    )
    head = repr((code.co_name, code.co_names, code.co_varnames, code.co_freevars, code.co_argcount))
    return f"code({head};{code.co_code.hex()};{consts})"


class Canonicalizer:
    """Writes values as process-independent text (see the module docstring).

    Args:
      hook: called first for every value; returns its text, or ``None`` to let the
        canonicalizer handle it (:func:`canonicalizer` writes jaxprs and avals this way).
    """

    def __init__(self, hook: Hook | None = None) -> None:
        self._hook = hook
        self._path: set[int] = set()  # ids of the containers being written (cycle guard)

    def value(self, v: Any, depth: int = 0) -> str:
        """The canonical text of ``v``."""
        if depth > _MAX_DEPTH:
            return "<deep>"
        if v is None or isinstance(v, (bool, int, float, complex)) and type(v) in _SCALARS:
            return _SCALARS[type(v)](v)
        if isinstance(v, str):
            return "s" + repr(v)
        if isinstance(v, (bytes, bytearray)):
            return "b" + bytes(v).hex()
        if self._hook is not None:
            text = self._hook(v, self)
            if text is not None:
                return text
        if id(v) in self._path:
            return "<cycle>"
        self._path.add(id(v))
        try:
            return self._compound(v, depth + 1)
        finally:
            self._path.discard(id(v))

    def _compound(self, v: Any, depth: int) -> str:
        each = functools.partial(self.value, depth=depth)
        if isinstance(v, enum.Enum):
            return f"enum {qualified_name(type(v))}.{v.name}"
        if isinstance(v, (np.ndarray, np.generic, jax.Array)):
            return array_text(v)
        if isinstance(v, np.dtype):
            return f"dtype {v}"
        if isinstance(v, type):
            return f"type {qualified_name(v)}"
        if isinstance(v, types.ModuleType):
            return f"module {v.__name__}"
        if isinstance(v, jax.tree_util.PyTreeDef):
            return f"treedef {_treedef_text(v, self)}"
        sharding = _sharding_text(v, self)
        if sharding is not None:
            return sharding
        if isinstance(v, tuple) and hasattr(type(v), "_fields"):
            return f"{qualified_name(type(v))}(" + ",".join(map(each, v)) + ")"
        if isinstance(v, (tuple, list)):
            inner = ",".join(map(each, v))
            return f"({inner})" if isinstance(v, tuple) else f"[{inner}]"
        if isinstance(v, dict):
            items = sorted((each(k), each(x)) for k, x in v.items())
            return "{" + ",".join(f"{k}:{x}" for k, x in items) + "}"
        if isinstance(v, (set, frozenset)):
            return f"{type(v).__name__}{{" + ",".join(sorted(map(each, v))) + "}"
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            fields = ",".join(f"{f.name}={each(getattr(v, f.name, None))}" for f in dataclasses.fields(v))
            return f"{qualified_name(type(v))}({fields})"
        if isinstance(v, functools.partial):
            return f"partial({each(v.func)};{each(v.args)};{each(v.keywords)})"
        if isinstance(v, types.CodeType):
            return _code_text(v, self)
        if isinstance(v, (types.FunctionType, types.MethodType)) or callable(v):
            return self._callable(v, depth)
        return f"{qualified_name(type(v))}:{scrub(repr(v))[:_MAX_REPR]}"

    def _callable(self, fn: Any, depth: int) -> str:
        """A function by its code, closure values and defaults; a bound method by its function and
        its instance; a builtin by its name; a callable object by its class's ``__call__`` and
        its state."""
        each = functools.partial(self.value, depth=depth)
        if isinstance(fn, types.MethodType):
            return f"method({each(fn.__func__)};{each(fn.__self__)})"
        wrapped = getattr(fn, "__wrapped__", None)
        if isinstance(fn, types.FunctionType):
            cells = []
            for cell in fn.__closure__ or ():
                try:
                    cells.append(each(cell.cell_contents))
                except ValueError:  # an empty cell
                    cells.append("<empty>")
            return (
                f"fn({_code_text(fn.__code__, self)};closure({','.join(cells)});"
                f"defaults({each(fn.__defaults__)};{each(fn.__kwdefaults__)})"
                + (f";wraps({each(wrapped)})" if wrapped is not None else "")
                + ")"
            )
        if isinstance(fn, (types.BuiltinFunctionType, np.ufunc)):
            return f"builtin {qualified_name(fn)}"
        state = getattr(fn, "__dict__", None)
        call = getattr(type(fn), "__call__", None)
        parts = [f"callable {qualified_name(type(fn))}"]
        if isinstance(call, types.FunctionType):
            parts.append(_code_text(call.__code__, self))
        if wrapped is not None:
            parts.append(f"wraps({each(wrapped)})")
        if isinstance(state, dict):
            parts.append(each({k: x for k, x in state.items() if not k.startswith("__")}))
        elif wrapped is None:
            parts.append(scrub(repr(fn))[:_MAX_REPR])
        return "(" + ";".join(parts) + ")"


_SCALARS: dict[type, Callable[[Any], str]] = {
    type(None): lambda v: "None",
    bool: lambda v: "T" if v else "F",
    int: lambda v: f"i{v}",
    float: lambda v: f"f{v!r}",
    complex: lambda v: f"c{v!r}",
}


# --------------------------------------------------------------------------------------------
# A process-independent text of a jaxpr (what the signature hashes)


def _aval_text(aval: Any) -> str:
    """``str(aval)`` (weak types as ``~``, explicit shardings as ``@axis``, ``JAXPR_TEXT``) plus
    the memory space where it is not the device's."""
    text = str(aval)
    space = getattr(aval, "memory_space", None)
    name = getattr(space, "name", None)
    if name is not None and name != "Device":
        text += f"<{name}>"
    return text


def _effects_text(effects: Any) -> str:
    return "{" + ",".join(sorted(qualified_name(type(e)) + ":" + scrub(repr(e)) for e in effects)) + "}"


_EQN_CONTEXT_FIELDS = (
    "compute_type",
    "threefry_partitionable",
    "cur_abstract_mesh",
    "remove_size_one_mesh_axis",
    "xla_metadata",
)


def _open_jaxpr_text(jaxpr: Any, canon: Canonicalizer) -> str:
    """One open jaxpr as text, its variables numbered in order of definition (``JAXPR_TEXT``)."""
    names: dict[Any, str] = {}
    contexts: dict[int, str] = {}  # equations mostly share a few context objects

    def context(ctx: Any) -> str:
        text = contexts.get(id(ctx))
        if text is None:
            text = contexts[id(ctx)] = ",".join(canon.value(getattr(ctx, f, None)) for f in _EQN_CONTEXT_FIELDS)
        return text

    def define(v: Any) -> str:
        if _jax_internals.is_dropped(v):
            return f"_:{_aval_text(v.aval)}"
        names[v] = f"%{len(names)}"
        return f"{names[v]}:{_aval_text(v.aval)}"

    def use(v: Any) -> str:
        if _jax_internals.is_literal(v):
            return f"lit({canon.value(np.asarray(v.val))}:{_aval_text(v.aval)})"
        return names.get(v, "%free")

    lines = [
        "const " + " ".join(define(v) for v in jaxpr.constvars),
        "in " + " ".join(define(v) for v in jaxpr.invars),
    ]
    for eqn in jaxpr.eqns:
        ins = " ".join(use(v) for v in eqn.invars)
        params = ",".join(f"{k}={canon.value(eqn.params[k])}" for k in sorted(eqn.params))
        ctx = context(eqn.ctx)
        outs = " ".join(define(v) for v in eqn.outvars)
        lines.append(f"{outs} = {eqn.primitive.name}[{params}] {ins} {_effects_text(eqn.effects)} ctx({ctx})")
    lines.append("out " + " ".join(use(v) for v in jaxpr.outvars))
    lines.append("effects " + _effects_text(jaxpr.effects))
    return "{" + "\n".join(lines) + "}"


def _jaxpr_hook(v: Any, canon: Canonicalizer) -> str | None:
    """Text for JAX's internal types inside jaxprs (``JAXPR_TEXT``); ``None`` for anything else."""
    kind = _jax_internals.internal_kind(v)
    if kind is None:
        return None
    if kind == "closed_jaxpr":
        consts = ",".join(canon.value(c) for c in v.consts)
        return f"closed({_open_jaxpr_text(v.jaxpr, canon)};consts({consts}))"
    if kind == "jaxpr":
        return _open_jaxpr_text(v, canon)
    if kind == "aval":
        return f"aval {_aval_text(v)}"
    if kind == "primitive":
        return f"primitive {v.name}"
    if kind == "extended_dtype":  # typed PRNG keys' dtypes
        return f"dtype {v}"
    if kind == "debug":  # names and source lines for messages (``DEBUG_INFO``)
        return "debug"
    # a function JAX holds with its pending transformations (``WrappedFun``)
    return f"wrapped({canon.value(v.f)};{canon.value(v.transforms)};{canon.value(v.params)})"


def canonicalizer() -> Canonicalizer:
    """A :class:`Canonicalizer` that also writes jaxprs, avals, primitives and JAX's wrapped
    functions."""
    return Canonicalizer(hook=_jaxpr_hook)


def jaxpr_text(closed_jaxpr: Any, canon: Canonicalizer | None = None) -> str:
    """The computation of a (closed) jaxpr as process-independent text (``JAXPR_TEXT``).

    Variables are numbered in order of definition, per jaxpr; every equation is written as its
    primitive, its params (sorted by name, each canonical: nested jaxprs, dtypes, shardings,
    callbacks by their code and closure values), its inputs, outputs with avals, effects and
    context (compute type, PRNG partitionability, mesh); the values of a closed jaxpr's
    constants are included. Source locations and debug names are not.
    """
    return (canon or canonicalizer()).value(closed_jaxpr)
