"""Defects found by trying clipcli as a new user would and on real files of other projects, each pinned.

Each test names the defect it pins; every one of them failed before its fix.
"""

from __future__ import annotations

import io
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
from safetensors import safe_open

from clipcli import core
from tests.test_cli import ENV, SAMPLES, WIDE, fnorm, js, ok, reference, run, write_st

NUMPY_DATA = Path(np.__file__).parent / "lib" / "tests" / "data"


def npz_arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


# --- 1. A norm beyond float64 must not turn a clip into NaNs ----------------------------------------


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


def test_clip_norm_of_a_tensor_whose_norm_overflows_float64_is_finite(huge, tmp_path):
    out = tmp_path / "clipped.npz"
    (c,) = js("clip-norm", huge, "-o", out, "--clip-norm", "2")["checkpoints"]
    rows = {t["name"]: t for t in c["tensors"]}
    assert rows["ellipkinc_neg_m"]["norm"] == "inf"
    assert rows["ellipkinc_neg_m"]["norm_after"] == pytest.approx(2.0, rel=1e-14)
    assert all(np.isfinite(a).all() for a in npz_arrays(out).values())


def test_nothing_is_ever_written_with_a_nan_scale(grads, tmp_path, monkeypatch):
    monkeypatch.setattr(core, "stats_clip_scale", lambda stats, clip: math.nan)
    out = tmp_path / "o.safetensors"
    result = run("clip-global-norm", grads, "-o", out, "--clip-norm", "1")
    assert result.exit_code == 1
    assert result.stderr == f"clipcli: error: {grads}: the clip scale is not a number; refusing to write NaN values\n"
    assert not out.exists()


@pytest.fixture
def grads(tmp_path) -> Path:
    path = tmp_path / "grads.safetensors"
    shutil.copy(SAMPLES / "grads.safetensors", path)
    return path


# --- 2. A tensor with a zero-length dimension -------------------------------------------------------


@pytest.mark.parametrize("suffix", [".safetensors", ".npy"])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("axes", ["-1", "1", "2", "0", "0,2"])
def test_clip_norm_along_axes_of_a_tensor_with_a_zero_length_dimension(tmp_path, suffix, dtype, axes):
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


# --- 3. Summaries cover every selected tensor, whatever --top and --sort show -----------------------


def test_summary_line_covers_all_tensors_under_top_and_sort():
    table = ok("global-norm", SAMPLES / "grads.safetensors", "--top", "2", "--sort", "size").stdout
    first = table.splitlines()[0]
    assert "over 16 tensors, 1 skipped" in first
    assert "largest share: model.layers.1.mlp.up_proj.weight (25.0%)" in first
    assert table.splitlines()[1] == "showing 2 of 16 tensors"


def test_several_checkpoints_summary_rows_cover_hidden_tensors(tmp_path):
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


def test_fail_nonfinite_sees_tensors_that_top_hides(tmp_path):
    src = write_st(tmp_path / "bad.safetensors", {"a": np.ones(4, np.float32), "z": np.array([np.nan], np.float32)})
    result = run("global-norm", src, "--top", "1", "--sort", "name", "--fail-nonfinite", "--quiet")
    assert (result.exit_code, result.stderr) == (1, f"clipcli: error: {src}: tensor z: holds 1 NaN value\n")


# --- 4. A gate never passes because nothing was measured --------------------------------------------


def test_a_typo_in_include_is_a_usage_error_naming_the_pattern_and_some_names(grads):
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
    result = run(command, grads, "--exclude", "*")
    assert result.exit_code == 2 and "--exclude '*' leaves no tensor selected" in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["clip-global-norm", "--clip-norm", "1"],
        ["clip-norm", "--clip-norm", "1"],
        ["clip-value", "--min", "0", "--max", "1"],
    ],
)
def test_a_clip_with_nothing_selected_writes_nothing_and_exits_2(grads, tmp_path, args):
    out = tmp_path / "o.safetensors"
    for selection in (["--include", "Model.*"], ["--include", "step"]):
        result = run(args[0], grads, "-o", out, *args[1:], *selection)
        assert result.exit_code == 2, result.output
        assert not out.exists()
    assert "no real floating tensor is selected" in result.stderr or "no floating" in result.stderr


def test_a_gate_on_a_checkpoint_without_floating_tensors_is_a_usage_error(tmp_path):
    src = write_st(tmp_path / "ints.safetensors", {"step": np.array(3, np.int64)})
    assert ok("global-norm", src).stdout.startswith(f"{src}: global norm 0 over 0 tensors, 1 skipped")
    for gate in (["--fail-above", "1"], ["--fail-nonfinite"]):
        result = run("global-norm", src, *gate)
        assert result.exit_code == 2 and "the gate has nothing to check" in result.stderr


# --- 5. Names from files never drive the terminal ---------------------------------------------------


def test_control_characters_in_names_are_escaped_everywhere(tmp_path):
    names = {"esc\x1b[31mred": np.ones(3, np.float32), "new\nline": np.ones(2, np.float32)}
    src = write_st(tmp_path / "esc.safetensors", {**names, "bell\x07": np.array(1, np.int64)}, {"k\x1b]0;x": "v\x9b1"})
    outputs = [
        ok("global-norm", src).stdout,
        ok("global-norm", src, src, "--depth", "1").stdout,
        ok("inspect", src).stdout,
        ok("clip-norm", src, "--dry-run", "--clip-norm", "1").stdout,
    ]
    for out in outputs:
        assert not any(c in out for c in "\x1b\x07\x9b")
    table = outputs[0]
    assert "esc\\x1b[31mred" in table and "new\\nline" in table and "bell\\x07" in table
    assert len(table.splitlines()) == 5  # headline, header, two rows, one skipped line: no row split
    assert "metadata k\\x1b]0;x = v\\x9b1" in outputs[2]


# --- 6. Names are never wrapped or cut --------------------------------------------------------------


@pytest.mark.parametrize("columns", ["40", "60", "80", None])
def test_names_are_never_wrapped_at_any_width(columns):
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


# --- 8, 9, 10, 11. Real files of other projects -----------------------------------------------------


def test_python2_npy_of_numpys_own_test_data():
    path = NUMPY_DATA / "win64python2.npy"
    if not path.exists():
        pytest.skip("NumPy's test data is not installed")
    with pytest.warns(UserWarning, match="Python 2"):
        expected = np.load(path)
    (c,) = js("global-norm", path)["checkpoints"]
    assert c["global_norm"] == fnorm([expected])


def test_python2_npy_with_long_integers_in_its_shape(tmp_path):
    path = tmp_path / "py2.npy"
    data = np.arange(6, dtype="<f8")
    header = "{'descr': '<f8', 'fortran_order': False, 'shape': (2L, 3L), }".ljust(117) + "\n"
    path.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + data.tobytes())
    with pytest.warns(UserWarning, match="Python 2"):
        np.testing.assert_array_equal(np.load(path), data.reshape(2, 3))  # NumPy reads it: so does clipcli
    (t,) = js("inspect", path)["checkpoints"][0]["tensors"]
    assert t["shape"] == [2, 3]


@pytest.fixture
def mixed_npz(tmp_path) -> Path:
    """What scipy.sparse.save_npz writes (a text member) beside records and float128."""
    path = tmp_path / "sparse.npz"
    np.savez_compressed(
        path,
        indices=np.array([0, 2, 1], np.int32),
        indptr=np.array([0, 1, 3], np.int32),
        format=np.array("csr"),
        shape=np.array([2, 3]),
        data=np.array([1.0, -2.0, 3.0]),
        records=np.zeros(2, dtype=[("a", "<f4"), ("b", "<i2")]),
        quad=np.ones(3, np.longdouble),
    )
    return path


def test_npz_with_non_numeric_members_is_listed_measured_and_clipped(mixed_npz, tmp_path):
    listing = {t["name"]: t["dtype"] for t in js("inspect", mixed_npz)["checkpoints"][0]["tensors"]}
    assert listing == {
        "indices": "int32",
        "indptr": "int32",
        "format": "U3",
        "shape": "int64",
        "data": "float64",
        "records": "structured",
        "quad": "float128",
    }
    (c,) = js("global-norm", mixed_npz)["checkpoints"]
    assert c["global_norm"] == math.sqrt(14)
    assert {s["name"]: s["reason"] for s in c["skipped"]}["format"] == "no arithmetic on U3 (carried as bytes)"
    out = tmp_path / "clipped.npz"
    ok("clip-value", mixed_npz, "-o", out, "--min", "-1", "--max", "1", "--quiet")
    with zipfile.ZipFile(mixed_npz) as before, zipfile.ZipFile(out) as after:
        for name in ("format.npy", "records.npy", "quad.npy", "indices.npy"):
            assert after.read(name) == before.read(name)  # copied through byte for byte
    np.testing.assert_array_equal(npz_arrays(out)["data"], [1.0, -1.0, 1.0])


def test_a_member_that_is_no_npy_file_is_carried(tmp_path):
    path = tmp_path / "notes.npz"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("readme.txt", b"hello")
        z.writestr("w.npy", npy(np.ones(2, np.float32)))
    out = tmp_path / "o.npz"
    ok("clip-value", path, "-o", out, "--min", "0", "--max", "0.5", "--quiet")
    with zipfile.ZipFile(out) as z:
        assert z.read("readme.txt") == b"hello"
    assert js("inspect", path)["checkpoints"][0]["tensors"][0]["dtype"] == "bytes"


def npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def test_a_non_numeric_member_cannot_go_to_safetensors(mixed_npz, tmp_path):
    result = run("clip-value", mixed_npz, "-o", tmp_path / "o.safetensors", "--min", "0", "--max", "1")
    assert result.exit_code == 3 and "tensor format: safetensors has no dtype for U3" in result.stderr
    assert not (tmp_path / "o.safetensors").exists()


def test_clipping_a_compressed_npz_keeps_each_members_compression(tmp_path):
    path = tmp_path / "mel_filters.npz"  # like Whisper's: a mostly-zero filter bank, deflated
    mel = np.zeros((80, 201), np.float32)
    mel[np.arange(80), np.arange(80) * 2] = 0.03
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(zipfile.ZipInfo("mel_80.npy"), npy(mel), zipfile.ZIP_DEFLATED)
        z.writestr(zipfile.ZipInfo("raw.npy"), npy(np.ones(3, np.float32)), zipfile.ZIP_STORED)
        z.writestr(zipfile.ZipInfo("bz.npy"), npy(np.ones(3, np.float32)), zipfile.ZIP_BZIP2)
    out = tmp_path / "clipped.npz"
    ok("clip-norm", path, "-o", out, "--clip-norm", "0.1", "--quiet")
    with zipfile.ZipFile(out) as z:
        methods = {i.filename: i.compress_type for i in z.infolist()}
    assert methods == {"mel_80.npy": zipfile.ZIP_DEFLATED, "raw.npy": zipfile.ZIP_STORED, "bz.npy": zipfile.ZIP_BZIP2}
    assert out.stat().st_size < 2 * path.stat().st_size


def test_safetensors_header_with_leading_whitespace_is_read_like_the_reference(tmp_path):
    data = np.arange(3, dtype=np.float32).tobytes()
    header = b'  \n{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}}'
    path = tmp_path / "space.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)
    with safe_open(path, "np") as f:  # the reference reads it
        expected = f.get_tensor("w")
    (c,) = js("global-norm", path)["checkpoints"]
    assert c["global_norm"] == fnorm([expected])


def test_npy_header_beyond_numpys_limit_is_refused_as_numpy_refuses_it(tmp_path):
    path = tmp_path / "long.npy"
    header = ("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }" + " " * 12_000 + "\n").encode()
    path.write_bytes(b"\x93NUMPY\x02\x00" + len(header).to_bytes(4, "little") + header + bytes(4))
    with pytest.raises(ValueError, match="max_header_size"):
        np.load(path)
    result = run("inspect", path)
    assert result.exit_code == 3
    assert "more than the 10000 NumPy reads (its max_header_size)" in result.stderr


# --- 12. Messages that say what is wrong ------------------------------------------------------------


def test_a_text_file_named_safetensors_is_called_text(tmp_path):
    path = tmp_path / "notes.safetensors"
    path.write_text("These are my notes about the gradients of yesterday's run.\n")
    result = run("inspect", path)
    assert (result.exit_code, result.stderr) == (3, f"clipcli: error: {path}: not a safetensors file: a text file\n")


def test_a_pytorch_zip_named_npz_is_called_a_pytorch_checkpoint(tmp_path):
    path = tmp_path / "model.npz"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("model/data.pkl", b"\x80\x02}q\x00.")
        z.writestr("model/data/0", bytes(8))
    result = run("inspect", path)
    assert result.exit_code == 3
    assert (
        result.stderr
        == f"clipcli: error: {path}: not an .npz file: a PyTorch zip checkpoint (name it .pt, .pth or .bin)\n"
    )


@pytest.mark.parametrize("target", ["out.txt", "-", "/dev/full", "out.pt5"])
def test_an_output_that_names_no_format_is_a_usage_error(grads, tmp_path, target):
    path = target if target.startswith("/") or target == "-" else str(tmp_path / target)
    result = run("clip-global-norm", grads, "-o", path, "--clip-norm", "5")
    assert result.exit_code == 2, result.output
    assert "Usage:" in result.stderr and "Invalid value for -o" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grads.safetensors"]


def test_a_sharded_input_does_not_make_a_directory_named_out_txt(tmp_path):
    shutil.copytree(SAMPLES / "sharded", tmp_path / "sharded")
    result = run("clip-global-norm", tmp_path / "sharded", "-o", tmp_path / "out.txt", "--clip-norm", "5")
    assert result.exit_code == 2 and "unknown output format '.txt'" in result.stderr
    assert not (tmp_path / "out.txt").exists()
    ok("clip-global-norm", tmp_path / "sharded", "-o", f"{tmp_path / 'out.d'}/", "--clip-norm", "5", "--quiet")
    assert (tmp_path / "out.d" / "model.safetensors.index.json").exists()


def test_a_file_without_a_known_suffix_is_read_as_what_it_is(tmp_path):
    for name, content in (
        ("grads", (SAMPLES / "grads.safetensors").read_bytes()),
        ("grads.bak", (SAMPLES / "grads.npz").read_bytes()),
        ("one", npy(np.ones(3, np.float32))),
    ):
        (tmp_path / name).write_bytes(content)
        assert js("global-norm", tmp_path / name)["checkpoints"][0]["global_norm"] > 0


# --- 13, 16. --depth and the summary row in every format; --sort and --top everywhere ---------------


def test_depth_groups_and_the_global_norm_in_csv():
    lines = ok("global-norm", SAMPLES / "grads.safetensors", "--depth", "3", "--format", "csv").stdout.splitlines()
    kinds = [line.rsplit(",", 1)[1] for line in lines[1:]]
    assert kinds == ["tensor"] * 16 + ["group"] * 4 + ["global"]
    groups = {line.split(",")[1]: float(line.split(",")[4]) for line in lines if line.endswith(",group")}
    assert set(groups) == {"model.embed_tokens.weight", "model.layers.0", "model.layers.1", "model.norm.weight"}
    assert math.sqrt(sum(g * g for g in groups.values())) == pytest.approx(145.376, rel=1e-5)


def test_depth_in_the_table_of_several_checkpoints():
    out = ok("global-norm", SAMPLES / "grads.safetensors", SAMPLES / "grads.npz", "--depth", "3").stdout
    assert out.count("model.layers.1 ") == 2 and f"{SAMPLES / 'grads.npz'}: groups" in out


def test_sort_and_top_for_inspect_and_the_clip_commands(grads):
    (c,) = js("inspect", grads, "--sort", "size", "--top", "2")["checkpoints"]
    assert [t["nbytes"] for t in c["tensors"]] == [32768, 16384]  # ties keep the file's order
    assert [t["name"] for t in c["tensors"]] == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"]
    assert c["tensor_count"] == 17
    (c,) = js("clip-norm", grads, "--dry-run", "--clip-norm", "1", "--sort", "norm", "--top", "3")["checkpoints"]
    assert c["tensors"][0]["name"] == "model.layers.1.mlp.up_proj.weight"
    assert len(c["tensors"]) == 3 and c["tensor_count"] == 16
    table = ok("clip-value", grads, "--dry-run", "--min", "0", "--max", "1", "--top", "1").stdout
    assert "over 16 tensors" in table and "showing 1 of 16 tensors" in table


# --- 17. Help, completion and metavars --------------------------------------------------------------


@pytest.mark.parametrize("command", ["inspect", "global-norm", "clip-value", "clip-norm", "clip-global-norm"])
def test_help_ends_with_examples_and_names_arguments_as_words(command):
    text = ok(command, "--help").stdout
    assert "{" not in text.splitlines()[0] and "CKPT" in text.splitlines()[0]
    examples = text[text.index("Examples:") :].splitlines()[1:]
    assert sum(line.strip().startswith(f"clipcli {command} ") for line in examples) >= 2
    assert "<str>" not in text


def test_ord_reads_as_a_word_and_completion_is_offered():
    assert "--ord P" in ok("global-norm", "--help").stdout
    root = ok("--help").stdout
    assert "--install-completion" in root and "--show-completion" in root


# --- 18. Small things a user reads ------------------------------------------------------------------


def test_inspect_shows_element_counts_and_the_parameter_count():
    out = ok("inspect", SAMPLES / "grads.safetensors").stdout.splitlines()
    tensors = reference(SAMPLES / "grads.safetensors").values()
    total, size = sum(a.size for a in tensors), sum(a.nbytes for a in tensors) / 1024
    assert out[0] == f"{SAMPLES / 'grads.safetensors'}: safetensors, 17 tensors, {total:,} parameters, {size:.1f} KiB"
    assert out[3].split()[:5] == ["tensor", "dtype", "shape", "elements", "size"]
    assert out[4].split()[3] == "16,384"  # 256 x 64


def test_clip_reports_max_abs_after(grads, tmp_path):
    (c,) = js("clip-value", grads, "-o", tmp_path / "o.safetensors", "--min", "-0.01", "--max", "0.01")["checkpoints"]
    assert all(t["max_abs_after"] <= 0.010009765625 for t in c["tensors"])
    assert c["max_abs_after"] == max(t["max_abs_after"] for t in c["tensors"])


def test_grammar_and_options_echoed_as_written(tmp_path):
    src = write_st(tmp_path / "one.safetensors", {"w": np.array([np.nan, np.inf, 1.0], np.float32)})
    assert "over 1 tensor;" in ok("clip-value", src, "--dry-run", "--min", "0", "--max", "1").stdout
    result = run("clip-norm", src, "--dry-run", "--clip-norm", "1")
    assert result.stderr == f"clipcli: error: {src}: tensor w: holds 1 NaN value and 1 Inf value\n"
    result = run("global-norm", SAMPLES / "grads.safetensors", "--fail-above", "1e2", "--quiet")
    assert result.stderr.endswith("exceeds --fail-above 1e2\n")


def test_blank_line_between_inspected_checkpoints_and_no_trailing_spaces():
    out = ok("inspect", SAMPLES / "grads.safetensors", SAMPLES / "grads.npz").stdout
    assert f"\n\n{SAMPLES / 'grads.npz'}: npz, 17 tensors" in out
    for args in (["inspect"], ["global-norm", "--depth", "2"], ["clip-norm", "--dry-run", "--clip-norm", "1"]):
        for line in ok(*args, SAMPLES / "grads.safetensors").stdout.splitlines():
            assert line == line.rstrip(), (args, line)


def test_progress_names_each_pass(grads, tmp_path, monkeypatch):
    from rich.progress import Progress

    from clipcli import cli

    monkeypatch.setattr(cli, "PROGRESS_MIN_BYTES", 0)
    monkeypatch.setattr(cli, "_is_terminal", lambda stream: True)
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


def test_drawing_a_table_does_not_load_rich(tmp_path):
    # Rich's tables took 5.3 s for 10,000 rows where JSON took 0.8 s; the table is plain text now.
    src = write_st(tmp_path / "many.safetensors", {f"t{i}": np.ones(2, np.float32) for i in range(100)})
    code = (
        "import sys; from clipcli.cli import main\n"
        f"try: main(['global-norm', {str(src)!r}])\n"
        "except SystemExit: pass\n"
        "assert 'rich' not in sys.modules, sorted(m for m in sys.modules if m.startswith('rich'))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_a_safetensors_run_imports_no_reader_it_does_not_need(tmp_path):
    # PyTorch's reader with its unpickler, the thread pool (with logging) and tempfile were a tenth of the
    # start-up of every run; they are imported when a file or a write needs them.
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
