"""`clipcli verify`: exit statuses (0 nothing found, 1 findings, 2 usage, 3 nothing to verify), one error line, the
table, JSON and CSV, names escaped, and the library's same report."""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import clipcli
from tests.helpers import SAMPLES, js, ok, raw_safetensors, run, write_st


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    d = tmp_path / "sharded"
    shutil.copytree(SAMPLES / "sharded", d)
    return d


def test_a_clean_checkpoint_exits_0(shards: Path) -> None:
    text = ok("verify", shards).stdout
    assert text == f"{shards}: sharded\nverified: nothing found\n"
    out = js("verify", shards)
    assert out == {
        "schema": 1,
        "command": "verify",
        "path": str(shards),
        "format": "sharded",
        "values": False,
        "ok": True,
        "findings": [],
    }


def test_defects_exit_1_listed_with_one_error_line(shards: Path) -> None:
    first = shards / "model-00001-of-00002.safetensors"
    first.write_bytes(first.read_bytes()[:-100])
    save_file({"x": np.ones(2)}, str(shards / "model-extra.safetensors"))
    result = run("verify", shards)
    assert result.exit_code == 1, result.output
    lines = result.stdout.splitlines()
    assert lines[-1] == "2 findings in 2 files"
    assert lines[1].split() == ["file", "tensor", "kind", "problem"]
    assert f"{first} - truncated the tensors' data ends" in " ".join(lines[2].split())
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"clipcli: error: {first}: truncated: ") and "(and 1 more finding)" in result.stderr
    findings = json.loads(run("verify", shards, "--format", "json").stdout)["findings"]
    assert [(Path(f["file"]).name, f["kind"]) for f in findings] == [
        (first.name, "truncated"),
        ("model-extra.safetensors", "stray-shard"),
    ]
    rows = list(csv.reader(io.StringIO(run("verify", shards, "--format", "csv").stdout)))
    assert rows[0] == ["file", "tensor", "kind", "problem"] and len(rows) == 3


def test_a_file_open_refuses_is_verified_exit_1_not_3(tmp_path: Path) -> None:
    """The line between 1 and 3: a malformed file of a known format is what verify is for."""
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    path = tmp_path / "bad.safetensors"
    path.write_bytes(raw_safetensors(header, b"\0" * 16))
    assert run("inspect", path).exit_code == 3
    result = run("verify", path)
    assert result.exit_code == 1
    assert [f["kind"] for f in json.loads(run("verify", path, "--format", "json").stdout)["findings"]] == [
        "overlap",
        "trailing-bytes",
    ]


@pytest.mark.parametrize(
    "content",
    [None, b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\n", b"<!doctype html><html></html>"],
    ids=["missing", "lfs-pointer", "html"],
)
def test_nothing_to_verify_exits_3(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "m.safetensors"
    if content is not None:
        path.write_bytes(content)
    result = run("verify", path)
    assert result.exit_code == 3
    assert result.stdout == "" and result.stderr.startswith(f"clipcli: error: {path}: ")
    assert result.stderr.count("\n") == 1


def test_manifest_round_trip_and_differences(tmp_path: Path) -> None:
    manifest = tmp_path / "manifest.json"
    manifest.write_text(ok("hash", SAMPLES / "pytorch_model.bin", "--format", "json").stdout)
    text = ok("verify", SAMPLES / "grads.safetensors", "--manifest", manifest).stdout
    assert text.splitlines()[1] == f"manifest {manifest}: 17 tensors compared, checkpoint hash matches"
    changed = tmp_path / "changed.safetensors"
    with clipcli.open(SAMPLES / "grads.safetensors") as ckpt:
        tensors = {n: ckpt.read(n) for n in ckpt.names if ckpt.dtypes[n] != "bfloat16"}
        dropped = sorted(n for n in ckpt.names if ckpt.dtypes[n] == "bfloat16")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 2
    write_st(changed, tensors)
    result = run("verify", changed, "--manifest", manifest, "--format", "json")
    assert result.exit_code == 1
    out = json.loads(result.stdout)
    assert out["manifest"]["missing"] == dropped and dropped
    assert [c["name"] for c in out["manifest"]["changed"]] == ["model.norm.weight"]
    excluded = [x for name in [*dropped, "model.norm.weight"] for x in ("--exclude", name)]
    assert ok("verify", changed, "--manifest", manifest, *excluded)


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    two = tmp_path / "two.json"
    two.write_text(ok("hash", SAMPLES / "grads.safetensors", SAMPLES / "grads.npz", "--format", "json").stdout)
    result = run("verify", SAMPLES / "grads.safetensors", "--manifest", two)
    assert result.exit_code == 2 and "2 checkpoints" in result.stderr
    assert run("verify", SAMPLES / "grads.safetensors", "--include", "model.*").exit_code == 2
    assert run("verify", SAMPLES / "grads.safetensors", "--values", "--include", "nothing.*").exit_code == 2


def test_names_are_escaped_in_the_table(tmp_path: Path) -> None:
    path = write_st(tmp_path / "m.safetensors", {"evil\x1b[31m\nname": np.zeros(3, np.float32)})
    result = run("verify", path, "--values")
    assert result.exit_code == 1
    assert "\x1b" not in result.output and "evil\\x1b[31m\\nname" in result.stdout
    assert json.loads(run("verify", path, "--values", "--format", "json").stdout)["findings"][0]["tensor"] == (
        "evil\x1b[31m\nname"
    )


def test_library_report_is_the_json(tmp_path: Path) -> None:
    path = write_st(tmp_path / "m.safetensors", {"a": np.array([1.0, np.inf]), "z": np.zeros(2)})
    report = clipcli.verify_of(path, values=True)
    assert report.to_dict() == json.loads(run("verify", path, "--values", "--format", "json").stdout)
    assert [(p.tensor, p.kind) for p in report.problems] == [("a", "nonfinite"), ("z", "all-zero")]


def test_help_has_examples_and_the_exit_statuses() -> None:
    text = " ".join(ok("verify", "--help").stdout.split())
    assert "Examples:" in text and "clipcli verify shards/" in text
    assert "0 nothing found; 1 a defect or a difference found" in text
