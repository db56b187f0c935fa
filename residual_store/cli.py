"""The ``residual-store`` command line (also ``python -m residual_store``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _cmd_demo(args: argparse.Namespace) -> int:
    from residual_store.demo import DemoConfig, run_demo

    cfg = DemoConfig(steps=args.steps, n_microbatches=args.microbatches)
    result = run_demo(cfg)
    worst = max(result["max_rel_grad_diff"])
    ok = worst < 1e-4
    print(f"gradient check against jax.grad: {'PASS' if ok else 'FAIL'} (max rel. diff {worst:.2e})")
    return 0 if ok else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="residual-store",
        description="Split JAX forward from backward, with typed, storable residuals.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small transformer with a pipeline schedule")
    demo.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    demo.add_argument("--microbatches", type=int, default=8, help="microbatches per step (default 8)")
    demo.set_defaults(run=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
