"""The run's verdict in one line, for the console and the last line of summary.txt:
``dsconform: NODE node7 FAILED (3 failures in 2 capabilities)`` or ``dsconform: NODE node7
PASSED``.

It is the verdict ``dsconform.prom`` serves (``dsconform_node_passed``) and ``dsconform
aggregate`` gives: both come from ``aggregate.NodeResult.problems`` of the same results.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dsconform.results import aggregate, summary
from dsconform.results.records import Outcome


def of_summary(result: Mapping[str, Any], outcomes: Sequence[Outcome], hostname: str
               ) -> aggregate.NodeResult:
    """The node as ``dsconform aggregate`` would read it from this summary (a finished run),
    for a run that writes no results folder."""
    return aggregate.NodeResult(
        name=hostname, path=Path("-"), hostname=hostname, finished=True,
        exitstatus=result.get("exitstatus"), capabilities=dict(result["capabilities"]),
        failures=list(result["failures"]), notices=list(result.get("notices") or []),
        known_issues=list(result.get("known_issues") or []),
        outcomes=[asdict(o) for o in outcomes], measures={}, environment={})


def _plural(n: int, word: str) -> str:
    if n == 1:
        return f"1 {word}"
    return f"{n} {word[:-1] + 'ies' if word.endswith('y') else word + 's'}"


def line(node: aggregate.NodeResult, stopped: str | None = None) -> str:
    """``dsconform: NODE <host> PASSED``, or FAILED with what failed: the failing tests and the
    capabilities they are in, then any other reason (an exit status, an unfinished run), each
    up to its first colon (the summary above the line says the rest). ``stopped``: why the run
    stopped early, said for its exit status (a collection error is no interruption)."""
    problems = node.problems
    if not problems:
        return f"dsconform: NODE {node.hostname} PASSED"
    groups = {f"{g['count']} x {g['reason']}" for g in node.failures}
    why = []
    failed = sum(int(g.get("count") or 0) for g in node.failures)
    if failed:
        caps = sum(1 for c in node.capabilities.values() if isinstance(c, dict)
                   and sum(c.get(k, 0) for k in summary.FAILED))
        why.append(f"{_plural(failed, 'failure')} in {_plural(max(caps, 1), 'capability')}")
    for p in problems:
        if p in groups:
            continue
        if stopped and p.startswith("pytest exit status"):
            why.append(stopped.split(": ", 1)[0].split(" (", 1)[0])
        else:
            why.append(p.split(": ", 1)[0])
    return f"dsconform: NODE {node.hostname} FAILED ({'; '.join(why)})"
