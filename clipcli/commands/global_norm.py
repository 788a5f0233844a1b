"""`global-norm`: per-tensor norms and the global norm of the selected floating tensors, and its gates."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from clipcli.checkpoint import Checkpoint
from clipcli.commands.audit import pickle_audit
from clipcli.commands.gates import exceeds, limit_text
from clipcli.commands.measure import NormOptions, groups, measure, nonfinite, shared_once
from clipcli.commands.passes import NO_PROGRESS, Progress
from clipcli.commands.select import Selection, order, select, shared_storages
from clipcli.core.norms import NormAccumulator
from clipcli.errors import CheckFailedError, UsageError
from clipcli.report.norms import CheckpointNorms, Combined, NormReport
from clipcli.report.rows import summarize


class NormLimits(NamedTuple):
    """The gates of `global-norm`: `fail_above` (a global norm above it or not finite fails), `fail_nonfinite`
    (a selected tensor holding NaN or Inf fails). `fail_above_text`: the limit as the command line gave it,
    for the message."""

    fail_above: float | None = None
    fail_nonfinite: bool = False
    fail_above_text: str | None = None

    @property
    def gated(self) -> bool:
        return self.fail_above is not None or self.fail_nonfinite


def global_norm(
    ckpt: Checkpoint, options: NormOptions = NormOptions(), progress: Progress = NO_PROGRESS
) -> CheckpointNorms:
    """Per-tensor norms and the global norm of the selected floating tensors.

    The rows shown follow `sort` and `top`; the global norm, the shares and the summary cover them all.

    Raises:
        UsageError: when --include/--exclude select no tensor.
    """
    return measured_norms(ckpt, options, progress)[0]


def norm_report(
    ckpts: Sequence[Checkpoint],
    options: NormOptions = NormOptions(),
    progress: Progress = NO_PROGRESS,
    combined: bool = False,
    prefix_with_file: bool = False,
    limits: NormLimits = NormLimits(),
) -> NormReport:
    """`global_norm` of each checkpoint (each closed once measured), and with `combined` the global norm over
    all of them (`combine`); `prefix_with_file` names the rows FILE/NAME and lets names repeat across files.

    Raises:
        UsageError: when --include/--exclude select no tensor, when a gate has nothing to check
            (`check_measured`), or when `combined` meets one name in two checkpoints (`check_distinct`).
    """
    if combined and not prefix_with_file:
        check_distinct(ckpts, options.selection)
    if prefix_with_file:
        check_prefixes(ckpts)
    measured = []
    for ckpt in ckpts:
        with ckpt:
            prefix = file_prefix(ckpt) if prefix_with_file else ""
            norms, acc = measured_norms(ckpt, options, progress, prefix)
            check_measured(norms, limits)
            measured.append((norms, acc))
    joint = combine(measured, options.ord) if combined else None
    return NormReport(options.ord, tuple(norms for norms, _ in measured), joint)


def measured_norms(
    ckpt: Checkpoint, options: NormOptions = NormOptions(), progress: Progress = NO_PROGRESS, prefix: str = ""
) -> tuple[CheckpointNorms, NormAccumulator]:
    """`global_norm`, and the accumulator of its global norm (to combine with other checkpoints'); `prefix`
    goes before every tensor name the report shows (--prefix-with-file); with `count_shared_once`, names on one
    storage count once in the global norm (`shared_once`), each still a row of its own."""
    p = options.ord
    selected, skipped = select(ckpt, options.selection)
    repeats = shared_once(selected) if options.count_shared_once else None
    m = measure(ckpt, selected, skipped, p, progress, options.jobs, repeats)
    rows = [replace(r, name=prefix + r.name) for r in m.rows] if prefix else m.rows
    every = groups(m, options.depth, p) if options.depth else ()
    norms = CheckpointNorms(
        path=str(ckpt.path),
        summary=summarize(rows),
        global_norm=m.total.result().norm,
        tensors=order(rows, options.sort, options.top),
        skipped=tuple(m.skipped),
        groups=order(every, options.sort, options.top) if options.depth else None,
        group_count=len(every),
        shared=shared_storages(selected),
        pickle=pickle_audit(ckpt),
    )
    return norms, m.total


def file_prefix(ckpt: Checkpoint) -> str:
    """What --prefix-with-file puts before a checkpoint's tensor names: its file (or directory) name and `/`."""
    return f"{Path(ckpt.path).name}/"


def check_distinct(ckpts: Sequence[Checkpoint], selection: Selection, what: str = "--combined") -> None:
    """Refuses --combined over checkpoints that share a selected tensor name: the same tensor twice (replicas of
    data parallelism) would be counted twice; --prefix-with-file says they are different tensors.

    Raises:
        UsageError: naming the first tensor found in two checkpoints.
    """
    seen: dict[str, str] = {}
    for ckpt in ckpts:
        here: dict[str, str] = {}
        for t in ckpt.tensors:
            if not selection.selects(t.name):
                continue
            if t.name in seen:  # in an earlier checkpoint: another file, or the same one given twice
                raise UsageError(
                    f"tensor {t.name!r} is in {seen[t.name]} and in {ckpt.path}: {what} would count it twice "
                    "(give --prefix-with-file if they are different tensors)",
                    param="--combined" if what == "--combined" else None,
                )
            here[t.name] = str(ckpt.path)
        seen.update(here)


def check_prefixes(ckpts: Sequence[Checkpoint]) -> None:
    """Refuses --prefix-with-file over checkpoints of one file name: their rows would carry the same names.

    Raises:
        UsageError: naming the file name given twice.
    """
    names = [file_prefix(c) for c in ckpts]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise UsageError(
            f"two checkpoints are named {twice.rstrip('/')!r}: --prefix-with-file would give their tensors the same "
            "names (the same file twice is counted twice)",
            param="--prefix-with-file",
        )


def combine(parts: Sequence[tuple[CheckpointNorms, NormAccumulator]], p: float) -> Combined:
    """One global norm over the selected tensors of several checkpoints, as if concatenated (exact: their
    accumulators merged), and each checkpoint's share of it."""
    total = NormAccumulator(p)
    for _, acc in parts:
        total.merge(acc)
    stats = total.result()
    return Combined(
        global_norm=stats.norm,
        tensors=sum(c.summary.tensors for c, _ in parts),
        max_abs=stats.max_abs,
        nan=stats.nan,
        inf=stats.inf,
        shares=tuple(acc.share_of(total) for _, acc in parts),
    )


def check_measured(c: CheckpointNorms, limits: NormLimits) -> None:
    """Refuses a gate over a checkpoint with nothing measured: a gate never passes because nothing was.

    Raises:
        UsageError: when a gate is given and no floating tensor is selected.
    """
    if limits.gated and not c.summary.tensors:
        gate = "--fail-above" if limits.fail_above is not None else "--fail-nonfinite"
        raise UsageError("no floating tensor is selected, so the gate has nothing to check", c.path, gate)


def failures(report: NormReport, limits: NormLimits) -> list[str]:
    """Why the report fails its gates: one line for each checkpoint that fails one (NaN or Inf first), none
    where it passes."""
    out = []
    text = limits.fail_above_text or (limit_text(limits.fail_above) if limits.fail_above is not None else "")
    for c in report.checkpoints:
        error = nonfinite(c.path, c.summary.nonfinite) if limits.fail_nonfinite else None
        if error is None and report.combined is None and limits.fail_above is not None and c.exceeds(limits.fail_above):
            error = CheckFailedError(exceeds("global norm", c.global_norm, "--fail-above", text), c.path)
        if error is not None:
            out.append(str(error))
    if report.combined is not None and limits.fail_above is not None and report.exceeds(limits.fail_above):
        g = report.combined.global_norm
        where = f"{len(report.checkpoints)} checkpoints combined"
        out.append(str(CheckFailedError(exceeds("combined global norm", g, "--fail-above", text), where)))
    return out
