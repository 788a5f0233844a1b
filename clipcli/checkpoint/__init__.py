"""Checkpoints: list tensors from headers, read them in bounded chunks, write them atomically.

A format is a module under `formats/` ending with its `FORMAT` record (`plugin.Format`), named once in
`registry`; the modules here know no format: `tensor` (what a header describes, and where its bytes lie),
`source` (where bytes come from: a `Store` of files, each a `Source` of ranged reads), `reader` (an open
checkpoint), `decode` (bytes to values), `engine` and `workers` (work over chunks by N workers; `pairs`:
over two checkpoints in lockstep), `write` (plans, checks and writes), `atomic` (the one way a file is
written), `copy` (bytes copied unchanged by the kernel), `crc` and `zipmember` (zip members read in parts
or as streams), `defects` (what `verify` finds wrong, by each format's `findings`).
"""

from __future__ import annotations

import importlib
from typing import Any

from clipcli.checkpoint.decode import as_values, decode, pair_values
from clipcli.checkpoint.engine import CHUNK_BYTES, map_chunks, run
from clipcli.checkpoint.plugin import Finding, Format, Opened, Plan
from clipcli.checkpoint.reader import MAX_NUMPY_DIMS, Checkpoint, c_order, open_checkpoint
from clipcli.checkpoint.registry import register
from clipcli.checkpoint.tensor import TensorInfo

# The names of the modules that a command which only reads never needs (writing, copying, verifying, pairs of
# checkpoints), imported when first asked for (`__getattr__`): each process pays only for what it runs.
_IMPORTED_WHEN_ASKED = {
    "atomic_write": "atomic",
    "FileRange": "copy",
    "unchanged_range": "copy",
    "find_defects": "defects",
    "run_pairs": "pairs",
    "MAX_LZMA_DICTIONARY": "zipmember",  # zip members are read only from zips
    **dict.fromkeys(
        (
            "Place",
            "c_order_blocks",
            "check_output",
            "check_plan",
            "check_report",
            "output_kind",
            "placed",
            "plan",
            "save",
            "shared_in_output",
            "transposed",
        ),
        "write",
    ),
}

__all__ = [
    "CHUNK_BYTES",
    "MAX_LZMA_DICTIONARY",
    "MAX_NUMPY_DIMS",
    "Checkpoint",
    "FileRange",
    "Finding",
    "Format",
    "Opened",
    "Place",
    "Plan",
    "TensorInfo",
    "as_values",
    "atomic_write",
    "byte_layout",
    "c_order",
    "c_order_blocks",
    "carried_dtype",
    "check_output",
    "check_plan",
    "check_report",
    "decode",
    "find_defects",
    "map_chunks",
    "open_checkpoint",
    "output_kind",
    "pair_values",
    "placed",
    "plan",
    "register",
    "run",
    "run_pairs",
    "save",
    "shared_in_output",
    "transposed",
    "unchanged_range",
]


def byte_layout(t: TensorInfo) -> tuple[str, bool]:
    """How a type carried as bytes lies: its stored type (byte order included; "" where it has none) and whether
    in Fortran order (where the shape makes the orders differ). Two such tensors of one type whose layouts agree
    hold the same values exactly when they hold the same bytes."""
    from clipcli.checkpoint.formats.npy import byte_layout as layout  # here: only comparing such types needs it

    return layout(t)


def carried_dtype(t: TensorInfo) -> Any:
    """The NumPy type of a type clipcli carries as bytes (`array_dtype` None: strings, records), or None."""
    from clipcli.checkpoint.formats.npy import carried_dtype as dtype  # here: only such types need it

    return dtype(t)


def __getattr__(name: str) -> Any:
    module = _IMPORTED_WHEN_ASKED.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
