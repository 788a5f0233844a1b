"""Fixed blocks of values: widening to float64, power sums per block or slice, and the compiled loops' dispatch."""

from __future__ import annotations

import functools
import math
import threading
from typing import Any

import numpy as np

from clipcli.core.exact import POWER_OF_TWO_ORDER

try:  # the fused loops, compiled at install (clipcli/_fused.c)
    from clipcli import _fused
except ImportError:  # not built (no compiler): NumPy and BLAS do the same work, summing in BLAS's order
    _fused = None

# Elements per partial sum. Partial sums are taken over fixed blocks counted from the start of
# each tensor and then added exactly, so a norm does not depend on how a tensor is chunked.
BLOCK = 1 << 13
# Values are widened to float64 this many at a time, so temporaries stay small and in the core's cache.
PIECE = 16 * BLOCK


# The reductions themselves: the array methods add a Python call per use, and the fast paths make many.
_sum = np.add.reduce


# The magnitude bits (bits & 0x7FFF) of a 16-bit float from which it is inf or NaN (bfloat16's: `_ml_types`).
INF16 = 0x7C00  # float16's inf; its NaNs lie above
_NONFINITE16 = {np.dtype(np.float16): INF16}


# What `_fused.square_sums` calls the dtypes it reads (bfloat16: `_ml_types`).
_FUSED_KINDS = {np.dtype(np.float32): 0, np.dtype(np.float16): 2}

# Dtypes NumPy does not know itself are numbered from here (NPY_USERDEF): ml_dtypes' among them.
_USER_TYPES = 256


@functools.cache
def _ml_types() -> tuple[frozenset[np.dtype], np.dtype]:
    """The floating dtypes that NumPy does not know (ml_dtypes'; every one of them widens exactly to float32), and
    bfloat16 among them, with its entries in the tables above.

    ml_dtypes is imported here, when a dtype NumPy does not know is first looked at: an array can be of one of
    its types only once it is imported, and a run over NumPy's own types need not (5 ms of its start).
    """
    import ml_dtypes

    bfloat16 = np.dtype(ml_dtypes.bfloat16)
    _NONFINITE16[bfloat16] = 0x7F80
    _FUSED_KINDS[bfloat16] = 1
    names = ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz"]
    names += ["float8_e4m3", "float8_e3m4", "float8_e8m0fnu", "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn"]
    return frozenset(np.dtype(getattr(ml_dtypes, name)) for name in names if hasattr(ml_dtypes, name)), bfloat16


def _is_ml_float(dtype: np.dtype) -> bool:
    """Whether `dtype` is one of ml_dtypes' floating types."""
    return dtype.num >= _USER_TYPES and dtype in _ml_types()[0]


def _is_bfloat16(dtype: np.dtype) -> bool:
    return dtype.num >= _USER_TYPES and dtype == _ml_types()[1]


def __getattr__(name: str) -> Any:
    if name == "BFLOAT16":  # (`_ml_types`: ml_dtypes imported where it is asked for)
        return _ml_types()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Power sums of a block are rescaled by 2**-e (exactly) when |x|**p could leave float64's range.
SCALE_LIMIT = 600


class BlockParts:
    """Parts of blocks cut by chunk edges (blocks count from a tensor's first value), kept until a block is
    whole, so that what is summed block by block does not depend on how the tensor was chunked."""

    __slots__ = ("_parts",)

    def __init__(self) -> None:
        self._parts: dict[int, list[tuple[int, np.ndarray]]] = {}

    def __bool__(self) -> bool:
        return bool(self._parts)

    def add(self, start: int, values: np.ndarray) -> np.ndarray | None:
        """Keeps `values` (kept as given: pass a copy), the part from `start` of its block; returns the
        block's values in order once all its parts are here."""
        block = start // BLOCK
        self._parts.setdefault(block, []).append((start, values))
        return self._take(block, last=False)

    def merge(self, other: BlockParts) -> list[np.ndarray]:
        """Takes `other`'s parts (another worker's of the same tensor); returns the blocks they make whole."""
        whole = []
        for block, parts in other._parts.items():
            self._parts.setdefault(block, []).extend(parts)
            values = self._take(block, last=False)
            if values is not None:
                whole.append(values)
        other._parts = {}
        return whole

    def rest(self) -> list[np.ndarray]:
        """What is left, block by block: each block seen in part (a tensor's tail) as its values in order."""
        return [self._take(block, last=True) for block in sorted(self._parts)]  # type: ignore[misc]

    def _take(self, block: int, last: bool) -> np.ndarray | None:
        parts = self._parts[block]
        if not last and sum(v.size for _, v in parts) < BLOCK:
            return None
        del self._parts[block]
        parts.sort(key=lambda part: part[0])
        return parts[0][1] if len(parts) == 1 else np.concatenate([v for _, v in parts])


def is_floating(dtype: np.dtype) -> bool:
    """Whether `dtype` is a real floating type, NumPy's own or one of ml_dtypes'."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or _is_ml_float(dtype)


def _is_inexact(dtype: np.dtype) -> bool:
    """Whether `dtype` is a floating or complex type."""
    return is_floating(dtype) or np.dtype(dtype).kind == "c"


def check_inexact(t: np.ndarray, op: str) -> None:
    """Raises TypeError, naming `op`, unless `t` is a floating or complex tensor."""
    if not _is_inexact(t.dtype):
        raise TypeError(f"{op} needs a floating or complex tensor, got {t.dtype.name}")


def as_tensor(t: Any) -> np.ndarray:
    """`t` as an array; TypeError for an object array."""
    t = np.asarray(t)
    if t.dtype == object:
        raise TypeError("object arrays are not tensors")
    return t


_local = threading.local()


def scratch(n: int, dtype: type, slot: str = "") -> np.ndarray:
    """A reusable buffer of this thread's (freshly touched memory is slow: reuse it); one per dtype and slot."""
    key = np.dtype(dtype).char + slot
    buf = getattr(_local, key, None)
    if buf is None or buf.size < n:
        buf = np.empty(max(n, PIECE), dtype)
        setattr(_local, key, buf)
    return buf[:n]


def widen(x: np.ndarray, slot: str | None = "") -> tuple[np.ndarray | None, np.ndarray]:
    """The values as float64, exactly (complex values become moduli), and again when they all fit float32.

    The first array, when not None, holds the same values as float32: a cheaper form to scan for the
    largest magnitude (None for float64, complex, bfloat16 and finite float16 values). With a `slot`, `x`
    is flat and both may be scratch buffers, valid until the next call in this thread with the same slot;
    with None, the float64 values are a new array of x's shape (or x itself, when it is float64).
    """
    if x.dtype.kind == "c":
        return None, np.abs(x.astype(np.complex128, copy=False))
    if x.dtype == np.float64:
        return None, x
    if slot is None and x.dtype == np.float16:  # NumPy's cast, in one pass: slow on subnormals only
        return None, x.astype(np.float64)
    wide = np.empty(x.shape) if slot is None else scratch(x.size, np.float64, slot)
    if x.dtype == np.float16 and top16(x) < INF16:  # NumPy's float16 casts are slow (very, on subnormals)
        float16_scaled_down(x.view(np.uint16), wide)
        wide *= 2.0**112
        return None, wide
    if _is_bfloat16(x.dtype):  # ml_dtypes widens bfloat16 to float64 fast (float16 is NumPy's: slow)
        np.copyto(wide, x)
        return None, wide
    narrow = x.astype(np.float32) if _is_ml_float(x.dtype) or x.dtype == np.float16 else x
    np.copyto(wide, narrow)
    return narrow, wide


def top16(x: np.ndarray) -> int:
    """The largest magnitude bits (bits & 0x7FFF) among 16-bit floats; 0 when there are none."""
    return int((x.view(np.uint16) & 0x7FFF).max()) if x.size else 0


def float16_scaled_down(bits: np.ndarray, wide: np.ndarray) -> None:
    """Writes finite float16 values (given as bits) times 2**-112 into float64 `wide`, exactly.

    Moved into float32 position, float16's exponent and mantissa are the float32 of |x| * 2**-112 (the
    exponent biases differ by 112; float16 subnormals become float32 subnormals): no float16 arithmetic.
    """
    u = scratch(bits.size, np.uint32)
    np.left_shift(bits, 16, out=u, dtype=np.uint32)
    signed = u.view(np.int32)
    np.right_shift(signed, 3, out=signed)  # exponent and mantissa in place; the sign copied down
    np.bitwise_and(u, 0x8FFFE000, out=u)  # and cleared where it was copied
    np.copyto(wide, u.view(np.float32))


def square_sums(x: np.ndarray) -> tuple[np.ndarray, int, float] | None:
    """The sum of squares of each block of float32, bfloat16 or float16 values, and their largest magnitude.

    Returns (sums, e, peak): the blocks' sums of squares are `sums * 2**e` (float64 sums of exact squares,
    each rounded as `row_dots` adds); None when the values are of another dtype or some are not finite.
    `x.size` is a multiple of BLOCK. `_fused.square_sums` takes them in one pass; without it, NumPy widens
    pieces of them to float64 first (float16's scaled by 2**-112: its squares and their sums are the same
    bits times 2**-224).
    """
    sums = np.empty(x.size // BLOCK)
    kind = fused_kind(x.dtype)
    if kind is not None:  # one pass over the values as they are; strided ones a piece at a time, copied
        peak, step = 0.0, fused_step(PIECE, x)
        for start in range(0, x.size, step):
            piece = _fused_view(x[start : start + step], kind)
            peak = max(peak, _fused.square_sums(piece, sums[start // BLOCK : (start + piece.size) // BLOCK], kind))
        return (sums, 0, peak) if math.isfinite(_sum(sums)) else None  # else a NaN or inf
    wide = scratch(min(x.size, PIECE), np.float64)
    if x.dtype == np.float32:
        peak = float(max(x.max(), -x.min()))  # NaN when a value is NaN
        if not math.isfinite(peak):
            return None
        for start in range(0, x.size, PIECE):
            piece = x[start : start + PIECE]
            w = wide[: piece.size].reshape(-1, BLOCK)
            np.copyto(w, piece.reshape(-1, BLOCK))
            row_dots(w, w, out=sums[start // BLOCK : (start + piece.size) // BLOCK])
        return sums, 0, peak
    bfloat16 = _is_bfloat16(x.dtype)  # (and so its entry in _NONFINITE16 made)
    if x.dtype not in _NONFINITE16:
        return None
    top = 0
    magnitudes = scratch(min(x.size, PIECE), np.uint16)
    bits = scratch(min(x.size, PIECE), np.uint32)
    for start in range(0, x.size, PIECE):
        piece = x[start : start + PIECE].view(np.uint16)
        m = magnitudes[: piece.size]
        np.bitwise_and(piece, 0x7FFF, out=m)
        top = max(top, int(m.max()))
        w = wide[: piece.size].reshape(-1, BLOCK)
        if bfloat16:  # ml_dtypes widens bfloat16 to float64 fast, and exactly
            np.copyto(w, x[start : start + PIECE].reshape(-1, BLOCK))
        else:  # float16's magnitude bits, moved into float32 position, are the float32 |x| * 2**-112
            b = bits[: piece.size]  # exactly (subnormals included): no slow float16 arithmetic
            np.left_shift(m, 13, out=b, dtype=np.uint32)
            np.copyto(w, b.view(np.float32).reshape(-1, BLOCK))
        row_dots(w, w, out=sums[start // BLOCK : (start + piece.size) // BLOCK])
    if top >= _NONFINITE16[x.dtype]:
        return None
    return sums, 0 if bfloat16 else 224, float(np.array(top, np.uint16).view(x.dtype))


def fused_kind(dtype: np.dtype) -> int | None:
    """The kind `_fused` reads values of `dtype` as; None for other dtypes, or when `_fused` was not built."""
    if _fused is None:
        return None
    if dtype.num >= _USER_TYPES:
        _ml_types()  # (bfloat16's entry)
    return _FUSED_KINDS.get(dtype)


def fused_step(piece: int, *arrays: np.ndarray) -> int:
    """How many values to give a fused loop at a time: all where they lie contiguous, else pieces to copy."""
    return max(arrays[0].size, 1) if all(x.flags.c_contiguous for x in arrays) else piece


def fused_pair_sums(a: np.ndarray, b: np.ndarray, rows: np.ndarray, kinds: tuple[int, int]) -> tuple[int, float]:
    """`_fused.pair_sums` of pieces of A and B of the fused `kinds`: per block, d·d, a·a, b·b and a·b into `rows`.

    Returns:
        How many pairs differ, and the largest magnitude of their differences.
    """
    return _fused.pair_sums(_fused_view(a, kinds[0]), _fused_view(b, kinds[1]), rows, *kinds)


# `_fused.stats_f32`'s output: its length, and where its counts lie (see clipcli/_fused.c).
STATS_LEN = 1068
STATS_SUBNORMAL = 1024
STATS_SCALARS = 1047
# Values one `_fused.stats_f32` call takes at most (its counts are int64 sums of fewer than 2**31 values).
STATS_CALL = 1 << 26


def fused_stats_state() -> np.ndarray:
    """A fresh running total for `fused_stats`: nothing seen (see clipcli/_fused.c, stats_f32)."""
    out = np.zeros(STATS_LEN, np.int64)
    out[STATS_SCALARS + 5 : STATS_SCALARS + 8] = [0x7F800000, 0xFF800000, -1]  # +inf, -inf; no peak
    return out


def fused_stats(x: np.ndarray, out: np.ndarray, start: int) -> np.ndarray | None:
    """`_fused.stats_f32` of flat float32 values (starting a block, the first at flat index `start`).

    Adds their counts into `out` (of `fused_stats_state`, laid out as clipcli/_fused.c says).

    Returns:
        Nine float64 sums per block (`casts.error_sums`' as the C file lays them out); None, `out` left
        as it was, for values of another dtype or more than `STATS_CALL`, or when `_fused` was not built.
    """
    if _fused is None or x.dtype != np.float32 or x.size >= STATS_CALL:
        return None
    errors = np.empty(((x.size + BLOCK - 1) // BLOCK, 9))
    _fused.stats_f32(np.ascontiguousarray(x), out, errors, start)
    return errors


def fused_exact_columns(sums: np.ndarray) -> list[tuple[int, int] | None]:
    """Per column of `fused_stats`' error rows (non-negative float64 terms, `_fused` built), its exact sum as
    (integer, exponent); None for a column whose terms lie too far apart for `_fused.exact_columns`."""
    return _fused.exact_columns(np.ascontiguousarray(sums), sums.shape[1])


def fused_stats_ready(dtype: np.dtype) -> bool:
    """Whether `fused_stats` takes values of `dtype` (`_fused` built, and float32 in native order)."""
    return _fused is not None and dtype == np.float32


def _fused_view(x: np.ndarray, kind: int) -> np.ndarray:
    """Values of a `_fused` kind as its loops read them: float32 as they are, 16-bit floats as their bits."""
    x = np.ascontiguousarray(x)
    return x.view(np.uint16) if kind else x


def row_dots(x: np.ndarray, y: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Σxy of each row (a block) of two float64 matrices, in `_fused`'s fixed order of eight lanes.

    Lane j adds the terms j, j + 8, ... in turn; the lanes are then added pairwise (see clipcli/_fused.c).
    The C loop is as fast as BLAS's dot product, and as accurate for a block of 8192
    positive terms (<= 8192 * 2**-53 relative, within the 1e-12 the norms promise). Its order is the one
    `_fused.pair_sums` takes its four sums in, so the fused path of `DiffAccumulator` gives the bits of the
    others. A row's sum depends on its values alone (not on where it lies in memory), so a norm is the same
    bits for any chunking. Where `_fused` was not built, BLAS's dot product serves, in its own order, on
    every path alike (and `DiffAccumulator` takes no fused path).
    """
    if out is None:
        out = np.empty(x.shape[0])
    if _fused is None:
        return np.vecdot(x, y, out=out)
    _fused.row_dots(np.ascontiguousarray(x), np.ascontiguousarray(y), out)
    return out


def power_sums(
    w: np.ndarray, m: np.ndarray, p: float, slices: Any, segments: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Sums of |w|**p over slices of `w` as `s * 2**k`, rescaling slices whose powers leave float64's range.

    The one kernel of the norms and the differences: over axes, rows of blocks, and segments of tails.

    Args:
        w: float64 values.
        m: the largest magnitude of each slice; `s` and `k` (int64) come shaped like it.
        p: the order.
        slices: the axes summed along, kept in `m` (axis 1 of a matrix: its rows are blocks, whose squares
            are summed in `row_dots`' order); or, with `segments`, where each segment of a flat `w` starts.
        segments: whether `slices` are the starts of segments, each summed by `np.add.reduceat`.
    """
    if math.isinf(p):  # the inf-norm needs the peaks alone
        return m, np.zeros(m.shape, np.int64)
    if p > POWER_OF_TWO_ORDER:
        return _high_order_sums(w / _spread(_divisors(m), w, slices, segments), m, p, slices, segments)
    e = np.frexp(m)[1].astype(np.int64)
    e = np.where(np.abs(e) * p > SCALE_LIMIT, e, 0)
    if e.any():
        w = np.ldexp(w, -_spread(e, w, slices, segments))
    if p == 2.0 and not segments and slices == 1:
        return row_dots(w, w)[:, None], np.where(e != 0, 2 * e, 0).astype(np.int64)
    if p == 2.0:
        powers = np.square(w)
    elif p == 1.0:
        powers = np.abs(w)
    else:
        powers = np.power(np.abs(w), p)
    s = _slice_sums(powers, slices, segments)
    k, fraction = _times_order(e, p)
    return (s * np.exp2(fraction) if p != int(p) else s), k


def row_power_sums(w: np.ndarray, m: np.ndarray, p: float) -> tuple[np.ndarray, np.ndarray]:
    """`power_sums` of each row of `w` (`m`: their peaks), flat; a row shorter than a block (a tensor's tail)
    summed by `segment_power_sums`, as the tails of `small_norms` and `small_diffs` are: the same bits alone
    and among other tails."""
    if w.shape[1] < BLOCK:
        return segment_power_sums(w.reshape(-1), np.arange(0, w.size, w.shape[1]), m, p)
    s, k = power_sums(w, m[:, None], p, 1)
    return s.ravel(), k.ravel()


def segment_power_sums(w: np.ndarray, starts: np.ndarray, m: np.ndarray, p: float) -> tuple[np.ndarray, np.ndarray]:
    """`power_sums` of the segments of a flat array that begin at `starts` (`m`: each one's peak).

    Summed by `np.add.reduceat`, whose sum of a segment does not depend on its neighbours: the tail of a
    tensor gives the same bits alone and among other tensors' (see `small_norms`).
    """
    return power_sums(w, m, p, starts, segments=True)


def _spread(a: np.ndarray, w: np.ndarray, slices: Any, segments: bool) -> np.ndarray:
    """One value per slice laid over the slices' values: repeated along segments, else as it is (it broadcasts)."""
    return np.repeat(a, np.diff(np.append(slices, w.size))) if segments else a


def _slice_sums(x: np.ndarray, slices: Any, segments: bool) -> np.ndarray:
    """The sum of each slice of `x`: of each segment, or along the axes (kept)."""
    return np.add.reduceat(x, slices) if segments else x.sum(axis=slices, keepdims=True)


def _times_order(e: np.ndarray, p: float) -> tuple[np.ndarray, np.ndarray]:
    """e * p for integer exponents e, as an integer part (int64) and a fraction in [0, 1) right to an ulp.

    p's fraction is split into 24 high bits, whose products with e are exact, and the rest, whose products
    are below 2**-13: a float product e * p was off by 9e-14 at e = 997 (a norm of 1e300 2e-14 off at 3.3).
    """
    whole = math.floor(p)
    if whole == p:
        return e * whole, np.zeros(e.shape)
    high = float(np.float32(p - whole))  # p - whole is exact; its top 24 bits
    low = p - whole - high
    a = e * high  # exact: 11 bits times 24
    a_whole = np.floor(a)
    fraction = (a - a_whole) + e * low
    f_whole = np.floor(fraction)
    return e * whole + (a_whole + f_whole).astype(np.int64), fraction - f_whole


def _divisors(m: np.ndarray) -> np.ndarray:
    """Each slice's largest magnitude, what `_high_order_sums` divides it by: 1 where it is 0, inf or NaN."""
    return np.where((m > 0) & np.isfinite(m), m, 1.0)


def _high_order_sums(
    ratios: np.ndarray, m: np.ndarray, p: float, slices: Any, segments: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Sums of |x|**p for an order above `POWER_OF_TWO_ORDER`, as s * 2**k, from each slice's x / m.

    The largest ratio of a slice is exactly 1, so its powers stay in range (the smaller ones may vanish, as
    they would against it); they are summed per slice, and the sums are multiplied by m**p, taken as
    2**(p * log2 m) with the exponent split exactly: m = f * 2**e, p * e = floor(p) * e (an integer) plus
    (p - floor(p)) * e, and p * log2(f) lies in [-p, 0). Each ratio is off by half an ulp at most, its
    power by p half-ulps, and the sum's root by half an ulp again.
    """
    r = np.abs(ratios)
    # Powers below 2**-1000 add nothing beside the slice's largest, 1; NumPy's powers are slow there (subnormals)
    powers = np.power(r, p, out=np.zeros_like(r), where=~(r < 2.0 ** (-1000.0 / p)))  # NaN stays NaN
    s = _slice_sums(powers, slices, segments)
    f, e = np.frexp(_divisors(m))
    whole = math.floor(p)
    k = (p - whole) * e + p * np.log2(f)
    k_whole = np.floor(k)
    return s * np.exp2(k - k_whole), k_whole.astype(np.int64) + e.astype(np.int64) * whole


def add_power_sums(
    total: tuple[np.ndarray, np.ndarray] | None, part: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Two power sums `s * 2**k` added in float64, at the larger exponent of each pair."""
    if total is None:
        return part
    (s, k), (s2, k2) = total, part
    if not k.any() and not k2.any():
        return s + s2, k
    top = np.maximum(k, k2)
    return np.ldexp(s, k - top) + np.ldexp(s2, k2 - top), top


def power_sums_root(s: np.ndarray, k: np.ndarray, p: float) -> np.ndarray:
    """(s * 2**k) ** (1/p): the norms of power sums.

    Orders but 1 and 2 take s in [0.5, 1) (its exponent added to k) and the root as
    2**((rem + log2 s) / p) * 2**whole, with k / p split exactly into the integer `whole` and `rem`, as
    `ExactSum.root` does: a float division k / p was off by up to 4e-14 relative where k is large
    (values of 1e300), 1/p's rounding in s ** (1/p) by 2e-15 where s was 1e-25, and below an order of
    1/1074 that power left float64's range.
    """
    if p in (1.0, 2.0):  # s * 2**k exactly; sqrt(s) * 2**(k/2) correctly rounded (k is even)
        with np.errstate(over="ignore"):
            return np.ldexp(np.sqrt(s) if p == 2.0 else s, k // int(p))
    s, exponents = np.frexp(s)
    k = k + exponents
    if p == int(p):
        whole, rem = np.divmod(k, int(p))  # exact in int64
    else:
        rem = np.fmod(k, p)  # exact (k < 2**53 for orders below 8e12)
        whole = np.round((k - rem) / p).astype(np.int64)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):  # a norm beyond float64 is inf
        r = (rem + np.log2(s)) / p  # -inf for s = 0, NaN for NaN, inf for inf
        below = np.floor(np.where(np.isfinite(r), r, 0.0))
        root = np.ldexp(np.exp2(r - below), np.clip(whole + below, -(2**31), 2**31 - 1).astype(np.int64))
        return np.where(np.isfinite(r), root, np.exp2(r))  # 0 for s = 0 (or far below), inf far above
