"""Casts to the narrow standard floats: what round-to-nearest-even does to values, and its error per block."""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import numpy as np

from clipcli.core.blocks import BLOCK, widen


class Target(NamedTuple):
    """What rounding to a cast target needs of it: fixed numbers (a test pins them against `ml_dtypes.finfo`),
    so that a run over float32 or float16 values imports no ml_dtypes (5 ms of its start) to know them."""

    itemsize: int
    precision: int  # significant bits, the implicit one included
    smallest: int  # the exponent of its smallest normal value, 2**smallest
    max: float  # its largest finite value


# The standard narrow floats a tensor may be cast to, by name, in the order a report lists them (and
# `_fused.stats_f32` counts them).
TARGETS = {
    "float16": Target(2, 11, -14, 65504.0),
    "bfloat16": Target(2, 8, -126, float.fromhex("0x1.fep127")),
    "float8_e4m3fn": Target(1, 4, -6, 448.0),
    "float8_e5m2": Target(1, 3, -14, 57344.0),
}
CAST_NAMES = tuple(TARGETS)

# The largest magnitude that no target overflows on: above it float8_e4m3fn does (464 is a tie, rounded to
# even: 448). The error sums' norms are split there (see `error_sums`).
KEPT_BY_ALL = 464.0


def cast(x: np.ndarray, target: str) -> np.ndarray:
    """Values cast to `target` (a name of `TARGETS`) with round-to-nearest-even, as float32 (as float64 for
    float64 values).

    A float64 value is rounded once, exactly, by `_rounded` (inf beyond the target's range); ml_dtypes
    itself rounds float64 to a float8 twice, through float32, which can differ on a tie made by the first
    rounding. Other values are cast by NumPy or ml_dtypes (every one of theirs widens exactly to float32).
    """
    if x.dtype == np.float64:
        return _rounded(x, target)
    source = x if x.dtype.kind == "f" else x.astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # overflowing casts are what is counted here
        narrow = source.astype(target_dtype(target))
    return _widened(target)[narrow.view(np.uint8 if TARGETS[target].itemsize == 1 else np.uint16)]


def cast_counts(x: np.ndarray, wide: np.ndarray, target: str, finite: bool, zeros: int) -> list[int]:
    """[overflow, flush, subnormal]: what the cast `wide` (of `cast`) did to the values `x`.

    Args:
        x: the values, holding `zeros` zeros (all finite where `finite`).
        wide: their casts to `target`.
        target: the name of the dtype cast to.
        finite: whether every value of `x` is finite.
        zeros: how many values of `x` are zero.

    Returns:
        The finite values that overflow (to inf or NaN), the non-zero values that flush to zero, and the
        values that land subnormal.
    """
    overflow = x.size - int(np.count_nonzero(np.isfinite(wide)))
    if not finite:
        with np.errstate(invalid="ignore"):  # a signalling NaN is a NaN all the same
            overflow -= int(np.count_nonzero(~np.isfinite(x.astype(np.float64))))
    zero = int(np.count_nonzero(wide == 0.0))
    tiny = math.ldexp(1.0, TARGETS[target].smallest)
    return [overflow, zero - zeros, int(np.count_nonzero(np.abs(wide) < tiny)) - zero]


@functools.cache
def target_dtype(target: str) -> np.dtype:
    """The dtype a target names (ml_dtypes imported here, where a cast needs its types)."""
    if target == "float16":
        return np.dtype(np.float16)
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, target))


def error_sums(x: np.ndarray, casts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per block of `BLOCK` values (the last may be shorter), the sums behind the casts' relative errors.

    Each sum is float64, over exact terms, taken in `_fused`'s order (`lane_sums`), so that
    `_fused.stats_f32` gives the same bits. `x` starts a block.

    Args:
        x: the values (floating).
        casts: their casts to each target (`cast`).

    Returns:
        base: the sums of x² over the values of magnitude `KEPT_BY_ALL` or less;
        errors: per target (a column each), the sums of (x − cast(x))² over the finite values whose cast
            is finite (the values a cast keeps);
        above: per target, the sums of x² over the values it keeps above `KEPT_BY_ALL`.
        A target's relative error is sqrt(Σ errors / (Σ base + Σ above)): no sum cancels another.
    """
    with np.errstate(invalid="ignore"):  # a signalling NaN is a NaN all the same
        w = widen(x, None)[1].astype(np.float64, copy=False)
    in_base = np.abs(w) <= KEPT_BY_ALL  # False for NaN
    errors, above = [], []
    for c in casts:
        kept = np.isfinite(w) & np.isfinite(c)
        with np.errstate(invalid="ignore"):  # inf - inf, left out as the values that are not kept
            d = np.where(kept, w - c, 0.0)  # exact: the error of a cast is a value of the source's dtype
        errors.append(lane_sums(d * d))
        a = np.where(kept & ~in_base, w, 0.0)
        above.append(lane_sums(a * a))
    b = np.where(in_base, w, 0.0)
    columns = (len(x) + BLOCK - 1) // BLOCK, len(casts)
    return lane_sums(b * b), np.array(errors).T.reshape(columns), np.array(above).T.reshape(columns)


def lane_sums(terms: np.ndarray) -> np.ndarray:
    """The sum of each block of non-negative float64 terms in `_fused`'s order (see clipcli/_fused.c).

    Lane j adds the terms j, j + 8, ... in turn (NumPy adds the rows of a (rows, 8) array in order:
    it does not sum pairwise across rows); then the lanes are added as ((l0 + l1) + (l2 + l3)) +
    ((l4 + l5) + (l6 + l7)). A short last block is padded with zeros, which add nothing to such sums.
    """
    blocks = (terms.size + BLOCK - 1) // BLOCK
    padded = np.zeros(blocks * BLOCK)
    padded[: terms.size] = terms
    lanes = np.add.reduce(padded.reshape(blocks, BLOCK // 8, 8), axis=1)
    return ((lanes[:, 0] + lanes[:, 1]) + (lanes[:, 2] + lanes[:, 3])) + (
        (lanes[:, 4] + lanes[:, 5]) + (lanes[:, 6] + lanes[:, 7])
    )


@functools.lru_cache(maxsize=64)
def precision(dtype: np.dtype) -> int:
    """The significant bits of a floating dtype's values (the implicit bit included)."""
    return int(_finfo(dtype).nmant) + 1


@functools.lru_cache(maxsize=64)
def smallest_exponent(dtype: np.dtype) -> int:
    """The exponent of a floating dtype's smallest normal value: below 2**that, its values are subnormal."""
    return math.frexp(float(_finfo(dtype).smallest_normal))[1] - 1


def _finfo(dtype: np.dtype) -> Any:
    """NumPy's `finfo` of its own floating types, ml_dtypes' of the others (of a tensor of which it is imported)."""
    if dtype.num < 256:  # NPY_USERDEF: NumPy's own type
        return np.finfo(dtype)
    import ml_dtypes

    return ml_dtypes.finfo(dtype)


def _rounded(w: np.ndarray, target: str) -> np.ndarray:
    """float64 values rounded to nearest even in `target` (inf beyond its largest finite value), exactly.

    Each value is scaled by a power of two so that its last place in `target` (that of the binade, or of
    the subnormals) becomes 1, rounded to an integer by np.rint (to even on ties) and scaled back.
    """
    info = TARGETS[target]
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and Inf stay NaN and Inf
        shift = np.maximum(np.frexp(w)[1] - 1, info.smallest) - (info.precision - 1)
        r = np.ldexp(np.rint(np.ldexp(w, -shift)), shift)
        return np.where(np.abs(r) > info.max, np.copysign(np.inf, w), r)


_tables: dict[str, np.ndarray] = {}


def _widened(target: str) -> np.ndarray:
    """Every value of an 8- or 16-bit float as float32, indexed by its bits: a faster widening than a cast."""
    table = _tables.get(target)
    if table is None:
        dtype = target_dtype(target)
        bits = np.arange(1 << (8 * dtype.itemsize), dtype=np.uint8 if dtype.itemsize == 1 else np.uint16)
        table = _tables[target] = bits.view(dtype).astype(np.float32)
    return table
