"""One node's (or one rank's) results folder, read and judged: ``load_node`` reads what its
run wrote (summary.json, benchmarks.json, records.jsonl, and dsconform.prom for which attempt is
the newest), and ``NodeResult.problems`` says why the node did not pass, one line each. The
cluster report (dsconform.results.aggregate) and dsconform.prom (dsconform.results.prometheus)
both judge a node by it, so the two never disagree."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsconform.results import attempt, compare, records, summary
from dsconform.results import format as results_format

#: pytest's exit statuses, for a node whose run ended badly without a failing test.
EXIT_STATUS = {1: "tests failed", 2: "interrupted", 3: "internal error", 4: "usage error",
               5: "no tests ran"}


class AggregateInputError(ValueError):
    """Input aggregate cannot use; the message names the folder or file and what to do."""


@dataclass
class NodeResult:
    """One node's (or one rank's) results folder, as read."""
    name: str                      # the folder's name: the node, for the drain command
    path: Path
    hostname: str
    finished: bool                 # False: records.jsonl without summary.json (a killed run)
    exitstatus: int | None
    capabilities: dict[str, dict[str, int]]
    failures: list[dict[str, Any]]  # summary groups: {"reason", "count", "cases"}
    notices: list[str]
    known_issues: list[dict[str, Any]]
    outcomes: list[dict[str, Any]]
    measures: dict[str, compare.Measure]
    environment: dict[str, str]
    rendezvous: dict[str, Any] | None = None
    run_id: str = ""               # the run's own identity: a copied folder has the same one
    absent: bool = False           # expected (--expect) and no folder was found
    has_benchmarks: bool = True    # False: summary.json without the benchmarks.json beside it
    status: str = ""               # summary.json's status ("" in older summaries)
    reason: str = ""               # why the run as a whole did not pass, in one line

    @classmethod
    def missing(cls, name: str) -> NodeResult:
        return cls(name=name, path=Path("-"), hostname=name, finished=False, exitstatus=None,
                   capabilities={}, failures=[], notices=[], known_issues=[], outcomes=[],
                   measures={}, environment={}, absent=True)

    @property
    def job(self) -> str | None:
        """The torchrun/Slurm job this run was a rank of (None: a plain run). A job on one node
        too: its folders are ranks (``<node>-rank<R>``), not nodes."""
        r = self.rendezvous or {}
        return str(r["job"]) if r.get("job") is not None else None

    @property
    def problems(self) -> list[str]:
        """Why this node failed, one line each (empty: it passed)."""
        if self.absent:
            return ["no results folder: its run never started or wrote nothing (expected by "
                    "--expect)"]
        if self.status == "refused":
            return [f"the run was refused: {self.reason or 'no reason recorded'}"]
        out = []
        if not self.finished:
            last = self.outcomes[-1]["nodeid"] if self.outcomes else "none"
            out.append(self.reason or f"the run did not finish: no summary.json "
                                      f"({len(self.outcomes)} test outcomes in records.jsonl, "
                                      f"the last {last})")
        out += [f"{g['count']} x {g['reason']}" for g in self.failures]
        status = self.exitstatus
        if self.finished and status not in (None, 0) and (status != 1 or not self.failures):
            why = EXIT_STATUS.get(status, "unknown")
            notes = "; ".join(self.notices)
            out.append(self.reason or f"pytest exit status {status} ({why})"
                       + (f": {notes}" if notes else ""))
        if self.finished and status in (None, 0) and not self.outcomes and not any(
                sum(c.values()) for c in self.capabilities.values() if isinstance(c, dict)):
            out.append("the run recorded no test outcome: it proves nothing about the node (a "
                       "selection that matched nothing, or a --collect-only run)")
        if self.finished and not self.has_benchmarks:
            out.append("no benchmarks.json beside summary.json: its outcomes and measurements "
                       "cannot be read (an incomplete copy of the folder?)")
        return out

    @property
    def failed(self) -> bool:
        return bool(self.problems)

    @property
    def verdict(self) -> str:
        """The node's verdict in a word: passed, FAILED, REFUSED (the newest run never
        started), NOT FINISHED (it is running, or was killed) or NO RESULTS."""
        if not self.failed:
            return "passed"
        if self.absent:
            return "NO RESULTS"
        if self.status == "refused":
            return "REFUSED"
        return "FAILED" if self.finished else "NOT FINISHED"


def _check_summary(doc: Any, path: Path) -> None:
    def foreign(what: str) -> AggregateInputError:
        return AggregateInputError(f"{path}: not a dsconform summary.json ({what}); expected the "
                                   "summary a `pytest suites --results DIR` run writes")
    if not isinstance(doc, dict):
        raise foreign(f"a JSON {type(doc).__name__}, not an object")
    caps = doc.get("capabilities")
    if not isinstance(caps, dict) or not all(isinstance(c, dict) for c in caps.values()):
        raise foreign("no 'capabilities' table")
    for key in ("failures", "known_issues"):
        if not isinstance(doc.get(key, []), list):
            raise foreign(f"'{key}' is not a list")
    for i, g in enumerate(doc.get("failures", [])):
        if not isinstance(g, dict) or not {"reason", "count"} <= set(g):
            raise foreign(f"failures[{i}] has no 'reason' and 'count'")
    if not isinstance(doc.get("node", {}), dict):
        raise foreign("'node' is not an object")


def _summarize(outcomes: list[dict[str, Any]]) -> dict[str, Any]:
    fields = ("nodeid", "outcome", "capability", "reason")
    try:
        return summary.summarize([records.Outcome(**{k: o[k] for k in fields if k in o})
                                  for o in outcomes])
    except (TypeError, KeyError) as e:
        raise AggregateInputError(f"outcomes without nodeid/outcome/capability: {e}") from None


def load_node(path: Path) -> NodeResult:
    """Read one node's results folder. Raises AggregateInputError.

    A summary.json or benchmarks.json older than the newest attempt that dsconform.prom names
    (running, killed or refused: attempt.stale_against) is not read: that attempt is what the
    folder says about the node now."""
    summary_path, bench_path, journal_path = (path / f for f in results_format.RESULT_FILES)
    mark = attempt.read_mark(path)
    doc = summ = None
    if bench_path.exists():
        try:
            doc = results_format.load_benchmarks(bench_path)
        except results_format.ResultsFormatError as e:
            raise AggregateInputError(str(e)) from None
    started = ((doc or {}).get("dsconform") or {}).get("started")
    if summary_path.exists():
        summ = results_format.read_json(summary_path, AggregateInputError)
        _check_summary(summ, summary_path)
    stale = [p.name for p, d, begun in ((bench_path, doc, started),
                                        (summary_path, summ, (summ or {}).get("started")
                                         or started))
             if d is not None and attempt.stale_against(mark, p, begun)]
    if stale:
        doc = None if bench_path.name in stale else doc
        summ = None if summary_path.name in stale else summ
    if summ is None and doc is None and mark is not None and (mark.refused or stale):
        return _newest_attempt(path, mark, stale)
    outcomes = list(((doc or {}).get("dsconform") or {}).get("outcomes") or [])
    finished = True
    if summ is None and doc is not None:
        summ = _summarize(outcomes)  # a folder that lost its summary.json: rebuild it
    elif summ is None:
        finished = False
        try:
            outcomes = (results_format.read_journal(journal_path)
                        if journal_path.exists() or mark is None else [])
        except OSError as e:
            raise AggregateInputError(f"{journal_path}: cannot read: {e}") from None
        try:
            summ = _summarize(outcomes)
        except AggregateInputError as e:
            raise AggregateInputError(f"{journal_path}: {e}") from None
    return node_from_summary(path, summ, doc=doc, outcomes=outcomes, finished=finished)


def _newest_attempt(path: Path, mark: attempt.Mark, stale: list[str]) -> NodeResult:
    """The verdict of a folder whose newest attempt wrote none of its own (refused before its
    results folder could take a summary, running, killed): that attempt's, never the older
    run's files beside it."""
    older = (f"; the {' and '.join(stale)} beside it are an older run's and are not read"
             if stale else "")
    node = NodeResult.missing(path.name)
    node.path, node.absent = path, False
    node.status = "refused" if mark.refused else ""
    # problems() puts "the run was refused: " before a refused run's reason.
    node.reason = (("" if mark.refused else "the run did not finish: ")
                   + f"the newest run's {mark.path.name} says so{older}")
    return node


def node_from_summary(path: Path, summ: dict[str, Any], *, doc: dict[str, Any] | None = None,
                      outcomes: list[dict[str, Any]] | None = None,
                      finished: bool = True) -> NodeResult:
    """A node's result from its summary (and the benchmarks.json and outcomes beside it): how
    aggregate and dsconform.prom judge a folder, or a refused run that wrote only a summary."""
    outcomes = outcomes if outcomes is not None else []
    node = summ.get("node") or {}
    machine = (doc or {}).get("machine_info") or {}
    hostname = str(node.get("hostname") or machine.get("node") or path.name)
    measures = compare.read_run(doc).measures if doc is not None else {}
    rdzv = summ.get("rendezvous")
    rank = rdzv.get("rank") if isinstance(rdzv, dict) else None
    return NodeResult(
        name=path.name, path=path, hostname=hostname, finished=finished,
        exitstatus=summ.get("exitstatus"), capabilities=summ.get("capabilities") or {},
        failures=summ.get("failures") or [], notices=list(summ.get("notices") or []),
        known_issues=summ.get("known_issues") or [], outcomes=outcomes, measures=measures,
        environment=compare.environment(doc) if doc is not None else {},
        rendezvous=rdzv if isinstance(rdzv, dict) else None,
        run_id=f"{hostname}|{(doc or {}).get('datetime', '')}|{rank}" if doc else "",
        has_benchmarks=doc is not None or not finished or summ.get("status") == "refused",
        status=str(summ.get("status") or ""), reason=str(summ.get("reason") or ""))
