"""Norms and TensorFlow's clipping operations on NumPy arrays, accumulated exactly in float64."""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing

__all__ = ["DiffStats", "clip_by_global_norm", "clip_by_norm", "clip_by_value", "diff", "global_norm", "norm"]

if TYPE_CHECKING:
    from typing import Any

    from clipcli.core.differences import DiffStats as DiffStats
    from clipcli.core.differences import diff as diff
    from clipcli.core.ops import clip_by_global_norm as clip_by_global_norm
    from clipcli.core.ops import clip_by_norm as clip_by_norm
    from clipcli.core.ops import clip_by_value as clip_by_value
    from clipcli.core.ops import global_norm as global_norm
    from clipcli.core.ops import norm as norm


def __getattr__(name: str) -> Any:
    # Imported when asked for: a run that imports one of the core's modules (`clipcli.core.blocks`) needs
    # neither the operations nor the differences (their record types cost a run's start-up).
    if name in ("DiffStats", "diff"):
        from clipcli.core import differences

        return getattr(differences, name)
    if name in __all__:
        from clipcli.core import ops

        return getattr(ops, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
