"""What the gates (`--fail-*`) share: the line that says a figure exceeds its limit, and the one a run exits with."""

from __future__ import annotations

import math


def exceeds(what: str, value: float, gate: str, limit: str) -> str:
    """'global norm 6.1 exceeds --fail-above 1', or 'global norm is nan, not finite (--fail-above 1)'."""
    if math.isfinite(value):
        return f"{what} {value!r} exceeds {gate} {limit}"
    return f"{what} is {value!r}, not finite ({gate} {limit})"


def failure(reasons: list[str], count: int) -> str | None:
    """The one line a run over `count` checkpoints exits 1 with, from each failing checkpoint's reason; None
    where none failed."""
    if len(reasons) <= 1:
        return reasons[0] if reasons else None
    return f"{len(reasons)} of {count} checkpoints fail their gates: {'; '.join(reasons)}"


def limit_text(limit: float) -> str:
    """A limit as a person would type it: 1 rather than 1.0, every digit kept."""
    short = f"{limit:g}"
    return short if float(short) == limit else repr(limit)
