"""The upgrade radar's timeline: one run of the suite per DeepSpeed release, side by side.

Columns are releases in version order; each is a results document (``benchmarks.json``) of one
run of the same selection. Rows are:

- **tests**, by the stable id ``dsconform compare`` matches on (``ZERO-EQ-1[cpu-z1-...]``); a
  cell is ``passed``, ``failed`` (failed, error, or a strict xfail that passed), ``known`` (a
  strict xfail: a known upstream issue, a torch incompatibility, or the suite's own named
  limitation), ``skipped``, or ``-`` (not in that run);
- **capabilities** (the suites): the counts of each state;
- **known issues**: the cases each registry entry covered in each run;
- **facts**: what a test found rather than judged, such as the 54 DeepSpeed defaults ZERO-DEF-1
  pins.

A **change** is a row whose state (or a fact's value) differs from the previous column's; it is
named by the first release that shows it: a failure that appears or goes away, a known issue
that starts or ends, a feature removed (a skip whose reason names a removal), a default that
moved. The **verdict** is ``dsconform compare`` of the first column with the last: exit 0 no
regression, 1 a regression (``compare``'s rules, bounds included).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from dsconform.results import compare
from dsconform.results.summary import reason_key

PASSED, FAILED, KNOWN, SKIPPED, NOT_RUN = "passed", "failed", "known", "skipped", "-"
STATES = (PASSED, FAILED, KNOWN, SKIPPED)
_STATE = {"passed": PASSED, "failed": FAILED, "error": FAILED, "xpassed": FAILED,
          "xfailed": KNOWN, "skipped": SKIPPED}
#: A skip that says a feature was removed upstream (dsconform/base/removed.py words it so).
REMOVED = re.compile(r"removed in DeepSpeed (\S+)")

# Change kinds, in the order a reader wants them.
FAILS, FIXED, KNOWN_FROM, KNOWN_GONE, REMOVED_FROM, SKIPS, RUNS, NOT_RUN_FROM, MOVED = (
    "fails", "passes again", "known issue", "known issue gone", "removed", "skipped", "runs",
    "not run", "default moved")
KINDS = (FAILS, FIXED, KNOWN_FROM, KNOWN_GONE, REMOVED_FROM, SKIPS, RUNS, NOT_RUN_FROM, MOVED)


def state(outcome: dict[str, Any] | None) -> str:
    """A test cell: passed, failed, known, skipped, or "-" (not in the run)."""
    return NOT_RUN if outcome is None else _STATE[outcome["outcome"]]


@dataclass
class Column:
    """One release's run."""
    label: str  # the release: "0.19.8"
    run: compare.Run
    doc: dict[str, Any]
    source: str = ""  # where its results are

    @property
    def counts(self) -> Counter:
        return Counter(state(o) for o in self.run.outcomes.values())


@dataclass
class Row:
    key: str  # the stable id, capability, issue id or fact name
    kind: str  # "test", "capability", "known issue", "fact"
    cells: list[str]
    reasons: list[str] = field(default_factory=list)  # per column: skip / failure reason
    issues: list[str] = field(default_factory=list)  # per column: the known issue's id

    @property
    def steady(self) -> bool:
        return len(set(self.cells)) == 1


@dataclass(frozen=True)
class Change:
    """A row's state (or a fact's value) differs from the previous release's: ``first`` is the
    first release that shows it."""
    kind: str  # FAILS, FIXED, ...
    row: str
    first: str
    before: str
    after: str
    detail: str = ""  # the new cell's reason, the known issue, the removal

    @property
    def group_key(self) -> tuple[str, str, str]:
        """Changes of one release with one cause are one line of the report."""
        return self.first, self.kind, reason_key(self.detail, self.row)


@dataclass
class Timeline:
    columns: list[Column]
    tests: list[Row]
    capabilities: list[Row]
    known_issues: list[Row]
    facts: list[Row]
    changes: list[Change]
    verdict: compare.RunComparison  # the first column against the last

    @property
    def regressed(self) -> bool:
        return self.verdict.regressed

    @property
    def labels(self) -> list[str]:
        return [c.label for c in self.columns]

    def grouped_changes(self) -> list[tuple[tuple[str, str, str], list[Change]]]:
        """Changes grouped by (release, kind, cause), in release order, then kind order."""
        order = {c.label: i for i, c in enumerate(self.columns)}
        groups: dict[tuple[str, str, str], list[Change]] = {}
        for ch in self.changes:
            groups.setdefault(ch.group_key, []).append(ch)
        return sorted(groups.items(), key=lambda kv: (order[kv[0][0]], KINDS.index(kv[0][1]),
                                                      -len(kv[1])))


def _transition(before: str, after: str, reason: str) -> str | None:
    """The change kind of a test cell going from ``before`` to ``after``."""
    if before == after:
        return None
    if after == NOT_RUN:
        return NOT_RUN_FROM
    if after == FAILED:
        return FAILS
    if after == KNOWN:
        return KNOWN_FROM
    if after == SKIPPED:
        return REMOVED_FROM if REMOVED.search(reason or "") else SKIPS
    # after is PASSED
    if before == FAILED:
        return FIXED
    if before == KNOWN:
        return KNOWN_GONE
    return RUNS


def _test_rows(columns: list[Column]) -> tuple[list[Row], list[Change]]:
    keys = sorted({k for c in columns for k in c.run.outcomes})
    rows, changes = [], []
    for key in keys:
        outcomes = [c.run.outcomes.get(key) for c in columns]
        row = Row(key, "test", [state(o) for o in outcomes],
                  [(o or {}).get("reason") or "" for o in outcomes],
                  [(o or {}).get("known_issue") or "" for o in outcomes])
        rows.append(row)
        for i in range(1, len(columns)):
            before, after = row.cells[i - 1], row.cells[i]
            if before == NOT_RUN and after != NOT_RUN:
                kind = _transition(PASSED, after, row.reasons[i]) if after != PASSED else None
                kind = kind or RUNS  # first seen in this release
            else:
                kind = _transition(before, after, row.reasons[i])
            if kind is None:
                continue
            detail = row.reasons[i]
            if kind == KNOWN_FROM and row.issues[i]:
                detail = f"{row.issues[i]}: {detail}" if detail else row.issues[i]
            elif kind == KNOWN_GONE and row.issues[i - 1]:
                detail = f"{row.issues[i - 1]} no longer fails"
            changes.append(Change(kind, key, columns[i].label, before, after, detail))
    return rows, changes


def _capability_rows(columns: list[Column]) -> list[Row]:
    caps = sorted({o.get("capability") or "-" for c in columns for o in c.run.outcomes.values()})
    rows = []
    for cap in caps:
        cells = []
        for c in columns:
            n = Counter(state(o) for o in c.run.outcomes.values()
                        if (o.get("capability") or "-") == cap)
            cells.append("/".join(str(n[s]) for s in STATES) if n else NOT_RUN)
        rows.append(Row(cap, "capability", cells))
    return rows


def _issue_rows(columns: list[Column]) -> tuple[list[Row], list[Change]]:
    ids = sorted({o["known_issue"] for c in columns for o in c.run.outcomes.values()
                  if o.get("known_issue")})
    rows, changes = [], []
    for issue in ids:
        counts = [sum(1 for o in c.run.outcomes.values() if o.get("known_issue") == issue
                      and o["outcome"] != "skipped") for c in columns]
        rows.append(Row(issue, "known issue", [str(n) if n else NOT_RUN for n in counts]))
    return rows, changes


def _fact_rows(columns: list[Column]) -> tuple[list[Row], list[Change]]:
    keys = sorted({k for c in columns for k in c.run.facts})
    rows, changes = [], []
    for key in keys:
        values = [_fact(c.run.facts[key]) if key in c.run.facts else NOT_RUN for c in columns]
        rows.append(Row(key, "fact", values))
        last = None  # the last value recorded: a run that did not record it changes nothing
        for i, v in enumerate(values):
            if v == NOT_RUN:
                continue
            if last is not None and v != last:
                changes.append(Change(MOVED, key, columns[i].label, last, v))
            last = v
    return rows, changes


def _fact(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def build(columns: list[tuple[str, dict[str, Any], str]], threshold: float = 0.10) -> Timeline:
    """The timeline of ``columns``: (release label, checked results document, where it came
    from), in release order. At least two columns."""
    if len(columns) < 2:
        raise ValueError(f"a timeline needs at least two releases, got {len(columns)}")
    labels = [label for label, _, _ in columns]
    if len(set(labels)) != len(labels):
        raise ValueError(f"releases given twice: {', '.join(labels)}")
    cols = [Column(label, compare.read_run(doc, label), doc, source)
            for label, doc, source in columns]
    tests, changes = _test_rows(cols)
    issues, _ = _issue_rows(cols)
    facts, moved = _fact_rows(cols)
    verdict = compare.compare(cols[0].doc, cols[-1].doc, threshold, base_label=labels[0],
                              new_label=labels[-1])
    return Timeline(cols, tests, _capability_rows(cols), issues, facts, changes + moved, verdict)
