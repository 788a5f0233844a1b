"""The commands that measure, clip and convert: inspect, global-norm, the clips, diff and convert."""

# No `from __future__ import annotations` here: Typer reads the commands' annotations at every run, and
# as strings it would evaluate each of them (450 evals, a tenth of the 10,000-tiny-tensor run's start-up).

import math
import operator
import os
from pathlib import Path
from typing import Any

from clipcli import cli_options as opts
from clipcli.cli_app import app, exit_on_gate, handled_errors, opening_several, selection_of, worker_count
from clipcli.cli_output import emit
from clipcli.cli_output import progress as progress_bar

# --- Commands ---------------------------------------------------------------------------------------


@app.command(
    cls=opts.Command,
    epilog=opts.examples(
        "clipcli inspect model.safetensors",
        "clipcli inspect shards/ --sort size --top 10",
        "clipcli inspect optimizer.npz --include 'state.*' --format json",
    ),
)
def inspect(
    checkpoints: opts.Checkpoints,
    sort: opts.InspectSort = None,
    top: opts.Top = None,
    include: opts.Include = None,
    exclude: opts.Exclude = None,
    fmt: opts.FormatOpt = opts.Format.table,
    quiet: opts.Quiet = False,
    fail_unsafe_pickle: opts.FailUnsafePickle = False,
    debug: opts.Debug = False,
) -> None:
    """List tensor names, dtypes, shapes, element counts, sizes and the file's metadata, from the headers."""
    with handled_errors(debug, "inspect"):
        from clipcli.checkpoint import open_checkpoint
        from clipcli.commands import inspect as command
        from clipcli.report.listing import InspectReport

        opened = [open_checkpoint(path) for path in checkpoints]
        options = command.InspectOptions(selection_of(include, exclude, *opened), sort and sort.value, top)
        listings = []
        for ckpt in opened:
            with ckpt:
                listings.append(command.inspect(ckpt, options))
        emit(InspectReport(tuple(listings)), fmt, quiet)


@app.command(
    "global-norm",
    cls=opts.Command,
    epilog=opts.examples(
        "clipcli global-norm grads.safetensors --sort norm --top 10",
        "clipcli global-norm grads.safetensors --depth 3 --format csv > layers.csv",
        "clipcli global-norm grads.safetensors --fail-above 100 --fail-nonfinite --quiet",
    ),
)
def global_norm(
    checkpoints: opts.Checkpoints,
    ord: opts.Ord = "2",
    depth: opts.Depth = None,
    sort: opts.Sort = None,
    top: opts.Top = None,
    fail_above: opts.FailAbove = None,
    fail_nonfinite: opts.FailNonfinite = False,
    combined: opts.CombinedOpt = False,
    prefix_with_file: opts.PrefixWithFile = False,
    count_shared_once: opts.CountSharedOnce = False,
    jobs: opts.Jobs = None,
    include: opts.Include = None,
    exclude: opts.Exclude = None,
    fmt: opts.FormatOpt = opts.Format.table,
    quiet: opts.Quiet = False,
    fail_unsafe_pickle: opts.FailUnsafePickle = False,
    debug: opts.Debug = False,
) -> None:
    """Per-tensor norms, max |x|, NaN/Inf counts and shares, and the global norm (tf.linalg.global_norm).

    A gate (--fail-above, --fail-nonfinite) never passes because nothing was measured: a checkpoint with no
    floating tensor selected is a usage error (exit 2) when a gate is given. --combined adds one global norm
    over the tensors of all the checkpoints (per-rank gradient files: the norm clip_grad_norm_ sees across
    ranks), which --fail-above then checks.
    """
    with handled_errors(debug, "global_norm"):  # --ord: its limit is the core's (NumPy)
        p = opts.parse_ord(ord)
        limit = None if fail_above is None else opts.parse_limit(fail_above, "--fail-above")
        from clipcli.checkpoint import open_checkpoint
        from clipcli.commands import gates
        from clipcli.commands import global_norm as command

        limits = command.NormLimits(limit, fail_nonfinite, fail_above)
        if prefix_with_file and not combined:
            opts.usage("only with --combined", "--prefix-with-file")
        opened = [open_checkpoint(path) for path in checkpoints]
        selection = selection_of(include, exclude, *opened)
        options = command.NormOptions(
            selection, p, depth, sort and sort.value, top, worker_count(jobs), count_shared_once=count_shared_once
        )
        with progress_bar(_bytes_of(*opened), quiet) as progress:
            report = command.norm_report(opened, options, progress, combined, prefix_with_file, limits)
        emit(report, fmt, quiet)
        exit_on_gate(gates.failure(command.failures(report, limits), len(report.checkpoints)))


def _clip(
    run: Any,
    kind: Any,
    checkpoint: Path,
    output: str | None,
    in_place: bool,
    dry_run: bool,
    drop_metadata: bool,
    report_file: Path | None,
    quiet: bool,
    fmt: opts.Format,
    include: list[str] | None,
    exclude: list[str] | None,
    passes: int = 2,
    **options: Any,
) -> None:
    """The part the clip commands share: the output checked, the options made, the command run, the report out.

    `run`: the function of `clipcli.commands.clip` to run; `kind`: its options' type; `options`: their fields but
    those of the output and the selection; `passes`: how many times the command reads the checkpoint, for the
    progress bar.
    """
    from clipcli.checkpoint import check_report, open_checkpoint
    from clipcli.commands.write import output_target

    if in_place and output is not None:
        opts.usage("give either -o/--output or --in-place, not both", "--in-place")
    if in_place and opts.is_url(checkpoint):
        opts.usage("a URL cannot be replaced in place: give -o OUT (a local path)", "--in-place")
    if output is None and not (in_place or dry_run):
        opts.usage("missing; give -o OUT, --in-place or --dry-run", "-o/--output")
    with open_checkpoint(checkpoint) as ckpt:
        if drop_metadata:
            ckpt.metadata = {}
        target = output_target(ckpt, output, in_place, dry_run)
        if report_file is not None:
            check_report(report_file, ckpt, target)
        selection = selection_of(include, exclude, ckpt)
        settings = kind(output=target, in_place=in_place, selection=selection, **options)
        with progress_bar(passes * sum(t.nbytes for t in ckpt.tensors), quiet) as progress:
            result = run(ckpt, settings, progress)
    emit(result, fmt, quiet, report_file)


@app.command(
    "clip-value",
    cls=opts.Command,
    epilog=opts.examples(
        "clipcli clip-value grads.safetensors -o clipped.safetensors --min -1 --max 1",
        "clipcli clip-value grads.npz -o clipped.npz --min -0.01 --max 0.01 --include 'model.norm.*'",
        "clipcli clip-value grads.safetensors --in-place --min -5 --max 5 --quiet",
    ),
)
def clip_value(
    checkpoint: opts.OneCheckpoint,
    min_: opts.Min,
    max_: opts.Max,
    output: opts.Output = None,
    in_place: opts.InPlace = False,
    dry_run: opts.DryRun = False,
    drop_metadata: opts.DropMetadata = False,
    report_file: opts.ReportFile = None,
    sort: opts.Sort = None,
    top: opts.Top = None,
    jobs: opts.Jobs = None,
    include: opts.Include = None,
    exclude: opts.Exclude = None,
    fmt: opts.FormatOpt = opts.Format.table,
    quiet: opts.Quiet = False,
    fail_unsafe_pickle: opts.FailUnsafePickle = False,
    debug: opts.Debug = False,
) -> None:
    """tf.clip_by_value on every selected real floating tensor: NaN stays NaN, +-inf is clipped to the bounds.

    --min and --max are rounded to each tensor's dtype first, as TensorFlow does: a bfloat16 tensor
    clipped at 0.1 is clipped at 0.10009765625.
    """
    lo, hi = opts.parse_float(min_, "--min"), opts.parse_float(max_, "--max")
    if lo > hi:
        opts.usage(f"--min {min_} exceeds --max {max_}", "--min")
    with handled_errors(debug, "clip", writes=True):
        from clipcli.commands import clip

        _clip(
            clip.clip_value, clip.ClipValueOptions, checkpoint, output, in_place, dry_run, drop_metadata, report_file,
            quiet, fmt, include, exclude, passes=1, min=lo, max=hi, sort=sort and sort.value, top=top,
            jobs=worker_count(jobs),
        )  # fmt: skip


@app.command(
    "clip-norm",
    cls=opts.Command,
    epilog=opts.examples(
        "clipcli clip-norm grads.safetensors -o clipped.safetensors --clip-norm 1",
        "clipcli clip-norm grads.safetensors -o rows.safetensors --clip-norm 1 --axes -1",
        "clipcli clip-norm grads.safetensors --dry-run --clip-norm 1 --sort norm --top 5",
    ),
)
def clip_norm(
    checkpoint: opts.OneCheckpoint,
    clip_norm: opts.ClipNorm,
    axes: opts.Axes = None,
    output: opts.Output = None,
    in_place: opts.InPlace = False,
    dry_run: opts.DryRun = False,
    drop_metadata: opts.DropMetadata = False,
    report_file: opts.ReportFile = None,
    allow_nonfinite: opts.AllowNonfinite = False,
    sort: opts.Sort = None,
    top: opts.Top = None,
    jobs: opts.Jobs = None,
    include: opts.Include = None,
    exclude: opts.Exclude = None,
    fmt: opts.FormatOpt = opts.Format.table,
    quiet: opts.Quiet = False,
    fail_unsafe_pickle: opts.FailUnsafePickle = False,
    debug: opts.Debug = False,
) -> None:
    """tf.clip_by_norm on each selected floating or complex tensor separately, optionally along axes.

    A tensor whose rank is too small for --axes is passed through and listed as skipped.
    """
    c = opts.parse_float(clip_norm, "--clip-norm")
    opts.positive_finite(c, clip_norm, "--clip-norm")
    ax = opts.parse_axes(axes)
    with handled_errors(debug, "clip", writes=True):
        from clipcli.commands import clip

        _clip(
            clip.clip_norm, clip.ClipNormOptions, checkpoint, output, in_place, dry_run, drop_metadata, report_file,
            quiet, fmt, include, exclude, clip_norm=c, axes=ax, allow_nonfinite=allow_nonfinite,
            sort=sort and sort.value, top=top, jobs=worker_count(jobs),
        )  # fmt: skip


@app.command(
    "clip-global-norm",
    cls=opts.Command,
    epilog=opts.examples(
        "clipcli clip-global-norm grads.safetensors -o clipped.safetensors --clip-norm 5",
        "clipcli clip-global-norm shards/ -o clipped/ --clip-norm 5 --report report.json",
        "clipcli clip-global-norm grads.safetensors --dry-run --clip-norm 5 --format json",
    ),
)
def clip_global_norm(
    checkpoints: opts.ClipCheckpoints,
    clip_norm: opts.GlobalClipNorm,
    use_norm: opts.UseNorm = None,
    output: opts.Output = None,
    in_place: opts.InPlace = False,
    dry_run: opts.DryRun = False,
    drop_metadata: opts.DropMetadata = False,
    report_file: opts.ReportFile = None,
    allow_nonfinite: opts.AllowNonfinite = False,
    prefix_with_file: opts.ClipPrefixWithFile = False,
    count_shared_once: opts.CountSharedOnce = False,
    sort: opts.Sort = None,
    top: opts.Top = None,
    jobs: opts.Jobs = None,
    include: opts.Include = None,
    exclude: opts.Exclude = None,
    fmt: opts.FormatOpt = opts.Format.table,
    quiet: opts.Quiet = False,
    fail_unsafe_pickle: opts.FailUnsafePickle = False,
    debug: opts.Debug = False,
) -> None:
    """tf.clip_by_global_norm over all selected floating and complex tensors together: one common scale.

    Reports the global norm before, the scale applied and the norm after. Several checkpoints (per-rank
    gradient files) are clipped together, with one scale from the global norm over all of them, each into
    -o DIR/<its file name> (or --in-place); a tensor name in two of them is a usage error unless
    --prefix-with-file.
    """
    c = opts.parse_float(clip_norm, "--clip-norm")
    opts.positive_finite(c, clip_norm, "--clip-norm")
    g = None if use_norm is None else opts.parse_float(use_norm, "--use-norm")
    if g is not None and not (math.isfinite(g) and g >= 0):
        opts.usage(f"must be a finite number >= 0, got {use_norm}", "--use-norm")
    if prefix_with_file and len(checkpoints) == 1:
        opts.usage("only with several checkpoints", "--prefix-with-file")
    with handled_errors(debug, "clip", writes=True):
        from clipcli.commands import clip

        fields = dict(
            clip_norm=c, use_norm=g, allow_nonfinite=allow_nonfinite, sort=sort and sort.value, top=top,
            jobs=worker_count(jobs), count_shared_once=count_shared_once,
        )  # fmt: skip
        if len(checkpoints) > 1:
            _clip_together(
                checkpoints, output, in_place, dry_run, drop_metadata, report_file, quiet, fmt, include, exclude,
                prefix_with_file, fields,
            )  # fmt: skip
            return
        _clip(
            clip.clip_global_norm, clip.ClipGlobalNormOptions, checkpoints[0], output, in_place, dry_run,
            drop_metadata, report_file, quiet, fmt, include, exclude, **fields,
        )  # fmt: skip


def _clip_together(
    paths: list[Path],
    output: str | None,
    in_place: bool,
    dry_run: bool,
    drop_metadata: bool,
    report_file: Path | None,
    quiet: bool,
    fmt: opts.Format,
    include: list[str] | None,
    exclude: list[str] | None,
    prefix_with_file: bool,
    fields: dict[str, Any],
) -> None:
    """clip-global-norm of several checkpoints: each into OUT/<its name> (or in place), with one scale."""
    import contextlib

    from clipcli.checkpoint import check_report, open_checkpoint
    from clipcli.commands import clip
    from clipcli.commands.global_norm import check_distinct
    from clipcli.commands.write import output_target

    if in_place and output is not None:
        opts.usage("give either -o/--output or --in-place, not both", "--in-place")
    if in_place and any(opts.is_url(p) for p in paths):
        opts.usage("a URL cannot be replaced in place: give -o DIR (a local path)", "--in-place")
    if output is None and not (in_place or dry_run):
        opts.usage("missing; give -o DIR (several checkpoints), --in-place or --dry-run", "-o/--output")
    if output is not None:  # a directory, as a sharded output's (see check_output): never a file made one
        out = Path(output)
        if out.exists() and not out.is_dir():
            opts.usage(f"{output} exists and is not a directory; several checkpoints go into -o DIR", "-o/--output")
        if out.suffix and not output.endswith(("/", os.sep)) and not out.is_dir():
            opts.usage(
                f"several checkpoints go into a directory, not a {out.suffix} file; give -o DIR (a name without "
                "a suffix, or ending in '/')",
                "-o/--output",
            )
    names = [Path(p).name for p in paths]
    given = names if output is not None else [os.path.realpath(p) for p in paths]
    twice = next((n for n in given if given.count(n) > 1), None)
    if twice is not None:  # into one DIR/<name>, or one file clipped twice in place
        where = f"they cannot both go to {output}/{twice}" if output is not None else "it would be clipped twice"
        opts.usage(f"two checkpoints are {twice!r}: {where}", "-o/--output" if output is not None else "--in-place")
    # A dry run writes nothing (DIR need not exist); a DIR made here is removed again if nothing was written to it.
    directory = None if output is None or dry_run else Path(output)
    made = directory is not None and not directory.exists()
    try:
        with contextlib.ExitStack() as stack:
            with opening_several():  # (an unsafe pickle's gate names every unsafe file, before any output)
                opened = [stack.enter_context(open_checkpoint(p)) for p in paths]
            selection = selection_of(include, exclude, *opened)
            if not prefix_with_file:
                check_distinct(opened, selection, "clip-global-norm of several checkpoints")
            if directory is not None:
                directory.mkdir(parents=True, exist_ok=True)
            settings = []
            for ckpt, name in zip(opened, names, strict=True):
                if drop_metadata:
                    ckpt.metadata = {}
                target = output_target(ckpt, None if directory is None else str(directory / name), in_place, dry_run)
                if report_file is not None:
                    check_report(report_file, ckpt, target)
                settings.append(
                    clip.ClipGlobalNormOptions(output=target, in_place=in_place, selection=selection, **fields)
                )
            with progress_bar(2 * _bytes_of(*opened), quiet) as progress:
                result = clip.clip_global_norms(opened, settings, progress)
    except BaseException:
        if made and directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()
        raise
    emit(result, fmt, quiet, report_file)


@app.command(
    cls=opts.Command,
    epilog=opts.examples(
        "clipcli diff step-1000.safetensors step-2000.safetensors --sort diff --top 10",
        "clipcli diff pytorch_model.bin model.safetensors --fail-different",
        "clipcli diff base/ finetuned/ --depth 3 --fail-rel-above 0.05 --format json",
    ),
)
def diff(
    a: opts.DiffA,
    b: opts.DiffB,
    ord: opts.Ord = "2",
    depth: opts.Depth = None,
    sort: opts.DiffSort = None,
    top: opts.Top = None,
    fail_above: opts.DiffFailAbove = None,
    fail_rel_above: opts.FailRelAbove = None,
    fail_different: opts.FailDifferent = False,
    maps: opts.Maps = None,
    jobs: opts.Jobs = None,
    include: opts.Include = None,
    exclude: opts.Exclude = None,
    fmt: opts.FormatOpt = opts.Format.table,
    quiet: opts.Quiet = False,
    fail_unsafe_pickle: opts.FailUnsafePickle = False,
    debug: opts.Debug = False,
) -> None:
    """How far checkpoint B is from A: ‖A−B‖, ‖A‖, ‖B‖, ‖A−B‖/‖A‖, cosine, max |a−b| and changed elements.

    Tensors are matched by name; tensors of different dtypes are compared by value (how much did the
    bfloat16 conversion change the weights?); bit-identical tensors are summed up in one line; tensors
    in one checkpoint only, and shape mismatches, are listed. Without a gate the exit status is 0 whatever
    differs, as with `git diff`. --map 'A_PREFIX=B_PREFIX' pairs names that differ by a prefix (a Lightning
    `state_dict.`, a DDP `module.`): rows and only-in-A are named as in A, only-in-B as in B.
    """
    with handled_errors(debug, "diff"):  # --ord: its limit is the core's (NumPy)
        p = opts.parse_ord(ord)
        limit = None if fail_above is None else opts.parse_limit(fail_above, "--fail-above")
        rel_limit = None if fail_rel_above is None else opts.parse_limit(fail_rel_above, "--fail-rel-above")
        from clipcli.checkpoint import open_checkpoint
        from clipcli.commands import diff as command

        limits = command.DiffLimits(limit, rel_limit, fail_different, fail_above, fail_rel_above)
        with open_checkpoint(a) as ca, open_checkpoint(b) as cb:
            selection = selection_of(include, exclude, ca, cb)
            pairs = tuple(command.parse_map(m) for m in maps or ())
            options = command.DiffOptions(selection, p, depth, sort and sort.value, top, worker_count(jobs), pairs)
            total = _bytes_of(ca, cb)
            with progress_bar(total, quiet) as progress:
                report = command.diff(ca, cb, options, progress)
        command.check_measured(report, limits)
        emit(report, fmt, quiet)
        exit_on_gate(next(iter(command.failures(report, limits)), None))


@app.command(
    cls=opts.Command,
    epilog=opts.examples(
        "clipcli convert pytorch_model.bin -o model.safetensors",
        "clipcli convert model.safetensors -o shards/ --max-shard-size 5GB",
        "clipcli convert shards/ -o merged.safetensors --dry-run",
    ),
)
def convert(
    checkpoint: opts.ConvertCheckpoint,
    output: opts.ConvertOutput,
    max_shard_size: opts.MaxShardSize = None,
    dry_run: opts.DryRun = False,
    drop_metadata: opts.DropMetadata = False,
    report_file: opts.ReportFile = None,
    sort: opts.InspectSort = None,
    top: opts.Top = None,
    jobs: opts.Jobs = None,
    include: opts.Include = None,
    exclude: opts.Exclude = None,
    fmt: opts.FormatOpt = opts.Format.table,
    quiet: opts.Quiet = False,
    fail_unsafe_pickle: opts.FailUnsafePickle = False,
    debug: opts.Debug = False,
) -> None:
    """The same tensors in another format or layout: every value, dtype, shape, name and the metadata kept,
    or an error that says what would be lost.

    PyTorch files (read without torch, never unpickled) become .safetensors, .npz or .pt (torch's zip format,
    which torch.load(weights_only=True) reads); sharded checkpoints merge into one file; one file splits into
    shards with --max-shard-size. Tensors that share storage in a PyTorch file (tied weights) become separate
    copies (in a .pt, one storage where they are the same view), and the report says so. Tensors left out by
    --include/--exclude are not written.
    """
    max_shard = None if max_shard_size is None else opts.parse_size(max_shard_size, "--max-shard-size")
    with handled_errors(debug, "convert", writes=True):
        from clipcli.checkpoint import check_output, check_report, open_checkpoint
        from clipcli.commands import convert as command

        with open_checkpoint(checkpoint) as ckpt:
            if drop_metadata:
                ckpt.metadata = {}
            target = check_output(output, ckpt, resharding=max_shard is not None, command="convert")
            if report_file is not None:
                check_report(report_file, ckpt, None if dry_run else target)
            selection = selection_of(include, exclude, ckpt)
            options = command.ConvertOptions(
                target=target, dry_run=dry_run, max_shard=max_shard, selection=selection, sort=sort and sort.value,
                top=top, jobs=worker_count(jobs),
            )  # fmt: skip
            with progress_bar(sum(t.nbytes for t in ckpt.tensors), quiet) as progress:
                report = command.convert(ckpt, options, progress)
        emit(report, fmt, quiet, report_file)


@app.command(
    cls=opts.Command,
    epilog=opts.examples(
        "clipcli trajectory run/step-*.safetensors",
        "clipcli trajectory run/step-* --depth 3 --format csv > layers.csv",
        "clipcli trajectory run/step-*.safetensors --plot trajectory.png",
    ),
)
def trajectory(
    checkpoints: opts.Checkpoints,
    depth: opts.Depth = None,
    plot: opts.Plot = None,
    keep_order: opts.KeepOrder = False,
    jobs: opts.Jobs = None,
    include: opts.Include = None,
    exclude: opts.Exclude = None,
    fmt: opts.FormatOpt = opts.Format.table,
    quiet: opts.Quiet = False,
    fail_unsafe_pickle: opts.FailUnsafePickle = False,
    debug: opts.Debug = False,
) -> None:
    """A run's checkpoints, step by step: each one's global norm and, against the previous one, |Δ|, the relative
    change and the cosine, plus the cosine to the first; checkpoints identical to the previous one (the same
    content hashes) are flagged.

    The checkpoints are taken in natural order of their names (step-200 before step-1000), or as given with
    --keep-order; the step is the last number in a name. --plot FILE.png|.svg draws the trajectory (needs
    matplotlib: pip install 'clipcli[plot]').
    """
    with handled_errors(debug, "trajectory"):
        from clipcli.checkpoint.atomic import atomic_write
        from clipcli.commands import trajectory as command

        if plot is not None:
            from clipcli.report.plot import FORMATS

            if plot.suffix.lower() not in FORMATS:
                opts.usage(f"draws .png or .svg files, not {plot.suffix or 'a file without a suffix'}", "--plot")
        selection = selection_of(include, exclude)
        options = command.TrajectoryOptions(selection, depth, worker_count(jobs), keep_order)
        report = command.trajectory(checkpoints, options)
        if plot is not None:
            from clipcli.report.plot import figure_bytes

            figure = figure_bytes(report, plot.suffix)
            with atomic_write(plot) as f:
                f.write(figure)
        emit(report, fmt, quiet)


def _bytes_of(*ckpts: Any) -> int:
    """The bytes of every tensor of the checkpoints (for a progress bar)."""
    return sum(sum(map(_NBYTES, c.tensors)) for c in ckpts)


_NBYTES = operator.attrgetter("nbytes")
