"""diff in the commands layer: small tensors read and measured together report what pairs read alone do."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clipcli.checkpoint import engine as _engine
from clipcli.checkpoint import open_checkpoint
from clipcli.commands.diff import DiffOptions, diff
from clipcli.commands.select import Selection
from clipcli.core.blocks import BLOCK
from clipcli.core.differences import DiffAccumulator
from clipcli.errors import UsageError
from tests.helpers import write_st

F32, F16 = np.float32, np.float16


def lora(path: Path, n: int, seed: int, gaps: bool = False) -> Path:
    """n small tensors (a LoRA adapter's shapes, some of other dtypes), as .safetensors or as an .npz (whose
    members have headers between them)."""
    rng = np.random.default_rng(0)
    noise = np.random.default_rng(seed)
    tensors = {}
    for i in range(n):
        x = rng.standard_normal((8, 16)) + (noise.standard_normal((8, 16)) * 1e-3 if i % 3 else 0.0)
        tensors[f"layers.{i // 8}.lora_{i % 2}.{i}.weight"] = x.astype([F32, F32, F32, F16][i % 4])
    tensors["big"] = rng.standard_normal(3 * BLOCK + 5).astype(F32) + seed  # not small: alone
    tensors["step"] = np.array(seed, np.int64)  # compared for sameness only
    if gaps:
        np.savez(path, **tensors)
        return path
    return write_st(path, tensors)


def test_small_pairs_read_together_report_what_pairs_read_alone_report(tmp_path, monkeypatch):
    # pairs of small tensors read together (both sides at once, per run of dtypes) must report every figure,
    # share, group and sameness as pairs read one by one
    a = lora(tmp_path / "a.safetensors", 300, 0)
    outs = {}
    for name, b in (("b", lora(tmp_path / "b.safetensors", 300, 1)), ("npz", lora(tmp_path / "b.npz", 300, 1, True))):
        for together in (True, False):
            if not together:
                monkeypatch.setattr(_engine, "SMALL_TENSOR", -1)  # every pair a task of its own
            with open_checkpoint(a) as ca, open_checkpoint(b) as cb:
                for ord in (2.0, 3.0):
                    report = diff(ca, cb, DiffOptions(ord=ord, depth=3))
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
        report = diff(ca, cb, DiffOptions(depth=3, jobs=2))
    assert repr((report.stats, report.tensors, report.others, report.groups)) == outs["b", True, 2.0]


def test_many_small_pairs_make_no_accumulator_each(tmp_path, monkeypatch):
    # found measuring many tiny pairs: a DiffAccumulator per pair (and its merge, result, row objects) was the cost
    a, b = lora(tmp_path / "a.safetensors", 2000, 0), lora(tmp_path / "b.safetensors", 2000, 1)
    made = []
    init = DiffAccumulator.__init__
    monkeypatch.setattr(DiffAccumulator, "__init__", lambda self, *args: made.append(1) or init(self, *args))
    with open_checkpoint(a) as ca, open_checkpoint(b) as cb:
        report = diff(ca, cb)
    assert len(report.tensors) == 2001 and len(made) < 10


def test_names_only_in_b_are_found_in_linear_time(tmp_path):
    # found timing a 12,000-tensor diff (issue 22 item 24): B's names were checked against a set rebuilt per
    # name, 11 s of a 0.4 s run; 30,000 names took minutes
    import time

    n = 30_000
    a = write_st(tmp_path / "a.safetensors", {f"t.{i}": np.full(1, i, F32) for i in range(n)})
    b = write_st(tmp_path / "b.safetensors", {f"t.{i}": np.full(1, i, F32) for i in range(1, n + 1)})
    start = time.monotonic()
    with open_checkpoint(a) as ca, open_checkpoint(b) as cb:
        report = diff(ca, cb)
    assert report.only_a == ("t.0",) and report.only_b == (f"t.{n}",) and len(report.tensors) == n - 1
    assert time.monotonic() - start < 15


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    tensors=st.lists(
        st.tuples(
            st.sampled_from(["f32", "f16", "bf16", "i32", "f32-f16", "shape", "only-a", "only-b"]),
            st.sampled_from(["same", "changed", "nan", "zero", "empty"]),
        ),
        min_size=1,
        max_size=8,
    ),
    ord=st.sampled_from([2.0, 1.0, 3.0, np.inf]),
    include=st.sampled_from([(), ("t1*",), ("t[0-3]",)]),
    mapped=st.booleans(),
)
def test_a_diff_taken_at_once_reports_what_pairs_taken_one_by_one_report(tmp_path, tensors, ord, include, mapped):
    # the common case of diff's pairs and rows is tested at once (found timing two 12,000-tensor LoRA adapters):
    # every report the same as the loop over each pair makes
    import clipcli.commands.diff as command

    rng = np.random.default_rng(len(tensors))
    a, b = {}, {}
    for i, (kind, values) in enumerate(tensors):
        shape = (0, 3) if values == "empty" else (2, 3)
        x = rng.standard_normal(shape)
        y = x + (1e-3 if values == "changed" else 0.0)
        if values == "nan" and kind != "i32":
            x[0, 0] = y[0, 0] = np.nan
        if values == "zero":
            x = np.zeros_like(x)
        dtype_a, dtype_b = {"f32-f16": (np.float32, np.float16), "f16": (np.float16,) * 2}.get(kind, (np.float32,) * 2)
        dtype_a = dtype_b = {"bf16": ml_dtypes.bfloat16, "i32": np.int32}.get(kind, dtype_a)
        if kind != "only-b":
            a[f"t{i}"] = x.astype(dtype_a)
        if kind != "only-a":
            b[("m." if mapped else "") + f"t{i}"] = (y.T if kind == "shape" else y).astype(dtype_b)
    pa, pb = write_st(tmp_path / "a.safetensors", a), write_st(tmp_path / "b.safetensors", b)
    options = DiffOptions(selection=Selection(include), ord=ord, maps=(("", "m."),) if mapped else ())
    reports = []
    for at_once in (True, False):
        with pytest.MonkeyPatch.context() as patch:
            if not at_once:
                patch.setattr(command, "_comparable", lambda *args: ([], []))
                patch.setattr(command, "_plain_rows", lambda *args: [])
                patch.setattr(command, "_listed", lambda ts, s: {t.name: t for t in ts if s.selects(t.name)})
            with open_checkpoint(pa) as ca, open_checkpoint(pb) as cb:
                try:
                    reports.append(repr(diff(ca, cb, options)))
                except UsageError as e:
                    reports.append(str(e))
    assert reports[0] == reports[1]
