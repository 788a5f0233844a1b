"""The reports of the clip commands: each tensor's norm before and after, the global norms, where it went."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from clipcli.errors import shown_path
from clipcli.report.norms import Norms, csv_header, norm_name
from clipcli.report.render import SCHEMA, Report, csv_num, fmt, num, plural


@dataclass(frozen=True, kw_only=True)
class ClipReport(Norms, Report):
    """What a clip command did to one checkpoint (`global_norm` before, `global_norm_after`, the output: None on
    a dry run); each clip command's report adds its bounds."""

    command: ClassVar[str]
    global_norm_after: float | None = None
    output: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.output is not None:
            object.__setattr__(self, "output", shown_path(self.output))

    def _bounds(self) -> dict[str, float]:
        """The command's bounds as the JSON names them."""
        raise NotImplementedError

    def _what(self) -> str:
        """What the clip did, for the headline."""
        raise NotImplementedError

    def _after(self) -> str:
        return f"{norm_name(2.0)} {fmt(self.global_norm)} -> {fmt(self.global_norm_after)}"

    def _json(self) -> dict[str, Any]:
        one = self._checkpoint_json(clip=True)
        one.update({k: num(v) for k, v in self._bounds().items()})
        one["global_norm_after"] = num(self.global_norm_after)
        one["max_abs_after"] = num(self.summary.max_abs_after)
        one["output"] = self.output
        return {"schema": SCHEMA, "command": self.command, "ord": 2, "checkpoints": [one]}

    def _csv(self, w: Any) -> None:
        w.writerow(csv_header(clip=True))
        self._tensor_rows(w, clip=True)
        w.writerow(
            [*self._global_row(), csv_num(self.global_norm_after), csv_num(self.summary.max_abs_after), "global"]
        )

    def _blocks(self) -> list[list[str]]:
        skipped = f", {len(self.skipped):,} skipped" if self.skipped else ""
        target = "dry run, nothing written" if self.output is None else f"written to {self.output}"
        head = f"{self.path}: {self._what()} over {plural(self.summary.tensors, 'tensor')}{skipped}; {target}"
        return [self._lines(head, clip=True) + self._tail(written=self.output is not None)]


@dataclass(frozen=True, kw_only=True)
class ClipValueReport(ClipReport):
    """`clip-value`: every selected real floating tensor clipped to [min, max]."""

    command: ClassVar[str] = "clip-value"
    min: float
    max: float

    def _bounds(self) -> dict[str, float]:
        return {"min": self.min, "max": self.max}

    def _what(self) -> str:
        return f"clipped to [{fmt(self.min)}, {fmt(self.max)}]: {self._after()}"


@dataclass(frozen=True, kw_only=True)
class ClipNormReport(ClipReport):
    """`clip-norm`: each selected tensor (or slice along --axes) scaled to a norm of at most `clip_norm`."""

    command: ClassVar[str] = "clip-norm"
    clip_norm: float

    def _bounds(self) -> dict[str, float]:
        return {"clip_norm": self.clip_norm}

    def _what(self) -> str:
        return f"clip norm {fmt(self.clip_norm)}: {self._after()}"


@dataclass(frozen=True, kw_only=True)
class ClipGlobalNormReport(ClipReport):
    """`clip-global-norm`: every selected tensor scaled by one `scale`, to a global norm of at most `clip_norm`."""

    command: ClassVar[str] = "clip-global-norm"
    clip_norm: float
    scale: float

    def _bounds(self) -> dict[str, float]:
        return {"clip_norm": self.clip_norm, "scale": self.scale}

    def _what(self) -> str:
        return f"{self._after()} (scale {fmt(self.scale)})"


@dataclass(frozen=True)
class ClipGlobalNormsReport(Report):
    """`clip-global-norm` of several checkpoints together: the global norm over all of them before and after, the
    one scale, and each checkpoint's own report."""

    command: ClassVar[str] = "clip-global-norm"
    clip_norm: float
    scale: float
    global_norm: float
    global_norm_after: float
    checkpoints: tuple[ClipGlobalNormReport, ...]

    def _json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema": SCHEMA, "command": self.command, "ord": 2}
        out["combined"] = {
            "global_norm": num(self.global_norm),
            "clip_norm": num(self.clip_norm),
            "scale": num(self.scale),
            "global_norm_after": num(self.global_norm_after),
        }
        out["checkpoints"] = [c._json()["checkpoints"][0] for c in self.checkpoints]
        return out

    def _csv(self, w: Any) -> None:
        w.writerow(csv_header(clip=True))
        for c in self.checkpoints:
            c._tensor_rows(w, clip=True)
            row = [*c._global_row(), csv_num(c.global_norm_after), csv_num(c.summary.max_abs_after), "global"]
            w.writerow(row)
        combined = ["", "", "", "", csv_num(self.global_norm), "", "", "", "", csv_num(self.global_norm_after), ""]
        w.writerow([*combined, "combined"])

    def _blocks(self) -> list[list[str]]:
        n = len(self.checkpoints)
        head = (
            f"{n} checkpoints combined: {norm_name(2.0)} {fmt(self.global_norm)} -> {fmt(self.global_norm_after)} "
            f"(scale {fmt(self.scale)}, clip norm {fmt(self.clip_norm)})"
        )
        return [[head], *(c._blocks()[0] for c in self.checkpoints)]
