"""Issue 22, diff: metadata in --fail-different, rel where A holds NaN, per-tensor speed of many small pairs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file
from typer.testing import CliRunner

from clipcli.cli import app
from tests.conftest import st_bytes

ENV = {"NO_COLOR": "1", "COLUMNS": "100", "TERMINAL_WIDTH": "100"}


def cli(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args], env=ENV)


def write(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> Path:
    path.write_bytes(st_bytes(tensors, metadata))
    return path


def diff_json(*args: object) -> dict:
    result = cli("diff", *args, "--format", "json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# --- item 22: rel is ‖A−B‖ / ‖A‖ ------------------------------------------------------------------


def test_rel_is_nan_where_a_holds_nan_even_at_the_same_place_in_b(tmp_path):
    # issue 22 item 22: NaN in A at the same place as in B gave rel 0 (per tensor, per group, globally)
    x = np.array([np.nan, 1.0, 2.0], np.float32)
    a = write(tmp_path / "a.safetensors", {"m.x": x, "m.y": np.ones(2, np.float32)})
    b = write(tmp_path / "b.safetensors", {"m.x": x.copy(), "m.y": np.ones(2, np.float32)})
    d = diff_json(a, b, "--depth", "1")
    rows = {t["name"]: t for t in d["tensors"]}
    assert (d["diff_norm"], d["norm_a"], d["rel"]) == (0.0, "nan", "nan")
    assert (rows["m.x"]["diff_norm"], rows["m.x"]["rel"]) == (0.0, "nan")
    assert rows["m.y"]["rel"] == 0.0  # a finite A: 0 / ‖A‖
    assert [(g["name"], g["rel"]) for g in d["groups"]] == [("m", "nan")]
    assert cli("diff", a, b, "--fail-rel-above", "1").exit_code == 1  # a gate fails on a non-finite figure
    assert cli("diff", a, b, "--fail-above", "0", "--fail-different").exit_code == 0  # nothing differs
    inf = write(tmp_path / "inf.safetensors", {"m.x": np.array([np.inf, 1.0], np.float32)})
    assert diff_json(inf, inf)["rel"] == 0.0  # 0 / inf
    assert math.isnan(float(diff_json(a, a)["tensors"][0]["rel"]))


# --- item 20: metadata counts in --fail-different --------------------------------------------------

TORCH = Path(__file__).parent / "data" / "torch"


def test_metadata_that_differs_is_listed_and_fails_the_gate(tmp_path):
    # issue 22 item 20: equal tensors with another `epoch` or `lr` passed --fail-different, the report silent
    w = {"w": np.arange(4, dtype=np.float32)}
    a = write(tmp_path / "a.safetensors", w, {"epoch": "3", "lr": "0.1", "format": "pt", "x\x1b[2J": "1"})
    b = write(tmp_path / "b.safetensors", w, {"epoch": "4", "lr": "0.1", "step": "7"})
    d = diff_json(a, b)
    assert d["metadata_differs"] == ["epoch", "step", "x\x1b[2J"]  # `format` (which library saved it) is layout
    assert d["different"] == ["3 metadata keys differ (epoch, ...)"]
    gate = cli("diff", a, b, "--fail-different")
    assert gate.exit_code == 1 and "metadata differs: epoch, step, x\\x1b[2J" in gate.stdout  # escaped
    assert gate.stderr.count("clipcli: error:") == 1 and "3 metadata keys differ" in gate.stderr
    csv = cli("diff", a, b, "--format", "csv").stdout.splitlines()
    rows = [line for line in csv if line.endswith(",metadata")]
    assert rows == [f"{k},,,,,,,,,,,0,,metadata" for k in ("epoch", "step", "x\\x1b[2J")]
    assert csv[-1].split(",")[-4:-2] == ["0", "0"]  # the global row: nothing changed, yet not identical
    excluded = ["--exclude", "epoch", "--exclude", "x*", "--exclude", "step"]
    assert cli("diff", a, b, "--fail-different", *excluded).exit_code == 0  # keys are selected as names are
    same = write(tmp_path / "same.safetensors", w, {"epoch": "3", "lr": "0.1", "x\x1b[2J": "1", "format": "np"})
    assert cli("diff", a, same, "--fail-different").exit_code == 0


def test_torch_leaves_count_and_a_conversion_keeps_them(tmp_path):
    # issue 22 item 20: a PyTorch file's non-tensor leaves (epoch, lr) are metadata: compared as strings
    source = TORCH / "lightning.ckpt"
    out = tmp_path / "converted.safetensors"
    assert cli("convert", source, "-o", out, "--quiet").exit_code == 0
    assert cli("diff", source, out, "--fail-different").exit_code == 0  # clipcli's own conversion: the same
    with safe_open(out, "np") as f:
        metadata = f.metadata()
    assert metadata["epoch"] == "3"
    moved = write(tmp_path / "moved.safetensors", load_file(out), {**metadata, "epoch": "4"})
    d = diff_json(source, moved)
    assert (d["metadata_differs"], d["changed"]) == (["epoch"], 0)
    assert cli("diff", source, moved, "--fail-different").exit_code == 1
    dropped = tmp_path / "dropped.safetensors"
    assert cli("convert", source, "-o", dropped, "--drop-metadata", "--quiet").exit_code == 0
    assert diff_json(source, dropped)["metadata_differs"] == sorted(metadata)  # what --drop-metadata lost
