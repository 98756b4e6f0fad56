"""ZeRO against torch DDP: one cell of the comparison (``ZeroCase``), the model and the per-rank
data both trainers see, and the rank entry point that trains both side by side
(``train_zero_and_ddp``), with what a comparison of the two records.

Shared by the suites that train ZeRO: suites/test_zero.py (the equivalence matrix), and the
checkpoint, DeepNVMe (ZeRO-Infinity), loss-scaling and multi-node suites, which reuse its cell,
model and data, or the whole run.

Each call trains the same model twice in the same process: once with the DeepSpeed engine and once
with torch DDP, from the same initial weights, on the same per-rank data with the same optimizer
settings, and returns both traces (per-step losses, per-step gradients at the accumulation
boundary, initial and final parameters) as CPU tensors for the parent to compare.

Ranks are pooled and reused: every call re-seeds, and destroys its engine before returning.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from dsconform.checks.dsconfig import ds_config

if TYPE_CHECKING:
    from dsconform.checks.equivalence import Comparison
    from dsconform.results.records import MetricsRecorder

# fp16 runs with a static loss scale so plain DDP can apply exactly the same one (a power of two:
# scaling and unscaling are exact). The dynamic scaler is the loss-scaling suite's business.
FP16_STATIC_LOSS_SCALE = 1024.0
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Elements per ZeRO-Infinity parameter swap buffer: more than any parameter partition of the
# models the suites train (1024 x 1024 on one rank); DeepSpeed's default 1e8 would allocate five
# buffers of 1e8 elements per rank.
NVME_BUFFER_ELEMENTS = 1 << 21


@dataclass(frozen=True)
class ZeroCase:
    """One cell of the ZeRO-vs-DDP matrix; everything a rank needs to reproduce it."""
    stage: int
    dtype: str
    optimizer: str
    grad_accum: int
    world_size: int | str    # "all": every GPU of the node, resolved before running
    offload_optimizer: bool = False
    offload_param: bool = False
    width: int = 53          # hidden width; odd sizes force ZeRO partition padding
    seed: int = 1234
    lr: float | None = None  # None: the optimizer's default below
    steps: int = 20
    micro_batch: int = 4
    d_in: int = 13
    d_out: int = 7
    # SGD only; None: 0.9, so that SGD has optimizer state for ZeRO to partition.
    momentum: float | None = None
    # ZeRO-Infinity (suites/test_deepnvme.py): "nvme" swaps what is offloaded to nvme_path, a
    # directory the caller owns. DeepSpeed swaps only tensors of 1 MiB or more: give a width
    # whose partitions are that large (1024 on 2 ranks), or nothing reaches the disk.
    offload_device: str = "cpu"
    nvme_path: str | None = None
    # Weight decay on both sides: Adam's is an L2 term of the gradient (ds_config writes
    # adam_w_mode false; DDP's reference is torch Adam(weight_decay=...)), as SGD's. 0: none,
    # and the id and records stay as they were; > 0 adds "_l2" to the optimizer in the id.
    weight_decay: float = 0.0
    # gradient_clipping on both sides: 0 pins DeepSpeed's default (1.0) off, which keeps fp32 SGD
    # bit-exact; > 0 clips DeepSpeed's global norm and DDP's torch.nn.utils.clip_grad_norm_
    # over the full gradient, and adds "-clip<v>" to the id.
    clip: float = 0.0
    # The engine configured with gradient_accumulation_steps 1 while the caller accumulates
    # grad_accum micro-batches itself: engine.set_gradient_accumulation_boundary(False) before
    # each backward but the last, each loss divided by grad_accum, one engine.step() per step
    # (DeepSpeed's documented manual accumulation); adds "-manual" to the id.
    manual_accum: bool = False

    def __post_init__(self) -> None:
        sgd = self.optimizer == "sgd"
        if self.lr is None:
            object.__setattr__(self, "lr", 0.05 if sgd else 1e-3)
        if self.momentum is None:
            object.__setattr__(self, "momentum", 0.9 if sgd else 0.0)

    @property
    def offload(self) -> str:
        return "param+opt" if self.offload_param else ("opt" if self.offload_optimizer else "none")

    @property
    def id(self) -> str:
        l2 = "_l2" if self.weight_decay else ""
        return (f"z{self.stage}-off_{self.offload}-{self.dtype}-{self.optimizer}{l2}"
                f"-gas{self.grad_accum}-ws{self.world_size}"
                + ("" if self.offload_device == "cpu" else f"-{self.offload_device}")
                + (f"-clip{self.clip:g}" if self.clip else "")
                + ("-manual" if self.manual_accum else ""))

    def with_(self, **changes: Any) -> ZeroCase:
        return replace(self, **changes)

    def config(self) -> dict[str, Any]:
        if not isinstance(self.world_size, int):
            raise ValueError(f"{self.id}: resolve world_size={self.world_size!r} first")
        nvme = {} if self.offload_device == "cpu" else {
            "offload_device": self.offload_device, "nvme_path": self.nvme_path,
            "nvme_buffer_elements": NVME_BUFFER_ELEMENTS}
        return ds_config(stage=self.stage, dtype=self.dtype, optimizer=self.optimizer,
                         lr=self.lr, micro_batch=self.micro_batch,
                         grad_accum=1 if self.manual_accum else self.grad_accum,
                         world_size=self.world_size, offload_optimizer=self.offload_optimizer,
                         offload_param=self.offload_param, gradient_clipping=self.clip,
                         weight_decay=self.weight_decay, momentum=self.momentum,
                         loss_scale=FP16_STATIC_LOSS_SCALE if self.dtype == "fp16" else 0.0,
                         **nvme)

    def params(self) -> dict[str, Any]:
        """Flat parameters for metric records. nvme_path is one run's own directory (never
        comparable across runs); CPU offload records keep the keys they always had."""
        p = asdict(self)
        del p["nvme_path"]
        if self.offload_device == "cpu":
            del p["offload_device"]
        if not self.weight_decay:
            del p["weight_decay"]
        if not self.clip:
            del p["clip"]
        if not self.manual_accum:
            del p["manual_accum"]
        return p


# Where each stage can put things on the CPU: stage 0 has nothing to offload, parameters move only
# under stage 3. (offload_optimizer, offload_param)
ZERO_OFFLOADS = {0: ((False, False),),
                 1: ((False, False), (True, False)),
                 2: ((False, False), (True, False)),
                 3: ((False, False), (True, False), (True, True))}


class MLP(nn.Module):
    def __init__(self, d_in: int, width: int, d_out: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, width)
        self.fc2 = nn.Linear(width, width)
        self.fc3 = nn.Linear(width, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


def rank_batches(case: ZeroCase, rank: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per-rank batches[step][micro]: a generator seeded by (seed, rank), so ranks differ and
    both trainers see identical data."""
    g = torch.Generator().manual_seed(case.seed * 1000 + rank)
    return [[(torch.randn(case.micro_batch, case.d_in, generator=g),
              torch.randn(case.micro_batch, case.d_out, generator=g))
             for _ in range(case.grad_accum)] for _ in range(case.steps)]


def cpu_fp32(t: torch.Tensor) -> torch.Tensor:
    """A detached fp32 copy on the CPU: what the traces carry to the parent."""
    return t.detach().to("cpu", torch.float32).clone()


def _train_ddp(model: nn.Module, case: ZeroCase, data, dev: torch.device) -> dict[str, Any]:
    """The reference: DDP in fp32; bf16/fp16 under torch.autocast with fp32 master weights, fp16
    with the same static loss scale DeepSpeed gets."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = model.to(dev)
    ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    if case.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=case.lr, momentum=case.momentum,
                              weight_decay=case.weight_decay)
    else:  # torch Adam (L2 weight decay) is the reference for every Adam implementation
        opt = torch.optim.Adam(model.parameters(), lr=case.lr, betas=(0.9, 0.999), eps=1e-8,
                               weight_decay=case.weight_decay)
    scale = FP16_STATIC_LOSS_SCALE if case.dtype == "fp16" else 1.0
    autocast = (torch.autocast(device_type=dev.type, dtype=TORCH_DTYPES[case.dtype])
                if case.dtype != "fp32" else contextlib.nullcontext())
    losses, grads, norms = [], [], []
    for batches in data:
        opt.zero_grad(set_to_none=True)
        step_loss = 0.0
        for micro, (x, y) in enumerate(batches):
            # Reduce once per accumulation boundary, as DeepSpeed does.
            sync = micro == len(batches) - 1
            with (contextlib.nullcontext() if sync else ddp.no_sync()):
                with autocast:
                    out = ddp(x.to(dev))
                loss = F.mse_loss(out.float(), y.to(dev))
                (loss / case.grad_accum * scale).backward()
            step_loss += loss.item()
        if scale != 1.0:  # unscale before the step, as DeepSpeed's fp16 optimizer does
            for p in model.parameters():
                p.grad.div_(scale)
        grads.append({n: cpu_fp32(p.grad) for n, p in model.named_parameters()})
        if case.clip:  # the norm before clipping, over the whole (reduced) gradient
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)))
        opt.step()
        losses.append(step_loss / case.grad_accum)
    params = {n: cpu_fp32(p) for n, p in model.named_parameters()}
    del ddp, opt
    return {"losses": losses, "grads": grads, "params": params, "param_source": "ddp",
            "grad_norms": norms}


def _perturb_backward(engine: Any, factor: float, from_step: int) -> None:
    """Fault injection for the ZeRO suite's red test: from optimizer step ``from_step`` on,
    multiply the loss by ``factor`` inside engine.backward (a wrapper on this engine only)."""
    original = engine.backward
    calls = iter(range(1 << 62))

    def backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if next(calls) // engine.gradient_accumulation_steps() >= from_step:
            loss = loss * factor
        return original(loss, *args, **kwargs)

    engine.backward = backward


def layout_problems(engine: Any, case: ZeroCase) -> list[str]:
    """Evidence that the engine runs the ZeRO stage and offload the case asked for, read from
    what it built (not from its config): the stage; on more than one rank, an fp32 master
    partition smaller than the model (stages 1-2) or every parameter partitioned (stage 3,
    ``ds_tensor``); the partitions on the CPU where the optimizer (or, stage 3, the parameters)
    are offloaded to it, on the accelerator where nothing is. An engine that fell back to
    stage 0, or ignored an offload, would match DDP as well: only this sees it."""
    problems = []
    stage = engine.zero_optimization_stage()
    if stage != case.stage:
        problems.append(f"the engine runs ZeRO stage {stage}, the case asked for {case.stage}")
    world = engine.dp_world_size
    named = list(engine.module.named_parameters())
    numel = sum(int(getattr(p, "ds_numel", p.numel())) for _, p in named)
    opt = engine.optimizer
    accel = torch.device(engine.device).type

    def expected_device(offloaded: bool) -> str | None:
        """Where a partition must live: the CPU when offloaded there, the accelerator when not
        offloaded, None when offloaded to nvme (swapped out: no device to read)."""
        if not offloaded:
            return accel
        return "cpu" if case.offload_device == "cpu" else None

    opt_device = expected_device(case.offload_optimizer)
    # What the ZeRO optimizer set itself up to do (its own flags, not the config's).
    flags = {1: {"cpu_offload": case.offload_optimizer},
             2: {"cpu_offload": case.offload_optimizer},
             3: {"offload_optimizer": case.offload_optimizer,
                 "offload_param": case.offload_param}}.get(case.stage, {})
    for flag, wanted in flags.items():
        found = getattr(opt, flag, None)
        if found is None:
            problems.append(f"engine.optimizer ({type(opt).__name__}) has no {flag}: DeepSpeed's "
                            f"internals changed or ZeRO-{case.stage} is not on; update "
                            f"dsconform/checks/zero_vs_ddp.py layout_problems")
        elif bool(found) != wanted:
            problems.append(f"the ZeRO optimizer's {flag} is {found}, the case asked for "
                            f"{wanted}")
    if case.stage in (1, 2):
        parts = getattr(opt, "single_partition_of_fp32_groups", None)
        if not parts:
            return problems + [f"no ZeRO-{case.stage} fp32 partition found (engine.optimizer of "
                               f"type {type(opt).__name__} has no single_partition_of_fp32_"
                               f"groups): DeepSpeed's internals changed or ZeRO is not on; "
                               f"update dsconform/checks/zero_vs_ddp.py layout_problems"]
        held = sum(t.numel() for t in parts)
        if world > 1 and held >= numel:
            problems.append(f"this rank holds {held} fp32 master elements of the model's {numel} "
                            f"on {world} ranks: the optimizer state is not partitioned")
        where = sorted({t.device.type for t in parts})
        if opt_device is not None and where != [opt_device]:
            problems.append(f"the fp32 master partition is on {where}, expected {opt_device} "
                            f"(offload_optimizer {case.offload_optimizer})")
    if case.stage == 3:
        whole = [n for n, p in named
                 if getattr(p, "ds_tensor", None) is None
                 or (world > 1 and p.ds_numel > 1 and p.ds_tensor.numel() >= p.ds_numel)]
        if whole:
            problems.append(f"{len(whole)} of {len(named)} parameters are not partitioned by "
                            f"ZeRO-3 on {world} ranks (no ds_tensor, or one as large as the "
                            f"parameter): {whole[:3]}")
        param_device = expected_device(case.offload_param)
        where = sorted({p.ds_tensor.device.type for _, p in named
                        if getattr(p, "ds_tensor", None) is not None})
        if param_device is not None and where and where != [param_device]:
            problems.append(f"the parameter partitions are on {where}, expected {param_device} "
                            f"(offload_param {case.offload_param})")
        flat = getattr(opt, "fp32_partitioned_groups_flat", None)
        if flat and opt_device is not None:
            where = sorted({t.device.type for t in flat})
            if where != [opt_device]:
                problems.append(f"the fp32 master partition is on {where}, expected "
                                f"{opt_device} (offload_optimizer {case.offload_optimizer})")
    return problems


def _scale_gradient(engine: Any, name: str, factor: float) -> None:
    """Fault injection for the ZeRO suite's red test: one parameter's gradient times ``factor``
    on the DeepSpeed side (a tensor hook on that parameter of this engine only)."""
    param = dict(engine.module.named_parameters())[name]
    param.register_hook(lambda grad: grad * factor)


def _global_norm(engine: Any) -> float | None:
    """The global gradient norm the engine clipped with at its last step (unscaled), or None
    where this engine does not keep it (stage 0 without mixed precision clips in place)."""
    norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    return float(norm.item() if hasattr(norm, "item") else norm)


def _train_deepspeed(model: nn.Module, case: ZeroCase, data, dev: torch.device,
                     perturb: float, perturb_from_step: int,
                     inspect: Callable[[Any], Any] | None = None,
                     grad_factor: tuple[str, float] | None = None) -> dict[str, Any]:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=case.config())
    try:
        # The pinned semantics reached the engine (DeepSpeed's own default is 1.0).
        assert engine.gradient_clipping() == case.clip, \
            f"gradient_clipping: expected {case.clip}, found {engine.gradient_clipping()}"
        layout = layout_problems(engine, case)
        if perturb != 1.0:
            _perturb_backward(engine, perturb, perturb_from_step)
        if grad_factor is not None:
            _scale_gradient(engine, *grad_factor)
        dtype = TORCH_DTYPES[case.dtype]
        # safe_get_full_grad returns the gradient as it sits before the optimizer step: with fp16
        # still multiplied by the loss scale.
        scale = FP16_STATIC_LOSS_SCALE if case.dtype == "fp16" else 1.0
        named = list(engine.module.named_parameters())
        losses, grads, norms = [], [], []
        for batches in data:
            step_loss = 0.0
            for i, (x, y) in enumerate(batches):
                out = engine(x.to(dev, dtype))
                loss = F.mse_loss(out.float(), y.to(dev))
                step_loss += loss.item()
                if case.manual_accum:
                    engine.set_gradient_accumulation_boundary(i == len(batches) - 1)
                    loss = loss / len(batches)
                engine.backward(loss)
                boundary = engine.is_gradient_accumulation_boundary()
                if boundary:
                    # Collective on stage 3: every rank gathers every parameter, same order.
                    grads.append({n: cpu_fp32(safe_get_full_grad(p)) / scale
                                  for n, p in named})
                if boundary or not case.manual_accum:
                    engine.step()
                if boundary and case.clip:
                    norms.append(_global_norm(engine))
            losses.append(step_loss / case.grad_accum)
        # What a suite wants to know about the trained engine before it is destroyed.
        inspected = inspect(engine) if inspect is not None else None
        params, source = {}, "fp32_master"
        for n, p in named:
            full = safe_get_full_fp32_param(p)
            if full is None:
                # No fp32 master behind this parameter (stage 0): the model weight is the state.
                source = "model"
                with deepspeed.zero.GatheredParameters([p]):
                    full = p.data
            params[n] = cpu_fp32(full)
        result = {"losses": losses, "grads": grads, "params": params, "param_source": source,
                  "layout_problems": layout, "grad_norms": norms}
        if inspect is not None:
            result["inspected"] = inspected
        return result
    finally:
        engine.destroy()
        del engine


def train_zero_and_ddp(case: ZeroCase, perturb: float = 1.0, perturb_from_step: int = 0,
                       inspect: Callable[[Any], Any] | None = None,
                       lr_factor: float = 1.0,
                       grad_factor: tuple[str, float] | None = None) -> dict[str, Any]:
    """Rank entry point: DDP trace and DeepSpeed trace of the same run on this rank.

    Both traces carry ``init``, the parameters both trainers start from (the whole-update
    check, ``dsconform.checks.tolerances.Tol.update``).
    ``perturb`` != 1 injects a fault into DeepSpeed's side only (see ``_perturb_backward``);
    so does ``lr_factor`` != 1 (DeepSpeed's optimizer gets ``case.lr * lr_factor``), and
    ``grad_factor`` = (name, f) (that parameter's gradient times f, see ``_scale_gradient``).
    ``inspect(engine)`` (a module-level function) runs after the last step; what it returns is
    the DeepSpeed trace's ``inspected``.
    """
    import pytest
    from deepspeed.accelerator import get_accelerator

    from dsconform.harness.api import device, rank, seed_everything

    if case.dtype == "fp16" and not get_accelerator().is_fp16_supported():
        # Decided identically on every rank. DeepSpeed's CPU accelerator needs mkldnn fp16
        # (AVX512-FP16/AMX); without it deepspeed.initialize refuses fp16.
        pytest.skip(f"Requires: [fp16 (found {get_accelerator().device_name()} accelerator "
                    f"without fp16 support)]")

    seed_everything(case.seed)
    dev = torch.device(device())
    model = MLP(case.d_in, case.width, case.d_out)
    reference_model = MLP(case.d_in, case.width, case.d_out)
    reference_model.load_state_dict(model.state_dict())
    init = {n: cpu_fp32(p) for n, p in model.named_parameters()}
    data = rank_batches(case, rank())
    ds_case = case if lr_factor == 1.0 else case.with_(lr=case.lr * lr_factor)
    try:
        ddp = _train_ddp(reference_model, case, data, dev)
        ds = _train_deepspeed(model.to(dev), ds_case, data, dev, perturb, perturb_from_step,
                              inspect, grad_factor)
    finally:
        gc.collect()
    ddp["init"] = ds["init"] = init
    return {"rank": rank(), "ds": ds, "ddp": ddp}


def clip_problems(results: list[dict[str, Any]], case: ZeroCase, rtol: float
                  ) -> tuple[list[str], int, float]:
    """Gradient clipping judged from both traces of every rank: (problems, the steps whose
    global norm exceeded the clip, the worst relative difference of the two norms). DDP's norm
    is clip_grad_norm_'s over the full reduced gradient; DeepSpeed's, what the engine clipped
    with (get_global_grad_norm). A norm taken over one rank's partition only still trains, but
    differs from DDP's on more than one rank. The data must clip on some steps, or the cell
    could not fail; an engine that keeps no norm fails, except stage 0 without mixed precision,
    which clips in place and keeps none (its parameters still show the clipping)."""
    problems: list[str] = []
    reference = results[0]["ddp"]["grad_norms"]
    clipped = sum(1 for n in reference if n > case.clip)
    if not clipped:
        problems.append(f"no step's gradient norm exceeds {case.clip:g} (norms "
                        f"{min(reference):.3g}-{max(reference):.3g}): the cell cannot show "
                        f"clipping")
    worst = 0.0
    kept_none = case.stage == 0 and case.dtype == "fp32"
    for r, res in enumerate(results):
        ds, ddp = res["ds"]["grad_norms"], res["ddp"]["grad_norms"]
        if len(ds) != len(ddp):
            problems.append(f"rank {r}: {len(ds)} DeepSpeed norms for {len(ddp)} steps")
            continue
        for step, (d, ref) in enumerate(zip(ds, ddp), start=1):
            if d is None:
                if not kept_none:
                    problems.append(f"rank {r} step {step}: the engine kept no global gradient "
                                    f"norm (get_global_grad_norm() is None) while clipping")
                continue
            rel = abs(d - ref) / ref if ref else abs(d)
            worst = max(worst, rel)
            if rel > rtol:
                problems.append(f"rank {r} step {step}: DeepSpeed's global gradient norm "
                                f"{d:.9g}, DDP's {ref:.9g} (off by {d - ref:+.3g}, relative "
                                f"{rel:.3g} > rtol {rtol:g})")
    return problems, clipped, worst


def zero_check_name(case: ZeroCase) -> str:
    """The tolerance table's check: accumulation reduces in a different order (tolerances.py)."""
    return "zero_accum" if case.grad_accum > 1 else "zero"


def record_zero_comparison(metrics: MetricsRecorder, cmp: Comparison, case: ZeroCase,
                           accelerator: str) -> None:
    """Worst differences, recorded even when within tolerance: drift across upgrades shows."""
    params = {**case.params(), "accelerator": accelerator, "rtol": cmp.tol.rtol,
              "atol": cmp.tol.atol}
    loss_abs, loss_rel = cmp.worst("loss")
    # The loss is held to atol + rtol x |loss|: rtol is the bound of its relative difference
    # (the atol share only widens it), so a comparison judges its drift against rtol.
    metrics.record("zero.loss_max_rel_diff", loss_rel, unit="1", better="lower",
                   bound=cmp.tol.rtol, **params)
    metrics.record("zero.grad_max_abs_diff", cmp.worst("grad")[0], unit="1", better="lower",
                   **params)
    metrics.record("zero.param_max_abs_diff", cmp.worst("param")[0], unit="1", better="lower",
                   **params)
    if cmp.tol.update is not None:  # bf16/fp16: the whole update against DDP's (Tol.update)
        metrics.record("zero.update_rel_diff", cmp.worst("update")[1], unit="1", better="lower",
                       bound=cmp.tol.update, **params)
    if cmp.tol.gain is not None:
        metrics.record("zero.update_gain_dev", cmp.worst("gain")[0], unit="1", better="lower",
                       bound=cmp.tol.gain, **params)
    if cmp.tol.tensor_gain is not None:  # the same gain, per parameter tensor
        metrics.record("zero.tensor_gain_dev", cmp.worst("tensor_gain")[0], unit="1",
                       better="lower", bound=cmp.tol.tensor_gain, **params)
