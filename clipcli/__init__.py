"""clipcli: checkpoint tensor norms and TensorFlow's clipping operations, on files and NumPy arrays.

On arrays: `clip_by_value`, `clip_by_norm`, `clip_by_global_norm`, `global_norm`, `norm`, `diff` (TensorFlow's
signatures). On files: `open(path)`, and one function per command returning its report: `inspect_of`,
`global_norm_of`, `diff_of`, `clip_value_of`, `clip_norm_of`, `clip_global_norm_of`, `convert_of`,
`hash_of`, `stats_of`, `trajectory_of`, `verify_of`;
`failures(report, fail_above=...)` applies the command line's gates.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: `python -m clipcli` runs this first

__version__ = "0.1.0"

_ARRAYS = ["clip_by_global_norm", "clip_by_norm", "clip_by_value", "diff", "global_norm", "norm"]
_FILES = [
    "CheckpointFile",
    "clip_global_norm_of",
    "clip_norm_of",
    "clip_value_of",
    "convert_of",
    "diff_of",
    "failures",
    "global_norm_of",
    "hash_of",
    "inspect_of",
    "open",
    "trajectory_of",
    "verify_of",
    "stats_of",
]
__all__ = ["__version__", *_ARRAYS, *_FILES]

if TYPE_CHECKING:
    from typing import Any

    from clipcli.api import CheckpointFile as CheckpointFile
    from clipcli.api import clip_global_norm_of as clip_global_norm_of
    from clipcli.api import clip_norm_of as clip_norm_of
    from clipcli.api import clip_value_of as clip_value_of
    from clipcli.api import convert_of as convert_of
    from clipcli.api import diff_of as diff_of
    from clipcli.api import failures as failures
    from clipcli.api import global_norm_of as global_norm_of
    from clipcli.api import hash_of as hash_of
    from clipcli.api import inspect_of as inspect_of
    from clipcli.api import open as open
    from clipcli.api import stats_of as stats_of
    from clipcli.api import trajectory_of as trajectory_of
    from clipcli.api import verify_of as verify_of
    from clipcli.core import clip_by_global_norm as clip_by_global_norm
    from clipcli.core import clip_by_norm as clip_by_norm
    from clipcli.core import clip_by_value as clip_by_value
    from clipcli.core import diff as diff
    from clipcli.core import global_norm as global_norm
    from clipcli.core import norm as norm


def __getattr__(name: str) -> Any:
    # The array functions live in clipcli.core, those over files in clipcli.api; importing them lazily keeps
    # `import clipcli` (and `clipcli --help`) free of NumPy.
    if name in _ARRAYS:
        from clipcli import core

        return getattr(core, name)
    if name in _FILES:
        from clipcli import api

        return getattr(api, name)
    raise AttributeError(f"module 'clipcli' has no attribute {name!r}")
