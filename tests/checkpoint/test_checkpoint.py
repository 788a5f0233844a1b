"""Checkpoint I/O against the safetensors library and NumPy: round trips, malformed files, memory, shards."""

from __future__ import annotations

import io
import itertools
import json
import math
import os
import stat
import struct
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from clipcli.checkpoint import Checkpoint, open_checkpoint, placed, save
from clipcli.checkpoint.formats import safetensors as _safetensors
from clipcli.core.blocks import BLOCK
from clipcli.core.norms import NormAccumulator
from clipcli.errors import FileTypeError, MalformedError, MissingFileError, UnsupportedError, UsageError, WriteError
from tests.helpers import (
    SAMPLES,
    first_tensor_norm_and_peak,
    fnorm,
    js,
    npy,
    npz_arrays,
    ok,
    raw_safetensors,
    run,
    st_bytes,
    st_read,
)

NUMPY_DATA = Path(np.__file__).parent / "lib" / "tests" / "data"

ST_DTYPES = [
    np.bool_,
    np.uint8,
    np.int8,
    np.uint16,
    np.int16,
    np.uint32,
    np.int32,
    np.uint64,
    np.int64,
    np.float16,
    ml_dtypes.bfloat16,
    np.float32,
    np.float64,
    np.complex64,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
]
NPY_DTYPES = [
    np.bool_,
    np.uint8,
    np.int8,
    np.uint16,
    np.int16,
    np.uint32,
    np.int32,
    np.uint64,
    np.int64,
    np.float16,
    np.float32,
    np.float64,
    np.complex64,
    np.complex128,
]
SHAPES = [(), (0,), (7,), (3, 5), (0, 4), (2, 3, 4), (1000, 37)]


def sample(dtype, shape, seed=0) -> np.ndarray:
    """Values spread over the dtype's bit patterns (NaN and Inf included for floats)."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    if dtype == np.bool_:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def small_chunks(ckpt: Checkpoint):
    return lambda t: ckpt.chunks(t, max_bytes=999)  # forces many chunks, unaligned to the 8-byte items


# --- Round trips ------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", ST_DTYPES, ids=lambda d: np.dtype(d).name)
def test_safetensors_round_trip(tmp_path, dtype, shape):
    a = sample(dtype, shape)
    src = tmp_path / "ref.safetensors"
    src.write_bytes(st_bytes({"x": a, "y": sample(np.float32, (3,), 1)}, {"k": "v"}))
    with open_checkpoint(src) as ckpt:
        infos = {t.name: t for t in ckpt.tensors}
        assert infos["x"].dtype == np.dtype(dtype).name and infos["x"].shape == shape
        assert same_bytes(a, ckpt.read(infos["x"]))
        assert ckpt.metadata == {"k": "v"}
        save(ckpt, tmp_path / "out.safetensors", small_chunks(ckpt))
    assert st_read(tmp_path / "out.safetensors") == st_read(src)
    if np.dtype(dtype) not in (
        np.dtype(ml_dtypes.bfloat16),
        np.dtype(ml_dtypes.float8_e4m3fn),
        np.dtype(ml_dtypes.float8_e5m2),
        np.dtype(np.complex64),
        np.dtype(np.bool_),
    ):
        with safe_open(tmp_path / "out.safetensors", "np") as f:
            assert same_bytes(a, f.get_tensor("x"))
            assert f.metadata() == {"k": "v"}


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", NPY_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("compression", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_npz_round_trip(tmp_path, dtype, shape, compression):
    a = sample(dtype, shape)
    src = tmp_path / "ref.npz"
    (np.savez if compression == zipfile.ZIP_STORED else np.savez_compressed)(src, x=a, y=np.arange(3.0))
    with open_checkpoint(src) as ckpt:
        assert [t.name for t in ckpt.tensors] == ["x", "y"]
        assert same_bytes(a, ckpt.read(ckpt.tensors[0]))
        save(ckpt, tmp_path / "out.npz", small_chunks(ckpt))
    with np.load(tmp_path / "out.npz", allow_pickle=False) as z:
        assert same_bytes(a, z["x"])
        assert same_bytes(np.arange(3.0), z["y"])


@pytest.mark.parametrize("dtype", NPY_DTYPES, ids=lambda d: np.dtype(d).name)
def test_npy_round_trip_is_byte_identical_to_np_save(tmp_path, dtype):
    a = sample(dtype, (4, 6))
    np.save(tmp_path / "t.npy", a)
    with open_checkpoint(tmp_path / "t.npy") as ckpt:
        (t,) = ckpt.tensors
        assert t.name == "t"
        save(ckpt, tmp_path / "out.npy", small_chunks(ckpt))
    assert (tmp_path / "out.npy").read_bytes() == (tmp_path / "t.npy").read_bytes()


@pytest.mark.parametrize(
    "make",
    [
        lambda a: np.asfortranarray(a),
        lambda a: a.astype(a.dtype.newbyteorder(">")),
        lambda a: np.asfortranarray(a.astype(">f8")),
    ],
)
def test_fortran_order_and_big_endian_members(tmp_path, make):
    a = np.arange(24, dtype=np.float64).reshape(4, 6) * 1.5
    np.savez(tmp_path / "f.npz", x=make(a))
    with open_checkpoint(tmp_path / "f.npz") as ckpt:
        np.testing.assert_array_equal(ckpt.read(ckpt.tensors[0]), a)
        assert ckpt.tensors[0].dtype == "float64"
        save(ckpt, tmp_path / "out.safetensors", small_chunks(ckpt))
        save(ckpt, tmp_path / "out.npz", small_chunks(ckpt))
    with safe_open(tmp_path / "out.safetensors", "np") as f:
        np.testing.assert_array_equal(f.get_tensor("x"), a)
    with np.load(tmp_path / "out.npz") as z:
        np.testing.assert_array_equal(z["x"], a)


@pytest.mark.parametrize("method", [zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA, zipfile.ZIP_DEFLATED])
def test_npz_members_compressed_by_any_zipfile_method(tmp_path, method):
    a = np.linspace(0, 1, 100_000, dtype=np.float32)
    buf = io.BytesIO()
    np.lib.format.write_array(buf, a)
    with zipfile.ZipFile(tmp_path / "c.npz", "w", method) as z:
        z.writestr("weights", buf.getvalue())  # a member without the .npy suffix, as NumPy allows
    with open_checkpoint(tmp_path / "c.npz") as ckpt:
        (t,) = ckpt.tensors
        assert t.name == "weights"
        assert same_bytes(a, ckpt.read(t))


def test_npz_output_is_deterministic(tmp_path):
    np.savez(tmp_path / "a.npz", x=np.arange(5.0))
    for name in ("o1.npz", "o2.npz"):
        with open_checkpoint(tmp_path / "a.npz") as ckpt:
            save(ckpt, tmp_path / name, ckpt.chunks)
    assert (tmp_path / "o1.npz").read_bytes() == (tmp_path / "o2.npz").read_bytes()


def test_safetensors_writer_keeps_order_and_metadata(tmp_path):
    tensors = {"z": np.ones(3, np.float32), "a": np.ones(2, np.int64), "m": np.ones(1, ml_dtypes.bfloat16)}
    src = tmp_path / "in.safetensors"
    src.write_bytes(st_bytes(tensors, {"format": "pt"}))
    with open_checkpoint(src) as ckpt:
        order = [t.name for t in ckpt.tensors]
        save(ckpt, tmp_path / "out.safetensors", ckpt.chunks)
    with open_checkpoint(tmp_path / "out.safetensors") as out:
        assert [t.name for t in out.tensors] == order
        assert out.metadata == {"format": "pt"}


def test_newer_dtypes_are_carried_as_bytes(tmp_path):
    # a review found F8_E8M0 carried as bytes here but normed from a .pt: it reads as ml_dtypes' scale type now
    header = {
        "e": {"dtype": "F8_E8M0", "shape": [4], "data_offsets": [0, 4]},
        "f4": {"dtype": "F4", "shape": [2, 4], "data_offsets": [4, 8]},
        "f6": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [8, 11]},
    }
    src = tmp_path / "new.safetensors"
    src.write_bytes(raw_safetensors(header, bytes(range(11))))
    with open_checkpoint(src) as ckpt:
        assert [(t.dtype, t.nbytes, t.array_dtype) for t in ckpt.tensors] == [
            ("float8_e8m0fnu", 4, np.dtype(ml_dtypes.float8_e8m0fnu)),
            ("float4_e2m1fn", 4, None),
            ("float6_e2m3fn", 3, None),
        ]
        save(ckpt, tmp_path / "out.safetensors", ckpt.chunks)
        with pytest.raises(UnsupportedError, match="without losing"):
            save(ckpt, tmp_path / "out.npz", ckpt.chunks)
    assert (tmp_path / "out.safetensors").read_bytes()[-11:] == bytes(range(11))
    assert not (tmp_path / "out.npz").exists()


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2])
def test_lossy_conversion_to_npz_is_refused_before_writing(tmp_path, dtype):
    src = tmp_path / "in.safetensors"
    src.write_bytes(st_bytes({"ok": np.ones(2, np.float32), "x": np.ones(2, dtype)}))
    with open_checkpoint(src) as ckpt, pytest.raises(UnsupportedError) as e:
        save(ckpt, tmp_path / "out.npz", ckpt.chunks)
    assert str(e.value).startswith(f"{tmp_path / 'out.npz'}: tensor x: cannot write {np.dtype(dtype).name} to")
    assert not (tmp_path / "out.npz").exists()


def test_complex128_has_no_safetensors_dtype(tmp_path):
    np.savez(tmp_path / "c.npz", z=np.ones(2, np.complex128))
    with open_checkpoint(tmp_path / "c.npz") as ckpt, pytest.raises(UnsupportedError, match="complex128"):
        save(ckpt, tmp_path / "out.safetensors", ckpt.chunks)


def test_npy_output_needs_exactly_one_tensor(tmp_path):
    np.savez(tmp_path / "two.npz", a=np.ones(2), b=np.ones(2))
    with open_checkpoint(tmp_path / "two.npz") as ckpt, pytest.raises(UnsupportedError, match="one tensor"):
        save(ckpt, tmp_path / "out.npy", ckpt.chunks)


def test_chunks_respect_the_size_bound_and_alignment(tmp_path):
    a = np.arange(10_000, dtype=np.float32).reshape(100, 100)
    np.save(tmp_path / "a.npy", a)
    with open_checkpoint(tmp_path / "a.npy") as ckpt:
        (t,) = ckpt.tensors
        sizes = [c.size for c in ckpt.chunks(t, max_bytes=1000, align=100)]
        assert all(s == 200 for s in sizes[:-1]) and sum(sizes) == 10_000
        assert next(c.size for c in ckpt.chunks(t, max_bytes=10, align=100)) == 100  # at least one row


def test_python2_npy_of_numpys_own_test_data():
    # found on a real file of another project: NumPy's own win64python2.npy (a Python 2 header) was not read
    path = NUMPY_DATA / "win64python2.npy"
    if not path.exists():
        pytest.skip("NumPy's test data is not installed")
    with pytest.warns(UserWarning, match="Python 2"):
        expected = np.load(path)
    (c,) = js("global-norm", path)["checkpoints"]
    assert c["global_norm"] == fnorm([expected])


def test_python2_npy_with_long_integers_in_its_shape(tmp_path):
    # found on real files of other projects: a Python 2 .npy header with long integers (2L, 3L) was not read
    path = tmp_path / "py2.npy"
    data = np.arange(6, dtype="<f8")
    header = "{'descr': '<f8', 'fortran_order': False, 'shape': (2L, 3L), }".ljust(117) + "\n"
    path.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + data.tobytes())
    with pytest.warns(UserWarning, match="Python 2"):
        np.testing.assert_array_equal(np.load(path), data.reshape(2, 3))  # NumPy reads it: so does clipcli
    (t,) = js("inspect", path)["checkpoints"][0]["tensors"]
    assert t["shape"] == [2, 3]


def test_safetensors_header_with_leading_whitespace_is_read_like_the_reference(tmp_path):
    # found trying clipcli as a new user: a safetensors header starting with whitespace was not read as the library does
    data = np.arange(3, dtype=np.float32).tobytes()
    header = b'  \n{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}}'
    path = tmp_path / "space.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)
    with safe_open(path, "np") as f:  # the reference reads it
        expected = f.get_tensor("w")
    (c,) = js("global-norm", path)["checkpoints"]
    assert c["global_norm"] == fnorm([expected])


# --- Writing: atomic, never over the input -----------------------------------------------------------


def test_output_that_is_the_input_is_refused(tmp_path):
    np.savez(tmp_path / "a.npz", x=np.ones(3))
    before = (tmp_path / "a.npz").read_bytes()
    with open_checkpoint(tmp_path / "a.npz") as ckpt, pytest.raises(WriteError, match="refusing to overwrite"):
        save(ckpt, tmp_path / "a.npz", ckpt.chunks)
    os.symlink(tmp_path / "a.npz", tmp_path / "link.npz")
    with open_checkpoint(tmp_path / "a.npz") as ckpt, pytest.raises(WriteError, match="refusing to overwrite"):
        save(ckpt, tmp_path / "link.npz", ckpt.chunks)
    assert (tmp_path / "a.npz").read_bytes() == before


def test_in_place_replaces_atomically_and_keeps_the_mode(tmp_path):
    np.save(tmp_path / "a.npy", np.ones(3))
    os.chmod(tmp_path / "a.npy", 0o640)
    with open_checkpoint(tmp_path / "a.npy") as ckpt:
        save(ckpt, tmp_path / "a.npy", lambda t: [np.full(3, 2.0)], in_place=True)
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), [2, 2, 2])
    assert (os.stat(tmp_path / "a.npy").st_mode & 0o777) == 0o640
    assert sorted(os.listdir(tmp_path)) == ["a.npy"]


def test_new_files_get_the_umask_mode(tmp_path):
    np.save(tmp_path / "a.npy", np.ones(3))
    old = os.umask(0o027)
    try:
        with open_checkpoint(tmp_path / "a.npy") as ckpt:
            save(ckpt, tmp_path / "b.npy", ckpt.chunks)
    finally:
        os.umask(old)
    assert (os.stat(tmp_path / "b.npy").st_mode & 0o777) == 0o640


def test_a_failing_write_leaves_no_file(tmp_path):
    np.save(tmp_path / "a.npy", np.ones(3))

    def broken(t):
        yield np.ones(1)
        raise RuntimeError("boom")

    with open_checkpoint(tmp_path / "a.npy") as ckpt, pytest.raises(RuntimeError):
        save(ckpt, tmp_path / "b.npy", broken)
    assert sorted(os.listdir(tmp_path)) == ["a.npy"]


def test_writing_through_a_symlink_writes_its_target(tmp_path):
    np.save(tmp_path / "a.npy", np.ones(3))
    np.save(tmp_path / "target.npy", np.zeros(1))
    os.symlink("target.npy", tmp_path / "link.npy")
    with open_checkpoint(tmp_path / "a.npy") as ckpt:
        save(ckpt, tmp_path / "link.npy", ckpt.chunks)
    assert os.path.islink(tmp_path / "link.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "target.npy"), [1, 1, 1])


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
    # found on real files of other projects: scipy.sparse.save_npz's text member (and records) was not carried
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
    # found trying clipcli as a new user: an .npz member that is no .npy file was not carried through a clip
    path = tmp_path / "notes.npz"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("readme.txt", b"hello")
        z.writestr("w.npy", npy(np.ones(2, np.float32)))
    out = tmp_path / "o.npz"
    ok("clip-value", path, "-o", out, "--min", "0", "--max", "0.5", "--quiet")
    with zipfile.ZipFile(out) as z:
        assert z.read("readme.txt") == b"hello"
    assert js("inspect", path)["checkpoints"][0]["tensors"][0]["dtype"] == "bytes"


def test_a_non_numeric_member_cannot_go_to_safetensors(mixed_npz, tmp_path):
    # found trying clipcli as a new user: a non-numeric .npz member clipped into safetensors had no one-line refusal
    result = run("clip-value", mixed_npz, "-o", tmp_path / "o.safetensors", "--min", "0", "--max", "1")
    assert result.exit_code == 3 and "tensor format: safetensors has no dtype for U3" in result.stderr
    assert not (tmp_path / "o.safetensors").exists()


def test_clipping_a_compressed_npz_keeps_each_members_compression(tmp_path):
    # found on a real file of another project: clipping Whisper's mel_filters.npz did not keep each member's compression
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


# --- Memory -----------------------------------------------------------------------------------------


def test_reading_a_large_file_keeps_memory_bounded(tmp_path):
    path = tmp_path / "big.safetensors"
    n = 64 * 1024 * 1024  # 256 MiB of float32
    header = raw_safetensors({"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}})
    with open(path, "wb") as f:
        f.write(header)
        block = np.full(1 << 20, 0.5, np.float32).tobytes()
        for _ in range(64):
            f.write(block)
    stats, peak = first_tensor_norm_and_peak(path)
    assert stats.norm == 0.5 * np.sqrt(n)
    assert peak < 32 * 1024 * 1024, peak


# --- Sharded checkpoints ----------------------------------------------------------------------------


def make_sharded(root: Path) -> dict[str, np.ndarray]:
    root.mkdir()
    tensors = {f"layers.{i}.w": np.full((4, 3), i + 1.0, np.float32) for i in range(4)}
    tensors["step"] = np.array(3, np.int64)
    shards = {
        "m-00001-of-00002.safetensors": ["layers.0.w", "layers.1.w"],
        "m-00002-of-00002.safetensors": ["layers.2.w", "layers.3.w", "step"],
    }
    for shard, names in shards.items():
        (root / shard).write_bytes(st_bytes({n: tensors[n] for n in names}, {"format": "pt"}))
    index = {"metadata": {"total_size": 0}, "weight_map": {n: s for s, ns in shards.items() for n in ns}}
    (root / "m.safetensors.index.json").write_text(json.dumps(index))
    return tensors


@pytest.mark.parametrize("how", ["index", "directory"])
def test_sharded_checkpoint_reads_as_one_and_writes_back_the_layout(tmp_path, how):
    tensors = make_sharded(tmp_path / "in")
    src = tmp_path / "in" / "m.safetensors.index.json" if how == "index" else tmp_path / "in"
    with open_checkpoint(src) as ckpt:
        assert ckpt.format == "sharded"
        assert sorted(t.name for t in ckpt.tensors) == sorted(tensors)
        for t in ckpt.tensors:
            assert same_bytes(tensors[t.name], ckpt.read(t))
        written = save(ckpt, tmp_path / "out", ckpt.chunks)
    assert [p.name for p in written] == [
        "m-00001-of-00002.safetensors",
        "m-00002-of-00002.safetensors",
        "m.safetensors.index.json",
    ]
    for shard in ("m-00001-of-00002.safetensors", "m-00002-of-00002.safetensors"):
        assert st_read(tmp_path / "out" / shard) == st_read(tmp_path / "in" / shard)
    index = json.loads((tmp_path / "out" / "m.safetensors.index.json").read_text())
    assert index["weight_map"] == json.loads((tmp_path / "in" / "m.safetensors.index.json").read_text())["weight_map"]
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in tensors.values())


def test_sharded_checkpoint_merges_into_one_file(tmp_path):
    tensors = make_sharded(tmp_path / "in")
    with open_checkpoint(tmp_path / "in") as ckpt:
        save(ckpt, tmp_path / "merged.safetensors", ckpt.chunks)
    with safe_open(tmp_path / "merged.safetensors", "np") as f:
        got = {k: f.get_tensor(k).tobytes() for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    assert got == {k: v.tobytes() for k, v in tensors.items()}


def test_shards_without_an_index(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.safetensors").write_bytes(st_bytes({"x": np.ones(2, np.float32)}))
    (tmp_path / "d" / "b.safetensors").write_bytes(st_bytes({"y": np.ones(3, np.float32)}))
    with open_checkpoint(tmp_path / "d") as ckpt:
        assert [t.name for t in ckpt.tensors] == ["x", "y"]
        assert [p.name for p in save(ckpt, tmp_path / "o", ckpt.chunks)] == ["a.safetensors", "b.safetensors"]


def test_directory_output_needs_a_sharded_input(tmp_path):
    np.save(tmp_path / "a.npy", np.ones(2))
    with open_checkpoint(tmp_path / "a.npy") as ckpt, pytest.raises(UsageError, match="sharded input"):
        save(ckpt, tmp_path / "outdir", ckpt.chunks)


# --- Malformed and mistaken files --------------------------------------------------------------------

GOOD_HEADER = {
    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
    "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
}


def st_case(header=None, data=bytes(12), length=None, raw=None):
    return raw if raw is not None else raw_safetensors(GOOD_HEADER if header is None else header, data, length)


def npy_bytes(a) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def npy_with_header(text: str, data: bytes = b"", version=(1, 0)) -> bytes:
    body = text.encode("latin1")
    size = struct.pack("<H" if version[0] == 1 else "<I", len(body))
    return b"\x93NUMPY" + bytes(version) + size + body + data


def zip_bytes(members: dict[str, bytes], method=zipfile.ZIP_STORED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", method) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


def with_entry(name, **changes):
    header = json.loads(json.dumps(GOOD_HEADER))
    header[name].update(changes)
    return header


def flip_last_data_byte(zipped: bytes) -> bytes:
    b = bytearray(zipped)
    central = b.rfind(b"PK\x01\x02")
    b[central - 1] ^= 0xFF  # the last byte of the stored member's data
    return bytes(b)


def encrypted(zipped: bytes) -> bytes:
    """The archive with the 'encrypted' flag set on its member, in both the local and central headers."""
    b = bytearray(zipped)
    b[6] |= 1
    central = b.rfind(b"PK\x01\x02")
    b[central + 8] |= 1
    return bytes(b)


def lzma_dictionary(zipped: bytes, size: int) -> bytes:
    """The archive with its LZMA member's dictionary size field rewritten."""
    b = bytearray(zipped)
    name_len, extra_len = struct.unpack("<HH", b[26:30])
    at = 30 + name_len + extra_len + 5
    b[at : at + 4] = struct.pack("<I", min(size, 2**32 - 1))
    return bytes(b)


DUPLICATE = (
    b'{"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}'
)
SURROGATE_NAME = b'{"\\ud800":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}}'
SURROGATE_NAME = struct.pack("<Q", len(SURROGATE_NAME)) + SURROGATE_NAME
SURROGATE_METADATA = b'{"__metadata__":{"k":"\\udc80"},"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}}'
SURROGATE_METADATA = struct.pack("<Q", len(SURROGATE_METADATA)) + SURROGATE_METADATA
# an object array whose pickle ends before its STOP: malformed (a whole pickle is audited and carried as bytes)
OBJECT_NPY = npy_with_header("{'descr': '|O', 'fortran_order': False, 'shape': (1,), }", b"\x80\x04N")
MALFORMED = {
    # safetensors: the header
    "empty.safetensors": (b"", FileTypeError, "not a safetensors file: an empty file"),
    "short.safetensors": (b"\x05\x00\x00", MalformedError, "only 3 bytes, too short for a safetensors header"),
    "huge-header.safetensors": (st_case(length=100_000_001), MalformedError, "exceeds the limit of 100000000"),
    "header-past-end.safetensors": (st_case(length=5000), MalformedError, "runs past the end of the file"),
    "not-an-object.safetensors": (st_case(raw=struct.pack("<Q", 2) + b"[]"), MalformedError, "does not start with"),
    "bad-utf8.safetensors": (struct.pack("<Q", 4) + b'{"\xff}', MalformedError, "not valid UTF-8 JSON"),
    "bad-json.safetensors": (struct.pack("<Q", 9) + b'{"a": 1,,', MalformedError, "not valid UTF-8 JSON"),
    "deep-json.safetensors": (
        struct.pack("<Q", 200_001) + b"{" + b'"a":' * 0 + b"[" * 200_000,
        MalformedError,
        "not valid UTF-8 JSON",
    ),
    "entry-not-object.safetensors": (st_case({"a": 1}, b""), MalformedError, "tensor a: the tensor's entry"),
    "unknown-dtype.safetensors": (st_case(with_entry("a", dtype="F128")), UnsupportedError, "unknown dtype 'F128'"),
    "lowercase-dtype.safetensors": (st_case(with_entry("a", dtype="f32")), UnsupportedError, "unknown dtype 'f32'"),
    "missing-dtype.safetensors": (
        st_case({"a": {"shape": [2], "data_offsets": [0, 8]}}, bytes(8)),
        MalformedError,
        "missing or non-string 'dtype'",
    ),
    "negative-shape.safetensors": (st_case(with_entry("a", shape=[-2])), MalformedError, "'shape' must be a list"),
    "float-shape.safetensors": (st_case(with_entry("a", shape=[2.0])), MalformedError, "'shape' must be a list"),
    "shape-not-list.safetensors": (st_case(with_entry("a", shape=2)), MalformedError, "'shape' must be a list"),
    "three-offsets.safetensors": (
        st_case(with_entry("a", data_offsets=[0, 4, 8])),
        MalformedError,
        "'data_offsets' must be two",
    ),
    "reversed-offsets.safetensors": (
        st_case(with_entry("a", data_offsets=[8, 0])),
        MalformedError,
        "end before they begin",
    ),
    "size-mismatch.safetensors": (st_case(with_entry("a", shape=[3])), MalformedError, "needs 12 bytes"),
    "terabyte-claim.safetensors": (
        st_case(with_entry("a", shape=[1 << 38])),
        MalformedError,
        "needs 1099511627776 bytes",
    ),
    "not-from-zero.safetensors": (
        st_case({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8)),
        MalformedError,
        "data offsets 4..8: the first tensor's data must start at 0",
    ),
    "gap.safetensors": (
        st_case(with_entry("b", data_offsets=[9, 13]), bytes(13)),
        MalformedError,
        "tensor b: data offsets 9..13 are not contiguous",
    ),
    "overlap.safetensors": (
        st_case(with_entry("b", data_offsets=[4, 8]), bytes(8)),
        MalformedError,
        "are not contiguous",
    ),
    "trailing-bytes.safetensors": (st_case(data=bytes(13)), MalformedError, "holds 13 bytes of data"),
    "truncated-data.safetensors": (st_case(data=bytes(11)), MalformedError, "holds 11 bytes of data"),
    "out-of-range.safetensors": (
        st_case(with_entry("b", shape=[1000], data_offsets=[8, 4008])),
        MalformedError,
        "holds 12 bytes of data",
    ),
    "duplicate-key.safetensors": (struct.pack("<Q", len(DUPLICATE)) + DUPLICATE, MalformedError, "duplicate key 'a'"),
    "metadata-not-strings.safetensors": (
        st_case({**GOOD_HEADER, "__metadata__": {"k": 1}}),
        MalformedError,
        "__metadata__ must map strings to strings",
    ),
    # what is not an object is refused, even when Python would take it for an empty one
    **{
        f"metadata-{kind}.safetensors": (
            st_case({**GOOD_HEADER, "__metadata__": value}),
            MalformedError,
            "__metadata__ must map strings to strings",
        )
        for kind, value in (("empty-string", ""), ("zero", 0), ("false", False), ("empty-list", []))
    },
    # a lone surrogate escaped in JSON is no text: nothing could print or write it
    "surrogate-name.safetensors": (
        st_case(raw=SURROGATE_NAME + bytes(12)),
        MalformedError,
        "tensor \\ud800: the tensor's name holds a lone surrogate",
    ),
    "surrogate-metadata.safetensors": (
        st_case(raw=SURROGATE_METADATA + bytes(12)),
        MalformedError,
        "metadata 'k' holds a lone surrogate",
    ),
    # safetensors: the wrong kind of file
    "lfs.safetensors": (
        b"version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 123\n",
        FileTypeError,
        "a Git LFS pointer, not the checkpoint itself (run `git lfs pull`)",
    ),
    "html.safetensors": (b"<!DOCTYPE html><html><body>Not found</body></html>", FileTypeError, "an HTML page"),
    "pickle.safetensors": (b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01K\x01u.", FileTypeError, "a Python pickle"),
    "zip.safetensors": (zip_bytes({"x.npy": npy_bytes(np.ones(2))}), FileTypeError, "a zip archive"),
    "torch.safetensors": (zip_bytes({"archive/data.pkl": b"\x80\x02."}), FileTypeError, "a PyTorch zip checkpoint"),
    "npy.safetensors": (npy_bytes(np.ones(2)), FileTypeError, "a NumPy .npy file"),
    # .npy
    "lfs.npy": (b"version https://git-lfs.github.com/spec/v1\n", FileTypeError, "Git LFS pointer"),
    "bad-version.npy": (b"\x93NUMPY\x09\x09" + npy_bytes(np.ones(2))[8:], MalformedError, "version 9.9"),
    "code.npy": (npy_with_header("__import__('os').system('true')"), MalformedError, "not a Python literal"),
    "object.npy": (OBJECT_NPY, MalformedError, "tensor object: the pickle ends at byte 3 without a STOP"),
    "missing-key.npy": (
        npy_with_header("{'descr': '<f4', 'shape': (1,), }", bytes(4)),
        MalformedError,
        "exactly 'descr', 'fortran_order' and 'shape'",
    ),
    "truncated.npy": (npy_bytes(np.ones(4))[:-3], MalformedError, "needs 32 bytes of data, the file holds 29"),
    "trailing.npy": (npy_bytes(np.ones(4)) + b"x", MalformedError, "the file holds 33"),
    "huge-header.npy": (
        b"\x93NUMPY\x02\x00" + struct.pack("<I", 1 << 30),
        MalformedError,
        "the .npy header is 1073741824 bytes, more than the 10000 NumPy reads",
    ),
    "negative-shape.npy": (
        npy_with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }"),
        MalformedError,
        "'shape' must be a tuple",
    ),
    "void.npy": (
        npy_with_header("{'descr': '|V2', 'fortran_order': False, 'shape': (1,), }", bytes(2)),
        UnsupportedError,
        "raw bytes (bfloat16 or float8 saved without its type?)",
    ),
    # .npz
    "safetensors.npz": (st_bytes({"a": np.ones(2, np.float32)}), FileTypeError, "not an .npz file: a safetensors"),
    "html.npz": (b"<html>", FileTypeError, "not an .npz file: an HTML page"),
    "corrupt.npz": (b"PK\x03\x04" + bytes(100), MalformedError, "not a valid zip archive"),
    "truncated.npz": (zip_bytes({"x.npy": npy_bytes(np.ones(100))})[:500], MalformedError, "not a valid zip"),
    "object-member.npz": (zip_bytes({"x.npy": OBJECT_NPY}), MalformedError, "tensor x: the pickle ends at byte 3"),
    "extra-bytes.npz": (
        zip_bytes({"x.npy": npy_bytes(np.ones(2)) + b"zz"}),
        MalformedError,
        "tensor x: the member holds 146 bytes but its header declares 144",
    ),
    "short-member.npz": (zip_bytes({"x.npy": npy_bytes(np.ones(2))[:-1]}), MalformedError, "declares 144"),
    "bomb.npz": (
        zip_bytes(
            {"x.npy": npy_with_header("{'descr': '<f8', 'fortran_order': False, 'shape': (1000000000000,), }")},
            zipfile.ZIP_DEFLATED,
        ),
        MalformedError,
        "declares 8000000000",
    ),
    "crc.npz": (flip_last_data_byte(zip_bytes({"x.npy": npy_bytes(np.arange(4.0))})), MalformedError, "Bad CRC-32"),
    "encrypted.npz": (
        encrypted(zip_bytes({"x.npy": npy_bytes(np.ones(2))})),
        MalformedError,
        "is encrypted, password required",
    ),  # found by the fuzzer: zipfile raises RuntimeError
    "lzma-dictionary.npz": (
        lzma_dictionary(zip_bytes({"x.npy": npy_bytes(np.ones(2))}, zipfile.ZIP_LZMA), 1 << 32),
        UnsupportedError,
        "LZMA dictionary of 4294967295 bytes exceeds",
    ),  # found by fuzzing
    "comma-dtype.npy": (
        npy_with_header("{'descr': ',', 'fortran_order': False, 'shape': (), }"),
        MalformedError,
        "unknown dtype ','",
    ),  # found by fuzzing: np.dtype(',') raises SyntaxError
    "nul-name.npz": (
        zip_bytes({"x.npy": npy_bytes(np.ones(2))}).replace(b"x.npy", b"\x00\x00\x00\x00\x00"),
        MalformedError,
        "not a valid zip archive",
    ),  # found by fuzzing: zipfile raises IndexError
    "unknown.dat": (b"\x00" * 16, FileTypeError, "unknown checkpoint suffix"),
    "zeros.bin": (b"\x00" * 16, FileTypeError, "not a PyTorch file: not a known checkpoint format"),
}


def read_everything(path: Path) -> None:
    with open_checkpoint(path) as ckpt:
        for t in ckpt.tensors:
            for _ in ckpt.chunks(t):
                pass


@pytest.mark.parametrize(("name", "case"), MALFORMED.items(), ids=list(MALFORMED))
def test_malformed_files_get_the_right_error(tmp_path, name, case):
    content, error, message = case
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(error) as e:
        read_everything(path)
    line = str(e.value)
    assert line.startswith(str(path)), line
    assert message in line, line
    assert "\n" not in line
    assert path.read_bytes() == content
    assert os.listdir(tmp_path) == [name]


def test_there_are_at_least_forty_malformed_cases():
    assert len(MALFORMED) >= 40


@pytest.mark.parametrize(
    ("mutate", "error", "message"),
    [
        (lambda root: (root / "m.safetensors.index.json").write_text("{oops"), MalformedError, "not valid JSON"),
        (lambda root: (root / "m-00002-of-00002.safetensors").unlink(), MissingFileError, "does not exist"),
        (
            lambda root: (root / "m.safetensors.index.json").write_text(
                json.dumps({"weight_map": {"layers.0.w": "../escape.safetensors"}})
            ),
            MalformedError,
            "leaves the checkpoint's directory",
        ),
        (
            lambda root: (root / "m.safetensors.index.json").write_text(
                json.dumps({"weight_map": {"layers.0.w": "m-00001-of-00002.safetensors"}})
            ),
            MalformedError,
            "does not map this tensor",
        ),
        (
            lambda root: (root / "m.safetensors.index.json").write_text(
                json.dumps(
                    {
                        "weight_map": {
                            **{n: "m-00001-of-00002.safetensors" for n in ("layers.0.w", "layers.1.w", "ghost")}
                        }
                    }
                )
            ),
            MalformedError,
            "tensor ghost named by the index is not in",
        ),
        (lambda root: (root / "m.safetensors.index.json").write_text("[]"), MalformedError, "no 'weight_map'"),
        (lambda root: (root / "x.safetensors.index.json").write_text("{}"), Exception, "2 index files"),
    ],
)
def test_malformed_sharded_checkpoints(tmp_path, mutate, error, message):
    make_sharded(tmp_path / "in")
    mutate(tmp_path / "in")
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        open_checkpoint(tmp_path / "in")


def test_missing_file(tmp_path):
    with pytest.raises(MissingFileError, match="no such file"):
        open_checkpoint(tmp_path / "nope.safetensors")


def test_npy_header_beyond_numpys_limit_is_refused_as_numpy_refuses_it(tmp_path):
    # found trying clipcli as a new user: an .npy header beyond NumPy's max_header_size was not refused as by NumPy
    path = tmp_path / "long.npy"
    header = ("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }" + " " * 12_000 + "\n").encode()
    path.write_bytes(b"\x93NUMPY\x02\x00" + len(header).to_bytes(4, "little") + header + bytes(4))
    with pytest.raises(ValueError, match="max_header_size"):
        np.load(path)
    result = run("inspect", path)
    assert result.exit_code == 3
    assert "more than the 10000 NumPy reads (its max_header_size)" in result.stderr


def test_a_text_file_named_safetensors_is_called_text(tmp_path):
    # found trying clipcli as a new user: a text file named .safetensors got no message saying it is text
    path = tmp_path / "notes.safetensors"
    path.write_text("These are my notes about the gradients of yesterday's run.\n")
    result = run("inspect", path)
    assert (result.exit_code, result.stderr) == (3, f"clipcli: error: {path}: not a safetensors file: a text file\n")


@pytest.mark.parametrize(
    ("text", "what"),
    [
        ("[tool.ruff]\nline-length = 120\n", "a text file"),  # found by a new user: TOML was "a JSON file"
        ("[section]\nkey = value\n", "a text file"),
        ('[1, 2, {"a": "b"}]\n', "a JSON file"),
        ('{"weight_map": {"a": "' + "x" * 600 + '"}}', "a JSON file"),  # cut short in a string at 512 bytes
        ('{"a": [' + "1, " * 300 + "1]}", "a JSON file"),  # cut short between values
        ('{"a": 1}\n{"a": 2}\n', "a JSON file"),  # JSON lines
        ('{"a": [' + "true, " * 90 + "1]}", "a JSON file"),  # cut in a `true` at 512 bytes (found by a review)
        ('{"a": [' + "1, " * 168 + "-1, " + "1, " * 10 + "1]}", "a JSON file"),  # cut after a minus sign
        ("[a]\n", "a text file"),
    ],
)
def test_json_and_text_files_are_told_apart(tmp_path, text, what):
    path = tmp_path / "config.bin"
    path.write_text(text)
    result = run("inspect", path)
    assert result.exit_code == 3 and result.stderr.endswith(f": {what}\n"), result.stderr


def test_a_pytorch_zip_named_npz_is_called_a_pytorch_checkpoint(tmp_path):
    # found trying clipcli as a new user: a PyTorch zip named .npz was not called a PyTorch checkpoint
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


def test_a_file_without_a_known_suffix_is_read_as_what_it_is(tmp_path):
    # found trying clipcli as a new user: a file without a known suffix was not read as what it is
    for name, content in (
        ("grads", (SAMPLES / "grads.safetensors").read_bytes()),
        ("grads.bak", (SAMPLES / "grads.npz").read_bytes()),
        ("one", npy(np.ones(3, np.float32))),
    ):
        (tmp_path / name).write_bytes(content)
        assert js("global-norm", tmp_path / name)["checkpoints"][0]["global_norm"] > 0


# --- Threads and chunk sizes do not change the result -------------------------------------------------


@pytest.fixture
def multi_chunk(tmp_path) -> Path:
    rng = np.random.default_rng(9)
    tensors = {
        "a": (rng.standard_normal(700_001) * 1e3).astype(np.float32),
        "b": rng.standard_normal((300, 1001)).astype(ml_dtypes.bfloat16),
        "c": rng.standard_normal(5).astype(np.float16),
        "d": rng.standard_normal(200_000) * 1e-200,
    }
    path = tmp_path / "m.safetensors"
    path.write_bytes(st_bytes(tensors))
    return path


class _Norms:
    def __init__(self, p):
        self.p, self.accs = p, {}

    def chunk(self, t, offset, values):
        self.accs.setdefault(t.name, NormAccumulator(self.p)).add(values, offset // values.itemsize)

    def result(self):
        return self.accs


@pytest.mark.parametrize("ord_", [2, 1, 3, np.inf])
def test_the_engine_gives_the_same_bits_for_any_jobs_chunk_size_and_worker_kind(multi_chunk, monkeypatch, ord_):
    from clipcli.checkpoint import engine as _engine

    results = set()
    with open_checkpoint(multi_chunk) as ckpt:
        for kind, jobs in (("inline", 1), ("threads", 2), ("threads", 3), ("processes", 2), ("processes", 3)):
            # chunk sizes that cut blocks anywhere: a block's parts meet again however they were shared out
            for chunk in (8192 * 8, 8192 * 8 * 3 + 4, 99_996, 4 << 20):
                monkeypatch.setattr(_engine, "CHUNK_BYTES", chunk)
                monkeypatch.setattr(_engine, "_MIN_CHUNK", chunk)
                monkeypatch.setattr(_engine, "_BYTES_PER_WORKER", 1)
                parts = _engine.run(ckpt, ckpt.tensors, lambda: _Norms(ord_), jobs, kind=kind, unit=BLOCK)
                per_tensor = {t.name: NormAccumulator(ord_) for t in ckpt.tensors}
                for accs in parts:
                    for name, acc in accs.items():
                        per_tensor[name].combine(acc)
                total = NormAccumulator(ord_)
                for acc in per_tensor.values():
                    total.merge(acc)
                results.add(total.result())
    assert len(results) == 1
    whole = NormAccumulator(ord_)
    with open_checkpoint(multi_chunk) as ckpt:
        for t in ckpt.tensors:
            whole.merge(_whole(ckpt, t, ord_))
    assert results == {whole.result()}


@settings(max_examples=200, deadline=None)
@given(
    layout=st.lists(
        st.tuples(st.sampled_from([0, 1, 16, 48, 64, 300]), st.sampled_from([0, 0, 1, 4096, 4097])), max_size=40
    ),
    max_bytes=st.sampled_from([1, 16, 64, 128, 1 << 20]),  # (runs ending exactly at their limit among them)
    other=st.sampled_from(["", "file", "dtype", "big", "back"]),
)
@example(layout=[(16, 0), (48, 0), (0, 0), (1, 0)], max_bytes=64, other="")  # a run that ends at its limit
def test_small_tensors_fall_into_the_same_tasks_found_per_run_as_per_tensor(layout, max_bytes, other):
    # the runs of small tensors are found per run where every tensor is small and in order (found timing 10,000
    # tiny tensors): the same tasks as the loop over every tensor
    from clipcli.checkpoint import TensorInfo
    from clipcli.checkpoint import engine as _engine
    from clipcli.checkpoint.engine import SMALL_TENSOR
    from clipcli.checkpoint.tensor import Span

    tensors, end = [], 0
    for i, (nbytes, gap) in enumerate(layout):
        file, dtype = "a", np.dtype(np.uint8)
        if i == len(layout) // 2 and other:  # one unlike the rest
            nbytes, gap = (
                (SMALL_TENSOR + 1, gap) if other == "big" else (nbytes, -min(end, 5) if other == "back" else gap)
            )
            file, dtype = ("b" if other == "file" else file), (None if other == "dtype" else dtype)
        tensors.append(TensorInfo(f"t{i}", "uint8", (nbytes,), nbytes, file, dtype, location=Span(end + gap)))
        end += gap + nbytes
    runs = _engine._tasks(_AnyReader(), tensors, max_bytes, {}, 1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_engine, "_small_runs", lambda *args: None)
        assert _engine._tasks(_AnyReader(), tensors, max_bytes, {}, 1) == runs


@settings(max_examples=200, deadline=None)
@given(
    layout=st.lists(
        st.tuples(
            st.sampled_from([0, 1, 16, 48, 64, 300]),
            st.sampled_from([0, 0, 1, 4096, 4097]),
            st.sampled_from([0, 0, 1, 4096, 4097]),
        ),
        max_size=40,
    ),
    max_bytes=st.sampled_from([1, 16, 64, 128, 1 << 20]),
    other=st.sampled_from(["", "file", "dtype", "big", "back", "fortran"]),
    side=st.sampled_from([0, 1]),
)
def test_small_pairs_fall_into_the_same_tasks_found_per_run_as_per_pair(layout, max_bytes, other, side):
    # as for one checkpoint's small tensors: the runs of small pairs (a diff of two 12,000-tensor LoRA adapters)
    # are found per run where every pair is small and in order, the same tasks as the loop over every pair
    from clipcli.checkpoint import TensorInfo
    from clipcli.checkpoint import pairs as _pairs
    from clipcli.checkpoint.engine import SMALL_TENSOR
    from clipcli.checkpoint.tensor import Span

    sides: list[list[TensorInfo]] = [[], []]
    ends = [0, 0]
    for i, (nbytes, *gaps) in enumerate(layout):
        for k in (0, 1):
            size, gap, file, dtype, fortran = nbytes, gaps[k], "a", np.dtype(np.uint8), False
            if i == len(layout) // 2 and other and k == side:  # one unlike the rest, on one side
                size = SMALL_TENSOR + 1 if other == "big" else size
                gap = -min(ends[k], 5) if other == "back" else gap
                file = "b" if other == "file" else file
                dtype = None if other == "dtype" else dtype
                fortran = other == "fortran"
            location = Span(ends[k] + gap)
            sides[k].append(TensorInfo(f"t{i}", "uint8", (size, 2), 2 * size, file, dtype, fortran, location))
            ends[k] += gap + 2 * size
    pairs = list(zip(*sides, strict=True))
    readers = (_AnyReader(), _AnyReader())
    tasks = _pairs._pair_tasks(readers, pairs, max_bytes, 1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_pairs, "_small_pair_runs", lambda *args: None)
        assert _pairs._pair_tasks(readers, pairs, max_bytes, 1) == tasks


class _AnyReader:
    def random_access(self, t):
        return True


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 1 << 20), min_size=1, max_size=40),
    max_bytes=st.sampled_from([1 << 12, 1 << 16, 1 << 20]),
    parts=st.integers(2, 9),
)
@example(sizes=[1 << 20] * 3, max_bytes=1 << 16, parts=4)  # 48 tasks of 64 KiB: 4 parts of 12
def test_a_pass_in_parts_hands_out_every_task_once_each_part_in_order(sizes, max_bytes, parts):
    # engine.in_parts (a remote file read on in parts, a connection each): the tasks as `_tasks` made them, dealt
    # out in turn; the parts of about equal bytes, each starting where its first task does
    from clipcli.checkpoint import TensorInfo
    from clipcli.checkpoint import engine as _engine
    from clipcli.checkpoint.tensor import Span

    tensors, end = [], 0
    for i, n in enumerate(sizes):
        tensors.append(TensorInfo(f"t{i}", "uint8", (n,), n, "a", np.dtype(np.uint8), location=Span(end)))
        end += n
    tasks = _engine._tasks(_AnyReader(), tensors, max_bytes, {}, 1)
    dealt, starts = _engine.in_parts(tasks, tensors, parts)
    assert sorted(dealt) == sorted(tasks) and len(dealt) == len(tasks)

    def where(task):  # (the first byte, the bytes) of a task in the file
        first = tensors[task.tensors[0]]
        if task.batch:
            return first.location.offset, sum(tensors[i].nbytes for i in task.tensors)
        return first.location.offset + task.offset, task.nbytes

    cuts = [0, *(at for _, at in starts), end]
    assert all(file == "a" for file, _ in starts) and cuts == sorted(set(cuts))
    assert len(starts) < min(parts, len(tasks))  # fewer where a large task spans more than a part's share
    largest = max(where(task)[1] for task in tasks)
    if len({where(task)[1] for task in tasks}) == 1:  # tasks of one size: as many parts as asked for
        assert len(starts) == min(parts, len(tasks)) - 1
    for k, (lo, hi) in enumerate(itertools.pairwise(cuts)):
        mine = [where(task) for task in dealt if lo <= where(task)[0] < hi]
        assert [at for at, _ in mine] == sorted(at for at, _ in mine)  # each part's tasks in file order
        assert sum(n for _, n in mine) == hi - lo <= end / parts + largest
        assert dealt.index(next(t for t in dealt if where(t)[0] == lo)) == k  # each part's first, dealt in turn


def _whole(ckpt, t, ord_):
    acc = NormAccumulator(ord_)
    acc.add(ckpt.read(t))
    return acc


def test_map_chunks_keeps_order_with_threads(multi_chunk):
    with open_checkpoint(multi_chunk) as ckpt:
        expected = [(t.name, c.tobytes()) for t in ckpt.tensors for c in ckpt.chunks(t, 1 << 16)]
        chunks = ckpt.map_chunks(ckpt.tensors, lambda t, offset, c: c.copy(), 3, 1 << 16, unit=1)
        got = [(t.name, c.tobytes()) for t, c in chunks]
    assert got == expected


def test_error_lines_escape_control_characters_in_names(tmp_path):
    # found by fuzzing: a tensor named "\n" split the error over two lines
    path = tmp_path / "n.safetensors"
    path.write_bytes(raw_safetensors({"\n": {}}))
    with pytest.raises(MalformedError) as e:
        open_checkpoint(path)
    # escaped as in a report (issue 22 item 10: one escaping function), no longer quoted as repr() does
    assert str(e.value) == f"{path}: tensor \\n: missing or non-string 'dtype'"


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_written_bytes_are_handed_to_the_disk_as_the_write_goes(tmp_path, monkeypatch, suffix):
    # a write that replaces a file waits for the disk (fsync) before it commits: it should not fill the page
    # cache and then wait in fsync: every WRITEBACK_BYTES the written range is handed on (posix_fadvise
    # DONTNEED starts its writeback); a refused hint changes nothing
    from clipcli.checkpoint import atomic as _files

    monkeypatch.setattr(_files, "WRITEBACK_BYTES", 1 << 20)
    tensors = {f"t{i}": np.full(300_000, i, np.float32) for i in range(8)}  # 9.2 MiB of data
    src = tmp_path / "src.safetensors"
    src.write_bytes(st_bytes(tensors))
    calls = []

    def advise(fd, offset, length, advice):
        calls.append((offset, length, advice))
        raise OSError(22, "not supported here")

    monkeypatch.setattr(os, "posix_fadvise", advise, raising=False)
    out = tmp_path / f"out{suffix}"
    out.write_bytes(b"old")  # replaced: durable
    with open_checkpoint(src) as ckpt:
        save(ckpt, out, lambda t: ckpt.chunks(t, 1 << 18))
    assert len(calls) >= 8 and all(a == os.POSIX_FADV_DONTNEED for _, _, a in calls)
    assert [o for o, _, _ in calls[1:]] == [o + n for o, n, _ in calls[:-1]]  # consecutive ranges
    assert calls[0][0] == 0 and all(n >= 1 << 20 for _, n, _ in calls)
    with open_checkpoint(out) as written:
        for t in written.tensors:
            np.testing.assert_array_equal(written.read(t), tensors[t.name])


@pytest.mark.parametrize("replaces", [False, True])
@pytest.mark.parametrize("suffix", [".safetensors", ".npz", ".pt"])
def test_a_new_file_is_written_as_cp_writes_and_a_replaced_one_durably(tmp_path, monkeypatch, suffix, replaces):
    # a new output is complete when renamed (the kernel writes it back, as after `cp`); a file replaced
    # (--in-place, an output written again) is fsynced, with its directory, before and after its rename, so
    # that a power loss leaves the old or the new one; its bytes are handed to the disk as they come
    import clipcli.checkpoint.atomic as atomic

    synced, advised = [], []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.fstat(fd).st_mode) or real_fsync(fd))
    monkeypatch.setattr(os, "posix_fadvise", lambda *a: advised.append(a), raising=False)
    monkeypatch.setattr(atomic, "WRITEBACK_BYTES", 1 << 16)
    tensors = {f"t{i}": np.full(100_000, i, np.float32) for i in range(3)}
    src = tmp_path / "src.safetensors"
    src.write_bytes(st_bytes(tensors))
    out = tmp_path / f"out{suffix}"
    if replaces:
        out.write_bytes(b"old")
    with open_checkpoint(src) as ckpt:
        if suffix == ".safetensors":  # the writer that workers write into in any order
            with placed(ckpt, out) as places:
                assert places is not None
                for t in ckpt.tensors:
                    places[t.name].write(0, ckpt.read(t))
        else:
            save(ckpt, out, lambda t: ckpt.chunks(t, 1 << 16))
    if replaces:
        kinds = [stat.S_ISREG(m) for m in synced]
        assert kinds == [True, False] and advised  # the file, then its directory; the bytes as they came
    else:
        assert synced == [] and advised == []
    with open_checkpoint(out) as written:
        for t in written.tensors:
            np.testing.assert_array_equal(written.read(t), tensors[t.name])


def test_a_damaged_member_among_small_members_read_together_is_caught(tmp_path):
    # small stored members are read in one task, their headers between them; each CRC-32 is still checked
    path = tmp_path / "many.npz"
    np.savez(path, **{f"m{i}": np.full(10, float(i)) for i in range(20)})
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("m7.npy")
    raw = bytearray(path.read_bytes())
    local = struct.unpack("<HH", raw[info.header_offset + 26 : info.header_offset + 30])
    last = info.header_offset + 30 + sum(local) + info.file_size - 1  # the member's last data byte
    raw[last] ^= 0x40
    path.write_bytes(bytes(raw))
    with open_checkpoint(path) as ckpt, pytest.raises(MalformedError, match=r"Bad CRC-32 for file 'm7\.npy'"):
        from clipcli.checkpoint.engine import run
        from clipcli.commands.measure import NormKernel

        run(ckpt, ckpt.tensors, lambda: NormKernel(2.0), 1, unit=BLOCK)


@pytest.mark.parametrize("dtype", ["<f8", "|b1", "<U3", ">i4", "<c16", "|u1", "<f2"])
@pytest.mark.parametrize("shape", [(), (5,), (2, 3), (0,), (1, 2, 3, 4)])
@pytest.mark.parametrize("fortran", [False, True])
def test_headers_np_save_writes_read_as_ast_reads_them(dtype, shape, fortran):
    import ast

    from clipcli.checkpoint.formats import npy as _npy

    buf = io.BytesIO()
    np.save(buf, np.zeros(shape, dtype, order="F" if fortran else "C"))
    raw = buf.getvalue()
    n = struct.unpack("<H", raw[8:10])[0]
    text = raw[10 : 10 + n].decode("latin1")
    assert _npy._literal(text, 1) == ast.literal_eval(text)


@pytest.mark.parametrize("empty_first", [True, False])
def test_an_empty_tensor_listed_anywhere_at_an_offset_of_a_nonempty_one_is_read_as_the_reference_reads_it(
    tmp_path, empty_first
):
    # Found by a review: the entries were ordered by start alone, so an empty tensor listed after a
    # non-empty one at the same offset broke the contiguity check; the reference orders by (start, end).
    entries = {"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    empty = {"e": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}
    header = {**empty, **entries} if empty_first else {**entries, **empty}
    path = tmp_path / "m.safetensors"
    path.write_bytes(raw_safetensors(header, np.arange(4, dtype=np.float32).tobytes()))
    with safe_open(path, "np") as f:
        want = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    with open_checkpoint(path) as ckpt:
        got = {t.name: ckpt.read(t) for t in ckpt.tensors}
    assert set(got) == set(want) == {"x", "e"}
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


@pytest.mark.parametrize(
    ("header", "data"),
    [
        (b'{"a":{"dtype":"F32","shape":[-0],"data_offsets":[0,0]}}', b""),
        (b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[-0,4]}}', b"\0" * 4),
        (b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0, -0 ]}}', b""),
        (b'{"a-0":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"__metadata__":{"k":"-0"}}', b"\0" * 4),
        (b'{"a":{"dtype":"F32","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}}', b""),
        (b'{"a":{"dtype":"F64","shape":[2305843009213693952,0],"data_offsets":[0,0]}}', b""),  # 2**61 * 64 bits
        (b'{"a":{"dtype":"F32","shape":[0,4294967296,4294967296],"data_offsets":[0,0]}}', b""),
        (b'{"a":{"dtype":"F32","shape":[18446744073709551615,0],"data_offsets":[0,0]}}', b""),
        (b'{"a":{"dtype":"F32","shape":[18446744073709551616,0],"data_offsets":[0,0]}}', b""),
    ],
)
def test_zero_size_and_negative_zero_entries_are_taken_as_the_reference_reader_takes_them(tmp_path, header, data):
    # Found by a review and pinned: JSON's -0 (a float to the reference reader) and element counts that
    # pass 64 bits before a 0 were read as empty tensors; the reference reader refuses both.
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    try:
        with safe_open(path, "np") as f:
            want = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    except Exception:  # the reference reader's SafetensorError
        want = None
    # issue 22 item 12 changed this: a dimension of 2**63 or more, which the reference reader takes in an empty
    # tensor, is refused (no NumPy or torch tensor has one; written to .npy it could not be loaded)
    if want is None or any(d >= 2**63 for shape in want.values() for d in shape):
        with pytest.raises(MalformedError):
            open_checkpoint(path)
    else:
        with open_checkpoint(path) as ckpt:
            assert {t.name: t.shape for t in ckpt.tensors} == want


def test_an_npy_shape_numpy_cannot_hold_is_refused_even_when_empty(tmp_path):
    # Found by the differential fuzz test against np.load and pinned: (0, 1161, 1986083556600943) was read
    # as an empty tensor, and written back into .npy files NumPy cannot load.
    text = b"{'descr': '<f4', 'fortran_order': False, 'shape': (0, 1161, 1986083556600943), }"
    text += b" " * (117 - len(text)) + b"\n"
    path = tmp_path / "z.npy"
    path.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text)
    with pytest.raises(ValueError):
        np.load(path)
    with pytest.raises(MalformedError, match="larger than any array NumPy can hold"):
        open_checkpoint(path)
    fits = text.replace(b"1986083556600943", b"1986083556600".ljust(16))  # 0 x 1161 x 2e12 floats: NumPy holds it
    path.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(fits)) + fits)
    with open_checkpoint(path) as ckpt:
        assert ckpt.tensors[0].shape == np.load(path).shape == (0, 1161, 1986083556600)


_JSON_VALUES = st.one_of(
    st.integers(-3, 2**40), st.booleans(), st.floats(allow_nan=False), st.none(), st.text(max_size=3)
)


@settings(max_examples=500, deadline=None)
@given(
    dtype=st.one_of(st.sampled_from(sorted(_safetensors.CODES)), _JSON_VALUES, st.lists(st.integers(), max_size=1)),
    shape=st.one_of(st.lists(st.integers(-1, 6), max_size=3), st.lists(_JSON_VALUES, max_size=2), _JSON_VALUES),
    offsets=st.one_of(st.lists(st.integers(-1, 400), min_size=1, max_size=3), st.lists(_JSON_VALUES, max_size=3)),
    keys=st.sets(st.sampled_from(["dtype", "shape", "data_offsets"])),
    extra=st.booleans(),
    fitting=st.booleans(),
)
def test_an_entry_is_taken_or_refused_as_the_full_checks_say(dtype, shape, offsets, keys, extra, fitting):
    d = _safetensors.dtype_by_code(dtype) if isinstance(dtype, str) else None
    if fitting and d is not None and isinstance(shape, list) and all(type(x) is int and x >= 0 for x in shape):
        bits = int(np.prod(shape, dtype=object)) * d.bits  # the offsets the shape needs (a well-formed entry)
        offsets = [offsets[0], offsets[0] + bits // 8] if offsets and type(offsets[0]) is int else offsets
    info: object = {k: v for k, v in (("dtype", dtype), ("shape", shape), ("data_offsets", offsets)) if k in keys}
    if extra:
        info = [info] if keys else "not an object"

    def outcome(check):
        try:
            return check(Path("m.safetensors"), "t", info, 8)
        except (MalformedError, UnsupportedError) as e:
            return type(e), str(e)

    assert outcome(_safetensors._entry) == outcome(_safetensors._checked_entry)


def test_a_surrogate_pair_is_text_and_null_metadata_is_none(tmp_path):
    header = b'{"__metadata__":null,"\\ud83d\\ude00":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}}'
    path = tmp_path / "pair.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + np.ones(3, np.float32).tobytes())
    with open_checkpoint(path) as ckpt:
        assert [t.name for t in ckpt.tensors] == ["\U0001f600"] and ckpt.metadata == {}
    with safe_open(path, "np") as f:  # the reference reader agrees on both
        assert list(f.keys()) == ["\U0001f600"] and not f.metadata()


def test_metadata_of_every_shard_is_kept(tmp_path):
    # found by a review: only the first shard's metadata was kept
    (tmp_path / "a.safetensors").write_bytes(st_bytes({"x": np.ones(2, np.float32)}, {"format": "pt", "step": "1"}))
    (tmp_path / "b.safetensors").write_bytes(st_bytes({"y": np.ones(2, np.float32)}, {"format": "pt", "lr": "0.1"}))
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.metadata == {"format": "pt", "step": "1", "lr": "0.1"}


def test_an_npz_directory_entry_pointing_at_another_member_is_refused(tmp_path):
    # an entry pointing at another member's local header: that member's header and bytes, read as this one's
    from tests.helpers import redirect_member

    buf = io.BytesIO()
    np.savez(buf, x=np.arange(4.0), y=np.arange(4.0) * 2)
    path = tmp_path / "r.npz"
    path.write_bytes(redirect_member(buf.getvalue(), "y.npy", "x.npy"))
    with pytest.raises(MalformedError, match="bad local header"):
        open_checkpoint(path)


def test_an_npz_np_load_does_not_take_for_a_zip_is_refused(tmp_path):
    # Found by the differential fuzz test against np.load: a damaged .npz whose zip directory listed no
    # member was read as a checkpoint of no tensors (a clip would have written an empty file)
    buf = io.BytesIO()
    np.savez(buf, x=np.arange(4.0))
    data = bytearray(buf.getvalue())
    data[2:4] = b"\0\0"  # no local header at the start
    end = data.rfind(b"PK\x05\x06")
    data[end + 8 : end + 12] = b"\0\0\0\0"  # the end record lists no member
    path = tmp_path / "damaged.npz"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError):
        np.load(path, allow_pickle=False)
    with pytest.raises(MalformedError, match="its first bytes are no zip member's header"):
        open_checkpoint(path)


def test_shard_directories_skip_folders_named_like_shards_and_name_broken_links(tmp_path):
    # a review: a folder `old.safetensors/` (or one named like an index) beside the shards made the whole
    # directory unreadable ("Is a directory"), and a broken link gave a message naming only the directory
    (tmp_path / "a.safetensors").write_bytes(st_bytes({"x": np.ones(2, np.float32)}))
    (tmp_path / "old.safetensors").mkdir()
    (tmp_path / "x.safetensors.index.json").mkdir()
    with open_checkpoint(tmp_path) as ckpt:
        assert [t.name for t in ckpt.tensors] == ["x"]
    (tmp_path / "gone.safetensors").symlink_to(tmp_path / "nowhere.safetensors")
    with pytest.raises(MissingFileError, match="not a file \\(a broken link\\?\\)") as e:
        open_checkpoint(tmp_path)
    assert "gone.safetensors" in str(e.value)


@pytest.mark.parametrize(
    "text",
    [
        # one tensor's offsets split over the text after two names (JSON it is not): not read as two tensors
        '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},:[4,"b":{"dtype":"F32","shape":[1],"data_offsets"8]}}',
        '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},:[4,8]},"b":{"dtype":"F32","shape":[1],"data_offsets""}',
        '{"a":{"dtype":"F32","shape":[1],"data_offsets":[00,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}',
    ],
)
def test_a_header_split_at_its_quotes_is_taken_only_where_it_is_json(tmp_path, text):
    # found reading headers by splitting them at their quotes (`_compact`, timing 10,000 tiny tensors): text that is
    # laid out like a tensor's objects but is no JSON is refused as the checking parse refuses it
    raw = text.encode()
    assert _safetensors._compact(raw, text, 8 + len(raw)) is None
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(8))
    with pytest.raises(MalformedError, match="not valid UTF-8 JSON"):
        open_checkpoint(path)


# review 31: a tensor's entry with an unknown key whose value the reference reader (serde_json) refuses was taken:
# NaN, Infinity, numbers past float64's range, a lone surrogate's escape, nesting of 128 levels or more
@pytest.mark.parametrize(
    ("extra", "taken"),
    [
        ("NaN", False),
        ("-Infinity", False),
        ("[Infinity]", False),
        ("1e400", False),
        ("-1e400", False),
        ("1" + "0" * 400, False),
        ('"\\ud800"', False),
        ('1,"\\udc00":1', False),
        ("[" * 126 + "]" * 126, False),
        ("[" * 125 + "]" * 125, True),
        ("1e-400", True),
        ("1" + "0" * 30, True),
        ('"\\ud83d\\ude00"', True),
        ('{"a":[1.5,null,true]}', True),
    ],
)
def test_an_unknown_key_is_taken_exactly_when_the_reference_reader_takes_it(tmp_path, extra, taken):
    header = ('{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":' + extra + "}}").encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + np.float32(5).tobytes())
    try:
        with safe_open(str(path), "np") as f:
            reference = f.get_tensor("w")
    except Exception:  # the reference reader refuses it
        reference = None
    assert (reference is not None) == taken
    if taken:
        with open_checkpoint(path) as ckpt:
            np.testing.assert_array_equal(ckpt.read(ckpt.tensors[0]), reference)
    else:
        with pytest.raises(MalformedError):
            open_checkpoint(path).close()


_ENTRY = '"dtype":"F32","shape":[2],"data_offsets":[0,8]'


# found in review: a key given twice where the reference reader ignores it (an unknown key of a tensor's entry,
# or inside its value) was refused; where it takes it (a tensor's field) it refuses it too; clipcli refuses a tensor
# named twice and a metadata key given twice by choice (README, "Choices"), where the reference keeps the last
@pytest.mark.parametrize(
    ("header", "taken"),
    [
        ('{"a":{' + _ENTRY + ',"foo":1,"foo":2}}', True),
        ('{"a":{' + _ENTRY + ',"foo":{"x":1,"x":2}}}', True),
        ('{"__metadata__":{"k":"1"},"a":{' + _ENTRY + ',"z":[{"q":1,"q":2}]}}', True),
        ('{"a":{"dtype":"F32",' + _ENTRY + "}}", False),
        ('{"a":{' + _ENTRY + ',"shape":[2]}}', False),
        ('{"a":{' + _ENTRY + ',"data_offsets":[0,8]}}', False),
    ],
)
def test_a_repeated_key_is_refused_where_the_reference_reader_refuses_it(tmp_path, header, taken):
    path = tmp_path / "r.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + bytes(8))
    try:
        safe_open(path, "np")
        reference = True
    except Exception:  # (the library's own error type)
        reference = False
    assert reference is taken
    if taken:
        with open_checkpoint(path) as c:
            assert [(t.name, t.shape) for t in c.tensors] == [("a", (2,))]
    else:
        with pytest.raises(MalformedError, match="duplicate key"):
            open_checkpoint(path)
    for by_choice in (
        '{"a":{' + _ENTRY + '},"a":{' + _ENTRY + "}}",
        '{"__metadata__":{"k":"1","k":"2"},"a":{' + _ENTRY + "}}",
    ):
        path.write_bytes(struct.pack("<Q", len(by_choice)) + by_choice.encode() + bytes(8))
        safe_open(path, "np")  # the reference reader keeps the last
        with pytest.raises(MalformedError, match="duplicate key"):
            open_checkpoint(path)
