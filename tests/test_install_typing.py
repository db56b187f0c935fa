"""Typing after the README's install: ``pip install -e .`` gives type checkers the package as
``pip install .`` does (issue 45, item 2).

setuptools installs an editable project as a plain path entry (a ``.pth`` file naming the
project's root) only when every package lies where its name says under one root; otherwise it
installs an import hook, which mypy and other type checkers cannot run, and every type of the
library becomes ``Any``. The fast test checks the layout that makes the plain entry; the slow one
installs the project both ways into throwaway environments and runs mypy on a user script that
misuses the API: the same report, naming the misuse, after either install.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_lies_where_its_name_says_under_the_root():
    setuptools = _config()
    assert setuptools["package-dir"] == {"": "."}  # one root: setuptools' plain path entry
    listed = set(setuptools["packages"])
    for name in listed:
        assert (ROOT / name.replace(".", "/") / "__init__.py").is_file(), name
    found = {
        str(init.parent.relative_to(ROOT)).replace("/", ".")
        for top in ("residual_store", "residual_store_serializers")
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert found == listed  # no package left out of a regular install


def test_an_editable_install_here_is_a_plain_path_entry():
    """Where this environment installed the project editable (as the README does), what it
    installed is a path line, not an ``import`` of a finder."""
    site = Path(sysconfig.get_paths()["purelib"])
    entries = sorted(site.glob("__editable__.residual_store-*.pth"))
    if not entries:
        pytest.skip("the project is not installed editable in this environment")
    lines = [line for e in entries for line in e.read_text().splitlines() if line.strip()]
    assert lines and not [line for line in lines if line.startswith("import")], lines
    assert [Path(line).resolve() for line in lines] == [ROOT] * len(lines)


_USER_SCRIPT = """\
import jax.numpy as jnp
import residual_store as rs

fwd = rs.split(lambda w: jnp.sum(jnp.sin(w)))
with rs.Store(None) as store:
    count: int = store.keys()
    store.put("mb0", fwd(jnp.ones(3))[1])
misspelled = rs.Stor(None), rs.spilt(lambda w: w)
"""


def _mypy_after(install: list[str], tmp_path: Path, name: str) -> str:
    """mypy's report on the user script, for a fresh environment where the project was installed
    with ``pip install <install>`` (its dependencies: this environment's, through a path entry)."""
    env_dir = tmp_path / name
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()
    # after the project's own entry: jax, numpy... from here (a path line: its .pth files unread)
    Path(purelib, "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", *install],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    user = tmp_path / f"user_{name}"
    user.mkdir()
    (user / "train.py").write_text(_USER_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH")}
    report = subprocess.run(  # outside the repository: only the installed project is found
        [sys.executable, "-m", "mypy", "--python-executable", str(python), "--no-incremental", "train.py"],
        cwd=user, env=env, capture_output=True, text=True, timeout=600,
    )
    return report.stdout + report.stderr


@pytest.mark.slow
@pytest.mark.subprocess
def test_mypy_types_a_user_script_after_an_editable_install_as_after_a_regular_one(tmp_path):
    editable = _mypy_after(["-e", "."], tmp_path, "editable")
    regular = _mypy_after(["."], tmp_path, "regular")
    assert "Cannot find implementation or library stub" not in editable, editable
    assert 'Incompatible types in assignment (expression has type "list[str]", variable has type "int")' in editable
    assert 'Argument 1 to "put" of "Store" has incompatible type "str"' in editable, editable
    for name in ("Stor", "spilt"):  # misspelled: the lazy module __getattr__ is no catch-all for mypy
        assert f'Module has no attribute "{name}"' in editable, editable
    assert editable == regular
