"""`diff`: how far checkpoint B is from A, tensor by tensor (matched by name) and over all, and its gates."""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from clipcli.checkpoint import Checkpoint, TensorInfo, byte_layout, pair_values
from clipcli.commands import passes
from clipcli.commands.audit import pickle_audit
from clipcli.commands.gates import exceeds, limit_text
from clipcli.commands.measure import NormOptions
from clipcli.commands.passes import NO_PROGRESS, PerTensor, Progress, gathered
from clipcli.commands.select import Selection, floating, order
from clipcli.core.blocks import BLOCK, is_floating
from clipcli.core.differences import DiffAccumulator, DiffFigures
from clipcli.core.small import SmallDiffs, small_diffs
from clipcli.errors import CheckFailedError, UsageError
from clipcli.report.diff import DiffGroup, DiffReport, DiffRow, Mismatch


@dataclass(frozen=True)
class DiffOptions(NormOptions):
    """What `diff` compares (`NormOptions`: the order is that of ‖A−B‖; `sort` also takes diff and rel), and
    `maps`: (A prefix, B prefix) pairs, the first whose A prefix starts a name of A renaming it to the name it
    has in B (`--map 'state_dict.='`: A's `state_dict.x` is B's `x`)."""

    maps: tuple[tuple[str, str], ...] = ()


def parse_map(text: str) -> tuple[str, str]:
    """`A_PREFIX=B_PREFIX` (either side may be empty; the first `=` splits them).

    Raises:
        UsageError: without a `=`, or with both prefixes empty.
    """
    a, sep, b = text.partition("=")
    if not sep or not (a or b):
        raise UsageError(f"{text!r} is not A_PREFIX=B_PREFIX (e.g. 'state_dict.=' or 'module.=')", param="--map")
    return a, b


def name_in_b(name: str, maps: tuple[tuple[str, str], ...]) -> str:
    """The name a tensor of A has in B: the first map whose A prefix starts it renames it; else the same name."""
    for prefix_a, prefix_b in maps:
        if name.startswith(prefix_a):
            return prefix_b + name[len(prefix_a) :]
    return name


@dataclass(frozen=True)
class DiffLimits:
    """The gates of `diff`: `fail_above` (the global ‖A−B‖), `fail_rel_above` (‖A−B‖/‖A‖), `fail_different`
    (anything at all differs); the `*_text` fields give the limits as the command line gave them, for the
    message."""

    fail_above: float | None = None
    fail_rel_above: float | None = None
    fail_different: bool = False
    fail_above_text: str | None = None
    fail_rel_above_text: str | None = None


def check_measured(report: DiffReport, limits: DiffLimits) -> None:
    """Refuses a norm gate over checkpoints with no floating tensor in both: a gate never passes because nothing
    was measured.

    Raises:
        UsageError: when a norm gate is given and no floating tensor was compared.
    """
    if (limits.fail_above is not None or limits.fail_rel_above is not None) and not report.tensors:
        gate = "--fail-above" if limits.fail_above is not None else "--fail-rel-above"
        raise UsageError("no floating tensor is in both checkpoints, so the gate has nothing to check", report.a, gate)


def failures(report: DiffReport, limits: DiffLimits) -> list[str]:
    """Why the report fails its gates, in the order --fail-different, --fail-above, --fail-rel-above (the
    command line exits with the first); none where it passes."""
    # named as before the reports kept paths as typed back: `./` before A only (the pair is one "path")
    b = report.b[2:] if report.b.startswith("./-") else report.b
    where = f"{report.a} vs {b}"
    out = []
    if limits.fail_different and report.different:
        out.append(CheckFailedError(f"{'; '.join(report.different)} (--fail-different)", where))
    if limits.fail_above is not None and report.exceeds(limits.fail_above):
        text = limits.fail_above_text or limit_text(limits.fail_above)
        out.append(CheckFailedError(exceeds("‖A−B‖", report.stats.diff_norm, "--fail-above", text), where))
    if limits.fail_rel_above is not None and report.rel_exceeds(limits.fail_rel_above):
        text = limits.fail_rel_above_text or limit_text(limits.fail_rel_above)
        out.append(CheckFailedError(exceeds("‖A−B‖/‖A‖", report.checked_rel, "--fail-rel-above", text), where))
    return [str(e) for e in out]


class DiffKernel:
    """A worker's kernel for diff: per pair, its differences (blocks merged exactly) and whether all its
    bytes were the same."""

    worker_bytes = 7 << 20

    def __init__(self, p: float, pairs: list[tuple[TensorInfo, TensorInfo]], numeric: list[bool]):
        self.p, self.pairs, self.numeric = p, pairs, numeric
        self.accs: dict[int, DiffAccumulator] = {}
        self.small: list[tuple[list[int], SmallDiffs]] = []  # runs of small pairs, by pair number
        self.differs: set[int] = set()  # pairs some of whose bytes (or dtypes) differ
        self.values_differ: set[int] = set()  # pairs compared for sameness some of whose values differ

    def batch(
        self, ids: Sequence[int], raw_a: np.ndarray, starts_a: list[int], raw_b: np.ndarray, starts_b: list[int]
    ) -> None:
        """Whole small pairs read together: runs of pairs of one pair of native floating dtypes, fewer than
        BLOCK values each, in a few NumPy passes for the run (`small_diffs`, the same bits); the others
        pair by pair."""
        if self._one_run(ids):  # the common case, tested at once: every pair of one run
            self._run(ids, raw_a, starts_a, raw_b, starts_b)
            return
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
        """The dtypes of pair i where it is measured among other small pairs of them (`small_diffs`:
        native floating values, fewer than BLOCK and more than none); None where it is measured alone."""
        a, b = self.pairs[i]
        small = self.numeric[i] and a.stored_dtype is None and b.stored_dtype is None
        return (a.array_dtype, b.array_dtype) if small and 0 < a.size < BLOCK else None

    def _one_run(self, ids: Sequence[int]) -> bool:
        """Whether every pair of `ids` has one `_run_key` (not None)."""
        if not all(map(self.numeric.__getitem__, ids)):
            return False
        side_a, side_b = zip(*map(self.pairs.__getitem__, ids), strict=True)
        dtypes = set(zip(map(_ARRAY_DTYPE, side_a), map(_ARRAY_DTYPE, side_b), strict=True))
        if len(dtypes) != 1 or set(map(_STORED_DTYPE, side_a)) | set(map(_STORED_DTYPE, side_b)) != {None}:
            return False
        sizes = list(map(_NBYTES, side_a))
        return min(sizes) > 0 and max(sizes) < BLOCK * side_a[0].array_dtype.itemsize

    def _run(
        self, ids: Sequence[int], raw_a: np.ndarray, starts_a: list[int], raw_b: np.ndarray, starts_b: list[int]
    ) -> None:
        ta, tb = self.pairs[ids[0]]
        side_a, side_b = map(list, zip(*map(self.pairs.__getitem__, ids), strict=True))
        va = gathered(raw_a, starts_a, side_a, ta.array_dtype)
        vb = gathered(raw_b, starts_b, side_b, tb.array_dtype)
        sizes = np.fromiter(map(_NBYTES, side_a), np.int64, len(side_a)) // ta.array_dtype.itemsize
        self.small.append((list(ids), small_diffs(va, vb, sizes, self.p)))
        if ta.array_dtype != tb.array_dtype:
            self.differs.update(ids)
            return
        bits = np.dtype(f"u{ta.array_dtype.itemsize}")
        equal = np.logical_and.reduceat(va.view(bits) == vb.view(bits), np.cumsum(sizes) - sizes)
        self.differs.update(itertools.compress(ids, (~equal).tolist()))

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
            acc = self.accs[i] = DiffAccumulator(self.p)
        if same:
            acc.add_identical(a)
        else:
            acc.add(a, b)
        if a.size % BLOCK:  # a pair's last chunk (the others are whole blocks), maybe taken before the others
            acc.end_block()

    def result(
        self,
    ) -> tuple[dict[int, DiffAccumulator], list[tuple[list[int], SmallDiffs]], set[int], set[int]]:
        return self.accs, self.small, self.differs, self.values_differ


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


# Metadata that says how a file was written, not what it holds: the `format` of a safetensors `__metadata__`
# (`pt`, `np`, `tf`, ...: the library that saved it), which every Hugging Face save writes and a PyTorch file,
# an .npz or clipcli's own conversion of them does not.
def metadata_differs(a: Checkpoint, b: Checkpoint, selection: Selection) -> tuple[str, ...]:
    """The metadata keys, sorted, that the selection takes and whose values (strings) differ or that one
    checkpoint alone has, layout keys aside."""
    layout = a.layout_keys | b.layout_keys
    keys = a.metadata.keys() | b.metadata.keys()
    return tuple(sorted(k for k in keys - layout if a.metadata.get(k) != b.metadata.get(k) and selection.selects(k)))


def diff(
    a: Checkpoint, b: Checkpoint, options: DiffOptions = DiffOptions(), progress: Progress = NO_PROGRESS
) -> DiffReport:
    """How far checkpoint B is from A, tensor by tensor (matched by name) and over all compared tensors.

    Floating tensors of the same shape are compared by value, whatever their dtypes; other tensors
    (integers, types carried as bytes) only for being the same; tensors in one checkpoint only, shapes
    that differ and metadata keys that differ (`metadata_differs`) are listed. Both are read in lockstep,
    in chunks.

    Raises:
        UsageError: when --include/--exclude leave either checkpoint with no tensor.
    """
    selection, p, depth, sort, top = options.selection, options.ord, options.depth, options.sort, options.top
    listed_a, listed_b = _listed(a.tensors, selection), _listed(b.tensors, selection)
    if (selection.include or selection.exclude) and not (listed_a and listed_b):
        selection.check(b if listed_a else a)  # never silently empty: per checkpoint
    in_b = _names_in_b(listed_a, options.maps)
    named_in_b = set(in_b.values())
    in_both = list(map(listed_b.__contains__, map(in_b.__getitem__, listed_a)))  # (by map: 12,000 names)
    names = list(itertools.compress(listed_a, in_both))
    mismatched: list[Mismatch] = []
    pairs, numeric = _comparable(listed_a, listed_b, in_b, names)
    for name in names if not pairs and names else ():
        ta, tb = listed_a[name], listed_b[in_b[name]]
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
            numeric.append(floating(ta) and floating(tb))
    progress.phase("comparing", sum(map(_NBYTES, itertools.chain.from_iterable(pairs))))
    results = passes.run_pass((a, b), pairs, lambda: DiffKernel(p, pairs, numeric), options.jobs, progress=progress)
    per_pair = PerTensor([batch for _, small, _, _ in results for batch in small])
    differs: set[int] = set()
    values_differ: set[int] = set()
    for accs, _, worker_differs, worker_values_differ in results:
        differs |= worker_differs
        values_differ |= worker_values_differ
        for i, acc in accs.items():
            per_pair.setdefault(i, DiffAccumulator(p)).merge(acc)
    total = DiffAccumulator(p)
    # each numeric pair's figures (an empty tensor's, which has no chunks, those of no values)
    figures: list[DiffFigures | None] = [None] * len(pairs)
    for ids, s in per_pair.batches:
        s.merge_into(total)
        if ids[-1] - ids[0] + 1 == len(ids):  # (ids ascending: a range, as a run of pairs lying together is)
            figures[ids[0] : ids[-1] + 1] = s.figures()
            continue
        for i, f in zip(ids, s.figures(), strict=True):
            figures[i] = f
    for i, acc in per_pair.items():  # the pairs measured alone
        total.merge(acc)
        figures[i] = acc.result().figures()
    whole = total.result()
    g = whole.diff_norm
    # (d / g) ** p for orders 1 and 2 where g is a finite number; else from the exact sums (see `measure.measured`)
    plain = 0 < g < math.inf and p in (1.0, 2.0)
    shares: dict[int, float | None] = {}
    if not plain:
        for ids, s in per_pair.batches:
            shares.update(zip(ids, s.shares_of(total), strict=True))
        shares.update((i, acc.share_of(total)) for i, acc in per_pair.items())
    rows = _plain_rows(pairs, numeric, differs, figures, g, p) if plain else []
    others: list[DiffRow] = []
    for i, (ta, tb) in enumerate(pairs if not rows else ()):
        identical = ta.dtype == tb.dtype and i not in differs
        if not numeric[i]:
            either = floating(ta) or floating(tb)
            reason = f"floating in {'A' if floating(ta) else 'B'} only" if either else "not a floating tensor"
            others.append(DiffRow.other(ta, tb, identical, i not in values_differ, reason))
            continue
        f = figures[i] or DiffAccumulator(p).result().figures()
        share = (f[2] / g) ** p if plain else shares.get(i, 0.0)
        rows.append(DiffRow(ta.name, ta.shape, ta.dtype, tb.dtype, ta.nbytes, identical, *f, share))
    every = _diff_groups(per_pair, pairs, numeric, depth, p, total) if depth else ()
    groups = order(every, sort, top) if depth else None
    return DiffReport(
        ord=p,
        a=str(a.path),
        b=str(b.path),
        stats=whole,
        tensors=tuple(rows),
        # --top K picks among the tensors that differ; the identical ones are counted, not ranked
        shown=order(rows, sort, None) if top is None else order([r for r in rows if not r.identical], sort, top),
        others=tuple(others),
        only_a=tuple(itertools.compress(listed_a, map(operator.not_, in_both))),
        only_b=tuple(itertools.filterfalse(named_in_b.__contains__, listed_b)),
        mismatched=tuple(mismatched),
        metadata_differs=metadata_differs(a, b, selection),
        groups=groups,
        group_count=len(every),
        pickle_a=pickle_audit(a),
        pickle_b=pickle_audit(b),
    )


def _listed(tensors: Sequence[TensorInfo], selection: Selection) -> dict[str, TensorInfo]:
    """The tensors the selection takes, by name."""
    if not (selection.include or selection.exclude):
        return dict(zip(map(_NAME, tensors), tensors, strict=True))
    return {t.name: t for t in tensors if selection.selects(t.name)}


def _comparable(
    listed_a: dict[str, TensorInfo], listed_b: dict[str, TensorInfo], in_b: dict[str, str], names: list[str]
) -> tuple[list[tuple[TensorInfo, TensorInfo]], list[bool]]:
    """The pairs of `names` and whether each is numeric (both floating), where every pair can be compared by value
    or bytes (the common case, tested at once: the same shapes, values on both sides); else none (`diff` then
    sorts them one by one)."""
    side_a = list(map(listed_a.__getitem__, names))
    side_b = list(map(listed_b.__getitem__, map(in_b.__getitem__, names)))
    dtypes = set(map(_ARRAY_DTYPE, side_a)) | set(map(_ARRAY_DTYPE, side_b))
    if (
        None in dtypes
        or set(map(_SKIP, side_a)) | set(map(_SKIP, side_b)) != {None}
        or type(None) in set(map(type, map(_LOCATION, side_a))) | set(map(type, map(_LOCATION, side_b)))
        or list(map(_SHAPE, side_a)) != list(map(_SHAPE, side_b))
    ):
        return [], []
    floats = {d: is_floating(d) for d in dtypes}
    numeric = list(
        map(
            operator.and_,
            map(floats.__getitem__, map(_ARRAY_DTYPE, side_a)),
            map(floats.__getitem__, map(_ARRAY_DTYPE, side_b)),
        )
    )
    return list(zip(side_a, side_b, strict=True)), numeric


def _plain_rows(
    pairs: list[tuple[TensorInfo, TensorInfo]],
    numeric: list[bool],
    differs: set[int],
    figures: list[DiffFigures | None],
    g: float,
    p: float,
) -> list[DiffRow]:
    """`diff`'s rows where every pair is numeric and measured, and the shares are `(diff_norm / g) ** p` (the
    common case, tested at once; else none, and `diff` makes them one by one)."""
    if not pairs or not all(numeric) or None in figures:
        return []
    side_a, side_b = zip(*pairs, strict=True)
    dtypes_a = list(map(_DTYPE, side_a))
    same = map(operator.eq, dtypes_a, map(_DTYPE, side_b))
    identical = map(operator.and_, same, map(operator.not_, map(differs.__contains__, range(len(pairs)))))
    fields = map(_NAME, side_a), map(_SHAPE, side_a), dtypes_a, map(_DTYPE, side_b), map(_NBYTES, side_a), identical
    heads = zip(*fields, strict=True)
    shares = map(pow, map(operator.truediv, map(_DIFF_NORM, figures), itertools.repeat(g)), itertools.repeat(p))
    rows = map(operator.add, map(operator.add, heads, figures), zip(shares))  # (head, *figures, share)
    return list(itertools.starmap(DiffRow, rows))


_NAME, _DTYPE, _SHAPE, _NBYTES, _SKIP, _LOCATION, _ARRAY_DTYPE, _STORED_DTYPE = map(
    operator.attrgetter, ("name", "dtype", "shape", "nbytes", "skip", "location", "array_dtype", "stored_dtype")
)
_DIFF_NORM = operator.itemgetter(2)


def _names_in_b(listed_a: dict[str, TensorInfo], maps: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """Each selected name of A and the name it has in B (`name_in_b`).

    Raises:
        UsageError: when the maps give two tensors of A one name in B.
    """
    if not maps:
        return dict(zip(listed_a, listed_a, strict=True))
    in_b: dict[str, str] = {}
    taken: dict[str, str] = {}
    for name in listed_a:
        mapped = in_b[name] = name_in_b(name, maps)
        if mapped in taken:
            raise UsageError(f"--map gives {taken[mapped]!r} and {name!r} of A the same name in B, {mapped!r}")
        taken[mapped] = name
    return in_b


def _diff_groups(
    accs: PerTensor,
    pairs: list[tuple[TensorInfo, TensorInfo]],
    numeric: list[bool],
    depth: int,
    p: float,
    total: DiffAccumulator,
) -> list[DiffGroup]:
    totals: dict[str, DiffAccumulator] = {}
    counts: dict[str, int] = {}
    for i, (ta, _) in enumerate(pairs):
        if numeric[i]:
            key = ".".join(ta.name.split(".")[:depth])
            totals.setdefault(key, DiffAccumulator(p)).merge(accs[i])
            counts[key] = counts.get(key, 0) + 1
    out = []
    for key, acc in totals.items():
        s = acc.result()
        out.append(DiffGroup(key, counts[key], s.diff_norm, s.norm_a, s.rel, acc.share_of(total), s.norm_b, s.cosine))
    return out
