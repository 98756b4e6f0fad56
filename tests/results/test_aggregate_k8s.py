"""``dsconform aggregate --scheduler k8s`` MUST print (never run) kubectl's cordon, a
``dsconform/verdict`` NoSchedule taint, the verdict and reason labels (valid Kubernetes label
values) and the whole reason as a shell-safe annotation, for each failing node and for no
passing node; the default (``--scheduler slurm``) keeps printing Slurm's ``scontrol`` lines.

Node folders come from the plugin's own writers (tests/results/test_aggregate.py's helpers).
"""

from __future__ import annotations

import shlex

import pytest

from dsconform.results import aggregate
from dsconform.results.render import aggregate as aggregate_report
from tests.results.test_aggregate import BUSBW, ZERO, busbw, good, outcome, run_cli, write_node

ISOLATE = ("ISOLATE (drain the node and replace the GPU): GPU 0 (PCI 0000:2a:00.0): GPU has "
           "fallen off the bus: Xid 79 x1 during the run")


def kubectl_lines(lines: list[str], node: str) -> list[str]:
    """The kubectl lines naming ``node`` (kubectl cordon NODE, kubectl VERB nodes NODE ...)."""
    return [ln for ln in lines if ln.startswith("kubectl ") and node in shlex.split(ln)[2:4]]


def label_values(line: str) -> dict[str, str]:
    """The values of a `kubectl label nodes NODE dsconform/verdict=V dsconform/reason=R
    --overwrite` line, each checked to be a valid label value."""
    argv = shlex.split(line)
    assert argv[:3] == ["kubectl", "label", "nodes"] and argv[-1] == "--overwrite", line
    pairs = [a.partition("=") for a in argv[4:-1]]
    assert [k for k, eq, _ in pairs if eq] == ["dsconform/verdict", "dsconform/reason"], (
        f"{line!r}: expected exactly the verdict and reason labels")
    assert len(pairs) == 2, f"{line!r}: stray arguments"
    for _, _, value in pairs:
        assert_valid_label_value(value)
    return {k: v for k, _, v in pairs}


def assert_valid_label_value(value: str) -> None:
    assert len(value) <= 63 and aggregate.K8S_LABEL_VALUE.match(value), (
        f"{value!r}: not a valid Kubernetes label value (<= 63 of [A-Za-z0-9._-], "
        "alphanumeric at both ends)")


def test_a_failing_node_gets_cordon_taint_label_annotate_and_a_passing_one_nothing(tmp_path):
    root = tmp_path / "nightly"
    good(root / "gpu-a01")
    reason = "all_reduce.busbw = 120 GB/s is below its floor 200 GB/s [bytes=1073741824]"
    write_node(root / "gpu-a02", outcomes=[outcome(BUSBW, "failed", reason), outcome(ZERO)],
               metrics=[busbw(120.0)])
    proc = run_cli(root, "--scheduler", "k8s", "--no-plot", "--out", tmp_path / "out",
                   cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "scontrol" not in proc.stdout
    assert kubectl_lines(lines, "gpu-a01") == []
    assert kubectl_lines(lines, "gpu-a02") == [
        "kubectl cordon gpu-a02",
        "kubectl taint nodes gpu-a02 dsconform/verdict=failed:NoSchedule --overwrite",
        "kubectl label nodes gpu-a02 dsconform/verdict=failed dsconform/reason=failed-collectives"
        " --overwrite",
        "kubectl annotate nodes gpu-a02 'dsconform/reason=dsconform: 1 x all_reduce.busbw = 120 "
        "GB/s is below its floor 200 GB/s [bytes=1073741824]' --overwrite"]
    assert "printed, NOT run" in proc.stdout
    md = (tmp_path / "out" / "cluster.md").read_text()
    assert "kubectl cordon gpu-a02" in md
    # Every node passing: no kubectl line at all.
    good(root / "gpu-a02")
    proc = run_cli(root, "--scheduler", "k8s", "--no-plot", "--out", tmp_path / "out2",
                   cwd=tmp_path)
    assert proc.returncode == 0 and "kubectl" not in proc.stdout, proc.stdout


def test_the_default_stays_slurm(tmp_path):
    write_node(tmp_path / "gpu-a02", outcomes=[outcome(ZERO, "failed", "boom")])
    report = aggregate.analyse(aggregate.collect([tmp_path]))
    slurm = ['scontrol update nodename=gpu-a02 state=drain reason="dsconform: 1 x boom"']
    assert aggregate.drain_commands(report) == slurm
    assert aggregate.drain_commands(report, "slurm") == slurm
    proc = run_cli(tmp_path, "--no-plot", "--out", tmp_path / "out", cwd=tmp_path)
    assert slurm[0] in proc.stdout.splitlines() and "kubectl" not in proc.stdout
    with pytest.raises(ValueError, match="--scheduler 'pbs': expected one of slurm, k8s"):
        aggregate.drain_commands(report, "pbs")
    proc = run_cli(tmp_path, "--scheduler", "pbs", cwd=tmp_path)
    assert proc.returncode == 2 and "invalid choice: 'pbs'" in proc.stderr


def test_every_kind_of_problem_maps_to_a_valid_short_label_value(tmp_path):
    write_node(tmp_path / "hw", outcomes=[outcome(ZERO, "failed", ISOLATE)])
    write_node(tmp_path / "tests", outcomes=[outcome(ZERO, "failed", "boom"),
                                             outcome(BUSBW, "failed", "slow")])
    write_node(tmp_path / "interrupted", outcomes=[outcome(ZERO)], exitstatus=2)
    write_node(tmp_path / "crashed", outcomes=[outcome(ZERO)], exitstatus=3)
    write_node(tmp_path / "empty", outcomes=[])
    good(tmp_path / "partial")
    (tmp_path / "partial" / "benchmarks.json").unlink()
    (tmp_path / "killed").mkdir()
    (tmp_path / "killed" / "records.jsonl").write_text("")
    report = aggregate.analyse(aggregate.collect([tmp_path]), expect=["absent"])
    lines = aggregate.drain_commands(report, "k8s")
    tokens = {}
    for line in lines:
        if line.startswith("kubectl label "):
            values = label_values(line)
            assert values["dsconform/verdict"] == "failed"
            tokens[shlex.split(line)[3]] = values["dsconform/reason"]
    assert tokens == {"hw": "isolate", "tests": "failed-collectives-zero",
                      "interrupted": "interrupted", "crashed": "internal-error",
                      "empty": "no-tests", "partial": "incomplete-results",
                      "killed": "unfinished", "absent": "no-results"}


@pytest.mark.parametrize("capability", ["x" * 80, "Zero Offload/NVMe", "-._-"])
def test_odd_capability_names_still_give_valid_label_values(capability):
    node = aggregate.NodeResult.missing("n1")
    node.absent = False
    node.capabilities = {capability: {"failed": 1}}
    token = aggregate.reason_token(node, "1 x boom")
    assert_valid_label_value(token)
    assert token.startswith("failed")


def test_the_label_check_refuses_invalid_values(tmp_path, monkeypatch):
    """The check above can fail: values Kubernetes refuses are refused here too, and a token
    taken unsanitized from the reason is caught."""
    for bad in ("x" * 64, "has space", "-leading", "trailing.", "a/b", "é"):
        with pytest.raises(AssertionError, match="not a valid Kubernetes label value"):
            assert_valid_label_value(bad)
    write_node(tmp_path / "n1", outcomes=[outcome(ZERO, "failed", "boom")])
    report = aggregate.analyse(aggregate.collect([tmp_path]))
    (line,) = [ln for ln in aggregate.drain_commands(report, "k8s") if " label " in ln]
    assert label_values(line)["dsconform/reason"] == "failed-zero"
    for fake, message in ((lambda node, problem: problem, "stray arguments"),
                          (lambda node, problem: "failed-" + "x" * 60, "not a valid")):
        monkeypatch.setattr(aggregate, "reason_token", fake)
        (line,) = [ln for ln in aggregate.drain_commands(report, "k8s") if " label " in ln]
        with pytest.raises(AssertionError, match=message):
            label_values(line)


def test_annotation_is_shell_safe_and_names_are_checked(tmp_path):
    evil = "bad \"x\" $(rm -rf /) `y` 'z'\nsecond line"
    write_node(tmp_path / "n1", outcomes=[outcome(ZERO, "failed", evil)])
    write_node(tmp_path / "GPU_A01", outcomes=[outcome(ZERO, "failed", "boom")])
    report = aggregate.analyse(aggregate.collect([tmp_path]))
    lines = aggregate.drain_commands(report, "k8s")
    assert lines[0] == ("# 'GPU_A01': not a valid Kubernetes node name (name the folder after "
                        "the node: --results /results/$(NODE_NAME), from spec.nodeName)")
    (annotate,) = [ln for ln in lines if ln.startswith("kubectl annotate")]
    argv = shlex.split(annotate)
    assert argv[:4] == ["kubectl", "annotate", "nodes", "n1"] and argv[-1] == "--overwrite"
    assert len(argv) == 6
    assert argv[4] == "dsconform/reason=dsconform: 1 x bad \"x\" $(rm -rf /) `y` 'z' second line"


def test_jobs_under_k8s_a_one_node_job_names_its_node_a_multi_node_job_none(tmp_path):
    one = {"launcher": "torchrun", "job": "j7", "world_size": 2, "nodes": 1}
    for rank in (0, 1):
        write_node(tmp_path / "one" / f"gpu-a01-rank{rank}",
                   outcomes=[outcome(ZERO, "failed", "expected >= 32 CPU cores, found 2")],
                   rendezvous={**one, "rank": rank, "local_rank": rank, "node_rank": 0})
    many = {"launcher": "torchrun", "job": "dsconform-multinode", "world_size": 2, "nodes": 2}
    for rank in (0, 1):
        write_node(tmp_path / "many" / f"gpu-b0{rank}-rank{rank}",
                   outcomes=[outcome(ZERO, "failed", "rank 1 of 2 raised RuntimeError: NCCL")],
                   rendezvous={**many, "rank": rank, "local_rank": 0, "node_rank": rank})
    report = aggregate.analyse(aggregate.collect([tmp_path]))
    lines = aggregate.drain_commands(report, "k8s")
    assert lines[:2] == ["kubectl cordon gpu-a01",
                         "kubectl taint nodes gpu-a01 dsconform/verdict=failed:NoSchedule "
                         "--overwrite"]
    assert "dsconform/reason=dsconform: job j7 rank gpu-a01-rank0: 1 x expected" in lines[3]
    assert [ln for ln in lines if "gpu-b0" in ln] == [
        f"# gpu-b0{r}-rank{r}: rank of multi-node job dsconform-multinode failed; a multi-node "
        "failure names no single node: compare the nodes' single-node runs" for r in (0, 1)]
    report.scheduler = "k8s"
    assert "kubectl cordon gpu-a01" in aggregate_report.terminal(report)
    assert aggregate_report.to_json(report)["drain_commands"] == lines
