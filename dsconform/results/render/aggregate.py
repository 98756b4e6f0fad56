"""The cluster report of ``dsconform aggregate`` as text: terminal, markdown, JSON and one
merged JUnit XML (one testsuite per node, test classes prefixed with the node's name, and one
``node-verdict`` case per node that fails with the node's reasons, so a CI system shows a node
that failed without a failing test - a killed run, "no GPU test ran" - as red too).
"""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dsconform.results import prometheus, summary
from dsconform.results.aggregate import FORMAT, ClusterReport, NodeResult, cell, drain_commands

OUTLIERS_SHOWN = 20


def _value(v: float, unit: str) -> str:
    return f"{v:.4g} {unit}" if math.isfinite(v) else str(v)


def _verdict(report: ClusterReport) -> str:
    n, bad = len(report.nodes), len(report.failed_nodes)
    if bad:
        return f"FAILED: {bad} of {n} node folder(s) failed"
    return f"PASSED: all {n} node folder(s) passed"


def _node_label(n: NodeResult) -> str:
    r = n.rendezvous or {}
    if n.job is not None:
        return f"{n.name} (rank {r.get('rank')} of job {n.job})"
    return n.name


def _matrix_rows(report: ClusterReport) -> list[list[str]]:
    rows = []
    for n in report.nodes:
        verdict = n.verdict
        rows.append([n.name, n.hostname, n.environment.get("profile", "-"),
                     n.environment.get("DeepSpeed", "-")]
                    + [cell(n.capabilities.get(c)) for c in report.capabilities] + [verdict])
    return rows


def _matrix_header(report: ClusterReport) -> list[str]:
    return ["node", "host", "profile", "DeepSpeed", *report.capabilities, "verdict"]


def _outlier_line(o: Any) -> str:
    limit = f", its limit {_value(o.limit, o.unit)}" if o.limit is not None else ""
    return (f"{o.node}: {o.metric} = {_value(o.value, o.unit)} is {_versus(o)} the median "
            f"{_value(o.fleet_median, o.unit)} of its type ({o.better} is better: {o.ratio:.0%} "
            f"of the median's performance, {o.fleet} nodes of {o.node_type}{limit})")


def _versus(o: Any) -> str:
    """How the value stands to the median of its type, in the metric's own terms: a share for a
    rate, a multiple for a time (lower is better: 43 s against 0.43 s is 100x, not 1%)."""
    if o.better == "higher" or not o.fleet_median:
        return f"{o.value / o.fleet_median:.0%} of" if o.fleet_median else "against"
    return f"{o.value / o.fleet_median:.3g}x"


def terminal(report: ClusterReport) -> list[str]:
    out = [f"dsconform aggregate: {_verdict(report)}"]
    header = _matrix_header(report)
    rows = [header] + _matrix_rows(report)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    out += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    if report.failed_nodes:
        out.append("failing nodes:")
        for n in report.failed_nodes:
            out.append(f"  {_node_label(n)}:")
            out += [f"    {p}" for p in n.problems]
    for job in report.jobs:
        kind, nodes = ("multi-node job", f"{job.nodes} nodes") if job.nodes > 1 else (
            "one-node job", "1 node")
        out.append(f"{kind} {job.job}: {nodes}, world size {job.world_size}, "
                   f"{len(job.members)} rank folder(s): {'FAILED' if job.failed else 'passed'}")
    if report.outliers:
        out.append(f"outliers (performance below {report.outlier_pct:g}% of the median of the "
                   "node's type):")
        out += [f"  {_outlier_line(o)}" for o in report.outliers[:OUTLIERS_SHOWN]]
        if len(report.outliers) > OUTLIERS_SHOWN:
            out.append(f"  ... {len(report.outliers) - OUTLIERS_SHOWN} more in the report")
    for ki in report.known_issues:
        out.append(f"known upstream issue {ki['id']}: {ki['cases']} case(s) on "
                   f"{len(ki['nodes'])} node(s): {ki['title']} {ki['link']}")
    drains = drain_commands(report)
    if drains:
        out.append("# Drain commands for the failing nodes (printed, NOT run; review, then run):")
        out += drains
    return out


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    def esc(v: str) -> str:
        return v.replace("|", "\\|")
    return (["| " + " | ".join(esc(h) for h in header) + " |",
             "|" + "|".join(" --- " for _ in header) + "|"]
            + ["| " + " | ".join(esc(v) for v in r) + " |" for r in rows])


def markdown(report: ClusterReport) -> str:
    out = ["# dsconform cluster report", "", f"**{_verdict(report)}**", ""]
    if report.sources:
        out += ["From: " + ", ".join(f"`{s}`" for s in report.sources), ""]
    out += ["## Nodes by capability", "",
            "`ok N`: N tests ran and passed (known: strict xfails of known upstream issues); "
            "`FAIL F/N`: F of N failed; `skip`: every test skipped; `-`: not run.", ""]
    out += _md_table(_matrix_header(report), _matrix_rows(report)) + [""]
    if report.failed_nodes:
        out += ["## Failing nodes", ""]
        for n in report.failed_nodes:
            out.append(f"- **{_node_label(n)}** (`{n.path}`)")
            out += [f"  - {p}" for p in n.problems]
        out += ["", "Drain commands (printed by `dsconform aggregate`, never run by it):", "",
                "```bash", *drain_commands(report), "```", ""]
    if report.jobs:
        out += ["## Multi-node jobs", ""]
        rows = [[j.job, str(j.nodes), str(j.world_size), str(len(j.members)),
                 ", ".join(sorted({m.hostname for m in j.members})),
                 "FAILED" if j.failed else "passed"] for j in report.jobs]
        out += _md_table(["job", "nodes", "world size", "rank folders", "hosts", "verdict"],
                         rows) + [""]
    out += [f"## Outliers (performance below {report.outlier_pct:g}% of the median of the "
            "node's type)", ""]
    if report.outliers:
        rows = [[o.node, o.node_type, f"`{o.metric}`", _value(o.value, o.unit),
                 _value(o.fleet_median, o.unit), f"{o.ratio:.0%}", o.better,
                 _value(o.limit, o.unit) if o.limit is not None else "-"]
                for o in report.outliers]
        out += _md_table(["node", "type", "metric", "value", "median of its type",
                          "performance", "better", "limit"], rows)
    else:
        out.append(f"None among {len(report.metrics)} performance metric(s) measured on two or "
                   "more nodes of one type.")
    out += ["", "## Known upstream issues (each counted once)", ""]
    if report.known_issues:
        rows = [[ki["id"], ki["title"], ki["link"], ki["deepspeed"], str(ki["cases"]),
                 ", ".join(ki["nodes"])] for ki in report.known_issues]
        out += _md_table(["id", "what", "link", "DeepSpeed", "cases", "nodes"], rows)
    else:
        out.append("None hit.")
    return "\n".join(out) + "\n"


def to_json(report: ClusterReport) -> dict[str, Any]:
    def node(n: NodeResult) -> dict[str, Any]:
        return {"name": n.name, "path": str(n.path), "hostname": n.hostname,
                "failed": n.failed, "verdict": n.verdict, "problems": n.problems,
                "finished": n.finished, "status": n.status,
                "exitstatus": n.exitstatus, "capabilities": n.capabilities,
                "environment": n.environment, "rendezvous": n.rendezvous}
    return {
        "format": FORMAT,
        "failed": report.failed,
        "verdict": _verdict(report),
        "sources": report.sources,
        "capabilities": report.capabilities,
        "nodes": [node(n) for n in report.nodes],
        "failed_nodes": [n.name for n in report.failed_nodes],
        "drain_commands": drain_commands(report),
        "jobs": [{"job": j.job, "nodes": j.nodes, "world_size": j.world_size,
                  "members": [m.name for m in j.members], "failed": j.failed}
                 for j in report.jobs],
        "outlier_pct": report.outlier_pct,
        "outliers": [asdict(o) for o in report.outliers],
        "metrics": report.metrics,
        "known_issues": report.known_issues,
    }


# ------------------------------------------------------------------ JUnit XML

def _synthesized(n: NodeResult) -> ET.Element:
    """A testsuite from the node's outcomes, where its junit.xml is missing or unreadable."""
    suite = ET.Element("testsuite", name=n.name)
    for o in n.outcomes:
        path, _, name = str(o.get("nodeid", "")).partition("::")
        classname = path.removesuffix(".py").replace("/", ".")
        tc = ET.SubElement(suite, "testcase", classname=classname, name=name or path,
                           time=str(o.get("duration_s", 0)))
        kind = o.get("outcome")
        if kind in summary.FAILED:
            ET.SubElement(tc, "failure", message=str(o.get("reason", kind)))
        elif kind in ("skipped", "xfailed"):
            ET.SubElement(tc, "skipped", message=str(o.get("reason", kind)))
    return suite


def _node_suites(n: NodeResult) -> list[ET.Element]:
    path = n.path / "junit.xml"
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return [_synthesized(n)]
    if root.tag == "testsuite":
        return [root]
    suites = list(root.iter("testsuite"))
    return suites if suites else [_synthesized(n)]


def junit(report: ClusterReport) -> bytes:
    root = ET.Element("testsuites", name="dsconform cluster")
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for n in report.nodes:
        for suite in _node_suites(n):
            suite.set("name", n.name)
            suite.set("hostname", n.hostname)
            for tc in suite.iter("testcase"):
                tc.set("classname", f"{n.name}.{tc.get('classname', '')}".rstrip("."))
            verdict = ET.SubElement(suite, "testcase", classname=n.name, name="node-verdict")
            if n.failed:
                failure = ET.SubElement(verdict, "failure", message=n.problems[0][:500])
                failure.text = "\n".join(n.problems)
            cases = list(suite.iter("testcase"))
            counts = {"tests": len(cases),
                      "failures": sum(1 for c in cases if c.find("failure") is not None),
                      "errors": sum(1 for c in cases if c.find("error") is not None),
                      "skipped": sum(1 for c in cases if c.find("skipped") is not None)}
            for k, v in counts.items():
                suite.set(k, str(v))
                totals[k] += v
            root.append(suite)
    for k, v in totals.items():
        root.set(k, str(v))
    return ET.tostring(root, encoding="utf-8", xml_declaration=True)


def write(report: ClusterReport, out: Path) -> list[Path]:
    """cluster.md, cluster.json, junit.xml and cluster.prom into ``out`` (created)."""
    out.mkdir(parents=True, exist_ok=True)
    files = {"cluster.md": markdown(report).encode(),
             "cluster.json": (json.dumps(to_json(report), indent=2, default=str) + "\n").encode(),
             "junit.xml": junit(report)}
    written = []
    for name, data in files.items():
        (out / name).write_bytes(data)
        written.append(out / name)
    written.append(prometheus.write_cluster(report, out))  # for Prometheus, atomically
    return written


def main(dirs: list[str], *, out: str, outlier_pct: float, plot: bool,
         expect: list[str] | None = None, scheduler: str = "slurm") -> int:
    """``dsconform aggregate``: exit 0 every node passed, 1 a node failed, 2 unusable input."""
    import sys

    from dsconform.results import aggregate
    from dsconform.results.render import aggregate_chart as aggregate_plot

    def unusable(msg: object) -> int:
        print(f"dsconform aggregate: {msg}", file=sys.stderr)
        return 2

    try:
        report = aggregate.analyse(aggregate.collect(dirs), outlier_pct, sources=list(dirs),
                                   expect=expect)
    except (aggregate.AggregateInputError, ValueError) as e:
        return unusable(e)
    report.scheduler = scheduler  # whose drain commands are printed
    print("\n".join(terminal(report)))
    target = Path(out)
    try:
        written = write(report, target)
        if plot:
            try:
                aggregate_plot.draw(report, target / "heatmap.png")
                written.append(target / "heatmap.png")
            except aggregate_plot.PlotUnavailable as e:
                print(e, file=sys.stderr)
    except OSError as e:
        return unusable(f"cannot write the report to {target}: {e.strerror or e}")
    print(f"report: {', '.join(str(p) for p in written)}", file=sys.stderr)
    return 1 if report.failed else 0
