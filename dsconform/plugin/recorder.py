"""The run's recorder: every test's outcome, metric and fact as it ends (records.jsonl), and at
the session's end benchmarks.json (pytest-benchmark's format, machine_info extended),
summary.json and summary.txt in --results."""

from __future__ import annotations

import contextlib
import inspect
import json
import platform
import re
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

import dsconform
from dsconform.gate import known_issues
from dsconform.node import nccl_env
from dsconform.plugin import refusal
from dsconform.plugin.keys import ITEM_CAPABILITY
from dsconform.plugin.runstate import RunState
from dsconform.profile.select import rendezvous_info
from dsconform.results import aggregate, prometheus, records, summary, verdict
from dsconform.results import format as results_format
from dsconform.results.node_folder import node_from_summary
from dsconform.results.run_files import write_atomically


def must_statement(doc: str | None) -> str:
    """A test's MUST statement: its docstring's first paragraph on one line (``ZERO-EQ-1: ...``;
    a statement wrapped over several lines is kept whole)."""
    first = inspect.cleandoc(doc or "").split("\n\n")[0]
    return " ".join(line.strip() for line in first.splitlines() if line.strip())


def _reason(report: pytest.TestReport) -> str:
    """One line: a skip's or an expected failure's reason, or the first line of the failure's
    message."""
    if report.skipped and hasattr(report, "wasxfail"):
        return str(report.wasxfail)[:300]
    if report.skipped and isinstance(report.longrepr, tuple):
        return re.sub(r"^Skipped: ", "", str(report.longrepr[2]))
    if not report.failed:
        return ""
    crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", None)
    text = crash if crash else (report.longreprtext or "")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    first = re.sub(r"^(Failed|E): ", "", lines[0]) if lines else ""
    return first[:300]


def case_facts(item: pytest.Item, known_issue: str) -> dict[str, str]:
    """What an outcome records about its test beside the report (records.CASE_PROPERTY)."""
    return {"capability": item.stash.get(ITEM_CAPABILITY, "")
            or capability_from_nodeid(item.nodeid),
            "must": must_statement(getattr(getattr(item, "function", None), "__doc__", None)),
            "known_issue": known_issue}


def capability_from_nodeid(nodeid: str) -> str:
    path = Path(nodeid.split("::", 1)[0])
    return re.sub(r"^test_|\.py$", "", path.name) if path.parent.name == "suites" else "project"


class Recorder:
    """Collects outcomes and metrics where reports arrive (the xdist controller, or the only
    process), and writes the results at the end. Registered as a plugin in pytest_configure."""

    def __init__(self, state: RunState):
        self.state = state
        # Each test's records.CASE_PROPERTY, from its setup and call reports (the only way it
        # reaches an xdist controller); a teardown report's outcome takes it from there.
        self.cases: dict[str, dict[str, str]] = {}
        # Selected tests that need a GPU, from the reports' keywords (under xdist the controller
        # never sees the items), and how many of them ran (not skipped).
        self.gpu_tests: set[str] = set()
        self.gpu_tests_ran = 0
        # (node id, the error's first line) of each file that did not collect: a run stopped
        # by them says so, not "interrupted".
        self.collection_errors: list[tuple[str, str]] = []
        self.stopped: str | None = None  # why the run stopped early, said after its summary
        # The run's verdict in one line (dsconform.results.verdict), the last of summary.txt
        # and of the plugin's console output; None until the session ends.
        self.verdict: str | None = None
        # A usage error that stopped collection (a test path that does not exist): the run was
        # refused, in pytest's words.
        self.refused: str | None = None
        if state.results is not None:  # this run's journal starts empty (the last one's was
            # set aside at configure: dsconform.plugin.refusal.begin)
            (state.results / "records.jsonl").write_text("")

    @pytest.hookimpl(wrapper=True)
    def pytest_collection(self, session: pytest.Session):
        try:
            return (yield)
        except pytest.UsageError as e:
            self.refused = str(e)
            raise

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.collection_errors.append((report.nodeid or ".", _error_line(report)))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        for key, value in report.user_properties:
            if key == records.CASE_PROPERTY:
                self.cases[report.nodeid] = dict(value)
        outcome = None
        if report.when == "call" or (report.when == "setup" and not report.passed):
            outcome = report.outcome
            if hasattr(report, "wasxfail"):
                outcome = "xfailed" if report.skipped else "xpassed"
            elif report.when == "setup" and report.failed:
                outcome = "error"
        elif report.when == "teardown":
            for key, value in report.user_properties:
                if key == records.USER_PROPERTY:
                    self.state.metrics.append(records.Metric(**value))
                    self._journal({"metric": value})
                elif key == records.FACT_PROPERTY:
                    self.state.facts.append(records.Fact(**value))
                    self._journal({"fact": value})
            if report.failed:
                outcome = "error"
        if outcome is None:
            return
        case = self.cases.get(report.nodeid, {})
        cap = case.get("capability") or capability_from_nodeid(report.nodeid)
        # A known issue is "hit" by a case that ran (xfailed, or failed/xpassed), not a skip.
        # (An intermittent issue's case that passed did not hit it either.)
        known = "" if outcome in ("skipped", "passed") else case.get("known_issue", "")
        o = records.Outcome(report.nodeid, outcome, cap, _reason(report),
                            round(report.duration, 3), case.get("must", ""), known)
        self.state.outcomes.append(o)
        if "gpu" in report.keywords:
            self.gpu_tests.add(report.nodeid)
            if outcome != "skipped":
                self.gpu_tests_ran += 1
        # When the phase that decided it ran (epoch seconds): where a run's time went.
        entry = {"outcome": asdict(o), "start": round(report.start, 3),
                 "stop": round(report.stop, 3)}
        batch_seconds = dict(report.user_properties).get(records.BATCH_SECONDS)
        if batch_seconds is not None:  # the cell's own call, which its test only waited for
            entry["batch_seconds"] = batch_seconds
        self._journal(entry)

    def _journal(self, entry: dict) -> None:
        """Append to records.jsonl as each test ends: if the run dies (a native crash, a kill at
        a time limit), what was measured so far is still on disk."""
        if self.state.results is not None:
            with open(self.state.results / "records.jsonl", "a") as f:
                f.write(json.dumps(entry, default=str) + "\n")

    def no_gpu_test_ran(self) -> str | None:
        """A run that cannot pass for want of GPUs, why in one line (None when that is not the
        case): the GPU tier where no GPU is found (profile.select.run_kind), or, on a node with
        NVIDIA GPUs, a run that selected GPU tests and ran none of them."""
        kind = self.state.kind
        if kind is not None and kind.failure:
            return kind.failure
        node = self.state.node
        if not node.is_gpu_node or not self.gpu_tests or self.gpu_tests_ran:
            return None
        why = node.unusable_gpus() or "every GPU test was skipped"
        return (f"this node has {node.gpus_present} NVIDIA GPUs, and none of the "
                f"{len(self.gpu_tests)} GPU tests selected ran ({why}): not a pass")

    def summary(self) -> dict[str, Any]:
        issues = {ki.id: ki.summary() for ki in known_issues.KNOWN_ISSUES}
        return summary.summarize(self.state.outcomes, issues)

    def interrupted(self, session: pytest.Session) -> str:
        ran = len({o.nodeid for o in self.state.outcomes})
        if n := len(self.collection_errors):
            where = "; ".join(f"{nodeid}: {line}" for nodeid, line in self.collection_errors[:3])
            more = f" (and {n - 3} more)" if n > 3 else ""
            return (f"the run stopped at collection after {ran} tests: {n} "
                    f"{'files' if n > 1 else 'file'} did not collect: {where}{more}; no test "
                    "ran past it, so this run does not accept the node")
        selected = len(session.items)  # 0 on an xdist controller, which collects nothing
        of = f" of {selected} selected" if selected >= ran and selected else ""
        return (f"the run was interrupted after {ran}{of} tests (Ctrl-C, or SIGINT from a time "
                "limit such as nightly-node.sh's DSCONFORM_TIME_S): the rest did not run, so "
                "this run does not accept the node")

    def lines(self, result: dict[str, Any]) -> list[str]:
        notices = list(self.state.notices)
        if (why := self.no_gpu_test_ran()) and why not in notices:
            notices.append(why)
        out = summary.lines(result, profile=self.state.profile.name,
                            host=self.state.node.hostname, notices=notices,
                            run=self.state.kind.description if self.state.kind else "")
        if self.state.op_builds is not None:  # what the cold start cost
            from dsconform.ops.prebuild import summary_line
            out += [ln for ln in [summary_line(self.state.op_builds.timings())] if ln]
        return out

    @staticmethod
    def run_lines(config: pytest.Config) -> list[str]:
        """What the run's machinery cost, after the verdict: rank and lane start-ups, their
        phases, the cell batch (docs/performance.md reads them)."""
        from dsconform.harness import timeline
        out: list[str] = [ln for ln in [timeline.line()] if ln]
        dist = sys.modules.get("dsconform.harness.api")
        stats = dist.startup_stats() if dist is not None else None
        if stats and stats["pools"]:
            out.append(f"rank start-ups: {stats['pools']} ({stats['from_standby']} from standby "
                       f"ranks), {stats['waited_s']:.1f} s waited for them")
        if stats and stats["lanes"]:
            out.append(f"lane start-ups: {stats['lanes']}, {stats['lane_waited_s']:.1f} s waited "
                       f"for them (summed over lanes); {stats['lane_calls']} calls ran on lanes")
        if dist is not None:
            ranks, phases = dist.startup_phases()
            if ranks:
                out.append(f"rank start-up, median of {ranks} ranks: "
                           + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()))
        if "dsconform.plugin.batch" in sys.modules:
            for b in sys.modules["dsconform.plugin.batch"].batch_stats(config):
                wait = b["longest_wait"]
                out.append(
                    f"cell batch: {b['cells']} cells of {', '.join(b['tests'])} at once "
                    f"({b['lanes']} lanes per world size) in {b['seconds']:.1f} s (its writes "
                    f"synced to disk in {b['sync_seconds']:.1f} s of it), in the "
                    "background from the end of collection"
                    + (" (stopped early)" if b["stopped"] else "")
                    + f"; tests waited {b['waited_s']:.1f} s for it"
                    + (f" (longest: {wait[1].split('::')[-1]} {wait[0]:.1f} s)" if wait else "")
                    + f"; the cells' calls add up to {b['cell_seconds']:.1f} s, longest: "
                    + ", ".join(f"{nodeid.split('::')[-1]} {sec:.1f} s"
                                for sec, nodeid in b["longest"]))
        return out

    def _verdict(self, result: dict[str, Any]) -> str:
        """The verdict line, read back from the results just written as dsconform.prom and
        `dsconform aggregate` read them."""
        try:
            node = aggregate.load_node(self.state.results)
        except aggregate.AggregateInputError:  # unreadable: judged from what was to be written
            node = verdict.of_summary(result, self.state.outcomes, self.state.node.hostname)
        return verdict.line(node, self.stopped)

    def pytest_terminal_summary(self, terminalreporter, exitstatus: int,
                                config: pytest.Config) -> None:
        if not self.state.outcomes:
            for why in dict.fromkeys(w for w in (self.stopped, self.no_gpu_test_ran()) if w):
                terminalreporter.write_line(f"dsconform: {why}")
            return
        terminalreporter.section("dsconform conformance summary")
        for line in self.lines(self.summary()) + self.run_lines(config):
            terminalreporter.write_line(line)
        if self.state.results:
            terminalreporter.write_line(f"results: {self.state.results}/benchmarks.json, "
                                        "summary.json, summary.txt, junit.xml, records.jsonl")

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if "dsconform.plugin.batch" in sys.modules:  # -x or Ctrl-C ended the run before the batch
            sys.modules["dsconform.plugin.batch"].stop(session.config)
        if self.no_gpu_test_ran() and session.exitstatus in (pytest.ExitCode.OK,
                                                              pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        state = self.state
        if session.exitstatus == pytest.ExitCode.INTERRUPTED:  # said in summary.json and .txt
            self.stopped = self.interrupted(session)
            state.notices.append(self.stopped)
        if self.refused:
            state.notices.append(self.refused)
        if refusal.conclude(session.config) is None:
            return
        textfile = session.config.getoption("prometheus_textfile", None)
        result = self.summary()
        if state.results is None:
            result.update(exitstatus=int(session.exitstatus), notices=state.notices)
            self.verdict = verdict.line(verdict.of_summary(
                result, state.outcomes, state.node.hostname), self.stopped)
            if textfile:  # the "not finished" written there at the start must not stay
                self._write_prom(None, textfile, session)
            return
        prof = {"name": state.profile.name, "source": state.profile.source,
                "how": state.selection.how}  # the profile in force and how it was chosen
        doc = records.document(
            state.metrics, state.outcomes, machine_info=_machine_info(state),
            commit_info=_commit_info(), profile=prof,
            extra_benchmarks=_pytest_benchmark_entries(session.config), started=state.started,
            known_issues=result["known_issues"], facts=state.facts)
        rdzv = rendezvous_info()  # which job and rank this was, for `dsconform aggregate`
        ops = state.op_builds.timings() if state.op_builds is not None else None
        doc["dsconform"]["ops"] = ops  # each op build's seconds (dsconform.ops.prebuild)
        status, reason = self.run_status(int(session.exitstatus))
        result.update(status=status, reason=reason, started=state.started,
                      ended=doc["dsconform"]["finished"],
                      run=({"gpu": state.kind.gpu, "description": state.kind.description}
                           if state.kind else None),
                      profile=prof, node=state.node.to_dict(),
                      exitstatus=int(session.exitstatus), notices=state.notices,
                      rendezvous=rdzv.to_dict() if rdzv else None, ops=ops,
                      collection_errors=[{"nodeid": n, "error": e}
                                         for n, e in self.collection_errors])
        soak = next((f.value for f in state.facts if f.name == results_format.SOAK_SECTION), None)
        if soak is not None:  # a --soak run: its burn-in's per-GPU report (docs/burn-in.md)
            result["soak"] = soak
        write_atomically(state.results / "benchmarks.json",
                         json.dumps(doc, indent=2, default=str))
        write_atomically(state.results / "summary.json",
                         json.dumps(result, indent=2, default=str))
        self.verdict = self._verdict(result)
        write_atomically(state.results / "summary.txt", "\n".join(
            self.lines(result) + self.run_lines(session.config) + [self.verdict]) + "\n")
        self._write_prom(state.results, textfile, session)

    def _write_prom(self, results: Path | None, textfile: str | None,
                    session: pytest.Session) -> None:
        """The verdict for Prometheus, a failed or interrupted run's too; without --results,
        only into the --prometheus-textfile folder."""
        try:
            if results is not None:
                prometheus.write_run(results, textfile)
                return
            status, reason = self.run_status(int(session.exitstatus))
            summ = {**self.summary(), "exitstatus": int(session.exitstatus), "status": status,
                    "reason": reason, "node": {"hostname": self.state.node.hostname}}
            node = node_from_summary(Path(self.state.node.hostname), summ,
                                     outcomes=[asdict(o) for o in self.state.outcomes])
            node.has_benchmarks = True  # without --results no benchmarks.json is written
            prometheus.write(prometheus.result_families(node, started=self.state.started),
                             Path(textfile).expanduser() / prometheus.PROM_FILE)
        except prometheus.TextfileError as e:  # shown in the terminal's summary
            self.state.notices.append(f"--prometheus-textfile: {e}: this run's verdict is not "
                                      "there")

    def run_status(self, exitstatus: int) -> tuple[str, str]:
        """summary.json's ``status`` (results.format.STATUSES) and ``reason``: why the run as
        a whole did not pass, in one line ("" on a pass, or where failing tests say it)."""
        why = self.refused or self.stopped or self.no_gpu_test_ran() or ""
        if exitstatus == pytest.ExitCode.USAGE_ERROR:
            return "refused", (self.refused or "pytest stopped the run with a usage error "
                               "(see its output)").removeprefix("dsconform: ")
        if exitstatus == pytest.ExitCode.INTERRUPTED:
            return "interrupted", why
        if exitstatus == pytest.ExitCode.OK and self.state.outcomes:
            return "passed", ""
        return "failed", why


def _error_line(report: pytest.CollectReport) -> str:
    """A collection error's first line: the exception's (``E   ImportError: ...`` in pytest's
    text), else the text's first line."""
    text = str(report.longreprtext or report.longrepr or "")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    raised = next((ln[1:].strip() for ln in lines if re.match(r"^E\s", ln)), None)
    return (raised or (lines[0] if lines else "no error text"))[:300]


def _machine_info(state: RunState) -> dict[str, Any]:
    n, p = state.node, state.profile
    uname = platform.uname()
    return {
        "node": uname.node, "processor": uname.processor, "machine": uname.machine,
        "python_implementation": platform.python_implementation(),
        "python_version": platform.python_version(), "release": uname.release,
        "system": uname.system, "cpu": {"count": n.cpu_cores},
        "gpu_model": n.gpu_model, "gpu_count": n.gpu_count, "gpus_present": n.gpus_present,
        "gpu_bus_ids": n.hardware.bus_ids, "driver": n.driver_version,
        "cuda": n.cuda_version, "nccl": n.nccl_version, "torch": n.torch_version,
        "deepspeed": n.deepspeed_version, "dsconform": dsconform.__version__, "profile": p.name,
        "host_memory_bytes": n.host_memory_bytes, "shm_bytes": n.shm_bytes,
        # NCCL_ALGO, NCCL_NVLS_ENABLE, ...: settings that change what collectives measure.
        "nccl_settings": nccl_env.machine_info(nccl_env.nccl_settings()),
    }


def _commit_info() -> dict[str, Any]:
    try:
        from pytest_benchmark.utils import get_commit_info
        return get_commit_info()
    except Exception as e:  # no git, not a repository: the record is still useful
        return {"error": str(e)}


def _pytest_benchmark_entries(config: pytest.Config) -> list[dict]:
    """Benchmarks taken with pytest-benchmark's own fixture, merged into the one file."""
    out = []
    for b in getattr(getattr(config, "_benchmarksession", None), "benchmarks", []) or []:
        with contextlib.suppress(Exception):
            out.append(b.as_dict(include_data=False))
    return out
