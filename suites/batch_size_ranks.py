"""Code that runs inside the ranks of suites/test_batch_size.py.

Every case's config is written by ``ds_config`` with only the batch keys the case gives.
``configure`` hands each to DeepSpeed's own config class (``DeepSpeedConfig``: where the rule
lives, and what ``deepspeed.initialize`` builds first), ``train`` builds a real engine and
trains one step; both return the three values DeepSpeed took, or the error it raised, as plain
values.

Fault injection for the project's red tests, off by default: ``lenient=True`` replaces
``DeepSpeedConfig._batch_assertion`` (the check that refuses a triple) by one that accepts
everything, for the duration of the call.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dsconform.suite import device, ds_config, seed_everything, world


def _config(case: Any) -> dict[str, Any]:
    keys = tuple(k for k in ("train", "micro", "accum") if k in case.given)
    return ds_config(stage=0, dtype="fp32", optimizer="sgd", lr=0.01, micro_batch=case.micro,
                     grad_accum=case.accum, world_size=world(), batch_keys=keys,
                     train_batch=case.train if "train" in keys else None)


@contextlib.contextmanager
def _lenient(on: bool) -> Iterator[None]:
    if not on:
        yield
        return
    from deepspeed.runtime.config import DeepSpeedConfig

    original = DeepSpeedConfig._batch_assertion
    DeepSpeedConfig._batch_assertion = lambda self: None
    try:
        yield
    finally:
        DeepSpeedConfig._batch_assertion = original


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def configure(cases: list[Any], lenient: bool = False) -> list[dict[str, Any]]:
    """Rank entry point: DeepSpeedConfig of every case."""
    from deepspeed.runtime.config import DeepSpeedConfig

    out = []
    with _lenient(lenient):
        for case in cases:
            try:
                c = DeepSpeedConfig(_config(case))
                out.append({"values": (c.train_batch_size, c.train_micro_batch_size_per_gpu,
                                       c.gradient_accumulation_steps)})
            except Exception as e:  # the refusal is the outcome under test
                out.append({"error": _error(e)})
    return out


def train(case: Any, lenient: bool = False) -> dict[str, Any]:
    """Rank entry point: an engine of the case's config, the three values it reports, and one
    optimizer step of its micro-batches."""
    import deepspeed

    seed_everything(0)
    model = nn.Linear(3, 1).to(device())
    with _lenient(lenient):
        try:
            engine, _, _, _ = deepspeed.initialize(model=model,
                                                   model_parameters=model.parameters(),
                                                   config=_config(case))
        except Exception as e:  # the refusal is the outcome under test
            return {"error": _error(e)}
    try:
        values = (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                  engine.gradient_accumulation_steps())
        micro, accum = values[1], values[2]
        for _ in range(accum):
            loss = engine(torch.randn(micro, 3, device=device())).pow(2).mean()
            engine.backward(loss)
            engine.step()
        return {"values": values, "global_steps": engine.global_steps,
                "global_samples": engine.global_samples}
    finally:
        engine.destroy()
        del engine
        gc.collect()
