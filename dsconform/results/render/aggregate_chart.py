"""The cluster's performance as one picture: a heat map of nodes (rows) by metrics (columns).

Each cell is the node's performance relative to the median of that metric among the nodes of
its type (the same profile and GPUs), direction-aware (a rate divided by the median rate, the
median time divided by a time): 100% is the median, 80% a fifth slower. Cells below the outlier
threshold are outlined; failing nodes' names are red. Only performance metrics measured on two
or more nodes of one type appear (dsconform/results/aggregate.py). matplotlib is optional
(``pip install 'dsconform[plot]'``): ``require()`` says so in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dsconform.results.aggregate import ClusterReport
from dsconform.results.render import plots as plotting
from dsconform.results.render.plots import (
    PlotUnavailable as PlotUnavailable,  # callers catch it here
)

MISSING = ("dsconform aggregate: heatmap.png not written: matplotlib is not installed "
           "(pip install 'dsconform[plot]', or pip install matplotlib); the other reports are "
           "written")
MAX_COLUMNS = 60  # the metrics with the worst node first, when there are more
LOW, HIGH = 0.5, 1.5  # colour scale, as a fraction of the median of the node's type


def require() -> None:
    """Raise PlotUnavailable (one line: what to install) when matplotlib cannot be imported."""
    plotting.require(MISSING)


def columns(report: ClusterReport, max_columns: int = MAX_COLUMNS) -> list[str]:
    """The metrics shown, worst node first when they do not all fit."""
    keys = sorted(report.metrics, key=lambda k: min(report.metrics[k].values()))
    return sorted(keys[:max_columns])


def draw(report: ClusterReport, path: str | Path) -> Any:
    """Write the heat map as a PNG; returns the matplotlib Figure."""
    require()
    import matplotlib

    matplotlib.use("Agg")  # a file, never a window
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    cols = columns(report)
    nodes = [n for n in report.nodes if any(n.name in report.metrics[k] for k in cols)]
    width = min(30.0, 3 + 0.55 * max(len(cols), 4))
    height = min(30.0, 2.5 + 0.35 * max(len(nodes), 2))
    fig = Figure(figsize=(width, height))
    ax = fig.add_subplot()
    ax.set_title(f"performance relative to the median of the node's type (outlier below "
                 f"{report.outlier_pct:g}%)", fontsize=10)
    if not cols:
        ax.text(0.5, 0.5, "no performance metric was measured on two or more nodes",
                ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        fig.savefig(path, format="png", dpi=100)
        return fig
    nan = float("nan")
    grid = [[report.metrics[k].get(n.name, nan) for k in cols] for n in nodes]
    image = ax.imshow(grid, cmap="RdYlGn", vmin=LOW, vmax=HIGH, aspect="auto")
    threshold = report.outlier_pct / 100
    for y, row in enumerate(grid):
        for x, r in enumerate(row):
            if r != r:  # NaN: not measured on this node
                continue
            ax.text(x, y, f"{r:.0%}", ha="center", va="center", fontsize=7)
            if r < threshold:
                ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, linewidth=2,
                                       edgecolor="black"))
    ax.set_xticks(range(len(cols)))
    ax.set_xticklabels([_short(k) for k in cols], rotation=60, ha="right", fontsize=7)
    ax.set_yticks(range(len(nodes)))
    ax.set_yticklabels([n.name for n in nodes], fontsize=8)
    for label, n in zip(ax.get_yticklabels(), nodes):
        if n.failed:
            label.set_color("red")
    fig.colorbar(image, ax=ax, format=lambda v, _: f"{v:.0%}", shrink=0.8)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    return fig


def _short(key: str, limit: int = 48) -> str:
    return key if len(key) <= limit else "..." + key[-(limit - 3):]
