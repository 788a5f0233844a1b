"""What `verify` finds wrong with a checkpoint's structure, from its headers and sizes, by its format."""

from __future__ import annotations

import os
from pathlib import Path

from clipcli.checkpoint import registry
from clipcli.checkpoint.plugin import Finding
from clipcli.checkpoint.reader import at_path, remote_store
from clipcli.checkpoint.source import Store


def find_defects(
    path: str | os.PathLike[str], store: Store | None = None, opened: bool = False
) -> tuple[str, list[Finding]]:
    """The format of the checkpoint at `path` and every defect it sees (`Format.defects`; [] for none); `opened`:
    the caller has opened it without a refusal (what opening checks is not checked again).

    A malformed checkpoint is what this is for: its defects are findings. Only a path that is no checkpoint of
    a known format at all raises.

    Raises:
        MissingFileError, FileTypeError, InputError: for a path that is missing, unreadable, not a regular
            file, or of no known format (or a file that is evidently something other than its name says).
        UnsupportedError: for what clipcli cannot read (a dtype, a version, a storage transform).
    """

    def check(where: Path, s: Store) -> tuple[str, list[Finding]]:
        fmt = registry.format_of(where, s)
        return fmt.name, fmt.defects(where, s, opened)

    remote = remote_store(path, store)
    if remote is None:
        return at_path(path, store, check)
    store, where = remote
    try:
        return at_path(where, store, check)
    finally:
        store.close()
