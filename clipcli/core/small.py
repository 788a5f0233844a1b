"""The norms and differences of many small tensors, measured together in a few NumPy passes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from clipcli.core.blocks import BLOCK, PIECE, segment_power_sums, widen
from clipcli.core.exact import ExactSum, cosine_of, int_quotient, int_root, int_term, ldexp, share, sqrt_quotients
from clipcli.core.norms import NormAccumulator, parse_ord

if TYPE_CHECKING:  # (the differences are imported where pairs are measured: a run of norms needs none)
    from clipcli.core.differences import DiffAccumulator, DiffFigures


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
        """What adding tensor i to a `NormAccumulator` of its own gives."""
        counts = float(self.max_abs[i]), int(self.nan[i]), int(self.inf[i])
        return NormAccumulator.whole(self.p, int(self.size[i]), *counts, (float(self.sums[i]), int(self.exps[i])))

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
        total = whole.power_sum()
        if not total.acc:
            return [0.0] * len(self)
        m, e = total.root(1.0)  # the whole sum as float(top) * 2**e
        with np.errstate(under="ignore"):
            return np.ldexp(self.sums / m, self.exps - e).tolist()

    def merge_into(self, total: NormAccumulator) -> None:
        """`total.merge(self.accumulator(i))` for every tensor."""
        if total.p != self.p:
            raise ValueError("cannot merge norms of different orders")
        finite = (self.nan == 0) & (self.inf == 0)
        if not math.isinf(self.p):
            total.add_sums(self.sums[finite], self.exps[finite])
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
    ends = np.cumsum(lengths)
    present_ends, flat, unsure = ends[present], x.reshape(-1), []
    # In pieces of whole tensors of at most PIECE values (or one), whose float64 values stay in the core's cache:
    # a segment's figures do not depend on its neighbours, so the same bits as all at once.
    first = 0
    while first < present.size:
        i = present[first]
        lo = ends[i] - lengths[i]
        last = max(first + 1, int(np.searchsorted(present_ends, lo + PIECE, "right")))
        ids = present[first:last]
        starts = ends[ids] - lengths[ids] - lo
        # Signalling NaNs are counted as NaN all the same; the sums of segments holding NaN or Inf (which may
        # overflow) are not used.
        with np.errstate(invalid="ignore", over="ignore"):
            w = widen(flat[lo : ends[ids[-1]]])[1]
            m = np.maximum.reduceat(np.abs(w), starts)
            finite = np.isfinite(m)
            sums[ids], exps[ids] = segment_power_sums(w, starts, np.where(finite, m, 1.0), p)
        max_abs[ids] = m
        unsure += ids[~finite].tolist()
        first = last
    for i in unsure:  # NaN or Inf: counted one by one (rare)
        acc = NormAccumulator(p)
        a = int(np.sum(lengths[:i]))
        with np.errstate(invalid="ignore"):
            acc.add_rows(widen(flat[a : a + lengths[i]])[1].reshape(1, -1))
        max_abs[i], nan[i], inf[i] = acc.max_abs, acc.nan, acc.inf
    return SmallNorms(p, lengths, max_abs, nan, inf, sums, exps)


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
        from clipcli.core.differences import DiffAccumulator

        if j in self.general:
            return self.general[j]
        sides = tuple(side.accumulator(j) for side in self._sides())
        diff = float(self.diff[j]), int(self.diff_exps[j])
        counts = float(self.max_abs_diff[j]), int(self.changed[j]), int(self.a.size[j])
        return DiffAccumulator.of_pair(self.p, sides, diff, (self.dot[j : j + 1], self.dot_exps[j : j + 1]), counts)

    def _sides(self) -> tuple[SmallNorms, ...]:
        """As `DiffAccumulator.sides`: A's and B's p-norms and, for p other than 2, their 2-norms."""
        return (self.a, self.b) if self.p == 2.0 else (self.a, self.b, self.a2, self.b2)

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
            sure, roots = sqrt_quotients(self.diff[todo], one, self.a.sums[todo], one)
            scale = (self.diff_exps[todo] - self.a.exps[todo]) // 2  # both even
            roots = np.ldexp(roots, scale)
            sure &= (roots > 2.0**-1000) & (roots < 2.0**1000)  # no subnormal, no overflow on the way
            for j, value in zip(todo[sure].tolist(), roots[sure].tolist(), strict=True):
                rel[j] = value
            todo = todo[~sure]
        for j in todo.tolist():
            num, den = int_term(float(self.diff[j]), int(self.diff_exps[j])), int_term(*self.a.term(j))
            rel[j] = ldexp(*int_root(*int_quotient(*num, *den), p))
        # cosine: None where a 2-norm is 0, 1 where Σab = Σa² = Σb² (equal terms: a pair of the same values)
        both = (self.a2.sums != 0.0) & (self.b2.sums != 0.0)
        parallel = (self.dot == self.a2.sums) & (self.dot_exps == self.a2.exps)
        parallel &= (self.a2.sums == self.b2.sums) & (self.a2.exps == self.b2.exps)
        cosine: list[float | None] = [1.0 if x else None for x in both.tolist()]
        todo = np.flatnonzero(both & ~parallel)
        dot = self.dot[todo]
        # (Σab)² / (Σa² Σb²) with exponents 2 kd - ka - kb, which the scales of `product_scales` make 0
        even = 2 * self.dot_exps[todo] == self.a2.exps[todo] + self.b2.exps[todo]
        sure, roots = sqrt_quotients(dot, dot, self.a2.sums[todo], self.b2.sums[todo])
        sure &= even
        for j, value, negative in zip(todo[sure].tolist(), roots[sure].tolist(), (dot[sure] < 0).tolist(), strict=True):
            cosine[j] = -min(value, 1.0) if negative else min(value, 1.0)
        for j in todo[~sure].tolist():
            dot_term = int_term(float(self.dot[j]), int(self.dot_exps[j]))
            cosine[j] = cosine_of(*dot_term, *int_term(*self.a2.term(j)), *int_term(*self.b2.term(j)))
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
        for small, side in zip(self._sides(), total.sides(), strict=True):
            small.merge_into(side)
        counts = float(self.max_abs_diff.max(initial=0.0)), int(self.changed.sum()), int(self.a.size.sum())
        total.add_terms((self.diff, self.diff_exps), (self.dot, self.dot_exps), counts)
        for acc in self.general.values():
            total.merge(acc)

    def shares_of(self, whole: DiffAccumulator) -> list[float | None]:
        """Each pair's `accumulator(j).share_of(whole)`: correctly rounded, one by one where not 0."""
        if math.isinf(self.p) or whole.nan_diff + whole.inf_diff:
            return [None if math.isinf(self.p) else math.nan] * len(self)
        total = whole.diff_sum()
        if not total.acc:
            return [0.0] * len(self)
        return [
            self.general[j].share_of(whole)
            if j in self.general
            else share(ExactSum.of(*int_term(s, k)), total, self.p, False)
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
    # In pieces of whole pairs of at most PIECE values a side (or one), whose float64 values stay in the core's
    # cache: a pair's figures do not depend on its neighbours, so the same bits as all at once.
    ends = np.cumsum(lengths)
    pieces, first = [], 0
    while first < lengths.size:
        lo = ends[first] - lengths[first]
        last = max(first + 1, int(np.searchsorted(ends, lo + PIECE, "right")))
        pieces.append(
            _piece_diffs(a.reshape(-1)[lo : ends[last - 1]], b.reshape(-1)[lo : ends[last - 1]], lengths[first:last], p)
        )
        first = last
    if len(pieces) == 1:
        return pieces[0]
    return _joined(pieces)


def _joined(pieces: list[SmallDiffs]) -> SmallDiffs:
    """The SmallDiffs of pairs measured in pieces, one after another."""

    def norms(side: str) -> SmallNorms:
        parts = [getattr(s, side) for s in pieces]
        fields = ("size", "max_abs", "nan", "inf", "sums", "exps")
        return SmallNorms(parts[0].p, *(np.concatenate([getattr(n, f) for n in parts]) for f in fields))

    p = pieces[0].p
    a, b = norms("a"), norms("b")
    a2, b2 = (a, b) if p == 2.0 else (norms("a2"), norms("b2"))
    fields = ("diff", "diff_exps", "dot", "dot_exps", "max_abs_diff", "changed")
    arrays = (np.concatenate([getattr(s, f) for s in pieces]) for f in fields)
    general, offset = {}, 0
    for s in pieces:
        general.update((j + offset, acc) for j, acc in s.general.items())
        offset += len(s)
    return SmallDiffs(p, a, b, a2, b2, *arrays, general)


def _piece_diffs(a: np.ndarray, b: np.ndarray, lengths: np.ndarray, p: float) -> SmallDiffs:
    """`small_diffs` of one piece."""
    from clipcli.core.differences import DiffAccumulator, product_scales

    starts = np.cumsum(lengths) - lengths
    # Signalling NaNs are NaN all the same; pairs holding NaN or inf, or whose differences overflow (float64
    # values), take the general path: their sums here are not used.
    with np.errstate(invalid="ignore", over="ignore"):
        wa, wb = widen(a.reshape(-1))[1], widen(b.reshape(-1), "b")[1]
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
        return SmallNorms(q, lengths, m, zeros, zeros, *segment_power_sums(w, starts, m, q))

    sa, sb = side(wa, ma, p), side(wb, mb, p)
    sa2, sb2 = (sa, sb) if p == 2.0 else (side(wa, ma, 2.0), side(wb, mb, 2.0))
    ea, eb = product_scales(ma, mb)  # as `_add_dots` scales a tail
    if ea.any() or eb.any():
        counts = np.diff(np.append(starts, wa.size))
        wa, wb = np.ldexp(wa, -np.repeat(ea, counts)), np.ldexp(wb, -np.repeat(eb, counts))
    dots = np.add.reduceat(wa * wb, starts)
    if math.isinf(p):
        ds, dk = np.zeros(lengths.size), zeros
    else:
        ds, dk = segment_power_sums(d, starts, md, p)
    changed = np.add.reduceat(d != 0, starts, dtype=np.int64)
    general = {}
    for j in np.flatnonzero(~plain).tolist():  # last: an accumulator's passes reuse the scratch buffers above
        general[j] = DiffAccumulator(p)
        general[j].add(a.reshape(-1)[starts[j] : ends[j]], b.reshape(-1)[starts[j] : ends[j]])
    return SmallDiffs(p, sa, sb, sa2, sb2, ds, dk, dots, ea + eb, md, changed, general)
