"""The commands that answer "can I trust this checkpoint?": hash (and stats, verify)."""

# No `from __future__ import annotations` here: Typer reads the commands' annotations at every run.

from clipcli import cli_options as opts
from clipcli.cli_app import app, handled_errors, selection_of, worker_count
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

    Types carried as bytes (strings, records) and tensors without values (sparse, quantized, meta) are skipped
    with the reason; --include/--exclude choose the tensors the checkpoint hash covers.
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
