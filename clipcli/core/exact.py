"""Exact sums of float64 terms as Python integers times a power of two, and their roots and quotients."""

from __future__ import annotations

import math

import numpy as np

# Up to this order a block's powers are scaled by a power of two, its largest into [0.5, 1), and summed
# exactly; above it that largest power could leave float64's range (0.5 ** 1075 is 0), so each block is
# divided by its largest magnitude instead (`blocks`' high-order sums) and the sums keep `_WINDOW` bits.
POWER_OF_TWO_ORDER = 1000.0


# Bits an order's exact sum keeps above `POWER_OF_TWO_ORDER` (below it: all; they span at most ~2.2 million).
# The roots read 64 of them; the rest are margin, so that the sums' order cannot reach those 64.
_WINDOW = 4096


class ExactSum:
    """An exact sum of non-negative terms `s * 2**k`, kept as a Python integer times 2**low."""

    __slots__ = ("acc", "low", "window")

    @classmethod
    def of(cls, acc: int, low: int) -> ExactSum:
        """The sum `acc * 2**low` (an order's window aside)."""
        total = cls()
        total.acc, total.low = acc, low
        return total

    def __init__(self, p: float = 2.0) -> None:
        self.acc = 0
        self.low = 0
        # Orders above `POWER_OF_TWO_ORDER` keep the top `_WINDOW` bits, the bits below as a sticky last bit:
        # their sums' exponents may lie p * 2000 bits apart.
        self.window = _WINDOW if p > POWER_OF_TWO_ORDER and not math.isinf(p) else None

    def add(self, s: float, k: int) -> None:
        """Adds one non-negative term `s * 2**k` exactly."""
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
        """Adds non-negative float64 terms times 2**k exactly (see `add_columns`)."""
        add_columns([self], sums.reshape(-1, 1), k)

    def add_terms(self, s: np.ndarray, k: np.ndarray) -> None:
        """Adds non-negative terms `s * 2**k` (arrays of any shape, each term its own exponent) exactly."""
        s, k = s.ravel(), k.ravel()
        if not s.size:
            return
        if not k.any():
            self.add_many(s)
            return
        for value, e in zip(s.tolist(), k.tolist(), strict=True):
            self.add(value, e)

    def merge(self, other: ExactSum) -> None:
        """Adds another exact sum."""
        if other.acc:
            self.add_int(other.acc, other.low)

    def add_int(self, acc: int, low: int) -> None:
        """Adds the integer term `acc * 2**low` exactly (within an order's window)."""
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
        """The p-th root of the sum as `(m, e)`, the root being m * 2**e (see `int_root`)."""
        return int_root(self.acc, self.low, p)


def int_root(acc: int, low: int, p: float) -> tuple[float, int]:
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
    if p <= POWER_OF_TWO_ORDER:  # in float64 (|x| < 2**53 here): fmod is exact, the quotient an integer
        rem = math.fmod(x, p)
        whole = round((x - rem) / p)
        r = (rem + math.log2(f)) / p
        below = math.floor(r)
        return 2.0 ** (r - below), whole + below
    from fractions import Fraction  # rarely needed: not imported with the core

    r = (Fraction(x) + Fraction(math.log2(f))) / Fraction(p)
    whole = math.floor(r)
    return 2.0 ** float(r - whole), whole


def root_value(total: ExactSum, p: float) -> float:
    """The root of an exact sum as a float64: inf when it is too large for one."""
    return ldexp(*total.root(p))


def share(part: ExactSum, whole: ExactSum, p: float, nonfinite: bool) -> float | None:
    """part / whole, correctly rounded: None for the inf-norm, NaN where whole holds NaN or Inf, 0 for a zero whole."""
    if math.isinf(p):
        return None
    if nonfinite:
        return math.nan
    if not whole.acc:
        return 0.0
    return root_value(quotient(part, whole), 1.0)  # the quotient's 130 bits and a sticky bit: one rounding


def _shift_sticky(a: int, shift: int) -> int:
    """a * 2**-shift as an integer; bits shifted out set the lowest bit, so a later rounding is correct."""
    if shift <= 0:
        return a << -shift
    if shift >= a.bit_length():  # all of it shifted out (a large order's terms lie far apart)
        return int(a != 0)
    return (a >> shift) | (a & ((1 << shift) - 1) != 0)


def ldexp(x: float, e: int) -> float:
    """x * 2**e for any integer e: inf or 0 where e lies beyond C's long."""
    try:
        return math.ldexp(x, e)
    except OverflowError:  # e beyond C's long: far above float64's range, or far below it
        return math.copysign(math.inf if e > 0 else 0.0, x)


def add_columns(totals: list[ExactSum], sums: np.ndarray, k: int = 0) -> None:
    """Adds each column of non-negative float64 terms times 2**k to its total, exactly.

    A column's terms become 53-bit integers shifted to their common exponent (when they lie within 2**10 of
    one another: int64 holds them) and summed in NumPy as two halves of 32 bits, exact for fewer than 2**31
    terms; a column spread wider, or of a few terms, is added one term at a time.

    Args:
        totals: one exact sum per column.
        sums: the terms, one row per block and one column per total.
        k: the power of two they are all multiplied by.
    """
    if sums.shape[0] <= 8:  # a few terms (a small tensor's blocks): one at a time beats NumPy's set-up
        for total, column in zip(totals, sums.T.tolist(), strict=True):
            for s in column:
                total.add(s, k)
        return
    mantissas, exponents = np.frexp(sums)
    exponents = np.where(mantissas == 0, exponents.max(axis=0), exponents)  # zeros: out of the range
    low = exponents.min(axis=0)
    shifts = exponents - low
    wide = (shifts.max(axis=0) > 10).tolist()
    ints = (mantissas * 9007199254740992.0).astype(np.int64) << np.minimum(shifts, 10)  # < 2**63: exact
    high = (ints >> 32).sum(axis=0).tolist()
    rest = (ints & 0xFFFFFFFF).sum(axis=0).tolist()
    for j, total in enumerate(totals):
        if wide[j]:  # too far apart for int64: one at a time
            for s in sums[:, j].tolist():
                total.add(s, k)
        else:
            total.add_int((high[j] << 32) + rest[j], int(low[j]) - 53 + k)


def to_float(acc: int, low: int) -> float:
    """acc * 2**low, correctly rounded; +-inf beyond float64's range."""
    try:
        return float(acc << low) if low >= 0 else acc / (1 << -low)  # int / int rounds correctly
    except OverflowError:
        return -math.inf if acc < 0 else math.inf


def signed(positive: ExactSum, negative: ExactSum) -> tuple[int, int]:
    """positive - negative as (integer, exponent): the value is integer * 2**exponent."""
    low = min(positive.low, negative.low)
    return (positive.acc << (positive.low - low)) - (negative.acc << (negative.low - low)), low


def add_signed(positive: ExactSum, negative: ExactSum, s: np.ndarray, k: np.ndarray) -> None:
    """Adds signed sums `s * 2**k` exactly: the positive ones to `positive`, the others' magnitudes to `negative`."""
    positive.add_terms(np.maximum(s, 0.0), k)
    negative.add_terms(np.maximum(-s, 0.0), k)


def quotient(num: ExactSum, den: ExactSum) -> ExactSum:
    """num / den (den > 0) to at least 130 bits, the bits beyond kept as a sticky last bit for `int_root`."""
    return ExactSum.of(*int_quotient(num.acc, num.low, den.acc, den.low))


def int_quotient(num: int, num_low: int, den: int, den_low: int) -> tuple[int, int]:
    """`quotient` of num * 2**num_low over den * 2**den_low, as (integer, exponent)."""
    shift = max(0, 130 + den.bit_length() - num.bit_length())
    q, r = divmod(num << shift, den)
    return (q << 1) | (r != 0), num_low - den_low - shift - 1


def cosine_of(dot: int, low: int, a: int, a_low: int, b: int, b_low: int) -> float:
    """Σab / sqrt(Σa² Σb²) for Σab = dot * 2**low, Σa² = a * 2**a_low and Σb² = b * 2**b_low (not 0):
    sqrt((Σab)² / (Σa² Σb²)), correctly rounded, at most 1."""
    cosine = min(ldexp(*int_root(*int_quotient(dot * dot, 2 * low, a * b, a_low + b_low), 2.0)), 1.0)
    return -cosine if dot < 0 else cosine


def int_term(s: float, k: int) -> tuple[int, int]:
    """s * 2**k as (integer, exponent), the integer s's 53-bit mantissa (signed): as `ExactSum.add` holds it."""
    mantissa, exponent = math.frexp(s)
    return int(mantissa * 9007199254740992.0), exponent - 53 + k


def _two_product(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x * y as hi + lo exactly (Dekker: Veltkamp's splits; |x|, |y| and the product well inside float64's range)."""
    hi = x * y
    cx = x * 134217729.0  # 2**27 + 1
    xh = cx - (cx - x)
    cy = y * 134217729.0
    yh = cy - (cy - y)
    xl, yl = x - xh, y - yh
    return hi, ((xh * yh - hi) + xh * yl + xl * yh) + xl * yl


def sqrt_quotients(a: np.ndarray, b: np.ndarray, c: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """sqrt(|ab / (cd)|) of float64 arrays, correctly rounded where the first array says so (else to an ulp).

    The quotient and its root in double-double arithmetic, to about 2**-104 relative: the rounding to float64
    is certain unless the root lies within 2**-96 of a midpoint between two float64s (one pair in 2**43),
    or at a power of two, or the values lie where the products could leave float64's range; there the
    exact sums must say (`int_quotient`, `int_root`).
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
