"""`clipcli hash`: the manifest on the command line, its formats, its exits, and the library's same report."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import struct

import numpy as np
import pytest

import clipcli
from clipcli.checkpoint import engine as _engine
from tests.helpers import DATA, SAMPLES, WRITTEN_BY_TORCH, js, ok, run, write_st


def ref_hash(a: np.ndarray) -> str:
    name = a.dtype.name.encode()
    head = struct.pack("<Q", len(name)) + name + struct.pack("<Q", a.ndim) + struct.pack(f"<{a.ndim}q", *a.shape)
    return hashlib.sha256(head + np.ascontiguousarray(a, a.dtype.newbyteorder("<")).tobytes()).hexdigest()


@pytest.fixture
def ckpt(tmp_path):
    rng = np.random.default_rng(7)
    tensors = {
        "a.weight": rng.standard_normal((200, 300)).astype(np.float32),
        "a.bias": rng.standard_normal(300).astype(np.float32),
        "b.weight": rng.standard_normal((150, 80)),
        "step": np.array(3, np.int64),
    }
    return write_st(tmp_path / "m.safetensors", tensors), tensors


def test_json_is_the_manifest(ckpt):
    path, tensors = ckpt
    out = js("hash", path)
    assert out["schema"] == 1 and out["command"] == "hash"
    [c] = out["checkpoints"]
    assert set(c) == {"path", "format", "hash", "tensors", "skipped"}
    assert c["path"] == str(path) and c["format"] == "safetensors" and c["skipped"] == []
    assert sorted(c["tensors"], key=lambda t: t["name"]) == [
        {"name": n, "dtype": a.dtype.name, "shape": list(a.shape), "sha256": ref_hash(a)}
        for n, a in sorted(tensors.items())
    ]


def test_jobs_give_the_same_json_bytes(ckpt, monkeypatch):
    monkeypatch.setattr(_engine, "CHUNK_BYTES", 1 << 13)
    monkeypatch.setattr(_engine, "_MIN_CHUNK", 1 << 13)
    monkeypatch.setattr(_engine, "_BYTES_PER_WORKER", 1)
    path, _ = ckpt
    outs = {ok("hash", path, "--jobs", j, "--format", "json").stdout for j in (1, 2, 8)}
    assert len(outs) == 1


def test_library_report_is_the_json(ckpt, monkeypatch):
    path, _ = ckpt
    monkeypatch.chdir(path.parent)
    report = clipcli.hash_of(path.name, include="a.*", sort="name", top=1)
    assert report.to_dict() == js("hash", path.name, "--include", "a.*", "--sort", "name", "--top", "1")
    assert [t["name"] for t in report.to_dict()["checkpoints"][0]["tensors"]] == ["a.bias"]


def test_the_same_checkpoint_hash_across_formats_on_the_command_line():
    out = js("hash", SAMPLES / "grads.safetensors", SAMPLES / "pytorch_model.bin")
    a, b = out["checkpoints"]
    assert a["hash"] == b["hash"] and a["tensors"] == b["tensors"]


def test_table_and_csv(ckpt):
    path, tensors = ckpt
    text = ok("hash", path).stdout
    whole = js("hash", path)["checkpoints"][0]["hash"]
    assert text.splitlines()[0] == f"{path}: safetensors, 4 tensors hashed"
    assert text.splitlines()[1] == f"checkpoint hash {whole}"
    assert all(ref_hash(a) in text for a in tensors.values())
    rows = list(csv.reader(io.StringIO(ok("hash", path, "--format", "csv").stdout)))
    assert rows[0] == ["path", "name", "dtype", "shape", "sha256", "kind"]
    assert [str(path), "a.weight", "float32", "200x300", ref_hash(tensors["a.weight"]), "tensor"] in rows
    assert len(rows) == 1 + 4 + 1
    assert rows[-1] == [str(path), "", "", "", whole, "checkpoint"]


def test_text_is_hashed_as_stored_and_tensors_without_values_are_skipped_with_the_reason(tmp_path):
    path = tmp_path / "mixed.npz"
    np.savez(path, text=np.array(["ab", "c"]), x=np.arange(3.0))
    c = js("hash", path)["checkpoints"][0]
    assert [(t["name"], t["dtype"]) for t in c["tensors"]] == [("text", "U2"), ("x", "float64")]
    assert c["skipped"] == []
    special = js("hash", DATA / "torch" / "special.pt")["checkpoints"][0]
    reasons = {s["name"]: s["reason"] for s in special["skipped"]}
    assert reasons["quantized"] == "quantized tensor (torch.per_tensor_affine)" and "meta" in reasons
    assert "skipped quantized (qint8): quantized tensor" in ok("hash", DATA / "torch" / "special.pt").stdout


def test_bad_input_exits_3_with_one_line(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    result = run("hash", bad)
    assert result.exit_code == 3
    assert result.stderr.startswith("clipcli: error: ") and result.stderr.count("\n") == 1
    assert run("hash", tmp_path / "missing.safetensors").exit_code == 3


def test_a_truncated_file_exits_3(ckpt):
    path, _ = ckpt
    path.write_bytes(path.read_bytes()[:-10])
    result = run("hash", path)
    assert result.exit_code == 3 and result.stderr.count("\n") == 1


def test_an_empty_selection_is_a_usage_error(ckpt):
    path, _ = ckpt
    result = run("hash", path, "--include", "nothing.*")
    assert result.exit_code == 2 and "nothing.*" in result.stderr


def test_help_has_examples():
    text = ok("hash", "--help").stdout
    assert "Examples:" in text and "clipcli hash model.safetensors" in text


def test_json_parses_strictly(ckpt):
    path, _ = ckpt
    json.loads(ok("hash", path, "--format", "json").stdout, parse_constant=lambda c: pytest.fail(c))


READ_BY_TORCH = WRITTEN_BY_TORCH


@pytest.mark.parametrize("path", READ_BY_TORCH, ids=lambda p: p.name)
def test_files_torch_wrote_hash_as_their_values_read_whole(path, tmp_path):
    # views, tied weights, big-endian and legacy files, distributed checkpoints: streamed hashes against
    # hashlib over the values `read` gives (another read path), and the same after a conversion
    report = clipcli.hash_of(path).to_dict()["checkpoints"][0]
    with clipcli.open(path) as ckpt:
        assert {t["name"]: t["sha256"] for t in report["tensors"]} == {
            t["name"]: ref_hash(ckpt.read(t["name"])) for t in report["tensors"]
        }
    if report["tensors"] and all(t["dtype"] != "complex128" for t in report["tensors"]):
        out = tmp_path / "c.safetensors"
        names = [t["name"] for t in report["tensors"]]
        clipcli.convert_of(path, out, include=names, drop_metadata=True)
        assert clipcli.hash_of(out).to_dict()["checkpoints"][0]["hash"] == report["hash"]
