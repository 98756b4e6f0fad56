"""The onebit suite's GPU checks (ONEBIT-CONV-1, ONEBIT-CKPT-1/2/3) go red on the defects they
exist for.

DeepSpeed's 1-bit optimizers need GPUs, cupy and DeepSpeed <= 0.19.6, none of which this machine
has, so the suite's own test functions run here on rank results shaped like the ones
suites/onebit_ranks.py returns (curves and flags as measured on the CPU stand-in, see
dsconform/checks/tolerances.py), once as they should be and once with one defect each. The real runs
happen on the GPU node; what is checked here is that the suite would notice.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsconform.profile.schema import Profile
from dsconform.results.records import MetricsRecorder
from suites import test_onebit as suite

PROFILE = Profile(name="t", source="t", gpu_count=2)


def decay(first: float, last: float, steps: int) -> list[float]:
    """A loss curve falling geometrically from ``first`` to ``last``."""
    return [first * (last / first) ** (i / (steps - 1)) for i in range(steps)]


WEIGHTS = torch.linspace(-1, 1, 97)


PARAMS = 2632  # the suite's MLP 32-64-8


def elements(steps, start, first=PARAMS):
    """What the CPU stand-in counted per step: the initialising step 0 compresses once, nothing
    until ``start``, then every parameter's elements on every step."""
    return [first] + [0] * (start - 1) + [PARAMS] * (steps - start)


def rank_result(losses, compressed=True, weights=WEIGHTS):
    per_step = elements(len(losses), suite.FREEZE_STEP) if compressed else [0] * len(losses)
    return {"losses": list(losses), "seconds": [0.001] * len(losses), "weights": weights.clone(),
            "stage": {"optimizer_class": "OnebitAdam", "compressed": compressed,
                      "backward_allreduce": not compressed},
            "compressed_calls": sum(1 for e in per_step if e) * 4,
            "compressed_elements": per_step, "param_elements": PARAMS}


@pytest.fixture
def metrics():
    return MetricsRecorder("t::t", "onebit", lambda m: None)


@pytest.fixture
def runs(monkeypatch):
    """suite._train answers from this dict of {"baseline" | "compressed": per-rank results}."""
    canned = {"baseline": [rank_result(decay(2.2, 0.0038, suite.STEPS), compressed=False)] * 2,
              "compressed": [rank_result(decay(2.2, 0.0049, suite.STEPS))] * 2}

    def train(run):
        return canned["baseline" if run.freeze_step > run.steps else "compressed"]

    monkeypatch.setattr(suite, "_train", train)
    monkeypatch.setattr(suite, "need_cupy", lambda profile: None)
    return canned


def converge(metrics):
    suite.test_converges_like_baseline("onebit_adam", "fp32", PROFILE, metrics)


def test_convergence_check_passes_as_measured(runs, metrics):
    converge(metrics)
    ratio = next(m for m in metrics.recorded if m.name == "onebit.final_loss_ratio")
    assert ratio.value == pytest.approx(0.0049 / 0.0038, rel=0.05)


@pytest.mark.parametrize("defect, message", [
    ("compressed ends 4x the baseline", r"ratio 3\.\d+ beyond 1 \+ rtol = 2.5"),
    ("never compressed", "did not train in the compressed stage"),
    ("one step compressed nothing", r"rank 0: 1 of 160 steps .* \(step 120: 0\)"),
    ("a parameter never compressed", r"rank 1: 160 of 160 steps from step 40 on compressed "
                                     r"fewer than the model's 2632 parameter elements "
                                     r"\(step 40: 2568"),
    ("a step not counted", "199 steps counted, 200 run"),
    ("baseline does not learn", "did not learn the task"),
    ("compressed stage stalls", "stopped learning in the compressed stage"),
    ("replicas differ", "replicas hold different weights"),
    ("loss becomes NaN", "loss not finite from step 150"),
])
def test_convergence_check_goes_red(defect, message, runs, metrics):
    c = runs["compressed"][0]
    if defect == "compressed ends 4x the baseline":
        c["losses"] = decay(2.2, 4 * 0.0038, suite.STEPS)
    elif defect == "never compressed":
        c["stage"] = {**c["stage"], "compressed": False, "backward_allreduce": True}
    elif defect == "one step compressed nothing":
        c["compressed_elements"] = list(c["compressed_elements"])
        c["compressed_elements"][120] = 0
    elif defect == "a parameter never compressed":  # fc1.bias: 64 elements missing
        runs["compressed"] = [c, {**c, "compressed_elements": [
            e - 64 if e else 0 for e in c["compressed_elements"]]}]
    elif defect == "a step not counted":
        c["compressed_elements"] = c["compressed_elements"][1:]
    elif defect == "baseline does not learn":
        runs["baseline"] = [rank_result(decay(2.2, 0.5, suite.STEPS), False)] * 2
    elif defect == "compressed stage stalls":  # 0.05 at the freeze, 0.03 from then on
        c["losses"] = (decay(2.2, 0.05, suite.FREEZE_STEP)
                       + [0.03] * (suite.STEPS - suite.FREEZE_STEP))
        runs["baseline"] = [rank_result(decay(2.2, 0.03, suite.STEPS), False)] * 2
    elif defect == "replicas differ":
        runs["compressed"] = [c, {**c, "weights": WEIGHTS + 1e-6}]
    elif defect == "loss becomes NaN":
        c["losses"][150:] = [math.nan] * (suite.STEPS - 150)
    with pytest.raises(AssertionError, match=message):
        converge(metrics)


# ---------------------------------------------------------------- resume

def resume_result(**changes):
    """One rank's train_save_resume result as the CPU stand-in measured 1-bit Adam's."""
    left = suite.STEPS - suite.SAVE_AT
    whole = decay(2.2, 0.0049, suite.STEPS)
    result = {
        "uninterrupted": {"losses": whole, "seconds": [0.001] * suite.STEPS,
                          "weights": WEIGHTS.clone(), "errors_end": {"count": 8, "max_abs": 0.01}},
        "resumed": {"losses": decay(whole[suite.SAVE_AT], 0.0045, left),
                    "seconds": [0.001] * left, "weights": WEIGHTS.clone(),
                    "errors_end": {"count": 8, "max_abs": 0.01},
                    "stage_end": {"optimizer_class": "OnebitAdam", "compressed": True,
                                  "backward_allreduce": False},
                    "compressed_calls": 316, "compressed_elements": elements(left, 2),
                    "param_elements": PARAMS},
        "weights_at_save": WEIGHTS.clone(), "weights_after_load": WEIGHTS.clone(),
        "errors_at_save": {"count": 8, "max_abs": 0.02},
        "stage_at_save": {"optimizer_class": "OnebitAdam", "compressed": True,
                          "backward_allreduce": False},
        "errors_after_load": {"count": 0, "max_abs": 0.0},
        "stage_after_load": {"optimizer_class": "OnebitAdam", "compressed": True,
                             "backward_allreduce": False},
        "step_after_load": suite.SAVE_AT, "loaded": True}
    for key, value in changes.items():
        where, _, field = key.partition("__")
        if field:
            result[where] = {**result[where], field: value}
        else:
            result[key] = value
    return result


def after_load(second, last):
    """A resumed curve whose first loss is the saved weights' (as it must be), then
    ``second`` falling to ``last``."""
    whole = decay(2.2, 0.0049, suite.STEPS)
    return [whole[suite.SAVE_AT]] + decay(second, last, suite.STEPS - suite.SAVE_AT - 1)


@pytest.fixture
def resumed(monkeypatch):
    box = {"ranks": [resume_result(), resume_result()]}
    monkeypatch.setattr(suite, "resume", lambda run, scratch: box["ranks"])
    monkeypatch.setattr(suite, "need_cupy", lambda profile: None)
    return box


def run_resume_tests(metrics, tmp_path):
    for test in (suite.test_resume_in_compressed_stage, suite.test_resume_keeps_converging,
                 suite.test_replicas_agree_after_resume):
        test("onebit_adam", "fp32", PROFILE, tmp_path, metrics)


def test_resume_checks_pass_as_measured(resumed, metrics, tmp_path):
    run_resume_tests(metrics, tmp_path)


@pytest.mark.parametrize("changes, message", [
    (dict(errors_after_load={"count": 8, "max_abs": 0.02}),
     "still holds 8 error buffers .* documents that a load resets the worker and server errors"),
    (dict(stage_after_load__backward_allreduce=True), "the compressed stage must continue"),
    (dict(errors_at_save={"count": 0, "max_abs": 0.0}), "not compressing with live errors"),
    (dict(resumed__compressed_elements=elements(suite.STEPS - suite.SAVE_AT, 3)),
     r"did not compress again .* rank 0: 1 of 78 steps from step 2 on .* \(step 2: 0\)"),
    (dict(weights_after_load=WEIGHTS + 1e-3),
     "rank 0's weights after load_checkpoint differ from the weights rank 0 saved at step 120"),
    (dict(resumed__losses=decay(decay(2.2, 0.0049, suite.STEPS)[suite.SAVE_AT - 1], 0.0045,
                                suite.STEPS - suite.SAVE_AT)),
     "rank 0's first loss after the resume is .* at step 120, on the same weights and batch"),
    (dict(loaded=False), "found no checkpoint"),
    (dict(resumed__losses=after_load(0.07, 0.09)), "it must keep converging"),
    (dict(resumed__losses=after_load(0.012, 0.009)),
     "resumed final loss .* beyond 1 \\+ rtol = 1.5"),
])
def test_resume_checks_go_red(changes, message, resumed, metrics, tmp_path):
    resumed["ranks"] = [resume_result(**changes), resume_result(**changes)]
    with pytest.raises(AssertionError, match=message):
        run_resume_tests(metrics, tmp_path)


def test_replica_check_after_resume_goes_red(resumed, metrics, tmp_path):
    """What DS-ONEBIT-RESUME-LOCAL-STEP looks like: replicas apart after the resume only."""
    apart = resume_result(resumed__weights=WEIGHTS + 4.6e-3)
    resumed["ranks"] = [resume_result(), apart]
    with pytest.raises(AssertionError, match="resumed at step 120: the two data-parallel "
                                             "replicas hold different weights"):
        run_resume_tests(metrics, tmp_path)


# ---------------------------------------------------------------- cupy, in the parent

def test_missing_cupy_skips_unless_promised(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "cupy" else real(name, *a))
    with pytest.raises(pytest.skip.Exception, match=r"Requires: \[cupy \(found none\)\]"):
        suite.need_cupy(PROFILE)
    promises = Profile(name="p", source="t", gpu_count=2, onebit=("ZeroOneAdam",))
    with pytest.raises(pytest.fail.Exception,
                       match=r"profile p promises \[ZeroOneAdam\]: expected cupy .* found none"):
        suite.need_cupy(promises)


def test_lamb_convergence_bound_is_below_its_baseline():
    """1-bit LAMB ends near 0.1x its uncompressed baseline (2xH200 fp16 0.104; stand-in
    0.07-0.17): a run at 0.6x, six times worse, MUST fail; one at 0.3x passes. 1-bit Adam's
    fp16 bound holds 1.64 (measured) and fails 3.2."""
    from dsconform.checks.tolerances import tolerance
    from suites.test_onebit import within_ratio

    for dtype in ("fp32", "fp16"):
        tol = tolerance("onebit_convergence", dtype, "onebit_lamb", accelerator="cuda")
        assert within_ratio(0.3, 1.0, tol) and not within_ratio(0.6, 1.0, tol), (dtype, tol)
    tol = tolerance("onebit_convergence", "fp16", "onebit_adam", accelerator="cuda")
    assert within_ratio(1.64, 1.0, tol) and not within_ratio(3.2, 1.0, tol), tol


# ---------------------------------------------------------------- the byte count, on gloo

def test_wire_count_sees_torch_distributed_whoever_calls_it():
    """ONEBIT-COMM-1's byte count sits on torch.distributed: a collective called straight on
    torch.distributed (which a count on deepspeed.comm alone never saw) is counted like one
    through deepspeed.comm, and an object collective it has no bus factor for is named."""
    from dsconform.harness import api as dist
    from tests import rank_fns

    results = dist.run_ranks(rank_fns.wire_count, 2, timeout_s=120, accelerator="cpu")
    for r in results:
        assert r["bytes"] == 4000 + 1000, r
        assert r["calls"] == {"all_reduce": 1, "all_gather": 1} and not r["uncounted"], r
        assert r["object_calls"] == {"all_gather_object": 1}, r  # its inner all_gather: once
        assert r["object_uncounted"] == ["all_gather_object"], r
        assert r["restored"], r
