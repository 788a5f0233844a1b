"""TensorFlow's clipping and norm operations on NumPy arrays, with TensorFlow's argument checks."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from clipcli.core.axes import axis_norm, normalize_axes, tensor_power_sums
from clipcli.core.blocks import INF16, PIECE, as_tensor, check_inexact, is_floating, scratch, top16, widen
from clipcli.core.norms import NormAccumulator, NormStats, given_norm_stats, parse_ord
from clipcli.core.scale import scaled, stats_clip_scale, sums_clip_scale, tensor_clip_scale


def clip_by_value(t: Any, clip_value_min: Any, clip_value_max: Any, out: np.ndarray | None = None) -> np.ndarray:
    """`tf.clip_by_value`: min(max(t, clip_value_min), clip_value_max), computed as TensorFlow does.

    The bounds are converted to t's dtype first (a bfloat16 tensor clipped at 0.1 is clipped at
    0.10009765625); bounds may be tensors that broadcast to t's shape. NaN stays NaN; +-inf is clipped.
    `out` (t's dtype and shape; it may be `t` itself) receives the result instead of a new array.

    Raises:
        TypeError: for a float bound on an integer tensor, or a boolean or complex tensor.
        ValueError: when a bound would broadcast the result to a larger shape than t.
    """
    t = as_tensor(t)
    if t.dtype.kind in "bc":
        raise TypeError(f"clip_by_value does not support {t.dtype.name} tensors")
    lo, hi = _bound(clip_value_min, t.dtype), _bound(clip_value_max, t.dtype)
    shape = np.broadcast_shapes(t.shape, lo.shape, hi.shape)
    if shape != t.shape:
        raise ValueError(f"clip bounds of shape {lo.shape} and {hi.shape} would broadcast {t.shape} to {shape}")
    flat = t.flags.c_contiguous and (out is None or (out.flags.c_contiguous and out.ndim == t.ndim))
    if t.dtype == np.float16 and flat and _plain_bounds(lo, hi) and top16(t) <= INF16:
        return _clip_float16(t, lo, hi, out)
    out = np.empty_like(t) if out is None else out  # also 0-d: NumPy would return a scalar
    with np.errstate(invalid="ignore"):  # signalling NaNs stay NaN
        np.minimum(t, hi, out=out)
        return np.maximum(out, lo, out=out)


def _plain_bounds(lo: np.ndarray, hi: np.ndarray) -> bool:
    """Whether float16 bounds are scalars, neither NaN nor -0.0 (what `_clip_float16` takes)."""
    return (
        not lo.ndim
        and not hi.ndim
        and max(top16(lo), top16(hi)) <= INF16
        and (-0x8000 not in (lo.view(np.int16), hi.view(np.int16)))
    )


def _clip_float16(t: np.ndarray, lo: np.ndarray, hi: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """`clip_by_value` for float16 values without NaN and scalar bounds (not -0.0), on integer keys.

    NumPy's float16 comparisons are slow. A value's key is its magnitude's bits, negated when the
    sign is set: keys order as the values do, +-0 equal. Clipped keys turn back into bits; -0.0 stays
    -0.0 where it is kept, as NumPy's float16 minimum and maximum keep a value equal to a bound.
    """
    result = np.empty_like(t) if out is None else out
    source, target = t.reshape(-1).view(np.int16), result.reshape(-1).view(np.int16)
    lo_key, hi_key = (int(_float16_keys(b.reshape(1).view(np.int16))[0]) for b in (lo, hi))
    keeps_zero = lo_key <= 0 <= hi_key
    for start in range(0, source.size, PIECE):
        bits, res = source[start : start + PIECE], target[start : start + PIECE]
        key, negative_zero = scratch(bits.size, np.int16), scratch(bits.size, np.bool_)
        if keeps_zero:
            np.equal(bits, -0x8000, out=negative_zero)
        _float16_keys(bits, out=key)
        np.minimum(key, hi_key, out=key)  # in TensorFlow's order: with lo > hi, everything becomes lo
        np.maximum(key, lo_key, out=key)
        sign = np.right_shift(key, 15, out=res)  # -1 where negative, else 0
        np.bitwise_xor(key, sign, out=key)
        key -= sign  # the magnitude
        np.bitwise_and(sign, -0x8000, out=res)
        res |= key
        if keeps_zero:
            res |= negative_zero.view(np.int8).astype(np.int16) << 15
    return result


def _float16_keys(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Ordered integer keys of float16 bit patterns (int16): the magnitude, negated when the sign is set."""
    sign = bits >> 15  # -1 or 0
    key = np.bitwise_and(bits, 0x7FFF, out=out)
    key ^= sign
    key -= sign
    return key


def _bound(value: Any, dtype: np.dtype) -> np.ndarray:
    b = np.asarray(value)
    if dtype.kind in "iu":
        if b.dtype.kind not in "iub":
            raise TypeError(f"cannot convert a {b.dtype.name} clip bound to an integer tensor's {dtype.name}")
        info = np.iinfo(dtype)  # a bound beyond the range clips like the range's end
        return np.clip(b, info.min, info.max).astype(dtype)
    if b.dtype.kind not in "iu" and not is_floating(b.dtype):
        raise TypeError(f"cannot convert a {b.dtype.name} clip bound to {dtype.name}")
    with np.errstate(over="ignore", invalid="ignore"):  # a bound beyond the range becomes inf: it clips the same
        bound = b.astype(dtype)
        lost = np.isnan(bound) & ~np.isnan(b)
    if lost.any():  # beyond the range of a type that has no inf (float8 'fn' types): NaN, which would clip every
        top = ml_dtypes.finfo(dtype).max  # value to NaN; its largest finite value clips the same as inf would
        bound = np.where(lost, np.where(b > 0, top, -top).astype(dtype), bound)
    return bound


def clip_by_norm(t: Any, clip_norm: float, axes: Any = None) -> np.ndarray:
    """`tf.clip_by_norm`: t * clip_norm / max(l2norm(t, axes), clip_norm).

    The norm is taken over `axes` (all of them by default; negative axes count from the end) and
    computed exactly in float64. A tensor whose norm is at most `clip_norm` comes back bit-identical.
    A negative `clip_norm` is treated as 0, as TensorFlow does.

    Raises:
        TypeError: for an integer or boolean tensor.
        ValueError: for an axis out of range.
    """
    t = as_tensor(t)
    check_inexact(t, "clip_by_norm")
    clip_norm = max(float(clip_norm), 0.0)
    axes = normalize_axes(axes, t.ndim)
    if axes is None or len(axes) == t.ndim:
        return scaled(t, tensor_clip_scale(_stats_accumulator(t, 2).result(), clip_norm))
    return scaled(t, sums_clip_scale(*tensor_power_sums(t, 2.0, axes), clip_norm))


def clip_by_global_norm(t_list: Sequence[Any], clip_norm: float, use_norm: Any = None) -> tuple[list[Any], float]:
    """`tf.clip_by_global_norm`: each t * clip_norm / max(global_norm, clip_norm), with one scale.

    Entries that are None stay None. If the global norm (or `use_norm`) is NaN or infinite every
    output is NaN, as in TensorFlow. Tensors come back bit-identical when no clipping is needed.

    Returns:
        The clipped tensors and the global norm (the computed one, or `use_norm`) as float64.

    Raises:
        TypeError: if `t_list` is a single array rather than a list or tuple, or holds integers.
    """
    _check_sequence(t_list)
    tensors = [None if t is None else as_tensor(t) for t in t_list]
    for t in tensors:
        if t is not None:
            check_inexact(t, "clip_by_global_norm")
    stats = _global_stats(tensors) if use_norm is None else given_norm_stats(use_norm)
    scale = _global_scale(stats, float(clip_norm))
    return [None if t is None else scaled(t, scale) for t in tensors], stats.norm


def _global_scale(stats: NormStats, clip_norm: float) -> float:
    # TensorFlow computes clip_norm * min(1/g, 1/clip_norm): a negative clip_norm leaves the
    # tensors as they are, a zero clip_norm zeroes them.
    if clip_norm < 0 and not (stats.nan or stats.inf):
        return 1.0
    return stats_clip_scale(stats, clip_norm)


def global_norm(t_list: Sequence[Any]) -> float:
    """`tf.linalg.global_norm`: sqrt(sum(l2norm(t)**2 for t in t_list)), as float64.

    Entries that are None are ignored. Accumulated in float64 from exactly widened values, with block
    sums added exactly, so it is right to within 1e-12 relative (typically 1e-15) at any size and never
    overflows on the way (TensorFlow: 3.8e-7 at 10**8).

    Raises:
        TypeError: if `t_list` is not a list or tuple, or holds an integer tensor.
    """
    _check_sequence(t_list)
    return _global_stats(t_list).norm


def _global_stats(t_list: Sequence[Any]) -> NormStats:
    total = NormAccumulator(2)
    for t in t_list:
        if t is not None:
            total.merge(_stats_accumulator(np.asarray(t), 2))
    return total.result()


def _stats_accumulator(t: np.ndarray, ord: Any) -> NormAccumulator:
    acc = NormAccumulator(ord)
    acc.add(t)
    return acc


def _check_sequence(t_list: Any) -> None:
    if not isinstance(t_list, Sequence) or isinstance(t_list, (str, bytes)):
        raise TypeError(f"`t_list` should be a list or tuple of tensors, got {type(t_list).__name__}")


_MATRIX_ORDS = ("euclidean", "fro", 1, 2, math.inf)


def norm(t: Any, ord: Any = "euclidean", axis: Any = None, keepdims: bool = False) -> Any:
    """`tf.norm`: a vector norm over all values or one axis, or a matrix norm over two axes, as float64.

    Vector orders: 'euclidean' (2), 1, inf and any p > 0. Matrix orders (a 2-axis `axis`): 'fro' and
    'euclidean' (Frobenius), 1 (largest column sum), inf (largest row sum) and 2 (largest singular value).

    Raises:
        TypeError: for an integer or boolean tensor.
        ValueError: for an unsupported order or axis.
    """
    t = as_tensor(t)
    check_inexact(t, "norm")
    if isinstance(axis, (list, tuple)) and len(axis) == 2:
        axes: tuple[int, ...] = _matrix_axes(axis, t.ndim)
        result = _matrix_norm(t, ord, axes)
    elif axis is None:
        axes = tuple(range(t.ndim))
        result = np.full((1,) * t.ndim, _stats_accumulator(t, ord).result().norm)
    else:
        if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):  # as TensorFlow: no 1-element list
            raise ValueError(f"'axis' must be None, an integer, or a tuple of 2 unique integers, got {axis!r}")
        axes = normalize_axes(axis, t.ndim) or ()
        result = axis_norm(t, parse_ord(ord), axes)
    if not keepdims:
        result = np.squeeze(result, axis=axes)
    return float(result) if result.ndim == 0 else result


def _matrix_axes(axis: Sequence[Any], ndim: int) -> tuple[int, int]:
    a0, a1 = (int(a) for a in axis)
    for a in (a0, a1):
        if not -ndim <= a < ndim:
            raise ValueError(f"axis {a} is out of range for a tensor of rank {ndim}")
    a0, a1 = a0 % ndim, a1 % ndim
    if a0 == a1:
        raise ValueError(f"'axis' must name two different axes, got {tuple(axis)!r}")
    return a0, a1


def _matrix_norm(t: np.ndarray, ord: Any, axes: tuple[int, int]) -> np.ndarray:
    rows, cols = axes
    if isinstance(ord, bool) or ord not in _MATRIX_ORDS:
        raise ValueError(f"'ord' must be one of 'fro', 'euclidean', 1, 2, inf for a matrix norm, got {ord!r}")
    if ord in ("fro", "euclidean"):
        return axis_norm(t, 2.0, tuple(sorted(axes)))
    if ord == 1:
        return axis_norm(t, 1.0, (rows,)).max(axis=cols, keepdims=True)
    if ord == math.inf:
        return axis_norm(t, 1.0, (cols,)).max(axis=rows, keepdims=True)
    w = np.moveaxis(widen(t, None)[1] if t.dtype.kind != "c" else t.astype(np.complex128), (rows, cols), (-2, -1))
    sigma = np.linalg.svd(w, compute_uv=False)[..., 0]
    return np.expand_dims(sigma, axis=(rows, cols))
