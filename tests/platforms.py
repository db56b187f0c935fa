"""What the platform the suite runs on computes, cannot compute, and lowers a stored backward for.

CI runs the suite on a CPU, where every answer here is the strict one and nothing changes. The
same suite runs on an accelerator in one process for a developer's own checks (a TPU v5e with
JAX 0.10.2 was the first), where a few dtypes cannot be compiled or computed at all: a test of
one is skipped there with the platform's reason, never passed.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import pytest


def backend() -> str:
    """The platform JAX computes on in this process (asked when a test runs, not at import:
    asking starts JAX's backends, which some tests configure first)."""
    return jax.default_backend()

# Measured on a TPU v5e (JAX 0.10.2), one dtype case a process (an abort ends the process).
_CANNOT: dict[str, dict[str, str]] = {
    "tpu": {
        "complex128": "XLA's TPU compiler aborts the process compiling a complex128 computation",
        "int2": "a TPU has no rank-1 int2 arrays (INVALID_ARGUMENT: INT2 is not supported for rank 1)",
        "uint2": "a TPU has no rank-1 uint2 arrays (INVALID_ARGUMENT: INT2 is not supported for rank 1)",
    },
}
_CANNOT_COMMITTED: dict[str, dict[str, str]] = {
    "tpu": {"int1": "JAX on a TPU computes with no committed int1 array (Unexpected XLA layout override)"},
}


def cannot_compute(case: str, *, committed: bool = False) -> str | None:
    """Why this platform cannot compute with residuals of dtype ``case`` (committed to a device,
    if ``committed``), or ``None`` where it can."""
    reason = _CANNOT.get(backend(), {}).get(case)
    if reason is None and committed:
        reason = _CANNOT_COMMITTED.get(backend(), {}).get(case)
    return reason


def skip_what_cannot_compute(case: str, *, committed: bool = False) -> None:
    """Skips the calling test, with the platform's reason, where :func:`cannot_compute` has one."""
    reason = cannot_compute(case, committed=committed)
    if reason is not None:
        pytest.skip(f"on {backend()}: {reason}")


def lowered_for(requested: Sequence[str]) -> tuple[str, ...]:
    """The platforms a backward exported for ``requested`` is lowered for in this process: this
    platform first, then the others in the order asked (``("cuda", "cpu")`` gives
    ``("cpu", "cuda")`` on a CPU, ``("tpu", "cuda", "cpu")`` on a TPU)."""
    return (backend(), *(p for p in requested if p != backend()))
