"""Which tensors a command works on (--include/--exclude) and which rows its report shows (--sort/--top)."""

from __future__ import annotations

import fnmatch
import functools
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from clipcli.checkpoint import Checkpoint, TensorInfo
from clipcli.core.blocks import is_floating
from clipcli.errors import UsageError, printable
from clipcli.report.rows import Skipped

_floating = functools.lru_cache(is_floating)  # asked per tensor: few dtypes, 12,000 tensors


class Selection(NamedTuple):
    """Which tensors a command works on: shell-style globs on tensor names."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    def reason_to_skip(self, t: TensorInfo, real_only: bool = False) -> str | None:
        """Why the command leaves `t` out of its norms (not selected, not floating, ...), or None."""
        if self.include and not any(fnmatch.fnmatchcase(t.name, g) for g in self.include):
            return "not selected by --include"
        if self.exclude and any(fnmatch.fnmatchcase(t.name, g) for g in self.exclude):
            return "excluded by --exclude"
        if t.skip is not None:
            return t.skip
        if t.array_dtype is None:
            return f"no arithmetic on {t.dtype} (carried as bytes)"
        if not _floating(t.array_dtype) and not (t.array_dtype.kind == "c" and not real_only):
            return "not a floating tensor" if t.array_dtype.kind != "c" else "complex values have no order"
        return None

    def listed(self, t: TensorInfo) -> bool:
        """Whether the patterns take the tensor."""
        return self.selects(t.name)

    def selects(self, name: str) -> bool:
        """Whether the patterns take a name (a tensor's, or a metadata key's)."""
        if self.include and not any(fnmatch.fnmatchcase(name, g) for g in self.include):
            return False
        return not (self.exclude and any(fnmatch.fnmatchcase(name, g) for g in self.exclude))

    def unmatched(self, *ckpts: Checkpoint) -> list[str]:
        """The options (`--include 'x'`) whose pattern matches no tensor of any of the checkpoints."""
        names = {t.name for c in ckpts for t in c.tensors}
        flagged = [("--include", g) for g in self.include] + [("--exclude", g) for g in self.exclude]
        return [f"{flag} {printable(g)!r}" for flag, g in flagged if not any(fnmatch.fnmatchcase(n, g) for n in names)]

    def check(self, ckpt: Checkpoint) -> None:
        """Refuses --include/--exclude patterns that leave no tensor of the checkpoint selected.

        Raises:
            UsageError: naming the patterns and a few names the checkpoint has.
        """
        if not (self.include or self.exclude) or any(self.listed(t) for t in ckpt.tensors):
            return
        if not self.exclude:
            what = "no tensor matches " + " or ".join(repr(printable(g)) for g in self.include)
        else:
            flags = [*(f"--include {printable(g)!r}" for g in self.include)]
            flags += [f"--exclude {printable(g)!r}" for g in self.exclude]
            what = " ".join(flags) + (" leave" if len(flags) > 1 else " leaves") + " no tensor selected"
        raise UsageError(f"{what}; {some_names(ckpt)}", ckpt.path, "--include" if self.include else "--exclude")


EVERY = Selection()  # no pattern: every tensor


def some_names(ckpt: Checkpoint, k: int = 3) -> str:
    """'its tensors include a, b, c (17 in all)', for a message."""
    if not ckpt.tensors:
        return "it holds no tensor"
    names = ", ".join(printable(t.name) for t in ckpt.tensors[:k])
    more = f" ({len(ckpt.tensors):,} in all)" if len(ckpt.tensors) > k else ""
    return f"its tensors include {names}{more}"


def select(ckpt: Checkpoint, selection: Selection, real_only: bool = False) -> tuple[list[TensorInfo], list[Skipped]]:
    """The tensors the command measures, and those it skips with the reason.

    Raises:
        UsageError: when the patterns select no tensor (`Selection.check`).
    """
    tensors = ckpt.tensors
    if (  # the common case, tested at once: no pattern, and every tensor of a floating type (`floating`)
        not (selection.include or selection.exclude)
        and set(map(_SKIP, tensors)) <= {None}
        and all(d is not None and _floating(d) for d in set(map(_ARRAY_DTYPE, tensors)))
    ):
        return list(tensors), []
    return partition(ckpt, selection, lambda t: selection.reason_to_skip(t, real_only))


_SKIP, _ARRAY_DTYPE = operator.attrgetter("skip"), operator.attrgetter("array_dtype")


def without_values(t: TensorInfo, selection: Selection, what: str) -> str | None:
    """Why a command over every value (`what` it gives: "content hash", "statistics") leaves a tensor out: not
    selected, no values (sparse, quantized, meta) or a type carried as bytes (strings, records); None to take it."""
    if not selection.listed(t):
        return selection.reason_to_skip(t)
    if t.skip is not None:
        return t.skip
    if t.array_dtype is None:
        return f"no {what} of {t.dtype} (carried as bytes)"
    return None


def partition(
    ckpt: Checkpoint, selection: Selection, reason_to_skip: Callable[[TensorInfo], str | None]
) -> tuple[list[TensorInfo], list[Skipped]]:
    """The tensors a command takes, and those it skips with the reason `reason_to_skip` gives (None: taken).

    Raises:
        UsageError: when the patterns select no tensor (`Selection.check`).
    """
    selection.check(ckpt)
    selected, skipped = [], []
    for t in ckpt.tensors:
        reason = reason_to_skip(t)
        if reason:
            skipped.append(Skipped(t.name, t.dtype, reason))
        else:
            selected.append(t)
    return selected, skipped


def select_to_clip(
    ckpt: Checkpoint, selection: Selection, real_only: bool = False
) -> tuple[list[TensorInfo], list[Skipped]]:
    """`select`, refusing a selection with nothing to clip.

    Raises:
        UsageError: when no floating tensor is selected.
    """
    selected, skipped = select(ckpt, selection, real_only)
    if not selected:
        kinds = "real floating" if real_only else "floating or complex"
        message = f"no {kinds} tensor is selected, so there is nothing to clip; {some_names(ckpt)}"
        raise UsageError(message, ckpt.path, "--include" if selection.include or selection.exclude else None)
    return selected, skipped


def floating(t: TensorInfo) -> bool:
    """Whether a tensor's values take part in norms (floating ones, readable)."""
    return t.skip is None and t.array_dtype is not None and _floating(t.array_dtype)


def shared_storages(tensors: Iterable[TensorInfo]) -> tuple[tuple[str, ...], ...]:
    """Groups of names on one storage (tied weights in a PyTorch file), as the reports list them."""
    groups: dict[str, list[str]] = {}
    for t in tensors:
        if t.storage is not None:
            groups.setdefault(t.storage, []).append(t.name)
    return tuple(tuple(names) for names in groups.values() if len(names) > 1)


def _nan_first(value: float | None) -> tuple[bool, float]:
    """A key that sorts NaN above every number (it matters most), None below."""
    if value is None:
        return (False, -math.inf)
    return (math.isnan(value), 0.0 if math.isnan(value) else value)


_SORT_KEYS = {
    "name": lambda r: (r.name,),
    "norm": lambda r: _nan_first(getattr(r, "norm", getattr(r, "norm_a", None))),
    "size": lambda r: (getattr(r, "nbytes", getattr(r, "tensors", 0)),),
    "diff": lambda r: _nan_first(r.diff_norm),
    "rel": lambda r: _nan_first(r.rel),
}


def order(rows: Sequence, sort: str | None, top: int | None) -> tuple:
    """Rows sorted (name ascending; norm, size, diff and rel descending) and cut to the first `top`."""
    out = list(rows)
    if sort:
        out.sort(key=_SORT_KEYS[sort], reverse=sort != "name")
    return tuple(out[:top] if top else out)
