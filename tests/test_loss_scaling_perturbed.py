"""The loss-scaling checks MUST go red when the real DeepSpeed object misbehaves.

Every check of suites/test_loss_scaling.py is run here against real DeepSpeed objects, first as
they are (the control: the check passes) and then with one real DeepSpeed class patched in the
rank process (tests/loss_scaling_cpu_fp16.py), where the same check must fail and say what broke:

- the scaler never lowers its scale on overflow (DynamicLossScaler.update_scale): the state
  machine (LOSS-SCALE-1) and the engine check (LOSS-SCALE-4) both go red;
- a skipped step still changes the parameters (ZeRO's skip path runs the inner optimizer);
- the first clean step after a skip is dropped; one rank steps alone on a skipped step (the
  consensus check); a static scale moves; the floor holds silently instead of ending the run;
- bf16 gets a scaler, or its weights turn NaN (LOSS-SCALE-5);
- fp16 stage 0 does not converge (LOSS-SCALE-6), shown with DeepSpeed's own upstream bug
  DS-8393 rather than a patch.

The engine runs use DeepSpeed's fp16 engine on the CPU accelerator: this CPU has no oneDNN fp16,
so the accelerator's fp16 check is lifted inside the rank (torch's CPU kernels compute fp16
fine). The suite never does that; these runs also show the suite's GPU code working end to end
on every stage before it meets a GPU.
"""

from __future__ import annotations

import pytest

from dsconform.dist import run_ranks
from dsconform.tolerances import tolerance
from suites.loss_scaling_ranks import CurveCase, ScalingCase
from suites.test_loss_scaling import (
    TIMEOUT_S,
    ScalerMachine,
    check_bf16_run,
    check_convergence,
    check_engine_run,
    run_scaler_machine,
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
