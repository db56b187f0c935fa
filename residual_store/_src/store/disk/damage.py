"""How the store says a context is damaged, in one wording wherever it is met: ``get``,
``arrays``, ``verify``, ``info``'s ``damage``, and so the command line's ``ls``, ``inspect``,
``verify``, ``export`` and ``diff``.

The damaged file is named once, by its path in the store (``bundle data/mb1.<id>/bundle.zip is
truncated (1,179 bytes on disk, the manifest says 2,359)``), and the error says what to do next.
A file of the wrong size or missing is found with one ``stat`` per file (:func:`size_damage`,
what ``ls`` can afford for every context); a changed byte only by reading it, in the words of the
check that found it, without the key (said once, by whoever reports it).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import residual_store_serializers as serializers
from residual_store._src.errors import CorruptContextError
from residual_store._src.store.disk import paths
from residual_store._src.store.disk.protocol import Backend
from residual_store._src.store.disk.records import StoredContext

__all__ = ["damaged_context", "manifest_damage", "size_damage", "size_words", "without_key"]


def size_words(what: str, size: int, expected: int) -> str:
    """``what`` (a file in words) of ``size`` bytes where its manifest says ``expected``."""
    kind = "truncated" if size < expected else "too long"
    return f"{what} is {kind} ({size:,} bytes on disk, the manifest says {expected:,})"


def _sized_files(stored: StoredContext) -> Iterator[tuple[str, str, int]]:
    """(its name in words, path, bytes) of each file of ``stored`` whose size its manifest
    fixes: the bundle (its recorded size) and each chunk file of an array outside it (its
    chunk's raw bytes, the only codec being ``bytes``; an array with no element has none)."""
    if stored.bundle is not None:
        yield f"bundle {stored.bundle.path}", stored.bundle.path, stored.bundle.nbytes
    seen: set[str] = set()
    for i, r in enumerate(stored.records):
        if r.bundled or r.path in seen or math.prod(r.shape) == 0:
            continue
        seen.add(r.path)
        try:
            itemsize = serializers.numpy_dtype(r.dtype).itemsize
        except (serializers.SerializationError, ValueError, TypeError):
            continue  # a dtype this process cannot read: get and verify say so
        if r.chunk_shape is None:
            files = [("/".join((r.path, serializers.chunk_key(r.shape) or "")), math.prod(r.shape) * itemsize)]
        else:
            chunk_bytes = math.prod(r.chunk_shape) * itemsize
            chunks = (serializers.chunk_index_key(idx) for idx, _ in r.chunk_checksums or ())
            files = [("/".join((r.path, chunk)), chunk_bytes) for chunk in chunks]
        for path, nbytes in files:
            yield f"residual {i} ({r.name}): file {path}", path, nbytes


def size_damage(backend: Backend, stored: StoredContext) -> str | None:
    """The first file of ``stored`` that is missing or of another size than its manifest says,
    in words naming it once (``None``: every size is right, or the storage gives no sizes).

    One ``stat`` per file and nothing read. A truncated copy or a half-written file shows here;
    a flipped byte only when it is read."""
    for what, path, expected in _sized_files(stored):
        try:
            size = backend.tree_bytes(path)
            if size is None:
                return None  # a kvstore: listings give no sizes
            if size == expected:
                continue
            if size == 0 and not backend.exists(path):
                return f"{what} is missing"
        except CorruptContextError as err:  # a link on the way, refused
            return f"{what} cannot be read: {err}"
        return size_words(what, size, expected)
    return None


def without_key(key: str, text: str) -> str:
    """``text`` (a check's words about context ``key``) without its leading naming of the key."""
    for prefix in (f"manifest of context {key!r}: ", f"context {key!r}, ", f"context {key!r}: "):
        if text.startswith(prefix):
            return text[len(prefix) :]
    return text


def manifest_damage(key: str, err: BaseException) -> str:
    """What is wrong with ``key``'s manifest, naming the file once."""
    return f"manifest {paths.manifest_path(key)}: {without_key(key, str(err))}"


def damaged_context(key: str, why: str) -> CorruptContextError:
    """The error of a read of the damaged context ``key`` (``why``: what is damaged, naming its
    file once), with what to do next; ``key`` and ``damage`` are kept on it for a program that
    words its own advice (the command line)."""
    error = CorruptContextError(
        f"context {key!r} is damaged: {why}. Next: store.delete({key!r}) removes it (gc then frees its "
        "files), or put it again, or restore the checkpoint step that saved it; store.verify() checks "
        "every context"
    )
    error.key, error.damage = key, why
    return error
