"""`find_defects`: each structural defect planted in a file of every format is found and named by its kind, all
of them in one checkpoint, from headers and sizes alone; a clean checkpoint of every format has none."""

from __future__ import annotations

import io
import json
import struct
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from clipcli.checkpoint import find_defects, open_checkpoint
from clipcli.checkpoint.source import LocalStore
from clipcli.errors import FileTypeError, MalformedError, MissingFileError
from tests.helpers import DATA, dcp_checkpoint, pickle_ops, raw_safetensors, torch_view, torch_zip_file

W = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
B = np.linspace(-1, 1, 5)


def kinds(path: Path) -> list[tuple[str | None, str]]:
    """(tensor, kind) of each finding, in the order found."""
    return [(f.tensor, f.kind) for f in find_defects(path)[1]]


def sharded(d: Path, shards: dict[str, dict[str, np.ndarray]], weight_map: dict[str, str] | None = None) -> Path:
    """A directory of safetensors shards and its index (the weight map of the shards' own tensors by default)."""
    d.mkdir()
    for name, arrays in shards.items():
        save_file(arrays, str(d / name))
    if weight_map is None:
        weight_map = {t: name for name, arrays in shards.items() for t in arrays}
    (d / "m.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return d


def torch_file(path: Path) -> Path:
    storage = np.arange(6, dtype=np.float32)
    obj = {"w": torch_view("float32", 6, (2, 3), (3, 1))}
    return torch_zip_file(path, b"\x80\x02" + pickle_ops(obj) + b".", {"0": storage.tobytes()})


def clean(kind: str, tmp: Path) -> Path:
    if kind == "safetensors":
        save_file({"w": W, "b": B}, str(tmp / "m.safetensors"))
        return tmp / "m.safetensors"
    if kind == "sharded":
        return sharded(tmp / "shards", {"a.safetensors": {"w": W}, "b.safetensors": {"b": B}})
    if kind == "directory":
        d = tmp / "loose"
        d.mkdir()
        save_file({"w": W}, str(d / "a.safetensors"))
        save_file({"b": B}, str(d / "b.safetensors"))
        return d
    if kind == "npz":
        np.savez_compressed(tmp / "m.npz", w=W, b=B)
        return tmp / "m.npz"
    if kind == "npy":
        np.save(tmp / "w.npy", W)
        return tmp / "w.npy"
    if kind == "torch":
        return torch_file(tmp / "m.pt")
    assert kind == "dcp"
    rows = np.arange(24, dtype=np.float32).reshape(4, 6)
    return dcp_checkpoint(tmp / "dcp", {"w": ((4, 6), [((0, 0), rows[:2]), ((2, 0), rows[2:])])})


@pytest.mark.parametrize("kind", ["safetensors", "sharded", "directory", "npz", "npy", "torch", "dcp"])
def test_a_clean_checkpoint_has_no_defects(tmp_path: Path, kind: str) -> None:
    path = clean(kind, tmp_path)
    fmt, found = find_defects(path)
    assert found == []
    assert fmt == open_checkpoint(path).format.split("-")[0]


# -- safetensors: every reference rule, every violation ------------------------------------------------------


def test_safetensors_truncated_and_trailing(tmp_path: Path) -> None:
    save_file({"w": W}, str(tmp_path / "ok.safetensors"))
    data = (tmp_path / "ok.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-5])
    (tmp_path / "long.safetensors").write_bytes(data + b"\0" * 3)
    (tmp_path / "header.safetensors").write_bytes(data[:20])
    assert kinds(tmp_path / "cut.safetensors") == [(None, "truncated")]
    assert kinds(tmp_path / "long.safetensors") == [(None, "trailing-bytes")]
    assert kinds(tmp_path / "header.safetensors") == [(None, "truncated")]


def test_safetensors_every_violation_is_listed(tmp_path: Path) -> None:
    """A gap, an overlap, a wrong byte size, an unknown dtype and trailing bytes in one header: all named, where
    opening the file stops at the first."""
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "gap": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]},  # 8..12 left out
        "over": {"dtype": "F32", "shape": [2], "data_offsets": [14, 22]},  # overlaps gap
        "size": {"dtype": "F32", "shape": [3], "data_offsets": [22, 30]},  # 12 bytes declared, 8 held
        "odd": {"dtype": "X9", "shape": [1], "data_offsets": [30, 34]},
    }
    path = tmp_path / "bad.safetensors"
    path.write_bytes(raw_safetensors(header, b"\0" * 40))
    assert kinds(path) == [
        ("size", "header"),
        ("odd", "header"),
        ("gap", "gap"),
        ("over", "overlap"),
        (None, "trailing-bytes"),
    ]
    with pytest.raises(MalformedError):
        open_checkpoint(path)


def test_safetensors_first_tensor_not_at_zero_and_same_region_twice(tmp_path: Path) -> None:
    header = {
        "a": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]},
        "b": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]},
    }
    path = tmp_path / "twice.safetensors"
    path.write_bytes(raw_safetensors(header, b"\0" * 8))
    found = find_defects(path)[1]
    assert [(f.tensor, f.kind) for f in found] == [("a", "gap"), ("b", "overlap")]
    assert "must start at 0" in found[0].problem and found[0].file == str(path)


def test_a_file_that_is_no_checkpoint_is_refused_not_listed(tmp_path: Path) -> None:
    (tmp_path / "page.safetensors").write_bytes(b"<!doctype html><html>" + b" " * 100)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(FileTypeError):
        find_defects(tmp_path / "page.safetensors")
    with pytest.raises(FileTypeError):
        find_defects(tmp_path / "notes.txt")
    with pytest.raises(MissingFileError):
        find_defects(tmp_path / "nothing.safetensors")


# -- sharded ---------------------------------------------------------------------------------------------------


def test_sharded_missing_truncated_stray_and_disagreeing(tmp_path: Path) -> None:
    """Five defects in one sharded checkpoint, each named."""
    d = sharded(
        tmp_path / "s",
        {
            "m-1.safetensors": {"w": W, "extra": B},  # `extra` is in no weight map
            "m-2.safetensors": {"b": B},
            "m-3.safetensors": {"c": B},  # truncated below
            "m-4.safetensors": {"w": W, "z": B},  # `w` again
            "m-5.safetensors": {"y": B},  # in no weight map
        },
        {"w": "m-1.safetensors", "b": "m-2.safetensors", "gone": "m-2.safetensors", "c": "m-3.safetensors"}
        | {"x": "missing.safetensors", "z": "m-4.safetensors"},
    )
    data = (d / "m-3.safetensors").read_bytes()
    (d / "m-3.safetensors").write_bytes(data[:-4])
    found = find_defects(d)[1]
    got = {(Path(f.file).name, f.tensor, f.kind) for f in found}
    assert got == {
        ("m.safetensors.index.json", None, "missing-shard"),
        ("m.safetensors.index.json", "gone", "not-in-shard"),
        ("m-3.safetensors", None, "truncated"),
        ("m-1.safetensors", "extra", "not-in-index"),
        ("m-4.safetensors", "w", "duplicate"),
        ("m-5.safetensors", None, "stray-shard"),
    }
    assert len(found) == len(got)
    with pytest.raises(MalformedError):  # opening stops at the first
        open_checkpoint(d / "m.safetensors.index.json")


def test_sharded_wrong_shard_and_bad_shard(tmp_path: Path) -> None:
    d = sharded(tmp_path / "s", {"a.safetensors": {"w": W}, "b.safetensors": {"b": B}}, {"w": "b.safetensors"})
    (d / "b.safetensors").write_bytes(b"<html>" + b" " * 100)  # not a safetensors file at all
    swapped = {"w": "b.safetensors", "b": "a.safetensors"}
    d2 = sharded(tmp_path / "t", {"a.safetensors": {"w": W}, "b.safetensors": {"b": B}}, swapped)
    assert set(kinds(d)) == {(None, "bad-shard"), (None, "stray-shard")}
    assert set(kinds(d2)) == {("w", "not-in-shard"), ("b", "not-in-shard"), ("w", "wrong-shard"), ("b", "wrong-shard")}


def test_a_directory_of_shards_without_index_holding_a_tensor_twice(tmp_path: Path) -> None:
    d = tmp_path / "loose"
    d.mkdir()
    save_file({"w": W}, str(d / "a.safetensors"))
    save_file({"w": W, "b": B}, str(d / "b.safetensors"))
    save_file({"c": B}, str(d / "c.safetensors"))
    data = (d / "c.safetensors").read_bytes()
    (d / "c.safetensors").write_bytes(data + b"x")
    assert kinds(d) == [(None, "trailing-bytes"), ("w", "duplicate")]


def test_an_empty_file_among_loose_shards_is_a_finding(tmp_path: Path) -> None:
    # found trying it: an empty .safetensors beside the others ended verify with status 3, as if none was there
    d = tmp_path / "loose"
    d.mkdir()
    save_file({"w": W}, str(d / "a.safetensors"))
    (d / "b.safetensors").write_bytes(b"")
    assert kinds(d) == [(None, "bad-shard")]


def test_a_malformed_index(tmp_path: Path) -> None:
    d = sharded(tmp_path / "s", {"a.safetensors": {"w": W}})
    (d / "m.safetensors.index.json").write_text("{not json")
    assert kinds(d) == [(None, "index")]


# -- zip members' CRCs ---------------------------------------------------------------------------------------


def flip(path: Path, member: str, at: int | None = None) -> None:
    """Flips one bit of a member's stored bytes, `at` bytes into them (by default half-way: its CRC-32 no longer
    matches)."""
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(member)
    at = info.compress_size // 2 if at is None else at
    data = bytearray(path.read_bytes())
    local = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    data[info.header_offset + 30 + sum(local) + at] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_npz_member_crc(tmp_path: Path, save) -> None:
    path = tmp_path / "m.npz"
    save(path, w=np.arange(1000, dtype=np.float32), b=B)
    flip(path, "w.npy")
    found = find_defects(path)[1]
    assert [(f.tensor, f.kind) for f in found] in ([("w", "crc")], [("w", "zip-member")])
    assert "w.npy" in found[0].problem
    if save is np.savez:  # a stored member: the flipped bit is a value, and only the CRC tells
        assert found[0].kind == "crc"
        assert open_checkpoint(path).format == "npz"


# found in review: a damaged storage's finding had "tensor": null; a damaged data.pkl was "malformed"
def test_pt_member_crc(tmp_path: Path) -> None:
    path = torch_file(tmp_path / "m.pt")
    flip(path, "archive/data/0", 5)
    found = find_defects(path)[1]
    assert [(f.tensor, f.kind) for f in found] == [("w", "crc")]
    assert "archive/data/0" in found[0].problem


def test_pt_shared_storage_crc_names_every_tensor_on_it(tmp_path: Path) -> None:
    """tied.pt (torch wrote it): emb.weight and head.weight on storage 0."""
    path = tmp_path / "tied.pt"
    path.write_bytes((DATA / "torch" / "tied.pt").read_bytes())
    flip(path, "tied/data/0")
    found = find_defects(path)[1]
    assert [(f.tensor, f.kind) for f in found] == [("emb.weight", "crc"), ("head.weight", "crc")]
    assert all("tied/data/0" in f.problem for f in found)


@pytest.mark.parametrize("at", [0, None])
def test_pt_data_pkl_crc_is_a_crc_defect(tmp_path: Path, at: int | None) -> None:
    path = tmp_path / "tied.pt"
    path.write_bytes((DATA / "torch" / "tied.pt").read_bytes())
    flip(path, "tied/data.pkl", at)
    found = find_defects(path)[1]
    assert [(f.tensor, f.kind) for f in found] == [(None, "crc")]
    assert found[0].problem == "member tied/data.pkl: Bad CRC-32 for the member (it is damaged)"
    with pytest.raises(MalformedError, match=r"tied\.pt: member tied/data\.pkl: Bad CRC-32 for the member"):
        open_checkpoint(path)


def test_npz_and_pt_defects_that_opening_refuses(tmp_path: Path) -> None:
    np.savez(tmp_path / "m.npz", w=W)
    data = (tmp_path / "m.npz").read_bytes()
    (tmp_path / "m.npz").write_bytes(data[: len(data) // 2])
    assert [k for _, k in kinds(tmp_path / "m.npz")] == ["malformed"]


# -- distributed checkpoints ---------------------------------------------------------------------------------


def test_dcp_missing_file(tmp_path: Path) -> None:
    d = clean("dcp", tmp_path)
    (d / "__0_0.distcp").unlink()
    found = find_defects(d)[1]
    assert [(f.tensor, f.kind) for f in found] == [("w", "missing-file")]
    assert "__0_0.distcp" in found[0].problem


def test_dcp_short_file(tmp_path: Path) -> None:
    d = clean("dcp", tmp_path)
    data = (d / "__0_0.distcp").read_bytes()
    (d / "__0_0.distcp").write_bytes(data[:-10])
    assert kinds(d) == [("w", "short-file")]


def test_dcp_gap_overlap_and_a_region_twice_all_listed(tmp_path: Path) -> None:
    rows = np.arange(24, dtype=np.float32).reshape(4, 6)
    d = dcp_checkpoint(
        tmp_path / "dcp",
        {
            "gap": ((4, 6), [((0, 0), rows[:2])]),  # rows 2..4 in no chunk
            "over": ((3, 6), [((0, 0), rows[:2] + 100), ((1, 0), rows[2:] + 100)]),  # row 1 twice, none of row 2
            "fine": ((4, 6), [((0, 0), rows[:2] + 200), ((2, 0), rows[2:] + 200)]),
            "tied": ((2, 6), [((0, 0), rows[:2] + 200)]),  # the same bytes as fine's first chunk
        },
    )
    found = find_defects(d)[1]
    assert [(f.tensor, f.kind) for f in found] == [
        ("gap", "chunk-gap"),
        ("over", "chunk-overlap"),
        ("tied", "region-twice"),
    ]
    assert "fine" in found[2].problem and found[2].file == str(d / "__0_0.distcp")


# -- only headers and sizes ----------------------------------------------------------------------------------


class _Counted(io.RawIOBase):
    def __init__(self, f: io.FileIO, counter: list[int]):
        self.f, self.counter = f, counter

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)

    def tell(self) -> int:
        return self.f.tell()

    def fileno(self) -> int:
        return self.f.fileno()

    def readinto(self, buffer) -> int:
        n = self.f.readinto(buffer)
        self.counter[0] += n or 0
        return n

    def close(self) -> None:
        self.f.close()
        super().close()


class CountingStore(LocalStore):
    """The file system, counting every byte read through it."""

    def __init__(self) -> None:
        super().__init__()
        self.counter = [0]

    def open(self, path: Path):
        return io.BufferedReader(_Counted(io.FileIO(path, "rb"), self.counter), 4096)

    def source(self, path):
        raise AssertionError("no ranged read of tensor data")


@pytest.mark.parametrize("kind", ["file", "sharded"])
def test_no_tensor_data_is_read(tmp_path: Path, kind: str) -> None:
    big = {f"t{i}": np.full(50_000, i, np.float32) for i in range(10)}  # 2 MB of values
    if kind == "file":
        save_file(big, str(tmp_path / "m.safetensors"))
        path = tmp_path / "m.safetensors"
    else:
        path = sharded(tmp_path / "s", {f"m-{i}.safetensors": {n: a} for i, (n, a) in enumerate(big.items())})
    store = CountingStore()
    assert find_defects(path, store)[1] == []
    assert 0 < store.counter[0] < 3 * 4096 * 11  # a few buffers' worth per file (of 200 kB of values each)


# -- files real torch writes (skipped without torch) -----------------------------------------------------------


def test_torch_save_then_a_flipped_storage_byte(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    path = tmp_path / "m.pt"
    torch.save({"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3)}, path)
    assert find_defects(path)[1] == []
    with zipfile.ZipFile(path) as z:
        storage = next(i.filename for i in z.infolist() if "/data/" in i.filename and i.file_size == 4000)
    flip(path, storage)
    found = find_defects(path)[1]
    assert [(f.kind, storage in f.problem) for f in found] == [("crc", True)]


def test_torch_dcp_save_then_a_missing_file(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    d = tmp_path / "dcp"
    with warnings.catch_warnings():  # torch warns that it saves in one process
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(2)}, checkpoint_id=str(d))
    assert find_defects(d) == ("distcp", [])
    for f in d.glob("*.distcp"):
        f.unlink()
    assert sorted((f.tensor, f.kind) for f in find_defects(d)[1]) == [("b", "missing-file"), ("w", "missing-file")]


@pytest.mark.parametrize("name", ["tied.pt", "script/nested.pt", "adam_legacy.pt"])
def test_verify_parses_a_pytorch_files_pickle_once(monkeypatch, name):
    # gh-24: verify without --values parsed each pickle twice (its structure, then the audit), ~+7%
    from clipcli.checkpoint.formats import _torch_zip, torch
    from clipcli.commands.verify import verify

    parsed = []
    for module, which in ((_torch_zip, "unpickle"), (torch, "unpickle_at")):
        real = getattr(module, which)
        monkeypatch.setattr(module, which, lambda *a, _real=real, **k: parsed.append(1) or _real(*a, **k))
    path = Path(__file__).parents[1] / "data" / "torch" / name
    with open_checkpoint(path):
        once = len(parsed)  # what opening it parses: its pickles, each once
    parsed.clear()
    report = verify(path)
    assert report.findings == () and len(parsed) == once
