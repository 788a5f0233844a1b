"""Issue 22, diff: metadata in --fail-different, rel where A holds NaN, per-tensor speed of many small pairs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file
from typer.testing import CliRunner

from clipcli import commands, core
from clipcli.checkpoint import engine as _engine
from clipcli.checkpoint import open_checkpoint
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


# --- item 24: many small pairs, measured together -------------------------------------------------

F32, F64, BF16, F16 = np.float32, np.float64, ml_dtypes.bfloat16, np.float16


def small_pairs(seed: int, da, db, specials: bool, n: int = 40):
    """Pairs of small tensors lying one after another: values of several scales, some pairs equal."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 300, n).tolist()
    scale = 10.0 ** rng.integers(-30, 30, n).repeat(sizes) if da == db == F64 else 1.0
    a = (rng.standard_normal(sum(sizes)) * scale).astype(da)
    b = (a.astype(F64) * (1 + rng.choice([0, 1e-3, 1], sum(sizes)) * rng.standard_normal(sum(sizes)))).astype(db)
    starts = np.cumsum(sizes) - sizes
    b[starts[0] : starts[0] + sizes[0]] = a[starts[0] : starts[0] + sizes[0]]  # an equal pair
    if specials:
        a[starts[1]], b[starts[2] + 1], a[starts[3]], b[starts[3]] = np.nan, np.inf, np.nan, np.nan
        if da == db == F64:
            a[starts[4]], b[starts[4]] = 1.5e308, -1.5e308  # a difference beyond float64
    return a, b, sizes


@pytest.mark.parametrize("p", [2, 1, 3, np.inf])
@pytest.mark.parametrize(("da", "db"), [(F32, F32), (F64, F64), (BF16, BF16), (F16, F16), (F32, BF16)])
@pytest.mark.parametrize("specials", [False, True])
def test_small_pairs_measured_together_give_each_pairs_own_bits(p, da, db, specials):
    # issue 22 item 24: 12,000 tiny pairs cost 1 ms each in DiffAccumulators; `small_diffs` measures a run of
    # them in a few NumPy passes, and must give every figure of each pair's own accumulator, bit for bit
    a, b, sizes = small_pairs(hash((p, str(da), str(db), specials)) % 2**32, da, db, specials)
    s = core.small_diffs(a, b, sizes, p)
    alone, total = [], core.DiffAccumulator(p)
    for start, n in zip(np.cumsum(sizes) - sizes, sizes, strict=True):
        acc = core.DiffAccumulator(p)
        acc.add(a[start : start + n], b[start : start + n])
        alone.append(acc)
        total.merge(acc)
    assert repr(s.figures()) == repr([acc.result().figures() for acc in alone])
    assert all(repr(s.accumulator(j).result()) == repr(acc.result()) for j, acc in enumerate(alone))
    merged = core.DiffAccumulator(p)
    s.merge_into(merged)
    assert repr(merged.result()) == repr(total.result())
    assert repr(s.shares_of(total)) == repr([acc.share_of(total) for acc in alone])


def test_rel_and_cosine_roots_in_double_double_are_the_exact_ones():
    # issue 22 item 24: rel and cosine of many pairs are rounded from double-double quotients where that is
    # certain; they must be the correctly rounded roots of the exact sums' quotients
    rng = np.random.default_rng(3)
    n = 20_000
    a, b, c, d = (rng.random((4, n)) + 0.5) * np.exp2(rng.integers(-100, 100, (4, n)))
    b[: n // 2] = a[: n // 2]  # (Σab)² over Σa²Σb²: a square over a product
    c[n // 4 :] = a[n // 4 :] * (1 + rng.standard_normal(n - n // 4) * 1e-9)  # nearly 1: cosines of close pairs
    sure, roots = core._sqrt_quotients(a, b, c, d)
    assert sure.mean() > 0.99
    for j in np.flatnonzero(sure).tolist():
        terms = [core._int_term(float(x[j]), 0) for x in (a, b, c, d)]
        (na, ea), (nb, eb), (nc, ec), (nd, ed) = terms
        exact = core._ldexp(*core._root(*core._int_quotient(na * nb, ea + eb, nc * nd, ec + ed), 2.0))
        assert roots[j] == exact, (a[j], b[j], c[j], d[j])


def lora(path: Path, n: int, seed: int, gaps: bool = False) -> Path:
    """n small tensors (a LoRA adapter's shapes, some of other dtypes), as .safetensors or as an .npz (whose
    members have headers between them)."""
    rng = np.random.default_rng(0)
    noise = np.random.default_rng(seed)
    tensors = {}
    for i in range(n):
        x = rng.standard_normal((8, 16)) + (noise.standard_normal((8, 16)) * 1e-3 if i % 3 else 0.0)
        tensors[f"layers.{i // 8}.lora_{i % 2}.{i}.weight"] = x.astype([F32, F32, F32, F16][i % 4])
    tensors["big"] = rng.standard_normal(3 * core.BLOCK + 5).astype(F32) + seed  # not small: alone
    tensors["step"] = np.array(seed, np.int64)  # compared for sameness only
    if gaps:
        np.savez(path, **tensors)
        return path
    return write(path, tensors)


def test_small_pairs_read_together_report_what_pairs_read_alone_report(tmp_path, monkeypatch):
    # issue 22 item 24: pairs of small tensors read together (both sides at once, per run of dtypes) must
    # report every figure, share, group and sameness as pairs read one by one
    a = lora(tmp_path / "a.safetensors", 300, 0)
    outs = {}
    for name, b in (("b", lora(tmp_path / "b.safetensors", 300, 1)), ("npz", lora(tmp_path / "b.npz", 300, 1, True))):
        for together in (True, False):
            if not together:
                monkeypatch.setattr(_engine, "SMALL_TENSOR", -1)  # every pair a task of its own
            with open_checkpoint(a) as ca, open_checkpoint(b) as cb:
                for ord in (2.0, 3.0):
                    report = commands.diff(ca, cb, commands.Selection(), ord, depth=3)
                    outs[name, together, ord] = repr((report.stats, report.tensors, report.others, report.groups))
            monkeypatch.undo()
        for ord in (2.0, 3.0):
            assert outs[name, True, ord] == outs[name, False, ord]
    assert outs["b", True, 2.0] == outs["npz", True, 2.0]  # the same tensors in another layout: the same bits
    monkeypatch.setattr(_engine, "_BYTES_PER_WORKER", 1)  # two workers, and forked ones, on a small input
    monkeypatch.setattr(_engine, "_PROCESS_BYTES", 0)
    monkeypatch.setattr(_engine, "CHUNK_BYTES", 1 << 14)  # runs of a few pairs: many tasks for the workers
    monkeypatch.setattr(_engine, "_MIN_CHUNK", 1 << 14)
    with open_checkpoint(a) as ca, open_checkpoint(tmp_path / "b.safetensors") as cb:
        report = commands.diff(ca, cb, commands.Selection(), 2.0, depth=3, jobs=2)
    assert repr((report.stats, report.tensors, report.others, report.groups)) == outs["b", True, 2.0]


def test_many_small_pairs_make_no_accumulator_each(tmp_path, monkeypatch):
    # issue 22 item 24: a DiffAccumulator per pair (and its merge, result, row objects) cost 1 ms a tensor
    a, b = lora(tmp_path / "a.safetensors", 2000, 0), lora(tmp_path / "b.safetensors", 2000, 1)
    made = []
    init = core.DiffAccumulator.__init__
    monkeypatch.setattr(core.DiffAccumulator, "__init__", lambda self, *args: made.append(1) or init(self, *args))
    with open_checkpoint(a) as ca, open_checkpoint(b) as cb:
        report = commands.diff(ca, cb, commands.Selection(), 2.0)
    assert len(report.tensors) == 2001 and len(made) < 10
