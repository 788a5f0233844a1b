"""`verify`: a checkpoint's structure checked whole, its values (--values) and its content against a manifest."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from clipcli.checkpoint import Checkpoint, Finding, find_defects, open_checkpoint
from clipcli.checkpoint.source import Store
from clipcli.commands.audit import pickle_audit
from clipcli.commands.hash import HashOptions, hash_checkpoint, reason_to_skip
from clipcli.commands.measure import measure, nonfinite_counts
from clipcli.commands.passes import NO_PROGRESS, Progress
from clipcli.commands.select import EVERY, Selection, select
from clipcli.core.hashing import checkpoint_hash
from clipcli.errors import CheckFailedError, InputError, MalformedError, MissingFileError, UsageError
from clipcli.report.render import plural
from clipcli.report.verify import Changed, ManifestCheck, Problem, VerifyReport

_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Manifest:
    """One checkpoint's manifest as `clipcli hash --format json` writes it: its checkpoint hash and, per tensor,
    (name, dtype, shape, SHA-256)."""

    path: str
    hash: str
    tensors: tuple[tuple[str, str, tuple[int, ...], str], ...]
    skipped: tuple[str, ...] = ()  # the tensors it lists without a hash (no values), not those left unselected


@dataclass(frozen=True)
class VerifyOptions:
    """What `verify` checks beyond the structure: a `manifest` to compare with, the `values` (NaN, Inf, all-zero
    floating tensors), over the tensors `selection` takes, with `jobs` workers."""

    manifest: Manifest | None = None
    values: bool = False
    selection: Selection = EVERY
    jobs: int = 1


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """The manifest of one checkpoint in a file `clipcli hash --format json` wrote.

    Raises:
        MissingFileError: for a file that cannot be read (exit 3, as a checkpoint that cannot be).
        MalformedError: for one that is not such a manifest, or one whose tensors do not give its checkpoint
            hash (cut by --top, or edited).
        UsageError: for a manifest of several checkpoints.
    """

    def bad(what: str) -> MalformedError:
        return MalformedError(f"not a manifest of `clipcli hash --format json`: {what}", path)

    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise MissingFileError(f"cannot read the manifest: {e.strerror or e}", path) from e
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise bad(f"not JSON ({' '.join(str(e).split())[:100]})") from e
    if not isinstance(doc, dict) or doc.get("command") != "hash" or doc.get("schema") != 1:
        raise bad('no "schema": 1 and "command": "hash"')
    checkpoints = doc.get("checkpoints")
    if not isinstance(checkpoints, list) or not checkpoints:
        raise bad('no "checkpoints" hashed')
    if len(checkpoints) != 1:
        n = len(checkpoints)
        raise UsageError(
            f"a manifest of {n} checkpoints' hashes, where verify takes one's (hash each checkpoint on its own)",
            path,
            "--manifest",
        )
    c = checkpoints[0]
    if not (isinstance(c, dict) and isinstance(c.get("hash"), str) and isinstance(c.get("tensors"), list)):
        raise bad('no "hash" and "tensors"')
    tensors = []
    for t in c["tensors"]:
        if not (
            isinstance(t, dict)
            and isinstance(t.get("name"), str)
            and isinstance(t.get("dtype"), str)
            and isinstance(t.get("shape"), list)
            and all(type(d) is int and d >= 0 for d in t["shape"])
            and isinstance(t.get("sha256"), str)
            and _SHA256.fullmatch(t["sha256"])
        ):
            raise bad('a tensor without "name", "dtype", "shape" and "sha256"')
        tensors.append((t["name"], t["dtype"], tuple(t["shape"]), t["sha256"]))
    skipped = c.get("skipped", [])
    if not isinstance(skipped, list) or not all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("reason"), str) for t in skipped
    ):
        raise bad('"skipped" is not a list of tensors with "name" and "reason"')
    unselected = ("not selected by --include", "excluded by --exclude")
    without = tuple(t["name"] for t in skipped if t["reason"] not in unselected)
    if len({t[0] for t in tensors} | set(without)) < len(tensors) + len(without):
        raise bad("a tensor listed twice")
    if checkpoint_hash((name, sha) for name, _, _, sha in tensors) != c["hash"]:
        raise bad("its tensors do not give its checkpoint hash (written with --top, or edited)")
    return Manifest(str(path), c["hash"], tuple(tensors), without)


def verify(
    path: str | os.PathLike[str],
    options: VerifyOptions = VerifyOptions(),
    progress: Progress = NO_PROGRESS,
    store: Store | None = None,
) -> VerifyReport:
    """The defects of a checkpoint's structure (`find_defects`: headers and sizes, zip members' CRCs), then,
    where it opens (which audits its pickles, for the command line's warning and gate), its differences from
    the manifest (every selected tensor hashed) and, with `values`, its floating tensors holding NaN or Inf or
    all zeros (one norm pass).

    A checkpoint whose format clipcli knows is verified whatever is wrong with it: its defects are findings.

    Raises:
        InputError: for a path that is missing, unreadable or no checkpoint of a known format, or one without
            structural defects that cannot be read (an unsupported dtype).
        UsageError: when --include/--exclude select no tensor, or are given with nothing they would choose for.
    """
    checks_tensors = options.manifest is not None or options.values
    if options.selection != EVERY and not checks_tensors:
        raise UsageError(
            "--include/--exclude choose the tensors --manifest and --values check; give one", path, "--include"
        )
    compared, values, audit = None, False, None
    try:  # opened even for the structure alone: its pickles audited (the command line's warning and gate)
        with open_checkpoint(path, store) as ckpt:
            audit = pickle_audit(ckpt)
            fmt, found = find_defects(path, store, opened=True)  # what opening checked is not checked again
            problems = [_problem(f) for f in found]
            if checks_tensors:
                fmt = ckpt.format
            if options.manifest is not None:
                compared = _compare(ckpt, options.manifest, options, progress)
            if options.values:
                problems += _value_problems(ckpt, options, progress)
                values = True
    except InputError:
        fmt, found = find_defects(path, store)  # raises for no checkpoint of a known format at all
        problems = [_problem(f) for f in found]
        compared, values = None, False
        if checks_tensors and not problems:
            raise
        # the defects found say why it cannot be read: they are the report
    return VerifyReport(
        path=str(path), format=fmt, findings=tuple(problems), manifest=compared, values=values, pickle=audit
    )


def failure(report: VerifyReport) -> str | None:
    """The line the command line exits 1 with: the first finding and how many more; None where nothing was found."""
    problems = report.problems
    if not problems:
        return None
    first = problems[0]
    more = f" (and {plural(len(problems) - 1, 'more finding')})" if len(problems) > 1 else ""
    return str(CheckFailedError(f"{first.kind}: {first.problem}{more}", first.file or report.path, first.tensor))


def _problem(f: Finding) -> Problem:
    return Problem(f.file, f.tensor, f.kind, f.problem)


def _compare(ckpt: Checkpoint, manifest: Manifest, options: VerifyOptions, progress: Progress) -> ManifestCheck:
    """The checkpoint's selected tensors hashed (`hash`'s own pass) and compared with the manifest's; those
    selected that have no content hash (a quantized, sparse or meta tensor) are unverified,
    so that a manifest never passes a tensor nothing was compared of."""
    selection = options.selection
    hashed = hash_checkpoint(ckpt, HashOptions(selection, jobs=options.jobs), progress)
    unverified = tuple(
        (t.name, why) for t in ckpt.tensors if selection.listed(t) and (why := reason_to_skip(t, selection)) is not None
    )
    expected = {name: (dtype, shape, sha) for name, dtype, shape, sha in manifest.tensors if selection.selects(name)}
    got = {t.name: t for t in hashed.tensors}
    # what the manifest lists without a hash: missing if gone, unverified if hashed here (nothing to compare)
    without = {name for name in manifest.skipped if selection.selects(name)}
    listed = expected.keys() | without
    unverified += tuple((name, "the manifest lists it without a content hash") for name in sorted(got.keys() & without))
    ours = hashed.hash
    if got.keys() & without:  # the checkpoint hash over the tensors the manifest hashed too
        ours = checkpoint_hash((t.name, t.sha256) for t in hashed.tensors if t.name not in without)
    files = {t.name: t.file for t in ckpt.tensors}
    changed = [
        Changed(t.name, t.dtype, t.shape, *expected[t.name][:2], files[t.name], t.sha256 != expected[t.name][2])
        for t in hashed.tensors
        if t.name in expected and (t.sha256, t.dtype, t.shape) != (expected[t.name][2], *expected[t.name][:2])
    ]
    manifest_hash = (
        manifest.hash if selection == EVERY else checkpoint_hash((name, sha) for name, (_, _, sha) in expected.items())
    )
    return ManifestCheck(
        path=manifest.path,
        hash=ours,
        manifest_hash=manifest_hash,
        compared=len(expected.keys() & got.keys()),
        missing=tuple(sorted(listed - got.keys() - {name for name, _ in unverified})),
        extra=tuple(sorted(got.keys() - listed)),
        changed=tuple(sorted(changed, key=lambda c: c.name)),
        unverified=unverified,
    )


def _value_problems(ckpt: Checkpoint, options: VerifyOptions, progress: Progress) -> list[Problem]:
    """Floating tensors holding NaN or Inf (`nonfinite`) or, non-empty, all zeros (`all-zero`: norm 0, no NaN),
    from the norm pass of `global-norm`.

    Raises:
        UsageError: when no floating tensor is selected (a check never passes because nothing was measured).
    """
    selected, skipped = select(ckpt, options.selection)
    if not selected:
        raise UsageError("no floating tensor is selected, so --values has nothing to check", ckpt.path, "--values")
    rows = measure(ckpt, selected, skipped, 2.0, progress, options.jobs).rows
    files = {t.name: t.file for t in selected}
    out = []
    for r in rows:
        if r.nan or r.inf:
            out.append(Problem(files[r.name], r.name, "nonfinite", f"holds {nonfinite_counts(r.nan, r.inf)}"))
        elif r.norm == 0 and math.prod(r.shape):
            out.append(Problem(files[r.name], r.name, "all-zero", f"every one of its values is zero ({r.dtype})"))
    return out
