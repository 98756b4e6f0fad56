"""Many nodes' results into one cluster answer: ``dsconform aggregate DIR...``.

A nightly acceptance run leaves one ``--results`` folder per node under a shared directory
(``$SHARED/nightly/$(hostname)``: summary.json, benchmarks.json, junit.xml, records.jsonl), and,
for the multi-node tier, one folder per rank. This module reads them and answers:

- **which nodes failed, and why** (dsconform.results.node_folder reads and judges each folder:
  the failure groups of its summary; a run that was refused, or did not finish, by its
  summary.json or by a dsconform.prom newer than it; a pytest exit status that is not 0);
- **a matrix of nodes by capabilities** (passed / failed / skipped per suite);
- **outliers**: a node whose performance metric is below ``outlier_pct`` percent of the median
  of its node type (the nodes of the same profile and GPUs: a 1-GPU node's numbers say nothing
  about an 8-GPU node's), even when it is above the floor the profile enforces.
  Direction-aware: a rate (GB/s, read from ``extra_info.rate``, dsconform/results/records.py)
  below the median, a time above it. Only performance metrics (records.PERFORMANCE_UNITS and
  rates) take part, and of them only what ``dsconform compare`` judges
  (dsconform/results/noise.py): an op build on the node whose cache was cold is a one-off
  cost, not a slow node, and a 40 us collective's time is latency. A ZeRO-vs-DDP
  difference of 1e-7 against a median of 0 is not an outlier but a tolerance question;
- **known upstream issues** (dsconform/gate/known_issues.py) once each, with the nodes they were hit
  on and the number of cases, never once per node;
- **jobs**: folders whose run was a rank of a torchrun/Slurm rendezvous (summary.json
  ``rendezvous``) are grouped by job, never counted as nodes; a failing multi-node job names no
  node, a failing job on one node names that node (by hostname);
- the commands that would drain the failing nodes: Slurm's ``scontrol``, or Kubernetes'
  ``kubectl`` cordon, taint, label and annotate (``--scheduler k8s``). They are printed, never
  run: draining is a decision for a person.

A node is named by its folder (the recipes name it after the node: ``$(hostname)``, Slurm's
``$SLURMD_NODENAME``); that name is what the drain command uses. Bad input is an
AggregateInputError naming the folder or file and what to do: an empty folder, a JSON file that
is not this suite's, a node that appears twice.

Outputs (dsconform/results/render/aggregate.py and aggregate_chart.py): markdown, JSON, merged
JUnit XML and a PNG heat map of nodes by metrics.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsconform.results import compare, noise, records, summary
from dsconform.results import format as results_format
from dsconform.results.node_folder import (
    EXIT_STATUS,
    AggregateInputError,
    NodeResult,
    load_node,
)

#: Files that make a folder a node's results folder (what the plugin writes under --results).
#: The marker of aggregate's own output folder, which may sit beside the node folders.
FORMAT = "dsconform-cluster/1"
REPORT_JSON = "cluster.json"
#: How deep below a DIR argument node folders are looked for (nightly/node7,
#: nightly/multinode/node7-rank3).
MAX_DEPTH = 2
DEFAULT_OUTLIER_PCT = 90.0
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
DRAIN_REASON_CHARS = 100
_RANK_SUFFIX = re.compile(r"-rank\d+$")
#: The hardware error gate's actions that fail a node, most severe first
#: (dsconform/node/severity.py FAILING): its failure reasons start with one.
HARDWARE_ACTIONS = ("ISOLATE", "REBOOT", "RESET")
_HARDWARE_REASON = re.compile(rf"^\d+ x ({'|'.join(HARDWARE_ACTIONS)}) \(")


@dataclass(frozen=True)
class Outlier:
    node: str
    metric: str          # the measure's key: "STABLE-ID[case]::metric"
    value: float
    unit: str
    better: str
    fleet_median: float
    ratio: float         # performance relative to the median: 1.0 = the median, 0.8 = 20% worse
    limit: float | None  # the floor (or ceiling) the suite enforced, which the node still met
    fleet: int           # nodes of its type that measured it
    node_type: str = ""  # what it was compared within (node_type): "h200-x2, 2x NVIDIA H200"


@dataclass
class Job:
    """A multi-node job: the ranks of one rendezvous whose folders were given."""
    job: str
    world_size: int
    nodes: int
    members: list[NodeResult] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(m.failed for m in self.members)


@dataclass
class ClusterReport:
    nodes: list[NodeResult]
    jobs: list[Job]
    capabilities: list[str]
    outliers: list[Outlier]
    known_issues: list[dict[str, Any]]
    # key -> node -> ratio to the median of the node's type (the heat map)
    metrics: dict[str, dict[str, float]]
    outlier_pct: float
    sources: list[str]
    scheduler: str = "slurm"       # whose commands drain_commands prints (SCHEDULERS)

    @property
    def failed_nodes(self) -> list[NodeResult]:
        return [n for n in self.nodes if n.failed]

    @property
    def failed(self) -> bool:
        return bool(self.failed_nodes)


# ------------------------------------------------------------------ reading

def _is_node_dir(path: Path) -> bool:
    # dsconform.prom alone: a run refused, or killed, before it wrote anything else.
    return any((path / f).is_file()
               for f in (*results_format.RESULT_FILES, results_format.PROM_FILE))


def _is_own_output(path: Path) -> bool:
    """aggregate's own output folder, written beside the node folders: not a node."""
    report = path / REPORT_JSON
    if not report.is_file():
        return False
    try:
        return json.loads(report.read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def find_node_dirs(root: Path, depth: int = 0) -> list[Path]:
    """The node folders at or below ``root`` (MAX_DEPTH levels). Raises AggregateInputError for
    an empty folder or one that holds no results."""
    if _is_node_dir(root):
        return [root]
    if _is_own_output(root):
        return []
    entries = [p for p in root.iterdir() if not p.name.startswith(".")]
    if not entries:
        raise AggregateInputError(
            f"{root}: empty folder: no node wrote results here (did its run start? is the shared "
            "results directory mounted on that node?); rerun the node or remove the folder")
    found: list[Path] = []
    if depth < MAX_DEPTH:
        for sub in sorted(p for p in entries if p.is_dir()):
            found += find_node_dirs(sub, depth + 1)
    if not found:
        raise AggregateInputError(
            f"{root}: no dsconform results in it (no "
            f"{', '.join(results_format.RESULT_FILES)} here or in the "
            f"folders below, {MAX_DEPTH} levels deep); give node folders written by `pytest "
            "suites --results DIR`, or the folder that holds them")
    return found


def collect(dirs: list[str | Path]) -> list[NodeResult]:
    """Every node folder under the given directories, each once. Raises AggregateInputError."""
    if not dirs:
        raise AggregateInputError("no folders given: dsconform aggregate DIR [DIR...]")
    paths: list[Path] = []
    for d in dirs:
        p = Path(d)
        if not p.exists():
            raise AggregateInputError(f"{d}: no such directory")
        if not p.is_dir():
            raise AggregateInputError(f"{d}: not a directory; give a node's --results folder or "
                                      "the folder that holds the nodes' folders")
        found = find_node_dirs(p)
        if not found:  # only aggregate's own output folder
            raise AggregateInputError(f"{d}: an aggregate report, not node results")
        paths += found
    by_name: dict[str, Path] = {}
    for p in paths:
        other = by_name.get(p.name)
        if other is not None:
            same = other.resolve() == p.resolve()
            raise AggregateInputError(
                f"node {p.name} appears twice: {other} and {p}"
                + (" (the same folder, given twice)" if same else "")
                + "; aggregate each node's results once (keep one folder per node: "
                  "--results $SHARED/$(hostname))")
        by_name[p.name] = p
    nodes = [load_node(p) for p in sorted(paths, key=lambda q: q.name)]
    runs: dict[str, NodeResult] = {}
    for n in nodes:
        if n.run_id and n.run_id in runs:
            raise AggregateInputError(
                f"the same run appears twice, as {runs[n.run_id].path} and {n.path} (same host "
                f"{n.hostname}, same finish time and rank): a copied folder? Keep one")
        runs[n.run_id] = n
    _check_jobs(nodes)
    return nodes


def _check_jobs(nodes: list[NodeResult]) -> None:
    seen: dict[tuple[str, Any], NodeResult] = {}
    for n in nodes:
        if n.job is None:
            continue
        key = (n.job, (n.rendezvous or {}).get("rank"))
        if key in seen:
            raise AggregateInputError(
                f"rank {key[1]} of job {key[0]} appears twice: {seen[key].path} and "
                f"{n.path}; each rank writes its own folder (--results .../$(hostname)-rank$RANK)")
        seen[key] = n


# ------------------------------------------------------------------ analysis

def is_performance(m: compare.Measure) -> bool:
    """A speed (a rate, a time) that is judged (noise.not_judged): what a median of nodes makes
    sense for."""
    return (m.unit in records.PERFORMANCE_UNITS
            and noise.not_judged(m.metric, m.unit, m.seconds, m.rounds) is None)


def relative(value: float, median: float, better: str) -> float | None:
    """Performance relative to the median, direction-aware (1.0 = the median, 0.5 = half
    as fast). None where it has no meaning (a median of 0, a value that is not finite)."""
    if not (math.isfinite(value) and math.isfinite(median)) or median <= 0:
        return None
    if better == "higher":
        return value / median
    return median / value if value > 0 else math.inf


def node_type(n: NodeResult) -> str:
    """What a node's performance is compared within: its profile and its GPUs."""
    env = n.environment
    return f"{env.get('profile', '-')}, {env.get('GPU', '-')}"


def fleet(nodes: list[NodeResult]) -> dict[tuple[str, str], dict[str, compare.Measure]]:
    """(node type, performance metric key) -> node name -> measure, for the metrics two or
    more nodes of one type measured."""
    by_key: dict[tuple[str, str], dict[str, compare.Measure]] = {}
    for n in nodes:
        for key, m in n.measures.items():
            if is_performance(m):
                by_key.setdefault((node_type(n), key), {})[n.name] = m
    return {k: v for k, v in sorted(by_key.items()) if len(v) >= 2}


def analyse(nodes: list[NodeResult], outlier_pct: float = DEFAULT_OUTLIER_PCT,
            sources: list[str] | None = None, expect: list[str] | None = None) -> ClusterReport:
    """The cluster report. ``expect``: the nodes that should have results (a job's node list);
    one without a single-node folder is a failing node too."""
    if not 0 < outlier_pct <= 100:
        raise ValueError(f"--outlier-pct {outlier_pct}: must be a percentage in (0, 100]")
    present = {n.name for n in nodes if n.job is None}
    absent = [NodeResult.missing(name) for name in dict.fromkeys(expect or [])
              if name not in present]
    nodes = sorted([*nodes, *absent], key=lambda n: n.name)
    outliers, ratios = [], {}
    for (kind, key), per_node in fleet(nodes).items():
        values = [m.value for m in per_node.values() if math.isfinite(m.value)]
        if len(values) < 2:
            continue
        median = statistics.median(values)
        for name, m in per_node.items():
            r = relative(m.value, median, m.better)
            if r is None:
                continue
            ratios.setdefault(key, {})[name] = r
            if r < outlier_pct / 100:
                outliers.append(Outlier(name, key, m.value, m.unit, m.better, median, r,
                                        m.limit, len(per_node), kind))
    outliers.sort(key=lambda o: (o.ratio, o.node))
    caps = sorted({c for n in nodes for c in n.capabilities})
    return ClusterReport(nodes, _jobs(nodes), caps, outliers, known_issues(nodes),
                         {k: v for k, v in sorted(ratios.items()) if v}, outlier_pct,
                         sources or [])


def _jobs(nodes: list[NodeResult]) -> list[Job]:
    jobs: dict[str, Job] = {}
    for n in nodes:
        if n.job is None:
            continue
        r = n.rendezvous or {}
        job = jobs.setdefault(n.job, Job(n.job, int(r.get("world_size") or 0),
                                         int(r.get("nodes") or 0)))
        job.members.append(n)
    for job in jobs.values():
        job.members.sort(key=lambda m: (m.rendezvous or {}).get("rank") or 0)
    return [jobs[k] for k in sorted(jobs)]


def known_issues(nodes: list[NodeResult]) -> list[dict[str, Any]]:
    """Each known upstream issue once: where it was hit and how many cases it covered."""
    merged: dict[str, dict[str, Any]] = {}
    for n in nodes:
        for ki in n.known_issues:
            if not isinstance(ki, dict) or "id" not in ki:
                continue
            entry = merged.setdefault(ki["id"], {
                "id": ki["id"], "title": ki.get("title", ""), "link": ki.get("link", ""),
                "deepspeed": ki.get("deepspeed", ""), "nodes": [], "cases": 0})
            entry["nodes"].append(n.name)
            entry["cases"] += int(ki.get("count") or len(ki.get("cases") or ()))
    return [merged[k] for k in sorted(merged)]


def cell(counts: dict[str, int] | None) -> str:
    """A capability's verdict on one node, for the matrix."""
    if not counts:
        return "-"
    failed = sum(counts.get(k, 0) for k in summary.FAILED)
    ran = sum(v for k, v in counts.items() if k != "skipped")
    if failed:
        return f"FAIL {failed}/{ran}"
    if ran:
        known = counts.get("xfailed", 0)
        return f"ok {ran}" + (f" ({known} known)" if known else "")
    return "skip"


# ------------------------------------------------------------------ draining (printed only)

def drain_problem(problems: list[str]) -> str:
    """The problem a drain reason names: a hardware action when the node has one (the most
    severe), so the reason says ISOLATE, REBOOT or RESET; else the first problem."""
    actions = [(HARDWARE_ACTIONS.index(m.group(1)), i) for i, p in enumerate(problems)
               if (m := _HARDWARE_REASON.match(p))]
    return problems[min(actions)[1]] if actions else problems[0]


def _drain_reason(problem: str) -> str:
    text = re.sub(r'["`$\\\n\r\t]+', " ", problem)
    text = re.sub(r"\s+", " ", text).strip()
    reason = f"dsconform: {text}"
    return reason if len(reason) <= DRAIN_REASON_CHARS else reason[:DRAIN_REASON_CHARS - 3] + "..."


#: The schedulers whose commands drain_commands prints (``dsconform aggregate --scheduler``).
SCHEDULERS = ("slurm", "k8s")
#: A Kubernetes node name is an RFC 1123 subdomain; a label value is at most 63 characters of
#: [A-Za-z0-9._-], beginning and ending with a letter or digit (an empty value is valid too).
_K8S_NODE_NAME = re.compile(r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?"
                            r"(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
K8S_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
#: The node's dsconform/reason annotation: the whole problem, up to this many characters.
K8S_ANNOTATION_CHARS = 1000
#: A problem's short token (the dsconform/reason label), by how NodeResult.problems words it.
_REASON_TOKENS = (("no results folder", "no-results"), ("the run did not finish", "unfinished"),
                  ("the run was refused", "refused"),
                  ("no GPU found", "no-gpu"), ("the run recorded no test", "no-tests"),
                  ("no benchmarks.json", "incomplete-results"))


def reason_token(node: NodeResult, problem: str) -> str:
    """The problem as a valid Kubernetes label value: the hardware action (isolate, reboot,
    reset), how the run ended badly, or ``failed-<capabilities>`` for failing tests."""
    if m := _HARDWARE_REASON.match(problem):
        token = m.group(1).lower()
    elif problem.startswith("pytest exit status"):
        token = EXIT_STATUS.get(node.exitstatus or 0, f"exit-{node.exitstatus}")
    else:
        token = next((t for prefix, t in _REASON_TOKENS if problem.startswith(prefix)), "")
    if not token:
        failed = [c for c, counts in node.capabilities.items()
                  if isinstance(counts, dict) and any(counts.get(k) for k in summary.FAILED)]
        token = "-".join(["failed", *failed])
    token = re.sub(r"[^A-Za-z0-9._-]+", "-", token)[:63].strip("-._")
    return token or "failed"


def _kubectl(name: str, token: str, problem: str) -> list[str]:
    text = re.sub(r"[\s\x00-\x1f\x7f]+", " ", f"dsconform: {problem}").strip()
    if len(text) > K8S_ANNOTATION_CHARS:
        text = text[:K8S_ANNOTATION_CHARS - 3] + "..."
    return [f"kubectl cordon {name}",
            f"kubectl taint nodes {name} dsconform/verdict=failed:NoSchedule --overwrite",
            f"kubectl label nodes {name} dsconform/verdict=failed dsconform/reason={token} "
            "--overwrite",
            f"kubectl annotate nodes {name} {shlex.quote('dsconform/reason=' + text)} --overwrite"]


def drain_commands(report: ClusterReport, scheduler: str | None = None) -> list[str]:
    """The commands that would drain each failing node, for a person to run: Slurm's
    ``scontrol ... state=drain``, or for ``k8s`` kubectl's cordon, a ``dsconform/verdict``
    NoSchedule taint, the ``dsconform/verdict`` and ``dsconform/reason`` labels and the whole
    reason as an annotation (scheduler: default the report's). A failing rank of a multi-node
    job names no node by itself (the fault may be its peer or the network): it gets a comment,
    not a command. A failing job on one node names that node."""
    scheduler = scheduler or report.scheduler
    if scheduler not in SCHEDULERS:
        raise ValueError(f"--scheduler {scheduler!r}: expected one of {', '.join(SCHEDULERS)}")
    k8s = scheduler == "k8s"
    valid = (_K8S_NODE_NAME if k8s else _NODE_NAME).match
    kind = "Kubernetes" if k8s else "Slurm"
    hint = "/results/$(NODE_NAME), from spec.nodeName" if k8s else "$SHARED/$(hostname)"

    def commands(name: str, n: NodeResult, prefix: str = "") -> list[str]:
        problem = drain_problem(n.problems)
        if k8s:
            return _kubectl(name, reason_token(n, problem), prefix + problem)
        return [f'scontrol update nodename={name} state=drain '
                f'reason="{_drain_reason(prefix + problem)}"']

    lines = []
    drained: set[str] = set()  # one command per node, its first failure's reason
    for n in sorted(report.failed_nodes, key=lambda n: n.job is not None):
        one_node = n.job is not None and int((n.rendezvous or {}).get("nodes") or 1) == 1
        if one_node:  # its ranks all ran there: drain that node, named as its folders are
            name = _RANK_SUFFIX.sub("", n.name)  # <node>-rank<R> (examples/nightly-node.sh)
            if name in drained:
                continue
            drained.add(name)
            if valid(name):
                lines += commands(name, n, f"job {n.job} rank {n.name}: ")
            else:
                lines.append(f"# {name!r} (job {n.job}): not a valid {kind} node name")
        elif n.job is not None:
            lines.append(f"# {n.name}: rank of multi-node job {n.job} failed; a multi-node "
                         "failure names no single node: compare the nodes' single-node runs")
        elif not valid(n.name):
            lines.append(f"# {n.name!r}: not a valid {kind} node name (name the folder after the "
                         f"node: --results {hint})")
        elif n.name not in drained:
            drained.add(n.name)
            lines += commands(n.name, n)
    return lines
