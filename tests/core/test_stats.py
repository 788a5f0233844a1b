"""Exact tensor statistics against references: fractions for sums, NumPy for counts, ml_dtypes for casts."""

from __future__ import annotations

import itertools
import math
import pickle
from collections import Counter
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clipcli.core import blocks
from clipcli.core.blocks import BLOCK
from clipcli.core.casts import CAST_NAMES, TARGETS
from clipcli.core.stats import StatsAccumulator, TensorStats, default_casts, tensor_stats

CAST_TARGETS = [np.dtype(t) for t in (np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)]

FLOATS = [
    np.float16,
    ml_dtypes.bfloat16,
    np.float32,
    np.float64,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e8m0fnu,
    *(  # the other float8 kinds clipcli reads, those this ml_dtypes has
        getattr(ml_dtypes, n)
        for n in ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz", "float8_e4m3", "float8_e3m4")
        if hasattr(ml_dtypes, n)
    ),
]
INTEGERS = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64]
COMPLEX = [np.complex64, np.complex128]


def name(dtype) -> str:
    return np.dtype(dtype).name


def sample(dtype, n: int, seed: int = 0) -> np.ndarray:
    """n values of `dtype` spread over its range: normals of several scales, or random integers."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, n).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    if dtype.kind == "c":
        part = sample(np.float32 if dtype.itemsize == 8 else np.float64, 2 * n, seed)
        return part.view(dtype)
    if dtype == np.dtype(ml_dtypes.float8_e8m0fnu):
        return rng.integers(0, 255, n, dtype=np.uint8).view(dtype)
    scale = np.exp2(rng.integers(-30, 10, n)) if dtype.itemsize > 2 else np.exp2(rng.integers(-8, 4, n))
    with np.errstate(over="ignore"):
        return (rng.standard_normal(n) * scale).astype(dtype)


def values_of(t: np.ndarray) -> np.ndarray:
    """The values a `TensorStats` describes: a complex tensor's parts, in C order."""
    t = np.ascontiguousarray(t)
    if t.dtype.kind == "c":
        return t.view(np.float32 if t.dtype.itemsize == 8 else np.float64).reshape(-1)
    return t.reshape(-1)


def rounded_sqrt(q: Fraction) -> float:
    """sqrt(q), correctly rounded: the float whose midpoints with its neighbours enclose it (ties to even)."""
    k = (q.numerator.bit_length() - q.denominator.bit_length()) // 2  # q / 4**k lies near 1: no overflow
    r = math.ldexp(math.sqrt(float(q / Fraction(4) ** k)), k)
    for _ in range(4):
        below = (Fraction(math.nextafter(r, 0.0)) + Fraction(r)) ** 2 / 4
        above = (Fraction(r) + Fraction(math.nextafter(r, math.inf))) ** 2 / 4
        if q < below or (q == below and odd(r)):
            r = math.nextafter(r, 0.0)
        elif q > above or (q == above and odd(r)):
            r = math.nextafter(r, math.inf)
        else:
            return r
    raise AssertionError("not converged")


def odd(x: float) -> bool:
    """Whether the last bit of x's mantissa is 1."""
    return bool(np.array(x).view(np.uint64) & 1)


def test_a_std_on_a_midpoint_rounds_to_even():
    # found by a random sweep: (70144 - 9.968061931431293e-10) / 2 lies halfway between two float64s
    t = np.array([9.968061931431293e-10, 70144.0], ml_dtypes.bfloat16)
    exact = (Fraction(70144) - Fraction(float(t[0]))) / 2
    assert tensor_stats(t).std == float(exact) == rounded_sqrt(exact**2) == 35071.999999999505


def reference(t: np.ndarray, casts=None) -> dict:
    """Every figure of `TensorStats`, computed independently: Fractions for sums, NumPy float64 for the rest."""
    v = values_of(t)
    floating = v.dtype.kind not in "biu"
    if not floating:
        ints = [int(x) for x in v.tolist()]
        numbers = [Fraction(x) for x in ints]
        ref = {"nan": 0, "posinf": 0, "neginf": 0, "subnormals": 0, "exponents": (), "casts": ()}
        ref["min"] = min(ints, default=None)
        ref["max"] = max(ints, default=None)
        mags = [abs(x) for x in ints]
        ref["max_abs"] = max(mags, default=None)
        ref["argmax_abs"] = mags.index(ref["max_abs"]) if mags else None
        ref["zeros"] = ints.count(0)
    else:
        w = v.astype(np.float64)
        finite = np.isfinite(w)
        numbers = [Fraction(x) for x in w[finite].tolist()]
        notnan = ~np.isnan(w)
        ref = {"nan": int((~notnan).sum()), "posinf": int((w == np.inf).sum()), "neginf": int((w == -np.inf).sum())}
        ref["min"] = float(w[notnan].min()) + 0.0 if notnan.any() else None
        ref["max"] = float(w[notnan].max()) + 0.0 if notnan.any() else None
        mags = np.where(notnan, np.abs(w), -1.0)
        ref["max_abs"] = float(mags.max()) if notnan.any() else None
        ref["argmax_abs"] = int(np.argmax(mags)) if notnan.any() else None
        ref["zeros"] = int((w == 0).sum())
        tiny = float(ml_dtypes.finfo(v.dtype).smallest_normal)
        ref["subnormals"] = int(((w != 0) & (np.abs(w) < tiny)).sum())
        nonzero = w[finite & (w != 0)]
        ref["exponents"] = tuple(sorted(Counter((np.frexp(nonzero)[1] - 1).tolist()).items()))
        targets = [np.dtype(c) for c in (default_casts(t.dtype) if casts is None else casts)]
        ref["casts"] = tuple(cast_reference(v, c) for c in targets)
    n = v.size
    ref["count"] = n
    bad = ref["nan"] + ref["posinf"] + ref["neginf"]
    if not n:
        ref["mean"] = ref["std"] = None
    elif bad:
        both = ref["nan"] or (ref["posinf"] and ref["neginf"])
        ref["mean"] = math.nan if both else math.inf if ref["posinf"] else -math.inf
        ref["std"] = math.nan
    else:
        total = sum(numbers, Fraction(0))
        ref["mean"] = float(total / n)
        spread = sum(((x - total / n) ** 2 for x in numbers), Fraction(0)) / n
        ref["std"] = rounded_sqrt(spread) if spread else 0.0
    ref["all_zero"] = n > 0 and ref["zeros"] == n
    ref["constant"] = n > 1 and not ref["nan"] and ref["min"] == ref["max"]
    return ref


def cast_reference(v: np.ndarray, target: np.dtype) -> tuple:
    """(name, overflow, flush, subnormal, rel_error) from ml_dtypes' own cast, the error by Fractions."""
    w = v.astype(np.float64)
    if v.dtype == np.float64:  # ml_dtypes would round twice, through float32: rounded by Fractions
        c = np.array([rne(x, target) for x in w.tolist()])
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            c = v.astype(np.float32).astype(target).astype(np.float64)
    finite = np.isfinite(w)
    kept = finite & np.isfinite(c)
    tiny = float(ml_dtypes.finfo(target).smallest_normal)
    overflow = int((finite & ~np.isfinite(c)).sum())
    flush = int((finite & (w != 0) & (c == 0)).sum())
    subnormal = int((kept & (c != 0) & (np.abs(c) < tiny)).sum())
    a = [Fraction(x) for x in w[kept].tolist()]
    d = [Fraction(x) - Fraction(y) for x, y in zip(w[kept].tolist(), c[kept].tolist(), strict=True)]
    norm2 = sum((x * x for x in a), Fraction(0))
    rel = rounded_sqrt(sum((x * x for x in d), Fraction(0)) / norm2) if norm2 else None
    return (target.name, overflow, flush, subnormal, rel)


def rne(x: float, target: np.dtype) -> float:
    """x rounded to nearest even in `target`'s precision and exponents; inf beyond its largest finite value."""
    if not math.isfinite(x) or x == 0:
        return x
    info = ml_dtypes.finfo(target)
    low = max(math.frexp(x)[1], math.frexp(float(info.smallest_normal))[1]) - 1 - int(info.nmant)
    r = round(Fraction(x) / Fraction(2) ** low) * Fraction(2) ** low  # round(): to even on ties
    return math.copysign(math.inf, x) if r and abs(r) > Fraction(float(info.max)) else math.copysign(float(r), x)


def test_float64_casts_round_once():
    # ml_dtypes casts float64 to bfloat16 and float8 through float32, rounding twice: 1 + 2**-8 + 2**-40
    # became 1.0 in bfloat16 (not 1 + 2**-7), 1.0625 + 2**-40 became 1.0 in float8_e4m3fn (not 1.125)
    t = np.array([1 + 2**-8 + 2**-40, 1.0625 + 2**-40])
    bf16, e4m3 = np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)
    assert [rne(x, bf16) for x in t.tolist()] == [1 + 2**-7, 1.0625]
    assert [rne(x, e4m3) for x in t.tolist()] == [1.0, 1.125]
    s = tensor_stats(t, [bf16, e4m3])
    for got in s.casts:
        assert got.rel_error == pytest.approx(cast_reference(t, np.dtype(got.dtype))[4], rel=1e-12, abs=0)


def assert_matches(s: TensorStats, ref: dict, t: np.ndarray) -> None:
    assert s.dtype == name(t.dtype)
    for field in ("count", "nan", "posinf", "neginf", "zeros", "subnormals", "exponents", "all_zero", "constant"):
        assert getattr(s, field) == ref[field], field
    for field in ("min", "max", "max_abs", "argmax_abs", "mean", "std"):
        assert repr(getattr(s, field)) == repr(ref[field]), field  # repr: NaN equals NaN, -0.0 is not 0.0
    assert len(s.casts) == len(ref["casts"])
    for got, (target, overflow, flush, subnormal, rel) in zip(s.casts, ref["casts"], strict=True):
        assert (got.dtype, got.overflow, got.flush, got.subnormal) == (target, overflow, flush, subnormal), target
        if rel is None:
            assert got.rel_error is None
        else:  # exact squares, float64 sums per block in a fixed order, added exactly
            assert got.rel_error == pytest.approx(rel, rel=1e-12, abs=0), target


def fed(t: np.ndarray, cuts: list[int], order: list[int] | None = None, casts=None) -> TensorStats:
    """The statistics of `t` fed as chunks cut at `cuts` (flat indices), each to its own accumulator,
    merged in `order`."""
    flat = t.reshape(-1)
    edges = sorted({0, *cuts, flat.size})
    accs = [StatsAccumulator(t.dtype, casts)] if len(edges) < 2 else []
    for a, b in itertools.pairwise(edges):
        acc = StatsAccumulator(t.dtype, casts)
        acc.add(flat[a:b], a)
        accs.append(acc)
    order = order or list(range(len(accs)))
    total = accs[order[0]]
    for i in order[1:]:
        total.merge(accs[i])
    return total.result()


ALL = FLOATS + INTEGERS + COMPLEX


@pytest.mark.parametrize("dtype", ALL, ids=name)
@pytest.mark.parametrize("shape", [(), (0,), (2, 0), (1,), (7,), (3, 50)], ids=str)
def test_small_tensors_of_every_dtype_match_the_reference(dtype, shape):
    t = sample(dtype, int(np.prod(shape)), seed=len(shape)).reshape(shape)
    assert_matches(tensor_stats(t), reference(t), t)


@pytest.mark.parametrize("dtype", ALL, ids=name)
def test_a_tensor_larger_than_a_block_matches_the_reference(dtype):
    t = sample(dtype, 2 * BLOCK + 77, seed=1)
    s = tensor_stats(t)
    assert_matches(s, reference(t), t)
    assert repr(fed(t, [1, 5000, BLOCK, BLOCK + 3, 2 * BLOCK + 1])) == repr(s)


PLANTED = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -3e-39, 1e-310, 70000.0, -1e6, 500.0, 1e-9, 3e-8, 2.0**-25]


@pytest.mark.parametrize("dtype", FLOATS + COMPLEX, ids=name)
def test_planted_nan_inf_zeros_subnormals_and_overflows_are_counted(dtype):
    t = sample(dtype, 3 * BLOCK, seed=2)
    v = values_of(t).copy()
    with np.errstate(over="ignore", invalid="ignore"):
        planted = np.array(PLANTED).astype(v.dtype)
    v[[5, 17, BLOCK - 1, BLOCK, 2 * BLOCK + 9, 40, 41, 42, 43, 44, 45, 46, 47, 48]] = planted
    t = v.view(t.dtype)
    s = tensor_stats(t, casts=CAST_TARGETS)
    assert_matches(s, reference(t, CAST_TARGETS), t)


def test_every_cast_boundary_of_every_target_against_ml_dtypes():
    # the midpoints where round-to-nearest-even overflows, flushes or leaves the subnormals, and their neighbours
    edges = []
    for target in CAST_TARGETS:
        info = ml_dtypes.finfo(target)
        for x in (float(info.max), float(info.smallest_normal), float(info.smallest_subnormal)):
            up = x + max(2.0 ** (math.frexp(x)[1] - 1 - int(info.nmant)), float(info.smallest_subnormal))
            for point in (x, x / 2, (x + up) / 2, x * 1.5):
                edges += [point, np.nextafter(point, 0), np.nextafter(point, np.inf)]
    t = np.array(edges + [-e for e in edges])
    for dtype in (np.float64, np.float32):
        with np.errstate(over="ignore"):  # bfloat16's largest values lie beyond float32's: inf there
            v = t.astype(dtype)
        v = np.concatenate([v, np.nextafter(v, dtype(np.inf)), np.nextafter(v, dtype(0))])  # neighbours in dtype
        assert_matches(tensor_stats(v, CAST_TARGETS), reference(v, CAST_TARGETS), v)


def test_mean_and_std_are_correctly_rounded_where_float64_sums_cancel():
    # 1e8 and -1e8 around tiny values: a float64 running sum loses the tiny ones, the exact sum does not
    t = np.array([1e8, 3e-9, -1e8, 1e-30, 7.0, 2.0**-1074, -7.0, 5e-300], np.float64)
    s = tensor_stats(t)
    ref = reference(t)
    assert (s.mean, s.std) == (ref["mean"], ref["std"])
    assert s.mean == float(sum(map(Fraction, t.tolist())) / 8)


def test_float64_sums_are_exact_across_the_whole_range():
    rng = np.random.default_rng(5)
    t = rng.standard_normal(3000) * np.exp2(rng.integers(-1070, 1000, 3000))
    s = tensor_stats(t)
    ref = reference(t)
    assert (s.mean, s.std) == (ref["mean"], ref["std"])


def test_integers_sum_exactly_beyond_float64():
    t = np.array([2**63 - 1, 2**63 - 1, -(2**63), 5], np.int64)
    s = tensor_stats(t)
    assert s.mean == float(Fraction(sum(t.tolist()), 4))
    assert (s.min, s.max, s.max_abs, s.argmax_abs) == (-(2**63), 2**63 - 1, 2**63, 2)
    assert s.casts == () and s.exponents == ()
    u = np.array([2**64 - 1, 0], np.uint64)
    assert tensor_stats(u).mean == float(Fraction(2**64 - 1, 2))


def test_bools_read_from_raw_bytes_count_as_their_values():
    t = np.frombuffer(bytes([0, 2, 1, 255]), dtype=np.bool_)
    s = tensor_stats(t)
    assert (s.zeros, s.max, s.mean, s.argmax_abs) == (1, 1, 0.75, 1)


def test_all_zero_and_constant_tensors_are_flagged():
    zeros = tensor_stats(np.array([0.0, -0.0, 0.0], np.float32))
    assert zeros.all_zero and zeros.constant and zeros.std == 0.0 and zeros.max_abs == 0.0
    assert zeros.exponents == () and zeros.min == 0.0 and math.copysign(1, zeros.min) == 1
    ones = tensor_stats(np.full(BLOCK + 1, 0.1, ml_dtypes.bfloat16))
    assert ones.constant and not ones.all_zero and ones.std == 0.0
    assert ones.mean == float(np.array(0.1, ml_dtypes.bfloat16))
    assert not tensor_stats(np.array([1.0, np.nan])).constant
    assert not tensor_stats(np.float32(0)).constant and tensor_stats(np.float32(0)).all_zero
    assert not tensor_stats(np.zeros(0)).all_zero


def test_the_first_largest_magnitude_is_found_across_chunks_and_signs():
    t = np.array([1.0, -3.0, 2.0, 3.0, -3.0, np.nan, 3.0])
    assert tensor_stats(t).argmax_abs == 1
    assert fed(t, [2, 4], [2, 0, 1]).argmax_abs == 1
    assert tensor_stats(np.array([np.nan, np.nan])).max_abs is None
    assert tensor_stats(np.array([np.nan, -np.inf, 2.0])).argmax_abs == 1


def test_default_casts_are_the_narrower_standard_floats():
    assert default_casts(np.float32) == ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
    assert default_casts(np.complex64) == default_casts(np.float32)
    assert default_casts(np.float16) == ("float8_e4m3fn", "float8_e5m2")
    assert default_casts(ml_dtypes.float8_e5m2) == () and default_casts(np.int32) == ()


def test_cast_targets_figures_are_ml_dtypes_own():
    # fixed in clipcli.core.casts, so that a float32 run imports no ml_dtypes: each must be ml_dtypes' own
    assert tuple(t.name for t in CAST_TARGETS) == CAST_NAMES
    for target in CAST_TARGETS:
        info = ml_dtypes.finfo(target)
        smallest = math.frexp(float(info.smallest_normal))[1] - 1
        assert TARGETS[target.name] == (target.itemsize, int(info.nmant) + 1, smallest, float(info.max)), target.name
        assert type(TARGETS[target.name].max) is float and 2.0**smallest == float(info.smallest_normal)


def test_targets_given_as_names_dtypes_or_numpy_spellings_are_the_same():
    t = sample(np.float32, 100)
    names = tensor_stats(t, ["float8_e5m2", "bfloat16"])
    assert [c.dtype for c in names.casts] == ["float8_e5m2", "bfloat16"]
    assert repr(tensor_stats(t, [ml_dtypes.float8_e5m2, np.dtype(ml_dtypes.bfloat16)])) == repr(names)
    assert repr(tensor_stats(t, ["f2"])) == repr(tensor_stats(t, ["float16"]))


def test_wrong_dtypes_and_targets_are_refused():
    with pytest.raises(TypeError):
        StatsAccumulator(object)
    with pytest.raises(ValueError, match="cast targets"):
        StatsAccumulator(np.float32, ["float64"])
    acc = StatsAccumulator(np.float32)
    with pytest.raises(TypeError, match="float32"):
        acc.add(np.zeros(2), 0)
    with pytest.raises(ValueError, match="merge"):
        acc.merge(StatsAccumulator(np.float64))


def test_big_endian_chunks_give_the_native_statistics():
    t = sample(np.float32, 1000, seed=9)
    acc = StatsAccumulator(np.dtype(">f4"))
    acc.add(t.astype(">f4"), 0)
    assert repr(acc.result()) == repr(tensor_stats(t))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.float64, np.complex64, np.int32])
@pytest.mark.parametrize("chunk", [1, 1000, BLOCK - 1, BLOCK, BLOCK + 1])
def test_chunks_of_several_sizes_give_the_bits_of_one(dtype, chunk):
    n = 1 + 2 * BLOCK + 5 if chunk > 1 else 300
    t = sample(dtype, n, seed=3)
    acc = StatsAccumulator(t.dtype)
    for start in range(0, n, chunk):
        acc.add(t[start : start + chunk], start)
    assert repr(acc.result()) == repr(tensor_stats(t))


@st.composite
def split_tensors(draw):
    dtype = draw(st.sampled_from([np.float32, np.float16, ml_dtypes.float8_e4m3fn, np.float64, np.int16]))
    n = draw(st.integers(0, 2 * BLOCK + 50))
    cuts = draw(st.lists(st.integers(0, n), max_size=6))
    order = draw(st.permutations(range(len(set(cuts) | {0, n}) + 1)))
    return sample(dtype, n, seed=draw(st.integers(0, 9))), cuts, order


@settings(max_examples=30, deadline=None)
@given(split_tensors())
def test_merging_chunks_in_any_order_gives_the_bits_of_one_pass(case):
    t, cuts, order = case
    chunks = len({0, *cuts, t.size}) - 1
    order = [i for i in order if i < chunks] or [0]  # an empty tensor: no chunk, one empty accumulator
    assert repr(fed(t, cuts, order)) == repr(tensor_stats(t))


# --- the fused loop (clipcli/_fused.c, stats_f32) against the NumPy path, bit for bit ----------------------

needs_loops = pytest.mark.skipif(blocks._fused is None, reason="clipcli/_fused.c was not built (no compiler?)")

# Every kind of float32 the loop tells apart: NaN (quiet, signalling, negative), ±inf, ±0, subnormals,
# each target's flush, subnormal and overflow edges and neighbours, 464 (float8_e4m3fn's last kept) and
# its neighbour, bfloat16's overflow tie and float32's largest
EDGES32 = np.array(
    [
        *(0x7FC00000, 0x7F800001, 0xFFC00001, 0x7F800000, 0xFF800000, 0, 0x80000000, 1, 0x807FFFFF, 0x8000, 0x8001),
        *(0x33000000, 0x33000001, 0x387FE000, 0x387FDFFF, 0x477FF000, 0x477FEFFF, 0x43E80000, 0x43E80001),
        *(0x3A800000, 0x3C700000, 0x47700000, 0x476FFFFF, 0x37000000, 0x38600000, 0x7F7F8000, 0x7F7F7FFF, 0x7F7FFFFF),
    ],
    np.uint32,
)


def planted32(n: int, seed: int) -> np.ndarray:
    """float32 values of every scale, a share of them made edges of `EDGES32` (either sign)."""
    rng = np.random.default_rng(seed)
    v = (rng.standard_normal(n) * np.exp2(rng.integers(-140, 100, n))).astype(np.float32)
    bits = v.view(np.uint32)
    where = rng.random(n) < 0.05
    bits[where] = rng.choice(EDGES32, int(where.sum())) ^ (rng.integers(0, 2, int(where.sum()), np.uint32) << 31)
    return v


def without_loops(monkeypatch, f, *args):
    """f(*args) on the NumPy path: `_fused` taken away for the call."""
    with monkeypatch.context() as m:
        m.setattr(blocks, "_fused", None)
        return f(*args)


@needs_loops
@pytest.mark.parametrize("seed", range(3))
def test_the_fused_loop_gives_the_bits_of_numpy_for_every_kind_of_float32(monkeypatch, seed):
    t = planted32(3 * BLOCK + 1001, seed)
    cuts = [3, 4000, BLOCK + 17, 2 * BLOCK, 2 * BLOCK + 8, 3 * BLOCK + 999]
    fused = fed(t, cuts, [4, 0, 6, 2, 1, 5, 3])
    assert repr(fused) == repr(without_loops(monkeypatch, fed, t, cuts, [2, 6, 5, 4, 0, 1, 3]))
    assert repr(fused) == repr(tensor_stats(t))
    with np.errstate(invalid="ignore"):  # the reference widens signalling NaNs
        assert_matches(fused, reference(t), t)


@needs_loops
@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=40), st.integers(0, 2 * BLOCK), st.integers(1, 100))
def test_any_float32_bits_give_the_bits_of_numpy(bits, filler, cut):
    # random bit patterns: NaN payloads, subnormals and every exponent, in a run of ordinary values
    t = np.concatenate([np.array(bits, np.uint32).view(np.float32), np.linspace(-2, 3, filler, dtype=np.float32)])
    cuts = [min(cut, t.size), max(t.size - cut, 0)]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(blocks, "_fused", None)
        slow = fed(t, cuts)
    assert repr(fed(t, cuts, list(range(len({0, *cuts, t.size}) - 2, -1, -1)) or [0])) == repr(slow)
    with np.errstate(invalid="ignore"):  # the reference widens signalling NaNs
        assert_matches(tensor_stats(t), reference(t), t)


@needs_loops
def test_complex64_parts_take_the_fused_loop_with_the_same_bits(monkeypatch):
    t = planted32(2 * BLOCK + 6, 7).view(np.complex64)
    assert repr(tensor_stats(t)) == repr(without_loops(monkeypatch, tensor_stats, t))


def weights32(n: int, seed: int) -> np.ndarray:
    """float32 weights (normals of scale 0.02) in long ordinary runs, a few values made edges of `EDGES32`."""
    rng = np.random.default_rng(seed)
    v = (rng.standard_normal(n) * 0.02).astype(np.float32)
    bits = v.view(np.uint32)
    where = rng.random(n) < 0.003
    bits[where] = rng.choice(EDGES32, int(where.sum())) ^ (rng.integers(0, 2, int(where.sum()), np.uint32) << 31)
    return v


def fused_totals(out: np.ndarray) -> tuple[int, int]:
    """Σx · 2**149 and Σx² · 2**298 from `_fused.stats_f32`'s sums per exponent field (exact integers)."""
    shift = [max(e, 1) - 1 for e in range(255)]
    total = sum(int(out[256 + e]) << shift[e] for e in range(255))
    squares = sum(((int(out[768 + e]) % 2**64) << 64 | int(out[512 + e]) % 2**64) << 2 * shift[e] for e in range(255))
    return total, squares


def fused_runs(t: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """`_fused.stats_f32`'s counts and error rows of t from the AVX-512 loop (where the machine has it) and the
    generic one."""
    runs = []
    for wide in (True, False):
        out, errors = blocks.fused_stats_state(), np.zeros(((t.size + BLOCK - 1) // BLOCK, 9))
        blocks._fused.stats_f32(t, out, errors, 5, wide)
        runs.append((out, errors))
    return runs


def assert_same_runs(runs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """The two loops' counts, extremes and error sums are the same bits, and their exact sums the same numbers
    (the AVX-512 loop puts the sums of the values in a block's window apart from the others': the shares per
    exponent field differ)."""
    (wide, wide_errors), (generic, generic_errors) = runs
    assert np.array_equal(wide[:256], generic[:256])
    assert np.array_equal(wide[1024:], generic[1024:])
    assert fused_totals(wide) == fused_totals(generic)
    assert wide_errors.tobytes() == generic_errors.tobytes()


def assert_exact_both_signs(monkeypatch, t: np.ndarray) -> None:
    """For t and -t: the two loops agree (`assert_same_runs`), their exact sums of x and x² are those of
    `Fraction`, and the statistics are those of NumPy's path."""
    for x in (t, -t):
        runs = fused_runs(x)
        assert_same_runs(runs)
        total, squares = fused_totals(runs[0][0])
        exact = [Fraction(float(v)) for v in x]
        assert Fraction(total, 2**149) == sum(exact)
        assert Fraction(squares, 2**298) == sum(v * v for v in exact)
        assert repr(tensor_stats(x)) == repr(without_loops(monkeypatch, tensor_stats, x))


@needs_loops
@pytest.mark.parametrize("seed", range(3))
def test_the_avx512_loop_gives_the_bits_of_the_generic_loop(monkeypatch, seed):
    # the AVX-512 loop (where the machine has it) takes the runs of ordinary values; wide=False leaves all to
    # the generic loop: counts, exact sums, extremes and every error sum must be the same, and NumPy's
    t = weights32(3 * BLOCK + 1001, seed)
    assert_same_runs(fused_runs(t))
    cuts = [16, BLOCK + 24, 2 * BLOCK + 8]
    fused = fed(t, cuts, [2, 0, 3, 1])
    assert repr(fused) == repr(without_loops(monkeypatch, fed, t, cuts, [1, 3, 0, 2]))
    with np.errstate(invalid="ignore"):  # the reference widens signalling NaNs
        assert_matches(fused, reference(t), t)


@needs_loops
def test_the_avx512_loop_gives_the_bits_of_the_generic_loop_for_values_spread_far_below_their_largest():
    # a block with many values below its window makes the next one take the bins for all values, until a block
    # has few again: spread blocks, then narrow ones, then spread again
    rng = np.random.default_rng(3)
    spread = (rng.choice([-1.0, 1.0], 2 * BLOCK) * np.exp2(rng.uniform(-60, 0, 2 * BLOCK))).astype(np.float32)
    t = np.concatenate([spread, weights32(2 * BLOCK + 5, 4), spread[: BLOCK + 40], planted32(BLOCK, 5)])
    assert_same_runs(fused_runs(t))
    assert_same_runs(fused_runs(-t))


@needs_loops
def test_a_block_that_outgrows_the_window_of_the_block_before_gives_the_bits_of_the_generic_loop(monkeypatch):
    # after blocks of ordinary values whose largest lie within a binade of each other, the AVX-512 loop opens the
    # window of the block before's largest, a binade up, and stops at a value above it: the rest of the block
    # takes a window of its own. Rises at the second group, mid-group and at the last value, by one binade and
    # by many; blocks far below the window; zeros; each after a run of steady blocks
    rng = np.random.default_rng(7)
    scales = [1e-3] * 3 + [1e-3] * 4 + [1e-3] * 4 + [1e-6] * 4 + [0.0] * 2 + [1e-2] * 4 + [2.0**-120] * 2
    t = np.concatenate([rng.standard_normal(BLOCK) * s for s in scales]).astype(np.float32)
    top = float(np.abs(t[2 * BLOCK : 3 * BLOCK]).max())
    t[3 * BLOCK + 16] = 4 * top  # two binades above the block before's: above its window, in the second group
    t[3 * BLOCK + BLOCK // 2 + 5 :][: BLOCK // 2 - 5] *= 1e6  # and far above, from mid-group to the block's end
    t[8 * BLOCK - 1] = 400.0  # the last value of a block, in the largest ordinary binade
    t[9 * BLOCK + 3] = 2 * float(np.abs(t[8 * BLOCK - BLOCK : 8 * BLOCK - 1]).max())  # a binade up: in the window
    t[19 * BLOCK + 40] = 1.0  # after zeros
    assert_exact_both_signs(monkeypatch, t)


@needs_loops
@pytest.mark.parametrize("top", [0x43E7FFFF, 0x3F7FFFFF, 0x0C7FFFFF, 0x057FFFFF])
def test_the_avx512_window_sums_stay_exact_at_their_bounds(monkeypatch, top):
    # the AVX-512 loop sums a block's values whose exponent field lies within 18 of the largest's (464's at
    # most) in float64 lanes: blocks of the largest significands of one sign at the window's top and bottom,
    # and just below it (those go to the bins), must keep every bit of the exact sums
    e = top >> 23
    rows = []
    for fields in ([e], [e, e - 18], [e, e - 18, e - 19], [e - 18, e - 19, 1, 0]):
        # the largest significand of each field, and a power of two (its least) at the window's edges
        bits = np.array([max(f, 0) << 23 | 0x7FFFFF for f in fields] + [max(f, 0) << 23 for f in fields[1:]], np.uint32)
        rows.append(np.resize(bits, BLOCK))
    t = np.concatenate(rows).view(np.float32)
    assert_exact_both_signs(monkeypatch, t)


def test_cast_errors_beside_values_that_overflow_keep_their_precision():
    # found when the norm kept by a cast was the sum of all finite x² less those that overflow: 1e10's
    # square swamped the small values' (float16's rel_error was off by 2e-9)
    t = np.concatenate([np.array([1e5, -3e5, 1e10], np.float32), sample(np.float32, BLOCK, seed=4) * 1e-3])
    assert_matches(tensor_stats(t, CAST_TARGETS), reference(t, CAST_TARGETS), t)


def test_a_pickled_accumulator_is_small_and_merges_to_the_bits_of_one_pass():
    t = planted32(5 * BLOCK + 3, 8)
    head, tail = StatsAccumulator(t.dtype), StatsAccumulator(t.dtype)
    head.add(t[: 2 * BLOCK + 5], 0)
    tail.add(t[2 * BLOCK + 5 :], 2 * BLOCK + 5)
    sent = pickle.dumps(tail)  # a worker's accumulator, as the engine sends it
    assert len(sent) < 64 << 10  # no per-value state: the counts, sums and the values of blocks cut in two
    head.merge(pickle.loads(sent))
    assert repr(head.result()) == repr(tensor_stats(t))


def test_an_accumulator_of_whole_blocks_pickles_in_a_few_kib():
    # found profiling stats' parent: each worker sent ~19 KiB a tensor (all 2,200 exponent bins, 18 ExactSum
    # objects), 2.5 MB and ~10 ms of pickling for a 2 GiB checkpoint; the used bins and (integer, exponent) pairs
    t = planted32(5 * BLOCK, 9)
    part = StatsAccumulator(t.dtype)
    part.add(t[2 * BLOCK :], 2 * BLOCK)
    sent = pickle.dumps(part)
    assert len(sent) < 4 << 10
    whole = StatsAccumulator(t.dtype)
    whole.add(t[: 2 * BLOCK], 0)
    whole.merge(pickle.loads(sent))
    assert repr(whole.result()) == repr(tensor_stats(t))
    empty = pickle.loads(pickle.dumps(StatsAccumulator(np.float64, ["float16"])))  # no bins used, one target
    assert repr(empty.result()) == repr(tensor_stats(np.zeros(0), ["float16"]))


@needs_loops
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(0, 40), spread=st.sampled_from([0, 10, 50, 51, 1100]))
@settings(max_examples=60, deadline=None)
def test_exact_columns_are_the_exact_sums_of_the_error_rows(seed, rows, spread):
    rng = np.random.default_rng(seed)
    sums = rng.random((rows, 9)) * np.exp2(rng.integers(-spread, 1, (rows, 9)).astype(float) - 500 * (spread > 1000))
    sums[rng.random((rows, 9)) < 0.2] = 0.0
    sums[:, 4] = 0.0  # a column all zeros
    if rows:
        sums[0, 5] = 5e-324  # the smallest subnormal
    for j, exact in enumerate(blocks.fused_exact_columns(sums)):
        terms = [Fraction(x) for x in sums[:, j].tolist()]
        nonzero = [math.frexp(x)[1] for x in sums[:, j].tolist() if x]
        if exact is None:  # the caller adds a column of terms more than 50 binades apart another way
            assert max(nonzero) - min(nonzero) > 50
        else:
            assert Fraction(exact[0]) * Fraction(2) ** exact[1] == sum(terms, Fraction(0))
    assert blocks.fused_exact_columns(np.array([[1.0, -1.0, np.inf]]))[1:] == [None, None]
