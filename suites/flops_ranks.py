"""Code that runs inside the ranks of suites/test_flops.py.

Each cell is a small module whose forward does one kind of work (a Linear with or without bias,
torch.matmul, torch.bmm, a broadcast matmul, a conv, scaled_dot_product_attention, a module used
twice, broadcasting elementwise ops by function and by operator), built here from the cell's
kind and shapes; its analytic counts live in the suite. The ranks return DeepSpeed's counts as
plain ints:

- ``profile_module``: ``deepspeed.profiling.flops_profiler.get_model_profile`` on the module;
- ``profile_engine``: an engine whose config enables the flops profiler at ``profile_step``,
  trained past it; per step whether the profiler was running during the forward, what it held
  then (``get_total_flops``/``get_total_macs``/``get_total_params``), what the engine's
  ``flops_profiler`` kept after the step (``flops``/``macs``/``params``) and whether its report
  file exists;
- ``matmul_throughput`` (GPU): the profiler's count of one large matmul and the seconds it takes.

Fault injection for the project's red tests, off by default: ``scale=f`` multiplies the counts
DeepSpeed's own counting function for ``torch.matmul`` and ``F.linear`` returns, inside the
profiler (``_matmul_flops_compute``, ``_linear_flops_compute``), by ``f``.

Ranks are pooled and reused: every call re-seeds and restores what it changed before returning.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dsconform.suite import device, ds_config, seed_everything


class _Linear(nn.Module):
    def __init__(self, n_in: int, n_out: int, bias: bool, uses: int = 1) -> None:
        super().__init__()
        self.fc = nn.Linear(n_in, n_out, bias=bias)
        self.uses = uses

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.uses):
            x = self.fc(x)
        return x


class _Matmul(nn.Module):
    """x @ w by the spelling ``op`` names, w a parameter of ``shape``."""

    def __init__(self, shape: tuple[int, ...], op: str) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(*shape))
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.op == "bmm":
            return torch.bmm(x, self.w)
        return torch.matmul(x, self.w)


class _Conv(nn.Module):
    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int, padding: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=padding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class _Attention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v)


class _ScaleShift(nn.Module):
    """x * w + b over the last dimension, broadcasting w and b; by torch.mul/torch.add or by
    the operators."""

    def __init__(self, width: int, operators: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(width))
        self.b = nn.Parameter(torch.randn(width))
        self.operators = operators

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.operators:
            return x * self.w + self.b
        return torch.add(torch.mul(x, self.w), self.b)


def build(kind: str, params: dict[str, Any]) -> nn.Module:
    """The module of one cell: ``kind`` and its constructor's ``params``."""
    builders = {"linear": _Linear, "matmul": _Matmul, "conv": _Conv, "attention": _Attention,
                "scale_shift": _ScaleShift}
    return builders[kind](**params)


@contextlib.contextmanager
def _torch_linear() -> Iterator[None]:
    """torch's own F.linear for the duration, then whatever was there. A ZeRO-3 engine built
    earlier in this pooled process leaves ``torch.nn.functional.linear`` replaced by its
    memory-efficient wrapper (DeepSpeed says it persists), which the profiler would count as
    well: a profile must not depend on which test ran before it in the same rank. A ZeRO-3
    engine built inside replaces it again, as it would in a fresh process."""
    found = F.linear
    F.linear = torch._C._nn.linear
    try:
        yield
    finally:
        F.linear = found


@contextlib.contextmanager
def _scaled_counts(scale: float) -> Iterator[None]:
    """Fault injection: the profiler's matmul and linear counters return ``scale`` x their
    counts. The profiler binds them when it patches torch, so they are swapped in its module."""
    if scale == 1:
        yield
        return
    from deepspeed.profiling.flops_profiler import profiler

    originals = {name: getattr(profiler, name)
                 for name in ("_matmul_flops_compute", "_linear_flops_compute")}

    def scaled(fn):
        def count(*args, **kwargs):
            flops, macs = fn(*args, **kwargs)
            return int(flops * scale), int(macs * scale)
        return count

    for name, fn in originals.items():
        setattr(profiler, name, scaled(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(profiler, name, fn)


def _inputs(shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    return [torch.randn(*s, device=device()) for s in shapes]


def profile_module(kind: str, params: dict[str, Any], shapes: list[tuple[int, ...]],
                   scale: float = 1.0) -> dict[str, int]:
    """Rank entry point: get_model_profile's flops, MACs and parameters of one cell's module."""
    from deepspeed.profiling.flops_profiler import get_model_profile

    seed_everything(0)
    module = build(kind, params).to(device())
    with _torch_linear(), _scaled_counts(scale):
        flops, macs, n_params = get_model_profile(
            module, args=_inputs(shapes), print_profile=False, detailed=False, warm_up=1,
            as_string=False)
    return {"flops": int(flops), "macs": int(macs), "params": int(n_params)}


class EngineModel(nn.Module):
    """Two bias-free Linear layers: a forward whose count is the same under every convention."""

    def __init__(self, n_in: int, hidden: int, n_out: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(n_in, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, n_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x))


def _read_profiler(profiler: Any) -> dict[str, int] | None:
    """What a started profiler holds; None where it is not running (its attributes are set by
    start_profile and removed by end_profile)."""
    try:
        return {"flops": int(profiler.get_total_flops()), "macs": int(profiler.get_total_macs()),
                "params": int(profiler.get_total_params())}
    except AttributeError:
        return None


def profile_engine(stage: int, dims: tuple[int, int, int], micro_batch: int, profile_step: int,
                   steps: int, report: str, scale: float = 1.0) -> dict[str, Any]:
    """Rank entry point: ``steps`` steps of an engine whose flops profiler runs at
    ``profile_step``, its report written to ``report``."""
    import deepspeed

    seed_everything(0)
    model = EngineModel(*dims).to(device())
    config = ds_config(stage=stage, dtype="fp32", optimizer="sgd", lr=0.01,
                       micro_batch=micro_batch, grad_accum=1, world_size=1,
                       flops_profile_step=profile_step, flops_output=report)
    with _torch_linear(), _scaled_counts(scale):
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=config)
        try:
            trace = []
            x = torch.randn(micro_batch, dims[0], device=device())
            for _ in range(steps):
                before = engine.global_steps
                loss = engine(x).pow(2).mean()
                during = _read_profiler(engine.flops_profiler)
                engine.backward(loss)
                engine.step()
                kept = {k: getattr(engine.flops_profiler, k, None)
                        for k in ("flops", "macs", "params")}
                trace.append({"global_step": before, "during": during,
                              "kept": {k: None if v is None else int(v) for k, v in kept.items()},
                              "report": os.path.exists(report)})
            return {"trace": trace, "stage": engine.zero_optimization_stage()}
        finally:
            engine.destroy()
            del engine
            gc.collect()


def matmul_throughput(dtype: str, size: int, iters: int, rounds: int = 3) -> dict[str, Any]:
    """Rank entry point (GPU): the profiler's count of one (size x size) @ (size x size) matmul
    module in ``dtype``, then the seconds per forward, ``rounds`` rounds of ``iters``."""
    from deepspeed.profiling.flops_profiler import get_model_profile

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    seed_everything(0)
    module = _Matmul((size, size), "matmul").to(device(), torch_dtype)
    x = torch.randn(size, size, device=device(), dtype=torch_dtype)
    with _torch_linear():
        flops, macs, _ = get_model_profile(module, args=[x], print_profile=False,
                                           detailed=False, warm_up=1, as_string=False)
    seconds = []
    with torch.no_grad():
        for _ in range(3):
            module(x)
        for _ in range(rounds):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(iters):
                module(x)
            torch.cuda.synchronize()
            seconds.append((time.perf_counter() - start) / iters)
    name = torch.cuda.get_device_name()
    del module, x
    return {"flops": int(flops), "macs": int(macs), "seconds": seconds, "device": name}
