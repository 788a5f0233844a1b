"""What each command does, on open checkpoints: select tensors, measure norms, clip, write, report."""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import itertools
import math
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from clipcli import core
from clipcli.checkpoint import (
    MAX_NUMPY_DIMS,
    Checkpoint,
    Place,
    TensorInfo,
    byte_layout,
    check_plan,
    decode,
    pair_values,
    placed,
    run,
    run_pairs,
    save,
)
from clipcli.errors import CheckFailedError, UnsupportedError, UsageError
from clipcli.report import (
    CheckpointReport,
    DiffGroup,
    DiffReport,
    DiffRow,
    Group,
    InspectRow,
    Mismatch,
    Report,
    Skipped,
    Summary,
    TensorRow,
    plural,
    printable,
    summarize,
)


class Progress:
    """Where a command says how far it is: a named pass over so many bytes, then bytes done. Does nothing."""

    def phase(self, label: str, total: int) -> None:
        pass

    def advance(self, n: int) -> None:
        pass


_NO_PROGRESS = Progress()


_floating = functools.lru_cache(core.is_floating)  # asked per tensor: few dtypes, 12,000 tensors


class Selection(NamedTuple):
    """Which tensors a command works on: shell-style globs on tensor names."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    def reason_to_skip(self, t: TensorInfo, real_only: bool = False) -> str | None:
        if self.include and not any(fnmatch.fnmatchcase(t.name, g) for g in self.include):
            return "not selected by --include"
        if self.exclude and any(fnmatch.fnmatchcase(t.name, g) for g in self.exclude):
            return "excluded by --exclude"
        if t.skip is not None:
            return t.skip
        if t.array_dtype is None:
            return f"no arithmetic on {t.dtype} (carried as bytes)"
        if not _floating(t.array_dtype) and not (t.array_dtype.kind == "c" and not real_only):
            return "not a floating tensor" if t.array_dtype.kind != "c" else "complex values have no order"
        return None

    def listed(self, t: TensorInfo) -> bool:
        return self.selects(t.name)

    def selects(self, name: str) -> bool:
        """Whether the patterns take a name (a tensor's, or a metadata key's)."""
        if self.include and not any(fnmatch.fnmatchcase(name, g) for g in self.include):
            return False
        return not (self.exclude and any(fnmatch.fnmatchcase(name, g) for g in self.exclude))

    def unmatched(self, *ckpts: Checkpoint) -> list[str]:
        """The options (`--include 'x'`) whose pattern matches no tensor of any of the checkpoints."""
        names = {t.name for c in ckpts for t in c.tensors}
        flagged = [("--include", g) for g in self.include] + [("--exclude", g) for g in self.exclude]
        return [f"{flag} {printable(g)!r}" for flag, g in flagged if not any(fnmatch.fnmatchcase(n, g) for n in names)]

    def check(self, ckpt: Checkpoint) -> None:
        """Refuses --include/--exclude patterns that leave no tensor of the checkpoint selected.

        Raises:
            UsageError: naming the patterns and a few names the checkpoint has.
        """
        if not (self.include or self.exclude) or any(self.listed(t) for t in ckpt.tensors):
            return
        if not self.exclude:
            what = "no tensor matches " + " or ".join(repr(printable(g)) for g in self.include)
        else:
            flags = [*(f"--include {printable(g)!r}" for g in self.include)]
            flags += [f"--exclude {printable(g)!r}" for g in self.exclude]
            what = " ".join(flags) + (" leave" if len(flags) > 1 else " leaves") + " no tensor selected"
        raise UsageError(f"{what}; {_some_names(ckpt)}", ckpt.path, "--include" if self.include else "--exclude")


def _some_names(ckpt: Checkpoint, k: int = 3) -> str:
    """'its tensors include a, b, c (17 in all)', for a message."""
    if not ckpt.tensors:
        return "it holds no tensor"
    names = ", ".join(printable(t.name) for t in ckpt.tensors[:k])
    more = f" ({len(ckpt.tensors):,} in all)" if len(ckpt.tensors) > k else ""
    return f"its tensors include {names}{more}"


def inspect(
    ckpt: Checkpoint, selection: Selection, sort: str | None = None, top: int | None = None
) -> CheckpointReport:
    """Names, dtypes, shapes, sizes and metadata, from the headers alone."""
    selection.check(ckpt)
    rows = [InspectRow(t.name, t.dtype, t.shape, t.nbytes, t.file) for t in ckpt.tensors if selection.listed(t)]
    summary = Summary(len(rows), elements=sum(r.elements for r in rows), nbytes=sum(r.nbytes for r in rows))
    listed = [t for t in ckpt.tensors if selection.listed(t)]
    return CheckpointReport(
        str(ckpt.path),
        summary,
        format=ckpt.format,
        metadata=ckpt.metadata,
        listing=order(rows, sort, top),
        shared=shared_storages(listed),
    )


@dataclass
class _Measured:
    rows: list[TensorRow]
    skipped: list[Skipped]
    total: core.NormAccumulator
    per_tensor: _PerTensor


def _select(ckpt: Checkpoint, selection: Selection, real_only: bool = False) -> tuple[list[TensorInfo], list[Skipped]]:
    selection.check(ckpt)
    selected, skipped = [], []
    for t in ckpt.tensors:
        reason = selection.reason_to_skip(t, real_only)
        if reason:
            skipped.append(Skipped(t.name, t.dtype, reason))
        else:
            selected.append(t)
    return selected, skipped


def _select_to_clip(
    ckpt: Checkpoint, selection: Selection, real_only: bool = False
) -> tuple[list[TensorInfo], list[Skipped]]:
    """`_select`, refusing a selection with nothing to clip.

    Raises:
        UsageError: when no floating tensor is selected.
    """
    selected, skipped = _select(ckpt, selection, real_only)
    if not selected:
        kinds = "real floating" if real_only else "floating or complex"
        message = f"no {kinds} tensor is selected, so there is nothing to clip; {_some_names(ckpt)}"
        raise UsageError(message, ckpt.path, "--include" if selection.include or selection.exclude else None)
    return selected, skipped


class _Norms:
    """A worker's kernel: the norm of each tensor's chunks it reads, blocks placed by their offsets."""

    worker_bytes = 5 << 20  # what one worker takes (see _engine.WORKERS_BUDGET)

    def __init__(self, p: float):
        self.p = p
        self.accs: dict[str, core.NormAccumulator] = {}
        self.small: list[tuple[list[str], core.SmallNorms]] = []  # runs of small tensors, by name

    def chunk(self, t: TensorInfo, offset: int, values: np.ndarray) -> None:
        acc = self.accs.get(t.name)
        if acc is None:
            acc = self.accs[t.name] = core.NormAccumulator(self.p)
        acc.add(values, offset // values.itemsize)

    def batch(self, ts: list[TensorInfo], raw: np.ndarray, starts: list[int]) -> None:
        """Whole small tensors read together: runs of one native dtype, fewer than BLOCK values each, in a
        few NumPy passes for the run (`core.small_norms`, the same bits)."""
        i = 0
        while i < len(ts):
            t = ts[i]
            dtype = t.array_dtype
            if t.stored_dtype is not None or t.size >= core.BLOCK or not core.is_floating(dtype):
                self.chunk(t, 0, _values(raw, starts[i], t))
                i += 1
                continue
            small = core.BLOCK * dtype.itemsize  # fewer bytes than this: fewer values than a block
            j = i + 1
            while j < len(ts) and _joins(ts[j], dtype, small):
                j += 1
            run = ts[i:j]
            end = starts[j - 1] + ts[j - 1].nbytes
            if end - starts[i] == sum(map(_NBYTES, run)):
                values = raw[starts[i] : end].view(dtype)
            else:  # with gaps between them (an .npz's member headers)
                values = np.concatenate([raw[starts[k] : starts[k] + ts[k].nbytes] for k in range(i, j)])
                values = values.view(dtype)
            sizes = [u.nbytes // dtype.itemsize for u in run]
            self.small.append(([u.name for u in run], core.small_norms(values, sizes, self.p)))
            i = j

    def result(self) -> tuple[dict[str, core.NormAccumulator], list[tuple[list[str], core.SmallNorms]]]:
        return self.accs, self.small


def _joins(u: TensorInfo, dtype: np.dtype, small: int) -> bool:
    """Whether u joins a run of small tensors of `dtype` (each of fewer than `small` bytes) for `small_norms`."""
    return (u.array_dtype is dtype or u.array_dtype == dtype) and u.stored_dtype is None and u.nbytes < small


_NBYTES = operator.attrgetter("nbytes")


def _values(raw: np.ndarray, start: int, t: TensorInfo) -> np.ndarray:
    return decode(raw[start : start + t.nbytes], t)


class _PerTensor(dict):
    """Each tensor's accumulator by name (or each pair's by number, for diff); those of small tensors measured
    together (`batches`) are made from their `core.SmallNorms` (`core.SmallDiffs`) when first asked for (by
    --depth, or a clip)."""

    def __init__(self, batches: Sequence[tuple[list[Any], Any]] = ()):
        super().__init__()
        self.batches = batches
        self._where = {key: (s, i) for keys, s in batches for i, key in enumerate(keys)}

    def __missing__(self, key: Any) -> Any:
        s, i = self._where[key]
        acc = self[key] = s.accumulator(i)
        return acc


def _combined(
    p: float,
    tensors: list[TensorInfo],
    parts: Iterable[dict[str, core.NormAccumulator]],
    batches: Sequence[tuple[list[str], core.SmallNorms]] = (),
) -> _PerTensor:
    """Each tensor's norm from the workers' parts (exactly: the same bits however the chunks were shared)."""
    per_tensor = _PerTensor(batches)
    for accs in parts:
        for name, acc in accs.items():
            if name in per_tensor:
                per_tensor[name].combine(acc)
            else:
                per_tensor[name] = acc
    for t in tensors:
        if t.name not in per_tensor and t.name not in per_tensor._where:
            per_tensor[t.name] = core.NormAccumulator(p)  # no chunks: empty
    return per_tensor


def _measure(
    ckpt: Checkpoint,
    selected: list[TensorInfo],
    skipped: list[Skipped],
    p: float,
    progress: Progress,
    jobs: int,
) -> _Measured:
    progress.phase("measuring", sum(t.nbytes for t in selected))
    results = run(ckpt, selected, lambda: _Norms(p), jobs, progress=progress.advance, unit=core.BLOCK)
    batches = [batch for _, small in results for batch in small]
    return _measured(selected, skipped, _combined(p, selected, (accs for accs, _ in results), batches), p)


def _measured(selected: list[TensorInfo], skipped: list[Skipped], per_tensor: _PerTensor, p: float) -> _Measured:
    """The report's rows from each selected tensor's accumulated norm (small tensors' in a few NumPy passes)."""
    total = core.NormAccumulator(p)
    stats: dict[str, tuple[float, float, int, int]] = {}
    for names, s in per_tensor.batches:
        s.merge_into(total)
        figures = zip(s.norms().tolist(), s.max_abs.tolist(), s.nan.tolist(), s.inf.tolist(), strict=True)
        stats.update(zip(names, figures, strict=True))
    for t in selected:
        if t.name not in stats:
            acc = per_tensor[t.name]
            r = acc.result()
            stats[t.name] = (r.norm, r.max_abs, r.nan, r.inf)
            total.merge(acc)
    g = total.result().norm
    # (norm / g) ** p for orders 1 and 2 where both are finite numbers (within an ulp or two); else from the
    # exact sums, which are right also where the norms overflow float64, and for any order (the ratio's
    # rounding grows p times in its power: shares of 1e15-norms were 3% off)
    plain = 0 < g < math.inf and p in (1.0, 2.0)
    shares = (
        {}
        if plain
        else {n: x for names, s in per_tensor.batches for n, x in zip(names, s.shares_of(total), strict=True)}
    )
    rows = []
    for t in selected:
        norm, max_abs, nan, inf = stats[t.name]
        share = (norm / g) ** p if plain else shares[t.name] if t.name in shares else per_tensor[t.name].share_of(total)
        rows.append(TensorRow(t.name, t.dtype, t.shape, t.nbytes, norm, max_abs, nan, inf, share))
    return _Measured(rows, skipped, total, per_tensor)


def _groups(m: _Measured, depth: int, p: float) -> tuple[Group, ...]:
    accs: dict[str, core.NormAccumulator] = {}
    counts: dict[str, int] = {}
    for r in m.rows:
        key = ".".join(r.name.split(".")[:depth])
        accs.setdefault(key, core.NormAccumulator(p)).merge(m.per_tensor[r.name])
        counts[key] = counts.get(key, 0) + 1
    out = []
    for key, acc in accs.items():
        out.append(Group(key, counts[key], acc.result().norm, acc.share_of(m.total)))
    return tuple(out)


def _nan_first(value: float | None) -> tuple[bool, float]:
    """A key that sorts NaN above every number (it matters most), None below."""
    if value is None:
        return (False, -math.inf)
    return (math.isnan(value), 0.0 if math.isnan(value) else value)


_SORT_KEYS = {
    "name": lambda r: (r.name,),
    "norm": lambda r: _nan_first(getattr(r, "norm", getattr(r, "norm_a", None))),
    "size": lambda r: (getattr(r, "nbytes", getattr(r, "tensors", 0)),),
    "diff": lambda r: _nan_first(r.diff_norm),
    "rel": lambda r: _nan_first(r.rel),
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
    progress: Progress = _NO_PROGRESS,
    jobs: int = 1,
) -> CheckpointReport:
    """Per-tensor norms and the global norm of the selected floating tensors.

    The rows shown follow `sort` and `top`; the global norm, the shares and the summary cover them all.
    """
    selected, skipped = _select(ckpt, selection)
    m = _measure(ckpt, selected, skipped, p, progress, jobs)
    g = m.total.result().norm
    every = _groups(m, depth, p) if depth else ()
    groups = order(every, sort, top) if depth else None
    shared = shared_storages(selected)
    return CheckpointReport(
        str(ckpt.path),
        summarize(m.rows),
        g,
        order(m.rows, sort, top),
        tuple(m.skipped),
        groups,
        len(every),
        shared=shared,
    )


def check_nonfinite(path: str, rows: Iterable[TensorRow]) -> None:
    """Refuses data holding NaN or Inf, naming the tensors.

    Raises:
        CheckFailedError: when a tensor holds NaN or Inf.
    """
    bad = [r for r in rows if r.nan or r.inf]
    if bad:
        first = bad[0]
        others = (
            f"; also {plural(len(bad) - 1, 'other tensor')}: "
            + ", ".join(printable(r.name) for r in bad[1:6])
            + (", ..." if len(bad) > 6 else "")
            if len(bad) > 1
            else ""
        )
        raise CheckFailedError(f"holds {nonfinite_counts(first.nan, first.inf)}{others}", path, first.name)


def nonfinite_counts(nan: int, inf: int) -> str:
    """'2 NaN values and 1 Inf value', without the parts that are zero."""
    parts = [
        f"{nan:,} NaN value{'s' * (nan != 1)}" if nan else "",
        f"{inf:,} Inf value{'s' * (inf != 1)}" if inf else "",
    ]
    return " and ".join(p for p in parts if p) or "no NaN or Inf value"


# --- Clipping ---------------------------------------------------------------------------------------


class ClipJob(NamedTuple):
    """Where a clip command writes (`output`, None with `dry_run`), how, and which rows its report shows."""

    output: Path | None
    in_place: bool = False
    allow_nonfinite: bool = False
    jobs: int = 1
    sort: str | None = None
    top: int | None = None


ChunkOp = Callable[[np.ndarray], np.ndarray]
_ROW_GROUP = 1 << 18  # values clipped per step along rows


class _Op(NamedTuple):
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


class _Clips:
    """A worker's kernel for the clip commands: each chunk through its tensor's op, measured after (and
    before, with `measure_first`), and written where it goes (`places`; None on a dry run)."""

    worker_bytes = 6 << 20

    def __init__(self, ops: dict[str, _Op], places: dict[str, Place] | None, measure_first: bool):
        self.ops, self.places = ops, places
        self.before = _Norms(2.0) if measure_first else None
        self.after = _Norms(2.0)

    def chunk(self, t: TensorInfo, offset: int, values: np.ndarray) -> None:
        op = self.ops.get(t.name)
        if op is not None:
            if self.before is not None:
                self.before.chunk(t, offset, values)
            values = op.apply(values)
            self.after.chunk(t, offset, values)
        if self.places is not None:
            self.places[t.name].write(offset, values)

    def result(self) -> tuple[dict[str, core.NormAccumulator], dict[str, core.NormAccumulator]]:
        return ({} if self.before is None else self.before.accs), self.after.accs


def _write(
    ckpt: Checkpoint, job: ClipJob, ops: dict[str, _Op], progress: Progress, measure_first: bool = False
) -> tuple[_PerTensor, _PerTensor]:
    """Streams every tensor into the output (or, on a dry run, those with an op nowhere), through its op.

    Returns the norms of what was read (only with `measure_first`: one pass instead of two) and of what
    was written, for the tensors that have an op. Workers write their chunks in place into the output's
    files; an output that must be written in order (an .npz) is written by `_write_in_order`.
    """
    align = {n: op.align for n, op in ops.items()}
    opped = [t for t in ckpt.tensors if t.name in ops]
    with contextlib.ExitStack() as stack:
        places = None if job.output is None else stack.enter_context(placed(ckpt, job.output, job.in_place))
        if job.output is not None and places is None:
            return _write_in_order(ckpt, job, ops, progress, measure_first)
        tensors = opped if places is None else ckpt.tensors
        progress.phase("clipping" if job.output is None else "writing", sum(t.nbytes for t in tensors))
        results = run(
            ckpt,
            tensors,
            lambda: _Clips(ops, places, measure_first),
            job.jobs,
            align,
            progress.advance,
            unit=core.BLOCK,
        )
    before = _combined(2.0, opped, (r[0] for r in results)) if measure_first else _PerTensor()
    return before, _combined(2.0, opped, (r[1] for r in results))


def _write_in_order(
    ckpt: Checkpoint, job: ClipJob, ops: dict[str, _Op], progress: Progress, measure_first: bool
) -> tuple[_PerTensor, _PerTensor]:
    """`_write` for outputs whose bytes must come in order: chunks computed by threads, written in turn."""

    def work(t: TensorInfo, offset: int, chunk: np.ndarray) -> tuple[np.ndarray, tuple[core.NormAccumulator, ...]]:
        op = ops.get(t.name)
        if op is None:
            return chunk, ()
        read, written = core.NormAccumulator(2), core.NormAccumulator(2)
        if measure_first:
            read.add(chunk, offset // chunk.itemsize)
        out = op.apply(chunk)
        written.add(out, offset // out.itemsize)
        return out, (read, written)

    before, after = _PerTensor(), _PerTensor()
    for name in ops:
        before[name], after[name] = core.NormAccumulator(2), core.NormAccumulator(2)
    progress.phase("writing", sum(t.nbytes for t in ckpt.tensors))
    results = ckpt.map_chunks(
        ckpt.tensors, work, job.jobs, align={n: op.align for n, op in ops.items()}, unit=core.BLOCK
    )
    stream = _InOrder(results)

    def chunks(t: TensorInfo) -> Iterator[np.ndarray]:
        for out, norms in stream.take(t):
            if norms:
                before[t.name].combine(norms[0])
                after[t.name].combine(norms[1])
            progress.advance(out.nbytes)
            yield out

    try:
        save(ckpt, job.output, chunks, in_place=job.in_place)
    finally:
        results.close()  # type: ignore[attr-defined]
    return (before if measure_first else _PerTensor()), after


def _finish(
    ckpt: Checkpoint, job: ClipJob, m: _Measured, after: dict[str, core.NormAccumulator], **fields: object
) -> CheckpointReport:
    total_after = core.NormAccumulator(2)
    rows = []
    for r in m.rows:
        acc = after.get(r.name, m.per_tensor[r.name])
        total_after.merge(acc)
        stats = acc.result()
        rows.append(replace(r, norm_after=stats.norm, max_abs_after=stats.max_abs))
    summary = summarize(rows, max_abs_after=max((r.max_abs_after or 0.0 for r in rows), default=0.0))
    return CheckpointReport(
        str(ckpt.path),
        summary,
        m.total.result().norm,
        order(rows, job.sort, job.top),
        tuple(m.skipped),
        global_norm_after=total_after.result().norm,
        output=None if job.output is None else str(job.output),
        shared=shared_storages(ckpt.tensors),  # every tensor is written, the unselected as they were
        **fields,  # type: ignore[arg-type]
    )


def _refuse_nan_scale(path: str, scale: float, job: ClipJob) -> None:
    """Nothing is written with a NaN scale unless --allow-nonfinite asked for TensorFlow's NaN outputs."""
    if math.isnan(scale) and not job.allow_nonfinite:
        raise CheckFailedError("the clip scale is not a number; refusing to write NaN values", path)


def clip_global_norm(
    ckpt: Checkpoint,
    selection: Selection,
    job: ClipJob,
    clip_norm: float,
    use_norm: float | None = None,
    progress: Progress = _NO_PROGRESS,
) -> CheckpointReport:
    """`tf.clip_by_global_norm` over all selected floating and complex tensors: one common scale.

    The scale comes from the exact global norm: finite and right also when the norm is too large for
    float64 (the report then says the norm is inf).
    """
    selected, skipped = _select_to_clip(ckpt, selection)
    m = _measure(ckpt, selected, skipped, 2.0, progress, job.jobs)
    if not job.allow_nonfinite:
        check_nonfinite(str(ckpt.path), m.rows)
    if use_norm is None:
        scale = core.stats_clip_scale(m.total.result(), clip_norm)
    else:
        # as the library's clip_by_global_norm takes it: a tiny scale keeps its bits
        scale = core.stats_clip_scale(core.given_norm_stats(use_norm), clip_norm)
    _refuse_nan_scale(str(ckpt.path), scale, job)
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
    progress: Progress = _NO_PROGRESS,
) -> CheckpointReport:
    """`tf.clip_by_norm` on each selected tensor separately, over all axes or the given ones."""
    selected, skipped = _select_to_clip(ckpt, selection)
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
    m = _measure(ckpt, selected, skipped, 2.0, progress, job.jobs)
    if not job.allow_nonfinite:
        check_nonfinite(str(ckpt.path), m.rows)
    streamed = [t for t in selected if _reduces_rows(t, axes)]
    axis_sums = _axis_sums(ckpt, streamed, axes, job.jobs) if streamed else {}
    ops = {}
    for t in selected:
        op = _clip_norm_op(t, m.per_tensor[t.name].result(), clip_norm, axes, axis_sums.get(t.name), job)
        if op is not None:
            ops[t.name] = op
    _, after = _write(ckpt, job, ops, progress)
    return _finish(ckpt, job, m, after, clip={"clip_norm": clip_norm})


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
    ax = None if axes is None else core.normalize_axes(axes, len(t.shape))
    return ax is not None and 0 in ax and len(ax) < len(t.shape) and not t.fortran_order


def _axis_sums(
    ckpt: Checkpoint, tensors: list[TensorInfo], axes: tuple[int, ...] | None, jobs: int
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Sums of squares over axes that include axis 0, streamed: one more read of these tensors, in row groups.

    The groups' float64 sums are added in the order of the rows as they arrive (the threads of
    `map_chunks` keep it), as `core.clip_by_norm` adds them, so a file gives the same bits as the array
    in memory and nothing larger than a group's sums is held.
    """

    def group_sums(t: TensorInfo, offset: int, chunk: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        return core.axis_power_sums(chunk.reshape(-1, *t.shape[1:]), core.normalize_axes(axes, len(t.shape)), 2.0)

    align = {t.name: max(core.row_group(t.shape) * math.prod(t.shape[1:]), 1) for t in tensors}
    totals: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    results = ckpt.map_chunks(tensors, group_sums, jobs, align=align, unit=core.BLOCK)
    try:
        for t, parts in results:
            for part in parts:
                totals[t.name] = core.add_power_sums(totals.get(t.name), part)
    finally:
        results.close()  # type: ignore[attr-defined]
    return totals


def _clip_norm_op(
    t: TensorInfo,
    stats: core.NormStats,
    clip: float,
    axes: tuple[int, ...] | None,
    axis_sums: tuple[np.ndarray, np.ndarray] | None,
    job: ClipJob,
) -> _Op | None:
    """The per-chunk op of `clip-norm` on one tensor; None when it comes back unchanged.

    Over all axes the tensor's norm is known from the first pass: one scale. Slices along axis 0 are
    independent, so with axes that leave axis 0 whole rows are streamed; with axis 0 among the axes,
    `axis_sums` (streamed before) give one scale per slice across the rows. A tensor in Fortran order
    is held in memory.
    """
    ax = None if axes is None else core.normalize_axes(axes, len(t.shape))
    if t.size == 0:  # no values: nothing to clip
        return None
    if ax is None or len(ax) == len(t.shape):
        scale = core.tensor_clip_scale(stats, clip)
        _refuse_nan_scale(t.file, scale, job)
        return None if scale == 1.0 else _Op(lambda c: core.scaled(c, scale, out=c))
    if t.fortran_order:
        return _Op(lambda c: core.clip_by_norm(c.reshape(t.shape, order="F"), clip, ax).ravel(order="F"), t.size)
    rest = t.shape[1:]
    row = math.prod(rest)
    if 0 in ax:
        if axis_sums is None:  # no values
            return None
        scales = core.sums_clip_scale(*axis_sums, clip)
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
    ckpt: Checkpoint, selection: Selection, job: ClipJob, lo: float, hi: float, progress: Progress = _NO_PROGRESS
) -> CheckpointReport:
    """`tf.clip_by_value` on every selected real floating tensor; NaN stays NaN, +-inf is clipped.

    One pass: the norms before clipping are taken from the chunks as they are read.
    """
    selected, skipped = _select_to_clip(ckpt, selection, real_only=True)
    ops = {t.name: _Op(lambda c: core.clip_by_value(c, lo, hi, out=c)) for t in selected}
    before, after = _write(ckpt, job, ops, progress, measure_first=True)
    return _finish(ckpt, job, _measured(selected, skipped, before, 2.0), after, clip={"min": lo, "max": hi})


# --- Converting ------------------------------------------------------------------------------------


class _Copy:
    """A worker's kernel for convert: every chunk written where it goes."""

    worker_bytes = 4 << 20

    def __init__(self, places: dict[str, Place]):
        self.places = places

    def chunk(self, t: TensorInfo, offset: int, values: np.ndarray) -> None:
        self.places[t.name].write(offset, values)

    def result(self) -> None:
        return None


def convert(
    ckpt: Checkpoint,
    selection: Selection,
    target: Path,
    job: ClipJob,
    max_shard: int | None = None,
    progress: Progress = _NO_PROGRESS,
) -> CheckpointReport:
    """The same tensors in another format or layout at `target`, every value, dtype, shape and name kept,
    or a refusal that says what would be lost. Tensors left out by --include/--exclude are not written;
    with `job.output` None (a dry run) nothing is.

    Raises:
        UnsupportedError: for a tensor or the metadata the output cannot hold (before anything is written).
    """
    selection.check(ckpt)
    tensors = [t for t in ckpt.tensors if selection.listed(t)]
    left_out = tuple(
        Skipped(t.name, t.dtype, selection.reason_to_skip(t) or "") for t in ckpt.tensors if not selection.listed(t)
    )
    layout = check_plan(ckpt, target, None, tensors, max_shard)  # also on a dry run: what the write would refuse
    if job.output is not None:
        progress.phase("converting", sum(t.nbytes for t in tensors))
        with placed(ckpt, job.output, None, tensors, max_shard) as places:
            if places is not None:
                run(ckpt, tensors, lambda: _Copy(places), job.jobs, progress=progress.advance, unit=core.BLOCK)
        if places is None:
            save(ckpt, job.output, ckpt.chunks, None, tensors, max_shard)
    where = {t.name: str(file) for file, group in layout.files for t in group}
    rows = [InspectRow(t.name, t.dtype, t.shape, t.nbytes, where[t.name]) for t in tensors]
    summary = Summary(len(rows), elements=sum(r.elements for r in rows), nbytes=sum(r.nbytes for r in rows))
    files = [str(file) for file, _ in layout.files] + ([str(layout.index)] if layout.index else [])
    return CheckpointReport(
        str(ckpt.path),
        summary,
        skipped=left_out,
        format=ckpt.format,
        metadata=ckpt.metadata,
        listing=order(rows, job.sort, job.top),
        output=None if job.output is None else str(job.output),
        files=tuple(files),
        shared=shared_storages(tensors),
    )


def shared_storages(tensors: Iterable[TensorInfo]) -> tuple[tuple[str, ...], ...]:
    """Groups of names on one storage (tied weights in a PyTorch file), as the reports list them."""
    groups: dict[str, list[str]] = {}
    for t in tensors:
        if t.storage is not None:
            groups.setdefault(t.storage, []).append(t.name)
    return tuple(tuple(names) for names in groups.values() if len(names) > 1)


# --- Comparing two checkpoints ----------------------------------------------------------------------


class _Diffs:
    """A worker's kernel for diff: per pair, its differences (blocks merged exactly) and whether all its
    bytes were the same."""

    worker_bytes = 7 << 20

    def __init__(self, p: float, pairs: list[tuple[TensorInfo, TensorInfo]], numeric: list[bool]):
        self.p, self.pairs, self.numeric = p, pairs, numeric
        self.accs: dict[int, core.DiffAccumulator] = {}
        self.small: list[tuple[list[int], core.SmallDiffs]] = []  # runs of small pairs, by pair number
        self.differs: set[int] = set()  # pairs some of whose bytes (or dtypes) differ
        self.values_differ: set[int] = set()  # pairs compared for sameness some of whose values differ

    def batch(
        self, ids: Sequence[int], raw_a: np.ndarray, starts_a: list[int], raw_b: np.ndarray, starts_b: list[int]
    ) -> None:
        """Whole small pairs read together: runs of pairs of one pair of native floating dtypes, fewer than
        BLOCK values each, in a few NumPy passes for the run (`core.small_diffs`, the same bits); the others
        pair by pair."""
        i = 0
        for key, group in itertools.groupby(self._run_key(k) for k in ids):
            j = i + sum(1 for _ in group)
            if key is not None:
                self._run(ids[i:j], raw_a, starts_a[i:j], raw_b, starts_b[i:j])
            for k, sa, sb in zip(ids[i:j] if key is None else (), starts_a[i:j], starts_b[i:j], strict=False):
                ta, tb = self.pairs[k]
                self.pair(k, 0, *pair_values(ta, tb, raw_a[sa : sa + ta.nbytes], raw_b[sb : sb + tb.nbytes]))
            i = j

    def _run_key(self, i: int) -> tuple[np.dtype, np.dtype] | None:
        """The dtypes of pair i where it is measured among other small pairs of them (`core.small_diffs`:
        native floating values, fewer than BLOCK and more than none); None where it is measured alone."""
        a, b = self.pairs[i]
        small = self.numeric[i] and a.stored_dtype is None and b.stored_dtype is None
        return (a.array_dtype, b.array_dtype) if small and 0 < a.size < core.BLOCK else None

    def _run(
        self, ids: Sequence[int], raw_a: np.ndarray, starts_a: list[int], raw_b: np.ndarray, starts_b: list[int]
    ) -> None:
        ta, tb = self.pairs[ids[0]]
        run = [self.pairs[i] for i in ids]
        va = _gathered(raw_a, starts_a, [a for a, _ in run], ta.array_dtype)
        vb = _gathered(raw_b, starts_b, [b for _, b in run], tb.array_dtype)
        sizes = [a.nbytes // ta.array_dtype.itemsize for a, _ in run]
        self.small.append((list(ids), core.small_diffs(va, vb, sizes, self.p)))
        if ta.array_dtype != tb.array_dtype:
            self.differs.update(ids)
            return
        bits = np.dtype(f"u{ta.array_dtype.itemsize}")
        equal = np.logical_and.reduceat(va.view(bits) == vb.view(bits), np.cumsum(sizes) - sizes)
        self.differs.update(i for i, same in zip(ids, equal.tolist(), strict=True) if not same)

    def pair(self, i: int, start: int, a: np.ndarray, b: np.ndarray, same: bool) -> None:
        if not same:
            self.differs.add(i)
        if not self.numeric[i]:
            # by value across dtypes (int32 against int64, a mask as bool or uint8); else the bytes tell
            if not same and (a.dtype == b.dtype or not _same_numbers(a, b)):
                self.values_differ.add(i)
            return
        acc = self.accs.get(i)
        if acc is None:
            acc = self.accs[i] = core.DiffAccumulator(self.p)
        if same:
            acc.add_identical(a)
        else:
            acc.add(a, b)

    def result(
        self,
    ) -> tuple[dict[int, core.DiffAccumulator], list[tuple[list[int], core.SmallDiffs]], set[int], set[int]]:
        return self.accs, self.small, self.differs, self.values_differ


def _gathered(raw: np.ndarray, starts: list[int], tensors: list[TensorInfo], dtype: np.dtype) -> np.ndarray:
    """The values of tensors read together, one after another: a view where they lie without gaps."""
    end = starts[-1] + tensors[-1].nbytes
    if end - starts[0] == sum(map(_NBYTES, tensors)):
        return raw[starts[0] : end].view(dtype)
    return np.concatenate([raw[s : s + t.nbytes] for s, t in zip(starts, tensors, strict=True)]).view(dtype)


def _same_numbers(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether arrays of two dtypes hold the same numbers, exactly: NumPy compares an integer with a float in
    float64, where 2**53 + 1 equals 2**53 (integers with integers it compares exactly)."""
    if (a.dtype.kind in "biu") == (b.dtype.kind in "biu"):
        return bool(np.array_equal(a, b))
    ints, other = (a, b) if a.dtype.kind in "biu" else (b, a)
    if other.dtype.kind == "c":
        if np.any(other.imag):
            return False
        other = other.real
    w = other.astype(np.float64)  # exact: every floating type here fits float64
    unsigned = ints.dtype.kind in "bu"
    lo, hi = (0.0, 2.0**64) if unsigned else (-(2.0**63), 2.0**63)
    if not ((w == np.trunc(w)) & (w >= lo) & (w < hi)).all():  # NaN and inf fail here too
        return False
    target = np.uint64 if unsigned else np.int64
    return bool(np.array_equal(w.astype(target), ints.astype(target)))


def _comparable(t: TensorInfo) -> bool:
    """Whether a tensor's values take part in the norms of a diff (as in global-norm: floating ones)."""
    return t.skip is None and t.array_dtype is not None and _floating(t.array_dtype)


# Metadata that says how a file was written, not what it holds: the `format` of a safetensors `__metadata__`
# (`pt`, `np`, `tf`, ...: the library that saved it), which every Hugging Face save writes and a PyTorch file,
# an .npz or clipcli's own conversion of them does not.
_LAYOUT_KEYS = {"safetensors": frozenset({"format"}), "sharded": frozenset({"format"})}


def metadata_differs(a: Checkpoint, b: Checkpoint, selection: Selection) -> tuple[str, ...]:
    """The metadata keys, sorted, that the selection takes and whose values (strings) differ or that one
    checkpoint alone has, layout keys aside."""
    layout = _LAYOUT_KEYS.get(a.format, frozenset()) | _LAYOUT_KEYS.get(b.format, frozenset())
    keys = a.metadata.keys() | b.metadata.keys()
    return tuple(sorted(k for k in keys - layout if a.metadata.get(k) != b.metadata.get(k) and selection.selects(k)))


def diff(
    a: Checkpoint,
    b: Checkpoint,
    selection: Selection,
    p: float,
    depth: int | None = None,
    sort: str | None = None,
    top: int | None = None,
    progress: Progress = _NO_PROGRESS,
    jobs: int = 1,
) -> DiffReport:
    """How far checkpoint B is from A, tensor by tensor (matched by name) and over all compared tensors.

    Floating tensors of the same shape are compared by value, whatever their dtypes; other tensors
    (integers, types carried as bytes) only for being the same; tensors in one checkpoint only, shapes
    that differ and metadata keys that differ (`metadata_differs`) are listed. Both are read in lockstep,
    in chunks.

    Raises:
        UsageError: when --include/--exclude select nothing in either checkpoint.
    """
    listed_a = {t.name: t for t in a.tensors if selection.selects(t.name)}
    listed_b = {t.name: t for t in b.tensors if selection.selects(t.name)}
    if (selection.include or selection.exclude) and not listed_a and not listed_b:
        selection.check(a)
    names = [n for n in listed_a if n in listed_b]
    mismatched, pairs, numeric = [], [], []
    for name in names:
        ta, tb = listed_a[name], listed_b[name]
        if ta.shape != tb.shape:
            mismatched.append(Mismatch(name, ta.shape, tb.shape, "shapes differ"))
        elif ta.skip is not None or tb.skip is not None or ta.location is None or tb.location is None:
            mismatched.append(Mismatch(name, ta.shape, tb.shape, f"cannot be compared: {ta.skip or tb.skip}"))
        elif (ta.array_dtype is None) != (tb.array_dtype is None) or (ta.array_dtype is None and ta.dtype != tb.dtype):
            what = f"{ta.dtype} with {tb.dtype}" if ta.dtype != tb.dtype else f"{ta.dtype} in another byte order"
            mismatched.append(Mismatch(name, ta.shape, tb.shape, f"cannot compare {what}"))
        elif ta.array_dtype is None and byte_layout(ta) != byte_layout(tb):
            reason = f"cannot compare {ta.dtype} stored as bytes in another type, byte order or element order"
            mismatched.append(Mismatch(name, ta.shape, tb.shape, reason))
        else:
            pairs.append((ta, tb))
            numeric.append(_comparable(ta) and _comparable(tb))
    progress.phase("comparing", sum(x.nbytes + y.nbytes for x, y in pairs))
    results = run_pairs((a, b), pairs, lambda: _Diffs(p, pairs, numeric), jobs, core.BLOCK, progress.advance)
    per_pair = _PerTensor([batch for _, small, _, _ in results for batch in small])
    differs: set[int] = set()
    values_differ: set[int] = set()
    for accs, _, worker_differs, worker_values_differ in results:
        differs |= worker_differs
        values_differ |= worker_values_differ
        for i, acc in accs.items():
            per_pair.setdefault(i, core.DiffAccumulator(p)).merge(acc)
    total = core.DiffAccumulator(p)
    # each numeric pair's figures (an empty tensor's, which has no chunks, those of no values)
    figures: list[core.DiffFigures | None] = [None] * len(pairs)
    for ids, s in per_pair.batches:
        s.merge_into(total)
        for i, f in zip(ids, s.figures(), strict=True):
            figures[i] = f
    for i, acc in per_pair.items():  # the pairs measured alone
        total.merge(acc)
        figures[i] = acc.result().figures()
    whole = total.result()
    g = whole.diff_norm
    # (d / g) ** p for orders 1 and 2 where g is a finite number; else from the exact sums (see `_measured`)
    plain = 0 < g < math.inf and p in (1.0, 2.0)
    shares: dict[int, float | None] = {}
    if not plain:
        for ids, s in per_pair.batches:
            shares.update(zip(ids, s.shares_of(total), strict=True))
        shares.update((i, acc.share_of(total)) for i, acc in per_pair.items())
    rows, others = [], []
    for i, (ta, tb) in enumerate(pairs):
        identical = ta.dtype == tb.dtype and i not in differs
        if not numeric[i]:
            floating = _comparable(ta) or _comparable(tb)
            reason = f"floating in {'A' if _comparable(ta) else 'B'} only" if floating else "not a floating tensor"
            others.append(DiffRow.other(ta, tb, identical, i not in values_differ, reason))
            continue
        f = figures[i] or core.DiffAccumulator(p).result().figures()
        share = (f[2] / g) ** p if plain else shares.get(i, 0.0)
        rows.append(DiffRow(ta.name, ta.shape, ta.dtype, tb.dtype, ta.nbytes, identical, *f, share))
    every = _diff_groups(per_pair, pairs, numeric, depth, p, total) if depth else ()
    groups = order(every, sort, top) if depth else None
    return DiffReport(
        a=str(a.path),
        b=str(b.path),
        stats=whole,
        tensors=tuple(rows),
        # --top K picks among the tensors that differ; the identical ones are counted, not ranked
        shown=order(rows, sort, None) if top is None else order([r for r in rows if not r.identical], sort, top),
        others=tuple(others),
        only_a=tuple(n for n in listed_a if n not in listed_b),
        only_b=tuple(n for n in listed_b if n not in listed_a),
        mismatched=tuple(mismatched),
        metadata_differs=metadata_differs(a, b, selection),
        groups=groups,
        group_count=len(every),
    )


def _diff_groups(
    accs: _PerTensor,
    pairs: list[tuple[TensorInfo, TensorInfo]],
    numeric: list[bool],
    depth: int,
    p: float,
    total: core.DiffAccumulator,
) -> list[DiffGroup]:
    totals: dict[str, core.DiffAccumulator] = {}
    counts: dict[str, int] = {}
    for i, (ta, _) in enumerate(pairs):
        if numeric[i]:
            key = ".".join(ta.name.split(".")[:depth])
            totals.setdefault(key, core.DiffAccumulator(p)).merge(accs[i])
            counts[key] = counts.get(key, 0) + 1
    out = []
    for key, acc in totals.items():
        s = acc.result()
        out.append(DiffGroup(key, counts[key], s.diff_norm, s.norm_a, s.rel, acc.share_of(total)))
    return out


def make_report(command: str, p: float, checkpoints: Sequence[CheckpointReport]) -> Report:
    return Report(command, p, tuple(checkpoints))
