"""The report of `hash`: each checkpoint's per-tensor content hashes (its manifest) and its checkpoint hash."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from clipcli.errors import shown_path
from clipcli.report.audit import PickleAudit, add_audit, audit_lines
from clipcli.report.render import SCHEMA, Report, cell, plural, shape_text, showing, table
from clipcli.report.rows import Skipped


@dataclass(frozen=True)
class HashRow:
    """One hashed tensor: its SHA-256 over the canonical form (dtype name, shape, values little-endian in C
    order), as 64 hexadecimal digits."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    sha256: str


@dataclass(frozen=True, kw_only=True)
class CheckpointHashes:
    """One checkpoint's hashes: `tensors` are the rows shown (after --sort and --top); `hash` and `count`
    cover every hashed tensor."""

    path: str
    format: str | None
    hash: str
    count: int
    tensors: tuple[HashRow, ...] = ()
    skipped: tuple[Skipped, ...] = ()
    pickle: PickleAudit | None = None  # a pickle-based checkpoint's audit

    def __post_init__(self) -> None:  # paths as they can be typed back (`shown_path`), in every format
        object.__setattr__(self, "path", shown_path(self.path))


@dataclass(frozen=True)
class HashReport(Report):
    """`hash`: per checkpoint, the content hash of each selected tensor and the checkpoint hash over them."""

    command: ClassVar[str] = "hash"
    checkpoints: tuple[CheckpointHashes, ...]

    def _json(self) -> dict[str, Any]:
        out = []
        for c in self.checkpoints:
            tensors = [
                {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "sha256": t.sha256} for t in c.tensors
            ]
            skipped = [{"name": s.name, "dtype": s.dtype, "reason": s.reason} for s in c.skipped]
            one = {"path": c.path, "format": c.format, "hash": c.hash, "tensors": tensors, "skipped": skipped}
            out.append(add_audit(one, c.pickle))
        return {"schema": SCHEMA, "command": self.command, "checkpoints": out}

    def _csv(self, w: Any) -> None:
        w.writerow(["path", "name", "dtype", "shape", "sha256", "kind"])
        for c in self.checkpoints:
            for t in c.tensors:
                w.writerow([cell(c.path), cell(t.name), t.dtype, shape_text(t.shape), t.sha256, "tensor"])
            w.writerow([cell(c.path), "", "", "", c.hash, "checkpoint"])

    def _blocks(self) -> list[list[str]]:
        blocks = []
        for c in self.checkpoints:
            skipped = f", {len(c.skipped):,} skipped" if c.skipped else ""
            lines = [f"{c.path}: {c.format}, {plural(c.count, 'tensor')} hashed{skipped}", f"checkpoint hash {c.hash}"]
            rows = ([t.name, t.dtype, shape_text(t.shape), t.sha256] for t in c.tensors)
            if c.tensors:
                lines += showing(len(c.tensors), c.count, "tensor")
                lines += table(["tensor", "dtype", "shape", "sha256"], rows)
            elif not c.skipped:  # a header over no rows reads as a listing that went wrong
                lines.append("it holds no tensors")
            shown = [s for s in c.skipped if not s.reason.startswith(("not selected", "excluded"))]
            lines += [f"skipped {s.name} ({s.dtype}): {s.reason}" for s in shown[:10]]
            if len(shown) > 10:
                lines.append(f"... and {plural(len(shown) - 10, 'more skipped tensor')} (listed in --format json)")
            blocks.append(lines + audit_lines(c.pickle))
        return blocks
