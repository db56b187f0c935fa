"""Timing shared by the benchmarks: medians of repeated runs, and candidates timed round-robin.

Every number a benchmark prints is a median of timed runs after an untimed warm-up (the first
run pays page faults and compiles); candidates compared in one table run round-robin, each round
starting one candidate later, so that drift on a shared machine hits them alike.
"""

from __future__ import annotations

import dataclasses
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["Case", "cpu_seconds", "interleaved_medians", "timed"]


def timed(fn: Callable[[], object], setup: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn()`` (until its result is ready) over ``repeats`` runs, each after
    ``setup()``, after one untimed run, so that every row finds the allocator and page cache in
    the same warm state (otherwise the first reader pays the page faults)."""
    return interleaved_medians({"fn": Case(fn, setup)}, repeats)["fn"]


def cpu_seconds() -> tuple[float, float]:
    """User and system CPU seconds of this process so far, all its threads."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


@dataclasses.dataclass
class Case:
    """One candidate: ``fn`` is timed (until its result is ready); setup/teardown are not.
    ``cpu`` collects the (user, system) CPU seconds of each timed run."""

    fn: Callable[[], Any]
    setup: Callable[[], Any] | None = None
    teardown: Callable[[], Any] | None = None
    cpu: list[tuple[float, float]] = dataclasses.field(default_factory=list)

    def run(self) -> float:
        if self.setup is not None:
            self.setup()
        user, system = cpu_seconds()
        start = time.perf_counter()
        jax.block_until_ready(self.fn())
        elapsed = time.perf_counter() - start
        user_end, system_end = cpu_seconds()
        self.cpu.append((user_end - user, system_end - system))
        if self.teardown is not None:
            self.teardown()
        return elapsed

    def median_cpu(self) -> tuple[float, float]:
        return tuple(statistics.median(c[i] for c in self.cpu) for i in range(2))  # type: ignore[return-value]


def interleaved_medians(cases: dict[str, Case], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds per candidate, timing them round-robin so that drift on a shared machine
    affects every candidate alike; each round starts one candidate later, so that none always
    runs right after the same neighbour (whose freed memory or deleted files it might pay for)."""
    for case in cases.values():
        for _ in range(warmup):
            case.run()
        case.cpu.clear()
    times: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(cases[name].run())
    return {name: statistics.median(ts) for name, ts in times.items()}
