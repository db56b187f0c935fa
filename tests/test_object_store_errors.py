"""An object store whose bucket goes away (the server killed and started again without it, or
the bucket deleted): a write (``flush``) and a listing raise ``rs.StoreUnavailableError`` naming
the bucket, never tensorstore's plain ``ValueError``; nothing is reported as a damaged context
(nothing stored is wrong); and the store still closes. A read of one object cannot tell a gone
bucket from a missing object (S3 answers 404 to both): ``get`` says the context is not there."""

from __future__ import annotations

import uuid

import jax
import jax.numpy as jnp
import pytest

import residual_store as rs
import s3_server
from residual_store_serializers import CorruptDataError, UnavailableError
from residual_store_serializers.kv_errors import convert_read_error, convert_write_error, is_unavailable

# tensorstore's error for a request to a bucket that is not there, as the s3 driver raises it
NO_BUCKET = ValueError(
    "NOT_FOUND: NoSuchBucket: The specified bucket does not exist [http_response_code='404'] "
    "[http_response_body='<Error><Code>NoSuchBucket</Code></Error>']"
)


def test_a_missing_bucket_is_an_unavailable_store_not_missing_data():
    assert is_unavailable(NO_BUCKET)
    for convert in (convert_read_error, convert_write_error):
        err = convert(NO_BUCKET, "reading data/k.0/bundle.zip")
        assert isinstance(err, UnavailableError) and "NoSuchBucket" in str(err)
    # an object that is not there is still missing data, not an unavailable store
    missing = convert_read_error(ValueError("NOT_FOUND: Error opening file: No such file"), "reading x")
    assert isinstance(missing, CorruptDataError) and not is_unavailable(missing)


@pytest.mark.subprocess
@pytest.mark.skipif(not s3_server.available(), reason="moto[s3] and flask are in the test extra")
def test_a_server_killed_and_started_without_the_bucket_raises_store_unavailable():
    fwd = rs.split(lambda w, x: jnp.sum(jnp.tanh(x @ w)))
    w = jax.random.normal(jax.random.key(0), (3, 2))
    ctx = [fwd(w, jax.random.normal(jax.random.key(i + 1), (4, 3)))[1] for i in range(2)]
    with s3_server.serving("residuals") as server:
        spec = server.spec("residuals", f"run-{uuid.uuid4().hex[:8]}/")
        store = rs.Store(spec, timeout=5, device_budget=0, host_budget=0)  # gets read the store
        try:
            store.put(ctx[0], "mb0")
            store.flush()
            server.process.kill()  # killed (moto keeps its objects in memory: all gone) ...
            server.process.wait()
            server.stop()
            server.start()  # ... and started again on the same endpoint, without the bucket
            store.put(ctx[1], "mb1")
            with pytest.raises(rs.StoreUnavailableError, match="bucket 'residuals' is not there") as info:
                store.flush()
            assert isinstance(info.value, OSError) and "http_response_body" not in str(info.value)
            with pytest.raises(rs.StoreUnavailableError, match="bucket 'residuals'"):
                store.keys()  # a listing says the bucket is gone; a read of one object cannot
            with pytest.raises(rs.ResidualStoreError) as info:  # (S3 answers 404 for both)
                store.get("mb0")
            assert not isinstance(info.value, rs.CorruptContextError)  # nothing stored is wrong
            with pytest.raises(rs.StoreUnavailableError):
                store.verify()
        finally:
            store.close()  # closes: the failed write is not retried at close
        with pytest.raises(rs.InvalidArgumentError, match="closed"):
            store.keys()
        server.make_bucket("residuals")  # made again: the store opens (empty) and works
        with rs.Store(spec) as again:
            assert again.keys() == []
            again.put(ctx[1], "mb1")
            again.flush()
            assert again.keys() == ["mb1"]
