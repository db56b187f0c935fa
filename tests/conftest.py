"""Shared fixtures: compile counting through jax.monitoring, fresh random inputs, and the suite's
own temp folder (checked for leaks at the end, then removed)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator

import jax
import pytest

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Counts XLA backend compiles seen through ``jax.monitoring`` while active: JAX times each
    one as ``BACKEND_COMPILE_EVENT``, whether XLA ran it or the run's compilation cache (below)
    answered it."""

    def __init__(self) -> None:
        self.count = 0
        self._active = False
        self._lock = threading.Lock()

    def _listener(self, event: str, duration: float, **kwargs: object) -> None:
        if event == BACKEND_COMPILE_EVENT and self._active:
            with self._lock:
                self.count += 1

    @contextlib.contextmanager
    def counting(self) -> Iterator["CompileCounter"]:
        self.count = 0
        self._active = True
        try:
            yield self
        finally:
            self._active = False


_COUNTER = CompileCounter()
jax.monitoring.register_event_duration_secs_listener(_COUNTER._listener)


@pytest.fixture(scope="session", autouse=True)
def float32_matmuls_on_a_tpu() -> Iterator[None]:
    """On a TPU, float32 matmuls at JAX's default precision run as bfloat16 passes and agree with
    a float64 reference to about three digits; the suite's float32 comparisons (``rtol=1e-5``)
    assume float32 arithmetic, which ``"highest"`` gives there (about seven digits). Elsewhere
    (CI's CPU) nothing changes. (A fixture, not import-time code: asking for the backend
    starts JAX's backends, which some test modules configure at import.)"""
    if jax.default_backend() != "tpu":
        yield
        return
    before = jax.config.jax_default_matmul_precision  # type: ignore[attr-defined]  # (a runtime flag)
    jax.config.update("jax_default_matmul_precision", "highest")  # every thread's (writers trace too)
    try:
        yield
    finally:
        jax.config.update("jax_default_matmul_precision", before)


@pytest.fixture
def compiles() -> CompileCounter:
    """``with compiles.counting() as c: ...; c.count`` is the number of backend compiles."""
    return _COUNTER


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> jax.Array:
    """A fresh key per test (seeded from the test's name and a per-run salt)."""
    import random
    import zlib

    seed = zlib.crc32(request.node.nodeid.encode()) ^ random.SystemRandom().randrange(2**31)
    return jax.random.key(seed)


# -- the suite's own temp folder, and nothing of ours left in it ---------------------------------
#
# Invariant: from this module's import on (before collection), ``tempfile`` in this process and
# in every subprocess started with the inherited environment (examples, store readers, worker
# pairs) makes its folders under ``SUITE_TEMP``, a fresh folder of the system temp folder. The
# leak check looks there only: other jobs on the machine may make ``rs-*`` folders or stores in
# the system temp folder at any time, and they are none of this suite's business.

_OUR_PREFIXES = (
    "residual-store-", "rs-", "zero-bubble-", "resume-", "offload-example-", "mp-store-", "preemptible-",
)
SYSTEM_TEMP = tempfile.gettempdir()


def _make_suite_temp(system_temp: str) -> tuple[str, str]:
    """``(outer, inner)``: a fresh folder in ``system_temp``, and the folder in it that becomes
    this process's and its subprocesses' temp folder (``TMPDIR``/``TEMP``/``TMP``,
    ``tempfile.tempdir``). The extra level keeps a store made directly in a ``mkdtemp`` folder
    two levels below the system temp folder, where an older copy of this check, running in
    another checkout at the same time, does not look. pytest's ``tmp_path`` folders stay in the
    system temp folder (``PYTEST_DEBUG_TEMPROOT``), where pytest keeps the last runs'."""
    outer = tempfile.mkdtemp(prefix="residual_store_suite_", dir=system_temp)
    inner = os.path.join(outer, "tmp")
    os.mkdir(inner)
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", system_temp)
    for var in ("TMPDIR", "TEMP", "TMP"):
        os.environ[var] = inner
    tempfile.tempdir = inner
    return outer, inner


_SUITE_OUTER, SUITE_TEMP = _make_suite_temp(SYSTEM_TEMP)


def _share_compilation_cache(folder: str) -> None:
    """One XLA compilation cache for the run: this process's, its pytest-xdist workers' and
    every subprocess's (through the environment they inherit), in the suite's folder. The tests
    build the same small programs again and again, in new splits and new processes; each
    program compiles once a run. A compile the cache answers is still one to a test that counts
    compiles (JAX times it as it times one XLA runs: :class:`CompileCounter`)."""
    cache = os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", folder)  # (a worker: the controller's)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


_share_compilation_cache(os.path.join(_SUITE_OUTER, "xla-cache"))


def _is_ours(path: str, name: str) -> bool:
    """A folder this project's code makes: one of its prefixes, or holding a store (its marker
    in it, or one level down: a store inside a ``mkdtemp`` folder)."""
    if name.startswith(_OUR_PREFIXES):
        return True
    if os.path.exists(os.path.join(path, "residual-store.json")):
        return True
    try:
        return any(os.path.exists(os.path.join(path, sub, "residual-store.json")) for sub in os.listdir(path))
    except OSError:
        return False


def ours_left_in(root: str) -> list[str]:
    """The names of the folders of ours (:func:`_is_ours`) directly in ``root``, sorted."""
    found = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if os.path.isdir(path) and not os.path.islink(path) and _is_ours(path, name):
            found.append(name)
    return sorted(found)


@pytest.fixture(scope="session", autouse=True)
def nothing_left_in_the_temp_folder() -> Iterator[None]:
    """The suite (docs examples, examples, subprocesses) leaves no store or folder of ours in
    its own temp folder, ``SUITE_TEMP``; what is in the system temp folder is not looked at."""
    yield
    left = ours_left_in(SUITE_TEMP)
    assert not left, f"the tests left these in their temp folder {SUITE_TEMP}: {left}"


def pytest_unconfigure(config: pytest.Config) -> None:
    """Removes the suite's temp folder (after the session fixture's check, and also for a run
    that started no test)."""
    shutil.rmtree(_SUITE_OUTER, ignore_errors=True)


# -- two tiers -----------------------------------------------------------------------------------
#
# The fast tier (``pytest -n 2 --dist loadfile -m "not slow"``, as the README runs it: two
# pytest-xdist workers, each file's tests in one of them) aims at 90 s on 2 cores and takes about
# 105 s (the README says what was last measured): no test in it starts another process, and none
# takes more than a few seconds. A test that starts other processes pays their imports and
# compiles, so it is slow by nature; the others that take seconds are marked ``slow`` where they
# are defined (``--durations`` finds them). Each worker imports this module: its own temp folder
# (in the one the controlling process made), its own leak check, its own compile counter.


def pytest_collection_finish(session: pytest.Session) -> None:
    """Starts the type checker's process as the tests begin when its test is selected, so that
    it runs beside them rather than after them (tests/test_lint.py). Not in a pytest-xdist
    worker: every worker collects every test, and only the one given the test would wait for
    its process (there the test starts it, beside the other worker's tests)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if any(item.nodeid.endswith("test_lint.py::test_mypy_finds_nothing") for item in session.items):
        import test_lint

        test_lint.start_mypy()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("subprocess") or item.get_closest_marker("multiprocess"):
            item.add_marker(pytest.mark.slow)
