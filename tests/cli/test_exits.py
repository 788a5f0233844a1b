"""Exit statuses and what the command line promises: escaped strings, closed stdout, stop signals, permissions."""

from __future__ import annotations

import csv
import ctypes
import io
import json
import os
import shutil
import signal
import stat
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from clipcli.cli import app
from clipcli.report.listing import InspectReport, Listing
from clipcli.report.norms import CheckpointNorms, NormReport
from clipcli.report.rows import Skipped, Summary
from tests.helpers import ROOT, SAMPLES, ok, raw_safetensors, run, run_bounded, st_bytes, write_st

ENV = {**os.environ, "NO_COLOR": "1", "COLUMNS": "100", "PYTHONPATH": str(ROOT)}
EVIL = "\x1b]0;title\x07\x1b[2J"  # sets a terminal's window title, then clears its screen
CONTROLS = "\x1b\x07\x9b"


def clipcli(*args: object, **kwargs: object) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "clipcli", *map(str, args)], capture_output=True, text=True, env=ENV, **kwargs
    )


def one_error_line(stderr: str) -> str:
    assert stderr.count("\n") == 1 and stderr.startswith("clipcli: error: "), stderr
    return stderr


# --- Every string from a file is escaped -------------------------------------------------------------


def _bin(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def flagged_pt(path: Path, flag: str) -> Path:
    """A zip .pt (hand-written protocol-2 pickle) of one float32 tensor whose flags dict holds `flag`."""
    storage = b"(" + _bin("storage") + b"ctorch\nFloatStorage\n" + _bin("0") + _bin("cpu") + b"J\x02\0\0\0tQ"
    ordered = b"ccollections\nOrderedDict\n)R"
    flags = b"}(" + _bin(flag) + b"\x88u"
    args = b"(" + storage + b"J\0\0\0\0" + b"(J\x02\0\0\0t" + b"(J\x01\0\0\0t" + b"\x89" + ordered + flags + b"t"
    tensor = b"ctorch._utils\n_rebuild_tensor_v2\n" + args + b"R"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", b"\x80\x02}(" + _bin("w") + tensor + b"u.")
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/data/0", np.ones(2, np.float32).tobytes())
        z.writestr("archive/version", "3\n")
    return path


def test_a_skip_reason_from_a_file_reaches_no_terminal_raw(tmp_path):
    # issue 22 item 10: a tensor-flags key holding escapes set the window title through "skipped w: tensor flags ..."
    src = flagged_pt(tmp_path / "flags.pt", EVIL)
    r = run_bounded("global-norm", src, seconds=30, memory_mb=1024)
    assert r.returncode in (0, 3), r  # a skip line, or a refusal of flags torch does not know: escaped either way
    assert not any(c in r.stdout + r.stderr for c in CONTROLS), r
    assert "\\x1b]0;title\\x07\\x1b[2J" in r.stdout + r.stderr


def test_the_text_report_escapes_every_line_not_only_names():
    # issue 22 item 10: skip reasons, metadata values and tied names went to the terminal as the file gave them
    skipped = (Skipped("w", "float32", f"tensor flags {EVIL}"),)
    norms = CheckpointNorms(path="p", summary=Summary(0), skipped=skipped, shared=((EVIL, "b"),))
    listing = Listing(path="p", format=None, summary=Summary(0), metadata={"k": EVIL}, shared=((EVIL, "b"),))
    for report in (NormReport(2.0, (norms,)), InspectReport((listing,))):
        text = report.to_text()
        assert not any(ch in text for ch in CONTROLS) and "\\x1b]0;title\\x07" in text


def test_an_error_message_quoting_a_file_is_escaped(tmp_path):
    # issue 22 item 10: an error message that quotes file content (a dtype string) is one escaped line
    src = tmp_path / "bad.safetensors"
    src.write_bytes(raw_safetensors({"w": {"dtype": EVIL, "shape": [1], "data_offsets": [0, 4]}}, bytes(4)))
    r = run_bounded("inspect", src, seconds=30)
    assert r.returncode == 3 and r.seconds < 5
    one_error_line(r.stderr)
    assert not any(c in r.stderr for c in CONTROLS) and "\\x1b]0;title" in r.stderr


def test_every_error_line_is_escaped(capsys):
    # issue 22 item 10: an internal error's text, or a library's message, may quote anything from a file
    import typer

    from clipcli import cli_app

    with pytest.raises(typer.Exit):
        cli_app._fail(f"internal error (ValueError: {EVIL})", 70)
    err = capsys.readouterr().err
    assert err == "clipcli: error: internal error (ValueError: \\x1b]0;title\\x07\\x1b[2J)\n"


def test_control_characters_in_a_message_never_reach_the_terminal(tmp_path):
    # found by a fresh user (second review): an error message passed a tensor name's control characters to the terminal
    name = "evil\x1b[2Jname"
    path = write_st(tmp_path / "t.safetensors", {name: np.array([1.0, np.inf], np.float32)})
    result = run("global-norm", path, "--fail-nonfinite")
    assert result.exit_code == 1 and "\x1b" not in result.stderr and "\\x1b" in result.stderr


@pytest.mark.parametrize("command", ["global-norm", "inspect", "diff"])
def test_csv_escapes_control_characters_in_names(tmp_path, command):
    # found by a fresh user (second review): CSV reports passed control characters in names through raw
    name = "w\x1b]0;title\x07"
    path = write_st(tmp_path / "t.safetensors", {name: np.array([1.0, 2.0], np.float32)})
    other = write_st(tmp_path / "u.safetensors", {name: np.array([1.0, 3.0], np.float32)})
    paths = [path, other] if command == "diff" else [path]
    text = ok(command, *paths, "--format", "csv").stdout
    assert "\x1b" not in text and "\x07" not in text and "\\x1b" in text


def test_control_characters_in_names_are_escaped_everywhere(tmp_path):
    # found trying clipcli as a new user: control characters in tensor names and metadata reached the terminal raw
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


# --- Standard output closed or full --------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["table", "json"])
def test_a_closed_stdout_is_exit_4_not_an_internal_error(grads, tmp_path, fmt):
    # issue 22 item 14: `clipcli global-norm f >&-` exited 70 "internal error" (sys.stdout is None)
    closed = [sys.executable, "-c", "import os, sys; os.close(1); os.execv(sys.executable, sys.argv[1:])"]
    run = [*closed, sys.executable, "-m", "clipcli"]
    done = subprocess.run([*run, "global-norm", str(grads), "--format", fmt], capture_output=False,
                          stderr=subprocess.PIPE, text=True, env=ENV)  # fmt: skip
    assert done.returncode == 4, done.stderr
    assert one_error_line(done.stderr) == "clipcli: error: standard output: cannot write the report: closed\n"
    # nothing to print: 0; a clip's output is written, and the lost report is still exit 4
    quiet = subprocess.run([*run, "global-norm", str(grads), "-q"], stderr=subprocess.PIPE, text=True, env=ENV)
    assert (quiet.returncode, quiet.stderr) == (0, "")
    out = tmp_path / "o.safetensors"
    clip = subprocess.run([*run, "clip-global-norm", str(grads), "-o", str(out), "--clip-norm", "1"],
                          stderr=subprocess.PIPE, text=True, env=ENV)  # fmt: skip
    assert clip.returncode == 4 and out.exists(), clip.stderr


def test_a_failed_gate_is_exit_1_even_when_the_report_is_lost(grads):
    # a review found `clipcli global-norm f --fail-above 100 | true` exit 0 with no reason (the broken pipe
    # ended the command before its gate), and `>&-` exit 4: the gate decides first, its reason on stderr
    gate = [sys.executable, "-m", "clipcli", "global-norm", str(grads), "--fail-above", "100"]
    reason = f"clipcli: error: {grads}: global norm 145.37555051140208 exceeds --fail-above 100\n"
    closed = [sys.executable, "-c", "import os, sys; os.close(1); os.execv(sys.executable, sys.argv[1:])"]
    done = subprocess.run([*closed, *gate], stderr=subprocess.PIPE, text=True, env=ENV)
    assert (done.returncode, one_error_line(done.stderr)) == (1, reason)
    r, w = os.pipe()
    os.close(r)  # a reader gone before the report is written: EPIPE
    done = subprocess.run(gate, stdout=w, stderr=subprocess.PIPE, text=True, env=ENV)
    os.close(w)
    assert (done.returncode, one_error_line(done.stderr)) == (1, reason)
    r, w = os.pipe()
    os.close(r)
    done = subprocess.run(gate[:-2], stdout=w, stderr=subprocess.PIPE, text=True, env=ENV)  # no gate: `| head`
    os.close(w)
    assert (done.returncode, done.stderr) == (0, "")


def test_a_full_stdout_is_exit_4(grads):
    # issue 22 item 14: stdout on /dev/full
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "clipcli", "global-norm", str(grads)], stdout=full,
                              stderr=subprocess.PIPE, text=True, env=ENV)  # fmt: skip
    assert done.returncode == 4
    assert one_error_line(done.stderr).endswith("cannot write the report: No space left on device\n")


def test_a_failed_gate_with_a_full_stdout_says_the_report_was_lost(grads):
    # review 28: `global-norm F --fail-above X > /dev/full` exited 1 with the gate's line alone: nothing said that
    # the report was lost (`| head` and `>&-` stay one line: test_a_closed_stdout_is_exit_4_not_an_internal_error)
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    with open("/dev/full", "w") as full:
        command = [sys.executable, "-m", "clipcli", "global-norm", str(grads), "--fail-above", "100"]
        done = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, text=True, env=ENV)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "clipcli: warning: standard output: cannot write the report: No space left on device",
        f"clipcli: error: {grads}: global norm 145.37555051140208 exceeds --fail-above 100",
    ]


def test_a_report_that_cannot_be_written_to_stdout_is_exit_4():
    # found by a fresh user (second review): a report that stdout (/dev/full) could not take exited 120, not 4
    with open("/dev/full", "w") as full:
        command = [sys.executable, "-m", "clipcli", "global-norm", str(SAMPLES / "grads.safetensors")]
        done = subprocess.run(command, env=ENV, stdout=full, stderr=subprocess.PIPE, text=True, check=False)
    assert done.returncode == 4
    assert done.stderr == "clipcli: error: standard output: cannot write the report: No space left on device\n"


# --- Stop signals at any moment end the process by the signal -----------------------------------------


def _interrupt_during_numpys_import(sig: signal.Signals) -> str:
    """A program that runs `python -m clipcli` and sends itself `sig` in the middle of NumPy's import."""
    return (
        "import os, runpy, signal, sys\n"
        "class Hook:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'numpy._core._multiarray_umath':\n"
        f"            os.kill(os.getpid(), {int(sig)})\n"
        "        return None\n"
        "sys.meta_path.insert(0, Hook())\n"
        "sys.argv[0] = 'clipcli'\n"
        "runpy.run_module('clipcli', run_name='__main__', alter_sys=True)\n"
    )


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_during_numpys_import_is_one_line_and_the_signal(grads, sig):
    # issue 22 item 15: a stop while NumPy imported gave exit 1 and NumPy's 70-90 line traceback ending in
    # "ImportError: numpy._core.umath failed to import"
    code = _interrupt_during_numpys_import(sig)
    done = subprocess.run([sys.executable, "-c", code, "global-norm", str(grads)], capture_output=True, text=True,
                          env=ENV, timeout=60)  # fmt: skip
    assert done.returncode == -sig, done.stderr
    assert done.stderr == ("clipcli: interrupted\n" if sig == signal.SIGINT else "clipcli: terminated\n")
    assert done.stdout == ""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_python_swallows_prints_no_exception_ignored(grads, tmp_path, sig):
    # issue 22 item 15: a SIGTERM landing in a weakref callback of the import machinery printed "Exception
    # ignored in: <function _get_module_lock.<locals>.cb>" and a traceback before "clipcli: terminated"
    code = (
        "import os, sys\n"
        "from clipcli import _stops\n"
        "class Stop:\n"
        f"    def __del__(self): _stops.stop({int(sig)})  # raised where Python swallows it\n"
        "real = os.fchmod\n"
        "def fchmod(fd, mode):  # on the way to the commit\n"
        "    Stop()\n"
        "    real(fd, mode)\n"
        "os.fchmod = fchmod\n"
        "from clipcli.cli import main\n"
        "main(sys.argv[1:])\n"
    )
    out = tmp_path / "out.safetensors"
    done = subprocess.run([sys.executable, "-c", code, "clip-global-norm", str(grads), "-o", str(out), "--clip-norm",
                           "1"], capture_output=True, text=True, env=ENV, timeout=60)  # fmt: skip
    assert done.returncode == -sig
    assert done.stderr == ("clipcli: interrupted\n" if sig == signal.SIGINT else "clipcli: terminated\n")
    assert not out.exists()


@pytest.fixture(scope="module")
def slow(tmp_path_factory) -> Path:
    """A checkpoint that takes a good part of a second to clip, to stop at any moment of a run."""
    path = tmp_path_factory.mktemp("slow") / "slow.safetensors"
    path.write_bytes(st_bytes({"w": np.random.default_rng(0).standard_normal(1 << 24).astype(np.float32)}))
    return path


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_at_any_moment_from_start_up_on_ends_the_process_by_it(slow, tmp_path, sig):
    # issue 22 item 15: stops from 0 to 0.5 s (start-up, NumPy's import, the work): one line or none, the signal
    out = tmp_path / "out.safetensors"
    stopped = 0
    for delay in np.linspace(0, 0.5, 11):
        out.unlink(missing_ok=True)  # written by a run that finished before its stop
        proc = subprocess.Popen(
            [sys.executable, "-m", "clipcli", "clip-global-norm", slow, "-o", out, "--clip-norm", "1", "-q", "-j", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
        )  # fmt: skip
        time.sleep(delay)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=60)
        if stderr.rstrip().endswith("\nKeyboardInterrupt") and ", in stop\n" not in stderr:
            continue  # Python's own handler: a stop in Python's start-up, before clipcli's handlers (the README)
        assert "Traceback" not in stderr and stdout == "", (delay, stderr)
        if proc.returncode == 0:  # finished first
            continue
        assert proc.returncode == -sig, (delay, proc.returncode, stderr)
        assert stderr in ("", "clipcli: interrupted\n" if sig == signal.SIGINT else "clipcli: terminated\n")
        assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
        stopped += stderr != ""
    assert stopped >= 2  # some stops landed in a run, and were handled


def test_ctrl_c_stops_a_shell_loop_over_checkpoints(slow, tmp_path):
    # issue 22 item 16: clipcli exited 130 after Ctrl-C, so `for f in ...; do clipcli ...; done` went on to
    # clip and write the next files; now it dies by SIGINT and bash ends the loop
    loop = (
        f"for f in a b c; do {sys.executable} -m clipcli clip-global-norm {slow} -o {tmp_path}/$f.safetensors "
        "--clip-norm 1 -q -j 1; done; echo loop went on"
    )
    proc = subprocess.Popen(["bash", "-c", loop], start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)  # fmt: skip
    deadline = time.monotonic() + 60
    while not any(p.name.endswith(".tmp") for p in tmp_path.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.005)  # the first clip is writing
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole foreground process group
    stdout, stderr = proc.communicate(timeout=60)
    assert "loop went on" not in stdout and proc.returncode == -signal.SIGINT, (stdout, stderr)
    assert stderr == "clipcli: interrupted\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no output, no temporary file, no next file


def test_the_interrupted_status_is_a_death_by_the_signal(grads, tmp_path):
    # issue 22 item 16: os.waitstatus WIFSIGNALED, as a shell or a supervisor sees it
    code = _interrupt_during_numpys_import(signal.SIGINT)
    proc = subprocess.Popen([sys.executable, "-c", code, "global-norm", str(grads)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=ENV)  # fmt: skip
    _, status = os.waitpid(proc.pid, 0)
    proc.returncode = 0  # reaped here
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGINT


def test_an_inherited_ignored_sigint_stays_ignored(slow, tmp_path):
    # issue 22 item 16: a background job (`clipcli ... &` in a script) starts with SIGINT ignored: it runs on
    out = tmp_path / "out.safetensors"

    def ignore_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    proc = subprocess.Popen(
        [sys.executable, "-m", "clipcli", "clip-global-norm", slow, "-o", out, "--clip-norm", "1", "-q", "-j", "1"],
        stderr=subprocess.PIPE, text=True, env=ENV, preexec_fn=ignore_sigint,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not any(p.name.endswith(".tmp") for p in tmp_path.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert (proc.returncode, stderr) == (0, "") and out.exists()


# --- A file, shard or directory without permission -------------------------------------------------------


def _without_root_s_read_override() -> None:
    """In the child: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding set, so that root, once
    it execs, reads only what the permission bits let it (the tests run as root here)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _skip_unless_permissions_bind() -> None:
    """Skips a test of permission bits where they bind no one: root that cannot drop its override."""
    if os.geteuid() == 0:
        try:
            subprocess.run(["true"], preexec_fn=_without_root_s_read_override, check=True)
        except (OSError, subprocess.SubprocessError):
            pytest.skip("cannot drop root's capability to read any file")


def _unprivileged(*args: object) -> subprocess.CompletedProcess:
    preexec = _without_root_s_read_override if os.geteuid() == 0 else None
    return subprocess.run([sys.executable, "-m", "clipcli", *map(str, args)], capture_output=True, text=True,
                          env=ENV, preexec_fn=preexec, timeout=60)  # fmt: skip


def test_an_unreadable_file_shard_or_directory_is_exit_3_naming_it(grads, tmp_path):
    # issue 22 item 17: exit 2 with Click's four-line usage error ("Path ... is not readable"); now exit 3,
    # one line naming the file, the shard or the directory that cannot be read
    _skip_unless_permissions_bind()
    closed = tmp_path / "closed.safetensors"
    shutil.copy(grads, closed)
    closed.chmod(0)
    shards = tmp_path / "shards"
    shutil.copytree(ROOT / "samples" / "sharded", shards)
    shard = sorted(shards.glob("*.safetensors"))[0]
    shard.chmod(0)
    locked = tmp_path / "locked"
    locked.mkdir()
    shutil.copy(grads, locked / "g.safetensors")
    locked.chmod(0)
    try:
        cases = [
            (["inspect", closed], closed),
            (["global-norm", closed], closed),
            (["clip-global-norm", closed, "--dry-run", "--clip-norm", "1"], closed),
            (["diff", grads, closed], closed),
            (["global-norm", shards], shard),
            (["inspect", locked], locked),
            (["inspect", locked / "g.safetensors"], locked / "g.safetensors"),
        ]
        for args, named in cases:
            done = _unprivileged(*args)
            assert done.returncode == 3, (args, done.stderr)
            assert one_error_line(done.stderr) == f"clipcli: error: {named}: cannot read: Permission denied\n"
    finally:
        locked.chmod(0o755)


def test_an_output_in_a_directory_that_cannot_be_searched_is_exit_4(grads, tmp_path):
    # a review found exit 70 (Path.is_dir raised PermissionError in the checks before writing), for -o, a
    # directory of shards and --report alike
    _skip_unless_permissions_bind()
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0)
    try:
        cases = [
            ["clip-global-norm", grads, "-o", locked / "x.safetensors", "--clip-norm", "1"],
            ["convert", ROOT / "samples" / "sharded", "-o", f"{locked}/"],
            ["clip-global-norm", grads, "-o", tmp_path / "ok.safetensors", "--clip-norm", "1", "--report",
             locked / "r.json"],
        ]  # fmt: skip
        for args in cases:
            done = _unprivileged(*args)
            assert done.returncode == 4, (args, done.stderr)
            assert one_error_line(done.stderr).endswith("cannot write there: Permission denied\n"), done.stderr
        assert not (tmp_path / "ok.safetensors").exists()
    finally:
        locked.chmod(0o755)


# --- Usage errors of one line; --report - ---------------------------------------------------------------


def test_nothing_to_clip_is_a_usage_error_of_one_line(tmp_path):
    # issue 22 item 18: Click's four-line block ("Invalid value: ...") for a file without a floating tensor
    src = tmp_path / "steps.npz"
    np.savez(src, step=np.arange(3))
    done = clipcli("clip-global-norm", src, "-o", tmp_path / "o.npz", "--clip-norm", "1")
    assert done.returncode == 2
    assert one_error_line(done.stderr).startswith(f"clipcli: error: {src}: no floating or complex tensor")
    assert not (tmp_path / "o.npz").exists()


def test_report_dash_is_refused_before_anything_is_read(grads, tmp_path, monkeypatch):
    # issue 22 item 19: `--report -` wrote the JSON into a file named `-`; refused as `-o -` is (the JSON on
    # stdout is --format json)
    monkeypatch.chdir(tmp_path)
    done = clipcli("clip-global-norm", grads, "--dry-run", "--clip-norm", "1", "--report", "-")
    assert done.returncode == 2 and "--report" in done.stderr and "--format json" in done.stderr
    assert not (tmp_path / "-").exists()


# --- Paths, terminals, completion, ownership and CSV cells -----------------------------------------------


def test_an_ascii_terminal_gets_the_diff_summary_in_ascii(tmp_path):
    # issue 22 item 25: under an ASCII stdout the summary read "\u2016A\u2212B\u2016"
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    a.write_bytes(st_bytes({"w": np.ones(3, np.float32)}))
    b.write_bytes(st_bytes({"w": np.full(3, 2, np.float32)}))
    done = subprocess.run([sys.executable, "-m", "clipcli", "diff", str(a), str(b)], capture_output=True,
                          env={**ENV, "PYTHONIOENCODING": "ascii"})  # fmt: skip
    assert done.returncode == 0
    head = done.stdout.decode("ascii").splitlines()[0]
    assert f"{a} -> {b}: |A-B| 1.73205" in head and "\\u" not in head
    utf8 = clipcli("diff", a, b)
    assert "‖A−B‖ 1.73205" in utf8.stdout  # a terminal that can show them keeps the symbols


def test_an_empty_path_is_a_usage_error_not_the_current_directory(tmp_path, grads, monkeypatch):
    # issue 22 item 25: `clipcli inspect ""` read the current directory
    monkeypatch.chdir(grads.parent)
    for args in (["inspect", ""], ["global-norm", grads, ""], ["diff", "", grads], ["convert", "", "-o", "x.npz"]):
        done = clipcli(*args)
        assert done.returncode == 2 and "an empty path names no file" in done.stderr, args
    # a review found `-o ''` taken for the current directory: a sharded clip replaced the shards there, exit 0
    shards = tmp_path / "here"
    shutil.copytree(ROOT / "samples" / "sharded", shards)
    before = {p.name: p.read_bytes() for p in shards.iterdir()}
    monkeypatch.chdir(shards)
    for args in (
        ["clip-global-norm", ROOT / "samples" / "sharded", "-o", "", "--clip-norm", "1"],
        ["convert", ROOT / "samples" / "sharded", "-o", ""],
        ["clip-value", grads, "-o", "", "--min", "-1", "--max", "1"],
    ):
        done = clipcli(*args)
        assert done.returncode == 2 and "an empty path names no file" in done.stderr, args
    assert {p.name: p.read_bytes() for p in shards.iterdir()} == before


def test_max_shard_size_errors_name_the_option(grads, tmp_path):
    # issue 22 item 25: "Invalid value: out.safetensors: --max-shard-size writes shards" named no option
    done = clipcli("convert", grads, "-o", tmp_path / "one.safetensors", "--max-shard-size", "1MB")
    assert done.returncode == 2 and "Invalid value for --max-shard-size:" in done.stderr
    done = clipcli("convert", grads, "-o", tmp_path / "d", "--max-shard-size", "1e400")
    assert done.returncode == 2 and "Invalid value for --max-shard-size: must be a finite size" in done.stderr


@pytest.mark.parametrize(("shell", "marker"), [("zsh", "#compdef clipcli"), ("fish", "complete --command clipcli")])
def test_show_completion_prints_the_named_shell_s_script(shell, marker):
    # issue 22 item 25: Typer's --show-completion is a flag: `--show-completion zsh` printed bash's script
    done = clipcli("--show-completion", shell)
    assert done.returncode == 0 and done.stdout.startswith(marker), done.stdout[:200]
    assert "complete -o default" not in done.stdout  # bash's
    assert clipcli("--show-completion").returncode == 0  # without a shell: the current one, as before


def test_in_place_keeps_the_owner_and_group(grads):
    # issue 22 item 25: `--in-place` as root gave the file to root
    if os.geteuid() != 0:
        pytest.skip("only root may give a file to another user")
    os.chown(grads, 1234, 4321)
    grads.chmod(0o640)
    done = clipcli("clip-global-norm", grads, "--in-place", "--clip-norm", "1", "-q")
    assert done.returncode == 0, done.stderr
    st = grads.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1234, 4321, 0o640)


def test_csv_text_cells_cannot_be_formulas_and_numbers_stay_numbers(tmp_path):
    # issue 22 item 25: names starting with = + - @ were written raw (formula injection in spreadsheets)
    names = ['=HYPERLINK("http://x")', "+1+2", "-cmd", "@SUM(A1)", "-1.5", "ok"]
    src = tmp_path / "f.safetensors"
    src.write_bytes(st_bytes({n: np.array([-1.5, 0.5], np.float32) for n in names}))
    for command in ("global-norm", "inspect"):
        out = CliRunner().invoke(app, [command, str(src), "--format", "csv"]).stdout
        rows = list(csv.DictReader(io.StringIO(out)))
        shown = sorted(r["name"] for r in rows if r["kind"] == "tensor")
        # a text cell gets the prefix whatever follows (a name "-1.5" is text): only number cells are numbers
        assert shown == sorted(['\'=HYPERLINK("http://x")', "'+1+2", "'-cmd", "'@SUM(A1)", "'-1.5", "ok"])
    # numbers are numbers: a cosine of -1 stays -1.0
    b = tmp_path / "neg.safetensors"
    b.write_bytes(st_bytes({n: np.array([1.5, -0.5], np.float32) for n in names}))
    out = CliRunner().invoke(app, ["diff", str(src), str(b), "--format", "csv"]).stdout
    rows = list(csv.DictReader(io.StringIO(out)))
    assert {r["cosine"] for r in rows} == {"-1.0"}
    assert sorted(r["name"] for r in rows if r["kind"] == "tensor")[0] == "'+1+2"


def test_a_path_starting_with_a_dash_is_shown_as_typed(grads, tmp_path, monkeypatch):
    # issue 22 item 25: `./-x.safetensors` was echoed as `-x.safetensors`, which a command line takes for an option
    monkeypatch.chdir(tmp_path)
    shutil.copy(grads, tmp_path / "-x.safetensors")
    done = clipcli("global-norm", "./-x.safetensors")
    assert done.stdout.startswith("./-x.safetensors: global norm ")
    assert json.loads(clipcli("inspect", "./-x.safetensors", "--format", "json").stdout)["checkpoints"][0]["path"] == (
        "./-x.safetensors"
    )
    gate = clipcli("global-norm", "./-x.safetensors", "--fail-above", "1", "-q")
    assert gate.returncode == 1 and one_error_line(gate.stderr).startswith("clipcli: error: ./-x.safetensors: ")
    diff = clipcli("diff", "./-x.safetensors", grads)
    assert diff.stdout.startswith(f"./-x.safetensors -> {grads}: ")


def test_show_completion_without_a_shell_to_find_uses_shell_or_says_what_to_name(monkeypatch):
    # found running the suite from a detached job: no shell among the parents gave "Shell  not supported." (1)
    import typer._completion_shared as shared

    from tests.helpers import ENV, run

    monkeypatch.setattr(shared, "_get_shell_name", lambda: None)
    fish = run("--show-completion", env={**ENV, "SHELL": "/usr/bin/fish"})
    assert fish.exit_code == 0 and fish.stdout.startswith("complete --command clipcli")
    none = run("--show-completion", env={**{k: v for k, v in ENV.items() if k != "SHELL"}, "SHELL": ""})
    assert none.exit_code == 2 and "cannot tell the current shell; name one: bash, zsh" in none.output
