"""Norms over some axes of a tensor, summed in groups of whole rows that a stream of chunks reproduces."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from clipcli.core.blocks import add_power_sums, power_sums, power_sums_root, widen

# A norm over axes that include axis 0 reduces about this many values at a time, in groups of whole rows
# (slices along axis 0) fixed by the tensor's shape: a tensor streamed in chunks of whole groups gets the
# same bits as one held in memory, and nothing larger than a group is widened.
_GROUP = 1 << 16


def normalize_axes(axes: Any, ndim: int) -> tuple[int, ...] | None:
    """Axes as sorted non-negative ints (None stays None).

    Raises:
        ValueError: for an axis out of range or a repeated axis.
    """
    if axes is None:
        return None
    if isinstance(axes, (int, np.integer)):
        axes = (axes,)
    out = []
    for a in axes:
        a = int(a)
        if not -ndim <= a < ndim:
            raise ValueError(f"axis {a} is out of range for a tensor of rank {ndim}")
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"duplicate axes in {tuple(axes)}")
    return tuple(sorted(out))


def axis_norm(t: np.ndarray, p: float, axes: tuple[int, ...]) -> np.ndarray:
    """The p-norm over `axes` of a floating or complex tensor, with the axes kept, as float64."""
    if math.isinf(p):
        with np.errstate(invalid="ignore"):  # signalling NaNs in the data; they are NaN norms all the same
            return np.abs(widen(t, None)[1]).max(axis=axes, keepdims=True, initial=0.0)
    root = power_sums_root(*tensor_power_sums(t, p, axes), p)
    if p in (1.0, 2.0):  # rounded sums of non-negative terms: never below the largest term
        return root
    with np.errstate(invalid="ignore"):  # never below the largest magnitude either (rounded powers could put it so)
        return np.maximum(root, np.abs(widen(t, None)[1]).max(axis=axes, keepdims=True, initial=0.0))


def tensor_power_sums(t: np.ndarray, p: float, axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The sums of |x|**p over `axes` (a finite p) as `(s, k)`, the sums being s * 2**k, axes kept."""
    if 0 in axes:
        total = None
        for part in axis_power_sums(t, axes, p):
            total = add_power_sums(total, part)
        assert total is not None
        return total
    # Signalling NaNs in the data are NaN norms all the same; the powers of slices holding NaN or Inf (not
    # scaled) may overflow, and those norms are NaN or inf.
    with np.errstate(invalid="ignore", over="ignore"):
        w = widen(t, None)[1]
        m = np.abs(w).max(axis=axes, keepdims=True, initial=0.0)
        return power_sums(w, m, p, axes)


def row_group(shape: tuple[int, ...]) -> int:
    """The rows (slices along axis 0) in each group of a norm over axes that include axis 0."""
    return max(_GROUP // max(math.prod(shape[1:]), 1), 1)


def axis_power_sums(rows: np.ndarray, axes: tuple[int, ...], p: float) -> list[tuple[np.ndarray, np.ndarray]]:
    """The sums of |x|**p over `axes` (which include axis 0) of each group of `rows`, in order, as (s, k).

    `rows` is a tensor, or a run of its rows that starts at a group's first row. The sums of a group are
    `s * 2**k`, shaped like the norm (the axes kept); fold them in order with `add_power_sums`.
    """
    group = row_group(rows.shape)
    parts = []
    with np.errstate(invalid="ignore", over="ignore"):  # as in `tensor_power_sums`
        for start in range(0, max(rows.shape[0], 1), group):
            w = widen(rows[start : start + group], None)[1]
            m = np.abs(w).max(axis=axes, keepdims=True, initial=0.0)
            parts.append(power_sums(w, m, p, axes))
    return parts
