"""Measuring norms: the kernel that accumulates each tensor's chunks, and the report's rows from its sums."""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from clipcli.checkpoint import Checkpoint, TensorInfo, decode
from clipcli.commands import passes
from clipcli.commands.passes import PerTensor, Progress, gathered
from clipcli.commands.select import EVERY, Selection
from clipcli.core.blocks import BLOCK, is_floating
from clipcli.core.norms import NormAccumulator
from clipcli.core.small import SmallNorms, small_norms
from clipcli.errors import CheckFailedError, printable
from clipcli.report.render import plural
from clipcli.report.rows import Group, Skipped, TensorRow


@dataclass(frozen=True)
class NormOptions:
    """What a command that measures norms (`global-norm`, `diff`) measures: the tensors `selection` takes, the
    norms' order `ord` (2, 1, inf or any p > 0), groups of the first `depth` name parts, rows sorted by `sort`
    (name, norm, size; for diff also diff, rel) and cut to `top`, with `jobs` workers."""

    selection: Selection = EVERY
    ord: float = 2.0
    depth: int | None = None
    sort: str | None = None
    top: int | None = None
    jobs: int = 1
    # names on one view of one storage count once in the global norm (`shared_once`); keyword-only, so that the
    # fields of a subclass (`DiffOptions.maps`) keep their places
    count_shared_once: bool = field(default=False, kw_only=True)


class NormKernel:
    """A worker's kernel: the norm of each tensor's chunks it reads, blocks placed by their offsets."""

    worker_bytes = 5 << 20  # what one worker takes (see _engine.WORKERS_BUDGET)

    def __init__(self, p: float):
        self.p = p
        self.accs: dict[str, NormAccumulator] = {}
        self.small: list[tuple[list[str], SmallNorms]] = []  # runs of small tensors, by name

    def chunk(self, t: TensorInfo, offset: int, values: np.ndarray) -> None:
        acc = self.accs.get(t.name)
        if acc is None:
            acc = self.accs[t.name] = NormAccumulator(self.p)
        acc.add(values, offset // values.itemsize)

    def batch(self, ts: list[TensorInfo], raw: np.ndarray, starts: list[int]) -> None:
        """Whole small tensors read together: runs of one native dtype, fewer than BLOCK values each, in a
        few NumPy passes for the run (`small_norms`, the same bits)."""
        dtype = ts[0].array_dtype
        if (  # the common case, tested at once: a run of them all
            len(set(map(_ARRAY_DTYPE, ts))) == 1
            and set(map(_STORED_DTYPE, ts)) == {None}
            and is_floating(dtype)
            and max(map(_NBYTES, ts)) < BLOCK * dtype.itemsize
        ):
            values = gathered(raw, starts, ts, dtype)
            self.small.append((list(map(_NAME, ts)), small_norms(values, _sizes(ts, dtype), self.p)))
            return
        i = 0
        while i < len(ts):
            t = ts[i]
            dtype = t.array_dtype
            if t.stored_dtype is not None or t.size >= BLOCK or not is_floating(dtype):
                self.chunk(t, 0, _values(raw, starts[i], t))
                i += 1
                continue
            small = BLOCK * dtype.itemsize  # fewer bytes than this: fewer values than a block
            j = i + 1
            for u in itertools.islice(ts, j, None):  # the run: those of `dtype`, each fewer than `small` bytes
                if not (
                    (u.array_dtype is dtype or u.array_dtype == dtype) and u.stored_dtype is None and u.nbytes < small
                ):
                    break
                j += 1
            run = ts[i:j]
            values = gathered(raw, starts[i:j], run, dtype)
            self.small.append(([u.name for u in run], small_norms(values, _sizes(run, dtype), self.p)))
            i = j

    def result(self) -> tuple[dict[str, NormAccumulator], list[tuple[list[str], SmallNorms]]]:
        return self.accs, self.small


def _sizes(run: list[TensorInfo], dtype: np.dtype) -> np.ndarray:
    """The element counts of a run of tensors of `dtype`."""
    return np.fromiter(map(_NBYTES, run), np.int64, len(run)) // dtype.itemsize


_NBYTES, _ARRAY_DTYPE, _STORED_DTYPE, _NAME = map(
    operator.attrgetter, ("nbytes", "array_dtype", "stored_dtype", "name")
)
_HEAD = operator.attrgetter("name", "dtype", "shape", "nbytes")
_FIRST = operator.itemgetter(0)


def _values(raw: np.ndarray, start: int, t: TensorInfo) -> np.ndarray:
    return decode(raw[start : start + t.nbytes], t)


def combined(
    p: float,
    tensors: list[TensorInfo],
    parts: Iterable[dict[str, NormAccumulator]],
    batches: Sequence[tuple[list[str], SmallNorms]] = (),
) -> PerTensor:
    """Each tensor's norm from the workers' parts (exactly: the same bits however the chunks were shared)."""
    per_tensor = PerTensor(batches)
    for accs in parts:
        for name, acc in accs.items():
            if name in per_tensor:
                per_tensor[name].combine(acc)
            else:
                per_tensor[name] = acc
    if len(per_tensor) + per_tensor.batched_count < len(tensors):  # (every tensor is one or the other)
        for t in tensors:
            if t.name not in per_tensor and not per_tensor.batched(t.name):
                per_tensor[t.name] = NormAccumulator(p)  # no chunks: empty
    return per_tensor


class Measured(NamedTuple):
    """The rows of the measured tensors, the skipped ones, the total over all and each tensor's accumulator;
    `repeats` are the names left out of the total as repeats of another (`shared_once`), each to its first."""

    rows: list[TensorRow]
    skipped: list[Skipped]
    total: NormAccumulator
    per_tensor: PerTensor
    repeats: dict[str, str]


def shared_once(tensors: Sequence[TensorInfo]) -> dict[str, str]:
    """The names that --count-shared-once leaves out of a global norm, each to the first name before it that is
    the same tensor: the same view (dtype, shape and place) of the same storage, as tied weights are. This is
    how `torch.nn.utils.clip_grad_norm_(model.parameters())` counts them: `parameters()` gives a tied parameter
    once. Other views of a storage (a slice, a transpose) are tensors of their own and count."""
    first: dict[object, str] = {}
    out = {}
    for t in tensors:
        if t.storage is None:
            continue
        key = (t.storage, t.dtype, t.shape, t.stored_dtype, t.location)
        try:
            out[t.name] = first[key]
        except KeyError:
            first[key] = t.name
        except TypeError:  # a location that cannot be compared as a key: a tensor of its own
            continue
    return out


def measure(
    ckpt: Checkpoint,
    selected: list[TensorInfo],
    skipped: list[Skipped],
    p: float,
    progress: Progress,
    jobs: int,
    repeats: dict[str, str] | None = None,
) -> Measured:
    """One pass over the selected tensors: each one's norm, max |x|, NaN and Inf counts, and share; `repeats`
    (`shared_once`) are measured and listed but left out of the total."""
    progress.phase("measuring", sum(map(_NBYTES, selected)))
    results = passes.run_pass(ckpt, selected, lambda: NormKernel(p), jobs, progress=progress)
    batches = [batch for _, small in results for batch in small]
    return measured(selected, skipped, combined(p, selected, (accs for accs, _ in results), batches), p, repeats)


def measured(
    selected: list[TensorInfo],
    skipped: list[Skipped],
    per_tensor: PerTensor,
    p: float,
    repeats: dict[str, str] | None = None,
) -> Measured:
    """The report's rows from each selected tensor's accumulated norm (small tensors' in a few NumPy passes); the
    total leaves out `repeats`, each a repeat of a name that counts (`shared_once`)."""
    total = NormAccumulator(p)
    stats: dict[str, tuple[float, float, int, int]] = {}
    batched = list(itertools.chain.from_iterable(names for names, _ in per_tensor.batches))
    # every tensor batched, in order, none a repeat (the common case): their figures in a list, not a dict by name
    in_order: list[tuple[float, float, int, int]] | None = (
        [] if not repeats and batched == list(map(_NAME, selected)) else None
    )
    for names, s in per_tensor.batches:
        if not repeats:
            s.merge_into(total)
        figures = zip(s.norms().tolist(), s.max_abs.tolist(), s.nan.tolist(), s.inf.tolist(), strict=True)
        if in_order is not None:
            in_order += figures
        else:
            stats.update(zip(names, figures, strict=True))
    if in_order is None and len(stats) < len(selected):  # (names are distinct: every one batched or not)
        for t in selected:
            if t.name not in stats:
                acc = per_tensor[t.name]
                r = acc.result()
                stats[t.name] = (r.norm, r.max_abs, r.nan, r.inf)
                if not repeats:
                    total.merge(acc)
    if repeats:  # each tensor's exact sums, the repeats left out (the same bits as merging whole batches)
        for t in selected:
            if t.name not in repeats:
                total.merge(per_tensor[t.name])
    g = total.result().norm
    # (norm / g) ** p for orders 1 and 2 where both are finite numbers (within an ulp or two); else from the
    # exact sums, which are right also where the norms overflow float64, and for any order (the ratio's
    # rounding grows p times in its power: shares of 1e15-norms were 3% off)
    plain = 0 < g < math.inf and p in (1.0, 2.0)
    if in_order is not None and not plain:  # (those rows take the figures by name)
        stats = dict(zip(batched, in_order, strict=True))
    shares = (
        {}
        if plain
        else {n: x for names, s in per_tensor.batches for n, x in zip(names, s.shares_of(total), strict=True)}
    )
    if plain:  # (by maps, in C but for each row's __init__: a checkpoint may hold 10,000 tiny tensors)
        figures = in_order if in_order is not None else list(map(stats.__getitem__, map(_NAME, selected)))
        # (norm, max_abs, nan, inf)
        heads = map(_HEAD, selected)  # (name, dtype, shape, nbytes)
        shares = map(pow, map(operator.truediv, map(_FIRST, figures), itertools.repeat(g)), itertools.repeat(p))
        rows = list(itertools.starmap(TensorRow, map(operator.add, map(operator.add, heads, figures), zip(shares))))
    else:
        rows = [
            TensorRow(
                t.name,
                t.dtype,
                t.shape,
                t.nbytes,
                *stats[t.name],
                shares[t.name] if t.name in shares else per_tensor[t.name].share_of(total),
            )
            for t in selected
        ]
    return Measured(rows, skipped, total, per_tensor, dict(repeats or {}))


def groups(m: Measured, depth: int, p: float) -> tuple[Group, ...]:
    """The norms of the tensors grouped by the first `depth` dot-separated parts of their names (a repeat counted
    only in a group its first name is not in: each tensor once per group)."""
    accs: dict[str, NormAccumulator] = {}
    counts: dict[str, int] = {}
    merged: set[tuple[str, str]] = set()  # (group, name counted), with repeats
    for r in m.rows:
        key = ".".join(r.name.split(".")[:depth])
        acc = accs.setdefault(key, NormAccumulator(p))
        counted = m.repeats.get(r.name, r.name)
        if (key, counted) not in merged:
            merged.add((key, counted))
            acc.merge(m.per_tensor[r.name])
        counts[key] = counts.get(key, 0) + 1
    out = []
    for key, acc in accs.items():
        out.append(Group(key, counts[key], acc.result().norm, acc.share_of(m.total)))
    return tuple(out)


def nonfinite(path: str, rows: Iterable[TensorRow]) -> CheckFailedError | None:
    """The error that names the tensors holding NaN or Inf, or None where none does."""
    bad = [r for r in rows if r.nan or r.inf]
    if not bad:
        return None
    first = bad[0]
    others = (
        f"; also {plural(len(bad) - 1, 'other tensor')}: "
        + ", ".join(printable(r.name) for r in bad[1:6])
        + (", ..." if len(bad) > 6 else "")
        if len(bad) > 1
        else ""
    )
    return CheckFailedError(f"holds {nonfinite_counts(first.nan, first.inf)}{others}", path, first.name)


def check_nonfinite(path: str, rows: Iterable[TensorRow]) -> None:
    """Refuses data holding NaN or Inf, naming the tensors.

    Raises:
        CheckFailedError: when a tensor holds NaN or Inf.
    """
    error = nonfinite(path, rows)
    if error is not None:
        raise error


def nonfinite_counts(nan: int, inf: int) -> str:
    """'2 NaN values and 1 Inf value', without the parts that are zero."""
    parts = [
        f"{nan:,} NaN value{'s' * (nan != 1)}" if nan else "",
        f"{inf:,} Inf value{'s' * (inf != 1)}" if inf else "",
    ]
    return " and ".join(p for p in parts if p) or "no NaN or Inf value"
