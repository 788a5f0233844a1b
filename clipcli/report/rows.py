"""The rows and summaries the reports share: a tensor's norms, a skipped tensor, a group."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(unsafe_hash=True)  # never changed once made; not frozen: made per tensor, 4 times as fast
class TensorRow:
    """One selected tensor: its norm, largest magnitude, non-finite counts and share of the global norm**p."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    norm: float
    max_abs: float
    nan: int
    inf: int
    share: float | None
    norm_after: float | None = None
    max_abs_after: float | None = None


class Skipped(NamedTuple):
    """A tensor left out of the norms (and passed through unchanged by the clip commands)."""

    name: str
    dtype: str
    reason: str


class Group(NamedTuple):
    """Tensors whose names share their first N dot-separated parts."""

    name: str
    tensors: int
    norm: float
    share: float | None


class Summary(NamedTuple):
    """Figures over every selected tensor of a checkpoint, whichever rows --sort and --top show."""

    tensors: int
    max_abs: float = 0.0
    nan: int = 0
    inf: int = 0
    largest: TensorRow | None = None  # the row with the largest share (None for --ord inf, or no row)
    max_abs_after: float | None = None
    elements: int = 0
    nbytes: int = 0
    nonfinite: tuple[TensorRow, ...] = ()  # the rows holding NaN or Inf
    objects: int = 0  # rows that are pickled objects (an .npz's object arrays): listed, no tensor, no parameters


def summarize(rows: Sequence[TensorRow], max_abs_after: float | None = None) -> Summary:
    """The summary of all selected tensors' rows."""
    shares = [-1.0 if x is None or x != x else x for x in map(_SHARE, rows)]  # (x != x: NaN)
    top = max(shares, default=-1.0)
    nan, inf = sum(map(_NAN, rows)), sum(map(_INF, rows))
    return Summary(
        tensors=len(rows),
        max_abs=max(map(_MAX_ABS, rows), default=0.0),
        nan=nan,
        inf=inf,
        largest=rows[shares.index(top)] if top >= 0 else None,
        max_abs_after=max_abs_after,
        elements=sum(map(math.prod, map(_SHAPE, rows))),
        nbytes=sum(map(_NBYTES, rows)),
        nonfinite=tuple(r for r in rows if r.nan or r.inf) if nan or inf else (),
    )


_NAN, _INF, _MAX_ABS, _NBYTES, _SHARE, _SHAPE = map(
    operator.attrgetter, ("nan", "inf", "max_abs", "nbytes", "share", "shape")
)
