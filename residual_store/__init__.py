"""residual-store: split JAX forward from backward, with typed, storable residuals.

The public names are imported on first use (:pep:`562`): ``import residual_store`` itself costs
no JAX import, so the command line answers ``--help`` at once; the first name used imports them
all, as an eager ``__init__`` would.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# The library's logger prints nothing unless the application configures logging (the logging
# HOWTO, "Configuring Logging for a Library"); without a handler of its own, Python's last-resort
# handler would print its WARNINGs (a failed background write) on stderr.
logging.getLogger("residual_store").addHandler(logging.NullHandler())

# every public name -> the module that defines it (the static face below lists the same)
_EXPORTS = {
    "split": "residual_store._src.split",
    "Split": "residual_store._src.split",
    "backward": "residual_store._src.backward",
    "is_inexact": "residual_store._src.filters",
    "plan": "residual_store._src.plan.request",
    "PlanOptions": "residual_store._src.plan.request",
    "explain": "residual_store._src.plan.request",
    "plan_of": "residual_store._src.plan.request",
    "Plan": "residual_store._src.plan.choose",
    "Decision": "residual_store._src.plan.choose",
    "DeviceProfile": "residual_store._src.plan.profile",
    "device_profile": "residual_store._src.plan.profile",
    "Store": "residual_store._src.store",
    "flush_on_sigterm": "residual_store._src.store.preemption",
    "VerifyReport": "residual_store._src.store.inspection",
    "ContextInfo": "residual_store._src.store.inspection",
    "ResidualInfo": "residual_store._src.store.inspection",
    "BackwardInfo": "residual_store._src.store.inspection",
    "StoreUsage": "residual_store._src.store.inspection",
    "SignatureUsage": "residual_store._src.store.inspection",
    "enable_compilation_cache": "residual_store._src.compile_cache",
    "ResidualContext": "residual_store._src.context",
    "ResidualSpec": "residual_store._src.context",
    "CallSpec": "residual_store._src.context",
    "InputAval": "residual_store._src.context",
    "CacheInfo": "residual_store._src.cache",
    "ResidualStoreError": "residual_store._src.errors",
    "SignatureMismatchError": "residual_store._src.errors",
    "InvalidArgumentError": "residual_store._src.errors",
    "ContextNotFoundError": "residual_store._src.errors",
    "InvalidKeyError": "residual_store._src.errors",
    "CorruptContextError": "residual_store._src.errors",
    "StoreFullError": "residual_store._src.errors",
    "BackwardUnavailableError": "residual_store._src.errors",
    "StoreNotFoundError": "residual_store._src.errors",
    "ReadOnlyStoreError": "residual_store._src.errors",
    "StoreUnavailableError": "residual_store._src.errors",
    "ResidualStoreWarning": "residual_store._src.errors",
    "RecomputeWarning": "residual_store._src.errors",
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:  # the same names, for type checkers and editors
    from residual_store._src.backward import backward
    from residual_store._src.cache import CacheInfo
    from residual_store._src.compile_cache import enable_compilation_cache
    from residual_store._src.context import CallSpec, InputAval, ResidualContext, ResidualSpec
    from residual_store._src.errors import (
        BackwardUnavailableError,
        ContextNotFoundError,
        CorruptContextError,
        InvalidArgumentError,
        InvalidKeyError,
        ReadOnlyStoreError,
        RecomputeWarning,
        ResidualStoreError,
        ResidualStoreWarning,
        SignatureMismatchError,
        StoreFullError,
        StoreNotFoundError,
        StoreUnavailableError,
    )
    from residual_store._src.filters import is_inexact
    from residual_store._src.plan.choose import Decision, Plan
    from residual_store._src.plan.profile import DeviceProfile, device_profile
    from residual_store._src.plan.request import PlanOptions, explain, plan, plan_of
    from residual_store._src.split import Split, split
    from residual_store._src.store import Store
    from residual_store._src.store.inspection import (
        BackwardInfo,
        ContextInfo,
        ResidualInfo,
        SignatureUsage,
        StoreUsage,
        VerifyReport,
    )
    from residual_store._src.store.preemption import flush_on_sigterm


if not TYPE_CHECKING:  # a type checker sees the names above, and no other: a misspelled one is an error

    def __getattr__(name: str) -> Any:
        """The public names, imported (all of them) on the first use of one."""
        if name not in _EXPORTS:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        namespace = globals()
        for public, module in _EXPORTS.items():
            namespace[public] = getattr(importlib.import_module(module), public)
        return namespace[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
