"""Norms and TensorFlow's clipping operations on NumPy arrays, accumulated exactly in float64."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import ml_dtypes
import numpy as np

try:  # the fused loops, compiled at install (clipcli/_fused.c)
    from clipcli import _fused
except ImportError:  # not built (no compiler): NumPy and BLAS do the same work, summing in BLAS's order
    _fused = None

__all__ = [
    "BLOCK",
    "DiffAccumulator",
    "DiffStats",
    "NormAccumulator",
    "NormStats",
    "SmallDiffs",
    "SmallNorms",
    "clip_by_global_norm",
    "clip_by_norm",
    "clip_by_value",
    "clip_scale",
    "diff",
    "given_norm_stats",
    "global_norm",
    "is_floating",
    "norm",
    "normalize_axes",
    "parse_ord",
    "scaled",
    "small_diffs",
    "small_norms",
    "stats_clip_scale",
    "sums_clip_scale",
    "tensor_clip_scale",
]

# Elements per partial sum. Partial sums are taken over fixed blocks counted from the start of
# each tensor and then added exactly, so a norm does not depend on how a tensor is chunked.
BLOCK = 1 << 13
# Values are widened to float64 this many at a time, so temporaries stay small and in the core's cache.
_PIECE = 16 * BLOCK
# Pieces of 16- and 8-bit values scaled at a time, their temporaries (15 to 20 bytes a value) near the float32
# ones of earlier (one per value of `_PIECE`), for many workers' memory.
_NARROW_PIECE = 8 * BLOCK
# Pieces of pairs in `DiffAccumulator`'s fast path: twice as large, as it makes twice the NumPy calls a piece
# (larger still is slower with two workers, whose scratch buffers then crowd the shared cache).
_PAIR_PIECE = 32 * BLOCK
# The reductions themselves: the array methods add a Python call per use, and the fast paths make many.
_sum, _max, _min = np.add.reduce, np.maximum.reduce, np.minimum.reduce

# Floating dtypes that NumPy does not know; every one of them widens exactly to float32.
_ML_FLOATS = frozenset(
    np.dtype(getattr(ml_dtypes, name))
    for name in (
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e4m3b11fnuz",
        "float8_e4m3",
        "float8_e3m4",
        "float8_e8m0fnu",
        "float6_e2m3fn",
        "float6_e3m2fn",
        "float4_e2m1fn",
    )
    if hasattr(ml_dtypes, name)
)

_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

# The magnitude bits (bits & 0x7FFF) of a 16-bit float from which it is inf or NaN.
_INF16 = 0x7C00  # float16's inf; its NaNs lie above
_NONFINITE16 = {_BFLOAT16: 0x7F80, np.dtype(np.float16): _INF16}
# What `_fused.square_sums` calls the dtypes it reads.
_FUSED_KINDS = {np.dtype(np.float32): 0, _BFLOAT16: 1, np.dtype(np.float16): 2}

# Power sums of a block are rescaled by 2**-e (exactly) when |x|**p could leave float64's range.
_SCALE_LIMIT = 600
# Up to this order a block's powers are scaled by a power of two, its largest into [0.5, 1), and summed
# exactly; above it that largest power could leave float64's range (0.5 ** 1075 is 0), so each block is
# divided by its largest magnitude instead (`_high_order_sums`) and the sums keep `_WINDOW` bits.
_POWER_OF_TWO_ORDER = 1000.0
# Bits an order's exact sum keeps above `_POWER_OF_TWO_ORDER` (below it: all; they span at most ~2.2 million).
# The roots read 64 of them; the rest are margin, so that the sums' order cannot reach those 64.
_WINDOW = 4096
# The largest finite order. Its sums' exponents (p * 1075 at most) stay within int64; from there on the p-norm
# of up to 2**63 values lies within 1e-13 relative of the largest magnitude, which is `ord=inf`.
MAX_ORDER = 1e15

# A norm over axes that include axis 0 reduces about this many values at a time, in groups of whole rows
# (slices along axis 0) fixed by the tensor's shape: a tensor streamed in chunks of whole groups gets the
# same bits as one held in memory, and nothing larger than a group is widened.
_GROUP = 1 << 16


def is_floating(dtype: np.dtype) -> bool:
    """Whether `dtype` is a real floating type, NumPy's own or one of ml_dtypes'."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or dtype in _ML_FLOATS


def _is_inexact(dtype: np.dtype) -> bool:
    return is_floating(dtype) or np.dtype(dtype).kind == "c"


def _check_inexact(t: np.ndarray, op: str) -> None:
    if not _is_inexact(t.dtype):
        raise TypeError(f"{op} needs a floating or complex tensor, got {t.dtype.name}")


def parse_ord(ord: Any) -> float:
    """The vector order as a float: 'euclidean' is 2, and any p > 0 or inf is accepted.

    Raises:
        ValueError: for any other order, as TensorFlow does.
    """
    if type(ord) is float and 0 < ord <= MAX_ORDER:  # the common case, first: an accumulator per tensor parses it
        return ord
    if isinstance(ord, str):
        if ord == "euclidean":
            return 2.0
        raise ValueError(f"'ord' must be 'euclidean', inf or a number > 0 for a vector norm, got {ord!r}")
    if isinstance(ord, bool) or not isinstance(ord, (int, float, np.integer, np.floating)):
        raise ValueError(f"'ord' must be a number, got {ord!r}")
    p = float(ord)
    if not p > 0:
        raise ValueError(f"'ord' must be > 0, got {ord!r}")
    if MAX_ORDER < p < math.inf:
        raise ValueError(
            f"'ord' above {MAX_ORDER:g} is not supported (the norm is then the largest magnitude to 1e-13: ord=inf),"
            f" got {ord!r}"
        )
    return p


def _magnitudes(x: np.ndarray) -> np.ndarray:
    """The values of `x` as float64, widened exactly (complex values become their moduli)."""
    if x.dtype.kind == "c":
        return np.abs(x.astype(np.complex128, copy=False))
    if x.dtype == np.float64:
        return x
    if x.dtype in _ML_FLOATS:
        x = x.astype(np.float32)
    return x.astype(np.float64)


@dataclass(unsafe_hash=True)  # never changed once made; not frozen: made per tensor, 4 times as fast
class NormStats:
    """The p-norm of a set of values, with their largest magnitude and non-finite counts."""

    norm: float
    max_abs: float
    nan: int
    inf: int
    size: int
    # The norm as m * 2**e, also when it is too large for float64 (None for NaN/Inf data and the inf-norm).
    exact: tuple[float, int] | None = None


class _ExactSum:
    """An exact sum of non-negative terms `s * 2**k`, kept as a Python integer times 2**low."""

    __slots__ = ("acc", "low", "window")

    def __init__(self, p: float = 2.0) -> None:
        self.acc = 0
        self.low = 0
        # Orders above `_POWER_OF_TWO_ORDER` keep the top `_WINDOW` bits, the bits below as a sticky last bit:
        # their sums' exponents may lie p * 2000 bits apart.
        self.window = _WINDOW if p > _POWER_OF_TWO_ORDER and not math.isinf(p) else None

    def add(self, s: float, k: int) -> None:
        if s == 0.0:
            return
        mantissa, exponent = math.frexp(s)
        m = int(mantissa * 9007199254740992.0)  # 2**53: the 53-bit integer mantissa
        e = exponent - 53 + k
        if self.window is not None:
            self.add_int(m, e)
            return
        if e < self.low:
            self.acc <<= self.low - e
            self.low = e
        self.acc += m << (e - self.low)

    def add_many(self, sums: np.ndarray, k: int = 0) -> None:
        """Adds non-negative float64 terms times 2**k exactly: as 53-bit integers shifted to a common exponent."""
        mantissas, exponents = np.frexp(sums)
        exponents[mantissas == 0] = exponents.max()  # zeros add nothing: keep them out of the range
        low = int(exponents.min())
        shifts = exponents - low
        if shifts.max() > 10:  # too far apart for int64: one at a time
            for s in sums.tolist():
                self.add(s, k)
            return
        ints = (mantissas * 9007199254740992.0).astype(np.int64) << shifts  # < 2**63: exact
        self.add_int(sum(ints.tolist()), low - 53 + k)

    def merge(self, other: _ExactSum) -> None:
        if other.acc:
            self.add_int(other.acc, other.low)

    def add_int(self, acc: int, low: int) -> None:
        if not acc:
            return
        if not self.acc:
            self.acc, self.low = acc, low
            return
        if self.window is not None:
            acc, low = self._fit(acc, low)
        if low < self.low:
            self.acc <<= self.low - low
            self.low = low
        self.acc += acc << (low - self.low)

    def _fit(self, acc: int, low: int) -> tuple[int, int]:
        """Drops the bits of the sum and of the term `acc * 2**low` below the window that their sum will take."""
        floor = max(self.low + self.acc.bit_length(), low + acc.bit_length()) - self.window
        if self.low < floor:
            self.acc, self.low = _shift_sticky(self.acc, floor - self.low), floor
        if low < floor:
            acc, low = _shift_sticky(acc, floor - low), floor
        return acc, low

    def root(self, p: float) -> tuple[float, int]:
        """The p-th root of the sum as `(m, e)`, the root being m * 2**e (see `_root`)."""
        return _root(self.acc, self.low, p)


def _root(acc: int, low: int, p: float) -> tuple[float, int]:
    """(acc * 2**low) ** (1/p) as `(m, e)`, the root being m * 2**e: never overflows, whatever its size.

    Orders 1 and 2 are correctly rounded (once m * 2**e is a float64); orders from 1 up within a few
    ulps; below 1 the error grows as 1/p (log2's rounding over p: 2e-14 at 0.01). Zero is (0.0, 0).
    """
    if acc == 0:
        return 0.0, 0
    if p == 2.0:
        shift = acc.bit_length() - 120
        shift += (low + shift) % 2  # an even exponent halves exactly
        a = _shift_sticky(acc, shift)
        s = math.isqrt(a)
        return float(s | (s * s != a)), (low + shift) // 2
    shift = acc.bit_length() - 64
    top, exponent = _shift_sticky(acc, shift), low + shift
    if p == 1.0:
        return float(top), exponent
    # 2**((x + log2(f)) / p), x = exponent + 63 and top = f * 2**63 (f in [1, 2)), with x / p split exactly
    # into an integer and the remainder over p (fmod is exact; by rationals above an order of 1000, whose x
    # passes 2**53 near 1e15, and where one value's norm comes out as itself): log2(f)'s error over p is
    # the root's. A plain float division x / p was off by up to 2e-13 relative where the sum's exponent is
    # large (values of 1e200).
    f = float(top) * 2.0**-63
    x = exponent + 63
    if p <= _POWER_OF_TWO_ORDER:  # in float64 (|x| < 2**53 here): fmod is exact, the quotient an integer
        rem = math.fmod(x, p)
        whole = round((x - rem) / p)
        r = (rem + math.log2(f)) / p
        below = math.floor(r)
        return 2.0 ** (r - below), whole + below
    r = (Fraction(x) + Fraction(math.log2(f))) / Fraction(p)
    whole = math.floor(r)
    return 2.0 ** float(r - whole), whole


def _share(part: _ExactSum, whole: _ExactSum, p: float, nonfinite: bool) -> float | None:
    if math.isinf(p):
        return None
    if nonfinite:
        return math.nan
    if not whole.acc:
        return 0.0
    return _root_value(_quotient(part, whole), 1.0)  # the quotient's 130 bits and a sticky bit: one rounding


def _root_value(total: _ExactSum, p: float) -> float:
    """The root of an exact sum as a float64: inf when it is too large for one."""
    return _ldexp(*total.root(p))


def _shift_sticky(a: int, shift: int) -> int:
    """a * 2**-shift as an integer; bits shifted out set the lowest bit, so a later rounding is correct."""
    if shift <= 0:
        return a << -shift
    if shift >= a.bit_length():  # all of it shifted out (a large order's terms lie far apart)
        return int(a != 0)
    return (a >> shift) | (a & ((1 << shift) - 1) != 0)


def _ldexp(x: float, e: int) -> float:
    try:
        return math.ldexp(x, e)
    except OverflowError:  # e beyond C's long: far above float64's range, or far below it
        return math.copysign(math.inf if e > 0 else 0.0, x)


class NormAccumulator:
    """Streams chunks of values into a p-norm, with float64 block sums added exactly.

    Feed one tensor's values in order with `add` (any chunk sizes: the result is the same bits), then
    read `result()`. Accumulators of several tensors combine with `merge` into a global norm, again
    exactly. Values are widened exactly to float64; blocks whose powers could overflow or underflow
    float64 are rescaled by a power of two, so the norm of finite values is never inf or 0 by accident.

    Args:
        ord: the order p: 'euclidean' or 2, 1, inf, or any p > 0.
    """

    __slots__ = ("_fragments", "_position", "_sum", "inf", "max_abs", "nan", "p", "size")

    def __init__(self, ord: Any = 2) -> None:
        self.p = parse_ord(ord)
        self._sum = _ExactSum(self.p)
        # Values of blocks seen in part (at a chunk's edges), widened: block number -> [(offset, values)].
        self._fragments: dict[int, list[tuple[int, np.ndarray]]] = {}
        self._position = 0
        self.max_abs = 0.0
        self.nan = 0
        self.inf = 0
        self.size = 0

    def add(self, chunk: np.ndarray, offset: int | None = None) -> None:
        """Adds values of the tensor (any shape; taken in C order): the next ones, or those from `offset` on.

        Blocks are counted from the tensor's first value, whatever the chunks: a block cut by a chunk's
        edge is kept until its other parts arrive (here, or from another accumulator by `combine`), so
        the result is the same bits for any chunking, in any order.
        """
        chunk = np.asarray(chunk)
        _check_inexact(chunk, "a norm")
        flat = chunk.reshape(-1)
        start = self._position if offset is None else offset
        self._position = start + flat.size
        self.size += flat.size
        # A signalling NaN in the data raises "invalid" when converted; it is counted as NaN all the same.
        with np.errstate(invalid="ignore"):
            head = min(-start % BLOCK, flat.size)
            if head:
                self._fragment(start, flat[:head])
            rest = flat[head:]
            full = rest.size - rest.size % BLOCK
            if full:
                self._add_whole_blocks(rest[:full])
            if full < rest.size:
                self._fragment(start + head + full, rest[full:])

    def _fragment(self, start: int, values: np.ndarray) -> None:
        block = start // BLOCK
        self._fragments.setdefault(block, []).append((start, _widen(values)[1].copy()))
        self._complete(block)

    def _complete(self, block: int, last: bool = False) -> None:
        """Adds a block once all its parts are here (or, `last`, what there is of it: the tensor's tail)."""
        pieces = self._fragments[block]
        if not last and sum(v.size for _, v in pieces) < BLOCK:
            return
        del self._fragments[block]
        pieces.sort(key=lambda piece: piece[0])
        values = pieces[0][1] if len(pieces) == 1 else np.concatenate([v for _, v in pieces])
        with np.errstate(invalid="ignore"):
            if values.size == BLOCK:
                self._add_blocks(None, values.reshape(1, -1))
            else:  # a tensor's tail: summed as `small_norms` sums it, alone or among others
                self._add_tails(values, np.zeros(1, np.int64))

    def _add_tails(self, w: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Adds segments of float64 values (beginning at `starts`) as blocks; returns their sums and peaks."""
        m = np.maximum.reduceat(np.abs(w), starts)  # NaN where a segment holds one
        finite = np.isfinite(m)
        if not finite.all():
            ends = np.append(starts[1:], w.size)
            for a, b in zip(starts[~finite].tolist(), ends[~finite].tolist(), strict=True):
                self._add_blocks(None, w[a:b].reshape(1, -1))  # counts NaN and Inf
            m = np.where(finite, m, 1.0)
        with np.errstate(over="ignore"):  # only segments holding NaN or Inf can overflow: their sums are unused
            s, k = _segment_power_sums(w, starts, m, self.p)
        for ok, peak, total, e in zip(finite.tolist(), m.tolist(), s.tolist(), k.tolist(), strict=True):
            if ok:
                self.max_abs = max(self.max_abs, peak)
                if not math.isinf(self.p):
                    self._sum.add(total, e)
        return s, k, m

    def _add_whole_blocks(self, x: np.ndarray) -> None:
        if self.p == 2.0:
            squares = _square_sums(x)
            if squares is not None:
                sums, e, peak = squares
                self.max_abs = max(self.max_abs, peak)
                self._sum.add_many(sums, e)
                return
        for start in range(0, x.size, _PIECE):
            narrow, wide = _widen(x[start : start + _PIECE])
            self._add_blocks(None if narrow is None else narrow.reshape(-1, BLOCK), wide.reshape(-1, BLOCK))

    def merge(self, other: NormAccumulator) -> None:
        """Adds the values `other` has seen, as a separate tensor."""
        other._flush()
        self._add_counts(other)

    def combine(self, other: NormAccumulator) -> None:
        """Adds the values `other` has seen of the same tensor (another worker's chunks, with their offsets)."""
        self._add_counts(other)
        for block, pieces in other._fragments.items():
            self._fragments.setdefault(block, []).extend(pieces)
            self._complete(block)
        other._fragments = {}

    def _add_counts(self, other: NormAccumulator) -> None:
        if other.p != self.p:
            raise ValueError("cannot merge norms of different orders")
        self._sum.merge(other._sum)
        self.max_abs = max(self.max_abs, other.max_abs)
        self.nan += other.nan
        self.inf += other.inf
        self.size += other.size

    def result(self) -> NormStats:
        """The norm and statistics of everything added so far."""
        if self._fragments:
            self._flush()
        exact = None
        if self.nan:
            value = math.nan
        elif self.inf:
            value = math.inf
        elif math.isinf(self.p):
            value = self.max_abs
        else:
            exact = self._sum.root(self.p)
            value = max(_ldexp(*exact), self.max_abs)  # a p-norm is never below it (rounded powers could put it so)
        return NormStats(value, self.max_abs, self.nan, self.inf, self.size, exact)

    def _flush(self) -> None:
        for block in sorted(self._fragments):
            self._complete(block, last=True)

    def share_of(self, whole: NormAccumulator) -> float | None:
        """The sum of |x|**p seen here over `whole`'s (which includes it): its share of whole's norm**p.

        Correctly rounded from the exact sums, so also right where the norms overflow float64. None for
        the inf-norm, NaN where whole holds NaN or Inf, 0 where whole is 0.
        """
        self._flush()
        whole._flush()
        return _share(self._sum, whole._sum, self.p, whole.nan + whole.inf > 0)

    def _add_blocks(self, narrow: np.ndarray | None, w: np.ndarray) -> None:
        """Adds blocks (rows of `w`, float64; `narrow` holds the same values as float32, if they fit one)."""
        source = w if narrow is None else narrow
        m = np.maximum(source.max(axis=1), -source.min(axis=1)).astype(np.float64)
        finite = np.isfinite(m)
        if not finite.all():
            # Blocks holding NaN or inf make the norm NaN or inf; only their counts are needed.
            bad = w[~finite]
            nans = np.isnan(bad)
            self.nan += int(np.count_nonzero(nans))
            self.inf += int(np.count_nonzero(np.isinf(bad)))
            if not nans.all():
                self.max_abs = max(self.max_abs, float(np.abs(bad[~nans]).max()))
            m, w = m[finite], w[finite]
        if m.size == 0:
            return
        self.max_abs = max(self.max_abs, float(m.max()))
        if math.isinf(self.p):
            return
        sums, k = _power_sums(w, m[:, None], self.p, axis=1)
        for s, e in zip(sums.ravel().tolist(), k.ravel().tolist(), strict=True):
            self._sum.add(s, e)


_local = threading.local()


def _scratch(n: int, dtype: type, slot: str = "") -> np.ndarray:
    """A reusable buffer of this thread's (freshly touched memory is slow: reuse it); one per dtype and slot."""
    key = np.dtype(dtype).char + slot
    buf = getattr(_local, key, None)
    if buf is None or buf.size < n:
        buf = np.empty(max(n, _PIECE), dtype)
        setattr(_local, key, buf)
    return buf[:n]


def _widen(x: np.ndarray, slot: str = "") -> tuple[np.ndarray | None, np.ndarray]:
    """The values as float64, exactly (complex values become moduli), and again when they all fit float32.

    The first array, when not None, holds the same values as float32: a cheaper form to scan for the
    largest magnitude (None for float64, complex, bfloat16 and finite float16 values).
    Both may be scratch buffers, valid until the next call in this thread with the same `slot`.
    """
    if x.dtype.kind == "c":
        return None, np.abs(x.astype(np.complex128, copy=False))
    if x.dtype == np.float64:
        return None, x
    narrow = x
    if x.dtype == np.float16 and _top16(x) < _INF16:  # NumPy's float16 casts are slow (very, on subnormals)
        wide = _scratch(x.size, np.float64, slot)
        _float16_scaled_down(x.view(np.uint16), wide)
        wide *= 2.0**112
        return None, wide
    if x.dtype == _BFLOAT16:  # ml_dtypes widens bfloat16 to float64 fast (float16 is NumPy's: slow)
        wide = _scratch(x.size, np.float64, slot)
        np.copyto(wide, x)
        return None, wide
    if x.dtype in _ML_FLOATS or x.dtype == np.float16:
        narrow = x.astype(np.float32)
    wide = _scratch(x.size, np.float64, slot)
    np.copyto(wide, narrow)
    return narrow, wide


def _top16(x: np.ndarray) -> int:
    """The largest magnitude bits (bits & 0x7FFF) among 16-bit floats; 0 when there are none."""
    return int((x.view(np.uint16) & 0x7FFF).max()) if x.size else 0


def _float16_scaled_down(bits: np.ndarray, wide: np.ndarray) -> None:
    """Writes finite float16 values (given as bits) times 2**-112 into float64 `wide`, exactly.

    Moved into float32 position, float16's exponent and mantissa are the float32 of |x| * 2**-112 (the
    exponent biases differ by 112; float16 subnormals become float32 subnormals): no float16 arithmetic.
    """
    u = _scratch(bits.size, np.uint32)
    np.left_shift(bits, 16, out=u, dtype=np.uint32)
    signed = u.view(np.int32)
    np.right_shift(signed, 3, out=signed)  # exponent and mantissa in place; the sign copied down
    np.bitwise_and(u, 0x8FFFE000, out=u)  # and cleared where it was copied
    np.copyto(wide, u.view(np.float32))


def _square_sums(x: np.ndarray) -> tuple[np.ndarray, int, float] | None:
    """The sum of squares of each block of float32, bfloat16 or float16 values, and their largest magnitude.

    Returns (sums, e, peak): the blocks' sums of squares are `sums * 2**e` (float64 sums of exact squares,
    each rounded as `_row_dots` adds); None when the values are of another dtype or some are not finite.
    `x.size` is a multiple of BLOCK. `_fused.square_sums` takes them in one pass; without it, NumPy widens
    pieces of them to float64 first (float16's scaled by 2**-112: its squares and their sums are the same
    bits times 2**-224).
    """
    sums = np.empty(x.size // BLOCK)
    kind = _fused_kind(x.dtype)
    if kind is not None:  # one pass over the values as they are; strided ones a piece at a time, copied
        peak, step = 0.0, _fused_step(_PIECE, x)
        for start in range(0, x.size, step):
            piece = _fused_view(x[start : start + step], kind)
            peak = max(peak, _fused.square_sums(piece, sums[start // BLOCK : (start + piece.size) // BLOCK], kind))
        return (sums, 0, peak) if math.isfinite(_sum(sums)) else None  # else a NaN or inf
    wide = _scratch(min(x.size, _PIECE), np.float64)
    if x.dtype == np.float32:
        peak = float(max(x.max(), -x.min()))  # NaN when a value is NaN
        if not math.isfinite(peak):
            return None
        for start in range(0, x.size, _PIECE):
            piece = x[start : start + _PIECE]
            w = wide[: piece.size].reshape(-1, BLOCK)
            np.copyto(w, piece.reshape(-1, BLOCK))
            _row_dots(w, w, out=sums[start // BLOCK : (start + piece.size) // BLOCK])
        return sums, 0, peak
    if x.dtype not in _NONFINITE16:
        return None
    top = 0
    magnitudes = _scratch(min(x.size, _PIECE), np.uint16)
    bits = _scratch(min(x.size, _PIECE), np.uint32)
    for start in range(0, x.size, _PIECE):
        piece = x[start : start + _PIECE].view(np.uint16)
        m = magnitudes[: piece.size]
        np.bitwise_and(piece, 0x7FFF, out=m)
        top = max(top, int(m.max()))
        w = wide[: piece.size].reshape(-1, BLOCK)
        if x.dtype == _BFLOAT16:  # ml_dtypes widens bfloat16 to float64 fast, and exactly
            np.copyto(w, x[start : start + _PIECE].reshape(-1, BLOCK))
        else:  # float16's magnitude bits, moved into float32 position, are the float32 |x| * 2**-112
            b = bits[: piece.size]  # exactly (subnormals included): no slow float16 arithmetic
            np.left_shift(m, 13, out=b, dtype=np.uint32)
            np.copyto(w, b.view(np.float32).reshape(-1, BLOCK))
        _row_dots(w, w, out=sums[start // BLOCK : (start + piece.size) // BLOCK])
    if top >= _NONFINITE16[x.dtype]:
        return None
    return sums, 0 if x.dtype == _BFLOAT16 else 224, float(np.array(top, np.uint16).view(x.dtype))


def _fused_kind(dtype: np.dtype) -> int | None:
    """The kind `_fused` reads values of `dtype` as; None for other dtypes, or when `_fused` was not built."""
    return None if _fused is None else _FUSED_KINDS.get(dtype)


def _fused_step(piece: int, *arrays: np.ndarray) -> int:
    """How many values to give a fused loop at a time: all where they lie contiguous, else pieces to copy."""
    return max(arrays[0].size, 1) if all(x.flags.c_contiguous for x in arrays) else piece


def _fused_view(x: np.ndarray, kind: int) -> np.ndarray:
    """Values of a `_fused` kind as its loops read them: float32 as they are, 16-bit floats as their bits."""
    x = np.ascontiguousarray(x)
    return x.view(np.uint16) if kind else x


def _row_squares(w: np.ndarray) -> np.ndarray:
    """The sum of squares of each row of a float64 matrix."""
    return _row_dots(w, w)


def _row_dots(x: np.ndarray, y: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Σxy of each row (a block) of two float64 matrices, in `_fused`'s fixed order of eight lanes.

    Lane j adds the terms j, j + 8, ... in turn; the lanes are then added pairwise (see clipcli/_fused.c).
    The C loop takes 0.2 ns a value, as BLAS's dot product does, and is as accurate for a block of 8192
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


def _power_sums(w: np.ndarray, m: np.ndarray, p: float, axis: Any) -> tuple[np.ndarray, np.ndarray]:
    """Sums of |w|**p along `axis` as `s * 2**k`, rescaling slices whose powers leave float64's range.

    `m` is the largest magnitude of each slice, with the reduced axes kept.
    Returns `s` (float64) and `k` (int64) shaped like `m`.
    """
    if p > _POWER_OF_TWO_ORDER:
        return _high_order_sums(w / _divisors(m), m, p, lambda powers: powers.sum(axis=axis, keepdims=True))
    e = np.frexp(m)[1].astype(np.int64)
    e = np.where(np.abs(e) * p > _SCALE_LIMIT, e, 0)
    if e.any():
        w = np.ldexp(w, -e)
    if p == 2.0 and axis == 1:
        return _row_squares(w)[:, None], np.where(e != 0, 2 * e, 0).astype(np.int64)
    if p == 2.0:
        powers = np.square(w)
    elif p == 1.0:
        powers = np.abs(w)
    else:
        powers = np.power(np.abs(w), p)
    s = powers.sum(axis=axis, keepdims=True)
    k, fraction = _times_order(e, p)
    return (s * np.exp2(fraction) if p != int(p) else s), k


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


def _segment_power_sums(w: np.ndarray, starts: np.ndarray, m: np.ndarray, p: float) -> tuple[np.ndarray, np.ndarray]:
    """`_power_sums` of the segments of a flat array that begin at `starts` (`m`: each one's peak), as s * 2**k.

    Summed by `np.add.reduceat`, whose sum of a segment does not depend on its neighbours: the tail of a
    tensor gives the same bits alone and among other tensors' (see `small_norms`).
    """
    if math.isinf(p):  # the inf-norm needs the peaks alone
        return m, np.zeros(m.shape, np.int64)
    if p > _POWER_OF_TWO_ORDER:
        ratios = w / np.repeat(_divisors(m), np.diff(np.append(starts, w.size)))
        return _high_order_sums(ratios, m, p, lambda powers: np.add.reduceat(powers, starts))
    e = np.frexp(m)[1].astype(np.int64)
    e = np.where(np.abs(e) * p > _SCALE_LIMIT, e, 0)
    if e.any():
        w = np.ldexp(w, -np.repeat(e, np.diff(np.append(starts, w.size))))
    if p == 2.0:
        powers = np.square(w)
    elif p == 1.0:
        powers = np.abs(w)
    else:
        powers = np.power(np.abs(w), p)
    s = np.add.reduceat(powers, starts)
    k, fraction = _times_order(e, p)
    return (s * np.exp2(fraction) if p != int(p) else s), k


def _divisors(m: np.ndarray) -> np.ndarray:
    """Each slice's largest magnitude, what `_high_order_sums` divides it by: 1 where it is 0, inf or NaN."""
    return np.where((m > 0) & np.isfinite(m), m, 1.0)


def _high_order_sums(
    ratios: np.ndarray, m: np.ndarray, p: float, reduce: Callable[[np.ndarray], np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Sums of |x|**p for an order above `_POWER_OF_TWO_ORDER`, as s * 2**k, from each slice's x / m.

    The largest ratio of a slice is exactly 1, so its powers stay in range (the smaller ones may vanish, as
    they would against it); `reduce` sums them per slice, and the sums are multiplied by m**p, taken as
    2**(p * log2 m) with the exponent split exactly: m = f * 2**e, p * e = floor(p) * e (an integer) plus
    (p - floor(p)) * e, and p * log2(f) lies in [-p, 0). Each ratio is off by half an ulp at most, its
    power by p half-ulps, and the sum's root by half an ulp again.
    """
    r = np.abs(ratios)
    # Powers below 2**-1000 add nothing beside the slice's largest, 1; NumPy's powers are slow there (subnormals)
    powers = np.power(r, p, out=np.zeros_like(r), where=~(r < 2.0 ** (-1000.0 / p)))  # NaN stays NaN
    s = reduce(powers)
    f, e = np.frexp(_divisors(m))
    whole = math.floor(p)
    k = (p - whole) * e + p * np.log2(f)
    k_whole = np.floor(k)
    return s * np.exp2(k - k_whole), k_whole.astype(np.int64) + e.astype(np.int64) * whole


@dataclass(eq=False)
class SmallNorms:
    """The norms of small tensors measured together (`small_norms`): per-tensor NumPy arrays.

    `size`, `max_abs` (the largest magnitude, inf included, NaN aside), `nan` and `inf` counts, and for
    tensors with neither NaN nor Inf the sum of |x|**p as `sums * 2**exps`. `accumulator(i)` is what
    adding tensor i to a `NormAccumulator` of its own gives; `norms()` and `merge_into` give the same
    bits as those accumulators' results and merges, in a few NumPy passes for all of them.
    """

    p: float
    size: np.ndarray
    max_abs: np.ndarray
    nan: np.ndarray
    inf: np.ndarray
    sums: np.ndarray
    exps: np.ndarray

    def __len__(self) -> int:
        return self.size.size

    def term(self, i: int) -> tuple[float, int]:
        """Tensor i's sum of |x|**p as (s, k): s * 2**k."""
        return float(self.sums[i]), int(self.exps[i])

    def accumulator(self, i: int) -> NormAccumulator:
        acc = NormAccumulator(self.p)
        acc.size = acc._position = int(self.size[i])
        acc.max_abs, acc.nan, acc.inf = float(self.max_abs[i]), int(self.nan[i]), int(self.inf[i])
        if not (acc.nan or acc.inf or math.isinf(self.p)):
            acc._sum.add(float(self.sums[i]), int(self.exps[i]))
        return acc

    def norms(self) -> np.ndarray:
        """Each tensor's norm, as `accumulator(i).result().norm`.

        A tensor's sum is one float64 term s * 2**k: its root is sqrt(s) * 2**(k/2) (k is even for p = 2)
        or s * 2**k for p = 1, each correctly rounded as the exact sums' roots are.
        """
        p = self.p
        if math.isinf(p):
            out = self.max_abs.copy()
        elif p == 2.0:
            with np.errstate(over="ignore"):
                out = np.ldexp(np.sqrt(self.sums), self.exps // 2)
        elif p == 1.0:
            with np.errstate(over="ignore"):
                out = np.ldexp(self.sums, self.exps)
        else:
            out = np.array([self.accumulator(i).result().norm for i in range(len(self))])
        out[self.inf > 0] = math.inf
        out[self.nan > 0] = math.nan
        return out

    def shares_of(self, whole: NormAccumulator) -> list[float | None]:
        """Each tensor's `accumulator(i).share_of(whole)`, to an ulp (its sum over whole's, rounded to 53 bits),
        in a few NumPy passes for all of them."""
        if math.isinf(self.p) or whole.nan or whole.inf:
            return [None if math.isinf(self.p) else math.nan] * len(self)
        whole._flush()
        if not whole._sum.acc:
            return [0.0] * len(self)
        m, e = whole._sum.root(1.0)  # the whole sum as float(top) * 2**e
        with np.errstate(under="ignore"):
            return np.ldexp(self.sums / m, self.exps - e).tolist()

    def merge_into(self, total: NormAccumulator) -> None:
        """`total.merge(self.accumulator(i))` for every tensor."""
        if total.p != self.p:
            raise ValueError("cannot merge norms of different orders")
        finite = (self.nan == 0) & (self.inf == 0)
        if not math.isinf(self.p):
            _add_power_sums(total._sum, self.sums[finite], self.exps[finite])
        total.max_abs = max(total.max_abs, float(self.max_abs.max(initial=0.0)))
        total.nan += int(self.nan.sum())
        total.inf += int(self.inf.sum())
        total.size += int(self.size.sum())


def small_norms(x: np.ndarray, sizes: Sequence[int], ord: Any = 2) -> SmallNorms:
    """The norms of small tensors whose values lie one after another in `x`, each fewer than BLOCK.

    The same bits as adding each tensor to an accumulator of its own, in a few NumPy passes for all of
    them: a checkpoint of 10,000 tiny tensors (a LoRA adapter) costs little more than one of their size.
    """
    p = parse_ord(ord)
    lengths = np.asarray(sizes, np.int64)
    if (lengths >= BLOCK).any():
        raise ValueError(f"small_norms takes tensors of fewer than {BLOCK} values")
    n = lengths.size
    max_abs, sums = np.zeros(n), np.zeros(n)
    nan, inf, exps = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64)
    present = np.flatnonzero(lengths)
    if present.size:
        starts = (np.cumsum(lengths) - lengths)[present]
        # Signalling NaNs are counted as NaN all the same; the sums of segments holding NaN or Inf (which may
        # overflow) are not used.
        with np.errstate(invalid="ignore", over="ignore"):
            w = _widen(x.reshape(-1))[1]
            m = np.maximum.reduceat(np.abs(w), starts)
            finite = np.isfinite(m)
            sums[present], exps[present] = _segment_power_sums(w, starts, np.where(finite, m, 1.0), p)
        max_abs[present] = m
        for i in present[~finite].tolist():  # NaN or Inf: counted one by one (rare)
            acc = NormAccumulator(p)
            a = int(np.sum(lengths[:i]))
            with np.errstate(invalid="ignore"):
                acc._add_blocks(None, _widen(x.reshape(-1)[a : a + lengths[i]])[1].reshape(1, -1))
            max_abs[i], nan[i], inf[i] = acc.max_abs, acc.nan, acc.inf
    return SmallNorms(p, lengths, max_abs, nan, inf, sums, exps)


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
    value = _ldexp(q, exponent)
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
    _check_inexact(t, "scaling")
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
        if t.dtype == np.float16 and flat and not factor.ndim and factor >= 0 and _top16(t) < _INF16:
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


def _scaled_narrow(t: np.ndarray, factor: np.ndarray, out: np.ndarray) -> None:
    """`scaled` for 16- and 8-bit floats, with `factor` of t's shape (a broadcast view will do; 24 bits).

    Each product is exact in float64 (at most 11 bits times 24) and rounded once to the dtype through
    `_round_to_odd`, in pieces of `_NARROW_PIECE` values (rows, or parts of one): temporaries stay small
    whatever the shape and whichever axes the factors vary along.
    """
    if (t.size <= _NARROW_PIECE or not t.ndim) and t.dtype == _BFLOAT16 and factor.dtype == np.float32:
        _scaled_bfloat16(t, factor, out)
    elif t.size <= _NARROW_PIECE or not t.ndim:
        product = _scratch(t.size, np.float64, "product").reshape(t.shape)
        np.multiply(t, factor, out=product, dtype=np.float64)
        narrow = _round_to_odd(product, _scratch(t.size, np.float32, "narrow").reshape(t.shape))
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
    narrow = _scratch(t.size, np.float32, "narrow").reshape(t.shape)
    np.multiply(t, factor, out=narrow, dtype=np.float32)
    low = np.bitwise_and(narrow.view(np.uint32), 0xFFFF, out=_scratch(t.size, np.uint32, "low").reshape(t.shape))
    halfway = np.equal(low, 0x8000, out=_scratch(t.size, np.bool_, "halfway").reshape(t.shape))
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
    inexact, away, negative = (_scratch(x.size, np.bool_, k).reshape(x.shape) for k in ("inexact", "away", "neg"))
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

    Bits are moved instead of NumPy's float16 casts, which take 10-50 ns per value on subnormals (most
    of a float16 gradient), and no float32 arithmetic sees a subnormal (as slow).
    """
    result = np.empty_like(t) if out is None else out
    source, target = t.reshape(-1).view(np.uint16), result.reshape(-1).view(np.uint16)
    for start in range(0, source.size, _NARROW_PIECE):
        bits = source[start : start + _NARROW_PIECE]
        n = bits.size
        m, product, sign = _scratch(n, np.int32), _scratch(n, np.float64), _scratch(n, np.uint16)
        np.bitwise_and(bits, 0x8000, out=sign)
        _float16_scaled_down(bits, product)
        product *= float(factor) * 2.0**112  # t * factor, exactly
        u = _scratch(n, np.uint32)  # _float16_scaled_down's scratch, free again
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


def _as_tensor(t: Any) -> np.ndarray:
    t = np.asarray(t)
    if t.dtype == object:
        raise TypeError("object arrays are not tensors")
    return t


def clip_by_value(t: Any, clip_value_min: Any, clip_value_max: Any, out: np.ndarray | None = None) -> np.ndarray:
    """`tf.clip_by_value`: min(max(t, clip_value_min), clip_value_max), computed as TensorFlow does.

    The bounds are converted to t's dtype first (a bfloat16 tensor clipped at 0.1 is clipped at
    0.10009765625); bounds may be tensors that broadcast to t's shape. NaN stays NaN; +-inf is clipped.
    `out` (t's dtype and shape; it may be `t` itself) receives the result instead of a new array.

    Raises:
        TypeError: for a float bound on an integer tensor, or a boolean or complex tensor.
        ValueError: when a bound would broadcast the result to a larger shape than t.
    """
    t = _as_tensor(t)
    if t.dtype.kind in "bc":
        raise TypeError(f"clip_by_value does not support {t.dtype.name} tensors")
    lo, hi = _bound(clip_value_min, t.dtype), _bound(clip_value_max, t.dtype)
    shape = np.broadcast_shapes(t.shape, lo.shape, hi.shape)
    if shape != t.shape:
        raise ValueError(f"clip bounds of shape {lo.shape} and {hi.shape} would broadcast {t.shape} to {shape}")
    flat = t.flags.c_contiguous and (out is None or (out.flags.c_contiguous and out.ndim == t.ndim))
    if t.dtype == np.float16 and flat and _plain_bounds(lo, hi) and _top16(t) <= _INF16:
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
        and max(_top16(lo), _top16(hi)) <= _INF16
        and (-0x8000 not in (lo.view(np.int16), hi.view(np.int16)))
    )


def _clip_float16(t: np.ndarray, lo: np.ndarray, hi: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """`clip_by_value` for float16 values without NaN and scalar bounds (not -0.0), on integer keys.

    NumPy compares float16 at ~20 ns a value. A value's key is its magnitude's bits, negated when the
    sign is set: keys order as the values do, +-0 equal. Clipped keys turn back into bits; -0.0 stays
    -0.0 where it is kept, as NumPy's float16 minimum and maximum keep a value equal to a bound.
    """
    result = np.empty_like(t) if out is None else out
    source, target = t.reshape(-1).view(np.int16), result.reshape(-1).view(np.int16)
    lo_key, hi_key = (int(_float16_keys(b.reshape(1).view(np.int16))[0]) for b in (lo, hi))
    keeps_zero = lo_key <= 0 <= hi_key
    for start in range(0, source.size, _PIECE):
        bits, res = source[start : start + _PIECE], target[start : start + _PIECE]
        key, negative_zero = _scratch(bits.size, np.int16), _scratch(bits.size, np.bool_)
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
    if b.dtype.kind not in "iuf" and b.dtype not in _ML_FLOATS:
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
    t = _as_tensor(t)
    _check_inexact(t, "clip_by_norm")
    clip_norm = max(float(clip_norm), 0.0)
    axes = normalize_axes(axes, t.ndim)
    if axes is None or len(axes) == t.ndim:
        return scaled(t, tensor_clip_scale(_stats_accumulator(t, 2).result(), clip_norm))
    return scaled(t, sums_clip_scale(*_axis_power_sums(t, 2.0, axes), clip_norm))


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


def _axis_norm(t: np.ndarray, p: float, axes: tuple[int, ...]) -> np.ndarray:
    """The p-norm over `axes` of a floating or complex tensor, with the axes kept, as float64."""
    if math.isinf(p):
        with np.errstate(invalid="ignore"):  # signalling NaNs in the data; they are NaN norms all the same
            return np.abs(_magnitudes(t)).max(axis=axes, keepdims=True, initial=0.0)
    root = power_sums_root(*_axis_power_sums(t, p, axes), p)
    if p in (1.0, 2.0):  # rounded sums of non-negative terms: never below the largest term
        return root
    with np.errstate(invalid="ignore"):  # never below the largest magnitude either (rounded powers could put it so)
        return np.maximum(root, np.abs(_magnitudes(t)).max(axis=axes, keepdims=True, initial=0.0))


def _axis_power_sums(t: np.ndarray, p: float, axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
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
        w = _magnitudes(t)
        m = np.abs(w).max(axis=axes, keepdims=True, initial=0.0)
        return _power_sums(w, m, p, axis=axes)


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
    with np.errstate(invalid="ignore", over="ignore"):  # as in `_axis_power_sums`
        for start in range(0, max(rows.shape[0], 1), group):
            w = _magnitudes(rows[start : start + group])
            m = np.abs(w).max(axis=axes, keepdims=True, initial=0.0)
            parts.append(_power_sums(w, m, p, axis=axes))
    return parts


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
    `_ExactSum.root` does: a float division k / p was off by up to 4e-14 relative where k is large
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
    tensors = [None if t is None else _as_tensor(t) for t in t_list]
    for t in tensors:
        if t is not None:
            _check_inexact(t, "clip_by_global_norm")
    stats = _global_stats(tensors) if use_norm is None else given_norm_stats(use_norm)
    scale = _global_scale(stats, float(clip_norm))
    return [None if t is None else scaled(t, scale) for t in tensors], stats.norm


def given_norm_stats(use_norm: Any) -> NormStats:
    """The statistics of a global norm given rather than measured (`use_norm`): NaN or Inf counted as data's."""
    g = float(use_norm)
    return NormStats(g, math.nan, int(math.isnan(g)), int(math.isinf(g)), 0)


def _global_scale(stats: NormStats, clip_norm: float) -> float:
    # TensorFlow computes clip_norm * min(1/g, 1/clip_norm): a negative clip_norm leaves the
    # tensors as they are, a zero clip_norm zeroes them.
    if clip_norm < 0 and not (stats.nan or stats.inf):
        return 1.0
    return stats_clip_scale(stats, clip_norm)


_MATRIX_ORDS = ("euclidean", "fro", 1, 2, math.inf)


def norm(t: Any, ord: Any = "euclidean", axis: Any = None, keepdims: bool = False) -> Any:
    """`tf.norm`: a vector norm over all values or one axis, or a matrix norm over two axes, as float64.

    Vector orders: 'euclidean' (2), 1, inf and any p > 0. Matrix orders (a 2-axis `axis`): 'fro' and
    'euclidean' (Frobenius), 1 (largest column sum), inf (largest row sum) and 2 (largest singular value).

    Raises:
        TypeError: for an integer or boolean tensor.
        ValueError: for an unsupported order or axis.
    """
    t = _as_tensor(t)
    _check_inexact(t, "norm")
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
        result = _axis_norm(t, parse_ord(ord), axes)
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
        return _axis_norm(t, 2.0, tuple(sorted(axes)))
    if ord == 1:
        return _axis_norm(t, 1.0, (rows,)).max(axis=cols, keepdims=True)
    if ord == math.inf:
        return _axis_norm(t, 1.0, (cols,)).max(axis=rows, keepdims=True)
    w = np.moveaxis(_magnitudes(t) if t.dtype.kind != "c" else t.astype(np.complex128), (rows, cols), (-2, -1))
    sigma = np.linalg.svd(w, compute_uv=False)[..., 0]
    return np.expand_dims(sigma, axis=(rows, cols))


# --- Differences between two tensors ---------------------------------------------------------------


@dataclass(frozen=True)
class DiffStats:
    """How far tensor B is from tensor A, from exact sums over their values and differences.

    `diff_norm`, `norm_a` and `norm_b` are p-norms (NaN when a value in them is NaN, inf when one is
    inf); `norm2_a`, `norm2_b`, `dot` and `cosine` are always 2-norms and the Euclidean inner product.
    Equal values (NaN against NaN, an inf against the same inf, -0.0 against 0.0) differ by 0.
    """

    diff_norm: float  # ‖A − B‖_p
    norm_a: float  # ‖A‖_p
    norm_b: float  # ‖B‖_p
    rel: float | None  # ‖A − B‖_p / ‖A‖_p; None when ‖A‖ is 0 (NaN when A holds NaN)
    cosine: float | None  # Σab / (‖A‖₂‖B‖₂); None when a 2-norm is 0, NaN when a side holds NaN or inf
    dot: float  # Σab; NaN when a side holds NaN or inf
    norm2_a: float  # ‖A‖₂
    norm2_b: float  # ‖B‖₂
    max_abs_diff: float  # max |a − b|: 0 when nothing differs, NaN when NaN meets a number
    changed: int  # pairs whose values differ
    size: int  # pairs compared
    nan_a: int
    inf_a: int
    nan_b: int
    inf_b: int

    def figures(self) -> DiffFigures:
        """(norm_a, norm_b, diff_norm, rel, cosine, max_abs_diff, changed): what a report's row shows."""
        return (self.norm_a, self.norm_b, self.diff_norm, self.rel, self.cosine, self.max_abs_diff, self.changed)


# What a report shows of a pair (`DiffStats.figures`, `SmallDiffs.figures`).
DiffFigures = tuple[float, float, float, "float | None", "float | None", float, int]


class DiffAccumulator:
    """Streams pairs of chunks of two tensors into the exact statistics of their difference.

    Feed A's and B's values in the same order with `add` (any chunk sizes: the result is the same bits),
    or `add_identical` where a chunk of B has the same dtype and bytes as A's, then read `result()`.
    Accumulators of several tensors, or of several workers' whole blocks of one tensor, combine exactly
    with `merge`. Values of any real dtype are widened exactly to float64 (integers beyond 2**53
    are rounded once) and compared by value; their differences are rounded once at most. Sums are taken
    as `NormAccumulator` takes them: float64 sums over fixed blocks, added exactly. The signed dot
    product for the cosine keeps its positive and negative block sums apart, each exact.

    Args:
        ord: the order p of the norms: 'euclidean' or 2, 1, inf, or any p > 0.
    """

    def __init__(self, ord: Any = 2) -> None:
        self.p = parse_ord(ord)
        self._a, self._b = NormAccumulator(self.p), NormAccumulator(self.p)
        # The cosine's 2-norms: the p-norms themselves when p is 2.
        self._a2, self._b2 = (self._a, self._b) if self.p == 2.0 else (NormAccumulator(2), NormAccumulator(2))
        self._diff = _ExactSum(self.p)
        self._dot, self._dot_neg = _ExactSum(), _ExactSum()
        self._pending: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self.max_abs_diff = 0.0  # among the differences that are numbers
        self.nan_diff = 0  # pairs whose difference is NaN: NaN against a number
        self.inf_diff = 0  # pairs whose difference is inf because a value is inf
        self.changed = 0
        self.size = 0

    def add(self, a: np.ndarray, b: np.ndarray) -> None:
        """Adds the next values of A and of B (chunks of equal size, any shape; taken in C order).

        Raises:
            TypeError: for a complex or non-numeric chunk.
            ValueError: when the chunks differ in size.
        """
        a, b = _flat_pair(a, b)
        self.size += a.size
        # A signalling NaN in the data raises "invalid" when converted; it is a NaN all the same.
        with np.errstate(invalid="ignore"):
            if self._pending is not None:
                need = BLOCK - self._pending[0].size
                self._extend_pending(self._pairs(a[:need], b[:need]))
                a, b = a[need:], b[need:]
            full = a.size - a.size % BLOCK
            if full:
                self._add_whole_blocks(a[:full], b[:full])
            if full < a.size:
                self._extend_pending(self._pairs(a[full:], b[full:]))

    def add_identical(self, a: np.ndarray) -> None:
        """Adds the next values of A where B's are the same bytes of the same dtype: `add(a, a)`, faster.

        Nothing differs; A's sums serve for both sides and for the dot product.
        """
        a = np.asarray(a)
        _check_real(a)
        a = a.reshape(-1)
        self.size += a.size
        with np.errstate(invalid="ignore"):  # signalling NaNs, as in `add`
            if self._pending is not None:
                need = BLOCK - self._pending[0].size
                self._extend_pending(_same(a[:need]))
                a = a[need:]
            full = a.size - a.size % BLOCK
            if full:
                self._add_identical_blocks(a[:full])
            if full < a.size:
                self._extend_pending(_same(a[full:]))

    def merge(self, other: DiffAccumulator) -> None:
        """Adds the pairs `other` has seen, as a separate tensor (or another worker's whole blocks)."""
        if other.p != self.p:
            raise ValueError("cannot merge differences of different orders")
        other._flush()
        sides = [(self._a, other._a), (self._b, other._b)]
        if self.p != 2.0:
            sides += [(self._a2, other._a2), (self._b2, other._b2)]
        for mine, theirs in sides:
            mine.merge(theirs)
        for total, part in ((self._diff, other._diff), (self._dot, other._dot), (self._dot_neg, other._dot_neg)):
            total.merge(part)
        self.max_abs_diff = max(self.max_abs_diff, other.max_abs_diff)
        self.nan_diff += other.nan_diff
        self.inf_diff += other.inf_diff
        self.changed += other.changed
        self.size += other.size

    def result(self) -> DiffStats:
        """The statistics of every pair added so far."""
        self._flush()
        a, b = self._a.result(), self._b.result()
        a2, b2 = self._a2.result(), self._b2.result()
        max_abs_diff = math.nan if self.nan_diff else self.max_abs_diff
        if self.nan_diff:
            diff_norm = math.nan
        elif self.inf_diff:
            diff_norm = math.inf
        elif math.isinf(self.p):
            diff_norm = self.max_abs_diff
        else:
            diff_norm = max(_root_value(self._diff, self.p), self.max_abs_diff)  # as `NormAccumulator.result`
        nonfinite = a.nan + a.inf + b.nan + b.inf > 0
        return DiffStats(
            diff_norm=diff_norm,
            norm_a=a.norm,
            norm_b=b.norm,
            rel=self._rel(diff_norm, a),
            cosine=math.nan if nonfinite else self._cosine(),
            dot=math.nan if nonfinite else _to_float(*_signed(self._dot, self._dot_neg)),
            norm2_a=a2.norm,
            norm2_b=b2.norm,
            max_abs_diff=max_abs_diff,
            changed=self.changed,
            size=self.size,
            nan_a=a.nan,
            inf_a=a.inf,
            nan_b=b.nan,
            inf_b=b.inf,
        )

    def share_of(self, whole: DiffAccumulator) -> float | None:
        """The sum of |a − b|**p seen here over `whole`'s: its share of whole's ‖A − B‖**p, as
        `NormAccumulator.share_of` gives it (NaN where a difference in whole is NaN or inf)."""
        self._flush()
        whole._flush()
        return _share(self._diff, whole._diff, self.p, whole.nan_diff + whole.inf_diff > 0)

    def _rel(self, diff_norm: float, a: NormStats) -> float | None:
        """‖A − B‖ / ‖A‖: from the exact sums (no overflow, correctly rounded for p = 1, 2) when finite.

        None only when ‖A‖ is 0; NaN when A holds NaN, even where nothing changed (0 / NaN, as the spec's
        quotient is).
        """
        if a.norm == 0.0:
            return None
        if math.isinf(self.p) or self.nan_diff + self.inf_diff + a.nan + a.inf:
            return diff_norm / a.norm
        return _root_value(_quotient(self._diff, self._a._sum), self.p)

    def _cosine(self) -> float | None:
        """Σab / sqrt(Σa² Σb²), the sums exact: sqrt((Σab)² / (Σa² Σb²)), correctly rounded, at most 1."""
        a, b = self._a2._sum, self._b2._sum
        if not (a.acc and b.acc):
            return None
        return _cosine_of(*_signed(self._dot, self._dot_neg), a.acc, a.low, b.acc, b.low)

    def _extend_pending(self, values: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        """Adds widened pairs and their differences to the block in progress; adds the block once full."""
        wa, wb, d = values
        if self._pending is None:
            self._pending = (wa.copy(), wb.copy(), d.copy())
        else:
            pa, pb, pd = self._pending
            self._pending = (np.concatenate([pa, wa]), np.concatenate([pb, wb]), np.concatenate([pd, d]))
        if self._pending[0].size == BLOCK:
            self._flush()

    def _flush(self) -> None:
        if self._pending is not None:
            wa, wb, d = self._pending
            self._pending = None
            self._add_blocks(wa.reshape(1, -1), wb.reshape(1, -1), d.reshape(1, -1))

    def _add_whole_blocks(self, a: np.ndarray, b: np.ndarray) -> None:
        if self.p == 2.0 and _squares_fit(a.dtype) and _squares_fit(b.dtype):
            self._add_squares(a, b)
            return
        for start in range(0, a.size, _PIECE):
            rows = (v.reshape(-1, BLOCK) for v in self._pairs(a[start : start + _PIECE], b[start : start + _PIECE]))
            self._add_blocks(*rows)

    def _add_squares(self, a: np.ndarray, b: np.ndarray) -> None:
        """The fast path for p = 2 and values of float32's range: four dot products per block, NaN and inf aside.

        Pairs of float32, bfloat16 and float16 values take one fused pass (`_fused.pair_sums`, which widens
        as it reads); other dtypes, and stretches holding NaN or inf, NumPy's passes (`_add_pieces`). Every
        path gives the same bits for a block of finite values.
        """
        sums = np.empty((4, a.size // BLOCK))  # per block: d·d, a·a, b·b, a·b
        kinds = _fused_kind(a.dtype), _fused_kind(b.dtype)
        if None in kinds:
            self._add_pieces(a, b, sums)
        else:
            step = _fused_step(_PAIR_PIECE, a, b)
            for start in range(0, a.size, step):
                pa, pb = a[start : start + step], b[start : start + step]
                part = sums[:, start // BLOCK : (start + pa.size) // BLOCK]
                rows = np.empty((part.shape[1], 4))
                changed, top = _fused.pair_sums(_fused_view(pa, kinds[0]), _fused_view(pb, kinds[1]), rows, *kinds)
                if math.isfinite(_sum(rows[:, 1]) + _sum(rows[:, 2])):  # as in `_add_pieces`: no NaN or inf
                    part[:] = rows.T
                    self._count_changes(changed, top)
                else:
                    self._add_pieces(pa, pb, part)
        self._add_sums(sums)

    def _add_pieces(self, a: np.ndarray, b: np.ndarray, sums: np.ndarray) -> None:
        """`_add_squares` by NumPy's passes over pieces of widened values, writing blocks' finite sums to `sums`.

        Sums of squares of values in float32's range are finite exactly when the values are, so those sums
        tell when a piece needs the general path (`_add_blocks`, which adds it; its blocks' `sums` are 0).
        """
        for start in range(0, a.size, _PAIR_PIECE):
            pa, pb = a[start : start + _PAIR_PIECE], b[start : start + _PAIR_PIECE]
            part = sums[:, start // BLOCK : (start + pa.size) // BLOCK]
            wa = _widen(pa)[1].reshape(-1, BLOCK)
            wb = _widen(pb, "b")[1].reshape(-1, BLOCK)  # a scratch buffer of its own: it becomes a − b
            dd, aa, bb, ab = part
            _row_dots(wa, wa, out=aa)
            _row_dots(wb, wb, out=bb)
            if not math.isfinite(_sum(aa) + _sum(bb)):  # sums of non-negative finite squares cannot overflow
                part[:] = 0.0
                self._add_blocks(wa, wb, self._differences(wa, wb))
                continue
            _row_dots(wa, wb, out=ab)
            d = np.subtract(wa, wb, out=wb)
            _row_dots(d, d, out=dd)
            top = float(max(_max(d, None), -_min(d, None)))
            self._count_changes(_count_nonzero(d) if top else 0, top)

    def _add_sums(self, sums: np.ndarray) -> None:
        """Adds blocks' sums of finite values: rows d·d, a·a, b·b and a·b."""
        self._diff.add_many(sums[0])
        self._a._sum.add_many(sums[1])
        self._b._sum.add_many(sums[2])
        _add_signed(self._dot, self._dot_neg, sums[3], np.zeros(sums[3].size, np.int64))

    def _count_changes(self, changed: int, top: float) -> None:
        """Counts finite differences: how many are not 0, and the largest magnitude among them."""
        self.changed += changed
        self.max_abs_diff = max(self.max_abs_diff, top)

    def _add_identical_blocks(self, x: np.ndarray) -> None:
        if self.p == 2.0:
            squares = _square_sums(x)
            if squares is not None:
                sums, e, _ = squares
                for total in (self._a._sum, self._b._sum, self._dot):
                    total.add_many(sums, e)
                return
        for start in range(0, x.size, _PIECE):
            w = _widen(x[start : start + _PIECE])[1].reshape(-1, BLOCK)
            side = NormAccumulator(self.p)
            side._add_blocks(None, w)
            self._a.merge(side)
            self._b.merge(side)
            squares = side
            if self.p != 2.0:
                squares = NormAccumulator(2)
                squares._add_blocks(None, w)
                self._a2.merge(squares)
                self._b2.merge(squares)
            self._dot.merge(squares._sum)  # a·a is a², block by block: the sums of squares are the dot product's

    def _pairs(self, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A's and B's values widened to float64 and their differences (scratch buffers), counted."""
        wa, wb = _widen(a)[1], _widen(b, "b")[1]
        if a.dtype.kind in "iub" and b.dtype.kind in "iub" and max(a.itemsize, b.itemsize) == 8:
            return wa, wb, self._count(wa, wb, _integer_differences(a, b, _scratch(a.size, np.float64, "d")))
        return wa, wb, self._differences(wa, wb)

    def _differences(self, wa: np.ndarray, wb: np.ndarray) -> np.ndarray:
        # finite values may overflow (1e308 - -1e308); inf - inf is NaN until equal values are set to 0
        with np.errstate(over="ignore", invalid="ignore"):
            return self._count(wa, wb, np.subtract(wa, wb, out=_scratch(wa.size, np.float64, "d").reshape(wa.shape)))

    def _count(self, wa: np.ndarray, wb: np.ndarray, d: np.ndarray) -> np.ndarray:
        """Sets the differences of equal values to 0 (NaN and NaN, inf and inf); counts what differs."""
        if not d.size:
            return d
        top = float(max(d.max(), -d.min()))
        if not math.isfinite(top):
            d[((wa == wb) | (np.isnan(wa) & np.isnan(wb))) & ~np.isfinite(d)] = 0.0
            nan = np.isnan(d)
            self.nan_diff += int(np.count_nonzero(nan))
            self.inf_diff += int(np.count_nonzero(np.isinf(d) & ~(np.isfinite(wa) & np.isfinite(wb))))
            top = float(np.abs(d[~nan]).max(initial=0.0))  # inf where finite values' difference overflows
        self._count_changes(_count_nonzero(d), top)
        return d

    def _add_blocks(self, wa: np.ndarray, wb: np.ndarray, d: np.ndarray) -> None:
        """Adds blocks (rows) of A's and B's values, as float64, and of their differences.

        A's and B's own sums are taken as `NormAccumulator` takes them (a tensor's tail, a partial block,
        by `_add_tails`), so ‖A‖ and ‖B‖ are the bits `global-norm` reports.
        """
        sides = [(self._a, wa), (self._b, wb)]
        if self.p != 2.0:
            sides += [(self._a2, wa), (self._b2, wb)]
        for side, w in sides:
            if w.shape[1] < BLOCK:
                side._add_tails(w.reshape(-1), np.zeros(1, np.int64))
            else:
                side._add_blocks(None, w)
        self._add_dots(wa, wb)
        if not math.isinf(self.p):
            self._add_difference_sums(wa, wb, d)

    def _add_dots(self, wa: np.ndarray, wb: np.ndarray) -> None:
        """Adds Σab of each block without NaN or inf."""
        ma, mb = _row_peaks(wa), _row_peaks(wb)
        finite = np.isfinite(ma) & np.isfinite(mb)
        if not finite.all():
            wa, wb, ma, mb = wa[finite], wb[finite], ma[finite], mb[finite]
        ea, eb = _product_scales(ma, mb)
        if ea.any() or eb.any():
            wa, wb = np.ldexp(wa, -ea[:, None]), np.ldexp(wb, -eb[:, None])
        if wa.shape[1] < BLOCK and wa.size:  # a tail: reduced as its sum of squares is, so a·a is a² bit for bit
            dots = np.add.reduceat(np.multiply(wa, wb).reshape(-1), np.arange(0, wa.size, wa.shape[1]))
        else:
            dots = _row_dots(wa, wb)
        _add_signed(self._dot, self._dot_neg, dots, ea + eb)

    def _add_difference_sums(self, wa: np.ndarray, wb: np.ndarray, d: np.ndarray) -> None:
        """Adds Σ|a − b|**p of each block whose differences are numbers, overflowed ones included."""
        m = _row_peaks(d)
        finite = np.isfinite(m)
        if not finite.all():
            # Blocks with NaN or inf differences make the norm NaN or inf (counted already). Differences of
            # finite values beyond float64's range are taken at half scale: a/2 - b/2, then 2**p the sum.
            both = np.isfinite(wa) & np.isfinite(wb)
            overflow = ~finite & ~(np.isnan(d) | (np.isinf(d) & ~both)).any(axis=1)
            if overflow.any():
                half = np.where(np.isinf(d[overflow]), wa[overflow] * 0.5 - wb[overflow] * 0.5, d[overflow] * 0.5)
                s, k = _block_power_sums(half, _row_peaks(half), self.p)
                whole = math.floor(self.p)
                _add_power_sums(self._diff, s * 2.0 ** (self.p - whole), k + whole)
            d, m = d[finite], m[finite]
        if m.size:
            _add_power_sums(self._diff, *_block_power_sums(d, m, self.p))


def _block_power_sums(w: np.ndarray, m: np.ndarray, p: float) -> tuple[np.ndarray, np.ndarray]:
    """`_power_sums` of each row of `w` (`m`: their peaks); a row shorter than a block (a tensor's tail) summed
    by `_segment_power_sums`, as its sides' sums are: the same bits alone and among other tails (`small_diffs`)."""
    if w.shape[1] < BLOCK:
        return _segment_power_sums(w.reshape(-1), np.arange(0, w.size, w.shape[1]), m, p)
    return _power_sums(w, m[:, None], p, axis=1)


def _check_real(t: np.ndarray) -> None:
    if not (is_floating(t.dtype) or t.dtype.kind in "iub"):
        raise TypeError(f"diff compares real or integer tensors, got {t.dtype.name}")


def _flat_pair(a: Any, b: Any) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(a), np.asarray(b)
    _check_real(a)
    _check_real(b)
    if a.size != b.size:
        raise ValueError(f"chunks of A and B must be of equal size, got {a.size} and {b.size}")
    return a.reshape(-1), b.reshape(-1)


def _same(a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A's values widened, twice, and zero differences: a pair of identical chunks."""
    w = _widen(a)[1]
    return w, w, np.zeros(w.size)


def _squares_fit(dtype: np.dtype) -> bool:
    """Whether values of `dtype` widened to float64 have finite squares, products and differences (no rescaling)."""
    return (is_floating(dtype) and dtype != np.float64) or (dtype.kind in "iub" and dtype.itemsize <= 4)


def _row_peaks(w: np.ndarray) -> np.ndarray:
    """The largest magnitude of each row; NaN where a row holds NaN."""
    return np.maximum(w.max(axis=1), -w.min(axis=1))


def _product_scales(ma: np.ndarray, mb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exponents (ea, eb) to scale rows of A and B by (2**-ea, 2**-eb) where their products could leave float64.

    Rows are scaled only where the product of their largest magnitudes lies beyond 2**±600. For A = B
    these are the exponents `_power_sums` scales squares by, so a·a is the sum of squares bit for bit.
    """
    ea, eb = np.frexp(ma)[1].astype(np.int64), np.frexp(mb)[1].astype(np.int64)
    far = np.abs(ea + eb) > _SCALE_LIMIT
    return np.where(far, ea, 0), np.where(far, eb, 0)


def _count_nonzero(d: np.ndarray) -> int:
    # np.count_nonzero on float64 is three times slower than on a boolean mask (NumPy 2.4)
    return int(np.count_nonzero(np.not_equal(d, 0.0, out=_scratch(d.size, np.bool_).reshape(d.shape))))


def _add_power_sums(total: _ExactSum, s: np.ndarray, k: np.ndarray) -> None:
    """Adds non-negative sums `s * 2**k` exactly."""
    s, k = s.ravel(), k.ravel()
    if not s.size:
        return
    if not k.any():
        total.add_many(s)
        return
    for value, e in zip(s.tolist(), k.tolist(), strict=True):
        total.add(value, e)


def _add_signed(positive: _ExactSum, negative: _ExactSum, s: np.ndarray, k: np.ndarray) -> None:
    """Adds signed sums `s * 2**k` exactly: the positive ones to `positive`, the others' magnitudes to `negative`."""
    _add_power_sums(positive, np.maximum(s, 0.0), k)
    _add_power_sums(negative, np.maximum(-s, 0.0), k)


def _integer_differences(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """a - b of two integer tensors as float64, rounded once (exact below 2**53), in `out`.

    Each value splits into 32-bit halves, hi * 2**32 + lo, whose differences float64 holds exactly.
    """
    halves = []
    for x in (a, b):
        x = x if x.dtype == np.uint64 else x.astype(np.int64)
        halves.append(((x >> 32).astype(np.float64), (x & 0xFFFFFFFF).astype(np.float64)))
    (hi_a, lo_a), (hi_b, lo_b) = halves
    np.subtract(hi_a, hi_b, out=out)
    out *= 2.0**32
    out += lo_a - lo_b
    return out


def _exact(acc: int, low: int) -> _ExactSum:
    total = _ExactSum()
    total.acc, total.low = acc, low
    return total


def _signed(positive: _ExactSum, negative: _ExactSum) -> tuple[int, int]:
    """positive - negative as (integer, exponent): the value is integer * 2**exponent."""
    low = min(positive.low, negative.low)
    return (positive.acc << (positive.low - low)) - (negative.acc << (negative.low - low)), low


def _cosine_of(dot: int, low: int, a: int, a_low: int, b: int, b_low: int) -> float:
    """Σab / sqrt(Σa² Σb²) for Σab = dot * 2**low, Σa² = a * 2**a_low and Σb² = b * 2**b_low (not 0):
    sqrt((Σab)² / (Σa² Σb²)), correctly rounded, at most 1."""
    cosine = min(_ldexp(*_root(*_int_quotient(dot * dot, 2 * low, a * b, a_low + b_low), 2.0)), 1.0)
    return -cosine if dot < 0 else cosine


def _to_float(acc: int, low: int) -> float:
    """acc * 2**low, correctly rounded; +-inf beyond float64's range."""
    try:
        return float(acc << low) if low >= 0 else acc / (1 << -low)  # int / int rounds correctly
    except OverflowError:
        return -math.inf if acc < 0 else math.inf


def _quotient(num: _ExactSum, den: _ExactSum) -> _ExactSum:
    """num / den (den > 0) to at least 130 bits, the bits beyond kept as a sticky last bit for `root`."""
    return _exact(*_int_quotient(num.acc, num.low, den.acc, den.low))


def _int_quotient(num: int, num_low: int, den: int, den_low: int) -> tuple[int, int]:
    """`_quotient` of num * 2**num_low over den * 2**den_low, as (integer, exponent)."""
    shift = max(0, 130 + den.bit_length() - num.bit_length())
    q, r = divmod(num << shift, den)
    return (q << 1) | (r != 0), num_low - den_low - shift - 1


def _two_product(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x * y as hi + lo exactly (Dekker: Veltkamp's splits; |x|, |y| and the product well inside float64's range)."""
    hi = x * y
    cx = x * 134217729.0  # 2**27 + 1
    xh = cx - (cx - x)
    cy = y * 134217729.0
    yh = cy - (cy - y)
    xl, yl = x - xh, y - yh
    return hi, ((xh * yh - hi) + xh * yl + xl * yh) + xl * yl


def _sqrt_quotients(a: np.ndarray, b: np.ndarray, c: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """sqrt(|ab / (cd)|) of float64 arrays, correctly rounded where the first array says so (else to an ulp).

    The quotient and its root in double-double arithmetic, to about 2**-104 relative: the rounding to float64
    is certain unless the root lies within 2**-96 of a midpoint between two float64s (one pair in 2**43),
    or at a power of two, or the values lie where the products could leave float64's range; there the
    exact sums must say (`_int_quotient`, `_root`).
    """
    big = 2.0**220
    with np.errstate(all="ignore"):
        n_hi, n_lo = _two_product(a, b)
        d_hi, d_lo = _two_product(c, d)
        q = n_hi / d_hi
        p_hi, p_lo = _two_product(q, d_hi)
        q_lo = (((n_hi - p_hi) - p_lo) + n_lo - q * d_lo) / d_hi  # n_hi - p_hi exact: p_hi lies near n_hi
        q_hi = q + q_lo  # the quotient q_hi + q_lo, renormalized
        q_lo -= q_hi - q
        root = np.sqrt(q_hi)
        s_hi, s_lo = _two_product(root, root)
        low = (((q_hi - s_hi) - s_lo) + q_lo) / (2.0 * root)  # sqrt(q_hi + q_lo) - root, to about 2**-104 root
        t = low / np.spacing(root)  # in ulps of root: the result is root + round(t) ulps
        k = np.rint(t)
        near = np.abs(np.abs(t - k) - 0.5) < 2.0**-44
        mantissa = np.frexp(root)[0]  # where root + k ulps could cross a power of two (whose ulps differ)
        edge = (mantissa < 0.5 + 2.0**-48) | (mantissa > 1.0 - 2.0**-48)
        ranged = [(1 / big < np.abs(x)) & (np.abs(x) < big) for x in (a, b, c, d)]
        sure = ranged[0] & ranged[1] & ranged[2] & ranged[3] & ~near & ~edge & (np.abs(k) <= 2)
        out = root + k * np.spacing(root)
    return sure & np.isfinite(out), out


def _int_term(s: float, k: int) -> tuple[int, int]:
    """s * 2**k as (integer, exponent), the integer s's 53-bit mantissa (signed): as `_ExactSum.add` holds it."""
    mantissa, exponent = math.frexp(s)
    return int(mantissa * 9007199254740992.0), exponent - 53 + k


@dataclass(eq=False)
class SmallDiffs:
    """The differences of small pairs measured together (`small_diffs`): per-pair NumPy arrays.

    A pair of fewer than BLOCK values a side is one block, a tail, so each of its sums is one term: A's and
    B's p-norms (`a`, `b`) and 2-norms (`a2`, `b2`: the same for p = 2) as `SmallNorms`, Σ|a − b|**p as
    `diff * 2**diff_exps`, Σab as `dot * 2**dot_exps`, with `max_abs_diff` and `changed`. Pairs holding
    NaN or inf, or whose differences overflow, have accumulators of their own (`general`; zeros in the
    arrays). `accumulator(j)`, `figures()`, `merge_into` and `shares_of` give the bits that each pair's
    own `DiffAccumulator` gives, in a few NumPy passes for orders 1 and 2.
    """

    p: float
    a: SmallNorms
    b: SmallNorms
    a2: SmallNorms
    b2: SmallNorms
    diff: np.ndarray
    diff_exps: np.ndarray
    dot: np.ndarray
    dot_exps: np.ndarray
    max_abs_diff: np.ndarray
    changed: np.ndarray
    general: dict[int, DiffAccumulator]

    def __len__(self) -> int:
        return self.diff.size

    def accumulator(self, j: int) -> DiffAccumulator:
        """What adding pair j to a `DiffAccumulator` of its own gives."""
        if j in self.general:
            return self.general[j]
        acc = DiffAccumulator(self.p)
        acc._a, acc._b = self.a.accumulator(j), self.b.accumulator(j)
        acc._a2, acc._b2 = (acc._a, acc._b) if self.p == 2.0 else (self.a2.accumulator(j), self.b2.accumulator(j))
        if not math.isinf(self.p):
            acc._diff.add(float(self.diff[j]), int(self.diff_exps[j]))
        _add_signed(acc._dot, acc._dot_neg, self.dot[j : j + 1], self.dot_exps[j : j + 1])
        acc.max_abs_diff, acc.changed, acc.size = float(self.max_abs_diff[j]), int(self.changed[j]), int(self.a.size[j])
        return acc

    def figures(self) -> list[DiffFigures]:
        """Each pair's (norm_a, norm_b, diff_norm, rel, cosine, max_abs_diff, changed), as its accumulator's
        `result()` has them: the roots of one term each, vectorized for orders 1 and 2 (correctly rounded as
        the exact sums' are); rel and cosine from the exact terms, where they are not 0 or 1."""
        p = self.p
        if p not in (1.0, 2.0):
            return [self.accumulator(j).result().figures() for j in range(len(self))]
        with np.errstate(over="ignore"):
            root = (
                np.ldexp(np.sqrt(self.diff), self.diff_exps // 2) if p == 2.0 else np.ldexp(self.diff, self.diff_exps)
            )
        norm_a = self.a.norms()
        # rel: None where ‖A‖ is 0, 0 where nothing differs, else the root of the terms' exact quotient
        rel: list[float | None] = [None if x == 0.0 else 0.0 for x in norm_a.tolist()]
        todo = np.flatnonzero((norm_a != 0.0) & (self.diff != 0.0))
        if p == 2.0:  # the roots that double-double arithmetic rounds for certain
            one = np.ones(todo.size)
            sure, roots = _sqrt_quotients(self.diff[todo], one, self.a.sums[todo], one)
            scale = (self.diff_exps[todo] - self.a.exps[todo]) // 2  # both even
            roots = np.ldexp(roots, scale)
            sure &= (roots > 2.0**-1000) & (roots < 2.0**1000)  # no subnormal, no overflow on the way
            for j, value in zip(todo[sure].tolist(), roots[sure].tolist(), strict=True):
                rel[j] = value
            todo = todo[~sure]
        for j in todo.tolist():
            num, den = _int_term(float(self.diff[j]), int(self.diff_exps[j])), _int_term(*self.a.term(j))
            rel[j] = _ldexp(*_root(*_int_quotient(*num, *den), p))
        # cosine: None where a 2-norm is 0, 1 where Σab = Σa² = Σb² (equal terms: a pair of the same values)
        both = (self.a2.sums != 0.0) & (self.b2.sums != 0.0)
        parallel = (self.dot == self.a2.sums) & (self.dot_exps == self.a2.exps)
        parallel &= (self.a2.sums == self.b2.sums) & (self.a2.exps == self.b2.exps)
        cosine: list[float | None] = [1.0 if x else None for x in both.tolist()]
        todo = np.flatnonzero(both & ~parallel)
        dot = self.dot[todo]
        # (Σab)² / (Σa² Σb²) with exponents 2 kd - ka - kb, which the scales of `_product_scales` make 0
        even = 2 * self.dot_exps[todo] == self.a2.exps[todo] + self.b2.exps[todo]
        sure, roots = _sqrt_quotients(dot, dot, self.a2.sums[todo], self.b2.sums[todo])
        sure &= even
        for j, value, negative in zip(todo[sure].tolist(), roots[sure].tolist(), (dot[sure] < 0).tolist(), strict=True):
            cosine[j] = -min(value, 1.0) if negative else min(value, 1.0)
        for j in todo[~sure].tolist():
            dot_term = _int_term(float(self.dot[j]), int(self.dot_exps[j]))
            cosine[j] = _cosine_of(*dot_term, *_int_term(*self.a2.term(j)), *_int_term(*self.b2.term(j)))
        out = list(
            zip(
                norm_a.tolist(),
                self.b.norms().tolist(),
                np.maximum(root, self.max_abs_diff).tolist(),  # as `result` takes it
                rel,
                cosine,
                self.max_abs_diff.tolist(),
                self.changed.tolist(),
                strict=True,
            )
        )
        for j, acc in self.general.items():
            out[j] = acc.result().figures()
        return out

    def merge_into(self, total: DiffAccumulator) -> None:
        """`total.merge(self.accumulator(j))` for every pair."""
        if total.p != self.p:
            raise ValueError("cannot merge differences of different orders")
        sides = [(self.a, total._a), (self.b, total._b)]
        if self.p != 2.0:
            sides += [(self.a2, total._a2), (self.b2, total._b2)]
        for small, side in sides:
            small.merge_into(side)
        if not math.isinf(self.p):
            _add_power_sums(total._diff, self.diff, self.diff_exps)
        _add_signed(total._dot, total._dot_neg, self.dot, self.dot_exps)
        total.max_abs_diff = max(total.max_abs_diff, float(self.max_abs_diff.max(initial=0.0)))
        total.changed += int(self.changed.sum())
        total.size += int(self.a.size.sum())
        for acc in self.general.values():
            total.merge(acc)

    def shares_of(self, whole: DiffAccumulator) -> list[float | None]:
        """Each pair's `accumulator(j).share_of(whole)`: correctly rounded, one by one where not 0."""
        if math.isinf(self.p) or whole.nan_diff + whole.inf_diff:
            return [None if math.isinf(self.p) else math.nan] * len(self)
        whole._flush()
        if not whole._diff.acc:
            return [0.0] * len(self)
        return [
            self.general[j].share_of(whole)
            if j in self.general
            else _share(_exact(*_int_term(s, k)), whole._diff, self.p, False)
            for j, (s, k) in enumerate(zip(self.diff.tolist(), self.diff_exps.tolist(), strict=True))
        ]


def small_diffs(a: np.ndarray, b: np.ndarray, sizes: Sequence[int], ord: Any = 2) -> SmallDiffs:
    """The differences of small pairs of tensors whose values lie one after another in `a` and `b`, each pair
    of fewer than BLOCK values and more than none.

    The same bits as adding each pair to a `DiffAccumulator` of its own, in a few NumPy passes for all of
    them: two LoRA adapters of 12,000 tiny tensors compare at the speed of their bytes, not of 12,000 objects.
    """
    p = parse_ord(ord)
    lengths = np.asarray(sizes, np.int64)
    if a.size != b.size or lengths.sum() != a.size or (lengths >= BLOCK).any() or (lengths <= 0).any():
        raise ValueError(f"small_diffs takes pairs of equal size, each of 1 to {BLOCK - 1} values")
    starts = np.cumsum(lengths) - lengths
    # Signalling NaNs are NaN all the same; pairs holding NaN or inf, or whose differences overflow (float64
    # values), take the general path: their sums here are not used.
    with np.errstate(invalid="ignore", over="ignore"):
        wa, wb = _widen(a.reshape(-1))[1], _widen(b.reshape(-1), "b")[1]
        d = wa - wb
        ma, mb, md = (np.maximum.reduceat(np.abs(w), starts) for w in (wa, wb, d))
    plain = np.isfinite(ma) & np.isfinite(mb) & np.isfinite(md)
    ends = starts + lengths
    if not plain.all():
        apart = np.repeat(~plain, lengths)  # their values set to 0: they add nothing here
        wa, wb, d = (np.where(apart, 0.0, w) for w in (wa, wb, d))
        ma, mb, md = (np.where(plain, m, 0.0) for m in (ma, mb, md))
        lengths = np.where(plain, lengths, 0)
    zeros = np.zeros(lengths.size, np.int64)

    def side(w: np.ndarray, m: np.ndarray, q: float) -> SmallNorms:
        return SmallNorms(q, lengths, m, zeros, zeros, *_segment_power_sums(w, starts, m, q))

    sa, sb = side(wa, ma, p), side(wb, mb, p)
    sa2, sb2 = (sa, sb) if p == 2.0 else (side(wa, ma, 2.0), side(wb, mb, 2.0))
    ea, eb = _product_scales(ma, mb)  # as `_add_dots` scales a tail
    if ea.any() or eb.any():
        counts = np.diff(np.append(starts, wa.size))
        wa, wb = np.ldexp(wa, -np.repeat(ea, counts)), np.ldexp(wb, -np.repeat(eb, counts))
    dots = np.add.reduceat(wa * wb, starts)
    if math.isinf(p):
        ds, dk = np.zeros(lengths.size), zeros
    else:
        ds, dk = _segment_power_sums(d, starts, md, p)
    changed = np.add.reduceat(d != 0, starts, dtype=np.int64)
    general = {}
    for j in np.flatnonzero(~plain).tolist():  # last: an accumulator's passes reuse the scratch buffers above
        general[j] = DiffAccumulator(p)
        general[j].add(a.reshape(-1)[starts[j] : ends[j]], b.reshape(-1)[starts[j] : ends[j]])
    return SmallDiffs(p, sa, sb, sa2, sb2, ds, dk, dots, ea + eb, md, changed, general)


def diff(a: Any, b: Any, ord: Any = "euclidean") -> DiffStats:
    """How far `b` is from `a`: ‖a − b‖, ‖a‖, ‖b‖, ‖a − b‖/‖a‖, the cosine, max |a − b| and the changed count.

    Values of any real dtypes are compared by value, widened exactly to float64 and accumulated as the
    norms are: ‖a − b‖ from differences rounded once at most, the cosine Σab / (‖a‖₂‖b‖₂) from an exact
    signed dot product (right to 1e-12, also for nearly equal tensors). NaN equals NaN and -0.0 equals 0.0.

    Args:
        a: the reference tensor (array-like).
        b: a tensor of the same shape.
        ord: the order of the norms: 'euclidean' (2), 1, inf or any p > 0; the cosine is Euclidean.

    Returns:
        A `DiffStats`.

    Raises:
        TypeError: for object, complex or non-numeric tensors.
        ValueError: when the shapes differ, or for an unsupported order.
    """
    a, b = _as_tensor(a), _as_tensor(b)
    if a.shape != b.shape:
        raise ValueError(f"cannot compare tensors of shapes {a.shape} and {b.shape}")
    acc = DiffAccumulator(ord)
    acc.add(a, b)
    return acc.result()
