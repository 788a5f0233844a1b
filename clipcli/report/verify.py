"""The report of `verify`: the defects of a checkpoint's structure and values, and its differences from a manifest."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from clipcli.errors import shown_path
from clipcli.report.audit import PickleAudit, add_audit, audit_lines
from clipcli.report.render import SCHEMA, Report, cell, plural, shape_text, table


@dataclass(frozen=True)
class Problem:
    """One finding: the file it is in, the tensor it concerns (None: the file's), a stable short code of its
    kind and what is wrong, in words."""

    file: str
    tensor: str | None
    kind: str
    problem: str

    def __post_init__(self) -> None:  # a file as it can be typed back (a URL keeps its //)
        object.__setattr__(self, "file", shown_path(self.file))


@dataclass(frozen=True)
class Changed:
    """A tensor whose content hash differs from the manifest's, with the dtype and shape on each side."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    manifest_dtype: str
    manifest_shape: tuple[int, ...]
    file: str = ""  # the file that holds it (a shard's, in a sharded checkpoint)
    hash_differs: bool = True  # False: the hash matches, the manifest's dtype or shape does not (it was edited)

    @property
    def what(self) -> str:
        """What changed, in words: the values, and the dtype and shape where they did."""
        parts = []
        if self.dtype != self.manifest_dtype:
            parts.append(f"dtype {self.manifest_dtype} -> {self.dtype}")
        if self.shape != self.manifest_shape:
            parts.append(f"shape {shape_text(self.manifest_shape)} -> {shape_text(self.shape)}")
        if not self.hash_differs:
            said = [f"dtype {self.manifest_dtype}"] if self.dtype != self.manifest_dtype else []
            said += [f"shape {shape_text(self.manifest_shape)}"] if self.shape != self.manifest_shape else []
            return f"the manifest says {', '.join(said)}, but its content hash, which matches, is not of that (edited?)"
        return "content hash differs" + (f" ({', '.join(parts)})" if parts else " (same dtype and shape)")


@dataclass(frozen=True, kw_only=True)
class ManifestCheck:
    """A checkpoint compared with a manifest (`clipcli hash --format json`): the tensors both hold, those only in
    the manifest (`missing`) or only in the checkpoint (`extra`), those whose hash differs, and both checkpoint
    hashes (over the tensors compared on each side)."""

    path: str
    hash: str
    manifest_hash: str
    compared: int
    missing: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    changed: tuple[Changed, ...] = ()
    unverified: tuple[tuple[str, str], ...] = ()  # (name, why): selected tensors with no content hash to compare

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", shown_path(self.path))

    @property
    def matches(self) -> bool:
        return self.hash == self.manifest_hash and not (self.missing or self.extra or self.changed or self.unverified)


@dataclass(frozen=True, kw_only=True)
class VerifyReport(Report):
    """`verify`: a checkpoint's defects (structure, then values where they were read) and its comparison with a
    manifest, if one was given; `values` says whether values were read (--values)."""

    command: ClassVar[str] = "verify"
    path: str
    format: str
    findings: tuple[Problem, ...] = ()
    manifest: ManifestCheck | None = None
    values: bool = False
    pickle: PickleAudit | None = None  # a pickle-based checkpoint's audit (where it opens)

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", shown_path(self.path))

    @property
    def problems(self) -> tuple[Problem, ...]:
        """Every finding: the structure's and values', then the manifest's differences (kinds `missing`, `extra`,
        `changed` and `checkpoint-hash`) and the tensors it cannot vouch for (`unverified`: no content hash)."""
        m = self.manifest
        if m is None:
            return self.findings
        out = [
            Problem(self.path, name, "missing", f"in the manifest {m.path}, not in the checkpoint")
            for name in m.missing
        ]
        out += [
            Problem(self.path, name, "extra", f"in the checkpoint, not in the manifest {m.path}") for name in m.extra
        ]
        out += [Problem(c.file or self.path, c.name, "changed", c.what) for c in m.changed]
        out += [
            Problem(self.path, name, "unverified", f"not compared with the manifest: {why}")
            for name, why in m.unverified
        ]
        if m.hash != m.manifest_hash:
            out.append(
                Problem(self.path, None, "checkpoint-hash", f"{m.hash} where the manifest has {m.manifest_hash}")
            )
        return self.findings + tuple(out)

    @property
    def ok(self) -> bool:
        """Whether nothing was found: no defect and, with a manifest, no difference (exit status 0, else 1)."""
        return not self.problems

    def _json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema": SCHEMA, "command": self.command, "path": self.path, "format": self.format}
        out["values"] = self.values
        out["ok"] = self.ok
        out["findings"] = [
            {"file": p.file, "tensor": p.tensor, "kind": p.kind, "problem": p.problem} for p in self.problems
        ]
        m = self.manifest
        if m is not None:
            changed = [
                {
                    "name": c.name,
                    "dtype": c.dtype,
                    "shape": list(c.shape),
                    "manifest_dtype": c.manifest_dtype,
                    "manifest_shape": list(c.manifest_shape),
                }
                for c in m.changed
            ]
            out["manifest"] = {
                "path": m.path,
                "hash": m.hash,
                "manifest_hash": m.manifest_hash,
                "compared": m.compared,
                "missing": list(m.missing),
                "extra": list(m.extra),
                "changed": changed,
                "unverified": [{"name": name, "reason": why} for name, why in m.unverified],
            }
        return add_audit(out, self.pickle)

    def _csv(self, w: Any) -> None:
        w.writerow(["file", "tensor", "kind", "problem"])
        for p in self.problems:
            w.writerow([cell(p.file), cell(p.tensor or ""), p.kind, cell(p.problem)])

    def _blocks(self) -> list[list[str]]:
        problems = self.problems
        lines = [f"{self.path}: {self.format}" + (", values read" if self.values else "")]
        m = self.manifest
        if m is not None:
            same = "matches" if m.hash == m.manifest_hash else "differs"
            lines.append(f"manifest {m.path}: {plural(m.compared, 'tensor')} compared, checkpoint hash {same}")
        if problems:
            rows = ([p.file, p.tensor or "-", p.kind, p.problem] for p in problems)
            lines += table(["file", "tensor", "kind", "problem"], rows)
            files = len({p.file for p in problems})
            lines.append(f"{plural(len(problems), 'finding')} in {plural(files, 'file')}")
        else:
            lines.append("verified: nothing found")
        return [lines + audit_lines(self.pickle)]
