"""The pickle audit in every command's report: the same `pickle` object as `inspect`'s, per checkpoint (diff:
`pickle_a`/`pickle_b`), one table line, none for files that are no pickle; `--fail-unsafe-pickle` after the
report for the commands that only report, before any output for those that write.

The PyTorch files were written by real torch (tests/data/torch/make_torch_files.py); hostile.pt opcode by opcode.
No test here loads a pickle: the reference for each report's audit is `inspect`'s, which
tests/checkpoint/test_hostile_calls.py holds to `pickletools` and to real torch's verdict.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import clipcli
from tests.checkpoint.test_hostile_calls import SENTINEL, call, state_dict, torch_file
from tests.helpers import DATA, ENV, run, write_st

INERT = DATA / "torch" / "inert"
NAMESPACE = INERT / "namespace.pt"  # argparse.Namespace beside the tensors: torch.load(weights_only=True) refuses
TIED = DATA / "torch" / "tied.pt"  # plain tensors: torch.load(weights_only=True) loads it
HOSTILE = INERT / "hostile.pt"  # os.system, eval, exec, subprocess.Popen, ...
DCP = DATA / "dcp" / "single"  # a distributed checkpoint: its .metadata is a pickle
SHARDED_BIN = DATA / "torch" / "sharded_bin"  # PyTorch shards: several pickles, one audit
NPZ_OBJECTS = DATA / "npz" / "objects.npz"  # object members: pickles NumPy's loader would load
PICKLES = [NAMESPACE, TIED, HOSTILE, DCP, SHARDED_BIN, NPZ_OBJECTS]
CLEAN = {**ENV, "PYTHONWARNINGS": "ignore"}


def inspected(path: Path) -> dict[str, Any]:
    """`inspect`'s audit of `path`: the reference every other report's must equal."""
    result = run("inspect", path, "--format", "json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["checkpoints"][0]["pickle"]


def report(*args: object) -> dict[str, Any]:
    """The JSON report of a run that succeeds (or, for verify, that may find defects: exit 1)."""
    result = run(*args, "--format", "json")
    assert result.exit_code in ((0, 1) if args[0] == "verify" else (0,)), result.output
    return json.loads(result.stdout)


def float_tensor(path: Path) -> str:
    """The name of a float32 tensor of `path` (a clip must have one selected)."""
    with clipcli.open(path) as ckpt:
        return next(n for n, d in ckpt.dtypes.items() if d == "float32")


# Each command over one checkpoint: its arguments after the path, given the test's tmp_path and the path.
ONE: dict[str, Callable[[Path, Path], list[object]]] = {
    "global-norm": lambda tmp, p: [],
    "stats": lambda tmp, p: [],
    "hash": lambda tmp, p: [],
    "verify": lambda tmp, p: [],
    "verify --values": lambda tmp, p: ["--values"],
    "clip-value --dry-run": lambda tmp, p: ["--min", "-0.5", "--max", "0.5", "--dry-run"],
    # written whole: a distributed checkpoint's complex32, which no output holds, only in a dry run; object members
    # only into an .npz
    "clip-norm": lambda tmp, p: ["--clip-norm", "0.5", *(["--dry-run"] if p == DCP else ["-o", tmp / _clipped(p)])],
    "clip-global-norm --report": lambda tmp, p: ["--clip-norm", "0.5", "--dry-run", "--report", tmp / "r.json"],
    "convert": lambda tmp, p: ["-o", tmp / "out.safetensors", "--drop-metadata"],
    "convert --dry-run": lambda tmp, p: ["-o", tmp / "out.safetensors", "--dry-run"],
}


def _clipped(path: Path) -> str:
    return "o.npz" if path.suffix == ".npz" else "o.safetensors"


def _checkpoints(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return doc.get("checkpoints", [doc])  # verify: one checkpoint, at the top


@pytest.mark.parametrize("path", PICKLES, ids=lambda p: p.name)
@pytest.mark.parametrize("name", list(ONE))
def test_each_commands_report_carries_inspects_audit(tmp_path: Path, name: str, path: Path) -> None:
    command = name.split()[0]
    extra = ONE[name](tmp_path, path)
    if command.startswith(("clip", "convert")):  # (a distributed checkpoint's complex32: no output holds it)
        extra += ["--include", float_tensor(path)]
    doc = report(command, path, *extra)
    expected = inspected(path)
    assert [c["pickle"] for c in _checkpoints(doc)] == [expected]
    if "--report" in extra:  # the file --report writes is the same JSON
        assert json.loads((tmp_path / "r.json").read_text())["checkpoints"][0]["pickle"] == expected
    text = run(command, path, *extra, env=CLEAN)
    assert text.exit_code in (0, 1) if command == "verify" else text.exit_code == 0, text.output
    torch_line = "pickle: loads with torch.load(weights_only=True): "
    numpy_line = "pickle (object arrays, which only np.load(allow_pickle=True) unpickles): calls beyond NumPy's own: "
    line = numpy_line if path == NPZ_OBJECTS else torch_line
    assert sum(x.startswith(line) for x in text.stdout.split("\n")) == 1, text.stdout


def test_several_checkpoints_each_carry_their_own(tmp_path: Path) -> None:
    paths = [NAMESPACE, TIED, HOSTILE]
    audits = [inspected(p) for p in paths]
    assert audits[0] != audits[1] != audits[2]
    for command in (["global-norm"], ["global-norm", "--combined", "--prefix-with-file"], ["stats"], ["hash"]):
        doc = report(*command, *paths)
        assert [c["pickle"] for c in doc["checkpoints"]] == audits, command
    doc = report("trajectory", *paths, "--keep-order")
    assert [c["pickle"] for c in doc["checkpoints"]] == audits
    copies = [shutil.copy(p, tmp_path / f"{i}.pt") for i, p in enumerate(paths)]
    out = tmp_path / "out"
    doc = report("clip-global-norm", *copies, "--clip-norm", "0.5", "-o", out, "--prefix-with-file", "--drop-metadata")
    assert [c["pickle"] for c in doc["checkpoints"]] == audits
    text = run("global-norm", *paths, env=CLEAN).stdout
    lines = [line for line in text.split("\n") if ": pickle: " in line]
    assert [line.split(": pickle: ")[0] for line in lines] == [str(p) for p in paths], text


def test_diff_names_each_sides_audit_as_its_other_per_side_fields(tmp_path: Path) -> None:
    """`pickle_a` and `pickle_b`, as `norm_a`/`norm_b` and `only_a`/`only_b`; a side that is no pickle has none."""
    doc = report("diff", NAMESPACE, HOSTILE)
    assert doc["pickle_a"] == inspected(NAMESPACE) and doc["pickle_b"] == inspected(HOSTILE)
    st = write_st(tmp_path / "w.safetensors", {"w": np.ones(3, np.float32)})
    doc = report("diff", st, TIED)
    assert "pickle_a" not in doc and doc["pickle_b"] == inspected(TIED)
    text = run("diff", NAMESPACE, HOSTILE, env=CLEAN).stdout.split("\n")
    assert [line[:3] for line in text if ": pickle: " in line] == ["A: ", "B: "], text


def test_reports_of_files_that_are_no_pickle_carry_none(tmp_path: Path) -> None:
    st = write_st(tmp_path / "w.safetensors", {"w": np.arange(4, dtype=np.float32), "step": np.array(3, np.int64)})
    npz = tmp_path / "w.npz"
    np.savez(npz, w=np.ones(2, np.float32))
    for path in (st, npz):
        for name, args in ONE.items():
            command = name.split()[0]
            extra = args(tmp_path, path) + (["--include", "w"] if command.startswith("clip") else [])
            out = tmp_path / "out.safetensors"
            out.unlink(missing_ok=True)
            doc = report(command, path, *extra)
            assert all("pickle" not in c for c in _checkpoints(doc)), (name, path)
            assert "pickle" not in run(command, path, *extra, env=CLEAN).stdout, (name, path)
        assert "pickle_a" not in report("diff", path, path) and "pickle_b" not in report("diff", path, path)
        assert all("pickle" not in c for c in report("trajectory", path, path)["checkpoints"])


def test_the_library_reports_carry_it_as_the_json_does(tmp_path: Path) -> None:
    audit = clipcli.open(NAMESPACE).pickle
    assert audit == inspected(NAMESPACE)
    name = float_tensor(NAMESPACE)
    reports = [
        clipcli.global_norm_of(NAMESPACE),
        clipcli.stats_of(NAMESPACE),
        clipcli.hash_of(NAMESPACE),
        clipcli.clip_norm_of(NAMESPACE, clip_norm=0.5, include=name),
        clipcli.convert_of(NAMESPACE, tmp_path / "o.safetensors", dry_run=True),
        clipcli.trajectory_of(NAMESPACE, TIED),
    ]
    for r in reports:
        assert r.to_dict()["checkpoints"][0]["pickle"] == audit, type(r).__name__
    assert clipcli.verify_of(NAMESPACE).to_dict()["pickle"] == audit
    assert clipcli.diff_of(NAMESPACE, NAMESPACE).to_dict()["pickle_b"] == audit


def test_names_from_the_file_are_escaped_in_the_table_line(tmp_path: Path) -> None:
    """gh-audit: a global's name comes from the file; the table line shows its control characters escaped."""
    pkl = state_dict({"cfg": call("os\x1b[2J", "system", f"touch {SENTINEL}", "reduce")})
    path = torch_file(tmp_path / "evil.pt", pkl, legacy=False)
    text = run("global-norm", path, env=CLEAN).stdout
    line = next(line for line in text.split("\n") if line.startswith("pickle: "))
    assert line.endswith("calls outside the allowlist: os\\x1b[2J.system"), line
    assert "\x1b" not in text
    assert {"name": "os\x1b[2J.system", "use": "call", "count": 1} in report("hash", path)["checkpoints"][0]["pickle"][
        "globals"
    ]
    assert not (tmp_path / SENTINEL).exists()


def test_a_file_refused_for_a_reference_alone_says_no_unsafe_call(tmp_path: Path) -> None:
    """review 28: a file that only names os.system (no call) was "no; calls outside the allowlist: none"."""
    path = torch_file(tmp_path / "ref.pt", state_dict({"f": b"cos\nsystem\n"}), legacy=False)
    text = run("global-norm", path, env=CLEAN).stdout
    line = next(line for line in text.split("\n") if line.startswith("pickle: "))
    assert (
        line == "pickle: loads with torch.load(weights_only=True): no; unsafe calls: none (its globals: --format json)"
    )
    audit = report("global-norm", path)["checkpoints"][0]["pickle"]
    assert audit["loads_with_weights_only"] is False
    assert {"name": "os.system", "use": "name", "count": 1} in audit["globals"]


def test_the_gate_line_escapes_a_name_as_the_warning_does(tmp_path: Path) -> None:
    """review 28: a global's name with a newline was escaped in the warning (`\\n`) but flattened to a space in
    the --fail-unsafe-pickle error line; both show it escaped, the same way."""
    pkl = state_dict({"cfg": call("run\nfake\x07", "system", f"touch {SENTINEL}", "stack_global")})
    path = torch_file(tmp_path / "evil.pt", pkl, legacy=False)
    r = run("global-norm", path, "--fail-unsafe-pickle", env=CLEAN)
    assert r.exit_code == 1
    warning, error = r.stderr.splitlines()
    assert "run\\nfake\\x07.system" in warning, warning
    assert error.startswith("clipcli: error: ") and "run\\nfake\\x07.system" in error, error
    assert "\x07" not in r.stderr
    assert not (tmp_path / SENTINEL).exists()


# found in review: with several unsafe checkpoints, the gate's line named only the first
@pytest.mark.parametrize("command", ["inspect", "global-norm", "hash"])
def test_the_gate_line_names_each_unsafe_file(tmp_path: Path, command: str) -> None:
    pkl = state_dict({"cfg": call("os", "system", f"touch {SENTINEL}", "reduce")})
    odd = torch_file(tmp_path / "odd\nname\x1b.pt", pkl, legacy=False)
    args = [HOSTILE, TIED, odd] if command != "hash" else [HOSTILE, odd]
    r = run(command, *args, "--fail-unsafe-pickle", "--quiet", env=CLEAN)
    lines = r.stderr.splitlines()
    assert r.exit_code == 1 and len(lines) == 3, r.output
    shown = str(odd).replace("\n", "\\n").replace("\x1b", "\\x1b")
    assert lines[1] == f"clipcli: warning: {shown}: torch.load would call os.system (never called here)"
    hostile_calls = lines[0].removeprefix(f"clipcli: warning: {HOSTILE}: ").removesuffix(" (never called here)")
    assert lines[2] == (
        f"clipcli: error: {HOSTILE}: {hostile_calls}; {shown}: torch.load would call os.system (--fail-unsafe-pickle)"
    )
    assert "\x1b" not in r.stderr and not (tmp_path / SENTINEL).exists()


# found in review: a writer over several unsafe checkpoints stopped at the first, naming only it
def test_a_writers_gate_names_each_unsafe_file_before_any_output(tmp_path: Path) -> None:
    pkl = state_dict({"cfg": call("os", "system", f"touch {SENTINEL}", "reduce")})
    odd = torch_file(tmp_path / "odd.pt", pkl, legacy=False)
    out = tmp_path / "out"
    r = run("clip-global-norm", HOSTILE, odd, "-o", out, "--clip-norm", "0.5", "--fail-unsafe-pickle", env=CLEAN)
    lines = r.stderr.splitlines()
    assert r.exit_code == 1 and len(lines) == 3, r.output
    assert lines[1] == f"clipcli: warning: {odd}: torch.load would call os.system (never called here)"
    assert lines[2].startswith(f"clipcli: error: {HOSTILE}: ") and lines[2].endswith(
        f"; {odd}: torch.load would call os.system (--fail-unsafe-pickle)"
    )
    assert not out.exists() and r.stdout == "" and not (tmp_path / SENTINEL).exists()


REPORTERS = {
    "inspect": [],
    "global-norm": [],
    "stats": [],
    "hash": [],
    "verify": [],
    "trajectory": [],
}


@pytest.mark.parametrize("command", list(REPORTERS))
def test_the_gate_of_a_report_command_fails_after_the_report(command: str) -> None:
    """The vetting step gets the report, with the audit, on stdout, and then exit 1 with the gate's one line."""
    result = run(command, HOSTILE, "--fail-unsafe-pickle", "--format", "json")
    lines = result.stderr.splitlines()
    assert result.exit_code == 1 and len(lines) == 2, result.output
    assert lines[0].startswith(f"clipcli: warning: {HOSTILE}: torch.load would call ")
    assert lines[1].startswith(f"clipcli: error: {HOSTILE}: ") and lines[1].endswith("(--fail-unsafe-pickle)")
    assert _checkpoints(json.loads(result.stdout))[0]["pickle"] == inspected(HOSTILE)
    quiet = run(command, HOSTILE, "--fail-unsafe-pickle", "--quiet")
    assert quiet.exit_code == 1 and quiet.stdout == "" and quiet.stderr == result.stderr, quiet.output
    passes = run(command, TIED, "--fail-unsafe-pickle", "--format", "json")
    assert passes.exit_code == 0 and passes.stderr == "", passes.output


def test_the_gate_of_diff_fails_after_the_report_and_before_its_own_gates() -> None:
    result = run("diff", TIED, HOSTILE, "--fail-unsafe-pickle", "--fail-different", "--format", "json")
    lines = result.stderr.splitlines()
    assert result.exit_code == 1 and len(lines) == 2 and lines[1].endswith("(--fail-unsafe-pickle)"), result.output
    assert json.loads(result.stdout)["pickle_b"] == inspected(HOSTILE)
    other = run("diff", TIED, HOSTILE, "--fail-different", "--format", "json")  # without it: the diff's own line
    assert other.exit_code == 1 and "(--fail-unsafe-pickle)" not in other.stderr, other.output


def test_the_unsafe_pickle_line_is_the_one_shown_when_another_gate_fails_too() -> None:
    result = run("global-norm", HOSTILE, "--fail-unsafe-pickle", "--fail-above", "0")
    lines = result.stderr.splitlines()
    assert result.exit_code == 1 and len(lines) == 2 and lines[1].endswith("(--fail-unsafe-pickle)"), result.output
    assert "pickle: loads with torch.load(weights_only=True): no" in result.stdout


@pytest.mark.parametrize(
    "command",
    [
        ["convert", "--dry-run"],
        ["clip-value", "--min", "-0.5", "--max", "0.5", "--dry-run"],
        ["clip-norm", "--clip-norm", "0.5", "--dry-run"],
        ["clip-global-norm", "--clip-norm", "0.5", "--dry-run"],
    ],
    ids=lambda c: c[0],
)
def test_the_gate_of_a_writer_fails_before_any_output_even_a_dry_runs_report(tmp_path: Path, command: list) -> None:
    report_file = tmp_path / "report.json"
    args = [command[0], HOSTILE, *command[1:], "--report", report_file, "--fail-unsafe-pickle"]
    if command[0] == "convert":
        args[2:2] = ["-o", tmp_path / "out.safetensors"]
    result = run(*args)
    assert result.exit_code == 1 and result.stdout == "", result.output
    assert result.stderr.splitlines()[1].endswith("(--fail-unsafe-pickle)")
    assert list(tmp_path.iterdir()) == []
