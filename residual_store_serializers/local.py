"""The local-file fast path: zarr v3 arrays in a plain local folder, with ``os`` calls only.

It writes each chunk with ``os.write`` straight from the array's buffer (no copy),
``zarr.json`` after it, and fsyncs files and folders when asked; it reads a chunk
with one ``readv`` into a 64-byte aligned buffer (:func:`aligned_empty`), so a later
``jax.device_put`` on CPU can use the memory in place. Sizes are checked against the
expected shape before reading. The bytes are those of :mod:`serializers.zarr`, the
same as :mod:`serializers.kv` writes and reads.

Chunked arrays (:class:`~serializers.zarr.ChunkedArray`) are written chunk by chunk,
possibly by several writers that each hold some chunks (:func:`write_chunks_local`),
and read chunk by chunk (:func:`read_chunk_local`). A chunk write never removes the
array's other chunks, so write into a fresh folder or one holding an array of the
same layout.

Safety: every file is opened without following a symbolic link and without blocking,
and every folder below the store's root is checked not to be a link (the primitives of
:mod:`serializers.files`), so a damaged or hostile store is refused, never followed outside
its root.

Errors: a missing, truncated or oversized chunk, missing or mismatching metadata ->
:class:`~serializers.errors.CorruptDataError` naming the file. ``ENOSPC``/``EFBIG``/
``EDQUOT`` while writing -> :class:`~serializers.errors.DiskFullError`, after removing
what that write had created.
"""

from __future__ import annotations

import functools
import os
import shutil
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

import numpy as np

from .aligned import ALIGNMENT, aligned_empty
from .checksums import Verifier
from .errors import CorruptDataError
from .files import (
    Folders,
    Undo,
    check_folders_local,
    fsync_file,
    fsync_folder_local,
    is_regular,
    overwrite_file_in_place,
    read_file_exact_local,
    read_file_local,
    read_sized_file,
    sync_data,
    write_file,
    write_file_local,
)
from .zarr import (
    CHUNK_KEY_SEPARATOR,
    MAX_METADATA_BYTES,
    METADATA_KEY,
    ArrayRead,
    ChunkedArray,
    DTypeLike,
    PathLike,
    Shape,
    check_attributes,
    check_relpath,
    check_zarr_metadata,
    describe_arrays,
    disk_array,
    disk_chunks,
    disk_metadata,
)

# The file primitives (serializers.files) and aligned buffers (serializers.aligned) are named
# here too, as before they had modules of their own: ``from serializers.local import ...`` of
# them keeps working.
__all__ = [
    "write_arrays_local",
    "read_array_local",
    "read_arrays_local",
    "write_chunks_local",
    "read_chunk_local",
    "check_array_metadata_local",
    # re-exported from serializers.aligned and serializers.files
    "ALIGNMENT",
    "aligned_empty",
    "read_file_local",
    "check_folders_local",
    "fsync_folder_local",
    "sync_data",
    "write_file_local",
    "read_file_exact_local",
]

_IO_THREADS: Final[int] = 4
_io_pool: ThreadPoolExecutor | None = None
_io_pool_lock = threading.Lock()


def _in_parallel(fn: Callable[[Any], None], items: Sequence[Any], *, parallel: bool = True) -> None:
    """Runs ``fn`` over ``items`` on a few threads (in this one unless ``parallel``), waits for
    all, raises the first error.

    File creation, writes and fsyncs release the GIL and the filesystem overlaps them
    (measured 2026-11-29 on the 2-core development machine, ext4: 25 small arrays 23 ms -> 11
    ms; 62 fsyncs 121 ms -> 14 ms).
    """
    global _io_pool
    if len(items) <= 1 or not parallel:
        for item in items:
            fn(item)
        return
    with _io_pool_lock:
        if _io_pool is None:
            _io_pool = ThreadPoolExecutor(_IO_THREADS, thread_name_prefix="serializers-io")
    futures = [_io_pool.submit(fn, item) for item in items]
    errors = [f.exception() for f in futures]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first


def _overwrite_in_place(
    folder: str, a: np.ndarray, meta: Callable[[], bytes] | None, undo: Undo, *, fsync: bool
) -> bool:
    """Writes ``a`` over the chunk of an existing array of the same shape and dtype, creating no
    file or folder (creations dominate small writes here); ``False`` if there is no such chunk.

    The caller vouches that the folder holds an array of ``a``'s shape and dtype; the chunk's
    size is checked, and ``zarr.json`` is rewritten only if it differs from ``meta()`` (other
    attributes); ``meta`` ``None``: the caller vouches for its attributes too, and it is kept.
    """
    chunks = disk_chunks(a)
    if chunks:
        ((key, view),) = chunks
        if not overwrite_file_in_place(os.path.join(folder, key), view, undo, fsync=fsync):
            return False
    elif not is_regular(os.path.join(folder, METADATA_KEY)):
        return False
    if meta is not None:
        _write_metadata_local(folder, meta(), undo, reuse=True, fsync=fsync)
    return True


def _write_chunk_local(folder: str, key: str, view: memoryview, undo: Undo, *, reuse: bool, fsync: bool) -> None:
    p = os.path.join(folder, key)
    if reuse and overwrite_file_in_place(p, view, undo, fsync=fsync):
        return
    write_file(p, view, undo, fsync=fsync)


def _write_metadata_local(folder: str, meta: bytes, undo: Undo, *, reuse: bool, fsync: bool) -> None:
    """Writes ``meta`` as the folder's ``zarr.json``; with ``reuse``, one already holding exactly
    these bytes (a recycled folder of the same layout and attributes) is kept as it is."""
    p = os.path.join(folder, METADATA_KEY)
    if reuse and _holds(p, meta):
        return
    write_file(p, memoryview(meta), undo, fsync=fsync)


def _holds(p: str, data: bytes) -> bool:
    """Whether ``p`` is a regular file itself (not through a link) holding exactly ``data``."""
    if not is_regular(p):
        return False
    try:
        return read_file_local(p, max_bytes=len(data)) == data
    except CorruptDataError:  # larger, or swapped for something else meanwhile: rewritten
        return False


def _call(task: Callable[[], None]) -> None:
    task()


def _write_small_file(
    root: str,
    path: str,
    data: bytes | Sequence[memoryview | bytes],
    undo: Undo,
    *,
    fsync: bool,
    temporary: bool,
    reuse: bool = False,
) -> None:
    """Writes ``data`` (bytes, or buffers one after another: a bundle) as the file ``path`` (its
    folder made by the caller); overwriting one that is there changes no folder's entries, nor
    does a ``temporary`` one (its caller renames it and syncs the folder then). With ``reuse``, a
    file of exactly this size there (a recycled folder's) is overwritten in place."""
    p = os.path.join(root, *path.split("/"))
    view = memoryview(data) if isinstance(data, bytes | bytearray | memoryview) else data
    if reuse and overwrite_file_in_place(p, view, undo, fsync=fsync):
        return
    write_file(p, view, undo, fsync=fsync, new_name=not temporary and not is_regular(p))


def _write_one_local(
    root: str,
    path: str,
    arr: Any,
    undo: Undo,
    *,
    fsync: bool,
    reuse: bool = False,
    keep_metadata: bool = False,
    attributes: Mapping[str, Any] | None = None,
) -> None:
    a = disk_array(arr)  # path: checked by the caller
    folder = os.path.join(root, *path.split("/"))
    fresh = undo.makedirs(folder)  # a folder this call made holds no stale chunks
    meta = None if keep_metadata else functools.partial(disk_metadata, a, attributes)
    if reuse and not fresh and _overwrite_in_place(folder, a, meta, undo, fsync=fsync):
        return
    meta_bytes = disk_metadata(a, attributes)
    for name in [] if fresh else os.listdir(folder):  # chunks of an array this one replaces
        if name == "c" or name.startswith("c" + CHUNK_KEY_SEPARATOR):
            stale = os.path.join(folder, name)
            if os.path.isdir(stale) and not os.path.islink(stale):
                shutil.rmtree(stale)
            else:
                os.unlink(stale)
    for key, view in disk_chunks(a):
        write_file(os.path.join(folder, key), view, undo, fsync=fsync, fresh=fresh)
    write_file(os.path.join(folder, METADATA_KEY), memoryview(meta_bytes), undo, fsync=fsync, fresh=fresh)


def write_arrays_local(
    root: PathLike,
    arrays: Mapping[str, Any],
    *,
    fsync: bool = False,
    reuse: bool = False,
    write_metadata: bool = True,
    attributes: Mapping[str, Mapping[str, Any]] | None = None,
    files: Mapping[str, bytes | Sequence[memoryview | bytes]] | None = None,
    keep_metadata: bool = False,
    sync_folders: Sequence[str] = (),
    temporaries: Mapping[str, bytes] | None = None,
) -> None:
    """Writes ``{path: array}`` as zarr v3 arrays under the local folder ``root``.

    The fast path: plain ``os.write`` of each array's own buffer (no copy for a
    C-contiguous little-endian array), the chunk first and ``zarr.json`` last.
    Existing arrays at these paths are replaced.

    Args:
      root: the store folder; created if missing.
      arrays: relative array path -> array.
      fsync: fsync every file written and every folder that gained an entry, so
        the arrays survive a power loss once this returns.
      reuse: the paths hold arrays of the same shapes and dtypes that nobody
        reads any more (a recycled folder): overwrite their chunks in place, and
        their ``zarr.json`` only where its bytes differ (other attributes).
      write_metadata: write the ``zarr.json`` of :class:`ChunkedArray` values (a
        writer of some chunks of an array whose metadata another writer writes
        passes ``False``). Plain arrays always get theirs.
      attributes: array path (a key of ``arrays``) -> the zarr attributes of that
        array, a JSON-able mapping written into its ``zarr.json`` (none for a path
        not given).
      keep_metadata: with ``reuse``, the caller vouches that the arrays there have
        these very attributes too (its record of the folder's layout says so): their
        ``zarr.json`` is kept without being read (one open and read less per array).
      sync_folders: relative paths of other folders to fsync with the rest (with
        ``fsync``): ones the caller renamed something into.
      temporaries: like ``files``, for files the caller renames into place itself
        (and then syncs that folder): their own folder is not synced here.
      files: relative file path -> bytes of other files written with the arrays (a
        group's ``zarr.json``), or a sequence of buffers written one after another (a
        bundle, :mod:`serializers.bundle`), created or overwritten where they are (not
        atomically: for files that commit nothing; with ``reuse``, a file of the same size
        is overwritten in place), fsynced alike.

    A value may be a :class:`ChunkedArray`: its chunks are written as files
    ``c.i.j`` (in parallel with everything else), then its ``zarr.json``; the
    array's other chunks, if any are there, are left alone.

    Raises:
      ValueError, TypeError: an unsafe path, or attributes JSON cannot hold or for a
        path not in ``arrays``, before any array is written.
      DiskFullError: on ``ENOSPC``/``EFBIG``/``EDQUOT``; every file and folder
        this call created is removed first. Any other error removes them too.
    """
    root = os.path.normpath(os.fspath(root))
    attrs = attributes or {}
    undo = Undo(root)
    try:
        undo.makedirs(root)
        others = {**(files or {}), **(temporaries or {})}
        for path in [*arrays, *others]:
            check_relpath(path)
        check_attributes(arrays, attributes)
        for parent in sorted({os.path.dirname(os.path.join(root, *p.split("/"))) for p in [*arrays, *others]}):
            undo.makedirs(parent)  # shared parents first; each array's own folder in parallel
        plain = [(p, a) for p, a in arrays.items() if not isinstance(a, ChunkedArray)]
        chunked = [(p, a) for p, a in arrays.items() if isinstance(a, ChunkedArray)]
        folders = {p: os.path.join(root, *p.split("/")) for p, _ in chunked}
        for p, _ in chunked:
            undo.makedirs(folders[p])
        # Each file is fsynced on the descriptor that wrote it, by the thread that wrote it.
        tasks: list[Callable[[], None]] = [
            functools.partial(
                _write_one_local, root, p, a, undo, fsync=fsync, reuse=reuse,
                keep_metadata=keep_metadata, attributes=attrs.get(p),
            )
            for p, a in plain
        ]
        tasks += [  # every chunk of every chunked array in parallel, then their zarr.json
            functools.partial(_write_chunk_local, folders[p], key, view, undo, reuse=reuse, fsync=fsync)
            for p, a in chunked
            for key, view in disk_chunks(a)
        ]
        tasks += [  # other files (a group's zarr.json, a bundle), overwritten where they are
            functools.partial(
                _write_small_file, root, p, data, undo, fsync=fsync, temporary=p in (temporaries or {}), reuse=reuse
            )
            for p, data in others.items()
        ]
        # Overwriting recycled files without fsync only copies into the page cache: handing that
        # to other threads costs more than it saves (and competes with the caller's compute).
        _in_parallel(_call, tasks, parallel=fsync or not reuse)
        if write_metadata:
            _in_parallel(
                lambda item: _write_metadata_local(
                    folders[item[0]], disk_metadata(item[1], attrs.get(item[0])), undo, reuse=reuse, fsync=fsync
                ),
                chunked,
            )
        if fsync:  # files first (any not yet), then the folders that gained an entry
            undo.dirty_dirs.update(os.path.join(root, *f.split("/")) for f in sync_folders)
            _in_parallel(fsync_file, [p for p, is_dir in undo.created if not is_dir and p not in undo.synced])
            _in_parallel(fsync_folder_local, undo.dirty_folders())
    except BaseException as e:
        written = describe_arrays([*arrays, *(files or {})]) or "zarr metadata"  # (a bundle alone: its file)
        undo.fail(e, f"{written} under {root!r}")
        raise


def _one(path: str, attributes: Mapping[str, Any] | None) -> dict[str, Mapping[str, Any]] | None:
    """The ``attributes`` argument of :func:`write_arrays_local` for the one array ``path``."""
    return None if attributes is None else {path: attributes}


def read_array_local(
    root: PathLike,
    path: str,
    shape: Shape,
    dtype: DTypeLike,
    *,
    check_metadata: bool = True,
    checksum: str | None = None,
) -> np.ndarray:
    """Reads a zarr v3 array written by either path from the local folder ``root``.

    The result is a fresh, writable, 64-byte aligned array of ``shape`` and
    ``dtype``.

    Args:
      root: the store folder.
      path: the array's relative path.
      shape, dtype: what the caller's manifest says the array is.
      check_metadata: also read ``zarr.json`` and check that it describes this
        shape and dtype in the single-chunk raw layout (one small extra read).
      checksum: the array's stored checksum (:func:`serializers.checksum`):
        verified while reading, piece by piece.

    Raises:
      CorruptDataError: a missing or wrong-sized chunk file, or missing or
        mismatching metadata; the message names the file.
    """
    return read_arrays_local(root, [(path, shape, dtype, checksum)], check_metadata=check_metadata)[0]


def read_arrays_local(
    root: PathLike,
    arrays: Sequence[tuple[str, Shape, DTypeLike, str | None]],
    *,
    check_metadata: bool = True,
    empty: Callable[[Shape, np.dtype], np.ndarray] = aligned_empty,
) -> list[np.ndarray]:
    """:func:`read_array_local` of each ``(path, shape, dtype, checksum)`` in order (``checksum``
    may be ``None``), in this thread, examining each folder on the way once: the arrays of one
    context share all their folders but their own, and for a small context that walk costs more
    than reading the bytes.

    ``empty(shape, dtype)`` gives the buffer each array is read into (a fresh, 64-byte aligned,
    C-contiguous array: every byte of it is read before it is returned).

    Raises:
      CorruptDataError: as :func:`read_array_local`, for the first array that fails.
    """
    folders = Folders(root)
    return [
        _read_single_chunk(folders, path, shape, dtype, check_metadata, checksum, empty)
        for path, shape, dtype, checksum in arrays
    ]


def _read_single_chunk(
    folders: Folders,
    path: str,
    shape: Shape,
    dtype: DTypeLike,
    check_metadata: bool,
    checksum: str | None,
    empty: Callable[[Shape, np.dtype], np.ndarray],
) -> np.ndarray:
    asked = ArrayRead.of(path, shape, dtype)
    folder = folders.path(tuple(path.split("/")))
    what = asked.what
    if check_metadata:
        _check_metadata_file(folder, asked)
    verifier = Verifier(checksum, what=what) if checksum is not None else None
    if not asked.stored:
        out = aligned_empty(asked.shape, asked.dtype)
        if verifier is not None:
            verifier.check()
        return out
    return read_sized_file(os.path.join(folder, asked.key), asked.shape, asked.dtype, what, verifier, empty)


def write_chunks_local(
    root: PathLike,
    path: str,
    shape: Shape,
    dtype: DTypeLike,
    chunk_shape: Shape,
    chunks: Mapping[Sequence[int], Any],
    *,
    fsync: bool = False,
    write_metadata: bool = True,
    attributes: Mapping[str, Any] | None = None,
) -> None:
    """Writes some chunks of the chunked zarr v3 array ``path`` under the local folder ``root``.

    ``chunks`` maps a chunk index (``(i, j)``) to an array of exactly ``chunk_shape`` and
    ``dtype``; each is written to its own file ``c.i.j`` straight from its buffer, then
    ``zarr.json`` (unless ``write_metadata`` is false: another writer of the same array writes
    it), with the array's zarr ``attributes`` if given. Chunks not given are left as they are,
    so several writers can each write theirs.

    Raises:
      ValueError: a chunk shape that does not divide ``shape`` (no edge chunks), an index
        outside the grid, a chunk of the wrong shape or dtype.
      DiskFullError: as :func:`write_arrays_local`, after removing what this call created.
    """
    arr = ChunkedArray(shape, dtype, chunk_shape, chunks)
    write_arrays_local(
        root, {path: arr}, fsync=fsync, write_metadata=write_metadata, attributes=_one(path, attributes)
    )


def read_chunk_local(
    root: PathLike,
    path: str,
    shape: Shape,
    dtype: DTypeLike,
    chunk_shape: Shape,
    chunk_index: Sequence[int],
    *,
    check_metadata: bool = True,
) -> np.ndarray:
    """Reads chunk ``chunk_index`` of a chunked zarr v3 array from the local folder ``root``.

    The result is a fresh, writable, 64-byte aligned array of ``chunk_shape``. With
    ``check_metadata``, ``zarr.json`` must describe this shape, dtype and chunk shape.

    Raises:
      ValueError: a chunk shape that does not divide ``shape``, an index outside the grid.
      CorruptDataError: a missing or wrong-sized chunk file, missing or mismatching metadata;
        the message names the file.
    """
    asked = ArrayRead.of(path, shape, dtype, chunk_shape, chunk_index)
    folder = check_folders_local(root, path.split("/"))
    if check_metadata:
        _check_metadata_file(folder, asked)
    return read_sized_file(os.path.join(folder, asked.key), asked.piece, asked.dtype, asked.what)


def _check_metadata_file(folder: str, asked: ArrayRead) -> None:
    meta_path = os.path.join(folder, METADATA_KEY)
    raw = read_file_local(meta_path, max_bytes=MAX_METADATA_BYTES, what=asked.what)
    if raw is None:
        raise CorruptDataError(f"{asked.what}: metadata file {meta_path} is missing")
    check_zarr_metadata(raw, asked.shape, asked.name, f"{asked.what} ({meta_path})", asked.chunk_shape)


def check_array_metadata_local(
    root: PathLike, path: str, shape: Shape, dtype: DTypeLike, chunk_shape: Shape | None = None
) -> None:
    """Checks that the ``zarr.json`` of the array ``path`` under the local folder ``root`` is a
    regular file describing ``shape``, ``dtype`` and ``chunk_shape`` (default: one chunk) in the
    raw layout: what plain ``zarr`` needs to read the array (the fast readers do not read it).

    Raises:
      CorruptDataError: it is missing, not a regular file, oversized, or describes another array.
    """
    asked = ArrayRead.of(path, shape, dtype, chunk_shape)
    _check_metadata_file(check_folders_local(root, path.split("/")), asked)
