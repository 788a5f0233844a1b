"""`verify`: a manifest of `hash` verifies the checkpoint's conversions in every format and names each difference;
--values names NaN, Inf and all-zero tensors as NumPy counts them; files torch wrote verify clean."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import clipcli
from clipcli.checkpoint import engine as _engine
from clipcli.commands.verify import read_manifest
from clipcli.core.hashing import checkpoint_hash
from clipcli.errors import MalformedError, MissingFileError, UsageError
from tests.helpers import DATA, WRITTEN_BY_TORCH, dcp_checkpoint, run, write_st

RNG = np.random.default_rng(25)
TENSORS = {
    "w": RNG.standard_normal((3, 4)).astype(np.float32),
    "v": RNG.standard_normal((2, 3, 2)),
    "step": np.array(1234, np.int64),
    "e": np.zeros((0, 3), np.float32),
}


def manifest(path: Path, out: Path, **kw) -> Path:
    out.write_text(clipcli.hash_of(path, **kw).to_json())
    return out


def sources(tmp: Path) -> dict[str, Path]:
    """The same tensors as a .safetensors, an .npz, a sharded directory and a DCP; files torch wrote."""
    save_file(TENSORS, str(tmp / "m.safetensors"))
    np.savez_compressed(tmp / "m.npz", **TENSORS)
    d = tmp / "shards"
    d.mkdir()
    save_file({"w": TENSORS["w"], "step": TENSORS["step"]}, str(d / "a.safetensors"))
    save_file({"v": TENSORS["v"], "e": TENSORS["e"]}, str(d / "b.safetensors"))
    w = TENSORS["w"]
    dcp = dcp_checkpoint(tmp / "dcp", {"w": ((3, 4), [((0, 0), w[:1]), ((1, 0), w[1:])])})
    return {
        "safetensors": tmp / "m.safetensors",
        "npz": tmp / "m.npz",
        "sharded": d,
        "dcp": dcp,
        "pt": DATA / "torch" / "views.pt",
        "pt-legacy": DATA / "torch" / "nested_legacy.pt",
        "bin-shards": DATA / "torch" / "sharded_bin",
        "torch-dcp": DATA / "dcp" / "sharded",
    }


@pytest.mark.parametrize("kind", ["safetensors", "npz", "sharded", "dcp", "pt", "pt-legacy", "bin-shards", "torch-dcp"])
def test_a_manifest_verifies_the_conversion(tmp_path: Path, kind: str) -> None:
    """The manifest of a checkpoint verifies its .safetensors conversion (and itself); nothing found, exit 0."""
    source = sources(tmp_path)[kind]
    m = manifest(source, tmp_path / "manifest.json")
    out = tmp_path / "converted.safetensors"
    clipcli.convert_of(source, out)
    for path in (source, out):
        report = clipcli.verify_of(path, manifest=m)
        assert report.ok, report.to_text()
        d = report.to_dict()
        assert d["findings"] == [] and d["manifest"]["missing"] == d["manifest"]["extra"] == []
        stated = json.loads(m.read_text())["checkpoints"][0]["hash"]
        assert d["manifest"]["hash"] == d["manifest"]["manifest_hash"] == stated


def test_one_changed_value_is_named(tmp_path: Path) -> None:
    source = write_st(tmp_path / "a.safetensors", TENSORS)
    m = manifest(source, tmp_path / "m.json")
    changed = dict(TENSORS, v=TENSORS["v"].copy())
    changed["v"][1, 2, 0] = np.nextafter(changed["v"][1, 2, 0], 2.0)  # one ulp
    report = clipcli.verify_of(write_st(tmp_path / "b.safetensors", changed), manifest=m)
    assert not report.ok
    assert [(p.tensor, p.kind) for p in report.problems] == [("v", "changed"), (None, "checkpoint-hash")]
    assert "same dtype and shape" in report.problems[0].problem
    assert report.to_dict()["manifest"]["compared"] == 4


def test_dtype_and_shape_changes_missing_and_extra(tmp_path: Path) -> None:
    source = write_st(tmp_path / "a.safetensors", TENSORS)
    m = manifest(source, tmp_path / "m.json")
    other = {
        "w": TENSORS["w"].astype(np.float64),
        "v": TENSORS["v"].reshape(3, 4),
        "e": TENSORS["e"],
        "new": np.ones(2, np.float32),
    }
    report = clipcli.verify_of(write_st(tmp_path / "b.safetensors", other), manifest=m)
    got = {(p.tensor, p.kind): p.problem for p in report.problems}
    assert set(got) == {
        ("step", "missing"),
        ("new", "extra"),
        ("w", "changed"),
        ("v", "changed"),
        (None, "checkpoint-hash"),
    }
    assert "dtype float32 -> float64" in got[("w", "changed")] and "shape" not in got[("w", "changed")]
    assert "shape 2x3x2 -> 3x4" in got[("v", "changed")] and "dtype" not in got[("v", "changed")]
    changed = report.to_dict()["manifest"]["changed"]
    assert {c["name"]: (c["manifest_dtype"], c["dtype"]) for c in changed} == {
        "v": ("float64", "float64"),
        "w": ("float32", "float64"),
    }


def test_include_and_exclude_restrict_both_sides(tmp_path: Path) -> None:
    source = write_st(tmp_path / "a.safetensors", TENSORS)
    m = manifest(source, tmp_path / "m.json")
    other = dict(TENSORS, step=np.array(1, np.int64))
    del other["e"]
    path = write_st(tmp_path / "b.safetensors", other)
    assert not clipcli.verify_of(path, manifest=m).ok
    report = clipcli.verify_of(path, manifest=m, exclude=["step", "e"])
    assert report.ok, report.to_text()
    expected = clipcli.hash_of(source, exclude=["step", "e"]).checkpoints[0].hash
    assert report.manifest.hash == report.manifest.manifest_hash == expected
    assert report.manifest.compared == 2


def test_values_nonfinite_and_all_zero(tmp_path: Path) -> None:
    """NaN and Inf counted per tensor as NumPy counts them; a non-empty floating tensor of zeros (±0) flagged, an
    empty one and an integer one not."""
    a = RNG.standard_normal(1000).astype(np.float32)
    a[[3, 500]] = np.nan
    a[7] = -np.inf
    tensors = {
        "a": a,
        "zeros": np.array([0.0, -0.0, 0.0], np.float16),
        "empty": np.zeros((0,), np.float32),
        "ints": np.zeros(4, np.int32),
        "fine": np.ones(3),
        "nan_zero": np.array([0.0, np.nan]),
    }
    path = write_st(tmp_path / "m.safetensors", tensors)
    assert clipcli.verify_of(path).ok  # the structure alone is fine
    report = clipcli.verify_of(path, values=True)
    got = {(p.tensor, p.kind): p.problem for p in report.problems}
    assert set(got) == {("a", "nonfinite"), ("zeros", "all-zero"), ("nan_zero", "nonfinite")}
    assert got[("a", "nonfinite")] == (
        f"holds {int(np.isnan(a).sum())} NaN values and {int(np.isinf(a).sum())} Inf value"
    )
    assert report.to_dict()["values"] is True


def test_values_with_no_floating_tensor_is_a_usage_error(tmp_path: Path) -> None:
    path = write_st(tmp_path / "m.safetensors", {"ids": np.arange(3)})
    with pytest.raises(UsageError, match="nothing to check"):
        clipcli.verify_of(path, values=True)


def test_jobs_give_the_same_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_engine, "CHUNK_BYTES", 4096)  # many chunks per tensor
    big = {f"t{i}": RNG.standard_normal(5000 + i).astype(np.float32) for i in range(6)}
    big["t2"][17] = np.nan
    source = write_st(tmp_path / "a.safetensors", big)
    m = manifest(source, tmp_path / "m.json")
    big["t4"] = big["t4"] + 1
    path = write_st(tmp_path / "b.safetensors", big)
    outs = {clipcli.verify_of(path, manifest=m, values=True, jobs=j).to_json() for j in (1, 2, 8)}
    assert len(outs) == 1
    assert [(f["tensor"], f["kind"]) for f in json.loads(outs.pop())["findings"]] == [
        ("t2", "nonfinite"),
        ("t4", "changed"),
        (None, "checkpoint-hash"),
    ]


def test_structural_defects_come_with_the_manifest_check(tmp_path: Path) -> None:
    """A stray shard does not stop the comparison; a truncated shard does (the checkpoint cannot be read), and its
    defect is the report."""
    s = sources(tmp_path)
    m = manifest(s["sharded"], tmp_path / "m.json")
    save_file({"x": np.ones(2)}, str(s["sharded"] / "c.safetensors"))  # a directory without index: now holds x
    report = clipcli.verify_of(s["sharded"], manifest=m)
    assert [(p.tensor, p.kind) for p in report.problems] == [("x", "extra"), (None, "checkpoint-hash")]
    data = (s["sharded"] / "a.safetensors").read_bytes()
    (s["sharded"] / "a.safetensors").write_bytes(data[:-8])
    report = clipcli.verify_of(s["sharded"], manifest=m)
    assert [(p.tensor, p.kind) for p in report.problems] == [(None, "truncated")]
    assert report.manifest is None and not report.ok


def test_nothing_to_verify_raises(tmp_path: Path) -> None:
    with pytest.raises(MissingFileError):
        clipcli.verify_of(tmp_path / "none.safetensors")


@pytest.mark.parametrize(
    "path",
    [*WRITTEN_BY_TORCH, *sorted(p for p in (DATA / "torch" / "inert").iterdir() if p.suffix == ".pt")],
    ids=lambda p: p.name,
)
def test_every_file_torch_wrote_verifies_clean(path: Path) -> None:
    report = clipcli.verify_of(path, values=False)
    assert report.ok, report.to_text()


# -- manifests ---------------------------------------------------------------------------------------------


def test_types_carried_as_bytes_are_hashed_as_stored_and_tensors_without_values_unverified(tmp_path: Path) -> None:
    # found by a red team: a manifest passed a changed byte-string member (hash skipped it), exit 0, "verified"
    a, b, copy = tmp_path / "a.npz", tmp_path / "b.npz", tmp_path / "copy.npz"
    records = np.zeros(2, dtype=[("i", "<i4"), ("x", ">f8")])
    np.savez(a, f=np.ones(3, np.float32), x=np.array([b"abc"]), u=np.array(["h\u00e9", "x"]), r=records)
    np.savez(b, f=np.ones(3, np.float32), x=np.array([b"abd"]), u=np.array(["h\u00e9", "x"]), r=records)
    manifest = tmp_path / "m.json"
    manifest.write_text(clipcli.hash_of(a).to_json())
    assert [t["name"] for t in json.loads(manifest.read_text())["checkpoints"][0]["tensors"]] == ["f", "x", "u", "r"]
    changed = json.loads(run("verify", b, "--manifest", manifest, "--format", "json").stdout)
    assert [(f["tensor"], f["kind"]) for f in changed["findings"]] == [("x", "changed"), (None, "checkpoint-hash")]
    run("convert", a, "-o", copy)  # the same bytes, another file: the same hashes
    for same in (a, copy):
        assert run("verify", same, "--manifest", manifest).exit_code == 0
    x = tmp_path / "x.npy"  # an .npy and the .npz member it came from: one hash
    np.save(x, np.array([b"abc"]))
    assert clipcli.hash_of(x).checkpoints[0].tensors[0].sha256 == clipcli.hash_of(a).checkpoints[0].tensors[1].sha256
    # tensors with no values to hash (quantized, meta, nested, ...) are unverified: never passed
    special = DATA / "torch" / "special.pt"
    manifest.write_text(clipcli.hash_of(special).to_json())
    result = run("verify", special, "--manifest", manifest, "--format", "json")
    report = json.loads(result.stdout)
    unverified = {u["name"] for u in report["manifest"]["unverified"]}
    assert result.exit_code == 1 and {"quantized", "meta", "nested"} <= unverified
    assert {f["tensor"] for f in report["findings"] if f["kind"] == "unverified"} == unverified
    left_out = [arg for name in sorted(unverified) for arg in ("--exclude", name)]
    assert run("verify", special, "--manifest", manifest, *left_out).exit_code == 0
    # a manifest that hashed "quantized" (dense there): unverified here, not also missing (found by a review)
    skipped_there = json.loads(manifest.read_text())
    only_w = tmp_path / "only_w.npz"  # (found by a review: the manifest's tensors without a hash, gone, passed)
    np.savez(only_w, **{"fp32": np.ones(1, np.float32)})
    gone = json.loads(run("verify", only_w, "--manifest", manifest, "--format", "json").stdout)["manifest"]
    assert {"quantized", "meta", "nested"} <= set(gone["missing"])
    doc = skipped_there
    doc["checkpoints"][0]["skipped"] = [t for t in doc["checkpoints"][0]["skipped"] if t["name"] != "quantized"]
    doc["checkpoints"][0]["tensors"].append({"name": "quantized", "dtype": "float32", "shape": [3], "sha256": "0" * 64})
    rows = doc["checkpoints"][0]["tensors"]
    doc["checkpoints"][0]["hash"] = checkpoint_hash((t["name"], t["sha256"]) for t in rows)
    manifest.write_text(json.dumps(doc))
    report = json.loads(run("verify", special, "--manifest", manifest, "--format", "json").stdout)
    assert [f["kind"] for f in report["findings"] if f["tensor"] == "quantized"] == ["unverified"]


def test_unreadable_manifests_are_unreadable_input_and_several_checkpoints_a_usage_error(tmp_path: Path) -> None:
    # found by a new user: a missing manifest was a usage error (2); verify exits 0, 1 or 3 (spec)
    a = write_st(tmp_path / "a.safetensors", TENSORS)
    b = write_st(tmp_path / "b.safetensors", {"x": np.ones(2)})
    (tmp_path / "two.json").write_text(clipcli.hash_of(a, b).to_json())
    with pytest.raises(UsageError, match="a manifest of 2 checkpoints") as info:
        read_manifest(tmp_path / "two.json")
    assert info.value.param == "--manifest"
    cases = {
        "none.json": ('{"schema": 1, "command": "hash"}', 'no "checkpoints" hashed'),  # (found by a review: 2)
        "empty.json": ('{"schema": 1, "command": "hash", "checkpoints": []}', 'no "checkpoints" hashed'),
        "top.json": (clipcli.hash_of(a, top=1).to_json(), "--top"),
        "text.json": ("{", "not JSON"),
        "norms.json": (clipcli.global_norm_of(a).to_json(), '"command": "hash"'),
        "shape.json": (clipcli.hash_of(a).to_json().replace('"shape": [3, 4]', '"shape": [3, -4]'), "a tensor"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(MalformedError, match=message.replace("[", r"\[")):
            read_manifest(tmp_path / name)
    with pytest.raises(MissingFileError, match="cannot read the manifest"):
        read_manifest(tmp_path / "missing.json")
    missing = run("verify", a, "--manifest", tmp_path / "missing.json")
    assert missing.exit_code == 3 and missing.stderr == (
        f"clipcli: error: {tmp_path / 'missing.json'}: cannot read the manifest: No such file or directory\n"
    )
    assert run("verify", a, "--manifest", tmp_path / "text.json").exit_code == 3


def test_a_manifest_that_listed_a_tensor_without_its_hash_leaves_it_unverified(tmp_path: Path) -> None:
    # manifests written before types carried as bytes were hashed list strings under "skipped" (found by a review:
    # extra and a checkpoint-hash difference on an unchanged file)
    a = tmp_path / "a.npz"
    np.savez(a, f=np.ones(3, np.float32), x=np.array([b"abc"]))
    doc = json.loads(clipcli.hash_of(a).to_json())
    c = doc["checkpoints"][0]
    c["tensors"] = [t for t in c["tensors"] if t["name"] != "x"]
    c["skipped"] = [{"name": "x", "dtype": "S3", "reason": "no content hash of S3 (carried as bytes)"}]
    c["hash"] = checkpoint_hash((t["name"], t["sha256"]) for t in c["tensors"])
    manifest = tmp_path / "old.json"
    manifest.write_text(json.dumps(doc))
    result = run("verify", a, "--manifest", manifest, "--format", "json")
    report = json.loads(result.stdout)
    assert result.exit_code == 1 and [(f["tensor"], f["kind"]) for f in report["findings"]] == [("x", "unverified")]


def test_a_changed_tensor_is_named_with_its_shard_and_an_edited_dtype_or_shape_is_found(tmp_path: Path) -> None:
    # found by a new user: a changed tensor of a sharded checkpoint named the directory, not the shard; a manifest
    # whose dtype or shape was edited (its hashes intact) passed
    d = sources(tmp_path)["sharded"]
    m = manifest(d, tmp_path / "m.json")
    save_file({"v": TENSORS["v"] + 1, "e": TENSORS["e"]}, str(d / "b.safetensors"))
    report = clipcli.verify_of(d, manifest=m)
    assert next((p.file, p.tensor, p.kind) for p in report.problems) == (str(d / "b.safetensors"), "v", "changed")
    for field, value, says in (("dtype", "floaty", "says dtype floaty,"), ("shape", [7, 7], "says shape 7x7,")):
        doc = json.loads(m.read_text())
        w = next(t for t in doc["checkpoints"][0]["tensors"] if t["name"] == "w")
        w[field] = value
        edited = tmp_path / f"edited-{field}.json"
        edited.write_text(json.dumps(doc))
        found = clipcli.verify_of(d, manifest=edited)
        problems = [(p.tensor, p.kind, p.problem) for p in found.problems if p.tensor == "w"]
        assert len(problems) == 1 and problems[0][1] == "changed" and says in problems[0][2], problems
        assert "but its content hash, which matches, is not of that (edited?)" in problems[0][2]


def test_a_damaged_record_in_a_distributed_checkpoints_chunk_is_found(tmp_path: Path) -> None:
    # found by a new user: a byte flipped in a .distcp chunk's data record (a torch.save archive inside the
    # file, with its CRC-32) passed verify without --manifest, where the same flip in a .pt is a `crc` finding
    import shutil

    d = shutil.copytree(DATA / "dcp" / "sharded", tmp_path / "dcp")
    assert clipcli.verify_of(d).ok
    shard = sorted(d.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[data.find(b"archive/data/0") + len("archive/data/0") + 80] ^= 0xFF  # inside the record's data
    shard.write_bytes(bytes(data))
    found = clipcli.verify_of(d)
    assert [(p.file, p.kind) for p in found.problems] == [(str(shard), "crc")]
    assert "member archive/data/0: Bad CRC-32" in found.problems[0].problem and found.problems[0].tensor
