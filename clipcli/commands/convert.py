"""`convert`: the same tensors in another format or layout, every value, dtype, shape and name kept."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from clipcli.checkpoint import Checkpoint, check_plan, shared_in_output
from clipcli.commands.inspect import listing_fields
from clipcli.commands.passes import NO_PROGRESS, Progress
from clipcli.commands.select import EVERY, Selection
from clipcli.commands.write import write
from clipcli.report.listing import ConvertReport
from clipcli.report.rows import Skipped


@dataclass(frozen=True, kw_only=True)
class ConvertOptions:
    """Where `convert` writes: `target` (a file whose suffix names the format, or a directory of shards);
    `dry_run`: nothing written; `max_shard`: shards of at most so many bytes and an index. The tensors
    `selection` takes are written; the report's rows are sorted by `sort` (name, size) and cut to `top`;
    `jobs` workers."""

    target: Path
    dry_run: bool = False
    max_shard: int | None = None
    selection: Selection = EVERY
    sort: str | None = None
    top: int | None = None
    jobs: int = 1


def convert(ckpt: Checkpoint, options: ConvertOptions, progress: Progress = NO_PROGRESS) -> ConvertReport:
    """The same tensors in another format or layout at `options.target`, every value, dtype, shape and name
    kept, or a refusal that says what would be lost. Tensors left out by --include/--exclude are not written;
    on a dry run nothing is.

    Raises:
        UsageError: when --include/--exclude select no tensor.
        UnsupportedError: for a tensor or the metadata the output cannot hold (before anything is written).
    """
    o = options
    selection = o.selection
    selection.check(ckpt)
    tensors = [t for t in ckpt.tensors if selection.listed(t)]
    left_out = tuple(
        Skipped(t.name, t.dtype, selection.reason_to_skip(t) or "") for t in ckpt.tensors if not selection.listed(t)
    )
    layout = check_plan(ckpt, o.target, None, tensors, o.max_shard)  # also on a dry run: what the write would refuse
    if not o.dry_run:
        write(
            ckpt, o.target, {}, in_place=None, tensors=tensors, max_shard=o.max_shard, jobs=o.jobs,
            progress=progress, label="converting", worker_bytes=4 << 20,
        )  # fmt: skip
    where = {t.name: str(file) for file, group in layout.files for t in group}
    files = [str(file) for file, _ in layout.files] + ([str(layout.index)] if layout.index else [])
    return ConvertReport(
        **listing_fields(ckpt, tensors, where, o.sort, o.top),
        left_out=left_out,
        output=None if o.dry_run else str(o.target),
        files=tuple(files),
        indexed=layout.index is not None,
        shared_kept=shared_in_output(o.target, tensors),
    )
