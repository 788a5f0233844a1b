"""`clipcli stats`: its JSON, CSV and table, its gates and exits, workers, and the library's same report."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import clipcli
from clipcli.checkpoint import engine as _engine
from clipcli.core.stats import CastReadiness, TensorStats, tensor_stats
from clipcli.report import render
from clipcli.report.stats import StatsRow, tensor_json
from tests.helpers import SAMPLES, WRITTEN_BY_TORCH, js, ok, run, write_st

FIELDS = ["name", "dtype", "shape", "count", "min", "max", "max_abs", "argmax_abs", "mean", "std", "zeros"]
FIELDS += ["subnormals", "nan", "posinf", "neginf", "all_zero", "constant", "exponents", "casts"]


def as_json(s) -> dict:
    """A `TensorStats` as the report's JSON writes it, built here from its fields."""

    def num(x):
        if isinstance(x, float) and not math.isfinite(x):
            return "nan" if math.isnan(x) else "inf" if x > 0 else "-inf"
        return x

    out = {f: num(getattr(s, f)) for f in FIELDS[3:-2]}
    out["exponents"] = [[e, n] for e, n in s.exponents]
    out["casts"] = [
        {"dtype": c.dtype, "overflow": c.overflow, "flush": c.flush, "subnormal": c.subnormal, "rel_error": c.rel_error}
        for c in s.casts
    ]
    return out


@pytest.fixture
def ckpt(tmp_path):
    rng = np.random.default_rng(11)
    w = rng.standard_normal((200, 300)).astype(np.float32)
    w[3, 7], w[9, 9] = np.inf, np.nan
    tensors = {
        "a.weight": w,
        "a.bias": (rng.standard_normal(300) * 1e5).astype(np.float32),
        "b.weight": rng.standard_normal((150, 80)).astype(ml_dtypes.bfloat16),
        "b.lora_A": np.zeros((4, 8), np.float16),
        "step": np.array(3, np.int64),
    }
    return write_st(tmp_path / "m.safetensors", tensors), tensors


def test_json_carries_every_figure(ckpt):
    path, tensors = ckpt
    out = js("stats", path)
    assert (out["schema"], out["command"]) == (1, "stats")
    [c] = out["checkpoints"]
    assert list(c) == ["path", "format", "summary", "tensors", "skipped"]
    assert (c["path"], c["format"], c["skipped"]) == (str(path), "safetensors", [])
    for t in c["tensors"]:
        assert list(t) == FIELDS
        a = tensors[t["name"]]
        assert (t["dtype"], t["shape"]) == (a.dtype.name, list(a.shape))
        assert {k: t[k] for k in FIELDS[3:]} == as_json(tensor_stats(a)), t["name"]
    s = c["summary"]
    assert s["tensor_count"] == 5 and s["count"] == sum(a.size for a in tensors.values())
    assert (s["max_abs"], s["max_abs_tensor"]) == ("inf", "a.weight")
    assert (s["nan"], s["posinf"], s["all_zero"], s["nonfinite"]) == (1, 1, ["b.lora_A"], ["a.weight"])
    assert s["overflow"]["float16"] == int(np.count_nonzero(np.abs(tensors["a.bias"]) >= 65520))


def test_jobs_give_the_same_json_bytes(ckpt, monkeypatch):
    monkeypatch.setattr(_engine, "CHUNK_BYTES", 1 << 13)
    monkeypatch.setattr(_engine, "_MIN_CHUNK", 1 << 13)
    monkeypatch.setattr(_engine, "_BYTES_PER_WORKER", 1)
    path, _ = ckpt
    outs = {ok("stats", path, "--jobs", j, "--format", "json", "--depth", "1").stdout for j in (1, 2, 8)}
    assert len(outs) == 1


def test_library_report_is_the_json(ckpt, monkeypatch):
    path, _ = ckpt
    monkeypatch.chdir(path.parent)
    report = clipcli.stats_of(path.name, include="a.*", sort="max_abs", top=1, cast="float16")
    args = ("stats", path.name, "--include", "a.*", "--sort", "max_abs", "--top", "1", "--cast", "float16")
    assert report.to_dict() == js(*args)
    [t] = report.to_dict()["checkpoints"][0]["tensors"]
    assert t["name"] == "a.weight" and [c["dtype"] for c in t["casts"]] == ["float16"]
    assert clipcli.failures(report, fail_nonfinite=True) == [
        f"{path.name}: tensor a.weight: holds 1 NaN, 1 +Inf and 0 -Inf values (--fail-nonfinite)"
    ]
    assert clipcli.failures(report) == []
    with pytest.raises(TypeError):
        clipcli.failures(report, fail_above=1.0)


def test_table_essentials_histogram_and_summary(ckpt):
    path, tensors = ckpt
    lines = ok("stats", path, "--sort", "name").stdout.splitlines()
    assert lines[0] == f"{path}: safetensors, 5 tensors, {sum(a.size for a in tensors.values()):,} values"
    assert lines[1].startswith("max |x| inf (a.weight); nan 1, +inf 1, -inf 0; 1 all-zero tensor, 1 constant")
    head = lines[2].split()
    assert head[:3] == ["tensor", "dtype", "min"] and head[-1] == "exponents"
    assert {"f16", "bf16", "e4m3", "e5m2"} <= set(head)
    rows = {line.split()[0]: line for line in lines[3:]}
    assert "all-zero" in rows["b.lora_A"] and rows["step"].split()[2:6] == ["3", "3", "3", "3"]
    exponents = tensor_stats(tensors["a.bias"]).exponents
    lo, hi = exponents[0][0], exponents[-1][0]
    bars = rows["a.bias"].split(f"2^{lo} ")[1].split(f" 2^{hi}")[0]
    assert len(bars) == hi - lo + 1 and set(bars) <= set(" ▁▂▃▄▅▆▇█") and "█" in bars


def test_sort_and_top_show_rows_but_the_summary_covers_all(ckpt):
    path, _ = ckpt
    full, top = js("stats", path)["checkpoints"][0], js("stats", path, "--sort", "std", "--top", "1")["checkpoints"][0]
    assert top["summary"] == full["summary"]
    assert [t["name"] for t in top["tensors"]] == ["a.weight"]  # NaN sorts above every number
    assert "showing 1 of 5 tensors" in ok("stats", path, "--top", "1").stdout


def test_depth_groups(ckpt):
    path, tensors = ckpt
    c = js("stats", path, "--depth", "1")["checkpoints"][0]
    groups = {g["name"]: g for g in c["groups"]}
    assert c["group_count"] == 3 and groups["b"]["all_zero"] == 1 and groups["a"]["nan"] == 1
    assert groups["b"]["count"] == tensors["b.weight"].size + tensors["b.lora_A"].size
    assert "group" in ok("stats", path, "--depth", "1").stdout
    rows = list(csv.DictReader(io.StringIO(ok("stats", path, "--depth", "1", "--format", "csv").stdout)))
    by_group = {r["name"]: r for r in rows if r["kind"] == "group"}
    assert set(by_group) == {"a", "b", "step"} and by_group["b"]["all_zero"] == "1"
    assert by_group["a"]["float16_overflow"] == str(groups["a"]["overflow"]["float16"])


def test_csv_header_and_rows(ckpt):
    path, tensors = ckpt
    rows = list(csv.DictReader(io.StringIO(ok("stats", path, "--format", "csv").stdout)))
    header = ok("stats", path, "--format", "csv").stdout.splitlines()[0].split(",")
    assert header[:4] == ["path", "name", "dtype", "shape"] and header[-2:] == ["exponents", "kind"]
    assert "float16_overflow" in header and "float8_e5m2_rel_error" in header
    by_name = {r["name"]: r for r in rows if r["kind"] == "tensor"}
    s = tensor_stats(tensors["a.bias"])
    assert float(by_name["a.bias"]["std"]) == s.std and int(by_name["a.bias"]["argmax_abs"]) == s.argmax_abs
    assert by_name["a.weight"]["nan"] == "1" and by_name["step"]["float16_overflow"] == ""
    assert by_name["a.bias"]["exponents"] == " ".join(f"{e}:{n}" for e, n in s.exponents)
    [whole] = [r for r in rows if r["kind"] == "checkpoint"]
    assert whole["count"] == str(sum(a.size for a in tensors.values())) and whole["max_abs"] == "inf"


def test_names_with_control_characters_are_escaped_in_the_table(tmp_path):
    path = write_st(tmp_path / "m.safetensors", {"evil\x1b[31m\n.w": np.ones(3, np.float32)})
    out = ok("stats", path).stdout
    assert "\x1b" not in out and "evil\\x1b[31m\\n.w" in out
    assert js("stats", path)["checkpoints"][0]["tensors"][0]["name"] == "evil\x1b[31m\n.w"


def test_an_ascii_stdout_gets_an_ascii_histogram(tmp_path):
    w = np.random.default_rng(3).standard_normal(5000).astype(np.float32)
    src = write_st(tmp_path / "m.safetensors", {"w": w})
    env = {**os.environ, "PYTHONIOENCODING": "ascii", "NO_COLOR": "1"}
    done = subprocess.run([sys.executable, "-m", "clipcli", "stats", str(src)], capture_output=True, env=env)
    assert (done.returncode, done.stderr) == (0, b"")
    row = done.stdout.decode("ascii").splitlines()[-1]
    exponents = tensor_stats(w).exponents
    lo, hi = exponents[0][0], exponents[-1][0]
    bars = row.split(f"2^{lo} ")[1].split(f" 2^{hi}")[0]
    assert len(bars) == hi - lo + 1 and set(bars) <= set(" .:-=+*#@") and "\\u" not in row
    counts = dict(exponents)
    levels = [" .:-=+*#@".index(c) for c in bars]
    assert [bool(n) for n in levels] == [e in counts for e in range(lo, hi + 1)]  # a blank where a binade has none
    by_count = sorted((counts.get(lo + i, 0), n) for i, n in enumerate(levels))
    assert [n for _, n in by_count] == sorted(levels) and len(set(levels)) >= 5  # taller for more values


def test_each_gate_exits_1_when_it_should_and_0_when_not(ckpt):
    path, _ = ckpt
    cases = [
        (("--fail-nonfinite",), 1),
        (("--fail-nonfinite", "--exclude", "a.weight"), 0),
        (("--fail-max-abs", "1e30", "--exclude", "a.weight"), 0),
        (("--fail-max-abs", "10", "--exclude", "a.weight"), 1),
        (("--fail-max-abs", "1e30", "--include", "a.weight"), 1),  # an Inf and a NaN exceed any bound
        (("--fail-cast-overflow", "float16", "--include", "a.bias"), 1),
        (("--fail-cast-overflow", "bfloat16", "--include", "a.bias"), 0),
        (("--fail-cast-overflow", "float16", "--include", "b.*", "--cast", "float8_e5m2"), 0),
        (("--fail-all-zero",), 1),
        (("--fail-all-zero", "--exclude", "*lora*"), 0),
    ]
    for args, status in cases:
        result = run("stats", path, "--quiet", *args)
        assert result.exit_code == status, (args, result.output)
        if status:
            assert result.stderr.startswith(f"clipcli: error: {path}: tensor ") and result.stderr.count("\n") == 1


def test_a_gate_with_no_floating_tensor_selected_is_a_usage_error(ckpt):
    path, _ = ckpt
    for gate in (
        ["--fail-nonfinite"],
        ["--fail-max-abs", "1"],
        ["--fail-all-zero"],
        ["--fail-cast-overflow", "float16"],
    ):
        result = run("stats", path, "--include", "step", *gate)
        assert result.exit_code == 2 and "nothing to check" in result.stderr, gate
    assert run("stats", path, "--include", "step").exit_code == 0


def test_bad_options_are_usage_errors(ckpt):
    path, _ = ckpt
    for args in (["--cast", "float4"], ["--fail-cast-overflow", "int8"], ["--fail-max-abs", "-1"], ["--sort", "x"]):
        result = run("stats", path, *args)
        assert result.exit_code == 2, args
    result = run("stats", path, "--include", "nothing.*")
    assert result.exit_code == 2 and "nothing.*" in result.stderr


def test_bad_input_exits_3_with_one_line(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    result = run("stats", bad)
    assert result.exit_code == 3 and result.stderr.startswith("clipcli: error: ") and result.stderr.count("\n") == 1
    assert run("stats", tmp_path / "missing.safetensors").exit_code == 3


def test_help_has_examples():
    text = ok("stats", "--help").stdout
    assert "Examples:" in text and "clipcli stats model.safetensors" in text


def test_json_parses_strictly_and_several_checkpoints(ckpt):
    path, _ = ckpt
    text = ok("stats", path, SAMPLES / "grads.npz", "--format", "json").stdout
    out = json.loads(text, parse_constant=lambda c: pytest.fail(c))
    assert [c["format"] for c in out["checkpoints"]] == ["safetensors", "npz"]


READ_BY_TORCH = WRITTEN_BY_TORCH


@pytest.mark.parametrize("path", READ_BY_TORCH, ids=lambda p: p.name)
def test_files_torch_wrote_as_their_values_read_whole(path):
    # views, tied weights, big-endian and legacy files, distributed checkpoints: streamed figures against the
    # core's over the values `read` gives (another read path)
    report = clipcli.stats_of(path).to_dict()["checkpoints"][0]
    with clipcli.open(path) as ckpt:
        for t in report["tensors"]:
            assert {k: t[k] for k in FIELDS[3:]} == as_json(tensor_stats(ckpt.read(t["name"]))), t["name"]


_COUNTS = st.integers(0, 2**64)
_FIGURE = st.one_of(st.none(), st.floats(), st.integers(-(2**64), 2**64), st.sampled_from([-0.0, 5e-324]))
_CASTS = st.lists(
    st.builds(
        CastReadiness, st.sampled_from(["float16", "float8_e5m2"]), _COUNTS, _COUNTS, _COUNTS, st.none() | st.floats()
    ),
    max_size=4,
).map(tuple)
_STATS = st.builds(
    TensorStats,
    dtype=st.just("float32"),
    count=_COUNTS,
    min=_FIGURE,
    max=_FIGURE,
    max_abs=_FIGURE,
    argmax_abs=st.none() | _COUNTS,
    mean=st.none() | st.floats(),
    std=st.none() | st.floats(),
    zeros=_COUNTS,
    subnormals=_COUNTS,
    nan=_COUNTS,
    posinf=_COUNTS,
    neginf=_COUNTS,
    exponents=st.lists(st.tuples(st.integers(-1100, 1100), _COUNTS), max_size=5).map(tuple),
    all_zero=st.booleans(),
    constant=st.booleans(),
    casts=_CASTS,
)


@settings(max_examples=300, deadline=None)
@given(name=st.text(), shape=st.lists(st.integers(0, 2**40), max_size=4).map(tuple), s=_STATS)
def test_a_tensor_row_is_written_as_the_encoder_writes_it(name, shape, s):
    row = StatsRow(name, "float32", shape, 0, True, s)
    fields = {"name": name, "dtype": "float32", "shape": list(shape)}
    fields |= {f: render.num(getattr(s, f)) for f in FIELDS[3:-2]}
    fields["exponents"] = [list(p) for p in s.exponents]
    fields["casts"] = [
        {
            "dtype": c.dtype,
            "overflow": c.overflow,
            "flush": c.flush,
            "subnormal": c.subnormal,
            "rel_error": render.num(c.rel_error),
        }
        for c in s.casts
    ]
    assert tensor_json(row) == render.COMPACT.encode(fields)


def test_stats_of_float32_tensors_imports_no_ml_dtypes(tmp_path):
    # the cast targets' figures are fixed numbers (pinned against ml_dtypes in tests/core/test_stats.py): a run
    # over float32 values (cast by _fused's loop) paid ml_dtypes' import (5 ms of its start) for none of its types
    path = write_st(tmp_path / "f.safetensors", {"a": np.arange(6, dtype=np.float32), "b": -np.ones(3, np.float32)})
    code = (
        "import sys\nfrom clipcli.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
        "    assert not e.code, e.code\nprint('ml_dtypes' in sys.modules)"
    )
    args = [sys.executable, "-c", code, "stats", str(path), "--format", "json"]
    r = subprocess.run(args, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    report, imported = r.stdout.rsplit("\n", 2)[:2]
    casts = json.loads(report)["checkpoints"][0]["tensors"][0]["casts"]
    assert [c["dtype"] for c in casts] == ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
    assert imported == "False"
