"""Where a residual's array comes from when a split's forward runs.

A traced forward returns only the residuals it computes; the others are the call's own input
leaves (weights, the batch) or the function's closed-over constants, which a context takes live,
never copied. A *slot* ``(source, index)`` says which: ``index`` counts within ``consts``, the
flat input leaves, or the executable's outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["FROM_CONST", "FROM_INPUT", "FROM_OUTPUT", "Slot", "of_input", "gather"]

FROM_CONST, FROM_INPUT, FROM_OUTPUT = 0, 1, 2

Slot = tuple[int, int]  # (source, index)


def of_input(j: int, n_consts: int) -> Slot:
    """The slot of the forward jaxpr's ``j``-th input, whose inputs are the constants, then the
    flat input leaves."""
    return (FROM_CONST, j) if j < n_consts else (FROM_INPUT, j - n_consts)


def gather(slots: Sequence[Slot], consts: Sequence[Any], inputs: Sequence[Any], outputs: Sequence[Any]) -> list[Any]:
    """The value at each slot."""
    by_source = (consts, inputs, outputs)
    return [by_source[src][i] for src, i in slots]
