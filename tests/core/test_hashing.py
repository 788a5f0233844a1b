"""Canonical content hashes against hashlib over canonical bytes built here, by hand."""

from __future__ import annotations

import hashlib
import struct
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clipcli.core.hashing import TensorHasher, canonical_header, checkpoint_hash, tensor_hash

DTYPES = [
    np.bool_,
    np.int8,
    np.uint8,
    np.int16,
    np.uint16,
    np.int32,
    np.uint32,
    np.int64,
    np.uint64,
    np.float16,
    ml_dtypes.bfloat16,
    np.float32,
    np.float64,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e8m0fnu,
    np.complex64,
    np.complex128,
]
SHAPES = [(), (0,), (3, 0, 2), (1,), (5,), (2, 3), (3, 1, 4)]


def reference(t: np.ndarray) -> str:
    """SHA-256 over the canonical form, assembled with struct and item-by-item byte reversal."""
    name = np.dtype(t.dtype).name.encode()
    head = struct.pack("<Q", len(name)) + name + struct.pack("<Q", t.ndim) + struct.pack(f"<{t.ndim}q", *t.shape)
    size = t.dtype.itemsize
    items = []
    for value in t.reshape(-1, order="C"):  # native bytes, reversed where the array is big-endian
        raw = np.array(value, dtype=t.dtype).tobytes()
        if t.dtype.byteorder == ">" or (t.dtype.byteorder == "=" and sys.byteorder == "big"):
            raw = b"".join(raw[i : i + size // 2 if t.dtype.kind == "c" else size][::-1] for i in _parts(t.dtype))
        items.append(raw)
    return hashlib.sha256(head + b"".join(items)).hexdigest()


def _parts(dtype: np.dtype) -> list[int]:
    return [0, dtype.itemsize // 2] if dtype.kind == "c" else [0]


def sample(dtype, shape, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape, dtype=np.int64))
    raw = rng.integers(0, 256, n * np.dtype(dtype).itemsize, dtype=np.uint8)
    if np.dtype(dtype) == np.bool_:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_tensor_hashes_as_sha256_of_its_canonical_bytes(dtype, shape):
    t = sample(dtype, shape)
    assert tensor_hash(t) == reference(t)


@pytest.mark.parametrize("dtype", [np.int16, np.float32, np.float64, np.complex64, np.complex128, np.uint64])
def test_big_endian_fortran_and_strided_tensors_hash_as_their_little_endian_c_order_form(dtype):
    t = sample(dtype, (4, 6), seed=1)
    expected = tensor_hash(t)
    big = t.astype(t.dtype.newbyteorder(">"))
    assert tensor_hash(big) == expected == reference(big)
    assert tensor_hash(np.asfortranarray(t)) == expected
    assert tensor_hash(np.asfortranarray(big)) == expected
    wide = np.zeros((4, 12), dtype)
    wide[:, ::2] = t
    assert tensor_hash(wide[:, ::2]) == expected


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.complex64, np.bool_])
@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 1000])
def test_chunks_of_any_size_hash_as_the_whole_tensor(dtype, chunk):
    t = sample(dtype, (10, 33), seed=2)
    hasher = TensorHasher(t.dtype, t.shape)
    flat = t.reshape(-1)
    for start in range(0, flat.size, chunk):
        hasher.update(flat[start : start + chunk])
    assert hasher.hexdigest() == tensor_hash(t)


def test_big_endian_chunks_hash_as_little_endian_ones():
    t = sample(np.float64, (50,), seed=3)
    hasher = TensorHasher(np.dtype(">f8"), (50,))
    for start in range(0, 50, 7):
        hasher.update(t[start : start + 7].astype(">f8"))
    assert hasher.hexdigest() == tensor_hash(t)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 17), st.integers(0, 8 * 24 - 1))
def test_one_flipped_bit_changes_the_hash(which, bit):
    dtype = DTYPES[which]
    t = sample(dtype, (24 // np.dtype(dtype).itemsize + 1,), seed=4)
    raw = bytearray(t.tobytes())
    bit %= 8 * len(raw)
    raw[bit // 8] ^= 1 << (bit % 8)
    flipped = np.frombuffer(bytes(raw), dtype=t.dtype).reshape(t.shape)
    if t.dtype == np.bool_:  # a bool hashes its value: a bit of a True's byte beyond the lowest changes nothing
        same = np.array_equal(flipped.view(np.uint8) != 0, t)
        assert (tensor_hash(flipped) == tensor_hash(t)) == same
        return
    assert tensor_hash(flipped) != tensor_hash(t)


def test_a_bool_hashes_its_value_whatever_byte_holds_true():
    odd = np.frombuffer(bytes([0, 1, 2, 255]), dtype=np.bool_)
    assert tensor_hash(odd) == tensor_hash(np.array([False, True, True, True]))


def test_the_same_bytes_under_another_dtype_or_shape_hash_differently():
    t = np.arange(6, dtype=np.int32)
    hashes = {
        tensor_hash(t),
        tensor_hash(t.view(np.float32)),
        tensor_hash(t.reshape(2, 3)),
        tensor_hash(t.reshape(3, 2)),
    }
    assert len(hashes) == 4
    assert tensor_hash(np.zeros(0, np.float32)) != tensor_hash(np.zeros((0, 1), np.float32))


def test_zero_and_negative_zero_and_nan_payloads_hash_differently():
    values = np.array([0.0, -0.0], np.float32)
    assert tensor_hash(values[:1]) != tensor_hash(values[1:])
    nan = np.array([0x7FC00000, 0x7FC00001], np.uint32).view(np.float32)
    assert tensor_hash(nan[:1]) != tensor_hash(nan[1:])


def test_the_header_is_length_prefixed_name_and_int64_shape():
    assert canonical_header(np.float32, (2, 3)) == (
        b"\x07\x00\x00\x00\x00\x00\x00\x00float32\x02\x00\x00\x00\x00\x00\x00\x00"
        b"\x02\x00\x00\x00\x00\x00\x00\x00\x03\x00\x00\x00\x00\x00\x00\x00"
    )
    assert canonical_header(ml_dtypes.bfloat16, ()) == struct.pack("<Q", 8) + b"bfloat16" + struct.pack("<Q", 0)


def test_a_known_hash_is_pinned():
    # the canonical form must never change: a manifest written today is checked by every later release
    t = np.arange(6, dtype=np.float32).reshape(2, 3)
    header = struct.pack("<Q", 7) + b"float32" + struct.pack("<Qqq", 2, 2, 3)
    assert tensor_hash(t) == hashlib.sha256(header + struct.pack("<6f", 0, 1, 2, 3, 4, 5)).hexdigest()


def test_a_hasher_refuses_other_dtypes_and_counts_values():
    hasher = TensorHasher(np.float32, (2, 2))
    with pytest.raises(TypeError, match="float32"):
        hasher.update(np.zeros(2, np.float64))
    hasher.update(np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="3 of the tensor's 4 values"):
        hasher.digest()
    with pytest.raises(ValueError, match="more values"):
        hasher.update(np.zeros(2, np.float32))
    with pytest.raises(TypeError):
        TensorHasher(object, (1,))
    with pytest.raises(ValueError, match="negative"):
        TensorHasher(np.float32, (-1,))


def test_the_checkpoint_hash_is_over_sorted_names_and_raw_tensor_hashes():
    hashes = {"b": tensor_hash(np.ones(2)), "a": tensor_hash(np.zeros(2)), "é": tensor_hash(np.ones(1))}
    body = b"".join(
        struct.pack("<Q", len(name.encode())) + name.encode() + bytes.fromhex(hashes[name]) for name in ("a", "b", "é")
    )
    assert checkpoint_hash(hashes) == hashlib.sha256(body).hexdigest()
    assert checkpoint_hash(reversed(list(hashes.items()))) == checkpoint_hash(hashes)
    assert checkpoint_hash({**hashes, "a": hashes["b"]}) != checkpoint_hash(hashes)
    assert checkpoint_hash({}) == hashlib.sha256(b"").hexdigest()


def test_the_checkpoint_hash_refuses_a_name_twice_and_malformed_hashes():
    with pytest.raises(ValueError, match="twice"):
        checkpoint_hash([("a", "00" * 32), ("a", "11" * 32)])
    with pytest.raises(ValueError, match="64 hexadecimal"):
        checkpoint_hash([("a", "00" * 31)])
