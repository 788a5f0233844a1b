"""Tensors copied unchanged into an ordered output (`.pt`, `.npz`, `.npy`) by the kernel (`checkpoint.copy`): the
same bytes as read and written, the CRC-32s zipfile checks, every fallback, and a short input refused."""

from __future__ import annotations

import errno
import os
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest

from clipcli.checkpoint import copy as _copy
from clipcli.checkpoint import open_checkpoint, unchanged_range
from tests.checkpoint.test_faults import leftovers
from tests.checkpoint.test_torch_write import _read_all, _torch_load
from tests.helpers import ok, run, write_st


@pytest.fixture
def source(tmp_path) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    arrays = {
        "big": rng.standard_normal((513, 1031)).astype(np.float32),  # 2.1 MB: copied
        "small": rng.standard_normal(100).astype(np.float32),  # read with the others
        "ints": np.arange(300_001, dtype=np.int64),  # 2.4 MB
        "wide": rng.standard_normal(200_003),  # float64, 1.6 MB
    }
    return write_st(tmp_path / "in.safetensors", arrays), arrays


def _copied(monkeypatch) -> list[tuple[int, int]]:
    """The kernel copies made from now on: (bytes asked, bytes copied)."""
    calls: list[tuple[int, int]] = []
    real = os.copy_file_range

    def spy(src, dst, count, offset_src=None, offset_dst=None):
        n = real(src, dst, count, offset_src, offset_dst)
        calls.append((count, n))
        return n

    monkeypatch.setattr(os, "copy_file_range", spy)
    return calls


def _values(path: Path) -> dict[str, bytes]:
    if path.suffix == ".pt":
        return {k: v.tobytes() for k, v in _read_all(path).items()}
    if path.suffix == ".npz":
        with np.load(path) as z:
            return {k: z[k].tobytes() for k in z.files}
    with open_checkpoint(path) as ckpt:
        return {t.name: ckpt.read(t).tobytes() for t in ckpt.tensors}


@pytest.mark.parametrize("suffix", [".pt", ".npz"])
def test_large_tensors_are_copied_by_the_kernel_and_come_out_the_same(tmp_path, monkeypatch, source, suffix):
    src, arrays = source
    calls = _copied(monkeypatch)
    out = tmp_path / f"out{suffix}"
    ok("convert", src, "-o", out)
    assert _values(out) == {k: a.tobytes() for k, a in arrays.items()}
    with zipfile.ZipFile(out) as z:
        assert z.testzip() is None  # every record's CRC-32 (for .pt computed from the input while it was copied)
    if suffix == ".pt":
        assert sum(n for _, n in calls) == sum(a.nbytes for k, a in arrays.items() if k != "small")
        assert _torch_load(out, arrays) in (None, "ok")
    else:
        assert calls == []  # a zip member's stream has no file: read and written


def test_a_clip_copies_what_it_does_not_change(tmp_path, monkeypatch, source):
    src, arrays = source
    calls = _copied(monkeypatch)
    out = tmp_path / "out.pt"
    ok("clip-value", src, "-o", out, "--min", "-0.5", "--max", "0.5")
    assert sum(n for _, n in calls) == arrays["ints"].nbytes  # the integers pass through; the floats are clipped
    got = _read_all(out)
    assert got["ints"].tobytes() == arrays["ints"].tobytes()
    np.testing.assert_array_equal(got["big"], np.clip(arrays["big"], np.float32(-0.5), np.float32(0.5)))


@pytest.mark.parametrize("failure", [errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, "short"])
def test_where_the_kernel_copies_part_or_nothing_the_rest_is_read_and_written(tmp_path, monkeypatch, source, failure):
    src, arrays = source
    real = os.copy_file_range
    calls = []

    def partial(src_fd, dst, count, offset_src=None, offset_dst=None):
        calls.append(count)
        if failure == "short":  # a kernel that copies a little at a time
            return real(src_fd, dst, min(count, 12345), offset_src, offset_dst)
        if len(calls) > 1:  # the first copy goes through, then the file system refuses
            raise OSError(failure, os.strerror(failure))
        return real(src_fd, dst, min(count, 1 << 20), offset_src, offset_dst)

    monkeypatch.setattr(os, "copy_file_range", partial)
    out = tmp_path / "out.pt"
    ok("convert", src, "-o", out)
    assert _values(out) == {k: a.tobytes() for k, a in arrays.items()}
    with zipfile.ZipFile(out) as z:
        assert z.testzip() is None
    assert len(calls) > 1


def test_an_input_cut_short_while_copied_is_refused_and_nothing_is_written(tmp_path, monkeypatch, source):
    src, _ = source
    with open_checkpoint(src) as ckpt:
        first = next(t.name for t in ckpt.tensors if t.nbytes >= _copy.MIN_BYTES)  # the first copied
    real = os.copy_file_range

    def cut(src_fd, dst, count, offset_src=None, offset_dst=None):
        os.truncate(src, offset_src + 1000)  # another program shortens the input between header and data
        return real(src_fd, dst, count, offset_src, offset_dst)

    monkeypatch.setattr(os, "copy_file_range", cut)
    out = tmp_path / "out.pt"
    done = run("convert", src, "-o", out)
    assert done.exit_code == 3
    assert done.stderr == f"clipcli: error: {src}: tensor {first}: the file ends before the tensor's data does\n"
    assert not out.exists() and leftovers(tmp_path) == []


def test_only_tensors_stored_as_an_output_holds_them_are_copied(tmp_path):
    big = np.arange(300_000, dtype=np.float64)
    path = tmp_path / "f.npy"
    np.save(path, np.asfortranarray(big.reshape(600, 500)))  # Fortran order: transposed on the way, never copied
    np.save(tmp_path / "be.npy", big.astype(">f8"))  # big-endian: swapped on the way
    np.save(tmp_path / "c.npy", big)
    np.save(tmp_path / "tiny.npy", big[:10])
    with (
        open_checkpoint(path) as f,
        open_checkpoint(tmp_path / "be.npy") as be,
        open_checkpoint(tmp_path / "c.npy") as c,
        open_checkpoint(tmp_path / "tiny.npy") as tiny,
    ):
        assert unchanged_range(f.store, f.tensors[0]) is None
        assert unchanged_range(be.store, be.tensors[0]) is None
        assert unchanged_range(tiny.store, tiny.tensors[0]) is None
        r = unchanged_range(c.store, c.tensors[0])
        assert r is not None and (r.offset, r.nbytes) == (128, big.nbytes)
        assert r.crc() == zlib.crc32(big.tobytes()) and r.crc(12345) == zlib.crc32(big.tobytes(), 12345)
    assert big[:10].nbytes < _copy.MIN_BYTES
