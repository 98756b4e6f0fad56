"""A comparison of two runs (``dsconform.results.compare``) as the terminal table and as markdown.

Both are rendered from the same sections, in the order a user reads them after an upgrade:
the environment, what stopped working, what got slower or drifted, what silently changed, the
known upstream issues that appeared or went away, what improved or was fixed, then the rest
(other outcome changes, new and vanished tests, what could not be compared, renamed tests).
The four headline sections are always shown, with "none" when empty: "nothing stopped working"
is an answer too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from dsconform.results import noise
from dsconform.results.changes import (
    CHANGED,
    FACT,
    IMPROVEMENT,
    KNOWN_ISSUE,
    METRIC,
    NEW,
    NOT_COMPARABLE,
    NOT_JUDGED,
    OUTCOME,
    REGRESSION,
    RENAMED,
    UNCHANGED,
    VANISHED,
    Change,
)
from dsconform.results.compare import BOUND_APPROACH, RunComparison

ROWS_SHOWN = 40  # per section of the terminal table; the markdown lists every row
JSON_FORMAT = "dsconform-compare/1"


@dataclass
class Section:
    title: str
    columns: tuple[str, ...]
    rows: list[tuple[str, ...]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    always: bool = False  # shown (with "none") when empty


def _band(c: Change) -> str:
    if c.bound is not None:  # judged by its bound, not by a share of its own value
        return f"bound {c.bound:.4g}"
    if c.band is None:
        return ""
    return f"±{c.band:.1%}" + ("" if c.noise_known else ", noise unknown")


def _why(c: Change) -> str:
    """An outcome change's reason: what follows 'base -> new' in its detail."""
    return c.detail.split(": ", 1)[1] if ": " in c.detail else ""


def sections(result: RunComparison) -> list[Section]:
    base, new = result.base, result.new
    env = Section("Environment", ("", "base", "new", ""), always=True)
    for label, b in base.env.items():
        n = new.env[label]
        env.rows.append((label, b, n, "changed" if b != n else ""))

    stopped = Section("What stopped working", ("test", "base", "new", "reason"), always=True)
    stopped.rows = [(c.name, c.base, c.new, _why(c)) for c in result.of(REGRESSION, OUTCOME)]
    not_run = sum(1 for c in result.of(REGRESSION, OUTCOME) if c.new == "not run")
    if not_run:
        stopped.notes.append(f"{not_run} tests that passed in BASE did not run in NEW: removed, "
                             "or NEW ran a smaller selection (compare runs of the same files, "
                             "-m and -k)")

    slower = Section("What got slower or drifted", ("metric", "base", "new", "change",
                                                    "noise band", "better"), always=True)
    for c in result.of(REGRESSION, METRIC):
        slower.rows.append((c.name, c.base, c.new, c.change + (f", {c.beyond}" if c.beyond else ""),
                            _band(c), c.better))

    silent = Section("What silently changed", ("fact", "base", "new"), always=True,
                     notes=list(result.notes))
    silent.rows = [(c.name, c.base, c.new) for c in result.of(CHANGED, FACT)]
    only = [(lbl, len(result.of(kind, FACT))) for lbl, kind in (("NEW", NEW), ("BASE", VANISHED))]
    for lbl, count in only:
        if count:
            silent.notes.append(f"{count} facts recorded only in {lbl} (tests that ran in one "
                                "run only)")

    issues = Section("Known upstream issues", ("issue", "base", "new", "what"))
    for c in result.of(NEW, KNOWN_ISSUE) + result.of(VANISHED, KNOWN_ISSUE) + result.of(
            CHANGED, KNOWN_ISSUE):
        issues.rows.append((c.name, c.base, c.new, c.detail))

    fixed = Section("What improved or was fixed", ("test or metric", "base", "new", "change"),
                    always=True)
    fixed.rows = [(c.name, c.base, c.new, _why(c)) for c in result.of(IMPROVEMENT, OUTCOME)]
    fixed.rows += [(c.name, c.base, c.new, f"{c.change} ({c.better} is better, {_band(c)})")
                   for c in result.of(IMPROVEMENT, METRIC)]

    other = Section("Other outcome changes", ("test", "base", "new", "reason"))
    other.rows = [(c.name, c.base, c.new, _why(c)) for c in result.of(CHANGED, OUTCOME)]

    appeared = Section("New and vanished tests and metrics", ("test or metric", "", "detail"))
    for kind, area in ((NEW, OUTCOME), (VANISHED, OUTCOME), (NEW, METRIC), (VANISHED, METRIC)):
        appeared.rows += [(c.name, kind, c.detail) for c in result.of(kind, area)]

    incomparable = Section("Not comparable", ("metric", "why"))
    incomparable.rows = [(c.name, c.detail) for c in result.of(NOT_COMPARABLE)]

    unjudged = Section("Not judged (reported, never a regression)",
                       ("metric", "base", "new", "change", "why"))
    unjudged.rows = [(c.name, c.base, c.new, c.change, c.detail.split("not judged: ", 1)[-1])
                     for c in result.of(NOT_JUDGED)]

    renamed = Section("Matched by conformance id across a rename", ("id", "base test -> new test"))
    renamed.rows = [(c.name, c.detail) for c in result.of(RENAMED)]
    return [env, stopped, slower, silent, issues, fixed, other, appeared, incomparable, unjudged,
            renamed]


def verdict(result: RunComparison) -> str:
    regressions = result.of(REGRESSION)
    if not regressions:
        return "no regression"
    outcomes = sum(1 for c in regressions if c.area == OUTCOME)
    return (f"REGRESSION: {len(regressions)} ({outcomes} outcomes, "
            f"{len(regressions) - outcomes} metrics)")


def tally(result: RunComparison) -> str:
    metrics = result.of(UNCHANGED, METRIC)
    unknown = sum(1 for c in metrics if not c.noise_known)
    bounded = sum(1 for c in metrics if c.bound is not None)
    incomparable = len(result.of(NOT_COMPARABLE))
    unjudged = len(result.of(NOT_JUDGED))
    # Metrics whose parameters or units differ were not compared: say how many, so a change of
    # parameters (a tolerance override, another world size) cannot hide a metric silently.
    return (f"unchanged: {len(metrics)} metrics within their noise band ({unknown} of them "
            f"measured once: noise unknown)"
            + (f" or their bound ({bounded} metrics judged by the tolerance their test holds "
               "them to)" if bounded else "")
            + f", {len(result.of(UNCHANGED, OUTCOME))} outcomes, "
            f"{len(result.of(UNCHANGED, FACT))} facts"
            + (f"; not judged: {unjudged} metrics (see 'Not judged')" if unjudged else "")
            + (f"; NOT COMPARED: {incomparable} metrics (see 'Not comparable')"
               if incomparable else ""))


def _warning_lines(result: RunComparison) -> list[str]:
    if not result.warnings:
        return []
    return ["WARNING: these runs are of DIFFERENT HARDWARE; differences may come from the "
            "machines, not from the software (--strict makes this exit 2): "
            + "; ".join(result.warnings)]


def _cap(rows: list[tuple[str, ...]]) -> tuple[list[tuple[str, ...]], int]:
    return rows[:ROWS_SHOWN], max(0, len(rows) - ROWS_SHOWN)


def terminal(result: RunComparison) -> list[str]:
    """The terminal table: one block per section, columns aligned."""
    lines = [f"dsconform compare: BASE {result.base.label} -> NEW {result.new.label}"]
    lines += _warning_lines(result)
    for s in sections(result):
        if not s.rows and not s.always:
            continue
        count = f" ({len(s.rows)})" if s.title != "Environment" else ""
        lines.append(f"== {s.title}{count} ==")
        rows, more = _cap(s.rows)
        if rows:
            lines += _aligned([s.columns] + rows)
        elif not s.notes:
            lines.append("  none")
        if more:
            lines.append(f"  ... {more} more (the markdown report lists them all)")
        lines += [f"  note: {n}" for n in s.notes]
    lines.append(tally(result))
    lines.append(verdict(result))
    return lines


def _aligned(rows: Sequence[tuple[str, ...]]) -> list[str]:
    # The last column is free text (a reason): not padded, so long reasons do not widen the rest.
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    out = []
    for r in rows:
        cells = [c.ljust(w) for c, w in zip(r, widths)] + [r[-1]]
        out.append(("  " + "  ".join(cells)).rstrip())
    return out


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def rule(threshold: float) -> str:
    """How metrics were judged, in two sentences (dsconform/results/noise.py)."""
    families = ", ".join(f"±{r.value:.0%} for {prefix}*" for prefix, r in
                         noise.MIN_CHANGE.items())
    return (f"A metric counts as changed beyond {noise.NOISE_SPREADS.value:g} times the pooled "
            "spread of both runs' rounds and beyond a minimum relative change "
            f"(±{threshold:.0%}; {families}); one-off costs, timings under "
            f"{noise.MIN_SECONDS.value * 1e6:g} us and shares of time that moved under "
            f"{noise.PERCENT_POINTS.value:g} point are not judged. A value past its enforced "
            "limit is a regression however small; a value its test holds to a tolerance counts "
            f"only when it crosses it or passes {BOUND_APPROACH:.0%} of it.")


def markdown(result: RunComparison) -> str:
    """The comparison as markdown, for a pull request or a wiki page: every row, no cap."""
    b_ds, n_ds = result.base.env["DeepSpeed"], result.new.env["DeepSpeed"]
    title = (f"DeepSpeed {b_ds} -> {n_ds}" if b_ds != n_ds
             else f"{result.base.label} -> {result.new.label}")
    out = [f"# dsconform comparison: {title}", "",
           f"BASE `{result.base.label}`, NEW `{result.new.label}`. "
           f"**{verdict(result)}**; {tally(result)}. {rule(result.threshold)}", ""]
    for w in _warning_lines(result):
        out += [f"> **{w}**", ""]
    for s in sections(result):
        if not s.rows and not s.always:
            continue
        out += [f"## {s.title}", ""]
        if s.rows:
            out.append("| " + " | ".join(_md(c) for c in s.columns) + " |")
            out.append("|" + " --- |" * len(s.columns))
            for r in s.rows:
                cells = [_md(c) for c in r]
                if s.title == "Environment" and r[-1]:
                    cells[2] = f"**{cells[2]}**"
                out.append("| " + " | ".join(cells) + " |")
        elif not s.notes:
            out.append("None.")
        out += [f"_{_md(n)}_" for n in s.notes]
        out.append("")
    return "\n".join(out)


def as_json(result: RunComparison) -> dict[str, Any]:
    """The whole comparison as data (``--json FILE``): every change with its full values (a
    long fact's, which the table and the markdown summarise), the environments, the verdict."""
    return {
        "format": JSON_FORMAT,
        "base": {"label": result.base.label, "environment": result.base.env},
        "new": {"label": result.new.label, "environment": result.new.env},
        "threshold": result.threshold,
        "regressed": result.regressed,
        "verdict": verdict(result),
        "rule": rule(result.threshold),
        "noise_rules": noise.rules(),
        "warnings": list(result.warnings),
        "notes": list(result.notes),
        "changes": [asdict(c) for c in result.changes],
    }
