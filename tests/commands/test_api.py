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
        # review 31: shapes and dtypes were rebuilt at each access (a loop over 50,000 names took minutes): made once,
        # read-only
        assert ckpt.shapes is ckpt.shapes and ckpt.dtypes is ckpt.dtypes
        with pytest.raises(TypeError):
            ckpt.shapes[ckpt.names[0]] = ()  # type: ignore[index]
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


def test_a_gate_over_nothing_measured_is_refused_as_on_the_command_line(samples):
    # found by a new user: failures() passed gates over integer-only files that the command line refuses (exit 2)
    np.savez("ints.npz", a=np.arange(3), b=np.arange(4))
    np.savez("ints2.npz", a=np.arange(3) + 1, b=np.arange(4))
    norms, diffs = clipcli.global_norm_of("ints.npz"), clipcli.diff_of("ints.npz", "ints2.npz")
    for report, gate in ((norms, {"fail_above": 0.0}), (norms, {"fail_nonfinite": True}), (diffs, {"fail_above": 0.0}),
                         (diffs, {"fail_rel_above": 0.0})):  # fmt: skip
        with pytest.raises(UsageError, match="nothing to check"):
            clipcli.failures(report, **gate)
        assert cli("global-norm" if report is norms else "diff", *(["ints.npz"] if report is norms else
                   ["ints.npz", "ints2.npz"]), "--" + next(iter(gate)).replace("_", "-"),
                   *([] if gate.get("fail_nonfinite") else ["0"]))[0] == 2  # fmt: skip


def test_failures_refuses_a_negative_threshold_and_passes_a_report_without_gates(samples):
    # found by a new user: fail_above=-1 was accepted (the command line: exit 2); a clip report raised TypeError
    report = clipcli.global_norm_of("grads.safetensors")
    with pytest.raises(UsageError, match=">= 0"):
        clipcli.failures(report, fail_above=-1.0)
    assert clipcli.failures(clipcli.clip_global_norm_of("grads.safetensors", clip_norm=1.0)) == []


def test_clip_functions_drop_metadata_as_the_command_line_does(samples):
    # found by a new user: a checkpoint with metadata could not be clipped into .npz from Python
    from safetensors.numpy import save_file

    kwargs = {"clip_norm": 1.0, "output": "out.npz", "drop_metadata": True}
    with_metadata = samples / "meta.safetensors"
    save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, with_metadata, metadata={"format": "pt"})
    with pytest.raises(clipcli.errors.UnsupportedError, match="drop-metadata"):
        clipcli.clip_global_norm_of(with_metadata, **{**kwargs, "drop_metadata": False})
    report = clipcli.clip_global_norm_of(with_metadata, **kwargs)
    assert report.to_dict()["checkpoints"][0]["output"] == "out.npz"
    status, _, err = cli("clip-global-norm", with_metadata, "-o", "cli.npz", "--clip-norm", "1", "--drop-metadata")
    assert status == 0, err
    with np.load("out.npz") as a, np.load("cli.npz") as b:
        assert {k: a[k].tobytes() for k in a.files} == {k: b[k].tobytes() for k in b.files}


def test_read_gives_arrays_of_their_own_type_and_refuses_what_is_not_read(samples):
    # found by a new user: a string member came as uint8 bytes; a sparse tensor's read raised a bare AssertionError
    s = np.array(["x", "yy"])
    r = np.array([(1, 2.5)], dtype=[("i", "<i4"), ("f", ">f8")])
    np.savez_compressed("mixed.npz", s=s, r=r, f=np.asfortranarray(np.arange(6.0).reshape(2, 3)))
    with clipcli.open("mixed.npz") as ckpt:
        for name, want in (("s", s), ("r", r)):
            got = ckpt.read(name)
            assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()
    special = SAMPLES.parent / "tests" / "data" / "torch" / "special.pt"
    with clipcli.open(special) as ckpt:
        skipped = [n for n in ckpt.names if ckpt.info(n).skip is not None]
        assert skipped
        for name in skipped:
            with pytest.raises(clipcli.errors.UnsupportedError, match="does not read this tensor"):
                ckpt.read(name)
            with pytest.raises(clipcli.errors.UnsupportedError):
                next(ckpt.chunks(name))


def test_the_library_refuses_what_the_command_line_refuses(tmp_path):
    # found by a new user: top=0, depth=0, jobs=0 and an unknown sort were taken silently by the *_of functions
    from clipcli.errors import UsageError
    from tests.helpers import SAMPLES

    grads = SAMPLES / "grads.safetensors"
    for call in (
        lambda: clipcli.stats_of(grads, top=0),
        lambda: clipcli.stats_of(grads, depth=0),
        lambda: clipcli.stats_of(grads, jobs=0),
        lambda: clipcli.global_norm_of(grads, top=-2),
        lambda: clipcli.hash_of(grads, sort="norm"),
        lambda: clipcli.inspect_of(grads, sort="norm"),
        lambda: clipcli.trajectory_of(),
    ):
        with pytest.raises(UsageError):
            call()


def test_failures_of_a_verify_report_is_what_the_command_line_exits_with(tmp_path):
    import shutil

    from tests.helpers import SAMPLES

    d = tmp_path / "sharded"
    shutil.copytree(SAMPLES / "sharded", d)
    shutil.copy(d / "model-00001-of-00002.safetensors", d / "model-00003-of-00004.safetensors")
    report = clipcli.verify_of(d)
    assert not report.ok and len(clipcli.failures(report)) == 1 and "stray-shard" in clipcli.failures(report)[0]
    assert clipcli.failures(clipcli.verify_of(SAMPLES / "sharded")) == []
