"""A node with one GPU runs every check that means something on one rank: `pytest suites -m gpu`
there takes the one-rank cells (``one_gpu_tier``) in place of the two-rank acceptance cells they
cover (``covered_on_one_gpu``), and only checks that need two ranks still skip for GPUs>=2. A node
with two GPUs keeps the acceptance tier the markers leave alone.

The real suites are collected in a subprocess, on this machine, with the node's GPUs faked
(``dsconform.node.detect.probe`` patched by a plugin loaded with ``-p``), and the selection
written out after the plugin chose the tier.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsconform.base.pairwise import uncovered_pairs

ROOT = Path(__file__).resolve().parents[2]

FAKE_NODE = '''
import json
import os

import pytest

from dsconform.gate.requires import MARK, merge_conditions
from dsconform.node import detect

GPUS = int(os.environ["FAKE_GPUS"])
_probe = detect.probe


def probe():
    facts = _probe()
    facts.gpus = [detect.GpuInfo("NVIDIA H200", 150 * 10**9, "9.0") for _ in range(GPUS)]
    facts.hardware = detect.GpuHardware(count=GPUS, models=["NVIDIA H200"] * GPUS,
                                        source="nvml")
    facts.cuda_version, facts.nccl_version = "12.8", "2.27.3"
    return facts


detect.probe = probe


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    items = []
    for it in session.items:
        names = sorted({m.name for m in it.iter_markers()})
        need = merge_conditions(list(it.iter_markers(MARK)), names).get("min_gpus", 0)
        items.append({"id": it.nodeid, "marks": names, "min_gpus": need})
    with open(os.environ["FAKE_SELECTION"], "w") as f:
        json.dump(items, f)
'''

NVME_PATH = ('[[nvme.paths]]\npath = "@scratch"\nread_gbps = 0.1\nwrite_gbps = 0.05\n'
             'gds = false\nbytes = 67108864\nsource = "a stand-in"\n')

SUITES = ("test_zero.py", "test_loss_scaling.py", "test_checkpoint.py", "test_checkpoint_files.py",
          "test_zero_infinity.py")

# What still needs two GPUs on a one-GPU node in these suites, and why: each by nature.
TWO_RANKS = {
    "test_zero.py::test_zero_partition_padding": "partition padding across ranks",
    "test_loss_scaling.py::test_overflow_handling": "overflow consensus across ranks",
    "test_checkpoint.py::test_universal_reshard": "resharding between world sizes",
}


def test_accel_cell_marks_cuda_cells_only_and_refuses_the_wrong_world_size():
    from dsconform.gate.requires import accel_cell

    def names(param) -> list[str]:
        return [m.mark.name if hasattr(m, "mark") else m.name for m in param.marks]

    assert "one_gpu_tier" in names(accel_cell("cuda", id="c", slow=True, one_gpu="tier"))
    assert names(accel_cell("cuda", id="c", world_size=2, one_gpu="covered"))[-1] == \
        "covered_on_one_gpu"
    assert names(accel_cell("cpu", id="c", one_gpu="tier")) == []
    assert names(accel_cell("cuda", id="c")) == ["gpu", "requires"]
    with pytest.raises(ValueError, match="'tier' is for one-rank cells"):
        accel_cell("cuda", id="c", world_size=2, one_gpu="tier")
    with pytest.raises(ValueError, match="'tier' is for one-rank cells"):
        accel_cell("cuda", id="c", world_size=1, one_gpu="covered")
    with pytest.raises(ValueError, match="known: tier, covered"):
        accel_cell("cuda", id="c", one_gpu="joined")


def _collect(tmp_path: Path, gpus: int, markexpr: str) -> dict[str, dict]:
    """The real suites' selection on a node of ``gpus`` fake H200s, by node id."""
    plugin_dir = tmp_path / "plugin"
    plugin_dir.mkdir(exist_ok=True)
    (plugin_dir / "fake_node.py").write_text(FAKE_NODE)
    prof = tmp_path / f"p{gpus}.toml"
    prof.write_text(f'[profile]\nname = "fake-{gpus}"\n[gpus]\ncount = {gpus}\n\n{NVME_PATH}')
    out = tmp_path / f"selection-{gpus}-{markexpr or 'all'}.json"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "DSCONFORM_PROFILE"))}
    env.update(FAKE_GPUS=str(gpus), FAKE_SELECTION=str(out),
               PYTHONPATH=os.pathsep.join(filter(None, [str(plugin_dir), str(ROOT),
                                                        env.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "suites", "-p", "fake_node", "--profile", str(prof),
         "--results", "", "--collect-only", "-q", "-m", markexpr, "-p", "no:cacheprovider"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {it["id"]: it for it in json.loads(out.read_text())}


@pytest.fixture(scope="module")
def selections(tmp_path_factory) -> dict[str, dict[str, dict]]:
    tmp = tmp_path_factory.mktemp("one-gpu")
    return {"all": _collect(tmp, 2, ""), "one": _collect(tmp, 1, "gpu"),
            "two": _collect(tmp, 2, "gpu")}


def _test(node_id: str) -> str:
    """``suites/test_zero.py::test_x[params]`` -> ``test_zero.py::test_x``."""
    return node_id.split("/")[-1].split("[")[0]


def _param(node_id: str) -> str:
    return node_id.partition("[")[2].rstrip("]")


def _mine(node_id: str) -> bool:
    return _test(node_id).split("::")[0] in SUITES


def _marked(items: dict[str, dict], mark: str) -> set[str]:
    return {i for i, it in items.items() if mark in it["marks"]}


def test_two_gpu_node_keeps_the_acceptance_tier(selections):
    """With two GPUs `-m gpu` selects exactly the `gpu` tests that are not `slow` (nor
    `promised_ops_only`: the fake profile promises no op): the one-GPU markers change nothing
    there."""
    every = selections["all"]
    expected = {i for i, it in every.items() if "gpu" in it["marks"]
                and not {"slow", "promised_ops_only"} & set(it["marks"])}
    assert set(selections["two"]) == expected


def test_one_gpu_node_swaps_covered_cells_for_one_rank_cells(selections):
    every, one, two = selections["all"], selections["one"], selections["two"]
    tier, covered = _marked(every, "one_gpu_tier"), _marked(every, "covered_on_one_gpu")
    assert tier and covered
    for i in tier | covered:  # CUDA cells only: the CPU accelerator's cells carry neither
        assert "gpu" in every[i]["marks"] and "cuda" in _param(i).split("-"), i
    assert all(every[i]["min_gpus"] == 1 for i in tier)
    assert all(every[i]["min_gpus"] >= 2 for i in covered)
    assert set(one) == (set(two) - covered) | tier
    for suite in SUITES:  # every suite of this change has a one-rank tier
        assert any(_test(i).startswith(suite) for i in tier), suite


def test_one_gpu_node_skips_only_what_needs_two_ranks(selections):
    """The cells a one-GPU node still selects that need 2 GPUs (the gate skips them there) are
    the checks that need two ranks by nature: for the loss-scaling engine only its consensus
    cells, and each of those tests says why in its docstring."""
    from suites.test_loss_scaling import consensus_cells

    one = selections["one"]
    two_gpu = {i for i, it in one.items() if it["min_gpus"] >= 2 and _mine(i)}
    assert {_test(i) for i in two_gpu} == set(TWO_RANKS)
    consensus = {i for i in two_gpu if _test(i) == "test_loss_scaling.py::test_overflow_handling"}
    assert {_param(i) for i in consensus} == {f"cuda-{c}" for c in consensus_cells()}
    assert len(consensus_cells()) == 4  # one per stage
    import suites.test_checkpoint as ckpt
    import suites.test_loss_scaling as ls
    import suites.test_zero as zero
    for test in TWO_RANKS:
        module = {"test_zero.py": zero, "test_loss_scaling.py": ls,
                  "test_checkpoint.py": ckpt}[test.split("::")[0]]
        doc = getattr(module, test.split("::")[1]).__doc__
        assert "two ranks" in doc, test


def _tier_of(items: dict[str, dict], test: str) -> set[str]:
    return {_param(i) for i in _marked(items, "one_gpu_tier") if _test(i) == test}


def _covered_of(items: dict[str, dict], test: str) -> set[str]:
    return {_param(i) for i in _marked(items, "covered_on_one_gpu") if _test(i) == test}


def test_zero_one_rank_tier_covers_every_pair(selections):
    """ZERO-EQ-1's one-rank tier: every pair of the other axes' values at one rank, every known
    issue's one-rank cell and every tolerance entry."""
    from dsconform.base.compat import installed_deepspeed
    from dsconform.checks.zero_vs_ddp import zero_check_name
    from dsconform.gate.known_issues import KNOWN_ISSUES
    from suites.test_zero import _axes
    from suites.zero_ranks import matrix

    cases = {f"cuda-{c.id}": c for c in matrix(world_sizes=(1,))}
    marked = _tier_of(selections["all"], "test_zero.py::test_zero_matches_ddp")
    tier = [cases[p] for p in marked if p in cases]
    universe = [_axes(c) for c in cases.values()]
    axes = {k: sorted({cell[k] for cell in universe}, key=str) for k in universe[0]}
    assert uncovered_pairs(axes, [_axes(c) for c in tier],
                           valid=lambda cell: cell in universe) == set()
    here = installed_deepspeed()
    for p, c in cases.items():
        if any(ki.affects(here) and ki.covers(f"test_zero.py::test_zero_matches_ddp[{p}]")
               for ki in KNOWN_ISSUES):
            assert c in tier, p
    keys = {(zero_check_name(c), c.dtype, c.optimizer) for c in cases.values()}
    assert keys == {(zero_check_name(c), c.dtype, c.optimizer) for c in tier}
    covered = _covered_of(selections["all"], "test_zero.py::test_zero_matches_ddp")
    assert covered and all(p.endswith("-ws2") for p in covered)
    # Cells beside the matrix (Adam with L2): each two-rank one left out has its one-rank twin.
    beside = {p for p in covered if p.replace("-ws2", "-ws1") not in cases}
    assert {_twin(p) for p in beside} <= marked


@pytest.mark.parametrize("test, axes_name, matrix_name", [
    ("test_loss_scaling.py::test_overflow_handling", "ACCEPTANCE_AXES", "engine_matrix"),
    ("test_loss_scaling.py::test_applied_steps_match_fp32", "STEP_SIZE_AXES",
     "step_size_matrix"),
])
def test_loss_scaling_one_rank_tiers_cover_every_pair(selections, test, axes_name,
                                                      matrix_name):
    import suites.test_loss_scaling as ls

    axes = {k: v for k, v in getattr(ls, axes_name).items() if k != "world_size"}
    cases = {f"cuda-{c.id}": c for c in getattr(ls, matrix_name)()}
    tier = [cases[p] for p in _tier_of(selections["all"], test)]
    assert {c.world_size for c in tier} == {1}
    assert uncovered_pairs(axes, [{k: getattr(c, k) for k in axes} for c in tier]) == set()
    covered = {cases[p] for p in _covered_of(selections["all"], test)}
    assert covered and {c.world_size for c in covered} == {2}


def _twin(param: str) -> str:
    """A two-rank cell's one-rank twin: ``cuda-z2-fp16-ws2`` -> ``cuda-z2-fp16-ws1``,
    ``cuda-2-bf16`` -> ``cuda-2-bf16-ws1``."""
    return param[:-len("ws2")] + "ws1" if param.endswith("-ws2") else f"{param}-ws1"


@pytest.mark.parametrize("test", [
    "test_loss_scaling.py::test_bf16_has_no_scaler",
    "test_loss_scaling.py::test_fp16_bf16_converge",
    "test_checkpoint.py::test_round_trip_is_exact",
    "test_checkpoint.py::test_resume_in_fresh_process",
    "test_checkpoint.py::test_partial_load",
    "test_checkpoint.py::test_consolidated_fp32_equals_masters",
    "test_checkpoint.py::test_stage_change",
    "test_checkpoint_files.py::test_damaged_checkpoint_is_refused",
    "test_checkpoint_files.py::test_flipped_bit_is_detected",
    "test_checkpoint_files.py::test_storage_returns_written_bytes",
    "test_checkpoint_files.py::test_save_throughput",
    "test_checkpoint_files.py::test_load_throughput",
    "test_zero_infinity.py::test_zero_infinity_matches_ddp",
])
def test_every_covered_cell_has_its_one_rank_twin(selections, test):
    """Where the acceptance tier is a list of cells rather than pairs over a world-size axis,
    each two-rank cell left out on a one-GPU node runs there at one rank."""
    covered = _covered_of(selections["all"], test)
    assert covered
    assert {_twin(p) for p in covered} == _tier_of(selections["all"], test)


def test_checkpoint_round_trip_one_rank_tier_is_pairwise(selections):
    from suites.test_checkpoint import DTYPES, _valid

    axes = {"stage": [0, 1, 2, 3], "offload": ["none", "opt", "param+opt"],
            "dtype": list(DTYPES)}
    cells = []
    for p in _tier_of(selections["all"], "test_checkpoint.py::test_round_trip_is_exact"):
        _, stage, offload, dtype, ws = p.split("-")
        assert ws == "ws1", p
        cells.append({"stage": int(stage), "offload": offload, "dtype": dtype})
    assert uncovered_pairs(axes, cells, valid=_valid) == set()


def test_deepnvme_one_rank_tier_is_pairwise(selections):
    from suites.test_zero_infinity import ZINF_AXES

    cells = []
    for p in _tier_of(selections["all"], "test_zero_infinity.py::test_zero_infinity_matches_ddp"):
        *_, offload, dtype, optimizer, ws = p.split("-")
        assert ws == "ws1", p
        cells.append({"offload": offload, "dtype": dtype, "optimizer": optimizer})
    assert uncovered_pairs(ZINF_AXES, cells) == set()
