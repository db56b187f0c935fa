"""The residual store: tiers (device, host, disk), the disk format, background I/O."""

from residual_store._src.store.store import Store

__all__ = ["Store"]
