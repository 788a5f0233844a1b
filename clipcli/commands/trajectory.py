"""`trajectory`: a run's checkpoints in step order, each one's global norm and how far it moved from the last."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from clipcli.checkpoint import Checkpoint, open_checkpoint
from clipcli.commands.diff import DiffOptions, diff
from clipcli.commands.global_norm import global_norm
from clipcli.commands.hash import HashOptions, hash_checkpoint
from clipcli.commands.measure import NormOptions
from clipcli.commands.passes import NO_PROGRESS, Progress
from clipcli.commands.select import EVERY, Selection
from clipcli.report.diff import DiffReport
from clipcli.report.norms import CheckpointNorms
from clipcli.report.trajectory import Step, StepGroup, TrajectoryReport


@dataclass(frozen=True)
class TrajectoryOptions:
    """What `trajectory` measures: the tensors `selection` takes, groups of the first `depth` name parts, with
    `jobs` workers; the checkpoints in natural order of their names unless `keep_order`."""

    selection: Selection = EVERY
    depth: int | None = None
    jobs: int = 1
    keep_order: bool = False


_NUMBER = re.compile(r"\d+")


def natural_key(path: str | Path) -> tuple:
    """Sorts names as a person would: `step-200` before `step-1000` (digit runs compared as numbers)."""
    parts = _NUMBER.split(str(path))
    numbers = [int(n) for n in _NUMBER.findall(str(path))]
    return tuple(x for pair in zip(parts, [*numbers, -1], strict=True) for x in pair)


def step_of(path: str | Path) -> int | None:
    """The step a checkpoint's name gives: the last number in its file (or directory) name; None without one."""
    name = Path(path).name
    numbers = _NUMBER.findall(name.removesuffix(Path(name).suffix) if "." in name else name) or _NUMBER.findall(name)
    return int(numbers[-1]) if numbers else None


def ordered(paths: Sequence[str | Path], keep_order: bool = False) -> list[str | Path]:
    """The checkpoints in the order `trajectory` takes them: natural order of their paths, or as given."""
    return list(paths) if keep_order else sorted(paths, key=natural_key)


def trajectory(
    paths: Sequence[str | Path], options: TrajectoryOptions = TrajectoryOptions(), progress: Progress = NO_PROGRESS
) -> TrajectoryReport:
    """One step per checkpoint: its global norm and content hash, and against the previous checkpoint ‖Δ‖, the
    relative change and the cosine, plus the cosine to the first; identical to the previous one when their
    checkpoint hashes (over the selected tensors, names included) are equal and no tensor without a content hash
    differs.

    The differences are `diff`'s (tensors matched by name, floating tensors compared by value, the figures over
    the tensors both have); the global norm is `global-norm`'s, over every selected floating tensor. Each
    checkpoint is read for its hash, its norm, and its differences to the previous and to the first.

    Raises:
        UsageError: when --include/--exclude select nothing in a checkpoint.
    """
    o = options
    norm_options = NormOptions(o.selection, 2.0, o.depth, None, None, o.jobs)
    diff_options = DiffOptions(o.selection, 2.0, o.depth, None, None, o.jobs)
    steps: list[Step] = []
    first: Checkpoint | None = None
    previous: Checkpoint | None = None
    try:
        for path in ordered(paths, o.keep_order):
            ckpt = open_checkpoint(path)
            hashes = hash_checkpoint(ckpt, HashOptions(o.selection, jobs=o.jobs), progress)
            norms = global_norm(ckpt, norm_options, progress)
            to_previous = to_first = None
            identical = False
            if previous is not None:
                against = diff(previous, ckpt, diff_options, progress)
                to_previous = _compared(against)
                to_first = to_previous if previous is first else _compared(diff(first, ckpt, diff_options, progress))
                # the hashes leave out tensors with no content hash (quantized, sparse): diff tells of those
                identical = steps[-1].hash == hashes.hash and not against.tensors_differ
            steps.append(_step(path, ckpt, hashes.hash, norms, to_previous, to_first, identical))
            if previous is not None and previous is not first:
                previous.close()
            first = first or ckpt
            previous = ckpt
    finally:
        for ckpt in {id(c): c for c in (first, previous) if c is not None}.values():
            ckpt.close()
    return TrajectoryReport(steps=tuple(steps), depth=o.depth)


def _compared(report: DiffReport) -> DiffReport | None:
    """A diff that compared tensors; None for one with no floating tensor in both checkpoints (no movement was
    measured: its ‖Δ‖ of 0 would read as "did not move")."""
    return report if report.tensors else None


def _step(
    path: str | Path,
    ckpt: Checkpoint,
    digest: str,
    norms: CheckpointNorms,
    to_previous: DiffReport | None,
    to_first: DiffReport | None,
    identical: bool,
) -> Step:
    moved = {g.name: g for g in (to_previous.groups or ())} if to_previous is not None else {}
    groups = tuple(
        StepGroup(
            name=g.name,
            norm=g.norm,
            delta=moved[g.name].diff_norm if g.name in moved else None,
            rel=moved[g.name].rel if g.name in moved else None,
            cosine=moved[g.name].cosine if g.name in moved else None,
        )
        for g in (norms.groups or ())
    )
    return Step(
        path=str(ckpt.path),
        step=step_of(path),
        hash=digest,
        global_norm=norms.global_norm,
        tensors=norms.summary.tensors,
        delta=None if to_previous is None else to_previous.stats.diff_norm,
        rel=None if to_previous is None else to_previous.stats.rel,
        cosine=None if to_previous is None else to_previous.stats.cosine,
        cosine_first=None if to_first is None else to_first.stats.cosine,
        identical=identical,
        groups=groups,
        pickle=norms.pickle,
    )
