"""requires(): unmet needs skip with the values found; unmet promises fail."""

from __future__ import annotations

import pytest

from dsconform.gate import requires as gating
from dsconform.profile.schema import NvmePath, Profile
from tests.node.test_detect import fake_node

H200X2 = Profile(name="h200-x2", source="t", gpu_count=2, bf16=True, nccl_min_version="2.21",
                 ops=("fused_adam", "async_io"), deepspeed_min_version="0.19")
CPU = Profile(name="cpu-ci", source="t", gpu_count=0, ops=("cpu_adam",))


def verdict(conditions, node, prof, **kw):
    return gating.evaluate(conditions, node, prof, **kw)


def test_met_conditions_pass():
    v = verdict({"min_gpus": 2, "bf16": True, "nccl": "2.21"}, fake_node(2), H200X2)
    assert v.ok


def test_unpromised_need_skips_with_found_values():
    v = verdict({"min_gpus": 2}, fake_node(1), Profile(name="x", source="t", gpu_count=1))
    assert not v.broken_promises
    assert v.skip_reason == "Requires: [GPUs>=2 (found 1)]"


def test_a_check_that_needs_two_ranks_by_nature_says_why_it_skips():
    one = Profile(name="x", source="t", gpu_count=1)
    v = verdict({"min_gpus": 2, "two_ranks": "a collective runs between ranks"}, fake_node(1), one)
    assert v.skip_reason == ("Requires: [GPUs>=2 (found 1; needs two ranks by nature: a "
                             "collective runs between ranks)]")
    assert verdict({"min_gpus": 1, "two_ranks": "x"}, fake_node(1), one).ok  # one-rank cells run


def test_only_unmet_conditions_are_listed():
    v = verdict({"min_gpus": 1, "bf16": True, "nccl": "2.30"}, fake_node(2), H200X2)
    assert v.skip_reason == "Requires: [NCCL>=2.30 (found 2.28.9)]"


def test_promised_need_fails_with_expected_and_found():
    v = verdict({"min_gpus": 1}, fake_node(0), H200X2)
    assert v.fail_reason == "profile h200-x2 promises [GPUs>=1]: expected 2 GPUs, found 0"


def test_bf16_promise():
    v = verdict({"bf16": True}, fake_node(2, cc="7.0"), H200X2)
    assert [u.condition for u in v.broken_promises] == ["bf16"]
    assert "cc 7.0" in v.fail_reason


def test_op_promised_or_not():
    incompatible = {"async_io": False, "cpu_adam": True}.get
    v = verdict({"op": ["async_io", "cpu_adam"]}, fake_node(0), H200X2, op_compatible=incompatible)
    assert v.fail_reason == ("profile h200-x2 promises [op async_io]: expected op async_io to "
                             "load, found not compatible")
    v = verdict({"op": "async_io"}, fake_node(0), CPU, op_compatible=incompatible)
    assert v.skip_reason == "Requires: [op async_io (found not compatible)]"


def test_nvme_needs_a_path_in_the_profile():
    assert verdict({"nvme": True}, fake_node(0), CPU).skip_reason == \
        "Requires: [NVMe path in profile (found none)]"
    with_path = Profile(name="p", source="t", gpu_count=0,
                        nvme_paths=(NvmePath("/mnt", 1.0, 1.0),))
    assert verdict({"nvme": True}, fake_node(0), with_path).ok


def test_deepspeed_specifier():
    node = fake_node(0)  # DeepSpeed 0.19.8
    v = verdict({"deepspeed": "<0.19.7"}, node, H200X2)
    assert v.skip_reason == "Requires: [DeepSpeed<0.19.7 (found 0.19.8)]"
    old = fake_node(0)
    old.deepspeed_version = "0.18.0"
    v = verdict({"deepspeed": ">=0.19"}, old, H200X2)  # promised by deepspeed.min_version
    assert v.broken_promises
    with pytest.raises(ValueError, match="not a version specifier"):
        verdict({"deepspeed": "new"}, node, H200X2)


def test_nccl_missing_on_cpu_is_promised_failure():
    node = fake_node(0)
    node.nccl_version = None
    v = verdict({"nccl": "2.21"}, node, H200X2)
    assert "expected NCCL>=2.21, found none" in v.fail_reason


def test_multinode_is_never_promised():
    v = verdict({"multinode": True}, fake_node(2), H200X2)
    assert v.skip_reason == "Requires: [multi-node rendezvous (found single node)]"
    assert verdict({"multinode": True}, fake_node(2), H200X2, multinode=True).ok


def test_markers_imply_conditions_and_strictest_wins():
    marks = [gating.requires(min_gpus=4).mark, gating.requires(op="a").mark,
             gating.requires(op=["a", "b"]).mark]
    merged = gating.merge_conditions(marks, {"gpu", "multigpu", "nvme"})
    assert merged == {"min_gpus": 4, "op": ["a", "b"], "nvme": True}


def test_requires_rejects_unknown_conditions():
    with pytest.raises(TypeError, match="min_gpu"):
        gating.requires(min_gpu=2)


def test_accel_params_mark_cuda_only():
    cpu, cuda = gating.accel_params(2)
    assert cpu.values == ("cpu",) and not cpu.marks
    names = [m.name for m in cuda.marks]
    assert names == ["gpu", "multigpu", "requires"] and cuda.marks[-1].kwargs == {"min_gpus": 2}


def test_a_gpu_promise_on_a_node_whose_torch_lost_its_gpus_names_both_counts(monkeypatch):
    """Seen on 2xH200 with CUDA_VISIBLE_DEVICES='': "expected 2 GPUs, found 0" read like a CPU
    machine; the failure now says the GPUs are there and torch cannot use them."""
    from dsconform.gate.requires import evaluate
    from dsconform.node.detect import GpuHardware
    from dsconform.profile.schema import from_data
    from tests.node.test_detect import fake_node

    node = fake_node(0)
    node.hardware = GpuHardware(count=2, models=["NVIDIA H200"] * 2, source="nvml")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    prof = from_data({"profile": {"name": "h200-x2"}, "gpus": {"count": 2}}, "t")
    v = evaluate({"min_gpus": 1}, node, prof)
    assert v.fail_reason == ("profile h200-x2 promises [GPUs>=1]: expected 2 GPUs, found 0 usable: "
                             "2 GPUs present (nvml: NVIDIA H200), 0 usable by torch; "
                             "CUDA_VISIBLE_DEVICES='' is set")


def test_an_xdist_workers_share_short_of_gpus_skips_but_a_short_node_still_fails():
    """-n 2 on a 2-GPU node gives each worker one GPU: a 2-rank test cannot run there, and that
    is how the run was split, not a broken promise (seen on 2xH200: 46 FAILED). The node itself
    still has to have the promised GPUs."""
    v = verdict({"min_gpus": 2}, fake_node(1), H200X2, whole_node=fake_node(2))
    assert not v.ok and not v.broken_promises
    assert "xdist worker's share of the node's 2" in v.skip_reason
    assert "-n" in v.skip_reason
    v = verdict({"min_gpus": 2}, fake_node(1), H200X2, whole_node=fake_node(1))
    assert v.broken_promises and "expected 2 GPUs, found 1" in v.fail_reason


def test_the_run_asks_each_ops_probe_once_and_keeps_the_answer(monkeypatch):
    """The gate's op probe returns its answer; the run state (plugin) keeps it per op."""
    from dsconform.gate import requires as gate_requires
    from dsconform.plugin.runstate import RunState

    asked = []
    monkeypatch.setattr(gate_requires, "op_compatible", lambda op: asked.append(op) or True)
    state = RunState(selection=None, scratch=None, scratch_is_temp=False, results=None,
                     started="")
    assert state.op_compatible("async_io") and state.op_compatible("async_io")
    assert asked == ["async_io"] and state.op_cache == {"async_io": True}
