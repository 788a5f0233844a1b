"""The report as plain frozen dataclasses, and its table, JSON and CSV renderings."""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from typing import Any

SCHEMA = 1


@dataclass(frozen=True)
class TensorRow:
    """One selected tensor: its norm, largest magnitude, non-finite counts and share of the global norm**p."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    norm: float
    max_abs: float
    nan: int
    inf: int
    share: float | None
    norm_after: float | None = None


@dataclass(frozen=True)
class Skipped:
    """A tensor left out of the norms (and passed through unchanged by the clip commands)."""

    name: str
    dtype: str
    reason: str


@dataclass(frozen=True)
class Group:
    """Tensors whose names share their first N dot-separated parts."""

    name: str
    tensors: int
    norm: float
    share: float | None


@dataclass(frozen=True)
class InspectRow:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: str


@dataclass(frozen=True)
class CheckpointReport:
    """The report of one checkpoint; the clip fields are set by the clip commands only."""

    path: str
    global_norm: float = math.nan
    tensors: tuple[TensorRow, ...] = ()
    skipped: tuple[Skipped, ...] = ()
    groups: tuple[Group, ...] | None = None
    format: str | None = None
    metadata: dict[str, str] | None = None
    listing: tuple[InspectRow, ...] = ()
    clip: dict[str, float] = field(default_factory=dict)
    scale: float | None = None
    global_norm_after: float | None = None
    output: str | None = None


@dataclass(frozen=True)
class Report:
    command: str
    ord: float
    checkpoints: tuple[CheckpointReport, ...]


# --- JSON -------------------------------------------------------------------------------------------


def _num(x: float | None) -> Any:
    """A number for strict JSON: non-finite values become the strings 'nan', 'inf', '-inf'."""
    if x is None:
        return None
    if isinstance(x, int):
        return x
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def _ord(p: float) -> Any:
    return "inf" if math.isinf(p) else int(p) if p == int(p) else p


def to_json(report: Report) -> str:
    """The report as one strict JSON object (see the README for the schema)."""
    out: dict[str, Any] = {"schema": SCHEMA, "command": report.command}
    if report.command != "inspect":
        out["ord"] = _ord(report.ord)
    out["checkpoints"] = [_checkpoint_json(report.command, c) for c in report.checkpoints]
    return json.dumps(out, indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def _checkpoint_json(command: str, c: CheckpointReport) -> dict[str, Any]:
    if command == "inspect":
        return {
            "path": c.path,
            "format": c.format,
            "metadata": c.metadata or {},
            "tensors": [
                {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "nbytes": t.nbytes, "file": t.file}
                for t in c.listing
            ],
        }
    out: dict[str, Any] = {"path": c.path, "global_norm": _num(c.global_norm)}
    tensors = []
    for t in c.tensors:
        row = {
            "name": t.name,
            "dtype": t.dtype,
            "shape": list(t.shape),
            "norm": _num(t.norm),
            "max_abs": _num(t.max_abs),
            "nan": t.nan,
            "inf": t.inf,
            "share": _num(t.share),
        }
        if command != "global-norm":
            row["norm_after"] = _num(t.norm_after)
        tensors.append(row)
    out["tensors"] = tensors
    out["skipped"] = [{"name": s.name, "dtype": s.dtype, "reason": s.reason} for s in c.skipped]
    if c.groups is not None:
        out["groups"] = [
            {"name": g.name, "tensors": g.tensors, "norm": _num(g.norm), "share": _num(g.share)} for g in c.groups
        ]
    if command != "global-norm":
        out.update({k: _num(v) for k, v in c.clip.items()})
        if command == "clip-global-norm":
            out["scale"] = _num(c.scale)
        out["global_norm_after"] = _num(c.global_norm_after)
        out["output"] = c.output
    return out


# --- CSV --------------------------------------------------------------------------------------------


def _shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) if shape else "scalar"


def to_csv(report: Report) -> str:
    """One row per tensor (with its checkpoint's path), after a header row."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    if report.command == "inspect":
        w.writerow(["path", "name", "dtype", "shape", "nbytes", "file"])
        for c in report.checkpoints:
            for t in c.listing:
                w.writerow([c.path, t.name, t.dtype, _shape_text(t.shape), t.nbytes, t.file])
        return buf.getvalue()
    clip = report.command != "global-norm"
    w.writerow(
        ["path", "name", "dtype", "shape", "norm", "max_abs", "nan", "inf", "share"] + (["norm_after"] if clip else [])
    )
    for c in report.checkpoints:
        for t in c.tensors:
            row = [
                c.path,
                t.name,
                t.dtype,
                _shape_text(t.shape),
                _csv_num(t.norm),
                _csv_num(t.max_abs),
                t.nan,
                t.inf,
                _csv_num(t.share),
            ]
            w.writerow(row + ([_csv_num(t.norm_after)] if clip else []))
    return buf.getvalue()


def _csv_num(x: float | None) -> str:
    return "" if x is None else repr(float(x))


# --- Table ------------------------------------------------------------------------------------------


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.6g}"


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


_BLOCKS = " ▏▎▍▌▋▊▉█"


def _table() -> Any:
    from rich.table import Table

    return Table(box=None, pad_edge=False, padding=(0, 1, 0, 0))


def share_bar(share: float | None, width: int = 8) -> str:
    """A bar of eighth blocks for a share in [0, 1], followed by the percentage."""
    if share is None or math.isnan(share):
        return "-"
    eighths = round(min(max(share, 0.0), 1.0) * width * 8)
    bar = "█" * (eighths // 8) + (_BLOCKS[eighths % 8] if eighths % 8 else "")
    return f"{bar:<{width}} {share * 100:5.1f}%"


def headline(command: str, c: CheckpointReport, p: float) -> str:
    """The one line a person reads first."""
    norm_name = "global norm" if p == 2 else f"global {_ord(p)}-norm"
    counted = f"{len(c.tensors)} tensor{'s' * (len(c.tensors) != 1)}"
    skipped = f", {len(c.skipped)} skipped" if c.skipped else ""
    if command == "global-norm":
        top = max(
            (t for t in c.tensors if t.share is not None and not math.isnan(t.share)),
            key=lambda t: t.share or 0.0,
            default=None,
        )
        largest = f"; largest share: {top.name} ({(top.share or 0) * 100:.1f}%)" if top and len(c.tensors) > 1 else ""
        return f"{c.path}: {norm_name} {_fmt(c.global_norm)} over {counted}{skipped}{largest}"
    target = "dry run, nothing written" if c.output is None else f"written to {c.output}"
    if command == "clip-global-norm":
        what = f"{norm_name} {_fmt(c.global_norm)} -> {_fmt(c.global_norm_after)} (scale {_fmt(c.scale)})"
    elif command == "clip-value":
        what = (
            f"clipped to [{_fmt(c.clip.get('min'))}, {_fmt(c.clip.get('max'))}]: {norm_name} "
            f"{_fmt(c.global_norm)} -> {_fmt(c.global_norm_after)}"
        )
    else:
        what = (
            f"clip norm {_fmt(c.clip.get('clip_norm'))}: {norm_name} "
            f"{_fmt(c.global_norm)} -> {_fmt(c.global_norm_after)}"
        )
    return f"{c.path}: {what} over {counted}{skipped}; {target}"


def render_table(report: Report, console: Any) -> None:
    """Prints the report for a person on a rich Console; names are Text, never markup."""
    from rich.text import Text

    if report.command == "inspect":
        for c in report.checkpoints:
            total = sum(t.nbytes for t in c.listing)
            console.print(Text(f"{c.path}: {c.format}, {len(c.listing)} tensors, {_size(total)}"))
            for key, value in (c.metadata or {}).items():
                console.print(Text(f"  metadata {key} = {value}"))
            table = _table()
            for col, justify in (("tensor", "left"), ("dtype", "left"), ("shape", "left"), ("size", "right")):
                table.add_column(col, justify=justify, overflow="fold")
            sharded = c.format == "sharded"
            if sharded:
                table.add_column("file", overflow="fold")
            for t in c.listing:
                cells = [Text(t.name), t.dtype, _shape_text(t.shape), _size(t.nbytes)]
                table.add_row(*cells, *([Text(t.file)] if sharded else []))
            console.print(table)
        return
    if len(report.checkpoints) > 1:
        table = _table()
        for col, justify in (
            ("checkpoint", "left"),
            ("global norm", "right"),
            ("tensors", "right"),
            ("skipped", "right"),
            ("max |x|", "right"),
            ("nan", "right"),
            ("inf", "right"),
        ):
            table.add_column(col, justify=justify, overflow="fold")
        for c in report.checkpoints:
            max_abs = max((t.max_abs for t in c.tensors), default=0.0)
            table.add_row(
                Text(c.path),
                _fmt(c.global_norm),
                str(len(c.tensors)),
                str(len(c.skipped)),
                _fmt(max_abs),
                str(sum(t.nan for t in c.tensors)),
                str(sum(t.inf for t in c.tensors)),
            )
        console.print(table)
        return
    for c in report.checkpoints:
        console.print(Text(headline(report.command, c, report.ord)))
        clip = report.command != "global-norm"
        table = _table()
        columns = [("tensor", "left"), ("dtype", "left"), ("shape", "left"), ("norm", "right")]
        columns += [("norm after", "right")] if clip else [("share", "left")]
        columns += [("max |x|", "right"), ("nan", "right"), ("inf", "right")]
        for col, justify in columns:
            table.add_column(col, justify=justify, overflow="fold", no_wrap=col != "tensor")
        for t in c.tensors:
            cells = [Text(t.name), t.dtype, _shape_text(t.shape), _fmt(t.norm)]
            cells += [_fmt(t.norm_after)] if clip else [share_bar(t.share)]
            cells += [_fmt(t.max_abs), str(t.nan), str(t.inf)]
            table.add_row(*cells)
        console.print(table)
        if c.groups is not None:
            groups = _table()
            for col, justify in (("group", "left"), ("tensors", "right"), ("norm", "right"), ("share", "left")):
                groups.add_column(col, justify=justify, overflow="fold")
            for g in c.groups:
                groups.add_row(Text(g.name), str(g.tensors), _fmt(g.norm), share_bar(g.share))
            console.print(groups)
        unselected = [s for s in c.skipped if s.reason.startswith(("not selected", "excluded"))]
        for s in c.skipped:
            if s not in unselected:
                console.print(Text(f"skipped {s.name} ({s.dtype}): {s.reason}"))
        if unselected:
            n = len(unselected)
            console.print(Text(f"{n} tensor{'s' * (n != 1)} left out by --include/--exclude (listed in --format json)"))
