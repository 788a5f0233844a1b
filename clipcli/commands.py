"""What each command does, on open checkpoints: select tensors, measure norms, clip, write, report."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from clipcli import core
from clipcli.checkpoint import Checkpoint, TensorInfo, save
from clipcli.errors import CheckFailedError
from clipcli.report import CheckpointReport, Group, InspectRow, Report, Skipped, TensorRow

Progress = Callable[[int], None]


def _no_progress(n: int) -> None:
    pass


@dataclass(frozen=True)
class Selection:
    """Which tensors a command works on: shell-style globs on tensor names."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    def reason_to_skip(self, t: TensorInfo, real_only: bool = False) -> str | None:
        if self.include and not any(fnmatch.fnmatchcase(t.name, g) for g in self.include):
            return "not selected by --include"
        if any(fnmatch.fnmatchcase(t.name, g) for g in self.exclude):
            return "excluded by --exclude"
        if t.array_dtype is None:
            return f"no arithmetic on {t.dtype} (carried as bytes)"
        if not core.is_floating(t.array_dtype) and not (t.array_dtype.kind == "c" and not real_only):
            return "not a floating tensor" if t.array_dtype.kind != "c" else "complex values have no order"
        return None

    def listed(self, t: TensorInfo) -> bool:
        return (not self.include or any(fnmatch.fnmatchcase(t.name, g) for g in self.include)) and not any(
            fnmatch.fnmatchcase(t.name, g) for g in self.exclude
        )


def inspect(ckpt: Checkpoint, selection: Selection) -> CheckpointReport:
    """Names, dtypes, shapes, sizes and metadata, from the headers alone."""
    rows = tuple(InspectRow(t.name, t.dtype, t.shape, t.nbytes, t.file) for t in ckpt.tensors if selection.listed(t))
    return CheckpointReport(str(ckpt.path), format=ckpt.format, metadata=ckpt.metadata, listing=rows)


@dataclass
class _Measured:
    rows: list[TensorRow]
    skipped: list[Skipped]
    total: core.NormAccumulator
    per_tensor: dict[str, core.NormAccumulator]


def _select(ckpt: Checkpoint, selection: Selection, real_only: bool = False) -> tuple[list[TensorInfo], list[Skipped]]:
    selected, skipped = [], []
    for t in ckpt.tensors:
        reason = selection.reason_to_skip(t, real_only)
        if reason:
            skipped.append(Skipped(t.name, t.dtype, reason))
        else:
            selected.append(t)
    return selected, skipped


def _measure(
    ckpt: Checkpoint, selection: Selection, p: float, progress: Progress, jobs: int, real_only: bool = False
) -> _Measured:
    selected, skipped = _select(ckpt, selection, real_only)
    # One accumulator per worker and tensor: every chunk but a tensor's last holds whole blocks, so a
    # worker's chunks of a tensor add up like the whole tensor would, and merging is exact.
    partial: list[dict[str, core.NormAccumulator]] = [{} for _ in range(max(jobs, 1))]

    def add(worker: int, t: TensorInfo, chunk: np.ndarray) -> None:
        acc = partial[worker].get(t.name)
        if acc is None:
            acc = partial[worker][t.name] = core.NormAccumulator(p)
        acc.add(chunk)
        progress(chunk.nbytes)

    ckpt.scan(selected, add, jobs)
    per_tensor = {t.name: core.NormAccumulator(p) for t in selected}
    for accs in partial:
        for name, acc in accs.items():
            per_tensor[name].merge(acc)
    return _measured(selected, skipped, per_tensor, p)


def _measured(
    selected: list[TensorInfo], skipped: list[Skipped], per_tensor: dict[str, core.NormAccumulator], p: float
) -> _Measured:
    """The report's rows from each selected tensor's accumulated norm."""
    total = core.NormAccumulator(p)
    rows = []
    for t in selected:
        s = per_tensor[t.name].result()
        rows.append(TensorRow(t.name, t.dtype, t.shape, t.nbytes, s.norm, s.max_abs, s.nan, s.inf, None))
        total.merge(per_tensor[t.name])
    g = total.result().norm
    return _Measured([replace(r, share=_share(r.norm, g, p)) for r in rows], skipped, total, per_tensor)


def _norm_of(chunk: np.ndarray, p: float) -> core.NormAccumulator:
    acc = core.NormAccumulator(p)
    acc.add(chunk)
    return acc


def _share(norm: float, g: float, p: float) -> float | None:
    """norm**p / g**p, the tensor's part of the global norm**p; None for the inf-norm."""
    if math.isinf(p):
        return None
    if g == 0:
        return 0.0
    if not (math.isfinite(g) and math.isfinite(norm)):
        return math.nan
    return (norm / g) ** p


def _groups(m: _Measured, depth: int, p: float, g: float) -> tuple[Group, ...]:
    accs: dict[str, core.NormAccumulator] = {}
    counts: dict[str, int] = {}
    for r in m.rows:
        key = ".".join(r.name.split(".")[:depth])
        accs.setdefault(key, core.NormAccumulator(p)).merge(m.per_tensor[r.name])
        counts[key] = counts.get(key, 0) + 1
    out = []
    for key, acc in accs.items():
        n = acc.result().norm
        out.append(Group(key, counts[key], n, _share(n, g, p)))
    return tuple(out)


_SORT_KEYS = {
    "name": lambda r: (r.name,),
    "norm": lambda r: (math.isnan(r.norm), 0.0 if math.isnan(r.norm) else r.norm),  # NaN first: it matters most
    "size": lambda r: (getattr(r, "nbytes", getattr(r, "tensors", 0)),),
}


def order(rows: Sequence, sort: str | None, top: int | None) -> tuple:
    """Rows sorted (name ascending; norm and size descending) and cut to the first `top`."""
    out = list(rows)
    if sort:
        out.sort(key=_SORT_KEYS[sort], reverse=sort != "name")
    return tuple(out[:top] if top else out)


def global_norm(
    ckpt: Checkpoint,
    selection: Selection,
    p: float,
    depth: int | None = None,
    sort: str | None = None,
    top: int | None = None,
    progress: Progress = _no_progress,
    jobs: int = 1,
) -> CheckpointReport:
    """Per-tensor norms and the global norm of the selected floating tensors."""
    m = _measure(ckpt, selection, p, progress, jobs)
    g = m.total.result().norm
    groups = order(_groups(m, depth, p, g), sort, top) if depth else None
    return CheckpointReport(str(ckpt.path), g, order(m.rows, sort, top), tuple(m.skipped), groups)


def check_nonfinite(path: str, rows: Iterable[TensorRow]) -> None:
    """Refuses data holding NaN or Inf, naming the tensors.

    Raises:
        CheckFailedError: when a tensor holds NaN or Inf.
    """
    bad = [r for r in rows if r.nan or r.inf]
    if bad:
        first = bad[0]
        others = (
            f"; also {len(bad) - 1} other tensor{'s' * (len(bad) > 2)}: "
            + ", ".join(r.name for r in bad[1:6])
            + (", ..." if len(bad) > 6 else "")
            if len(bad) > 1
            else ""
        )
        raise CheckFailedError(f"holds {first.nan} NaN and {first.inf} Inf values{others}", path, first.name)


# --- Clipping ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClipJob:
    """Where a clip command writes: `output` (None with `dry_run`), and whether it may replace the input."""

    output: Path | None
    in_place: bool = False
    allow_nonfinite: bool = False
    jobs: int = 1


ChunkOp = Callable[[np.ndarray], np.ndarray]
_ROW_GROUP = 1 << 18  # values clipped per step along rows


@dataclass(frozen=True)
class _Op:
    """What happens to one tensor's chunks; `align` keeps rows whole (or, at the size, the whole tensor)."""

    apply: ChunkOp
    align: int = 1


class _InOrder:
    """Hands out the ordered results of `map_chunks` tensor by tensor, as the writer asks for them."""

    def __init__(self, results: Iterator[tuple[TensorInfo, Any]]):
        self._results = results
        self._head: tuple[TensorInfo, Any] | None = None
        self._started = False

    def take(self, t: TensorInfo) -> Iterator[Any]:
        if not self._started:
            self._head, self._started = next(self._results, None), True
        while self._head is not None and self._head[0] is t:
            yield self._head[1]
            self._head = next(self._results, None)


def _write(
    ckpt: Checkpoint, job: ClipJob, ops: dict[str, _Op], progress: Progress, measure_first: bool = False
) -> tuple[dict[str, core.NormAccumulator], dict[str, core.NormAccumulator]]:
    """Streams every tensor into the output (or nowhere, on a dry run), through its op if it has one.

    Returns the norms of what was read (only with `measure_first`: one pass instead of two) and of what
    was written, for the tensors that have an op.
    """

    def work(t: TensorInfo, chunk: np.ndarray) -> tuple[np.ndarray, tuple[core.NormAccumulator, ...]]:
        op = ops.get(t.name)
        if op is None:
            return chunk, ()
        read = (_norm_of(chunk, 2.0),) if measure_first else ()
        out = op.apply(chunk)
        return out, (*read, _norm_of(out, 2.0))

    before = {name: core.NormAccumulator(2) for name in ops} if measure_first else {}
    after = {name: core.NormAccumulator(2) for name in ops}
    results = ckpt.map_chunks(ckpt.tensors, work, job.jobs, align={n: op.align for n, op in ops.items()})
    stream = _InOrder(results)

    def chunks(t: TensorInfo) -> Iterator[np.ndarray]:
        for out, norms in stream.take(t):
            if norms:
                if measure_first:
                    before[t.name].merge(norms[0])
                after[t.name].merge(norms[-1])
            progress(out.nbytes)
            yield out

    try:
        if job.output is None:
            for t in ckpt.tensors:
                for _ in chunks(t):
                    pass
        else:
            save(ckpt, job.output, chunks, in_place=job.in_place)
    finally:
        results.close()  # type: ignore[attr-defined]
    return before, after


def _finish(
    ckpt: Checkpoint, job: ClipJob, m: _Measured, after: dict[str, core.NormAccumulator], **fields: object
) -> CheckpointReport:
    total_after = core.NormAccumulator(2)
    rows = []
    for r in m.rows:
        acc = after.get(r.name, m.per_tensor[r.name])
        total_after.merge(acc)
        rows.append(replace(r, norm_after=acc.result().norm))
    return CheckpointReport(
        str(ckpt.path),
        m.total.result().norm,
        tuple(rows),
        tuple(m.skipped),
        global_norm_after=total_after.result().norm,
        output=None if job.output is None else str(job.output),
        **fields,  # type: ignore[arg-type]
    )


def clip_global_norm(
    ckpt: Checkpoint,
    selection: Selection,
    job: ClipJob,
    clip_norm: float,
    use_norm: float | None = None,
    progress: Progress = _no_progress,
) -> CheckpointReport:
    """`tf.clip_by_global_norm` over all selected floating and complex tensors: one common scale."""
    m = _measure(ckpt, selection, 2.0, progress, job.jobs)
    if not job.allow_nonfinite:
        check_nonfinite(str(ckpt.path), m.rows)
    g = m.total.result().norm if use_norm is None else use_norm
    scale = core.clip_scale(g, clip_norm)
    # Chunks are the workers' own buffers: scaling them in place allocates nothing.
    ops = {} if scale == 1.0 else {r.name: _Op(lambda c: core.scaled(c, scale, out=c)) for r in m.rows}
    _, after = _write(ckpt, job, ops, progress)
    return _finish(ckpt, job, m, after, clip={"clip_norm": clip_norm}, scale=scale)


def clip_norm(
    ckpt: Checkpoint,
    selection: Selection,
    job: ClipJob,
    clip_norm: float,
    axes: tuple[int, ...] | None = None,
    progress: Progress = _no_progress,
) -> CheckpointReport:
    """`tf.clip_by_norm` on each selected tensor separately, over all axes or the given ones."""
    m = _measure(ckpt, selection, 2.0, progress, job.jobs)
    if not job.allow_nonfinite:
        check_nonfinite(str(ckpt.path), m.rows)
    if axes is not None:
        too_small = [r for r in m.rows if not _axes_fit(axes, len(r.shape))]
        for r in too_small:
            m.rows.remove(r)
            reason = f"rank {len(r.shape)} is too small for --axes {','.join(map(str, axes))}"
            m.skipped.append(Skipped(r.name, r.dtype, reason))
        m.total = _total(m)
    infos = {t.name: t for t in ckpt.tensors}
    streamed = [infos[r.name] for r in m.rows if _reduces_rows(infos[r.name], axes)]
    axis_norms = _axis_norms(ckpt, streamed, axes, job.jobs) if streamed else {}
    ops = {}
    for r in m.rows:
        op = _clip_norm_op(infos[r.name], r.norm, clip_norm, axes, axis_norms.get(r.name))
        if op is not None:
            ops[r.name] = op
    _, after = _write(ckpt, job, ops, progress)
    return _finish(ckpt, job, m, after, clip={"clip_norm": clip_norm})


def _total(m: _Measured) -> core.NormAccumulator:
    total = core.NormAccumulator(2)
    for r in m.rows:
        total.merge(m.per_tensor[r.name])
    return total


def _axes_fit(axes: tuple[int, ...], rank: int) -> bool:
    return all(-rank <= a < rank for a in axes) and len({a % rank for a in axes}) == len(axes) if rank else False


def _reduces_rows(t: TensorInfo, axes: tuple[int, ...] | None) -> bool:
    """Whether clip-norm takes norms across rows (axis 0 among the axes, not all of them) of a C-order tensor."""
    ax = None if axes is None else core.normalize_axes(axes, len(t.shape))
    return ax is not None and 0 in ax and len(ax) < len(t.shape) and not t.fortran_order


def _axis_norms(
    ckpt: Checkpoint, tensors: list[TensorInfo], axes: tuple[int, ...] | None, jobs: int
) -> dict[str, np.ndarray]:
    """Norms over axes that include axis 0, streamed: one more read of these tensors, in whole row groups."""

    def group_sums(t: TensorInfo, chunk: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        return core.axis_power_sums(chunk.reshape(-1, *t.shape[1:]), core.normalize_axes(axes, len(t.shape)), 2.0)

    align = {t.name: max(core.row_group(t.shape) * math.prod(t.shape[1:]), 1) for t in tensors}
    totals: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    results = ckpt.map_chunks(tensors, group_sums, jobs, align=align)
    try:
        for t, parts in results:
            for part in parts:  # in order: the same bits as in memory, whatever the chunks
                totals[t.name] = core.add_power_sums(totals.get(t.name), part)
    finally:
        results.close()  # type: ignore[attr-defined]
    return {name: core.power_sums_root(*total, 2.0) for name, total in totals.items()}


def _clip_norm_op(
    t: TensorInfo, norm: float, clip: float, axes: tuple[int, ...] | None, axis_norms: np.ndarray | None
) -> _Op | None:
    """The per-chunk op of `clip-norm` on one tensor; None when it comes back unchanged.

    Over all axes the tensor's norm is known from the first pass: one scale. Slices along axis 0 are
    independent, so with axes that leave axis 0 whole rows are streamed; with axis 0 among the axes,
    `axis_norms` (streamed before) give one scale per slice across the rows. A tensor in Fortran order
    is held in memory.
    """
    ax = None if axes is None else core.normalize_axes(axes, len(t.shape))
    if ax is None or len(ax) == len(t.shape):
        scale = core.clip_scale(norm, clip)
        return None if scale == 1.0 else _Op(lambda c: core.scaled(c, scale, out=c))
    if t.fortran_order:
        return _Op(lambda c: core.clip_by_norm(c.reshape(t.shape, order="F"), clip, ax).ravel(order="F"), t.size)
    rest = t.shape[1:]
    row = math.prod(rest)
    if 0 in ax:
        if axis_norms is None:  # no values
            return None
        scales = core.clip_scale(axis_norms, clip)
        if (scales == 1.0).all():
            return None
        return _Op(lambda c: core.scaled(c.reshape(-1, *rest), scales, out=c.reshape(-1, *rest)).reshape(-1), row)
    group = max(_ROW_GROUP // max(row, 1), 1)

    def clip_rows(c: np.ndarray) -> np.ndarray:
        rows = c.reshape(-1, *rest)
        for i in range(0, len(rows), group):  # a few rows at a time: float64 temporaries stay small
            rows[i : i + group] = core.clip_by_norm(rows[i : i + group], clip, ax)
        return c

    return _Op(clip_rows, row)


def clip_value(
    ckpt: Checkpoint, selection: Selection, job: ClipJob, lo: float, hi: float, progress: Progress = _no_progress
) -> CheckpointReport:
    """`tf.clip_by_value` on every selected real floating tensor; NaN stays NaN, +-inf is clipped.

    One pass: the norms before clipping are taken from the chunks as they are read.
    """
    selected, skipped = _select(ckpt, selection, real_only=True)
    ops = {t.name: _Op(lambda c: core.clip_by_value(c, lo, hi, out=c)) for t in selected}
    before, after = _write(ckpt, job, ops, progress, measure_first=True)
    return _finish(ckpt, job, _measured(selected, skipped, before, 2.0), after, clip={"min": lo, "max": hi})


def make_report(command: str, p: float, checkpoints: Sequence[CheckpointReport]) -> Report:
    return Report(command, p, tuple(checkpoints))
