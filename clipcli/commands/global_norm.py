"""`global-norm`: per-tensor norms and the global norm of the selected floating tensors, and its gates."""

from __future__ import annotations

from dataclasses import dataclass

from clipcli.checkpoint import Checkpoint
from clipcli.commands.gates import exceeds, limit_text
from clipcli.commands.measure import NormOptions, groups, measure, nonfinite
from clipcli.commands.passes import NO_PROGRESS, Progress
from clipcli.commands.select import order, select, shared_storages
from clipcli.errors import CheckFailedError, UsageError
from clipcli.report.norms import CheckpointNorms, NormReport
from clipcli.report.rows import summarize


@dataclass(frozen=True)
class NormLimits:
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
    p = options.ord
    selected, skipped = select(ckpt, options.selection)
    m = measure(ckpt, selected, skipped, p, progress, options.jobs)
    every = groups(m, options.depth, p) if options.depth else ()
    return CheckpointNorms(
        path=str(ckpt.path),
        summary=summarize(m.rows),
        global_norm=m.total.result().norm,
        tensors=order(m.rows, options.sort, options.top),
        skipped=tuple(m.skipped),
        groups=order(every, options.sort, options.top) if options.depth else None,
        group_count=len(every),
        shared=shared_storages(selected),
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
    for c in report.checkpoints:
        error = nonfinite(c.path, c.summary.nonfinite) if limits.fail_nonfinite else None
        if error is None and limits.fail_above is not None and c.exceeds(limits.fail_above):
            text = limits.fail_above_text or limit_text(limits.fail_above)
            error = CheckFailedError(exceeds("global norm", c.global_norm, "--fail-above", text), c.path)
        if error is not None:
            out.append(str(error))
    return out
