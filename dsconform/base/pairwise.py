"""Tiers of a test matrix: every pair of axis values in the acceptance tier, the whole cartesian
product in the nightly tier.

``pytest -m gpu`` must accept a node in minutes, yet no check may get weaker: every value of
every axis, and every pair of values of any two axes, still runs. A pairwise covering array does
that with a few dozen cells where the full product has hundreds (the ZeRO matrix: 288 cells per
accelerator). Cells the acceptance tier must hold whatever the pairs (the cases a tolerance entry
or a known issue names) are passed as ``must``. Everything else is marked ``slow`` and runs in
the nightly tier (``-m slow`` or ``-m ""``).

The construction is greedy and deterministic (same axes, same cells, on every machine and run),
so a comparison of two runs compares the same cells.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

Cell = dict[str, Any]


def _pairs(cell: Mapping[str, Any], names: Sequence[str]) -> set[tuple]:
    return {(a, cell[a], b, cell[b]) for a, b in itertools.combinations(names, 2)}


def axis_values(cells: Iterable[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """The axes of a list of cells: {name: its values in the order the cells first show them}."""
    axes: dict[str, list[Any]] = {}
    for cell in cells:
        for name, value in cell.items():
            values = axes.setdefault(name, [])
            if value not in values:
                values.append(value)
    return axes


def pairwise(axes: Mapping[str, Sequence[Any]], *, valid: Callable[[Cell], bool] = lambda c: True,
             must: Iterable[Cell] = ()) -> list[Cell]:
    """A small set of valid cells in which every pair of axis values that occurs in some valid
    cell occurs at least once, starting from ``must`` (kept, in order, first).

    ``axes``: {name: values}; ``valid(cell)`` rejects impossible combinations (offload on stage
    0); ``must`` cells must be valid full cells.
    """
    names = list(axes)
    universe = [dict(zip(names, combo)) for combo in itertools.product(*axes.values())]
    universe = [c for c in universe if valid(c)]
    if not universe:
        return []
    needed = set().union(*(_pairs(c, names) for c in universe))
    chosen: list[Cell] = []
    for cell in must:
        if set(cell) != set(names) or not valid(cell):
            raise ValueError(f"must-cell {cell} is not a valid cell of axes {names}")
        if cell not in chosen:
            chosen.append(dict(cell))
            needed -= _pairs(cell, names)
    remaining = [c for c in universe if c not in chosen]
    while needed:
        best = max(remaining, key=lambda c: len(_pairs(c, names) & needed))
        gain = _pairs(best, names) & needed
        if not gain:  # cannot happen: every needed pair comes from some valid cell
            raise AssertionError(f"pairs not coverable: {sorted(needed)[:3]}")
        chosen.append(best)
        remaining.remove(best)
        needed -= gain
    return chosen


def uncovered_pairs(axes: Mapping[str, Sequence[Any]], cells: Iterable[Mapping[str, Any]], *,
                    valid: Callable[[Cell], bool] = lambda c: True) -> set[tuple]:
    """Pairs of axis values that occur in a valid cell but in none of ``cells`` (empty: the
    cells cover every pair). For tests that the acceptance tier stays complete."""
    names = list(axes)
    universe = [dict(zip(names, combo)) for combo in itertools.product(*axes.values())]
    needed = set().union(set(), *(_pairs(c, names) for c in universe if valid(c)))
    covered = set().union(set(), *(_pairs(c, names) for c in cells))
    return needed - covered


def covering_cases(cases: Sequence[Any], axes_of: Callable[[Any], Mapping[str, Any]], *,
                   must: Iterable[Any] = (),
                   first: Mapping[str, Callable[[Any], Any]] | None = None) -> list[Any]:
    """The cases of a pairwise covering array over the axes the cases show (``axes_of(case)``:
    {axis: value}); only combinations some case has are valid. ``must``: cases the array keeps
    whatever the pairs; ``first``: {axis: sort key} to prefer some values among cells that
    cover as many new pairs (the most ranks, say)."""
    by_axes = {tuple(axes_of(c).items()): c for c in cases}
    axes = axis_values(axes_of(c) for c in cases)
    for name, key in (first or {}).items():
        axes[name].sort(key=key)
    chosen = pairwise(axes, valid=lambda cell: tuple(cell.items()) in by_axes,
                      must=[dict(axes_of(c)) for c in must])
    return [by_axes[tuple(cell.items())] for cell in chosen]
