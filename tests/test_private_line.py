"""The private line, as Optax, Orbax and JAX draw it: residual-store's internals live under
``residual_store/_src/``; the package shows its public modules only; a test that reaches past
the public face says so in its name.

A test of internals is one that uses a name imported from ``residual_store._src`` (directly, or
through a helper, fixture or constant of its module that does) or spells that module in code it
runs elsewhere (a subprocess's script). Its name has ``internals`` in it, or its module's does
(``test_jax_internals.py``): ``pytest -k "not internals"`` runs what holds whatever the layout.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "residual_store"
TESTS = ROOT / "tests"
INTERNAL = "residual_store._src"

# The package's face: the public API (``__init__``), ``python -m residual_store``, the command
# line, the README's demo, contexts in Orbax steps, pipeline timelines the examples lay out.
PUBLIC_MODULES = {"__init__", "__main__", "cli", "demo", "orbax", "pipeline"}


def test_the_package_shows_its_public_modules_and_keeps_the_rest_under_src():
    shown = {p.stem for p in PACKAGE.glob("*.py")} | {
        p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()
    }
    assert shown == PUBLIC_MODULES | {"_src"}, (
        f"modules beside the public ones: {sorted(shown - PUBLIC_MODULES - {'_src'})} (internals go under _src/)"
    )


def _is_internal_module(module: str | None) -> bool:
    return module is not None and (module == INTERNAL or module.startswith(INTERNAL + "."))


def _reaches_in(node: ast.AST, internal: set[str]) -> bool:
    """Whether ``node`` uses one of the names ``internal``, the attribute ``_src`` or a string
    that spells the internal package."""
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and n.id in internal:
            return True
        if isinstance(n, ast.Attribute) and n.attr == "_src":
            return True
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and INTERNAL in n.value:
            return True
    return False


def _defined_names(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return set()


def internal_tests(source: str) -> list[str]:
    """The names of the tests (functions, and methods of classes, named ``test_*``) of a test
    module that reach past the public face, in order."""
    tree = ast.parse(source)
    internal: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and _is_internal_module(n.module):
            internal |= {a.asname or a.name for a in n.names}
        elif isinstance(n, ast.Import):
            internal |= {a.asname for a in n.names if a.asname and _is_internal_module(a.name)}
    # module-level helpers, fixtures and constants built on internals are internals too
    changed = True
    while changed:
        changed = False
        for node in tree.body:
            names = _defined_names(node) - internal
            if names and _reaches_in(node, internal):
                internal |= names
                changed = True

    def uses(fn: ast.FunctionDef | ast.AsyncFunctionDef, outer: ast.AST | None = None) -> bool:
        params = {a.arg for a in [*fn.args.args, *fn.args.kwonlyargs]}
        return _reaches_in(fn, internal) or bool(params & internal) or (outer is not None and _reaches_in(outer, internal))

    found = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test") and uses(node):
            found.append(node.name)
        elif isinstance(node, ast.ClassDef):
            own = [s for s in node.body if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))]
            shared = ast.Module(body=[*own, *node.decorator_list], type_ignores=[]) if own or node.decorator_list else None
            found += [m.name for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                      and m.name.startswith("test") and uses(m, shared)]
    return found


def test_the_check_finds_tests_that_reach_in():
    source = '''
import residual_store as rs
from residual_store._src.store.disk import tier as d
import residual_store._src.store.disk.layout as layout
import pytest

SLOW_DISK = d.Disk
PUBLIC = rs.Store

def _helper():
    return SLOW_DISK

@pytest.fixture
def spy(monkeypatch):
    monkeypatch.setattr(d, "x", 1)

def test_public(tmp_path):
    rs.Store(str(tmp_path))

def test_uses_helper():
    _helper()

def test_takes_spy(spy):
    pass

def test_layout():
    layout.x

def test_subprocess():
    run("from residual_store._src.split import trace")

def test_attribute():
    import residual_store
    residual_store._src.x

class TestThings:
    def test_public_method(self):
        PUBLIC

    def test_internal_method(self):
        d.x
'''
    assert internal_tests(source) == [
        "test_uses_helper", "test_takes_spy", "test_layout", "test_subprocess", "test_attribute",
        "test_internal_method",
    ]


_TEST_FILES = sorted(TESTS.rglob("test_*.py"))


@pytest.mark.parametrize("path", _TEST_FILES, ids=lambda p: str(p.relative_to(TESTS)))
def test_tests_of_internals_say_so_in_their_names(path):
    if "internals" in path.stem or path.name in ("test_house.py", "test_private_line.py"):
        return  # the whole module is about internals (the house rules read the source itself)
    unnamed = [name for name in internal_tests(path.read_text()) if "internals" not in name]
    assert not unnamed, (
        f"{path.name}: these tests reach into {INTERNAL} without saying so in their names "
        f"(name them test_internals_...): {unnamed}"
    )
