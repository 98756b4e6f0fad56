"""The conformance summary: outcomes per capability, failures and skips grouped by their cause,
and the known upstream issues a run hit.

Twelve failures with one cause are one line: a reason is grouped with its case id taken out
(the parametrization id, e.g. ``cuda-z0-off_none-fp16-sgd-gas1-ws2``) and its measured numbers
masked, so cells of a matrix that fail alike collapse into one line with their count, followed
by the case ids. The first case's full reason is what the line shows.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from dsconform.results.records import Outcome

#: Failures, as the summary counts them (xpassed: a strict xfail that passed).
FAILED = ("failed", "error", "xpassed")
#: What the known column counts: strict xfails, of a known upstream issue or of a limitation
#: the suite marks itself (each listed under "known N").
KNOWN = "xfailed"
#: The summary table's columns and the outcomes each counts.
COLUMNS = (("passed", ("passed",)), ("failed", FAILED), ("skipped", ("skipped",)),
           ("known", (KNOWN,)))
WIDTHS = (8, 8, 9, 7)
# Measured values differ from case to case: 0.0123, 1.9e-07, 3e-4. Integers (step 5, 2 GPUs)
# stay: a different count is a different story.
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d*|\.\d+|\d+(?=[eE]))(?:[eE][-+]?\d+)?(?![\w.])")
CASES_SHOWN = 8


def _case_labels(nodeids: list[str]) -> list[str]:
    """Short labels of a group's cases: the bare case ids when they are cells of one test
    (``cuda-z0-...``), else each test with its case (``test_half_precision_matmul[bf16]``),
    with its file where two files have a test of that name (``test_zero.py::test_x[a]``)."""
    tests = {n.split("[", 1)[0] for n in nodeids}
    if len(tests) == 1:
        return [case_id(n) or n.rsplit("::", 1)[-1] for n in nodeids]
    files_of: dict[str, set[str]] = {}
    for n in nodeids:
        path, _, test = n.split("[", 1)[0].rpartition("::")
        files_of.setdefault(test, set()).add(path)
    labels = []
    for n in nodeids:
        path, _, test = n.split("[", 1)[0].rpartition("::")
        label = n.rsplit("::", 1)[-1]
        labels.append(label if len(files_of[test]) == 1
                      else f"{path.rsplit('/', 1)[-1]}::{label}")
    return labels


def case_id(nodeid: str) -> str:
    """The parametrization id of a node id ("" when the test is not parametrized)."""
    m = re.search(r"\[(.*)\]$", nodeid)
    return m.group(1) if m else ""


def _without_case_id(reason: str, nodeid: str) -> str:
    """The reason with its case id taken out: as a leading label ("cuda-z0-...: first ..."),
    and anywhere when the id is a compound one (has a dash). A short id such as "fp16" is a word
    the reason may need ("expected fp16 support"): it is only removed as a label."""
    cid = case_id(nodeid)
    if not cid:
        return reason
    text = reason
    if text.startswith(cid):
        text = text[len(cid):]
    if "-" in cid:
        text = text.replace(cid, "")
    return re.sub(r"^[\s:,-]+", "", text) or reason


def reason_key(reason: str, nodeid: str) -> str:
    """What groups a reason: the case id taken out, measured numbers masked."""
    return _NUMBER.sub("#", _without_case_id(reason, nodeid))


def _shown(reason: str, nodeid: str) -> str:
    return _without_case_id(reason, nodeid)


def group(entries: Iterable[tuple[str, str]]) -> list[dict[str, Any]]:
    """[(nodeid, reason)] -> [{"reason", "count", "cases"}], largest group first."""
    groups: dict[str, dict[str, Any]] = {}
    for nodeid, reason in entries:
        key = reason_key(reason, nodeid)
        g = groups.setdefault(key, {"reason": _shown(reason, nodeid), "count": 0, "cases": []})
        g["count"] += 1
        g["cases"].append(nodeid)
    return sorted(groups.values(), key=lambda g: -g["count"])


def summarize(outcomes: Sequence[Outcome],
              known_issues: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Counts per capability, grouped failures, skips and expected failures, and the known
    issues hit (each once, with the cases it made strict xfails). ``known_issues``: id ->
    {"title", "link", "deepspeed"}."""
    per_cap: dict[str, Counter] = defaultdict(Counter)
    skips, failures, xfails = [], [], []
    hit: dict[str, list[str]] = defaultdict(list)
    for o in outcomes:
        per_cap[o.capability][o.outcome] += 1
        if o.outcome == "skipped":
            skips.append((o.nodeid, o.reason))
        elif o.outcome in FAILED:
            failures.append((o.nodeid, o.reason))
        elif o.outcome == KNOWN:
            xfails.append((o.nodeid, o.reason))
            # Only the xfails: a covered case that failed another way is a failure, and the
            # known column, which counts xfails, must add up to this list.
            if o.known_issue:
                hit[o.known_issue].append(o.nodeid)
    known = []
    for issue_id, cases in sorted(hit.items()):
        info = dict((known_issues or {}).get(issue_id, {}))
        known.append({"id": issue_id, **info, "count": len(cases), "cases": cases})
    return {"capabilities": {k: dict(v) for k, v in sorted(per_cap.items())},
            "failures": group(failures), "skips": group(skips), "xfails": group(xfails),
            "known_issues": known}


def _known_lines(summary: Mapping[str, Any]) -> list[str]:
    """The known column's cases, each issue once: a registered upstream issue by its id, any
    other strict xfail (a known limitation the suite itself marks) by its reason."""
    issues = summary.get("known_issues") or []
    out = [f"  {k['count']:>4} x {k['id']}: {k.get('title', '')} {k.get('link', '')} "
           f"(DeepSpeed {k.get('deepspeed', '?')})" for k in issues]
    registered = {c for k in issues for c in k.get("cases", ())}
    others = group((c, g["reason"]) for g in summary.get("xfails") or () for c in g["cases"]
                   if c not in registered)
    out += [f"  {g['count']:>4} x {g['reason']}" for g in others]
    return out


def column_totals(summary: Mapping[str, Any]) -> dict[str, int]:
    """The table's columns over every capability: what its "failed N", "skipped N" and
    "known N" lines count."""
    totals: Counter = Counter()
    for c in summary["capabilities"].values():
        for column, outcomes in COLUMNS:
            totals[column] += sum(c.get(k, 0) for k in outcomes)
    return dict(totals)


def lines(summary: Mapping[str, Any], *, profile: str, host: str,
          notices: Sequence[str] = (), run: str = "") -> list[str]:
    """The summary as printed. ``run``: what kind of run it was (a GPU or a CPU run)."""
    out = [f"profile {profile} on {host}"]
    out += [f"run: {run}"] if run else []
    out += [f"NOTE: {n}" for n in notices]
    out.append(f"{'capability':<22}" + "".join(f"{column:>{w}}" for (column, _), w
                                                in zip(COLUMNS, WIDTHS)))
    for cap, c in summary["capabilities"].items():
        out.append(f"{cap:<22}" + "".join(f"{sum(c.get(k, 0) for k in outcomes):>{w}}"
                                          for (_, outcomes), w in zip(COLUMNS, WIDTHS)))
    totals = column_totals(summary)
    for column, key in (("failed", "failures"), ("skipped", "skips")):
        if summary[key]:
            out.append(f"{column} {totals[column]}, by reason:")
            for g in summary[key]:
                out.append(f"  {g['count']:>4} x {g['reason']}")
                # Failures list their cases (skips do too, in summary.json).
                if g["count"] > 1 and key == "failures":
                    ids = _case_labels(g["cases"])
                    more = f", ... {len(ids) - CASES_SHOWN} more" if len(ids) > CASES_SHOWN else ""
                    out.append(f"         cases: {', '.join(ids[:CASES_SHOWN])}{more}")
    known = _known_lines(summary)
    if known:
        out.append(f"known {totals['known']} (strict xfails: known upstream issues and "
                   "limitations, not node failures):")
        out += known
    return out
