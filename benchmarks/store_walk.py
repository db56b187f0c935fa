"""The shape of the store's house, measured: imports inside ``residual_store/_src/store`` and one
key's steady-state trip through it.

Prints, for the checkout it runs in:

- **imports**: arrows between store modules (``from residual_store._src.store[.x] import ...`` and
  ``import ...store.x``, anywhere in a module, those under ``if TYPE_CHECKING:`` included: a type
  checker follows them as a reader does), the longest
  chain of them (levels: a module importing nothing of the store is level 1), and the import
  cycles (strongly connected groups of more than one module);
- **pass-through functions**: functions and methods whose whole body (after a docstring) is one
  ``return f(...)`` or ``f(...)`` whose arguments are only the function's own parameters (at
  least one, in any order) and constants (a room too many);
- **one key's trip** (``sys.setprofile`` on every thread, after a warm-up store): the store's
  functions entered and the modules they live in, for a ``put`` (caller's thread) and for a
  ``get`` from disk in a freshly opened store (``Store(path, host_budget=0)``, the context of a
  64x32 ``tanh`` split), and how often the store's lock is taken on that get.

Run: ``python benchmarks/store_walk.py [--json]``. Nothing is timed: the numbers are counts.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STORE = ROOT / "residual_store" / "_src" / "store"
PREFIX = "residual_store._src.store"


# -- imports -------------------------------------------------------------------------------------


def _module_name(path: Path) -> str:
    rel = path.relative_to(STORE).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([PREFIX, *parts]) if parts else PREFIX


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in ast.walk(node):
                skip.add(id(inner))
    return skip


def import_graph(type_checking: bool = True) -> dict[str, set[str]]:
    """Store module -> the store modules it imports (``type_checking``: also those imported for
    annotations only)."""
    modules = {_module_name(p): p for p in STORE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules if m != PREFIX}
    for name, path in modules.items():
        if name == PREFIX:
            continue
        tree = ast.parse(path.read_text())
        skip: set[int] = set() if type_checking else _type_checking_nodes(tree)
        package = name.rsplit(".", 1)[0] if not path.name == "__init__.py" else name
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.append(full if full in graph else base)
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                while t not in graph and "." in t and t.startswith(PREFIX):
                    t = t.rsplit(".", 1)[0]
                if t in graph and t != name:
                    graph[name].add(t)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def _levels(graph: dict[str, set[str]]) -> tuple[int, list[str]]:
    """The longest chain of imports, a cycle counted as one level (its modules joined by ``+``),
    and one such chain."""
    group_of = {m: "+".join(c) for c in _cycles(graph) for m in c}
    node = lambda m: group_of.get(m, m)
    dag: dict[str, set[str]] = {}
    for m, targets in graph.items():
        dag.setdefault(node(m), set()).update(node(t) for t in targets if node(t) != node(m))
    memo: dict[str, tuple[int, list[str]]] = {}

    def depth(v: str) -> tuple[int, list[str]]:
        if v not in memo:
            best: tuple[int, list[str]] = (1, [v])
            for w in dag.get(v, ()):
                d, chain = depth(w)
                if d + 1 > best[0]:
                    best = (d + 1, [v, *chain])
            memo[v] = best
        return memo[v]

    return max((depth(v) for v in dag), key=lambda t: t[0])


# -- pass-through functions --------------------------------------------------------------------


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = fn.args
    names = [p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]]
    if a.vararg:
        names.append(a.vararg.arg)
    if a.kwarg:
        names.append(a.kwarg.arg)
    return [n for n in names if n not in ("self", "cls")]


def _arg_names(call: ast.Call) -> list[str] | None:
    """The names the call passes (constants skipped), or ``None`` if it computes an argument."""
    out = []
    values = [a.value if isinstance(a, ast.Starred) else a for a in call.args] + [k.value for k in call.keywords]
    for value in values:
        if isinstance(value, ast.Constant):
            continue
        if not isinstance(value, ast.Name):
            return None
        out.append(value.id)
    return out


def pass_throughs() -> list[str]:
    """``module:function`` for every function whose body only forwards its arguments."""
    found = []
    for path in sorted(STORE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = list(node.body)
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]
            if len(body) != 1:
                continue
            stmt = body[0]
            call = stmt.value if isinstance(stmt, (ast.Return, ast.Expr)) else None
            if not isinstance(call, ast.Call):
                continue
            params = _params(node)
            names = _arg_names(call)
            if params and names and set(names) <= set(params):
                found.append(f"{path.relative_to(STORE)}:{node.name}")
    return found


# -- one key's trip ------------------------------------------------------------------------------


class _Walk:
    """Counts the store's functions entered, per thread, while it is on."""

    def __init__(self) -> None:
        self.calls: dict[str, list[tuple[str, str]]] = {}
        self._lock = threading.Lock()

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        filename = frame.f_code.co_filename
        if str(STORE) not in filename:
            return
        module = str(Path(filename).relative_to(STORE))
        with self._lock:
            self.calls.setdefault(threading.current_thread().name, []).append((module, frame.f_code.co_qualname))

    def __enter__(self) -> _Walk:
        threading.setprofile(self._profile)
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def _summary(calls: list[tuple[str, str]]) -> dict[str, Any]:
    # a comprehension or generator expression is a code object of its own on 3.11 (inlined from
    # 3.12 on): not a function of the store's, whatever the Python
    calls = [(m, f) for m, f in calls if not f.endswith(("<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>"))]
    modules = {m for m, _ in calls}
    lock = sum(1 for m, f in calls if f.endswith("__enter__") and m.endswith("critical.py"))
    return {"functions": len(calls), "distinct": len(set(calls)), "modules": len(modules), "lock": lock,
            "by_module": dict(Counter(m for m, _ in calls).most_common())}


def trip() -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    import residual_store as rs

    fwd = rs.split(lambda w, x: jnp.sum(jnp.tanh(x @ w)))
    w = jax.random.normal(jax.random.key(0), (64, 32))
    x = jax.random.normal(jax.random.key(1), (8, 64))
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as root:
        # a warm-up store: every first-use cost (compiles, caches, threads) paid before the walk
        with rs.Store(f"{root}/warm", host_budget=0) as warm:
            for i in range(3):
                warm.put(fwd(w, x)[1], f"k{i}")
            warm.flush()
            rs.backward(warm.get("k0"))
        with rs.Store(f"{root}/walk", host_budget=0) as store:
            store.put(fwd(w, x)[1], "warm")
            store.flush()
            _, ctx = fwd(w, x)
            with _Walk() as walk:
                store.put(ctx, "k")
            caller = threading.current_thread().name
            out["put"] = _summary(walk.calls.get(caller, []))
            out["put_other_threads"] = _summary([c for t, cs in walk.calls.items() if t != caller for c in cs])
            store.flush()
        with rs.Store(f"{root}/walk", host_budget=0) as fresh:
            fresh.get("warm")
            with _Walk() as walk:
                fresh.get("k")
            out["get"] = _summary([c for cs in walk.calls.values() for c in cs])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--no-trip", action="store_true", help="the static counts only (no JAX)")
    args = parser.parse_args()
    graph = import_graph()
    levels, chain = _levels(graph)
    result: dict[str, Any] = {
        "modules": len(graph),
        "import_arrows": sum(len(v) for v in graph.values()),
        "levels": levels,
        "longest_chain": [m.replace(PREFIX + ".", "") for m in chain],
        "cycles": [[m.removeprefix(PREFIX + ".") for m in c] for c in _cycles(graph)],
        "pass_throughs": pass_throughs(),
    }
    if not args.no_trip:
        result["trip"] = trip()
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"store modules: {result['modules']}; import arrows: {result['import_arrows']}; levels: {levels}")
    print(f"  longest chain: {' > '.join(result['longest_chain'])}")
    print(f"  cycles: {result['cycles'] or 'none'}")
    print(f"pass-through functions: {len(result['pass_throughs'])}")
    for name in result["pass_throughs"]:
        print(f"  {name}")
    if "trip" in result:
        for what in ("put", "put_other_threads", "get"):
            s = result["trip"][what]
            print(f"{what}: {s['functions']} functions entered ({s['distinct']} distinct) in {s['modules']} modules; "
                  f"lock taken {s['lock']} times")
            print("   " + ", ".join(f"{m} {n}" for m, n in s["by_module"].items()))


if __name__ == "__main__":
    main()
