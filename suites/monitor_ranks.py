"""Code that runs inside the ranks of suites/test_monitor.py.

An engine whose config enables ``csv_monitor`` (and ``tensorboard`` where it is installed) trains
a small regression under WarmupLR (the lr moves every step) with gradient accumulation; every
rank writes under a directory of its own (``<out>/rank<r>/``), so whatever a rank wrote is known
to be that rank's. After every optimizer step the ranks note what the engine holds: its lr
(``get_lr()``), ``global_samples`` (the step index DeepSpeed writes), the fp16 loss scale, and
the step's loss (the mean of this rank's micro-batch losses, what DeepSpeed wrote as
``train_loss`` before 0.18.3). Everything returned is plain numbers and file names.

Fault injection for the project's red tests, off by default: ``late=True`` wraps the engine's
``monitor.write_events`` so that every call writes the previous call's values at the current
call's step indices (a monitor one step late).
"""

from __future__ import annotations

import gc
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dsconform.suite import (
    device,
    ds_config,
    rank,
    read_scaler,
    schedules,
    seed_everything,
    world,
)

SCHEDULE = schedules.WarmupLR(warmup_min_lr=1e-3, warmup_max_lr=0.02, warmup_num_steps=8,
                              warmup_type="linear")


def rank_dirs(out: str, r: int) -> tuple[str, str]:
    """(csv_monitor's output_path, tensorboard's) of rank ``r``."""
    return os.path.join(out, f"rank{r}", "csv"), os.path.join(out, f"rank{r}", "tensorboard")


def _delay_by_one(monitor: Any) -> None:
    """Fault injection: each write carries the previous write's values."""
    original = monitor.write_events
    held: dict[str, Any] = {}

    def late(events, *args, **kwargs):
        shifted = [(name, held.get(name, value), step) for name, value, step in events]
        held.update({name: value for name, value, _ in events})
        return original(shifted, *args, **kwargs)

    monitor.write_events = late


def _files(root: str) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in Path(root).rglob("*") if p.is_file())


def train_logged(dtype: str, stage: int, steps: int, micro_batch: int, grad_accum: int,
                 out: str, tensorboard: bool, late: bool = False) -> dict[str, Any]:
    """Rank entry point: ``steps`` optimizer steps with the monitors on."""
    import deepspeed

    seed_everything(0)
    csv_dir, tb_dir = rank_dirs(out, rank())
    model = nn.Linear(6, 1).to(device())
    config = ds_config(stage=stage, dtype=dtype, optimizer="sgd", lr=0.02,
                       micro_batch=micro_batch, grad_accum=grad_accum, world_size=world(),
                       scheduler=SCHEDULE, csv_monitor_dir=csv_dir,
                       tensorboard_dir=tb_dir if tensorboard else None)
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)  # WarmupLR's warning when built
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    if late:
        _delay_by_one(engine.monitor)
    half = torch.float16 if dtype == "fp16" else torch.float32
    generator = torch.Generator().manual_seed(1 + rank())
    target = torch.randn(6, 1, generator=generator)
    noted = []
    try:
        for _ in range(steps):
            losses = []
            for _ in range(grad_accum):
                x = torch.randn(micro_batch, 6, generator=generator)
                y = x @ target
                pred = engine(x.to(device(), half))
                loss = (pred.float() - y.to(device())).pow(2).mean()
                engine.backward(loss)
                engine.step()
                losses.append(float(loss))
            scale = read_scaler(engine.optimizer).scale if dtype == "fp16" else None
            noted.append({"samples": engine.global_samples, "lr": float(engine.get_lr()[0]),
                          "loss": sum(v / grad_accum for v in losses), "loss_scale": scale,
                          "global_steps": engine.global_steps})
        monitor = engine.monitor
        for m in (getattr(monitor, "tb_monitor", None),):
            if m is not None and getattr(m, "summary_writer", None) is not None:
                m.summary_writer.flush()
    finally:
        engine.destroy()
        del engine
        gc.collect()
    return {"rank": rank(), "steps": noted, "files": _files(os.path.join(out, f"rank{rank()}"))
            if os.path.isdir(os.path.join(out, f"rank{rank()}")) else []}
