"""How far tensor B is from tensor A: `DiffAccumulator`, the `DiffStats` it gives, and `diff`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from clipcli.core.blocks import (
    BLOCK,
    PIECE,
    SCALE_LIMIT,
    as_tensor,
    fused_kind,
    fused_pair_sums,
    fused_step,
    is_floating,
    row_dots,
    row_power_sums,
    scratch,
    square_sums,
    widen,
)
from clipcli.core.exact import ExactSum, add_signed, cosine_of, quotient, root_value, share, signed, to_float
from clipcli.core.norms import NormAccumulator, NormStats, norm_of, parse_ord

# Pieces of pairs in `DiffAccumulator`'s fast path: twice as large, as it makes twice the NumPy calls a piece
# (larger still is slower with two workers, whose scratch buffers then crowd the shared cache).
_PAIR_PIECE = 32 * BLOCK
# The reductions themselves: the array methods add a Python call per use, and the fast paths make many.
_sum, _max, _min = np.add.reduce, np.maximum.reduce, np.minimum.reduce


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

    @classmethod
    def of_pair(
        cls,
        p: float,
        sides: tuple[NormAccumulator, ...],
        diff: tuple[float, int],
        dot: tuple[np.ndarray, np.ndarray],
        counts: tuple[float, int, int],
    ) -> DiffAccumulator:
        """An accumulator that has seen a whole pair, measured elsewhere (`small_diffs`).

        Args:
            p: the order.
            sides: the accumulators of A and B (p-norms) and, for p other than 2, of their 2-norms.
            diff: Σ|a − b|**p as (s, k): s * 2**k (left out for the inf-norm).
            dot: Σab as arrays (s, k) of one value each.
            counts: the largest difference, the pairs that differ, and the pairs.
        """
        acc = cls(p)
        acc._a, acc._b = sides[:2]
        acc._a2, acc._b2 = sides[2:] if acc.p != 2.0 else sides[:2]
        if not math.isinf(acc.p):
            acc._diff.add(*diff)
        add_signed(acc._dot, acc._dot_neg, *dot)
        acc.max_abs_diff, acc.changed, acc.size = counts
        return acc

    def __init__(self, ord: Any = 2) -> None:
        self.p = parse_ord(ord)
        self._a, self._b = NormAccumulator(self.p), NormAccumulator(self.p)
        # The cosine's 2-norms: the p-norms themselves when p is 2.
        self._a2, self._b2 = (self._a, self._b) if self.p == 2.0 else (NormAccumulator(2), NormAccumulator(2))
        self._diff = ExactSum(self.p)
        self._dot, self._dot_neg = ExactSum(), ExactSum()
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
        other.end_block()
        for mine, theirs in zip(self.sides(), other.sides(), strict=True):
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
        self.end_block()
        a, b = self._a.result(), self._b.result()
        a2, b2 = self._a2.result(), self._b2.result()
        max_abs_diff = math.nan if self.nan_diff else self.max_abs_diff
        diff_norm = norm_of(self._diff, self.p, self.max_abs_diff, self.nan_diff, self.inf_diff)[0]
        nonfinite = a.nan + a.inf + b.nan + b.inf > 0
        return DiffStats(
            diff_norm=diff_norm,
            norm_a=a.norm,
            norm_b=b.norm,
            rel=self._rel(diff_norm, a),
            cosine=math.nan if nonfinite else self._cosine(),
            dot=math.nan if nonfinite else to_float(*signed(self._dot, self._dot_neg)),
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

    def sides(self) -> tuple[NormAccumulator, ...]:
        """The accumulators of A's and B's p-norms and, for p other than 2, of their 2-norms (the cosine's)."""
        return (self._a, self._b) if self.p == 2.0 else (self._a, self._b, self._a2, self._b2)

    def add_terms(
        self, diff: tuple[np.ndarray, np.ndarray], dot: tuple[np.ndarray, np.ndarray], counts: tuple[float, int, int]
    ) -> None:
        """Adds whole pairs measured elsewhere (`small_diffs`), their sides added to `sides()` apart.

        Args:
            diff: Σ|a − b|**p of each pair as arrays (s, k): s * 2**k (left out for the inf-norm).
            dot: Σab of each pair, likewise.
            counts: the largest difference among them, the pairs that differ, and the pairs.
        """
        if not math.isinf(self.p):
            self._diff.add_terms(*diff)
        add_signed(self._dot, self._dot_neg, *dot)
        self.max_abs_diff = max(self.max_abs_diff, counts[0])
        self.changed += counts[1]
        self.size += counts[2]

    def diff_sum(self) -> ExactSum:
        """The exact sum of |a − b|**p of every pair added so far (a block in progress included)."""
        self.end_block()
        return self._diff

    def share_of(self, whole: DiffAccumulator) -> float | None:
        """The sum of |a − b|**p seen here over `whole`'s: its share of whole's ‖A − B‖**p, as
        `NormAccumulator.share_of` gives it (NaN where a difference in whole is NaN or inf)."""
        self.end_block()
        whole.end_block()
        return share(self._diff, whole._diff, self.p, whole.nan_diff + whole.inf_diff > 0)

    def _rel(self, diff_norm: float, a: NormStats) -> float | None:
        """‖A − B‖ / ‖A‖: from the exact sums (no overflow, correctly rounded for p = 1, 2) when finite.

        None only when ‖A‖ is 0; NaN when A holds NaN, even where nothing changed (0 / NaN, as the spec's
        quotient is).
        """
        if a.norm == 0.0:
            return None
        if math.isinf(self.p) or self.nan_diff + self.inf_diff + a.nan + a.inf:
            return diff_norm / a.norm
        return root_value(quotient(self._diff, self._a.power_sum()), self.p)

    def _cosine(self) -> float | None:
        """Σab / sqrt(Σa² Σb²), the sums exact: sqrt((Σab)² / (Σa² Σb²)), correctly rounded, at most 1."""
        a, b = self._a2.power_sum(), self._b2.power_sum()
        if not (a.acc and b.acc):
            return None
        return cosine_of(*signed(self._dot, self._dot_neg), a.acc, a.low, b.acc, b.low)

    def _extend_pending(self, values: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        """Adds widened pairs and their differences to the block in progress; adds the block once full."""
        wa, wb, d = values
        if self._pending is None:
            self._pending = (wa.copy(), wb.copy(), d.copy())
        else:
            pa, pb, pd = self._pending
            self._pending = (np.concatenate([pa, wa]), np.concatenate([pb, wb]), np.concatenate([pd, d]))
        if self._pending[0].size == BLOCK:
            self.end_block()

    def end_block(self) -> None:
        """Ends the block in progress: values added so far that fill no whole block (a tensor's last ones) are
        summed as a block of their own, and the values added next start a block. Feeding a tensor's chunks out of
        order (a worker that takes its last chunk before others of it), end the block after a chunk that is not
        whole blocks, so that the blocks are the tensor's own from its start, as in order."""
        if self._pending is not None:
            wa, wb, d = self._pending
            self._pending = None
            self._add_blocks(wa.reshape(1, -1), wb.reshape(1, -1), d.reshape(1, -1))

    def _add_whole_blocks(self, a: np.ndarray, b: np.ndarray) -> None:
        if self.p == 2.0 and _squares_fit(a.dtype) and _squares_fit(b.dtype):
            self._add_squares(a, b)
            return
        for start in range(0, a.size, PIECE):
            rows = (v.reshape(-1, BLOCK) for v in self._pairs(a[start : start + PIECE], b[start : start + PIECE]))
            self._add_blocks(*rows)

    def _add_squares(self, a: np.ndarray, b: np.ndarray) -> None:
        """The fast path for p = 2 and values of float32's range: four dot products per block, NaN and inf aside.

        Pairs of float32, bfloat16 and float16 values take one fused pass (`_fused.pair_sums`, which widens
        as it reads); other dtypes, and stretches holding NaN or inf, NumPy's passes (`_add_pieces`). Every
        path gives the same bits for a block of finite values.
        """
        sums = np.empty((4, a.size // BLOCK))  # per block: d·d, a·a, b·b, a·b
        kinds = fused_kind(a.dtype), fused_kind(b.dtype)
        if None in kinds:
            self._add_pieces(a, b, sums)
        else:
            step = fused_step(_PAIR_PIECE, a, b)
            for start in range(0, a.size, step):
                pa, pb = a[start : start + step], b[start : start + step]
                part = sums[:, start // BLOCK : (start + pa.size) // BLOCK]
                rows = np.empty((part.shape[1], 4))
                changed, top = fused_pair_sums(pa, pb, rows, kinds)
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
            wa = widen(pa)[1].reshape(-1, BLOCK)
            wb = widen(pb, "b")[1].reshape(-1, BLOCK)  # a scratch buffer of its own: it becomes a − b
            dd, aa, bb, ab = part
            row_dots(wa, wa, out=aa)
            row_dots(wb, wb, out=bb)
            if not math.isfinite(_sum(aa) + _sum(bb)):  # sums of non-negative finite squares cannot overflow
                part[:] = 0.0
                self._add_blocks(wa, wb, self._differences(wa, wb))
                continue
            row_dots(wa, wb, out=ab)
            d = np.subtract(wa, wb, out=wb)
            row_dots(d, d, out=dd)
            top = float(max(_max(d, None), -_min(d, None)))
            self._count_changes(_count_nonzero(d) if top else 0, top)

    def _add_sums(self, sums: np.ndarray) -> None:
        """Adds blocks' sums of finite values: rows d·d, a·a, b·b and a·b."""
        self._diff.add_many(sums[0])
        self._a.add_sums(sums[1])
        self._b.add_sums(sums[2])
        add_signed(self._dot, self._dot_neg, sums[3], np.zeros(sums[3].size, np.int64))

    def _count_changes(self, changed: int, top: float) -> None:
        """Counts finite differences: how many are not 0, and the largest magnitude among them."""
        self.changed += changed
        self.max_abs_diff = max(self.max_abs_diff, top)

    def _add_identical_blocks(self, x: np.ndarray) -> None:
        if self.p == 2.0:
            squares = square_sums(x)
            if squares is not None:
                sums, e, _ = squares
                self._a.add_sums(sums, e)
                self._b.add_sums(sums, e)
                self._dot.add_many(sums, e)
                return
        for start in range(0, x.size, PIECE):
            w = widen(x[start : start + PIECE])[1].reshape(-1, BLOCK)
            side = NormAccumulator(self.p)
            side.add_rows(w)
            self._a.merge(side)
            self._b.merge(side)
            squares = side
            if self.p != 2.0:
                squares = NormAccumulator(2)
                squares.add_rows(w)
                self._a2.merge(squares)
                self._b2.merge(squares)
            self._dot.merge(squares.power_sum())  # a·a is a², block by block: the sums of squares are the dot product's

    def _pairs(self, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A's and B's values widened to float64 and their differences (scratch buffers), counted."""
        wa, wb = widen(a)[1], widen(b, "b")[1]
        if a.dtype.kind in "iub" and b.dtype.kind in "iub" and max(a.itemsize, b.itemsize) == 8:
            return wa, wb, self._count(wa, wb, _integer_differences(a, b, scratch(a.size, np.float64, "d")))
        return wa, wb, self._differences(wa, wb)

    def _differences(self, wa: np.ndarray, wb: np.ndarray) -> np.ndarray:
        # finite values may overflow (1e308 - -1e308); inf - inf is NaN until equal values are set to 0
        with np.errstate(over="ignore", invalid="ignore"):
            return self._count(wa, wb, np.subtract(wa, wb, out=scratch(wa.size, np.float64, "d").reshape(wa.shape)))

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
        `NormAccumulator.add_rows`), so ‖A‖ and ‖B‖ are the bits `global-norm` reports.
        """
        sides = [(self._a, wa), (self._b, wb)]
        if self.p != 2.0:
            sides += [(self._a2, wa), (self._b2, wb)]
        for side, w in sides:
            side.add_rows(w)
        self._add_dots(wa, wb)
        if not math.isinf(self.p):
            self._add_difference_sums(wa, wb, d)

    def _add_dots(self, wa: np.ndarray, wb: np.ndarray) -> None:
        """Adds Σab of each block without NaN or inf."""
        ma, mb = _row_peaks(wa), _row_peaks(wb)
        finite = np.isfinite(ma) & np.isfinite(mb)
        if not finite.all():
            wa, wb, ma, mb = wa[finite], wb[finite], ma[finite], mb[finite]
        ea, eb = product_scales(ma, mb)
        if ea.any() or eb.any():
            wa, wb = np.ldexp(wa, -ea[:, None]), np.ldexp(wb, -eb[:, None])
        if wa.shape[1] < BLOCK and wa.size:  # a tail: reduced as its sum of squares is, so a·a is a² bit for bit
            dots = np.add.reduceat(np.multiply(wa, wb).reshape(-1), np.arange(0, wa.size, wa.shape[1]))
        else:
            dots = row_dots(wa, wb)
        add_signed(self._dot, self._dot_neg, dots, ea + eb)

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
                s, k = row_power_sums(half, _row_peaks(half), self.p)
                whole = math.floor(self.p)
                self._diff.add_terms(s * 2.0 ** (self.p - whole), k + whole)
            d, m = d[finite], m[finite]
        if m.size:
            self._diff.add_terms(*row_power_sums(d, m, self.p))


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
    w = widen(a)[1]
    return w, w, np.zeros(w.size)


def _squares_fit(dtype: np.dtype) -> bool:
    """Whether values of `dtype` widened to float64 have finite squares, products and differences (no rescaling)."""
    return (is_floating(dtype) and dtype != np.float64) or (dtype.kind in "iub" and dtype.itemsize <= 4)


def _row_peaks(w: np.ndarray) -> np.ndarray:
    """The largest magnitude of each row; NaN where a row holds NaN."""
    return np.maximum(w.max(axis=1), -w.min(axis=1))


def product_scales(ma: np.ndarray, mb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exponents (ea, eb) to scale rows of A and B by (2**-ea, 2**-eb) where their products could leave float64.

    Rows are scaled only where the product of their largest magnitudes lies beyond 2**±600. For A = B
    these are the exponents `row_power_sums` scales squares by, so a·a is the sum of squares bit for bit.
    """
    ea, eb = np.frexp(ma)[1].astype(np.int64), np.frexp(mb)[1].astype(np.int64)
    far = np.abs(ea + eb) > SCALE_LIMIT
    return np.where(far, ea, 0), np.where(far, eb, 0)


def _count_nonzero(d: np.ndarray) -> int:
    # np.count_nonzero is much slower on float64 than on a boolean mask
    return int(np.count_nonzero(np.not_equal(d, 0.0, out=scratch(d.size, np.bool_).reshape(d.shape))))


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
    a, b = as_tensor(a), as_tensor(b)
    if a.shape != b.shape:
        raise ValueError(f"cannot compare tensors of shapes {a.shape} and {b.shape}")
    acc = DiffAccumulator(ord)
    acc.add(a, b)
    return acc.result()
