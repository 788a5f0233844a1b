"""Hostile archives, headers and shards: subdirectory shards, .npz bombs, huge header numbers,
member names that escape, and headers of many tensors."""

from __future__ import annotations

import io
import json
import pickle
import struct
import time
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from clipcli.checkpoint import Checkpoint, TensorInfo, open_checkpoint, plan, save
from clipcli.checkpoint.formats import sharded as _sharded
from tests.helpers import npy_header, raw_safetensors, run_bounded, st_bytes, zeros_npz


def refused(r, *words: str) -> None:
    """Exit 3 with one `clipcli: error:` line that holds `words`."""
    assert r.returncode == 3, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("clipcli: error: "), r.stderr
    for w in words:
        assert w in lines[0], lines[0]


def npz_of(path: Path, members: dict[str, bytes], method: int = zipfile.ZIP_STORED) -> Path:
    with zipfile.ZipFile(path, "w", method) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


# -- Shards in subdirectories ---------------------------------------------------------------------------


def subdirectory_shards(root: Path) -> Path:
    """An index whose two shards have one name in two subdirectories."""
    for sub, name, value in (("a", "x", 3.0), ("b", "y", 4.0)):
        (root / sub).mkdir(parents=True)
        safetensors.numpy.save_file({name: np.full(4, value, np.float32)}, root / sub / "model.safetensors")
    weight_map = {"x": "a/model.safetensors", "y": "b/model.safetensors"}
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


@pytest.mark.parametrize("command", ["convert", "clip-norm"])
def test_shards_in_subdirectories_keep_their_paths(tmp_path: Path, command: str) -> None:
    # issue 22 item 2: a/model.safetensors and b/model.safetensors were both written to OUT/model.safetensors
    src = subdirectory_shards(tmp_path / "src")
    more = ["--clip-norm", "1e9"] if command == "clip-norm" else []
    r = run_bounded(command, src, "-o", tmp_path / "out", *more, seconds=30)
    assert r.returncode == 0, r
    out = tmp_path / "out"
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"] == {
        "x": "a/model.safetensors",
        "y": "b/model.safetensors",
    }
    assert not (out / "model.safetensors").exists()
    assert safetensors.numpy.load_file(out / "a" / "model.safetensors")["x"].tolist() == [3.0] * 4
    assert safetensors.numpy.load_file(out / "b" / "model.safetensors")["y"].tolist() == [4.0] * 4


def test_shards_in_subdirectories_clip_in_place(tmp_path: Path) -> None:
    # issue 22 item 2: --in-place replaced one shard with the other, leaving the checkpoint unreadable
    src = subdirectory_shards(tmp_path / "src")
    r = run_bounded("clip-norm", src, "--in-place", "--clip-norm", "1", seconds=30)
    assert r.returncode == 0, r
    with open_checkpoint(src) as ckpt:
        values = {t.name: ckpt.read(t) for t in ckpt.tensors}
    assert sorted(values) == ["x", "y"]
    assert np.allclose(values["x"], 0.5) and np.allclose(values["y"], 0.5)  # each norm (6, 8) clipped to 1


def test_stale_shards_in_an_output_subdirectory_are_refused(tmp_path: Path) -> None:
    # issue 22 item 2: an old shard in a subdirectory the write uses would stay beside the new ones
    src = subdirectory_shards(tmp_path / "src")
    (tmp_path / "out" / "a").mkdir(parents=True)
    (tmp_path / "out" / "a" / "old.safetensors").write_bytes(b"")
    r = run_bounded("convert", src, "-o", tmp_path / "out", seconds=30)
    assert r.returncode == 4 and "a/old.safetensors" in r.stderr, r
    assert not (tmp_path / "out" / "a" / "model.safetensors").exists()


@pytest.mark.parametrize("shard", ["../x.safetensors", "a/../../x.safetensors", "/tmp/x.safetensors"])
def test_index_shard_paths_that_leave_the_directory_are_refused(tmp_path: Path, shard: str) -> None:
    # issue 22 item 2: the index reader must refuse shard names that escape its directory
    (tmp_path / "x.safetensors").write_bytes(st_bytes({"w": np.ones(2, np.float32)}))
    (tmp_path / "ckpt").mkdir()
    index = tmp_path / "ckpt" / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w": shard}}))
    refused(run_bounded("inspect", index, seconds=30), "leaves the checkpoint's directory")


@pytest.mark.parametrize("shard", ["s1.safetensors/", "s1.safetensors/.", "./s1.safetensors/"])
def test_an_index_shard_path_naming_a_directory_is_refused(tmp_path: Path, shard: str) -> None:
    # found by a red team: "s1.safetensors/" was read as s1.safetensors by inspect and the clips (their
    # rewritten index dropped the slash), and called a stray shard by verify; a loader opening it finds no file
    (tmp_path / "s1.safetensors").write_bytes(st_bytes({"a": np.ones(2, np.float32)}))
    (tmp_path / "s2.safetensors").write_bytes(st_bytes({"b": np.ones(2, np.float32)}))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": shard, "b": "./s2.safetensors"}}))  # ./ reads as it is
    refused(run_bounded("inspect", index, seconds=30), "names a directory, not a shard file")
    found = run_bounded("verify", index, seconds=30)  # a defect found: verify's finding, exit 1
    assert found.returncode == 1 and f"index: shard path {shard!r} names a directory" in found.stderr, found


# -- bzip2 and LZMA bombs, Fortran order ----------------------------------------------------------------


@pytest.fixture(scope="module")
def bombs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bombs")
    return {
        "deflate": zeros_npz(root / "deflate.npz", 128 << 20, zipfile.ZIP_DEFLATED),  # ~130 KB, 1030:1
        "bzip2": zeros_npz(root / "bzip2.npz", 128 << 20, zipfile.ZIP_BZIP2),  # ~330 bytes
        "lzma": zeros_npz(root / "lzma.npz", 128 << 20, zipfile.ZIP_LZMA),  # ~19 KB
    }


@pytest.mark.parametrize("command", ["inspect", "global-norm"])
def test_a_large_compressed_member_is_read_within_bounded_memory(bombs: dict[str, Path], command: str) -> None:
    # issue 22 item 8: zipfile inflated a bzip2/LZMA member whole on its first read (1 KB of file: 2 GB); every
    # compressed member now goes through one bounded stream, deflate's as bzip2's and LZMA's
    # the address space of a clipcli that reads 4 MiB chunks (about 150 MB), not one that holds the 128 MB
    # member (peak_mb would be no measure: a forked child's starts at the size of the pytest process)
    r = run_bounded(command, bombs["deflate"], seconds=60, memory_mb=250)
    assert r.returncode == 0 and "a " in r.stdout, r


@pytest.mark.parametrize("method", ["bzip2", "lzma"])
@pytest.mark.parametrize("command", ["inspect", "global-norm"])
def test_npz_bombs_are_refused_by_their_ratio(bombs: dict[str, Path], method: str, command: str) -> None:
    # issue 22 item 8: bounded in memory, a 6 KB bzip2 member of 8 GiB of zeros still took global-norm 35 s:
    # a member that declares more than deflate could expand to (1032:1) is refused before it is read
    path = bombs[method]
    assert path.stat().st_size < 20_000
    r = run_bounded(command, path, seconds=10, memory_mb=250)
    assert r.returncode == 3 and r.seconds < 5, r
    assert r.stderr.count("\n") == 1 and "refused as a decompression bomb" in r.stderr, r


def test_a_compressed_member_longer_than_declared_is_read_to_its_declared_size(tmp_path: Path) -> None:
    # issue 22 item 8: the new bounded stream, like zipfile, stops at the declared size and checks the CRC-32
    path = npz_of(tmp_path / "a.npz", {"a.npy": npy(np.arange(1000, dtype=np.float32))}, zipfile.ZIP_BZIP2)
    data = bytearray(path.read_bytes())
    at = data.rindex(b"PK\x01\x02") + 20  # central directory: CRC at 16, compressed size 20, size 24
    assert struct.unpack_from("<I", data, at + 4)[0] == 128 + 4000
    struct.pack_into("<I", data, at + 4, 128 + 400)
    path.write_bytes(bytes(data))
    refused(run_bounded("inspect", path, seconds=30), "holds 528 bytes but its header declares 4128")
    crc = tmp_path / "crc.npz"
    npz_of(crc, {"a.npy": npy(np.arange(1000, dtype=np.float32))}, zipfile.ZIP_LZMA)
    data = bytearray(crc.read_bytes())
    at = data.rindex(b"PK\x01\x02") + 16
    struct.pack_into("<I", data, at, struct.unpack_from("<I", data, at)[0] ^ 1)
    crc.write_bytes(bytes(data))
    refused(run_bounded("global-norm", crc, seconds=30), "CRC-32")


def test_fortran_order_compressed_member_is_not_held_twice(tmp_path: Path) -> None:
    # issue 22 item 8: a Fortran-order compressed member was held whole twice over (and a list of copies)
    a = np.zeros((4096, 8192), np.float32, order="F")  # 128 MB
    a[1, 0], a[0, 1] = 1, 2
    path = tmp_path / "f.npz"
    np.savez_compressed(path, a=a)
    # room for the tensor once (it needs 250 MB of address space; holding it twice or thrice, over 350)
    r = run_bounded("convert", path, "-o", tmp_path / "f.safetensors", seconds=60, memory_mb=300)
    assert r.returncode == 0, r
    got = safetensors.numpy.load_file(tmp_path / "f.safetensors")["a"]
    assert got[1, 0] == 1 and got[0, 1] == 2 and got.sum() == 3


@pytest.mark.parametrize("shape", [(3, 1, 5, 7), (1, 9), (6, 1), (2, 0, 3)])
def test_fortran_order_is_transposed_by_blocks(tmp_path: Path, shape: tuple[int, ...], monkeypatch) -> None:
    # issue 22 item 8: blocks of C-order rows (small blocks here) give the same bytes as a whole transposition
    from clipcli.checkpoint import write as checkpoint

    monkeypatch.setattr(checkpoint, "CHUNK_BYTES", 24)
    a = np.asfortranarray(np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape))
    npz_of(tmp_path / "f.npz", {"a.npy": npy(a)}, zipfile.ZIP_DEFLATED)
    with open_checkpoint(tmp_path / "f.npz") as ckpt:
        save(ckpt, tmp_path / "f.safetensors", ckpt.chunks)
    assert np.array_equal(safetensors.numpy.load_file(tmp_path / "f.safetensors")["a"], a)


# -- Huge numbers in headers ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "words"),
    [
        ("(" + "9" * 5000 + ",)", "a number of 5000 digits"),
        ("(" + "9" * 5000 + ", 0)", "a number of 5000 digits"),
        ("(0x" + "f" * 5000 + ",)", "<a 20000-bit number>"),
        ("(" + str(2**63) + ",)", str(2**63)),
    ],
)
@pytest.mark.parametrize("container", ["npy", "npz"])
def test_huge_npy_dimensions_are_refused(tmp_path: Path, shape: str, words: str, container: str) -> None:
    # issue 22 item 12: a shape of one 5,000-digit integer exited 70 (Python's int-to-str limit)
    member = npy_header(shape)
    if container == "npy":
        path = tmp_path / "big.npy"
        path.write_bytes(member)
    else:
        path = npz_of(tmp_path / "big.npz", {"big.npy": member})
    r = run_bounded("inspect", path, seconds=10)
    refused(r, words)
    assert "zip archive" not in r.stderr and len(r.stderr) < 400


def test_a_huge_safetensors_number_is_quoted_short(tmp_path: Path) -> None:
    # issue 22 item 12: a 4,000-digit dimension was quoted whole in the message
    header = {"a": {"dtype": "F32", "shape": [10**3999], "data_offsets": [0, 4]}}
    path = tmp_path / "big.safetensors"
    path.write_bytes(raw_safetensors(header, bytes(4)))
    r = run_bounded("inspect", path, seconds=10)
    refused(r, "number out of range")  # as the reference reader (serde_json) says of it
    assert len(r.stderr) < 400
    # past Python's int-to-str limit (4,300 digits), in a header laid out as the reference writer lays it out
    text = '{"a":{"dtype":"F32","shape":[' + "1" * 5000 + '],"data_offsets":[0,4]}}'
    over = tmp_path / "over.safetensors"
    over.write_bytes(struct.pack("<Q", len(text)) + text.encode() + bytes(4))
    r = run_bounded("inspect", over, seconds=10)
    refused(r, "number out of range")
    assert "digits" not in r.stderr and len(r.stderr) < 400
    # a dimension of 2**63 or more, in a tensor of 0 elements: no .npy (nor torch) could hold it
    edge = tmp_path / "edge.safetensors"
    edge.write_bytes(raw_safetensors({"a": {"dtype": "F32", "shape": [2**63, 0], "data_offsets": [0, 0]}}))
    refused(run_bounded("inspect", edge, seconds=10), "integers from 0 to 2**63 - 1, got [9223372036854775808, 0]")


def torch_zip(path: Path, data_pkl: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", data_pkl)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
    return path


def test_a_meta_tensor_of_a_huge_element_count_is_refused(tmp_path: Path) -> None:
    # issue 22 item 12: a meta tensor whose element count has 5,600 digits exited 70 when printed
    dims = [2**62] * 300
    size = b"(" + b"".join(b"\x8a\x08" + d.to_bytes(8, "little") for d in dims) + b"t"
    meta = b"ctorch._utils\n_rebuild_meta_tensor_no_storage\n(ctorch\nfloat32\n" + size + b"(" + b"K\x01" * 300
    data_pkl = b"\x80\x02}X\x01\x00\x00\x00w" + meta + b"t\x89tRs."
    path = torch_zip(tmp_path / "meta.pt", data_pkl)
    for command in ("inspect", "global-norm"):
        refused(run_bounded(command, path, seconds=10), "tensor w", "300 dimensions", "2**63")


# -- .npz member names that escape ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../../x", "/etc/x", "a/../../x", "a\\..\\..\\x", "C:x", "a\x00b"])
def test_npz_member_names_that_escape_are_refused(tmp_path: Path, name: str) -> None:
    # issue 22 item 25: `convert X -o out.npz` wrote members such as ../../x.npy from a tensor's name
    src = tmp_path / "src.safetensors"
    src.write_bytes(st_bytes({name: np.ones(2, np.float32), "ok/w": np.ones(2, np.float32)}))
    out = tmp_path / "out.npz"
    refused(run_bounded("convert", src, "-o", out, seconds=10), "outside the directory it is extracted into")
    assert not out.exists()
    r = run_bounded("convert", src, "-o", out, "--include", "ok/w", seconds=10)
    assert r.returncode == 0, r
    with zipfile.ZipFile(out) as z:
        assert z.namelist() == ["ok/w.npy"]


# -- Many shards, many tensors ---------------------------------------------------------------------------


def test_an_index_of_many_shards_is_grouped_once(tmp_path: Path) -> None:
    # issue 22 item 9: every shard re-scanned the whole weight map (quadratic in the shard count)
    n = 30_000
    weight_map = {f"w{i}": f"s{i}.safetensors" for i in range(n)}
    for shard in weight_map.values():
        (tmp_path / shard).touch()
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))

    class One:
        def __init__(self, name: str):
            self.name = name

    def open_file(path: Path):
        return {}, [One("w" + path.name[1 : -len(".safetensors")])]

    start = time.perf_counter()
    _, tensors, files, _ = _sharded.open_index(index, open_file)
    assert len(tensors) == len(files) == n
    assert time.perf_counter() - start < 5  # linear: well under a second; quadratic: about a minute


def test_writing_many_shards_groups_tensors_once(tmp_path: Path) -> None:
    # issue 22 item 9: the output plan scanned every tensor for every shard (12,001 shards: over 5 minutes)
    n = 20_000
    src = tmp_path / "src"
    files = [src / f"s{i}.safetensors" for i in range(n)]
    tensors = [TensorInfo(f"w{i}", "float32", (1,), 4, str(f), np.dtype(np.float32)) for i, f in enumerate(files)]
    ckpt = Checkpoint(src, "sharded", {}, tensors, files)
    start = time.perf_counter()
    layout = plan(ckpt, tmp_path / "out")
    assert time.perf_counter() - start < 5  # linear: well under a second
    assert [(f.name, [t.name for t in group]) for f, group in layout.files[:2]] == [
        ("s0.safetensors", ["w0"]),
        ("s1.safetensors", ["w1"]),
    ]


def million_style_header(path: Path, n: int) -> Path:
    header = {f"model.layers.{i}.mlp.weight": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}
              for i in range(n)}  # fmt: skip
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + np.ones(n, np.float32).tobytes())
    return path


def test_a_header_of_many_tensors_costs_little_memory_per_tensor(tmp_path: Path) -> None:
    # issue 22 item 9: a header of 1,000,000 tensors took 1.3 GB (about 1.4 KB a tensor) to open
    n = 100_000
    path = million_style_header(tmp_path / "many.safetensors", n)
    tracemalloc.start()
    try:
        with open_checkpoint(path) as ckpt:
            kept, peak = tracemalloc.get_traced_memory()
            assert len(ckpt.tensors) == n and ckpt.read(ckpt.tensors[-1]).tolist() == [1.0]
    finally:
        tracemalloc.stop()
    assert kept / n < 400 and peak / n < 650, (kept / n, peak / n)  # bytes a tensor (it was 420 and 1,000)


def test_header_objects_in_other_key_orders_and_shapes_still_read(tmp_path: Path) -> None:
    # issue 22 item 9: the compact parse of a tensor's object keeps every other object as the reference reads it
    header = {
        "b": {"shape": [2], "dtype": "F32", "data_offsets": [0, 8]},
        "a": {"dtype": "F16", "shape": [2, 1], "data_offsets": [8, 12]},
        "__metadata__": {"dtype": "F32", "shape": "[1]", "data_offsets": "x"},
    }
    path = tmp_path / "mixed.safetensors"
    path.write_bytes(raw_safetensors(header, bytes(12)))
    with open_checkpoint(path) as ckpt:
        assert [(t.name, t.dtype, t.shape) for t in ckpt.tensors] == [("b", "float32", (2,)), ("a", "float16", (2, 1))]
        assert ckpt.metadata["shape"] == "[1]"
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(raw_safetensors({"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, bytes(4)))
    refused(run_bounded("inspect", bad, seconds=10), "tensor dtype", "not a JSON object")
    pickle.dumps(ckpt.tensors)  # records with slots still go to worker processes


@pytest.mark.parametrize("cut", [6, 9, 20])
def test_a_stored_member_cut_short_is_read_within_its_own_bytes(tmp_path: Path, cut: int) -> None:
    # found by a red team: a member of b"\x93NUMPY" alone read its version from the next zip record ("PK":
    # "unknown .npy format version 80.75"); np.load refuses it as cut short too
    whole = io.BytesIO()
    np.save(whole, np.arange(3.0))
    path = tmp_path / "cut.npz"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("x.npy", whole.getvalue()[:cut])
        z.writestr("y.npy", whole.getvalue())
    with pytest.raises(ValueError):
        np.load(path)["x"]
    r = run_bounded("inspect", path)
    assert (r.returncode, r.stderr) == (3, f"clipcli: error: {path}: tensor x: truncated .npy header\n"), r
