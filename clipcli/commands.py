"""What each command does, on open checkpoints: select tensors, measure norms, clip, write, report."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

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


def _measure(
    ckpt: Checkpoint, selection: Selection, p: float, progress: Progress, real_only: bool = False
) -> _Measured:
    total = core.NormAccumulator(p)
    rows, skipped, per_tensor = [], [], {}
    for t in ckpt.tensors:
        reason = selection.reason_to_skip(t, real_only)
        if reason:
            skipped.append(Skipped(t.name, t.dtype, reason))
            continue
        acc = core.NormAccumulator(p)
        for chunk in ckpt.chunks(t):
            acc.add(chunk)
            progress(chunk.nbytes)
        s = acc.result()
        rows.append(TensorRow(t.name, t.dtype, t.shape, t.nbytes, s.norm, s.max_abs, s.nan, s.inf, None))
        per_tensor[t.name] = acc
        total.merge(acc)
    g = total.result().norm
    return _Measured([replace(r, share=_share(r.norm, g, p)) for r in rows], skipped, total, per_tensor)


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
    "norm": lambda r: (not math.isnan(r.norm), r.norm),  # NaN norms first: they matter most
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
) -> CheckpointReport:
    """Per-tensor norms and the global norm of the selected floating tensors."""
    m = _measure(ckpt, selection, p, progress)
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


def _write(
    ckpt: Checkpoint, job: ClipJob, transform: Callable[[TensorInfo], Iterable[np.ndarray] | None], progress: Progress
) -> None:
    """Streams every tensor through `transform` (None: unchanged) into the output, or nowhere on a dry run."""

    def chunks(t: TensorInfo) -> Iterator[np.ndarray]:
        produced = transform(t)
        for chunk in ckpt.chunks(t) if produced is None else produced:
            yield chunk
            progress(chunk.nbytes)

    if job.output is None:
        for t in ckpt.tensors:
            for _ in chunks(t):
                pass
    else:
        save(ckpt, job.output, chunks, in_place=job.in_place)


def _after(acc: core.NormAccumulator, chunks: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
    for chunk in chunks:
        acc.add(chunk)
        yield chunk


def _finish(
    ckpt: Checkpoint, job: ClipJob, m: _Measured, after: dict[str, core.NormAccumulator], p: float, **fields: object
) -> CheckpointReport:
    total_after = core.NormAccumulator(p)
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
    m = _measure(ckpt, selection, 2.0, progress)
    if not job.allow_nonfinite:
        check_nonfinite(str(ckpt.path), m.rows)
    g = m.total.result().norm if use_norm is None else use_norm
    scale = core.clip_scale(g, clip_norm)
    selected = {r.name for r in m.rows}
    after: dict[str, core.NormAccumulator] = {}

    def transform(t: TensorInfo) -> Iterable[np.ndarray] | None:
        if t.name not in selected or scale == 1.0:
            return None
        acc = after[t.name] = core.NormAccumulator(2)
        return _after(acc, (core.scaled(c, scale) for c in ckpt.chunks(t)))

    _write(ckpt, job, transform, progress)
    return _finish(ckpt, job, m, after, 2.0, clip={"clip_norm": clip_norm}, scale=scale)


def clip_norm(
    ckpt: Checkpoint,
    selection: Selection,
    job: ClipJob,
    clip_norm: float,
    axes: tuple[int, ...] | None = None,
    progress: Progress = _no_progress,
) -> CheckpointReport:
    """`tf.clip_by_norm` on each selected tensor separately, over all axes or the given ones."""
    m = _measure(ckpt, selection, 2.0, progress)
    if not job.allow_nonfinite:
        check_nonfinite(str(ckpt.path), m.rows)
    rank_skips = [r for r in m.rows if axes is not None and not _axes_fit(axes, len(r.shape))]
    for r in rank_skips:
        m.rows.remove(r)
        m.skipped.append(
            Skipped(r.name, r.dtype, f"rank {len(r.shape)} is too small for --axes {','.join(map(str, axes or ()))}")
        )
    selected = {r.name: r for r in m.rows}
    after: dict[str, core.NormAccumulator] = {}

    def transform(t: TensorInfo) -> Iterable[np.ndarray] | None:
        r = selected.get(t.name)
        if r is None:
            return None
        acc = after[t.name] = core.NormAccumulator(2)
        ax = None if axes is None else core.normalize_axes(axes, len(t.shape))
        if ax is None or len(ax) == len(t.shape):
            scale = core.clip_scale(r.norm, clip_norm)
            if scale == 1.0:
                del after[t.name]
                return None
            return _after(acc, (core.scaled(c, scale) for c in ckpt.chunks(t)))
        return _after(acc, _clip_slices(ckpt, t, ax, clip_norm))

    _write(ckpt, job, transform, progress)
    m.total = core.NormAccumulator(2)
    for r in m.rows:
        m.total.merge(m.per_tensor[r.name])
    return _finish(ckpt, job, m, after, 2.0, clip={"clip_norm": clip_norm})


def _axes_fit(axes: tuple[int, ...], rank: int) -> bool:
    return all(-rank <= a < rank for a in axes) and len({a % rank for a in axes}) == len(axes) if rank else False


def _clip_slices(ckpt: Checkpoint, t: TensorInfo, axes: tuple[int, ...], clip: float) -> Iterator[np.ndarray]:
    """Per-slice clipping. Slices along axis 0 are independent, so whole rows are streamed; when axis 0
    is reduced, or the tensor is in Fortran order, the tensor is clipped whole (held in memory)."""
    if 0 in axes or t.fortran_order:
        yield core.clip_by_norm(ckpt.read(t), clip, axes).reshape(-1, order="F" if t.fortran_order else "C")
        return
    row = math.prod(t.shape[1:])
    for chunk in ckpt.chunks(t, align=row):
        yield core.clip_by_norm(chunk.reshape(-1, *t.shape[1:]), clip, axes).reshape(-1)


def clip_value(
    ckpt: Checkpoint, selection: Selection, job: ClipJob, lo: float, hi: float, progress: Progress = _no_progress
) -> CheckpointReport:
    """`tf.clip_by_value` on every selected real floating tensor; NaN stays NaN, +-inf is clipped."""
    m = _measure(ckpt, selection, 2.0, progress, real_only=True)
    selected = {r.name for r in m.rows}
    after: dict[str, core.NormAccumulator] = {}

    def transform(t: TensorInfo) -> Iterable[np.ndarray] | None:
        if t.name not in selected:
            return None
        acc = after[t.name] = core.NormAccumulator(2)
        return _after(acc, (core.clip_by_value(c, lo, hi) for c in ckpt.chunks(t)))

    _write(ckpt, job, transform, progress)
    return _finish(ckpt, job, m, after, 2.0, clip={"min": lo, "max": hi})


def make_report(command: str, p: float, checkpoints: Sequence[CheckpointReport]) -> Report:
    return Report(command, p, tuple(checkpoints))
