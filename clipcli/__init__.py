"""clipcli: checkpoint tensor norms and TensorFlow's clipping operations, on files and NumPy arrays."""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: `python -m clipcli` runs this first

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "clip_by_global_norm",
    "clip_by_norm",
    "clip_by_value",
    "diff",
    "global_norm",
    "norm",
]

if TYPE_CHECKING:
    from typing import Any

    from clipcli.core import clip_by_global_norm as clip_by_global_norm
    from clipcli.core import clip_by_norm as clip_by_norm
    from clipcli.core import clip_by_value as clip_by_value
    from clipcli.core import diff as diff
    from clipcli.core import global_norm as global_norm
    from clipcli.core import norm as norm


def __getattr__(name: str) -> Any:
    # The API lives in clipcli.core; importing it lazily keeps `clipcli --help` free of NumPy.
    if name in __all__:
        from clipcli import core

        return getattr(core, name)
    raise AttributeError(f"module 'clipcli' has no attribute {name!r}")
