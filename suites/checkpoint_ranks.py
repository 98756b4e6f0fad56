"""Code that runs inside the ranks of suites/test_checkpoint.py.

The model, the data and the ZeRO cell are the ZeRO suite's (dsconform/checks/zero_vs_ddp.py):
the same MLP with awkward widths, the same per-rank data seeded by (seed, rank). Every entry point
trains an engine for ``steps`` steps, saves, and builds a second engine from ANOTHER seed (so a
value the load forgets cannot be right by accident) that loads. What comes back to the parent is
plain: flat snapshots (``dsconform.checks.checkpoint_state``: module weights, fp32 master weights,
optimizer and scheduler state, counters, loss scaler) and training traces (losses, boundary
gradients, final parameters) as CPU tensors.

Checkpoint directories are given by the parent, under the run's scratch directory; ranks write
nowhere else. Ranks are pooled: every call re-seeds and destroys its engines before returning.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dsconform.suite import (
    MLP,
    TORCH_DTYPES,
    ZeroCase,
    checkpoint_state,
    cpu_fp32,
    ds_config,
    rank_batches,
)

# WarmupLR over more steps than any case trains: the learning rate still rises at every saved
# step, so a load that drops the scheduler restarts the warmup and shows.
WARMUP_STEPS = 10
# Dynamic fp16 loss scaling that moves within a few steps (2**8 doubled every 2 clean steps), so
# the scaler's state at the save is not its initial state.
FP16_SCALER = {"loss_scale": 0.0, "initial_scale_power": 8, "loss_scale_window": 2,
               "hysteresis": 2, "min_loss_scale": 1.0}
# The steps before a round trip's save (0-based) whose loss is made inf in fp16 cells, on every
# rank: the saved scaler then differs from a fresh one in every field a resumed run depends on
# (ZeRO 1-3: scale 128 against 256, hysteresis 1 against 2, last overflow 2 against -1, two
# skipped steps against 0; stage 0, which keeps no hysteresis: scale 64), so a load that drops
# any of them fails the round trip.
FP16_PRESAVE_OVERFLOWS = (0, 2)
# Attributes of DeepSpeed's loss scalers (LossScaler / DynamicLossScaler, or the fp16 optimizer
# wrappers that keep them on themselves) that a resumed run depends on.
_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis",
                  "scale_window", "min_scale", "delayed_shift", "scale_factor", "dynamic")


class CheckpointRefused(RuntimeError):
    """load_checkpoint raised, or reported failure by returning no path: the suite's corruption
    checks want exactly this, and tell it apart from any other error of a rank."""


@dataclass(frozen=True)
class CkptCase:
    """One checkpoint scenario; everything a rank needs to reproduce it."""
    stage: int
    dtype: str
    optimizer: str = "adam"
    offload_optimizer: bool = False
    offload_param: bool = False
    world_size: int = 2
    steps: int = 3          # trained before the save
    more_steps: int = 2     # trained after it (or after the load)
    width: int = 53
    seed: int = 1234
    tied: bool = False      # the model ties two layers' weights (consolidation)
    writer: str | None = None  # ds_config checkpoint_writer: None (torch.save) or "fast"

    @property
    def offload(self) -> str:
        return "param+opt" if self.offload_param else ("opt" if self.offload_optimizer else "none")

    @property
    def id(self) -> str:
        return f"z{self.stage}-off_{self.offload}-{self.dtype}-{self.optimizer}-ws{self.world_size}"

    def with_(self, **changes: Any) -> CkptCase:
        return replace(self, **changes)

    def params(self) -> dict[str, Any]:
        return asdict(self)

    def zero_case(self) -> ZeroCase:
        """The ZeRO suite's cell with this model and data (lr, momentum: its defaults)."""
        return ZeroCase(stage=self.stage, dtype=self.dtype, optimizer=self.optimizer, grad_accum=1,
                        world_size=self.world_size, offload_optimizer=self.offload_optimizer,
                        offload_param=self.offload_param, width=self.width, seed=self.seed,
                        steps=self.steps + self.more_steps)

    def config(self, *, load_universal: bool = False) -> dict[str, Any]:
        z = self.zero_case()
        return ds_config(stage=self.stage, dtype=self.dtype, optimizer=self.optimizer, lr=z.lr,
                         micro_batch=z.micro_batch, grad_accum=1, world_size=self.world_size,
                         offload_optimizer=self.offload_optimizer,
                         offload_param=self.offload_param, gradient_clipping=0.0,
                         weight_decay=0.0, momentum=z.momentum, lr_warmup_steps=WARMUP_STEPS,
                         checkpoint_writer=self.writer, load_universal=load_universal,
                         **(FP16_SCALER if self.dtype == "fp16" else {}))

    def n_params(self) -> int:
        z = self.zero_case()
        n = z.d_in * z.width + z.width + z.width * z.width + z.width + z.width * z.d_out + z.d_out
        return n + (z.width if self.tied else 0)  # the tied layer adds only its bias


class TiedMLP(MLP):
    """The ZeRO suite's MLP with its middle layer applied twice, through two modules that share
    one weight: ``named_parameters()`` lists the weight once, ``state_dict()`` under both names,
    as tied input/output embeddings are."""

    def __init__(self, d_in: int, width: int, d_out: int) -> None:
        super().__init__(d_in, width, d_out)
        self.fc2b = nn.Linear(width, width)
        self.fc2b.weight = self.fc2.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.gelu(self.fc2b(F.gelu(self.fc2(F.gelu(self.fc1(x)))))))


def tied_pairs(module: nn.Module) -> list[tuple[str, str]]:
    """(alias, owner) for every parameter reachable under a second name."""
    owner: dict[int, str] = {}
    pairs = []
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in owner:
            pairs.append((name, owner[id(p)]))
        else:
            owner[id(p)] = name
    return pairs


def _launcher_env() -> None:
    """FastPersist reads CROSS_SIZE / CROSS_RANK (nodes, this node's index), which only the
    `deepspeed` launcher sets: without them DeepSpeed 0.19.8 raises KeyError 'CROSS_SIZE' in
    deepspeed.initialize under torchrun, Slurm or this harness. Set them as that launcher would."""
    from dsconform.suite import rank, world

    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or world())
    os.environ.setdefault("CROSS_SIZE", str(max(1, world() // local)))
    os.environ.setdefault("CROSS_RANK", str(rank() // local))


def build(case: CkptCase, seed: int, *, config: dict[str, Any] | None = None) -> Any:
    """A DeepSpeed engine for ``case`` whose initial weights come from ``seed``."""
    import deepspeed
    import pytest
    from deepspeed.accelerator import get_accelerator

    from dsconform.suite import device, seed_everything

    if case.dtype == "fp16" and not get_accelerator().is_fp16_supported():
        # Decided identically on every rank (the parent gates with requires(fp16=True) first).
        pytest.skip(f"Requires: [fp16 (found {get_accelerator().device_name()} accelerator "
                    f"without fp16 support)]")
    _launcher_env()
    seed_everything(seed)
    z = case.zero_case()
    model = (TiedMLP if case.tied else MLP)(z.d_in, z.width, z.d_out).to(device())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config or case.config())
    return engine


def _batches(case: CkptCase) -> tuple[list, list]:
    from dsconform.suite import rank

    data = rank_batches(case.zero_case(), rank())
    return data[:case.steps], data[case.steps:]


def train(engine: Any, batches: list, dtype: str, overflow_at: tuple[int, ...] = ()
          ) -> dict[str, Any]:
    """One optimizer step per batch; the trace ``compare_traces`` reads (losses, the full
    gradients before each step, the final parameters). At the steps ``overflow_at`` the loss is
    multiplied by inf (an overflow the fp16 engine must skip; the trace then holds inf)."""
    from deepspeed.utils import safe_get_full_grad

    from dsconform.suite import device

    dev, dt = device(), TORCH_DTYPES[dtype]
    named = list(engine.module.named_parameters())
    losses, grads = [], []
    for i, micro_batches in enumerate(batches):
        (x, y), = micro_batches  # grad_accum is 1 here
        loss = F.mse_loss(engine(x.to(dev, dt)).float(), y.to(dev))
        engine.backward(loss * float("inf") if i in overflow_at else loss)
        # A collective on stage 3: every rank gathers every parameter, in the same order.
        grads.append({n: cpu_fp32(safe_get_full_grad(p)) for n, p in named})
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "params": final_params(engine)}


def final_params(engine: Any) -> dict[str, torch.Tensor]:
    """fp32 master weights where DeepSpeed keeps them, else the (gathered) model weights."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for n, p in engine.module.named_parameters():
        full = safe_get_full_fp32_param(p)
        if full is None:
            with deepspeed.zero.GatheredParameters([p]):
                full = p.data
        out[n] = cpu_fp32(full)
    return out


def _leaf(v: Any) -> Any:
    return float(v) if isinstance(v, torch.Tensor) and v.numel() == 1 else v


def snapshot(engine: Any, *, layout: bool = True) -> dict[str, Any]:
    """Everything a resumed run depends on, as flat leaves. Gathered (identical on every rank):
    ``module/`` weights in their dtype, ``fp32/`` master weights. This rank's own: ``optimizer/``
    (the wrapper's state_dict: its partition of the masters and moments, the loss scaler),
    ``scheduler/``, ``engine/`` counters and lr, ``loss_scaler/``. ``layout=False`` leaves out
    the optimizer state_dict, whose layout differs between ZeRO stages."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    snap: dict[str, Any] = {}
    for n, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):  # a no-op below stage 3
            snap[f"module/{n}"] = p.detach().to("cpu").clone()
        master = safe_get_full_fp32_param(p)
        if master is not None:
            snap[f"fp32/{n}"] = cpu_fp32(master)
    if layout:
        optimizer = checkpoint_state.flatten_state(engine.optimizer.state_dict(), "optimizer")
        snap.update(_without_padding(engine.optimizer, optimizer))
    if engine.lr_scheduler is not None:
        snap.update(checkpoint_state.flatten_state(engine.lr_scheduler.state_dict(), "scheduler"))
    snap["engine/global_steps"] = engine.global_steps
    snap["engine/global_samples"] = engine.global_samples
    snap["engine/skipped_steps"] = engine.skipped_steps
    snap.update(checkpoint_state.flatten_state([float(lr) for lr in engine.get_lr()], "engine/lr"))
    # ZeRO 1-3 keep a LossScaler/DynamicLossScaler; stage 0's fp16 wrappers a LossScaleConfig
    # (dynamic_loss_scale for dynamic, no hysteresis); bf16/fp32 wrappers a static scaler.
    opt = engine.optimizer
    scaler = (getattr(opt, "loss_scale_config", None) or getattr(opt, "loss_scaler", None)
              or opt)
    for field in _SCALER_FIELDS:
        value = _leaf(getattr(scaler, field, None))
        if field == "dynamic" and value is None:
            value = getattr(scaler, "dynamic_loss_scale", None)
        if isinstance(value, (bool, int, float)):
            snap[f"loss_scaler/{field}"] = value
    return snap


def _without_padding(optimizer: Any, flat: dict[str, Any]) -> dict[str, Any]:
    """ZeRO-3's flat partitions (``fp32_flat_groups[i]`` and the moments of sub-group i) end
    each parameter's slice with padding that is never written: on the rank whose slice runs
    past the parameter's end it holds whatever the allocator left, NaN at times (seen once on
    the CPU machine, the same NaN saved and loaded). The padding is no state: it is zeroed in
    the compared copy, per DeepSpeed's own record of it (groups_padding), and every element
    that is state is still compared. Other stages are returned as they are."""
    paddings = getattr(optimizer, "groups_padding", None)
    parts = getattr(optimizer, "fp16_partitioned_groups", None)
    if paddings is None or parts is None or len(paddings) != len(parts):
        return flat
    masks = []
    for group, pads in zip(parts, paddings):
        pieces = [torch.ones(t.numel(), dtype=torch.bool) for t in group]
        for piece, pad in zip(pieces, pads):
            if pad:
                piece[piece.numel() - pad:] = False
        masks.append(torch.cat(pieces) if pieces else torch.ones(0, dtype=torch.bool))
    out = dict(flat)
    for name, value in flat.items():
        index = _sub_group_of(name)
        if (index is None or index >= len(masks) or not isinstance(value, torch.Tensor)
                or value.dim() != 1 or value.numel() != masks[index].numel()
                or bool(masks[index].all())):
            continue
        out[name] = value.masked_fill(~masks[index], 0)
    return out


def _sub_group_of(name: str) -> int | None:
    """The ZeRO-3 sub-group a flat optimizer leaf belongs to: ``optimizer/fp32_flat_groups[i]``
    or ``optimizer/.../state/i/<moment>`` (the inner optimizer numbers its fp32 flats in
    sub-group order)."""
    import re

    found = (re.fullmatch(r"optimizer/fp32_flat_groups\[(\d+)\]", name)
             or re.fullmatch(r"optimizer/.*/state/(\d+)/[^/]+", name))
    return int(found.group(1)) if found else None


def full_state(engine: Any) -> dict[str, Any]:
    """The world-size independent state a universal checkpoint carries: gathered module
    weights, fp32 masters and Adam moments per parameter, the step counter, the lr, Adam's
    step count and the lr scheduler's state."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    state: dict[str, Any] = {}
    for n, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            state[f"module/{n}"] = p.detach().to("cpu").clone()
        state[f"fp32/{n}"] = cpu_fp32(safe_get_full_fp32_param(p))
        for key in ("exp_avg", "exp_avg_sq"):
            state[f"{key}/{n}"] = cpu_fp32(safe_get_full_optimizer_state(p, key))
    state["engine/global_steps"] = engine.global_steps
    state.update(checkpoint_state.flatten_state([float(lr) for lr in engine.get_lr()], "engine/lr"))
    # Adam's step count (its bias correction), however the partitions lay it out: the set of
    # the inner optimizer's per-state steps; and the lr scheduler, whose next lr it decides.
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    state["optimizer/steps"] = tuple(sorted({float(st["step"]) for st in inner.state.values()
                                             if "step" in st}))
    if engine.lr_scheduler is not None:
        state.update(checkpoint_state.flatten_state(engine.lr_scheduler.state_dict(), "scheduler"))
    return state


def _destroy(engine: Any) -> None:
    engine.destroy()
    gc.collect()


# ---------------------------------------------------------------------------- entry points

def round_trip(case: CkptCase, ckpt_dir: str, target: CkptCase | None = None,
               load_kwargs: dict[str, bool] | None = None) -> dict[str, Any]:
    """Engine A trains ``steps``, saves, records its state and trains ``more_steps`` more. Engine
    B (``target``'s configuration, another seed) loads and trains the same ``more_steps``.
    ``target`` with another stage is a stage change: then the optimizer layout is not compared."""
    from dsconform.suite import rank

    target = target or case
    same_layout = target.stage == case.stage
    before, after = _batches(case)
    a = build(case, case.seed)
    try:
        train(a, before, case.dtype,
              overflow_at=FP16_PRESAVE_OVERFLOWS if case.dtype == "fp16" else ())
        a.save_checkpoint(ckpt_dir, tag="roundtrip")
        saved = snapshot(a, layout=same_layout)
        reference = train(a, after, case.dtype)
    finally:
        _destroy(a)
    b = build(target, case.seed + 1)
    try:
        fresh = snapshot(b, layout=same_layout)
        load_path, _ = b.load_checkpoint(ckpt_dir, tag="roundtrip", **(load_kwargs or {}))
        loaded = snapshot(b, layout=same_layout)
        resumed = train(b, after, case.dtype)
    finally:
        _destroy(b)
    return {"rank": rank(), "load_path": load_path, "saved": saved, "fresh": fresh,
            "loaded": loaded, "reference": reference, "resumed": resumed}


def partial_load(case: CkptCase, ckpt_dir: str, mode: str) -> dict[str, Any]:
    """round_trip with ``load_checkpoint(**checkpoint_state.LOAD_MODES[mode])``."""
    return round_trip(case, ckpt_dir, load_kwargs=checkpoint_state.LOAD_MODES[mode])


def resume_save(case: CkptCase, ckpt_dir: str) -> dict[str, Any]:
    """The uninterrupted run: ``steps``, a save, ``more_steps`` (its trace is the reference)."""
    from dsconform.suite import rank

    before, after = _batches(case)
    a = build(case, case.seed)
    try:
        train(a, before, case.dtype,
              overflow_at=FP16_PRESAVE_OVERFLOWS if case.dtype == "fp16" else ())
        a.save_checkpoint(ckpt_dir, tag="resume")
        saved = snapshot(a)
        return {"rank": rank(), "pid": os.getpid(), "saved": saved,
                "reference": train(a, after, case.dtype)}
    finally:
        _destroy(a)


def resume_load(case: CkptCase, ckpt_dir: str) -> dict[str, Any]:
    """The resumed run, in a fresh process: load, then the same ``more_steps``."""
    from dsconform.suite import rank

    _, after = _batches(case)
    b = build(case, case.seed + 1)
    try:
        fresh = snapshot(b)
        load_path, _ = b.load_checkpoint(ckpt_dir, tag="resume")
        loaded = snapshot(b)
        return {"rank": rank(), "pid": os.getpid(), "load_path": load_path, "fresh": fresh,
                "loaded": loaded, "resumed": train(b, after, case.dtype)}
    finally:
        _destroy(b)


def save_and_consolidate(case: CkptCase, ckpt_dir: str) -> dict[str, Any]:
    """Train, save, and (rank 0, once every rank has saved) consolidate the checkpoint with
    ``get_fp32_state_dict_from_zero_checkpoint``. Returns the live engine's gathered fp32
    masters, its state_dict names and tied pairs, and the consolidated state dict."""
    import torch.distributed as dist
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from dsconform.suite import rank

    before, _ = _batches(case)
    a = build(case, case.seed)
    try:
        train(a, before, case.dtype)
        masters = final_params(a)
        names = list(a.module.state_dict().keys())
        pairs = tied_pairs(a.module)
        a.save_checkpoint(ckpt_dir, tag="consolidate")
    finally:
        _destroy(a)
    dist.barrier()
    consolidated = None
    if rank() == 0:
        with contextlib.redirect_stdout(io.StringIO()):  # its progress bars, not our output
            consolidated = get_fp32_state_dict_from_zero_checkpoint(ckpt_dir, tag="consolidate")
        consolidated = {k: v.detach().clone() for k, v in consolidated.items()}
    dist.barrier()
    return {"rank": rank(), "masters": masters, "names": names, "tied": pairs,
            "consolidated": consolidated}


def universal_save(case: CkptCase, ckpt_dir: str) -> dict[str, Any]:
    """Train on ``case.world_size`` ranks, save, and convert the checkpoint with DeepSpeed's
    ds_to_universal (rank 0, in-process, one worker) to ``<tag>_universal`` beside it, which
    also writes ``latest_universal``. Returns the full state at the save."""
    import argparse

    import torch.distributed as dist
    from deepspeed.checkpoint import ds_to_universal
    from deepspeed.checkpoint.constants import (
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )

    from dsconform.suite import rank

    before, _ = _batches(case)
    a = build(case, case.seed)
    try:
        train(a, before, case.dtype)
        state = full_state(a)
        # ds_to_universal requires this client state (Megatron-DeepSpeed writes it).
        info = {UNIVERSAL_CHECKPOINT_INFO: {
            UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}}
        a.save_checkpoint(ckpt_dir, tag="ucp", client_state=info)
    finally:
        _destroy(a)
    dist.barrier()
    if rank() == 0:
        args = argparse.Namespace(
            input_folder=str(Path(ckpt_dir) / "ucp"),
            output_folder=str(Path(ckpt_dir) / "ucp_universal"), num_extract_workers=1,
            num_merge_workers=1, keep_temp_folder=False, strict=True,
            inject_missing_state=False)
        with contextlib.redirect_stdout(io.StringIO()):
            ds_to_universal.main(args)
    dist.barrier()
    return {"rank": rank(), "state": state}


def universal_load(case: CkptCase, ckpt_dir: str) -> dict[str, Any]:
    """Load the universal checkpoint (``latest_universal``) on ``case.world_size`` ranks."""
    from dsconform.suite import rank

    b = build(case, case.seed + 1, config=case.config(load_universal=True))
    try:
        load_path, _ = b.load_checkpoint(ckpt_dir)
        return {"rank": rank(), "load_path": load_path, "state": full_state(b)}
    finally:
        _destroy(b)
