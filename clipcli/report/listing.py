"""The reports of `inspect` and `convert`: each checkpoint's tensors as its headers give them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from clipcli.errors import shown_path
from clipcli.report.audit import PickleAudit, add_audit, audit_lines
from clipcli.report.render import SCHEMA, Report, cell, plural, shape_text, shared_lines, showing, size, table
from clipcli.report.rows import Skipped, Summary


@dataclass(frozen=True)
class InspectRow:
    """One listed tensor: what its header says, and the file that holds it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: str

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


def listed(rows: Sequence[InspectRow]) -> Summary:
    """The summary of listed rows: how many tensors and their elements (parameters), how many pickled objects
    (an .npz's object arrays, whose items are Python objects, not parameters), and the bytes of all."""
    tensors = [r for r in rows if r.dtype != "object"]
    return Summary(
        len(tensors),
        elements=sum(r.elements for r in tensors),
        nbytes=sum(r.nbytes for r in rows),
        objects=len(rows) - len(tensors),
    )


@dataclass(frozen=True, kw_only=True)
class Listing:
    """One checkpoint's tensors from its headers: `tensors` are the rows shown (after --sort and --top),
    `summary` counts every selected tensor."""

    path: str
    format: str | None
    metadata: dict[str, str]
    summary: Summary
    tensors: tuple[InspectRow, ...] = ()
    shared: tuple[tuple[str, ...], ...] = ()  # names on one storage (tied weights in a PyTorch file)
    shared_kept: tuple[tuple[str, ...], ...] = ()  # of those, the names the output keeps on one storage (.pt)
    several_files: bool = False  # a layout of several files (shards, a distributed checkpoint): the table names each
    pickle: PickleAudit | None = None  # a pickle-based checkpoint's audit

    def __post_init__(self) -> None:  # paths as they can be typed back (`shown_path`), in every format
        object.__setattr__(self, "path", shown_path(self.path))

    def _counts(self) -> str:
        s = self.summary
        objects = f", {plural(s.objects, 'pickled object')}" if s.objects else ""
        return f"{plural(s.tensors, 'tensor')}, {plural(s.elements, 'parameter')}{objects}, {size(s.nbytes)}"

    def _table(self, several: bool) -> list[str]:
        rows = self.summary.tensors + self.summary.objects
        if not rows:  # a header over no rows reads as a listing that went wrong
            return ["it holds no tensors"]
        headers = ["tensor", "dtype", "shape", "elements", "size"] + (["file"] if several else [])
        cells = (
            [t.name, t.dtype, shape_text(t.shape), f"{t.elements:,}", size(t.nbytes)] + ([t.file] if several else [])
            for t in self.tensors
        )
        return showing(len(self.tensors), rows, "tensor") + table(headers, cells, right=(3, 4))

    def _tensors_json(self) -> list[dict[str, Any]]:
        return [
            {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "elements": t.elements, "nbytes": t.nbytes,
             "file": t.file}
            for t in self.tensors
        ]  # fmt: skip

    def _csv_rows(self, w: Any) -> None:
        for t in self.tensors:
            row = [cell(self.path), cell(t.name), t.dtype, shape_text(t.shape), t.elements, t.nbytes]
            w.writerow([*row, cell(t.file), "tensor"])
        w.writerow([cell(self.path), "", "", "", self.summary.elements, self.summary.nbytes, "", "global"])


def _pickle_lines(audit: PickleAudit | None, fmt: str | None) -> list[str]:
    """`inspect`'s lines of the audit: the verdict, then every global the pickles name."""
    if audit is None:
        return []
    fields = audit.fields
    named = "globals:" if fields["globals"] else "it names no globals"
    if fmt in ("npz", "npy"):  # object arrays: NumPy's loader, not torch's, would unpickle them
        lines = [f"  pickle (object arrays, which only np.load(allow_pickle=True) unpickles); {named}"]
    else:
        verdict = "loads" if fields["loads_with_weights_only"] else "does not load"
        lines = [f"  pickle: torch.load(weights_only=True) {verdict}; {named}"]
    return lines + [f"    {g['name']} ({g['use']} x{g['count']})" for g in fields["globals"]]


_CSV_HEADER = ["path", "name", "dtype", "shape", "elements", "nbytes", "file", "kind"]


@dataclass(frozen=True)
class InspectReport(Report):
    """`inspect`: names, dtypes, shapes, sizes and metadata of each checkpoint, from the headers alone."""

    command: ClassVar[str] = "inspect"
    checkpoints: tuple[Listing, ...]

    def _json(self) -> dict[str, Any]:
        out = []
        for c in self.checkpoints:
            s = c.summary
            one = {"path": c.path, "format": c.format, "metadata": c.metadata or {}}
            one.update({"tensor_count": s.tensors, "elements": s.elements, "nbytes": s.nbytes})
            if s.objects:
                one["object_count"] = s.objects
            one["tensors"] = c._tensors_json()
            one["shared_storage"] = [list(names) for names in c.shared]
            out.append(add_audit(one, c.pickle))
        return {"schema": SCHEMA, "command": self.command, "checkpoints": out}

    def _csv(self, w: Any) -> None:
        w.writerow(_CSV_HEADER)
        for c in self.checkpoints:
            c._csv_rows(w)

    def _blocks(self) -> list[list[str]]:
        blocks = []
        for c in self.checkpoints:
            lines = [f"{c.path}: {c.format}, {c._counts()}"]
            lines += [f"  metadata {k} = {v}" for k, v in (c.metadata or {}).items()]
            lines += _pickle_lines(c.pickle, c.format)
            lines += c._table(c.several_files)
            blocks.append(lines + shared_lines(c.shared, written=False))
        return blocks


@dataclass(frozen=True, kw_only=True)
class ConvertReport(Listing, Report):
    """`convert`: the tensors written (or, on a dry run, that would be), each with its output file."""

    command: ClassVar[str] = "convert"
    left_out: tuple[Skipped, ...] = ()  # tensors not written: left out by --include/--exclude
    output: str | None = None  # None on a dry run
    files: tuple[str, ...] = ()  # the files the conversion writes (or would), an index last
    indexed: bool = False  # whether the last of `files` is an index of the others (shards)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.output is not None:
            object.__setattr__(self, "output", shown_path(self.output))

    def _json(self) -> dict[str, Any]:
        s = self.summary
        out = {"path": self.path, "format": self.format, "metadata": self.metadata or {}}
        out.update({"output": self.output, "files": list(self.files)})
        out.update({"tensor_count": s.tensors, "elements": s.elements, "nbytes": s.nbytes})
        if s.objects:
            out["object_count"] = s.objects
        out["tensors"] = self._tensors_json()
        out["left_out"] = [s.name for s in self.left_out]
        out["shared_storage"] = [list(names) for names in self.shared]
        return {"schema": SCHEMA, "command": self.command, "checkpoints": [add_audit(out, self.pickle)]}

    def _csv(self, w: Any) -> None:
        w.writerow(_CSV_HEADER)
        self._csv_rows(w)

    def _blocks(self) -> list[list[str]]:
        target = "dry run, nothing written" if self.output is None else f"written to {self.output}"
        shards = self.files[:-1] if self.indexed else self.files
        files = f" in {plural(len(shards), 'shard')} and an index" if self.indexed else ""
        lines = [f"{self.path}: {self.format} -> {self._counts()}{files}; {target}"]
        lines += self._table(len(self.files) > 1)
        if self.left_out:
            lines.append(
                f"{plural(len(self.left_out), 'tensor')} left out by --include/--exclude (listed in --format json)"
            )
        lines += shared_lines(self.shared, self.output is not None, self.shared_kept)
        return [lines + audit_lines(self.pickle)]
