"""Any tensorstore kvstore (``memory``, ``file`` with options, ``gcs``, ``s3``) as the disk
tier's backend: requests bounded by a timeout, refusals and silences reported as
:class:`~residual_store._src.errors.StoreUnavailableError`; single-object puts as the commits (its
strategy: :class:`~residual_store._src.store.disk.kvstore.AtomicPuts`)."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import tensorstore as ts

import residual_store_serializers as serializers
from residual_store._src.errors import CorruptContextError, InvalidArgumentError, StoreUnavailableError
from residual_store._src.store.disk.paths import STORE_MARKER
from residual_store._src.store.disk.protocol import Backend, ContextWrite, Empty, StaleData, damaged
from residual_store_serializers.kv_errors import is_missing_bucket, ts_message

__all__ = ["AtomicPuts", "DEFAULT_TIMEOUT_S", "KvBackend", "URL_SCHEMES", "is_remote", "url_spec"]

# Seconds each request to an object store may take by default, tensorstore's retries included:
# an unreachable store is reported within it (tensorstore alone retries for minutes), and a
# context of a few GiB goes up or comes down well within it on a cloud machine's link.
DEFAULT_TIMEOUT_S = 30.0


def _requests(method: Callable[..., Any]) -> Callable[..., Any]:
    """A :class:`KvBackend` method whose requests to a store that does not answer, or that
    refuses them, raise :class:`StoreUnavailableError` (one line, saying what to do)."""

    @functools.wraps(method)
    def wrapper(self: KvBackend, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except StoreUnavailableError:
            raise
        except Exception as err:  # noqa: BLE001 - tensorstore raises ValueError and others
            if not (serializers.is_unavailable(err) or (self.remote and _refused(err))):
                raise
            raise self.unavailable(err) from err

    return wrapper


def _refused(err: BaseException) -> bool:
    """A request the store refused (credentials or permissions): an answer, but no data."""
    return isinstance(err, PermissionError) or str(err).startswith(("PERMISSION_DENIED", "UNAUTHENTICATED"))


# curl's words for a name that does not resolve (curl codes 5 and 6: the proxy's, the host's)
_UNKNOWN_HOST = re.compile(r"Could not resolve (?:proxy|host): ([^\s\[\]]+)")


def _unknown_host(err: BaseException) -> str | None:
    """The host ``err`` says does not resolve, if it says so."""
    found = _UNKNOWN_HOST.search(ts_message(err.__cause__ or err))
    return found.group(1) if found else None


def _no_credentials(err: BaseException) -> bool:
    """The store refused the credentials, or none could be had (tensorstore's words)."""
    text = ts_message(err.__cause__ or err)
    return _refused(err.__cause__ or err) or "Failed to get credentials" in text


# tensorstore's context resource for the retries of each networked driver (all three take
# max_retries, initial_delay and max_delay)
_RETRY_RESOURCES = {"s3": "s3_request_retries", "gcs": "gcs_request_retries", "http": "http_request_retries"}
_LOCAL_DRIVERS = ("file", "memory")


def is_remote(spec: Mapping[str, Any]) -> bool:
    """Whether ``spec``'s requests go over a network (an object store's, not ``file`` or ``memory``)."""
    return spec.get("driver") not in _LOCAL_DRIVERS


def _tried_once(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` whose requests are tried once (a networked driver's; any other as it is)."""
    name = _RETRY_RESOURCES.get(spec.get("driver"))  # type: ignore[arg-type]
    return spec if name is None else {**spec, name: {"max_retries": 1, "initial_delay": "1ms", "max_delay": "1ms"}}


def _with_timeout(spec: dict[str, Any], timeout: float | None) -> dict[str, Any]:
    """``spec`` whose retries fit in ``timeout`` seconds: tensorstore retries a failed request
    up to 32 times, waiting up to 32 s between tries (minutes before an unreachable store is
    reported); with a timeout, 3 tries, 1/10 then 1/5 of it apart, so a refused connection is
    reported well within it and no request goes on retrying after the store gave up on it. A
    spec that names its own retries keeps them."""
    name = _RETRY_RESOURCES.get(spec.get("driver"))  # type: ignore[arg-type]
    context = spec.get("context")
    if timeout is None or name is None or name in spec or (isinstance(context, Mapping) and name in context):
        return spec
    if context is not None and not isinstance(context, Mapping):
        return spec  # tensorstore says what is wrong with it
    retries = {"max_retries": 3, "initial_delay": f"{max(1, round(timeout * 100))}ms",
               "max_delay": f"{max(1, round(timeout * 250))}ms"}
    return {**spec, "context": {**(context or {}), name: retries}}


class KvBackend:
    """Any tensorstore kvstore spec (``memory``, ``file`` with options, ``gcs``, ``s3``).

    Every request to an object store waits at most ``timeout`` seconds
    (:data:`DEFAULT_TIMEOUT_S` if ``None``; a local kvstore's, with ``None``, as long as it
    takes), tensorstore's retries fitted into it (:func:`_with_timeout`); a request that
    outlives it, or that the store refuses or gives up on, raises
    :class:`StoreUnavailableError`. The first request is tried once (:meth:`_first_contact`):
    a failure no retry heals is reported at once. A spec tensorstore refuses raises
    :class:`InvalidArgumentError`."""

    def __init__(self, spec: Mapping[str, Any], timeout: float | None = None) -> None:
        self.description = repr(dict(spec))
        self.remote = is_remote(spec)
        self.timeout_given = timeout is not None
        self.timeout = DEFAULT_TIMEOUT_S if timeout is None and self.remote else timeout
        self.spec = _with_timeout(_with_quiet_credentials(dict(spec)), self.timeout)
        self.context = serializers.default_context()
        # (the SDKs' log lines of these first requests: kept off stderr by backends.opening)
        if self.remote:
            self._first_contact()
        self.kv = self._open(self.spec)

    def _open(self, spec: dict[str, Any]) -> Any:
        """The kvstore of ``spec``; :class:`InvalidArgumentError` for a spec tensorstore refuses."""
        try:
            opened = ts.KvStore.open(self._with_slash(spec), context=self.context)
            return serializers.wait_request(opened, self.timeout, "opening the kvstore")
        except Exception as err:  # noqa: BLE001 - tensorstore raises ValueError and others
            if serializers.is_unavailable(err):
                raise self.unavailable(err) from err
            message = str(err).split(" [tensorstore_spec=", 1)[0].strip().splitlines()
            raise InvalidArgumentError(
                f"tensorstore refuses the kvstore spec {self.description}: "
                f"{message[0] if message else type(err).__name__}; see "
                "https://google.github.io/tensorstore/kvstore/index.html for the drivers and their options"
            ) from None

    def _first_contact(self) -> None:
        """A read of the store marker, tried once: a failure no retry heals (a host that does
        not resolve, credentials refused or not to be had, a bucket that is not there), or no
        answer within the whole timeout, raises :class:`StoreUnavailableError` at once, where
        tensorstore would retry a name that does not resolve 32 times. Any other failure is
        left to the requests that follow, with their retries (a refused connection may be a
        server starting)."""
        try:
            kv = serializers.wait_request(
                ts.KvStore.open(self._with_slash(_tried_once(self.spec)), context=self.context), self.timeout,
                "opening the kvstore",
            )
            serializers.wait_request(kv.read(STORE_MARKER), self.timeout, f"reading {STORE_MARKER}")
        except Exception as err:  # noqa: BLE001 - tensorstore raises ValueError and others
            silent = isinstance(err, OSError) and err.errno == errno.ETIMEDOUT  # the whole timeout
            if silent or _unknown_host(err) or _no_credentials(err) or is_missing_bucket(err.__cause__ or err):
                raise self.unavailable(err) from err

    def unavailable(self, err: BaseException) -> StoreUnavailableError:
        """The :class:`StoreUnavailableError` of a request that met ``err``: its ``reason``
        (what happened, without advice), and ``timed_out`` where a longer timeout may help."""
        text = err.strerror if isinstance(err, OSError) and isinstance(err.strerror, str) else str(err)
        why = (text.strip().splitlines() or [type(err).__name__])[0].split(" [", 1)[0]  # (not the HTTP details)
        host = _unknown_host(err)
        timed_out = False
        if is_missing_bucket(err.__cause__ or err) or is_missing_bucket(err):
            reason = (f"the bucket {self.spec.get('bucket', '')!r} is not there (deleted, or an object store "
                      f"that restarted without it): {why}")
            advice = "Check the bucket and the endpoint, or make the bucket again"
        elif host is not None:
            reason = f"the object store's host {host} is unknown (no such name, or no network)"
            advice = "Check the endpoint and the network (a name that does not resolve is not retried)"
        elif _no_credentials(err):
            reason = f"the object store refused the credentials or the request: {why}"
            advice = "Check the credentials and the bucket's permissions (a refusal is not retried)"
        else:
            limit = (f"the timeout of {self.timeout:g} s" if self.timeout_given
                     else f"the default timeout of {self.timeout:g} s" if self.timeout is not None else "the time it took")
            reason = f"the object store did not answer within {limit}, or refused the request: {why}"
            longer = "a longer timeout" if self.timeout_given else "timeout=SECONDS"
            advice = f"Check the endpoint, the network and the credentials, or give {longer}"
            timed_out = True
        error = StoreUnavailableError(f"{self.description}: {reason}. {advice}")
        error.reason, error.timed_out = reason, timed_out
        return error

    @staticmethod
    def _with_slash(spec: dict[str, Any]) -> dict[str, Any]:
        path = spec.get("path", "")
        if path and not path.endswith("/"):
            spec = {**spec, "path": path + "/"}
        return spec

    latency_bound = True

    @_requests
    def write_context(self, write: ContextWrite) -> None:
        """The arrays (as :meth:`write_arrays`), then each file as one object (the manifest among
        them, if staged); in a folder named for this write alone (``fresh``), no listing to
        clear the paths first."""
        serializers.write_arrays_kv(
            self.spec, write.arrays, context=self.context, write_metadata=write.write_metadata,
            attributes=write.attributes, fresh=write.fresh, timeout=self.timeout,
        )
        for key, data in {**write.files, **write.temporaries}.items():  # a bundle's parts as one object
            self.put_bytes(key, data if isinstance(data, bytes) else b"".join(data), fsync=write.fsync)

    @_requests
    def write_arrays(self, arrays: Mapping[str, Any], *, fsync: bool, write_metadata: bool = True) -> None:
        """Chunks first and ``zarr.json`` last, so :meth:`array_exists` means complete; with
        ``write_metadata=False`` the ``zarr.json`` of chunked arrays is left to another writer."""
        serializers.write_arrays_kv(
            self.spec, arrays, context=self.context, write_metadata=write_metadata, timeout=self.timeout
        )

    @_requests
    def write_shared_arrays(
        self, arrays: Mapping[str, Any], *, fsync: bool, write_metadata: bool = True
    ) -> None:
        """Content-addressed arrays written in place (no rename on kvstores): every writer puts
        the same bytes, ``zarr.json`` last, and nothing is deleted, not even on failure, so a
        writer cannot tear an array another one completed. ``write_metadata=False``: each of
        several writers puts its chunks, and one puts the ``zarr.json`` after all are done."""
        serializers.write_arrays_kv(
            self.spec, arrays, context=self.context, write_metadata=write_metadata, content_addressed=True,
            timeout=self.timeout,
        )

    @_requests
    def read_array(
        self, path: str, shape: tuple[int, ...], dtype: str, checksum: str | None = None, *, empty: Empty | None = None
    ) -> np.ndarray:
        # one request for the chunk object: zarr.json is for other readers (see check_metadata)
        x = serializers.read_raw(
            self.kv, path, shape, dtype, empty=empty or serializers.aligned_empty, timeout=self.timeout
        )
        if checksum is not None:
            serializers.verify(x, checksum, what=f"array {path!r}")
        return x

    def read_arrays(
        self, arrays: Sequence[tuple[str, tuple[int, ...], str, str | None]], *, empty: Empty | None = None
    ) -> list[np.ndarray]:
        """:meth:`read_array` of each, one request after another (the disk tier reads a
        latency-bound store's arrays one per task, the tasks at once)."""
        return [self.read_array(*a, empty=empty) for a in arrays]

    @_requests
    def read_chunk(
        self, path: str, shape: tuple[int, ...], dtype: str, chunk_shape: tuple[int, ...], index: tuple[int, ...]
    ) -> np.ndarray:
        return serializers.read_raw(
            self.kv, path, shape, dtype, chunk_shape=chunk_shape, chunk_index=index, timeout=self.timeout
        )

    @_requests
    def read_file(
        self, key: str, nbytes: int, *, checksum: str | None = None, empty: Empty | None = None
    ) -> np.ndarray:
        """The object ``key`` of exactly ``nbytes`` bytes (one request), verified against its
        ``checksum``."""
        result = self._wait(self.kv.read(key), f"reading {key}")
        what = f"file {key!r}"
        if result.state != "value":
            raise serializers.CorruptDataError(f"{what} is missing")
        if len(result.value) != nbytes:
            kind = "truncated" if len(result.value) < nbytes else "too long"
            raise serializers.CorruptDataError(f"{what} is {kind}: {len(result.value)} bytes, expected {nbytes}")
        out = (empty or serializers.aligned_empty)((nbytes,), np.dtype(np.uint8))
        out[:] = np.frombuffer(result.value, dtype=np.uint8)
        if checksum is not None:
            serializers.verify(out, checksum, what=what)
        return out

    @_requests
    def check_metadata(
        self, path: str, shape: tuple[int, ...], dtype: str, chunk_shape: tuple[int, ...] | None = None
    ) -> None:
        """Checks the array's ``zarr.json`` (which the store's own reads skip, but plain ``zarr``
        needs): :class:`DamagedFileError` if it is missing or wrong."""
        try:
            serializers.check_array_metadata(self.kv, path, shape, dtype, chunk_shape, timeout=self.timeout)
        except (serializers.CorruptDataError, serializers.UnsupportedDTypeError, ValueError) as err:
            raise damaged(err) from None

    def array_exists(self, path: str) -> bool:
        return self.get_bytes(f"{path}/zarr.json") is not None

    @_requests
    def put_bytes(self, key: str, data: bytes, *, fsync: bool) -> None:
        self._wait(self.kv.write(key, data), f"writing {key}")

    def _wait(self, future: Any, what: str) -> Any:
        return serializers.wait_request(future, self.timeout, what)

    @_requests
    def get_bytes(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        result = self._wait(self.kv.read(key), f"reading {key}")
        if result.state != "value":
            return None
        limit = serializers.MAX_MANIFEST_BYTES if max_bytes is None else max_bytes
        if len(result.value) > limit:
            raise CorruptContextError(
                f"{self.description}: {key} is {len(result.value):,} bytes, over the {limit:,} allowed"
            )
        return bytes(result.value)

    @_requests
    def list_dir(self, prefix: str) -> list[str]:
        prefix = prefix.rstrip("/") + "/"
        end = prefix[:-1] + chr(ord("/") + 1)
        keys = self._wait(self.kv.list(ts.KvStore.KeyRange(prefix, end)), f"listing {prefix}")
        names = {k.decode()[len(prefix) :].split("/", 1)[0] for k in keys}
        return sorted(n for n in names if n and not n.startswith("."))

    @_requests
    def delete(self, key: str) -> None:
        self._wait(self.kv.delete_range(ts.KvStore.KeyRange(key, key + "\x00")), f"deleting {key}")

    @_requests
    def delete_tree(self, prefix: str) -> None:
        serializers.delete_prefix(self.spec, prefix.rstrip("/"), context=self.context, timeout=self.timeout)

    def age_seconds(self, prefix: str) -> float | None:
        return None  # kvstores have no portable mtime: gc only removes with older_than=0

    def tree_bytes(self, prefix: str) -> int | None:
        return None  # listing a kvstore gives keys, not sizes: unknown without reading everything

    def exists(self, key: str) -> bool:
        return self.get_bytes(key) is not None

    def is_file(self) -> bool:
        return False

    def root_exists(self) -> bool:
        return True  # a kvstore prefix exists as soon as anything is under it

    @_requests
    def is_empty(self) -> bool:
        prefix = ts.KvStore.KeyRange("", "")
        return not self._wait(self.kv.list(prefix), "listing the store")

    def list_temporary(self, prefix: str) -> list[str]:
        return []  # every object is written in one put: nothing temporary is left behind

    def version(self, key: str) -> Any | None:
        return None  # no cheap version: manifests are read each time

    def gc_lock(self, *, exclusive: bool) -> AbstractContextManager[None]:
        return contextlib.nullcontext()  # no cross-process lock: gc needs older_than=0 (see age_seconds)

    def sync_folder(self, prefix: str) -> None:
        pass  # no renames on kvstores

    def atomicity(self) -> AtomicPuts:
        """No renames: a single-object put is atomic, and is a manifest's commit."""
        return AtomicPuts(self)


# the kvstore URL schemes a store opens, and the tensorstore driver each must parse into: the
# kvstores a store can write (tensorstore's ``http`` is read-only, and an adapter such as
# ``|zip:`` or ``|ocdbt:`` is a format of its own, not a folder of objects)
URL_SCHEMES = {"file": "file", "memory": "memory", "s3": "s3", "gs": "gcs"}


def url_spec(url: str, scheme: str) -> dict[str, Any]:
    """The tensorstore kvstore spec of ``url`` (``scheme`` its scheme, as given: schemes are
    case-insensitive), parsed by tensorstore itself, as ``ts.KvStore.Spec(url)`` and
    ``"kvstore": url`` read it; :class:`InvalidArgumentError` for a scheme outside
    :data:`URL_SCHEMES` or a URL tensorstore refuses."""
    known = ", ".join(f"{s}://" for s in URL_SCHEMES)
    driver = URL_SCHEMES.get(scheme.lower())
    if driver is None:
        raise InvalidArgumentError(
            f"store path {url!r}: a store does not open {scheme}:// URLs; give a folder, a kvstore "
            f"URL ({known}) or a tensorstore kvstore spec (dict)"
        )
    normal = scheme.lower() + url[len(scheme):]
    try:
        spec = ts.KvStore.Spec(normal).to_json()
    except ValueError as err:
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        why = why.removeprefix(f'Parsing spec from url: "{normal}": ')
        raise InvalidArgumentError(f"store path {url!r} is not a kvstore URL tensorstore reads: {why}") from None
    if spec.get("driver") != driver:
        raise InvalidArgumentError(
            f"store path {url!r} is a {spec.get('driver')!r} kvstore, which a store cannot write: give "
            f"a plain {known} URL, without an adapter (|...)"
        )
    return spec


_ENVIRONMENT_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


def _with_quiet_credentials(spec: dict[str, Any]) -> dict[str, Any]:
    """An ``s3`` spec that names no credentials, opened where the environment holds them: the
    same credentials (the AWS default chain reads the environment first) through tensorstore's
    ``environment`` provider, so the SDK does not also look for ``~/.aws/config`` and print an
    error line for each file it cannot open. Any other spec as it is."""
    named = "aws_credentials" in spec or "aws_credentials" in (spec.get("context") or {})
    if spec.get("driver") != "s3" or named or not all(os.environ.get(k) for k in _ENVIRONMENT_CREDENTIALS):
        return spec
    return {**spec, "aws_credentials": {"type": "environment"}}


class AtomicPuts:
    """A medium whose single-object puts are atomic and which has no rename of a prefix (a
    tensorstore kvstore): objects are put where they belong, a manifest's put is the commit,
    nothing is recycled, and removals are direct."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def stage(self, key: str) -> None:
        return None

    def commit(self, staged: str | None, key: str, data: bytes, *, fsync: bool) -> bool:
        self.backend.put_bytes(key, data, fsync=fsync)
        return False

    def unstage(self, staged: str | None) -> None:
        pass  # nothing staged

    def remove(self, stale: StaleData) -> None:
        self.backend.delete_tree(stale.data_dir)

    recycle = remove  # nothing kept: a put has no rename to claim a folder with

    def claim(self, folder_shape: str, data_dir: str) -> bool:
        return False  # nothing kept

    def collect(self, path: str) -> bool:
        self.backend.delete_tree(path)
        return True

    def shared_staging(self, path: str, write_id: str) -> str:
        return path

    def publish_shared(self, staged: str, path: str, metadata: Mapping[str, Any], *, fsync: bool) -> None:
        self.backend.write_shared_arrays(metadata, fsync=fsync)

    def drop_shared_staging(self, staged: str, path: str) -> None:
        pass  # chunks without a zarr.json are no array; gc takes them with the unreferenced weight
