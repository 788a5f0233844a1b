"""PyTorch files through the commands: norms, inspect, clipping and convert against what real torch saved.

The corpus in tests/data/torch was made by real torch (make_torch_files.py); each file's .json holds what
torch read from it: names, dtypes, shapes, the SHA-256 of each tensor's C-order bytes and its norm summed
exactly (math.fsum). torch itself is not needed here.
"""

from __future__ import annotations

import hashlib
import json
import math
import pickle
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from tests.helpers import ROOT, SAMPLES, js, ok, pickletools_calls, run

DATA = ROOT / "tests" / "data" / "torch"
CORPUS = sorted(p for p in DATA.iterdir() if p.suffix in (".pt", ".pth", ".bin", ".ckpt"))
# what .safetensors cannot hold (complex128) and what has no values (skipped), left out of conversions
NOT_CONVERTIBLE = {"cplx128"}


def expected(path: Path) -> dict:
    return json.loads(path.with_name(path.name + ".json").read_text())


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.name)
def test_norms_names_shapes_and_dtypes_are_torchs(path):
    want = {t["name"]: t for t in expected(path)["tensors"]}
    listing = js("inspect", path)["checkpoints"][0]
    got = {t["name"]: t for t in listing["tensors"]}
    assert {n: (t["dtype"], t["shape"]) for n, t in got.items() if n in want} == {
        n: (t["dtype"], t["shape"]) for n, t in want.items()
    }
    assert listing["metadata"] == expected(path)["metadata"]
    (c,) = js("global-norm", path, "--ord", "2")["checkpoints"]
    for row in c["tensors"]:
        reference = want[row["name"]]["norm"]
        assert row["norm"] == pytest.approx(reference, rel=1e-13, abs=0), row["name"]


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.name)
def test_convert_to_safetensors_keeps_every_value_bit_for_bit(path, tmp_path):
    want = expected(path)
    skipped = {s["name"] for s in want["skipped"]} | NOT_CONVERTIBLE
    out = tmp_path / "out.safetensors"
    excludes = [arg for name in sorted(skipped) for arg in ("--exclude", name)]
    listing = [t["name"] for t in js("inspect", path)["checkpoints"][0]["tensors"]]
    if not set(listing) - skipped:
        pytest.skip("nothing to convert")
    ok("convert", path, "-o", out, *excludes, "--quiet")
    with safe_open(out, "np") as f:
        names = list(f.keys())
        metadata = f.metadata() or {}
    shas = {t["name"]: t["sha256"] for t in want["tensors"] if t["name"] not in skipped}
    assert sorted(names) == sorted(shas)
    assert metadata == want["metadata"]
    raw = out.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    for name, sha in shas.items():
        begin, end = header[name]["data_offsets"]
        assert hashlib.sha256(raw[8 + header_len + begin : 8 + header_len + end]).hexdigest() == sha, name


def test_tied_weights_are_reported_and_written_as_copies(tmp_path):
    out = tmp_path / "tied.safetensors"
    table = ok("convert", DATA / "tied.pt", "-o", out).stdout
    assert "tied: emb.weight, head.weight (written as separate copies)" in table
    assert js("inspect", DATA / "tied.pt")["checkpoints"][0]["shared_storage"] == [["emb.weight", "head.weight"]]
    assert "tied: emb.weight, head.weight (one storage in the file)" in ok("global-norm", DATA / "tied.pt").stdout
    with safe_open(out, "np") as f:
        np.testing.assert_array_equal(f.get_tensor("emb.weight"), f.get_tensor("head.weight"))


def test_sparse_and_quantized_tensors_are_listed_and_skipped_with_the_reason(tmp_path):
    (c,) = js("global-norm", DATA / "special.pt")["checkpoints"]
    reasons = {s["name"]: s["reason"] for s in c["skipped"]}
    assert reasons["sparse_coo"] == "sparse tensor (torch.sparse_coo)"
    assert reasons["quantized"].startswith("quantized tensor")
    result = run("convert", DATA / "special.pt", "-o", tmp_path / "o.safetensors")
    assert (
        result.exit_code == 3
        and "tensor sparse_coo: clipcli cannot write this tensor's values: sparse tensor (torch.sparse_coo)"
        in result.stderr
    )
    assert "clipcli convert with --exclude sparse_coo writes the other tensors" in result.stderr
    assert not (tmp_path / "o.safetensors").exists()


def test_skipped_tensors_with_a_storage_report_its_bytes():
    # gh-24: a quantized tensor was listed with nbytes 0; torch 2.13's `t.numel() * t.element_size()` gives these
    torch_nbytes = {"dense": 8, "quantized": 4, "quantized_channel": 6, "half_complex": 8, "conjugate": 24}
    (c,) = js("inspect", DATA / "special.pt")["checkpoints"]
    rows = {t["name"]: t["nbytes"] for t in c["tensors"]}
    assert {k: rows[k] for k in torch_nbytes} == torch_nbytes
    assert rows["meta"] == rows["sparse_coo"] == rows["nested"] == 0  # no dense storage of their own in the file
    assert c["nbytes"] == sum(rows.values())


def test_convert_refuses_what_would_be_lost(tmp_path):
    result = run("convert", DATA / "model_state.pt", "-o", tmp_path / "m.safetensors")
    assert result.exit_code == 3 and "tensor cplx128: safetensors has no dtype for complex128" in result.stderr
    result = run("convert", DATA / "adam.pt", "-o", tmp_path / "adam.npz")
    assert result.exit_code == 3
    assert "the metadata (16 entries: param_groups.0.lr" in result.stderr and "has no place in an .npz" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_convert_shards_and_merges_back(tmp_path):
    source = DATA / "nested.pt"
    ok("convert", source, "-o", tmp_path / "shards", "--max-shard-size", "40", "--quiet")
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in (tmp_path / "shards").glob("*.safetensors"))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert set(index["weight_map"].values()) == set(shards) and index["metadata"]["total_size"] == 72
    for shard in shards:
        assert (tmp_path / "shards" / shard).stat().st_size - 8 < 40 + 1024  # data at most 40 bytes a shard
    ok("convert", tmp_path / "shards", "-o", tmp_path / "merged.safetensors", "--quiet")
    before = js("global-norm", source)["checkpoints"][0]
    after = js("global-norm", tmp_path / "merged.safetensors")["checkpoints"][0]
    assert [(t["name"], t["norm"]) for t in before["tensors"]] == [(t["name"], t["norm"]) for t in after["tensors"]]


@pytest.mark.parametrize("size", ["0", "-5GB", "five", "5XB"])
def test_max_shard_size_must_be_a_size(tmp_path, size):
    result = run("convert", DATA / "nested.pt", "-o", tmp_path / "s", "--max-shard-size", size)
    assert result.exit_code == 2 and "--max-shard-size" in result.stderr


def test_convert_dry_run_checks_and_writes_nothing(tmp_path):
    table = ok("convert", DATA / "tied.pt", "-o", tmp_path / "o.safetensors", "--dry-run").stdout
    assert "dry run, nothing written" in table and not list(tmp_path.iterdir())
    result = run("convert", DATA / "model_state.pt", "-o", tmp_path / "o.safetensors", "--dry-run")
    assert result.exit_code == 3


def test_clipping_a_pytorch_file_writes_safetensors(tmp_path):
    out = tmp_path / "clipped.safetensors"
    (c,) = js("clip-global-norm", DATA / "grads.pt", "-o", out, "--clip-norm", "1")["checkpoints"]
    assert c["global_norm_after"] == pytest.approx(1.0, rel=1e-6)
    assert js("global-norm", out)["checkpoints"][0]["global_norm"] == c["global_norm_after"]
    # since issue 24 item 6, .pt too (tests/checkpoint/test_torch_write.py)
    (c,) = js("clip-global-norm", DATA / "grads.pt", "-o", tmp_path / "clipped.pt", "--clip-norm", "1")["checkpoints"]
    assert js("global-norm", tmp_path / "clipped.pt")["checkpoints"][0]["global_norm"] == c["global_norm_after"]


class _RunsCode:
    """A pickle payload that would create a file if it were ever loaded by pickle."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _torch_zip(path: Path, payload: bytes) -> None:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", payload)
        z.writestr("archive/version", "3\n")


def _torch_legacy(path: Path, payload: bytes) -> None:
    """The legacy format's three leading pickles (magic number, protocol, system info), the payload, and the
    list of storage keys (none)."""
    head = [0x1950A86A20F9469CFC6C, 1001, {"protocol_version": 1001, "little_endian": True}]
    path.write_bytes(b"".join(pickle.dumps(x, protocol=2) for x in head) + payload + pickle.dumps([], protocol=2))


@pytest.mark.parametrize("protocol", [2, 4])
def test_a_pickle_that_would_run_code_is_read_inert_with_a_warning_and_gated(tmp_path, protocol):
    marker = tmp_path / "ran"
    payload = pickle.dumps({"w": _RunsCode(marker)}, protocol=protocol)
    # protocol 2 reaches Path.touch through getattr; protocol 4 names it (STACK_GLOBAL)
    asked = "builtins.getattr" if protocol == 2 else "pathlib.Path.touch"
    calls = ", ".join(sorted(pickletools_calls(payload)))
    assert asked in calls
    for name, write in (("zip.pt", _torch_zip), ("legacy.pt", _torch_legacy)):
        path = tmp_path / name
        write(path, payload)
        warning = f"clipcli: warning: {path}: torch.load would call {calls} (never called here)\n"
        for command in (["inspect"], ["global-norm"], ["hash"]):
            result = run(*command[:1], path, *command[1:])
            assert (result.exit_code, result.stderr) == (0, warning)
            result = run(*command[:1], path, *command[1:], "--fail-unsafe-pickle")
            assert result.exit_code == 1
            assert (
                result.stderr
                == warning + f"clipcli: error: {path}: torch.load would call {calls} (--fail-unsafe-pickle)\n"
            )
        audit = json.loads(run("inspect", path, "--format", "json").stdout)["checkpoints"][0]["pickle"]
        assert audit["loads_with_weights_only"] is False
        assert {(g["name"], g["use"]) for g in audit["globals"] if g["use"] == "call"} == {
            (name, "call") for name in pickletools_calls(payload)
        }
    assert not marker.exists()


def test_a_plain_pickle_named_like_a_torch_file_is_called_a_pickle(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(pickle.dumps({"w": _RunsCode(tmp_path / "ran")}, protocol=2))
    result = run("inspect", path)
    assert (result.exit_code, result.stderr) == (  # the calls torch.load runs before it refuses it, named
        3,
        f"clipcli: error: {path}: not a PyTorch file: a Python pickle, not a torch.save file; torch.load would "
        "call builtins.getattr, pathlib.PosixPath (never called here)\n",
    )
    assert not (tmp_path / "ran").exists()


def test_a_torch_file_without_a_known_suffix_is_read_by_its_first_bytes(tmp_path):
    path = tmp_path / "checkpoint"
    path.write_bytes((DATA / "grads.pt").read_bytes())
    assert js("global-norm", path)["checkpoints"][0]["global_norm"] == pytest.approx(
        math.sqrt(sum(t["norm"] ** 2 for t in expected(DATA / "grads.pt")["tensors"])), rel=1e-13
    )


def test_reading_pytorch_files_imports_no_torch():
    import subprocess
    import sys

    for command in (["global-norm"], ["inspect"]):
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "clipcli", *command, str(DATA / "adam.pt"), "--quiet"],
            capture_output=True,
            text=True,
            check=True,
        )
        imported = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines() if "|" in line}
        assert "numpy" in imported and "torch" not in imported


# -- Hugging Face PyTorch shards: pytorch_model-0000K-of-0000N.bin and pytorch_model.bin.index.json ---------

SHARDED = DATA / "sharded_bin"
SHARDED_INDEX = SHARDED / "pytorch_model.bin.index.json"
SHARDED_WANT = json.loads((DATA / "sharded_bin.json").read_text())  # what torch read from the shards together


def stored_shas(path: Path) -> dict[str, str]:
    """The SHA-256 of each tensor's bytes in a .safetensors file, from its header (any dtype)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    return {
        k: hashlib.sha256(raw[8 + n + v["data_offsets"][0] : 8 + n + v["data_offsets"][1]]).hexdigest()
        for k, v in header.items()
    }


@pytest.mark.parametrize("path", [SHARDED, SHARDED_INDEX], ids=["directory", "index"])
def test_pytorch_shards_read_as_one_checkpoint_as_torch_reads_them(path):
    want = SHARDED_WANT
    listing = js("inspect", path)["checkpoints"][0]
    assert listing["format"] == "sharded-torch"
    got = {t["name"]: (t["dtype"], t["shape"]) for t in listing["tensors"]}
    assert got == {t["name"]: (t["dtype"], t["shape"]) for t in want["tensors"]}
    # storage keys repeat from shard to shard: only the pair torch saw on one storage is tied
    assert listing["shared_storage"] == want["shared"]
    norms = {t["name"]: t["norm"] for t in want["tensors"]}
    (c,) = js("global-norm", path)["checkpoints"]
    for row in c["tensors"]:
        assert row["norm"] == pytest.approx(norms[row["name"]], rel=1e-13, abs=0), row["name"]
    assert {row["name"] for row in c["tensors"]} | {s["name"] for s in c["skipped"]} == set(norms)


def test_pytorch_shards_convert_to_safetensors_bit_for_bit(tmp_path):
    want = {t["name"]: t["sha256"] for t in SHARDED_WANT["tensors"]}
    merged, shards = tmp_path / "merged.safetensors", tmp_path / "shards"
    ok("convert", SHARDED_INDEX, "-o", merged, "--quiet")
    ok("convert", SHARDED, "-o", shards, "--max-shard-size", "300", "--quiet")
    assert stored_shas(merged) == want
    pieces = sorted(shards.glob("*.safetensors"))
    assert len(pieces) > 1
    assert {k: v for piece in pieces for k, v in stored_shas(piece).items()} == want
    with safe_open(merged, "np") as f:  # the reference reader takes it
        assert sorted(f.keys()) == sorted(want)


def test_pytorch_shards_clip_to_one_file_and_are_never_written(tmp_path):
    out = tmp_path / "clipped.safetensors"
    (c,) = js("clip-global-norm", SHARDED_INDEX, "-o", out, "--clip-norm", "1")["checkpoints"]
    floats = [t["norm"] for t in SHARDED_WANT["tensors"] if t["dtype"].startswith(("float", "bfloat"))]
    g = math.sqrt(math.fsum(n * n for n in floats))
    assert c["global_norm"] == pytest.approx(g, rel=1e-13) and c["scale"] == pytest.approx(1 / g, rel=1e-13)
    assert c["shared_storage"] == SHARDED_WANT["shared"]  # the tied pair, written as two copies
    after = js("global-norm", out)["checkpoints"][0]
    assert after["global_norm"] == c["global_norm_after"] and after["shared_storage"] == []
    assert stored_shas(out)["tied.emb.weight"] == stored_shas(out)["tied.head.weight"]
    before = {p.name: p.read_bytes() for p in SHARDED.iterdir()}
    for args in (
        ["-o", tmp_path / "dir"],
        ["-o", tmp_path / "pytorch_model.bin.index.json"],
        ["--in-place"],
    ):
        for source in (SHARDED, SHARDED_INDEX):
            result = run("clip-global-norm", source, *args, "--clip-norm", "1")
            assert result.exit_code == 2, (source, args, result.output)
            assert "does not write them" in result.output
    assert not (tmp_path / "dir").exists()
    assert {p.name: p.read_bytes() for p in SHARDED.iterdir()} == before


def test_clipping_a_pytorch_file_in_place_replaces_it(tmp_path):
    # found by a fresh user (second review): --in-place on a PyTorch file was accepted while clipcli wrote none; since
    # issue 24 item 6 it writes .pt, so the file is clipped in place (atomically) and stays a torch.save file
    path = tmp_path / "pytorch_model.bin"
    shutil.copy(SAMPLES / "pytorch_model.bin", path)
    before = js("inspect", path)["checkpoints"][0]
    ok("clip-value", path, "--in-place", "--min", "-1", "--max", "1")
    after = js("inspect", path)["checkpoints"][0]
    assert after["format"] == "torch" and after["pickle"]["loads_with_weights_only"] is True
    assert [t["name"] for t in after["tensors"]] == [t["name"] for t in before["tensors"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pytorch_model.bin"]


def test_a_directory_with_both_kinds_of_shards_reads_the_safetensors_and_loose_files_never_win(tmp_path):
    for p in SHARDED.iterdir():
        (tmp_path / p.name).write_bytes(p.read_bytes())
    # a Hugging Face repository converted beside itself (found by a review: refused when the directory was
    # named, taken when the index was), then read through the safetensors index
    for source in (tmp_path, tmp_path / SHARDED_INDEX.name):
        ok("convert", source, "-o", tmp_path, "--max-shard-size", "300", "--quiet")
        (c,) = js("inspect", tmp_path)["checkpoints"]
        assert c["format"] == "sharded" and len({t["file"] for t in c["tensors"]}) > 1
        assert {t["name"] for t in c["tensors"]} == {t["name"] for t in SHARDED_WANT["tensors"]}
        for p in tmp_path.glob("model*"):
            p.unlink()
    # a stray .safetensors beside PyTorch shards (found by a review: it was read instead, and a gate passed)
    (tmp_path / "adapter_model.safetensors").write_bytes(
        (DATA.parent.parent.parent / "samples" / "grads.safetensors").read_bytes()
    )
    result = run("global-norm", tmp_path, "--fail-above", "1000")
    assert result.exit_code == 3
    assert "pytorch_model.bin.index.json and 1 .safetensors file(s) without an index" in result.output
    assert js("inspect", tmp_path / SHARDED_INDEX.name)["checkpoints"][0]["format"] == "sharded-torch"
    (tmp_path / "adapter_model.safetensors").unlink()
    assert js("inspect", tmp_path)["checkpoints"][0]["format"] == "sharded-torch"
    # another checkpoint's shards are not written beside these
    other = tmp_path.parent / "other.safetensors"
    other.write_bytes((DATA.parent.parent.parent / "samples" / "grads.safetensors").read_bytes())
    result = run("convert", other, "-o", tmp_path, "--max-shard-size", "1KB")
    assert result.exit_code == 4 and "pytorch_model.bin.index.json" in result.output


def test_a_pytorch_index_that_disagrees_with_its_shards_is_refused(tmp_path):
    for p in SHARDED.iterdir():
        (tmp_path / p.name).write_bytes(p.read_bytes())
    index_path = tmp_path / SHARDED_INDEX.name
    index = json.loads(index_path.read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"]["not.in.any.shard"] = index["weight_map"][name]
    index_path.write_text(json.dumps(index))
    result = run("global-norm", tmp_path)
    assert result.exit_code == 3 and "not.in.any.shard" in result.output
    index["weight_map"] = {name: "../outside.bin"}
    index_path.write_text(json.dumps(index))
    result = run("inspect", index_path)
    assert result.exit_code == 3 and "leaves the checkpoint's directory" in result.output


def test_pytorch_index_mistakes_are_named(tmp_path):
    for p in SHARDED.iterdir():
        (tmp_path / p.name).write_bytes(p.read_bytes())
    index_path = tmp_path / SHARDED_INDEX.name
    shard = next(iter(json.loads(index_path.read_text())["weight_map"].values()))
    for weight_map, message in [
        ({}, "'weight_map' names no tensors"),
        ({"f16": ""}, "an empty shard name"),
        ({"f16": "sub"}, "shard sub named by the index is not a file"),
        ({"f16": "gone.bin"}, "shard gone.bin named by the index does not exist"),
    ]:
        (tmp_path / "sub").mkdir(exist_ok=True)
        index_path.write_text(json.dumps({"weight_map": weight_map}))
        result = run("global-norm", tmp_path)
        assert result.exit_code == 3 and message in result.output, result.output
    index_path.unlink()
    result = run("inspect", tmp_path)
    assert result.exit_code == 3 and f"name a file in it such as {shard}" in result.output


def test_pytorch_shards_output_mistakes_name_what_to_do(tmp_path):
    for out in (tmp_path / "dir" / "model.safetensors.index.json", tmp_path / "dir"):
        result = run("clip-global-norm", SHARDED, "-o", out, "--clip-norm", "1")
        assert result.exit_code == 2 and "clipcli convert --max-shard-size" in result.output, result.output


def test_an_index_own_metadata_is_the_checkpoints(tmp_path):
    # a review: huggingface_hub's `metadata=` lands in the index only, for PyTorch shards; it was not shown,
    # and a conversion to one file dropped it silently
    shards = tmp_path / "shards"
    shards.mkdir()
    for p in SHARDED.iterdir():
        (shards / p.name).write_bytes(p.read_bytes())
    index_path = shards / SHARDED_INDEX.name
    index = json.loads(index_path.read_text())
    index["metadata"].update({"foo": "bar", "step": 7})
    index_path.write_text(json.dumps(index))
    assert js("inspect", shards)["checkpoints"][0]["metadata"] == {"foo": "bar", "step": "7"}
    out = tmp_path / "one.safetensors"
    ok("convert", shards, "-o", out, "--quiet")
    with safe_open(out, "np") as f:
        assert f.metadata() == {"foo": "bar", "step": "7"}
    result = run("convert", shards, "-o", tmp_path / "x.npz", "--include", "f64")
    assert result.exit_code == 3 and "the metadata (2 entries: foo, step)" in result.output  # said, not dropped


def test_a_storage_with_a_bad_crc_reads_as_torch_reads_it_and_verify_names_the_record(tmp_path):
    # gh-24: torch 2.13's torch.load checks no storage's CRC-32 (weights_only or not) and gives the damaged bytes;
    # clipcli's reads do the same, and verify is the check that names the record
    path = tmp_path / "damaged.pt"
    data = bytearray((DATA / "tied.pt").read_bytes())
    with zipfile.ZipFile(DATA / "tied.pt") as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
    local = info.header_offset
    start = local + 30 + int.from_bytes(data[local + 26 : local + 28], "little")  # past the name and extra field
    start += int.from_bytes(data[local + 28 : local + 30], "little")
    data[start] ^= 0x40  # a float32's low mantissa bits: another finite value
    path.write_bytes(bytes(data))
    before = {t["name"]: t["norm"] for t in js("global-norm", DATA / "tied.pt")["checkpoints"][0]["tensors"]}
    after = {t["name"]: t["norm"] for t in js("global-norm", path)["checkpoints"][0]["tensors"]}
    assert after.keys() == before.keys() and after != before  # read, values damaged, as torch gives them
    result = run("verify", path)
    assert result.exit_code == 1 and f"crc: member {info.filename}: Bad CRC-32" in result.output
    # found in review: the finding's tensor was null; it names each tensor on the storage
    report = json.loads(run("verify", path, "--format", "json").stdout)
    assert [(f["tensor"], f["kind"]) for f in report["findings"]] == [("emb.weight", "crc"), ("head.weight", "crc")]
