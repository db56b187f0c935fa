"""How the command line reads its numbers (argparse types) and writes them (sizes, ages,
tables, counts, the progress line on a terminal): plain text helpers, no JAX, no store."""

from __future__ import annotations

import argparse
import sys
import time

from residual_store._src.durations import parse_duration

__all__ = ["Progress", "age", "count", "duration", "human", "plural", "seconds", "status_line", "table"]


def plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else plural or word + 's'}"


def duration(text: str) -> float:
    """Seconds from ``"90"``, ``"90s"``, ``"15m"``, ``"1h"`` or ``"2d"`` (argparse type): the
    forms ``Store.gc(older_than=...)`` takes, read by the same parser."""
    try:
        return parse_duration(text, "--older-than")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--older-than: ")) from None


def seconds(text: str) -> float:
    """A positive number of seconds (argparse type of ``--timeout``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: a timeout is a positive number of seconds")
    return value


def count(text: str) -> int:
    """A whole number of at least 1 (argparse type of the demo's ``--steps``, ``--microbatches``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 1")
    return value


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{max(seconds, 0):.0f}s"


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


def status_line(text: str) -> None:
    """Draws ``text`` as the one status line on stderr, over the last one (``""`` erases it),
    for the caller to use where stderr is a terminal."""
    sys.stderr.write(f"\r{text}\x1b[K")
    sys.stderr.flush()


class Progress:
    """A line on stderr, redrawn as bytes go by (at most ten times a second) and erased at the
    end, only where stderr is a terminal: a callable for the ``progress`` argument of
    :class:`~residual_store.Store` methods."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.shown = sys.stderr.isatty()
        self.start = time.monotonic()
        self.last = float("-inf")
        self.drawn = False

    def __call__(self, done: int, total: int | None = None) -> None:
        now = time.monotonic()
        if not self.shown or (now - self.last < 0.1 and done != total):
            return
        self.last = now
        whole = f" of {human(total)}" if total else ""
        status_line(f"{self.label}: {human(done)}{whole} ({now - self.start:.1f} s)")
        self.drawn = True

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.drawn:  # the result follows on stdout, on a clean line
            status_line("")
