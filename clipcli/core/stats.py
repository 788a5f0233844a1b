"""Exact statistics of a tensor streamed in chunks: `StatsAccumulator`, `TensorStats` and `CastReadiness`."""

from __future__ import annotations

import functools
import itertools
import math
import operator
from dataclasses import dataclass
from typing import Any

import numpy as np

from clipcli.core.blocks import (
    BLOCK,
    PIECE,
    STATS_CALL,
    STATS_SCALARS,
    STATS_SUBNORMAL,
    BlockParts,
    as_tensor,
    fused_exact_columns,
    fused_stats,
    fused_stats_ready,
    fused_stats_state,
    is_floating,
    widen,
)
from clipcli.core.casts import CAST_NAMES, TARGETS, cast, cast_counts, error_sums, precision, smallest_exponent
from clipcli.core.exact import ExactSum, add_columns, add_signed, int_quotient, int_root, ldexp, signed

# `_fused.stats_f32`'s running counts are folded in before its int64 sums could overflow (2**39 values), and
# its error sums once this many calls have left some.
_FOLD_VALUES = 1 << 38
_FOLD_CALLS = 64

# frexp's exponents of float64 values lie in [-1073, 1024]: shifted by this, they index bins from 0.
_OFFSET = 1100
_BINS = 2200

# The accumulator's exact sums, and those it keeps per cast target (pickled as (integer, exponent) pairs).
_SUMS = ("_sum", "_sum_neg", "_squares", "_base")
_SUMS_PER_TARGET = ("_errors", "_above")


@dataclass(frozen=True)
class CastReadiness:
    """What a cast to a narrower float with round-to-nearest-even would do to a tensor's finite values."""

    dtype: str  # the target: float16, bfloat16, float8_e4m3fn or float8_e5m2 (`CAST_NAMES`)
    overflow: int  # finite values that would become inf or NaN (saturate, for a type without inf)
    flush: int  # non-zero values that would become zero
    subnormal: int  # values that would land subnormal (non-zero, below the target's smallest normal)
    # ‖x − cast(x)‖₂ / ‖x‖₂ over the finite values that do not overflow (both norms over those): exact
    # squares, float64 sums per block in one fixed order (`casts.error_sums`), added exactly, the quotient's
    # root correctly rounded from those (right to 1e-12); None when those values are all zero.
    rel_error: float | None


@dataclass(frozen=True)
class TensorStats:
    """Exact statistics of one tensor's values (of a complex tensor: its real and imaginary parts).

    min, max and max_abs ignore NaN (-0.0 is reported as 0.0) and are None where no value is a number;
    mean and std are correctly rounded from the exact sums (std is the population's, ddof=0), None for an
    empty tensor, NaN where a value is NaN (and std also where one is infinite), ±inf for a mean over
    infinities of one sign. A complex tensor is described by its parts, as a real tensor twice its size
    (exact, and what a cast acts on). Integer and bool tensors report exact extremes, sums and zeros, and
    no subnormals, exponents or casts.
    """

    dtype: str
    count: int  # values (a complex tensor: twice its size, real and imaginary parts in C order)
    min: float | int | None
    max: float | int | None
    max_abs: float | int | None
    argmax_abs: int | None  # the flat C-order index of the first value of largest magnitude
    mean: float | None
    std: float | None
    zeros: int  # 0.0 and -0.0
    subnormals: int  # in the tensor's own dtype
    nan: int
    posinf: int
    neginf: int
    # (e, n): n finite non-zero values with 2**e <= |x| < 2**(e + 1), by increasing e; zeros and NaN/Inf apart.
    exponents: tuple[tuple[int, int], ...]
    all_zero: bool  # values there are, and every one is zero
    constant: bool  # two values or more, all equal (all zero included), none NaN
    casts: tuple[CastReadiness, ...]


@functools.lru_cache(maxsize=64)  # (asked per accumulator: few dtypes)
def default_casts(dtype: Any) -> tuple[str, ...]:
    """The names of the cast targets narrower than `dtype` (of a complex dtype: than its parts); none for other
    dtypes."""
    part = _part_dtype(np.dtype(dtype))
    if not is_floating(part):
        return ()
    return tuple(name for name, t in TARGETS.items() if t.itemsize < part.itemsize)


class StatsAccumulator:
    """Streams chunks of one tensor's values into its exact statistics, `TensorStats`.

    Feed the values, in C order, with `add(values, start)` in any chunks and any order (each chunk's
    `start` is the flat index of its first value); workers' accumulators of the same tensor combine with
    `merge`. Counts and sums are exact (Python integers), so every chunking and every order of merges gives
    the same bits. Sums of x and x² are taken per binade: the mantissas of one binade are multiples of one
    unit, so their float64 sums are exact. float32 values (and complex64's parts) take one pass of
    `_fused.stats_f32` instead, which sums their integer significands per sign and exponent field in
    int64 and 128-bit integers; its running counts are folded into the exact sums before a merge, a
    result or a pickle. The cast errors are float64 sums of exact squares per block counted from the
    tensor's first value (`casts.error_sums`; a block cut by a chunk's edge waits for its other parts),
    taken in one order by `_fused` and by NumPy alike: the same bits whether `_fused` was built or not.

    Args:
        dtype: the tensor's dtype: bool, integer, floating (ml_dtypes' too) or complex.
        casts: the cast targets (names or dtypes, among `CAST_NAMES`); None for `default_casts(dtype)`.
    """

    def __init__(self, dtype: Any, casts: Any = None) -> None:
        self.dtype = _native(np.dtype(dtype))
        self._part = _part_dtype(self.dtype)
        if not (is_floating(self._part) or self._part.kind in "biu"):
            raise TypeError(f"no statistics for tensors of dtype {self.dtype}")
        self._floating = is_floating(self._part)
        targets = default_casts(self.dtype) if casts is None else tuple(map(_target_name, casts))
        if casts is not None and any(t not in TARGETS for t in targets):
            raise ValueError(f"cast targets are among {list(CAST_NAMES)}, got {list(targets)}")
        self.targets = targets if self._floating else ()
        self.count = 0
        self.nan = self.posinf = self.neginf = self.zeros = 0
        self._min: float | int | None = None
        self._max: float | int | None = None
        self._peak: tuple[float | int, int] | None = None  # the largest magnitude and its first index
        self._sum, self._sum_neg, self._squares = ExactSum(), ExactSum(), ExactSum()
        self._int_sum = self._int_squares = 0  # integer tensors' sums
        self._bins = np.zeros(_BINS, np.int64)  # values per frexp exponent (+ _OFFSET), zeros in bin _OFFSET
        self._readiness = {t: [0, 0, 0] for t in self.targets}  # overflow, flush, subnormal
        # The cast errors' exact sums (see `casts.error_sums`): x² up to 464, and per target (x − cast(x))² and
        # the x² of the values above 464 that it keeps
        self._base = ExactSum()
        self._errors = {t: ExactSum() for t in self.targets}
        self._above = {t: ExactSum() for t in self.targets}
        self._parts = BlockParts()  # values of blocks cut by chunk edges, for the cast errors
        # float32 values' running counts from `_fused.stats_f32`, and its error sums not yet added: folded
        # into the fields above by `_fold` (before a merge, a result, or a count its bins could not hold)
        self._fused: np.ndarray | None = None
        self._fused_count = 0
        self._pending: list[np.ndarray] = []

    def add(self, values: Any, start: int) -> None:
        """Adds values of the tensor (any shape, taken in C order), the first at flat index `start`.

        Raises:
            TypeError: when the values are of another dtype than the accumulator's.
        """
        values = as_tensor(values)
        if values.dtype.newbyteorder("=") != self.dtype:
            raise TypeError(f"expected values of dtype {self.dtype.name}, got {values.dtype.name}")
        flat = np.ascontiguousarray(values.reshape(-1), dtype=self.dtype)
        if not flat.size:
            return
        if self.dtype.kind == "c":  # real and imaginary parts, in turn
            flat, start = flat.view(self._part), 2 * start
        if not self._floating:
            self._add_integers(flat, start)
            return
        head = min(-start % BLOCK, flat.size)
        full = (flat.size - head) - (flat.size - head) % BLOCK
        for a, b in ((0, head), (head + full, flat.size)):
            if b > a:
                self._add_floats(flat[a:b], start + a, whole=False)
        step = STATS_CALL // 2 if fused_stats_ready(flat.dtype) else PIECE  # _fused takes long runs
        for a in range(head, head + full, step):
            self._add_floats(flat[a : min(a + step, head + full)], start + a, whole=True)

    def __getstate__(self) -> dict[str, Any]:
        """The state to pickle (a worker's, sent to its parent): `_fused`'s running counts folded in first; the
        exponent bins as the few that are used and the exact sums as (integer, exponent) pairs (2,200 bins were 17
        KiB a tensor; 18 `ExactSum` objects took most of the time a worker's ~150 accumulators took to pickle)."""
        self._fold()
        used = np.flatnonzero(self._bins)
        lo, hi = (int(used[0]), int(used[-1]) + 1) if used.size else (0, 0)
        state = {**self.__dict__, "_bins": (lo, self._bins[lo:hi].tobytes())}
        for name in _SUMS:
            state[name] = (state[name].acc, state[name].low)
        for name in _SUMS_PER_TARGET:
            state[name] = [(total.acc, total.low) for total in state[name].values()]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        lo, counts = state["_bins"]
        state["_bins"] = np.zeros(_BINS, np.int64)
        state["_bins"][lo : lo + len(counts) // 8] = np.frombuffer(counts, np.int64)
        for name in _SUMS:
            state[name] = ExactSum.of(*state[name])
        for name in _SUMS_PER_TARGET:
            state[name] = {t: ExactSum.of(*pair) for t, pair in zip(state["targets"], state[name], strict=True)}
        self.__dict__.update(state)

    def merge(self, other: StatsAccumulator) -> None:
        """Adds the values of the same tensor that `other` has seen (another worker's chunks).

        Raises:
            ValueError: when `other` is of another dtype or other cast targets.
        """
        if (other.dtype, other.targets) != (self.dtype, self.targets):
            raise ValueError("cannot merge statistics of different dtypes or cast targets")
        self._fold()
        other._fold()
        self.count += other.count
        self.nan += other.nan
        self.posinf += other.posinf
        self.neginf += other.neginf
        self.zeros += other.zeros
        if other._min is not None:
            self._extremes(other._min, other._max, *other._peak)
        for mine, theirs in ((self._sum, other._sum), (self._sum_neg, other._sum_neg), (self._squares, other._squares)):
            mine.merge(theirs)
        self._int_sum += other._int_sum
        self._int_squares += other._int_squares
        self._bins += other._bins
        self._base.merge(other._base)
        for t in self.targets:
            self._readiness[t] = [a + b for a, b in zip(self._readiness[t], other._readiness[t], strict=True)]
            self._errors[t].merge(other._errors[t])
            self._above[t].merge(other._above[t])
        for x in self._parts.merge(other._parts):
            self._add_block_errors(x)

    def result(self) -> TensorStats:
        """The statistics of every value added so far (a block seen in part is taken as the tensor's tail)."""
        self._fold()
        for x in self._parts.rest():
            self._add_block_errors(x)
        exponents, subnormals = self._exponents()
        return TensorStats(
            dtype=_name(self.dtype),
            count=self.count,
            min=self._min,
            max=self._max,
            max_abs=None if self._peak is None else self._peak[0],
            argmax_abs=None if self._peak is None else self._peak[1],
            mean=self._mean(),
            std=self._std(),
            zeros=self.zeros,
            subnormals=subnormals,
            nan=self.nan,
            posinf=self.posinf,
            neginf=self.neginf,
            exponents=exponents,
            all_zero=self.count > 0 and self.zeros == self.count,
            constant=self.count > 1 and not self.nan and self._min == self._max,
            casts=tuple(self._cast_readiness(t) for t in self.targets),
        )

    # --- values -------------------------------------------------------------------------------------

    def _add_floats(self, x: np.ndarray, start: int, whole: bool) -> None:
        """Adds floating values from flat index `start`; `whole`: they are whole blocks, else a fragment."""
        if fused_stats_ready(x.dtype):
            self._add_fused(x, start, whole)
            return
        self.count += x.size
        # A signalling NaN in the data raises "invalid" when converted; it is a NaN all the same.
        with np.errstate(invalid="ignore"):
            w = widen(x)[1]
        lo, hi = int(np.argmin(w)), int(np.argmax(w))  # a NaN, where there is one: the first
        finite = math.isfinite(w[lo]) and math.isfinite(w[hi])
        if finite:
            self._extremes(*_extremes_of(w, lo, hi, np.arange(0), start))
            nonfinite = 0
        else:
            w, nonfinite = self._count_nonfinite(w, start)
        zeros = x.size - int(np.count_nonzero(np.not_equal(w, 0.0))) - nonfinite  # NaN and Inf became 0 in w
        self.zeros += zeros
        self._add_sums(w)
        self._add_casts(x, finite, zeros, errors=whole)
        if not whole:
            block = self._parts.add(start, x.copy())
            if block is not None:
                self._add_block_errors(block)

    def _add_fused(self, x: np.ndarray, start: int, whole: bool) -> None:
        """Adds float32 values from flat index `start` through `_fused.stats_f32`; `whole` as `_add_floats`'."""
        if self._fused is None:
            self._fused = fused_stats_state()
        errors = fused_stats(x, self._fused, start)
        self.count += x.size
        self._fused_count += x.size
        if whole:
            self._pending.append(errors)
        else:
            block = self._parts.add(start, x.copy())
            if block is not None:
                self._add_block_errors(block)
        if self._fused_count >= _FOLD_VALUES or len(self._pending) >= _FOLD_CALLS:
            self._fold()

    def _fold(self) -> None:
        """Folds `_fused.stats_f32`'s running counts and error sums into the accumulator's own fields."""
        if self._pending:
            self._add_fused_errors(np.concatenate(self._pending))
        self._pending = []
        out, self._fused, self._fused_count = self._fused, None, 0
        if out is None:
            return
        nan, posinf, neginf, zeros, _, lo, hi, peak, index = out[STATS_SCALARS : STATS_SCALARS + 9].tolist()
        self.nan += nan
        self.posinf += posinf
        self.neginf += neginf
        self.zeros += zeros
        if peak >= 0:  # a value that is not NaN
            lo, hi, peak = np.array([lo, hi, peak], np.uint32).view(np.float32).tolist()
            self._extremes(lo + 0.0, hi + 0.0, peak, index)
        self._bins[_OFFSET - 125 : _OFFSET + 129] += out[1:255]  # float32's exponent fields 1-254
        self._bins[_OFFSET - 148 : _OFFSET - 125] += out[STATS_SUBNORMAL:STATS_SCALARS]
        self._bins[_OFFSET] += zeros + nan + posinf + neginf  # as frexp gives them, for `_exponents`
        used = np.flatnonzero(out[:255] | out[256:511] | out[512:767] | out[768:1023])  # (sums may lie apart)
        if used.size:  # a value is its significand times 2**unit, unit = max(E, 1) - 150: the sums as one integer
            least = max(int(used[0]), 1) - 150
            shifts = (np.maximum(used, 1) - (150 + least)).tolist()  # (by maps: a fold per tensor and chunk run)
            wide = out.view(np.uint64)
            sums, lows, highs = out[256 + used].tolist(), wide[512 + used].tolist(), wide[768 + used].tolist()
            total = sum(map(operator.lshift, sums, shifts))
            wide_squares = map(operator.or_, map(operator.lshift, highs, itertools.repeat(64)), lows)  # 128 bits
            squares = sum(map(operator.lshift, wide_squares, map(operator.add, shifts, shifts)))
            if total >= 0:
                self._sum.add_int(total, least)
            else:
                self._sum_neg.add_int(-total, least)
            self._squares.add_int(squares, 2 * least)
        casts = out[STATS_SCALARS + 9 :].tolist()  # (overflow, flush, subnormal) per target of CAST_NAMES
        for t in self.targets:
            i = 3 * CAST_NAMES.index(t)
            self._readiness[t] = list(map(operator.add, self._readiness[t], casts[i : i + 3]))

    def _count_nonfinite(self, w: np.ndarray, start: int) -> tuple[np.ndarray, int]:
        """Counts NaN and ±Inf and takes the extremes of the other values.

        Returns:
            The values with NaN and Inf as 0, and how many those were.
        """
        nan = np.isnan(w)
        counts = [int(np.count_nonzero(c)) for c in (nan, w == math.inf, w == -math.inf)]
        self.nan += counts[0]
        self.posinf += counts[1]
        self.neginf += counts[2]
        numbers = np.flatnonzero(~nan)
        if numbers.size:
            v = w[numbers]
            self._extremes(*_extremes_of(v, int(np.argmin(v)), int(np.argmax(v)), numbers, start))
        return np.where(np.isfinite(w), w, 0.0), sum(counts)

    def _extremes(self, lo: float | int, hi: float | int, peak: float | int, index: int) -> None:
        """Takes in a smallest and a largest value and a largest magnitude at a flat index."""
        if self._min is None:
            self._min, self._max, self._peak = lo, hi, (peak, index)
            return
        self._min, self._max = min(self._min, lo), max(self._max, hi)
        if (-peak, index) < (-self._peak[0], self._peak[1]):  # larger, or as large and earlier
            self._peak = (peak, index)

    def _add_sums(self, w: np.ndarray) -> None:
        """Adds finite values' binades and their exact sums of x and x² (see `binade_sums`)."""
        counts, sums, squares = binade_sums(w, precision(self._part))
        self._bins += counts
        for s in sums:
            used = np.flatnonzero(s)
            add_signed(self._sum, self._sum_neg, s[used], used - _OFFSET)
        for s in squares:
            used = np.flatnonzero(s)
            self._squares.add_terms(s[used], 2 * (used - _OFFSET))

    def _add_integers(self, x: np.ndarray, start: int) -> None:
        """Adds integer or bool values: extremes, zeros and exact sums as Python integers."""
        if not x.size:
            return
        self.count += x.size
        if x.dtype.kind == "b":
            x = x.view(np.uint8) != 0
        i_lo, i_hi = int(np.argmin(x)), int(np.argmax(x))
        lo, hi = int(x[i_lo]), int(x[i_hi])
        peak, index = _peak_of(lo, hi, i_lo, i_hi)
        self._extremes(lo, hi, peak, start + index)
        self.zeros += x.size - int(np.count_nonzero(x))
        if x.dtype.itemsize <= 2:  # squares below 2**32: int64 sums of fewer than 2**31 of them are exact
            wide = x.astype(np.int64)
            self._int_sum += int(np.add.reduce(wide))
            self._int_squares += int(np.dot(wide, wide))
            return
        for piece in range(0, x.size, PIECE):
            values = x[piece : piece + PIECE].tolist()
            self._int_sum += sum(values)
            self._int_squares += sum(v * v for v in values)

    # --- casts --------------------------------------------------------------------------------------

    def _add_casts(self, x: np.ndarray, finite: bool, zeros: int, errors: bool) -> None:
        """Counts what casting `x` (holding `zeros` zeros) to each target does; adds the errors where `errors`."""
        casts = []
        for t in self.targets:
            wide = cast(x, t)
            counts = cast_counts(x, wide, t, finite, zeros)
            self._readiness[t] = [a + b for a, b in zip(self._readiness[t], counts, strict=True)]
            casts.append(wide)
        if errors and self.targets:
            base, errs, over = error_sums(x, casts)
            self._add_error_sums(base, errs, over)

    def _add_block_errors(self, x: np.ndarray) -> None:
        """Adds the cast errors of a block's values (or of a shorter run: the tensor's tail)."""
        if fused_stats_ready(x.dtype):
            self._add_fused_errors(fused_stats(x, fused_stats_state(), 0))  # its errors alone
        elif self.targets:
            self._add_error_sums(*error_sums(x, [cast(x, t) for t in self.targets]))

    def _add_fused_errors(self, errors: np.ndarray) -> None:
        """Adds the error sums of `_fused.stats_f32` (nine per block: its targets are `CAST_NAMES`), each column's
        exact sum taken by `_fused.exact_columns` (a tenth of `add_columns`' time on a tensor's few hundred rows)."""
        if not self.targets:
            return
        if self.targets != CAST_NAMES:  # the columns of the targets measured, as `_add_error_sums` stacks them
            columns = np.array([CAST_NAMES.index(t) for t in self.targets], np.intp)
            errors = np.column_stack([errors[:, 0], errors[:, 1 + columns], errors[:, 5 + columns]])
        totals = [self._base, *self._errors.values(), *self._above.values()]
        for j, (total, exact) in enumerate(zip(totals, fused_exact_columns(errors), strict=True)):
            if exact is None:  # terms too far apart for 128 bits
                add_columns([total], errors[:, j : j + 1])
            else:
                total.add_int(*exact)

    def _add_error_sums(self, base: np.ndarray, errors: np.ndarray, above: np.ndarray) -> None:
        """Adds blocks' sums of x² up to 464, and per target (a column each) of (x − cast(x))² and of the x²
        of the values above 464 that it keeps (`casts.error_sums`)."""
        if not self.targets:
            return
        totals = [self._base, *(self._errors[t] for t in self.targets), *(self._above[t] for t in self.targets)]
        add_columns(totals, np.column_stack([base, errors, above]))

    def _cast_readiness(self, t: str) -> CastReadiness:
        overflow, flush, subnormal = self._readiness[t]
        base, above, error = self._base, self._above[t], self._errors[t]
        low = min(base.low, above.low)
        kept = (base.acc << (base.low - low)) + (above.acc << (above.low - low))  # their exact sum, times 2**low
        if not kept:
            rel = None
        elif not error.acc:
            rel = 0.0
        else:
            rel = ldexp(*int_root(*int_quotient(error.acc, error.low, kept, low), 2.0))
        return CastReadiness(t, overflow, flush, subnormal, rel)

    # --- results ------------------------------------------------------------------------------------

    def _exponents(self) -> tuple[tuple[tuple[int, int], ...], int]:
        """The histogram of binary exponents, and the values subnormal in the tensor's dtype."""
        if not self._floating:
            return (), 0
        bins = self._bins.copy()
        bins[_OFFSET] -= self.zeros + self.nan + self.posinf + self.neginf  # all 0 to frexp: its exponent 0
        used = bins.nonzero()[0]
        pairs = tuple(zip((used - (_OFFSET + 1)).tolist(), bins[used].tolist(), strict=True))
        smallest = smallest_exponent(self._part)
        return pairs, sum(n for e, n in pairs if e < smallest)

    def _exact_sums(self) -> tuple[int, int, int, int]:
        """Σx as (integer, exponent) and Σx² likewise: the value is integer * 2**exponent."""
        if not self._floating:
            return self._int_sum, 0, self._int_squares, 0
        return *signed(self._sum, self._sum_neg), self._squares.acc, self._squares.low

    def _mean(self) -> float | None:
        if not self.count:
            return None
        if self.nan or (self.posinf and self.neginf):
            return math.nan
        if self.posinf or self.neginf:
            return math.inf if self.posinf else -math.inf
        total, low = self._exact_sums()[:2]
        return _dyadic_over(total, low, self.count)

    def _std(self) -> float | None:
        """sqrt((nΣx² − (Σx)²) / n²), the numerator an exact integer times a power of two: correctly rounded."""
        if not self.count:
            return None
        if self.nan or self.posinf or self.neginf:
            return math.nan
        s, s_low, q, q_low = self._exact_sums()
        low = min(q_low, 2 * s_low)
        spread = (self.count * q << (q_low - low)) - (s * s << (2 * s_low - low))
        if not spread:
            return 0.0
        return ldexp(*int_root(*int_quotient(spread, low, self.count * self.count, 0), 2.0))


def tensor_stats(t: Any, casts: Any = None) -> TensorStats:
    """The exact statistics of a whole tensor (array-like): `StatsAccumulator` fed it in one chunk.

    Args:
        t: the tensor.
        casts: the cast targets; None for those narrower than its dtype (`default_casts`).
    """
    t = as_tensor(t)
    acc = StatsAccumulator(t.dtype, casts)
    acc.add(t, 0)
    return acc.result()


def binade_sums(w: np.ndarray, precision: int) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """Finite float64 values per binade, and their sums of x and of x², exact, as float64 per binade.

    Each value is f * 2**e (np.frexp: |f| in [0.5, 1)), f a multiple of 2**-precision. f is split into
    limbs of `bits` bits (`_limbs`); a binade's limbs, and the products of two limbs, are multiples of one
    unit and below 2**(2 * bits) of them, so float64 adds up to 2**(53 - 2 * bits) of them exactly (2**17
    for float64's 18-bit limbs, `PIECE` values: the most one call sees).

    Returns:
        counts: values per bin (bin e + _OFFSET; zeros fall in bin _OFFSET);
        sums: arrays whose sum is, per bin, the sum of f (Σx is Σ sums[b] * 2**e);
        squares: arrays whose sum is, per bin, the sum of f² (Σx² is Σ squares[b] * 2**(2e)).
    """
    f, e = np.frexp(w)
    key = e.astype(np.intp)
    key += _OFFSET
    counts = np.bincount(key, minlength=_BINS)
    bits, limbs = _limbs(f, precision)

    def binned(weights: np.ndarray) -> np.ndarray:
        return np.bincount(key, weights=weights, minlength=_BINS)

    # Σf: f itself holds at most 2 * bits bits (the last limb apart, for float64: 36 and 17)
    sums = [binned(f)] if precision <= 2 * bits else [binned(limbs[0] + limbs[1]), binned(limbs[2])]
    squares = []
    for i, a in enumerate(limbs):
        squares.append(binned(a * a))
        for b in limbs[i + 1 :]:
            squares.append(2.0 * binned(a * b))  # doubled once summed: doubled terms could pass 2**53 units
    return counts, sums, squares


def _limbs(f: np.ndarray, precision: int) -> tuple[int, list[np.ndarray]]:
    """f (|f| < 1, multiples of 2**-precision) as a sum of limbs of at most `bits` bits each, the first largest."""
    bits = precision if precision <= 11 else 12 if precision <= 24 else 18
    limbs, rest = [], f
    for i in range(1, -(-precision // bits)):
        scale = 2.0 ** (bits * i)
        top = np.trunc(rest * scale) / scale  # exact: scaling by powers of two, truncation, and rest − top
        limbs.append(top)
        rest = rest - top
    limbs.append(rest)
    return bits, limbs


def _extremes_of(v: np.ndarray, i_lo: int, i_hi: int, where: np.ndarray, start: int) -> tuple[float, float, float, int]:
    """A chunk's smallest and largest value (at i_lo and i_hi of `v`), its largest magnitude and that one's flat index.

    `where` gives the chunk index of each of `v`'s values (empty: v is the chunk). -0.0 is taken as 0.0,
    so that which of two equal zeros comes first does not change a bit.
    """
    lo, hi = float(v[i_lo]) + 0.0, float(v[i_hi]) + 0.0
    peak, index = _peak_of(lo, hi, i_lo, i_hi)
    return lo, hi, peak, start + (int(where[index]) if where.size else index)


def _peak_of(lo: float | int, hi: float | int, i_lo: int, i_hi: int) -> tuple[float | int, int]:
    """The largest magnitude among values whose extremes lie at indices i_lo and i_hi, with its (first) index."""
    if hi > -lo or (hi == -lo and i_hi < i_lo):
        return abs(hi), i_hi
    return abs(lo), i_lo


@functools.lru_cache(maxsize=64)
def _name(dtype: np.dtype) -> str:
    """A dtype's name (NumPy makes it in Python at each ask: 4 us, a tenth of a result's time)."""
    return dtype.name


@functools.lru_cache(maxsize=64)
def _native(dtype: np.dtype) -> np.dtype:
    """`dtype` in the machine's byte order, one object per dtype (pickled once for all of a worker's tensors)."""
    return dtype.newbyteorder("=")


def _target_name(target: Any) -> str:
    """A cast target's name, given its name or its dtype."""
    return target if isinstance(target, str) and target in TARGETS else np.dtype(target).name


def _part_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype of a complex dtype's parts; any other dtype itself."""
    return np.dtype(f"f{dtype.itemsize // 2}") if dtype.kind == "c" else dtype


def _dyadic_over(total: int, low: int, n: int) -> float:
    """total * 2**low / n, correctly rounded (Python's integer division is)."""
    return (total << low) / n if low >= 0 else total / (n << -low)
