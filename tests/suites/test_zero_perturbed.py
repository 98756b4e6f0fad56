"""The ZeRO equivalence check MUST go red when DeepSpeed's update is off by a hair.

bf16 cells too: their element-wise bounds are wide (bf16 rounding), so an lr 20% off passed
them; the whole-update check (Tol.update, Tol.gain) MUST fail an lr 5% off in either direction.

One real case of suites/test_zero.py (ZeRO-3, fp32 SGD, 2 ranks on the CPU accelerator) runs
twice: as is, where it is bit-exact, and with a fault injected into the DeepSpeed side only -
from step 5 on the loss is multiplied by 1.001 inside ``engine.backward`` (a wrapper applied in
the rank, dsconform/checks/zero_vs_ddp.py ``_perturb_backward``). The comparison must then fail
and name step 5, the gradient that diverged, and the tolerance it broke. Nothing is mocked:
DeepSpeed and DDP really train.
"""

from __future__ import annotations

import pytest

from dsconform.checks.equivalence import compare_rank_results
from dsconform.checks.tolerances import tolerance
from dsconform.checks.zero_vs_ddp import ZeroCase, train_zero_and_ddp
from dsconform.harness.api import run_ranks

CASE = ZeroCase(stage=3, dtype="fp32", optimizer="sgd", grad_accum=1, world_size=2, steps=8)
PERTURB_FROM_STEP = 5


def _compare(perturb: float):
    results = run_ranks(train_zero_and_ddp, CASE.world_size, timeout_s=180, args=(CASE,),
                        kwargs={"perturb": perturb, "perturb_from_step": PERTURB_FROM_STEP},
                        accelerator="cpu")
    tol = tolerance("zero", "fp32", "sgd", accelerator="cpu")
    return compare_rank_results(results, tol, label=CASE.id)


def test_unperturbed_case_is_bit_exact():
    """The control: without the fault the same case MUST compare equal (bit-exact)."""
    cmp = _compare(1.0)
    assert cmp.ok, cmp.report()
    assert cmp.worst_abs == 0.0


def test_perturbed_update_fails_naming_the_step():
    """With the loss scaled by 1.001 from step 5 the comparison MUST fail at step 5."""
    cmp = _compare(1.001)
    assert not cmp.ok
    first = cmp.first_divergence
    # The scaled loss changes step 5's gradient first; its loss was computed before backward.
    assert (first.step, first.quantity) == (PERTURB_FROM_STEP, "grad")
    # Everything before the fault is still identical.
    assert all(d.within for d in cmp.differences if d.step < PERTURB_FROM_STEP)
    # The gradient is off by about the factor (more where a sum cancels): 1e-3 relative.
    assert 5e-4 < first.max_rel < 1e-2
    with pytest.raises(AssertionError) as err:
        cmp.assert_ok()
    msg = str(err.value)
    assert msg.startswith(f"{CASE.id}: first diverging step {PERTURB_FROM_STEP}: "
                          f"step {PERTURB_FROM_STEP}, grad of '"), msg
    assert "max abs diff" in msg and "max rel diff" in msg
    assert f"exceeds tolerance rtol=0 atol=0 ({cmp.tol.why})" in msg


BF16_CASES = {"adam": ZeroCase(stage=2, dtype="bf16", optimizer="adam", grad_accum=1,
                               world_size=2),
              "sgd": ZeroCase(stage=3, dtype="bf16", optimizer="sgd", grad_accum=4, world_size=2)}


def _compare_bf16(optimizer: str, lr_factor: float):
    case = BF16_CASES[optimizer]
    results = run_ranks(train_zero_and_ddp, case.world_size, timeout_s=180, args=(case,),
                        kwargs={"lr_factor": lr_factor}, accelerator="cpu")
    tol = tolerance("zero_accum" if case.grad_accum > 1 else "zero", "bf16", optimizer,
                    accelerator="cpu")
    return compare_rank_results(results, tol, label=case.id)


@pytest.mark.parametrize("optimizer", sorted(BF16_CASES))
def test_bf16_control_passes_with_its_gain_near_one(optimizer):
    cmp = _compare_bf16(optimizer, 1.0)
    assert cmp.ok, cmp.report()
    assert cmp.worst("gain")[0] < 2e-3 and cmp.worst("update")[1] < 0.05


@pytest.mark.parametrize("lr_factor", [1.2, 1.05, 0.95])
@pytest.mark.parametrize("optimizer", sorted(BF16_CASES))
def test_bf16_lr_error_fails_the_whole_update(optimizer, lr_factor):
    """DeepSpeed trained with lr x lr_factor: the gain MUST fail, naming the factor."""
    cmp = _compare_bf16(optimizer, lr_factor)
    assert not cmp.ok
    gains = [d for d in cmp.failures if d.quantity == "gain"]
    assert len(gains) == 2, cmp.report()  # one per rank
    for d in gains:  # the gain follows the lr (SGD's less than 1:1: the loss surface curves)
        assert abs(d.value - 1) > 0.02 and (d.value > 1) == (lr_factor > 1), d.describe()
    if (optimizer, lr_factor) == ("adam", 1.2):
        # What the element-wise bounds alone made of it: within, every loss, gradient, weight
        # (Adam moves each weight by about lr per step; 20% of 20 steps x 1e-3 < atol).
        elementwise = [d for d in cmp.differences if d.quantity in ("loss", "grad", "param")]
        assert elementwise and all(d.within for d in elementwise)
        assert "gain of all parameters (rank 0): the update is 1.1" in cmp.report()


def test_fp16_lr_error_fails_the_whole_update():
    """fp16 on a CPU with AVX512-FP16 (skips elsewhere: DeepSpeed refuses fp16 there), held to
    the GPU entry: an lr 5% high fails the gain, the control passes."""
    case = ZeroCase(stage=2, dtype="fp16", optimizer="adam", grad_accum=1, world_size=2)
    tol = tolerance("zero", "fp16", "adam", accelerator="cpu")
    cmps = {f: compare_rank_results(
        run_ranks(train_zero_and_ddp, 2, timeout_s=180, args=(case,), kwargs={"lr_factor": f},
                  accelerator="cpu"), tol, label=case.id) for f in (1.0, 1.05)}
    assert cmps[1.0].ok, cmps[1.0].report()
    assert not cmps[1.05].ok
    assert {d.quantity for d in cmps[1.05].failures} >= {"gain"}


# ZERO-EQ-1 matches DDP just as well when ZeRO is not what ran: the layout check reads what the
# engine built. Real DeepSpeed engines on gloo, 2 ranks (world size 2 is what partitions).
@pytest.mark.parametrize("asked, built, expected", [
    (dict(stage=2), dict(stage=2), []),
    (dict(stage=3), dict(stage=3), []),
    (dict(stage=3, offload_optimizer=True, offload_param=True),
     dict(stage=3, offload_optimizer=True, offload_param=True), []),
    (dict(stage=2), dict(stage=0), ["the engine runs ZeRO stage 0, the case asked for 2",
                                    "has no cpu_offload"]),
    (dict(stage=3), dict(stage=1), ["the engine runs ZeRO stage 1, the case asked for 3",
                                    "has no offload_optimizer", "has no offload_param",
                                    "parameters are not partitioned by ZeRO-3"]),
    (dict(stage=2, offload_optimizer=True), dict(stage=2),
     ["the ZeRO optimizer's cpu_offload is False, the case asked for True"]),
    (dict(stage=3, offload_optimizer=True, offload_param=True), dict(stage=3),
     ["offload_optimizer is False, the case asked for True",
      "offload_param is False, the case asked for True"]),
])
def test_layout_check_sees_what_the_engine_built(asked, built, expected):
    from tests import rank_fns

    for problems in run_ranks(rank_fns.zero_layout, 2, timeout_s=120, accelerator="cpu",
                              args=(asked, built)):
        text = "\n".join(problems)
        assert all(e in text for e in expected), text
        assert bool(problems) == bool(expected), text


def test_one_layers_gradient_off_fails_its_tensor_gain():
    """bf16 SGD with fc1.weight's gradient 10% low on the DeepSpeed side: the whole model's gain
    stays inside its bound (the larger layers dominate it), the per-tensor gain names fc1.weight.
    The same run without the fault passes (test_bf16_control_passes_with_its_gain_near_one)."""
    case = ZeroCase(stage=2, dtype="bf16", optimizer="sgd", grad_accum=1, world_size=2)
    results = run_ranks(train_zero_and_ddp, 2, timeout_s=180, args=(case,),
                        kwargs={"grad_factor": ("fc1.weight", 0.9)}, accelerator="cpu")
    cmp = compare_rank_results(results, tolerance("zero", "bf16", "sgd", accelerator="cpu"),
                               label=case.id)
    assert not cmp.ok
    whole = [d for d in cmp.differences if d.quantity == "gain"]
    assert whole and all(d.within for d in whole), cmp.report()  # what the model-wide gain saw
    failed = {(d.name, d.where) for d in cmp.failures if d.quantity == "tensor_gain"}
    assert failed == {("fc1.weight", "rank 0"), ("fc1.weight", "rank 1")}, cmp.report()
    assert "gain of 'fc1.weight' (rank 0): its update is 0.898" in cmp.report()


@pytest.mark.parametrize("tamper", [None, "comm_fp16"])
def test_changed_dtype_resolution_fails_zero_def_2(tamper):
    """ZERO-DEF-2 MUST go red when the engine carries gradients in another dtype than it
    resolves today: every fp32 and bf16 config here forced to communicate in fp16, read from a
    real engine and its ZeRO optimizer. The control (no tamper) passes."""
    from suites.test_zero import resolved_mismatches
    from suites.zero_ranks import read_resolved_dtypes

    found = run_ranks(read_resolved_dtypes, 1, timeout_s=180, kwargs={"tamper": tamper},
                      accelerator="cpu")[0]
    mismatches = resolved_mismatches(found)
    if tamper is None:
        assert not mismatches, mismatches
        return
    assert mismatches
    assert all("communication_data_type: expected" in m for m in mismatches), mismatches
    # the engine's and ZeRO's copies, every stage, both dtypes read here
    assert any(m.startswith("bf16.z3.zero.communication_data_type") for m in mismatches)
    assert any(m.startswith("fp32.z0.communication_data_type") for m in mismatches)
