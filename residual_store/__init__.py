"""residual-store: split JAX forward from backward, with typed, storable residuals."""

from residual_store.backward import backward
from residual_store.cache import CacheInfo
from residual_store.compile_cache import enable_compilation_cache
from residual_store.context import CallSpec, InputAval, ResidualContext, ResidualSpec
from residual_store.errors import (
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
from residual_store.filters import is_inexact
from residual_store.split import Split, split
from residual_store.store import Store
from residual_store.store.inspection import (
    BackwardInfo,
    ContextInfo,
    ResidualInfo,
    SignatureUsage,
    StoreUsage,
    VerifyReport,
)

__version__ = "0.1.0"

__all__ = [
    "split",
    "Split",
    "backward",
    "is_inexact",
    "Store",
    "VerifyReport",
    "ContextInfo",
    "ResidualInfo",
    "BackwardInfo",
    "StoreUsage",
    "SignatureUsage",
    "enable_compilation_cache",
    "ResidualContext",
    "ResidualSpec",
    "CallSpec",
    "InputAval",
    "CacheInfo",
    "ResidualStoreError",
    "SignatureMismatchError",
    "InvalidArgumentError",
    "ContextNotFoundError",
    "InvalidKeyError",
    "CorruptContextError",
    "StoreFullError",
    "BackwardUnavailableError",
    "StoreNotFoundError",
    "ReadOnlyStoreError",
    "StoreUnavailableError",
    "ResidualStoreWarning",
    "RecomputeWarning",
]
