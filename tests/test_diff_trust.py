"""Issue 22, diff: metadata in --fail-different, rel where A holds NaN, per-tensor speed of many small pairs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
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
