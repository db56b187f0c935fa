"""A device's speeds as the planner reads them: :class:`DeviceProfile`.

A plan weighs seconds against bytes: recomputing a residual costs its FLOPs at the device's
matmul rate (or its bytes at the memory's rate), moving it to host memory and back costs its
bytes at the link's rates, less what hides behind the compute beside the copy. Those rates
are a device kind's, so they are measured once per kind
(:mod:`residual_store._src.plan.measure`) and kept in memory, and on disk where the caller names
a folder; CPU and TPU v5e have built-in profiles (the issue's measurements on a v5e), so nothing
needs to measure to plan for them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import threading
from pathlib import Path
from typing import Any

from residual_store._src.errors import InvalidArgumentError

__all__ = ["CPU", "TPU_V5E", "DeviceProfile", "builtin_profile", "device_profile"]


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """What one kind of device does per second, as the planner's cost model reads it.

    Attributes:
      kind: the device kind it describes (``jax.Device.device_kind``), e.g. ``"cpu"``.
      matmul_flops: matrix-product FLOP/s at the model's precision.
      memory_bytes: device memory bytes/s (what an elementwise pass costs).
      d2h_bytes: device-to-host bytes/s of a store's copies (through its pool of reused pinned
        buffers), or ``None`` where there is no link (a CPU: host memory is the device's, so
        moving a residual there frees nothing).
      h2d_bytes: host-to-device bytes/s, or ``None`` likewise.
      duplex: whether the link moves both ways at once.
      hidden_forward: the seconds (0..1) of a forward's copy to host that hide behind a second
        of the matrix products beside it: the share of the copy hidden behind equal compute;
        behind ``r`` times the copy's time, ``min(1, r * hidden_forward)`` of it (the copies of
        one scan body share its compute: :func:`residual_store._src.plan.cost.copy_seconds`).
      hidden_backward: the same for a backward's copy back, beside the backward's products.
      program_d2h_bytes: device-to-host bytes/s of a plan's in-program offload where it differs
        from a store's copies (``None``: ``d2h_bytes``; the forward writes into donated pinned
        buffers, at the link's rate; a device whose program outputs pin fresh memory is slower).

    Invariant: ``d2h_bytes`` and ``h2d_bytes`` are both ``None`` or both positive.
    """

    kind: str
    matmul_flops: float
    memory_bytes: float
    d2h_bytes: float | None = None
    h2d_bytes: float | None = None
    duplex: bool = False
    hidden_forward: float = 0.0
    hidden_backward: float = 0.0
    program_d2h_bytes: float | None = None

    def __post_init__(self) -> None:
        for name in ("matmul_flops", "memory_bytes"):
            _positive(name, getattr(self, name))
        if (self.d2h_bytes is None) != (self.h2d_bytes is None):
            raise InvalidArgumentError("a device profile gives both link rates (d2h_bytes, h2d_bytes) or neither")
        if self.d2h_bytes is not None:
            _positive("d2h_bytes", self.d2h_bytes)
            _positive("h2d_bytes", self.h2d_bytes)
        if self.program_d2h_bytes is not None:
            _positive("program_d2h_bytes", self.program_d2h_bytes)
        for name in ("hidden_forward", "hidden_backward"):
            share = getattr(self, name)
            if not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
                raise InvalidArgumentError(f"DeviceProfile.{name} must be a share in [0, 1], got {share!r}")

    @property
    def has_link(self) -> bool:
        """Whether offloading to host memory frees device memory here."""
        return self.d2h_bytes is not None

    @property
    def program_d2h(self) -> float | None:
        """Device-to-host bytes/s of an in-program offload, or ``None`` without a link."""
        return None if self.d2h_bytes is None else self.program_d2h_bytes or self.d2h_bytes

    @property
    def digest(self) -> str:
        """A short digest of every number: two profiles that plan differently never share it."""
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InvalidArgumentError(f"DeviceProfile.{name} must be a positive number, got {value!r}")


CPU = DeviceProfile(kind="cpu", matmul_flops=5e10, memory_bytes=1e10)
"""A modest CPU core: no link (host memory is the device's), so a CPU plan keeps or recomputes."""

TPU_V5E = DeviceProfile(
    kind="TPU v5 lite",
    matmul_flops=165e12,  # bf16
    memory_bytes=819e9,
    d2h_bytes=13.4e9,  # into the pool's reused, donated pinned buffers
    h2d_bytes=14e9,
    duplex=True,  # 1 GiB each way in one program: 83 ms, against 74 and 77 one way
    hidden_forward=2 / 3,  # a forward's per-layer copies into donated buffers hid about 2/3 behind equal compute
    # a backward reading a scan's stack a slice ahead: the offloaded step (layer inputs, 72 MiB
    # each way) ran 2.4 ms over the same step keeping them, for 11 ms of copies (2026-12-06)
    hidden_backward=0.9,
)
"""A TPU v5e chip, from the measurements of issue 51 (main 838ccdd). A plan's in-program offload
writes into pinned buffers the split donates to its forward (:mod:`residual_store._src.scratch`),
at the link's rate, a scan's stacks an iteration at a time."""

_BUILTIN = {"cpu": CPU, "tpu v5 lite": TPU_V5E, "tpu v5e": TPU_V5E}
_MEASURED: dict[str, DeviceProfile] = {}  # device kind -> profile measured in this process
_LOCK = threading.Lock()


def builtin_profile(kind: str) -> DeviceProfile | None:
    """The built-in profile of a device kind (``"cpu"``, ``"TPU v5 lite"``), or ``None``."""
    return _BUILTIN.get(kind.strip().lower())


def device_profile(device: Any = None, *, remeasure: bool = False, cache_dir: str | os.PathLike[str] | None = None) -> DeviceProfile:
    """The profile of ``device``'s kind (default: JAX's first device).

    A built-in profile where there is one (unless ``remeasure``); else one measured in this
    process before, or read from ``cache_dir`` (a folder: one JSON file per device kind), or
    measured now (:func:`residual_store._src.plan.measure.measure`: about a second without a
    link, ten with one on a TPU v5e, most of it compiling) and kept in memory and in
    ``cache_dir``.
    """
    import jax

    device = jax.devices()[0] if device is None else device
    kind = str(device.device_kind)
    if not remeasure and (found := builtin_profile(kind)) is not None:
        return found
    with _LOCK:
        if not remeasure and kind in _MEASURED:
            return _MEASURED[kind]
        path = _cache_file(cache_dir, kind) if cache_dir is not None else None
        profile = _read(path) if path is not None and not remeasure else None
        if profile is None:
            from residual_store._src.plan import measure  # (it builds programs: only when asked)

            profile = measure.measure(device)
            if path is not None:
                _write(path, profile)
        _MEASURED[kind] = profile
        return profile


def _cache_file(cache_dir: str | os.PathLike[str], kind: str) -> Path:
    name = "".join(c if c.isalnum() else "-" for c in kind.lower())
    return Path(cache_dir).expanduser() / f"profile-{name}.json"


def _read(path: Path) -> DeviceProfile | None:
    """The profile cached at ``path``; ``None`` where there is none or it is unreadable."""
    try:
        return DeviceProfile(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, InvalidArgumentError):
        return None


def _write(path: Path, profile: DeviceProfile) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(dataclasses.asdict(profile), sort_keys=True))
    os.replace(tmp, path)  # a reader sees the old file or the new one, never half of one
