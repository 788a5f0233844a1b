"""Clip scales, and tensors scaled by them rounded once to their own dtype."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from clipcli.core.blocks import (
    BFLOAT16,
    BLOCK,
    INF16,
    check_inexact,
    float16_scaled_down,
    power_sums_root,
    scratch,
    top16,
)
from clipcli.core.exact import ldexp
from clipcli.core.norms import NormStats


def clip_scale(norm: Any, clip_norm: float) -> Any:
    """The factor `clip_norm / max(norm, clip_norm)`, in float64; exactly 1.0 when norm <= clip_norm.

    A NaN or infinite norm gives NaN, as in TensorFlow (every output becomes NaN).
    """
    norm = np.asarray(norm, dtype=np.float64)
    # norm 0 with clip_norm 0, or a tiny norm under a huge clip_norm: np.where takes 1.0 there
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        scale = np.where(norm <= clip_norm, 1.0, clip_norm / norm)
    scale = np.where(np.isfinite(norm), scale, np.nan)
    return scale if scale.ndim else float(scale)


def stats_clip_scale(stats: NormStats, clip_norm: float) -> float:
    """`clip_scale` from the exact norm: finite and right also when the norm is too large for float64.

    NaN or Inf in the data give NaN, as `clip_scale` does for a NaN or infinite norm. A scale below
    float64's normal range (clip_norm / norm < 2**-1022) comes as a `_Scale`, which keeps its 53 bits.
    """
    if stats.exact is None or math.isfinite(stats.norm):
        scale = clip_scale(stats.norm, clip_norm)
        if 0.0 <= scale < _MIN_NORMAL and clip_norm > 0:
            return _quotient_scale(clip_norm, stats.norm, 0)
        return scale
    m, e = stats.exact  # a finite norm beyond float64: certainly larger than clip_norm
    return _quotient_scale(clip_norm, m, e)


_MIN_NORMAL = 2.0**-1022


class _Scale(float):
    """A scale below float64's normal range: the float it rounds to, with its 53 bits kept as `q * 2**e`
    (`parts`), which `scaled` multiplies float64 tensors by (a subnormal float64 holds fewer bits: clipping
    float64 3e300s to 1e-300 gave 0)."""

    parts: tuple[float, int]


def _quotient_scale(clip_norm: float, m: float, e: int) -> float:
    """clip_norm / (m * 2**e), rounded once: a float, or a `_Scale` below float64's normal range."""
    (cm, ce), (mm, me) = math.frexp(clip_norm), math.frexp(m)
    q, qe = math.frexp(cm / mm)  # clip_norm / norm's 53 bits, in [0.5, 1): t * q cannot overflow
    exponent = qe + ce - me - e
    value = ldexp(q, exponent)
    if value >= _MIN_NORMAL:
        return value
    scale = _Scale(value)
    scale.parts = (q, exponent)
    return scale


def tensor_clip_scale(stats: NormStats, clip_norm: float) -> float:
    """The scale of `tf.clip_by_norm` on a whole tensor, `clip_norm / max(norm, clip_norm)`.

    As in TensorFlow's `t * clip_norm / max(norm, clip_norm)`: a tensor holding +-inf (and no NaN) is
    scaled by 0 (NaN where it is +-inf, +-0 elsewhere); one holding NaN by NaN.
    """
    if stats.inf and not stats.nan:
        return 0.0
    return stats_clip_scale(stats, clip_norm)


def sums_clip_scale(s: np.ndarray, k: np.ndarray, clip_norm: float) -> np.ndarray:
    """`tensor_clip_scale` for each slice, from its sum of squares `s * 2**k` (k even).

    Scales below float64's normal range come as a `_Scales` array, which keeps their 53 bits (`parts`).
    """
    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):  # zero and non-finite sums
        (cm, ce), (rm, re) = math.frexp(clip_norm), np.frexp(np.sqrt(s))
        q, qe = np.frexp(cm / rm)  # clip_norm / sqrt(s)'s 53 bits, in [0.5, 1)
        clip = power_sums_root(s, k, 2.0) > clip_norm
        q = np.where(np.isnan(s), np.nan, np.where(np.isinf(s), 0.0, np.where(clip, q, 1.0)))
        e = np.where(clip & np.isfinite(s), qe + ce - re - k // 2, 0)
        scale = np.ldexp(q, e)
    if not ((q > 0) & (scale < _MIN_NORMAL)).any():  # (0 where it underflows even float64's subnormals)
        return scale
    scales = scale.view(_Scales)
    scales.parts = (q, e)
    return scales


class _Scales(np.ndarray):
    """Per-slice scales some of which lie below float64's normal range, with their 53 bits kept as
    `q * 2**e` (`parts`), as `_Scale` keeps one."""

    parts: tuple[np.ndarray, np.ndarray]


def scaled(t: np.ndarray, scale: Any, out: np.ndarray | None = None) -> np.ndarray:
    """`t * scale` rounded once to t's dtype, the scale rounded to float32's 24 bits for <= 32-bit types.

    The scale keeps 24 significant bits whatever its size: below float32's normal range (2**-126), where a
    float32 would keep fewer, the products are taken in float64 (exactly) and rounded once. 16- and 8-bit
    floats: `x * scale24` is exact in float64, and rounded once to the dtype (through `_round_to_odd`), not
    to float32 first and then again. float64 tensors take the scale as it is.

    A scale of exactly 1.0 gives an identical copy (no ulp drift). `out` (t's dtype and shape; it may be
    `t` itself) receives the result instead of a new array.
    """
    check_inexact(t, "scaling")
    parts = getattr(scale, "parts", None)
    if parts is not None and t.dtype in (np.float64, np.complex128):
        return _scaled_by_parts(t, *parts, out=out)
    scale = np.asarray(scale, dtype=np.float64)
    if not scale.ndim and scale == 1.0:
        if out is None:
            return t.copy()
        np.copyto(out, t)
        return out
    out = np.empty_like(t) if out is None else out  # also 0-d: NumPy would return a scalar
    # NaN scales and signalling NaNs in the data raise "invalid"; rounding into a narrow type may overflow
    # to inf. Both are the intended results.
    with np.errstate(invalid="ignore", over="ignore"):
        if t.dtype in (np.float64, np.complex128):
            return np.multiply(t, scale, out=out)
        factor = _float32_precision(scale)
        if t.dtype in (np.float32, np.complex64):
            return np.multiply(t, factor, out=out, dtype=np.result_type(t.dtype, factor.dtype))
        flat = t.ndim == out.ndim and t.flags.c_contiguous and out.flags.c_contiguous  # both walk as one row
        if t.dtype == np.float16 and flat and not factor.ndim and factor >= 0 and top16(t) < INF16:
            return _scaled_float16(t, factor, out)
        _scaled_narrow(t, np.broadcast_to(factor, t.shape), out)
        return out


def _scaled_by_parts(t: np.ndarray, q: Any, e: Any, out: np.ndarray | None) -> np.ndarray:
    """`t * q * 2**e` for float64 and complex128 tensors (a `_Scale`, or `_Scales` per slice): by q (in
    [0.5, 1): no overflow), rounded once, then by powers of two, exact until the product leaves float64's
    normal range (where it rounds once more, into a subnormal)."""
    out = np.multiply(t, q, out=out)
    e = np.asarray(e, np.int64)
    with np.errstate(under="ignore", invalid="ignore"):
        while (e < -1000).any():
            step = np.maximum(e, -1000)
            out *= np.ldexp(1.0, step)
            e = e - step
        out *= np.ldexp(1.0, e)
    return out


_FLOAT32_NORMAL = 2.0**-126


def _float32_precision(scale: np.ndarray) -> np.ndarray:
    """The scale rounded to 24 significant bits: as float32, or as float64 where float32's range cannot hold it.

    A float32 below 2**-126 keeps fewer bits (a scale of 1e-43 would be 0.3% off); such scales, and those
    beyond float32's range, come back as float64 with 24 significant bits, so products with them are exact.
    """
    with np.errstate(over="ignore"):
        narrow = scale.astype(np.float32)
    magnitude = np.abs(scale)
    if ((magnitude >= _FLOAT32_NORMAL) & np.isfinite(narrow) | (magnitude == 0) | ~np.isfinite(scale)).all():
        return narrow  # float32's range holds it: rounded to 24 bits (the common case)
    mantissa, exponent = np.frexp(scale)
    return np.ldexp(mantissa.astype(np.float32).astype(np.float64), exponent)


# Pieces of 16- and 8-bit values scaled at a time, their temporaries (15 to 20 bytes a value) near the float32
# ones of earlier (one per value of `PIECE`), for many workers' memory.
_NARROW_PIECE = 8 * BLOCK


def _scaled_narrow(t: np.ndarray, factor: np.ndarray, out: np.ndarray) -> None:
    """`scaled` for 16- and 8-bit floats, with `factor` of t's shape (a broadcast view will do; 24 bits).

    Each product is exact in float64 (at most 11 bits times 24) and rounded once to the dtype through
    `_round_to_odd`, in pieces of `_NARROW_PIECE` values (rows, or parts of one): temporaries stay small
    whatever the shape and whichever axes the factors vary along.
    """
    if (t.size <= _NARROW_PIECE or not t.ndim) and t.dtype == BFLOAT16 and factor.dtype == np.float32:
        _scaled_bfloat16(t, factor, out)
    elif t.size <= _NARROW_PIECE or not t.ndim:
        product = scratch(t.size, np.float64, "product").reshape(t.shape)
        np.multiply(t, factor, out=product, dtype=np.float64)
        narrow = _round_to_odd(product, scratch(t.size, np.float32, "narrow").reshape(t.shape))
        np.copyto(out, narrow, casting="unsafe")
    elif t.shape[0] == 1:  # one row longer than a piece: its parts
        _scaled_narrow(t[0], factor[0], out[0])
    else:
        step = max(_NARROW_PIECE // (t.size // t.shape[0]), 1)
        for i in range(0, t.shape[0], step):
            _scaled_narrow(t[i : i + step], factor[i : i + step], out[i : i + step])


def _scaled_bfloat16(t: np.ndarray, factor: np.ndarray, out: np.ndarray) -> None:
    """`_scaled_narrow` for a piece of bfloat16: the float32 product, made exact where it matters.

    Rounding the float32 product again to bfloat16 gives the once-rounded exact product, except where the
    float32 product lies exactly halfway between two bfloat16 values (its low 16 bits are 0x8000): the
    exact product, on one side of it, may round the other way. Only those few are rounded from the exact
    product (`_round_to_odd`); the rest cost what the float32 product does.
    """
    narrow = scratch(t.size, np.float32, "narrow").reshape(t.shape)
    np.multiply(t, factor, out=narrow, dtype=np.float32)
    low = np.bitwise_and(narrow.view(np.uint32), 0xFFFF, out=scratch(t.size, np.uint32, "low").reshape(t.shape))
    halfway = np.equal(low, 0x8000, out=scratch(t.size, np.bool_, "halfway").reshape(t.shape))
    if halfway.any():
        at = np.nonzero(halfway)
        exact = t[at].astype(np.float64) * factor[at]
        narrow[at] = _round_to_odd(exact, np.empty(exact.size, np.float32))
    np.copyto(out, narrow, casting="unsafe")


def _round_to_odd(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """float64 `x` rounded to float32 `out` to odd: toward zero, then the last bit set where that was inexact.

    Rounded so and then to nearest in a type of at most 22 bits of precision (float16, bfloat16, float8),
    a value comes out as if rounded once, directly: the odd bit keeps what the second rounding needs to
    know, that the value lay off the float32 grid (Boldo & Melquiond, "When double rounding is odd").
    NaN and inf stay as they are; finite values beyond float32's range become its largest, odd, value.
    """
    np.copyto(out, x)  # to nearest
    inexact, away, negative = (scratch(x.size, np.bool_, k).reshape(x.shape) for k in ("inexact", "away", "neg"))
    np.not_equal(out, x, out=inexact)
    np.greater(out, x, out=away)  # away from zero where above a positive value or not above a negative one
    np.not_equal(away, np.signbit(x, out=negative), out=away)
    away &= inexact
    bits = out.view(np.uint32)
    np.subtract(bits, away, out=bits, casting="unsafe")  # toward zero
    np.bitwise_or(bits, inexact, out=bits, casting="unsafe")  # odd where not exact
    return out


def _scaled_float16(t: np.ndarray, factor: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """`scaled` for finite float16 values and a factor >= 0: the exact product, rounded once to float16.

    Bits are moved instead of NumPy's float16 casts, which are slow on subnormals (most
    of a float16 gradient), and no float32 arithmetic sees a subnormal (as slow).
    """
    result = np.empty_like(t) if out is None else out
    source, target = t.reshape(-1).view(np.uint16), result.reshape(-1).view(np.uint16)
    for start in range(0, source.size, _NARROW_PIECE):
        bits = source[start : start + _NARROW_PIECE]
        n = bits.size
        m, product, sign = scratch(n, np.int32), scratch(n, np.float64), scratch(n, np.uint16)
        np.bitwise_and(bits, 0x8000, out=sign)
        float16_scaled_down(bits, product)
        product *= float(factor) * 2.0**112  # t * factor, exactly
        u = scratch(n, np.uint32)  # float16_scaled_down's scratch, free again
        v = u.view(np.float32)
        _round_to_odd(product, v)  # to float32, keeping the bit that rounds it right to float16 below
        # Round |v| to float16's grid: adding 2**(E + 13), whose ulp is float16's ulp at v's exponent E
        # (E >= -14: float16's subnormal spacing below), rounds to nearest even; the sum's bits minus the
        # addend's count float16 ulps, which are float16's bits once the exponent is added back.
        np.bitwise_and(u, 0x7FFFFFFF, out=u)
        np.minimum(v, 65536.0, out=v)  # anything from 65520 up rounds to inf
        mu = m.view(np.uint32)
        np.bitwise_and(u, 0x7F800000, out=mu)
        np.maximum(mu, 113 << 23, out=mu)
        mu += 13 << 23
        v += mu.view(np.float32)
        u -= mu
        mu >>= 13
        u += mu
        u -= 126 << 10
        np.bitwise_or(u, sign, out=target[start : start + n], casting="unsafe")
    return result
