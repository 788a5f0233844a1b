"""`inspect`: names, dtypes, shapes, sizes and metadata of a checkpoint, from its headers alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from clipcli.checkpoint import Checkpoint, TensorInfo
from clipcli.commands.select import EVERY, Selection, order, shared_storages
from clipcli.errors import shown_path
from clipcli.report.audit import PickleAudit

if TYPE_CHECKING:  # (imported where a listing is made: every command imports `pickle_audit` from here)
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


def pickle_audit(ckpt: Checkpoint) -> PickleAudit | None:
    """The pickle audit every report on a pickle-based checkpoint carries (the JSON's `pickle`), else None: over
    several pickle files (PyTorch shards), each global's uses summed ("call" if any file calls it), and loaded
    only if every file loads."""
    audits = ckpt.pickle_audits
    if not audits:
        return None
    unsafe = tuple(sorted({name for a in audits for name in a.unsafe_calls}))
    if len(audits) == 1:
        return PickleAudit(audits[0].to_dict(), unsafe, audits[0].loader)
    uses: dict[str, list[int]] = {}  # name: [references, calls]
    for audit in audits:
        for g in audit.globals:
            counts = uses.setdefault(g.name, [0, 0])
            counts[g.use == "call"] += g.count
    fields = {
        "loads_with_weights_only": all(a.loads_with_weights_only for a in audits),
        "globals": [
            {"name": name, "use": "call" if calls else "name", "count": calls or refs}
            for name, (refs, calls) in sorted(uses.items())
        ],
    }
    return PickleAudit(fields, unsafe, audits[0].loader)
