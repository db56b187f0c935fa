"""The linter and the type checker run with the tests: ruff (pyflakes, pycodestyle, import
order) must find nothing in the package, the serializers, the tests, benchmarks and examples, and
mypy nothing in the package and the serializers it imports, both as pyproject.toml configures them. CI runs
the fast tier, so CI enforces them."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _tool(name: str) -> list[str]:
    found = shutil.which(name, path=str(pathlib.Path(sys.executable).parent))
    return [found] if found else [sys.executable, "-m", name]  # a test extra: missing, the test fails


def test_ruff_finds_nothing():
    done = subprocess.run([*_tool("ruff"), "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_ruff_is_configured_to_check_imports_and_style():
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
    assert {"E", "F", "W", "I"} <= set(config["lint"]["select"])


_MYPY: dict[str, object] = {}


def start_mypy() -> subprocess.Popen[str]:
    """mypy in a process of its own, started once: conftest starts it when the session selects
    :func:`test_mypy_finds_nothing`, so its ten seconds overlap the other tests."""
    if "process" not in _MYPY:
        cache = tempfile.mkdtemp(prefix="mypy-cache-")
        _MYPY["cache"] = cache
        _MYPY["process"] = subprocess.Popen(
            [*_tool("mypy"), "--cache-dir", os.path.join(cache, "cache")],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
    return _MYPY["process"]  # type: ignore[return-value]


def test_mypy_finds_nothing():
    process = start_mypy()
    try:
        out, _ = process.communicate(timeout=600)
    finally:
        shutil.rmtree(str(_MYPY["cache"]), ignore_errors=True)
    assert process.returncode == 0, out[-6000:]
    assert "Success: no issues found" in out
