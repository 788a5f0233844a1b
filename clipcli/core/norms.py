"""Norms of tensors streamed in chunks: the order, `NormAccumulator` and the `NormStats` it gives."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from clipcli.core.blocks import (
    BLOCK,
    PIECE,
    BlockParts,
    check_inexact,
    row_power_sums,
    segment_power_sums,
    square_sums,
    widen,
)
from clipcli.core.exact import ExactSum, ldexp, share

# The largest finite order. Its sums' exponents (p * 1075 at most) stay within int64; from there on the p-norm
# of up to 2**63 values lies within 1e-13 relative of the largest magnitude, which is `ord=inf`.
MAX_ORDER = 1e15


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


@dataclass(unsafe_hash=True)  # never changed once made; not frozen: one is made per tensor, and frozen is slower
class NormStats:
    """The p-norm of a set of values, with their largest magnitude and non-finite counts."""

    norm: float
    max_abs: float
    nan: int
    inf: int
    size: int
    # The norm as m * 2**e, also when it is too large for float64 (None for NaN/Inf data and the inf-norm).
    exact: tuple[float, int] | None = None


class NormAccumulator:
    """Streams chunks of values into a p-norm, with float64 block sums added exactly.

    Feed one tensor's values in order with `add` (any chunk sizes: the result is the same bits), then
    read `result()`. Accumulators of several tensors combine with `merge` into a global norm, again
    exactly. Values are widened exactly to float64; blocks whose powers could overflow or underflow
    float64 are rescaled by a power of two, so the norm of finite values is never inf or 0 by accident.

    Args:
        ord: the order p: 'euclidean' or 2, 1, inf, or any p > 0.
    """

    __slots__ = ("_parts", "_position", "_sum", "inf", "max_abs", "nan", "p", "size")

    @classmethod
    def whole(cls, p: float, size: int, max_abs: float, nan: int, inf: int, term: tuple[float, int]) -> NormAccumulator:
        """An accumulator that has seen a whole tensor, measured elsewhere (`small_norms`).

        Args:
            p: the order.
            size: how many values the tensor holds.
            max_abs: the largest magnitude.
            nan: the NaN values.
            inf: the infinite values.
            term: the sum of |x|**p as (s, k): s * 2**k; left out where the tensor holds NaN or Inf, and for
                the inf-norm.
        """
        acc = cls(p)
        acc.size = acc._position = size
        acc.max_abs, acc.nan, acc.inf = max_abs, nan, inf
        if not (nan or inf or math.isinf(acc.p)):
            acc._sum.add(*term)
        return acc

    def __init__(self, ord: Any = 2) -> None:
        self.p = parse_ord(ord)
        self._sum = ExactSum(self.p)
        # Values of blocks seen in part (at a chunk's edges), widened: block number -> [(offset, values)].
        self._parts = BlockParts()
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
        check_inexact(chunk, "a norm")
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
        whole = self._parts.add(start, widen(values)[1].copy())
        if whole is not None:
            self._add_block(whole)

    def _add_block(self, values: np.ndarray) -> None:
        """Adds a block's values (widened), or a shorter run: the tensor's tail."""
        with np.errstate(invalid="ignore"):
            if values.size == BLOCK:
                self._add_blocks(None, values.reshape(1, -1))
            else:  # a tensor's tail: summed as `small_norms` sums it, alone or among others
                self._add_tails(values, np.zeros(1, np.int64))

    def add_rows(self, w: np.ndarray) -> None:
        """Adds rows of values widened to float64: whole blocks, or one shorter row, a tensor's tail."""
        if w.shape[1] < BLOCK:
            self._add_tails(w.reshape(-1), np.zeros(1, np.int64))
        else:
            self._add_blocks(None, w)

    def add_sums(self, sums: np.ndarray, k: int | np.ndarray = 0) -> None:
        """Adds sums of |x|**p over blocks of finite values, `sums * 2**k` (one k, or one each), exactly.

        The values' counts (`size`, `max_abs`, `nan`, `inf`) are the caller's to add.
        """
        if isinstance(k, np.ndarray):
            self._sum.add_terms(sums, k)
        else:
            self._sum.add_many(sums, k)

    def power_sum(self) -> ExactSum:
        """The exact sum of |x|**p of every value added so far (blocks seen in part included, as tails)."""
        self._flush()
        return self._sum

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
            s, k = segment_power_sums(w, starts, m, self.p)
        for ok, peak, total, e in zip(finite.tolist(), m.tolist(), s.tolist(), k.tolist(), strict=True):
            if ok:
                self.max_abs = max(self.max_abs, peak)
                if not math.isinf(self.p):
                    self._sum.add(total, e)
        return s, k, m

    def _add_whole_blocks(self, x: np.ndarray) -> None:
        if self.p == 2.0:
            squares = square_sums(x)
            if squares is not None:
                sums, e, peak = squares
                self.max_abs = max(self.max_abs, peak)
                self._sum.add_many(sums, e)
                return
        for start in range(0, x.size, PIECE):
            narrow, wide = widen(x[start : start + PIECE])
            self._add_blocks(None if narrow is None else narrow.reshape(-1, BLOCK), wide.reshape(-1, BLOCK))

    def merge(self, other: NormAccumulator) -> None:
        """Adds the values `other` has seen, as a separate tensor."""
        other._flush()
        self._add_counts(other)

    def combine(self, other: NormAccumulator) -> None:
        """Adds the values `other` has seen of the same tensor (another worker's chunks, with their offsets)."""
        self._add_counts(other)
        for values in self._parts.merge(other._parts):
            self._add_block(values)

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
        if self._parts:
            self._flush()
        value, exact = norm_of(self._sum, self.p, self.max_abs, self.nan, self.inf)
        return NormStats(value, self.max_abs, self.nan, self.inf, self.size, exact)

    def _flush(self) -> None:
        for values in self._parts.rest():
            self._add_block(values)

    def share_of(self, whole: NormAccumulator) -> float | None:
        """The sum of |x|**p seen here over `whole`'s (which includes it): its share of whole's norm**p.

        Correctly rounded from the exact sums, so also right where the norms overflow float64. None for
        the inf-norm, NaN where whole holds NaN or Inf, 0 where whole is 0.
        """
        self._flush()
        whole._flush()
        return share(self._sum, whole._sum, self.p, whole.nan + whole.inf > 0)

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
        sums, k = row_power_sums(w, m, self.p)
        for s, e in zip(sums.tolist(), k.tolist(), strict=True):
            self._sum.add(s, e)


def norm_of(total: ExactSum, p: float, peak: float, nan: int, inf: int) -> tuple[float, tuple[float, int] | None]:
    """The p-norm of values whose |x|**p sum to `total` and whose largest magnitude is `peak`.

    NaN where a value is NaN, inf where one is infinite; never below `peak` (rounded powers could put it so).

    Returns:
        The norm, and its exact root as (m, e): m * 2**e (None for NaN or inf values, and the inf-norm).
    """
    if nan:
        return math.nan, None
    if inf:
        return math.inf, None
    if math.isinf(p):
        return peak, None
    exact = total.root(p)
    return max(ldexp(*exact), peak), exact


def given_norm_stats(use_norm: Any) -> NormStats:
    """The statistics of a global norm given rather than measured (`use_norm`): NaN or Inf counted as data's."""
    g = float(use_norm)
    return NormStats(g, math.nan, int(math.isnan(g)), int(math.isinf(g)), 0)
