"""The report of `stats`: each selected tensor's exact value statistics and cast readiness, per checkpoint."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from clipcli.errors import shown_path
from clipcli.report.audit import PickleAudit, add_audit, audit_lines
from clipcli.report.render import (
    COMPACT,
    SCHEMA,
    Rendered,
    Report,
    cell,
    fmt,
    histogram,
    num,
    number,
    plural,
    shape_json,
    shape_text,
    showing,
    string,
    table,
)
from clipcli.report.rows import Skipped

# The cast targets in the order the report lists them, with the short names of the table's columns.
CASTS = {"float16": "f16", "bfloat16": "bf16", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
_FIGURES = ("count", "min", "max", "max_abs", "argmax_abs", "mean", "std", "zeros", "subnormals", "nan")
_FIGURES += ("posinf", "neginf", "all_zero", "constant")
_CAST_FIGURES = ("overflow", "flush", "subnormal", "rel_error")


@dataclass(frozen=True)
class StatsRow:
    """One selected tensor and its statistics, `stats`: a `clipcli.core.stats.TensorStats` (count, min, max,
    max_abs, argmax_abs, mean, std, zeros, subnormals, nan, posinf, neginf, exponents, all_zero, constant,
    casts: CastReadiness(dtype, overflow, flush, subnormal, rel_error) per target). `floating`: its values
    are floating (real or complex), those the gates look at."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    floating: bool
    stats: Any

    @property
    def nonfinite(self) -> int:
        return self.stats.nan + self.stats.posinf + self.stats.neginf

    def overflow(self, target: str) -> int | None:
        """Values that would overflow a cast to `target`, or None where that cast was not measured."""
        return next((c.overflow for c in self.stats.casts if c.dtype == target), None)


@dataclass(frozen=True)
class StatsGroup:
    """Tensors whose names share their first N dot-separated parts: their figures together (from the rows)."""

    name: str
    tensors: int
    nbytes: int
    count: int
    min: float | int | None
    max: float | int | None
    max_abs: float | int | None
    zeros: int
    nan: int
    posinf: int
    neginf: int
    all_zero: int  # tensors all zeros
    overflow: tuple[tuple[str, int], ...]  # per cast target measured in any of them, values that would overflow

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf


@dataclass(frozen=True)
class StatsSummary:
    """Figures over every selected tensor of a checkpoint, whichever rows --sort and --top show."""

    tensors: int
    count: int = 0
    max_abs: float | None = None  # over the floating tensors (what --fail-max-abs looks at)
    max_abs_tensor: str | None = None  # the (first) tensor holding it
    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    zeros: int = 0
    all_zero: tuple[str, ...] = ()  # floating tensors all zeros
    constant: int = 0
    nonfinite: tuple[str, ...] = ()  # tensors holding NaN or Inf
    overflow: tuple[tuple[str, int], ...] = ()  # per cast target measured, values that would overflow


def summarize(rows: Sequence[StatsRow]) -> StatsSummary:
    """The summary of all selected tensors' rows."""
    peak: StatsRow | None = None
    for r in rows:
        m = r.stats.max_abs if r.floating else None
        if m is not None and (peak is None or m > peak.stats.max_abs):
            peak = r
    return StatsSummary(
        tensors=len(rows),
        count=sum(r.stats.count for r in rows),
        max_abs=None if peak is None else peak.stats.max_abs,
        max_abs_tensor=None if peak is None else peak.name,
        nan=sum(r.stats.nan for r in rows),
        posinf=sum(r.stats.posinf for r in rows),
        neginf=sum(r.stats.neginf for r in rows),
        zeros=sum(r.stats.zeros for r in rows),
        all_zero=tuple(r.name for r in rows if r.floating and r.stats.all_zero),
        constant=sum(r.stats.constant for r in rows),
        nonfinite=tuple(r.name for r in rows if r.nonfinite),
        overflow=_overflows(rows),
    )


def group(name: str, rows: Sequence[StatsRow]) -> StatsGroup:
    """The figures of a group of rows."""
    numbers = [r.stats for r in rows if r.stats.min is not None]
    return StatsGroup(
        name=name,
        tensors=len(rows),
        nbytes=sum(r.nbytes for r in rows),
        count=sum(r.stats.count for r in rows),
        min=min((s.min for s in numbers), default=None),
        max=max((s.max for s in numbers), default=None),
        max_abs=max((s.max_abs for s in numbers), default=None),
        zeros=sum(r.stats.zeros for r in rows),
        nan=sum(r.stats.nan for r in rows),
        posinf=sum(r.stats.posinf for r in rows),
        neginf=sum(r.stats.neginf for r in rows),
        all_zero=sum(r.floating and r.stats.all_zero for r in rows),
        overflow=_overflows(rows),
    )


def _overflows(rows: Iterable[StatsRow]) -> tuple[tuple[str, int], ...]:
    totals = dict.fromkeys(CASTS, -1)
    for r in rows:
        for c in r.stats.casts:
            totals[c.dtype] = max(totals[c.dtype], 0) + c.overflow
    return tuple((t, n) for t, n in totals.items() if n >= 0)


@dataclass(frozen=True, kw_only=True)
class CheckpointStats:
    """One checkpoint's statistics: `tensors` are the rows shown (after --sort and --top); `summary`, `every` and
    the gates cover every selected tensor; `groups` (--depth) are the groups shown, of `group_count`."""

    path: str
    format: str | None
    summary: StatsSummary
    tensors: tuple[StatsRow, ...] = ()
    every: tuple[StatsRow, ...] = field(default=(), repr=False)  # every selected tensor's row (for the gates)
    skipped: tuple[Skipped, ...] = ()
    groups: tuple[StatsGroup, ...] | None = None
    group_count: int = 0
    pickle: PickleAudit | None = None  # a pickle-based checkpoint's audit

    def __post_init__(self) -> None:  # paths as they can be typed back (`shown_path`), in every format
        object.__setattr__(self, "path", shown_path(self.path))


@dataclass(frozen=True)
class StatsReport(Report):
    """`stats`: per checkpoint, each selected tensor's exact statistics, exponent histogram and cast readiness."""

    command: ClassVar[str] = "stats"
    checkpoints: tuple[CheckpointStats, ...]

    def _json(self) -> dict[str, Any]:
        out = []
        for c in self.checkpoints:
            one: dict[str, Any] = {"path": c.path, "format": c.format, "summary": _summary_json(c.summary)}
            one["tensors"] = Rendered(tensor_json(t) for t in c.tensors)
            one["skipped"] = [{"name": s.name, "dtype": s.dtype, "reason": s.reason} for s in c.skipped]
            if c.groups is not None:
                one["groups"] = Rendered(COMPACT.encode(_group_json(g)) for g in c.groups)
                one["group_count"] = c.group_count
            out.append(add_audit(one, c.pickle))
        return {"schema": SCHEMA, "command": self.command, "checkpoints": out}

    def _csv(self, w: Any) -> None:
        w.writerow(CSV_HEADER)
        for c in self.checkpoints:
            path = cell(c.path)
            for t in c.tensors:
                s = t.stats
                casts = {x.dtype: x for x in s.casts}
                row = [path, cell(t.name), t.dtype, shape_text(t.shape), *(_csv_value(getattr(s, f)) for f in _FIGURES)]
                for target in CASTS:
                    x = casts.get(target)
                    row += [_csv_value(None if x is None else getattr(x, f)) for f in _CAST_FIGURES]
                w.writerow([*row, " ".join(f"{e}:{n}" for e, n in s.exponents), "tensor"])
            for g in c.groups or ():
                w.writerow(_aggregate_csv(path, cell(g.name), g, g.all_zero, dict(g.overflow), "group"))
            s = c.summary
            w.writerow(_aggregate_csv(path, "", s, len(s.all_zero), dict(s.overflow), "checkpoint"))

    def _blocks(self) -> list[list[str]]:
        return [_checkpoint_lines(c) for c in self.checkpoints]


CSV_HEADER = ["path", "name", "dtype", "shape", *_FIGURES]
CSV_HEADER += [f"{t}_{f}" for t in CASTS for f in _CAST_FIGURES] + ["exponents", "kind"]


def tensor_json(t: StatsRow) -> str:
    """A tensor's row as the encoder writes the object of every figure of its `TensorStats` (exponents as [[e, n],
    ...], casts as a list of objects), three times as fast as a dict through it (a test compares the two).
    """
    s = t.stats
    exponents = ", ".join([f"[{e:d}, {n:d}]" for e, n in s.exponents])
    casts = ", ".join(
        [
            f'{{"dtype": {string(c.dtype)}, "overflow": {c.overflow:d}, "flush": {c.flush:d}, '
            f'"subnormal": {c.subnormal:d}, "rel_error": {number(c.rel_error)}}}'
            for c in s.casts
        ]
    )
    return (
        f'{{"name": {string(t.name)}, "dtype": {string(t.dtype)}, "shape": {shape_json(t.shape)}, '
        f'"count": {s.count:d}, "min": {_value(s.min)}, "max": {_value(s.max)}, "max_abs": {_value(s.max_abs)}, '
        f'"argmax_abs": {_value(s.argmax_abs)}, "mean": {number(s.mean)}, "std": {number(s.std)}, '
        f'"zeros": {s.zeros:d}, "subnormals": {s.subnormals:d}, "nan": {s.nan:d}, "posinf": {s.posinf:d}, '
        f'"neginf": {s.neginf:d}, "all_zero": {_BOOL[s.all_zero]}, "constant": {_BOOL[s.constant]}, '
        f'"exponents": [{exponents}], "casts": [{casts}]}}'
    )


_BOOL = {False: "false", True: "true"}


def _value(x: float | int | None) -> str:
    """A figure as the encoder writes `num(x)`: an integer (of an integer tensor, or an index) whole."""
    return str(x) if type(x) is int else number(x)


def _summary_json(s: StatsSummary) -> dict[str, Any]:
    return {
        "tensor_count": s.tensors,
        "count": s.count,
        "max_abs": num(s.max_abs),
        "max_abs_tensor": s.max_abs_tensor,
        "nan": s.nan,
        "posinf": s.posinf,
        "neginf": s.neginf,
        "zeros": s.zeros,
        "all_zero": list(s.all_zero),
        "constant": s.constant,
        "nonfinite": list(s.nonfinite),
        "overflow": dict(s.overflow),
    }


def _group_json(g: StatsGroup) -> dict[str, Any]:
    out: dict[str, Any] = {"name": g.name, "tensors": g.tensors, "count": g.count}
    out.update({f: num(getattr(g, f)) for f in ("min", "max", "max_abs")})
    out.update({f: getattr(g, f) for f in ("zeros", "nan", "posinf", "neginf", "all_zero")})
    out["overflow"] = dict(g.overflow)
    return out


def _csv_value(x: Any) -> str:
    """A number cell: exact integers as written, floats by their repr (nan, inf), booleans as 1/0, none empty."""
    if x is None:
        return ""
    if isinstance(x, bool):
        return str(int(x))
    return repr(x)


def _aggregate_csv(path: str, name: str, a: Any, all_zero: int, overflow: dict[str, int], kind: str) -> list[str]:
    """A group's or a checkpoint's row: the figures it has, the others empty."""
    figures = {"count": a.count, "max_abs": a.max_abs, "zeros": a.zeros, "nan": a.nan}
    figures.update(posinf=a.posinf, neginf=a.neginf, all_zero=all_zero)
    figures.update(min=getattr(a, "min", None), max=getattr(a, "max", None))
    row = [path, name, "", "", *(_csv_value(figures.get(f)) for f in _FIGURES)]
    for target in CASTS:
        row += [_csv_value(overflow.get(target)), "", "", ""]
    return [*row, "", kind]


# --- Text -------------------------------------------------------------------------------------------


def _checkpoint_lines(c: CheckpointStats) -> list[str]:
    s = c.summary
    skipped = f", {len(c.skipped):,} skipped" if c.skipped else ""
    lines = [f"{c.path}: {c.format}, {plural(s.tensors, 'tensor')}, {plural(s.count, 'value')}{skipped}"]
    lines.append(_summary_line(s))
    casts = [t for t in CASTS if any(r.overflow(t) is not None for r in c.tensors)]
    lines += showing(len(c.tensors), s.tensors, "tensor")
    if c.tensors:
        headers = ["tensor", "dtype", "min", "max", "max |x|", "mean", "std", "zeros", "nan/inf", "flags"]
        headers += [f"{CASTS[t]} ovf" for t in casts]
        rows = table(headers, (_tensor_cells(r, casts) for r in c.tensors), right=range(2, len(headers)))
        # the histograms after the last column, right-aligned (so every line is as wide): nothing to measure
        histograms = ["exponents", *(exponent_histogram(r.stats.exponents) for r in c.tensors)]
        lines += [f"{row} {h}" for row, h in zip(rows, histograms, strict=True)]
    if c.groups is not None:
        lines += showing(len(c.groups), c.group_count, "group")
        headers = ["group", "tensors", "min", "max", "max |x|", "zeros", "nan/inf", "all-zero"]
        headers += [f"{CASTS[t]} ovf" for t in CASTS if any(dict(g.overflow).get(t) is not None for g in c.groups)]
        grows = (_group_cells(g, [h.split()[0] for h in headers[8:]]) for g in c.groups)
        lines += table(headers, grows, right=range(1, len(headers)))
    shown = [x for x in c.skipped if not x.reason.startswith(("not selected", "excluded"))]
    lines += [f"skipped {x.name} ({x.dtype}): {x.reason}" for x in shown[:10]]
    if len(shown) > 10:
        lines.append(f"... and {plural(len(shown) - 10, 'more skipped tensor')} (listed in --format json)")
    return lines + audit_lines(c.pickle)


def _summary_line(s: StatsSummary) -> str:
    """All selected tensors in a line: the largest magnitude and where, NaN/Inf, all-zero and constant tensors,
    overflowing casts."""
    where = f" ({s.max_abs_tensor})" if s.max_abs_tensor is not None and s.tensors > 1 else ""
    parts = [f"max |x| {fmt(s.max_abs)}{where}", f"nan {s.nan:,}, +inf {s.posinf:,}, -inf {s.neginf:,}"]
    parts.append(f"{plural(len(s.all_zero), 'all-zero tensor')}, {s.constant:,} constant")
    if s.overflow:
        parts.append("overflow " + ", ".join(f"{t} {n:,}" for t, n in s.overflow))
    return "; ".join(parts)


def _tensor_cells(r: StatsRow, casts: list[str]) -> list[str]:
    s = r.stats
    flags = ",".join(f for f, on in (("all-zero", s.all_zero), ("constant", s.constant and not s.all_zero)) if on)
    nonfinite = f"{s.nan:,}/{s.posinf + s.neginf:,}" if r.nonfinite else "0"
    cells = [r.name, r.dtype, _n(s.min), _n(s.max), _n(s.max_abs), fmt(s.mean), fmt(s.std), f"{s.zeros:,}"]
    cells += [nonfinite, flags or "-"]
    return cells + ["-" if (n := r.overflow(t)) is None else f"{n:,}" for t in casts]


def _group_cells(g: StatsGroup, short: list[str]) -> list[str]:
    overflow = {CASTS[t]: n for t, n in g.overflow}
    cells = [g.name, f"{g.tensors:,}", _n(g.min), _n(g.max), _n(g.max_abs), f"{g.zeros:,}"]
    cells += [f"{g.nan:,}/{g.posinf + g.neginf:,}" if g.nonfinite else "0", f"{g.all_zero:,}"]
    return cells + ["-" if (n := overflow.get(t)) is None else f"{n:,}" for t in short]


def _n(x: float | int | None) -> str:
    """A figure of the table: integers (of an integer tensor) whole, floats to six digits."""
    return str(x) if isinstance(x, int) and not isinstance(x, bool) else fmt(x)


def exponent_histogram(exponents: Sequence[tuple[int, int]]) -> str:
    """'2^-7 ▁▃█▅ 2^-4': one character per binade from the smallest to the largest used, taller for more values
    (log-scaled); '-' for none (an integer tensor, or only zeros, NaN and Inf)."""
    if not exponents:
        return "-"
    lo, hi = exponents[0][0], exponents[-1][0]
    counts = [0] * (hi - lo + 1)
    for e, n in exponents:
        counts[e - lo] = n
    most = math.log2(max(counts) + 1)
    levels = [0 if not n else max(1, round(8 * math.log2(n + 1) / most)) for n in counts]
    return f"2^{lo} {histogram(levels)} 2^{hi}"
