"""The linter runs with the tests: ruff (pyflakes, pycodestyle, import order), configured in
pyproject.toml, must find nothing in the package, the serializers, the tests, benchmarks and
examples. CI runs the fast tier, so CI enforces it."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    found = shutil.which("ruff", path=str(pathlib.Path(sys.executable).parent))
    return [found] if found else [sys.executable, "-m", "ruff"]  # a test extra: missing, the test fails


def test_ruff_finds_nothing():
    done = subprocess.run([*_ruff(), "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_ruff_is_configured_to_check_imports_and_style():
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
    assert {"E", "F", "W", "I"} <= set(config["lint"]["select"])
