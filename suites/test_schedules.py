"""Learning-rate schedules: every DeepSpeed scheduler, configured through the config's
``"scheduler"`` section as users write it, MUST set at every step the learning rate its
documentation gives, and MUST continue on the same curve after a checkpoint resume.

- The lr at every step (SCHED-LR-1 WarmupLR, SCHED-LR-2 WarmupDecayLR, SCHED-LR-3
  WarmupCosineLR, SCHED-LR-4 OneCycle). A one-weight model whose gradient is exactly 1 trains
  under plain SGD (fp32, ZeRO stage 0-3, one rank). Before every step and after the last one, the
  lr the optimizer's param group holds MUST be the model's (``dsconform/checks/schedules.py``:
  training step k runs at the scheduler's lr of iteration k - 1), the scheduler's
  ``get_last_lr()`` MUST say the same, and the lr the step applied (the weight's change) MUST be
  it too. Parameters are drawn by hypothesis in the parent (warmup steps, min/max lr, warmup_type
  log and linear, total steps, cosine ratios, cycle halves, stairs, decay) and each run goes past
  every boundary of its schedule (the last warmup step and the next, the end of the decay, the
  cycle's turn and end); explicit examples pin the corners (a warmup of 1 step, which DeepSpeed
  stretches to 2; total steps below the warmup; a cycle without a falling half).
- Resume (SCHED-RESUME-1): mid-schedule, ``save_checkpoint`` into the test's scratch directory;
  a second engine, from another weight and a fresh scheduler, ``load_checkpoint``s it and trains
  on. Right after the load its scheduler MUST be at the saved iteration and its param group at the
  saved lr, and every step after MUST run at the model's lr, equal to the uninterrupted run's
  (2 ranks on the CPU accelerator, every GPU on CUDA).

Tolerances: ``dsconform/checks/tolerances.py`` "schedule", "schedule_applied" and
"schedule_resume".

Upstream: https://deepspeed.readthedocs.io/en/latest/schedulers.html ,
https://www.deepspeed.ai/docs/config-json/#scheduler-parameters ,
https://github.com/deepspeedai/DeepSpeed/blob/master/deepspeed/runtime/lr_schedules.py .

Stable ids: SCHED-LR-1..4 (one per scheduler), SCHED-RESUME-1; each case id
(``cpu-WarmupCosineLR``) names its cell and does not change.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from dsconform.suite import (
    ACCELERATORS,
    accel_cell,
    accel_params,
    run_ranks,
    schedules,
    tolerance,
)
from suites import schedule_ranks

CAPABILITY = "schedules"
TIMEOUT_S = 300  # per call; an engine of one weight takes about a second

STAGES = st.sampled_from([0, 1, 2, 3])
# The optimizer's own lr: WarmupCosineLR scales it, the others overwrite it when built.
BASE_LRS = st.floats(min_value=1e-4, max_value=0.1, allow_nan=False, allow_infinity=False)
LOW_LRS = st.one_of(st.just(0.0), st.floats(min_value=1e-6, max_value=1e-2, allow_nan=False))
HIGH_LRS = st.floats(min_value=1e-4, max_value=0.1, allow_nan=False, allow_infinity=False)
RATIOS = st.floats(min_value=0.0, max_value=1.0, allow_nan=False, allow_infinity=False)
WARMUP_STEPS = st.integers(min_value=1, max_value=24)
WARMUP_TYPES = st.sampled_from(["log", "linear"])


@st.composite
def warmup_lr(draw: st.DrawFn) -> Any:
    return schedules.WarmupLR(warmup_min_lr=draw(LOW_LRS), warmup_max_lr=draw(HIGH_LRS),
                              warmup_num_steps=draw(WARMUP_STEPS),
                              warmup_type=draw(WARMUP_TYPES))


@st.composite
def warmup_decay_lr(draw: st.DrawFn) -> Any:
    warmup = draw(WARMUP_STEPS)
    return schedules.WarmupDecayLR(warmup_min_lr=draw(LOW_LRS), warmup_max_lr=draw(HIGH_LRS),
                                   warmup_num_steps=warmup, warmup_type=draw(WARMUP_TYPES),
                                   total_num_steps=draw(st.integers(1, warmup + 24)))


@st.composite
def warmup_cosine_lr(draw: st.DrawFn) -> Any:
    warmup = draw(WARMUP_STEPS)
    return schedules.WarmupCosineLR(total_num_steps=draw(st.integers(1, warmup + 24)),
                                    warmup_min_ratio=draw(RATIOS), warmup_num_steps=warmup,
                                    cos_min_ratio=draw(RATIOS), warmup_type=draw(WARMUP_TYPES))


@st.composite
def one_cycle(draw: st.DrawFn) -> Any:
    stairs = st.one_of(st.just(0), st.integers(1, 4))
    return schedules.OneCycle(
        cycle_min_lr=draw(LOW_LRS), cycle_max_lr=draw(HIGH_LRS),
        decay_lr_rate=draw(st.one_of(st.just(0.0), st.floats(0.01, 1.0, allow_nan=False))),
        cycle_first_step_size=draw(st.integers(1, 16)),
        cycle_second_step_size=draw(st.one_of(st.none(), st.integers(0, 16))),
        cycle_first_stair_count=draw(stairs),
        cycle_second_stair_count=draw(st.one_of(st.none(), stairs)),
        decay_step_size=draw(st.integers(0, 4)))


# ---------------------------------------------------------------------------------------------
# SCHED-LR-1..4: the lr at every step against the model
# ---------------------------------------------------------------------------------------------

def _values(found: float, expected: float) -> str:
    return f"{found!r}, the model {expected!r} (difference {found - expected:+.3e})"


def check_lr_trace(schedule: Any, base_lr: float, trace: dict[str, Any], accelerator: str, *,
                   first_step: int = 0, last_from: int = 0, where: str = "") -> list[str]:
    """One rank's trace of training steps ``first_step``... against the model, under the table's
    "schedule" (the lr held) and "schedule_applied" (the lr a step applied) entries. One line per
    problem; each lr list is judged up to its first divergence (later ones follow from it).
    ``last_from``: the first entries of ``get_last_lr()`` not judged."""
    held_tol = tolerance("schedule", "fp32", "sgd", accelerator=accelerator)
    applied_tol = tolerance("schedule_applied", "fp32", "sgd", accelerator=accelerator)
    head = f"{schedule!r}{where}"
    problems = []
    if trace.get("scheduler") is not None and trace["scheduler"] != schedule.type:
        problems.append(f"{head}: the engine built {trace['scheduler']}, the config says "
                        f"{schedule.type}")
    # (list, what it is, tolerance, leading entries not judged)
    checks = (("held", "the lr the param group holds", held_tol, 0),
              ("scheduler_last", "the scheduler's get_last_lr()", held_tol, last_from),
              ("applied", "the lr the SGD step applied", applied_tol, 0))
    for key, what, tol, skip in checks:
        values = trace[key]
        if key == "scheduler_last" and skip == 0 and values and values[0] is None:
            skip = 1  # OneCycle has no last lr before its first step
        if any(v is None for v in values[skip:]):
            problems.append(f"{head}: {what} failed after step "
                            f"{first_step + values.index(None, skip) - 1}")
            continue
        found = schedules.first_divergence(values[skip:], schedule, base_lr, tol.atol,
                                           first_iteration=first_step - 1 + skip)
        if found is not None:
            iteration, lr, expected = found
            problems.append(
                f"{head}: iteration {iteration} (the lr of step {iteration + 1}): {what} is "
                f"{_values(lr, expected)}; tolerance {tol.atol:g} x the peak lr "
                f"{schedule.peak(base_lr)!r} ({tol.why})")
    return problems


def run_lr_check(schedule: Any, stage: int, base_lr: float, accelerator: str,
                 shift: int = 0) -> list[str]:
    """Train past every boundary of ``schedule`` on one rank and judge the trace."""
    steps = schedules.steps_to_cover(schedule)
    trace = run_ranks(schedule_ranks.lr_trace, 1, timeout_s=TIMEOUT_S,
                      args=(schedule, stage, steps, base_lr), kwargs={"shift": shift},
                      accelerator=accelerator)[0]
    return check_lr_trace(schedule, base_lr, trace, accelerator,
                          where=f" on ZeRO stage {stage}, optimizer lr {base_lr!r}")


ACCEL = accel_params(1)


@pytest.mark.parametrize("accelerator", ACCEL)
@given(schedule=warmup_lr(), stage=STAGES, base_lr=BASE_LRS)
@example(schedule=schedules.WarmupLR(warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=1,
                                     warmup_type="log"), stage=0, base_lr=0.05)
@example(schedule=schedules.WarmupLR(warmup_min_lr=1e-3, warmup_max_lr=1e-4, warmup_num_steps=5,
                                     warmup_type="linear"), stage=3, base_lr=0.05)
def test_warmup_lr(accelerator: str, schedule: Any, stage: int, base_lr: float):
    """SCHED-LR-1: WarmupLR MUST set the documented lr at every step, warmup and after."""
    problems = run_lr_check(schedule, stage, base_lr, accelerator)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("accelerator", ACCEL)
@given(schedule=warmup_decay_lr(), stage=STAGES, base_lr=BASE_LRS)
@example(schedule=schedules.WarmupDecayLR(warmup_min_lr=1e-4, warmup_max_lr=0.01,
                                          warmup_num_steps=4, warmup_type="linear",
                                          total_num_steps=4), stage=1, base_lr=0.05)
@example(schedule=schedules.WarmupDecayLR(warmup_min_lr=0.0, warmup_max_lr=0.01,
                                          warmup_num_steps=6, warmup_type="log",
                                          total_num_steps=3), stage=2, base_lr=0.05)
def test_warmup_decay_lr(accelerator: str, schedule: Any, stage: int, base_lr: float):
    """SCHED-LR-2: WarmupDecayLR MUST set the documented lr at every step, to the end and past."""
    problems = run_lr_check(schedule, stage, base_lr, accelerator)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("accelerator", ACCEL)
@given(schedule=warmup_cosine_lr(), stage=STAGES, base_lr=BASE_LRS)
@example(schedule=schedules.WarmupCosineLR(total_num_steps=10, warmup_min_ratio=0.1,
                                           warmup_num_steps=1, cos_min_ratio=0.0,
                                           warmup_type="linear"), stage=0, base_lr=0.05)
@example(schedule=schedules.WarmupCosineLR(total_num_steps=2, warmup_min_ratio=0.0,
                                           warmup_num_steps=4, cos_min_ratio=0.5,
                                           warmup_type="log"), stage=3, base_lr=0.05)
def test_warmup_cosine_lr(accelerator: str, schedule: Any, stage: int, base_lr: float):
    """SCHED-LR-3: WarmupCosineLR MUST scale the optimizer's lr by the documented ratio."""
    problems = run_lr_check(schedule, stage, base_lr, accelerator)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("accelerator", ACCEL)
@given(schedule=one_cycle(), stage=STAGES, base_lr=BASE_LRS)
@example(schedule=schedules.OneCycle(cycle_min_lr=1e-4, cycle_max_lr=0.01, decay_lr_rate=0.5,
                                     cycle_first_step_size=3, cycle_second_step_size=5,
                                     decay_step_size=2), stage=2, base_lr=0.05)
@example(schedule=schedules.OneCycle(cycle_min_lr=1e-4, cycle_max_lr=0.01,
                                     cycle_first_step_size=4, cycle_second_step_size=0,
                                     cycle_first_stair_count=4), stage=0, base_lr=0.05)
@example(schedule=schedules.OneCycle(cycle_min_lr=0.0, cycle_max_lr=0.01,
                                     cycle_first_step_size=6, cycle_first_stair_count=3,
                                     cycle_second_stair_count=2, decay_lr_rate=0.1,
                                     decay_step_size=1), stage=1, base_lr=0.05)
def test_one_cycle(accelerator: str, schedule: Any, stage: int, base_lr: float):
    """SCHED-LR-4: OneCycle MUST cycle and decay the lr as documented at every step."""
    problems = run_lr_check(schedule, stage, base_lr, accelerator)
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------------
# SCHED-RESUME-1: the same curve after a checkpoint resume
# ---------------------------------------------------------------------------------------------

# (schedule, ZeRO stage, the step before which it saves, steps in all): each save falls where the
# lr moves (inside the warmup, the decay, the cosine, the cycle's falling half) and each run
# goes on past the schedule's later boundaries.
RESUME_CASES = {
    "WarmupLR": (schedules.WarmupLR(warmup_min_lr=1e-4, warmup_max_lr=0.01, warmup_num_steps=8,
                                    warmup_type="log"), 1, 4, 12),
    "WarmupDecayLR": (schedules.WarmupDecayLR(warmup_min_lr=1e-4, warmup_max_lr=0.01,
                                              warmup_num_steps=4, warmup_type="linear",
                                              total_num_steps=12), 2, 7, 15),
    "WarmupCosineLR": (schedules.WarmupCosineLR(total_num_steps=12, warmup_min_ratio=0.1,
                                                warmup_num_steps=4, cos_min_ratio=0.05,
                                                warmup_type="linear"), 3, 6, 15),
    "OneCycle": (schedules.OneCycle(cycle_min_lr=1e-4, cycle_max_lr=0.01, decay_lr_rate=0.5,
                                    cycle_first_step_size=4, cycle_second_step_size=6,
                                    decay_step_size=2), 0, 6, 16),
}
RESUME_BASE_LR = 0.05


def _resume_params() -> list:
    """accel x scheduler: 2 ranks on the CPU accelerator, every GPU (one or more) on CUDA."""
    return [accel_cell(accel, name, id=name, world_size=2 if accel == "cpu" else 1)
            for accel in ACCELERATORS for name in RESUME_CASES]


def check_resume(name: str, results: list[dict[str, Any]], accelerator: str) -> list[str]:
    """Every rank's uninterrupted and resumed runs against the model, and against each other."""
    schedule, stage, save_at, steps = RESUME_CASES[name]
    exact = tolerance("schedule_resume", "fp32", "sgd", accelerator=accelerator)
    problems = []
    for r, res in enumerate(results):
        where = f" on ZeRO stage {stage}, rank {r} of {len(results)}"
        problems += check_lr_trace(schedule, RESUME_BASE_LR, res["uninterrupted"], accelerator,
                                   where=f"{where}, the uninterrupted run")
        loaded = res["loaded"]["iteration"]
        if res["loaded"]["scheduler"] != schedule.type:
            problems.append(f"{schedule!r}{where}: the resumed engine built "
                            f"{res['loaded']['scheduler']}, the config says {schedule.type}")
        if res["fresh"]["iteration"] != -1:
            problems.append(f"{schedule!r}{where}: a freshly built scheduler is at iteration "
                            f"{res['fresh']['iteration']}, expected -1")
        if loaded != save_at - 1:
            problems.append(f"{schedule!r}{where}: after load_checkpoint the scheduler is at "
                            f"iteration {loaded}; it was saved at {save_at - 1} (after "
                            f"{save_at} steps)")
        if res["global_steps"] != steps:
            problems.append(f"{schedule!r}{where}: the resumed engine counts "
                            f"{res['global_steps']} steps, expected {steps}")
        resumed = res["resumed"]
        # get_last_lr() before the first resumed step is still the fresh scheduler's: a load
        # restores the iteration and the param group's lr, not the scheduler's last lr.
        problems += check_lr_trace(schedule, RESUME_BASE_LR, resumed, accelerator,
                                   first_step=save_at, last_from=1,
                                   where=f"{where}, resumed after step {save_at - 1}")
        # held[j] is the lr before step save_at + j; uninterrupted["held"] starts at step 0.
        before = res["uninterrupted"]["held"][save_at:]
        for j, (a, b) in enumerate(zip(resumed["held"], before)):
            if not abs(a - b) <= exact.atol:
                problems.append(f"{schedule!r}{where}: step {save_at + j} runs at {a!r} after "
                                f"the resume, at {b!r} uninterrupted (difference {a - b:+.3e}); "
                                f"tolerance {exact} ({exact.why})")
                break
    return problems


def run_resume(name: str, accelerator: str, world_size: int, ckpt_dir: str,
               load_scheduler: bool = True) -> list[str]:
    schedule, stage, save_at, steps = RESUME_CASES[name]
    results = run_ranks(schedule_ranks.resume_trace, world_size, timeout_s=TIMEOUT_S,
                        args=(schedule, stage, save_at, steps, RESUME_BASE_LR, ckpt_dir),
                        kwargs={"load_scheduler": load_scheduler}, accelerator=accelerator)
    return check_resume(name, results, accelerator)


@pytest.mark.parametrize("accelerator, name", _resume_params())
def test_resume_continues_the_curve(accelerator: str, name: str, scratch, node):
    """SCHED-RESUME-1: a checkpoint resumed mid-schedule MUST continue on the same lr curve."""
    world_size = 2 if accelerator == "cpu" else node.gpu_count
    problems = run_resume(name, accelerator, world_size, str(scratch / "ckpt"))
    assert not problems, "\n".join(problems)
