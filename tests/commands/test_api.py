"""The library over files: one function per command, whose report is the command line's (its JSON, its gates)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import clipcli
from clipcli.cli import app
from clipcli.errors import UsageError

SAMPLES = Path(__file__).resolve().parents[2] / "samples"
ENV = {"NO_COLOR": "1", "COLUMNS": "100", "TERMINAL_WIDTH": "100"}


@pytest.fixture
def samples(tmp_path, monkeypatch) -> Path:
    """The samples, copied where relative paths name them (as a script would), in the working directory."""
    for name in ("grads.safetensors", "grads.npz", "weights-step-1000.safetensors", "weights-step-2000.safetensors"):
        shutil.copy(SAMPLES / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def cli(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, [str(a) for a in args], env=ENV)
    return result.exit_code, result.stdout, result.stderr


def cli_json(*args: object) -> dict:
    status, out, err = cli(*args, "--format", "json")
    assert status == 0, err
    return json.loads(out)


@pytest.mark.parametrize(
    ("call", "command"),
    [
        (lambda: clipcli.inspect_of("grads.safetensors", sort="size", top=3), ["inspect", "grads.safetensors",
         "--sort", "size", "--top", "3"]),
        (lambda: clipcli.global_norm_of("grads.safetensors", "grads.npz", ord=1, depth=3, sort="norm"),
         ["global-norm", "grads.safetensors", "grads.npz", "--ord", "1", "--depth", "3", "--sort", "norm"]),
        (lambda: clipcli.global_norm_of("grads.safetensors", ord="inf", include="model.layers.*"),
         ["global-norm", "grads.safetensors", "--ord", "inf", "--include", "model.layers.*"]),
        (lambda: clipcli.diff_of("weights-step-1000.safetensors", "weights-step-2000.safetensors", depth=2, top=2),
         ["diff", "weights-step-1000.safetensors", "weights-step-2000.safetensors", "--depth", "2", "--top", "2"]),
        (lambda: clipcli.clip_value_of("grads.safetensors", min=-0.01, max=0.01),
         ["clip-value", "grads.safetensors", "--dry-run", "--min", "-0.01", "--max", "0.01"]),
        (lambda: clipcli.clip_norm_of("grads.safetensors", clip_norm=0.5, axes=[-1], exclude=["step"]),
         ["clip-norm", "grads.safetensors", "--dry-run", "--clip-norm", "0.5", "--axes", "-1", "--exclude", "step"]),
        (lambda: clipcli.clip_global_norm_of("grads.safetensors", clip_norm=5, sort="name", top=4),
         ["clip-global-norm", "grads.safetensors", "--dry-run", "--clip-norm", "5", "--sort", "name", "--top", "4"]),
        (lambda: clipcli.clip_global_norm_of("grads.npz", clip_norm=5, output="out.npz"),
         ["clip-global-norm", "grads.npz", "-o", "out.npz", "--clip-norm", "5"]),
        (lambda: clipcli.convert_of("grads.safetensors", "shards/", max_shard_size=100_000, dry_run=True),
         ["convert", "grads.safetensors", "-o", "shards/", "--max-shard-size", "100000", "--dry-run"]),
        (lambda: clipcli.convert_of("grads.npz", "converted.safetensors"),
         ["convert", "grads.npz", "-o", "converted.safetensors"]),
    ],
    ids=["inspect", "global-norm", "global-norm-inf", "diff", "clip-value", "clip-norm", "clip-global-norm",
         "clip-global-norm-written", "convert-dry-run", "convert"],
)  # fmt: skip
def test_to_dict_is_the_json_of_the_command_line(samples, call, command):
    report = call()
    assert report.to_dict() == cli_json(*command)
    assert json.loads(report.to_json()) == report.to_dict()


def test_a_report_renders_as_the_command_line_prints_it(samples):
    report = clipcli.global_norm_of("grads.safetensors", depth=2)
    assert report.to_text() == cli("global-norm", "grads.safetensors", "--depth", "2")[1]
    assert report.to_csv() == cli("global-norm", "grads.safetensors", "--depth", "2", "--format", "csv")[1]


@pytest.mark.parametrize("limit", [1.0, 145.0, 146.0, 1e9])
def test_a_library_caller_and_the_command_line_decide_the_same_gate(samples, limit):
    report = clipcli.global_norm_of("grads.safetensors")
    reasons = clipcli.failures(report, fail_above=limit)
    status, _, err = cli("global-norm", "grads.safetensors", "--fail-above", f"{limit:g}", "--quiet")
    assert status == (1 if reasons else 0) == (1 if report.exceeds(limit) else 0)
    assert err == "".join(f"clipcli: error: {r}\n" for r in reasons)


@pytest.mark.parametrize(
    "gates",
    [{"fail_above": 0.1}, {"fail_above": 10.0}, {"fail_rel_above": 0.01}, {"fail_rel_above": 0.9},
     {"fail_different": True}, {"fail_above": 10.0, "fail_different": True}],
)  # fmt: skip
def test_diff_gates_decide_the_same_in_the_library(samples, gates):
    a, b = "weights-step-1000.safetensors", "weights-step-2000.safetensors"
    report = clipcli.diff_of(a, b)
    reasons = clipcli.failures(report, **gates)
    flags = [f"--{k.replace('_', '-')}" + ("" if v is True else f"={v:g}") for k, v in gates.items()]
    status, _, err = cli("diff", a, b, *flags, "--quiet")
    assert status == (1 if reasons else 0)
    assert err == (f"clipcli: error: {reasons[0]}\n" if reasons else "")


def test_nonfinite_gate_names_the_tensor_as_the_command_line_does(samples):
    from safetensors.numpy import save_file

    save_file({"a": np.ones(3, np.float32), "b": np.array([1, np.nan, np.inf], np.float32)}, "bad.safetensors")
    report = clipcli.global_norm_of("bad.safetensors", "grads.safetensors")
    reasons = clipcli.failures(report, fail_nonfinite=True, fail_above=1.0)
    status, _, err = cli("global-norm", "bad.safetensors", "grads.safetensors", "--fail-nonfinite", "--fail-above", "1")
    assert status == 1 and len(reasons) == 2
    assert err == f"clipcli: error: 2 of 2 checkpoints fail their gates: {'; '.join(reasons)}\n"


def test_open_gives_names_dtypes_shapes_metadata_and_values(samples):
    from safetensors.numpy import load_file

    want = load_file("weights-step-1000.safetensors")
    with clipcli.open("weights-step-1000.safetensors") as ckpt:
        assert ckpt.names == list(want) and ckpt.format == "safetensors" and ckpt.metadata == {"step": "1000"}
        assert ckpt.shapes == {k: v.shape for k, v in want.items()}
        for name, array in want.items():
            np.testing.assert_array_equal(ckpt.read(name), array)
            np.testing.assert_array_equal(np.concatenate([c.copy() for c in ckpt.chunks(name)]), array.ravel())


def test_the_clip_functions_write_what_the_command_line_writes(samples):
    clipcli.clip_norm_of("grads.safetensors", clip_norm=0.5, output="lib.safetensors")
    assert cli("clip-norm", "grads.safetensors", "-o", "cli.safetensors", "--clip-norm", "0.5")[0] == 0
    assert Path("lib.safetensors").read_bytes() == Path("cli.safetensors").read_bytes()


def test_bad_options_are_usage_errors(samples):
    with pytest.raises(UsageError):
        clipcli.clip_norm_of("grads.safetensors", clip_norm=0)
    with pytest.raises(UsageError):
        clipcli.clip_value_of("grads.safetensors", min=1, max=0)
    with pytest.raises(UsageError):
        clipcli.clip_global_norm_of("grads.safetensors", clip_norm=1, output="o.safetensors", in_place=True)
    with pytest.raises(UsageError):
        clipcli.global_norm_of("grads.safetensors", ord=0)
    with pytest.raises(TypeError):
        clipcli.failures(clipcli.inspect_of("grads.safetensors"), fail_above=1.0)


def test_import_clipcli_imports_no_numpy():
    code = "import sys, clipcli; clipcli.global_norm_of; print('numpy' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=SAMPLES.parent, capture_output=True, text=True, check=True)
    assert done.stdout == "False\n"
