"""A run's verdict for Prometheus: ``dsconform.prom`` in node_exporter's textfile format, built
from the results folder's documents, and the cluster view ``cluster.prom`` from
``dsconform aggregate``.

The series (docs/fleet.md lists them with their labels):

- the verdict: ``dsconform_node_passed`` (1: the run accepts the node), the problems behind a 0
  (the ones ``dsconform aggregate`` names: failures, an interrupted, unfinished or refused run, a
  run that recorded nothing), whether the run finished, whether it was refused (it never started:
  a bad option, profile or folder), and pytest's exit status with its meaning;
- per capability (summary.json's keys) the tests passed, failed, skipped and known (strict xfails
  of a known upstream issue);
- every measured rate (benchmarks.json, read as ``dsconform compare`` reads it) in base units,
  bytes or floating-point operations per second, with its floor as a series of its own;
- the hardware error gate's counters per GPU and its findings per action, at the start and the
  end of the run (the facts ``health.start.*`` and ``health.end.*``), and of a
  ``dsconform health --json`` saved beside the results as ``health.json``;
- the run's start and end, the versions and the profile;
- a ``--soak`` run's burn-in per GPU (``dsconform_soak_*{gpu="0",bus_id=...}``): iterations,
  mismatches, throughput drift, matmul rate per window, highest temperature, slowdown clock
  events, gate findings; the soak's verdict and length.

The families are plain prometheus_client metric families in a registry of their own;
``write`` puts them in a file atomically (prometheus_client's ``write_to_textfile``: a temporary
file in the same folder, then a rename), so node_exporter never reads half a file.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, write_to_textfile
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)

from dsconform.results import aggregate, attempt, node_folder, summary
from dsconform.results import format as results_format

PROM_FILE = results_format.PROM_FILE  # node_exporter's convention: one file per job
CLUSTER_PROM = "cluster.prom"
#: `dsconform health --json`, where the job saved it beside the results.
HEALTH_JSON = "health.json"
PREFIX = "dsconform_"
#: A rate's unit -> (the series' unit suffix, the factor to base units, the unit in words).
RATE_UNITS: dict[str, tuple[str, float, str]] = {
    "GB/s": ("bytes_per_second", 1e9, "bytes per second (GB/s x 1e9)"),
    "TFLOPS": ("flop_per_second", 1e12, "floating-point operations per second (TFLOPS x 1e12)"),
    "steps/s": ("steps_per_second", 1.0, "steps per second"),
    "samples/s": ("samples_per_second", 1.0, "samples per second"),
}
RATE_LABELS = ("capability", "test", "metric", "size_bytes", "dtype", "gpu", "bus_id")
#: The summary table's columns: what each counts.
OUTCOME_COLUMNS = summary.COLUMNS
ACTIONS = (*aggregate.HARDWARE_ACTIONS, "MONITOR")
_ACTION = re.compile(rf"^({'|'.join(ACTIONS)})\b")
#: The phases of the gate: the suite's HEALTH-1 and HEALTH-2, and `dsconform health`.
PHASES = ("start", "end", "check")
GPU_LABELS = ("gpu", "bus_id", "when")
#: The versions info's labels and the machine_info keys they come from.
VERSIONS = (("dsconform", "dsconform"), ("deepspeed", "deepspeed"), ("torch", "torch"),
            ("cuda", "cuda"), ("nccl", "nccl"), ("driver", "driver"),
            ("python", "python_version"))


class TextfileError(OSError):
    """A textfile that cannot be written, naming the folder."""


class _Families:
    """A collector that hands the registry the families built from the documents."""

    def __init__(self, families: Iterable[Metric]):
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def registry_of(families: Iterable[Metric]) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Families(f for f in families if f.samples))  # no HELP without a sample
    return reg


def _gauge(name: str, doc: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, labels=list(labels))


def _counter(name: str, doc: str, labels: Iterable[str] = ()) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, labels=list(labels))


def _label(value: Any) -> str:
    """A label's text: "" where the record has no value (Prometheus reads "" as absent)."""
    if value is None or isinstance(value, (dict, list)):
        return ""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    return float(value) if results_format.is_number(value) else None


# ------------------------------------------------------------------ one node

def verdict_families(node: node_folder.NodeResult, labels: Mapping[str, str] | None = None
                     ) -> list[Metric]:
    """The node's verdict, as ``dsconform aggregate`` judges it (NodeResult.problems)."""
    names, values = list((labels or {}).keys()), list((labels or {}).values())
    passed = _gauge("node_passed", "1: the run accepts the node; 0: it does not (a failure, "
                    "an interrupted, unfinished or refused run, a run that recorded nothing)",
                    names)
    passed.add_metric(values, 0.0 if node.failed else 1.0)
    problems = _gauge("node_problems", "Reasons the run does not accept the node (failure "
                      "groups, exit status, an unfinished run): 0 on a pass", names)
    problems.add_metric(values, float(len(node.problems)))
    finished = _gauge("run_finished", "1: the run wrote its summary; 0: it is running, or "
                      "was killed before its end", names)
    finished.add_metric(values, 1.0 if node.finished else 0.0)
    refused = _gauge("run_refused", "1: the run was refused before its first test (a bad "
                     "option, profile or folder; the reason is in its summary.txt): its "
                     "verdict is 0", names)
    refused.add_metric(values, 1.0 if node.status == "refused" else 0.0)
    out: list[Metric] = [passed, problems, finished, refused]
    if isinstance(node.exitstatus, int) and not isinstance(node.exitstatus, bool):
        status = _gauge("run_exit_status", "pytest's exit status (0 passed, 1 tests failed, "
                        "2 interrupted, 3 internal error, 4 usage error, 5 no tests ran)",
                        [*names, "status"])
        code = int(node.exitstatus)
        status.add_metric([*values, "passed" if code == 0 else
                           aggregate.EXIT_STATUS.get(code, "unknown")], float(code))
        out.append(status)
    return out


def capability_family(nodes: Iterable[tuple[Mapping[str, str], Mapping[str, Mapping[str, int]]]],
                      name: str = "capability_tests") -> GaugeMetricFamily:
    """Tests per capability and outcome column (``known``: strict xfails, of a known upstream
    issue or a limitation; ``failed``: failed, error and xpassed), as the summary's table counts
    them."""
    nodes = list(nodes)
    extra = list(nodes[0][0]) if nodes else []
    fam = _gauge(name, "Tests of a capability by outcome, as the summary table counts them "
                 "(failed: failed, error, xpassed; known: strict xfails of a known upstream "
                 "issue or limitation)", [*extra, "capability", "outcome"])
    for labels, caps in nodes:
        for cap, counts in sorted(caps.items()):
            if not isinstance(counts, Mapping):
                continue
            for column, kinds in OUTCOME_COLUMNS:
                n = sum(int(counts.get(k) or 0) for k in kinds)
                fam.add_metric([*labels.values(), cap, column], float(n))
    return fam


def rate_families(node: node_folder.NodeResult) -> list[Metric]:
    """Every rate the run measured, in base units, and its floor where the suite held it to
    one; the count of rates below their floor (a NaN rate is below any floor)."""
    caps = {o.get("nodeid"): o.get("capability") or "" for o in node.outcomes
            if isinstance(o, dict)}
    rates: dict[str, GaugeMetricFamily] = {}
    floors: dict[str, GaugeMetricFamily] = {}
    below = 0
    seen: set[tuple[str, ...]] = set()
    for key, m in node.measures.items():
        if m.unit not in RATE_UNITS:
            continue
        suffix, factor, words = RATE_UNITS[m.unit]
        p = m.params
        # The test's stable id (compare's key without the metric): the same series run after
        # run. A second value with the same labels (one test, one metric, two links) is
        # numbered as compare numbers it.
        test, _, dup = key.partition(f"::{m.metric}")
        values = [caps.get(m.nodeid, ""), test, m.metric, _label(p.get("bytes")),
                  _label(p.get("dtype")), _label(p.get("gpu", p.get("src_gpu"))),
                  _label(p.get("bus_id", p.get("src_bus_id")))]
        if (suffix, *values) in seen:
            values[1] = test + dup
        seen.add((suffix, *values))
        if suffix not in rates:
            rates[suffix] = _gauge(f"rate_{suffix}", f"A measured rate, the median of its "
                                   f"rounds, in {words}", RATE_LABELS)
        rates[suffix].add_metric(values, m.value * factor)
        if m.limit is None:
            continue
        if suffix not in floors:
            floors[suffix] = _gauge(f"rate_floor_{suffix}", f"The floor the profile holds a "
                                    f"rate to, in {words}", RATE_LABELS)
        floors[suffix].add_metric(values, m.limit * factor)
        below += not m.value >= m.limit
    count = _gauge("rates_below_floor", "Measured rates whose median is below their floor")
    count.add_metric([], float(below))
    return [*rates.values(), *floors.values(), count]


def health_readings(doc: Mapping[str, Any] | None, check: Mapping[str, Any] | None
                    ) -> dict[str, dict[str, Any]]:
    """The gate's readings by phase: ``gpus`` (snapshots), ``actions`` (one per finding),
    ``kernel_xids``, ``xid_events``, and for ``check`` its ``exit_code`` and
    ``could_not_check``. From the facts health.<phase>.* and a health.json."""
    out: dict[str, dict[str, Any]] = {}
    facts = ((doc or {}).get("dsconform") or {}).get("facts") or []
    for f in facts:
        if not isinstance(f, dict):
            continue
        m = re.fullmatch(r"health\.(start|end)\.(\w+)", str(f.get("name", "")))
        if not m:
            continue
        phase, what, value = m.group(1), m.group(2), f.get("value")
        r = out.setdefault(phase, {"gpus": []})
        if what.startswith("gpu") and isinstance(value, dict):
            r["gpus"].append(value)
        elif what == "findings" and isinstance(value, list):
            r["actions"] = [_action(x) for x in value]
        elif what in ("kernel_xids", "xid_events") and isinstance(value, list):
            r[what] = len(value)
    if isinstance(check, Mapping) and isinstance(check.get("gpus"), list):
        findings = check.get("findings") if isinstance(check.get("findings"), list) else []
        out["check"] = {
            "gpus": [g for g in check["gpus"] if isinstance(g, dict)],
            "actions": [_action(x) for x in findings],
            **{k: len(check[k]) for k in ("kernel_xids", "xid_events", "could_not_check")
               if isinstance(check.get(k), list)},
            "exit_code": _number(check.get("exit_code"))}
    return out


def _action(finding: Any) -> str:
    """A finding's action: the start of its line (facts), or its ``action`` (health.json)."""
    if isinstance(finding, dict):
        finding = finding.get("action") or finding.get("line") or ""
    m = _ACTION.match(str(finding))
    return m.group(1) if m else "MONITOR"


#: (the snapshot's field, the series, its extra labels); _GPU_HELP: counter?, help
_GPU_SERIES = (
    ("uncorrected_volatile", "gpu_ecc_errors", {"kind": "uncorrected", "scope": "volatile"}),
    ("uncorrected_aggregate", "gpu_ecc_errors", {"kind": "uncorrected", "scope": "aggregate"}),
    ("corrected_volatile", "gpu_ecc_errors", {"kind": "corrected", "scope": "volatile"}),
    ("corrected_aggregate", "gpu_ecc_errors", {"kind": "corrected", "scope": "aggregate"}),
    ("remapped_rows.corrected", "gpu_remapped_rows", {"kind": "corrected"}),
    ("remapped_rows.uncorrected", "gpu_remapped_rows", {"kind": "uncorrected"}),
    ("remapped_rows.pending", "gpu_remap_pending", {}),
    ("remapped_rows.failed", "gpu_remap_failed", {}),
    ("retired_pages_pending", "gpu_retired_pages_pending", {}),
    ("pcie_replays", "gpu_pcie_replays", {}),
    ("pcie_width", "gpu_pcie_link_width", {}),
    ("pcie_max_width", "gpu_pcie_link_max_width", {}),
    ("recovery_action", "gpu_recovery_action", {}),
    ("compute_processes", "gpu_compute_processes", {}),
    ("persistence", "gpu_persistence_mode", {}),
    ("ecc_enabled", "gpu_ecc_mode", {}),
    ("reset_required", "gpu_reset_required", {}),
)
_GPU_HELP = {
    "gpu_ecc_errors": (True, "ECC errors NVML counts (volatile: since the driver loaded; "
                       "aggregate: the GPU's lifetime)"),
    "gpu_remapped_rows": (False, "Rows of GPU memory remapped"),
    "gpu_remap_pending": (False, "1: a row remap is pending (a GPU reset applies it)"),
    "gpu_remap_failed": (False, "1: a row remap failed (the GPU needs replacing)"),
    "gpu_retired_pages_pending": (False, "1: retired pages are pending (a reboot retires them)"),
    "gpu_pcie_replays": (True, "PCIe replays NVML counts"),
    "gpu_pcie_link_width": (False, "The PCIe link's width now (lanes)"),
    "gpu_pcie_link_max_width": (False, "The PCIe link's maximum width (lanes)"),
    "gpu_recovery_action": (False, "NVML's GPU recovery action (0: none)"),
    "gpu_compute_processes": (False, "Compute processes running on the GPU"),
    "gpu_persistence_mode": (False, "1: persistence mode on"),
    "gpu_ecc_mode": (False, "1: ECC on"),
    "gpu_reset_required": (False, "1: NVML says the GPU requires a reset"),
    "gpu_lost": (False, "1: NVML says the GPU is lost"),
    "gpu_unreadable_counters": (False, "Counters NVML could not read (the GPU could not be "
                                "checked)"),
    "gpu_nvlink_active": (False, "1: the NVLink is up"),
    "gpu_nvlink_errors": (True, "NVLink errors NVML counts, per link and kind"),
}


def _field(snapshot: Mapping[str, Any], path: str) -> float | None:
    value: Any = snapshot
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return _number(value)


def health_families(readings: Mapping[str, Mapping[str, Any]]) -> list[Metric]:
    """The gate's counters per GPU and phase (a counter NVML did not read has no series), and
    per phase its findings by action and the XIDs seen."""
    fams: dict[str, Metric] = {}

    def family(name: str, extra: Iterable[str]) -> Metric:
        if name not in fams:
            counter, doc = _GPU_HELP[name]
            make = _counter if counter else _gauge
            fams[name] = make(name, doc, [*GPU_LABELS, *extra])
        return fams[name]

    for phase in PHASES:
        for s in (readings.get(phase) or {}).get("gpus") or []:
            base = [_label(s.get("index")), _label(s.get("bus_id")), phase]
            for path, name, extra in _GPU_SERIES:
                v = _field(s, path)
                if v is not None:
                    family(name, extra).add_metric([*base, *extra.values()], v)
            family("gpu_lost", ()).add_metric(base, 1.0 if s.get("lost") else 0.0)
            unreadable = s.get("unreadable") if isinstance(s.get("unreadable"), dict) else {}
            family("gpu_unreadable_counters", ()).add_metric(base, float(len(unreadable)))
            for link in s.get("nvlinks") or []:
                if not isinstance(link, dict):
                    continue
                at = [*base, _label(link.get("link"))]
                family("gpu_nvlink_active", ("link",)).add_metric(
                    at, 1.0 if link.get("active") else 0.0)
                for kind in ("replay", "recovery", "crc_flit", "crc_data"):
                    v = _number(link.get(kind))
                    if v is not None:
                        family("gpu_nvlink_errors", ("link", "kind")).add_metric([*at, kind], v)
    findings = _gauge("health_findings", "The hardware error gate's findings by action "
                      "(ISOLATE, REBOOT, RESET fail the node; MONITOR does not)",
                      ["when", "action"])
    xids = _gauge("health_xids", "XIDs the gate saw (source kernel_log: the kernel log's Xid "
                  "and SXid lines since boot; nvml_events: NVML's XID events during the run)",
                  ["when", "source"])
    out = list(fams.values())
    for phase in PHASES:
        r = readings.get(phase)
        if r is None:
            continue
        if "actions" in r:
            for action in ACTIONS:
                findings.add_metric([phase, action], float(r["actions"].count(action)))
        for key, source in (("kernel_xids", "kernel_log"), ("xid_events", "nvml_events")):
            if key in r:
                xids.add_metric([phase, source], float(r[key]))
    out += [findings, xids]
    check = readings.get("check")
    if check is not None and check.get("exit_code") is not None:
        code = _gauge("health_check_exit_code", "`dsconform health`'s exit code (0 healthy, 1 "
                      "an action is needed, 2 could not check)")
        code.add_metric([], check["exit_code"])
        out.append(code)
    return out


def run_families(doc: Mapping[str, Any] | None, started: str | None = None,
                 ended: str | None = None) -> list[Metric]:
    """The run's start and end, the versions and the profile. ``started`` and ``ended``: for a
    run that wrote no benchmarks.json (running, refused)."""
    ds = (doc or {}).get("dsconform") or {}
    mi = (doc or {}).get("machine_info") or {}
    out: list[Metric] = []
    for name, text, doc_ in (
            ("run_start_timestamp_seconds", ds.get("started") or started,
             "When the run started, seconds since the epoch"),
            ("run_end_timestamp_seconds", ds.get("finished") or ended,
             "When the run wrote its results, seconds since the epoch")):
        t = attempt.timestamp(text)
        if t is not None:
            fam = _gauge(name, doc_)
            fam.add_metric([], t)
            out.append(fam)
    if mi:
        out.append(InfoMetricFamily(PREFIX + "versions", "The versions the run ran with",
                                    value={label: _label(mi.get(key)) for label, key in VERSIONS}))
        profile = mi.get("profile") or (ds.get("profile") or {}).get("name")
        out.append(InfoMetricFamily(PREFIX + "run", "The node and the profile it was held to",
                                    value={"profile": _label(profile),
                                           "hostname": _label(mi.get("node")),
                                           "gpu_model": _label(mi.get("gpu_model")),
                                           "gpus": _label(mi.get("gpu_count"))}))
    return out


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def node_families(folder: Path, started: str | None = None) -> list[Metric]:
    """Every series of one node's results folder. A folder that cannot be read, or a document
    that lacks a field, gives fewer series and a verdict of 0, never an exception.
    ``started``: the run's start, for a run that has written no document yet."""
    try:
        node = node_folder.load_node(folder)
    except node_folder.AggregateInputError as e:
        node = node_folder.NodeResult.missing(folder.name)
        node.absent, node.notices = False, [str(e)]
    try:
        doc = results_format.load_benchmarks(folder)
    except results_format.ResultsFormatError:
        doc = None
    check = _read_json(folder / HEALTH_JSON)
    summ = _read_json(folder / results_format.SUMMARY_JSON)
    summ = summ if isinstance(summ, dict) else {}
    return [*result_families(node, doc, check, started=started or summ.get("started"),
                             ended=summ.get("ended")),
            *soak_families(summ.get(results_format.SOAK_SECTION))]


def result_families(node: node_folder.NodeResult, doc: Mapping[str, Any] | None = None,
                    check: Mapping[str, Any] | None = None, *, started: str | None = None,
                    ended: str | None = None) -> list[Metric]:
    """The series of a node's result: its verdict, tests, rates, the gate's readings, the
    run's start and end."""
    return [*verdict_families(node), capability_family([({}, node.capabilities)]),
            *rate_families(node), *health_families(health_readings(doc, check)),
            *run_families(doc, started, ended)]


#: The soak's per-GPU series: (the report's field, the series, its help, the factor to base units).
_SOAK_SERIES = (
    ("iterations", "soak_iterations", "Iterations of the burn-in loop the GPU completed", 1.0),
    ("mismatches", "soak_mismatches", "Wrong results the burn-in found on the GPU (hashes, "
     "peers, float64 reference, ZeRO against DDP, HBM words)", 1.0),
    ("drift_pct", "soak_throughput_drift_ratio", "How much the sustained matmul rate of the last "
     "window of iterations is below the first's (0.05: 5% slower)", 0.01),
    ("max_temperature_c", "soak_temperature_max_celsius", "The GPU's highest temperature during "
     "the burn-in", 1.0),
    ("slowdown_temperature_c", "soak_slowdown_temperature_celsius", "The temperature at which "
     "the GPU slows itself down (NVML's threshold)", 1.0),
    ("samples", "soak_gate_samples", "Readings of the GPU by the hardware gate's sampler", 1.0),
)


def soak_families(section: Any) -> list[Metric]:
    """A --soak run's series (summary.json's ``soak``): per GPU its iterations, mismatches,
    throughput drift, matmul rate of the first and last windows, highest temperature, slowdown
    clock events by reason and gate findings; the soak's verdict and length. None without one."""
    if not isinstance(section, Mapping) or not isinstance(section.get("gpus"), list):
        return []
    labels = ("gpu", "bus_id")
    fams = [_gauge(name, doc, labels) for _, name, doc, _ in _SOAK_SERIES]
    rate = _gauge("soak_matmul_flop_per_second", "The sustained bf16 matmul rate, median of the "
                  "first and of the last window of iterations, " + RATE_UNITS["TFLOPS"][2],
                  [*labels, "window"])
    throttle = _gauge("soak_throttle_samples", "Sampler readings that showed a slowdown clock "
                      "event (NVML's reason)", [*labels, "reason"])
    findings = _gauge("soak_gate_findings", "Hardware gate findings (ISOLATE, REBOOT, RESET) "
                      "during the burn-in", labels)
    for g in section["gpus"]:
        if not isinstance(g, Mapping):
            continue
        at = [_label(g.get("gpu")), _label(g.get("bus_id"))]
        for (key, _, _, factor), fam in zip(_SOAK_SERIES, fams):
            v = _number(g.get(key))
            if v is not None:
                fam.add_metric(at, v * factor)
        for window in ("first", "last"):
            v = _number(g.get(f"tflops_{window}"))
            if v is not None:
                rate.add_metric([*at, window], v * RATE_UNITS["TFLOPS"][1])
        for reason, n in (g.get("throttle") or {}).items():
            throttle.add_metric([*at, str(reason)], float(n))
        findings.add_metric(at, float(len(g.get("findings") or [])))
    passed = _gauge("soak_passed", "1: the burn-in found nothing wrong on any GPU")
    passed.add_metric([], 1.0 if section.get("passed") else 0.0)
    length = _gauge("soak_duration_seconds", "How long the burn-in ran, and how long it was asked "
                    "to (--soak MINUTES)", ["kind"])
    for kind, v in (("ran", _number(section.get("elapsed_s"))),
                    ("asked", (_number(section.get("minutes")) or 0.0) * 60.0)):
        if v is not None:
            length.add_metric([kind], v)
    return [*fams, rate, throttle, findings, passed, length]


def write(families: Iterable[Metric], path: Path) -> Path:
    """Write the families to ``path`` in the text format, atomically (a temporary file in the
    same folder, then a rename). Raises TextfileError naming the folder."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_to_textfile(str(path), registry_of(families))
    except OSError as e:
        raise TextfileError(f"cannot write {path.name} into {path.parent}: "
                            f"{e.strerror or e}") from None
    return path


def write_run(folder: Path, textfile_dir: str | Path | None = None,
              started: str | None = None) -> list[Path]:
    """dsconform.prom into the results ``folder``, and into ``textfile_dir`` (the folder
    node_exporter's textfile collector reads) when given."""
    families = node_families(folder, started)
    paths = [write(families, folder / PROM_FILE)]
    if textfile_dir:
        paths.append(write(families, Path(textfile_dir).expanduser() / PROM_FILE))
    return paths


# ------------------------------------------------------------------ the cluster

def cluster_families(report: aggregate.ClusterReport) -> list[Metric]:
    """Per node its verdict and its tests per capability; its performance ratios (1.0: the
    median of its node type) and outliers."""
    passed = _gauge("cluster_node_passed", "1: the node's run accepts it (dsconform aggregate)",
                    ["node", "job"])
    problems = _gauge("cluster_node_problems", "Reasons a node's run does not accept it",
                      ["node", "job"])
    outliers = _gauge("cluster_node_outliers", "The node's performance metrics below the "
                      "outlier share of the median of its node type", ["node", "job"])
    per_node = {n.name: 0 for n in report.nodes}
    for o in report.outliers:
        per_node[o.node] = per_node.get(o.node, 0) + 1
    for n in report.nodes:
        labels = [n.name, n.job or ""]
        passed.add_metric(labels, 0.0 if n.failed else 1.0)
        problems.add_metric(labels, float(len(n.problems)))
        outliers.add_metric(labels, float(per_node.get(n.name, 0)))
    caps = capability_family([({"node": n.name}, n.capabilities) for n in report.nodes],
                             "cluster_capability_tests")
    ratio = _gauge("cluster_performance_ratio", "A node's performance relative to the median "
                   "of its node type, direction-aware (1: the median; 0.5: half as fast)",
                   ["node", "metric"])
    for key, by_node in sorted(report.metrics.items()):
        for name, r in sorted(by_node.items()):
            if math.isfinite(r):
                ratio.add_metric([name, key], r)
    threshold = _gauge("cluster_outlier_threshold_ratio", "The share of the median of its "
                       "node type below which a node is an outlier (--outlier-pct / 100)")
    threshold.add_metric([], report.outlier_pct / 100)
    verdict = _gauge("cluster_passed", "1: every node's run accepts it")
    verdict.add_metric([], 0.0 if report.failed else 1.0)
    return [verdict, passed, problems, outliers, caps, ratio, threshold]


def write_cluster(report: aggregate.ClusterReport, out: Path) -> Path:
    """cluster.prom into ``out``, atomically."""
    return write(cluster_families(report), out / CLUSTER_PROM)
