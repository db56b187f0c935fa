"""House rules of the on-disk formats (``residual_store_serializers/``) that a test can check: its
modules are peers over shared, public format modules, not a chain of borrowed internals.

* No module imports an underscore name from a sibling: what two modules share is public in
  one of them (in its ``__all__``).
* ``local`` and ``kv`` (two ways to the same bytes) do not import each
  other.
* No module is longer than 700 lines: a longer one holds more than one job.
* What a full disk is (``DISK_FULL_ERRNOS``) is defined once, in ``residual_store_serializers/errors.py``.
* Importing a module starts no thread: a thread pool is made when first used.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

NAME = "residual_store_serializers"
PACKAGE = Path(__file__).resolve().parents[1] / NAME
MODULES = sorted(PACKAGE.glob("*.py"))
MAX_LINES = 700


def _sibling_imports(source: str) -> list[tuple[int, str, str | None]]:
    """(line, sibling module, imported name or ``None`` for a module import) of every import of
    a module of the formats' package in ``source``, anywhere in it (a function's lazy import too)."""
    found: list[tuple[int, str, str | None]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # from . import x / from .x import y
                module = NAME + ("." + module if module else "")
            if module == NAME:  # from residual_store_serializers import kv
                found += [(node.lineno, f"{NAME}.{a.name}", None) for a in node.names]
            elif module.startswith(NAME + "."):
                found += [(node.lineno, module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names if a.name.startswith(NAME + ".")]
    return found


def test_the_check_finds_what_it_should():
    source = (
        "from residual_store_serializers.zarr import _disk_array, chunk_key\n"
        "from .local import aligned_empty\n"
        "import residual_store_serializers.kv\n"
        "def f():\n    from residual_store_serializers import local\n"
    )
    assert _sibling_imports(source) == [
        (1, f"{NAME}.zarr", "_disk_array"),
        (1, f"{NAME}.zarr", "chunk_key"),
        (2, f"{NAME}.local", "aligned_empty"),
        (3, f"{NAME}.kv", None),
        (5, f"{NAME}.local", None),
    ]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.name)
def test_no_module_imports_a_private_name_of_a_sibling(module):
    private = [
        f"{module.name}:{line} imports {name} from {source}"
        for line, source, name in _sibling_imports(module.read_text())
        if name is not None and name.startswith("_")
    ]
    assert not private, f"make these public in their module (in its __all__): {private}"


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.name)
def test_what_a_module_takes_from_a_sibling_is_in_that_siblings_all(module):
    for line, source, name in _sibling_imports(module.read_text()):
        if name is None:
            continue
        sibling = PACKAGE / (source.removeprefix(NAME + ".") + ".py")
        exported = _all(sibling.read_text())
        if name == "*":  # takes the sibling's __all__, and nothing else: it must have one
            assert exported, f"{module.name}:{line} imports * from {source}, which has no __all__"
            continue
        assert name in exported, f"{module.name}:{line} imports {name!r}, not in {source}.__all__"


def _all(source: str) -> set[str]:
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return {ast.literal_eval(e) for e in node.value.elts}  # type: ignore[attr-defined]
    return set()


@pytest.mark.parametrize("module, other", [("local", "kv"), ("kv", "local")])
def test_local_and_kv_do_not_import_each_other(module, other):
    imports = _sibling_imports((PACKAGE / f"{module}.py").read_text())
    assert not [i for i in imports if i[1] == f"{NAME}.{other}"], (
        f"{NAME}.{module} imports {NAME}.{other}: what they share belongs in a shared module"
    )


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.name)
def test_no_module_is_over_700_lines(module):
    lines = len(module.read_text().splitlines())
    assert lines <= MAX_LINES, f"{module.name} has {lines} lines (at most {MAX_LINES}): split it by job"


_DISK_FULL_ERRNO_NAMES = {"ENOSPC", "EFBIG", "EDQUOT"}


@pytest.mark.parametrize("module", [m for m in MODULES if m.name != "errors.py"], ids=lambda m: m.name)
def test_what_a_full_disk_is_is_defined_in_errors_only(module):
    """No module but errors.py spells a set of the disk-full errnos (raising one is fine)."""
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, (ast.Set, ast.Tuple, ast.List)):
            names = {e.attr for e in node.elts if isinstance(e, ast.Attribute)}
            assert not names & _DISK_FULL_ERRNO_NAMES, (
                f"{module.name}:{node.lineno} spells disk-full errnos: use serializers.errors.DISK_FULL_ERRNOS"
            )
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            assert not any(getattr(t, "id", "") == "DISK_FULL_ERRNOS" for t in targets), (
                f"{module.name}:{node.lineno} defines DISK_FULL_ERRNOS again"
            )


_THREAD_MAKERS = {"ThreadPoolExecutor", "ProcessPoolExecutor", "Thread", "Timer"}


def _module_level_calls(tree: ast.Module) -> list[ast.Call]:
    """Calls run when the module is imported: in its top-level statements, not inside a
    function or class body (a class's methods run later; its body's own calls count)."""
    calls: list[ast.Call] = []
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for default in [*node.args.defaults, *node.args.kw_defaults]:
                if default is not None:
                    todo.append(default)
            todo.extend(getattr(node, "decorator_list", []))
            continue
        if isinstance(node, ast.Call):
            calls.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return calls


def test_the_thread_check_finds_a_pool_made_at_import():
    tree = ast.parse("import concurrent.futures as cf\nPOOL = cf.ThreadPoolExecutor(4)\ndef f():\n    return Thread()\n")
    names = [getattr(c.func, "attr", getattr(c.func, "id", None)) for c in _module_level_calls(tree)]
    assert names == ["ThreadPoolExecutor"]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.name)
def test_importing_a_module_starts_no_thread(module):
    for call in _module_level_calls(ast.parse(module.read_text())):
        name = getattr(call.func, "attr", getattr(call.func, "id", None))
        assert name not in _THREAD_MAKERS, (
            f"{module.name}:{call.lineno} makes a {name} at import: make it on first use"
        )
