"""Distributed checkpoints (torch.distributed.checkpoint) through the commands, against what torch consolidated.

The corpus in tests/data/dcp was made by real torch (make_dcp.py): one process, and two processes over
gloo whose tensors are split in rows (Shard(0)) and columns (Shard(1)) between the ranks. Each .json holds
what torch's own consolidation (dcp_to_torch_save) gave: per tensor the SHA-256 of its C-order bytes and
its norm summed exactly. torch itself is not needed here.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.helpers import DATA as TESTS_DATA
from tests.helpers import js, ok, run

DATA = TESTS_DATA / "dcp"
CHECKPOINTS = ["single", "sharded", "megatron", "megatron_mcore015"]


def expected(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


def readable(name: str) -> dict[str, dict]:
    """The tensors clipcli reads values of (NumPy has a type for them), by name."""
    skipped = {s["name"] for s in expected(name)["skipped"]}
    return {t["name"]: t for t in expected(name)["tensors"] if t["name"] not in skipped and t.get("sha256")}


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_names_shapes_dtypes_and_norms_without_consolidating(name):
    want = readable(name)
    listing = js("inspect", DATA / name)["checkpoints"][0]
    assert listing["format"] == "distcp"
    got = {t["name"]: t for t in listing["tensors"]}
    assert {n: (got[n]["dtype"], got[n]["shape"]) for n in want} == {
        n: (t["dtype"], t["shape"]) for n, t in want.items()
    }
    (c,) = js("global-norm", DATA / name)["checkpoints"]
    rows = {t["name"]: t for t in c["tensors"]}
    for n, t in want.items():
        if n in rows:
            assert rows[n]["norm"] == pytest.approx(t["norm"], rel=1e-13, abs=0), n


def test_chunks_from_two_ranks_in_rows_and_columns_are_there():
    chunks = {t["name"]: t["chunks"] for t in expected("sharded")["tensors"]}
    assert len(chunks["rows"]) == 2 and chunks["rows"][1][0][0] > 0  # a second chunk of rows
    assert any(len(c) > 1 and c[1][0][1] > 0 for c in chunks.values())  # a second chunk of columns


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_convert_is_bit_identical_to_torchs_consolidation(name, tmp_path):
    want = readable(name)
    out = tmp_path / "whole.safetensors"
    listed = [t["name"] for t in js("inspect", DATA / name)["checkpoints"][0]["tensors"]]
    excludes = [arg for n in listed if n not in want for arg in ("--exclude", n)]
    ok("convert", DATA / name, "-o", out, *excludes, "--quiet")
    raw = out.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    for n, t in want.items():
        begin, end = header[n]["data_offsets"]
        assert hashlib.sha256(raw[8 + size + begin : 8 + size + end]).hexdigest() == t["sha256"], n
    with safe_open(out, "np") as f:
        assert sorted(f.keys()) == sorted(want)
        assert f.metadata() == expected(name)["metadata"]
    assert run("diff", DATA / name, out, *excludes, "--fail-different").exit_code == 0


def test_convert_into_shards(tmp_path):
    ok("convert", DATA / "sharded", "-o", tmp_path / "hf", "--max-shard-size", "200B", "--quiet")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert run("diff", DATA / "sharded", tmp_path / "hf", "--fail-different").exit_code == 0


def test_clipping_a_distributed_checkpoint_in_place_is_refused_as_for_any_pytorch_input(tmp_path):
    # (it clips into .safetensors and .npz and dry-runs since issue 22 item 23: tests/checkpoint/test_hostile_views.py)
    ckpt = tmp_path / "dcp"
    shutil.copytree(DATA / "sharded", ckpt)
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    result = run("clip-global-norm", ckpt, "--in-place", "--clip-norm", "1")
    assert result.exit_code == 2
    assert "clipcli reads PyTorch files but does not write them" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dcp"]
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before


@pytest.mark.parametrize("variant", sorted(p.name for p in (DATA / "malformed").glob("*.metadata")))
def test_a_malformed_checkpoint_is_one_error_line(tmp_path, variant):
    copy = tmp_path / "ckpt"
    shutil.copytree(DATA / "sharded", copy)
    shutil.copy(DATA / "malformed" / variant, copy / ".metadata")
    for command in (["inspect"], ["global-norm"], ["convert", "-o", str(tmp_path / "o.safetensors")]):
        result = run(command[0], copy, *command[1:])
        assert result.exit_code == 3, (variant, result.output)
        assert result.stderr.startswith("clipcli: error: ") and result.stderr.count("\n") == 1
    assert not (tmp_path / "o.safetensors").exists()


# found in review: a .metadata calling a foreign global refused the checkpoint (exit 3) instead of auditing it
def test_a_foreign_global_in_the_metadata_is_audited_read_and_never_run(tmp_path, monkeypatch):
    copy = tmp_path / "ckpt"
    shutil.copytree(DATA / "sharded", copy)
    shutil.copy(DATA / "foreign" / "foreign_global.metadata", copy / ".metadata")
    monkeypatch.chdir(tmp_path)
    warning = f"clipcli: warning: {copy / '.metadata'}: torch.load would call posix.system (never called here)"
    shown = run("inspect", copy, "--format", "json")
    assert shown.exit_code == 0 and shown.stderr.splitlines() == [warning], shown.output
    listing = json.loads(shown.stdout)["checkpoints"][0]
    assert {t["name"] for t in listing["tensors"]} == {t["name"] for t in expected("sharded")["tensors"]}
    assert {"name": "posix.system", "use": "call", "count": 1} in listing["pickle"]["globals"]
    norms, plain = (js("global-norm", path)["checkpoints"][0] for path in (copy, DATA / "sharded"))
    assert norms["global_norm"] == plain["global_norm"] and norms["tensors"] == plain["tensors"]
    gated = run("global-norm", copy, "--quiet", "--fail-unsafe-pickle")
    assert gated.exit_code == 1 and gated.stderr.splitlines()[0] == warning, gated.output
    assert "posix.system (--fail-unsafe-pickle)" in gated.stderr.splitlines()[-1]
    assert not (Path.cwd() / "clipcli-was-exploited").exists() and not (tmp_path / "clipcli-was-exploited").exists()


def test_a_chunk_past_the_end_of_its_file(tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(DATA / "sharded", copy)
    shard = copy / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    result = run("global-norm", copy)
    assert result.exit_code == 3 and result.stderr.count("\n") == 1


def test_the_metadata_file_named_alone_names_the_directory_to_give():
    # found by a new user: `inspect CKPT/.metadata` said "unknown checkpoint suffix ... a Python pickle"
    # (a lone `__0_0.distcp` already named its directory)
    result = run("inspect", TESTS_DATA / "dcp" / "single" / ".metadata")
    assert result.exit_code == 3
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "the metadata of a distributed checkpoint" in lines[0], lines
    assert f"name its directory ({TESTS_DATA / 'dcp' / 'single'}) instead" in lines[0], lines
