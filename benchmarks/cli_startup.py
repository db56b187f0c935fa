"""How long the command line takes to answer what needs no store: ``--help``, a mistyped
subcommand, and ``--version`` (which imports JAX to name its version), against ``python -c pass``.

Run: ``python benchmarks/cli_startup.py [--runs 15]``. Each row is the median wall time of
``--runs`` fresh processes (after one untimed warm-up each), the candidates run round-robin so
that drift on a shared machine hits them alike; the ratio is against the bare interpreter. Goal
(issue 27): ``--help`` and a mistyped subcommand under 0.5 s, which they meet by importing no JAX.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from timing import Case, interleaved_medians

ROOT = Path(__file__).resolve().parents[1]  # the checkout measured (first on the processes' path)

CANDIDATES = {
    "python -c pass": ["-c", "pass"],
    "residual-store --help": ["-m", "residual_store", "--help"],
    "residual-store lss (mistyped)": ["-m", "residual_store", "lss", "/data/s"],
    "residual-store ls --help": ["-m", "residual_store", "ls", "--help"],
    "residual-store --version (imports JAX)": ["-m", "residual_store", "--version"],
}


def _run(args: list[str]) -> subprocess.CompletedProcess[bytes]:
    """One fresh interpreter running ``args``, its output discarded."""
    return subprocess.run(
        [sys.executable, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="processes timed per row (default 15)")
    args = parser.parse_args()
    cases = {name: Case(lambda argv=argv: _run(argv)) for name, argv in CANDIDATES.items()}
    medians = interleaved_medians(cases, args.runs)
    base = medians["python -c pass"]
    width = max(map(len, CANDIDATES))
    print(f"{'command':<{width}}  {'median':>9}  {'x python -c pass':>16}")
    for name, seconds in medians.items():
        print(f"{name:<{width}}  {seconds * 1e3:7.0f} ms  {seconds / base:16.1f}")


if __name__ == "__main__":
    main()
