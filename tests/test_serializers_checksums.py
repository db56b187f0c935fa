"""Tests for serializers.checksums: format, bit-flip detection, no-copy hashing."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from residual_store_serializers import ALGORITHM, CorruptDataError, checksum, verify
from residual_store_serializers.checksums import _as_bytes

DTYPES = [np.bool_, np.int8, np.uint16, np.int32, np.int64, np.float16, np.float32, np.float64,
          ml_dtypes.bfloat16]  # fmt: skip


def _array(dtype: object, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    d = np.dtype(dtype)
    n = int(np.prod(shape)) * d.itemsize
    raw = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    if d == np.bool_:
        raw = raw & 1
    return raw.view(d).reshape(shape)


def test_format_is_prefixed_hex() -> None:
    c = checksum(np.arange(10, dtype=np.float32))
    algorithm, _, digest = c.partition(":")
    assert algorithm == ALGORITHM == "xxh3_64"
    assert len(digest) == 16 and int(digest, 16) >= 0


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (0,), (5,), (3, 4)])
def test_checksum_equals_checksum_of_raw_bytes(dtype: object, shape: tuple[int, ...]) -> None:
    a = _array(dtype, shape)
    assert checksum(a) == checksum(a.tobytes()) == checksum(memoryview(a.tobytes()))
    verify(a, checksum(a), what="a")


def test_contiguous_array_is_hashed_in_place() -> None:
    a = np.arange(1000, dtype=np.float32).reshape(10, 100)
    view = np.asarray(_as_bytes(a))
    assert np.shares_memory(view, a)
    b = np.arange(8).astype(ml_dtypes.bfloat16)
    assert np.shares_memory(np.asarray(_as_bytes(b)), b)


def test_non_contiguous_and_big_endian_hash_their_disk_bytes() -> None:
    a = np.arange(24, dtype=np.int32).reshape(4, 6)
    assert checksum(a.T) == checksum(np.ascontiguousarray(a.T))
    assert checksum(a[:, ::2]) == checksum(np.ascontiguousarray(a[:, ::2]))
    assert checksum(a.astype(">i4")) == checksum(a)


def test_different_data_differs() -> None:
    assert checksum(np.zeros(4, np.uint8)) != checksum(np.zeros(5, np.uint8))
    assert checksum(np.zeros(4, np.float32)) != checksum(np.ones(4, np.float32))


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=1, max_size=4096), bit=st.integers(min_value=0))
def test_single_bit_flip_is_detected(data: bytes, bit: int) -> None:
    a = np.frombuffer(data, dtype=np.uint8).copy()
    stored = checksum(a)
    bit %= a.size * 8
    a[bit // 8] ^= np.uint8(1 << (bit % 8))
    with pytest.raises(CorruptDataError, match="res7: checksum mismatch"):
        verify(a, stored, what="res7")


def test_verify_names_what_and_rejects_bad_expected() -> None:
    a = np.arange(6, dtype=np.float64)
    with pytest.raises(CorruptDataError, match="w1"):
        verify(a + 1, checksum(a), what="w1")
    with pytest.raises(CorruptDataError, match="unknown checksum algorithm 'md5'"):
        verify(a, "md5:" + "0" * 32, what="w1")
    for bad in [
        "",
        "xxh3_64",
        "xxh3_64:",
        "xxh3_64:xyz",
        "xxh3_64:" + "0" * 15,
        "xxh3_64:" + "A" * 16,
    ]:
        with pytest.raises(CorruptDataError, match="w1"):
            verify(a, bad, what="w1")
    with pytest.raises(CorruptDataError):
        verify(a, None, what="w1")  # type: ignore[arg-type]
