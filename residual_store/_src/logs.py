"""The library's logger, ``logging.getLogger("residual_store")``: commits, failed writes, gc and
collective steps, each record tagged with the JAX process index, so the logs of a multi-process
job can be merged and read.

Nothing is printed unless the application configures logging; for example
``logging.basicConfig(level=logging.DEBUG)`` shows every commit, ``INFO`` what gc removed and
``WARNING`` failed writes.

Example:
  >>> import logging
  >>> logging.getLogger("residual_store").name
  'residual_store'
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["LOGGER", "event"]

LOGGER = logging.getLogger("residual_store")
# its NullHandler is added by the package's __init__, at import (before any record)


def _process_index() -> int:
    try:
        import jax

        return int(jax.process_index())
    except Exception:  # noqa: BLE001 - before a backend exists, or without JAX: process 0
        return 0


def event(level: int, what: str, **fields: Any) -> None:
    """Logs ``what`` with ``fields`` as ``key=value`` pairs and the process index (the record
    also carries them as ``record.rs_process`` and ``record.rs_fields``)."""
    if not LOGGER.isEnabledFor(level):
        return
    process = _process_index()
    text = " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in fields.items())
    LOGGER.log(level, "[process %d] %s %s", process, what, text, extra={"rs_process": process, "rs_fields": fields})
