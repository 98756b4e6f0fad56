"""The cells of suites/test_state_fidelity.py and the code that runs inside their ranks.

``BufferedMLP`` carries a buffer of every kind torch models carry: BatchNorm's fp32 running
statistics and its int64 ``num_batches_tracked`` (updated by every forward in training mode),
an int64 counter of its own, an fp32 scale, a bf16 and an fp16 table, a bool mask, and a
non-persistent fp32 buffer (``cache``: in the module, never in its ``state_dict``). The
BatchNorm sits on the input and keeps no affine parameters, so its statistics depend on the
data alone: a plain copy of the model run forward on the same batches is their reference.

``round_trip`` (STATE-BUF-1): train, read the engine's module state, save, consolidate with
``get_fp32_state_dict_from_zero_checkpoint`` (ZeRO 1-3), load into a fresh engine and read its
state. ``accessors`` (STATE-FULL-1): DeepSpeed's ``safe_get_full_*`` after every step against
DDP's gradients and torch AdamW's parameters and moments on the same data.

Ranks are pooled and reused: every call re-seeds, and destroys its engines before returning.
"""

from __future__ import annotations

import contextlib
import copy
import io
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

IN, HIDDEN, OUT = 13, 53, 7  # odd widths: ZeRO pads every partition on two ranks
LR, BETAS, EPS = 1e-2, (0.9, 0.99), 1e-8
# Two parameter groups, as users write them: weights decay, biases do not (and step at 2x lr).
GROUPS = (("weight", 1.0, 0.1), ("bias", 2.0, 0.0))
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class BufferedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(IN, affine=False)
        self.fc1 = nn.Linear(IN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, OUT)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, HIDDEN))
        self.register_buffer("table_bf16", torch.linspace(-1, 1, OUT).to(torch.bfloat16))
        self.register_buffer("table_fp16", torch.linspace(1, -1, OUT).to(torch.float16))
        self.register_buffer("mask", torch.arange(HIDDEN) % 5 != 0)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("cache", torch.full((OUT,), 3.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In the statistics' own dtype: a release that casts buffers to the training dtype
        # shows as a dtype, not as a crash of the forward.
        x = self.norm(x.to(self.norm.running_mean.dtype))
        dtype = self.fc1.weight.dtype
        h = F.gelu(self.fc1(x.to(dtype))) * (self.scale * self.mask).to(dtype)
        out = self.fc2(h) + (self.table_bf16.float() + self.table_fp16.float()).to(dtype)
        with torch.no_grad():
            self.calls += 1
        return out


@dataclass(frozen=True)
class StateCase:
    stage: int
    dtype: str = "fp32"
    world_size: int = 2
    steps: int = 3
    micro_batch: int = 4
    seed: int = 11

    @property
    def id(self) -> str:
        return f"z{self.stage}-{self.dtype}-ws{self.world_size}"

    def with_world_size(self, world_size: int) -> StateCase:
        return replace(self, world_size=world_size)


def matrix() -> list[StateCase]:
    return [StateCase(stage, dtype) for stage in range(4) for dtype in PRECISIONS]


def config(case: StateCase) -> dict[str, Any]:
    """ds_config's pinned semantics with torch AdamW (``torch_adam``, ``adam_w_mode``) and no
    ``data_types.buffer_dtype``: buffers keep the dtype the model gave them."""
    from dsconform.suite import ds_config

    cfg = ds_config(stage=case.stage, dtype=case.dtype, optimizer="adam", lr=LR,
                    betas=BETAS, eps=EPS, micro_batch=case.micro_batch, grad_accum=1,
                    world_size=case.world_size)
    cfg["optimizer"]["params"]["adam_w_mode"] = True
    return cfg


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith(suffix)], "lr": LR * factor,
             "weight_decay": wd} for suffix, factor, wd in GROUPS]


def _engine(case: StateCase, model: nn.Module) -> Any:
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model),
                                           config=config(case))
    return engine


def _batches(case: StateCase, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(case.seed * 1009 + step * 31 + rank)
    return (torch.randn(case.micro_batch, IN, generator=g) * 2 + 1,
            torch.randn(case.micro_batch, OUT, generator=g))


def _clone(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").clone()


def module_state(engine: Any) -> dict[str, torch.Tensor]:
    """``engine.module.state_dict()`` with every ZeRO-3 parameter gathered, in its own dtype."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {k: _clone(v) for k, v in engine.module.state_dict().items()}


def non_persistent(module: nn.Module) -> dict[str, torch.Tensor]:
    persistent = set(module.state_dict())
    return {n: _clone(b) for n, b in module.named_buffers() if n not in persistent}


def masters(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 master (``safe_get_full_fp32_param``; a collective on ZeRO-3),
    or the parameter itself where none stands behind it (stage 0 fp32)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for n, p in engine.module.named_parameters():
        full = safe_get_full_fp32_param(p)
        if full is None:
            with deepspeed.zero.GatheredParameters([p]):
                full = p.data
        out[n] = _clone(full)
    return out


def _tamper_after_load(engine: Any, tamper: str | None) -> None:
    if tamper == "buffer_cast_after_load":  # the fp32 scale comes back as bf16
        engine.module.scale.data = engine.module.scale.data.to(torch.bfloat16)
    elif tamper == "buffer_value_after_load":  # one running mean off by 1e-3
        engine.module.norm.running_mean[0] += 1e-3


def round_trip(case: StateCase, ckpt_dir: str, tamper: str | None = None) -> dict[str, Any]:
    """STATE-BUF-1's rank entry point. Every rank trains on the same batches (DeepSpeed
    broadcasts buffers at initialisation only, so the buffers are one state on every rank).

    Returns {"rank", "reference": the buffers of a plain copy run forward on those batches,
    "non_persistent_initial", "engine": module state after training, "engine_np": its
    non-persistent buffers, "masters", "loaded", "loaded_np": the fresh engine's after the
    load, "consolidated": get_fp32_state_dict_from_zero_checkpoint's (rank 0; None at stage 0)}.
    """
    import torch.distributed as dist
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from dsconform.suite import device, rank, seed_everything

    seed_everything(case.seed)
    dev = device()
    model = BufferedMLP().to(dev)
    plain = copy.deepcopy(model)  # on the same device: the same kernels for the statistics
    initial_np = non_persistent(model)
    a = _engine(case, model)
    try:
        for step in range(case.steps):
            x, y = (t.to(dev) for t in _batches(case, step, 0))
            loss = F.mse_loss(a(x).float(), y)
            a.backward(loss)
            a.step()
            with torch.no_grad():
                plain(x)
        reference = {n: _clone(b) for n, b in plain.named_buffers()}
        engine, engine_np, master = module_state(a), non_persistent(a.module), masters(a)
        a.save_checkpoint(ckpt_dir, tag="state")
    finally:
        a.destroy()
    dist.barrier()
    consolidated = None
    if rank() == 0 and case.stage > 0:
        with contextlib.redirect_stdout(io.StringIO()):
            consolidated = get_fp32_state_dict_from_zero_checkpoint(ckpt_dir, tag="state")
        consolidated = {k: _clone(v) for k, v in consolidated.items()}
    dist.barrier()
    seed_everything(case.seed + 1)  # a fresh engine, other initial weights
    b = _engine(case, BufferedMLP().to(dev))
    try:
        b.load_checkpoint(ckpt_dir, tag="state")
        _tamper_after_load(b, tamper)
        loaded, loaded_np = module_state(b), non_persistent(b.module)
    finally:
        b.destroy()
    return {"rank": rank(), "reference": reference, "non_persistent_initial": initial_np,
            "engine": engine, "engine_np": engine_np, "masters": master, "loaded": loaded,
            "loaded_np": loaded_np, "consolidated": consolidated}


# ---------------------------------------------------------------- STATE-FULL-1
STATE_KEYS = ("exp_avg", "exp_avg_sq")


def _ddp(model: nn.Module) -> tuple[Any, torch.optim.Optimizer]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, broadcast_buffers=False)
    opt = torch.optim.AdamW(param_groups(ddp.module), betas=BETAS, eps=EPS)
    return ddp, opt


def _missing_state(p: Any, key: str) -> list[int]:
    """The ranks whose fragment of ``p`` (ZeRO 1/2) carries no optimizer state ``key``, agreed
    on every rank: safe_get_full_optimizer_state is a collective, a rank that raised would
    hang the others."""
    import torch.distributed as dist

    mapping = getattr(p, "_hp_mapping", None)
    lacks = mapping is not None and key not in (mapping.optim_fragment or {})
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, lacks)
    return [r for r, f in enumerate(flags) if f]


def _full_state(engine: Any) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """safe_get_full_optimizer_state of every parameter and key; the model's own optimizer
    state where the accessor returns None (stage 0 fp32: no master behind the parameter)."""
    from deepspeed.utils import safe_get_full_optimizer_state

    out, errors, fallback = {}, [], []
    for n, p in engine.module.named_parameters():
        for k in STATE_KEYS:
            missing = _missing_state(p, k)
            if missing:
                errors.append(f"safe_get_full_optimizer_state({n!r}, {k!r}) cannot be read: "
                              f"the state is not linked to the parameter's fp32 fragment on "
                              f"rank(s) {missing}")
                continue
            value = safe_get_full_optimizer_state(p, k)
            if value is None:
                value = engine.optimizer.state.get(p, {}).get(k)
                fallback.append(f"{n}/{k}")
            if value is None:
                errors.append(f"no optimizer state {k!r} for {n!r}")
                continue
            out[f"{n}/{k}"] = _clone(value).float()
    return out, errors, fallback


def _drop_group_state(engine: Any) -> None:
    """What a lost group looks like: the second parameter group's moments reset to zero."""
    opt = engine.basic_optimizer
    # ZeRO-3 hands its flat fp32 partitions to the optimizer only for the step.
    flat = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
    for p in [flat[1]] if flat is not None else opt.param_groups[1]["params"]:
        for k in STATE_KEYS:
            if k in opt.state.get(p, {}):
                opt.state[p][k].zero_()


def accessors(case: StateCase, tamper: str | None = None) -> dict[str, Any]:
    """STATE-FULL-1's rank entry point: the engine and DDP (torch AdamW) train the same initial
    model on the same per-rank batches. Returns {"rank", "grads" / "ddp_grads" (per step,
    read at the boundary), "params" / "ddp_params" (per step), "state" / "ddp_state" (after
    the last step), "state_errors", "fallback": the names read from the optimizer itself}."""
    from deepspeed.utils import safe_get_full_grad

    from dsconform.suite import device, rank, seed_everything

    seed_everything(case.seed)
    dev = device()
    model = BufferedMLP().to(dev)
    ddp, ddp_opt = _ddp(copy.deepcopy(model))
    engine = _engine(case, model)
    try:
        named = list(engine.module.named_parameters())
        out: dict[str, Any] = {"grads": [], "ddp_grads": [], "params": [], "ddp_params": []}
        for step in range(case.steps):
            x, y = (t.to(dev) for t in _batches(case, step, rank()))
            loss = F.mse_loss(engine(x).float(), y)
            # A gradient 0.1% off: what an accessor handing back a stale or unscaled
            # gradient looks like.
            engine.backward(loss * (1.001 if tamper == "perturb_grad" else 1.0))
            out["grads"].append({n: _clone(safe_get_full_grad(p)).float() for n, p in named})
            engine.step()
            out["params"].append(masters(engine))
            ddp_opt.zero_grad()
            F.mse_loss(ddp(x), y).backward()
            out["ddp_grads"].append({n: _clone(p.grad) for n, p in ddp.module.named_parameters()})
            ddp_opt.step()
            out["ddp_params"].append({n: _clone(p) for n, p in ddp.module.named_parameters()})
        if tamper == "drop_group_state":
            _drop_group_state(engine)
        out["state"], out["state_errors"], out["fallback"] = _full_state(engine)
        out["ddp_state"] = {f"{n}/{k}": _clone(ddp_opt.state[p][k])
                            for n, p in ddp.module.named_parameters() for k in STATE_KEYS}
        out["rank"] = rank()
        return out
    finally:
        engine.destroy()
