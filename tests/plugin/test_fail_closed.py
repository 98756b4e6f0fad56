"""A run MUST fail closed: no reader (a person, `dsconform aggregate`, node_exporter) may take an
older run's pass for the newest run's verdict.

- A run refused at its start (a bad --profile, --scratch, --prometheus-textfile) in a folder
  holding a pass sets that pass aside and writes its own "refused" verdict, with the reason, in
  summary.json, summary.txt, dsconform.prom and the --prometheus-textfile copy; exit 4.
- A run killed by SIGKILL leaves no green junit.xml, ds_report.json or summary beside its "not
  finished" dsconform.prom.
- `-m gpu` (the GPU acceptance tier) where no GPU is found fails, with one line saying why.
- `dsconform aggregate` never reports PASSED from files older than the newest attempt that a
  folder's dsconform.prom names.

The runs are real pytest runs of the plugin (in-process, or a subprocess for the kill); the node
without a GPU is the real probe with its GPUs taken out; folders for aggregate are written with
the plugin's own writers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dsconform.node import detect
from dsconform.results import aggregate, records, run_files, summary
from dsconform.results import format as results_format

ROOT = Path(__file__).resolve().parents[2]
PASSING = ("def test_a(metrics):\n"
           "    metrics.record('x', [1.0, 1.0, 1.0], unit='s', better='lower')\n")
GREEN = ("summary.json", "summary.txt", "benchmarks.json", "junit.xml", "ds_report.json",
         "records.jsonl")


def gauges(path: Path) -> dict[str, float]:
    """The unlabelled samples of a .prom file (the verdict's)."""
    return {s.name: s.value for fam in text_string_to_metric_families(path.read_text())
            for s in fam.samples if not s.labels}


def verdict_of(folder: Path) -> aggregate.NodeResult:
    [node] = aggregate.collect([folder])
    return node


@pytest.fixture
def passed_before(pytester, tmp_path):
    """A folder holding a passing run, its ds_report.json (the ops suite's) and its textfile
    copy: what a node's --results and node_exporter's folder hold after last night."""
    pytester.makepyfile(test_pass=PASSING)
    res, textfile = tmp_path / "res", tmp_path / "textfile"
    result = pytester.runpytest("-p", "fixtures.plugin", "-p", "no:cacheprovider",
                                "--results", str(res), "--prometheus-textfile", str(textfile))
    assert result.ret == 0
    (res / "ds_report.json").write_text('{"ops": {"fused_adam": "[OKAY]"}}')
    assert gauges(textfile / "dsconform.prom")["dsconform_node_passed"] == 1
    assert verdict_of(res).verdict == "passed"
    return res, textfile


@pytest.mark.parametrize("args, reason", [
    (["--profile", "/etc/passwd"], "/etc/passwd: not valid TOML"),
    (["--scratch", "/nonexistent"], "--scratch /nonexistent: no such directory"),
    (["--scratch", "/proc"], "--scratch /proc: not a directory on a disk"),
], ids=["bad-profile", "missing-scratch", "scratch-in-proc"])
def test_a_refused_run_supersedes_the_old_pass(pytester, passed_before, args, reason):
    res, textfile = passed_before
    passed_summary = (res / "summary.json").read_text()
    result = pytester.runpytest("-p", "fixtures.plugin", "-p", "no:cacheprovider",
                                "--results", str(res), "--prometheus-textfile", str(textfile),
                                *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    # The old pass is set aside, never left where a reader looks ...
    left = [name for name in GREEN if (res / name).exists() and name not in
            ("summary.json", "summary.txt")]
    assert left == [], f"the previous run's {left} outlived a refused run"
    assert (res / "summary.previous.json").read_text() == passed_summary
    # ... and the refused run's own verdict, with the reason, is in every place.
    summ = json.loads((res / "summary.json").read_text())
    assert summ["status"] == "refused" and summ["exitstatus"] == 4
    assert summ["reason"].startswith(reason), summ["reason"]
    text = (res / "summary.txt").read_text()
    assert text.startswith("REFUSED on ") and f"reason: {reason}" in text
    for prom in (res / "dsconform.prom", textfile / "dsconform.prom"):
        g = gauges(prom)
        assert (g["dsconform_node_passed"], g["dsconform_run_finished"],
                g["dsconform_run_refused"]) == (0, 1, 1), prom
    node = verdict_of(res)
    assert node.verdict == "REFUSED" and node.problems == [f"the run was refused: {summ['reason']}"]


def test_a_refused_run_writes_its_verdict_into_the_textfile_folder_without_results(
        pytester, passed_before):
    """--results that cannot be a folder: the refusal still reaches node_exporter's copy."""
    res, textfile = passed_before
    blocker = res.parent / "a-file"
    blocker.write_text("not a folder\n")
    result = pytester.runpytest("-p", "fixtures.plugin", "-p", "no:cacheprovider",
                                "--results", str(blocker / "res"),
                                "--prometheus-textfile", str(textfile))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    g = gauges(textfile / "dsconform.prom")
    assert (g["dsconform_node_passed"], g["dsconform_run_refused"]) == (0, 1)


def test_a_killed_run_leaves_no_green_file_beside_its_unfinished_verdict(tmp_path):
    """SIGKILL mid-run: junit.xml, ds_report.json, the summary and benchmarks.json of the run
    before are set aside at the start; what remains says "not finished"."""
    res, textfile = tmp_path / "res", tmp_path / "textfile"
    (tmp_path / "test_pass.py").write_text(PASSING)
    (tmp_path / "test_killed.py").write_text(
        "import os, signal\ndef test_a(): pass\n"
        "def test_b(): os.kill(os.getpid(), signal.SIGKILL)\n")

    def run(name: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pytest", name, "-p", "fixtures.plugin", "-p",
             "no:cacheprovider", "--rootdir", str(tmp_path), "--results", str(res),
             "--prometheus-textfile", str(textfile), "-q"],
            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
            text=True, timeout=300)

    assert run("test_pass.py").returncode == 0
    (res / "ds_report.json").write_text('{"ops": {"fused_adam": "[OKAY]"}}')
    killed = run("test_killed.py")
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    left = [name for name in GREEN if (res / name).exists() and name != "records.jsonl"]
    assert left == [], f"the previous run's {left} outlived a killed run"
    for prom in (res / "dsconform.prom", textfile / "dsconform.prom"):
        g = gauges(prom)
        assert (g["dsconform_node_passed"], g["dsconform_run_finished"]) == (0, 0), prom
    assert verdict_of(res).verdict == "NOT FINISHED"


def _without_gpus(monkeypatch) -> None:
    """This node as probed, with every trace of a GPU taken out (a node whose GPUs fell off
    the bus): the test holds on a GPU machine too."""
    real = detect.probe

    def probe() -> detect.NodeFacts:
        facts = real()
        facts.gpus = []
        facts.hardware = detect.GpuHardware(seen={
            "nvml": "unavailable (NVMLError_DriverNotLoaded: Driver Not Loaded)"})
        return facts
    monkeypatch.setattr(detect, "probe", probe)


def test_the_gpu_tier_where_no_gpu_is_found_fails_with_its_reason(pytester, tmp_path,
                                                                   monkeypatch):
    _without_gpus(monkeypatch)
    pytester.makepyfile(test_tier="import pytest\n\n@pytest.mark.gpu\ndef test_gpu():\n"
                                  "    pass\n\ndef test_cpu():\n    pass\n")
    res, textfile = tmp_path / "res", tmp_path / "textfile"
    result = pytester.runpytest("-p", "fixtures.plugin", "-p", "no:cacheprovider", "-m", "gpu",
                                "--results", str(res), "--prometheus-textfile", str(textfile))
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    why = ("no GPU found on this node (NVML: unavailable (NVMLError_DriverNotLoaded: Driver Not "
           "Loaded); /proc/driver/nvidia: no GPU; PCI: no NVIDIA GPU; torch: 0 CUDA devices) "
           "but -m gpu asks for the GPU acceptance tier")
    assert f"dsconform: {why}" in result.stdout.lines  # said once, before any test
    summ = json.loads((res / "summary.json").read_text())
    assert (summ["status"], summ["reason"], summ["exitstatus"]) == ("failed", why, 1)
    assert summ["run"]["gpu"] is False
    assert f"NOTE: {why}" in (res / "summary.txt").read_text().splitlines()
    for prom in (res / "dsconform.prom", textfile / "dsconform.prom"):
        assert gauges(prom)["dsconform_node_passed"] == 0, prom
    assert verdict_of(res).problems == [why]


def test_a_cpu_run_says_it_is_one(pytester, tmp_path, monkeypatch):
    _without_gpus(monkeypatch)
    pytester.makepyfile(test_tier="def test_cpu():\n    pass\n")
    res = tmp_path / "res"
    result = pytester.runpytest("-p", "fixtures.plugin", "-p", "no:cacheprovider",
                                "--results", str(res))
    assert result.ret == 0
    result.stdout.fnmatch_lines(["dsconform run: a CPU run: no GPU found on this node (NVML: *"])
    summ = json.loads((res / "summary.json").read_text())
    assert summ["status"] == "passed" and summ["run"]["gpu"] is False
    assert summ["run"]["description"].startswith("a CPU run: no GPU found")
    assert "run: a CPU run: " in (res / "summary.txt").read_text()


# ------------------------------------------------------------------ aggregate: the newest attempt

def _passed_folder(folder: Path, started: str | None = "2026-11-30T01:00:00+0000") -> Path:
    """A passing run as the plugin writes it; ``started`` None: a summary of an older version
    that carries no start (then the files' times decide)."""
    folder.mkdir(parents=True, exist_ok=True)
    outcomes = [records.Outcome("suites/test_zero.py::test_a", "passed", "zero")]
    doc = records.document([], outcomes, machine_info={"node": folder.name}, commit_info={},
                           profile={"name": "h200-x8"}, started=started)
    result = summary.summarize(outcomes)
    result.update(status="passed", reason="", started=started, profile={"name": "h200-x8"},
                  node={"hostname": folder.name}, exitstatus=0, notices=[], rendezvous=None)
    if started is None:
        del result["started"]
    (folder / "benchmarks.json").write_text(json.dumps(doc))
    (folder / "summary.json").write_text(json.dumps(result))
    (folder / "records.jsonl").write_text("")
    return folder


def _newer_attempt(folder: Path, *, refused: bool, started: str) -> None:
    """What a newer attempt wrote before it was refused or killed: only its dsconform.prom (its
    folder kept the old files: they could not be set aside)."""
    if refused:
        summ = run_files.refused_summary("dsconform: --scratch /x: no such directory",
                                       started=started, hostname=folder.name)
        run_files.write_refused(None, folder, summ)
    else:
        run_files.write_running([folder], started)


@pytest.mark.parametrize("refused, word", [(False, "NOT FINISHED"), (True, "REFUSED")])
def test_aggregate_never_passes_files_older_than_the_newest_attempt(tmp_path, refused, word):
    node = _passed_folder(tmp_path / "gpu-a01")
    assert verdict_of(node).verdict == "passed"
    _newer_attempt(node, refused=refused, started="2026-12-01T01:00:00+0000")
    found = verdict_of(node)
    assert found.verdict == word, found.problems
    what = "was refused" if refused else "did not finish"
    assert found.problems == [f"the run {what}: the newest run's dsconform.prom says so; the "
                              "benchmarks.json and summary.json beside it are an older run's "
                              "and are not read"]
    report = aggregate.analyse(aggregate.collect([tmp_path]))
    assert report.failed and [n.name for n in report.failed_nodes] == ["gpu-a01"]


def test_the_start_times_decide_not_the_files_times(tmp_path):
    """A copied folder has new modification times: the runs' starts still say which is older.
    Without starts (an older summary), the file older than the .prom is stale."""
    node = _passed_folder(tmp_path / "gpu-a01")
    _newer_attempt(node, refused=False, started="2026-12-01T01:00:00+0000")
    later = time.time() + 60
    for name in ("summary.json", "benchmarks.json"):
        os.utime(node / name, (later, later))  # copied after the .prom
    assert verdict_of(node).verdict == "NOT FINISHED"
    old = _passed_folder(tmp_path / "gpu-a02", started=None)
    earlier = time.time() - 60
    for name in ("summary.json", "benchmarks.json"):
        os.utime(old / name, (earlier, earlier))
    _newer_attempt(old, refused=False, started="2026-12-01T01:00:00+0000")
    assert verdict_of(old).verdict == "NOT FINISHED"


def test_a_summary_of_the_newest_attempt_is_read(tmp_path):
    """The .prom of the same run, written at its start and never rewritten (killed right after
    it wrote summary.json): the summary is that run's own, and it is read."""
    node = _passed_folder(tmp_path / "gpu-a01", started="2026-12-01T01:00:00+0000")
    _newer_attempt(node, refused=False, started="2026-12-01T01:00:00+0000")
    assert verdict_of(node).verdict == "passed"


def test_previous_names_are_never_read_as_a_verdict():
    """node_exporter reads every *.prom of its folder: the previous verdict is not one."""
    names = [results_format.previous_name(n) for n in results_format.VERDICT_FILES]
    assert "dsconform.prom.previous" in names and "summary.previous.json" in names
    assert not [n for n in names if n.endswith(".prom") or n in results_format.VERDICT_FILES]


def _node(gpus: int) -> detect.NodeFacts:
    hw = detect.GpuHardware(count=gpus, models=["NVIDIA H200"] * gpus, source="nvml",
                            seen={"nvml": gpus})
    return detect.NodeFacts(hostname="n", python="3.11", cpu_cores=8, host_memory_bytes=None,
                            shm_bytes=None, torch_version="2.13", deepspeed_version="0.19.8",
                            gpus=[detect.GpuInfo("NVIDIA H200", 150 * 10**9, "9.0")] * gpus,
                            hardware=hw)


@pytest.mark.parametrize("markexpr, gpus, gpu_run, fails", [
    ("gpu", 8, True, False), ("gpu and not slow", 8, True, False), ("", 8, True, False),
    ("not gpu and not slow", 8, False, False), ("gpu", 0, False, True),
    ("not slow", 0, False, False), ("not gpu", 0, False, False)])
def test_what_kind_of_run_it_is(markexpr, gpus, gpu_run, fails):
    from dsconform.profile.select import run_kind

    kind = run_kind(markexpr, _node(gpus))
    assert (kind.gpu, kind.failure is not None) == (gpu_run, fails), kind
    assert kind.description.startswith("a GPU run" if gpu_run else ("GPU tier" if fails
                                                                    else "a CPU run"))


def test_what_runs_no_test_leaves_the_last_verdict_alone(pytester, passed_before):
    """--help, --collect-only: no test runs, nothing is set aside or written, and -m gpu where
    no GPU is found fails only a run that runs tests."""
    res, textfile = passed_before
    before = {p.name: p.read_bytes() for p in res.iterdir() if p.name != "ranks.log"}
    for args in (["--help"], ["--collect-only", "-m", "gpu"]):
        result = pytester.runpytest("-p", "fixtures.plugin", "-p", "no:cacheprovider",
                                    "--results", str(res), "--prometheus-textfile",
                                    str(textfile), *args)
        assert result.ret in (0, pytest.ExitCode.NO_TESTS_COLLECTED), args
    after = {p.name: p.read_bytes() for p in res.iterdir() if p.name != "ranks.log"}
    assert after == before
    assert gauges(textfile / "dsconform.prom")["dsconform_node_passed"] == 1
