"""The NumPy core against the spec's worked examples, TensorFlow's edge cases and exact references."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
from decimal import MAX_EMAX, MIN_EMIN, Decimal, getcontext
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import clipcli
from clipcli import core
from clipcli.core import axes as core_axes
from clipcli.core import clip_by_global_norm, clip_by_norm, clip_by_value, global_norm, norm
from clipcli.core import small as core_small
from clipcli.core.axes import axis_norm, axis_power_sums, row_group
from clipcli.core.blocks import BLOCK, add_power_sums, power_sums_root, widen
from clipcli.core.norms import NormAccumulator
from clipcli.core.scale import _float32_precision, scaled
from clipcli.core.small import small_norms

F32 = np.float32


def ulps32(a, b) -> np.ndarray:
    """Distance in float32 ulps between two arrays of float32 values (exact, via the bit patterns)."""
    a, b = np.asarray(a, F32).ravel(), np.asarray(b, F32).ravel()

    def ordered(x):
        i = x.view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)

    return np.abs(ordered(a) - ordered(b))


def assert_within_ulps(actual, expected, ulps=2):
    assert np.asarray(actual).shape == np.asarray(expected, F32).shape
    d = ulps32(actual, expected)
    assert d.max() <= ulps, (actual, expected, d)


def exact_norm(values, p=2) -> float:
    """The p-norm of float values (p = 1 or 2), from exact rational arithmetic, correctly rounded."""
    total = sum((abs(Fraction(float(v))) ** p for v in np.asarray(values).ravel()), Fraction(0))
    if p == 1:
        return float(total)
    getcontext().prec = 60
    return float((Decimal(total.numerator) / Decimal(total.denominator)).sqrt())


# --- The spec's worked examples (float32 inputs, within 2 ulps of the printed numbers) ----------------


def test_clip_by_norm_doc_example():
    out = clip_by_norm(np.array([[1, 2, 3, 4, 5]], F32), 2.0)
    assert out.dtype == F32
    assert_within_ulps(out, [[0.26967996, 0.5393599, 0.80903983, 1.0787199, 1.3483998]])


def test_clip_by_norm_whole_tensor():
    out = clip_by_norm(np.array([[-2, -1, 0], [1, 2, 3]], F32), 4)
    assert_within_ulps(out, [[-1.8353258, -0.9176629, 0], [0.9176629, 1.8353258, 2.7529888]])


def test_clip_by_norm_per_row():
    out = clip_by_norm(np.array([[-2, -1, 0], [1, 2, 3]], F32), 3, axes=1)
    assert_within_ulps(out, [[-2, -1, 0], [0.8017837, 1.6035674, 2.4053512]])


def test_clip_by_global_norm_doc_example():
    t = [np.array([[0, 1, 2], [3, 4, 5]], F32), np.array([[-2, -4], [2, 4]], F32)]
    (a, b), g = clip_by_global_norm(t, 9)
    assert_within_ulps(a, [[0, 0.9233805, 1.846761], [2.7701416, 3.693522, 4.6169024]])
    assert_within_ulps(b, [[-1.846761, -3.693522], [1.846761, 3.693522]])
    assert g == math.sqrt(95)
    assert isinstance(g, float)


def test_clip_by_global_norm_article_example():
    t = [np.array([-2, 3, 6], F32), np.array([-4, 6, 12], F32)]
    out, g = clip_by_global_norm(t, 14.5)
    assert g == math.sqrt(49 + 196)
    scale = 14.5 / math.sqrt(49 + 196)
    for x, y in zip(t, out, strict=True):
        assert_within_ulps(y, x.astype(np.float64) * scale, ulps=1)


def test_clip_by_value_doc_example():
    out = clip_by_value(np.array([-4, -2, 0, 2, 4, 6], F32), -2, 2)
    np.testing.assert_array_equal(out, [-2, -2, 0, 2, 2, 2])
    assert out.dtype == F32


def test_norm_p_and_inf_examples():
    t = np.linspace(-10, 8, 12).reshape(3, 4).astype(F32)
    assert_within_ulps(norm(t, ord=1.5, axis=0), [12.364525, 11.0871725, 10.408293, 10.876119])
    assert_within_ulps(norm(t, ord=np.inf, axis=1), [10, 3.4545455, 8])


# --- TensorFlow's documented behaviour ----------------------------------------------------------------


def test_clip_by_value_integer_tensor_with_float_bound_is_type_error():
    a = np.array([[1, 20, 13], [3, 21, 13]], np.int32)
    np.testing.assert_array_equal(clip_by_value(a, 0, 3), [[1, 3, 3], [3, 3, 3]])
    with pytest.raises(TypeError):
        clip_by_value(a, 0.0, 3.0)


@pytest.mark.parametrize("dtype", [np.bool_, np.complex64])
def test_clip_by_value_rejects_bool_and_complex(dtype):
    with pytest.raises(TypeError):
        clip_by_value(np.zeros(3, dtype), 0, 1)


def test_clip_by_value_broadcast_bounds():
    t = np.array([[-5, 2, 3], [4, 5, 6]], F32)
    out = clip_by_value(t, np.array([-4, 0, 0], F32), np.array([[4.4], [5.0]], F32))
    np.testing.assert_array_equal(out, [[-4, 2, 3], [4, 5, 5]])


def test_clip_by_value_bound_that_grows_the_shape_is_value_error():
    with pytest.raises(ValueError, match="broadcast"):
        clip_by_value(np.zeros(3, F32), np.zeros((2, 3), F32), 1)


def test_clip_by_value_nonfinite_as_tensorflow():
    t = np.array([np.nan, np.inf, -np.inf, 1.0], F32)
    out = clip_by_value(t, -4.4, 4.4)
    assert np.isnan(out[0])
    np.testing.assert_array_equal(out[1:], np.array([4.4, -4.4, 1.0], F32))


def test_clip_by_value_rounds_bounds_to_the_dtype():
    t = np.array([0.5, 0.1, -1], ml_dtypes.bfloat16)
    out = clip_by_value(t, -0.5, 0.1)
    assert out.dtype == t.dtype
    assert float(out[0]) == 0.10009765625  # bfloat16(0.1), as TensorFlow converts the bound


def test_clip_by_value_integer_bound_beyond_range():
    np.testing.assert_array_equal(clip_by_value(np.array([-128, 0, 127], np.int8), -1000, 300), [-128, 0, 127])


def test_clip_by_norm_no_clipping_and_zero_norm():
    t = np.array([[1.0, 0, 0], [1.0, 0, 0]], F32)
    np.testing.assert_array_equal(clip_by_norm(t, 4.0), t)
    z = np.zeros((2, 3), F32)
    np.testing.assert_array_equal(clip_by_norm(z, 4.0), z)


def test_clip_by_norm_tensorflow_simple_example():
    out = clip_by_norm(np.array([[-3.0, 0, 0], [4.0, 0, 0]], F32), 4.0)
    assert_within_ulps(out, [[-2.4, 0, 0], [3.2, 0, 0]], ulps=1)


def test_clip_by_norm_negative_clip_norm_is_zero():
    out = clip_by_norm(np.array([3.0, 4.0], F32), -1.0)
    np.testing.assert_array_equal(out, [0, 0])
    assert not np.signbit(out).any()


def test_clip_by_norm_negative_axes():
    t = np.arange(24, dtype=F32).reshape(2, 3, 4)
    np.testing.assert_array_equal(clip_by_norm(t, 1.0, axes=-1), clip_by_norm(t, 1.0, axes=[2]))
    np.testing.assert_array_equal(clip_by_norm(t, 1.0, axes=[0, 1, 2]), clip_by_norm(t, 1.0))


def test_clip_by_norm_axis_out_of_range():
    with pytest.raises(ValueError, match="out of range"):
        clip_by_norm(np.zeros((2, 2), F32), 1.0, axes=2)


@pytest.mark.parametrize(
    "op",
    [
        lambda t: clip_by_norm(t, 1.0),
        lambda t: global_norm([t]),
        lambda t: clip_by_global_norm([t], 1.0),
        lambda t: norm(t),
    ],
)
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.bool_])
def test_norm_ops_reject_integer_tensors(op, dtype):
    with pytest.raises(TypeError):
        op(np.ones(3, dtype))


@pytest.mark.parametrize("op", [global_norm, lambda t: clip_by_global_norm(t, 1.0)])
@pytest.mark.parametrize("t_list", [np.ones(3, F32), "abc", 3.0])
def test_global_ops_need_a_list(op, t_list):
    with pytest.raises(TypeError):
        op(t_list)


def test_none_entries_are_ignored_and_kept_in_place():
    t = [None, np.array([3.0, 4.0], F32), None]
    assert global_norm(t) == 5.0
    out, g = clip_by_global_norm(t, 1.0)
    assert out[0] is None and out[2] is None
    assert_within_ulps(out[1], [0.6, 0.8], ulps=1)
    assert g == 5.0


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_nonfinite_global_norm_makes_every_output_nan(bad):
    t = [np.array([1.0, bad], F32), np.array([2.0, 3.0], ml_dtypes.bfloat16), np.array([1.0])]
    out, g = clip_by_global_norm(t, 1.0)
    assert math.isnan(g) if math.isnan(bad) else g == math.inf
    for x, y in zip(t, out, strict=True):
        assert y.dtype == x.dtype
        assert np.isnan(y.astype(np.float64)).all()


def test_use_norm_replaces_the_computed_norm():
    t = [np.array([3.0, 4.0], F32)]
    out, g = clip_by_global_norm(t, 1.0, use_norm=10.0)
    assert g == 10.0
    assert_within_ulps(out[0], [0.3, 0.4], ulps=1)
    out, _ = clip_by_global_norm(t, 1.0, use_norm=np.inf)
    assert np.isnan(out[0]).all()


def test_global_norm_tensorflow_test_case():
    x0 = np.array([[-2.0, 0, 0], [4.0, 0, 0]], F32)
    x1 = np.array([1.0, -2.0], F32)
    (a, b), g = clip_by_global_norm([x0, x1], 6.0)
    assert g == 5.0
    np.testing.assert_array_equal(a, x0)
    np.testing.assert_array_equal(b, x1)


@pytest.mark.parametrize("ord", ["fro", "nuc", 0, -1, -np.inf, True, None, "max"])
def test_vector_norm_rejects_other_orders(ord):
    with pytest.raises(ValueError):
        norm(np.ones(3, F32), ord=ord)


@pytest.mark.parametrize("ord", [3, 0.5, "nuc", -1])
def test_matrix_norm_rejects_other_orders(ord):
    with pytest.raises(ValueError):
        norm(np.ones((2, 2), F32), ord=ord, axis=(0, 1))


@pytest.mark.parametrize("axis", [(0, 0), (0, 1, 2), 5])
def test_norm_rejects_bad_axes(axis):
    with pytest.raises(ValueError):
        norm(np.ones((2, 2, 2), F32), axis=axis)


@pytest.mark.parametrize("ord", ["fro", "euclidean", 1, 2, np.inf])
def test_matrix_norms_against_numpy_in_float64(ord):
    rng = np.random.default_rng(0)
    t = rng.standard_normal((3, 5, 4)).astype(F32)
    np_ord = "fro" if ord == "euclidean" else ord
    expected = np.linalg.norm(t.astype(np.float64), ord=np_ord, axis=(1, 2))
    np.testing.assert_allclose(norm(t, ord=ord, axis=(1, 2)), expected, rtol=1e-13)
    kept = norm(t, ord=ord, axis=(1, 2), keepdims=True)
    assert kept.shape == (3, 1, 1)


def test_norm_keepdims_and_scalar_results():
    t = np.arange(6, dtype=F32).reshape(2, 3)
    assert isinstance(norm(t), float)
    assert norm(t, keepdims=True).shape == (1, 1)
    assert norm(t, axis=0, keepdims=True).shape == (1, 3)
    assert norm(t, axis=1).shape == (2,)


@pytest.mark.parametrize("axis", [[1], (1,), [0, 1, 1], "1", 1.0])
def test_norm_axis_is_an_int_or_a_pair_as_in_tensorflow(axis):
    with pytest.raises(ValueError, match="'axis' must be None, an integer, or a tuple of 2 unique integers"):
        norm(np.ones((2, 3), F32), axis=axis)


def test_norm_of_complex_values():
    z = np.array([3 + 4j, 0, 1j], np.complex64)
    assert norm(z) == math.sqrt(26)
    assert norm(z, ord=1) == 6.0
    assert norm(z, ord=np.inf) == 5.0
    out = clip_by_norm(z, 1.0)
    assert out.dtype == np.complex64
    np.testing.assert_allclose(out, z / np.sqrt(26), rtol=2e-7)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, np.float16])
def test_low_precision_dtypes(dtype):
    t = np.array([3.0, -4.0, 0.5], dtype)
    assert norm(t) == exact_norm(t.astype(np.float64))
    out = clip_by_norm(t, 1.0)
    assert out.dtype == np.dtype(dtype)
    # one rounding of float32(x) * float32(scale) to the dtype
    expected = (t.astype(F32) * F32(1.0 / exact_norm(t.astype(np.float64)))).astype(dtype)
    np.testing.assert_array_equal(out.view(np.uint8), expected.view(np.uint8))


def test_mixed_dtypes_in_one_global_norm():
    t = [np.array([3.0], ml_dtypes.bfloat16), np.array([4.0], np.float16), np.array([12.0]), np.array([0j + 84])]
    assert global_norm(t) == 85.0


# --- Better than TensorFlow: accuracy, range, no drift ----------------------------------------------


def test_global_norm_of_ten_million_float32_tenths():
    n = 10**7
    x = np.full(n, 0.1, F32)
    got = global_norm([x])
    getcontext().prec = 60
    exact = Decimal(float(F32(0.1))) * Decimal(n).sqrt()
    assert abs(Decimal(got) - exact) / exact <= Decimal("1e-12")
    assert abs(float(np.linalg.norm(x)) - float(exact)) / float(exact) > 1e-6  # the float32 baseline drifts


def test_accuracy_on_random_values_against_fractions():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(200_003) * np.exp(rng.uniform(-20, 20, 200_003))).astype(F32)
    assert abs(norm(x) - exact_norm(x)) <= 2e-15 * exact_norm(x)
    assert abs(norm(x, ord=1) - exact_norm(x, 1)) <= 2e-15 * exact_norm(x, 1)


@pytest.mark.parametrize(
    ("values", "dtype", "expected"),
    [
        ([300, 0], np.float16, 300.0),
        ([1e20], F32, float(F32(1e20))),
        ([1e-20], F32, float(F32(1e-20))),
        ([1e30, 1e30, 1e30], F32, float(F32(1e30)) * math.sqrt(3)),
        ([3e38, 3e38, 3e38], F32, float(F32(3e38)) * math.sqrt(3)),
        ([1e-45, 0], F32, float(F32(1e-45))),  # a subnormal is not flushed
        ([1e200, 1e200], np.float64, 1e200 * math.sqrt(2)),
        ([1e-200, 1e-200], np.float64, 1e-200 * math.sqrt(2)),
        ([1.5e308, 1.5e308], np.float64, math.inf),  # the true norm does not fit float64
        ([5e-324, 0], np.float64, 5e-324),
    ],
)
def test_no_overflow_or_underflow_on_the_way(values, dtype, expected):
    got = norm(np.array(values, dtype))
    assert got == pytest.approx(expected, rel=1e-15, abs=0)


def test_p_norms_of_extreme_float64_values():
    x = np.array([1e300, 2e300, 3e-300])
    assert norm(x, ord=3) == pytest.approx(1e300 * 9 ** (1 / 3), rel=1e-14)
    assert norm(x, ord=1) == pytest.approx(3e300, rel=1e-15)
    assert norm(np.array([3e-300, 4e-300]), ord=0.5) == pytest.approx((math.sqrt(3) + 2) ** 2 * 1e-300, rel=1e-14)


def test_norms_are_float64():
    assert isinstance(global_norm([np.ones(3, np.float16)]), float)
    assert norm(np.ones((2, 2), F32), axis=0).dtype == np.float64


def test_within_the_bound_comes_back_bit_identical():
    rng = np.random.default_rng(2)
    for dtype in (F32, np.float16, ml_dtypes.bfloat16, np.float64):
        t = rng.standard_normal(10_000).astype(dtype)
        c = norm(t)
        assert np.array_equal(clip_by_norm(t, c).view(np.uint8), t.view(np.uint8))
        (out,), _ = clip_by_global_norm([t], c * 2)
        assert np.array_equal(out.view(np.uint8), t.view(np.uint8))


def test_inputs_are_never_mutated():
    t = np.frombuffer(np.arange(8, dtype=F32).tobytes(), dtype=F32)  # read-only, like a file's buffer
    assert not t.flags.writeable
    clip_by_norm(t, 1.0)
    clip_by_value(t, 1, 2)
    clip_by_global_norm([t], 1.0)
    np.testing.assert_array_equal(t, np.arange(8))


# --- Hypothesis properties --------------------------------------------------------------------------

finite32 = st.floats(-(2.0**100), 2.0**100, allow_nan=False, width=32)
arrays32 = hnp.arrays(F32, hnp.array_shapes(min_dims=0, max_dims=3, max_side=6), elements=finite32)


@given(arrays32, st.floats(1e-3, 1e3))
def test_clipped_norm_is_at_most_the_bound(t, c):
    out = clip_by_norm(t, c)
    assert norm(out) <= c * (1 + 4e-7)
    if norm(t) <= c:
        assert np.array_equal(out, t)
    else:
        assert norm(out) == pytest.approx(c, rel=4e-7)


@example(np.array([3.8493495e6, 0.09375], F32), 8.317527912184968)  # found by hypothesis: 2 ulps
@given(arrays32, st.floats(1e-3, 1e3))
def test_clipping_twice_changes_almost_nothing(t, c):
    """Rounded to float32, the first clip's norm may exceed c by a few parts in 1e8: the second clip then
    scales by the float32 below 1, 1 - 2**-24 or 1 - 2**-23, which moves a value by up to 2 ulps."""
    once = clip_by_norm(t, c)
    twice = clip_by_norm(once, c)
    assert ulps32(once, twice).max(initial=0) <= 2


@given(st.lists(arrays32, min_size=1, max_size=4), st.floats(1e-3, 1e3))
def test_global_clip_uses_one_common_scale(ts, c):
    out, g = clip_by_global_norm(ts, c)
    scale = 1.0 if g <= c else c / g
    for x, y in zip(ts, out, strict=True):
        np.testing.assert_array_equal(y, x * F32(scale))
    # the promise is 1e-12 (block sums of up to 8192 terms are rounded); 1e-15 is only typical: many equal
    # large values (found by hypothesis) reach ~1e-14
    assert g == pytest.approx(exact_norm(np.concatenate([x.ravel() for x in ts])), rel=1e-12)


@example(np.array([0.1] * 9000, F32), [8192])  # a split that lands inside the first block
@given(hnp.arrays(F32, st.integers(0, 20_000), elements=finite32), st.lists(st.integers(0, 20_000), max_size=5))
@settings(max_examples=50)
def test_chunked_accumulation_gives_the_same_bits(x, cuts):
    one = NormAccumulator(2)
    one.add(x)
    pieces = NormAccumulator(2)
    for part in np.split(x, sorted(c for c in cuts if c <= x.size)):
        pieces.add(part)
    assert one.result() == pieces.result()


@example(np.full((6, 6, 6), 7.446979e17, F32), 2)  # equal values: the block sum's rounding, 1.3e-15
@given(arrays32, st.sampled_from([1, 2, 3, 0.5, np.inf]))
def test_norm_against_exact_fractions(t, p):
    assume(t.size)
    expected = float(np.max(np.abs(t.astype(np.float64)))) if p == np.inf else None
    if p in (1, 2):
        expected = exact_norm(t, p)
    got = norm(t, ord=p)
    if expected is None:
        ref = float(sum(Fraction(abs(float(v))) ** 3 for v in t.ravel())) ** (1 / 3) if p == 3 else None
        ref = ref if ref is not None else sum(abs(float(v)) ** 0.5 for v in t.ravel()) ** 2
        assert got == pytest.approx(ref, rel=1e-13)
    else:
        # exact up to the float64 sums of each block of values: the promise is 1e-12, typically 1e-15
        assert got == pytest.approx(expected, rel=1e-12, abs=0)


def test_merge_is_exact_for_values_far_apart():
    big, small = NormAccumulator(2), NormAccumulator(2)
    big.add(np.array([1e300]))
    small.add(np.array([1e-300] * 3))
    big.merge(small)
    assert big.result().norm == 1e300
    assert big.result().size == 4


def test_counts_of_nan_and_inf_and_max_abs():
    acc = NormAccumulator(2)
    acc.add(np.array([1.0, np.nan, -np.inf, -7.0, np.nan], F32))
    s = acc.result()
    assert (s.nan, s.inf, s.max_abs, s.size) == (2, 1, math.inf, 5)
    assert math.isnan(s.norm)


# --- Packaging --------------------------------------------------------------------------------------


def test_public_api_is_exported():
    assert clipcli.clip_by_global_norm is core.clip_by_global_norm
    for name in ("clip_by_value", "clip_by_norm", "global_norm", "norm"):
        assert callable(getattr(clipcli, name))


def test_core_imports_neither_typer_nor_rich():
    code = "import sys, clipcli.core; print(sorted(m for m in sys.modules if m.split('.')[0] in ('typer', 'rich')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_exact_sum_rounds_correctly_across_tensors():
    # 2**53 + 1 + 2**-60 lies just above a tie: truncating the low bits would round it down to 2**53.
    total = NormAccumulator(1)
    for v in (2.0**53, 1.0, 2.0**-60):
        part = NormAccumulator(1)
        part.add(np.array([v]))
        total.merge(part)
    assert total.result().norm == 2.0**53 + 2
    squares = NormAccumulator(2)
    for v in (3.0, 4.0, 2.0**-40):
        part = NormAccumulator(2)
        part.add(np.array([v]))
        squares.merge(part)
    assert squares.result().norm == exact_norm([3.0, 4.0, 2.0**-40])


@pytest.mark.parametrize("dtype", [F32, np.float64, np.float16, ml_dtypes.bfloat16, np.complex64])
def test_scaled_into_out_equals_scaled(dtype):
    t = (np.arange(-50, 50) * 1.37).astype(dtype)
    expected = scaled(t, 0.3)
    buf = t.copy()
    assert scaled(buf, 0.3, out=buf) is buf
    assert buf.tobytes() == expected.tobytes()
    same = t.copy()
    assert scaled(same, 1.0, out=same).tobytes() == t.tobytes()


def test_signalling_nans_are_counted_without_warnings():
    # found by fuzzing: widening a signalling NaN raises "invalid", which must not reach the user
    x = np.arange(8, dtype=F32)
    x.view(np.uint32)[3] = 0xFFA00000
    acc = NormAccumulator(2)
    acc.add(x)
    assert acc.result().nan == 1
    assert np.isnan(scaled(x, 0.5)[3]) and np.isnan(clip_by_value(x, 0, 1)[3])
    assert math.isnan(norm(x.reshape(2, 4), axis=1)[0])


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_every_16_bit_value_widens_exactly(dtype):
    # 16-bit floats are widened by moving bits, not by NumPy's casts: check every bit pattern
    x = np.arange(1 << 16, dtype=np.uint16).view(dtype)
    with np.errstate(invalid="ignore"):  # signalling NaNs
        reference = x.astype(np.float64)
        wide = widen(x)[1]
    np.testing.assert_array_equal(wide, reference)
    values = x[np.isfinite(reference)]
    np.testing.assert_array_equal(widen(values)[1], values.astype(np.float64))
    # the block sums of squares (p = 2) and the general path (p = 3) against exact rational sums
    exact = [Fraction(float(v)) for v in values.astype(np.float64)]
    squares = NormAccumulator(2)
    squares.add(values)
    s = squares.result()
    assert s.max_abs == max(abs(v) for v in exact)
    assert s.norm == pytest.approx(exact_norm(values.astype(np.float64)), rel=1e-14)
    cubes = NormAccumulator(3)
    cubes.add(values)
    assert cubes.result().norm == pytest.approx(float(sum(abs(v) ** 3 for v in exact)) ** (1 / 3), rel=1e-14)
    # with the non-finite patterns: counted, whatever path the values take
    everything = NormAccumulator(2)
    everything.add(x)
    assert (everything.result().nan, everything.result().inf) == (int(np.isnan(reference).sum()), 2)
    assert everything.result().max_abs == math.inf


def test_float16_subnormals_keep_the_fast_path_exact():
    # gradients stored as float16 are mostly tiny: subnormals below 2**-14 must widen exactly
    t = (np.random.default_rng(3).standard_normal(3 * BLOCK + 11) * 1e-5).astype(np.float16)
    assert (np.abs(t.astype(np.float64)) < 2.0**-14).mean() > 0.5
    assert norm(t) == pytest.approx(exact_norm(t.astype(np.float64)), rel=1e-14)
    assert norm(t, ord=np.inf) == float(np.abs(t.astype(np.float64)).max())


def rounded_once(x: np.ndarray, factor: float, dtype: np.dtype) -> np.ndarray:
    """Each x * factor (exact in float64) rounded to nearest, ties to even, in `dtype`: by search among all of
    its values, not by any cast (NumPy and ml_dtypes may round through float32)."""
    every = np.arange(1 << (8 * dtype.itemsize), dtype=np.uint16 if dtype.itemsize == 2 else np.uint8).view(dtype)
    with np.errstate(invalid="ignore"):  # signalling NaNs among the codes
        positive = every[np.isfinite(every) & ~np.signbit(every)]
    order = np.argsort(positive.astype(np.float64), kind="stable")
    grid, codes = positive.astype(np.float64)[order], positive.view(f"u{dtype.itemsize}")[order]
    keep = np.r_[True, grid[1:] != grid[:-1]]  # one code per value (the fnuz types have no -0)
    grid, codes = grid[keep], codes[keep]
    top = grid[-1]
    beyond = 2.0 ** (math.frexp(top)[1])  # where the next binade would start: inf sits there
    product = x.astype(np.float64) * factor
    m = np.abs(product)
    i = np.clip(np.searchsorted(grid, m, side="right") - 1, 0, grid.size - 1)
    lo = grid[i]
    hi = np.where(i + 1 < grid.size, grid[np.minimum(i + 1, grid.size - 1)], beyond)
    mid = (lo + hi) / 2  # exact: one bit more than the type has
    odd = (codes[i] & 1) == 1
    up = (m > mid) | ((m == mid) & odd)
    magnitude = np.where(up, hi, lo)
    magnitude = np.where(magnitude == beyond, np.inf, magnitude)
    return np.copysign(magnitude, product).astype(dtype)


_NARROW_FLOATS = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)] + [
    np.dtype(getattr(ml_dtypes, n)) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
]


@pytest.mark.parametrize("dtype", _NARROW_FLOATS, ids=lambda d: d.name)
def test_16_and_8_bit_floats_are_scaled_with_one_rounding(dtype):
    # every finite value of the type times factors that make ties, subnormals and zeros (and, where the type
    # has inf, overflow): the exact product rounded once to the dtype, found by search among its values.
    # A float32 product rounded again misses it by an ulp in some (float16: -15.71875 * 0.00371093 below).
    bits = np.arange(1 << (8 * dtype.itemsize), dtype=np.uint16 if dtype.itemsize == 2 else np.uint8)
    x = bits.view(dtype)
    with np.errstate(invalid="ignore"):  # signalling NaNs among the codes
        x = x[np.isfinite(x)]
    rng = np.random.default_rng(4)
    factors = [0.0, 1.0 - 2.0**-24, 0.5, 2.0**-24, 2.0**-110, 2.0**-140, 1 / 3, 1e-3, 100.0 / 26945.959589829967]
    factors += [2.0**-130 / 3, 2.0**-140 / 3]  # below float32's normal range: 24 bits all the same
    factors += [*rng.random(8), *(2.0 ** rng.uniform(-30, 0, 8))]
    if np.isinf(np.array(np.inf).astype(dtype)):  # the type has inf: products beyond its range overflow to it
        factors += [3.0, 2.0**14, 1e30]
    for f in factors:
        expected = rounded_once(x, float(round_fraction(Fraction(f), min_exponent=None)), dtype)
        got = scaled(x, f)
        assert got.view(f"u{dtype.itemsize}").tobytes() == expected.view(f"u{dtype.itemsize}").tobytes(), f
    t = x[: 3 * (x.size // 3)].reshape(3, -1)
    expected = rounded_once(t, float(F32(0.3)), dtype)
    assert scaled(t, 0.3).tobytes() == expected.tobytes()
    same = t.copy()
    assert scaled(same, 0.3, out=same) is same and same.tobytes() == expected.tobytes()
    columns = t.T  # not contiguous: the path for views
    assert scaled(columns, 0.3).tobytes() == expected.T.copy().tobytes()


def round_fraction(q: Fraction, bits: int = 24, min_exponent: int | None = -149) -> Fraction:
    """q rounded to nearest, ties to even, on a grid of `bits` significant bits whose finest step is
    2**min_exponent (float32's: 24 bits, 2**-149; None: no floor, any exponent); by integer arithmetic alone."""
    if q == 0:
        return q
    e = math.floor(math.log2(abs(q)))
    while Fraction(2) ** e > abs(q):  # log2 of a Fraction may be off by one near powers of two
        e -= 1
    while Fraction(2) ** (e + 1) <= abs(q):
        e += 1
    step = Fraction(2) ** (e - bits + 1 if min_exponent is None else max(e - bits + 1, min_exponent))
    n, rest = divmod(q / step, 1)
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and n % 2):
        n += 1
    return n * step


def test_round_fraction_agrees_with_float32_casts_of_exact_float64_values():
    # the reference itself, where a cast rounds once (a float64 holds x exactly): normal, subnormal, ties
    values = [1.0 + 2.0**-24, 1.0 + 3 * 2.0**-24, 3 * 2.0**-151, 2.0**-150, 5 * 2.0**-151, 1e-40, 1 / 3]
    for v in values:
        assert round_fraction(Fraction(v)) == Fraction(float(F32(v))), v


@given(
    st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=40),
    st.floats(-172.0, -126.0),
    st.floats(1.0, 2.0, exclude_max=True),
)
def test_a_scale_below_float32s_normal_range_keeps_24_bits(values, exponent, mantissa):
    # a float32 below 2**-126 holds fewer than 24 bits: a scale of 1e-43 was 0.3% off (clipping 3e38s to 1e-3)
    scale = math.ldexp(mantissa, math.floor(exponent))
    scale24 = round_fraction(Fraction(scale), min_exponent=None)
    x = np.array(values, F32)
    for t in (x, x.astype(np.complex64)):
        got = scaled(t, scale)
        assert got.dtype == t.dtype
        expected = [round_fraction(Fraction(float(v)) * scale24) for v in x.tolist()]
        assert [Fraction(float(v)) for v in got.real.tolist()] == expected, scale


def test_a_scale_in_float32s_range_takes_the_float32_product():
    # found by a review: every scale not exactly a float32 (0.3) took the float64 product (same bits, 4x slower)
    for scale in (0.3, 1.0, 0.0, 2.0**-126, np.array([0.3, 1e-20])):
        assert _float32_precision(np.asarray(scale, np.float64)).dtype == np.float32
    for scale in (1e-43, np.array([0.3, 1e-43]), 1e39):
        assert _float32_precision(np.asarray(scale, np.float64)).dtype == np.float64


def test_clipping_float32s_near_their_largest_keeps_the_scales_precision():
    x = np.full(1000, 3e38, F32)
    clipped = clip_by_norm(x, 1e-3)
    # each value is 1e-3 / sqrt(1000); the float32 scale (1.05e-43, subnormal) made it 3.1529216e-05
    assert clipped[0] == F32(1e-3 / math.sqrt(1000))
    (clipped,), _ = clip_by_global_norm([x], 1e-3)
    assert clipped[0] == F32(1e-3 / math.sqrt(1000))
    assert clip_by_norm(x.astype(ml_dtypes.bfloat16), 1e-3)[0] == ml_dtypes.bfloat16(1e-3 / math.sqrt(1000))


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.floats(1e200, 1e300) | st.floats(-1e300, -1e200), min_size=1, max_size=8),
    st.floats(1e-300, 1e-100),
    st.booleans(),
)
@example(  # 3.69e-16 off: the norm of float64s is not correctly rounded (their squares are not exact in float64)
    [1.3220497535691427e299, 3.3432892196717813e299, 9.171938415647707e299, -2.3769187720729693e299,
     4.509756443968828e299, -5.752154588480493e299, 6.449284399362997e299, -8.413968917986006e299],
    5.991456360741802e-101,
    False,
)  # fmt: skip
def test_a_float64_scale_below_the_normal_range_keeps_its_bits(values, clip, as_complex):
    # found by a review: clip_norm / norm below 2**-1022 was a subnormal float64: clipping [3e300, 4e300] to
    # 1e-300 gave [0, 0], to 1e-20 was 4.8e-4 off. Now the scale's 53 bits are kept (two roundings, as
    # TensorFlow's t * c / max(n, c) makes).
    x = np.array(values)
    total = sum(Fraction(v) ** 2 for v in values)
    assume(total > Fraction(clip) ** 2 * 2**2044)  # the scale is below float64's normal range
    getcontext().prec = 60
    exact_norm = Decimal(total.numerator).sqrt() / Decimal(total.denominator).sqrt()
    t = x.astype(np.complex128) if as_complex else x
    for got in (clip_by_norm(t, clip), clip_by_global_norm([t], clip)[0][0]):
        for v, g in zip(values, np.asarray(got).real.tolist(), strict=True):
            exact = Decimal(v) * Decimal(clip) / exact_norm
            # the norm (within 2**-52 of the exact one: float64 squares summed), the scale and the product each
            # rounded, or a subnormal spacing where the product is one
            assert abs(Decimal(g) - exact) <= max(abs(exact) * Decimal("4.5e-16"), Decimal(2.0**-1074)), (v, g, exact)


def test_clipping_float64s_near_their_largest_to_a_tiny_norm():
    # within an ulp: the scale and the product are each rounded once, as in TensorFlow's t * c / max(n, c)
    np.testing.assert_array_max_ulp(clip_by_norm(np.array([3e300, 4e300]), 1e-300), [6e-301, 8e-301], maxulp=1)
    np.testing.assert_array_max_ulp(clip_by_norm(np.array([3e300, 4e300]), 1e-20), [6e-21, 8e-21], maxulp=1)
    # a norm beyond float64 (1.3e308 * sqrt(3)) and a scale of 5e-309: 1.7 / sqrt(3), to an ulp (was 3 off)
    got = clip_by_norm(np.full(3, 1.3e308), 1.7)[0]
    assert abs(got - 0.98149545762236377402605) <= 1.2e-16


def test_the_float16_that_two_roundings_missed_is_rounded_once():
    # found by a review: the float32 product rounded again to float16 gave -0.058349609375
    (clipped,), _ = clip_by_global_norm([np.array([-15.71875], np.float16)], 100.0, use_norm=26945.959589829967)
    assert clipped.item() == -0.058319091796875
    exact = Fraction(-15.71875) * Fraction(float(F32(100.0 / 26945.959589829967)))
    neighbours = [Fraction(float(v)) for v in (np.float16(-0.058319091796875), np.float16(-0.058349609375))]
    assert abs(neighbours[0] - exact) < abs(neighbours[1] - exact)


def test_a_transposed_float16_tensor_is_clipped_as_its_copy():
    # the float16 fast path once wrote into a flattened copy of a non-contiguous output: the values came back
    # unscaled and scrambled
    x = np.arange(12, dtype=F32).reshape(3, 4).astype(np.float16)
    assert clip_by_norm(x.T, 1.0).tobytes() == clip_by_norm(x.T.copy(), 1.0).tobytes()
    assert clip_by_global_norm([x.T], 1.0)[0][0].tobytes() == clip_by_global_norm([x.T.copy()], 1.0)[0][0].tobytes()
    assert norm(clip_by_norm(x.T, 1.0)) == pytest.approx(1.0, rel=1e-3)


@pytest.mark.parametrize(
    "dtype", [np.float16, ml_dtypes.bfloat16, F32, np.float64, ml_dtypes.float8_e4m3fn, np.int32], ids=str
)
def test_every_operation_gives_a_view_what_it_gives_its_copy(dtype):
    # transposed, strided and reversed views: the fast paths walk C-contiguous memory; views take the others
    x = (np.random.default_rng(7).standard_normal((5, 7, 3)) * 3).astype(dtype)
    ops = [lambda a: clip_by_value(a, a.dtype.type(-1), a.dtype.type(1))]
    if dtype != np.int32:
        ops += [
            lambda a: clip_by_norm(a, 1.0),
            lambda a: clip_by_norm(a, 1.0, axes=[1]),
            lambda a: clip_by_global_norm([a], 1.0)[0][0],
            lambda a: np.asarray(norm(a)),
            lambda a: np.asarray(norm(a, ord=1.5, axis=0)),
        ]
    for view in (x.transpose(2, 0, 1), x[:, ::2], x[::-1]):
        for op in ops:
            got, expected = op(view), op(view.copy())
            assert (got.shape, got.tobytes()) == (expected.shape, expected.tobytes())
    same = x.transpose(2, 0, 1).copy(order="F")  # an output that is not C-contiguous
    expected = clip_by_value(same.copy(), dtype(-1), dtype(1))
    assert clip_by_value(same, dtype(-1), dtype(1), out=same) is same and same.tobytes() == expected.tobytes()


def test_float16_scaling_with_special_values_and_negative_factors():
    x = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    x = x[np.isfinite(x)]
    for f in (-0.5, -(1 / 3), -1e-3):  # the path for factors below zero: the same rounding
        assert scaled(x, f).tobytes() == rounded_once(x, float(F32(f)), np.dtype(np.float16)).tobytes()
    # non-finite values go NumPy's way (exact products here: nothing to round)
    special = np.array([np.inf, -np.inf, np.nan, 1.0, -(2.0**-20)], np.float16)
    with np.errstate(invalid="ignore"):
        for f in (0.5, -0.5, np.nan):
            assert scaled(special, f).tobytes() == (special.astype(F32) * F32(f)).astype(np.float16).tobytes()


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e5m2", "float16"])
def test_a_bound_beyond_the_types_range_clips_nothing_on_its_side(name):
    # rounded to a type without inf, 1e6 would be NaN, and every value clipped to NaN (found by a review)
    dtype = np.dtype(getattr(ml_dtypes, name, None) or name)
    top = float(ml_dtypes.finfo(dtype).max)
    x = np.array([0.5, -2, top, -top, 1], dtype)
    with np.errstate(over="ignore"):
        assert clip_by_value(x, -1e6, 1e6).tobytes() == x.tobytes()
        assert clip_by_value(x, -1, 1e6).astype(np.float64).tolist() == [0.5, -1, top, -1, 1]
        assert clip_by_value(x, np.array([-1e6, -1, -1e6, -1e6, 0]), 1e6).astype(np.float64).tolist() == [
            0.5, -1, top, -top, 1
        ]  # fmt: skip


def test_float16_clip_by_value_on_integer_keys_matches_numpys_float16_comparisons():
    # every float16 value against bounds at the edges (+-0, subnormals, +-inf, lo > hi); NumPy's float16
    # minimum/maximum is the reference (and the path taken with NaN values or a -0.0 bound)
    x = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    bounds = [-np.inf, -65504, -1.5, -(2.0**-24), -0.0, 0.0, 2.0**-24, 2.0**-14, 0.1, 65504, np.inf]
    for values in (x[~np.isnan(x)], x):
        for lo in bounds:
            for hi in bounds:
                lo16, hi16 = np.float16(lo), np.float16(hi)
                with np.errstate(invalid="ignore"):
                    expected = np.maximum(np.minimum(values, hi16), lo16)
                    got = clip_by_value(values, lo16, hi16)
                    same = values.copy()
                    assert clip_by_value(same, lo16, hi16, out=same) is same
                assert got.tobytes() == expected.tobytes() == same.tobytes(), (lo, hi)


@settings(max_examples=60, deadline=None)
@given(hnp.array_shapes(min_dims=2, max_dims=3, min_side=2, max_side=12), st.integers(1, 5), st.data())
def test_norms_across_rows_fold_groups_the_same_however_the_rows_are_cut(shape, group_values, data):
    # norms over axes that include axis 0 add fixed groups of rows in order: cutting the rows anywhere at a
    # group boundary (as the command line streams them) gives the same bits as the whole tensor
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    t = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3, shape)).astype(F32)  # sums that round
    axes = data.draw(st.sampled_from([a for a in [(0,), (0, 1), (0, 2), (0, 1, 2)] if max(a) < t.ndim]))
    original = core_axes._GROUP
    core_axes._GROUP = group_values * math.prod(t.shape[1:])  # a few rows per group, so there are several
    try:
        whole = axis_norm(t, 2.0, axes)
        group = row_group(t.shape)
        cuts = sorted(data.draw(st.sets(st.integers(1, max(t.shape[0] // group, 1)), max_size=3)))
        bounds = [0, *(c * group for c in cuts if c * group < t.shape[0]), t.shape[0]]
        total = None
        for a, b in itertools.pairwise(bounds):
            for part in axis_power_sums(t[a:b], axes, 2.0):
                total = add_power_sums(total, part)
        streamed = power_sums_root(*total, 2.0)
    finally:
        core_axes._GROUP = original
    assert streamed.tobytes() == whole.tobytes()
    w = t.astype(np.float64)
    reference = np.sqrt(np.sum(w * w, axis=axes, keepdims=True))
    np.testing.assert_allclose(whole, reference, rtol=1e-13, atol=0)


# --- Norms beyond float64, +-inf in clip_by_norm, 0-d results ----------------------------------------


def test_clip_by_norm_of_finite_values_whose_norm_overflows_float64_uses_the_exact_norm():
    t = np.full(4, 1e308)  # norm 2e308: inf as a float64, but the scale 1 / 2e308 is finite
    assert core.norm(t) == math.inf
    out = clip_by_norm(t, 1.0)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, 0.5, rtol=1e-15)


def test_clip_by_global_norm_beyond_float64_returns_inf_but_scales_by_the_exact_norm():
    tensors = [np.full(100, 1e308), np.full(10, 3e307)]
    clipped, g = clip_by_global_norm(tensors, 1.0)
    assert g == math.inf
    exact_over_1e300 = math.sqrt(100 * 1e16 + 10 * 9e14)  # the true global norm is ~1.0045e309
    for before, after in zip(tensors, clipped, strict=True):
        assert np.isfinite(after).all()
        np.testing.assert_allclose(after, before[0] / 1e300 / exact_over_1e300, rtol=1e-14)


def test_clip_by_norm_along_axes_uses_the_exact_norm_of_each_slice():
    t = np.array([[1e308, 1e308], [1.0, 1.0]])
    np.testing.assert_allclose(clip_by_norm(t, 1.0, axes=1), math.sqrt(0.5), rtol=1e-15)
    out = clip_by_norm(t, 1.0, axes=0)
    np.testing.assert_allclose(out, [[1.0, 1.0], [1e-308, 1e-308]], rtol=1e-15)


@pytest.mark.parametrize("dtype", [F32, np.float64, np.float16, ml_dtypes.bfloat16])
def test_clip_by_norm_of_a_tensor_holding_inf_is_tensorflows_t_times_c_over_inf(dtype):
    # t * clip_norm / max(norm, clip_norm) with norm inf: NaN where t is +-inf or NaN, +-0 elsewhere
    t = np.array([1.0, np.inf, -2.0, -np.inf, 0.0], dtype)
    out = clip_by_norm(t, 1.0)
    assert out.dtype == t.dtype
    expected = np.array([0.0, np.nan, -0.0, np.nan, 0.0])
    np.testing.assert_array_equal(out.astype(np.float64), expected)
    assert list(np.signbit(out.astype(np.float64)[[0, 2, 4]])) == [False, True, False]


def test_clip_by_norm_along_axes_with_inf_scales_only_that_slice_by_zero():
    t = np.array([[np.inf, 1.0], [3.0, 4.0]], F32)
    out = clip_by_norm(t, 1.0, axes=1)
    np.testing.assert_array_equal(out[0], [np.nan, 0.0])
    np.testing.assert_allclose(out[1], [0.6, 0.8], rtol=1e-7)


def test_clip_by_norm_of_a_tensor_holding_nan_is_all_nan():
    out = clip_by_norm(np.array([1.0, np.nan, 2.0], F32), 1.0)
    assert np.isnan(out).all()


@pytest.mark.parametrize(
    ("fn", "args"),
    [
        (clip_by_value, (0.0, 1.0)),
        (clip_by_norm, (1.0,)),
        (clip_by_norm, (5.0,)),
    ],
)
@pytest.mark.parametrize("dtype", [F32, np.float64, np.float16, ml_dtypes.bfloat16])
def test_library_takes_0d_arrays_and_returns_0d_arrays(fn, args, dtype):
    for t in (dtype(3), np.array(3, dtype)):
        out = fn(t, *args)
        assert isinstance(out, np.ndarray) and out.shape == () and out.dtype == np.dtype(dtype)


def test_clip_by_global_norm_of_0d_arrays_gives_0d_arrays():
    (a, b), g = clip_by_global_norm([np.float32(3), np.array(4, F32)], 1.0)
    assert g == 5.0
    assert a.shape == () and b.shape == () and a.dtype == b.dtype == F32
    assert (float(a), float(b)) == (float(F32(3) * F32(0.2)), float(F32(4) * F32(0.2)))


@settings(max_examples=150, deadline=None)
@given(
    st.data(),
    st.sampled_from([np.float32, np.float64, np.float16, ml_dtypes.bfloat16]),
    st.sampled_from([2, 1, np.inf, 3, 0.5, 2500.5]),
)
def test_small_norms_are_the_bits_of_an_accumulator_per_tensor(data, dtype, ord_):
    # 10,000 tiny tensors are measured in a few NumPy passes for all of them: every figure must be what each
    # tensor's own accumulator gives, at any scale (float64 at 1e-300 and 1e300: rescaled sums,
    # subnormal norms), with NaN and Inf, and tensors of no values.
    sizes = data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=12))
    scale = data.draw(st.sampled_from([1.0, 1e-300, 1e300, 5e-324]) if dtype is np.float64 else st.just(1.0))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    x = (rng.standard_normal(sum(sizes)) * scale).astype(dtype)
    for _ in range(data.draw(st.integers(0, 3))):
        if x.size:
            x[rng.integers(x.size)] = data.draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    piece = data.draw(st.sampled_from([None, 1, 37]))  # values a piece takes (found timing: in the cache)
    with pytest.MonkeyPatch.context() as patch:
        if piece is not None:
            patch.setattr(core_small, "PIECE", piece)
        small = small_norms(x, sizes, ord_)
    accs, total, start = [], NormAccumulator(ord_), 0
    for n in sizes:
        acc = NormAccumulator(ord_)
        acc.add(x[start : start + n])
        accs.append(acc)
        total.merge(acc)
        start += n
    want = [a.result() for a in accs]
    assert repr(small.norms().tolist()) == repr([w.norm for w in want])
    assert small.max_abs.tolist() == [w.max_abs for w in want]
    assert (small.nan.tolist(), small.inf.tolist()) == ([w.nan for w in want], [w.inf for w in want])
    assert [small.accumulator(i).result() for i in range(len(sizes))] == want
    merged = NormAccumulator(ord_)
    small.merge_into(merged)
    assert merged.result() == total.result()


def decimal_norm(xs, p: str) -> Decimal:
    """The p-norm of floats in 60-digit decimals, as max |x| * (sum of (|x| / max) ** p) ** (1/p): no power
    leaves the decimal range, whatever the order."""
    context = getcontext()
    context.prec, context.Emax, context.Emin = 60, MAX_EMAX, MIN_EMIN
    top = max(abs(Decimal(x)) for x in xs)
    return top * sum((abs(Decimal(x)) / top) ** Decimal(p) for x in xs) ** (1 / Decimal(p))


ORDERS = ["0.001", "0.01", "0.02", "0.05", "0.07", "0.1", "0.5", "1.5", "3", "999.5", "1000"]
ORDERS += ["1000.5", "1075", "1500", "4096.25", "1e6", "123456789.5", "1e12", "1e15"]


@pytest.mark.parametrize("p", ORDERS)
@pytest.mark.parametrize(
    "xs", [[3, 4], [3e-300, 4e-300], [1e30, 2, 5e-7], [1e300, 1e-300, 7.5], [5.0, 5.0 - 2**-50, 5.0 - 2**-49]]
)
def test_any_order_is_right_to_1e12(p, xs):
    # Found by a review: orders of 0.05 and below overflowed the root ((2**64) ** 20), exit 70; 1075 and
    # above underflowed a block's powers to 0 (a norm of 0 for [3, 4]): each block is now divided by its
    # largest magnitude above an order of 1000 (the spec: "any p > 0").
    exact = decimal_norm(xs, p)
    got = norm(np.array(xs, np.float64), ord=float(p))
    if exact > Decimal(sys.float_info.max):
        assert got == math.inf
    else:
        assert abs(Decimal(got) - exact) <= Decimal("1e-12") * exact
    assert norm(np.array([xs], np.float64), ord=float(p), axis=1)[0] == pytest.approx(float(exact), rel=1e-12)
    for special, expected in ((math.nan, math.nan), (math.inf, math.inf)):
        with_special = np.array([[*xs, special], [*xs, 0.0]])
        assert norm(with_special[0], ord=float(p)) == pytest.approx(expected, nan_ok=True)
        assert norm(with_special, ord=float(p), axis=1).tolist() == pytest.approx([expected, got], nan_ok=True)


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["0.5", "1.5", "2.5", "3", "7", "65", "100.5", "999.5", "1000", "1500", "1e6"]),
    st.lists(st.floats(-1.0, 1.0, allow_nan=False), min_size=1, max_size=20),
    st.floats(-250, 250),
)
def test_a_norm_of_any_order_is_right_to_a_few_ulps_at_any_scale(p, xs, exponent):
    # by reviews: --ord 1000 gave 2.9999999999999996 for [3.0], and 1.5 to 1000 were up to 3.8e-14 off (170
    # ulps) at 1e200: the root divided the sum's exponent by p in float64. Now by rationals.
    xs = [x * 10.0**exponent for x in xs]
    assume(any(xs))
    exact = decimal_norm(xs, p)
    got = norm(np.array(xs), ord=float(p))
    tolerance = max(Decimal("2e-15") * exact, Decimal(2.0**-1074))  # a subnormal norm: its spacing
    assert abs(Decimal(got) - exact) <= tolerance
    assert got >= max(abs(x) for x in xs)
    rows = norm(np.array([xs, xs[::-1]]), ord=float(p), axis=1)  # the axis path: its own sums, its own root
    assert all(abs(Decimal(r) - exact) <= tolerance and r >= max(map(abs, xs)) for r in rows)
    if float(p) > 1000:  # a block's largest power is exactly 1 there: one value's norm is itself
        assert norm(np.array(xs[:1]), ord=float(p)) == abs(xs[0])


@pytest.mark.parametrize("p", [1500.0, 1e6, 1e12, 1e15])
def test_a_high_order_norm_is_the_same_bits_in_any_chunks_and_bounded_in_memory(p):
    # blocks whose largest magnitudes lie 2**1700 apart: their sums' exponents p * 1700 bits apart (2e18 at
    # 1e15), which an exact integer sum could not hold; the sum keeps its top 4096 bits
    rng = np.random.default_rng(5)
    n = 5 * BLOCK + 123
    x = rng.standard_normal(n) * np.exp(rng.uniform(-600, 600, n))
    whole = NormAccumulator(p)
    whole.add(x)
    chunked = NormAccumulator(p)
    for start in range(0, n, 3001):
        chunked.add(x[start : start + 3001])
    merged = NormAccumulator(p)
    for start in range(0, n, BLOCK):
        part = NormAccumulator(p)
        part.add(x[start : start + BLOCK])
        merged.merge(part)
    assert whole.result() == chunked.result() == merged.result()
    assert whole._sum.acc.bit_length() <= 4097
    top = float(np.abs(x).max())
    exact = decimal_norm([float(v) for v in x[np.abs(x) >= top / 2]], str(p))  # the others add < 2**-1500
    assert abs(Decimal(whole.result().norm) - exact) <= Decimal("1e-12") * exact
    small = small_norms(x[:5000], [1000, 4000], ord=p).norms()
    assert small[1] == norm(x[1000:5000], ord=p)
    stats = core.diff(x, np.zeros(n), ord=p)
    assert stats.diff_norm == stats.norm_a == whole.result().norm


@pytest.mark.parametrize("p", [1.5e15, 1e300])
def test_orders_above_1e15_are_refused(p):
    with pytest.raises(ValueError, match=r"above 1e\+15 is not supported \(the norm is then the largest magnitude"):
        norm(np.array([3.0, 4.0]), ord=p)
    with pytest.raises(ValueError, match=r"above 1e\+15 is not supported"):
        NormAccumulator(p)


@pytest.mark.parametrize("p", [3.3, 33.3, 40.1, 300.3, 999.5])
@pytest.mark.parametrize("x", [1e300, 1e-300, 1e100])
def test_one_value_beyond_the_scale_limit_has_its_own_norm_at_fractional_orders(p, x):
    # found by a review: the exponent times p was a rounded float product (9e-14 off at e = 997), so the
    # norm of a single 1e300 came out 1.8e-14 (3.3) to 5.4e-14 (300.3) off
    assert norm(np.array([x, 0.0]), ord=p) == pytest.approx(x, rel=4e-16)
    assert norm(np.array([[x, 0.0]]), ord=p, axis=1)[0] == pytest.approx(x, rel=4e-16)


@pytest.mark.parametrize("p", [1e-4, 5e-4, 1 / 1074.5])
def test_an_axis_norm_of_a_tiny_order_is_the_whole_tensors(p):
    # found by a review: s ** (1/p) of a sum in [0.5, 1) underflowed below an order of 1/1074, and the
    # clamp to the largest magnitude returned 1.0 where the norm is 2**10000 (inf)
    for x in (np.array([1.0, 1.0]), np.array([5e-324, 5e-324]), np.array([0.0, 3.0])):
        whole = norm(x, ord=p)
        assert norm(x[:, None], ord=p, axis=0)[0] == pytest.approx(whole, rel=1e-9)
    assert norm(np.array([[0.0, 0.0], [1.0, np.nan], [np.inf, 1.0]]), ord=p, axis=1).tolist()[0] == 0.0


def test_tiny_float64_scales_never_overflow_and_keep_their_bits_per_slice():
    # found by a review: t * q with q in (0.5, 2) overflowed near 1.8e308 (inf written from finite values),
    # and per-slice scales (axes) below 2**-1022 were plain subnormals or 0 ([3e300, 3e300] -> [0, 0])
    h = math.hypot(1.7, 1.1)  # the norm is h * 1e308, beyond float64
    got = clip_by_norm(np.array([1.7e308, 1.1e308]), 1e-300)
    np.testing.assert_array_max_ulp(got, [1.7 / h * 1e-300, 1.1 / h * 1e-300], 3)
    x = np.array([[3e300, 3e300], [1.0, 2.0]])
    want = [[1e-300 / math.sqrt(2)] * 2, [1e-300 / math.sqrt(5), 2e-300 / math.sqrt(5)]]
    np.testing.assert_array_max_ulp(clip_by_norm(x, 1e-300, axes=1), want, 2)
    np.testing.assert_array_max_ulp(clip_by_norm(x.T, 1e-300, axes=0), np.array(want).T, 2)
    np.testing.assert_array_max_ulp(clip_by_norm(np.array([[1.7e308, 1.1e308]]), 3e-10, axes=0), [[3e-10] * 2], 1)
    got = clip_by_norm(np.array([[3.0, 4.0], [np.nan, 1.0], [np.inf, 1.0], [0.0, 0.0]]), 1.0, axes=1)
    np.testing.assert_array_max_ulp(got, [[0.6, 0.8], [np.nan, np.nan], [np.nan, 0.0], [0.0, 0.0]], 1)  # NaN in place
