"""The upgrade radar's timeline as text (terminal) and markdown (timeline.md), and the radar's
report step: the folders of one run per release in, the verdict out (``report``).

Cells: ``pass``, ``FAIL``, ``known``, ``skip``, ``-`` (not in that run); a capability's cell is
passed/failed/known/skipped counts. Changes are listed by the first release that shows them,
those of one release with one cause on one line with their count.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from dsconform.results import format as results_format
from dsconform.results import timeline as tl
from dsconform.results.render import compare as compare_report

SHOWN = {tl.PASSED: "pass", tl.FAILED: "FAIL", tl.KNOWN: "known", tl.SKIPPED: "skip",
         tl.NOT_RUN: "-"}
CASES_SHOWN = 6
TERMINAL_ROWS = 60
REASON_CHARS = 160


def _cell(state: str) -> str:
    return SHOWN.get(state, state)


def _verdict(t: tl.Timeline) -> str:
    first, last = t.labels[0], t.labels[-1]
    return (f"{first} -> {last}: {compare_report.verdict(t.verdict)} "
            f"(dsconform compare of the first release with the last; exit "
            f"{1 if t.regressed else 0})")


def _counts(col: tl.Column) -> str:
    n = col.counts
    return ", ".join(f"{n[s]} {s}" for s in tl.STATES if n[s]) or "nothing ran"


def _short(text: str, limit: int = REASON_CHARS) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def change_lines(t: tl.Timeline) -> list[tuple[str, str]]:
    """(release, one line) per group of changes, in release order."""
    out = []
    for (first, kind, _), changes in t.grouped_changes():
        rows = [c.row for c in changes]
        labels = _labels(rows)
        more = f", ... {len(rows) - CASES_SHOWN} more" if len(rows) > CASES_SHOWN else ""
        c0 = changes[0]
        if kind == tl.MOVED:
            what = f"{c0.row}: {c0.before} -> {c0.after}"
        else:
            what = (f"{len(rows)} x {kind} ({c0.before} -> {c0.after}): "
                    f"{', '.join(labels[:CASES_SHOWN])}{more}")
            if c0.detail:
                what += f" -- {_short(c0.detail)}"
        out.append((first, what))
    return out


def _labels(rows: list[str]) -> list[str]:
    """Rows of one conformance id as ``ZERO-EQ-1[a]``, then ``[b]``, ...: the id once."""
    heads = {r.split("[", 1)[0] for r in rows}
    if len(rows) > 1 and len(heads) == 1 and all("[" in r for r in rows):
        return [rows[0]] + ["[" + r.split("[", 1)[1] for r in rows[1:]]
    return rows


def terminal(t: tl.Timeline, max_rows: int = TERMINAL_ROWS) -> list[str]:
    """The timeline as printed: releases, capabilities, changes, the rows that are not steady,
    the verdict."""
    width = max(7, *(len(x) + 1 for r in [*t.capabilities, *t.tests]
                     for x in (*t.labels, *map(_cell, r.cells))))
    head = "".join(f"{lbl:>{width}}" for lbl in t.labels)
    out = ["releases:"]
    out += [f"  {c.label:<10} DeepSpeed {c.run.env['DeepSpeed']}, torch {c.run.env['torch']}: "
            f"{_counts(c)}" for c in t.columns]
    name_w = 40
    out.append(f"{'capability (pass/fail/known/skip)':<{name_w}}{head}")
    out += [f"{r.key:<{name_w}}" + "".join(f"{_cell(x):>{width}}" for x in r.cells)
            for r in t.capabilities]
    moving = [r for r in t.tests if not r.steady]
    failing = [r for r in t.tests if r.steady and r.cells[0] == tl.FAILED]
    if moving or failing:
        out.append(f"{'tests that change or fail':<{name_w}}{head}")
        for r in (moving + failing)[:max_rows]:
            name = r.key if len(r.key) < name_w else r.key[:name_w - 4] + "..."
            out.append(f"{name:<{name_w}}" + "".join(f"{_cell(x):>{width}}" for x in r.cells))
        if len(moving + failing) > max_rows:
            out.append(f"  ... {len(moving + failing) - max_rows} more rows in timeline.md")
    steady = _steady_text(t)
    out.append(f"steady in every release: {steady}")
    if t.changes:
        out.append("changes, by the first release that shows them:")
        out += [f"  {first}: {line}" for first, line in change_lines(t)]
    out.append(_verdict(t))
    return out


def _steady_text(t: tl.Timeline) -> str:
    n = Counter(r.cells[0] for r in t.tests if r.steady)
    return ", ".join(f"{n[s]} {SHOWN[s]}" for s in (*tl.STATES, tl.NOT_RUN) if n[s]) or "none"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    def esc(x: str) -> str:
        return str(x).replace("|", "\\|")
    out = ["| " + " | ".join(esc(h) for h in header) + " |",
           "| " + " | ".join("---" for _ in header) + " |"]
    out += ["| " + " | ".join(esc(x) for x in r) + " |" for r in rows]
    return out


def markdown(t: tl.Timeline, *, title: str = "", notes: Sequence[str] = ()) -> str:
    labels = t.labels
    out = [f"# {title or 'dsconform radar: DeepSpeed ' + ' -> '.join([labels[0], labels[-1]])}",
           "", f"**{_verdict(t)}**", ""]
    out += [f"> {n}" for n in notes] + ([""] if notes else [])
    out += ["## Releases", ""]
    out += _table(("release", "DeepSpeed", "torch", "passed", "failed", "known", "skipped",
                   "results"),
                  [(c.label, c.run.env["DeepSpeed"], c.run.env["torch"],
                    *(str(c.counts[s]) for s in tl.STATES), f"`{c.source}`")
                   for c in t.columns])
    out += ["", "## Changes, by the first release that shows them", ""]
    lines = change_lines(t)
    out += [f"- **{first}**: {line}" for first, line in lines] or ["None: every row is the "
                                                                   "same in every release."]
    out += ["", "## Capabilities (passed/failed/known/skipped)", ""]
    out += _table(("capability", *labels), [(r.key, *r.cells) for r in t.capabilities])
    if t.known_issues:
        out += ["", "## Known issues and torch incompatibilities (cases covered)", ""]
        out += _table(("entry", *labels), [(r.key, *r.cells) for r in t.known_issues])
    moved = [r for r in t.facts if len({v for v in r.cells if v != tl.NOT_RUN}) > 1]
    out += ["", f"## Facts that moved ({len(moved)} of {len(t.facts)} recorded)", ""]
    if moved:
        out += _table(("fact", *labels), [(r.key, *r.cells) for r in moved])
    else:
        out.append("None." if t.facts else "No run recorded facts (ZERO-DEF-1 did not run).")
    moving = [r for r in t.tests if not r.steady]
    out += ["", f"## Tests ({len(moving)} of {len(t.tests)} change across releases; steady: "
                f"{_steady_text(t)})", ""]
    ordered = moving + [r for r in t.tests if r.steady]
    out += _table(("test", *labels), [(r.key, *(_cell(x) for x in r.cells)) for r in ordered])
    regressions = t.verdict.of(compare_report.REGRESSION)
    if regressions:
        out += ["", f"## Regressions from {labels[0]} to {labels[-1]}", ""]
        out += _table(("what", "detail"), [(c.name, _short(c.detail)) for c in regressions])
    return "\n".join(out) + "\n"


def _shown_path(folder: Path, out: Path) -> str:
    """A release's folder as the report names it: relative to ``out`` when inside it (the
    report then reads the same wherever the folder is copied)."""
    try:
        return str(folder.resolve().relative_to(out.resolve()))
    except ValueError:
        return str(folder)


def summary_json(t: tl.Timeline) -> dict:
    """A small per-release summary: what each column ran and how it ended, and the changes."""
    return {
        "releases": [{"release": c.label, "deepspeed": c.run.env["DeepSpeed"],
                      "torch": c.run.env["torch"], "source": c.source,
                      "counts": {s: c.counts[s] for s in tl.STATES},
                      "known_issues": sorted({o["known_issue"] for o in c.run.outcomes.values()
                                              if o.get("known_issue")})}
                     for c in t.columns],
        "changes": [{"first": c.first, "kind": c.kind, "row": c.row, "before": c.before,
                     "after": c.after, "detail": _short(c.detail, 300)} for c in t.changes],
        "regressed": t.regressed,
        "regressions": [c.name for c in t.verdict.of(compare_report.REGRESSION)],
    }


def report(columns: Sequence[tuple[str, str]], out: str | Path, *, plot: bool = True,
           threshold: float = 0.10, notes: Sequence[str] = ()) -> int:
    """The radar's last step: read each release's results folder, print the timeline, write
    timeline.md, timeline.json and (with matplotlib) timeline.png into ``out``. Exit code as
    ``dsconform compare``: 0 no regression from the first release to the last, 1 regression,
    2 unusable input (said in one line)."""
    from dsconform.results.render import timeline_chart

    docs = []
    for label, folder in columns:
        try:
            doc = results_format.load_benchmarks(folder)
        except results_format.ResultsFormatError as e:
            print(f"dsconform radar: {label}: {e}", file=sys.stderr)
            return 2
        if results_format.ran_nothing(doc):
            print(f"dsconform radar: {label}: {folder} recorded no test outcome: nothing to "
                  "put on the timeline (did its run start?)", file=sys.stderr)
            return 2
        docs.append((label, doc, _shown_path(Path(folder), Path(out))))
    try:
        t = tl.build(docs, threshold)
    except ValueError as e:
        print(f"dsconform radar: {e}", file=sys.stderr)
        return 2
    print("\n".join(terminal(t)))
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "timeline.md").write_text(markdown(t, notes=notes))
        (out / "timeline.json").write_text(json.dumps(summary_json(t), indent=1) + "\n")
        print(f"markdown: {out / 'timeline.md'}", file=sys.stderr)
        if plot:
            try:
                timeline_chart.draw(t, out / "timeline.png")
                print(f"chart: {out / 'timeline.png'}", file=sys.stderr)
            except timeline_chart.PlotUnavailable as e:
                print(f"dsconform radar: no chart: {e}", file=sys.stderr)
    except OSError as e:
        print(f"dsconform radar: cannot write {e.filename}: {e.strerror or e}", file=sys.stderr)
        return 2
    return 1 if t.regressed else 0
