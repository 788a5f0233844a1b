"""The clip commands: `clip-value`, `clip-norm` and `clip-global-norm`, measured, clipped and written in a pass."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from clipcli.checkpoint import MAX_NUMPY_DIMS, Checkpoint, TensorInfo, shared_in_output
from clipcli.commands import passes
from clipcli.commands.audit import pickle_audit
from clipcli.commands.measure import Measured, check_nonfinite, measure, measured, shared_once
from clipcli.commands.passes import NO_PROGRESS, Progress
from clipcli.commands.select import EVERY, Selection, order, select_to_clip, shared_storages
from clipcli.commands.write import Op, check_write_cost, write
from clipcli.core import clip_by_norm, clip_by_value
from clipcli.core.axes import axis_power_sums, normalize_axes, row_group
from clipcli.core.blocks import add_power_sums
from clipcli.core.norms import NormAccumulator, NormStats, given_norm_stats
from clipcli.core.scale import scaled, stats_clip_scale, sums_clip_scale, tensor_clip_scale
from clipcli.errors import CheckFailedError, UnsupportedError, UsageError, printable
from clipcli.report.clip import (
    ClipGlobalNormReport,
    ClipGlobalNormsReport,
    ClipNormReport,
    ClipReport,
    ClipValueReport,
)
from clipcli.report.rows import Skipped, summarize

_ROW_GROUP = 1 << 18  # values clipped per step along rows


@dataclass(frozen=True, kw_only=True)
class ClipOptions:
    """What every clip command takes: where it writes (`output`; None: a dry run, nothing written), whether it
    replaces its input (`in_place`, with `output` the input's path), whether it writes NaN outputs for a norm
    that is not finite (`allow_nonfinite`), the tensors `selection` takes, the rows its report shows (`sort`:
    name, norm, size; `top`) and its workers (`jobs`)."""

    output: Path | None = None
    in_place: bool = False
    allow_nonfinite: bool = False
    selection: Selection = EVERY
    sort: str | None = None
    top: int | None = None
    jobs: int = 1


@dataclass(frozen=True, kw_only=True)
class ClipValueOptions(ClipOptions):
    """`clip-value`'s bounds, rounded to each tensor's dtype as TensorFlow does."""

    min: float
    max: float


@dataclass(frozen=True, kw_only=True)
class ClipNormOptions(ClipOptions):
    """`clip-norm`'s largest norm a tensor (or slice along `axes`) may keep."""

    clip_norm: float
    axes: tuple[int, ...] | None = None


@dataclass(frozen=True, kw_only=True)
class ClipGlobalNormOptions(ClipOptions):
    """`clip-global-norm`'s largest global norm, the global norm to use instead of measuring it, and whether names
    on one storage (tied weights) count once in the global norm (`measure.shared_once`; each is still written,
    scaled by the one scale)."""

    clip_norm: float
    use_norm: float | None = None
    count_shared_once: bool = False


def _written(ckpt: Checkpoint, o: ClipOptions, ops: dict[str, Op], progress: Progress, first: bool = False) -> Any:
    return write(ckpt, o.output, ops, in_place=o.in_place, measure_first=first, jobs=o.jobs, progress=progress)


def _finish(
    ckpt: Checkpoint,
    o: ClipOptions,
    m: Measured,
    after: dict[str, NormAccumulator],
    report: Callable[..., ClipReport],
    combined_after: NormAccumulator | None = None,
    **fields: Any,
) -> ClipReport:
    """The report of a clip; `combined_after`, where given, also takes in every norm after."""
    total_after = NormAccumulator(2)
    rows = []
    for r in m.rows:
        acc = after.get(r.name, m.per_tensor[r.name])
        if r.name not in m.repeats:  # a repeat of a name that counts (--count-shared-once) is counted once
            total_after.merge(acc)
            if combined_after is not None:
                combined_after.merge(acc)
        stats = acc.result()
        rows.append(replace(r, norm_after=stats.norm, max_abs_after=stats.max_abs))
    return report(
        path=str(ckpt.path),
        summary=summarize(rows, max_abs_after=max((r.max_abs_after or 0.0 for r in rows), default=0.0)),
        global_norm=m.total.result().norm,
        tensors=order(rows, o.sort, o.top),
        skipped=tuple(m.skipped),
        global_norm_after=total_after.result().norm,
        output=None if o.output is None else str(o.output),
        shared=shared_storages(ckpt.tensors),  # every tensor is written, the unselected as they were
        shared_kept=shared_in_output(o.output, ckpt.tensors),
        pickle=pickle_audit(ckpt),
        **fields,
    )


def _refuse_nan_scale(path: str, scale: float, o: ClipOptions) -> None:
    """Nothing is written with a NaN scale unless --allow-nonfinite asked for TensorFlow's NaN outputs."""
    if math.isnan(scale) and not o.allow_nonfinite:
        raise CheckFailedError("the clip scale is not a number; refusing to write NaN values", path)


def clip_global_norm(
    ckpt: Checkpoint, options: ClipGlobalNormOptions, progress: Progress = NO_PROGRESS
) -> ClipGlobalNormReport:
    """`tf.clip_by_global_norm` over all selected floating and complex tensors: one common scale.

    The scale comes from the exact global norm: finite and right also when the norm is too large for
    float64 (the report then says the norm is inf).

    Raises:
        UsageError: when no floating tensor is selected.
        CheckFailedError: when a tensor holds NaN or Inf (unless `allow_nonfinite`).
    """
    return clip_global_norms([ckpt], [options], progress).checkpoints[0]


def clip_global_norms(
    ckpts: Sequence[Checkpoint], options: Sequence[ClipGlobalNormOptions], progress: Progress = NO_PROGRESS
) -> ClipGlobalNormsReport:
    """`tf.clip_by_global_norm` over the selected tensors of several checkpoints together (per-rank gradient
    files): one global norm over all of them, one common scale, each checkpoint written as its own options say
    (they differ only in the output). Every checkpoint is measured before any is written; each output is
    written atomically, in turn.

    Raises:
        UsageError: when a checkpoint has no floating tensor selected.
        CheckFailedError: when a tensor holds NaN or Inf (unless `allow_nonfinite`).
    """
    o = options[0]
    measured = []
    total = NormAccumulator(2)
    for ckpt, oc in zip(ckpts, options, strict=True):
        selected, skipped = select_to_clip(ckpt, oc.selection)
        repeats = shared_once(selected) if oc.count_shared_once else None
        m = measure(ckpt, selected, skipped, 2.0, progress, oc.jobs, repeats)
        if not oc.allow_nonfinite:
            check_nonfinite(str(ckpt.path), m.rows)
        total.merge(m.total)
        measured.append(m)
    if o.use_norm is None:
        scale = stats_clip_scale(total.result(), o.clip_norm)
    else:
        # as the library's clip_by_global_norm takes it: a tiny scale keeps its bits
        scale = stats_clip_scale(given_norm_stats(o.use_norm), o.clip_norm)
    _refuse_nan_scale(str(ckpts[0].path), scale, o)
    for ckpt, oc in zip(ckpts, options, strict=True):  # every write's cost before any is written
        check_write_cost(ckpt, oc.output if not oc.in_place else ckpt.path)
    total_after = NormAccumulator(2)
    reports = []
    for ckpt, oc, m in zip(ckpts, options, measured, strict=True):
        # Chunks are the workers' own buffers: scaling them in place allocates nothing.
        ops = {} if scale == 1.0 else {r.name: Op(lambda c: scaled(c, scale, out=c)) for r in m.rows}
        _, after = _written(ckpt, oc, ops, progress)
        report = _finish(ckpt, oc, m, after, ClipGlobalNormReport, total_after, clip_norm=o.clip_norm, scale=scale)
        reports.append(report)
    return ClipGlobalNormsReport(
        clip_norm=o.clip_norm,
        scale=scale,
        global_norm=total.result().norm,
        global_norm_after=total_after.result().norm,
        checkpoints=tuple(reports),  # type: ignore[arg-type]
    )


def clip_norm(ckpt: Checkpoint, options: ClipNormOptions, progress: Progress = NO_PROGRESS) -> ClipNormReport:
    """`tf.clip_by_norm` on each selected tensor separately, over all axes or the given ones.

    Raises:
        UsageError: when no floating tensor is selected, or --axes fits none.
        UnsupportedError: for --axes on a tensor of more dimensions than NumPy holds.
        CheckFailedError: when a tensor's norm is not finite (unless `allow_nonfinite`).
    """
    o = options
    axes = o.axes
    selected, skipped = select_to_clip(ckpt, o.selection)
    if axes is not None:
        misfits = [(t, _axes_misfit(axes, len(t.shape))) for t in selected]
        skipped += [Skipped(t.name, t.dtype, why) for t, why in misfits if why]
        if not any(why is None for _, why in misfits):
            first, why = misfits[0]
            message = f"--axes {_axes_text(axes)} fits no selected tensor ({printable(first.name)}: {why})"
            raise UsageError(message, ckpt.path, "--axes")
        selected = [t for t, why in misfits if why is None]
        for t in selected:  # its rows are NumPy arrays of its rank
            if len(t.shape) > MAX_NUMPY_DIMS:
                raise UnsupportedError(
                    f"--axes on {len(t.shape)} dimensions, more than a NumPy array holds ({MAX_NUMPY_DIMS})",
                    ckpt.path,
                    t.name,
                )
    m = measure(ckpt, selected, skipped, 2.0, progress, o.jobs)
    if not o.allow_nonfinite:
        check_nonfinite(str(ckpt.path), m.rows)
    streamed = [t for t in selected if _reduces_rows(t, axes)]
    axis_sums = _axis_sums(ckpt, streamed, axes, o.jobs) if streamed else {}
    ops = {}
    for t in selected:
        op = _clip_norm_op(t, m.per_tensor[t.name].result(), o.clip_norm, axes, axis_sums.get(t.name), o)
        if op is not None:
            ops[t.name] = op
    _, after = _written(ckpt, o, ops, progress)
    return _finish(ckpt, o, m, after, ClipNormReport, clip_norm=o.clip_norm)  # type: ignore[return-value]


def _axes_text(axes: tuple[int, ...]) -> str:
    return ",".join(map(str, axes))


def _axes_misfit(axes: tuple[int, ...], rank: int) -> str | None:
    """Why --axes does not fit a tensor of this rank (the reason it is skipped), or None when it fits."""
    if not all(-rank <= a < rank for a in axes):
        return f"rank {rank} is too small for --axes {_axes_text(axes)}"
    if len({a % rank for a in axes}) != len(axes):
        return f"--axes {_axes_text(axes)} names one axis twice for rank {rank}"
    return None


def _reduces_rows(t: TensorInfo, axes: tuple[int, ...] | None) -> bool:
    """Whether clip-norm takes norms across rows (axis 0 among the axes, not all of them) of a C-order tensor."""
    ax = None if axes is None else normalize_axes(axes, len(t.shape))
    return ax is not None and 0 in ax and len(ax) < len(t.shape) and not t.fortran_order


class _AxisSums:
    """The kernel of the pass before clip-norm across rows: a row group's sums of squares over the axes."""

    ordered = True  # the groups' sums are added in the order of the rows

    def __init__(self, axes: tuple[int, ...] | None):
        self.axes = axes

    def chunk(self, t: TensorInfo, offset: int, chunk: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        rows = chunk.reshape(-1, *t.shape[1:])
        return axis_power_sums(rows, normalize_axes(self.axes, len(t.shape)), 2.0)


def _axis_sums(
    ckpt: Checkpoint, tensors: list[TensorInfo], axes: tuple[int, ...] | None, jobs: int
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Sums of squares over axes that include axis 0, streamed: one more read of these tensors, in row groups.

    The groups' float64 sums are added in the order of the rows as they arrive (the ordered pass keeps it),
    as `clip_by_norm` adds them, so a file gives the same bits as the array in memory and nothing
    larger than a group's sums is held.
    """
    align = {t.name: max(row_group(t.shape) * math.prod(t.shape[1:]), 1) for t in tensors}
    totals: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    results = passes.run_pass(ckpt, tensors, lambda: _AxisSums(axes), jobs, align)
    try:
        for t, parts in results:
            for part in parts:
                totals[t.name] = add_power_sums(totals.get(t.name), part)
    finally:
        results.close()
    return totals


def _clip_norm_op(
    t: TensorInfo,
    stats: NormStats,
    clip: float,
    axes: tuple[int, ...] | None,
    axis_sums: tuple[np.ndarray, np.ndarray] | None,
    o: ClipOptions,
) -> Op | None:
    """The per-chunk op of `clip-norm` on one tensor; None when it comes back unchanged.

    Over all axes the tensor's norm is known from the first pass: one scale. Slices along axis 0 are
    independent, so with axes that leave axis 0 whole rows are streamed; with axis 0 among the axes,
    `axis_sums` (streamed before) give one scale per slice across the rows. A tensor in Fortran order
    is held in memory.
    """
    ax = None if axes is None else normalize_axes(axes, len(t.shape))
    if t.size == 0:  # no values: nothing to clip
        return None
    if ax is None or len(ax) == len(t.shape):
        scale = tensor_clip_scale(stats, clip)
        _refuse_nan_scale(t.file, scale, o)
        return None if scale == 1.0 else Op(lambda c: scaled(c, scale, out=c))
    if t.fortran_order:
        return Op(lambda c: clip_by_norm(c.reshape(t.shape, order="F"), clip, ax).ravel(order="F"), t.size)
    rest = t.shape[1:]
    row = math.prod(rest)
    if 0 in ax:
        if axis_sums is None:  # no values
            return None
        scales = sums_clip_scale(*axis_sums, clip)
        if (scales == 1.0).all():
            return None
        return Op(lambda c: scaled(c.reshape(-1, *rest), scales, out=c.reshape(-1, *rest)).reshape(-1), row)
    group = max(_ROW_GROUP // max(row, 1), 1)

    def clip_rows(c: np.ndarray) -> np.ndarray:
        rows = c.reshape(-1, *rest)
        for i in range(0, len(rows), group):  # a few rows at a time: float64 temporaries stay small
            rows[i : i + group] = clip_by_norm(rows[i : i + group], clip, ax)
        return c

    return Op(clip_rows, row)


def clip_value(ckpt: Checkpoint, options: ClipValueOptions, progress: Progress = NO_PROGRESS) -> ClipValueReport:
    """`tf.clip_by_value` on every selected real floating tensor; NaN stays NaN, +-inf is clipped.

    One pass: the norms before clipping are taken from the chunks as they are read.

    Raises:
        UsageError: when no real floating tensor is selected.
    """
    o = options
    lo, hi = o.min, o.max
    selected, skipped = select_to_clip(ckpt, o.selection, real_only=True)
    ops = {t.name: Op(lambda c: clip_by_value(c, lo, hi, out=c)) for t in selected}
    before, after = _written(ckpt, o, ops, progress, first=True)
    m = measured(selected, skipped, before, 2.0)
    return _finish(ckpt, o, m, after, ClipValueReport, min=lo, max=hi)  # type: ignore[return-value]
