"""The comparison as one chart: the relative change of every metric, with its noise band.

One horizontal bar per metric: the relative change of its value from BASE to NEW, in percent.
Behind each bar a grey band spans the noise band the comparison held it to (the minimum
relative change, or the noise of both runs' rounds where that is wider:
dsconform/results/noise.py). Regressions are red (and their labels bold), improvements green,
changes within the band grey. Each label says which way is better. A change from exactly 0 (a
ZeRO difference that drifts from bit-exact) or to or from infinity has no relative size: its
bar is drawn to the edge and annotated ("from 0").

matplotlib is an optional dependency (``pip install 'dsconform[plot]'``): ``require()`` says so
in one line before any work is done.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsconform.results.changes import IMPROVEMENT, METRIC, REGRESSION, UNCHANGED, Change
from dsconform.results.compare import RunComparison
from dsconform.results.render import plots as plotting
from dsconform.results.render.plots import (
    PlotUnavailable as PlotUnavailable,  # callers catch it here
)

COLORS = {REGRESSION: "#d62728", IMPROVEMENT: "#2ca02c", UNCHANGED: "#8c8c8c"}
BAND_COLOR = "#dddddd"
MAX_ROWS = 60  # every regression, then the largest other changes up to this many rows
WORDS = {REGRESSION: "regressions", IMPROVEMENT: "improvements",
         UNCHANGED: "metrics within their noise band"}
MISSING = ("dsconform compare --plot needs matplotlib, which is not installed: "
           "pip install 'dsconform[plot]' (or pip install matplotlib)")


def require() -> None:
    """Raise PlotUnavailable (one line: what to install) when matplotlib cannot be imported."""
    plotting.require(MISSING)


@dataclass(frozen=True)
class Row:
    label: str
    rel: float  # relative change of the value; +-inf: no relative size (from 0, to inf)
    band: float
    kind: str  # REGRESSION, IMPROVEMENT, UNCHANGED
    change: str  # as the report shows it: "+12.3%", "from 0"


def rows(result: RunComparison, max_rows: int = MAX_ROWS) -> tuple[list[Row], str]:
    """The chart's rows, top to bottom: every regression, then improvements and unchanged
    metrics, the largest change for its band first (a share of time that went 0.002% -> 0.1%
    moved +5000% and stayed far inside its band), up to ``max_rows`` in all; and what was left
    out, in words."""
    arrow = {"higher": "↑ better", "lower": "↓ better"}
    out: list[Row] = []
    left_out = []
    for kind in (REGRESSION, IMPROVEMENT, UNCHANGED):
        changes = sorted((c for c in result.of(kind, METRIC) if c.rel is not None),
                         key=lambda c: (-_for_its_band(c), -abs(c.rel)))
        room = len(changes) if kind == REGRESSION else max(0, max_rows - len(out))
        if len(changes) > room:
            left_out.append(f"{len(changes) - room} {WORDS[kind]}")
        out += [Row(f"{c.name} ({arrow.get(c.better, c.better)})", c.rel, c.band or 0.0, kind,
                    c.change) for c in changes[:room]]
    return out, " and ".join(left_out)


def _for_its_band(c: Change) -> float:
    """How much of its band a change used (1: at its edge); a change with no relative size
    (from 0) within an infinite band used none of it."""
    if not c.band:
        return abs(c.rel)
    if math.isinf(c.band):
        return 0.0 if c.kind == UNCHANGED else math.inf
    return abs(c.rel) / c.band


def _limit(rs: list[Row]) -> float:
    finite = [abs(r.rel) for r in rs if math.isfinite(r.rel)] + [
        r.band for r in rs if math.isfinite(r.band)]
    # Room for the largest change, at most +-300% (a larger one is clipped and annotated).
    return min(max(finite + [0.05]) * 1.25, 3.0)


def draw(result: RunComparison, path: str | Path, title: str | None = None) -> Any:
    """Write the chart as a PNG to ``path``; returns the matplotlib Figure (its first axes holds
    one bar per row, in ``rows()`` order)."""
    require()
    import matplotlib

    matplotlib.use("Agg")  # a file, never a window
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle
    from matplotlib.ticker import PercentFormatter

    rs, left_out = rows(result)
    height = max(2.5, 0.32 * len(rs) + 1.6)
    longest = max((len(r.label) for r in rs), default=20)
    fig = Figure(figsize=(min(24.0, 6 + 0.075 * longest), height))
    ax = fig.add_subplot()
    b_ds, n_ds = result.base.env["DeepSpeed"], result.new.env["DeepSpeed"]
    ax.set_title(title or f"relative change per metric: DeepSpeed {b_ds} -> {n_ds} "
                          f"({len(result.of(REGRESSION, METRIC))} regressions)", fontsize=10)
    if not rs:
        ax.text(0.5, 0.5, "no metric was measured in both runs", ha="center", va="center",
                transform=ax.transAxes)
        ax.set_axis_off()
        fig.savefig(path, format="png", dpi=100)
        return fig
    lim = _limit(rs)
    ys = list(range(len(rs)))[::-1]  # first row at the top
    shown = [max(-lim, min(lim, r.rel)) for r in rs]
    for y, r in zip(ys, rs):
        band = min(r.band, lim * 1.35)  # an infinite band (a median of 0) spans the axis
        ax.add_patch(Rectangle((-band, y - 0.42), 2 * band, 0.84, color=BAND_COLOR,
                               zorder=0, linewidth=0))
    ax.barh(ys, shown, height=0.6, color=[COLORS[r.kind] for r in rs], zorder=2)
    for y, r, x in zip(ys, rs, shown):
        text = r.change
        if math.isfinite(r.rel) and abs(r.rel) > lim:
            text += " (clipped)"
        ax.text(x, y, f" {text} ", va="center",
                ha="left" if x >= 0 else "right", fontsize=7, zorder=3)
    ax.axvline(0, color="black", linewidth=0.8, zorder=1)
    ax.set_xlim(-lim * 1.35, lim * 1.35)
    ax.set_ylim(-0.6, len(rs) - 0.4)
    ax.set_yticks(ys, [r.label for r in rs], fontsize=7)
    for tick, r in zip(ax.get_yticklabels(), rs):
        if r.kind == REGRESSION:
            tick.set_color(COLORS[REGRESSION])
            tick.set_fontweight("bold")
    ax.xaxis.set_major_formatter(PercentFormatter(1.0))
    xlabel = ("relative change of the value, NEW vs BASE (grey: noise band; for a value held "
              "to a tolerance, the room before it approaches it)")
    if left_out:
        xlabel += f"\nnot shown: {left_out} (the markdown lists them)"
    ax.set_xlabel(xlabel, fontsize=8)
    handles = [Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in COLORS]
    ax.legend(handles, ["regression", "improvement", "within noise"], fontsize=7,
              loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    return fig
