"""Bytes become values in one step (a tensor's stored type, in native byte order), and a pair of them compared."""

from __future__ import annotations

from typing import Any

import numpy as np

_BYTES = np.dtype(np.uint8)


def stored_type(t: Any) -> np.dtype:
    """The type a tensor's bytes are stored as (its byte order included); bytes for a type carried as bytes."""
    return t.stored_dtype or t.array_dtype or _BYTES


def decode(raw: np.ndarray, t: Any) -> np.ndarray:
    """Tensor `t`'s bytes read (`raw`, uint8) as its values, in native byte order."""
    return as_values(raw, t.stored_dtype or t.array_dtype or _BYTES)


def as_values(raw: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Bytes viewed as values of `dtype`, byte-swapped into native order if need be."""
    values = raw.view(dtype)
    return values if dtype.isnative else values.astype(dtype.newbyteorder("="))


def pair_values(a: Any, b: Any, raw_a: np.ndarray, raw_b: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
    """The values of a pair's bytes read (of tensors `a` and `b`), and whether they are the same: the same
    dtype and bits."""
    va, vb = decode(raw_a, a), decode(raw_b, b)
    return va, vb, _equal_bytes(raw_a, raw_b) if stored_type(a) == stored_type(b) else equal_values(va, vb)


def equal_values(x: np.ndarray, y: np.ndarray) -> bool:
    """Whether two arrays (in native byte order) hold the same bits of the same type: a file's byte order is
    its format's, not its values'."""
    return x.dtype == y.dtype and _equal_bytes(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8))


def _equal_bytes(x: np.ndarray, y: np.ndarray) -> bool:
    """Whether two byte arrays are equal: compared 8 bytes at a time (NumPy compares uint64 at memory speed,
    bytes objects at a fraction), in stretches that grow from 64 KiB, so spans that differ early cost little."""
    if x.size != y.size:
        return False
    whole = x.size - x.size % 8
    wx, wy = x[:whole].view(np.uint64), y[:whole].view(np.uint64)
    start, step = 0, 1 << 13
    while start < wx.size:
        if not np.array_equal(wx[start : start + step], wy[start : start + step]):
            return False
        start, step = start + step, min(step * 4, 1 << 19)
    return bool((x[whole:] == y[whole:]).all())
