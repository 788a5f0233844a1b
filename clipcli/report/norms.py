"""The report of `global-norm`: per-tensor norms and each checkpoint's global norm; the tensor table and rows the
clip reports share."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from clipcli.errors import shown_path
from clipcli.report.audit import PickleAudit, add_audit, audit_lines, several_audit_lines
from clipcli.report.render import (
    SCHEMA,
    Rendered,
    Report,
    cell,
    csv_num,
    fmt,
    num,
    number,
    ord_value,
    plural,
    shape_json,
    shape_text,
    share_bar,
    shared_lines,
    showing,
    string,
    table,
)
from clipcli.report.rows import Group, Skipped, Summary, TensorRow


@dataclass(frozen=True, kw_only=True)
class Norms:
    """One checkpoint's norms: `tensors` are the rows shown (after --sort and --top); `summary` and
    `global_norm` cover every selected tensor."""

    path: str
    summary: Summary
    global_norm: float = math.nan
    tensors: tuple[TensorRow, ...] = ()
    skipped: tuple[Skipped, ...] = ()
    shared: tuple[tuple[str, ...], ...] = ()  # names on one storage (tied weights in a PyTorch file)
    shared_kept: tuple[tuple[str, ...], ...] = ()  # of those, the names the output keeps on one storage (.pt)
    pickle: PickleAudit | None = None  # a pickle-based checkpoint's audit

    def __post_init__(self) -> None:  # paths as they can be typed back (`shown_path`), in every format
        object.__setattr__(self, "path", shown_path(self.path))

    def exceeds(self, limit: float) -> bool:
        """Whether the global norm is above `limit` or not a finite number (`--fail-above`), even under inf."""
        return not (math.isfinite(self.global_norm) and self.global_norm <= limit)

    def _checkpoint_json(self, clip: bool) -> dict[str, Any]:
        s = self.summary
        out: dict[str, Any] = {
            "path": self.path,
            "global_norm": num(self.global_norm),
            "tensor_count": s.tensors,
            "max_abs": num(s.max_abs),
            "nan": s.nan,
            "inf": s.inf,
        }
        out["tensors"] = Rendered(tensor_json(t, clip) for t in self.tensors)
        out["skipped"] = [{"name": s.name, "dtype": s.dtype, "reason": s.reason} for s in self.skipped]
        out["shared_storage"] = [list(names) for names in self.shared]
        return add_audit(out, self.pickle)

    def _tensor_rows(self, w: Any, clip: bool) -> None:
        for t in self.tensors:
            nums = [csv_num(t.norm), csv_num(t.max_abs), t.nan, t.inf]
            row = [cell(self.path), cell(t.name), t.dtype, shape_text(t.shape), *nums]
            row.append(csv_num(t.share))
            w.writerow(row + ([csv_num(t.norm_after), csv_num(t.max_abs_after)] if clip else []) + ["tensor"])

    def _global_row(self) -> list[Any]:
        s = self.summary
        return [cell(self.path), "", "", "", csv_num(self.global_norm), csv_num(s.max_abs), s.nan, s.inf, ""]

    def _lines(self, head: str, clip: bool) -> list[str]:
        """The headline, the tensor table, then what was shared, skipped and left out."""
        lines = [head, *showing(len(self.tensors), self.summary.tensors, "tensor")]
        headers = ["tensor", "dtype", "shape", "norm"]
        headers += ["norm after", "max |x|", "max |x| after"] if clip else ["share", "max |x|"]
        headers += ["nan", "inf"]
        rows = []
        for t in self.tensors:
            cells = [t.name, t.dtype, shape_text(t.shape), fmt(t.norm)]
            if clip:
                cells += [fmt(t.norm_after), fmt(t.max_abs), fmt(t.max_abs_after)]
            else:
                cells += [share_bar(t.share), fmt(t.max_abs)]
            rows.append([*cells, f"{t.nan:,}", f"{t.inf:,}"])
        right = (3, 4, 5, 6, 7, 8) if clip else (3, 5, 6, 7)
        if rows:  # no column headings over no rows (a checkpoint of step counters)
            lines += table(headers, rows, right=right)
        return lines

    def _tail(self, written: bool) -> list[str]:
        lines = shared_lines(self.shared, written, self.shared_kept)
        unselected = [s for s in self.skipped if s.reason.startswith(("not selected", "excluded"))]
        lines += _skipped_lines([s for s in self.skipped if s not in unselected])
        if unselected:
            n = len(unselected)
            lines.append(f"{plural(n, 'tensor')} left out by --include/--exclude (listed in --format json)")
        return lines + audit_lines(self.pickle)


def norm_name(p: float) -> str:
    """'global norm', or 'global 1-norm' for another order."""
    return "global norm" if p == 2 else f"global {ord_value(p)}-norm"


def csv_header(clip: bool) -> list[str]:
    """The header row of a norms report, with the clip reports' two columns after."""
    head = ["path", "name", "dtype", "shape", "norm", "max_abs", "nan", "inf", "share"]
    return head + (["norm_after", "max_abs_after"] if clip else []) + ["kind"]


def tensor_json(t: TensorRow, clip: bool) -> str:
    """A tensor's row as the encoder writes `{"name": ..., "dtype": ..., ...}`, a third faster than a dict through it.

    Every value is written as the encoder writes it: strings by its own escaping, finite floats by their
    repr, non-finite ones as strings, None as null (a test compares the two on arbitrary rows).
    """
    row = (
        f'{{"name": {string(t.name)}, "dtype": {string(t.dtype)}, "shape": {shape_json(t.shape)}, '
        f'"norm": {number(t.norm)}, "max_abs": {number(t.max_abs)}, "nan": {t.nan:d}, "inf": {t.inf:d}, '
        f'"share": {number(t.share)}'
    )
    if clip:
        row += f', "norm_after": {number(t.norm_after)}, "max_abs_after": {number(t.max_abs_after)}'
    return row + "}"


def _skipped_lines(skipped: Sequence[Skipped], most: int = 10) -> list[str]:
    """A line per skipped tensor; beyond `most`, a line per reason with a count and the first names."""
    if len(skipped) <= most:
        return [f"skipped {s.name} ({s.dtype}): {s.reason}" for s in skipped]
    by_reason: dict[str, list[str]] = {}
    for s in skipped:
        by_reason.setdefault(s.reason, []).append(s.name)
    lines = []
    for reason, names in by_reason.items():
        first = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        lines.append(f"skipped {plural(len(names), 'tensor')} ({first}): {reason}")
    return [*lines, "(every skipped tensor is listed in --format json)"]


@dataclass(frozen=True, kw_only=True)
class CheckpointNorms(Norms):
    """One checkpoint of a `global-norm` report, with its groups (--depth) where asked for."""

    groups: tuple[Group, ...] | None = None
    group_count: int = 0  # the groups there are (--top may show fewer)

    def _group_lines(self) -> list[str]:
        assert self.groups is not None
        rows = ([g.name, f"{g.tensors:,}", fmt(g.norm), share_bar(g.share)] for g in self.groups)
        lines = showing(len(self.groups), self.group_count, "group")
        return lines + table(["group", "tensors", "norm", "share"], rows, right=(1, 2))


class Combined(NamedTuple):
    """`global-norm --combined`: one global norm over the selected tensors of all the checkpoints, as if
    concatenated, and each checkpoint's share of its norm**p (None for the inf-norm)."""

    global_norm: float
    tensors: int
    max_abs: float
    nan: int
    inf: int
    shares: tuple[float | None, ...]

    def exceeds(self, limit: float) -> bool:
        return not (math.isfinite(self.global_norm) and self.global_norm <= limit)


@dataclass(frozen=True)
class NormReport(Report):
    """`global-norm`: per-tensor norms, max |x|, NaN/Inf counts and shares, and each checkpoint's global norm
    (and, with --combined, the one over all of them)."""

    command: ClassVar[str] = "global-norm"
    ord: float
    checkpoints: tuple[CheckpointNorms, ...]
    combined: Combined | None = None

    def exceeds(self, limit: float) -> bool:
        """Whether a checkpoint's global norm (the combined one, with --combined) is above `limit` or not a finite
        number (`--fail-above`)."""
        if self.combined is not None:
            return self.combined.exceeds(limit)
        return any(c.exceeds(limit) for c in self.checkpoints)

    def _json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema": SCHEMA, "command": self.command, "ord": ord_value(self.ord)}
        k = self.combined
        if k is not None:
            out["combined"] = {
                "global_norm": num(k.global_norm),
                "tensor_count": k.tensors,
                "max_abs": num(k.max_abs),
                "nan": k.nan,
                "inf": k.inf,
            }
        out["checkpoints"] = []
        for i, c in enumerate(self.checkpoints):
            one = c._checkpoint_json(clip=False)
            if k is not None:
                one["share"] = num(k.shares[i])  # of the combined norm**p
            if c.groups is not None:
                one["groups"] = [
                    {"name": g.name, "tensors": g.tensors, "norm": num(g.norm), "share": num(g.share)} for g in c.groups
                ]
                one["group_count"] = c.group_count  # the groups there are: --top may list fewer
            out["checkpoints"].append(one)
        return out

    def _csv(self, w: Any) -> None:
        w.writerow(csv_header(clip=False))
        for c in self.checkpoints:
            c._tensor_rows(w, clip=False)
            for g in c.groups or ():
                w.writerow([cell(c.path), cell(g.name), "", "", csv_num(g.norm), "", "", "", csv_num(g.share), "group"])
            w.writerow([*c._global_row(), "global"])
        k = self.combined
        if k is not None:
            w.writerow(["", "", "", "", csv_num(k.global_norm), csv_num(k.max_abs), k.nan, k.inf, "", "combined"])

    def _blocks(self) -> list[list[str]]:
        if len(self.checkpoints) > 1 or self.combined is not None:
            return [self._several_lines()]
        c = self.checkpoints[0]
        s = c.summary
        top = s.largest
        largest = f"; largest share: {top.name} ({(top.share or 0) * 100:.1f}%)" if top and s.tensors > 1 else ""
        skipped = f", {len(c.skipped):,} skipped" if c.skipped else ""
        head = f"{c.path}: {norm_name(self.ord)} {fmt(c.global_norm)} over {plural(s.tensors, 'tensor')}{skipped}"
        lines = c._lines(head + largest, clip=False)
        if c.groups is not None:
            lines += c._group_lines()
        return [lines + c._tail(written=False)]

    def _several_lines(self) -> list[str]:
        k = self.combined
        headers = ["checkpoint", "global norm", "tensors", "skipped", "max |x|", "nan", "inf"]
        rows = []
        for i, c in enumerate(self.checkpoints):
            s = c.summary
            counts = [f"{s.tensors:,}", f"{len(c.skipped):,}", fmt(s.max_abs), f"{s.nan:,}", f"{s.inf:,}"]
            rows.append([c.path, fmt(c.global_norm), *counts] + ([share_bar(k.shares[i])] if k else []))
        lines = []
        if k is not None:
            headers.append("share")
            name = norm_name(self.ord)
            lines.append(
                f"combined {name} {fmt(k.global_norm)} over {plural(k.tensors, 'tensor')} "
                f"of {len(self.checkpoints)} checkpoints (max |x| {fmt(k.max_abs)}, nan {k.nan:,}, inf {k.inf:,})"
            )
        lines += table(headers, rows, right=range(1, 7))
        lines += several_audit_lines([(c.path, c.pickle) for c in self.checkpoints])
        for c in self.checkpoints:
            if c.groups is not None:
                lines += ["", f"{c.path}: groups", *c._group_lines()]
        return lines
