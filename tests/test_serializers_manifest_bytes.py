"""The bytes a manifest is written as do not change with how it is validated: manifests encoded
now equal, byte for byte, those the hand-written schema checks encoded (the files under
``tests/data/manifests``, written by ``serializers.manifest`` as it was at commit 49c70b8,
before msgspec), so their seals, and every store's manifests, stay what they were. Each file also decodes to the
map it was made from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from residual_store_serializers import BACKWARD_SCHEMA, ArrayRecord, chunked_checksum, decode_manifest, encode_manifest

DATA = Path(__file__).resolve().parent / "data" / "manifests"

_SUMS = [((a, b), f"xxh3_64:{a:08x}{b:08x}") for a in range(2) for b in range(3)]
RECORDS = (
    ArrayRecord("tanh model.py:12", "data/k.1/0", (2, 3), "float32", 24, "xxh3_64:0123456789abcdef"),
    ArrayRecord("input params['w1']", "weights/ab12/w1", (), "bfloat16", 2, "xxh3_64:fedcba9876543210",
                input_path="params['w1']", shared=True),
    ArrayRecord("dot model.py:30", "data/k.1/2", (4, 6), "int16", 48, chunked_checksum(_SUMS),
                chunk_shape=(2, 2), chunk_checksums=tuple(_SUMS)),
    ArrayRecord("exp model.py:31", "data/k.1/3", (5,), "float64", 40, "xxh3_64:00000000000000ff", offset=128),
)
MANIFESTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "context_v4.manifest": (
        {
            "key": "k",
            "signature": "rs2-" + "0" * 32,
            "created": 1700000000.25,
            "jax_version": "0.10.2",
            "spec": {"treedef": b"\x00\x01\x02", "names": ["a", "b"], "nested": {"x": [1, 2.5, None]}},
            "arrays": list(RECORDS),
            "bundle": {"nbytes": 4096, "checksum": "crc32:0badf00d"},
        },
        {},
    ),
    "backward_v4.manifest": (
        {
            "signature": "rs2-" + "1" * 32,
            "jax_version": "0.10.2",
            "available": True,
            "interface": "flat",
            "platforms": ["cpu", "cuda"],
            "left_out": {"tpu": "not lowered"},
            "exported": b"\x07" * 64,
        },
        {"schema": BACKWARD_SCHEMA},
    ),
}


@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_encoding_is_byte_identical_to_the_hand_written_checks(name):
    fields, kwargs = MANIFESTS[name]
    assert encode_manifest(fields, **kwargs) == (DATA / name).read_bytes()


@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_the_stored_bytes_decode_to_the_map_they_were_made_from(name):
    fields, kwargs = MANIFESTS[name]
    decoded = decode_manifest((DATA / name).read_bytes(), what=name, **kwargs)
    plain = {k: [r.to_dict() for r in v] if k == "arrays" else v for k, v in fields.items()}
    assert {k: v for k, v in decoded.items() if k not in ("format", "version")} == plain
    if name.startswith("context"):
        assert tuple(ArrayRecord.from_dict(r, fields_checked=True) for r in decoded["arrays"]) == RECORDS
