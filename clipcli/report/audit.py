"""The pickle audit as every report on a pickle-based checkpoint carries it: the JSON's `pickle` and one table line."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

TORCH = "torch.load"


class PickleAudit(NamedTuple):
    """What a checkpoint's pickles name and would call (`clipcli.commands.audit.pickle_audit` builds it).

    `fields` is the JSON's `pickle` object, `{"loads_with_weights_only": bool, "globals": [{"name", "use",
    "count"}]}`; `unsafe` the globals that `loader` would call beyond its allowlist (what the warning names);
    `loader` what would unpickle the file: `torch.load`, or NumPy's loader for the object arrays of an .npz.
    """

    fields: dict[str, Any]
    unsafe: tuple[str, ...] = ()
    loader: str = TORCH

    def line(self) -> str:
        """The table's one line: whether torch.load(weights_only=True) loads the file, and what a loader would
        call beyond its allowlist (never called here); for object arrays, what NumPy's would call beyond its own."""
        calls = ", ".join(self.unsafe) or "none"
        if self.loader != TORCH:  # object arrays: NumPy's loader, not torch's, would unpickle them
            return f"pickle (object arrays, which only {self.loader} unpickles): calls beyond NumPy's own: {calls}"
        if self.fields["loads_with_weights_only"]:  # then it calls nothing beyond the allowlist
            return "pickle: loads with torch.load(weights_only=True): yes"
        if not self.unsafe:  # refused for what it names or its kind (TorchScript, DCP's own classes), not calls
            return (
                "pickle: loads with torch.load(weights_only=True): no; unsafe calls: none (its globals: --format json)"
            )
        return f"pickle: loads with torch.load(weights_only=True): no; calls outside the allowlist: {calls}"


def audit_lines(audit: PickleAudit | None, path: str | None = None) -> list[str]:
    """The audit's table line (none for a checkpoint that is no pickle), after `path: ` where given."""
    if audit is None:
        return []
    return [audit.line() if path is None else f"{path}: {audit.line()}"]


def add_audit(out: dict[str, Any], audit: PickleAudit | None, key: str = "pickle") -> dict[str, Any]:
    """`out` with the audit's JSON object under `key`, where the checkpoint is a pickle; `out` as it was if not."""
    if audit is not None:
        out[key] = audit.fields
    return out


def several_audit_lines(paths_and_audits: Sequence[tuple[str, PickleAudit | None]]) -> list[str]:
    """A line per pickle-based checkpoint of several (`path: pickle: ...`)."""
    return [line for path, audit in paths_and_audits for line in audit_lines(audit, path)]
