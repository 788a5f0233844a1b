"""The diff core (DiffAccumulator, diff) against exact references: fractions, fsum and Python integers."""

from __future__ import annotations

import itertools
import math
from decimal import Decimal, getcontext
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import clipcli
from clipcli import core
from clipcli.core import DiffStats, diff
from clipcli.core import small as core_small
from clipcli.core.blocks import BLOCK, is_floating
from clipcli.core.differences import DiffAccumulator
from clipcli.core.exact import int_quotient, int_root, int_term, ldexp, sqrt_quotients
from clipcli.core.norms import NormAccumulator
from clipcli.core.small import small_diffs

F32, F64, BF16, F16 = np.float32, np.float64, ml_dtypes.bfloat16, np.float16


SCALE = 1074  # every float64 value times 2**1074 is an integer


def exact(x) -> list[int]:
    """The values of an array times 2**SCALE, as exact Python integers (floats through float64, which is exact)."""
    x = np.asarray(x).ravel()
    if x.dtype.kind in "iub":
        return [int(v) << SCALE for v in x.tolist()]
    out = []
    for v in x.astype(F64).tolist():
        n, d = v.as_integer_ratio()
        out.append(n << (SCALE - d.bit_length() + 1))
    return out


def root(total: Fraction, p: float) -> float:
    """total ** (1/p) for p = 1, 2 correctly rounded (60 digits, then one rounding); otherwise in float64."""
    if p == 1:
        return to_float(total)
    if p == 2:
        getcontext().prec = 60
        return float((Decimal(total.numerator) / Decimal(total.denominator)).sqrt())
    return float(total) ** (1 / p)


def to_float(x: Fraction) -> float:
    """x correctly rounded to float64, +-inf beyond its range."""
    try:
        return float(x)
    except OverflowError:
        return -math.inf if x < 0 else math.inf


def reference(a, b, p=2) -> dict:
    """Every figure of DiffStats from exact integer arithmetic on finite values."""
    xa, xb = exact(a), exact(b)
    d = [x - y for x, y in zip(xa, xb, strict=True)]
    one, two = Fraction(1, 1 << SCALE), Fraction(1, 1 << (2 * SCALE))
    dot, aa, bb = (sum(x * y for x, y in zip(u, v, strict=True)) * two for u, v in ((xa, xb), (xa, xa), (xb, xb)))
    if math.isinf(p):
        norms = [to_float(max(map(abs, vs), default=0) * one) for vs in (d, xa, xb)]
    else:
        norms = [root(sum(abs(v) ** p for v in vs) * one**p, p) for vs in (d, xa, xb)]
    getcontext().prec = 60
    cosine = None
    if aa and bb:
        dec = [Decimal(v.numerator) / Decimal(v.denominator) for v in (dot, aa, bb)]
        cosine = float(dec[0] / (dec[1] * dec[2]).sqrt())
    return {
        "diff_norm": norms[0],
        "norm_a": norms[1],
        "norm_b": norms[2],
        "dot": to_float(dot),
        "abs_dot": to_float(sum(abs(x * y) for x, y in zip(xa, xb, strict=True)) * two),
        "cosine": cosine,
        "max_abs_diff": to_float(max(map(abs, d), default=0) * one),
        "changed": sum(v != 0 for v in d),
    }


def bits(s: DiffStats) -> str:
    """The statistics down to the last bit (repr round-trips floats, tells -0.0 and NaN apart)."""
    return repr(s)


def accumulate(pairs, ord=2) -> DiffStats:
    acc = DiffAccumulator(ord)
    for a, b in pairs:
        acc.add(a, b)
    return acc.result()


def assert_matches(s: DiffStats, ref: dict, rtol=1e-12) -> None:
    """Norms right to 1e-12 relative (block sums of up to 8192 terms round), the cosine to 1e-12 absolute."""
    for name in ("diff_norm", "norm_a", "norm_b"):
        assert getattr(s, name) == pytest.approx(ref[name], rel=rtol, abs=0), name
    assert s.dot == ref["dot"] or abs(s.dot - ref["dot"]) <= 1e-12 * ref["abs_dot"]  # inf beyond float64
    if ref["cosine"] is None:
        assert s.cosine is None
    else:
        assert abs(s.cosine - ref["cosine"]) <= 1e-12
    assert s.max_abs_diff == ref["max_abs_diff"]
    assert s.changed == ref["changed"]


# --- Worked cases --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, F64, BF16, np.float16, ml_dtypes.float8_e4m3fn, np.int32, np.bool_])
def test_identical_tensors(dtype):
    a = (np.random.default_rng(0).standard_normal(3 * BLOCK + 5) * 4).astype(dtype)
    for s in (diff(a, a.copy()), accumulate([(a, a)])):
        assert (s.diff_norm, s.changed, s.max_abs_diff, s.rel, s.cosine) == (0.0, 0, 0.0, 0.0, 1.0)
        assert s.norm_a == s.norm_b == s.norm2_a and s.dot == pytest.approx(s.norm_a**2, rel=1e-15)
    same = DiffAccumulator()
    same.add_identical(a)
    assert bits(same.result()) == bits(diff(a, a))


@pytest.mark.parametrize("dtype", [F32, F64])
def test_one_element_one_ulp_apart(dtype):
    a = np.random.default_rng(1).standard_normal(20_000).astype(dtype)
    b = a.copy()
    b[12_345] = np.nextafter(a[12_345], dtype(np.inf))
    ulp = float(b[12_345]) - float(a[12_345])  # exact: neighbours
    s = diff(a, b)
    assert (s.diff_norm, s.max_abs_diff, s.changed) == (ulp, ulp, 1)
    assert s.rel == float(Fraction(ulp) / Fraction(s.norm_a)) or s.rel == pytest.approx(ulp / s.norm_a, rel=1e-15)
    assert diff(a, b, ord=1).diff_norm == diff(a, b, ord=np.inf).diff_norm == ulp
    assert diff(a, b, ord=0.5).diff_norm == pytest.approx(ulp, rel=1e-15)  # (x**0.5)**2: within a few ulps


def test_float32_against_its_bfloat16_rounding():
    a = np.random.default_rng(2).standard_normal(5_000) * np.exp(np.random.default_rng(3).uniform(-5, 5, 5_000))
    a = a.astype(F32)
    a[:100] = a[:100].astype(BF16)  # values that bfloat16 holds: unchanged
    b = a.astype(BF16)
    s = diff(a, b)
    ref = reference(a, b)
    assert_matches(s, ref)
    assert s.rel == pytest.approx(ref["diff_norm"] / ref["norm_a"], rel=1e-12)
    assert s.changed == a.size - 100


def test_float32_against_bfloat16_at_a_million_values_with_fsum():
    # a − bfloat16(a) has at most 17 significant bits: its square is exact in float64 and fsum is exact
    a = np.random.default_rng(4).standard_normal(10**6).astype(F32)
    d = a.astype(F64) - a.astype(BF16).astype(F64)
    assert np.all(np.ldexp(np.frexp(d)[0], 17) % 1 == 0)
    s = diff(a, a.astype(BF16))
    assert s.diff_norm == pytest.approx(math.sqrt(math.fsum((d * d).tolist())), rel=1e-12)
    wa, wb = a.astype(F64), a.astype(BF16).astype(F64)  # products of float32 values are exact in float64
    exact_cosine = math.fsum((wa * wb).tolist()) / math.sqrt(
        math.fsum((wa * wa).tolist()) * math.fsum((wb * wb).tolist())
    )
    assert abs(s.cosine - exact_cosine) <= 1e-12
    assert s.max_abs_diff == float(np.abs(d).max())


def nearly_parallel(scale: float) -> tuple[np.ndarray, np.ndarray]:
    """b = scale * (a + e), e orthogonal to a with |e| = 1e-5 |a|: cosine 1 / sqrt(1 + 1e-10) ~ 1 - 5e-11."""
    rng = np.random.default_rng(5)
    a, e = rng.standard_normal(10_000), rng.standard_normal(10_000)
    e -= a * (e @ a) / (a @ a)
    e *= 1e-5 * np.linalg.norm(a) / np.linalg.norm(e)
    return a, scale * (a + e)


@pytest.mark.parametrize("scale", [1.0, 1e-6])
def test_nearly_parallel_tensors_cosine_right_to_1e12(scale):
    a, b = nearly_parallel(scale)
    s, ref = diff(a, b), reference(a, b)
    assert 1e-11 < 1 - ref["cosine"] < 1e-10
    assert abs(s.cosine - ref["cosine"]) <= 1e-12
    assert_matches(s, ref)


def test_the_norm_identity_would_lose_the_cosine():
    # (‖A‖² + ‖B‖² − ‖A−B‖²) / (2‖A‖‖B‖), even from these correctly rounded norms, cancels: its error is
    # about 1e-16 * ‖A‖/‖B‖, here 1e-10. The dot product does not cancel.
    a, b = nearly_parallel(1e-6)
    s, ref = diff(a, b), reference(a, b)
    identity = (s.norm_a**2 + s.norm_b**2 - s.diff_norm**2) / (2 * s.norm_a * s.norm_b)
    assert abs(identity - ref["cosine"]) > 1e-12
    assert abs(s.cosine - ref["cosine"]) <= 1e-15


def test_zero_tensors():
    z, x = np.zeros(10, F32), np.arange(10, dtype=F32)
    s = diff(z, x)
    assert (s.rel, s.cosine, s.norm_a, s.diff_norm) == (None, None, 0.0, s.norm_b)
    s = diff(x, z)
    assert (s.rel, s.cosine, s.diff_norm) == (1.0, None, s.norm_a)
    s = diff(z, z)
    assert (s.rel, s.cosine, s.diff_norm, s.changed, s.dot) == (None, None, 0.0, 0, 0.0)


def test_negative_zero_equals_zero():
    a = np.array([-0.0, 0.0, -0.0, 1.0], F32)
    b = np.array([0.0, -0.0, -0.0, 1.0], F64)
    s = diff(a, b)
    assert (s.changed, s.diff_norm, s.max_abs_diff) == (0, 0.0, 0.0)
    assert math.copysign(1, s.max_abs_diff) == 1 and math.copysign(1, s.diff_norm) == 1


NAN, INF = math.nan, math.inf


@pytest.mark.parametrize(
    ("a", "b", "diff_norm", "max_abs_diff", "changed"),
    [
        ([NAN, 1.0, 2.0], [NAN, 1.0, 2.0], 0.0, 0.0, 0),  # NaN equals NaN
        ([INF, -INF, 2.0], [INF, -INF, 2.0], 0.0, 0.0, 0),  # the same inf
        ([NAN, INF, 2.0], [NAN, INF, 5.0], 3.0, 3.0, 1),  # equal non-finite values add nothing
        ([NAN, 1.0, 2.0], [1.0, 1.0, 2.0], NAN, NAN, 1),  # NaN against a number
        ([NAN, 1.0, 2.0], [1.0, NAN, 2.0], NAN, NAN, 2),  # NaNs at different places
        ([INF, 1.0, 2.0], [1.0, 1.0, 2.0], INF, INF, 1),
        ([INF, 1.0, 2.0], [-INF, 1.0, 2.0], INF, INF, 1),
        ([INF, 1.0, 2.0], [NAN, 1.0, 2.0], NAN, NAN, 1),
        ([1.0, 1.0, 2.0], [1.0, INF, 2.0], INF, INF, 1),
    ],
)
@pytest.mark.parametrize("dtype", [F32, F64, BF16, np.float16])
def test_nan_and_inf(a, b, diff_norm, max_abs_diff, changed, dtype):
    a, b = np.array(a, dtype), np.array(b, dtype)
    s = diff(a, b)
    assert bits(s.diff_norm) == bits(diff_norm) and bits(s.max_abs_diff) == bits(max_abs_diff)
    assert s.changed == changed
    assert math.isnan(s.cosine) and math.isnan(s.dot)  # a side holds NaN or inf
    assert (s.nan_a, s.inf_a, s.nan_b, s.inf_b) == tuple(
        int(f(x.astype(F64)).sum()) for x in (a, b) for f in (np.isnan, np.isinf)
    )
    # rel is ‖A−B‖ / ‖A‖ (issue 22 item 22: not 0 where nothing changed but A holds NaN)
    rel = s.diff_norm / s.norm_a
    assert s.rel == rel or (math.isnan(s.rel) and math.isnan(rel))


def test_nan_and_inf_in_the_fast_path_take_the_general_one():
    a = np.random.default_rng(6).standard_normal(5 * BLOCK).astype(F32)
    b = a + F32(0.5)
    a[3], b[3] = np.nan, np.nan  # equal: no difference
    a[BLOCK + 7] = b[BLOCK + 7] = np.inf
    s = diff(a, b)
    finite = np.isfinite(a)
    d = a[finite].astype(np.float64) - b[finite]  # exact: float32 values' differences
    # The blocks of the finite values alone lie elsewhere, so their float64 sums may differ in the last bit.
    assert s.diff_norm == pytest.approx(math.sqrt(math.fsum(d * d)), rel=1e-15)
    assert (s.max_abs_diff, s.changed) == (np.abs(d).max(), np.count_nonzero(d))
    assert (s.nan_a, s.inf_a, s.nan_b, s.inf_b) == (1, 1, 1, 1) and math.isnan(s.norm_a)


@pytest.mark.parametrize("scale", [1e200, 1e-200, 1e300, 1e-300])
def test_float64_extremes_give_their_true_figures(scale):
    rng = np.random.default_rng(7)
    a = rng.standard_normal(3_000) * scale
    b = a * (1 + rng.standard_normal(3_000) * 1e-3)
    s, ref = diff(a, b), reference(a, b)
    assert_matches(s, ref)
    assert s.rel == pytest.approx(ref["diff_norm"] / ref["norm_a"], rel=1e-12)


def test_float32_extremes():
    a = np.array([1e30, -3e38, 1e-45, 2e-38], F32)
    b = np.array([-1e30, 3e38, 0.0, 1e-38], F32)
    assert_matches(diff(a, b), reference(a, b))


def test_differences_beyond_float64_are_inf_but_rel_is_exact():
    a, b = np.array([1e308, -1e308, 1.0]), np.array([-1e308, 1e308, 1.0])
    s = diff(a, b)
    assert (s.diff_norm, s.max_abs_diff, s.changed, s.cosine) == (INF, INF, 2, -1.0)
    assert s.rel == 2.0 and s.norm_a == math.sqrt(2) * 1e308
    assert diff(a, b, ord=1).rel == 2.0


@pytest.mark.parametrize(
    ("da", "db"),
    [
        (F32, F64),
        (BF16, np.float16),
        (ml_dtypes.float8_e4m3fn, F32),
        (ml_dtypes.float8_e5m2, BF16),
        (np.int32, F32),
        (np.int8, np.uint16),
        (np.bool_, F32),
    ],
)
def test_mixed_dtypes_compare_by_value(da, db):
    rng = np.random.default_rng(8)
    a = (rng.standard_normal(BLOCK + 300) * 8).astype(da)
    b = (a.astype(F64) + rng.integers(-1, 2, a.size) * 0.25).astype(db)
    for p in (2, 1, np.inf):
        assert_matches(diff(a, b, ord=p), reference(a, b, p))


def test_integer_tensors_differ_exactly():
    a = np.array([2**62 + 1, -(2**63), 7, 2**53 + 1], np.int64)
    b = np.array([2**62, 2**63 - 1, 7, 2**53], np.int64)
    s = diff(a, b)
    assert (s.changed, s.max_abs_diff) == (3, float(2**64 - 1))
    assert s.diff_norm == root(Fraction(1 + (2**64 - 1) ** 2 + 1), 2)
    u = np.array([2**64 - 1, 0, 5], np.uint64)
    s = diff(u, np.array([-1, 0, 5], np.int64))
    assert (s.changed, s.max_abs_diff, s.diff_norm) == (1, float(2**64), float(2**64))
    s = diff(np.array([True, False, True]), np.array([True, True, False]))
    assert (s.changed, s.diff_norm, s.max_abs_diff, s.cosine) == (2, math.sqrt(2), 1.0, 0.5)


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 0, 2)])
def test_empty_tensors(shape):
    s = diff(np.zeros(shape, F32), np.zeros(shape, BF16))
    assert s == DiffStats(0.0, 0.0, 0.0, None, None, 0.0, 0.0, 0.0, 0.0, 0, 0, 0, 0, 0, 0)


@pytest.mark.parametrize("p", [1, 2, 3, 0.5, np.inf])
def test_any_order_against_fractions(p):
    rng = np.random.default_rng(9)
    a = (rng.standard_normal(2 * BLOCK + 77) * np.exp(rng.uniform(-10, 10, 2 * BLOCK + 77))).astype(F32)
    b = (a * (1 + rng.standard_normal(a.size).astype(F32) * F32(0.01))).astype(F32)
    s = diff(a, b, ord=p)
    if p == 0.5:  # irrational terms: fsum of correctly rounded square roots
        d = np.abs(a.astype(F64) - b.astype(F64))
        ref = {k: math.fsum(np.sqrt(x).tolist()) ** 2 for k, x in (("diff_norm", d), ("norm_a", np.abs(a.astype(F64))))}
        assert s.diff_norm == pytest.approx(ref["diff_norm"], rel=1e-13)
        assert s.norm_a == pytest.approx(ref["norm_a"], rel=1e-13)
        return
    ref = reference(a, b, p)
    assert_matches(s, ref, rtol=1e-12 if p in (1, 2, np.inf) else 1e-13)
    assert s.rel == pytest.approx(ref["diff_norm"] / ref["norm_a"], rel=1e-12)
    assert (s.norm2_a, s.norm2_b) == (diff(a, b).norm_a, diff(a, b).norm_b)  # the cosine's norms whatever p is


@pytest.mark.parametrize("p", [1, 2, 3, 0.5, np.inf])
@pytest.mark.parametrize("dtype", [F32, F64, BF16, np.float16, ml_dtypes.float8_e5m2])
def test_norms_are_the_norm_accumulators_bits(p, dtype):
    rng = np.random.default_rng(10)
    a = (rng.standard_normal(2 * BLOCK + 9) * 3).astype(dtype)
    b = (rng.standard_normal(2 * BLOCK + 9) * 3).astype(dtype)
    a[5] = np.nan
    s = diff(a, b, ord=p)
    for side, x in ((s.norm_a, a), (s.norm_b, b)):
        acc = NormAccumulator(p)
        acc.add(x)
        assert bits(side) == bits(acc.result().norm)


def test_fast_and_general_paths_agree_bit_for_bit():
    # chunks of 1000 send every block through the general path (the block in progress); one chunk takes the
    # fast path for whole blocks
    rng = np.random.default_rng(11)
    for da, db in [(F32, F32), (BF16, BF16), (np.float16, np.float16), (F32, BF16), (np.int16, np.int16)]:
        a = (rng.standard_normal(3 * BLOCK + 100) * 100).astype(da)
        b = (a.astype(F64) + rng.standard_normal(a.size)).astype(db)
        one = accumulate([(a, b)])
        pieces = accumulate([(a[i : i + 1000], b[i : i + 1000]) for i in range(0, a.size, 1000)])
        assert bits(one) == bits(pieces), (da, db)


def test_inputs_are_not_mutated_and_may_be_read_only():
    a = np.frombuffer(np.array([np.nan, np.inf, 1.0, 2.0], F64).tobytes(), F64)
    b = np.frombuffer(np.array([np.nan, np.inf, 3.0, 2.0], F64).tobytes(), F64)
    s = diff(a, b)
    assert s.diff_norm == 2.0
    assert np.isnan(a[0]) and a[1] == np.inf and b[2] == 3.0


def test_signalling_nans_without_warnings():
    a = np.arange(8, dtype=F32)
    a.view(np.uint32)[3] = 0xFFA00000
    s = diff(a, a.copy())
    assert (s.diff_norm, s.nan_a, s.changed) == (0.0, 1, 0)


# --- The API ---------------------------------------------------------------------------------------


def test_diff_checks_shapes_and_types():
    with pytest.raises(ValueError, match="shapes"):
        diff(np.zeros((2, 3)), np.zeros((3, 2)))
    with pytest.raises(TypeError):
        diff(np.array([1, None], object), np.array([1, 2], object))
    with pytest.raises(TypeError, match="complex"):
        diff(np.zeros(2, np.complex64), np.zeros(2, np.complex64))
    with pytest.raises(TypeError):
        diff(np.array(["a"]), np.array(["b"]))
    with pytest.raises(ValueError):
        diff([1.0], [2.0], ord=0)
    assert diff([[1.0, 2.0]], [[1.0, 4.0]]).diff_norm == 2.0  # array-likes
    assert diff(np.float32(3), np.float32(5)).diff_norm == 2.0  # 0-d


def test_accumulator_checks_its_arguments():
    acc = DiffAccumulator()
    with pytest.raises(ValueError, match="equal size"):
        acc.add(np.zeros(3), np.zeros(4))
    with pytest.raises(ValueError, match="orders"):
        acc.merge(DiffAccumulator(1))
    with pytest.raises(TypeError):
        acc.add_identical(np.zeros(2, np.complex128))


def test_public_api_is_exported():
    assert clipcli.diff is core.diff
    assert {"diff", "DiffStats"} <= set(core.__all__)


# --- Hypothesis properties ---------------------------------------------------------------------------

PAIRS = [
    (F32, F32),
    (BF16, BF16),
    (np.float16, np.float16),
    (F64, F64),
    (F32, BF16),
    (np.float16, BF16),
    (F64, F32),
    (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fn),
    (np.int32, np.int32),
    (np.int64, np.uint64),
]


def make_pair(seed: int, size: int, da, db, specials: bool) -> tuple[np.ndarray, np.ndarray]:
    """A and B: random values of many magnitudes, B equal to A over long runs (identical chunks happen)."""
    rng = np.random.default_rng(seed)
    if is_floating(da):
        a = (rng.standard_normal(size) * np.exp(rng.uniform(-8, 8, size))).astype(da)
        if specials and size:
            at = rng.integers(0, size, max(size // 500, 1))
            a[at] = rng.choice([np.nan, np.inf, -np.inf, -0.0], at.size)
    else:
        a = rng.integers(np.iinfo(da).min, np.iinfo(da).max, size, dtype=da, endpoint=True)
    b = a.astype(db)
    changed = rng.random(size) < rng.choice([0.0, 0.01, 0.5])
    if is_floating(db):
        b[changed] = (b[changed].astype(F64) * (1 + rng.standard_normal(int(changed.sum())) * 1e-3)).astype(db)
        run = -2  # a long run of B set apart from A
    else:
        b[changed] ^= 1
        run = -1
    if size and rng.random() < 0.3:
        start = int(rng.integers(0, size))
        b[start : start + BLOCK] = (
            b[start : start + BLOCK] * np.array(run, b.dtype) if run == -2 else ~b[start : start + BLOCK]
        )
    return a, b


pairs = st.sampled_from(PAIRS)
orders = st.sampled_from([2, 2, 1, 3, 0.5, np.inf, 1e9])


@example(seed=0, size=BLOCK + 1, pair=(F32, F32), specials=False, p=2, cuts=[BLOCK], identical=True)
@given(
    seed=st.integers(0, 2**32 - 1),
    size=st.integers(0, 3 * BLOCK + 50),
    pair=pairs,
    specials=st.booleans(),
    p=orders,
    cuts=st.lists(st.integers(0, 3 * BLOCK + 50), max_size=6),
    identical=st.booleans(),
)
@settings(max_examples=60, deadline=None)
def test_any_chunking_gives_the_same_bits(seed, size, pair, specials, p, cuts, identical):
    a, b = make_pair(seed, size, *pair, specials)
    whole = accumulate([(a, b)], p)
    acc = DiffAccumulator(p)
    bounds = [0, *sorted(c for c in cuts if c <= size), size]
    for lo, hi in itertools.pairwise(bounds):
        ca, cb = a[lo:hi], b[lo:hi]
        if identical and ca.dtype == cb.dtype and ca.tobytes() == cb.tobytes():
            acc.add_identical(ca)
        else:
            acc.add(ca, cb)
    assert bits(acc.result()) == bits(whole)


@given(
    seed=st.integers(0, 2**32 - 1),
    blocks=st.integers(0, 5),
    tail=st.integers(0, BLOCK - 1),
    pair=pairs,
    specials=st.booleans(),
    p=orders,
    data=st.data(),
)
@settings(max_examples=40, deadline=None)
def test_workers_merged_in_any_order_give_the_same_bits(seed, blocks, tail, pair, specials, p, data):
    # each worker takes whole blocks of the tensor (the last one its tail), in any order
    a, b = make_pair(seed, blocks * BLOCK + tail, *pair, specials)
    whole = accumulate([(a, b)], p)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(blocks, 1)), max_size=4)))
    bounds = [0, *(c * BLOCK for c in cuts if c * BLOCK < a.size), a.size]
    parts = []
    for lo, hi in itertools.pairwise(bounds):
        part = DiffAccumulator(p)
        part.add(a[lo:hi], b[lo:hi])
        parts.append(part)
    order = data.draw(st.permutations(range(len(parts))))
    total = DiffAccumulator(p)
    for i in order:
        total.merge(parts[i])
    assert bits(total.result()) == bits(whole)


@given(
    seed=st.integers(0, 2**32 - 1), size=st.integers(0, 2 * BLOCK + 10), pair=pairs, specials=st.booleans(), p=orders
)
@settings(max_examples=40, deadline=None)
def test_a_tensor_diffed_with_itself_is_zero(seed, size, pair, specials, p):
    a, _ = make_pair(seed, size, pair[0], pair[0], specials)
    s = diff(a, a.copy(), ord=p)
    same = DiffAccumulator(p)
    same.add_identical(a)
    assert bits(same.result()) == bits(s)
    assert (s.diff_norm, s.max_abs_diff, s.changed, s.size) == (0.0, 0.0, 0, size)
    # 0 / ‖A‖: NaN where A holds NaN (issue 22 item 22)
    assert bits(s.rel) == bits(None if s.norm_a == 0 else math.nan if s.nan_a else 0.0)
    if s.nan_a or s.inf_a:
        assert math.isnan(s.cosine)
    else:
        assert s.cosine == (None if s.norm2_a == 0 else 1.0)


finite32 = st.floats(-(2.0**100), 2.0**100, allow_nan=False, width=32)
small32 = hnp.arrays(F32, st.integers(0, 40), elements=finite32)


@given(small32, st.data(), st.sampled_from([1, 2, 3, np.inf]))
def test_small_tensors_against_fractions(a, data, p):
    b = data.draw(hnp.arrays(F32, a.shape, elements=finite32))
    s, ref = diff(a, b, ord=p), reference(a, b, p)
    assert_matches(s, ref, rtol=1e-12 if p != 3 else 1e-13)
    if ref["norm_a"]:
        assert s.rel == pytest.approx(ref["diff_norm"] / ref["norm_a"], rel=1e-12)


def test_dot_of_blocks_whose_maxima_multiply_beyond_range():
    # Blocks are scaled by their largest magnitudes when products could leave float64: products far below
    # ‖A‖‖B‖ may be lost (here 1e300 * 1e-300 twice), which moves the cosine by far less than 1e-12.
    a, b = np.array([1e300, 1e-300]), np.array([1e-300, 1e300])
    s = diff(a, b)
    assert abs(s.dot - 2.0) <= 1e-12 * s.norm2_a * s.norm2_b and s.cosine == pytest.approx(0.0, abs=1e-300)
    # without that need nothing is scaled: 1e200 * 1e-200 fits float64
    s = diff(np.array([1e200, 3e200]), np.array([2e-200, 1e-200]))
    assert s.dot == 5.0 and s.cosine == pytest.approx(1 / math.sqrt(2), rel=1e-15)


@given(seed=st.integers(0, 2**32 - 1), size=st.integers(1, BLOCK + 200), p=st.sampled_from([1, 2, np.inf]))
@settings(max_examples=15, deadline=None)
def test_float64_of_every_magnitude_against_integers(seed, size, p):
    rng = np.random.default_rng(seed)
    spread = rng.choice([1, 50, 300])  # values from 10**-spread to 10**spread, mixed within blocks
    a = rng.standard_normal(size) * 10.0 ** rng.uniform(-spread, spread, size)
    b = np.where(
        rng.random(size) < 0.5,
        a * (1 + rng.standard_normal(size) * 1e-6),
        rng.standard_normal(size) * 10.0 ** rng.uniform(-spread, spread, size),
    )
    s, ref = diff(a, b, ord=p), reference(a, b, p)
    for name in ("diff_norm", "norm_a", "norm_b"):
        assert getattr(s, name) == pytest.approx(ref[name], rel=1e-12, abs=0), name
    assert (s.max_abs_diff, s.changed) == (ref["max_abs_diff"], ref["changed"])
    assert abs(s.cosine - ref["cosine"]) <= 1e-12
    assert abs(s.dot - ref["dot"]) <= 1e-12 * s.norm2_a * s.norm2_b or s.dot == ref["dot"]
    if ref["norm_a"]:
        assert s.rel == pytest.approx(ref["diff_norm"] / ref["norm_a"], rel=1e-12)


def test_blocks_scaled_for_one_side_only():
    # A's largest magnitude has exponent 0 (|a| < 1) and B's 2**700: B alone is scaled, and the dot is right
    a = np.array([0.75, -0.5, 1e-300])
    b = np.array([2.0**700, 2.0**699, 3.0])
    s = diff(a, b)
    assert s.dot == 0.75 * 2.0**700 - 0.5 * 2.0**699 + 3e-300
    assert s.cosine == pytest.approx(reference(a, b)["cosine"], abs=1e-15)


def small_pairs(seed: int, da, db, specials: bool, n: int = 40):
    """Pairs of small tensors lying one after another: values of several scales, some pairs equal."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 300, n).tolist()
    scale = 10.0 ** rng.integers(-30, 30, n).repeat(sizes) if da == db == F64 else 1.0
    a = (rng.standard_normal(sum(sizes)) * scale).astype(da)
    b = (a.astype(F64) * (1 + rng.choice([0, 1e-3, 1], sum(sizes)) * rng.standard_normal(sum(sizes)))).astype(db)
    starts = np.cumsum(sizes) - sizes
    b[starts[0] : starts[0] + sizes[0]] = a[starts[0] : starts[0] + sizes[0]]  # an equal pair
    if specials:
        a[starts[1]], b[starts[2] + 1], a[starts[3]], b[starts[3]] = np.nan, np.inf, np.nan, np.nan
        if da == db == F64:
            a[starts[4]], b[starts[4]] = 1.5e308, -1.5e308  # a difference beyond float64
    return a, b, sizes


@pytest.mark.parametrize("p", [2, 1, 3, np.inf])
@pytest.mark.parametrize(("da", "db"), [(F32, F32), (F64, F64), (BF16, BF16), (F16, F16), (F32, BF16)])
@pytest.mark.parametrize("specials", [False, True])
@pytest.mark.parametrize("piece", [None, 700])  # the values a piece takes (found timing: kept in the cache)
def test_small_pairs_measured_together_give_each_pairs_own_bits(p, da, db, specials, piece, monkeypatch):
    # found measuring many tiny pairs: a DiffAccumulator each cost too much; `small_diffs` measures a run of them
    # in a few NumPy passes, and must give every figure of each pair's own accumulator, bit for bit
    a, b, sizes = small_pairs(hash((p, str(da), str(db), specials)) % 2**32, da, db, specials)
    if piece is not None:
        monkeypatch.setattr(core_small, "PIECE", piece)
    s = small_diffs(a, b, sizes, p)
    alone, total = [], DiffAccumulator(p)
    for start, n in zip(np.cumsum(sizes) - sizes, sizes, strict=True):
        acc = DiffAccumulator(p)
        acc.add(a[start : start + n], b[start : start + n])
        alone.append(acc)
        total.merge(acc)
    assert repr(s.figures()) == repr([acc.result().figures() for acc in alone])
    assert all(repr(s.accumulator(j).result()) == repr(acc.result()) for j, acc in enumerate(alone))
    merged = DiffAccumulator(p)
    s.merge_into(merged)
    assert repr(merged.result()) == repr(total.result())
    assert repr(s.shares_of(total)) == repr([acc.share_of(total) for acc in alone])


def test_rel_and_cosine_roots_in_double_double_are_the_exact_ones():
    # rel and cosine of many small pairs are rounded from double-double quotients where that is certain; they must
    # be the correctly rounded roots of the exact sums' quotients
    rng = np.random.default_rng(3)
    n = 20_000
    a, b, c, d = (rng.random((4, n)) + 0.5) * np.exp2(rng.integers(-100, 100, (4, n)))
    b[: n // 2] = a[: n // 2]  # (Σab)² over Σa²Σb²: a square over a product
    c[n // 4 :] = a[n // 4 :] * (1 + rng.standard_normal(n - n // 4) * 1e-9)  # nearly 1: cosines of close pairs
    sure, roots = sqrt_quotients(a, b, c, d)
    assert sure.mean() > 0.99
    for j in np.flatnonzero(sure).tolist():
        terms = [int_term(float(x[j]), 0) for x in (a, b, c, d)]
        (na, ea), (nb, eb), (nc, ec), (nd, ed) = terms
        exact = ldexp(*int_root(*int_quotient(na * nb, ea + eb, nc * nd, ec + ed), 2.0))
        assert roots[j] == exact, (a[j], b[j], c[j], d[j])
