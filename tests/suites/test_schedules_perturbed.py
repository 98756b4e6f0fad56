"""The scheduler suite's checks MUST go red when DeepSpeed's schedule is off by one step, or a
resume drops the scheduler's state.

Each test runs the suite's own rank code (suites/schedule_ranks.py) and judgement
(suites/test_schedules.py) on real DeepSpeed engines (the CPU accelerator, gloo), first as they
are (the control: no problem) and then perturbed on the real path:

- ``shift=1``: right after ``deepspeed.initialize`` DeepSpeed's own scheduler takes one extra
  ``step()``, so every training step runs at the next step's lr. SCHED-LR-1..4 MUST fail at the
  first iteration where the curve moves, naming it and both values;
- ``load_scheduler=False``: the resume loads the checkpoint with
  ``load_lr_scheduler_states=False``. SCHED-RESUME-1 MUST fail: the scheduler starts over at
  iteration -1 and the next step leaves the curve.
Nothing is mocked: DeepSpeed builds, steps, saves and loads the schedulers.
"""

from __future__ import annotations

import re

import pytest

from dsconform.checks import schedules
from dsconform.checks.tolerances import tolerance
from suites.test_schedules import RESUME_BASE_LR, RESUME_CASES, run_lr_check, run_resume

BASE_LR = RESUME_BASE_LR
CASES = {
    "WarmupLR": (schedules.WarmupLR(warmup_min_lr=1e-4, warmup_max_lr=0.01, warmup_num_steps=6,
                                    warmup_type="log"), 0),
    "WarmupDecayLR": (schedules.WarmupDecayLR(warmup_min_lr=0.0, warmup_max_lr=0.01,
                                              warmup_num_steps=3, warmup_type="linear",
                                              total_num_steps=9), 2),
    "WarmupCosineLR": (schedules.WarmupCosineLR(total_num_steps=10, warmup_min_ratio=0.2,
                                                warmup_num_steps=3, cos_min_ratio=0.1,
                                                warmup_type="linear"), 3),
    "OneCycle": (schedules.OneCycle(cycle_min_lr=1e-4, cycle_max_lr=0.01,
                                    cycle_first_step_size=3, cycle_second_step_size=4), 1),
}


def _first_moving_iteration(schedule) -> int:
    """The first iteration whose lr differs from the next one's beyond the suite's bound: where
    a schedule one step ahead must first be seen."""
    bound = tolerance("schedule", "fp32", "sgd", accelerator="cpu").atol * \
        schedule.peak(BASE_LR)
    i = -1
    while abs(schedule.lr_at(i + 1, BASE_LR) - schedule.lr_at(i, BASE_LR)) <= bound:
        i += 1
    return i


@pytest.mark.parametrize("name", sorted(CASES))
def test_schedule_one_step_ahead_fails(name):
    schedule, stage = CASES[name]
    assert run_lr_check(schedule, stage, BASE_LR, "cpu") == []  # the control
    problems = run_lr_check(schedule, stage, BASE_LR, "cpu", shift=1)
    assert problems, f"{name} one step ahead passed the check"
    i = _first_moving_iteration(schedule)
    text = "\n".join(problems)
    # The lr held, the scheduler's own and the applied lr all leave the curve there; what the
    # param group holds is the model's lr of the next iteration (to DeepSpeed's rounding).
    held = re.search(rf"iteration {i} \(the lr of step {i + 1}\): the lr the param group holds "
                     rf"is (\S+), the model {re.escape(repr(schedule.lr_at(i, BASE_LR)))} "
                     rf"\(difference ", text)
    assert held, text
    assert float(held.group(1)) == pytest.approx(schedule.lr_at(i + 1, BASE_LR), rel=1e-12)
    assert "the scheduler's get_last_lr()" in text and "the lr the SGD step applied" in text
    assert f"ZeRO stage {stage}" in text


@pytest.mark.parametrize("name", sorted(RESUME_CASES))
def test_resume_without_the_scheduler_state_fails(name, tmp_path):
    schedule, _, save_at, _ = RESUME_CASES[name]
    assert run_resume(name, "cpu", 2, str(tmp_path / "control")) == []  # the control
    problems = run_resume(name, "cpu", 2, str(tmp_path / "ckpt"), load_scheduler=False)
    text = "\n".join(problems)
    assert f"after load_checkpoint the scheduler is at iteration -1; it was saved at " \
           f"{save_at - 1}" in text, text
    # The first resumed step still runs at the restored param group's lr; the scheduler's next
    # step then restarts the curve: the lr before step save_at + 1 is iteration 0's.
    restarted = re.search(rf"iteration {save_at} \(the lr of step {save_at + 1}\): the lr the "
                          rf"param group holds is (\S+), the model ", text)
    assert restarted, text
    assert float(restarted.group(1)) == pytest.approx(schedule.lr_at(0, BASE_LR), rel=1e-12)
    assert f"step {save_at + 1} runs at" in text and "uninterrupted" in text
