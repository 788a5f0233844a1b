"""`inspect`: names, dtypes, shapes, sizes and metadata of a checkpoint, from its headers alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from clipcli.checkpoint import Checkpoint, TensorInfo
from clipcli.commands.audit import pickle_audit
from clipcli.commands.select import EVERY, Selection, order, shared_storages
from clipcli.errors import shown_path

if TYPE_CHECKING:  # (imported where a listing is made)
    from clipcli.report.listing import Listing


@dataclass(frozen=True)
class InspectOptions:
    """What `inspect` lists: the tensors `selection` takes, rows sorted by `sort` (name, size) and cut to `top`."""

    selection: Selection = EVERY
    sort: str | None = None
    top: int | None = None


def inspect(ckpt: Checkpoint, options: InspectOptions = InspectOptions()) -> Listing:
    """Names, dtypes, shapes, sizes and metadata, from the headers alone.

    Raises:
        UsageError: when --include/--exclude select no tensor.
    """
    from clipcli.report.listing import Listing

    selection = options.selection
    selection.check(ckpt)
    tensors = [t for t in ckpt.tensors if selection.listed(t)]
    return Listing(**listing_fields(ckpt, tensors, {}, options.sort, options.top))


def listing_fields(
    ckpt: Checkpoint, tensors: list[TensorInfo], files: dict[str, str], sort: str | None, top: int | None
) -> dict[str, Any]:
    """The fields of a `Listing` of `tensors` of `ckpt`, each in its file (`files[name]`, else its own)."""
    from clipcli.report.listing import InspectRow, listed

    rows = [InspectRow(t.name, t.dtype, t.shape, t.nbytes, shown_path(files.get(t.name, t.file))) for t in tensors]
    return {
        "path": str(ckpt.path),
        "format": ckpt.format,
        "metadata": ckpt.metadata,
        "summary": listed(rows),
        "tensors": order(rows, sort, top),
        "shared": shared_storages(tensors),
        "several_files": ckpt.sharded,
        "pickle": pickle_audit(ckpt),
    }
