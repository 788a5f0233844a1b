"""The report of `trajectory`: one step per checkpoint of a run, how far each moved, and the identical ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from clipcli.errors import shown_path
from clipcli.report.audit import PickleAudit, add_audit, several_audit_lines
from clipcli.report.diff import cosine_text, percent
from clipcli.report.render import SCHEMA, Report, cell, csv_num, fmt, num, plural, symbols, table


@dataclass(frozen=True)
class StepGroup:
    """A group of a step's tensors (--depth): its norm, and against the previous step its ‖Δ‖, rel and cosine."""

    name: str
    norm: float
    delta: float | None
    rel: float | None
    cosine: float | None


@dataclass(frozen=True, kw_only=True)
class Step:
    """One checkpoint of the run: its global norm and hash, and against the previous one ‖Δ‖, ‖Δ‖/‖previous‖ and
    the cosine (None for the first), the cosine to the first, and whether it is identical to the previous."""

    path: str
    step: int | None
    hash: str
    global_norm: float
    tensors: int
    delta: float | None = None
    rel: float | None = None
    cosine: float | None = None
    cosine_first: float | None = None
    identical: bool = False
    groups: tuple[StepGroup, ...] = ()
    pickle: PickleAudit | None = None  # a pickle-based checkpoint's audit

    def __post_init__(self) -> None:  # paths as they can be typed back (`shown_path`), in every format
        object.__setattr__(self, "path", shown_path(self.path))


@dataclass(frozen=True)
class TrajectoryReport(Report):
    """`trajectory`: the steps in order; `identical` names the steps identical to the one before them."""

    command: ClassVar[str] = "trajectory"
    steps: tuple[Step, ...]
    depth: int | None = None

    @property
    def identical(self) -> tuple[str, ...]:
        return tuple(s.path for s in self.steps if s.identical)

    def _json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema": SCHEMA, "command": self.command, "ord": 2, "checkpoints": []}
        for s in self.steps:
            one: dict[str, Any] = {
                "path": s.path,
                "step": s.step,
                "hash": s.hash,
                "global_norm": num(s.global_norm),
                "tensor_count": s.tensors,
                "delta": num(s.delta),
                "rel": num(s.rel),
                "cosine": num(s.cosine),
                "cosine_first": num(s.cosine_first),
                "identical_to_previous": s.identical,
            }
            if self.depth is not None:
                one["groups"] = [
                    {
                        "name": g.name,
                        "norm": num(g.norm),
                        "delta": num(g.delta),
                        "rel": num(g.rel),
                        "cosine": num(g.cosine),
                    }
                    for g in s.groups
                ]
            out["checkpoints"].append(add_audit(one, s.pickle))
        out["identical"] = list(self.identical)
        return out

    def _csv(self, w: Any) -> None:
        w.writerow(
            ["path", "step", "name", "norm", "delta", "rel", "cosine", "cosine_first", "identical", "hash", "kind"]
        )
        for s in self.steps:
            step = "" if s.step is None else s.step
            nums = [
                csv_num(s.global_norm),
                csv_num(s.delta),
                csv_num(s.rel),
                csv_num(s.cosine),
                csv_num(s.cosine_first),
            ]
            w.writerow([cell(s.path), step, "", *nums, s.identical, s.hash, "checkpoint"])
            for g in s.groups:
                nums = [csv_num(g.norm), csv_num(g.delta), csv_num(g.rel), csv_num(g.cosine), ""]
                w.writerow([cell(s.path), step, cell(g.name), *nums, "", "", "group"])

    def _blocks(self) -> list[list[str]]:
        n = len(self.steps)
        same = self.identical
        head = f"{plural(n, 'checkpoint')}"
        head += (
            f"; {len(same)} identical to the one before: {', '.join(same)}"
            if same
            else "; none identical to the one before"
        )
        headers = ["checkpoint", "step", "global norm", symbols("‖Δ‖"), "rel", "cosine", "cosine to first", "identical"]
        rows = [
            [
                s.path,
                "-" if s.step is None else f"{s.step:,}",
                fmt(s.global_norm),
                fmt(s.delta) if s.delta is not None else "-",
                percent(s.rel) if s.delta is not None else "-",
                cosine_text(s.cosine) if s.delta is not None else "-",
                cosine_text(s.cosine_first) if s.delta is not None else "-",
                "yes" if s.identical else "",
            ]
            for s in self.steps
        ]
        audits = several_audit_lines([(s.path, s.pickle) for s in self.steps])
        blocks = [[head, *table(headers, rows, right=range(1, 7)), *audits]]
        if self.depth is not None:
            names = list(dict.fromkeys(g.name for s in self.steps for g in s.groups))
            by_step = [{g.name: g for g in s.groups} for s in self.steps]
            group_rows = []
            for name in names:
                for s, groups in zip(self.steps, by_step, strict=True):
                    g = groups.get(name)
                    if g is not None:
                        delta = "-" if g.delta is None else fmt(g.delta)
                        rel = "-" if g.delta is None else percent(g.rel)
                        cos = "-" if g.delta is None else cosine_text(g.cosine)
                        group_rows.append([name, s.path, fmt(g.norm), delta, rel, cos])
            headers = ["group", "checkpoint", "norm", symbols("‖Δ‖"), "rel", "cosine"]
            blocks.append(table(headers, group_rows, right=range(2, 6)))
        return blocks
