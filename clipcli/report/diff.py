"""The report of `diff`: how far checkpoint B is from A, tensor by tensor and over all compared tensors."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from clipcli.errors import printable, shown_path
from clipcli.report.audit import PickleAudit, add_audit, audit_lines
from clipcli.report.render import (
    SCHEMA,
    Report,
    cell,
    csv_num,
    fmt,
    num,
    ord_value,
    plural,
    shape_text,
    share_bar,
    showing,
    symbols,
    table,
)


@dataclass(unsafe_hash=True)  # never changed once made; not frozen: made per tensor, 5 times as fast
class DiffRow:
    """One tensor of both checkpoints: how far B's values are from A's."""

    name: str
    shape: tuple[int, ...]
    dtype_a: str
    dtype_b: str
    nbytes: int
    identical: bool  # same dtype, shape and bytes
    norm_a: float | None = None
    norm_b: float | None = None
    diff_norm: float | None = None
    rel: float | None = None
    cosine: float | None = None
    max_abs_diff: float | None = None
    changed: int | None = None
    share: float | None = None
    reason: str | None = None  # why a pair is compared for sameness only

    @classmethod
    def other(cls, a: Any, b: Any, identical: bool, same_values: bool, reason: str) -> DiffRow:
        """The row of a pair compared only for being the same (integers, types carried as bytes): `changed`
        is 0 where the values are the same (in another dtype, too), None where some differ."""
        changed = 0 if same_values else None
        return cls(a.name, a.shape, a.dtype, b.dtype, a.nbytes, identical, changed=changed, reason=reason)


class DiffGroup(NamedTuple):
    """Compared tensors whose names share their first N dot-separated parts."""

    name: str
    tensors: int
    diff_norm: float
    norm_a: float
    rel: float | None
    share: float | None
    norm_b: float = math.nan
    cosine: float | None = None


class Mismatch(NamedTuple):
    """A name in both checkpoints whose tensors cannot be compared (shapes differ, no values)."""

    name: str
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    reason: str


@dataclass(frozen=True, kw_only=True)
class DiffReport(Report):
    """The difference of two checkpoints: `stats` over every compared tensor, `shown` after --sort/--top."""

    command: ClassVar[str] = "diff"
    ord: float = 2.0
    a: str
    b: str
    stats: Any  # core.DiffStats over all compared floating tensors, as if concatenated
    tensors: tuple[DiffRow, ...]
    shown: tuple[DiffRow, ...]
    others: tuple[DiffRow, ...]
    only_a: tuple[str, ...]
    only_b: tuple[str, ...]
    mismatched: tuple[Mismatch, ...]
    metadata_differs: tuple[str, ...] = ()  # metadata keys whose values differ or that one side alone has
    groups: tuple[DiffGroup, ...] | None = None
    group_count: int = 0  # the groups there are (--top may show fewer)
    pickle_a: PickleAudit | None = None  # the audit of A where it is a pickle-based checkpoint
    pickle_b: PickleAudit | None = None  # of B

    def __post_init__(self) -> None:  # paths as they can be typed back (`shown_path`), in every format
        object.__setattr__(self, "a", shown_path(self.a))
        object.__setattr__(self, "b", shown_path(self.b))

    @property
    def different(self) -> list[str]:
        """What differs, in words (empty when the checkpoints hold the same names, shapes, dtypes, values and
        metadata)."""
        return self._said(self.metadata_differs)

    @property
    def tensors_differ(self) -> bool:
        """Whether the tensors differ in any way `different` says (metadata aside)."""
        return bool(self._said(()))

    def _said(self, metadata_differs: tuple[str, ...]) -> list[str]:
        out = []
        changed = [r.name for r in self.tensors if r.changed] + [r.name for r in self.others if r.changed is None]
        # the same values in another dtype (float32 against bfloat16 of bfloat16 values): said apart
        retyped = [r.name for r in (*self.tensors, *self.others) if r.changed == 0 and r.dtype_a != r.dtype_b]
        differ = "tensor differs" if len(changed) == 1 else "tensors differ"
        dtypes = "tensor differs in dtype only" if len(retyped) == 1 else "tensors differ in dtype only"
        keys = "metadata key differs" if len(metadata_differs) == 1 else "metadata keys differ"
        for names, what in (
            (changed, differ), (retyped, dtypes), (self.only_a, "only in A"), (self.only_b, "only in B"),
            (metadata_differs, keys),
        ):  # fmt: skip
            if names:
                more = ", ..." if len(names) > 1 else ""
                out.append(f"{len(names):,} {what} ({printable(names[0])}{more})")
        if self.mismatched:
            m = self.mismatched[0]
            out.append(f"{len(self.mismatched):,} not comparable ({printable(m.name)}: {m.reason})")
        return out

    def exceeds(self, limit: float) -> bool:
        """Whether the global ‖A−B‖ is above `limit` or not a finite number (`--fail-above`)."""
        return _over(self.stats.diff_norm, limit)

    def rel_exceeds(self, limit: float) -> bool:
        """Whether the global ‖A−B‖/‖A‖ is above `limit` or not a finite number (`--fail-rel-above`); with ‖A‖
        0, whether anything differs."""
        return _over(self.checked_rel, limit)

    @property
    def checked_rel(self) -> float:
        """The global ‖A−B‖/‖A‖ a gate checks: 0 where both are 0, inf where only ‖A‖ is."""
        s = self.stats
        return s.rel if s.rel is not None else (0.0 if s.diff_norm == 0 else math.inf)

    def _json(self) -> dict[str, Any]:
        s = self.stats
        out: dict[str, Any] = {
            "schema": SCHEMA,
            "command": "diff",
            "ord": ord_value(self.ord),
            "a": self.a,
            "b": self.b,
            "diff_norm": num(s.diff_norm),
            "norm_a": num(s.norm_a),
            "norm_b": num(s.norm_b),
            "rel": num(s.rel),
            "cosine": num(s.cosine),
            "max_abs_diff": num(s.max_abs_diff),
            "changed": s.changed,
            "tensor_count": len(self.tensors),
            "identical_count": sum(r.identical for r in self.tensors),
            "different": self.different,
        }
        out["tensors"] = [
            {
                "name": r.name,
                "shape": list(r.shape),
                "dtype_a": r.dtype_a,
                "dtype_b": r.dtype_b,
                "norm_a": num(r.norm_a),
                "norm_b": num(r.norm_b),
                "diff_norm": num(r.diff_norm),
                "rel": num(r.rel),
                "cosine": num(r.cosine),
                "max_abs_diff": num(r.max_abs_diff),
                "changed": r.changed,
                "identical": r.identical,
                "share": num(r.share),
            }
            for r in self.shown
        ]
        out["skipped"] = [
            {"name": r.name, "dtype_a": r.dtype_a, "dtype_b": r.dtype_b, "identical": r.identical,
             "reason": f"{r.reason}: compared for being the same only"}
            for r in self.others
        ]  # fmt: skip
        out["only_a"] = list(self.only_a)
        out["only_b"] = list(self.only_b)
        out["mismatched"] = [
            {"name": m.name, "shape_a": list(m.shape_a), "shape_b": list(m.shape_b), "reason": m.reason}
            for m in self.mismatched
        ]
        out["metadata_differs"] = list(self.metadata_differs)
        if self.groups is not None:
            out["groups"] = [
                {"name": g.name, "tensors": g.tensors, "diff_norm": num(g.diff_norm), "norm_a": num(g.norm_a),
                 "rel": num(g.rel), "share": num(g.share)}
                for g in self.groups
            ]  # fmt: skip
            out["group_count"] = self.group_count
        return add_audit(add_audit(out, self.pickle_a, "pickle_a"), self.pickle_b, "pickle_b")

    def _csv(self, w: Any) -> None:
        """A row per compared tensor shown, per group, per tensor compared for sameness only, per metadata key
        that differs (kind `metadata`, the key as its name), and the whole.

        The global row's `identical` is 1 when nothing differs at all (what --fail-different checks).
        """
        numbers = ["norm_a", "norm_b", "diff_norm", "rel", "cosine", "max_abs_diff"]
        w.writerow(["name", "shape", "dtype_a", "dtype_b", *numbers, "changed", "identical", "share", "kind"])
        for r in self.shown:
            nums = [r.norm_a, r.norm_b, r.diff_norm, r.rel, r.cosine, r.max_abs_diff]
            row = [cell(r.name), shape_text(r.shape), r.dtype_a, r.dtype_b, *map(csv_num, nums), r.changed]
            w.writerow([*row, int(r.identical), csv_num(r.share), "tensor"])
        blank = [""] * 4
        for g in self.groups or ():
            nums = [csv_num(g.norm_a), "", csv_num(g.diff_norm), csv_num(g.rel)]
            w.writerow([cell(g.name), "", "", "", *nums, *blank[:3], "", csv_num(g.share), "group"])
        for r in self.others:
            row = [cell(r.name), shape_text(r.shape), r.dtype_a, r.dtype_b]
            w.writerow([*row, *blank, *blank[:3], int(r.identical), "", "skipped"])
        for key in self.metadata_differs:
            w.writerow([printable(key), *[""] * 10, 0, "", "metadata"])
        s = self.stats
        nums = [s.norm_a, s.norm_b, s.diff_norm, s.rel, s.cosine, s.max_abs_diff]
        w.writerow([*blank, *map(csv_num, nums), s.changed, int(not self.different), "", "global"])

    def _blocks(self) -> list[list[str]]:
        s = self.stats
        name = symbols("‖A−B‖" if self.ord == 2 else f"‖A−B‖{ord_value(self.ord)}")
        identical = sum(r.identical for r in self.tensors)
        head = f"{self.a} -> {self.b}: {name} {fmt(s.diff_norm)}"
        head += f" (rel {percent(s.rel)}, cosine {cosine_text(s.cosine)}) over {plural(len(self.tensors), 'tensor')}"
        head += f", {identical:,} identical" if identical else ""
        lines = [head]
        different = [r for r in self.shown if not r.identical]
        hidden = len(self.tensors) - identical - len(different)
        if different:
            headers = ["tensor", "dtype", "shape", "|A|", "|A-B|", "rel", "share", "cosine", "max |a-b|", "changed"]
            rows = []
            for r in different:
                dtype = r.dtype_a if r.dtype_a == r.dtype_b else f"{r.dtype_a}/{r.dtype_b}"
                rows.append([
                    r.name, dtype, shape_text(r.shape), fmt(r.norm_a), fmt(r.diff_norm), percent(r.rel),
                    share_bar(r.share), cosine_text(r.cosine), fmt(r.max_abs_diff), f"{r.changed:,}",
                ])  # fmt: skip
            lines += table(headers, rows, right=(3, 4, 5, 7, 8, 9))
        if hidden > 0:
            lines.append(
                f"{plural(hidden, 'other tensor')} that {'differs' if hidden == 1 else 'differ'} not shown (--top)"
            )
        if identical:
            listed = " (listed in --format json)" if any(r.identical for r in self.shown) else ""
            lines.append(f"{plural(identical, 'tensor')} identical, bit for bit{listed}")
        if self.groups is not None:
            rows = (
                [g.name, f"{g.tensors:,}", fmt(g.norm_a), fmt(g.diff_norm), percent(g.rel), share_bar(g.share)]
                for g in self.groups
            )
            lines += showing(len(self.groups), self.group_count, "group")
            lines += table(["group", "tensors", "|A|", "|A-B|", "rel", "share"], rows, right=(1, 2, 3, 4))
        for r in self.others:
            state = "the same" if r.identical else "different" if r.changed is None else "the same values"
            dtypes = r.dtype_a if r.dtype_a == r.dtype_b else f"{r.dtype_a} vs {r.dtype_b}"
            lines.append(f"compared for sameness only: {r.name} ({dtypes}): {state}")
        if self.only_a:
            lines.append(f"only in A: {', '.join(self.only_a)}")
        if self.only_b:
            lines.append(f"only in B: {', '.join(self.only_b)}")
        if self.metadata_differs:
            lines.append(f"metadata differs: {', '.join(self.metadata_differs)}")
        for m in self.mismatched:
            shapes = f"{shape_text(m.shape_a)} vs {shape_text(m.shape_b)}"
            lines.append(f"not compared: {m.name} ({shapes}): {m.reason}")
        return [lines + audit_lines(self.pickle_a, "A") + audit_lines(self.pickle_b, "B")]


def _over(value: float, limit: float) -> bool:
    """Whether a gate fails: the figure is above its threshold, or not a finite number (the spec), even under inf."""
    return not (math.isfinite(value) and value <= limit)


def percent(x: float | None) -> str:
    if x is None:
        return "-"
    if not math.isfinite(x):
        return fmt(x)
    return f"{x * 100:.3g}%"


def cosine_text(c: float | None) -> str:
    """A cosine; one close to 1 as 1-ε, so nearly parallel tensors still read apart."""
    if c is None or not math.isfinite(c) or c < 0.9999 or c == 1.0:
        return fmt(c)
    return f"1-{1 - c:.2g}"
