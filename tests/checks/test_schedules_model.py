"""dsconform/checks/schedules.py: the model of DeepSpeed's learning-rate schedules against
DeepSpeed's own scheduler classes, stepped on a torch optimizer (no engine, no ranks), and the
``scheduler`` argument of ``ds_config``.

The suite (suites/test_schedules.py) checks the same through real engines; this keeps the model
honest at a thousandth of the cost, over the suite's own strategies, and shows that a model one
step off (the red case) leaves DeepSpeed's curve.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsconform.checks import schedules
from dsconform.checks.dsconfig import ds_config
from dsconform.checks.tolerances import tolerance
from suites.test_schedules import one_cycle, warmup_cosine_lr, warmup_decay_lr, warmup_lr

BASE = dict(stage=0, dtype="fp32", optimizer="sgd", lr=0.05, micro_batch=1, grad_accum=1,
            world_size=1)
ATOL = tolerance("schedule", "fp32", "sgd", accelerator="cpu").atol


def deepspeed_lrs(schedule, base_lr: float, iterations: int) -> list[float]:
    """DeepSpeed's scheduler class built from the section's params on a torch SGD optimizer:
    the lr it sets as built (iteration -1) and after each of ``iterations`` steps."""
    from deepspeed.runtime import lr_schedules

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base_lr)
    section = ds_config(**{**BASE, "lr": base_lr}, scheduler=schedule)["scheduler"]
    sched = getattr(lr_schedules, section["type"])(opt, **section["params"])
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(iterations):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


@settings(max_examples=200, deadline=None)
@given(schedule=st.one_of(warmup_lr(), warmup_decay_lr(), warmup_cosine_lr(), one_cycle()),
       base_lr=st.floats(1e-4, 0.1))
def test_model_follows_deepspeeds_classes(schedule, base_lr):
    steps = schedules.steps_to_cover(schedule)
    found = deepspeed_lrs(schedule, base_lr, steps)
    assert schedules.first_divergence(found, schedule, base_lr, ATOL) is None


def test_a_model_one_step_off_leaves_the_curve():
    schedule = schedules.WarmupLR(warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=4,
                                  warmup_type="linear")
    ahead = deepspeed_lrs(schedule, 0.05, 8)[1:]  # DeepSpeed's lrs from iteration 0 on
    assert schedules.first_divergence(ahead, schedule, 0.05, ATOL) == (0, 0.0025, 0.0)


def test_boundaries_and_steps_to_cover():
    assert schedules.WarmupLR(warmup_num_steps=1).boundaries() == (1, 2)  # stretched to 2
    decay = schedules.WarmupDecayLR(warmup_num_steps=5, total_num_steps=3)
    assert decay.boundaries() == (2, 3, 4, 5)
    cycle = schedules.OneCycle(cycle_first_step_size=3, cycle_second_step_size=2,
                               decay_step_size=2)
    assert cycle.boundaries() == (2, 3, 4, 5, 6, 7)
    assert schedules.steps_to_cover(cycle) == 10
    assert schedules.lr_of_step(cycle, 0, 0.05) == cycle.lr_at(-1, 0.05) == cycle.cycle_min_lr


def test_ds_config_writes_the_section_as_users_write_it():
    schedule = schedules.WarmupCosineLR(total_num_steps=10, warmup_num_steps=3)
    cfg = ds_config(**BASE, scheduler=schedule)
    assert cfg["scheduler"] == {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 10, "warmup_min_ratio": 0.0, "warmup_num_steps": 3,
        "cos_min_ratio": 0.0001, "warmup_type": "log"}}
    assert "scheduler" not in ds_config(**BASE)


@pytest.mark.parametrize("changes, match", [
    (dict(scheduler={"type": "WarmupLR"}), r"ds_config\(scheduler=.*must be one of"),
    (dict(scheduler=schedules.WarmupLR(), lr_warmup_steps=3), "lr_warmup_steps=3 adds a "),
])
def test_ds_config_refuses_a_scheduler_it_cannot_write(changes, match):
    with pytest.raises(ValueError, match=match):
        ds_config(**{**BASE, **changes})


@pytest.mark.parametrize("build, match", [
    (lambda: schedules.WarmupLR(warmup_type="cosine"), r"WarmupLR\(warmup_type='cosine'\)"),
    (lambda: schedules.WarmupLR(warmup_num_steps=0), "warmup_num_steps=0.*integer >= 1"),
    (lambda: schedules.WarmupDecayLR(total_num_steps=0), "total_num_steps=0"),
    (lambda: schedules.WarmupCosineLR(cos_min_ratio=1.5), "ratio of the optimizer's lr"),
    (lambda: schedules.OneCycle(cycle_first_step_size=0), "cycle_first_step_size=0"),
    (lambda: schedules.OneCycle(cycle_max_lr=float("nan")), "cycle_max_lr=nan"),
])
def test_schedules_name_the_field_that_is_wrong(build, match):
    with pytest.raises(ValueError, match=match):
        build()
