"""The loss-scaling checks MUST go red when the real DeepSpeed object misbehaves.

Every check of suites/test_loss_scaling.py is run here against real DeepSpeed objects, first as
they are (the control: the check passes) and then with one real DeepSpeed class patched in the
rank process (tests/loss_scaling_cpu_fp16.py), where the same check must fail and say what broke:

- the scaler never lowers its scale on overflow (DynamicLossScaler.update_scale): the state
  machine (LOSS-SCALE-1) and the engine check (LOSS-SCALE-4) both go red;
- a skipped step still changes the parameters (ZeRO's skip path runs the inner optimizer);
- the first clean step after a skip is dropped; one rank steps alone on a skipped step (the
  consensus check); a static scale moves; the floor holds silently instead of ending the run;
- an applied step whose size is wrong (LOSS-SCALE-7): DeepSpeed's lr 5% high, a skip that
  still steps, and DeepSpeed's own DS-8588 (the step where the scale rises) and DS-8393 (stage
  0 never scales the loss); DS-8588 patched away, the same cell passes;
- bf16 gets a scaler, or its weights turn NaN (LOSS-SCALE-5);
- fp16 stage 0 does not converge (LOSS-SCALE-6), shown with DeepSpeed's own upstream bug
  DS-8393 rather than a patch.

The engine runs use DeepSpeed's fp16 engine on the CPU accelerator: this CPU has no oneDNN fp16,
so the accelerator's fp16 check is lifted inside the rank (torch's CPU kernels compute fp16
fine). The suite never does that; these runs also show the suite's GPU code working end to end
on every stage before it meets a GPU.
"""

from __future__ import annotations

import re

import pytest

from dsconform.checks.tolerances import tolerance
from dsconform.harness.api import run_ranks
from suites.loss_scaling_ranks import CurveCase, ScalingCase
from suites.test_loss_scaler import ScalerMachine, run_scaler_machine
from suites.test_loss_scaling import (
    TIMEOUT_S,
    check_bf16_run,
    check_convergence,
    check_engine_run,
    check_step_sizes,
)
from tests import loss_scaling_cpu_fp16 as cpu


def _engine(case: ScalingCase, perturb: str | None = None) -> list[str]:
    results = run_ranks(cpu.train_with_overflows, case.world_size, args=(case,),
                        kwargs={"perturb": perturb}, timeout_s=TIMEOUT_S, accelerator="cpu")
    return check_engine_run(case, results)


# --- LOSS-SCALE-1: the state machine --------------------------------------------------------

class _NeverLowers(ScalerMachine):
    trace_fn = staticmethod(cpu.scaler_trace)
    trace_kwargs = {"perturb": "never_lowers"}


class _SilentFloor(ScalerMachine):
    trace_fn = staticmethod(cpu.scaler_trace)
    trace_kwargs = {"perturb": "silent_floor"}


@pytest.mark.parametrize("machine, message", [
    (_NeverLowers, "DeepSpeed's scale after the step"),
    (_SilentFloor, "(an endless run of silent skips)"),
], ids=["never_lowers", "silent_floor"])
def test_state_machine_goes_red(machine, message):
    """The machine MUST find a sequence on which the perturbed real scaler leaves the model."""
    with pytest.raises(AssertionError) as err:
        run_scaler_machine(machine, shrink=False)
    assert message in str(err.value), str(err.value)
    assert "X = overflow" in str(err.value)


# --- LOSS-SCALE-4: the engine ---------------------------------------------------------------

@pytest.mark.parametrize("case", [
    ScalingCase(stage=0, world_size=2, scaler="h1", inject="grad_nan"),
    ScalingCase(stage=1, world_size=2, scaler="h2c", inject="loss_inf"),
    ScalingCase(stage=2, world_size=2, scaler="floor", inject="grad_inf"),
    ScalingCase(stage=3, world_size=2, scaler="static", inject="loss_nan"),
    ScalingCase(stage=3, world_size=1, scaler="h2", inject="grad_nan", optimizer="adam"),
], ids=lambda c: c.id)
def test_engine_control_passes(case):
    """Unperturbed, the suite's engine check MUST pass on every stage (fp16 on this CPU)."""
    assert _engine(case) == []


def test_known_stage0_defects_are_what_fails():
    """Stage 0 fails exactly where the known issues say: hysteresis ignored, silent floor."""
    h2 = _engine(ScalingCase(stage=0, world_size=1, scaler="h2", inject="loss_inf"))
    assert "step 1 (overflow (loss_inf) injected on rank 0): loss scale after the step " \
           "128.0, the model's 256.0" in h2[0], h2
    floor = _engine(ScalingCase(stage=0, world_size=1, scaler="floor", inject="loss_inf"))
    assert "step 3 (overflow (loss_inf) injected on rank 0): an overflow at min_loss_scale=1 " \
           "must end the run with an error; DeepSpeed skipped the step and went on" in floor[0]


@pytest.mark.parametrize("case, perturb, message", [
    (ScalingCase(stage=2, world_size=2, scaler="h1", inject="loss_inf"), "never_lowers",
     "step 2 (overflow (loss_inf) injected on rank 1): loss scale after the step 256.0, the "
     "model's 128.0"),
    (ScalingCase(stage=2, world_size=2, scaler="h1", inject="grad_inf"), "skip_still_steps",
     "step 2 (overflow (grad_inf) injected on rank 1): skipped, yet changed this rank's state: "
     "master0.0"),
    (ScalingCase(stage=1, world_size=2, scaler="h1", inject="loss_nan"), "clean_step_dropped",
     "step 3 (clean): applied, yet left the fp32 masters of fc1.weight"),
    (ScalingCase(stage=0, world_size=2, scaler="h1", inject="grad_nan"), "rank0_steps_alone",
     "step 2: the gathered fp32 masters of rank 0 and rank 1 differ in fc1.weight"),
    (ScalingCase(stage=2, world_size=2, scaler="static", inject="grad_nan"),
     "static_scale_moves", "step 1 (overflow (grad_nan) injected on rank 1): loss scale after "
     "the step 512.0, the model's 1024.0"),
    (ScalingCase(stage=3, world_size=2, scaler="floor", inject="loss_inf"), "silent_floor",
     "step 3 (overflow (loss_inf) injected on rank 1): an overflow at min_loss_scale=1 must end "
     "the run with an error; DeepSpeed skipped the step and went on"),
], ids=["never_lowers", "skip_still_steps", "clean_step_dropped", "rank0_steps_alone",
        "static_scale_moves", "silent_floor"])
def test_engine_check_goes_red(case, perturb, message):
    """Each perturbation of the real engine MUST fail the check, naming rank, step and what."""
    problems = _engine(case, perturb)
    assert any(message in p for p in problems), "\n".join(problems) or "no problem found"


# --- LOSS-SCALE-7: the size of applied steps -------------------------------------------------

def _steps(case: ScalingCase, perturb: str | None = None, lr_factor: float = 1.0,
           optimizer_tol: str | None = None) -> tuple[list[str], dict[str, float]]:
    results = run_ranks(cpu.train_with_overflows, case.world_size, args=(case,),
                        kwargs={"perturb": perturb, "lr_factor": lr_factor},
                        timeout_s=TIMEOUT_S, accelerator="cpu")
    # torch Adam ("adam") stands in for FusedAdam (whose op would JIT-build here): the same
    # fp16 wrappers, the same replica; held to FusedAdam's entry.
    tol = tolerance("loss_scaling", "fp16", optimizer_tol or case.optimizer, accelerator="cpu")
    return check_step_sizes(case, results, tol)


STEP_CONTROLS = [
    ScalingCase(stage=2, world_size=2, scaler="static", inject="loss_inf"),
    ScalingCase(stage=3, world_size=2, scaler="h2c", inject="loss_inf"),
    ScalingCase(stage=1, world_size=2, scaler="static", inject="loss_inf", optimizer="adam"),
]


@pytest.mark.parametrize("case", STEP_CONTROLS, ids=lambda c: c.id)
def test_step_size_control_passes(case):
    """Unperturbed, every applied step of ZeRO 1-3 MUST match the fp32 replica's (no rise of
    the scale in these patterns: DS-8588 does not apply)."""
    problems, worst = _steps(case, optimizer_tol="fused_adam" if case.optimizer == "adam"
                             else None)
    assert problems == [], problems
    assert 0 < worst["gain"] < 1e-3, worst  # it measured something, and agreed


@pytest.mark.parametrize("case", STEP_CONTROLS, ids=lambda c: c.id)
def test_step_size_lr_error_fails(case):
    """DeepSpeed's lr 5% high MUST fail the first applied step, with the gain found."""
    problems, worst = _steps(case, lr_factor=1.05,
                             optimizer_tol="fused_adam" if case.optimizer == "adam" else None)
    assert problems and "step 0 (scale" in problems[0], problems
    assert re.search(r"moved the fp32 masters 1\.0[45]\d*x as far as the fp32 replica",
                     problems[0]), problems
    assert worst["gain"] > 0.04, worst


def test_skipped_step_that_steps_fails_the_next_applied_step():
    """A skip that still runs the optimizer on zero gradients: SGD's momentum moves the masters
    on the skipped step 1 and again, on top of the real update, on step 2: step 2 MUST fail."""
    problems, _ = _steps(ScalingCase(stage=2, world_size=2, scaler="h2c", inject="loss_inf"),
                         perturb="skip_still_steps")
    assert problems and "step 2 (scale 256): moved the fp32 masters" in problems[0], problems


def _fake_run(moves_on_skip: float) -> list[dict]:
    """A fabricated one-rank run of the "static" pattern (0,1,0,1,1,0) whose applied steps
    match the replica's exactly; its skipped steps add ``moves_on_skip`` to every master."""
    import torch

    init = {"w": torch.zeros(4)}
    masters, replica, steps = init["w"].clone(), init["w"].clone(), []
    for i, overflow in enumerate((0, 1, 0, 1, 1, 0)):
        if overflow:
            masters = masters + moves_on_skip
        else:
            update = torch.tensor([1.0, -2.0, 0.5, 0.25]) * (i + 1) * 1e-2
            masters, replica = masters + update, replica + update
        steps.append({"step": i, "masters": {"w": masters.clone()},
                      "replica": {"w": replica.clone()}, "scale_used": 1024.0})
    return [{"rank": 0, "wrapper": "Fake", "init": init, "steps": steps}]


def test_whole_run_catches_what_single_steps_cannot():
    """Masters moved on a skipped step (and nothing else wrong) pass every applied step's own
    comparison; the whole run MUST fail. The unmoved fake passes."""
    case = ScalingCase(stage=2, world_size=1, scaler="static", inject="loss_inf")
    tol = tolerance("loss_scaling", "fp16", "sgd", accelerator="cpu")
    assert check_step_sizes(case, _fake_run(0.0), tol)[0] == []
    problems, _ = check_step_sizes(case, _fake_run(3e-3), tol)
    assert len(problems) == 1 and "the whole run to step 5" in problems[0], problems


def test_fewer_applied_steps_than_the_model_fails():
    """A run that ended early (or lost its records) MUST NOT pass on the steps it has."""
    case = ScalingCase(stage=2, world_size=1, scaler="static", inject="loss_inf")
    run = _fake_run(0.0)
    run[0]["steps"] = run[0]["steps"][:3]
    tol = tolerance("loss_scaling", "fp16", "sgd", accelerator="cpu")
    problems, _ = check_step_sizes(case, run, tol)
    assert problems == ["rank 0 (Fake): 2 applied steps compared, the model applies 3 (steps "
                        "[0, 2, 5])"], problems


def test_known_raise_step_defect_is_what_fails():
    """DS-8588: ZeRO-2's step where the scale rises (128 -> 256, step 5 of "h1") moves 0.79x as
    far (2 ranks); with the unscale by the scale backward used, the same cell passes."""
    case = ScalingCase(stage=2, world_size=2, scaler="h1", inject="loss_inf")
    problems, _ = _steps(case)
    assert problems and re.search(r"step 5 \(scale 128\): moved the fp32 masters 0\.[78]\d*x",
                                  problems[0]), problems
    fixed, worst = _steps(case, perturb="unscale_with_backward_scale")
    assert fixed == [] and 0 < worst["gain"] < 1e-3, (fixed, worst)


def test_known_stage0_unscaled_loss_is_what_fails():
    """DS-8393: stage-0 fp16 SGD's first step moves 1/loss_scale as far as fp32's."""
    problems, _ = _steps(ScalingCase(stage=0, world_size=1, scaler="static", inject="loss_inf"))
    assert problems and "step 0 (scale 1024): moved the fp32 masters 0.0009766x" in problems[0], \
        problems


# --- read_scaler on the real holders ----------------------------------------------------------

def test_adapter_reads_every_real_holder():
    views = run_ranks(cpu.adapter_views, 1, timeout_s=TIMEOUT_S)[0]

    def key(name):
        v = views[name]
        return (v["holder"], v["scale"], v["dynamic"], v["hysteresis_left"])

    assert key("dynamic") == ("DynamicLossScaler", 256.0, True, 2)
    assert key("static") == ("LossScaler", 1024.0, False, None)
    assert key("bf16") == ("LossScaler", 1.0, False, None)
    # Stage 0's wrappers keep no hysteresis; the unfused one has no cur_scale attribute at all.
    assert key("FP16_Optimizer") == ("FP16_Optimizer", 256.0, True, None)
    assert key("FP16_UnfusedOptimizer") == ("FP16_UnfusedOptimizer", 1024.0, False, None)
    assert key("FP16_UnfusedOptimizer_bf16") == ("FP16_UnfusedOptimizer", None, False, None)


# --- LOSS-SCALE-5: bf16 -----------------------------------------------------------------------

@pytest.mark.parametrize("perturb, message", [
    (None, None),
    ("bf16_gets_scaler", "step 0: bf16 has a loss scaler (dynamic=True, scale 65536.0)"),
    ("bf16_poisoned", "loss or fp32 masters not finite from step 4 on"),
], ids=["control", "bf16_gets_scaler", "bf16_poisoned"])
def test_bf16_check(perturb, message):
    """bf16 on ZeRO-2: passes as is; a scaler, or NaN weights, MUST fail the check."""
    results = run_ranks(cpu.train_bf16, 2, args=(2, 2), kwargs={"perturb": perturb},
                        timeout_s=TIMEOUT_S, accelerator="cpu")
    problems = check_bf16_run(results)
    if message is None:
        assert problems == []
    else:
        assert any(message in p for p in problems), "\n".join(problems) or "no problem found"


# --- LOSS-SCALE-6: convergence ----------------------------------------------------------------

def test_convergence_check_goes_red_on_stage0_fp16():
    """DS-8393 (stage 0 never scales the loss, then unscales): fp16 SGD MUST fail the check."""
    case = CurveCase(stage=0, dtype="fp16", steps=40)
    results = run_ranks(cpu.train_curve, case.world_size, args=(case,), timeout_s=600,
                        accelerator="cpu")
    tol = tolerance("convergence", "fp16", "sgd", accelerator="cpu")
    curves, problems = check_convergence(case, results, tol)
    assert problems, f"stage-0 fp16 converged like fp32: {curves}"
    assert problems[0].startswith("fp16 (FP16_UnfusedOptimizer) ended at loss"), problems
    # It barely moved: updates were 1/65536 of fp32's.
    assert curves["fp16"]["last_mean"] > 0.9 * curves["fp16"]["first_mean"], curves
