"""Shared fixtures: compile counting through jax.monitoring, fresh random inputs."""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from collections.abc import Iterator

import jax
import pytest

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Counts XLA backend compiles seen through ``jax.monitoring`` while active."""

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


# -- nothing left in the system temp folder -----------------------------------------------------

_OUR_PREFIXES = ("residual-store-", "rs-", "zero-bubble-", "resume-", "offload-example-", "mp-store-")


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


def _ours_in_temp() -> set[str]:
    root = tempfile.gettempdir()
    found = set()
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if not name.startswith("pytest-of-") and os.path.isdir(path) and not os.path.islink(path) and _is_ours(path, name):
            found.add(name)
    return found


@pytest.fixture(scope="session", autouse=True)
def nothing_left_in_the_temp_folder() -> Iterator[None]:
    """The suite (docs examples, examples, subprocesses) leaves no store or folder of ours in the
    system temp folder; pytest's own ``tmp_path`` folders are pytest's to keep."""
    before = _ours_in_temp()
    yield
    left = sorted(_ours_in_temp() - before)
    assert not left, f"the tests left these in {tempfile.gettempdir()}: {left}"
