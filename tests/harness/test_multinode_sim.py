"""Two nodes on localhost MUST pass the multi-node tier, and ``dsconform aggregate`` MUST make one
report of them: the nightly recipe's stage 2 as CI can run it.

Two torchrun agents (``--nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d``, gloo on the CPU
accelerator), as two nodes would run them, each start one rank through the recipes' own helper
(``--no-python examples/nightly-node.sh rank RESULTS``, as examples/nightly-pdsh.sh does): one
pytest process, one rank of a job whose rendezvous spans two "nodes". They run
``suites/test_multinode.py -m multinode`` (ZeRO vs DDP across the ranks, every collective exact,
busbw) and tests/multinode_perturbed.py, where each of those checks is broken on purpose and
must go red. Each rank writes its own results folder (``RESULTS/<host>-rank<RANK>``); aggregate
then reads them.

About 90 s on the 2-core CPU machine (each agent imports torch and DeepSpeed and probes the
node; the first ZeRO case initialises DeepSpeed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil

from dsconform.harness.api import free_port

REPO = Path(__file__).resolve().parents[2]
AGENT_TIMEOUT_S = 480  # generous: other engineers' tests share the two cores
# Never inherited: an xdist worker's variables, or a rank's, would confuse the agents' pytest.
DROPPED = ("PYTEST_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_",
           "GROUP_RANK", "TORCHELASTIC_", "SLURM_")


def launch_two_nodes(results: Path, logs: Path) -> list[tuple[int, str]]:
    """Start both agents, wait for them; (exit code, log tail) per agent."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(DROPPED)}
    env.update(PYTHONUNBUFFERED="1", PYTHON=sys.executable, DSCONFORM_TIME_S="600")
    agents = []
    for node in (0, 1):
        # Two "nodes" on one host: each names itself as Slurm would (MN-NODES-1 counts names;
        # the result folders take it too).
        env = dict(env, SLURMD_NODENAME=f"simnode{node}")
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                   "--nproc-per-node=1", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=dsconform-sim-{port}",
                   "--max-restarts=0", "--no-python",
                   str(REPO / "examples" / "nightly-node.sh"), "rank", str(results),
                   "suites/test_multinode.py", "tests/multinode_perturbed.py", "-m", "multinode"]
        log = open(logs / f"agent{node}.log", "w")  # closed below
        agents.append((subprocess.Popen(command, cwd=REPO, env=env, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True), log))
    try:
        for agent, _ in agents:
            try:
                agent.wait(timeout=AGENT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                break
    finally:
        for agent, log in agents:
            if agent.poll() is None:
                for child in psutil.Process(agent.pid).children(recursive=True):
                    child.kill()
                os.killpg(agent.pid, 9)
                agent.wait()
            log.close()
    tails = [(agent.returncode, (logs / f"agent{n}.log").read_text()[-2000:])
             for n, (agent, _) in enumerate(agents)]
    # Each rank's pytest output, beside its results (examples/nightly-node.sh).
    for pytest_log in sorted(results.glob("*/pytest.log")):
        tails.append((None, f"{pytest_log.parent.name}: {pytest_log.read_text()[-3000:]}"))
    return tails


def test_two_nodes_on_localhost_pass_the_multinode_tier_and_aggregate(tmp_path):
    results = tmp_path / "nightly" / "multinode"
    results.mkdir(parents=True)
    agents = launch_two_nodes(results, tmp_path)
    logs = "\n\n".join(f"--- {n} (exit {code}) ---\n{tail}"
                       for n, (code, tail) in enumerate(agents))
    assert [code for code, _ in agents[:2]] == [0, 0], logs
    folders = sorted(p.name for p in results.iterdir())
    assert folders == ["simnode0-rank0", "simnode1-rank1"], (folders, logs)
    ranks = []
    for folder in folders:
        summ = json.loads((results / folder / "summary.json").read_text())
        caps = summ["capabilities"]
        # 6 ZeRO cases (the fp16 one skips on CPUs without oneDNN fp16), 5 collectives exact.
        # and MN-NODES-1 (two node names)
        assert caps["multinode"].get("passed", 0) >= 11, (caps, logs)
        # busbw at the default size: measured and recorded, no floor at this job size: skipped
        assert caps["multinode"].get("skipped", 0) >= 1, (caps, logs)
        assert caps["multinode"].get("failed", 0) == 0, (caps, logs)
        # The checks broken on purpose went red (each of these tests asserts that).
        assert caps["multinode-red"] == {"passed": 3}, (caps, logs)
        rdzv = summ["rendezvous"]
        assert (rdzv["nodes"], rdzv["world_size"], rdzv["launcher"]) == (2, 2, "torchrun")
        ranks.append((rdzv["job"], rdzv["rank"]))
    assert ranks[0][0] == ranks[1][0] and sorted(r for _, r in ranks) == [0, 1], ranks

    out = tmp_path / "cluster"
    proc = subprocess.run([sys.executable, "-m", "dsconform.cli", "aggregate",
                           str(tmp_path / "nightly"), "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASSED: all 2 node folder(s) passed" in proc.stdout
    assert f"multi-node job {ranks[0][0]}: 2 nodes, world size 2, 2 rank folder(s): passed" \
        in proc.stdout
    report = json.loads((out / "cluster.json").read_text())
    assert [n["name"] for n in report["nodes"]] == folders
    assert report["jobs"][0]["members"] == folders, report["jobs"]
    busbw = [k for k in report["metrics"] if k.endswith("::all_reduce.busbw")]
    assert len(busbw) == 1 and set(report["metrics"][busbw[0]]) == set(folders)
    assert (out / "junit.xml").exists() and (out / "heatmap.png").exists()


def test_a_gpu_profile_is_not_checked_across_nodes_on_the_cpu():
    """Torch seeing no GPU on a node whose profile promises them MUST fail the multinode checks,
    not move them to gloo; a CPU profile runs them there."""
    from types import SimpleNamespace

    import pytest

    from suites.test_multinode import _ran_on_gpus

    cpu_node = SimpleNamespace(accelerator="cpu", gpu_count=0)
    with pytest.raises(pytest.fail.Exception, match="promises 8 GPUs per node, but torch sees "
                                                    "none here"):
        _ran_on_gpus(cpu_node, SimpleNamespace(gpus_promised=8, name="h100-x8"))
    _ran_on_gpus(cpu_node, SimpleNamespace(gpus_promised=0, name="cpu-ci"))
    _ran_on_gpus(SimpleNamespace(accelerator="cuda", gpu_count=8),
                 SimpleNamespace(gpus_promised=8, name="h100-x8"))


def test_ranks_on_one_host_fail_the_node_count(monkeypatch):
    """MN-NODES-1: a rendezvous that claims 2 nodes whose ranks all report one node name (two
    launcher groups on one host) MUST fail, naming the node and its ranks; distinct names pass."""
    from types import SimpleNamespace

    import pytest

    from suites import test_multinode as suite

    node = SimpleNamespace(accelerator="cpu", gpu_count=0)
    prof = SimpleNamespace(gpus_promised=0, name="cpu-ci")
    monkeypatch.setattr(suite, "rendezvous_info", lambda: SimpleNamespace(nodes=2))
    same = [{"rank": 0, "node": "gpu-07"}, {"rank": 1, "node": "gpu-07"}]
    monkeypatch.setattr(suite, "run_ranks", lambda *a, **k: same)
    with pytest.raises(AssertionError, match=r"spans 2 nodes, the ranks ran on 1: gpu-07: "
                                             r"ranks \[0, 1\]"):
        suite.test_ranks_span_the_nodes(node, prof)
    monkeypatch.setattr(suite, "run_ranks", lambda *a, **k: [{"rank": 0, "node": "gpu-07"},
                                                            {"rank": 1, "node": "gpu-08"}])
    suite.test_ranks_span_the_nodes(node, prof)
