"""Norms and TensorFlow's clipping operations on NumPy arrays, accumulated exactly in float64."""

from __future__ import annotations

from clipcli.core.differences import DiffStats, diff
from clipcli.core.ops import clip_by_global_norm, clip_by_norm, clip_by_value, global_norm, norm

__all__ = ["DiffStats", "clip_by_global_norm", "clip_by_norm", "clip_by_value", "diff", "global_norm", "norm"]
