"""global-norm --combined: one global norm over several checkpoints' tensors, against exact references."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

import clipcli
from tests.helpers import js, run, write_st

F32 = np.float32


def exact_pnorm(arrays, p: int) -> float:
    """The p-norm of all values together, from exact sums (correctly rounded for p = 1; p = 2 within an ulp)."""
    total = sum((abs(Fraction(float(v))) ** p for a in arrays for v in np.ravel(a)), Fraction(0))
    return float(total) if p == 1 else math.sqrt(total)


@pytest.fixture
def ranks(tmp_path):
    """Three per-rank gradient files of distinct tensors (and one step counter, skipped)."""
    rng = np.random.default_rng(7)
    arrays = [
        {"layers.0.w": rng.standard_normal((8, 5)).astype(F32), "step": np.array(3, np.int64)},
        {"layers.1.w": (rng.standard_normal((6, 6)) * 4).astype(F32), "layers.1.b": rng.standard_normal(6).astype(F32)},
        {"head.w": rng.standard_normal((3, 7)).astype(np.float64)},
    ]
    paths = [write_st(tmp_path / f"rank{i}.safetensors", a) for i, a in enumerate(arrays)]
    floats = [[v for v in a.values() if v.dtype.kind == "f"] for a in arrays]
    return paths, floats


@pytest.mark.parametrize("p", [1, 2])
def test_the_combined_norm_is_the_norm_of_all_tensors_together(ranks, p):
    paths, floats = ranks
    report = js("global-norm", *paths, "--combined", "--ord", str(p))
    every = [a for f in floats for a in f]
    assert math.isclose(report["combined"]["global_norm"], exact_pnorm(every, p), rel_tol=1e-12)
    assert report["combined"]["tensor_count"] == len(every)
    assert report["combined"]["max_abs"] == max(float(np.abs(a).max()) for a in every)
    whole = sum(abs(Fraction(float(v))) ** p for a in every for v in a.ravel())
    for c, f in zip(report["checkpoints"], floats, strict=True):
        part = sum(abs(Fraction(float(v))) ** p for a in f for v in a.ravel())
        assert math.isclose(c["share"], float(part / whole), rel_tol=1e-12)
        assert math.isclose(c["global_norm"], exact_pnorm(f, p), rel_tol=1e-12)  # each its own, as without
    assert math.isclose(sum(c["share"] for c in report["checkpoints"]), 1.0, rel_tol=1e-12)


def test_the_inf_norm_combined_is_the_largest_magnitude_and_has_no_shares(ranks):
    paths, floats = ranks
    report = js("global-norm", *paths, "--combined", "--ord", "inf")
    assert report["combined"]["global_norm"] == max(float(np.abs(a).max()) for f in floats for a in f)
    assert all(c["share"] is None for c in report["checkpoints"])


def test_fail_above_checks_the_combined_norm(ranks):
    paths, floats = ranks
    g = exact_pnorm([a for f in floats for a in f], 2)
    largest_own = max(exact_pnorm(f, 2) for f in floats)
    between = (largest_own + g) / 2
    assert largest_own < between < g
    assert run("global-norm", *paths, "--fail-above", between, "-q").exit_code == 0
    failed = run("global-norm", *paths, "--combined", "--fail-above", between, "-q")
    assert failed.exit_code == 1 and "combined global norm" in failed.output
    assert run("global-norm", *paths, "--combined", "--fail-above", g * 1.001, "-q").exit_code == 0


def test_a_name_in_two_checkpoints_is_a_usage_error_unless_prefixed_with_the_file(tmp_path):
    a = write_st(tmp_path / "a.safetensors", {"w": np.ones(3, F32)})
    b = write_st(tmp_path / "b.safetensors", {"w": np.full(4, 2, F32)})
    clash = run("global-norm", a, b, "--combined")
    assert clash.exit_code == 2 and "'w' is in" in clash.output and "--prefix-with-file" in clash.output
    assert run("global-norm", a, b).exit_code == 0  # without --combined: two reports, no clash
    report = js("global-norm", a, b, "--combined", "--prefix-with-file")
    assert [t["name"] for c in report["checkpoints"] for t in c["tensors"]] == ["a.safetensors/w", "b.safetensors/w"]
    assert report["combined"]["global_norm"] == math.sqrt(3 + 16)
    alone = run("global-norm", a, "--prefix-with-file")
    assert alone.exit_code == 2 and "only with --combined" in alone.output


def test_the_combined_report_is_the_same_bytes_for_any_jobs_and_from_python(ranks):
    paths, _ = ranks
    outs = {run("global-norm", *paths, "--combined", "--format", "json", "--jobs", j).stdout for j in ("1", "2", "8")}
    assert len(outs) == 1
    report = clipcli.global_norm_of(*paths, combined=True)
    assert report.to_dict() == js("global-norm", *paths, "--combined")
    assert report.combined.tensors == 4


def test_the_table_and_csv_show_the_combined_norm(ranks):
    paths, _ = ranks
    table = run("global-norm", *paths, "--combined").stdout
    assert table.startswith("combined global norm ") and "over 4 tensors of 3 checkpoints" in table
    csv = run("global-norm", *paths, "--combined", "--format", "csv").stdout.splitlines()
    assert csv[-1].endswith(",combined") and csv[-1].split(",")[4] == repr(
        js("global-norm", *paths, "--combined")["combined"]["global_norm"]
    )


def test_clip_global_norm_of_several_checkpoints_scales_all_by_one_scale(ranks, tmp_path):
    # issue 26 item 2: per-rank gradient files clipped with the scale their combined norm gives
    from safetensors.numpy import load_file

    paths, floats = ranks
    every = [a for f in floats for a in f]
    total = sum(Fraction(float(v)) ** 2 for a in every for v in a.ravel())
    clip_norm = 3.0
    out = tmp_path / "clipped"
    report = js("clip-global-norm", *paths, "-o", out, "--clip-norm", clip_norm)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in paths)
    combined = report["combined"]
    assert math.isclose(combined["global_norm"], math.sqrt(total), rel_tol=1e-12)
    assert math.isclose(combined["scale"], clip_norm / math.sqrt(total), rel_tol=1e-15)
    assert all(c["scale"] == combined["scale"] for c in report["checkpoints"])
    scale = combined["scale"]
    after = Fraction(0)
    for path in paths:
        before, clipped = load_file(path), load_file(out / path.name)
        assert list(before) == list(clipped)
        for name, x in before.items():
            y = clipped[name]
            assert y.dtype == x.dtype and y.shape == x.shape
            if x.dtype.kind != "f":
                assert np.array_equal(x, y)  # the step counter passes through
                continue
            exact = x.astype(np.float64) * scale  # the product of two floats, rounded once to the dtype
            ulp = np.spacing(np.abs(exact).astype(x.dtype)).astype(np.float64)
            assert np.all(np.abs(y.astype(np.float64) - exact) <= ulp)
            after += sum(Fraction(float(v)) ** 2 for v in y.ravel())
    assert math.sqrt(after) <= clip_norm * (1 + 1e-6)
    assert math.isclose(combined["global_norm_after"], math.sqrt(after), rel_tol=1e-12)
    assert (
        run(
            "global-norm", *(out / p.name for p in paths), "--combined", "--fail-above", clip_norm * (1 + 1e-6)
        ).exit_code
        == 0
    )


def test_clip_of_several_refuses_clashes_twins_nan_and_a_missing_output(tmp_path):
    a = write_st(tmp_path / "a.safetensors", {"w": np.ones(3, F32)})
    b = write_st(tmp_path / "b.safetensors", {"w": np.full(4, 2, F32)})
    out = tmp_path / "out"
    clash = run("clip-global-norm", a, b, "-o", out, "--clip-norm", "1")
    assert clash.exit_code == 2 and "'w' is in" in clash.output and not out.exists()
    done = js("clip-global-norm", a, b, "-o", out, "--clip-norm", "1", "--prefix-with-file")
    assert done["combined"]["global_norm"] == math.sqrt(3 + 16) and sorted(p.name for p in out.iterdir()) == [
        "a.safetensors",
        "b.safetensors",
    ]
    (tmp_path / "twin").mkdir()
    twin = write_st(tmp_path / "twin" / "a.safetensors", {"v": np.ones(2, F32)})
    same_name = run("clip-global-norm", a, twin, "-o", tmp_path / "o2", "--clip-norm", "1")
    assert same_name.exit_code == 2 and "two checkpoints are 'a.safetensors'" in same_name.output
    nan = write_st(tmp_path / "nan.safetensors", {"u": np.array([1.0, np.nan], F32)})
    refused = run("clip-global-norm", a, nan, "-o", tmp_path / "o3", "--clip-norm", "1")
    assert refused.exit_code == 1 and "NaN" in refused.output
    assert not any((tmp_path / "o3").glob("*"))  # measured first: nothing written
    missing = run("clip-global-norm", a, nan, "--clip-norm", "1")
    assert missing.exit_code == 2 and "-o DIR" in missing.output


def test_clip_of_several_in_place_and_jobs_give_the_same_bytes(ranks, tmp_path):
    import shutil

    paths, _ = ranks
    outs = []
    for jobs in ("1", "2"):
        d = tmp_path / f"in-place-{jobs}"
        d.mkdir()
        copies = [shutil.copy(p, d / p.name) for p in paths]
        run("clip-global-norm", *copies, "--in-place", "--clip-norm", "2", "--jobs", jobs, "-q")
        outs.append([(d / p.name).read_bytes() for p in paths])
    assert outs[0] == outs[1] and outs[0] != [p.read_bytes() for p in paths]
    other = tmp_path / "o"
    run("clip-global-norm", *paths, "-o", other, "--clip-norm", "2", "-q")
    assert [(other / p.name).read_bytes() for p in paths] == outs[0]


def test_the_same_file_twice_is_never_counted_twice(ranks, tmp_path):
    # found by a new user: `--combined` of one file given twice counted every tensor twice, exit 0
    paths, _ = ranks
    twice = run("global-norm", paths[0], paths[0], "--combined")
    assert twice.exit_code == 2 and "would count it twice" in twice.output
    (tmp_path / "copy").mkdir()
    copy = tmp_path / "copy" / paths[0].name
    copy.write_bytes(paths[0].read_bytes())
    prefixed = run("global-norm", paths[0], copy, "--combined", "--prefix-with-file")
    assert prefixed.exit_code == 2 and f"two checkpoints are named '{paths[0].name}'" in prefixed.output
    in_place = run("clip-global-norm", paths[1], paths[1], "--in-place", "--clip-norm", "1")
    assert in_place.exit_code == 2 and "clipped twice" in in_place.output


def test_a_dry_run_of_several_needs_no_dir_and_a_refused_clip_leaves_none(ranks, tmp_path):
    # found by a new user: --dry-run failed on a missing -o DIR (exit 4); a refused clip left an empty DIR
    paths, _ = ranks
    dry = run("clip-global-norm", *paths, "-o", tmp_path / "dry", "--clip-norm", "1", "--dry-run", "-q")
    assert dry.exit_code == 0 and not (tmp_path / "dry").exists()
    nan = write_st(tmp_path / "nan.safetensors", {"u": np.array([1.0, np.nan], F32)})
    refused = run("clip-global-norm", paths[0], nan, "-o", tmp_path / "o", "--clip-norm", "1")
    assert refused.exit_code == 1 and not (tmp_path / "o").exists()
    empty = run("clip-global-norm", *paths, "-o", tmp_path / "o2", "--clip-norm", "1", "--include", "zzz")
    assert empty.exit_code == 2 and not (tmp_path / "o2").exists()


def test_several_go_into_a_directory_never_into_a_file_or_a_name_with_a_suffix(ranks, tmp_path):
    # found by a new user: an existing file as -o crashed (exit 70, FileExistsError); `-o out.safetensors` or
    # `-o out.txt` made a directory of that name (which then reads as a broken set of shards), exit 0
    paths, _ = ranks
    existing = tmp_path / "existing.safetensors"
    existing.write_bytes(b"keep")
    for out, says in (
        (existing, "exists and is not a directory"),
        (tmp_path / "made.safetensors", "not a .safetensors file"),
        (tmp_path / "made.txt", "not a .txt file"),
    ):
        result = run("clip-global-norm", *paths, "-o", out, "--clip-norm", "1", "--prefix-with-file")
        assert result.exit_code == 2 and "Invalid value for -o/--output" in result.output and says in result.output
    assert existing.read_bytes() == b"keep" and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [existing.name, *(p.name for p in paths)]
    )
    slash = run("clip-global-norm", *paths, "-o", f"{tmp_path / 'dir.v2'}/", "--clip-norm", "1", "-q")
    assert slash.exit_code == 0 and sorted(p.name for p in (tmp_path / "dir.v2").iterdir()) == sorted(
        p.name for p in paths
    )
