"""The upgrade radar's timeline as one chart (timeline.png).

Top: per release, a stacked bar of its tests by state (passed, failed, known, skipped). Below:
a grid with one row per test whose state changes across the releases (or fails in all of
them), one column per release, each cell coloured by its state; the release where a row
changes is where its colour does.

matplotlib is an optional dependency (``pip install 'dsconform[plot]'``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dsconform.results import timeline as tl
from dsconform.results.render import plots as plotting
from dsconform.results.render.plots import (
    PlotUnavailable as PlotUnavailable,  # callers catch it here
)

COLORS = {tl.PASSED: "#2ca02c", tl.FAILED: "#d62728", tl.KNOWN: "#ff7f0e",
          tl.SKIPPED: "#bdbdbd", tl.NOT_RUN: "#ffffff"}
MAX_ROWS = 60
MISSING = ("dsconform radar's chart needs matplotlib, which is not installed: "
           "pip install 'dsconform[plot]' (or pip install matplotlib); timeline.md is written "
           "without it")


def require() -> None:
    plotting.require(MISSING)


def rows(t: tl.Timeline, max_rows: int = MAX_ROWS) -> tuple[list[tl.Row], int]:
    """The grid's rows (changing tests, then tests failing everywhere) and how many were left
    out."""
    chosen = [r for r in t.tests if not r.steady]
    chosen += [r for r in t.tests if r.steady and r.cells[0] == tl.FAILED]
    return chosen[:max_rows], max(0, len(chosen) - max_rows)


def draw(t: tl.Timeline, path: str | Path) -> Any:
    """Write the chart as a PNG; returns the matplotlib Figure."""
    require()
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    grid, left_out = rows(t)
    labels = t.labels
    # Sizes in inches: the bars 2 in tall, each grid row 0.2 in, the labels' width to the left.
    longest = max((len(r.key) for r in grid), default=20)
    label_in = min(7.0, 0.055 * longest + 0.3)
    width = max(9.0, label_in + 1.4 + 0.6 * len(labels))
    grid_in = 0.2 * len(grid) + (0.9 if grid else 0)
    height = 3.0 + grid_in
    fig = Figure(figsize=(width, height))
    left, right = label_in / width, 1 - 1.3 / width
    ax_bar = fig.add_axes((left, (grid_in + 0.6) / height, right - left, 1.9 / height))
    xs = list(range(len(labels)))
    bottom = [0] * len(labels)
    for s in tl.STATES:
        n = [c.counts[s] for c in t.columns]
        ax_bar.bar(xs, n, bottom=bottom, color=COLORS[s], label=s, width=0.7)
        bottom = [b + v for b, v in zip(bottom, n)]
    ax_bar.set_xticks(xs, labels, fontsize=7)
    ax_bar.set_xlim(-0.5, len(labels) - 0.5)
    ax_bar.set_ylabel("tests", fontsize=8)
    verdict = "REGRESSION" if t.regressed else "no regression"
    ax_bar.set_title(f"dsconform radar: tests by state per DeepSpeed release ({labels[0]} -> "
                     f"{labels[-1]}: {verdict})", fontsize=9)
    ax_bar.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax_bar.tick_params(labelsize=7)
    if grid:
        ax = fig.add_axes((left, 0.45 / height, right - left, (0.2 * len(grid)) / height))
        for y, r in enumerate(reversed(grid)):
            for x, s in enumerate(r.cells):
                ax.add_patch(Rectangle((x - 0.45, y - 0.4), 0.9, 0.8, color=COLORS[s],
                                       linewidth=0))
        ax.set_xlim(-0.5, len(labels) - 0.5)
        ax.set_ylim(-0.6, len(grid) - 0.4)
        ax.set_xticks(xs, labels, fontsize=7)
        ax.xaxis.tick_top()
        ax.set_yticks(range(len(grid)), [r.key for r in reversed(grid)], fontsize=6)
        more = f" ({left_out} more in timeline.md)" if left_out else ""
        ax.set_xlabel(f"tests whose state changes across releases or that fail in all{more}\n"
                      "green passed, red failed, orange known, grey skipped, white not run",
                      fontsize=7)
    fig.savefig(path, format="png", dpi=100)
    return fig
