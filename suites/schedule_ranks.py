"""Code that runs inside the ranks of suites/test_schedules.py.

An engine is built from a config whose ``"scheduler"`` section is written as a user writes it
(``ds_config(scheduler=...)``) and trains a model of one weight ``w`` whose loss is ``w`` itself:
its gradient is exactly 1 on every rank, so plain SGD (no momentum, no weight decay, no clipping)
moves ``w`` by exactly the lr the optimizer applied, up to fp32 rounding. Per step the ranks
return the lr the optimizer's param group holds before the step (``engine.get_lr()``, what the
scheduler set), the scheduler's own ``get_last_lr()``, and the applied lr read off the weight
(the fp32 master on ZeRO 1-3). Everything is plain floats.

Fault injection for the project's red tests, off by default: ``shift=n`` steps the scheduler n
extra times right after ``deepspeed.initialize`` (the schedule runs n steps ahead of training);
``load_scheduler=False`` loads a checkpoint without the scheduler's state
(``load_lr_scheduler_states=False``).

Ranks are pooled and reused: every call re-seeds and destroys its engines before returning.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import torch
from torch import nn

from dsconform.suite import device, ds_config, seed_everything, world


class OneWeight(nn.Module):
    """loss = w: d loss / d w = 1, so an SGD step moves w by exactly -lr."""

    def __init__(self, start: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((1,), start))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum()


def _engine(schedule: Any, stage: int, base_lr: float, start: float) -> Any:
    import deepspeed

    seed_everything(0)
    model = OneWeight(start).to(device())
    config = ds_config(stage=stage, dtype="fp32", optimizer="sgd", lr=base_lr, micro_batch=1,
                       grad_accum=1, world_size=world(), scheduler=schedule)
    # WarmupLR and WarmupCosineLR log a warning when built (they read the lr of iteration -1).
    ds_logger = logging.getLogger("DeepSpeed")
    level = ds_logger.level
    ds_logger.setLevel(logging.ERROR)
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=config)
    finally:
        ds_logger.setLevel(level)
    return engine


def _weight(engine: Any) -> float:
    """The weight the optimizer steps: the fp32 master on ZeRO 1-3, the module's on stage 0."""
    from deepspeed.utils import safe_get_full_fp32_param

    w = engine.module.w
    master = safe_get_full_fp32_param(w)
    return float((w.data if master is None else master).detach().float().cpu()[0])


def _lr(engine: Any) -> float:
    return float(engine.get_lr()[0])


def _last_lr(engine: Any) -> float | None:
    """The scheduler's get_last_lr(); None where it has none yet (OneCycle sets it on its first
    step only, and asserts before)."""
    try:
        return float(engine.lr_scheduler.get_last_lr()[0])
    except AssertionError:
        return None


def _train(engine: Any, steps: int) -> dict[str, list[float]]:
    """``steps`` steps: per step the lr held before it, the scheduler's last lr and the lr the
    step applied; then the lr held after the last one."""
    x = torch.ones(1, device=device())
    held, last, applied = [], [], []
    for _ in range(steps):
        held.append(_lr(engine))
        last.append(_last_lr(engine))
        before = _weight(engine)
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        applied.append(before - _weight(engine))
    held.append(_lr(engine))
    last.append(_last_lr(engine))
    return {"held": held, "scheduler_last": last, "applied": applied}


def _describe(engine: Any) -> dict[str, Any]:
    sched = engine.lr_scheduler
    return {"scheduler": None if sched is None else type(sched).__name__,
            "iteration": None if sched is None else sched.last_batch_iteration,
            "optimizer": type(engine.optimizer).__name__}


def lr_trace(schedule: Any, stage: int, steps: int, base_lr: float,
             shift: int = 0) -> dict[str, Any]:
    """Rank entry point: ``steps`` steps of the engine ``schedule`` configures."""
    engine = _engine(schedule, stage, base_lr, start=0.0)
    try:
        for _ in range(shift):  # fault injection (red tests): the schedule runs ahead
            engine.lr_scheduler.step()
        built = _describe(engine)
        trace = _train(engine, steps)
        return {**built, **trace, "iteration_after": engine.lr_scheduler.last_batch_iteration}
    finally:
        engine.destroy()
        del engine
        gc.collect()


def resume_trace(schedule: Any, stage: int, save_at: int, steps: int, base_lr: float,
                 ckpt_dir: str, load_scheduler: bool = True) -> dict[str, Any]:
    """Rank entry point: ``save_at`` steps, ``save_checkpoint`` into ``ckpt_dir`` (tag "mid"),
    on to ``steps`` (the uninterrupted run); then a second engine from another starting weight
    and a fresh scheduler loads "mid" and trains the remaining ``steps - save_at`` steps."""
    first = _engine(schedule, stage, base_lr, start=0.0)
    try:
        before = _train(first, save_at)
        first.save_checkpoint(ckpt_dir, tag="mid")
        after = _train(first, steps - save_at)
        uninterrupted = {k: before[k][:-1] + after[k] if k != "applied" else before[k] + after[k]
                         for k in before}
    finally:
        first.destroy()
        del first
        gc.collect()
    second = _engine(schedule, stage, base_lr, start=1.0)
    try:
        fresh = _describe(second)
        path, _ = second.load_checkpoint(ckpt_dir, tag="mid",
                                         load_lr_scheduler_states=load_scheduler)
        loaded = _describe(second)
        resumed = _train(second, steps - save_at)
        return {"uninterrupted": uninterrupted, "resumed": resumed, "fresh": fresh,
                "loaded": loaded, "load_path": path, "global_steps": second.global_steps}
    finally:
        second.destroy()
        del second
        gc.collect()
