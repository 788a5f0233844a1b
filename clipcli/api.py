"""The library over files: open a checkpoint, and one function per command that returns the command's report.

Each function takes the command's options as keyword arguments (as the command line spells them, with
underscores) and returns the frozen report the command renders: `report.to_dict()` is the content of
`--format json`, `report.to_text()` the table, `report.to_csv()` the CSV. `failures(report, ...)` applies
the command line's gates (`--fail-above`, ...) to a report, so a script decides as the command line does.
"""

from __future__ import annotations

import functools
import math
import os
import types
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from clipcli.errors import UnsupportedError, UsageError

if TYPE_CHECKING:
    import numpy as np

    from clipcli.checkpoint import Checkpoint, TensorInfo
    from clipcli.report.clip import ClipGlobalNormReport, ClipNormReport, ClipValueReport
    from clipcli.report.diff import DiffReport
    from clipcli.report.hash import HashReport
    from clipcli.report.listing import ConvertReport, InspectReport
    from clipcli.report.norms import NormReport
    from clipcli.report.stats import StatsReport
    from clipcli.report.trajectory import TrajectoryReport
    from clipcli.report.verify import VerifyReport

PathLike = str | os.PathLike[str]


class CheckpointFile:
    """An open checkpoint (from `open`): its tensors' names, dtypes and shapes, its metadata, and their values.

    Reading it reads the headers only; `read` and `chunks` read a tensor's bytes. Use it in a `with` block, or
    `close` it.
    """

    def __init__(self, ckpt: Checkpoint):
        self._ckpt = ckpt
        self._tensors = {t.name: t for t in ckpt.tensors}

    @property
    def path(self) -> str:
        return str(self._ckpt.path)

    @property
    def format(self) -> str:
        """The format: safetensors, sharded, npz, npy, torch, distcp, ..."""
        return self._ckpt.format

    @property
    def metadata(self) -> dict[str, str]:
        return dict(self._ckpt.metadata)

    @property
    def pickle(self) -> dict[str, Any] | None:
        """The pickle audit of a pickle-based checkpoint, as `inspect`'s JSON gives it; None for other formats."""
        from clipcli.commands.audit import pickle_audit

        audit = pickle_audit(self._ckpt)
        return None if audit is None else audit.fields

    @property
    def names(self) -> list[str]:
        """The tensors' names, in the file's order."""
        return list(self._tensors)

    @functools.cached_property
    def dtypes(self) -> Mapping[str, str]:
        """Each tensor's dtype, as NumPy / ml_dtypes name it (`float32`, `bfloat16`): a read-only mapping, made
        once (`f.dtypes[name]` in a loop over 50,000 names rebuilt it at each look-up)."""
        return types.MappingProxyType({n: t.dtype for n, t in self._tensors.items()})

    @functools.cached_property
    def shapes(self) -> Mapping[str, tuple[int, ...]]:
        """Each tensor's shape: a read-only mapping, made once."""
        return types.MappingProxyType({n: t.shape for n, t in self._tensors.items()})

    def info(self, name: str) -> TensorInfo:
        """What the headers say of one tensor (dtype, shape, size, file, location).

        Raises:
            KeyError: for a name the checkpoint does not hold.
        """
        return self._tensors[name]

    def read(self, name: str) -> np.ndarray:
        """The whole tensor as an array of its shape (for tensors that fit in memory); a type carried as bytes
        (strings, records of an .npz) as an array of its own NumPy type.

        Raises:
            UnsupportedError: for a tensor listed but not read (sparse, quantized, meta: the reason says).
        """
        info = self._readable(name)
        if info.array_dtype is not None:
            return self._ckpt.read(info)
        from clipcli.checkpoint import carried_dtype

        raw = self._ckpt.read_flat(info)
        dtype = carried_dtype(info)
        if dtype is None:
            return raw
        import numpy as np

        return np.frombuffer(raw.tobytes(), dtype).reshape(info.shape, order="F" if info.fortran_order else "C")

    def chunks(self, name: str) -> Iterator[np.ndarray]:
        """The tensor's values as flat arrays in storage order, a few MiB each (a type carried as bytes: its
        bytes). Each is a view of one reused buffer, valid until the next is produced: copy what you keep.

        Raises:
            UnsupportedError: for a tensor listed but not read (sparse, quantized, meta: the reason says).
        """
        return self._ckpt.chunks(self._readable(name))

    def _readable(self, name: str) -> TensorInfo:
        info = self.info(name)
        if info.skip is not None:
            raise UnsupportedError(f"clipcli does not read this tensor's values: {info.skip}", info.file, name)
        return info

    def close(self) -> None:
        self._ckpt.close()

    def __enter__(self) -> CheckpointFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<clipcli checkpoint {self.path!r}: {self.format}, {len(self._tensors):,} tensors>"


def open(path: PathLike) -> CheckpointFile:
    """Opens a checkpoint (a file, a sharded index or a directory), reading its headers only.

    Raises:
        clipcli.errors.InputError: for a file that cannot be read as a checkpoint (missing, malformed, ...).
    """
    from clipcli.checkpoint import open_checkpoint

    return CheckpointFile(open_checkpoint(path))


def _selection(include: str | Iterable[str], exclude: str | Iterable[str]) -> Any:
    from clipcli.commands.select import Selection

    def patterns(p: str | Iterable[str]) -> tuple[str, ...]:
        return (p,) if isinstance(p, str) else tuple(p)

    return Selection(patterns(include), patterns(exclude))


def _order(ord: float | str) -> float:
    """An order as `--ord` takes it: 2, 1, inf (or 'inf') or any p in (0, 1e15]."""
    from clipcli.core.norms import MAX_ORDER

    p = float(ord)
    if not (0 < p <= MAX_ORDER or p == math.inf):
        raise UsageError(f"ord must be 1, 2, inf or any p in (0, {MAX_ORDER:g}], got {ord}", None, "--ord")
    return p


def _workers(jobs: int | None, top: int | None = None, depth: int | None = None) -> int:
    """The workers `jobs` asks for (the cores where None), with `jobs`, `top` and `depth` checked as the command
    line checks --jobs, --top and --depth.

    Raises:
        UsageError: for a value that is not an integer >= 1.
    """
    from clipcli.commands.passes import workers

    for value, param in ((jobs, "--jobs"), (top, "--top"), (depth, "--depth")):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UsageError(f"must be an integer >= 1, got {value!r}", None, param)
    return workers(jobs)


def _sort(sort: str | None, keys: tuple[str, ...]) -> str | None:
    """`sort` where the command's --sort takes it.

    Raises:
        UsageError: for another key.
    """
    if sort is not None and sort not in keys:
        raise UsageError(f"sort must be one of {', '.join(keys)}, got {sort!r}", None, "--sort")
    return sort


def inspect_of(
    *paths: PathLike,
    include: str | Iterable[str] = (),
    exclude: str | Iterable[str] = (),
    sort: str | None = None,
    top: int | None = None,
) -> InspectReport:
    """`clipcli inspect PATHS...`: names, dtypes, shapes, sizes and metadata, from the headers alone."""
    from clipcli.checkpoint import open_checkpoint
    from clipcli.commands.inspect import InspectOptions, inspect
    from clipcli.report.listing import InspectReport

    _workers(None, top)
    options = InspectOptions(_selection(include, exclude), _sort(sort, ("name", "size")), top)
    listings = []
    for path in paths:
        with open_checkpoint(path) as ckpt:
            listings.append(inspect(ckpt, options))
    return InspectReport(tuple(listings))


def global_norm_of(
    *paths: PathLike,
    ord: float | str = 2,
    depth: int | None = None,
    include: str | Iterable[str] = (),
    exclude: str | Iterable[str] = (),
    sort: str | None = None,
    top: int | None = None,
    jobs: int | None = None,
    combined: bool = False,
    prefix_with_file: bool = False,
    count_shared_once: bool = False,
) -> NormReport:
    """`clipcli global-norm PATHS...`: per-tensor norms and each checkpoint's global norm, and with `combined`
    the one over all of them (`report.combined`) (`report.exceeds(x)`: what `--fail-above x` checks)."""
    from clipcli.checkpoint import open_checkpoint
    from clipcli.commands.global_norm import NormOptions, norm_report

    if prefix_with_file and not combined:
        raise UsageError("only with combined=True", param="prefix_with_file")
    options = NormOptions(
        _selection(include, exclude),
        _order(ord),
        depth,
        _sort(sort, ("name", "norm", "size")),
        top,
        _workers(jobs, top, depth),
        count_shared_once=count_shared_once,
    )
    opened = []
    try:
        for path in paths:
            opened.append(open_checkpoint(path))
        return norm_report(opened, options, combined=combined, prefix_with_file=prefix_with_file)
    finally:
        for ckpt in opened:
            ckpt.close()


def diff_of(
    a: PathLike,
    b: PathLike,
    *,
    ord: float | str = 2,
    depth: int | None = None,
    include: str | Iterable[str] = (),
    exclude: str | Iterable[str] = (),
    sort: str | None = None,
    top: int | None = None,
    jobs: int | None = None,
    maps: Iterable[str] = (),
) -> DiffReport:
    """`clipcli diff A B`: how far B is from A, tensor by tensor and over all (`report.different`: what differs,
    in words; `report.exceeds(x)`, `report.rel_exceeds(r)`: what `--fail-above`, `--fail-rel-above` check);
    `maps`: the --map texts ('state_dict.=')."""
    from clipcli.checkpoint import open_checkpoint
    from clipcli.commands.diff import DiffOptions, diff, parse_map

    pairs = tuple(parse_map(m) for m in ([maps] if isinstance(maps, str) else maps))
    sort = _sort(sort, ("name", "norm", "size", "diff", "rel"))
    options = DiffOptions(
        _selection(include, exclude), _order(ord), depth, sort, top, _workers(jobs, top, depth), pairs
    )
    with open_checkpoint(a) as ca, open_checkpoint(b) as cb:
        return diff(ca, cb, options)


def _clip(
    path: PathLike, run: Any, kind: Any, output: PathLike | None, in_place: bool, drop_metadata: bool, **options: Any
) -> Any:
    """Opens the checkpoint, checks where it goes (None and not `in_place`: a dry run), and clips it with `run`,
    given its options (of type `kind`); `drop_metadata` writes none of the checkpoint's metadata."""
    from clipcli.checkpoint import open_checkpoint
    from clipcli.commands.write import output_target

    if in_place and output is not None:
        raise UsageError("give either output or in_place, not both", None, "--in-place")
    options["selection"] = _selection(options.pop("include"), options.pop("exclude"))
    options["jobs"] = _workers(options["jobs"], options.get("top"))
    with open_checkpoint(path) as ckpt:
        if drop_metadata:
            ckpt.metadata = {}
        out = None if output is None else os.fspath(output)
        target = output_target(ckpt, out, in_place, dry_run=output is None and not in_place)
        return run(ckpt, kind(output=target, in_place=in_place, **options))


def clip_value_of(
    path: PathLike,
    *,
    min: float,
    max: float,
    output: PathLike | None = None,
    in_place: bool = False,
    drop_metadata: bool = False,
    include: str | Iterable[str] = (),
    exclude: str | Iterable[str] = (),
    sort: str | None = None,
    top: int | None = None,
    jobs: int | None = None,
) -> ClipValueReport:
    """`clipcli clip-value PATH -o OUTPUT --min A --max B` (no output and not `in_place`: a dry run)."""
    if not min <= max:
        raise UsageError(f"min {min} exceeds max {max}", None, "--min")
    from clipcli.commands import clip

    return _clip(
        path, clip.clip_value, clip.ClipValueOptions, output, in_place, drop_metadata, min=float(min), max=float(max),
        include=include, exclude=exclude, sort=sort, top=top, jobs=jobs,
    )  # fmt: skip


def clip_norm_of(
    path: PathLike,
    *,
    clip_norm: float,
    axes: Sequence[int] | None = None,
    output: PathLike | None = None,
    in_place: bool = False,
    drop_metadata: bool = False,
    allow_nonfinite: bool = False,
    include: str | Iterable[str] = (),
    exclude: str | Iterable[str] = (),
    sort: str | None = None,
    top: int | None = None,
    jobs: int | None = None,
) -> ClipNormReport:
    """`clipcli clip-norm PATH -o OUTPUT --clip-norm N [--axes ...]` (no output and not `in_place`: a dry run)."""
    _positive_finite(clip_norm, "--clip-norm")
    from clipcli.commands import clip

    return _clip(
        path, clip.clip_norm, clip.ClipNormOptions, output, in_place, drop_metadata, clip_norm=float(clip_norm),
        axes=None if axes is None else tuple(axes), allow_nonfinite=allow_nonfinite, include=include,
        exclude=exclude, sort=sort, top=top, jobs=jobs,
    )  # fmt: skip


def clip_global_norm_of(
    path: PathLike,
    *,
    clip_norm: float,
    use_norm: float | None = None,
    output: PathLike | None = None,
    in_place: bool = False,
    drop_metadata: bool = False,
    allow_nonfinite: bool = False,
    include: str | Iterable[str] = (),
    exclude: str | Iterable[str] = (),
    sort: str | None = None,
    top: int | None = None,
    jobs: int | None = None,
    count_shared_once: bool = False,
) -> ClipGlobalNormReport:
    """`clipcli clip-global-norm PATH -o OUTPUT --clip-norm N [--use-norm G]` (no output and not `in_place`:
    a dry run)."""
    _positive_finite(clip_norm, "--clip-norm")
    if use_norm is not None and not (math.isfinite(use_norm) and use_norm >= 0):
        raise UsageError(f"use_norm must be a finite number >= 0, got {use_norm}", None, "--use-norm")
    from clipcli.commands import clip

    return _clip(
        path, clip.clip_global_norm, clip.ClipGlobalNormOptions, output, in_place, drop_metadata,
        clip_norm=float(clip_norm),
        use_norm=None if use_norm is None else float(use_norm), allow_nonfinite=allow_nonfinite, include=include,
        exclude=exclude, sort=sort, top=top, jobs=jobs, count_shared_once=count_shared_once,
    )  # fmt: skip


def _positive_finite(value: float, param: str) -> None:
    if not (math.isfinite(value) and value > 0):
        raise UsageError(f"{param[2:].replace('-', '_')} must be a finite number > 0, got {value}", None, param)


def convert_of(
    path: PathLike,
    output: PathLike,
    *,
    max_shard_size: int | None = None,
    dry_run: bool = False,
    drop_metadata: bool = False,
    include: str | Iterable[str] = (),
    exclude: str | Iterable[str] = (),
    sort: str | None = None,
    top: int | None = None,
    jobs: int | None = None,
) -> ConvertReport:
    """`clipcli convert PATH -o OUTPUT [--max-shard-size BYTES]`: the same tensors in another format or layout."""
    from clipcli.checkpoint import check_output, open_checkpoint
    from clipcli.commands.convert import ConvertOptions, convert

    with open_checkpoint(path) as ckpt:
        if drop_metadata:
            ckpt.metadata = {}
        target = check_output(output, ckpt, resharding=max_shard_size is not None, command="convert")
        options = ConvertOptions(
            target=target, dry_run=dry_run, max_shard=max_shard_size, selection=_selection(include, exclude),
            sort=_sort(sort, ("name", "size")), top=top, jobs=_workers(jobs, top),
        )  # fmt: skip
        return convert(ckpt, options)


def trajectory_of(
    *paths: PathLike,
    depth: int | None = None,
    include: str | Iterable[str] = (),
    exclude: str | Iterable[str] = (),
    jobs: int | None = None,
    keep_order: bool = False,
) -> TrajectoryReport:
    """`clipcli trajectory PATHS...`: each checkpoint's global norm and hash and how far it moved from the previous
    (`report.identical`: the checkpoints identical to the one before them)."""
    from clipcli.commands.trajectory import TrajectoryOptions, trajectory

    if not paths:
        raise UsageError("give at least one checkpoint", None, "CKPT")
    options = TrajectoryOptions(_selection(include, exclude), depth, _workers(jobs, None, depth), keep_order)
    return trajectory(paths, options)


def hash_of(
    *paths: PathLike,
    include: str | Iterable[str] = (),
    exclude: str | Iterable[str] = (),
    sort: str | None = None,
    top: int | None = None,
    jobs: int | None = None,
) -> HashReport:
    """`clipcli hash PATHS...`: each tensor's content hash over its canonical form, and each checkpoint's hash
    (equal in every format and layout; see `clipcli.core.hashing`)."""
    from clipcli.checkpoint import open_checkpoint
    from clipcli.commands.hash import HashOptions, hash_checkpoint
    from clipcli.report.hash import HashReport

    options = HashOptions(_selection(include, exclude), _sort(sort, ("name", "size")), top, _workers(jobs, top))
    hashed = []
    for path in paths:
        with open_checkpoint(path) as ckpt:
            hashed.append(hash_checkpoint(ckpt, options))
    return HashReport(tuple(hashed))


def verify_of(
    path: PathLike,
    *,
    manifest: PathLike | None = None,
    values: bool = False,
    include: str | Iterable[str] = (),
    exclude: str | Iterable[str] = (),
    jobs: int | None = None,
) -> VerifyReport:
    """`clipcli verify PATH`: every defect of the checkpoint's structure, and with `manifest` (a file of
    `clipcli hash --format json`) its differences from it, with `values` its NaN, Inf and all-zero floating
    tensors. `report.ok` is True where nothing was found (where the command line exits 0; 1 otherwise), and
    `report.problems` lists what was."""
    from clipcli.commands.verify import VerifyOptions, read_manifest, verify

    options = VerifyOptions(
        None if manifest is None else read_manifest(manifest), values, _selection(include, exclude), _workers(jobs)
    )
    return verify(path, options)


def stats_of(
    *paths: PathLike,
    cast: str | Iterable[str] | None = None,
    depth: int | None = None,
    include: str | Iterable[str] = (),
    exclude: str | Iterable[str] = (),
    sort: str | None = None,
    top: int | None = None,
    jobs: int | None = None,
) -> StatsReport:
    """`clipcli stats PATHS...`: each tensor's exact statistics and cast readiness (`clipcli.core.stats`); `cast`
    names the targets (None: per tensor the standard floats narrower than its dtype)."""
    from clipcli.checkpoint import open_checkpoint
    from clipcli.commands.stats import SORT_KEYS, StatsOptions, check_casts, stats
    from clipcli.report.stats import StatsReport

    if sort is not None and sort not in SORT_KEYS:
        raise UsageError(f"sort must be one of {', '.join(SORT_KEYS)}, got {sort!r}", None, "--sort")
    casts = None if cast is None else check_casts([cast] if isinstance(cast, str) else list(cast), "--cast")
    options = StatsOptions(_selection(include, exclude), casts, (), depth, sort, top, _workers(jobs, top, depth))
    measured = []
    for path in paths:
        with open_checkpoint(path) as ckpt:
            measured.append(stats(ckpt, options))
    return StatsReport(tuple(measured))


def failures(
    report: Any,
    *,
    fail_above: float | None = None,
    fail_nonfinite: bool = False,
    fail_rel_above: float | None = None,
    fail_different: bool = False,
    fail_max_abs: float | None = None,
    fail_cast_overflow: str | None = None,
    fail_all_zero: bool = False,
) -> list[str]:
    """The command line's gates on a report of `global_norm_of` (`fail_above`, `fail_nonfinite`), `diff_of`
    (`fail_above`, `fail_rel_above`, `fail_different`) or `stats_of` (`fail_max_abs`, `fail_cast_overflow`,
    `fail_all_zero`, `fail_nonfinite`), and of `verify_of` (no gate: what it found): why it fails them, one line
    each, or [] where it passes (where the command line exits 0; it exits 1 with the first line otherwise).

    Raises:
        UsageError: for a threshold below 0 or NaN, or a gate over a report where nothing was measured (no
            floating tensor selected): a gate never passes because nothing was measured, as on the command line.
        TypeError: for a gate the report's command does not have.
    """
    from clipcli.report.diff import DiffReport
    from clipcli.report.norms import NormReport
    from clipcli.report.stats import StatsReport
    from clipcli.report.verify import VerifyReport

    if isinstance(report, VerifyReport):  # verify's check is the command itself: what it found fails
        from clipcli.commands.verify import failure

        line = failure(report)
        return [] if line is None else [line]
    if isinstance(report, StatsReport) and fail_above is None and fail_rel_above is None and not fail_different:
        return _stats_failures(report, fail_max_abs, fail_cast_overflow, fail_all_zero, fail_nonfinite)
    if fail_max_abs is not None or fail_cast_overflow is not None or fail_all_zero:
        raise TypeError(f"a {type(report).__name__} has no gates fail_max_abs, fail_cast_overflow or fail_all_zero")
    for value, param in ((fail_above, "--fail-above"), (fail_rel_above, "--fail-rel-above")):
        if value is not None and not value >= 0:
            raise UsageError(f"must be a number >= 0 (a norm is never negative), got {value}", None, param)
    if fail_above is None and fail_rel_above is None and not (fail_nonfinite or fail_different):
        return []  # no gate: the command line exits 0
    if isinstance(report, NormReport) and fail_rel_above is None and not fail_different:
        from clipcli.commands import global_norm

        limits = global_norm.NormLimits(fail_above, fail_nonfinite)
        for c in report.checkpoints:
            global_norm.check_measured(c, limits)
        return global_norm.failures(report, limits)
    if isinstance(report, DiffReport) and not fail_nonfinite:
        from clipcli.commands import diff

        limits = diff.DiffLimits(fail_above, fail_rel_above, fail_different)
        diff.check_measured(report, limits)
        return diff.failures(report, limits)
    gates = {
        NormReport: "fail_above and fail_nonfinite",
        DiffReport: "fail_above, fail_rel_above and fail_different",
        StatsReport: "fail_max_abs, fail_cast_overflow, fail_all_zero and fail_nonfinite",
    }
    have = next((f"has the gates {g}" for kind, g in gates.items() if isinstance(report, kind)), "has no gates")
    raise TypeError(f"a {type(report).__name__} {have}")


def _stats_failures(
    report: StatsReport, max_abs: float | None, cast_overflow: str | None, all_zero: bool, nonfinite: bool
) -> list[str]:
    """`failures` of a `stats_of` report."""
    from clipcli.commands import stats

    if max_abs is not None and not max_abs >= 0:
        raise UsageError(
            f"must be a number >= 0 (a magnitude is never negative), got {max_abs}", None, "--fail-max-abs"
        )
    if cast_overflow is not None:
        stats.check_casts([cast_overflow], "--fail-cast-overflow")
    limits = stats.StatsLimits(max_abs, cast_overflow, all_zero, nonfinite)
    if not limits.gates:
        return []
    for c in report.checkpoints:
        stats.check_measured(c, limits)
    return stats.failures(report, limits)
