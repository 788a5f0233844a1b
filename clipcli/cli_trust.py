"""The commands that answer "can I trust this checkpoint?": hash, stats and verify."""

# No `from __future__ import annotations` here: Typer reads the commands' annotations at every run.

from pathlib import Path

from clipcli import cli_options as opts
from clipcli.cli_app import app, exit_on_gate, handled_errors, selection_of, worker_count
from clipcli.cli_output import emit
from clipcli.cli_output import progress as progress_bar


@app.command(
    "hash",
    cls=opts.Command,
    epilog=opts.examples(
        "clipcli hash model.safetensors",
        "clipcli hash pytorch_model.bin --format json > manifest.json",
        "clipcli hash shards/ --include 'model.layers.0.*' --format csv",
    ),
)
def hash_(
    checkpoints: opts.Checkpoints,
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
    """Content hashes: SHA-256 of each tensor's dtype name, shape and values (little-endian, C order), and one
    checkpoint hash over the sorted (name, hash) pairs; the same in every format and layout clipcli reads.

    Types carried as bytes (strings, records) are hashed over their bytes as stored; tensors without values
    (sparse, quantized, meta) are skipped with the reason; --include/--exclude choose the tensors the checkpoint
    hash covers.
    """
    with handled_errors(debug, "hash"):
        from clipcli.checkpoint import open_checkpoint
        from clipcli.commands import hash as command
        from clipcli.report.hash import HashReport

        opened = [open_checkpoint(path) for path in checkpoints]
        options = command.HashOptions(
            selection_of(include, exclude, *opened), sort and sort.value, top, worker_count(jobs)
        )
        hashed = []
        with progress_bar(sum(t.nbytes for c in opened for t in c.tensors), quiet) as progress:
            for ckpt in opened:
                with ckpt:
                    hashed.append(command.hash_checkpoint(ckpt, options, progress))
        emit(HashReport(tuple(hashed)), fmt, quiet)


@app.command(
    "stats",
    cls=opts.Command,
    epilog=opts.examples(
        "clipcli stats model.safetensors --sort max_abs --top 10",
        "clipcli stats model.safetensors --fail-cast-overflow float16 --quiet",
        "clipcli stats adapter.safetensors --fail-all-zero --fail-nonfinite --format json",
    ),
)
def stats(
    checkpoints: opts.Checkpoints,
    cast: opts.Cast = None,
    depth: opts.Depth = None,
    sort: opts.StatsSort = None,
    top: opts.Top = None,
    fail_max_abs: opts.FailMaxAbs = None,
    fail_cast_overflow: opts.FailCastOverflow = None,
    fail_all_zero: opts.FailAllZero = False,
    fail_nonfinite: opts.FailNonfinite = False,
    jobs: opts.Jobs = None,
    include: opts.Include = None,
    exclude: opts.Exclude = None,
    fmt: opts.FormatOpt = opts.Format.table,
    quiet: opts.Quiet = False,
    fail_unsafe_pickle: opts.FailUnsafePickle = False,
    debug: opts.Debug = False,
) -> None:
    """Is every value sane, and will it survive a cast? Per tensor, exact: count, min, max, max |x| and where,
    mean and std, zeros, subnormals, NaN, +Inf, -Inf, a histogram of binary exponents (one character per
    binade in the table), all-zero and constant flags, and per cast target the values that would overflow,
    flush to zero or land subnormal, and the relative error of the cast.

    Integer and bool tensors get their exact figures (no casts, no histogram); types carried as bytes and
    tensors without values are skipped with the reason. A gate looks at the selected floating tensors and
    never passes because nothing was measured: with none selected it is a usage error (exit 2).
    """
    with handled_errors(debug, "stats"):
        limit = None if fail_max_abs is None else opts.parse_limit(fail_max_abs, "--fail-max-abs")
        from clipcli.checkpoint import open_checkpoint
        from clipcli.commands import gates
        from clipcli.commands import stats as command
        from clipcli.report.stats import StatsReport

        casts = None if cast is None else command.check_casts([c.strip() for c in cast.split(",")], "--cast")
        gate_cast = (
            () if fail_cast_overflow is None else command.check_casts([fail_cast_overflow], "--fail-cast-overflow")
        )
        limits = command.StatsLimits(limit, fail_cast_overflow, fail_all_zero, fail_nonfinite, fail_max_abs)
        opened = [open_checkpoint(path) for path in checkpoints]
        selection = selection_of(include, exclude, *opened)
        options = command.StatsOptions(selection, casts, gate_cast, depth, sort and sort.value, top, worker_count(jobs))
        measured = []
        with progress_bar(sum(t.nbytes for c in opened for t in c.tensors), quiet) as progress:
            for ckpt in opened:
                with ckpt:
                    one = command.stats(ckpt, options, progress)
                    command.check_measured(one, limits)
                    measured.append(one)
        report = StatsReport(tuple(measured))
        emit(report, fmt, quiet)
        exit_on_gate(gates.failure(command.failures(report, limits), len(measured)))


@app.command(
    "verify",
    cls=opts.Command,
    epilog=opts.examples(
        "clipcli verify shards/",
        "clipcli verify model.safetensors --manifest manifest.json",
        "clipcli verify model.safetensors --values --format json",
    ),
)
def verify(
    checkpoint: opts.VerifyCheckpoint,
    manifest: opts.Manifest = None,
    values: opts.Values = False,
    jobs: opts.Jobs = None,
    include: opts.Include = None,
    exclude: opts.Exclude = None,
    fmt: opts.FormatOpt = opts.Format.table,
    quiet: opts.Quiet = False,
    fail_unsafe_pickle: opts.FailUnsafePickle = False,
    debug: opts.Debug = False,
) -> None:
    """Checks a checkpoint whole: its structure from headers and sizes (every shard an index names present and
    complete, no stray shard, tensors where the index says, offsets without gaps or overlaps, nothing truncated,
    zip members' CRCs, DCP chunks covering every tensor once), with --manifest every tensor's content hash
    against `clipcli hash --format json` of the original (missing, extra and changed tensors), with --values
    NaN, Inf and all-zero floating tensors.

    Exit status: 0 nothing found; 1 a defect or a difference found (all listed), including a checkpoint too
    malformed to open; 3 nothing to verify: the path is missing or unreadable, or no checkpoint of a format clipcli
    knows (or one it cannot read, such as an unsupported dtype). --include/--exclude choose the tensors --manifest
    and --values check.
    """
    with handled_errors(debug, "verify"):
        from clipcli.commands import verify as command

        options = command.VerifyOptions(
            manifest and command.read_manifest(manifest), values, selection_of(include, exclude), worker_count(jobs)
        )
        reads = manifest is not None or values  # the structure alone takes milliseconds: no bar
        with progress_bar(_bytes_in(Path(checkpoint)) if reads else 0, quiet) as progress:
            report = command.verify(checkpoint, options, progress)
        emit(report, fmt, quiet)
        exit_on_gate(command.failure(report))


def _bytes_in(path: Path) -> int:
    """The bytes of a file, or of the files in a directory (and one level below), 0 where it cannot tell: what
    decides whether a pass is long enough for a progress bar."""
    try:
        if not path.is_dir():
            return path.stat().st_size
        return sum(p.stat().st_size for p in [*path.iterdir(), *path.glob("*/*")] if p.is_file())
    except OSError:
        return 0
