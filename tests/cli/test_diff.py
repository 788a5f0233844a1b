"""clipcli diff: two checkpoints compared tensor by tensor, against exact references (fractions, fsum)."""

from __future__ import annotations

import json
import math
import shutil
from decimal import Decimal, getcontext
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from clipcli import core
from clipcli.checkpoint import engine as _engine
from clipcli.checkpoint import open_checkpoint
from clipcli.core.blocks import BLOCK
from clipcli.core.differences import DiffAccumulator
from tests.helpers import DATA, SAMPLES, js, ok, run, write_st

F32 = np.float32


def exact_norm(values) -> float:
    """The 2-norm of float values, exactly rounded (Fraction sum, Decimal root)."""
    total = sum((Fraction(float(v)) ** 2 for v in np.ravel(values)), Fraction(0))
    getcontext().prec = 60
    return float((Decimal(total.numerator) / Decimal(total.denominator)).sqrt())


def exact_diff_norm(a, b) -> float:
    return exact_norm([Fraction(float(x)) - Fraction(float(y)) for x, y in zip(np.ravel(a), np.ravel(b), strict=True)])


def diff_json(*args) -> dict:
    return json.loads(ok("diff", *args, "--format", "json").stdout)


@pytest.fixture
def pair(tmp_path):
    def make(a: dict, b: dict, suffix_b: str = ".safetensors"):
        pa = write_st(tmp_path / "a.safetensors", a)
        pb = tmp_path / f"b{suffix_b}"
        if suffix_b == ".npz":
            np.savez(pb, **b)
        else:
            write_st(pb, b)
        return pa, pb

    return make


def test_a_file_diffed_with_itself(tmp_path):
    src = SAMPLES / "grads.safetensors"
    d = diff_json(src, src)
    assert (d["diff_norm"], d["rel"], d["cosine"], d["changed"], d["different"]) == (0.0, 0.0, 1.0, 0, [])
    assert d["identical_count"] == d["tensor_count"] == 16
    assert all(t["identical"] and t["max_abs_diff"] == 0 for t in d["tensors"])
    assert d["norm_a"] == d["norm_b"] == js("global-norm", src)["checkpoints"][0]["global_norm"]
    table = ok("diff", src, src).stdout
    assert "16 tensors identical, bit for bit" in table and "|A-B|" not in table  # no rows of zeros
    assert run("diff", src, src, "--fail-different", "--fail-above", "0", "--fail-rel-above", "0").exit_code == 0


def test_one_element_off_by_one_ulp(pair):
    a = np.linspace(-1, 1, 1001).astype(F32)
    b = a.copy()
    b[500] = np.nextafter(b[500], F32(2))
    pa, pb = pair({"w": a}, {"w": b})
    d = diff_json(pa, pb)
    ulp = float(b[500]) - float(a[500])
    assert d["diff_norm"] == ulp == d["max_abs_diff"] and d["changed"] == 1
    assert d["rel"] == pytest.approx(ulp / exact_norm(a), rel=1e-15)
    assert d["different"] == ["1 tensor differs (w)"]
    assert run("diff", pa, pb, "--fail-different").exit_code == 1
    assert run("diff", pa, pb).exit_code == 0  # no gate: like git diff
    assert run("diff", pa, pb, "--fail-above", repr(ulp)).exit_code == 0
    assert run("diff", pa, pb, "--fail-above", repr(ulp / 2)).exit_code == 1


def test_float32_against_its_bfloat16_by_value(pair):
    a = np.random.default_rng(1).standard_normal(10_000).astype(F32)
    b = a.astype(ml_dtypes.bfloat16)
    pa, pb = pair({"w": a}, {"w": b})
    (t,) = diff_json(pa, pb)["tensors"]
    assert (t["dtype_a"], t["dtype_b"], t["identical"]) == ("float32", "bfloat16", False)
    assert t["diff_norm"] == pytest.approx(exact_diff_norm(a, b.astype(np.float64)), rel=1e-13)
    assert t["norm_b"] == pytest.approx(exact_norm(b.astype(np.float64)), rel=1e-13)


def test_fail_different_says_when_only_the_dtype_differs(pair):
    # a review: "5 tensors differ" beside a report of 0 changed values read as a contradiction
    b = np.random.default_rng(2).standard_normal(8).astype(ml_dtypes.bfloat16)
    pa, pb = pair({"w": b.astype(F32), "v": np.ones(3, F32)}, {"w": b, "v": np.zeros(3, F32)})
    result = run("diff", pa, pb, "--fail-different")
    assert result.exit_code == 1
    assert "1 tensor differs (v)" in result.output
    assert "1 tensor differs in dtype only (w)" in result.output


def test_nearly_parallel_tensors_get_their_cosine_right_to_1e_12(pair):
    rng = np.random.default_rng(2)
    a = rng.standard_normal(50_000)
    b = a + 1e-5 * rng.standard_normal(50_000)  # cosine ~ 1 - 5e-11
    pa, pb = pair({"w": a}, {"w": b})
    d = diff_json(pa, pb)
    fa, fb = [Fraction(float(x)) for x in a], [Fraction(float(x)) for x in b]
    dot = sum((x * y for x, y in zip(fa, fb, strict=True)), Fraction(0))
    aa = sum((x * x for x in fa), Fraction(0))
    bb = sum((y * y for y in fb), Fraction(0))
    getcontext().prec = 60
    product = aa * bb
    exact = (
        Decimal(dot.numerator) / Decimal(dot.denominator) / (Decimal(product.numerator) / product.denominator).sqrt()
    )
    assert 1 - float(exact) > 1e-11  # nearly parallel indeed
    assert abs(d["cosine"] - float(exact)) <= 1e-12
    (t,) = d["tensors"]
    assert abs(t["cosine"] - float(exact)) <= 1e-12


def test_a_zero_tensor(pair):
    pa, pb = pair({"z": np.zeros(4, F32), "w": np.ones(3, F32)}, {"z": np.ones(4, F32), "w": np.ones(3, F32)})
    rows = {t["name"]: t for t in diff_json(pa, pb)["tensors"]}
    assert (rows["z"]["rel"], rows["z"]["cosine"], rows["z"]["norm_a"]) == (None, None, 0.0)
    only_zero = pair({"z": np.zeros(4, F32)}, {"z": np.ones(4, F32)})
    d = diff_json(*only_zero)
    assert d["rel"] is None and d["diff_norm"] == 2.0
    assert run("diff", *only_zero, "--fail-rel-above", "1000").exit_code == 1  # ‖A‖ is 0 and ‖A−B‖ is not
    same_zero = pair({"z": np.zeros(4, F32)}, {"z": np.zeros(4, F32)})
    assert run("diff", *same_zero, "--fail-rel-above", "0").exit_code == 0


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_nonfinite_values_on_both_sides_at_the_same_place_are_no_difference(pair, value):
    a = np.array([1.0, value, 3.0], F32)
    pa, pb = pair({"w": a}, {"w": a.copy()})
    d = diff_json(pa, pb)
    assert (d["diff_norm"], d["max_abs_diff"], d["changed"]) == (0.0, 0.0, 0)
    assert d["cosine"] == "nan"  # a side holds NaN or Inf


def test_nan_on_one_side_makes_the_difference_nan_and_gates_fail(pair):
    pa, pb = pair({"w": np.array([1.0, 2.0], F32)}, {"w": np.array([1.0, np.nan], F32)})
    d = diff_json(pa, pb)
    assert d["diff_norm"] == "nan" and d["changed"] == 1
    assert run("diff", pa, pb, "--fail-above", "1e30").exit_code == 1
    assert run("diff", pa, pb, "--fail-rel-above", "1e30").exit_code == 1
    inf = pair({"w": np.array([1.0, 2.0], F32)}, {"w": np.array([1.0, np.inf], F32)})
    assert diff_json(*inf)["diff_norm"] == "inf"


def test_names_and_shapes_that_differ_are_listed_and_filtered(pair):
    pa, pb = pair(
        {"a.w": np.ones(2, F32), "only.a": np.ones(1, F32), "s.w": np.ones((2, 2), F32)},
        {"a.w": np.ones(2, F32), "only.b": np.ones(1, F32), "s.w": np.ones((2, 3), F32)},
    )
    d = diff_json(pa, pb)
    assert (d["only_a"], d["only_b"]) == (["only.a"], ["only.b"])
    assert d["mismatched"] == [{"name": "s.w", "shape_a": [2, 2], "shape_b": [2, 3], "reason": "shapes differ"}]
    filtered = diff_json(pa, pb, "--include", "a.*")
    assert (filtered["only_a"], filtered["only_b"], filtered["mismatched"], filtered["different"]) == ([], [], [], [])
    result = run("diff", pa, pb, "--fail-different")
    assert result.exit_code == 1 and "1 only in A (only.a)" in result.stderr and "shapes differ" in result.stderr


def test_an_empty_selection_is_a_usage_error(pair):
    pa, pb = pair({"w": np.ones(2, F32)}, {"w": np.ones(2, F32)})
    result = run("diff", pa, pb, "--include", "nothing.*")
    assert result.exit_code == 2 and "no tensor matches 'nothing.*'" in result.stderr
    disjoint = pair({"x": np.ones(2, F32)}, {"y": np.ones(2, F32)})
    assert run("diff", *disjoint, "--fail-above", "1").exit_code == 2  # nothing compared: the gate cannot pass
    assert run("diff", *disjoint, "--fail-different").exit_code == 1


def test_formats_and_layouts_compare_by_value(tmp_path):
    grads, npz, sharded = SAMPLES / "grads.safetensors", SAMPLES / "grads.npz", SAMPLES / "sharded"
    # sharded against merged: the same tensors; the metadata differs (issue 22 item 20: it counts)
    assert diff_json(grads, sharded)["different"] == ["1 metadata key differs (source)"]
    assert run("diff", grads, sharded, "--fail-different").exit_code == 1
    d = diff_json(grads, npz)  # the npz holds the bfloat16 tensors widened to float32, exactly
    assert d["diff_norm"] == 0.0 and d["changed"] == 0
    assert {t["identical"] for t in d["tensors"] if t["dtype_a"] == "bfloat16"} == {False}
    assert run("diff", grads, npz, "--fail-different").exit_code == 1  # the dtypes differ
    deflated = tmp_path / "deflated.npz"
    with np.load(npz) as z:
        np.savez_compressed(deflated, **{k: z[k] for k in z.files})
    assert run("diff", npz, deflated, "--fail-different").exit_code == 0  # streamed against read in place


def test_a_pytorch_file_against_its_conversion(tmp_path):
    source = DATA / "torch" / "grads.pt"
    out = tmp_path / "grads.safetensors"
    ok("convert", source, "-o", out, "--quiet")
    assert run("diff", source, out, "--fail-different").exit_code == 0


def test_gates_on_both_sides_of_their_thresholds(pair):
    a = np.ones(4, F32)
    b = a * F32(1.5)
    pa, pb = pair({"w": a}, {"w": b})
    d = diff_json(pa, pb)
    assert (d["diff_norm"], d["rel"]) == (1.0, 0.5)
    assert run("diff", pa, pb, "--fail-above", "1").exit_code == 0
    assert run("diff", pa, pb, "--fail-above", "0.999").exit_code == 1
    assert run("diff", pa, pb, "--fail-rel-above", "0.5").exit_code == 0
    result = run("diff", pa, pb, "--fail-rel-above", "0.49")
    assert result.exit_code == 1 and "exceeds --fail-rel-above 0.49" in result.stderr


def test_depth_sort_and_top():
    grads = SAMPLES / "grads.safetensors"
    other = SAMPLES / "grads.npz"
    d = diff_json(grads, other, "--depth", "3", "--sort", "name", "--top", "3")
    assert len(d["tensors"]) == 3 and [t["name"] for t in d["tensors"]] == sorted(t["name"] for t in d["tensors"])
    assert {g["name"] for g in d["groups"]} >= {"model.layers.0", "model.layers.1"}
    assert d["tensor_count"] == 16 and d["group_count"] == 4


def _diffs(ckpt_a, ckpt_b, kind, jobs):
    pairs = [(t, next(u for u in ckpt_b.tensors if u.name == t.name)) for t in ckpt_a.tensors]
    from clipcli.checkpoint.pairs import run_pairs
    from clipcli.commands.diff import DiffKernel

    results = run_pairs(
        (ckpt_a, ckpt_b), pairs, lambda: DiffKernel(2.0, pairs, [True] * len(pairs)), jobs, BLOCK, kind=kind
    )
    accs = {}
    for worker, _, _, _ in results:
        for i, acc in worker.items():
            accs.setdefault(i, DiffAccumulator(2.0)).merge(acc)
    return {pairs[i][0].name: acc.result() for i, acc in accs.items()}


def test_a_pairs_last_chunk_taken_before_the_others_keeps_its_blocks():
    # a worker may take a pair's last chunk (not whole blocks) before others of it: it was kept open as a block
    # that the next chunk's values filled, so that the block sums, and the last bits of rel and the cosine,
    # depended on which worker took which chunk (found by test_the_same_bits_for_any_workers, now and then)
    from clipcli.checkpoint import TensorInfo
    from clipcli.commands.diff import DiffKernel

    rng = np.random.default_rng(11)
    a = rng.standard_normal(3 * BLOCK + 1000).astype(F32)
    b = (a * np.float32(1.001)).astype(ml_dtypes.bfloat16)
    info = TensorInfo("x", "float32", a.shape, a.nbytes, "f", a.dtype)
    pieces = [(0, BLOCK), (BLOCK, 2 * BLOCK), (2 * BLOCK, 3 * BLOCK), (3 * BLOCK, a.size)]
    results = []
    for order in (pieces, pieces[::-1], [pieces[3], pieces[0], pieces[2], pieces[1]]):
        kernel = DiffKernel(2.0, [(info, info)], [True])
        for start, end in order:
            kernel.pair(0, start, a[start:end], b[start:end], False)
        results.append(kernel.result()[0][0].result())
    assert results[0] == results[1] == results[2] == core.diff(a, b)


def test_the_same_bits_for_any_workers(tmp_path, monkeypatch):
    rng = np.random.default_rng(5)
    a = {"x": rng.standard_normal(300_001).astype(F32), "y": rng.standard_normal((500, 301)).astype(np.float64)}
    b = {"x": (a["x"] * 1.0001).astype(ml_dtypes.bfloat16), "y": a["y"] + 1e-9}
    pa, pb = write_st(tmp_path / "a.safetensors", a), write_st(tmp_path / "b.safetensors", b)
    monkeypatch.setattr(_engine, "CHUNK_BYTES", 1 << 17)
    monkeypatch.setattr(_engine, "_MIN_CHUNK", 1 << 17)
    monkeypatch.setattr(_engine, "_BYTES_PER_WORKER", 1)
    with open_checkpoint(pa) as ca, open_checkpoint(pb) as cb:
        outcomes = [_diffs(ca, cb, kind, jobs) for kind, jobs in (("inline", 1), ("threads", 3), ("processes", 2))]
    assert outcomes[0] == outcomes[1] == outcomes[2]
    whole = core.diff(a["x"], b["x"])
    assert outcomes[0]["x"] == whole


def test_the_library_diff_is_exported():
    import clipcli

    stats = clipcli.diff(np.array([3.0, 4.0]), np.array([3.0, 0.0]))
    assert (stats.diff_norm, stats.norm_a, stats.rel) == (4.0, 5.0, 0.8)


def test_a_copy_with_different_tensor_order_is_the_same(tmp_path):
    src = SAMPLES / "grads.safetensors"
    with open_checkpoint(src) as ckpt:
        tensors, metadata = {t.name: ckpt.read(t) for t in ckpt.tensors}, ckpt.metadata
    reordered = write_st(tmp_path / "r.safetensors", dict(reversed(list(tensors.items()))), metadata)
    assert run("diff", src, reordered, "--fail-different").exit_code == 0
    shutil.copy(src, tmp_path / "copy.safetensors")
    assert run("diff", src, tmp_path / "copy.safetensors", "--fail-different").exit_code == 0


def test_shares_are_exact_where_the_global_difference_overflows_float64(pair):
    # found by a review: ‖A−B‖ of finite values beyond float64 (inf) made every share "nan"; they come from
    # the exact sums now, as do the groups'
    a, b = pair(
        {"h.t": np.array([1e308] * 3), "h.u": np.array([1.0]), "k": np.array([3.0])},
        {"h.t": np.array([-1e308] * 3), "h.u": np.array([2.0]), "k": np.array([5.0])},
    )
    d = diff_json(a, b, "--depth", "1")
    assert d["diff_norm"] == "inf"
    squares = {"h.t": 3 * (2 * Fraction(1e308)) ** 2, "h.u": Fraction(1), "k": Fraction(4)}
    total = sum(squares.values())
    assert {t["name"]: t["share"] for t in d["tensors"]} == {n: float(q / total) for n, q in squares.items()}
    groups = {g["name"]: g["share"] for g in d["groups"]}
    assert groups == {"h": float((squares["h.t"] + 1) / total), "k": float(4 / total)}


@pytest.mark.parametrize("gate", ["--fail-above", "--fail-rel-above"])
def test_a_gate_of_inf_still_fails_on_a_figure_that_is_not_finite(pair, gate):
    # the spec: a gate fails on a non-finite figure; `inf <= inf` let it pass
    a, b = pair({"t": np.array([0.0, np.inf] if gate == "--fail-above" else [0.0, 0.0])}, {"t": np.array([1.0, 2.0])})
    result = run("diff", a, b, gate, "inf")
    assert result.exit_code == 1, result.output
    assert run("diff", a, a, gate, "inf").exit_code == 0


def test_tensors_carried_as_bytes_are_compared_for_sameness(tmp_path):
    # found by a review: any pair of types carried as bytes (strings, float128, F8_E8M0) exited 70
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    np.savez(a, s=np.array(["ab", "c"]), q=np.ones(2, np.longdouble), f=np.ones(3, F32))
    np.savez(b, s=np.array(["ab", "d"]), q=np.ones(2, np.longdouble), f=np.ones(3, F32))
    d = diff_json(a, b)
    assert {r["name"]: r["identical"] for r in d["skipped"]} == {"s": False, "q": True}
    assert d["different"] == ["1 tensor differs (s)"]
    assert run("diff", a, a, "--fail-different").exit_code == 0
    assert run("diff", a, b, "--fail-different").exit_code == 1
    e8 = tmp_path / "e8.safetensors"
    header = b'{"x":{"dtype":"F8_E8M0","shape":[2],"data_offsets":[0,2]}}'
    e8.write_bytes(len(header).to_bytes(8, "little") + header + b"\x7f\x80")
    # F8_E8M0 now reads as ml_dtypes' float8_e8m0fnu, as from a PyTorch file (a review found the same tensor
    # normed from a .pt and skipped from its conversion): its powers of two 1 and 2 are compared by value
    (x,) = diff_json(e8, e8)["tensors"]
    assert (x["dtype_a"], x["identical"], x["diff_norm"], x["norm_a"]) == ("float8_e8m0fnu", True, 0.0, 5**0.5)


@pytest.mark.parametrize("suffix", [".npz", ".npy"])
def test_a_fortran_order_tensor_is_compared_element_by_element(tmp_path, suffix):
    # found by a review: Fortran order against C order paired storage order (0,3,1,4,2,5 with 0..5): equal
    # tensors came out 3.16 apart, and --fail-different failed
    x = np.arange(6, dtype=F32).reshape(2, 3)
    fortran = tmp_path / f"x{suffix}"
    if suffix == ".npz":
        np.savez(fortran, x=np.asfortranarray(x))
    else:
        np.save(fortran, np.asfortranarray(x))
    plain = write_st(tmp_path / "c.safetensors", {"x": x})
    d = diff_json(fortran, plain)
    assert (d["diff_norm"], d["changed"], d["cosine"], d["different"]) == (0.0, 0, 1.0, [])
    assert run("diff", fortran, plain, "--fail-different").exit_code == 0
    moved = write_st(tmp_path / "m.safetensors", {"x": x + np.array([[0, 0, 0], [0, 3, 4]], F32)})
    d = diff_json(fortran, moved)
    assert (d["diff_norm"], d["changed"], d["max_abs_diff"]) == (5.0, 2, 4.0)
    assert d["tensors"][0]["diff_norm"] == exact_diff_norm(x, x + np.array([[0, 0, 0], [0, 3, 4]], F32))
    assert diff_json(moved, fortran)["diff_norm"] == 5.0


def test_byte_order_is_the_files_not_a_difference(tmp_path):
    # found by a review: big-endian int64 and complex64 against little-endian ones of the same values "differ"
    be, le = tmp_path / "be.npz", tmp_path / "le.npz"
    np.savez(be, k=np.arange(3, dtype=">i8"), c=np.arange(3, dtype=">c8"), f=np.arange(3, dtype=">f4"))
    np.savez(le, k=np.arange(3, dtype="<i8"), c=np.arange(3, dtype="<c8"), f=np.arange(3, dtype="<f4"))
    d = diff_json(be, le)
    assert d["different"] == [] and all(r["identical"] for r in d["skipped"] + d["tensors"])
    assert run("diff", be, le, "--fail-different").exit_code == 0
    np.savez(le, k=np.array([0, 1, 3]), c=np.arange(3, dtype="<c8"), f=np.arange(3, dtype="<f4"))
    assert diff_json(be, le)["different"] == ["1 tensor differs (k)"]


def test_pairs_compared_for_sameness_are_compared_by_value_across_dtypes(pair):
    # found by a review: float32 against int32 (and int32 against int64, a mask as uint8 against bool) of the
    # same values were "different", with only A's dtype shown and "not a floating tensor" for a floating one
    a, b = pair(
        {"fi": np.array([1, 2], F32), "i": np.array([1, 2], np.int32), "j": np.array([1, 2], np.int32),
         "m": np.array([1, 0], np.uint8)},
        {"fi": np.array([1, 2], np.int32), "i": np.array([1, 2], np.int64), "j": np.array([1, 3], np.int64),
         "m": np.array([True, False])},
    )  # fmt: skip
    d = diff_json(a, b)
    assert d["different"] == ["1 tensor differs (j)", "3 tensors differ in dtype only (fi, ...)"]
    reasons = {r["name"]: r["reason"] for r in d["skipped"]}
    assert reasons["fi"] == "floating in A only: compared for being the same only"
    assert reasons["i"] == "not a floating tensor: compared for being the same only"
    table = ok("diff", a, b).stdout
    assert "compared for sameness only: fi (float32 vs int32): the same values" in table
    assert "compared for sameness only: j (int32 vs int64): different" in table
    assert run("diff", a, b, "--fail-different").exit_code == 1  # the dtypes differ


def test_integers_and_floats_compared_for_sameness_are_compared_exactly(pair):
    # found by a review: NumPy compares int64 with float64 in float64, so 2**53 + 1 "equalled" 2**53
    a, b = pair(
        {"i": np.array([2**53 + 1], np.int64), "j": np.array([2**53], np.int64), "u": np.array([7], np.uint8),
         "k": np.array([2**63 - 1], np.int64), "m": np.array([-1], np.int64)},
        {"i": np.array([2.0**53]), "j": np.array([2.0**53]), "u": np.array([7.0], F32),
         "k": np.array([2.0**63], F32), "m": np.array([2**64 - 1], np.uint64)},
    )  # fmt: skip
    d = diff_json(a, b)
    assert d["different"] == ["3 tensors differ (i, ...)", "2 tensors differ in dtype only (j, ...)"]
    assert {r["name"] for r in d["skipped"]} == {"i", "j", "u", "k", "m"}
    table = ok("diff", a, b).stdout
    for name, state in (("i", "different"), ("j", "the same values"), ("u", "the same values"), ("k", "different")):
        assert f": {name} (" in table and table.split(f": {name} (")[1].split("\n")[0].endswith(state), name


def test_types_carried_as_bytes_in_another_layout_are_not_compared(tmp_path):
    # found by a review: text in Fortran order against C order compared storage bytes: equal values
    # "different", different values "the same" (a --fail-different gate passed); '>U2' against '<U2' too
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    text = np.array([["a", "b"], ["c", "d"]])
    for left, right in (
        (np.asfortranarray(text), text),
        (np.asfortranarray(text), text.T.copy()),  # the same bytes in storage, other values
        (np.array(["ab", "c"], ">U2"), np.array(["ab", "c"], "<U2")),
    ):
        np.save(tmp_path / "a" / "x.npy", left)
        np.save(tmp_path / "b" / "x.npy", right)
        d = diff_json(tmp_path / "a" / "x.npy", tmp_path / "b" / "x.npy")
        assert [m["name"] for m in d["mismatched"]] == ["x"] and d["skipped"] == []
        assert "another type, byte order or element order" in d["mismatched"][0]["reason"]
        assert run("diff", tmp_path / "a" / "x.npy", tmp_path / "b" / "x.npy", "--fail-different").exit_code == 1
    np.save(tmp_path / "b" / "x.npy", np.asfortranarray(text))  # the same layout: compared by bytes
    np.save(tmp_path / "a" / "x.npy", np.asfortranarray(text))
    assert diff_json(tmp_path / "a" / "x.npy", tmp_path / "b" / "x.npy")["skipped"][0]["identical"] is True


def test_structured_members_of_other_fields_are_not_compared_by_bytes(tmp_path):
    # found by a review: every 8-byte record type is '|V8', so records of other fields' byte orders, order
    # or names over the same bytes were "the same" (field a: 1 against 16777216)
    a = np.array([(1, 2.0)], dtype=[("a", "<i4"), ("b", "<f4")])
    for other in (
        np.frombuffer(a.tobytes(), dtype=[("a", ">i4"), ("b", ">f4")]),
        np.frombuffer(a.tobytes(), dtype=[("b", "<i4"), ("a", "<f4")]),
    ):
        np.savez(tmp_path / "a.npz", t=a)
        np.savez(tmp_path / "b.npz", t=other)
        d = diff_json(tmp_path / "a.npz", tmp_path / "b.npz")
        assert [m["name"] for m in d["mismatched"]] == ["t"], d
        assert run("diff", tmp_path / "a.npz", tmp_path / "b.npz", "--fail-different").exit_code == 1
    np.savez(tmp_path / "b.npz", t=a.copy())
    assert diff_json(tmp_path / "a.npz", tmp_path / "b.npz")["skipped"][0]["identical"] is True


def test_a_diff_that_is_not_finite_says_so(tmp_path):
    # found by a fresh user (second review): a diff gate tripped by a NaN difference did not say it was not finite
    a = write_st(tmp_path / "a.safetensors", {"w": np.array([1.0, np.nan], np.float32)})
    b = write_st(tmp_path / "b.safetensors", {"w": np.array([1.0, 2.0], np.float32)})
    result = run("diff", a, b, "--fail-above", "1")
    assert result.exit_code == 1 and "‖A−B‖ is nan, not finite (--fail-above 1)" in result.stderr


def test_diff_top_counts_the_tensors_that_differ(steps):
    # found by a fresh user (second review): diff --top K gave identical tensors places among the K shown
    a, b = steps
    text = ok("diff", a, b, "--top", "2").stdout
    table = [line for line in text.splitlines() if line.startswith("model.")]
    assert len(table) == 2  # one of the 7 is identical: --top 2 still shows 2 rows
    assert "4 other tensors that differ not shown (--top)" in text and "1 tensor identical, bit for bit" in text
    report = js("diff", a, b, "--top", "2")
    assert len(report["tensors"]) == 2 and not any(t["identical"] for t in report["tensors"])
    assert report["tensor_count"] == 7 and report["identical_count"] == 1


def test_rel_is_nan_where_a_holds_nan_even_at_the_same_place_in_b(tmp_path):
    # found checking diff's figures: NaN in A at the same place as in B gave rel 0 (per tensor, per group, globally)
    x = np.array([np.nan, 1.0, 2.0], np.float32)
    a = write_st(tmp_path / "a.safetensors", {"m.x": x, "m.y": np.ones(2, np.float32)})
    b = write_st(tmp_path / "b.safetensors", {"m.x": x.copy(), "m.y": np.ones(2, np.float32)})
    d = diff_json(a, b, "--depth", "1")
    rows = {t["name"]: t for t in d["tensors"]}
    assert (d["diff_norm"], d["norm_a"], d["rel"]) == (0.0, "nan", "nan")
    assert (rows["m.x"]["diff_norm"], rows["m.x"]["rel"]) == (0.0, "nan")
    assert rows["m.y"]["rel"] == 0.0  # a finite A: 0 / ‖A‖
    assert [(g["name"], g["rel"]) for g in d["groups"]] == [("m", "nan")]
    assert run("diff", a, b, "--fail-rel-above", "1").exit_code == 1  # a gate fails on a non-finite figure
    assert run("diff", a, b, "--fail-above", "0", "--fail-different").exit_code == 0  # nothing differs
    inf = write_st(tmp_path / "inf.safetensors", {"m.x": np.array([np.inf, 1.0], np.float32)})
    assert diff_json(inf, inf)["rel"] == 0.0  # 0 / inf
    assert math.isnan(float(diff_json(a, a)["tensors"][0]["rel"]))


def test_metadata_that_differs_is_listed_and_fails_the_gate(tmp_path):
    # found checking diff's gates: equal tensors with another `epoch` or `lr` passed --fail-different, the report silent
    w = {"w": np.arange(4, dtype=np.float32)}
    a = write_st(tmp_path / "a.safetensors", w, {"epoch": "3", "lr": "0.1", "format": "pt", "x\x1b[2J": "1"})
    b = write_st(tmp_path / "b.safetensors", w, {"epoch": "4", "lr": "0.1", "step": "7"})
    d = diff_json(a, b)
    assert d["metadata_differs"] == ["epoch", "step", "x\x1b[2J"]  # `format` (which library saved it) is layout
    assert d["different"] == ["3 metadata keys differ (epoch, ...)"]
    gate = run("diff", a, b, "--fail-different")
    assert gate.exit_code == 1 and "metadata differs: epoch, step, x\\x1b[2J" in gate.stdout  # escaped
    assert gate.stderr.count("clipcli: error:") == 1 and "3 metadata keys differ" in gate.stderr
    csv = run("diff", a, b, "--format", "csv").stdout.splitlines()
    rows = [line for line in csv if line.endswith(",metadata")]
    assert rows == [f"{k},,,,,,,,,,,0,,metadata" for k in ("epoch", "step", "x\\x1b[2J")]
    assert csv[-1].split(",")[-4:-2] == ["0", "0"]  # the global row: nothing changed, yet not identical
    excluded = ["--exclude", "epoch", "--exclude", "x*", "--exclude", "step"]
    assert run("diff", a, b, "--fail-different", *excluded).exit_code == 0  # keys are selected as names are
    same = write_st(tmp_path / "same.safetensors", w, {"epoch": "3", "lr": "0.1", "x\x1b[2J": "1", "format": "np"})
    assert run("diff", a, same, "--fail-different").exit_code == 0


def test_torch_leaves_count_and_a_conversion_keeps_them(tmp_path):
    # found checking diff's gates: a PyTorch file's non-tensor leaves (epoch, lr) are metadata, compared as strings
    source = DATA / "torch" / "lightning.ckpt"
    out = tmp_path / "converted.safetensors"
    assert run("convert", source, "-o", out, "--quiet").exit_code == 0
    assert run("diff", source, out, "--fail-different").exit_code == 0  # clipcli's own conversion: the same
    with safe_open(out, "np") as f:
        metadata = f.metadata()
    assert metadata["epoch"] == "3"
    moved = write_st(tmp_path / "moved.safetensors", load_file(out), {**metadata, "epoch": "4"})
    d = diff_json(source, moved)
    assert (d["metadata_differs"], d["changed"]) == (["epoch"], 0)
    assert run("diff", source, moved, "--fail-different").exit_code == 1
    dropped = tmp_path / "dropped.safetensors"
    assert run("convert", source, "-o", dropped, "--drop-metadata", "--quiet").exit_code == 0
    assert diff_json(source, dropped)["metadata_differs"] == sorted(metadata)  # what --drop-metadata lost


def test_map_pairs_a_lightning_checkpoint_with_its_bare_state_dict(tmp_path):
    # issue 26 item 4: a Lightning `state_dict.`-prefixed file (written by real torch) against its bare state dict
    import clipcli

    lightning = DATA / "torch" / "lightning.ckpt"
    with clipcli.open(lightning) as ckpt:
        bare = {n.removeprefix("state_dict."): ckpt.read(n) for n in ckpt.names if n.startswith("state_dict.")}
        optimizer = sorted(n for n in ckpt.names if not n.startswith("state_dict."))
    assert bare and optimizer
    plain = write_st(tmp_path / "bare.safetensors", bare)
    without = diff_json(lightning, plain)
    assert without["tensors"] == [] and sorted(without["only_b"]) == sorted(bare)
    report = diff_json(lightning, plain, "--map", "state_dict.=")
    assert sorted(t["name"] for t in report["tensors"]) == sorted(f"state_dict.{n}" for n in bare)
    assert all(t["identical"] and t["diff_norm"] == 0 for t in report["tensors"])
    assert report["only_b"] == [] and report["mismatched"] == [] and sorted(report["only_a"]) == optimizer
    exact = exact_norm(np.concatenate([v.ravel() for v in bare.values()]))
    assert report["diff_norm"] == 0 and math.isclose(report["norm_a"], exact, rel_tol=1e-12)


def test_map_with_fail_different_passes_only_when_the_mapped_names_match(tmp_path):
    # a DDP `module.` prefix: the same values under other names; the first map that fits renames
    rng = np.random.default_rng(3)
    values = {"w": rng.standard_normal((4, 3)).astype(F32), "b": rng.standard_normal(3).astype(F32)}
    ddp = write_st(tmp_path / "ddp.safetensors", {f"module.{k}": v for k, v in values.items()})
    plain = write_st(tmp_path / "plain.safetensors", values)
    assert run("diff", ddp, plain, "--fail-different", "-q").exit_code == 1
    assert run("diff", ddp, plain, "--map", "module.=", "--fail-different", "-q").exit_code == 0
    assert run("diff", ddp, plain, "--map", "x.=y.", "--map", "module.=", "--fail-different", "-q").exit_code == 0
    assert run("diff", plain, ddp, "--map", "=module.", "--fail-different", "-q").exit_code == 0
    changed = write_st(tmp_path / "changed.safetensors", {**values, "w": values["w"] * 2})
    report = diff_json(ddp, changed, "--map", "module.=")
    rows = {t["name"]: t for t in report["tensors"]}
    assert rows["module.b"]["identical"] and not rows["module.w"]["identical"]
    assert math.isclose(rows["module.w"]["diff_norm"], exact_diff_norm(values["w"], values["w"] * 2), rel_tol=1e-12)


@pytest.mark.parametrize("text", ["nothing", "=", ""])
def test_a_map_that_is_not_a_prefix_pair_is_a_usage_error(tmp_path, text):
    a = write_st(tmp_path / "a.safetensors", {"w": np.ones(2, F32)})
    done = run("diff", a, a, "--map", text)
    assert done.exit_code == 2 and "--map" in done.output and "A_PREFIX=B_PREFIX" in done.output


def test_a_map_that_gives_two_tensors_one_name_is_a_usage_error(tmp_path):
    a = write_st(tmp_path / "a.safetensors", {"module.w": np.ones(2, F32), "w": np.ones(2, F32)})
    done = run("diff", a, a, "--map", "module.=")
    assert done.exit_code == 2 and "the same name in B, 'w'" in done.output


def test_diff_of_maps_as_the_command_line_does(tmp_path):
    import clipcli

    a = write_st(tmp_path / "a.safetensors", {"state_dict.w": np.arange(3, dtype=F32)})
    b = write_st(tmp_path / "b.safetensors", {"w": np.arange(3, dtype=F32)})
    report = clipcli.diff_of(a, b, maps="state_dict.=")
    assert report.to_dict() == diff_json(a, b, "--map", "state_dict.=")
    assert not report.different


def test_a_selection_that_leaves_one_side_empty_is_a_usage_error(tmp_path):
    # found by a new user: --include matching B only compared nothing and --fail-different failed on "only in B"
    a = write_st(tmp_path / "a.safetensors", {"module.norm.weight": np.ones(2, F32)})
    b = write_st(tmp_path / "b.safetensors", {"norm.weight": np.ones(2, F32)})
    done = run("diff", a, b, "--map", "module.=", "--include", "norm*", "--fail-different")
    assert done.exit_code == 2 and "norm*" in done.output
    assert run("diff", a, b, "--map", "module.=", "--include", "*norm*", "--fail-different").exit_code == 0


def test_negative_zero_passes_the_gate_but_is_not_identical(tmp_path) -> None:
    # the README's rule: --fail-different compares values as numbers; a row's `identical` is its bytes; the CSV's
    # global row's `identical` is 1 exactly when the gate passes
    a = write_st(tmp_path / "a.safetensors", {"x": np.array([0.0, 1.0], np.float32)})
    b = write_st(tmp_path / "b.safetensors", {"x": np.array([-0.0, 1.0], np.float32)})
    assert run("diff", a, b, "--fail-different", "-q").exit_code == 0
    row = js("diff", a, b)["tensors"][0]
    assert row["identical"] is False and row["changed"] == 0
    lines = ok("diff", a, b, "--format", "csv").stdout.splitlines()
    header = lines[0].split(",")
    rows = {r.split(",")[-1]: dict(zip(header, r.split(","), strict=True)) for r in lines[1:]}
    assert rows["tensor"]["identical"] == "0" and rows["global"]["identical"] == "1"
    c = write_st(tmp_path / "c.safetensors", {"x": np.array([0.5, 1.0], np.float32)})
    assert run("diff", a, c, "--fail-different", "-q").exit_code == 1
    assert ok("diff", a, c, "--format", "csv").stdout.splitlines()[-1].split(",")[-3] == "0"
