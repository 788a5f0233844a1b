"""The pickle audit a command's report carries, from the audits of a checkpoint's pickle files."""

from __future__ import annotations

from clipcli.checkpoint import Checkpoint
from clipcli.report.audit import PickleAudit


def pickle_audit(ckpt: Checkpoint) -> PickleAudit | None:
    """The pickle audit every report on a pickle-based checkpoint carries (the JSON's `pickle`), else None: over
    several pickle files (PyTorch shards), each global's uses summed ("call" if any file calls it), and loaded
    only if every file loads."""
    audits = ckpt.pickle_audits
    if not audits:
        return None
    unsafe = tuple(sorted({name for a in audits for name in a.unsafe_calls}))
    if len(audits) == 1:
        return PickleAudit(audits[0].to_dict(), unsafe, audits[0].loader)
    uses: dict[str, list[int]] = {}  # name: [references, calls]
    for audit in audits:
        for g in audit.globals:
            counts = uses.setdefault(g.name, [0, 0])
            counts[g.use == "call"] += g.count
    fields = {
        "loads_with_weights_only": all(a.loads_with_weights_only for a in audits),
        "globals": [
            {"name": name, "use": "call" if calls else "name", "count": calls or refs}
            for name, (refs, calls) in sorted(uses.items())
        ],
    }
    return PickleAudit(fields, unsafe, audits[0].loader)
