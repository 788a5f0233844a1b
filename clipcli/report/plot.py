"""The figure of a `trajectory` (`--plot`): its norms, its steps' ‖Δ‖ and cosines, as PNG or SVG bytes."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

from clipcli.errors import UsageError
from clipcli.report.trajectory import TrajectoryReport

WIDTH, HEIGHT, DPI = 8, 9, 100  # inches and dots per inch: a PNG of 800x900 pixels
FORMATS = {".png": "png", ".svg": "svg"}


def figure_bytes(report: TrajectoryReport, suffix: str) -> bytes:
    """The trajectory drawn in three panels over the steps (or the checkpoints' positions where a name has no
    step): the global norm (one line per group with --depth), ‖Δ‖ to the previous checkpoint (identical ones
    marked), and the cosine to the first. A panel whose values spread over more than two decades is drawn on
    a log scale.

    Raises:
        UsageError: for a suffix other than .png and .svg, or without matplotlib (the `plot` extra).
    """
    kind = FORMATS.get(suffix.lower())
    if kind is None:
        raise UsageError(f"--plot draws .png or .svg files, not {suffix or 'a file without a suffix'}", param="--plot")
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display, whatever the environment says
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'clipcli[plot]'", param="--plot") from None
    steps = report.steps
    numbered = all(s.step is not None for s in steps) and len({s.step for s in steps}) == len(steps)
    x = [s.step if numbered else i + 1 for i, s in enumerate(steps)]
    fig = Figure(figsize=(WIDTH, HEIGHT), dpi=DPI, layout="constrained")
    norm_ax, delta_ax, cos_ax = fig.subplots(3, 1, sharex=True)
    names = list(dict.fromkeys(g.name for s in steps for g in s.groups))
    if names:
        for name in names:
            values = [next((g.norm for g in s.groups if g.name == name), math.nan) for s in steps]
            norm_ax.plot(x, values, marker="o", label=name)
            deltas = [_value(next((g.delta for g in s.groups if g.name == name), None)) for s in steps]
            delta_ax.plot(x, deltas, marker="o", label=name)
        norm_ax.legend(fontsize="small", ncol=2)
    else:
        norm_ax.plot(x, [s.global_norm for s in steps], marker="o", label="global norm")
        delta_ax.plot(x, [_value(s.delta) for s in steps], marker="o", label="‖Δ‖ to the previous")
    same = [(xi, s) for xi, s in zip(x, steps, strict=True) if s.identical]
    if same:
        delta_ax.plot(
            [xi for xi, _ in same], [0.0 for _ in same], "rx", markersize=10, label="identical to the previous"
        )
        delta_ax.legend(fontsize="small")
    cos_ax.plot(x, [_value(s.cosine_first) for s in steps], marker="o", color="tab:green")
    norm_ax.set_ylabel("norm" if names else "global norm")
    delta_ax.set_ylabel("‖Δ‖ to the previous")
    cos_ax.set_ylabel("cosine to the first")
    cos_ax.set_xlabel("step" if numbered else "checkpoint")
    for ax in (norm_ax, delta_ax):
        _scale(ax, [v for line in ax.get_lines() for v in line.get_ydata()])
    for ax in (norm_ax, delta_ax, cos_ax):
        ax.grid(True, alpha=0.3)
    if not numbered:
        cos_ax.set_xticks(x)
    fig.suptitle(f"trajectory of {len(steps)} checkpoints")
    out = io.BytesIO()
    fig.savefig(out, format=kind, dpi=DPI, metadata={"Software": None} if kind == "png" else {"Date": None})
    return out.getvalue()


def _value(x: float | None) -> float:
    return math.nan if x is None else x


def _scale(ax: object, values: Sequence[float]) -> None:
    """A log scale where the positive values spread over more than two decades."""
    positive = [v for v in values if v > 0 and math.isfinite(v)]
    if positive and max(positive) / min(positive) > 100:
        ax.set_yscale("log")  # type: ignore[attr-defined]
