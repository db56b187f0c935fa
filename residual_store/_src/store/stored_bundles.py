"""A context's bundle (its small residuals in one zip file, see :mod:`serializers.bundle`) read
back and checked: one read and one CRC-32 over the whole file on the fast path, residual by
residual only to name what is damaged.

What a read checks is what the manifest's per-residual checksums and the signature's layout say,
not the manifest's word for the whole file: a manifest can be resealed by anyone who can write
the store (its self checksum guards against damage, not against edits), so the bundle's own
checksum in it vouches for nothing its residuals' do not. The residuals' offsets must be where
the layout of the context's residuals puts them (worked out once per layout), and the CRC-32 of
the whole file must be the one those residuals' CRC-32s and the layout's headers imply
(:func:`serializers.bundle.bundle_crc`): one CRC-32 pass as the file lands checks each residual
against its own checksum and every other byte against the headers.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

import residual_store_serializers as serializers
from residual_store._src.context import ResidualSpec
from residual_store._src.errors import CorruptContextError, StoreUnavailableError
from residual_store._src.store import layout
from residual_store._src.store.backend_protocol import Backend, Empty
from residual_store._src.store.critical import StoreLock
from residual_store._src.store.records import StoredContext
from residual_store_serializers import bundle as bundles

__all__ = ["check", "read"]


class _Layout(NamedTuple):
    """The bundle layout of one spec's bundled residuals, and their offsets in it."""

    spec: ResidualSpec  # held, so that its id names no other spec while this is cached
    bundle: bundles.BundleLayout
    offsets: tuple[int, ...]


_LAYOUTS_MAX = 64
_layouts: dict[tuple[int, tuple[int, ...]], _Layout] = {}
_layouts_lock = StoreLock()


def _layout_of(stored: StoredContext) -> _Layout:
    """The bundle layout of ``stored``'s bundled residuals, from :func:`layout.bundle_layout_of`
    (the writer's), remembered per spec object and residuals: a get finds it in one look-up of
    its spec's identity (comparing two equal specs of hundreds of residuals costs more than the
    rest of the check)."""
    spec = stored.spec
    key = (id(spec), stored.bundled)
    found = _layouts.get(key)
    if found is not None and found.spec is spec:
        return found
    records = stored.records
    try:
        made = layout.bundle_layout_of(spec, [(i, records[i].shape, records[i].dtype) for i in stored.bundled])
    except (ValueError, serializers.SerializationError) as err:  # past a zip's limits: no writer's
        raise CorruptContextError(f"context {stored.key!r}: its bundled residuals fit no bundle ({err})") from None
    found = _Layout(spec, made, tuple(a.offset for a in made.arrays))
    with _layouts_lock:
        _layouts.pop(key, None)
        while len(_layouts) >= _LAYOUTS_MAX:
            del _layouts[next(iter(_layouts))]
        _layouts[key] = found
    return found


def _check_offsets(key: str, stored: StoredContext, expected: _Layout) -> None:
    """:class:`CorruptContextError` naming the residual unless the bundle is of the layout's size
    and each bundled residual at the layout's offset for it."""
    ref = stored.bundle
    assert ref is not None
    what = f"context {key!r}, bundle {ref.path}"
    if ref.nbytes != expected.bundle.nbytes:
        raise CorruptContextError(
            f"{what}: the manifest gives it {ref.nbytes:,} bytes, the layout of its residuals "
            f"{expected.bundle.nbytes:,}"
        )
    got = stored.bundle_offsets
    if got != expected.offsets:
        j = next(j for j, (a, b) in enumerate(zip(got, expected.offsets)) if a != b)
        i = stored.bundled[j]
        raise CorruptContextError(
            f"{what}: residual {i} ({stored.records[i].name}) is at byte {got[j]:,} of it in the "
            f"manifest, where the layout of its residuals puts it at byte {expected.offsets[j]:,} "
            "(its arrays' offsets are not where this layout puts them)"
        )


def _expected_crc(key: str, stored: StoredContext) -> str:
    """The checksum the whole bundle of ``stored`` must have (``"crc32:..."``): the CRC-32 its
    residuals' CRC-32s and its layout imply, after its offsets are checked against the layout."""
    expected = _layout_of(stored)
    _check_offsets(key, stored, expected)
    return bundles.crc_checksum(bundles.bundle_crc(expected.bundle, stored.bundle_crcs))


def read(backend: Backend, key: str, stored: StoredContext, *, empty: Empty | None = None) -> dict[int, np.ndarray]:
    """The bundled residuals of ``key``, as views into one buffer: the bundle read in one call
    and checked as it lands against the CRC-32 of the whole file that the residuals' own
    CRC-32s and the layout imply (no work per residual but its view); the offsets the views
    are taken at are the layout's. On a mismatch the file is checked residual by residual, so
    that the error names the damaged one."""
    ref = stored.bundle
    assert ref is not None
    what = f"context {key!r}, bundle {ref.path}"
    expected = _expected_crc(key, stored)
    try:
        buffer = backend.read_file(ref.path, ref.nbytes, checksum=expected, empty=empty)
    except StoreUnavailableError:
        raise  # no answer is no damage
    except serializers.ChecksumMismatchError as err:
        # Which part: a residual (named), or the headers. The file is read again for that, and
        # may be gone by now (its context replaced or deleted meanwhile): check says so too.
        whole = f"checksum mismatch of the whole file: its CRC-32 is not the {expected} that its residuals' and its layout imply"
        try:
            check(backend, key, stored)
        except CorruptContextError as found:
            raise CorruptContextError(f"{found} ({whole})") from err
        raise CorruptContextError(f"{what}: {whole}") from err
    except serializers.CorruptDataError as err:  # missing, truncated, not a regular file
        raise CorruptContextError(f"{what}: {err}") from err
    except OSError as err:
        raise CorruptContextError(f"{what}: unreadable ({err})") from err
    return dict(zip(stored.bundled, bundles.bundle_views(stored.bundle_arrays, buffer)))


def check(backend: Backend, key: str, stored: StoredContext, buffer: np.ndarray | None = None) -> None:
    """Checks every byte of ``key``'s bundle (read here unless given): the offsets against the
    layout, each residual's bytes against its checksum, every other byte against the headers its
    writer wrote (which plain zip readers check): :class:`CorruptContextError` naming the
    residual or the headers."""
    ref = stored.bundle
    if ref is None:
        return
    indices = stored.bundled
    records = [stored.records[i] for i in indices]
    what = f"context {key!r}, bundle {ref.path}"
    expected = _layout_of(stored)
    _check_offsets(key, stored, expected)
    try:
        if buffer is None:
            buffer = backend.read_file(ref.path, ref.nbytes)
        sums: list[Any] = [r.checksum if r.nbytes else None for r in records]
        names = [f"residual {i} ({r.name})" for i, r in zip(indices, records)]
        bundles.check_bundle(expected.bundle, buffer, sums, what=what, names=names)
    except StoreUnavailableError:
        raise  # no answer is no damage
    except (serializers.SerializationError, ValueError) as err:  # missing, of another size, damaged
        raise CorruptContextError(str(err) if str(err).startswith(what) else f"{what}: {err}") from err
    except OSError as err:
        raise CorruptContextError(f"{what}: unreadable ({err})") from err
