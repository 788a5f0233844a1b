"""Faults: the exit-status contract through real processes, kill -9, a full disk, read-only targets, Ctrl-C."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from typer.testing import CliRunner

from clipcli.checkpoint import open_checkpoint
from clipcli.cli import app
from tests.helpers import ROOT, digest, st_bytes

ENV = {**os.environ, "NO_COLOR": "1", "COLUMNS": "100"}


def clipcli(*args: object, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "clipcli", *map(str, args)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=timeout,
        check=False,
    )


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    grads = tmp_path / "grads.safetensors"
    shutil.copy(ROOT / "samples" / "grads.safetensors", grads)
    nan = tmp_path / "nan.safetensors"
    nan.write_bytes(st_bytes({"ok": np.ones(2, np.float32), "w": np.array([1.0, np.nan], np.float32)}))
    lfs = tmp_path / "lfs.safetensors"
    lfs.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 1\n")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(grads.read_bytes()[:1000])
    (tmp_path / "adir.safetensors").mkdir()
    return {
        "grads": grads,
        "nan": nan,
        "lfs": lfs,
        "cut": cut,
        "out": tmp_path / "out.safetensors",
        "npz": tmp_path / "out.npz",
        "missing": tmp_path / "missing.npz",
        "adir": tmp_path / "adir.safetensors",
    }


# Every row of the spec's exit-status table (1, 2, 3, 4), with the exact last line of stderr.
SCENARIOS = [
    ("success", ["global-norm", "{grads}", "--quiet"], 0, None),
    (
        "gradients exploded",
        ["global-norm", "{grads}", "--fail-above", "100", "--quiet"],
        1,
        "clipcli: error: {grads}: global norm {g} exceeds --fail-above 100",
    ),
    (
        "a NaN with --fail-nonfinite",
        ["global-norm", "{nan}", "--fail-nonfinite", "--quiet"],
        1,
        "clipcli: error: {nan}: tensor w: holds 1 NaN value",
    ),
    (
        "a norm not finite with --fail-above",
        ["global-norm", "{nan}", "--fail-above", "1e9", "--quiet"],
        1,
        "clipcli: error: {nan}: global norm is nan, not finite (--fail-above 1e9)",
    ),
    (
        "a clip of non-finite data",
        ["clip-global-norm", "{nan}", "-o", "{out}", "--clip-norm", "1"],
        1,
        "clipcli: error: {nan}: tensor w: holds 1 NaN value",
    ),
    (
        "a bad value",
        ["clip-norm", "{grads}", "-o", "{out}", "--clip-norm", "-1"],
        2,
        "Error: Invalid value for --clip-norm: must be a finite number > 0, got -1",
    ),
    (
        "min above max",
        ["clip-value", "{grads}", "-o", "{out}", "--min", "2", "--max", "1"],
        2,
        "Error: Invalid value for --min: --min 2 exceeds --max 1",
    ),
    (
        "an unknown option",
        ["global-norm", "{grads}", "--frobnicate"],
        2,
        "Error: No such option: --frobnicate (Possible options: --format)",
    ),
    ("a missing file", ["inspect", "{missing}"], 3, "clipcli: error: {missing}: no such file or directory"),
    (
        "a Git LFS pointer",
        ["global-norm", "{lfs}"],
        3,
        "clipcli: error: {lfs}: not a safetensors file: a Git LFS "
        "pointer, not the checkpoint itself (run `git lfs pull`)",
    ),
    (
        "a truncated file",
        ["clip-global-norm", "{cut}", "-o", "{out}", "--clip-norm", "1"],
        3,
        "clipcli: error: {cut}: header length 1744 runs past the end of the file (1000 bytes)",
    ),
    (
        "a lossy conversion",
        ["clip-value", "{grads}", "-o", "{npz}", "--min", "0", "--max", "1"],
        3,
        "clipcli: error: {npz}: tensor model.embed_tokens.weight: cannot write bfloat16 to .npy/.npz without "
        "losing it (NumPy has no portable type for it); write .safetensors instead",
    ),
    (
        "an overwrite of the input",
        ["clip-norm", "{grads}", "-o", "{grads}", "--clip-norm", "1"],
        4,
        "clipcli: error: {grads}: refusing to overwrite the input (use --in-place to replace it)",
    ),
    (
        "a directory in the way",
        ["clip-norm", "{grads}", "-o", "{adir}", "--clip-norm", "1"],
        4,
        "clipcli: error: {adir}: is a directory",
    ),
]


@pytest.mark.parametrize(("name", "args", "status", "line"), SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_exit_status_contract(files, name, args, status, line):
    report = json.loads(clipcli("global-norm", files["grads"], "--format", "json").stdout)
    g = repr(report["checkpoints"][0]["global_norm"])
    before = {k: digest(p) for k, p in files.items() if p.is_file()}
    done = clipcli(*(a.format(**files) for a in args))
    assert done.returncode == status, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    if line is None:
        assert done.stderr == ""
    else:
        assert done.stderr.rstrip("\n").splitlines()[-1] == line.format(**files, g=g)
        if status != 2:
            assert done.stderr.count("\n") == 1
    assert {k: digest(p) for k, p in files.items() if k in before} == before  # no input touched
    if status:
        assert not files["out"].exists() and not files["npz"].exists()
    assert leftovers(files["grads"].parent) == []


def test_internal_error_is_70_with_one_line(files):
    code = (
        "import sys, clipcli.commands.global_norm as c\n"
        "def boom(*a, **k): raise RuntimeError('boom')\n"
        "c.norm_report = boom\n"
        "from clipcli.cli import main\n"
        "main(sys.argv[1:])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "global-norm", str(files["grads"])],
        capture_output=True,
        text=True,
        env=ENV,
        check=False,
    )
    assert done.returncode == 70
    assert done.stderr.startswith("clipcli: error: internal error (RuntimeError: boom); this is a bug, please report")
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    """A 96 MiB checkpoint: long enough to interrupt in the middle of a clip."""
    path = tmp_path_factory.mktemp("big") / "big.safetensors"
    rng = np.random.default_rng(3)
    block = rng.standard_normal(1 << 20).astype(np.float32)
    tensors = {f"layers.{i}.w": np.resize(block, (1024, 1024)) * (i + 1) for i in range(20)}
    tensors["layers.b"] = np.resize(block, 1 << 22).astype(ml_dtypes.bfloat16)
    path.write_bytes(st_bytes(tensors))
    return path


def _written(directory: Path) -> int | None:
    """The bytes written so far into the clip's temporary file in `directory`, or None while there is none. The
    writer makes it at its full size at once (sparse), so what counts is the room its data takes on disk."""
    names = leftovers(directory)
    if not names:
        return None
    try:
        return os.stat(directory / names[0]).st_blocks * 512
    except FileNotFoundError:  # renamed over the target meanwhile
        return None


def test_sigkill_leaves_old_bytes_or_a_complete_file(big, tmp_path):
    # it once failed on a loaded machine: kills timed by sleeps (fractions of a clip's duration) landed after the
    # clip had finished; now each kill waits for a state of the write it can see: how much of the file is written
    expected = tmp_path / "expected.safetensors"
    assert clipcli("clip-global-norm", big, "-o", expected, "--clip-norm", "1", "--quiet").returncode == 0
    total = expected.stat().st_size
    out = tmp_path / "out.safetensors"
    old = b"old bytes that must survive"
    source = digest(big)
    command = [sys.executable, "-m", "clipcli", "clip-global-norm", str(big), "-o", str(out), "--clip-norm", "1"]
    interrupted = 0
    # None: at start-up, before anything is written; then when that share of the output is written
    for share in (None, 0.0, 0.1, 0.3, 0.5, 0.7, 0.9):
        for _ in range(5):  # a write that outran the watch (the machine busy) is tried again
            out.write_bytes(old)
            proc = subprocess.Popen([*command, "--quiet"], env=ENV)
            deadline = time.monotonic() + 120
            while share is not None and proc.poll() is None and time.monotonic() < deadline:
                written = _written(tmp_path)
                if written is not None and written >= share * total:
                    break
                time.sleep(0.001)
            midway = share is not None and proc.poll() is None and _written(tmp_path) is not None
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            content = out.read_bytes()
            assert content == old or content == expected.read_bytes(), share
            assert digest(big) == source
            for name in leftovers(tmp_path):  # a killed process cannot clean up; its file is only a temporary
                (tmp_path / name).unlink()
            if share is None or midway:
                break
        interrupted += midway
    assert interrupted >= 5  # most kills landed in the middle of the write
    # and one left alone: the complete file
    out.write_bytes(old)
    assert clipcli(*command[3:], "--quiet").returncode == 0 and out.read_bytes() == expected.read_bytes()


@pytest.mark.parametrize(
    ("sig", "status", "line"),
    [(signal.SIGINT, 130, "clipcli: interrupted\n"), (signal.SIGTERM, 143, "clipcli: terminated\n")],
)
def test_sigint_and_sigterm_exit_and_remove_the_temporary_file(big, tmp_path, sig, status, line):
    out = tmp_path / "out.safetensors"
    for _ in range(5):  # on a loaded machine the clip may reach its commit before the signal: then again
        out.write_bytes(b"old")
        proc = subprocess.Popen(
            [sys.executable, "-m", "clipcli", "clip-global-norm", big, "-o", out, "--clip-norm", "1", "--quiet"],
            env=ENV,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 60
        while not leftovers(tmp_path) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)  # wait until the write has started
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=60)
        if proc.returncode == 0:  # committed before the signal came: dropped, the write complete
            assert stderr == "" and out.read_bytes() != b"old" and leftovers(tmp_path) == []
            continue
        assert proc.returncode == -sig  # ends by the signal (issue 22 item 16): a shell sees 128 + sig = `status`
        assert 128 + sig == status
        assert stderr == line
        assert out.read_bytes() == b"old"
        assert leftovers(tmp_path) == []
        return
    pytest.fail("the clip finished before it could be interrupted, five times")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_just_as_the_temporary_file_is_created_removes_it(tmp_path, monkeypatch, sig):
    # found by the test above on a loaded machine: a stop between mkstemp and the `try` that removes the
    # file (here: as mkstemp returns) left `.out.safetensors.*.tmp` behind. Now deferred until that `try`.
    import tempfile

    from clipcli import _stops
    from clipcli.checkpoint.atomic import atomic_write
    from clipcli.errors import Terminated

    real_mkstemp = tempfile.mkstemp

    def mkstemp_then_stop(*args, **kwargs):
        created = real_mkstemp(*args, **kwargs)
        os.kill(os.getpid(), sig)  # raised at once, unless deferred
        return created

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp_then_stop)
    monkeypatch.setattr(_stops, "_received", [])
    monkeypatch.setattr(_stops, "_committing", [False])
    previous = {s: signal.signal(s, _stops.stop) for s in (signal.SIGINT, signal.SIGTERM)}
    target = tmp_path / "out.safetensors"
    target.write_bytes(b"old")
    try:
        with pytest.raises(KeyboardInterrupt if sig == signal.SIGINT else Terminated), atomic_write(target) as f:
            f.write(b"new")
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.safetensors"]
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(("name", "status", "line"), [("SIGINT", 130, "interrupted"), ("SIGTERM", 143, "terminated")])
def test_a_stop_whose_exception_is_swallowed_still_commits_nothing(files, tmp_path, name, status, line):
    """Python swallows an exception raised in an at-fork hook or a __del__; the stop must hold all the same."""
    code = (
        "import os, signal, sys\n"
        "from clipcli import _stops\n"
        "real = os.fchmod\n"
        "def fchmod(fd, mode):  # on the way to the commit\n"
        "    try:\n"
        f"        _stops.stop(signal.{name})  # the signal's exception, raised where it is swallowed\n"
        "    except BaseException:\n"
        "        pass\n"
        "    real(fd, mode)\n"
        "os.fchmod = fchmod\n"
        "from clipcli.cli import main\n"
        "main(sys.argv[1:])\n"
    )
    out = tmp_path / "out.safetensors"
    before = digest(files["grads"])
    done = subprocess.run(
        [sys.executable, "-c", code, "clip-global-norm", str(files["grads"]), "-o", str(out), "--clip-norm", "1"],
        capture_output=True,
        text=True,
        env=ENV,
        check=False,
    )
    assert done.returncode == 128 - status  # ends by the signal (issue 22 item 16): a shell sees `status`
    assert done.stderr == f"clipcli: {line}\n"
    assert not out.exists() and leftovers(tmp_path) == [] and digest(files["grads"]) == before


@contextlib.contextmanager
def mounted_tmpfs(path: Path, options: str):
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, check=False)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); the simulated test covers it")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def test_full_disk_exits_4_and_leaves_nothing(files, tmp_path):
    with mounted_tmpfs(tmp_path / "small", "size=64k") as small:
        out = small / "out.safetensors"
        done = clipcli("clip-global-norm", files["grads"], "-o", out, "--clip-norm", "1")
        assert done.returncode == 4
        assert done.stderr == f"clipcli: error: {out}: No space left on device\n"
        assert list(small.iterdir()) == []


def test_read_only_target_exits_4(files, tmp_path):
    with mounted_tmpfs(tmp_path / "ro", "ro,size=64k") as ro:
        out = ro / "out.safetensors"
        done = clipcli("clip-global-norm", files["grads"], "-o", out, "--clip-norm", "1")
        assert done.returncode == 4
        assert done.stderr == f"clipcli: error: {out}: cannot create a file in {ro}: Read-only file system\n"


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_simulated_full_disk(files, tmp_path, monkeypatch, suffix):
    from clipcli.checkpoint import write as checkpoint
    from clipcli.checkpoint.formats import npz as _npz

    written = []

    def full(*args):
        written.append(args)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    # workers write a .safetensors in place (pwrite); an .npz is written in order (write_data)
    monkeypatch.setattr(checkpoint.os, "pwrite", full)
    monkeypatch.setattr(_npz, "write_data", full)
    source = ROOT / "samples" / "grads.npz" if suffix == ".npz" else files["grads"]
    out = tmp_path / f"full{suffix}"
    result = CliRunner().invoke(
        app, ["clip-norm", str(source), "-o", str(out), "--clip-norm", "1"], env={"NO_COLOR": "1"}
    )
    assert written
    assert result.exit_code == 4
    assert result.stderr == f"clipcli: error: {out}: No space left on device\n"
    assert not out.exists() and leftovers(tmp_path) == []


def test_unwritable_directory_simulated(files, tmp_path, monkeypatch):
    import tempfile

    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    result = CliRunner().invoke(
        app, ["clip-norm", str(files["grads"]), "-o", str(files["out"]), "--clip-norm", "1"], env={"NO_COLOR": "1"}
    )
    assert result.exit_code == 4
    assert result.stderr == f"clipcli: error: {files['out']}: cannot create a file in {tmp_path}: Permission denied\n"


def test_symlinked_output_and_in_place(files, tmp_path):
    target = tmp_path / "real.safetensors"
    target.write_bytes(b"old")
    link = tmp_path / "link.safetensors"
    link.symlink_to(target.name)
    assert clipcli("clip-global-norm", files["grads"], "-o", link, "--clip-norm", "1", "--quiet").returncode == 0
    assert link.is_symlink() and target.read_bytes() != b"old"
    clipped = target.read_bytes()
    # --in-place through a link replaces the file it points to; the link stays a link.
    alias = tmp_path / "alias.safetensors"
    alias.symlink_to(target.name)
    assert clipcli("clip-global-norm", alias, "--in-place", "--clip-norm", "0.5", "--quiet").returncode == 0
    assert alias.is_symlink() and target.read_bytes() != clipped
    # An output that is a link to the input is the input: refused.
    done = clipcli("clip-global-norm", target, "-o", alias, "--clip-norm", "0.1")
    assert done.returncode == 4 and "refusing to overwrite the input" in done.stderr


# found in review: a FIFO or a device as the output was replaced by a regular file, exit 0 (as root, `--report
# /dev/null` would have replaced /dev/null); `cp` writes into them, and so does clipcli now
@pytest.mark.parametrize("suffix", [".safetensors", ".npz", ".pt", ".json"])
def test_a_fifo_output_is_written_into_not_replaced(files, tmp_path, suffix):
    import stat
    import threading

    fifo, regular = tmp_path / f"fifo{suffix}", tmp_path / f"regular{suffix}"
    os.mkfifo(fifo)
    got: dict[str, bytes] = {}
    reader = threading.Thread(target=lambda: got.setdefault("bytes", fifo.read_bytes()), daemon=True)
    reader.start()
    source = ROOT / "samples" / "grads.npz"  # (float32 alone: every format holds it)
    for out in (fifo, regular):
        if suffix == ".json":
            args = ["clip-global-norm", source, "--dry-run", "--clip-norm", "1", "--report", out, "-q"]
        else:
            args = ["convert", source, "-o", out, "-q"]
        done = clipcli(*args)
        assert done.returncode == 0, done.stderr
    reader.join(30)
    assert stat.S_ISFIFO(fifo.lstat().st_mode) and leftovers(tmp_path) == []
    if suffix in (".safetensors", ".json"):
        assert got["bytes"] == regular.read_bytes()
        return
    # a zip into a stream that cannot seek back: each member's sizes after its data (zipfile's data descriptors),
    # the same tensors
    copy = tmp_path / f"copy{suffix}"
    copy.write_bytes(got["bytes"])
    hashes = [json.loads(clipcli("hash", f, "--format", "json").stdout)["checkpoints"][0] for f in (copy, regular)]
    assert hashes[0]["hash"] == hashes[1]["hash"] and len(hashes[0]["tensors"]) == 17  # (grads.npz: 17 tensors)
    if suffix == ".npz":
        with np.load(copy) as a, np.load(regular) as b:
            assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_a_device_output_is_written_into_and_a_full_one_exits_4(files):
    import stat

    if not stat.S_ISCHR(os.stat("/dev/full").st_mode):
        pytest.skip("no /dev/full")
    done = clipcli("clip-global-norm", files["grads"], "--dry-run", "--clip-norm", "1", "--report", "/dev/full", "-q")
    assert done.returncode == 4 and done.stderr == "clipcli: error: /dev/full: No space left on device\n"
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)
    # /dev/stdout on a pipe: a link to what has no path, written into (it was 'cannot create a file in /proc/...')
    done = clipcli("clip-global-norm", files["grads"], "--dry-run", "--clip-norm", "1", "--report", "/dev/stdout", "-q")
    assert done.returncode == 0 and json.loads(done.stdout)["command"] == "clip-global-norm", done.stderr


def test_hundreds_of_shards_are_read_and_written_within_a_small_open_files_limit(tmp_path):
    # Found by a review: every shard stayed open, so 600 shards under `ulimit -n 64` (or a diff of two
    # checkpoints of 130 shards under macOS's 256) failed with "Too many open files".
    rng = np.random.default_rng(5)
    sides = {}
    for side in ("a", "b"):
        directory = tmp_path / side
        directory.mkdir()
        for i in range(150):
            values = rng.standard_normal(3).astype(np.float32)
            (directory / f"model-{i:05d}.safetensors").write_bytes(st_bytes({f"t{i}": values}))
            sides.setdefault(side, []).append(values)
    limit = "import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)); "
    code = limit + "import sys; from clipcli.cli import main; sys.argv[0] = 'clipcli'; main()"
    clipped = tmp_path / "clipped"
    result = subprocess.run(
        [sys.executable, "-c", code, "clip-global-norm", str(tmp_path / "a"), "-o", str(clipped), "--clip-norm", "1"],
        capture_output=True,
        text=True,
    )  # a second review: the 150 output shards were all held open at once
    assert result.returncode == 0, result.stderr
    assert len(list(clipped.glob("*.safetensors"))) == 150
    for args in (["global-norm", tmp_path / "a", "--jobs", "2"], ["diff", tmp_path / "a", tmp_path / "b"]):
        result = subprocess.run(
            [sys.executable, "-c", code, *map(str, args), "--format", "json"], capture_output=True, text=True
        )
        assert result.returncode == 0, result.stderr
        out = json.loads(result.stdout)
        if args[0] == "global-norm":
            want = np.sqrt(sum(float(np.dot(v.astype(np.float64), v.astype(np.float64))) for v in sides["a"]))
            assert out["checkpoints"][0]["global_norm"] == pytest.approx(want, rel=1e-12)
        else:
            d = np.concatenate(sides["a"]).astype(np.float64) - np.concatenate(sides["b"]).astype(np.float64)
            assert out["diff_norm"] == pytest.approx(float(np.sqrt(np.dot(d, d))), rel=1e-12)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_once_the_output_is_committed_does_not_exit_130(files, tmp_path, monkeypatch, sig):
    # found by a review: 6 of 117 interrupted clips exited 130 ("the target untouched") with the output
    # already renamed into place; between two shards' renames a stop would commit some and not others
    from clipcli import _stops, cli

    real_replace = os.replace

    def replace_then_stop(src, dst):
        real_replace(src, dst)
        os.kill(os.getpid(), sig)  # dropped: the output is committed

    monkeypatch.setattr(os, "replace", replace_then_stop)
    monkeypatch.setattr(_stops, "_received", [])
    monkeypatch.setattr(_stops, "_committing", [False])
    out = tmp_path / "out.safetensors"
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as exit_:
            cli.main(["clip-global-norm", str(files["grads"]), "-o", str(out), "--clip-norm", "1", "-q"])
        ignored = signal.getsignal(signal.SIGINT)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    assert ignored is signal.SIG_IGN  # from the commit to the exit
    assert exit_.value.code == 0
    assert _stops._received == []
    with open_checkpoint(out) as ckpt:
        assert len(ckpt.tensors) > 0
    assert leftovers(tmp_path) == []
