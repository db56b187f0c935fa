"""The suite's leak check looks at its own temp folder, not the system's: another job making
``rs-*`` folders in the system temp folder during a run does not fail it, a leak of the suite's
own is still caught."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap

import pytest

import conftest

TESTS = pathlib.Path(__file__).resolve().parent


def test_the_suite_and_its_subprocesses_make_temp_folders_in_its_own_folder():
    assert tempfile.gettempdir() == conftest.SUITE_TEMP == os.environ["TMPDIR"]
    assert os.path.dirname(os.path.dirname(conftest.SUITE_TEMP)) == conftest.SYSTEM_TEMP
    child = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.mkdtemp(prefix='rs-child-'))"],
                           capture_output=True, text=True, check=True, timeout=60)
    made = child.stdout.strip()
    try:
        assert os.path.dirname(made) == conftest.SUITE_TEMP
    finally:
        os.rmdir(made)


def test_the_check_finds_folders_of_ours_and_nothing_else(tmp_path):
    (tmp_path / "rs-leaked").mkdir()                                  # one of our prefixes
    (tmp_path / "tmpabc" / "store").mkdir(parents=True)
    (tmp_path / "tmpabc" / "store" / "residual-store.json").write_text("{}")  # a store one level down
    (tmp_path / "someone-elses").mkdir()
    (tmp_path / "rs-a-file").write_text("")                           # not a folder
    assert conftest.ours_left_in(str(tmp_path)) == ["rs-leaked", "tmpabc"]


OTHER_JOB = '''
import os

def test_another_job_makes_folders_like_ours_in_the_system_temp_folder():
    system = os.environ["NESTED_SYSTEM_TEMP"]  # what the nested suite was started with as TMPDIR
    os.mkdir(os.path.join(system, "rs-another-job"))
    os.mkdir(os.path.join(system, "residual-store-another-job"))
'''

OWN_LEAK = '''
import tempfile

def test_a_test_that_leaks_a_folder_of_ours():
    tempfile.mkdtemp(prefix="rs-leak-")
'''


def _nested_suite(tmp_path: pathlib.Path, test_source: str) -> tuple[subprocess.CompletedProcess[str], pathlib.Path]:
    """Runs a one-test suite with this suite's conftest, its system temp folder a fresh folder
    (so that what it makes there is seen, and nothing else's): ``(the run, that folder)``."""
    suite, system = tmp_path / "suite", tmp_path / "system"
    suite.mkdir()
    system.mkdir()
    (suite / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    (suite / "test_it.py").write_text(textwrap.dedent(test_source))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_DEBUG_TEMPROOT", "PYTEST_ADDOPTS")}
    env.update(TMPDIR=str(system), TEMP=str(system), TMP=str(system), NESTED_SYSTEM_TEMP=str(system),
               JAX_PLATFORMS="cpu")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(suite), str(suite)],
        capture_output=True, text=True, timeout=120, cwd=suite, env=env,
    )
    return run, system


@pytest.mark.subprocess
def test_folders_like_ours_made_in_the_system_temp_folder_by_another_job_do_not_fail_the_suite(tmp_path):
    run, system = _nested_suite(tmp_path, OTHER_JOB)
    assert run.returncode == 0, run.stdout + run.stderr
    left = sorted(n for n in os.listdir(system) if not n.startswith("pytest-of-"))
    assert left == ["residual-store-another-job", "rs-another-job"]  # theirs, untouched; ours removed


@pytest.mark.subprocess
def test_a_leak_into_the_suites_own_temp_folder_fails_it(tmp_path):
    run, system = _nested_suite(tmp_path, OWN_LEAK)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "1 passed, 1 error" in run.stdout and "the tests left these in their temp folder" in run.stdout
    assert "rs-leak-" in run.stdout
    assert [n for n in os.listdir(system) if not n.startswith("pytest-of-")] == []  # removed all the same
