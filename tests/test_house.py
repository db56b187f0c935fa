"""House rules of the code that a test can check: every path of a store's tree is spelled in
``residual_store/_src/store/disk/paths.py`` only; the store asks its committer how to write, never which
kind it has, and the committer answers with methods that do the thing, not flags; only the store
and its collective module ask whether the job has several processes; JAX internals are used in
``_jax_internals`` only; no module is over 700 lines; no test is an expected failure that may pass."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "residual_store"
MODULES = sorted(PACKAGE.rglob("*.py"))
TESTS = sorted(Path(__file__).resolve().parent.glob("*.py"))
MAX_MODULE_LINES = 700
# the modules that may ask whether the job has several processes (the store decides, its
# collective module answers); the rest are told (a committer's methods, a flag)
_ASK_THE_JOB = {"process_count", "is_multiprocess"}
_MAY_ASK_THE_JOB = {Path("_src") / "store" / "store.py", Path("_src") / "store" / "collective.py"}

# a string that spells a path of the tree: a top folder followed by a slash, or a file name
# that only the tree has
_TREE_PATH = re.compile(r"^(contexts|data|weights|backwards)/|(^|/)(bundle\.zip|residual-store\.json)$|^\.(free|trash)$")


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (prose may name paths)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _path_literals(source: str) -> list[tuple[int, str]]:
    tree = ast.parse(source)
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            # (the literal parts of an f-string, f"data/{key}", are constants too)
            if _TREE_PATH.search(node.value):
                found.append((node.lineno, node.value))
    return found


def test_the_check_finds_paths_spelled_by_hand():
    assert [v for _, v in _path_literals('p = f"data/{key}.{wid}"\nq = "weights/" + d\nr = "x"')] == [
        "data/", "weights/",
    ]
    assert _path_literals('def f():\n    """Reads data/<key>.<id>/bundle.zip."""\n') == []


@pytest.mark.parametrize("module", [m for m in MODULES if m.name != "paths.py"], ids=lambda m: m.name)
def test_every_path_of_the_tree_is_spelled_in_paths_only(module):
    found = _path_literals(module.read_text())
    assert not found, f"{module.relative_to(PACKAGE.parent)} spells store paths itself (use store.paths): {found}"


def test_the_store_asks_its_committer_not_which_kind_it_has():
    source = (PACKAGE / "_src" / "store" / "store.py").read_text()
    for name in ("_collective", "CollectiveCommitter", "is_multiprocess", "process_index", "LocalBackend", "KvBackend"):
        assert name not in source, f"store.py branches on the kind of committer or backend ({name})"


def _names(source: str) -> set[str]:
    """The names, attributes and imported names ``source`` uses (not its strings or docstrings)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.add(node.name.rsplit(".", 1)[-1])
    return found


# what tells which medium a backend writes to, or makes a write atomic on one medium only: the
# backends and their strategies (store/disk/folder.py, store/disk/kvstore.py) use it, the write
# path calls the strategy
_ASK_THE_MEDIUM = {
    "can_rename", "LocalBackend", "KvBackend", "AtomicRenames", "AtomicPuts",
    "rename", "temporary_for", "publish", "touch",
}
_WRITE_PATH = [PACKAGE / "_src" / "store" / name for name in ("store.py", "disk/tier.py", "gc.py", "collective.py")]


@pytest.mark.parametrize("module", _WRITE_PATH, ids=lambda m: m.name)
def test_the_write_path_lets_the_medium_s_strategy_make_writes_atomic(module):
    asked = _names(module.read_text()) & _ASK_THE_MEDIUM
    assert not asked, (
        f"{module.relative_to(PACKAGE.parent)} asks which medium it writes to, or renames itself "
        f"({sorted(asked)}): call the backend's strategy (disk.atomicity, an Atomicity of store/disk/protocol.py)"
    )


_COMMITTER_KINDS = ("SingleProcessCommitter", "CollectiveCommitter")


@pytest.mark.parametrize("module", ["store.py", "persistence.py"])
def test_the_store_and_its_side_never_name_a_kind_of_committer(module):
    """They call the committer's methods, whichever committer ``committer_for`` chose."""
    used = _names((PACKAGE / "_src" / "store" / module).read_text())
    assert not used & set(_COMMITTER_KINDS), f"{module} names a kind of committer: {sorted(used & set(_COMMITTER_KINDS))}"


def test_the_committer_protocol_has_methods_not_flags():
    """What differs between one process and a job is done by the committer (a method each
    committer implements), never a flag its caller reads and interprets."""
    tree = ast.parse((PACKAGE / "_src" / "store" / "committer.py").read_text())
    protocol = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Committer")
    flags = [n.target.id for n in protocol.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    assert not flags, f"the Committer protocol has attributes for its callers to interpret: {flags}"
    methods = {n.name for n in protocol.body if isinstance(n, ast.FunctionDef)}
    for kind in _COMMITTER_KINDS:
        source = next(m for m in MODULES if f"class {kind}" in m.read_text()).read_text()
        cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == kind)
        defined = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)} | _static_functions(cls)
        assert methods <= defined, f"{kind} lacks {sorted(methods - defined)}"
        assert not _public_flags(cls), f"{kind} has flags for its callers to interpret: {_public_flags(cls)}"


def _static_functions(cls: ast.ClassDef) -> set[str]:
    """Names ``cls`` binds to a function itself (``key_for = staticmethod(put_key)``): a method
    that is the function, with no wrapper around it."""
    return {
        t.id for n in cls.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
        and isinstance(n.value.func, ast.Name) and n.value.func.id == "staticmethod"
        for t in n.targets if isinstance(t, ast.Name)
    }


def _public_flags(cls: ast.ClassDef) -> list[str]:
    """Public attributes that ``cls`` sets to ``True``/``False`` or a comparison, in its body
    or on ``self``."""
    found = []
    for node in ast.walk(cls):
        if not isinstance(node, ast.Assign):
            continue
        value = node.value
        if not (isinstance(value, ast.Compare) or (isinstance(value, ast.Constant) and isinstance(value.value, bool))):
            continue
        for target in node.targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                found.append(target.attr)
            elif isinstance(target, ast.Name) and node in cls.body:
                found.append(target.id)
    return [name for name in found if not name.startswith("_")]


def test_the_check_finds_flags():
    source = "class A:\n    x = True\n    _y = False\n    def __init__(self):\n        self.z = f() == 0\n        w = True\n"
    cls = ast.parse(source).body[0]
    assert isinstance(cls, ast.ClassDef) and _public_flags(cls) == ["x", "z"]


def test_the_check_finds_questions_about_the_job():
    assert _names('"""jax.process_count() > 1"""\nn = jax.process_count()\n') & _ASK_THE_JOB == {"process_count"}
    assert _names("from residual_store._src.store.collective import is_multiprocess\n") & _ASK_THE_JOB == {"is_multiprocess"}
    assert not _names('x = "is_multiprocess"  # is_multiprocess\n') & _ASK_THE_JOB


@pytest.mark.parametrize("module", MODULES, ids=lambda m: str(m.relative_to(PACKAGE)))
def test_only_the_store_and_its_collective_module_ask_whether_the_job_has_several_processes(module):
    if module.relative_to(PACKAGE) in _MAY_ASK_THE_JOB:
        return
    asked = _names(module.read_text()) & _ASK_THE_JOB
    assert not asked, (
        f"{module.relative_to(PACKAGE.parent)} asks whether the job has several processes ({sorted(asked)}): "
        "store/collective.py answers (committer_for, a committer's methods); pass the answer down"
    )


@pytest.mark.parametrize("module", MODULES, ids=lambda m: str(m.relative_to(PACKAGE)))
def test_no_module_is_over_700_lines(module):
    lines = len(module.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, (
        f"{module.relative_to(PACKAGE.parent)} has {lines} lines (at most {MAX_MODULE_LINES}): split it by concept"
    )


def _loose_xfails(source: str) -> list[int]:
    """Lines of ``source`` that mark a test ``xfail`` without ``strict=True`` (a test that may
    pass unnoticed)."""
    tree = ast.parse(source)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "xfail"]
    called = {id(c.func) for c in calls}
    bare = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "xfail" and id(n) not in called]
    loose = [
        c.lineno for c in calls
        if not any(k.arg == "strict" and isinstance(k.value, ast.Constant) and k.value.value is True for k in c.keywords)
    ]
    return sorted(bare + loose)


def test_the_check_finds_loose_xfails():
    source = (
        "import pytest\n@pytest.mark.xfail\ndef test_a(): pass\n"
        "@pytest.mark.xfail(reason='x')\ndef test_b(): pass\n"
        "@pytest.mark.xfail(strict=True, reason='x')\ndef test_c(): pass\n"
    )
    assert _loose_xfails(source) == [2, 4]


@pytest.mark.parametrize("test_module", TESTS, ids=lambda m: m.name)
def test_no_test_is_an_expected_failure_that_may_pass(test_module):
    if test_module == Path(__file__).resolve():
        return  # its own check's examples
    loose = _loose_xfails(test_module.read_text())
    assert not loose, f"{test_module.name}:{loose} mark tests xfail without strict=True"


@pytest.mark.parametrize("module", [m for m in MODULES if m.name != "_jax_internals.py"], ids=lambda m: m.name)
def test_jax_internals_are_used_in_one_module(module):
    tree = ast.parse(module.read_text())
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        assert not any(n == "jax._src" or n.startswith("jax._src.") for n in names), (
            f"{module.name}:{node.lineno} imports JAX internals: they belong in residual_store/_src/_jax_internals.py"
        )


def _package_imports(source: str) -> list[tuple[int, str, str | None]]:
    """(line, module, name) of every import of this package in ``source`` (name ``None`` for
    ``import module``); a relative import counts as one of the package."""
    found: list[tuple[int, str, str | None]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] == "residual_store"]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if node.level or module.split(".")[0] == "residual_store":
                found += [(node.lineno, module, a.name) for a in node.names]
    return found


def _private_imports(source: str, public: set[str]) -> list[tuple[int, str, str | None]]:
    """The imports of ``source`` that reach past the package's public face: a module other than
    ``residual_store`` itself, its ``demo`` (the README's job) and the command line's own text
    helpers (``_src/cli_text.py``: parsing and formatting; ``_src/interrupts.py``: its Ctrl-C; no
    library internals), or a name not in
    ``public``."""
    bad = []
    for line, module, name in _package_imports(source):
        if module == "residual_store" and (name is None or name in public):
            continue
        if module in ("residual_store._src.cli_text", "residual_store._src.interrupts"):
            continue
        if module == "residual_store.demo" and name is not None and not name.startswith("_"):
            continue
        bad.append((line, module, name))
    return bad


def test_the_check_finds_private_imports():
    public = {"Store", "__version__"}
    source = (
        "import residual_store as rs\nfrom residual_store import Store, __version__\n"
        "from residual_store.demo import run_demo\nfrom residual_store._src.store.disk.tier import DiskTier\n"
        "from residual_store import _jax_internals\nfrom .store import keys\nimport residual_store._src.store.disk.layout\n"
    )
    assert [line for line, _, _ in _private_imports(source, public)] == [4, 5, 6, 7]


def test_the_command_line_text_helpers_use_nothing_of_the_library():
    """Nothing but the durations parser they share with ``Store.gc``, which uses nothing of it."""
    imports = _package_imports((PACKAGE / "_src" / "cli_text.py").read_text())
    assert [(module, name) for _, module, name in imports] == [("residual_store._src.durations", "parse_duration")]
    assert not _package_imports((PACKAGE / "_src" / "durations.py").read_text())
    imports = _package_imports((PACKAGE / "_src" / "interrupts.py").read_text())
    assert [(module, name) for _, module, name in imports] == [("residual_store._src.cli_text", "status_line")]


def test_the_command_line_uses_the_public_api_only():
    import residual_store

    public = {*residual_store.__all__, "__version__"}
    source = (PACKAGE / "cli.py").read_text()
    assert not _private_imports(source, public), "cli.py reaches past the public API (use public Store methods)"
    tree = ast.parse(source)
    private = [
        (n.lineno, n.attr) for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "rs" and n.attr.startswith("_")
    ]
    assert not private, f"cli.py uses private names of the package: {private}"


def test_the_static_face_lists_what_the_package_imports_on_first_use():
    """``residual_store/__init__.py`` imports its public names on first use; the imports it
    shows type checkers (under ``TYPE_CHECKING``) name the same modules and names."""
    import residual_store

    static = {}
    for node in ast.walk(ast.parse((PACKAGE / "__init__.py").read_text())):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for sub in ast.walk(node):
                if isinstance(sub, ast.ImportFrom):
                    static.update({a.asname or a.name: sub.module for a in sub.names})
    assert static == residual_store._EXPORTS and list(residual_store._EXPORTS) == residual_store.__all__


@pytest.mark.slow
def test_public_functions_keep_their_names_whatever_is_imported_first():
    """``rs.split`` and ``rs.backward`` share their names with the modules that define them:
    importing those modules first (before any public name is used) leaves the functions."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, types, residual_store._src.split, residual_store._src.backward, residual_store as rs\n"
        "assert 'jax' in sys.modules\n"
        "assert rs.split is sys.modules['residual_store._src.split'].split and callable(rs.backward)\n"
        "assert not isinstance(rs.backward, types.ModuleType) and 'split' in dir(rs)\n"
        "from residual_store import backward, Store\n"
        "assert backward is sys.modules['residual_store._src.backward'].backward and Store is rs.Store\n"
        "import residual_store._src.store.store\n"
        "try:\n    rs.no_such_name\nexcept AttributeError as e:\n    assert 'no_such_name' in str(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=os.environ)
    assert out.returncode == 0, out.stderr


_THREAD_MAKERS = {"ThreadPoolExecutor", "ProcessPoolExecutor", "Thread", "Timer"}


def _threads_made_at_import(source: str) -> list[int]:
    """Lines of ``source`` that make a thread or pool when the module is imported: a call of
    one of ``_THREAD_MAKERS`` outside every function (a class body runs at import too)."""
    found = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in _THREAD_MAKERS:
                found.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def test_the_check_finds_pools_made_at_import():
    source = (
        "import threading\nfrom concurrent.futures import ThreadPoolExecutor\n"
        "POOL = ThreadPoolExecutor(2)\n"
        "def lazy():\n    return ThreadPoolExecutor(2)\n"
        "class Holder:\n    t = threading.Thread(target=print)\n"
    )
    assert _threads_made_at_import(source) == [3, 7]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: str(m.relative_to(PACKAGE)))
def test_no_thread_or_pool_is_made_at_import(module):
    lines = _threads_made_at_import(module.read_text())
    assert not lines, f"{module.relative_to(PACKAGE.parent)} makes threads at import (lines {lines}): make them on first use"


def _collaborator_questions(source: str) -> list[str]:
    """What ``source`` does to its collaborators that a facade must not: an ``is None`` test of
    one (``self._disk is None``), or an edit of another object's state (``self._work.pending[k] =``,
    ``self._work.deleting.pop(k)``, ``self._reads.loading.clear()``)."""
    found = []
    mutators = {"pop", "popitem", "clear", "update", "add", "discard", "remove", "setdefault", "append"}

    def own_attribute(node: ast.AST, depth: int) -> bool:
        """``self._x`` (depth 1) or ``self._x.y`` (depth 2)."""
        for _ in range(depth):
            if not isinstance(node, ast.Attribute):
                return False
            node = node.value
        return isinstance(node, ast.Name) and node.id == "self"

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            operands = [node.left, *node.comparators]
            if any(isinstance(o, ast.Constant) and o.value is None for o in operands) and any(
                own_attribute(o, 1) for o in operands
            ):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                inner = target.value if isinstance(target, ast.Subscript) else target
                if own_attribute(inner, 2):
                    found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in mutators:
            if own_attribute(node.func.value, 2):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_check_finds_a_facade_editing_its_collaborators():
    source = (
        "class S:\n def f(self, k):\n  if self._disk is None: pass\n  self._work.pending[k] = 1\n"
        "  self._work.deleting.pop(k, None)\n  del self._reads.loading[k]\n  self._ledger.begin_put(k)\n"
        "  if self._x.y is None: pass\n  self._n = 1\n"
    )
    assert sorted(f.split(":")[0] for f in _collaborator_questions(source)) == ["line 3", "line 4", "line 5", "line 6"]


def test_the_store_asks_its_parts_and_edits_none_of_their_state():
    found = _collaborator_questions((PACKAGE / "_src" / "store" / "store.py").read_text())
    assert not found, f"store.py tests a collaborator against None or edits another object's state: {found}"


def _plain_locks(source: str) -> list[int]:
    """Lines of ``threading.Lock()``/``RLock()``/``Condition()`` made without a StoreLock."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("Lock", "RLock"):
            found.append(node.lineno)
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("Condition"):
            if not (node.args and ast.unparse(node.args[0]) == "StoreLock()"):
                found.append(node.lineno)
    return found


def test_the_check_finds_plain_locks():
    source = (
        "import threading\na = threading.Lock()\nb = threading.RLock()\nc = threading.Condition()\n"
        "d = threading.Condition(StoreLock())\ne = StoreLock()\n"
    )
    assert _plain_locks(source) == [2, 3, 4]


@pytest.mark.parametrize("module", sorted((PACKAGE / "_src" / "store").glob("*.py")), ids=lambda m: m.name)
def test_every_lock_of_the_store_is_one_a_signal_handler_waits_out(module):
    """A SIGTERM handler waits for the writers; a plain lock the main thread holds when the signal
    lands, and a writer needs, would deadlock it (critical.py)."""
    if module.name == "critical.py":
        return  # where StoreLock wraps its RLock
    lines = _plain_locks(module.read_text())
    assert not lines, f"{module.name} makes plain locks (lines {lines}): use critical.StoreLock"


def test_no_test_but_the_demos_own_imports_the_demo():
    """The demo is a demo: tests bring their own models (tests/models.py, transformer_model.py),
    so changing the demo never changes what another test checks."""
    importers = []
    for path in sorted(Path(__file__).parent.glob("*.py")):
        if path.name == "test_demo.py":
            continue
        imported = [f"{module}.{name}" if name else module for _, module, name in _package_imports(path.read_text())]
        if any(m == "residual_store.demo" or m.startswith("residual_store.demo.") for m in imported):
            importers.append(path.name)
    assert not importers, f"these tests import residual_store.demo: {importers}"


@pytest.mark.slow  # seconds of its own: the fast tier aims at 90 s
def test_the_serializers_install_under_the_projects_own_name(tmp_path):
    """The formats install as ``residual_store_serializers``: a top-level ``serializers`` is
    another published distribution's name, and a user with both would get one overwritten."""
    import subprocess
    import sys
    import tomllib

    config = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    setuptools = config["tool"]["setuptools"]
    assert not [p for p in setuptools["packages"] if p.split(".")[0] == "serializers"]
    assert "residual_store_serializers" in setuptools["packages"]
    points = [v for group in config["project"]["entry-points"].values() for v in group.values()]
    assert points and all(v.startswith(("residual_store.", "residual_store_serializers.")) for v in points)
    probe = (
        "import importlib.util, residual_store, residual_store_serializers as s\n"
        "print(importlib.util.find_spec('serializers'), s.__name__, residual_store.Store.__module__)"
    )
    # run where the repository is not on the path: what an installed copy offers
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["None", "residual_store_serializers", "residual_store._src.store.store"]


_MADE_HERE = {"object.__new__", "cls", "cls.__new__", "super().__new__"}


def _private_sets(source: str) -> list[tuple[int, str]]:
    """(line, target) of each assignment to a private attribute of an object that is not its
    class's own: outside any class, or in a method, to anything but ``self``, ``cls`` or an
    instance the method itself makes (``object.__new__(cls)``, ``cls(...)``)."""
    found: list[tuple[int, str]] = []

    def own_names(func: ast.AST) -> set[str]:
        names = {"self", "cls"}
        for n in ast.walk(func):
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and ast.unparse(n.value.func) in _MADE_HERE:
                names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        return names

    def visit(node: ast.AST, own: set[str]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = own
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and isinstance(node, ast.ClassDef):
                inner = own_names(child)
            elif isinstance(child, ast.ClassDef):
                inner = set()
            if isinstance(child, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                for target in child.targets if isinstance(child, ast.Assign) else [child.target]:
                    found.extend(
                        (child.lineno, ast.unparse(n)) for n in ast.walk(target)
                        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
                        and not (isinstance(n.value, ast.Name) and n.value.id in own)
                    )
            visit(child, inner)

    visit(ast.parse(source), set())
    return found


def test_the_check_finds_private_attributes_set_from_outside():
    source = (
        "class A:\n"
        "    def __init__(self):\n        self._x = 1\n"
        "    @classmethod\n    def made(cls):\n        obj = object.__new__(cls)\n        obj._x = 2\n        return obj\n"
        "    def other(self, ctx):\n        ctx._y = 3\n        self._b._z = 4\n"
        "def f(ctx):\n    ctx._w = 5\n"
    )
    assert _private_sets(source) == [(10, "ctx._y"), (11, "self._b._z"), (13, "ctx._w")]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: str(m.relative_to(PACKAGE)))
def test_no_private_attribute_is_set_from_outside_its_class(module):
    found = _private_sets(module.read_text())
    assert not found, f"give the class a way to be told (a constructor, a method): {found}"


# -- the key table: one owner of the store's lock, nothing slow under it (issue 43) ----------------

_STORE = PACKAGE / "_src" / "store"


def _store_walk():  # noqa: ANN202 - the house's measures, shared with benchmarks/store_walk.py
    import importlib.util

    spec = importlib.util.spec_from_file_location("store_walk", PACKAGE.parent / "benchmarks" / "store_walk.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _lock_uses(source: str) -> list[str]:
    """Where ``source`` takes or touches the key table's lock (``table.lock``, ``self._table.lock``)
    or any ``with ... lock`` of its own."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "lock" and "table" in ast.unparse(node.value):
            found.append(ast.unparse(node))
        if isinstance(node, ast.With):
            found += [ast.unparse(i.context_expr) for i in node.items if "lock" in ast.unparse(i.context_expr).lower()]
    return found


def test_the_check_finds_the_store_lock_taken():
    assert sorted(_lock_uses("with self._table.lock:\n    pass\nx = store._table.lock\n")) == [
        "self._table.lock", "self._table.lock", "store._table.lock"
    ]


@pytest.mark.parametrize("module", ["store.py", "reads.py", "persistence.py"])
def test_the_facade_reads_and_persistence_take_no_store_lock(module):
    """The key table owns the store's lock: every transition is one of its methods."""
    found = _lock_uses((_STORE / module).read_text())
    assert not found, f"{module} takes a lock itself: {found}; ask the key table (table.py)"


def test_the_store_lock_is_the_tables_alone():
    users = sorted(str(m.relative_to(_STORE)) for m in _STORE.rglob("*.py") if m.name != "table.py"
                   and any("table" in u for u in _lock_uses(m.read_text())))
    assert not users, f"these modules take the key table's lock: {users}"


def test_the_table_imports_nothing_that_copies_reads_writes_or_waits():
    """Nothing slow under the lock: the table and what its transitions return import no disk,
    host-copy or worker module (rule 1 of table.py, as a rule of the house)."""
    allowed = {"context", "errors", "store.critical", "store.schedule", "store.tiers", "store.owed", "store.leaving",
               "store.entry"}
    for name in ("table.py", "owed.py"):
        tree = ast.parse((_STORE / name).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                    and n.module.startswith("residual_store")}
        inside = {m.removeprefix("residual_store._src.") for m in imported}
        assert inside <= allowed, f"{name} imports {sorted(inside - allowed)}: nothing slow runs under the lock"


def test_the_stores_imports_have_no_cycle_and_at_most_nine_levels():
    walk = _store_walk()
    graph = walk.import_graph()
    assert walk._cycles(graph) == [], "an import cycle inside store/"
    levels, chain = walk._levels(graph)
    assert levels <= 9, f"{levels} levels of imports: {' > '.join(chain)}"


def test_the_store_has_few_functions_that_only_forward_their_arguments():
    found = _store_walk().pass_throughs()
    assert len(found) <= 12, f"{len(found)} pass-through functions (a room too many each): {found}"


def test_house_md_names_every_module_and_none_that_is_gone():
    text = (PACKAGE.parent / "docs" / "house.md").read_text()
    named = {n for n in re.findall(r"`((?:[a-z_]+/)*[a-z_0-9]+\.py)`", text) if not n.startswith(("tests/", "benchmarks/"))}
    missing = []
    for module in MODULES:
        rel = module.relative_to(PACKAGE)
        if module.name == "__init__.py" or module.parent == PACKAGE:
            continue
        short = str(rel.relative_to("_src")) if rel.parts[0] == "_src" else str(rel)
        in_store = short.removeprefix("store/")
        if not ({short, in_store, module.name} & named):
            missing.append(short)
    assert not missing, f"docs/house.md does not name {missing}"
    modules = {m.name for m in PACKAGE.rglob("*.py")} | {m.name for m in (PACKAGE.parent / "residual_store_serializers").glob("*.py")}
    gone = sorted(n for n in named if n.rsplit("/", 1)[-1] not in modules)
    assert not gone, f"docs/house.md names modules that are gone: {gone}"
    files = re.findall(r"`((?:tests|benchmarks)/[a-z_0-9]+\.py)`", text)
    gone_files = sorted(f for f in files if not (PACKAGE.parent / f).is_file())
    assert files and not gone_files, f"docs/house.md names test files that are gone: {gone_files}"
