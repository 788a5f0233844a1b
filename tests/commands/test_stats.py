"""`stats`: each tensor's figures against the core's `tensor_stats` of the array and against references built here
(NumPy float64, `fractions`, `ml_dtypes` casts), the same in every format, chunking and number of workers."""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from fractions import Fraction
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from clipcli.checkpoint import TensorInfo, open_checkpoint
from clipcli.checkpoint import engine as _engine
from clipcli.commands.select import Selection
from clipcli.commands.stats import (
    StatsKernel,
    StatsLimits,
    StatsOptions,
    check_casts,
    check_measured,
    failures,
    stats,
)
from clipcli.core.stats import tensor_stats
from clipcli.errors import UsageError
from clipcli.report.stats import StatsReport
from tests.helpers import torch_tensor_pickle, torch_zip_file, write_st

RNG = np.random.default_rng(2025)
# planted: zeros of both signs, NaN, ±Inf, a float32 subnormal, values that overflow float16 and float8_e4m3fn,
# flush to zero or land subnormal in float16
PLANTED = [0.0, -0.0, math.nan, math.inf, -math.inf, 1e-40, 70000.0, 1e-8, 3e-6, 500.0, -2.5]


def planted(n: int, dtype, scale: float = 1.0) -> np.ndarray:
    a = (RNG.standard_normal(n) * scale).astype(np.float64)
    a[: len(PLANTED)] = PLANTED
    RNG.shuffle(a)
    with np.errstate(over="ignore"):
        return a.astype(dtype)


TENSORS = {
    "f32": planted(3000, np.float32).reshape(30, 100),
    "f16": planted(500, np.float16),
    "bf16": planted(700, ml_dtypes.bfloat16).reshape(7, 100),
    "f64": planted(400, np.float64, 1e200),
    "e4m3": (RNG.standard_normal(90) * 40).astype(ml_dtypes.float8_e4m3fn),
    "c64": (RNG.standard_normal(40) + 1j * RNG.standard_normal(40)).astype(np.complex64),
    "i64": RNG.integers(-(2**62), 2**62, 50),
    "i8": np.array([-128, 0, 127, 5], np.int8),
    "mask": np.array([True, False, True]),
    "zeros": np.zeros((4, 4), np.float32),
    "const": np.full(6, 1.5, np.float16),
    "scalar": np.array(-7.25, np.float32),
    "empty": np.zeros((0, 3), np.float32),
}


def report_of(path: Path, jobs: int = 1, **kw) -> StatsReport:
    with open_checkpoint(path) as ckpt:
        return StatsReport((stats(ckpt, StatsOptions(jobs=jobs, **kw)),))


def rows_of(path: Path, **kw) -> dict:
    return {r.name: r.stats for r in report_of(path, **kw).checkpoints[0].every}


# --- references, independent of the core ------------------------------------------------------------


def parts(a: np.ndarray) -> np.ndarray:
    """The values the figures are over, flat in C order (a complex tensor's real and imaginary parts in turn)."""
    flat = np.asarray(a).reshape(-1)
    return flat.view(np.dtype(f"f{flat.dtype.itemsize // 2}")) if flat.dtype.kind == "c" else flat


def ref_figures(a: np.ndarray) -> dict:
    """count, extremes, counts, exponents, mean (exact, from Fractions) and flags, from NumPy float64."""
    x = parts(a)
    if x.dtype.kind in "biu":
        v = [int(i) for i in x.astype(object)] if x.dtype.kind != "b" else [int(b) for b in x]
        peak = max(range(len(v)), key=lambda i: (abs(v[i]), -i)) if v else None
        return {
            "count": len(v),
            "min": min(v, default=None),
            "max": max(v, default=None),
            "max_abs": None if peak is None else abs(v[peak]),
            "argmax_abs": peak,
            "mean": float(Fraction(sum(v), len(v))) if v else None,
            "zeros": v.count(0),
            "exponents": (),
        }
    with np.errstate(invalid="ignore"):
        w = x.astype(np.float64)
    nan, finite = np.isnan(w), np.isfinite(w)
    numbers = w[~nan]
    magnitude = np.where(nan, -1.0, np.abs(w))
    nonzero = w[finite & (w != 0)]
    exponents = Counter((np.frexp(nonzero)[1] - 1).tolist())
    tiny = float(ml_dtypes.finfo(x.dtype).smallest_normal)
    out = {
        "count": w.size,
        "min": float(numbers.min()) + 0.0 if numbers.size else None,
        "max": float(numbers.max()) + 0.0 if numbers.size else None,
        "max_abs": float(np.abs(numbers).max()) if numbers.size else None,
        "argmax_abs": int(np.argmax(magnitude)) if numbers.size else None,
        "zeros": int(np.count_nonzero(w == 0)),
        "nan": int(nan.sum()),
        "posinf": int(np.count_nonzero(w == math.inf)),
        "neginf": int(np.count_nonzero(w == -math.inf)),
        "subnormals": int(np.count_nonzero(np.abs(nonzero) < tiny)),
        "exponents": tuple(sorted(exponents.items())),
        "all_zero": w.size > 0 and bool((w == 0).all()),
        "constant": w.size > 1 and not nan.any() and bool((w == w[0]).all()),
    }
    if finite.all() and w.size:
        exact = sum(map(Fraction, w.tolist()), Fraction(0)) / w.size
        out["mean"] = float(exact)
        variance = sum((Fraction(v) - exact) ** 2 for v in w.tolist()) / w.size
        out["std"] = math.sqrt(variance)  # (correctly rounded in the command: compared within 2 ulps)
    return out


def ref_cast(a: np.ndarray, target: str) -> tuple[int, int, int, float | None]:
    """overflow, flush, subnormal and the relative error of a cast by ml_dtypes (values of 32 bits or fewer: a
    single rounding), the error over the finite values that survive it, summed exactly."""
    x = parts(a)
    with np.errstate(invalid="ignore", over="ignore"):
        w = x.astype(np.float64)
        c = x.astype(np.float32).astype(target).astype(np.float64)
    finite, survives = np.isfinite(w), np.isfinite(c)
    tiny = float(ml_dtypes.finfo(target).smallest_normal)
    overflow = int(np.count_nonzero(finite & ~survives))
    flush = int(np.count_nonzero(finite & (w != 0) & (c == 0)))
    subnormal = int(np.count_nonzero(survives & (c != 0) & (np.abs(c) < tiny)))
    keep = finite & survives
    num = sum((Fraction(u) - Fraction(v)) ** 2 for u, v in zip(w[keep].tolist(), c[keep].tolist(), strict=True))
    den = sum(Fraction(u) ** 2 for u in w[keep].tolist())
    return overflow, flush, subnormal, (math.sqrt(num / den) if den else None)


def check_against_references(s, a: np.ndarray) -> None:
    ref = ref_figures(a)
    std = ref.pop("std", None)
    for k, v in ref.items():
        got = getattr(s, k)
        assert got == v or (isinstance(v, float) and math.isnan(v) and math.isnan(got)), (k, got, v)
    if std is not None:
        assert s.std == pytest.approx(std, rel=4e-16, abs=0)
    if parts(a).dtype.itemsize <= 4:
        for c in s.casts:
            overflow, flush, subnormal, rel = ref_cast(a, c.dtype)
            assert (c.overflow, c.flush, c.subnormal) == (overflow, flush, subnormal), c
            assert (c.rel_error is None) == (rel is None) and (rel is None or c.rel_error == pytest.approx(rel, 1e-12))


# --- the figures ------------------------------------------------------------------------------------


def test_every_figure_against_the_core_and_the_references(tmp_path):
    rows = rows_of(write_st(tmp_path / "a.safetensors", TENSORS))
    assert sorted(rows) == sorted(TENSORS)
    for name, a in TENSORS.items():
        assert repr(rows[name]) == repr(tensor_stats(a)), name  # repr: NaN figures compare equal
        check_against_references(rows[name], a)


def test_the_planted_values_are_counted(tmp_path):
    s = rows_of(write_st(tmp_path / "a.safetensors", {"f32": TENSORS["f32"]}))["f32"]
    assert (s.nan, s.posinf, s.neginf) == (1, 1, 1)
    assert s.zeros >= 2 and s.subnormals == 1 and s.max_abs == math.inf
    casts = {c.dtype: c for c in s.casts}
    assert list(casts) == ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]  # narrower than float32
    assert casts["float16"].overflow == 1 and casts["float16"].flush >= 2 and casts["float16"].subnormal >= 1
    assert casts["float8_e4m3fn"].overflow == 2  # 70000 and 500: e4m3fn's largest is 448


def test_cast_targets_as_asked(tmp_path):
    path = write_st(tmp_path / "a.safetensors", TENSORS)
    rows = rows_of(path, casts=("float8_e5m2", "float16"))
    assert [c.dtype for c in rows["f32"].casts] == ["float16", "float8_e5m2"]  # in the report's order
    assert [c.dtype for c in rows["f16"].casts] == ["float16", "float8_e5m2"]  # asked: even if not narrower
    assert rows["i64"].casts == () and rows["mask"].casts == ()
    assert [c.dtype for c in rows_of(path, also_cast=("float16",))["bf16"].casts] == [
        "float16",
        "float8_e4m3fn",
        "float8_e5m2",
    ]
    with pytest.raises(UsageError, match="float4"):
        check_casts(["float4"], "--cast")


def test_a_bfloat16_tensor_that_overflows_float16(tmp_path):
    a = np.array([1.0, 65504.0, 65520.0, 1e5, -3e38], ml_dtypes.bfloat16)
    s = rows_of(write_st(tmp_path / "a.safetensors", {"b": a}), also_cast=("float16",))["b"]
    (f16,) = [c for c in s.casts if c.dtype == "float16"]
    assert f16.overflow == ref_cast(a, "float16")[0] == 4  # in bfloat16 65504 and 65520 are 65536


# --- formats, chunks, workers -----------------------------------------------------------------------

_STORAGE = {"float32": "FloatStorage", "float64": "DoubleStorage", "int64": "LongStorage"}


def write_pt(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    """A torch.save zip written by hand: a dict of tensors, one storage each (C-order strides)."""
    body, storages = b"", {}
    for i, (name, a) in enumerate(tensors.items()):
        strides = tuple(int(np.prod(a.shape[k + 1 :])) for k in range(a.ndim))
        body += b"X" + struct.pack("<I", len(name)) + name.encode()
        body += torch_tensor_pickle(str(i), a.size, a.shape, strides, _STORAGE[a.dtype.name])
        storages[str(i)] = np.ascontiguousarray(a).tobytes()
    return torch_zip_file(path, b"\x80\x02}(" + body + b"u.", storages)


def write_sharded(d: Path, tensors: dict[str, np.ndarray]) -> Path:
    d.mkdir()
    names = list(tensors)
    weight_map = {}
    for k, group in enumerate((names[::2], names[1::2])):
        file = f"model-0000{k + 1}-of-00002.safetensors"
        write_st(d / file, {n: tensors[n] for n in group})
        weight_map.update(dict.fromkeys(group, file))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d / "model.safetensors.index.json"


def every_format(d: Path, tensors: dict[str, np.ndarray]) -> dict[str, Path]:
    d.mkdir(exist_ok=True)
    native = {n: a for n, a in tensors.items() if a.dtype.kind in "biufc"}  # .npz has no bfloat16 or float8
    np.savez(d / "stored.npz", **native)
    np.savez_compressed(d / "deflated.npz", **native)
    out = {
        "safetensors": write_st(d / "one.safetensors", tensors),
        "sharded": write_sharded(d / "shards", tensors),
        "npz stored": d / "stored.npz",
        "npz deflated": d / "deflated.npz",
    }
    if all(a.dtype.name in _STORAGE for a in tensors.values()):
        out["pt"] = write_pt(d / "model.pt", tensors)
    return out


def same_figures(path: Path, tensors: dict[str, np.ndarray], jobs: int = 1) -> None:
    rows = rows_of(path, jobs=jobs)
    assert set(rows) >= {n for n, a in tensors.items() if a.dtype.kind in "biufc"}, path
    assert {n: repr(s) for n, s in rows.items()} == {n: repr(tensor_stats(tensors[n])) for n in rows}, path


def test_the_same_figures_in_every_format(tmp_path):
    for path in every_format(tmp_path / "all", TENSORS).values():
        same_figures(path, TENSORS)  # (.pt: written for the dtypes it has below)
    torch_kinds = {n: TENSORS[n] for n in ("f32", "f64", "i64", "scalar", "empty")}
    same_figures(every_format(tmp_path / "pt", torch_kinds)["pt"], torch_kinds)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int16, np.complex64, np.bool_])
def test_fortran_and_big_endian_npy_as_their_c_order_twin(tmp_path, dtype):
    a = (RNG.standard_normal((5, 1, 70, 3)) * 50).astype(dtype)
    expected = repr(tensor_stats(a))  # argmax_abs is a C-order index; the cast errors' blocks are C-order blocks
    big = a.astype(a.dtype.newbyteorder(">"))
    for name, stored in (("c", a), ("f", np.asfortranarray(a)), ("b", big), ("fb", np.asfortranarray(big))):
        np.save(tmp_path / f"{name}.npy", stored)
        assert repr(rows_of(tmp_path / f"{name}.npy")[name]) == expected, name


@pytest.mark.parametrize("kind", ["threads", "processes"])
def test_larger_than_the_chunk_size_any_workers_the_same_bytes(tmp_path, monkeypatch, kind):
    monkeypatch.setattr(_engine, "CHUNK_BYTES", 1 << 12)
    monkeypatch.setattr(_engine, "_MIN_CHUNK", 1 << 12)
    monkeypatch.setattr(_engine, "_BYTES_PER_WORKER", 1)  # workers even for a small input
    monkeypatch.setattr(_engine, "_PROCESS_BYTES", 0 if kind == "processes" else 1 << 62)
    big = {
        "big": planted(301 * 97, np.float32).reshape(301, 97),
        "wide": planted(9000, np.float64, 1e10),
        "half": planted(5000, ml_dtypes.bfloat16),
        "small": np.arange(5.0),
        "ints": RNG.integers(-9, 9, (64, 70)),
        "fortran": np.asfortranarray(planted(3000, np.float32).reshape(60, 50)),
    }
    for fmt, path in every_format(tmp_path / "f", {k: v for k, v in big.items() if k != "fortran"}).items():
        texts = {report_of(path, jobs).to_json() for jobs in (1, 2, 8)}
        assert len(texts) == 1, fmt
        same_figures(path, {k: v for k, v in big.items() if k != "fortran"}, jobs=2)
    np.save(tmp_path / "fortran.npy", big["fortran"])
    for jobs in (1, 3):
        same_figures(tmp_path / "fortran.npy", {"fortran": big["fortran"]}, jobs)


def test_a_worker_finishes_a_tensor_whose_chunks_all_came_to_it_and_sends_back_only_its_figures():
    # (a pass deals each worker a run of chunks: most tensors' chunks all come to one worker, which finishes them
    # in parallel with the others, instead of sending its partial sums to the parent to merge and finish)
    x = planted(40_000, np.float32)
    t = TensorInfo("x", "float32", x.shape, x.nbytes, "f", x.dtype)
    kernel = StatsKernel(None, ())
    for start, end in ((32_768, 40_000), (0, 16_384)):  # in any order, as workers take chunks
        kernel.chunk(t, 4 * start, x[start:end])
    assert list(kernel.result()[0]) == ["x"] and kernel.result()[1] == {}  # (a part of it still to come)
    kernel.chunk(t, 4 * 16_384, x[16_384:32_768])
    accs, done = kernel.result()
    assert accs == {} and repr(done["x"]) == repr(tensor_stats(x))


# --- what is shown, skipped and gated ---------------------------------------------------------------


def test_skipped_with_the_reason_and_selection(tmp_path):
    path = tmp_path / "mixed.npz"
    np.savez(path, text=np.array(["ab", "c"]), x=np.arange(3.0), step=np.array(7))
    c = report_of(path).checkpoints[0]
    assert [r.name for r in c.tensors] == ["x", "step"]
    assert [(s.name, "carried as bytes" in s.reason) for s in c.skipped] == [("text", True)]
    c = report_of(path, selection=Selection(("x",))).checkpoints[0]
    assert [r.name for r in c.tensors] == ["x"] and {s.name for s in c.skipped} == {"text", "step"}
    with pytest.raises(UsageError, match="nothing"):
        report_of(path, selection=Selection(("nothing*",)))


def test_sort_and_top_choose_rows_the_summary_covers_all(tmp_path):
    path = write_st(tmp_path / "a.safetensors", TENSORS)
    whole = report_of(path).checkpoints[0]
    c = report_of(path, sort="max_abs", top=5).checkpoints[0]
    assert {r.name for r in c.tensors[:4]} == {"f32", "f16", "bf16", "f64"}  # an Inf each
    assert c.tensors[4].name == "i64"  # then 2**62-range integers
    assert c.summary == whole.summary and len(c.every) == len(TENSORS)
    assert c.summary.max_abs == math.inf
    assert c.summary.nan == sum(ref_figures(a).get("nan", 0) for a in TENSORS.values())
    assert c.summary.all_zero == ("zeros",) and c.summary.constant == 2
    most = report_of(path, sort="nonfinite", top=1).checkpoints[0].tensors
    assert [r.name for r in most] == ["f16"]  # its planted 70000 is one more Inf
    names = [r.name for r in report_of(path, sort="name").checkpoints[0].tensors]
    assert names == sorted(TENSORS)


def test_groups_by_depth(tmp_path):
    tensors = {"a.x": np.array([1.0, -4.0]), "a.y": np.zeros(3, np.float32), "b.z": np.array([2.0, math.nan])}
    c = report_of(write_st(tmp_path / "g.safetensors", tensors), depth=1).checkpoints[0]
    groups = {g.name: g for g in c.groups}
    assert (groups["a"].tensors, groups["a"].min, groups["a"].max_abs, groups["a"].all_zero) == (2, -4.0, 4.0, 1)
    assert (groups["b"].nan, groups["b"].max) == (1, 2.0)
    assert c.group_count == 2


def gate(path: Path, **limits) -> list[str]:
    report = report_of(path, also_cast=(limits["fail_cast_overflow"],) if "fail_cast_overflow" in limits else ())
    lim = StatsLimits(**limits)
    for c in report.checkpoints:
        check_measured(c, lim)
    return failures(report, lim)


def test_each_gate_fails_when_it_should_and_only_then(tmp_path):
    good = write_st(tmp_path / "good.safetensors", {"w": np.array([1.0, -3.0], np.float32), "step": np.array(10**6)})
    assert gate(good, fail_max_abs=3.0) == []  # the integer step is no value the gates look at
    assert gate(good, fail_max_abs=2.5) == [f"{good}: tensor w: max |x| 3.0 at flat index 1 exceeds --fail-max-abs 2.5"]
    assert gate(good, fail_cast_overflow="float16") == gate(good, fail_all_zero=True) == []
    assert gate(good, fail_nonfinite=True) == []
    big = write_st(tmp_path / "big.safetensors", {"w": np.array([1.0, 7e4], np.float32)})
    assert gate(big, fail_cast_overflow="float16") == [
        f"{big}: tensor w: 1 value would overflow float16 (--fail-cast-overflow float16)"
    ]
    assert gate(big, fail_cast_overflow="bfloat16") == []
    zero = write_st(tmp_path / "zero.safetensors", {"lora_A": np.zeros(4, np.float16), "b": np.ones(2, np.float16)})
    assert gate(zero, fail_all_zero=True) == [f"{zero}: tensor lora_A: is all zeros (--fail-all-zero)"]
    bad = write_st(tmp_path / "bad.safetensors", {"w": np.array([math.nan, 1.0], np.float32)})
    assert gate(bad, fail_nonfinite=True) == [
        f"{bad}: tensor w: holds 1 NaN, 0 +Inf and 0 -Inf values (--fail-nonfinite)"
    ]
    assert gate(bad, fail_max_abs=1e30)  # a NaN has no magnitude: never passes a bound


def test_a_gate_with_nothing_measured_is_a_usage_error(tmp_path):
    path = write_st(tmp_path / "ints.safetensors", {"step": np.array(3), "mask": np.array([True])})
    for limits in ({"fail_max_abs": 1.0}, {"fail_all_zero": True}, {"fail_nonfinite": True}):
        with pytest.raises(UsageError, match="nothing to check"):
            gate(path, **limits)
    assert gate(path) == []  # no gate: nothing to refuse


def test_ten_thousand_tiny_tensors(tmp_path):
    tensors = {f"layers.{i}.w": np.array([i, -i, 0.5], np.float32) for i in range(10_000)}
    c = report_of(write_st(tmp_path / "many.safetensors", tensors), jobs=2, top=3, sort="max_abs").checkpoints[0]
    assert c.summary.tensors == 10_000 and c.summary.max_abs == 9999.0
    assert [r.name for r in c.tensors] == ["layers.9999.w", "layers.9998.w", "layers.9997.w"]
    assert sum(r.stats.count for r in c.every) == 30_000
