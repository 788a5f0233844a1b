"""What a fresh user found (second review, 2026-11-22), each pinned: outputs that could destroy what the
user has, gates and messages that said less than they should, reports whose counts disagreed."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.helpers import ENV, SAMPLES, js, ok, run, write_st


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def cli(*args: object, stdin=None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "clipcli", *map(str, args)]
    return subprocess.run(command, env=ENV, capture_output=True, text=True, stdin=stdin, check=False)


@pytest.fixture
def steps(tmp_path) -> tuple[Path, Path]:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    shutil.copy(SAMPLES / "weights-step-1000.safetensors", a)
    shutil.copy(SAMPLES / "weights-step-2000.safetensors", b)
    return a, b


# --- Nothing the user has is destroyed -----------------------------------------------------------


def test_clipping_a_pytorch_file_in_place_is_refused_and_leaves_it(tmp_path):
    path = tmp_path / "pytorch_model.bin"
    shutil.copy(SAMPLES / "pytorch_model.bin", path)
    before = digest(path)
    result = run("clip-value", path, "--in-place", "--min", "-1", "--max", "1")
    assert result.exit_code == 2
    assert "--in-place" in result.stderr and "does not write them; give -o OUT.safetensors" in result.stderr
    assert digest(path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["pytorch_model.bin"]


@pytest.mark.parametrize("over", ["input", "output"])
def test_the_report_is_never_written_over_a_checkpoint(steps, tmp_path, over):
    a, _ = steps
    out = tmp_path / "out.safetensors"
    before = digest(a)
    report = a if over == "input" else out
    result = run("clip-value", a, "-o", out, "--report", report, "--min", "-0.1", "--max", "0.1")
    assert result.exit_code == 4
    assert "refusing to write the report over a checkpoint" in result.stderr
    assert digest(a) == before and not out.exists()


def test_convert_over_its_input_says_to_write_elsewhere(steps):
    a, _ = steps
    before = digest(a)
    result = run("convert", a, "-o", a)
    assert result.exit_code == 4 and "refusing to overwrite the input (write to another path)" in result.stderr
    assert digest(a) == before


def test_a_report_that_cannot_be_written_to_stdout_is_exit_4():
    with open("/dev/full", "w") as full:
        command = [sys.executable, "-m", "clipcli", "global-norm", str(SAMPLES / "grads.safetensors")]
        done = subprocess.run(command, env=ENV, stdout=full, stderr=subprocess.PIPE, text=True, check=False)
    assert done.returncode == 4
    assert done.stderr == "clipcli: error: standard output: cannot write the report: No space left on device\n"


def test_a_checkpoint_on_a_pipe_is_refused_with_what_to_do():
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


# --- Metadata is kept or explicitly dropped, never lost silently ------------------------------------


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


# --- Gates -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("command", "gate"), [("global-norm", "--fail-above"), ("diff", "--fail-rel-above")])
def test_a_negative_threshold_is_a_usage_error(steps, command, gate):
    a, b = steps
    paths = [a] if command == "global-norm" else [a, b]
    result = run(command, *paths, gate, "-1")
    assert result.exit_code == 2 and "must be a number >= 0" in result.stderr


def test_every_checkpoint_that_fails_the_gate_is_named(steps):
    a, b = steps
    both = run("global-norm", a, b, "--fail-above", "0.1", "--quiet")
    assert both.exit_code == 1
    assert both.stderr.count("\n") == 1 and "2 of 2 checkpoints fail their gates" in both.stderr
    assert f"{a}: global norm" in both.stderr and f"{b}: global norm" in both.stderr
    one = run("global-norm", a, b, "--fail-above", "6.088", "--quiet")  # |a| 6.08767, |b| 6.0893
    assert one.exit_code == 1 and one.stderr.startswith(f"clipcli: error: {b}: global norm 6.0893")


def test_a_diff_that_is_not_finite_says_so(tmp_path):
    a = write_st(tmp_path / "a.safetensors", {"w": np.array([1.0, np.nan], np.float32)})
    b = write_st(tmp_path / "b.safetensors", {"w": np.array([1.0, 2.0], np.float32)})
    result = run("diff", a, b, "--fail-above", "1")
    assert result.exit_code == 1 and "‖A−B‖ is nan, not finite (--fail-above 1)" in result.stderr


# --- clip-norm --axes ----------------------------------------------------------------------------


def test_axes_that_fit_no_tensor_are_a_usage_error(steps, tmp_path):
    a, _ = steps
    out = tmp_path / "out.safetensors"
    result = run("clip-norm", a, "-o", out, "--clip-norm", "1", "--axes", "0,1,2")
    assert result.exit_code == 2
    assert "--axes 0,1,2 fits no selected tensor" in result.stderr and "rank 2 is too small" in result.stderr
    assert not out.exists()


def test_an_axis_named_twice_is_the_reason_given(tmp_path):
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


# --- Reports say what they show ----------------------------------------------------------------------


def test_diff_top_counts_the_tensors_that_differ(steps):
    a, b = steps
    text = ok("diff", a, b, "--top", "2").stdout
    table = [line for line in text.splitlines() if line.startswith("model.")]
    assert len(table) == 2  # one of the 7 is identical: --top 2 still shows 2 rows
    assert "4 other tensors that differ not shown (--top)" in text and "1 tensor identical, bit for bit" in text
    report = js("diff", a, b, "--top", "2")
    assert len(report["tensors"]) == 2 and not any(t["identical"] for t in report["tensors"])
    assert report["tensor_count"] == 7 and report["identical_count"] == 1


def test_a_pattern_that_matches_nothing_is_warned_of(steps):
    a, b = steps
    result = run("global-norm", a, "--include", "*embed*", "--include", "nomatch*", "--quiet")
    assert result.exit_code == 0 and result.stderr == "clipcli: warning: --include 'nomatch*' matches no tensor\n"
    result = run("diff", a, b, "--exclude", "typo*", "--quiet")
    assert result.exit_code == 0 and result.stderr == "clipcli: warning: --exclude 'typo*' matches no tensor\n"
    assert run("global-norm", a, "--include", "*", "--quiet").stderr == ""


def test_many_skipped_tensors_are_summed_up_by_reason(tmp_path):
    tensors = {f"step.{i}": np.array(i, np.int64) for i in range(12)}
    tensors["w"] = np.ones((2, 2), np.float32)
    path = write_st(tmp_path / "t.safetensors", tensors)
    text = ok("global-norm", path).stdout
    assert "skipped 12 tensors (step.0, step.1, step.10, ...): not a floating tensor" in text
    assert "(every skipped tensor is listed in --format json)" in text
    assert "skipped step.11" not in text
    assert len(js("global-norm", path)["checkpoints"][0]["skipped"]) == 12


def test_control_characters_in_a_message_never_reach_the_terminal(tmp_path):
    name = "evil\x1b[2Jname"
    path = write_st(tmp_path / "t.safetensors", {name: np.array([1.0, np.inf], np.float32)})
    result = run("global-norm", path, "--fail-nonfinite")
    assert result.exit_code == 1 and "\x1b" not in result.stderr and "\\x1b" in result.stderr


@pytest.mark.parametrize("command", ["global-norm", "inspect", "diff"])
def test_csv_escapes_control_characters_in_names(tmp_path, command):
    name = "w\x1b]0;title\x07"
    path = write_st(tmp_path / "t.safetensors", {name: np.array([1.0, 2.0], np.float32)})
    other = write_st(tmp_path / "u.safetensors", {name: np.array([1.0, 3.0], np.float32)})
    paths = [path, other] if command == "diff" else [path]
    text = ok(command, *paths, "--format", "csv").stdout
    assert "\x1b" not in text and "\x07" not in text and "\\x1b" in text


def test_groups_cut_by_top_say_how_many_there_are(steps):
    a, b = steps
    text = ok("global-norm", a, "--depth", "3", "--top", "2").stdout
    assert "showing 2 of 3 groups" in text
    assert "of 3 groups" not in ok("global-norm", a, "--depth", "3", "--top", "3").stdout
    assert "showing 2 of 3 groups" in ok("diff", a, b, "--depth", "3", "--top", "2").stdout


# --- Third review (a fresh user again) ---------------------------------------------------------------


@pytest.mark.parametrize("where", ["missing/r.json", "a directory"])
def test_a_report_that_cannot_be_written_is_found_before_the_output_is(steps, tmp_path, where):
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
    src = write_st(tmp_path / "small.safetensors", {"x": np.arange(3, dtype=np.float32)})
    result = run("convert", src, "-o", tmp_path / "s.npy")
    assert result.exit_code == 3 and "an .npy holds no name: tensor 'x' would be read back as 's'" in result.stderr
    assert not (tmp_path / "s.npy").exists()
    ok("convert", src, "-o", tmp_path / "x.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "x.npy"), np.arange(3, dtype=np.float32))
    ok("clip-value", tmp_path / "x.npy", "-o", tmp_path / "y.npy", "--min", "0", "--max", "1")  # .npy to .npy


def test_shards_of_another_layout_in_the_output_directory_are_refused(tmp_path):
    out = tmp_path / "shards"
    ok("convert", SAMPLES / "grads.safetensors", "-o", f"{out}/", "--max-shard-size", "50KB")
    before = {p.name: digest(p) for p in out.iterdir()}
    result = run("convert", SAMPLES / "grads.safetensors", "-o", f"{out}/", "--max-shard-size", "1MB")
    assert result.exit_code == 4 and "which this write would leave beside its own shards" in result.stderr
    assert {p.name: digest(p) for p in out.iterdir()} == before
    ok("convert", SAMPLES / "grads.safetensors", "-o", f"{out}/", "--max-shard-size", "50KB")  # the same layout


def test_a_huge_clip_norm_over_a_tiny_norm_warns_of_nothing(steps):
    a, _ = steps
    result = run("clip-global-norm", a, "--dry-run", "--clip-norm", "1e308", "--use-norm", "1e-308")
    assert result.exit_code == 0 and result.stderr == ""


def test_a_report_in_a_directory_that_is_not_writable_is_refused_first(steps, tmp_path, monkeypatch):
    a, _ = steps
    out = tmp_path / "out.safetensors"
    report_dir = tmp_path / "locked"
    report_dir.mkdir()
    real = os.access  # root may write anywhere: the directory is made unwritable to clipcli's eyes
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != report_dir and real(p, mode))
    result = run("clip-value", a, "-o", out, "--min", "0", "--max", "1", "--report", report_dir / "r.json")
    assert result.exit_code == 4 and "is not writable" in result.stderr and not out.exists()
