"""``dsconform aggregate`` MUST turn many nodes' results into one answer: exit 1 naming a
failing node with its reasons and printing (never running) its drain command, flag a node below
a settable share of the median of its node type even above its floor, count a known upstream
issue once, merge JUnit XML, write markdown, JSON and a heat map, and refuse bad input (empty
folders, foreign JSON, a node that appears twice) with one line naming the folder or file.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from dsconform.gate.known_issues import KNOWN_ISSUES
from dsconform.results import aggregate, records, summary
from dsconform.results.render import aggregate as aggregate_report

KI = KNOWN_ISSUES[0]
BUSBW = "suites/test_collectives.py::test_busbw_floor[all_reduce-1073741824B-8gpu]"
ZERO = "suites/test_zero.py::test_zero_matches_ddp[cuda-z2-off_none-bf16-sgd-gas1-ws8]"


def outcome(nodeid: str, kind: str = "passed", reason: str = "", known: str = "") -> dict:
    cap = "collectives" if "collectives" in nodeid else "zero"
    return {"nodeid": nodeid, "outcome": kind, "capability": cap, "reason": reason,
            "known_issue": known}


def busbw(gbps: float, floor: float | None = 200.0, nodeid: str = BUSBW) -> records.Metric:
    """A real rate metric as record_rate makes it: seconds in the samples, GB/s derived."""
    amount = float(1 << 30) * 2 * 7 / 8
    seconds = [amount / 1e9 / (gbps * f) for f in (0.99, 1.0, 1.01)]
    rate = records.Rate(unit="GB/s", amount=amount, scale=1e9, limit=floor)
    return records.Metric(nodeid, "all_reduce.busbw", seconds, "s", "lower", None,
                          {"bytes": 1 << 30, "world_size": 8, "amount": amount}, "collectives",
                          rate)


def step_time(seconds: float) -> records.Metric:
    return records.Metric(ZERO, "zero.step_seconds", [seconds] * 3, "s", "lower", None, {},
                          "zero")


def write_node(folder: Path, *, outcomes: list[dict], metrics: list[records.Metric] = (),
               exitstatus: int | None = None, rendezvous: dict | None = None,
               hostname: str | None = None, profile: str = "h200-x8",
               gpus: str = "NVIDIA H200", count: int = 8) -> Path:
    """A node's --results folder as the plugin writes it (summary.json, benchmarks.json)."""
    folder.mkdir(parents=True, exist_ok=True)
    objs = [records.Outcome(**o) for o in outcomes]
    issues = {ki.id: {"title": ki.title, "link": ki.link, "deepspeed": ki.deepspeed}
              for ki in KNOWN_ISSUES}
    result = summary.summarize(objs, issues)
    host = hostname or folder.name
    doc = records.document(
        metrics, objs, machine_info={"node": host, "deepspeed": "0.19.8", "profile": profile,
                                     "gpu_model": gpus, "gpu_count": count},
        commit_info={}, profile={"name": profile}, started="2026-11-30T01:00:00+0000",
        known_issues=result["known_issues"])
    failed = any(o["outcome"] in summary.FAILED for o in outcomes)
    result.update(profile={"name": profile}, node={"hostname": host},
                  exitstatus=(1 if failed else 0) if exitstatus is None else exitstatus,
                  notices=[], rendezvous=rendezvous)
    (folder / "benchmarks.json").write_text(json.dumps(doc))
    (folder / "summary.json").write_text(json.dumps(result))
    return folder


def good(folder: Path, gbps: float = 300.0) -> Path:
    return write_node(folder, outcomes=[outcome(BUSBW), outcome(ZERO)], metrics=[busbw(gbps)])


def run_cli(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsconform.cli", "aggregate",
                           *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_a_failing_node_exits_1_names_it_and_prints_its_drain_command(tmp_path):
    """The issue's done-when: a good node and a failing one -> exit 1, the node, its drain."""
    root = tmp_path / "nightly"
    good(root / "gpu-a01")
    reason = "all_reduce.busbw = 120 GB/s is below its floor 200 GB/s [bytes=1073741824]"
    write_node(root / "gpu-a02", outcomes=[outcome(BUSBW, "failed", reason), outcome(ZERO)],
               metrics=[busbw(120.0)])
    proc = run_cli(root, "--out", tmp_path / "out", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert "FAILED: 1 of 2 node folder(s) failed" in out
    assert "gpu-a02:\n    1 x all_reduce.busbw = 120 GB/s is below its floor" in out
    drain = [ln for ln in out.splitlines() if ln.startswith("scontrol")]
    assert drain == ['scontrol update nodename=gpu-a02 state=drain reason="dsconform: 1 x '
                     'all_reduce.busbw = 120 GB/s is below its floor 200 GB/s '
                     '[bytes=1073741824]"']
    assert "printed, NOT run" in out
    report = json.loads((tmp_path / "out" / "cluster.json").read_text())
    assert report["failed_nodes"] == ["gpu-a02"] and report["failed"] is True
    md = (tmp_path / "out" / "cluster.md").read_text()
    assert "| gpu-a02 | gpu-a02 | h200-x8 | 0.19.8 | FAIL 1/1 | ok 1 | FAILED |" in md
    assert drain[0] in md
    # Merged JUnit: one suite per node, classes prefixed by the node, a node verdict per node.
    tree = ET.parse(tmp_path / "out" / "junit.xml").getroot()
    assert [s.get("name") for s in tree.iter("testsuite")] == ["gpu-a01", "gpu-a02"]
    verdicts = {s.get("name"): s.find("testcase[@name='node-verdict']") for s in tree}
    assert verdicts["gpu-a01"].find("failure") is None
    assert "below its floor" in verdicts["gpu-a02"].find("failure").get("message")
    assert tree.get("failures") == "2"  # the busbw case and gpu-a02's verdict


def test_all_good_exits_0_and_writes_every_report(tmp_path):
    good(tmp_path / "n1")
    good(tmp_path / "n2", gbps=305.0)
    proc = run_cli(tmp_path / "n1", tmp_path / "n2", "--out", tmp_path / "out", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASSED: all 2 node folder(s) passed" in proc.stdout
    assert "scontrol" not in proc.stdout
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["cluster.json", "cluster.md", "cluster.prom", "heatmap.png", "junit.xml"]
    assert (tmp_path / "out" / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_outlier_below_the_median_of_its_type_even_above_its_floor(tmp_path):
    for name, gbps, step in (("a", 300.0, 40.0), ("b", 310.0, 41.0), ("c", 250.0, 39.0),
                             ("d", 305.0, 60.0)):
        write_node(tmp_path / name, outcomes=[outcome(BUSBW)], metrics=[busbw(gbps),
                                                                          step_time(step)])
    nodes = aggregate.collect([tmp_path])
    report = aggregate.analyse(nodes, outlier_pct=90)
    found = {(o.node, o.metric.rsplit("::", 1)[-1]): o for o in report.outliers}
    assert set(found) == {("c", "all_reduce.busbw"), ("d", "zero.step_seconds")}
    c = found[("c", "all_reduce.busbw")]
    # 250 GB/s against the median 302.5: 83%, though above its 200 GB/s floor.
    assert c.unit == "GB/s" and c.limit == 200.0 and c.value == pytest.approx(250, rel=1e-9)
    assert c.ratio == pytest.approx(250 / 302.5) and c.fleet == 4
    assert c.node_type == "h200-x8, 8x NVIDIA H200"
    # Seconds: lower is better, 60 s against the median 40.5 s is 68% as fast.
    assert found[("d", "zero.step_seconds")].ratio == pytest.approx(40.5 / 60)
    assert not report.failed  # an outlier is reported, not a failure
    # The threshold is settable: at 80% only the slow build remains.
    assert [o.node for o in aggregate.analyse(nodes, outlier_pct=80).outliers] == ["d"]
    lines = aggregate_report.terminal(report)
    assert any(ln.startswith("  c: ") and "is 83% of the median 302.5 GB/s of its type" in ln
               and "its limit 200 GB/s" in ln for ln in lines), lines
    # A time is a multiple of the median (60 s is 1.48x 40.5 s), never "148% of" or "68% of".
    assert any(ln.startswith("  d: ") and "= 60 s is 1.48x the median 40.5 s of its type (lower "
               "is better: 68% of the median's performance, 4 nodes of h200-x8, 8x NVIDIA H200"
               in ln for ln in lines), lines


def test_known_issue_is_counted_once_not_per_node(tmp_path):
    cases = [f"suites/test_zero.py::test_zero_matches_ddp[cuda-z0-off_none-fp16-sgd-gas{g}-ws2]"
             for g in (1, 4)]
    for name in ("n1", "n2", "n3"):
        write_node(tmp_path / name, outcomes=[outcome(c, "xfailed", KI.reason, KI.id)
                                              for c in cases] + [outcome(ZERO)])
    proc = run_cli(tmp_path, "--out", tmp_path / "out", "--no-plot", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # a known issue is no node failure
    hits = [ln for ln in proc.stdout.splitlines() if KI.id in ln]
    assert hits == [f"known upstream issue {KI.id}: 6 case(s) on 3 node(s): {KI.title} "
                    f"{KI.link}"]
    report = json.loads((tmp_path / "out" / "cluster.json").read_text())
    assert report["known_issues"] == [{"id": KI.id, "title": KI.title, "link": KI.link,
                                       "deepspeed": KI.deepspeed, "nodes": ["n1", "n2", "n3"],
                                       "cases": 6}]
    assert "ok 3 (2 known)" in (tmp_path / "out" / "cluster.md").read_text()
    assert not (tmp_path / "out" / "heatmap.png").exists()


def test_unfinished_run_and_bad_exit_status_fail_their_node(tmp_path):
    # A run killed mid-way: records.jsonl only, its last line cut by the kill.
    killed = tmp_path / "killed"
    killed.mkdir()
    line = json.dumps({"outcome": outcome(ZERO)})
    (killed / "records.jsonl").write_text(line + "\n" + line[:20])
    write_node(tmp_path / "interrupted", outcomes=[outcome(ZERO)], exitstatus=2)
    good(tmp_path / "fine")
    report = aggregate.analyse(aggregate.collect([tmp_path]))
    problems = {n.name: n.problems for n in report.failed_nodes}
    assert problems == {
        "interrupted": ["pytest exit status 2 (interrupted)"],
        "killed": [f"the run did not finish: no summary.json (1 test outcomes in records.jsonl, "
                   f"the last {ZERO})"]}
    drains = aggregate.drain_commands(report)
    assert drains[1] == ('scontrol update nodename=killed state=drain reason="dsconform: the run '
                         'did not finish: no summary.json (1 test outcomes in records.jsonl, '
                         'the last su..."')


def test_a_run_that_ran_nothing_or_lost_its_benchmarks_fails_its_node(tmp_path):
    """A node whose run recorded no test (a selection that matched nothing) proves nothing; a
    folder whose benchmarks.json is gone cannot be read: neither passes."""
    write_node(tmp_path / "empty", outcomes=[])
    good(tmp_path / "partial")
    (tmp_path / "partial" / "benchmarks.json").unlink()
    good(tmp_path / "fine")
    report = aggregate.analyse(aggregate.collect([tmp_path]))
    problems = {n.name: n.problems for n in report.failed_nodes}
    assert problems == {
        "empty": ["the run recorded no test outcome: it proves nothing about the node (a "
                  "selection that matched nothing, or a --collect-only run)"],
        "partial": ["no benchmarks.json beside summary.json: its outcomes and measurements "
                    "cannot be read (an incomplete copy of the folder?)"]}


def test_drain_reasons_are_shell_safe_and_names_checked(tmp_path):
    write_node(tmp_path / "n1", outcomes=[outcome(ZERO, "failed", 'bad "x" $(rm -rf /) `y`')])
    write_node(tmp_path / "bad name", outcomes=[outcome(ZERO, "failed", "boom")])
    report = aggregate.analyse(aggregate.collect([tmp_path]))
    assert aggregate.drain_commands(report) == [
        "# 'bad name': not a valid Slurm node name (name the folder after the node: "
        "--results $SHARED/$(hostname))",
        'scontrol update nodename=n1 state=drain reason="dsconform: 1 x bad x (rm -rf /) y"']


def test_multinode_ranks_group_into_a_job_and_are_not_drained(tmp_path):
    job = {"launcher": "torchrun", "job": "nightly-42", "world_size": 2, "nodes": 2}
    for rank in (0, 1):
        write_node(tmp_path / "multinode" / f"gpu-a0{rank + 1}-rank{rank}",
                   outcomes=[outcome(ZERO, "failed", "rank 1 of 2 raised RuntimeError: NCCL")],
                   rendezvous={**job, "rank": rank, "local_rank": 0, "node_rank": rank},
                   hostname=f"gpu-a0{rank + 1}")
    good(tmp_path / "single" / "gpu-a01")
    report = aggregate.analyse(aggregate.collect([tmp_path]))
    (j,) = report.jobs
    assert (j.job, j.nodes, j.world_size, j.failed) == ("nightly-42", 2, 2, True)
    assert [m.name for m in j.members] == ["gpu-a01-rank0", "gpu-a02-rank1"]
    assert all(d.startswith("# gpu-a0") and "names no single node" in d
               for d in aggregate.drain_commands(report))
    md = aggregate_report.markdown(report)
    assert "| nightly-42 | 2 | 2 | 2 | gpu-a01, gpu-a02 | FAILED |" in md
    # The same rank twice is a copy, not a bigger job.
    shutil.copytree(tmp_path / "multinode" / "gpu-a01-rank0", tmp_path / "again" / "x-rank0")
    with pytest.raises(aggregate.AggregateInputError, match="the same run appears twice"):
        aggregate.collect([tmp_path])


def test_a_one_node_job_is_a_job_and_a_failure_drains_its_node_by_hostname(tmp_path):
    """`sbatch --nodes=1` still runs stage 2: its rank folders (<node>-rank<R>) are a job's
    ranks, not nodes; a failure there does name the node, by its hostname (never
    "vm-rank0", no Slurm node)."""
    job = {"launcher": "torchrun", "job": "j7", "world_size": 2, "nodes": 1}
    for rank in (0, 1):
        write_node(tmp_path / "multinode" / f"gpu-a01-rank{rank}",
                   outcomes=[outcome(ZERO, "failed", "expected >= 32 CPU cores, found 2")],
                   rendezvous={**job, "rank": rank, "local_rank": rank, "node_rank": 0},
                   hostname="gpu-a01.cluster.local")  # not the Slurm name: the folder's is
    good(tmp_path / "single" / "gpu-a01")
    report = aggregate.analyse(aggregate.collect([tmp_path]), expect=["gpu-a01"])
    (j,) = report.jobs
    assert (j.job, j.nodes, j.failed) == ("j7", 1, True)
    assert aggregate.drain_commands(report) == [
        'scontrol update nodename=gpu-a01 state=drain reason="dsconform: job j7 rank '
        'gpu-a01-rank0: 1 x expected >= 32 CPU cores, found 2"']
    # The node's single-node run failing too: still one command for the node, its own reason.
    write_node(tmp_path / "single" / "gpu-a01", outcomes=[outcome(ZERO, "failed", "boom")])
    drains = aggregate.drain_commands(aggregate.analyse(aggregate.collect([tmp_path])))
    assert drains == ['scontrol update nodename=gpu-a01 state=drain reason="dsconform: 1 x boom"']
    lines = aggregate_report.terminal(report)
    assert "one-node job j7: 1 node, world size 2, 2 rank folder(s): FAILED" in lines


@pytest.mark.parametrize("make, message", [
    (lambda d: (d / "gpu-a02").mkdir(),
     r"gpu-a02: empty folder: no node wrote results here"),
    (lambda d: (d / "gpu-a02").mkdir() or (d / "gpu-a02" / "summary.json").write_text(
        json.dumps({"tests": 3})),
     r"gpu-a02/summary.json: not a dsconform summary.json \(no 'capabilities' table\)"),
    (lambda d: (d / "gpu-a02").mkdir() or (d / "gpu-a02" / "summary.json").write_text("{nope"),
     r"gpu-a02/summary.json: not JSON"),
    (lambda d: (d / "gpu-a02").mkdir() or (d / "gpu-a02" / "benchmarks.json").write_text(
        json.dumps({"machine_info": {}, "benchmarks": []})),
     r"gpu-a02/benchmarks.json: a pytest-benchmark file without dsconform outcomes"),
    (lambda d: (d / "gpu-a02").mkdir() or (d / "gpu-a02" / "notes.txt").write_text("hi"),
     r"gpu-a02: no dsconform results in it"),
    (lambda d: good(d / "more" / "gpu-a01"),
     r"node gpu-a01 appears twice: .*nightly/gpu-a01 and .*nightly/more/gpu-a01"),
])
def test_bad_input_is_one_clear_line_and_exit_2(tmp_path, make, message):
    root = tmp_path / "nightly"
    good(root / "gpu-a01")
    make(root)
    with pytest.raises(aggregate.AggregateInputError, match=message):
        aggregate.collect([root])
    proc = run_cli(root, "--no-plot", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("dsconform aggregate: ") and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_the_same_folder_twice_and_missing_dirs(tmp_path):
    good(tmp_path / "n1")
    with pytest.raises(aggregate.AggregateInputError, match=r"appears twice.*given twice"):
        aggregate.collect([tmp_path / "n1", tmp_path / "n1"])
    with pytest.raises(aggregate.AggregateInputError, match="nope: no such directory"):
        aggregate.collect([tmp_path / "nope"])
    with pytest.raises(ValueError, match="--outlier-pct 0"):
        aggregate.analyse(aggregate.collect([tmp_path]), outlier_pct=0)


def test_own_output_inside_the_results_tree_is_skipped(tmp_path):
    good(tmp_path / "n1")
    good(tmp_path / "n2")
    for _ in range(2):  # the second run finds the first one's report beside the nodes
        assert aggregate_report.main([str(tmp_path)], out=str(tmp_path / "cluster"),
                                     outlier_pct=90, plot=False) == 0
    assert [n.name for n in aggregate.collect([tmp_path])] == ["n1", "n2"]


def test_heat_map_without_matplotlib_says_so_and_writes_the_rest(tmp_path, monkeypatch, capsys):
    good(tmp_path / "n1")
    good(tmp_path / "n2")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an absent package looks like
    code = aggregate_report.main([str(tmp_path)], out=str(tmp_path / "out"), outlier_pct=90,
                                 plot=True)
    assert code == 0
    err = capsys.readouterr().err
    assert ("dsconform aggregate: heatmap.png not written: matplotlib is not installed (pip "
            "install 'dsconform[plot]', or pip install matplotlib); the other reports are "
            "written\n") in err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "cluster.json", "cluster.md", "cluster.prom", "junit.xml"]


def test_expected_node_without_results_fails_and_is_drained(tmp_path):
    good(tmp_path / "gpu-a01")
    proc = run_cli(tmp_path, "--expect", "gpu-a01,gpu-a02", "--out", tmp_path / "out",
                   "--no-plot", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert ("gpu-a02:\n    no results folder: its run never started or wrote nothing (expected "
            "by --expect)") in proc.stdout
    assert ('scontrol update nodename=gpu-a02 state=drain reason="dsconform: no results folder: '
            'its run never started or wrote nothing (expected by --expect)"') in proc.stdout
    report = json.loads((tmp_path / "out" / "cluster.json").read_text())
    assert [n["name"] for n in report["nodes"]] == ["gpu-a01", "gpu-a02"]
