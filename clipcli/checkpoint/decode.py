"""Bytes become values in one step: a tensor's stored type, in native byte order."""

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
