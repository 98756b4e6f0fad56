"""STATE-BUF-1 and STATE-FULL-1 MUST go red when the state they check is wrong. Real DeepSpeed
on 2 CPU ranks, nothing mocked; each fault is injected into the DeepSpeed side only, through the
rank functions' ``tamper`` argument:

- ``buffer_cast_after_load``: after load_checkpoint the fp32 ``scale`` buffer is bf16;
- ``buffer_value_after_load``: after load_checkpoint one BatchNorm running mean is 1e-3 off;
- ``perturb_grad``: the gradient DeepSpeed holds (and its accessor returns) is 0.1% off;
- ``drop_group_state``: the second parameter group's Adam moments are lost (reset to zero).
"""

from __future__ import annotations

import pytest

from dsconform.harness.api import run_ranks
from suites.state_fidelity_ranks import StateCase, accessors, round_trip
from suites.test_state_fidelity import judge_accessors, judge_round_trip

# Cells of the CPU tier that pass untampered: ZeRO-3 in bf16 (a checkpoint per rank, the
# consolidation gathers partitions) and ZeRO-3 / stage 0 for the accessors (stage 0: the
# model's own parameters; ZeRO-3: gathered partitions).
ROUND_TRIP = StateCase(3, "bf16")


def _round_trip(tmp_path, tamper: str | None):
    results = run_ranks(round_trip, ROUND_TRIP.world_size, timeout_s=300,
                        args=(ROUND_TRIP, str(tmp_path / "ckpt")), kwargs={"tamper": tamper},
                        accelerator="cpu")
    return judge_round_trip(results, ROUND_TRIP, "cpu")


def test_round_trip_control_passes(tmp_path):
    cmp = _round_trip(tmp_path, None)
    assert cmp.ok, cmp.report()


def test_buffer_cast_to_another_dtype_fails(tmp_path):
    cmp = _round_trip(tmp_path, "buffer_cast_after_load")
    assert not cmp.ok
    assert any("state 'scale'" in p and "loaded" in p and "torch.bfloat16" in p
               for p in cmp.problems), cmp.report()


def test_buffer_value_changed_fails(tmp_path):
    cmp = _round_trip(tmp_path, "buffer_value_after_load")
    assert not cmp.ok
    assert {(d.name, d.where) for d in cmp.failures} == {
        ("norm.running_mean", f"rank {r}, loaded") for r in (0, 1)}, cmp.report()


def _accessors(stage: int, tamper: str | None):
    case = StateCase(stage)
    results = run_ranks(accessors, case.world_size, timeout_s=300, args=(case,),
                        kwargs={"tamper": tamper}, accelerator="cpu")
    return judge_accessors(results, case, "cpu")


@pytest.mark.parametrize("stage", [0, 3])
def test_accessor_control_passes(stage: int):
    cmp = _accessors(stage, None)
    assert cmp.ok, cmp.report()


@pytest.mark.parametrize("stage", [0, 3])
def test_perturbed_gradient_fails(stage: int):
    cmp = _accessors(stage, "perturb_grad")
    assert not cmp.ok
    # every gradient is off from step 0 on, by the perturbation's 0.1%
    grads = [d for d in cmp.failures if d.step == 0 and "safe_get_full_grad" in d.where]
    assert len(grads) == 8 and all(d.max_rel > 5e-4 for d in grads), cmp.report()


@pytest.mark.parametrize("stage", [0, 3])
def test_dropped_group_state_fails(stage: int):
    cmp = _accessors(stage, "drop_group_state")
    assert not cmp.ok
    # only the second group's (the biases') moments, nothing else
    assert {d.name for d in cmp.failures} == {
        f"{n}/{k}" for n in ("fc1.bias", "fc2.bias") for k in ("exp_avg", "exp_avg_sq")}, \
        cmp.report()
