"""Every format reads its bytes through a `Store`: the format matrix read from memory gives what the files give,
and a source that fails half-way gives one error line (exit 3), with no format knowing where bytes come from."""

from __future__ import annotations

import errno
import io
import json
import shutil
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from clipcli.checkpoint import Checkpoint, open_checkpoint
from clipcli.checkpoint.source import MemorySource, MemoryStore
from clipcli.errors import ClipcliError, ExitStatus
from tests.helpers import dcp_checkpoint, pickle_ops, torch_legacy, torch_tensor_pickle, torch_view, torch_zip_file

FORMATS = ["safetensors", "sharded", "npz-stored", "npz-deflated", "npy", "torch-zip", "torch-legacy", "dcp"]
W = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
B = np.linspace(-1, 1, 5)


def make(kind: str, tmp: Path) -> Path:
    """A checkpoint of `kind` in `tmp`, written by hand or by the format's own library."""
    if kind == "safetensors":
        save_file({"w": W, "b": B}, str(tmp / "m.safetensors"), metadata={"format": "np"})
        return tmp / "m.safetensors"
    if kind == "sharded":
        d = tmp / "shards"
        d.mkdir()
        save_file({"w": W}, str(d / "a.safetensors"))
        save_file({"b": B}, str(d / "b.safetensors"))
        weight_map = {"w": "a.safetensors", "b": "b.safetensors"}
        (d / "m.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        return d
    if kind.startswith("npz"):
        save = np.savez_compressed if kind == "npz-deflated" else np.savez
        save(tmp / "m.npz", w=W, b=B.astype(">f8"), f=np.asfortranarray(W))
        return tmp / "m.npz"
    if kind == "npy":
        np.save(tmp / "w.npy", W)
        return tmp / "w.npy"
    if kind == "torch-zip":
        storage = np.arange(6, dtype=np.float32)
        obj = {"w": torch_view("float32", 6, (2, 3), (3, 1)), "t": torch_view("float32", 6, (3, 2), (1, 3))}
        return torch_zip_file(tmp / "m.pt", b"\x80\x02" + pickle_ops(obj) + b".", {"0": storage.tobytes()})
    if kind == "torch-legacy":
        obj = b"\x80\x02}X\x01\x00\x00\x00w" + torch_tensor_pickle(legacy=True) + b"s."
        return torch_legacy(tmp / "m.pt", obj, {"0": struct.pack("<4f", 1.0, -2.0, 3.0, 0.5)})
    assert kind == "dcp"
    rows = np.arange(24, dtype=np.float32).reshape(4, 6)
    return dcp_checkpoint(tmp / "dcp", {"w": ((4, 6), [((0, 0), rows[:2]), ((2, 0), rows[2:])])})


def contents(ckpt) -> tuple:
    """What a checkpoint holds: its format, metadata, and each tensor's name, type, shape and values."""
    tensors = [(t.name, t.dtype, t.shape, ckpt.read(t).tobytes()) for t in ckpt.tensors]
    return ckpt.format, ckpt.metadata, tensors


@pytest.mark.parametrize("kind", FORMATS)
def test_a_checkpoint_in_memory_reads_as_from_its_files(tmp_path: Path, kind: str) -> None:
    path = make(kind, tmp_path)
    with open_checkpoint(path) as ckpt:
        expected = contents(ckpt)
    store = MemoryStore.copy_of([path])
    shutil.rmtree(path) if path.is_dir() else path.unlink()  # nothing left to read but the store
    with open_checkpoint(path, store) as ckpt:
        assert contents(ckpt) == expected
        assert ckpt.store is store


class FailingSource(MemorySource):
    """A source whose reads past the middle of the file fail, as a network or a disk might."""

    def read_into(self, offset: int, view: memoryview) -> int:
        if offset + len(view) > self.size() // 2:
            raise OSError(errno.EIO, "Input/output error", self.name)
        return super().read_into(offset, view)


@pytest.mark.parametrize("kind", FORMATS)
def test_a_source_that_fails_half_way_is_one_error_line(tmp_path: Path, kind: str) -> None:
    path = make(kind, tmp_path)
    store = MemoryStore.copy_of([path], FailingSource)
    with pytest.raises(ClipcliError) as caught, open_checkpoint(path, store) as ckpt:
        for t in ckpt.tensors:
            ckpt.read(t)
    e = caught.value
    assert e.status == ExitStatus.BAD_INPUT, (type(e), str(e))
    assert "\n" not in str(e) and str(e)


def test_a_memory_store_lists_directories_as_the_file_system(tmp_path: Path) -> None:
    d = make("sharded", tmp_path)
    store = MemoryStore.copy_of([d])
    assert store.kind(d) == "directory" and store.kind(d / "a.safetensors") == "file"
    assert store.kind(d / "missing") is None
    assert store.list(d) == sorted(d.iterdir())


def test_a_zip_reads_through_a_file_object_over_a_source(tmp_path: Path) -> None:
    path = make("npz-deflated", tmp_path)
    store = MemoryStore.copy_of([path])
    with store.open(path) as f, zipfile.ZipFile(f) as z:
        assert sorted(z.namelist()) == ["b.npy", "f.npy", "w.npy"]


class _Sums:
    """A kernel: each tensor's values summed by offset, so that any sharing of chunks gives the same result."""

    def __init__(self) -> None:
        self.parts: dict[tuple[str, int], float] = {}

    def chunk(self, t, offset: int, values: np.ndarray) -> None:
        self.parts[(t.name, offset)] = float(np.sum(values, dtype=np.float64))

    def result(self) -> dict[tuple[str, int], float]:
        return self.parts


@pytest.mark.parametrize("kind", ["torch-zip", "npz-stored", "dcp"])
def test_forked_workers_read_through_the_store(tmp_path: Path, kind: str, monkeypatch) -> None:
    from clipcli.checkpoint import engine

    monkeypatch.setattr(engine, "SMALL_TENSOR", -1)  # every tensor a task of its own
    monkeypatch.setattr(engine, "_BYTES_PER_WORKER", 1)
    path = make(kind, tmp_path)
    store = MemoryStore.copy_of([path])
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    results = {}
    for how in ("inline", "threads", "processes"):
        with open_checkpoint(path, store) as ckpt:
            numeric = [t for t in ckpt.tensors if t.array_dtype is not None]
            parts = engine.run(ckpt, numeric, _Sums, jobs=2, kind=how, unit=1)
        results[how] = {k: v for part in parts for k, v in part.items()}
    assert results["inline"] and results["inline"] == results["threads"] == results["processes"]


class BytesStore(MemoryStore):
    """A store of one's own whose files open as plain in-memory file objects (no descriptor, no source)."""

    def open(self, path: Path):
        return io.BytesIO(self.files[Path(path)])


@pytest.mark.parametrize("kind", FORMATS)
def test_a_store_may_open_files_as_any_seekable_file_object(tmp_path: Path, kind: str) -> None:
    # found by a new user: a Store whose `open` returned io.BytesIO failed with "cannot read: fileno"
    path = make(kind, tmp_path)
    with open_checkpoint(path) as ckpt:
        expected = contents(ckpt)
    store = BytesStore.copy_of([path])
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    with open_checkpoint(path, store) as ckpt:
        assert contents(ckpt) == expected


_told: list[int] = []  # where each read of a `ReadingOn` source may go on to


class ReadingOn(MemorySource):
    """A source that reads ahead (as a remote one does), recording where each read may go on to."""

    def read_within(self, offset: int, view: memoryview, end: int) -> int:
        _told.append(end)
        return self.read_into(offset, view)


def _three_reading_on(tmp_path: Path) -> Checkpoint:
    """A checkpoint of tensors a, b, c (4 values each, 0, 1, 2) on a `ReadingOn` store."""
    path = tmp_path / "m.safetensors"
    save_file({k: np.full(4, i, np.float32) for i, k in enumerate("abc")}, str(path))
    return open_checkpoint(path, MemoryStore.copy_of([path], ReadingOn))


def test_a_source_that_reads_ahead_is_told_where_the_reads_in_order_go_on_to(tmp_path: Path) -> None:
    # the plan is worked out when such a source first asks, so a local run never builds it: each new plan counts
    with _three_reading_on(tmp_path) as ckpt:
        a, b, c = sorted(ckpt.tensors, key=lambda t: t.location.offset)
        end = {t.name: t.location.offset + t.nbytes for t in (a, b, c)}
        for plan, reads, expected in (
            ([a, b], [a, b, c], [end["b"], end["b"], end["c"]]),  # c, not in the plan: its own end
            ([b, c], [a, b], [end["a"], end["c"]]),
            ((), [a], [end["a"]]),
        ):
            ckpt.will_read(plan)
            _told.clear()
            for t in reads:
                assert ckpt.read(t).tolist() == [float("abc".index(t.name))] * 4
            assert _told == expected


def test_a_source_that_reads_ahead_is_told_to_stop_where_another_part_starts(tmp_path: Path) -> None:
    # engine.in_parts: workers reading on in parts of a file of their own, a read stops before the next part
    with _three_reading_on(tmp_path) as ckpt:
        a, b, c = sorted(ckpt.tensors, key=lambda t: t.location.offset)
        ckpt.will_read([a, b, c], [(a.file, b.location.offset + 8), ("other", a.location.offset + 4)])
        _told.clear()
        for t in (a, b, c):
            ckpt.read(t)
        assert _told == [b.location.offset + 8] * 2 + [c.location.offset + c.nbytes]
