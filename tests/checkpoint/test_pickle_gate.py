"""The unsafe-pickle warning and `--fail-unsafe-pickle` on every command: `verify` too (its report first, then the
gate), the writers before any output is written, and with paths (URLs included) shown as given. Hostile files are
never loaded by pickle or torch."""

from __future__ import annotations

import re
import shutil
import zipfile
from pathlib import Path

import pytest

from tests.checkpoint.test_hostile_calls import SENTINEL, call, hostile_files, torch_file
from tests.helpers import DATA, ROOT, run_bounded, torchscript_jit
from tests.servers import range_server

INERT = DATA / "torch" / "inert"


def hostile_torchscript(d: Path) -> Path:
    """A TorchScript archive whose data.pkl calls os.system before its module (POP drops the result)."""
    plain = torchscript_jit(d)
    path = d / "hostile.jit"
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(path, "w") as z:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("/data.pkl"):
                data = data[:2] + call("os", "system", f"touch {SENTINEL}", "reduce") + b"0" + data[2:]
            z.writestr(info, data)
    return path


def every_form(tmp_path: Path) -> dict[str, Path]:
    """Each pickle-based input holding a hostile call, in tmp_path (where a payload would leave its sentinel)."""
    built = {form: path for form, (path, _) in hostile_files(tmp_path).items()}
    for name in ("hostile.pt", "hostile_legacy.pt"):
        built[name] = shutil.copy(INERT / name, tmp_path / name)
    built["npz"] = shutil.copy(DATA / "npz" / "hostile_object.npz", tmp_path / "hostile_object.npz")
    built["torchscript"] = hostile_torchscript(tmp_path)
    return built


@pytest.fixture
def in_tmp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # clipcli runs in tmp_path


def test_verify_warns_of_every_hostile_form_and_the_gate_fails_it(tmp_path: Path, in_tmp: None) -> None:
    for form, path in every_form(tmp_path).items():
        plain = run_bounded("verify", path.name, seconds=30, cwd=tmp_path)
        gated = run_bounded("verify", path.name, "--fail-unsafe-pickle", seconds=30, cwd=tmp_path)
        warning = plain.stderr.splitlines()
        assert plain.returncode == 0 and len(warning) == 1, (form, plain)
        assert warning[0].startswith(f"clipcli: warning: {path.name}") and "would call" in warning[0], (form, plain)
        assert warning[0].endswith("(never called here)") and "os.system" in plain.stderr.replace("posix", "os")
        lines = gated.stderr.splitlines()
        assert gated.returncode == 1 and lines[0] == warning[0] and len(lines) == 2, (form, gated)
        assert lines[1].startswith(f"clipcli: error: {path.name}") and lines[1].endswith("(--fail-unsafe-pickle)")
        # a report command: the report (the same as without the gate, its audit included), then the gate's exit 1
        assert gated.stdout == plain.stdout and "\npickle" in gated.stdout, (form, gated)
    assert not (tmp_path / SENTINEL).exists()


@pytest.mark.parametrize(
    "command",
    [
        ["convert"],
        ["clip-value", "--min", "-0.5", "--max", "0.5"],
        ["clip-norm", "--clip-norm", "0.5"],
        ["clip-global-norm", "--clip-norm", "0.5"],
    ],
    ids=lambda c: c[0],
)
def test_a_failed_gate_writes_nothing(tmp_path: Path, in_tmp: None, command: list[str]) -> None:
    source = shutil.copy(INERT / "hostile.pt", tmp_path / "hostile.pt")
    out = tmp_path / "out"
    out.mkdir()
    target = out / "e.safetensors"
    report = out / "report.json"
    gated = run_bounded(
        *command, source.name, "-o", target, "--fail-unsafe-pickle", "--report", report, seconds=30, cwd=tmp_path
    )
    lines = gated.stderr.splitlines()
    assert gated.returncode == 1 and len(lines) == 2 and lines[1].endswith("(--fail-unsafe-pickle)"), gated
    assert list(out.iterdir()) == []  # no output, no temporary file, no report
    plain = run_bounded(*command, source.name, "-o", target, seconds=30, cwd=tmp_path)
    assert plain.returncode == 0 and plain.stderr.splitlines() == lines[:1] and target.exists(), plain


def test_a_url_is_shown_as_given_in_the_warning_and_the_error(in_tmp: None) -> None:
    files = {"evil.pt": INERT / "hostile.pt", "dcp/__0_0.distcp": DATA / "dcp" / "single" / "__0_0.distcp"}
    with range_server(files) as server:
        url = f"{server.url}/evil.pt"
        plain = run_bounded("inspect", url, seconds=30)
        gated = run_bounded("global-norm", url, "--fail-unsafe-pickle", seconds=30)
        item = run_bounded("inspect", f"{server.url}/dcp/__0_0.distcp", seconds=30)
    assert plain.returncode == 0 and plain.stderr.startswith(f"clipcli: warning: {url}: torch.load would call"), plain
    lines = gated.stderr.splitlines()
    assert gated.returncode == 1 and lines[0] == plain.stderr.splitlines()[0], gated
    assert lines[1].startswith(f"clipcli: error: {url}: torch.load would call"), gated
    assert item.returncode == 3 and f"name its directory ({server.url}/dcp) instead" in item.stderr, item


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
# without STOP, a legacy file's stream runs on into its next pickle and stops at an opcode of the data after it
@pytest.mark.parametrize(
    ("end", "says"), [(b"\xff", "unknown pickle opcode 0xff"), (b"", "without a STOP opcode|unknown pickle opcode")]
)
def test_a_malformed_stream_after_a_hostile_call_names_the_call(
    tmp_path: Path, in_tmp: None, legacy: bool, end: bytes, says: str
) -> None:
    """Still exit 3 (malformed), but the one line says what the file attempted before the machine stopped."""
    pkl = b"\x80\x02" + call("os", "system", f"touch {SENTINEL}", "reduce") + b"0" + end
    path = torch_file(tmp_path / "bad.pt", pkl, legacy)
    r = run_bounded("inspect", path.name, seconds=30, cwd=tmp_path)
    lines = r.stderr.splitlines()
    assert r.returncode == 3 and len(lines) == 1 and re.search(says, lines[0]), r
    assert lines[0].endswith("; before that it would call os.system"), r
    assert not (tmp_path / SENTINEL).exists()
