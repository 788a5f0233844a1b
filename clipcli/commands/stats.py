"""`stats`: each selected tensor's exact value statistics and cast readiness, and the gates over them."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from clipcli.checkpoint import Checkpoint, TensorInfo, c_order_blocks, transposed
from clipcli.commands import passes
from clipcli.commands.audit import pickle_audit
from clipcli.commands.gates import limit_text
from clipcli.commands.passes import NO_PROGRESS, Progress
from clipcli.commands.select import EVERY, Selection, partition, without_values
from clipcli.core.blocks import is_floating
from clipcli.core.stats import CAST_NAMES, StatsAccumulator, TensorStats, default_casts
from clipcli.errors import CheckFailedError, UsageError, printable
from clipcli.report.render import plural
from clipcli.report.stats import CheckpointStats, StatsReport, StatsRow, group, summarize

SORT_KEYS = ("name", "size", "max_abs", "std", "zeros", "nonfinite", "overflow")


@dataclass(frozen=True)
class StatsOptions:
    """What `stats` measures: the tensors `selection` takes, cast to `casts` (target names; None: per tensor the
    standard floats narrower than its dtype) and to `also_cast` besides (a gate's target), groups of the first
    `depth` name parts, rows sorted by `sort` (`SORT_KEYS`; all but name largest first) and cut to `top`, with
    `jobs` workers."""

    selection: Selection = EVERY
    casts: tuple[str, ...] | None = None
    also_cast: tuple[str, ...] = ()
    depth: int | None = None
    sort: str | None = None
    top: int | None = None
    jobs: int = 1


@dataclass(frozen=True)
class StatsLimits:
    """The gates of `stats`, over the selected floating tensors: `fail_max_abs` (a value of larger magnitude, or a
    NaN, fails), `fail_cast_overflow` (a value that would overflow this target fails), `fail_all_zero` (a tensor
    all zeros fails), `fail_nonfinite` (a NaN or Inf fails). `fail_max_abs_text`: the limit as given."""

    fail_max_abs: float | None = None
    fail_cast_overflow: str | None = None
    fail_all_zero: bool = False
    fail_nonfinite: bool = False
    fail_max_abs_text: str | None = None

    @property
    def gates(self) -> list[str]:
        """The gates given, as the command line names them."""
        named = [("--fail-max-abs", self.fail_max_abs is not None), ("--fail-cast-overflow", self.fail_cast_overflow)]
        named += [("--fail-all-zero", self.fail_all_zero), ("--fail-nonfinite", self.fail_nonfinite)]
        return [name for name, given in named if given]


def check_casts(names: Sequence[str], param: str) -> tuple[str, ...]:
    """Cast target names, checked: among `CAST_NAMES`, each once.

    Raises:
        UsageError: for another name.
    """
    for name in names:
        if name not in CAST_NAMES:
            raise UsageError(
                f"{printable(name)!r} is not a cast target; choose among {', '.join(CAST_NAMES)}", None, param
            )
    return tuple(dict.fromkeys(names))


@functools.lru_cache(maxsize=256)  # asked per tensor: few dtypes
def cast_targets(dtype: np.dtype, casts: tuple[str, ...] | None, also: tuple[str, ...]) -> tuple[str, ...]:
    """The targets a tensor of `dtype` is cast to, in `CAST_NAMES` order (none for integer and bool tensors)."""
    if not (is_floating(dtype) or dtype.kind == "c"):
        return ()
    chosen = set(default_casts(dtype) if casts is None else casts)
    return tuple(t for t in CAST_NAMES if t in chosen or t in also)


class StatsKernel:
    """A worker's kernel: each tensor's chunks into its accumulator, placed by their offsets; a tensor whose
    chunks all came to this worker (most of them: `workers.Deal`) is kept as its `TensorStats` only, finished
    here, in parallel (an accumulator takes ~20 KiB, and merging and finishing them is the parent's alone)."""

    # What one worker takes (see _engine.WORKERS_BUDGET): its chunk buffer and the core's scratch, up to 8 MiB
    # for a 4 MiB chunk of float64 (tracemalloc); 16 workers asked for stay under 128 MiB with the parent's.
    worker_bytes = 12 << 20

    def __init__(self, casts: tuple[str, ...] | None, also: tuple[str, ...]):
        self.casts, self.also = casts, also
        self.accs: dict[str, StatsAccumulator] = {}
        self.done: dict[str, TensorStats] = {}
        self.seen: dict[str, int] = {}  # each open accumulator's values so far

    def chunk(self, t: TensorInfo, offset: int, values: np.ndarray) -> None:
        acc = self.accs.get(t.name)
        if acc is None:
            acc = StatsAccumulator(values.dtype, cast_targets(values.dtype, self.casts, self.also))
            if offset == 0 and values.size == t.size:  # (most small tensors: whole in one chunk)
                acc.add(values, 0)
                self.done[t.name] = acc.result()
                return
            self.accs[t.name] = acc
        acc.add(values, offset // values.itemsize)
        seen = self.seen[t.name] = self.seen.get(t.name, 0) + values.size
        if seen == t.size:  # every chunk of it came here
            self.done[t.name] = self.accs.pop(t.name).result()

    def result(self) -> tuple[dict[str, StatsAccumulator], dict[str, TensorStats]]:
        return self.accs, self.done


class GatherKernel(StatsKernel):
    """For tensors stored in another order than C order (Fortran): each gathered whole in one worker, then fed in
    C order, so that `argmax_abs` and the cast errors' blocks are those of the C-order tensor."""

    whole = True

    def __init__(self, casts: tuple[str, ...] | None, also: tuple[str, ...]):
        super().__init__(casts, also)
        self._open: dict[str, tuple[np.ndarray, int]] = {}

    def chunk(self, t: TensorInfo, offset: int, values: np.ndarray) -> None:
        whole, at = self._open.pop(t.name, None) or (np.empty(t.size, values.dtype), 0)
        whole[at : at + values.size] = values
        at += values.size
        if at < t.size:
            self._open[t.name] = (whole, at)
            return
        acc = StatsAccumulator(whole.dtype, cast_targets(whole.dtype, self.casts, self.also))
        start = 0
        for block in c_order_blocks(whole, t.shape):
            acc.add(block, start)
            start += block.size
        self.done[t.name] = acc.result()


def reason_to_skip(t: TensorInfo, selection: Selection) -> str | None:
    """Why `stats` leaves a tensor out: not selected, no values (sparse, quantized, meta) or a type carried as
    bytes (strings, records); None to measure it (floating, complex, integer and bool tensors)."""
    return without_values(t, selection, "statistics")


def stats(
    ckpt: Checkpoint, options: StatsOptions = StatsOptions(), progress: Progress = NO_PROGRESS
) -> CheckpointStats:
    """Each selected tensor's exact statistics (`clipcli.core.stats`); the summary covers all of them.

    `jobs` workers share the chunks; each tensor's parts are merged exactly, so `jobs` changes no bit. A tensor
    stored in Fortran order is gathered whole and measured in C order (held once, as `hash` holds it).

    Raises:
        UsageError: when --include/--exclude select no tensor.
    """
    selection = options.selection
    selected, skipped = partition(ckpt, selection, lambda t: reason_to_skip(t, selection))
    progress.phase("measuring", sum(t.nbytes for t in selected))
    casts, also = options.casts, options.also_cast
    plain = [t for t in selected if not transposed(t)]
    parts = list(passes.run_pass(ckpt, plain, lambda: StatsKernel(casts, also), options.jobs, progress=progress))
    if len(plain) < len(selected):
        gathered = [t for t in selected if transposed(t)]
        parts += passes.run_pass(ckpt, gathered, lambda: GatherKernel(casts, also), options.jobs, progress=progress)
    results = _merged(parts)
    rows = []
    for t in selected:
        s = results.get(t.name)
        if s is None:  # no chunks: an empty tensor
            s = StatsAccumulator(t.array_dtype, cast_targets(t.array_dtype, casts, also)).result()
        rows.append(StatsRow(t.name, t.dtype, t.shape, t.nbytes, _floating(t.array_dtype), s))
    groups = _groups(rows, options.depth) if options.depth else None
    return CheckpointStats(
        path=str(ckpt.path),
        format=ckpt.format,
        summary=summarize(rows),
        tensors=ordered(rows, options.sort, options.top),
        every=tuple(rows),
        skipped=tuple(skipped),
        groups=None if groups is None else ordered(groups, options.sort, options.top),
        group_count=len(groups or ()),
        pickle=pickle_audit(ckpt),
    )


def _merged(parts: Sequence[tuple[dict[str, StatsAccumulator], dict[str, TensorStats]]]) -> dict[str, TensorStats]:
    """Each tensor's statistics from the workers' parts (exactly: the same bits however the chunks were shared)."""
    results: dict[str, TensorStats] = {}
    accs: dict[str, StatsAccumulator] = {}
    for open_accs, done in parts:
        results.update(done)
        for name, acc in open_accs.items():
            if name in accs:
                accs[name].merge(acc)
            else:
                accs[name] = acc
    results.update((name, acc.result()) for name, acc in accs.items())
    return results


@functools.lru_cache(maxsize=256)
def _floating(dtype: np.dtype) -> bool:
    return is_floating(dtype) or dtype.kind == "c"


def _groups(rows: list[StatsRow], depth: int) -> list:
    by_name: dict[str, list[StatsRow]] = {}
    for r in rows:
        by_name.setdefault(".".join(r.name.split(".")[:depth]), []).append(r)
    return [group(name, members) for name, members in by_name.items()]


def _largest(value: float | int | None) -> tuple[bool, float]:
    """A key that sorts NaN above every number, None below."""
    if value is None:
        return (False, -math.inf)
    return (value != value, 0.0 if value != value else float(value))


_SORT = {
    "name": lambda r: (r.name,),
    "size": lambda r: (r.nbytes,),
    "max_abs": lambda r: _largest(_figure(r, "max_abs")),
    "std": lambda r: _largest(_figure(r, "std")),
    "zeros": lambda r: (_figure(r, "zeros"),),
    "nonfinite": lambda r: (r.nonfinite,),
    "overflow": lambda r: (_overflow(r),),
}


def _figure(r: object, name: str) -> object:
    stats = getattr(r, "stats", r)  # a tensor's row, or a group
    return getattr(stats, name, None)


def _overflow(r: object) -> int:
    if isinstance(r, StatsRow):
        return sum(c.overflow for c in r.stats.casts)
    return sum(n for _, n in r.overflow)  # type: ignore[attr-defined]


def ordered(rows: Sequence, sort: str | None, top: int | None) -> tuple:
    """Rows (or groups) sorted by `sort` (name ascending, the others largest first, stable) and cut to `top`."""
    out = list(rows)
    if sort:
        out.sort(key=_SORT[sort], reverse=sort != "name")
    return tuple(out[:top] if top else out)


# --- Gates ------------------------------------------------------------------------------------------


def check_measured(c: CheckpointStats, limits: StatsLimits) -> None:
    """Refuses a gate over a checkpoint with no floating tensor selected: a gate never passes because nothing
    was measured.

    Raises:
        UsageError: when a gate is given and no floating tensor is selected.
    """
    gates = limits.gates
    if gates and not any(r.floating for r in c.every):
        raise UsageError("no floating tensor is selected, so the gate has nothing to check", c.path, gates[0])


def failures(report: StatsReport, limits: StatsLimits) -> list[str]:
    """Why the report fails its gates: one line for each checkpoint that fails one (NaN or Inf first, then max
    |x|, cast overflow, all-zero tensors), none where it passes."""
    out = []
    for c in report.checkpoints:
        error = _failure(c, limits)
        if error is not None:
            out.append(str(error))
    return out


def _failure(c: CheckpointStats, limits: StatsLimits) -> CheckFailedError | None:
    rows = [r for r in c.every if r.floating]
    if limits.fail_nonfinite:
        bad = [r for r in rows if r.nonfinite]
        if bad:
            s = bad[0].stats
            what = f"holds {s.nan:,} NaN, {s.posinf:,} +Inf and {s.neginf:,} -Inf values (--fail-nonfinite)"
            return CheckFailedError(what + _others(bad), c.path, bad[0].name)
    if limits.fail_max_abs is not None:
        limit = limits.fail_max_abs
        bad = [r for r in rows if r.stats.nan or (r.stats.max_abs is not None and r.stats.max_abs > limit)]
        if bad:
            text = limits.fail_max_abs_text or limit_text(limit)
            s = bad[0].stats
            if s.nan and not (s.max_abs is not None and s.max_abs > limit):
                what = f"holds {plural(s.nan, 'NaN value')}, no magnitude (--fail-max-abs {text})"
            else:
                what = f"max |x| {s.max_abs!r} at flat index {s.argmax_abs} exceeds --fail-max-abs {text}"
            return CheckFailedError(what + _others(bad), c.path, bad[0].name)
    target = limits.fail_cast_overflow
    if target is not None:
        missing = [r for r in rows if r.overflow(target) is None]
        if missing:
            message = f"the cast to {target} was not measured for every floating tensor: include it in cast= (--cast)"
            raise UsageError(message, c.path, "--fail-cast-overflow")
        bad = [r for r in rows if r.overflow(target)]
        if bad:
            n = bad[0].overflow(target)
            what = f"{plural(n, 'value')} would overflow {target} (--fail-cast-overflow {target})"
            return CheckFailedError(what + _others(bad), c.path, bad[0].name)
    if limits.fail_all_zero:
        bad = [r for r in rows if r.stats.all_zero]
        if bad:
            return CheckFailedError("is all zeros (--fail-all-zero)" + _others(bad), c.path, bad[0].name)
    return None


def _others(bad: list[StatsRow]) -> str:
    if len(bad) < 2:
        return ""
    names = ", ".join(printable(r.name) for r in bad[1:6]) + (", ..." if len(bad) > 6 else "")
    return f"; also {plural(len(bad) - 1, 'other tensor')}: {names}"
