"""The command line: every command and option, exact error lines and exit statuses, checked outputs."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import zipfile
from decimal import Decimal, getcontext
from fractions import Fraction
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from clipcli import core
from clipcli.checkpoint import open_checkpoint
from clipcli.commands import clip as clip_commands
from clipcli.commands import global_norm as norm_commands
from clipcli.commands import passes as pass_runner
from clipcli.report import norms as norm_report
from clipcli.report import render as report_render
from clipcli.report import rows as report_rows
from tests.helpers import (
    DATA,
    ENV,
    GOLDEN,
    SAMPLES,
    WIDE,
    digest,
    fnorm,
    js,
    npz_arrays,
    ok,
    reference,
    run,
    st_bytes,
    write_st,
)

# --- global-norm ------------------------------------------------------------------------------------


def test_global_norm_matches_float64_reference(grads):
    ref = reference(grads)
    floats = {n: a for n, a in ref.items() if n != "step"}
    out = js("global-norm", grads)
    assert out["schema"] == 1 and out["command"] == "global-norm" and out["ord"] == 2
    (c,) = out["checkpoints"]
    assert c["path"] == str(grads)
    assert c["global_norm"] == pytest.approx(fnorm(floats.values()), rel=1e-15)
    assert sorted(t["name"] for t in c["tensors"]) == sorted(floats)  # deserialize() does not keep file order
    for t in c["tensors"]:
        a = floats[t["name"]]
        assert t["dtype"] == a.dtype.name and t["shape"] == list(a.shape)
        assert t["norm"] == pytest.approx(fnorm([a]), rel=1e-15)
        assert t["max_abs"] == float(np.abs(a.astype(np.float64)).max())
        assert (t["nan"], t["inf"]) == (0, 0)
    assert math.fsum(t["share"] for t in c["tensors"]) == pytest.approx(1.0, rel=1e-14)
    assert c["skipped"] == [{"name": "step", "dtype": "int64", "reason": "not a floating tensor"}]


@pytest.mark.parametrize("ord_", ["1", "inf", "3", "0.5"])
def test_global_norm_orders(grads, ord_):
    p = float(ord_)
    floats = [a for n, a in reference(grads).items() if n != "step"]
    (c,) = js("global-norm", grads, "--ord", ord_)["checkpoints"]
    assert c["global_norm"] == pytest.approx(fnorm(floats, p), rel=1e-13)
    shares = [t["share"] for t in c["tensors"]]
    if math.isinf(p):
        assert shares == [None] * len(shares)
    else:
        assert math.fsum(shares) == pytest.approx(1.0, rel=1e-12)


def test_same_global_norm_from_every_format(grads, sharded):
    out = js("global-norm", grads, SAMPLES / "grads.npz", sharded)
    norms = {c["global_norm"] for c in out["checkpoints"]}
    assert len(norms) == 1  # bfloat16 widens exactly to the npz twin's float32: the same bits


def test_depth_groups(grads):
    (c,) = js("global-norm", grads, "--depth", "3")["checkpoints"]
    groups = {g["name"]: g for g in c["groups"]}
    assert list(groups) == ["model.embed_tokens.weight", "model.layers.0", "model.layers.1", "model.norm.weight"]
    ref = reference(grads)
    layer1 = [a for n, a in ref.items() if n.startswith("model.layers.1.")]
    assert groups["model.layers.1"]["tensors"] == 7
    assert groups["model.layers.1"]["norm"] == pytest.approx(fnorm(layer1), rel=1e-15)
    assert math.fsum(g["share"] for g in c["groups"]) == pytest.approx(1.0, rel=1e-14)
    assert c["group_count"] == 4
    (top,) = js("global-norm", grads, "--depth", "3", "--sort", "norm", "--top", "2")["checkpoints"]
    assert [g["name"] for g in top["groups"]] == ["model.layers.1", "model.layers.0"] and top["group_count"] == 4


def test_depth_groups_and_the_global_norm_in_csv():
    # found trying clipcli as a new user: --depth's groups and the global row were missing from CSV
    lines = ok("global-norm", SAMPLES / "grads.safetensors", "--depth", "3", "--format", "csv").stdout.splitlines()
    kinds = [line.rsplit(",", 1)[1] for line in lines[1:]]
    assert kinds == ["tensor"] * 16 + ["group"] * 4 + ["global"]
    groups = {line.split(",")[1]: float(line.split(",")[4]) for line in lines if line.endswith(",group")}
    assert set(groups) == {"model.embed_tokens.weight", "model.layers.0", "model.layers.1", "model.norm.weight"}
    assert math.sqrt(sum(g * g for g in groups.values())) == pytest.approx(145.376, rel=1e-5)


def test_depth_in_the_table_of_several_checkpoints():
    # found trying clipcli as a new user: --depth did not group the table of several checkpoints
    out = ok("global-norm", SAMPLES / "grads.safetensors", SAMPLES / "grads.npz", "--depth", "3").stdout
    assert out.count("model.layers.1 ") == 2 and f"{SAMPLES / 'grads.npz'}: groups" in out


def test_groups_cut_by_top_say_how_many_there_are(steps):
    # found by a fresh user (second review): --top cutting the groups of --depth did not say how many groups there were
    a, b = steps
    text = ok("global-norm", a, "--depth", "3", "--top", "2").stdout
    assert "showing 2 of 3 groups" in text
    assert "of 3 groups" not in ok("global-norm", a, "--depth", "3", "--top", "3").stdout
    assert "showing 2 of 3 groups" in ok("diff", a, b, "--depth", "3", "--top", "2").stdout


def test_sort_and_top_keep_the_global_norm(grads):
    full = js("global-norm", grads)["checkpoints"][0]
    (c,) = js("global-norm", grads, "--sort", "norm", "--top", "3")["checkpoints"]
    assert c["global_norm"] == full["global_norm"]
    expected = sorted(full["tensors"], key=lambda t: t["norm"], reverse=True)[:3]
    assert c["tensors"] == expected
    by_name = js("global-norm", grads, "--sort", "name")["checkpoints"][0]["tensors"]
    assert [t["name"] for t in by_name] == sorted(t["name"] for t in full["tensors"])
    by_size = js("global-norm", grads, "--sort", "size", "--top", "1")["checkpoints"][0]["tensors"]
    assert by_size[0]["name"] == "model.embed_tokens.weight"


def test_summary_line_covers_all_tensors_under_top_and_sort():
    # found trying clipcli as a new user: the summary line covered only the tensors --top showed
    table = ok("global-norm", SAMPLES / "grads.safetensors", "--top", "2", "--sort", "size").stdout
    first = table.splitlines()[0]
    assert "over 16 tensors, 1 skipped" in first
    assert "largest share: model.layers.1.mlp.up_proj.weight (25.0%)" in first
    assert table.splitlines()[1] == "showing 2 of 16 tensors"


def test_sort_and_top_for_inspect_and_the_clip_commands(grads):
    # found trying clipcli as a new user: --sort and --top were missing from inspect and the clip commands
    (c,) = js("inspect", grads, "--sort", "size", "--top", "2")["checkpoints"]
    assert [t["nbytes"] for t in c["tensors"]] == [32768, 16384]  # ties keep the file's order
    assert [t["name"] for t in c["tensors"]] == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"]
    assert c["tensor_count"] == 17
    (c,) = js("clip-norm", grads, "--dry-run", "--clip-norm", "1", "--sort", "norm", "--top", "3")["checkpoints"]
    assert c["tensors"][0]["name"] == "model.layers.1.mlp.up_proj.weight"
    assert len(c["tensors"]) == 3 and c["tensor_count"] == 16
    table = ok("clip-value", grads, "--dry-run", "--min", "0", "--max", "1", "--top", "1").stdout
    assert "over 16 tensors" in table and "showing 1 of 16 tensors" in table


def test_include_exclude_globs(grads):
    (c,) = js("global-norm", grads, "--include", "model.layers.[0].*", "--exclude", "*.mlp.*")["checkpoints"]
    names = [t["name"] for t in c["tensors"]]
    assert names == [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"] + [
        "model.layers.0.input_layernorm.weight"
    ]
    reasons = {s["name"]: s["reason"] for s in c["skipped"]}
    assert reasons["model.layers.1.mlp.up_proj.weight"] == "not selected by --include"
    assert reasons["model.layers.0.mlp.up_proj.weight"] == "excluded by --exclude"
    ref = reference(grads)
    assert c["global_norm"] == pytest.approx(fnorm([ref[n] for n in names]), rel=1e-15)


def test_a_typo_in_include_is_a_usage_error_naming_the_pattern_and_some_names(grads):
    # found trying clipcli as a new user: a typo in --include selected nothing, and the gates passed
    result = run("global-norm", grads, "--include", "Model.*", "--fail-above", "1", "--fail-nonfinite")
    assert result.exit_code == 2
    assert "Usage: clipcli global-norm" in result.stderr
    assert (
        f"Invalid value for --include: {grads}: no tensor matches 'Model.*'; its tensors include "
        "model.embed_tokens.weight, model.layers.0.self_attn.q_proj.weight, "
        "model.layers.0.self_attn.k_proj.weight (17 in all)"
    ) in " ".join(result.stderr.split())
    assert result.stdout == ""


@pytest.mark.parametrize("command", ["inspect", "global-norm"])
def test_an_exclude_that_leaves_nothing_is_a_usage_error(grads, command):
    # found trying clipcli as a new user: an --exclude that left nothing selected was not a usage error
    result = run(command, grads, "--exclude", "*")
    assert result.exit_code == 2 and "--exclude '*' leaves no tensor selected" in result.stderr


def test_a_pattern_that_matches_nothing_is_warned_of(steps):
    # found by a fresh user (second review): an --include or --exclude pattern matching no tensor passed in silence
    a, b = steps
    result = run("global-norm", a, "--include", "*embed*", "--include", "nomatch*", "--quiet")
    assert result.exit_code == 0 and result.stderr == "clipcli: warning: --include 'nomatch*' matches no tensor\n"
    result = run("diff", a, b, "--exclude", "typo*", "--quiet")
    assert result.exit_code == 0 and result.stderr == "clipcli: warning: --exclude 'typo*' matches no tensor\n"
    assert run("global-norm", a, "--include", "*", "--quiet").stderr == ""


def test_csv_report(grads):
    lines = ok("global-norm", grads, "--format", "csv").stdout.splitlines()
    assert lines[0] == "path,name,dtype,shape,norm,max_abs,nan,inf,share,kind"
    first = lines[1].split(",")
    assert first[:4] == [str(grads), "model.embed_tokens.weight", "bfloat16", "256x64"]
    assert float(first[4]) == pytest.approx(fnorm([reference(grads)["model.embed_tokens.weight"]]), rel=1e-15)
    assert len(lines) == 18 and {line.split(",")[-1] for line in lines[1:17]} == {"tensor"}
    total = lines[17].split(",")  # the summary row: the global norm over every selected tensor
    floats = [a for n, a in reference(grads).items() if n != "step"]
    assert total[-1] == "global" and total[1:4] == ["", "", ""]
    assert float(total[4]) == pytest.approx(fnorm(floats), rel=1e-15)
    assert float(total[5]) == max(float(np.abs(a.astype(np.float64)).max()) for a in floats)


def test_several_checkpoints_give_one_summary_row_each(grads, sharded):
    out = run("global-norm", grads, sharded, env=WIDE).stdout.splitlines()
    assert out[0].split() == ["checkpoint", "global", "norm", "tensors", "skipped", "max", "|x|", "nan", "inf"]
    assert [line.split()[0] for line in out[1:]] == [str(grads), str(sharded)]


def test_several_checkpoints_summary_rows_cover_hidden_tensors(tmp_path):
    # found trying clipcli as a new user: several checkpoints' summary rows left out the tensors --top hid
    src = write_st(
        tmp_path / "bad.safetensors",
        {"a": np.ones(4, np.float32), "hidden": np.array([np.nan, 5.0, np.inf], np.float32)},
    )
    lines = run("global-norm", SAMPLES / "grads.safetensors", src, "--top", "1", "--sort", "name", env=WIDE)
    rows = {line.split()[0]: line.split()[1:] for line in lines.stdout.splitlines()[1:]}
    assert rows[str(SAMPLES / "grads.safetensors")] == ["145.376", "16", "1", "3.87341", "0", "0"]
    assert rows[str(src)] == ["nan", "2", "0", "inf", "1", "1"]
    out = js("global-norm", src, "--top", "1", "--sort", "name")["checkpoints"][0]
    assert (out["tensor_count"], out["max_abs"], out["nan"], out["inf"]) == (2, "inf", 1, 1)
    assert [t["name"] for t in out["tensors"]] == ["a"]


def test_fail_above(grads):
    g = js("global-norm", grads)["checkpoints"][0]["global_norm"]
    assert run("global-norm", grads, "--fail-above", g).exit_code == 0
    result = run("global-norm", grads, "--fail-above", "100", "--quiet")
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr == f"clipcli: error: {grads}: global norm {g!r} exceeds --fail-above 100\n"


def test_every_checkpoint_that_fails_the_gate_is_named(steps):
    # found by a fresh user (second review): of several checkpoints that failed a gate, one was named
    a, b = steps
    both = run("global-norm", a, b, "--fail-above", "0.1", "--quiet")
    assert both.exit_code == 1
    assert both.stderr.count("\n") == 1 and "2 of 2 checkpoints fail their gates" in both.stderr
    assert f"{a}: global norm" in both.stderr and f"{b}: global norm" in both.stderr
    one = run("global-norm", a, b, "--fail-above", "6.088", "--quiet")  # |a| 6.08767, |b| 6.0893
    assert one.exit_code == 1 and one.stderr.startswith(f"clipcli: error: {b}: global norm 6.0893")


@pytest.fixture
def nonfinite(tmp_path) -> Path:
    return write_st(
        tmp_path / "bad.safetensors",
        {
            "ok": np.ones(3, np.float32),
            "w": np.array([1.0, np.nan, np.inf, np.nan], np.float32),
            "v": np.array([-np.inf], ml_dtypes.bfloat16),
        },
    )


def test_fail_above_on_a_norm_that_is_not_finite(nonfinite):
    result = run("global-norm", nonfinite, "--fail-above", "1e30")
    assert result.exit_code == 1
    assert result.stderr == f"clipcli: error: {nonfinite}: global norm is nan, not finite (--fail-above 1e30)\n"


def test_a_gate_on_a_checkpoint_without_floating_tensors_is_a_usage_error(tmp_path):
    # found trying clipcli as a new user: a gate on a checkpoint without floating tensors passed, with nothing to check
    src = write_st(tmp_path / "ints.safetensors", {"step": np.array(3, np.int64)})
    assert ok("global-norm", src).stdout.startswith(f"{src}: global norm 0 over 0 tensors, 1 skipped")
    for gate in (["--fail-above", "1"], ["--fail-nonfinite"]):
        result = run("global-norm", src, *gate)
        assert result.exit_code == 2 and "the gate has nothing to check" in result.stderr


def test_fail_nonfinite(nonfinite, grads):
    assert run("global-norm", grads, "--fail-nonfinite").exit_code == 0
    result = run("global-norm", nonfinite, "--fail-nonfinite")
    assert result.exit_code == 1
    assert result.stderr == (
        f"clipcli: error: {nonfinite}: tensor w: holds 2 NaN values and 1 Inf value; also 1 other tensor: v\n"
    )
    (c,) = json.loads(run("global-norm", nonfinite, "--format", "json").stdout)["checkpoints"]
    assert c["global_norm"] == "nan"
    assert [(t["nan"], t["inf"], t["norm"], t["max_abs"]) for t in c["tensors"]] == [
        (0, 0, math.sqrt(3), 1.0),
        (2, 1, "nan", "inf"),
        (0, 1, "inf", "inf"),
    ]


def test_fail_nonfinite_sees_tensors_that_top_hides(tmp_path):
    # found trying clipcli as a new user: --fail-nonfinite passed on a NaN in a tensor that --top hid
    src = write_st(tmp_path / "bad.safetensors", {"a": np.ones(4, np.float32), "z": np.array([np.nan], np.float32)})
    result = run("global-norm", src, "--top", "1", "--sort", "name", "--fail-nonfinite", "--quiet")
    assert (result.exit_code, result.stderr) == (1, f"clipcli: error: {src}: tensor z: holds 1 NaN value\n")


def test_quiet_prints_nothing(grads):
    assert ok("global-norm", grads, "--quiet").stdout == ""


# --- inspect ----------------------------------------------------------------------------------------


def test_inspect_from_headers(grads, sharded):
    out = js("inspect", grads, sharded)
    assert out["command"] == "inspect" and "ord" not in out
    c, s = out["checkpoints"]
    assert c["format"] == "safetensors" and s["format"] == "sharded"
    assert c["metadata"] == {"format": "pt", "source": "clipcli samples/make_samples.py"}
    ref = reference(grads)
    assert {t["name"]: (t["dtype"], tuple(t["shape"]), t["nbytes"]) for t in c["tensors"]} == {
        n: (a.dtype.name, a.shape, a.nbytes) for n, a in ref.items()
    }
    assert {Path(t["file"]).name for t in s["tensors"]} == {
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    }
    table = run("inspect", sharded, "--include", "step", env=WIDE).stdout
    assert "step" in table and "model-00002-of-00002.safetensors" in table and "embed" not in table
    csv = ok("inspect", grads, "--format", "csv").stdout.splitlines()
    assert csv[0] == "path,name,dtype,shape,elements,nbytes,file,kind" and len(csv) == 19
    assert csv[-1].split(",")[-1] == "global"


def test_inspect_does_not_read_tensor_data(tmp_path):
    # A header that promises 1 GiB over a sparse file: inspect answers from the header alone.
    path = tmp_path / "huge.safetensors"
    path.write_bytes(st_bytes({"w": np.zeros(4, np.float32)}))
    header = {"w": {"dtype": "F32", "shape": [1 << 28], "data_offsets": [0, 1 << 30]}}
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + (1 << 30))
    (c,) = js("inspect", path)["checkpoints"]
    assert c["tensors"][0]["nbytes"] == 1 << 30


def test_inspect_shows_element_counts_and_the_parameter_count():
    # found trying clipcli as a new user: inspect showed no element counts and no parameter count
    out = ok("inspect", SAMPLES / "grads.safetensors").stdout.splitlines()
    tensors = reference(SAMPLES / "grads.safetensors").values()
    total, size = sum(a.size for a in tensors), sum(a.nbytes for a in tensors) / 1024
    assert out[0] == f"{SAMPLES / 'grads.safetensors'}: safetensors, 17 tensors, {total:,} parameters, {size:.1f} KiB"
    assert out[3].split()[:5] == ["tensor", "dtype", "shape", "elements", "size"]
    assert out[4].split()[3] == "16,384"  # 256 x 64


def test_inspect_of_a_checkpoint_without_tensors_says_so(tmp_path):
    # found in review: a header of columns over no rows; the JSON keeps "tensors": []
    empty_st, empty_npz = tmp_path / "e.safetensors", tmp_path / "e.npz"
    save_file({}, str(empty_st))
    np.savez(empty_npz)
    only_metadata = DATA / "torch" / "metadata_only.pt"  # torch.save({"step": 5, "lr": 0.1})
    for path in (only_metadata, empty_st, empty_npz):
        lines = ok("inspect", path).stdout.splitlines()
        assert lines[0].startswith(f"{path}: ") and ", 0 tensors, 0 parameters, 0 B" in lines[0]
        assert lines[-1] == "it holds no tensors" and not any(line.startswith("tensor ") for line in lines), lines
        (c,) = js("inspect", path)["checkpoints"]
        assert c["tensors"] == [] and c["tensor_count"] == 0
    # a pickle that names no global says so (was "...; globals:" over nothing)
    assert "  pickle: torch.load(weights_only=True) loads; it names no globals" in ok("inspect", only_metadata).stdout
    both = ok("inspect", only_metadata, SAMPLES / "grads.safetensors").stdout.splitlines()
    assert both.count("it holds no tensors") == 1 and any(line.split()[:2] == ["tensor", "dtype"] for line in both)


def test_blank_line_between_inspected_checkpoints_and_no_trailing_spaces():
    # found trying clipcli as a new user: inspected checkpoints ran together, and lines kept trailing spaces
    out = ok("inspect", SAMPLES / "grads.safetensors", SAMPLES / "grads.npz").stdout
    assert f"\n\n{SAMPLES / 'grads.npz'}: npz, 17 tensors" in out
    for args in (["inspect"], ["global-norm", "--depth", "2"], ["clip-norm", "--dry-run", "--clip-norm", "1"]):
        for line in ok(*args, SAMPLES / "grads.safetensors").stdout.splitlines():
            assert line == line.rstrip(), (args, line)


# --- clip-global-norm -------------------------------------------------------------------------------


def expected_scaled(a: np.ndarray, scale: float) -> np.ndarray:
    """The spec's arithmetic: float32(x) * float32(scale), rounded once to the dtype (float64 stays)."""
    if a.dtype == np.float64:
        return a * scale
    return (a.astype(np.float32) * np.float32(scale)).astype(a.dtype)


def test_clip_global_norm_output_against_references(grads, tmp_path):
    out = tmp_path / "clipped.safetensors"
    ref = reference(grads)
    g = fnorm([a for n, a in ref.items() if n != "step"])
    (c,) = js("clip-global-norm", grads, "-o", out, "--clip-norm", "5")["checkpoints"]
    assert c["global_norm"] == pytest.approx(g, rel=1e-15)
    assert c["scale"] == 5 / c["global_norm"]
    assert c["clip_norm"] == 5.0 and c["output"] == str(out)
    got = reference(out)
    assert set(got) == set(ref)
    for name, a in ref.items():
        expected = a if name == "step" else expected_scaled(a, c["scale"])
        assert got[name].tobytes() == expected.tobytes(), name
    assert c["global_norm_after"] == pytest.approx(fnorm([a for n, a in got.items() if n != "step"]), rel=1e-15)
    assert c["global_norm_after"] == pytest.approx(5.0, rel=1e-2)  # bfloat16 rounding
    with safe_open(out, "np") as f:
        assert f.metadata() == {"format": "pt", "source": "clipcli samples/make_samples.py"}
    for t in c["tensors"]:
        assert t["norm_after"] == pytest.approx(fnorm([got[t["name"]]]), rel=1e-15)


def test_clip_global_norm_no_clipping_is_bit_identical(grads, tmp_path):
    out = tmp_path / "same.safetensors"
    (c,) = js("clip-global-norm", grads, "-o", out, "--clip-norm", "1000")["checkpoints"]
    assert c["scale"] == 1.0
    assert out.read_bytes() == grads.read_bytes()


def test_clip_global_norm_use_norm(grads, tmp_path):
    out = tmp_path / "o.safetensors"
    (c,) = js("clip-global-norm", grads, "-o", out, "--clip-norm", "2", "--use-norm", "8")["checkpoints"]
    assert c["scale"] == 0.25
    w = "model.layers.0.self_attn.q_proj.weight"
    assert reference(out)[w].tobytes() == (reference(grads)[w] * np.float32(0.25)).tobytes()


def test_clip_global_norm_sharded_to_directory(sharded, tmp_path):
    out = tmp_path / "clipped"
    (c,) = js("clip-global-norm", sharded, "-o", out, "--clip-norm", "5")["checkpoints"]
    assert sorted(os.listdir(out)) == sorted(os.listdir(sharded))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    merged = {
        **reference(out / "model-00001-of-00002.safetensors"),
        **reference(out / "model-00002-of-00002.safetensors"),
    }
    original = reference(SAMPLES / "grads.safetensors")
    for name, a in original.items():
        expected = a if name == "step" else expected_scaled(a, c["scale"])
        assert merged[name].tobytes() == expected.tobytes()


def test_clip_global_norm_sharded_to_one_file(sharded, tmp_path):
    out = tmp_path / "merged.safetensors"
    ok("clip-global-norm", sharded, "-o", out, "--clip-norm", "5", "--quiet")
    assert set(reference(out)) == set(reference(SAMPLES / "grads.safetensors"))


def test_nonfinite_clip_is_refused_unless_allowed(nonfinite, tmp_path):
    out = tmp_path / "o.safetensors"
    for command in (["clip-global-norm"], ["clip-norm"]):
        result = run(*command, nonfinite, "-o", out, "--clip-norm", "1")
        assert result.exit_code == 1
        assert result.stderr == (
            f"clipcli: error: {nonfinite}: tensor w: holds 2 NaN values and 1 Inf value; also 1 other tensor: v\n"
        )
        assert not out.exists()
    ok("clip-global-norm", nonfinite, "-o", out, "--clip-norm", "1", "--allow-nonfinite")
    got = reference(out)
    assert all(np.isnan(got[n].astype(np.float64)).all() for n in ("ok", "w", "v"))


def test_clip_to_npz_converts_and_refuses_bfloat16(grads, tmp_path):
    result = run("clip-global-norm", grads, "-o", tmp_path / "o.npz", "--clip-norm", "5")
    assert result.exit_code == 3
    assert result.stderr.startswith(
        f"clipcli: error: {tmp_path / 'o.npz'}: tensor model.embed_tokens.weight: "
        "cannot write bfloat16 to .npy/.npz without losing it"
    )
    assert not (tmp_path / "o.npz").exists()
    ok("clip-global-norm", SAMPLES / "grads.npz", "-o", tmp_path / "o.safetensors", "--clip-norm", "5")
    with np.load(SAMPLES / "grads.npz") as z:
        assert reference(tmp_path / "o.safetensors")["step"] == z["step"]


def test_a_huge_clip_norm_over_a_tiny_norm_warns_of_nothing(steps):
    # found by a fresh user (third review): a huge --clip-norm over a tiny norm printed a RuntimeWarning
    a, _ = steps
    result = run("clip-global-norm", a, "--dry-run", "--clip-norm", "1e308", "--use-norm", "1e-308")
    assert result.exit_code == 0 and result.stderr == ""


@pytest.fixture
def huge(tmp_path) -> Path:
    """Like SciPy's special/tests/data/local.npz: finite float64 values near 1e308 (global norm > 1.8e308)."""
    path = tmp_path / "local.npz"
    rng = np.random.default_rng(1)
    np.savez_compressed(
        path,
        ellipkinc_neg_m=np.concatenate([np.full(40, 1e308), rng.standard_normal(100)]).reshape(20, 7),
        gammainc=rng.uniform(0, 1e14, (30, 3)),
    )
    return path


def exact_global_norm(arrays) -> Fraction:
    """The square of the global norm, exactly."""
    return sum((Fraction(float(x)) ** 2 for a in arrays for x in np.ravel(a)), Fraction(0))


def test_clip_global_norm_of_finite_values_beyond_float64_scales_by_the_exact_norm(huge, tmp_path):
    # found on a real file of another project: SciPy's local.npz (a global norm beyond float64) was clipped into NaNs
    out = tmp_path / "clipped.npz"
    (c,) = js("clip-global-norm", huge, "-o", out, "--clip-norm", "1")["checkpoints"]
    assert c["global_norm"] == "inf"  # too large for float64, as the report says
    arrays = npz_arrays(huge)
    square = exact_global_norm(arrays.values())
    scale = c["scale"]
    assert math.isfinite(scale) and scale > 0
    assert abs(Fraction(scale) ** 2 * square - 1) < Fraction(1, 10**14)  # scale = 1 / the exact norm
    clipped = npz_arrays(out)
    getcontext().prec = 60
    norm = Decimal(square.numerator).sqrt() / Decimal(square.denominator).sqrt()
    for name, before in arrays.items():
        assert np.isfinite(clipped[name]).all()
        # each x / the exact norm, to 2 ulps (the scale, 5.6e-310, keeps its 53 bits: a subnormal float64
        # would hold 44, and 1e-300-ish scales none)
        expected = np.array([float(Decimal(float(x)) / norm) for x in before.ravel()]).reshape(before.shape)
        np.testing.assert_array_max_ulp(clipped[name], expected, maxulp=2)
    assert c["global_norm_after"] == pytest.approx(1.0, rel=1e-14)


def test_nothing_is_ever_written_with_a_nan_scale(grads, tmp_path, monkeypatch):
    # found trying clipcli as a new user: a global norm beyond float64 gave a NaN scale, and NaNs were written
    monkeypatch.setattr(clip_commands, "stats_clip_scale", lambda stats, clip: math.nan)
    out = tmp_path / "o.safetensors"
    result = run("clip-global-norm", grads, "-o", out, "--clip-norm", "1")
    assert result.exit_code == 1
    assert result.stderr == f"clipcli: error: {grads}: the clip scale is not a number; refusing to write NaN values\n"
    assert not out.exists()


# --- clip-norm --------------------------------------------------------------------------------------


def test_clip_norm_per_tensor(grads, tmp_path):
    out = tmp_path / "o.safetensors"
    (c,) = js("clip-norm", grads, "-o", out, "--clip-norm", "4")["checkpoints"]
    ref, got = reference(grads), reference(out)
    for t in c["tensors"]:
        a = ref[t["name"]]
        n = fnorm([a])
        expected = a if n <= 4 else expected_scaled(a, 4 / n)
        assert got[t["name"]].tobytes() == expected.tobytes(), t["name"]
        assert t["norm_after"] <= 4 * (1 + 1e-2)


def test_clip_norm_along_axes(tmp_path):
    rng = np.random.default_rng(5)
    tensors = {
        "m": rng.standard_normal((300, 40)).astype(np.float32) * 3,
        "v": np.ones(5, np.float32),
        "t": rng.standard_normal((6, 7, 8)).astype(np.float32),
    }
    src = write_st(tmp_path / "a.safetensors", tensors)
    out = tmp_path / "o.safetensors"
    (c,) = js("clip-norm", src, "-o", out, "--clip-norm", "2", "--axes", "-1")["checkpoints"]
    got = reference(out)
    for name in ("m", "t", "v"):
        a = tensors[name].astype(np.float64)
        rows = np.sqrt((a * a).sum(axis=-1, keepdims=True))
        scale = np.where(rows <= 2, 1.0, 2 / rows)
        expected = (tensors[name] * scale.astype(np.float32)).astype(np.float32)
        assert got[name].tobytes() == expected.tobytes(), name
    (c,) = js("clip-norm", src, "-o", out, "--clip-norm", "2", "--axes", "0,1")["checkpoints"]
    assert c["skipped"] == [{"name": "v", "dtype": "float32", "reason": "rank 1 is too small for --axes 0,1"}]
    a = tensors["t"].astype(np.float64)
    cols = np.sqrt((a * a).sum(axis=(0, 1), keepdims=True))
    expected = (tensors["t"] * np.where(cols <= 2, 1.0, 2 / cols).astype(np.float32)).astype(np.float32)
    assert reference(out)["t"].tobytes() == expected.tobytes()
    assert reference(out)["v"].tobytes() == tensors["v"].tobytes()


def test_clip_norm_across_rows_streams_and_matches_the_library(tmp_path):
    # --axes with axis 0 (per-column norms) reads the tensor in chunks of whole row groups: the same bits
    # as clip_by_norm on the tensor in memory, for any --jobs
    rng = np.random.default_rng(6)
    tensors = {
        "w": (rng.standard_normal((3000, 1000)) * rng.uniform(0.1, 3, 1000)).astype(np.float32),  # 3 chunks
        "e": rng.standard_normal((700, 30, 50)).astype(ml_dtypes.bfloat16),
        "h": (rng.standard_normal((40, 6)) * 1e-3).astype(np.float16),
    }
    src = write_st(tmp_path / "a.safetensors", tensors)
    outputs = set()
    for axes in ("0", "0,-1"):
        for jobs in ("1", "3"):
            out = tmp_path / f"o{jobs}.safetensors"
            ok("clip-norm", src, "-o", out, "--clip-norm", "20", "--axes", axes, "--jobs", jobs, "--quiet")
            got = reference(out)
            for name, t in tensors.items():
                ax = tuple(int(a) for a in axes.split(","))
                expected = core.clip_by_norm(t, 20.0, ax)
                assert got[name].tobytes() == expected.tobytes(), (name, axes, jobs)
            outputs.add((axes, out.read_bytes()))
    assert len(outputs) == 2
    # and the library's norms across rows against float64 arithmetic
    a = tensors["w"].astype(np.float64)
    np.testing.assert_allclose(core.norm(tensors["w"], axis=0), np.sqrt((a * a).sum(axis=0)), rtol=1e-14)


def test_clip_norm_across_rows_holds_no_whole_tensor(tmp_path):
    import tracemalloc

    t = np.random.default_rng(7).standard_normal((4096, 4096)).astype(np.float32)  # 64 MiB
    src = write_st(tmp_path / "big.safetensors", {"w": t})
    tracemalloc.start()
    try:
        with open_checkpoint(src) as ckpt:
            options = clip_commands.ClipNormOptions(output=tmp_path / "o.safetensors", jobs=2, clip_norm=1.0, axes=(0,))
            clip_commands.clip_norm(ckpt, options)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 40 << 20, peak
    assert reference(tmp_path / "o.safetensors")["w"].tobytes() == core.clip_by_norm(t, 1.0, 0).tobytes()


def test_axes_that_fit_no_tensor_are_a_usage_error(steps, tmp_path):
    # found by a fresh user (second review): --axes that fit no selected tensor skipped them all, no usage error
    a, _ = steps
    out = tmp_path / "out.safetensors"
    result = run("clip-norm", a, "-o", out, "--clip-norm", "1", "--axes", "0,1,2")
    assert result.exit_code == 2
    assert "--axes 0,1,2 fits no selected tensor" in result.stderr and "rank 2 is too small" in result.stderr
    assert not out.exists()


def test_an_axis_named_twice_is_the_reason_given(tmp_path):
    # found by a fresh user (second review): a tensor skipped for an axis named twice did not say why
    rng = np.random.default_rng(2)
    path = write_st(
        tmp_path / "t.safetensors",
        {
            "flat": rng.standard_normal((4, 6)).astype(np.float32),
            "cube": rng.standard_normal((2, 3, 4)).astype(np.float32),
        },
    )
    (c,) = js("clip-norm", path, "--dry-run", "--clip-norm", "1", "--axes", "1,-1")["checkpoints"]
    assert c["skipped"] == [
        {"name": "flat", "dtype": "float32", "reason": "--axes 1,-1 names one axis twice for rank 2"}
    ]
    assert [t["name"] for t in c["tensors"]] == ["cube"]


def test_clip_norm_of_a_tensor_whose_norm_overflows_float64_is_finite(huge, tmp_path):
    # found on a real file of another project: a tensor whose norm overflows float64 was clipped into NaNs
    out = tmp_path / "clipped.npz"
    (c,) = js("clip-norm", huge, "-o", out, "--clip-norm", "2")["checkpoints"]
    rows = {t["name"]: t for t in c["tensors"]}
    assert rows["ellipkinc_neg_m"]["norm"] == "inf"
    assert rows["ellipkinc_neg_m"]["norm_after"] == pytest.approx(2.0, rel=1e-14)
    assert all(np.isfinite(a).all() for a in npz_arrays(out).values())


@pytest.mark.parametrize("suffix", [".safetensors", ".npy"])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("axes", ["-1", "1", "2", "0", "0,2"])
def test_clip_norm_along_axes_of_a_tensor_with_a_zero_length_dimension(tmp_path, suffix, dtype, axes):
    # found trying clipcli as a new user: clip-norm --axes failed on a tensor with a zero-length dimension
    if suffix == ".npy" and dtype is ml_dtypes.bfloat16:
        pytest.skip(".npy has no bfloat16")
    empty = np.zeros((4, 0, 2), dtype)
    src = tmp_path / f"z{suffix}"
    if suffix == ".npy":
        np.save(src, empty)
    else:
        write_st(src, {"z": empty, "w": np.ones((3, 1, 2), dtype)})
    out = tmp_path / f"o{suffix}"
    result = run("clip-norm", src, "-o", out, "--clip-norm", "1", "--axes", axes)
    assert result.exit_code == 0, result.output
    got = np.load(out) if suffix == ".npy" else reference(out)["z"]
    assert got.shape == (4, 0, 2)
    np.testing.assert_array_equal(core.clip_by_norm(empty, 1.0, axes=tuple(map(int, axes.split(",")))), got)


# --- clip-value -------------------------------------------------------------------------------------


def test_clip_value_rounds_bounds_to_each_dtype(tmp_path):
    tensors = {
        "b": np.array([0.5, 0.1, -3, np.nan], ml_dtypes.bfloat16),
        "f": np.array([0.5, -np.inf, np.inf, 0.05], np.float32),
        "i": np.array([5, -5], np.int64),
    }
    src = write_st(tmp_path / "v.safetensors", tensors)
    out = tmp_path / "o.safetensors"
    (c,) = js("clip-value", src, "-o", out, "--min", "-0.2", "--max", "0.1")["checkpoints"]
    assert (c["min"], c["max"]) == (-0.2, 0.1)
    got = reference(out)
    assert got["b"][0] == ml_dtypes.bfloat16(0.1) and float(got["b"][0]) == 0.10009765625
    assert float(got["b"][2]) == float(ml_dtypes.bfloat16(-0.2)) and np.isnan(got["b"][3].astype(np.float32))
    np.testing.assert_array_equal(got["f"], np.array([0.1, -0.2, 0.1, 0.05], np.float32))
    np.testing.assert_array_equal(got["i"], [5, -5])
    assert [s["name"] for s in c["skipped"]] == ["i"]


def test_clip_value_help_says_bounds_are_rounded():
    assert "0.10009765625" in ok("clip-value", "--help").stdout


def test_clip_reports_max_abs_after(grads, tmp_path):
    # found trying clipcli as a new user: the clip reports did not give the largest magnitude after the clip
    (c,) = js("clip-value", grads, "-o", tmp_path / "o.safetensors", "--min", "-0.01", "--max", "0.01")["checkpoints"]
    assert all(t["max_abs_after"] <= 0.010009765625 for t in c["tensors"])
    assert c["max_abs_after"] == max(t["max_abs_after"] for t in c["tensors"])


# --- Writing: --dry-run, --in-place, --report, the input protected ------------------------------------


def test_dry_run_writes_nothing(grads, tmp_path):
    (c,) = js("clip-global-norm", grads, "--dry-run", "--clip-norm", "5")["checkpoints"]
    assert c["output"] is None and c["global_norm_after"] == pytest.approx(5, rel=1e-2)
    assert sorted(os.listdir(tmp_path)) == ["grads.safetensors"]
    assert "dry run, nothing written" in ok("clip-value", grads, "--dry-run", "--min", "0", "--max", "1").stdout


def test_in_place(grads):
    before = reference(grads)
    ok("clip-global-norm", grads, "--in-place", "--clip-norm", "5", "--quiet")
    after = reference(grads)
    assert after["step"] == before["step"]
    assert fnorm([a for n, a in after.items() if n != "step"]) == pytest.approx(5, rel=1e-2)
    assert sorted(os.listdir(grads.parent)) == ["grads.safetensors"]


def test_output_onto_the_input_is_refused(grads):
    before = grads.read_bytes()
    result = run("clip-norm", grads, "-o", grads, "--clip-norm", "1")
    assert result.exit_code == 4
    assert result.stderr == f"clipcli: error: {grads}: refusing to overwrite the input (use --in-place to replace it)\n"
    assert grads.read_bytes() == before


def test_report_file(grads, tmp_path):
    report = tmp_path / "r.json"
    stdout = ok("clip-norm", grads, "--dry-run", "--clip-norm", "1", "--report", report, "--quiet").stdout
    assert stdout == ""
    data = json.loads(report.read_text())
    assert data["command"] == "clip-norm" and data["checkpoints"][0]["clip_norm"] == 1.0


def test_output_is_deterministic(grads, tmp_path):
    first = ok("clip-global-norm", grads, "-o", tmp_path / "a.safetensors", "--clip-norm", "5", "--format", "json")
    second = ok("clip-global-norm", grads, "-o", tmp_path / "b.safetensors", "--clip-norm", "5", "--format", "json")
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    assert first.stdout.replace("a.safetensors", "b.safetensors") == second.stdout


@pytest.mark.parametrize("over", ["input", "output"])
def test_the_report_is_never_written_over_a_checkpoint(steps, tmp_path, over):
    # found by a fresh user (second review): --report could name the input or the output and overwrite a checkpoint
    a, _ = steps
    out = tmp_path / "out.safetensors"
    before = digest(a)
    report = a if over == "input" else out
    result = run("clip-value", a, "-o", out, "--report", report, "--min", "-0.1", "--max", "0.1")
    assert result.exit_code == 4
    assert "refusing to write the report over a checkpoint" in result.stderr
    assert digest(a) == before and not out.exists()


def test_convert_over_its_input_says_to_write_elsewhere(steps):
    # found by a fresh user (second review): convert over its own input did not say to write elsewhere
    a, _ = steps
    before = digest(a)
    result = run("convert", a, "-o", a)
    assert result.exit_code == 4 and "refusing to overwrite the input (write to another path)" in result.stderr
    assert digest(a) == before


@pytest.fixture
def with_metadata(tmp_path) -> Path:
    rng = np.random.default_rng(5)
    tensors = {"w": rng.standard_normal((8, 4)).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32)}
    return write_st(tmp_path / "m.safetensors", tensors, {"format": "pt"})


@pytest.mark.parametrize(
    "args",
    [
        ["convert"],
        ["clip-value", "--min", "-0.5", "--max", "0.5"],
        ["clip-norm", "--clip-norm", "1"],
        ["clip-global-norm", "--clip-norm", "1"],
    ],
)
def test_metadata_into_npz_is_refused_unless_dropped(with_metadata, tmp_path, args):
    # found by a fresh user (second review): a clip into .npz dropped the metadata silently (convert refused it)
    command, *options = args
    out = tmp_path / "out.npz"
    result = run(command, with_metadata, "-o", out, *options)
    assert result.exit_code == 3
    assert "the metadata (1 entry: format) has no place in an .npz" in result.stderr
    assert "--drop-metadata" in result.stderr and not out.exists()
    ok(command, with_metadata, "-o", out, *options, "--drop-metadata")
    reference = load_file(with_metadata)
    with np.load(out) as z:
        assert sorted(z.files) == sorted(reference)
        if command == "convert":
            for name, values in reference.items():
                np.testing.assert_array_equal(z[name], values)


@pytest.mark.parametrize("where", ["missing/r.json", "a directory"])
def test_a_report_that_cannot_be_written_is_found_before_the_output_is(steps, tmp_path, where):
    # found by a fresh user (third review): an unwritable --report failed only after the output was written
    a, _ = steps
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"old")
    report = tmp_path / where
    if where == "a directory":
        report.mkdir()
    result = run("clip-global-norm", a, "-o", out, "--clip-norm", "1", "--report", report)
    assert result.exit_code == 4 and out.read_bytes() == b"old"
    result = run("convert", a, "-o", tmp_path / "c.safetensors", "--report", report)
    assert result.exit_code == 4 and not (tmp_path / "c.safetensors").exists()


def test_an_npy_output_that_would_rename_the_tensor_is_refused(tmp_path):
    # found by a fresh user (third review): an .npy output not named after its tensor lost the tensor's name
    src = write_st(tmp_path / "small.safetensors", {"x": np.arange(3, dtype=np.float32)})
    result = run("convert", src, "-o", tmp_path / "s.npy")
    assert result.exit_code == 3 and "an .npy holds no name: tensor 'x' would be read back as 's'" in result.stderr
    assert not (tmp_path / "s.npy").exists()
    ok("convert", src, "-o", tmp_path / "x.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "x.npy"), np.arange(3, dtype=np.float32))
    ok("clip-value", tmp_path / "x.npy", "-o", tmp_path / "y.npy", "--min", "0", "--max", "1")  # .npy to .npy


def test_shards_of_another_layout_in_the_output_directory_are_refused(tmp_path):
    # found by a fresh user (third review): shards of another layout were left beside the new ones in the output
    out = tmp_path / "shards"
    ok("convert", SAMPLES / "grads.safetensors", "-o", f"{out}/", "--max-shard-size", "50KB")
    before = {p.name: digest(p) for p in out.iterdir()}
    result = run("convert", SAMPLES / "grads.safetensors", "-o", f"{out}/", "--max-shard-size", "1MB")
    assert result.exit_code == 4 and "which this write would leave beside its own shards" in result.stderr
    assert {p.name: digest(p) for p in out.iterdir()} == before
    ok("convert", SAMPLES / "grads.safetensors", "-o", f"{out}/", "--max-shard-size", "50KB")  # the same layout


def test_a_report_in_a_directory_that_is_not_writable_is_refused_first(steps, tmp_path, monkeypatch):
    # found after the third review: a --report into a directory clipcli may not write was found after the output
    a, _ = steps
    out = tmp_path / "out.safetensors"
    report_dir = tmp_path / "locked"
    report_dir.mkdir()
    real = os.access  # root may write anywhere: the directory is made unwritable to clipcli's eyes
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != report_dir and real(p, mode))
    result = run("clip-value", a, "-o", out, "--min", "0", "--max", "1", "--report", report_dir / "r.json")
    assert result.exit_code == 4 and "is not writable" in result.stderr and not out.exists()


# --- Usage errors (2), before any file is read ------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["clip-norm", "missing.safetensors", "-o", "o.safetensors", "--clip-norm", "0"],
        ["clip-norm", "missing.safetensors", "-o", "o.safetensors", "--clip-norm", "-1"],
        ["clip-norm", "missing.safetensors", "-o", "o.safetensors", "--clip-norm", "inf"],
        ["clip-norm", "missing.safetensors", "-o", "o.safetensors", "--clip-norm", "nan"],
        ["clip-norm", "missing.safetensors", "-o", "o.safetensors", "--clip-norm", "abc"],
        ["clip-norm", "missing.safetensors", "-o", "o.safetensors", "--clip-norm", "1", "--axes", "a,b"],
        ["clip-norm", "missing.safetensors", "-o", "o.safetensors", "--clip-norm", "1", "--axes", "0,0"],
        ["clip-global-norm", "missing.safetensors", "-o", "o.safetensors", "--clip-norm", "1", "--use-norm", "-1"],
        ["clip-global-norm", "missing.safetensors", "-o", "o.safetensors", "--clip-norm", "1", "--use-norm", "inf"],
        ["clip-global-norm", "missing.safetensors", "--clip-norm", "1"],
        ["clip-global-norm", "missing.safetensors", "-o", "o.safetensors", "--in-place", "--clip-norm", "1"],
        ["clip-global-norm", "a.safetensors", "b.safetensors", "--clip-norm", "1"],  # several: -o DIR or --in-place
        ["clip-value", "missing.safetensors", "-o", "o.safetensors", "--min", "2", "--max", "1"],
        ["clip-value", "missing.safetensors", "-o", "o.safetensors", "--min", "1"],
        ["global-norm", "missing.safetensors", "--ord", "0"],
        ["global-norm", "missing.safetensors", "--ord", "-2"],
        ["global-norm", "missing.safetensors", "--depth", "0"],
        ["global-norm", "missing.safetensors", "--sort", "random"],
        ["global-norm", "missing.safetensors", "--fail-above", "x"],
        ["global-norm", "missing.safetensors", "--format", "xml"],
        ["global-norm"],
        ["frobnicate"],
    ],
)
def test_usage_errors_exit_2_before_reading(args):
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert "Usage: clipcli" in result.output
    assert "no such file" not in result.output


@pytest.mark.parametrize(("command", "gate"), [("global-norm", "--fail-above"), ("diff", "--fail-rel-above")])
def test_a_negative_threshold_is_a_usage_error(steps, command, gate):
    # found by a fresh user (second review): a negative --fail-above or --fail-rel-above was accepted
    a, b = steps
    paths = [a] if command == "global-norm" else [a, b]
    result = run(command, *paths, gate, "-1")
    assert result.exit_code == 2 and "must be a number >= 0" in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["clip-global-norm", "--clip-norm", "1"],
        ["clip-norm", "--clip-norm", "1"],
        ["clip-value", "--min", "0", "--max", "1"],
    ],
)
def test_a_clip_with_nothing_selected_writes_nothing_and_exits_2(grads, tmp_path, args):
    # found trying clipcli as a new user: a clip with nothing selected (a typo in --include) was not a usage error
    out = tmp_path / "o.safetensors"
    for selection in (["--include", "Model.*"], ["--include", "step"]):
        result = run(args[0], grads, "-o", out, *args[1:], *selection)
        assert result.exit_code == 2, result.output
        assert not out.exists()
    assert "no real floating tensor is selected" in result.stderr or "no floating" in result.stderr


@pytest.mark.parametrize("target", ["out.txt", "-", "/dev/full", "out.pt5"])
def test_an_output_that_names_no_format_is_a_usage_error(grads, tmp_path, target):
    # found trying clipcli as a new user: an -o naming no format (out.txt, -) was not a usage error
    path = target if target.startswith("/") or target == "-" else str(tmp_path / target)
    result = run("clip-global-norm", grads, "-o", path, "--clip-norm", "5")
    assert result.exit_code == 2, result.output
    assert "Usage:" in result.stderr and "Invalid value for -o" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grads.safetensors"]


def test_a_sharded_input_does_not_make_a_directory_named_out_txt(tmp_path):
    # found trying clipcli as a new user: a sharded input clipped to -o out.txt made a directory named out.txt
    shutil.copytree(SAMPLES / "sharded", tmp_path / "sharded")
    result = run("clip-global-norm", tmp_path / "sharded", "-o", tmp_path / "out.txt", "--clip-norm", "5")
    assert result.exit_code == 2 and "unknown output format '.txt'" in result.stderr
    assert not (tmp_path / "out.txt").exists()
    ok("clip-global-norm", tmp_path / "sharded", "-o", f"{tmp_path / 'out.d'}/", "--clip-norm", "5", "--quiet")
    assert (tmp_path / "out.d" / "model.safetensors.index.json").exists()


# --- Unreadable input (3), write failures (4), bugs (70), interrupts (130) ----------------------------


def test_unreadable_inputs_exit_3(tmp_path):
    result = run("global-norm", tmp_path / "missing.safetensors")
    assert (result.exit_code, result.stderr) == (
        3,
        f"clipcli: error: {tmp_path / 'missing.safetensors'}: no such file or directory\n",
    )
    lfs = tmp_path / "model.safetensors"
    lfs.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 9\n")
    result = run("clip-global-norm", lfs, "-o", tmp_path / "out.safetensors", "--clip-norm", "1")
    assert result.exit_code == 3
    assert result.stderr == (
        f"clipcli: error: {lfs}: not a safetensors file: a Git LFS pointer, not the "
        "checkpoint itself (run `git lfs pull`)\n"
    )
    assert not (tmp_path / "out.safetensors").exists()


def test_write_failures_exit_4(grads, tmp_path):
    (tmp_path / "adir.safetensors").mkdir()
    result = run("clip-norm", grads, "-o", tmp_path / "adir.safetensors", "--clip-norm", "1")
    assert (result.exit_code, result.stderr) == (
        4,
        f"clipcli: error: {tmp_path / 'adir.safetensors'}: is a directory\n",
    )
    result = run("clip-norm", grads, "-o", tmp_path / "no" / "such" / "dir.safetensors", "--clip-norm", "1")
    assert result.exit_code == 4
    assert result.stderr.startswith(f"clipcli: error: {tmp_path / 'no' / 'such' / 'dir.safetensors'}: ")
    result = run("clip-norm", grads, "-o", tmp_path / "outdir", "--clip-norm", "1")
    assert result.exit_code == 2 and "a directory output needs a sharded input" in result.stderr


def test_internal_errors_exit_70_with_one_line(grads, monkeypatch):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("division by zero\nsecond line")

    monkeypatch.setattr(norm_commands, "norm_report", broken)
    result = run("global-norm", grads)
    assert result.exit_code == 70
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("clipcli: error: internal error (ZeroDivisionError: division by zero second line);")
    assert "Traceback" not in result.output
    result = run("global-norm", grads, "--debug")  # the traceback, then the same line and status
    assert result.exit_code == 70
    assert "Traceback" in result.stderr and "ZeroDivisionError: division by zero" in result.stderr
    assert result.stderr.splitlines()[-1].startswith("clipcli: error: internal error (ZeroDivisionError:")


def test_debug_keeps_the_exit_status(tmp_path):
    # review 28: with --debug every error exited 1 (Python's status for an exception), where the table says 3
    result = run("inspect", tmp_path / "missing.pt", "--debug")
    assert result.exit_code == 3
    assert "Traceback" in result.stderr
    assert result.stderr.splitlines()[-1].startswith(f"clipcli: error: {tmp_path / 'missing.pt'}: ")


def test_interrupt_exits_130(grads, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(clip_commands, "clip_global_norm", interrupted)
    result = run("clip-global-norm", grads, "-o", grads.parent / "o.safetensors", "--clip-norm", "1")
    assert (result.exit_code, result.stderr) == (130, "clipcli: interrupted\n")


def test_a_checkpoint_on_a_pipe_is_refused_with_what_to_do():
    # found by a fresh user (second review): a checkpoint on a pipe got no message saying what to do
    with open(SAMPLES / "grads.safetensors", "rb") as f:
        done = subprocess.run(
            [sys.executable, "-m", "clipcli", "global-norm", "/dev/stdin"],
            env=ENV,
            capture_output=True,
            check=False,
            input=f.read(),
        )
    assert done.returncode == 3
    assert b"not a regular file (a pipe or a device?)" in done.stderr and b"save it to a file first" in done.stderr


# --- The JSON report ----------------------------------------------------------------------------------

_FLOATS = st.one_of(st.none(), st.floats(), st.sampled_from([0.0, -0.0, 5e-324, 1.7976931348623157e308]))


@settings(max_examples=300, deadline=None)
@given(
    name=st.text(),
    dtype=st.sampled_from(["float32", "bfloat16", "float8_e4m3fn"]),
    shape=st.lists(st.integers(0, 2**40), max_size=4).map(tuple),
    figures=st.tuples(st.floats(), st.floats(), _FLOATS, _FLOATS, _FLOATS),
    counts=st.tuples(st.integers(0, 2**63), st.integers(0, 2**63)),
    clip=st.booleans(),
)
def test_a_tensor_row_is_written_as_the_encoder_writes_it(name, dtype, shape, figures, counts, clip):
    norm, max_abs, share, norm_after, max_abs_after = figures
    row = report_rows.TensorRow(name, dtype, shape, 0, norm, max_abs, *counts, share, norm_after, max_abs_after)
    num = report_render.num
    fields = {"name": name, "dtype": dtype, "shape": list(shape), "norm": num(norm), "max_abs": num(max_abs),
              "nan": counts[0], "inf": counts[1], "share": num(share)}  # fmt: skip
    if clip:
        fields |= {"norm_after": num(norm_after), "max_abs_after": num(max_abs_after)}
    expected = report_render.COMPACT.encode(fields)
    assert norm_report.tensor_json(row, clip) == expected
    assert json.loads(expected)["name"] == name


@pytest.mark.parametrize("encoding", ["cp1252", "ascii"])
def test_a_stdout_that_is_not_utf8_gets_utf8_json_and_an_escaped_table(tmp_path, encoding):
    # a report redirected under a Windows code page or LANG=C used to end in exit 70 (the table's bars, a name)
    names = ["ünï.\U0001f600.w", "a.b"]
    src = write_st(tmp_path / "m.safetensors", {n: np.ones(3, np.float32) for n in names})
    env = {**os.environ, "PYTHONIOENCODING": encoding, "NO_COLOR": "1"}

    def run_cli(*args):
        command = [sys.executable, "-m", "clipcli", "global-norm", str(src), *args]
        done = subprocess.run(command, capture_output=True, env=env, check=False)
        assert (done.returncode, done.stderr) == (0, b""), done.stderr
        return done.stdout

    report = json.loads(run_cli("--format", "json").decode("utf-8"))
    assert sorted(t["name"] for t in report["checkpoints"][0]["tensors"]) == sorted(names)
    assert "ünï" in run_cli("--format", "csv").decode("utf-8")
    table = run_cli().decode(encoding)
    lines = table.splitlines()[1:]
    assert "#" in table and "\\U0001f600" in table  # no block bars in the encoding; the name escaped
    # in line: escaped before the columns were measured (a review found them escaped after)
    assert len({line.index("float32") for line in lines[1:]} | {lines[0].index("dtype")}) == 1


def test_no_column_headings_over_no_rows(tmp_path):
    steps = write_st(tmp_path / "steps.safetensors", {"step": np.array([7])})
    out = ok("global-norm", steps).stdout
    assert out.splitlines()[1:] == ["skipped step (int64): not a floating tensor"]


def test_csv_escapes_names_in_every_row_the_same_way(tmp_path):
    src = write_st(tmp_path / "m.safetensors", {"esc\x1b[31m.a": np.ones(2, np.float32), "esc\x1b[31m.b": np.ones(3)})
    out = ok("global-norm", src, "--format", "csv", "--depth", "1").stdout
    assert "\x1b" not in out
    assert out.count("esc\\x1b[31m") == 3  # two tensor rows and their group's


def test_the_json_report_has_one_line_per_row_and_parses_to_every_row(tmp_path):
    names = ["a", 'quote " and \\ backslash', "new\nline", "esc\x1b[31m", "ünï", '}, {"name": ']
    src = write_st(tmp_path / "m.safetensors", {n: np.full(3, i, np.float32) for i, n in enumerate(names)})
    out = ok("global-norm", src, "--format", "json").stdout
    (c,) = json.loads(out)["checkpoints"]
    assert sorted(t["name"] for t in c["tensors"]) == sorted(names)
    rows = [line for line in out.splitlines() if line.lstrip().startswith('{"name": ')]
    assert len(rows) == len(names)
    assert [json.loads(line.strip().rstrip(","))["name"] for line in rows] == [t["name"] for t in c["tensors"]]
    steps = write_st(tmp_path / "steps.safetensors", {"step": np.array([7])})
    empty = json.loads(ok("global-norm", steps, "--format", "json").stdout)["checkpoints"][0]
    assert (empty["tensors"], empty["tensor_count"], empty["skipped"][0]["name"]) == ([], 0, "step")


# --- The table --------------------------------------------------------------------------------------


def test_table_matches_the_golden_file(grads, monkeypatch):
    monkeypatch.chdir(grads.parent)
    got = ok("global-norm", "grads.safetensors", "--depth", "3").stdout
    golden = GOLDEN / "global-norm.txt"
    if os.environ.get("CLIPCLI_UPDATE_GOLDEN"):
        golden.write_text(got)
    assert got == golden.read_text()


def test_clip_table_matches_the_golden_file(grads, monkeypatch):
    monkeypatch.chdir(grads.parent)
    got = ok("clip-global-norm", "grads.safetensors", "-o", "clipped.safetensors", "--clip-norm", "5").stdout
    golden = GOLDEN / "clip-global-norm.txt"
    if os.environ.get("CLIPCLI_UPDATE_GOLDEN"):
        golden.write_text(got)
    assert got == golden.read_text()


def test_names_are_text_never_markup_and_never_truncated(tmp_path):
    long = "model.layers.17.block_sparse_moe.experts.63.w2.weight.with.a.very.long.suffix.that.goes.on"
    src = write_st(
        tmp_path / "m.safetensors",
        {"attn[k]": np.ones(2, np.float32), "[bold]x[/bold]": np.ones(1), long: np.ones(3, np.float32)},
    )
    table = run("global-norm", src).stdout
    assert "attn[k]" in table and "[bold]x[/bold]" in table
    assert long in table.replace("\n", "") or all(part in table for part in long.split("."))
    assert "…" not in table
    wide = run("global-norm", src, env=WIDE).stdout
    assert long in wide  # not a terminal and no COLUMNS: one line per row, however long


@pytest.mark.parametrize("columns", ["40", "60", "80", None])
def test_names_are_never_wrapped_at_any_width(columns):
    # found trying clipcli as a new user: a narrow terminal wrapped tensor names over two lines
    env = {**ENV, "COLUMNS": columns, "TERMINAL_WIDTH": columns}
    names = [n for n in reference(SAMPLES / "grads.safetensors") if n != "step"]
    for args in (["global-norm"], ["inspect"], ["clip-norm", "--dry-run", "--clip-norm", "1"]):
        lines = run(*args, SAMPLES / "grads.safetensors", env=env).stdout.splitlines()
        for name in names:
            assert any(line.startswith(name + " ") for line in lines), (args, name)
    piped = subprocess.run(
        [sys.executable, "-m", "clipcli", "global-norm", str(SAMPLES / "grads.safetensors")],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "60"},
        check=True,
    ).stdout
    assert sum(line.startswith("model.") for line in piped.splitlines()) == 16


def test_many_skipped_tensors_are_summed_up_by_reason(tmp_path):
    # found by a fresh user (second review): every skipped tensor took a line of the table, however many
    tensors = {f"step.{i}": np.array(i, np.int64) for i in range(12)}
    tensors["w"] = np.ones((2, 2), np.float32)
    path = write_st(tmp_path / "t.safetensors", tensors)
    text = ok("global-norm", path).stdout
    assert "skipped 12 tensors (step.0, step.1, step.10, ...): not a floating tensor" in text
    assert "(every skipped tensor is listed in --format json)" in text
    assert "skipped step.11" not in text
    assert len(js("global-norm", path)["checkpoints"][0]["skipped"]) == 12


def test_grammar_and_options_echoed_as_written(tmp_path):
    # found trying clipcli as a new user: 'over 1 tensors', and options echoed in another form than written
    src = write_st(tmp_path / "one.safetensors", {"w": np.array([np.nan, np.inf, 1.0], np.float32)})
    assert "over 1 tensor;" in ok("clip-value", src, "--dry-run", "--min", "0", "--max", "1").stdout
    result = run("clip-norm", src, "--dry-run", "--clip-norm", "1")
    assert result.stderr == f"clipcli: error: {src}: tensor w: holds 1 NaN value and 1 Inf value\n"
    result = run("global-norm", SAMPLES / "grads.safetensors", "--fail-above", "1e2", "--quiet")
    assert result.stderr.endswith("exceeds --fail-above 1e2\n")


def test_drawing_a_table_does_not_load_rich(tmp_path):
    # found measuring many tensors: rich drew a table of thousands of rows slowly; the table is plain text now
    src = write_st(tmp_path / "many.safetensors", {f"t{i}": np.ones(2, np.float32) for i in range(100)})
    code = (
        "import sys; from clipcli.cli import main\n"
        f"try: main(['global-norm', {str(src)!r}])\n"
        "except SystemExit: pass\n"
        "assert 'rich' not in sys.modules, sorted(m for m in sys.modules if m.startswith('rich'))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


# --- A real process ---------------------------------------------------------------------------------


def test_real_subprocess(grads, tmp_path):
    env = {**os.environ, "NO_COLOR": "1"}
    cmd = [sys.executable, "-m", "clipcli"]
    done = subprocess.run(
        [*cmd, "global-norm", str(grads), "--format", "json"], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["checkpoints"][0]["global_norm"] > 0
    done = subprocess.run(
        [*cmd, "global-norm", str(grads), "--fail-above", "1"], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 1 and done.stderr.startswith("clipcli: error: ")
    done = subprocess.run(
        [*cmd, "inspect", str(tmp_path / "nope.npz")], capture_output=True, text=True, env=env, check=False
    )
    assert (done.returncode, done.stderr) == (
        3,
        f"clipcli: error: {tmp_path / 'nope.npz'}: no such file or directory\n",
    )
    done = subprocess.run(
        [*cmd, "clip-norm", str(grads), "--clip-norm", "0"], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 2 and "Usage: clipcli clip-norm" in done.stderr
    done = subprocess.run([*cmd, "--version"], capture_output=True, text=True, env=env, check=False)
    assert done.stdout.startswith("clipcli ")


def test_copies_into_in_order_outputs_are_the_same_bytes_whatever_jobs(tmp_path):
    """A copy into an output written in order (.pt, .npz) reads its next chunks in threads with --jobs above 1:
    the same bytes as one thread, every zip record's CRC-32 right (zipfile's check), every value the input's."""
    rng = np.random.default_rng(24)
    tensors = {
        "w": rng.standard_normal((3000, 1000)).astype(np.float32),
        "h": rng.standard_normal((1000, 3000)).astype(np.float16),
        "r": rng.standard_normal((2000, 777)).astype(np.float32),
    }
    src = write_st(tmp_path / "big.safetensors", tensors)
    for suffix in (".pt", ".npz"):
        out = tmp_path / f"out{suffix}"
        outs = set()
        for jobs in ("1", "2", "3"):
            ok("convert", src, "-o", out, "--jobs", jobs, "--quiet")
            outs.add(out.read_bytes())
        assert len(outs) == 1, suffix
        with zipfile.ZipFile(out) as z:
            assert z.testzip() is None
            if suffix == ".pt":  # each storage a record of its bytes alone
                assert {z.read(f"out/data/{i}") for i in range(3)} == {t.tobytes() for t in tensors.values()}
            else:
                assert all(z.read(f"{name}.npy").endswith(t.tobytes()) for name, t in tensors.items())


def test_jobs_do_not_change_reports_or_outputs(tmp_path):
    rng = np.random.default_rng(4)
    src = write_st(
        tmp_path / "big.safetensors",
        {
            "w": rng.standard_normal((3000, 1000)).astype(np.float32),
            "b": rng.standard_normal((1000, 3000)).astype(ml_dtypes.bfloat16),
            "r": rng.standard_normal((2000, 777)).astype(np.float32),
        },
    )
    reports, files = set(), set()
    for jobs in ("1", "2", "3"):
        out = tmp_path / f"o{jobs}.safetensors"
        reports.add(ok("global-norm", src, "--jobs", jobs, "--format", "json").stdout)
        ok("clip-global-norm", src, "-o", out, "--clip-norm", "1", "--jobs", jobs, "--quiet")
        ok(
            "clip-norm",
            src,
            "-o",
            tmp_path / f"n{jobs}.safetensors",
            "--clip-norm",
            "1",
            "--axes",
            "-1",
            "--jobs",
            jobs,
            "--quiet",
        )
        value = tmp_path / f"v{jobs}.safetensors"
        clipped = ok("clip-value", src, "-o", value, "--min", "-1", "--max", "1", "--jobs", jobs, "--format", "json")
        reports.add(clipped.stdout.replace(str(value), "OUT"))
        files.add((out.read_bytes(), (tmp_path / f"n{jobs}.safetensors").read_bytes(), value.read_bytes()))
    assert len(reports) == 2 and len(files) == 1
    # clip-value takes its norms before clipping from the one pass that clips: the same as global-norm's
    by_command = {json.loads(r)["command"]: json.loads(r)["checkpoints"][0]["tensors"] for r in reports}
    measured, clipped = by_command["global-norm"], by_command["clip-value"]
    assert [(t["name"], t["norm"], t["max_abs"]) for t in measured] == [
        (t["name"], t["norm"], t["max_abs"]) for t in clipped
    ]


def test_clip_value_reads_the_checkpoint_once(grads, tmp_path, monkeypatch):
    runs = []
    real = pass_runner.run_pass
    monkeypatch.setattr(pass_runner, "run_pass", lambda *a, **k: runs.append(len(a[1])) or real(*a, **k))
    (c,) = js("clip-value", grads, "-o", tmp_path / "o.safetensors", "--min", "-0.01", "--max", "0.01")["checkpoints"]
    assert runs == [17]  # one pass over every tensor: it measures, clips and writes
    assert all(t["norm_after"] <= t["norm"] for t in c["tensors"])


def test_sort_by_norm_puts_nan_first(nonfinite):
    (c,) = js("global-norm", nonfinite, "--sort", "norm")["checkpoints"]
    assert [t["name"] for t in c["tensors"]] == ["w", "v", "ok"]  # NaN, then inf, then finite


def test_jobs_option_is_honoured_up_to_the_cores(grads, monkeypatch):
    seen = []
    real = norm_commands.measured_norms

    def spy(*args, **kwargs):
        seen.append(args[1].jobs)
        return real(*args, **kwargs)

    monkeypatch.setattr(norm_commands, "measured_norms", spy)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
    ok("global-norm", grads, "--jobs", "3", "--quiet")
    ok("global-norm", grads, "--jobs", "5", "--quiet")  # never more workers than cores
    ok("global-norm", grads, "--quiet")
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    ok("global-norm", grads, "--quiet")
    assert seen == [3, 4, 4, 6]


def test_progress_bar_only_on_a_terminal(grads, monkeypatch):
    from clipcli import cli_output

    monkeypatch.setattr(cli_output, "PROGRESS_MIN_BYTES", 0)
    plain = run("global-norm", grads, "--format", "json")
    assert plain.stderr == ""  # not a terminal: no bar
    advanced = []
    monkeypatch.setattr(cli_output, "is_terminal", lambda stream: True)
    from rich.progress import Progress

    real_advance = Progress.advance
    monkeypatch.setattr(Progress, "advance", lambda self, task, n: advanced.append(n) or real_advance(self, task, n))
    result = run("global-norm", grads, "--format", "json")
    assert sum(advanced) == sum(a.nbytes for n, a in reference(grads).items() if n != "step")
    assert json.loads(result.stdout) == json.loads(plain.stdout)  # the bar never touches stdout


def test_progress_names_each_pass(grads, tmp_path, monkeypatch):
    # found trying clipcli as a new user: the progress bar did not say which pass (measuring, writing) it showed
    from rich.progress import Progress

    from clipcli import cli_output

    monkeypatch.setattr(cli_output, "PROGRESS_MIN_BYTES", 0)
    monkeypatch.setattr(cli_output, "is_terminal", lambda stream: True)
    added = []
    real = Progress.add_task
    monkeypatch.setattr(
        Progress, "add_task", lambda self, label, total: added.append((label, total)) or real(self, label, total=total)
    )
    ok("clip-global-norm", grads, "-o", tmp_path / "o.safetensors", "--clip-norm", "1", "--quiet")
    assert added == []  # --quiet: no bar
    ok("clip-global-norm", grads, "-o", tmp_path / "o.safetensors", "--clip-norm", "1")
    tensors = reference(grads)
    floats = sum(a.nbytes for n, a in tensors.items() if n != "step")
    assert added == [("measuring", floats), ("writing", sum(a.nbytes for a in tensors.values()))]


def test_a_safetensors_run_imports_no_reader_it_does_not_need(tmp_path):
    # found profiling start-up: every run imported PyTorch's reader, the thread pool (with logging) and tempfile;
    # they are imported when a file or a write needs them
    src = write_st(tmp_path / "few.safetensors", {f"t{i}": np.ones(2, np.float32) for i in range(3)})
    unneeded = ["clipcli.checkpoint.formats.torch", "clipcli.checkpoint.formats.dcp",
                "clipcli.checkpoint.formats._pickle", "clipcli.checkpoint.formats.npz", "zipfile",
                "concurrent.futures", "tempfile"]  # fmt: skip
    code = (
        "import sys; from clipcli.cli import main\n"
        f"try: main(['global-norm', {str(src)!r}, '--format', 'json'])\n"
        "except SystemExit: pass\n"
        f"print([m for m in {unneeded!r} if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
    # and they are there when needed: a clip writes through tempfile
    code = code.replace(
        "'global-norm', ", f"'clip-norm', '-o', {str(tmp_path / 'o.safetensors')!r}, '--clip-norm', '1', "
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "['tempfile']"


def test_a_closed_pipe_is_not_an_error(tmp_path):
    src = write_st(tmp_path / "many.safetensors", {f"t{i}": np.ones(3, np.float32) for i in range(3000)})
    proc = subprocess.Popen(
        [sys.executable, "-m", "clipcli", "global-norm", str(src), "--format", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "NO_COLOR": "1"},
    )
    assert proc.stdout.readline() == b"{\n"
    proc.stdout.close()  # like `clipcli ... | head -1`
    stderr = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=60) == 0, stderr
    assert stderr == ""


def test_in_place_on_a_sharded_checkpoint(sharded):
    before = {p.name: p.read_bytes() for p in sharded.iterdir()}
    (c,) = js("clip-global-norm", sharded, "--in-place", "--clip-norm", "5")["checkpoints"]
    assert sorted(p.name for p in sharded.iterdir()) == sorted(before)
    after = json.loads(ok("global-norm", sharded, "--format", "json").stdout)["checkpoints"][0]
    assert after["global_norm"] == c["global_norm_after"]
    assert (sharded / "model-00001-of-00002.safetensors").read_bytes() != before["model-00001-of-00002.safetensors"]


def test_small_and_large_orders_work_and_orders_above_1e15_are_a_usage_error(tmp_path):
    src = tmp_path / "p.safetensors"
    src.write_bytes(st_bytes({"v": np.array([3, 4], np.float32)}))
    got = js("global-norm", src, "--ord", "0.05")["checkpoints"][0]["global_norm"]
    assert got == pytest.approx((3**0.05 + 4**0.05) ** 20, rel=1e-12)
    got = js("global-norm", src, "--ord", "2000")["checkpoints"][0]["global_norm"]
    assert got == pytest.approx(4 * (1 + 0.75**2000) ** (1 / 2000), rel=1e-15)  # was refused up to 1000
    other = tmp_path / "q.safetensors"
    other.write_bytes(st_bytes({"v": np.array([3, 5], np.float32)}))
    assert js("diff", src, other, "--ord", "1e6")["diff_norm"] == 1.0
    result = run("global-norm", src, "--ord", "2e15")
    assert result.exit_code == 2
    assert "orders above 1e+15 are not supported (the norm is then the largest magnitude: --ord inf)" in result.output
    assert run("diff", src, src, "--ord", "1e300").exit_code == 2


def test_shares_are_exact_where_the_global_norm_overflows_float64(tmp_path):
    # found by a review: a global norm of finite values beyond float64 (reported inf) made every share "nan"
    src = write_st(tmp_path / "huge.safetensors", {"a": np.full(4, 1e308), "b": np.full(4, 1e308), "c": np.ones(3)})
    report = js("global-norm", src, "--depth", "1")["checkpoints"][0]
    assert report["global_norm"] == "inf"
    total = 8 * Fraction(1e308) ** 2 + 3
    shares = {t["name"]: t["share"] for t in report["tensors"]}
    assert shares == {"a": float(4 * Fraction(1e308) ** 2 / total), "b": shares["a"], "c": float(3 / total)}
    assert (shares["a"] == 0.5 and 0 < shares["c"] < 1e-600) or shares["c"] == 0.0
    assert run("global-norm", src, "--fail-above", "inf").exit_code == 1  # a non-finite figure fails any gate
    clipped = js("clip-global-norm", src, "-o", tmp_path / "out.safetensors", "--clip-norm", "1")["checkpoints"][0]
    assert [t["share"] for t in clipped["tensors"]] == [shares["a"], shares["b"], shares["c"]]


def test_json_reports_a_path_that_is_not_utf8_and_escapes_what_a_terminal_should_not_get(tmp_path):
    # found by a review: a path that is not UTF-8 (Python holds its bytes as lone surrogates) made every JSON
    # report exit 70, some after the output was written; C1 controls and bidi overrides in names went out raw
    src = tmp_path / os.fsdecode(b"caf\xe9.safetensors")
    names = {"a\u202eb": np.ones(2, np.float32), "c\x9b[31m": np.ones(3, np.float32)}
    write_st(src, names)
    out = tmp_path / os.fsdecode(b"out\xff.safetensors")
    text = ok("clip-value", src, "-o", out, "--min", "0", "--max", "0.5", "--format", "json").stdout
    assert not any(c in text for c in "\u202e\x9b")
    report = json.loads(text)["checkpoints"][0]
    assert (report["path"], report["output"]) == (str(src), str(out))
    assert os.fsencode(report["path"]).endswith(b"caf\xe9.safetensors")
    assert sorted(t["name"] for t in report["tensors"]) == sorted(names)
    assert json.loads(ok("global-norm", src, "--format", "json").stdout)["checkpoints"][0]["path"] == str(src)
    assert json.loads(ok("diff", src, out, "--format", "json").stdout)["a"] == str(src)


@pytest.mark.parametrize(
    ("source", "output", "status"),
    [
        ({"w": np.ones(3, ml_dtypes.bfloat16)}, "m.npz", 3),  # bfloat16 into .npz
        ({"w": np.ones(3, np.float32)}, "meta.npz", 3),  # metadata without --drop-metadata
        ({"w": np.ones(3, np.float32)}, "in.safetensors", 4),  # the output is the input
        ({"w": np.ones(3, np.float32)}, "fine.safetensors", 0),
    ],
)
@pytest.mark.parametrize("command", [["clip-norm", "--clip-norm", "1"], ["clip-value", "--min", "0", "--max", "1"]])
def test_a_dry_run_refuses_what_the_write_would(tmp_path, source, output, status, command):
    # found by a review: --dry-run passed (exit 0) where the real run failed, so a green CI dry run promised
    # nothing; convert --dry-run refused already
    src = write_st(tmp_path / "in.safetensors", source, metadata={"a": "b"} if output == "meta.npz" else None)
    before = sorted(tmp_path.iterdir())
    args = [command[0], src, "-o", tmp_path / output, *command[1:], "-q"]
    assert run(*args, "--dry-run").exit_code == status
    assert sorted(tmp_path.iterdir()) == before  # a dry run writes nothing
    assert run(*args).exit_code == status


@pytest.mark.parametrize("p", ["3", "1000.5", "1e12", "1e15"])
def test_shares_at_any_order_are_exact(tmp_path, p):
    # found by a review: (norm / g) ** p multiplied the ratio's rounding by p: two equal tensors' shares
    # were 0.51369 and 0.51369 at --ord 1e15 (sum 1.027), 0.499962 at 1e12
    src = write_st(tmp_path / "two.safetensors", {"a.x": np.array([1.0]), "b.x": np.array([1.0])})
    report = js("global-norm", src, "--ord", p, "--depth", "1")["checkpoints"][0]
    assert [t["share"] for t in report["tensors"]] == [0.5, 0.5]
    assert [g["share"] for g in report["groups"]] == [0.5, 0.5]
    zeros = write_st(tmp_path / "zeros.safetensors", {"a.x": np.array([0.0]), "b.x": np.array([0.0])})
    d = json.loads(ok("diff", src, zeros, "--ord", p, "--format", "json").stdout)
    assert [t["share"] for t in d["tensors"]] == [0.5, 0.5]


@pytest.mark.parametrize("command", [["clip-norm", "--clip-norm", "1"], ["convert"]])
def test_a_dry_run_refuses_an_output_that_cannot_be_created(tmp_path, command):
    # found by a review: a missing directory or a directory in the way passed a dry run (exit 0), not the write
    src = write_st(tmp_path / "in.safetensors", {"w": np.ones(3, np.float32)})
    (tmp_path / "d.safetensors").mkdir()
    for output, line in (
        ("nodir/x.safetensors", f"cannot create a file in {tmp_path / 'nodir'}: No such file or directory"),
        ("d.safetensors", "d.safetensors: is a directory"),
    ):
        args = [command[0], src, "-o", tmp_path / output, *command[1:], "-q"]
        for dry in (["--dry-run"], []):
            result = run(*args, *dry)
            assert result.exit_code == 4 and line in result.output, (output, dry, result.output)
    shards = tmp_path / "new" / "shards"
    assert run("convert", src, "-o", shards, "--max-shard-size", "1MB", "--dry-run").exit_code == 0
    assert not (tmp_path / "new").exists()  # made by the write, not by a dry run


def test_an_index_in_the_way_fails_a_sharded_write_before_any_shard(tmp_path, sharded):
    # found by a review: a directory named like the output's index passed the dry run, and the write failed
    # only at the index, leaving the shards it had written (a partial output)
    out = tmp_path / "o1"
    (out / "model.safetensors.index.json").mkdir(parents=True)
    for dry in (["--dry-run"], []):
        result = run("clip-global-norm", sharded, "-o", out, "--clip-norm", "1", *dry)
        assert result.exit_code == 4 and "is a directory" in result.output, (dry, result.output)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors.index.json"]
    afile = tmp_path / "afile"
    afile.write_text("x")
    result = run("clip-global-norm", sharded, "-o", afile / "x.safetensors", "--clip-norm", "1", "--dry-run")
    assert result.exit_code == 4 and "Not a directory" in result.output


def test_a_dry_run_refuses_a_dangling_link_for_a_directory_output(tmp_path, sharded):
    # found by a review: the dry run followed the link to a parent that exists (exit 0); mkdir fails on it
    (tmp_path / "dl").symlink_to(tmp_path / "nowhere" / "deep")
    for dry in (["--dry-run"], []):
        result = run("clip-norm", sharded, "-o", f"{tmp_path / 'dl'}/", "--clip-norm", "1", *dry)
        assert result.exit_code == 4 and "cannot create the directory: File exists" in result.output, dry


def test_use_norm_with_a_tiny_scale_follows_the_library(tmp_path):
    # found by a review: --use-norm took the float scale (about 1e-608: 0), the library its exact bits
    src = tmp_path / "a.npz"
    np.savez(src, x=np.array([1e300, 1e300]))
    out = tmp_path / "g.npz"
    ok("clip-global-norm", src, "-o", out, "--clip-norm", "1e-300", "--use-norm", "1e308", "-q")
    expected, _ = core.clip_by_global_norm([np.array([1e300, 1e300])], 1e-300, use_norm=1e308)
    with np.load(out) as z:
        assert z["x"].tolist() == expected[0].tolist() == [1e-308, 1e-308]
    ok("clip-norm", src, "-o", out, "--clip-norm", "1e-300", "--axes", "-1", "-q")
    with np.load(out) as z:
        np.testing.assert_array_max_ulp(z["x"], [1e-300 / math.sqrt(2)] * 2, 2)
