"""A context's bundle (its small residuals in one zip file, see :mod:`serializers.bundle`) read
back and checked: one read and one whole-file checksum on the fast path, residual by residual
only to name what is damaged."""

from __future__ import annotations

import numpy as np

import serializers
from residual_store._src.errors import CorruptContextError, StoreUnavailableError
from residual_store._src.store import layout
from residual_store._src.store.backend_protocol import Backend, Empty
from residual_store._src.store.records import StoredContext
from serializers import bundle as bundles

__all__ = ["check", "read"]


def read(backend: Backend, key: str, stored: StoredContext, *, empty: Empty | None = None) -> dict[int, np.ndarray]:
    """The bundled residuals of ``key``, as views into one buffer: the bundle read in one
    call and checked against its whole-file checksum as it lands (no work per residual but
    its view). On a mismatch the file is checked residual by residual, so that the error
    names the damaged one."""
    ref = stored.bundle
    assert ref is not None
    what = f"context {key!r}, bundle {ref.path}"
    try:
        buffer = backend.read_file(ref.path, ref.nbytes, checksum=ref.checksum, empty=empty)
    except StoreUnavailableError:
        raise  # no answer is no damage
    except serializers.ChecksumMismatchError as err:
        # Which part: a residual (named), or the headers. The file is read again for that, and
        # may be gone by now (its context replaced or deleted meanwhile): check says so too.
        try:
            check(backend, key, stored)
        except CorruptContextError as found:
            raise CorruptContextError(f"{found} (the whole {err})") from err
        raise CorruptContextError(f"{what}: {err}") from err
    except serializers.CorruptDataError as err:  # missing, truncated, not a regular file
        raise CorruptContextError(f"{what}: {err}") from err
    except OSError as err:
        raise CorruptContextError(f"{what}: unreadable ({err})") from err
    return dict(zip(stored.bundled, bundles.bundle_views(stored.bundle_arrays, buffer)))


def check(backend: Backend, key: str, stored: StoredContext, buffer: np.ndarray | None = None) -> None:
    """Checks every byte of ``key``'s bundle (read here unless given): each residual's bytes
    against its checksum, every other byte against the headers its writer wrote (which plain
    zip readers check): :class:`CorruptContextError` naming the residual or the headers."""
    ref = stored.bundle
    if ref is None:
        return
    indices = stored.bundled
    records = [stored.records[i] for i in indices]
    what = f"context {key!r}, bundle {ref.path}"
    try:
        if buffer is None:
            buffer = backend.read_file(ref.path, ref.nbytes)
        bundle_layout = layout.bundle_layout_of(stored.spec, [(i, r.shape, r.dtype) for i, r in zip(indices, records)])
        if tuple(a.offset for a in bundle_layout.arrays) != tuple(r.offset for r in records):
            raise serializers.CorruptDataError("its arrays' offsets are not where this layout puts them")
        sums = [r.checksum if r.nbytes else None for r in records]
        names = [f"residual {i} ({r.name})" for i, r in zip(indices, records)]
        bundles.check_bundle(bundle_layout, buffer, sums, what=what, names=names)
    except StoreUnavailableError:
        raise  # no answer is no damage
    except (serializers.SerializationError, ValueError) as err:  # missing, of another size, damaged
        raise CorruptContextError(str(err) if str(err).startswith(what) else f"{what}: {err}") from err
    except OSError as err:
        raise CorruptContextError(f"{what}: unreadable ({err})") from err
