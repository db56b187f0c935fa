"""Shared fixtures: compile counting through jax.monitoring, fresh random inputs."""

from __future__ import annotations

import contextlib
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
