"""The cells of suites/test_optimizers.py, the references of its optimizers, and the code that
runs inside their ranks.

A cell trains a small MLP whose parameters sit in three groups of different lr and weight decay,
with the optimizer DeepSpeed builds from the config's ``"optimizer"`` section (or a client torch
optimizer), and steps a reference beside it with the very gradient DeepSpeed's optimizer
received (``safe_get_full_grad`` at the accumulation boundary).
So the check holds the optimizer's update rule alone: ZeRO's gradients against DDP's are
ZERO-EQ-1's business. After every step the engine's full fp32 parameters are read
(``safe_get_full_fp32_param``; the model's weights where no master exists), and after the last
the optimizer state (``safe_get_full_optimizer_state``).

The references (``Reference``): where torch has the optimizer (Adam, AdamW, Adagrad, the client
optimizer), torch's own, stepped on fp32 copies of the parameters; where torch has none (Lion,
LAMB, Muon), the published update rule written out below in plain tensor arithmetic, in float64
so the reference adds no rounding of its own worth comparing.

Ranks are pooled and reused: every call re-seeds, and destroys its engine before returning.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from suites.optimizer_rules import (
    BETAS,
    EPS,
    MUON_MOMENTUM,
    NS_COEFFS,
    Reference,
    newton_schulz5,
    torch_optimizer,
)

# The suite these cells belong to (suites/test_optimizers.py).
CAPABILITY = "optimizers"

# ---------------------------------------------------------------- the cells
# Every optimizer kind the suite holds, its config section, and the DeepSpeed class it must
# build where the optimizer stays on the device and where ZeRO-Offload moves it to the host.
# None: DeepSpeed does not build that kind there (no host Lamb; FusedLion needs a GPU).
KINDS: dict[str, dict[str, Any]] = {
    "adam": {"type": "Adam", "params": {"adam_w_mode": False},
             "device": "FusedAdam", "offload": "DeepSpeedCPUAdam",
             "ops": ("fused_adam", "cpu_adam"), "state": ("exp_avg", "exp_avg_sq")},
    "adamw": {"type": "AdamW", "params": {},
              "device": "FusedAdam", "offload": "DeepSpeedCPUAdam",
              "ops": ("fused_adam", "cpu_adam"), "state": ("exp_avg", "exp_avg_sq")},
    "adagrad": {"type": "Adagrad", "params": {},
                "device": "Adagrad", "offload": "DeepSpeedCPUAdagrad",
                "ops": (None, "cpu_adagrad"), "state": ("exp_avg_sq",)},
    "lion": {"type": "Lion", "params": {},
             "device": "FusedLion", "offload": "DeepSpeedCPULion",
             "ops": ("fused_lion", "cpu_lion"), "state": ("exp_avg",)},
    "lamb": {"type": "Lamb", "params": {"max_coeff": 10.0, "min_coeff": 0.01},
             "device": "FusedLamb", "offload": None,
             "ops": ("fused_lamb", None), "state": ("exp_avg", "exp_avg_sq")},
    # Muon on the matrices, its AdamW on the rest: one class on the device and offloaded.
    "muon": {"type": "Muon", "params": {"momentum": MUON_MOMENTUM},
             "device": "MuonWithAuxAdam", "offload": "MuonWithAuxAdam",
             "ops": ("fused_adam", "cpu_adam"), "state": ()},
    "client": {"type": None, "params": {},
               "device": "RAdam", "offload": "RAdam",
               "ops": (None, None), "state": ("exp_avg", "exp_avg_sq")},
}
# Kinds whose device-side class exists only as a CUDA kernel (no CPU-accelerator builder).
CUDA_ONLY_ON_DEVICE = ("lion", "lamb")
# Adagrad's state keeps torch's name on the device ("sum"), DeepSpeed's on the host.
DEVICE_STATE = {"adagrad": ("sum",)}

# The parameter groups: (parameter names, lr factor, weight decay). Every group decays
# differently and steps at its own lr; a dropped group setting changes that group's trajectory.
GROUPS = ((("fc1.weight",), 1.0, 0.1), (("fc2.weight",), 0.5, 0.0),
          (("fc1.bias", "fc2.bias"), 2.0, 0.01))
LR = {"adam": 1e-2, "adamw": 1e-2, "adagrad": 5e-2, "lion": 1e-3, "lamb": 1e-2,
      "muon": 2e-2, "client": 1e-2}
OFFLOADS = {0: ("none",), 1: ("none", "opt"), 2: ("none", "opt"), 3: ("none", "opt", "param+opt")}
IN, HIDDEN, OUT = 13, 53, 7  # odd widths: ZeRO pads every partition on two ranks


@dataclass(frozen=True)
class OptCase:
    kind: str
    stage: int
    offload: str = "none"
    dtype: str = "fp32"
    grad_accum: int = 1
    world_size: int = 2
    steps: int = 6
    micro_batch: int = 4
    seed: int = 7
    # Resume: save after this many steps, load into a fresh engine, train the rest (0: none).
    resume_at: int = 0
    # The plainest use: an MLP of matrices only (no biases, so Muon has no AdamW half) handed
    # to deepspeed.initialize as model.parameters(), no parameter groups.
    plain: bool = False
    # ZeRO-3: the model built under deepspeed.zero.Init (its parameters partitioned as they are
    # made), as large models are.
    zinit: bool = False

    @property
    def id(self) -> str:
        resume = f"-resume{self.resume_at}" if self.resume_at else ""
        return (f"{self.kind}-z{self.stage}-{self.offload}-{self.dtype}-gas{self.grad_accum}"
                f"-ws{self.world_size}{resume}{'-plain' if self.plain else ''}"
                f"{'-zinit' if self.zinit else ''}")

    @property
    def offloaded(self) -> bool:
        return self.offload != "none"

    def op(self) -> str | None:
        if self.plain and not self.offloaded:
            return None  # no AdamW half: Muon alone, no op to load
        return KINDS[self.kind]["ops"][self.offloaded]

    def expected_class(self) -> str:
        return KINDS[self.kind]["offload" if self.offloaded else "device"]

    def state_keys(self) -> tuple[str, ...]:
        if not self.offloaded and self.kind in DEVICE_STATE:
            return DEVICE_STATE[self.kind]
        return KINDS[self.kind]["state"]

    def with_(self, **changes: Any) -> OptCase:
        return replace(self, **changes)


def valid(kind: str, stage: int, offload: str) -> bool:
    """Where DeepSpeed builds this kind: offload only on ZeRO 1-3 (parameters on 3 only), and
    only for kinds with a host implementation."""
    if offload not in OFFLOADS[stage]:
        return False
    return KINDS[kind]["offload" if offload != "none" else "device"] is not None


def matrix(world_sizes: tuple[int, ...] = (1, 2)) -> list[OptCase]:
    """Every valid (kind, stage, offload, dtype, grad_accum, world_size) cell."""
    return [OptCase(kind, stage, off, dtype, gas, ws)
            for kind in KINDS for stage, offs in OFFLOADS.items() for off in offs
            if valid(kind, stage, off)
            for dtype in ("fp32", "bf16") for gas in (1, 4) for ws in world_sizes]


def config(case: OptCase, hyper: dict[str, Any]) -> dict[str, Any]:
    """The cell's DeepSpeed config: ds_config's pinned semantics, with the optimizer section the
    cell names (a client optimizer: none)."""
    from dsconform.suite import compat, ds_config

    cfg = ds_config(stage=case.stage, dtype=case.dtype, optimizer="sgd", lr=LR[case.kind],
                    grad_accum=case.grad_accum, world_size=case.world_size,
                    micro_batch=case.micro_batch, offload_optimizer=case.offloaded,
                    offload_param=case.offload == "param+opt")
    section = KINDS[case.kind]
    if section["type"] is None:
        del cfg["optimizer"]
    else:
        params = {"lr": LR[case.kind], "weight_decay": 0.0, **section["params"]}
        if case.kind != "adagrad":
            params["betas"] = list(hyper["betas"])
        if case.kind not in ("lion",):
            params["eps"] = hyper["eps"]
        cfg["optimizer"] = {"type": section["type"], "params": params}
    # Adagrad, Lion and a client optimizer are not on ZeRO's list of tested optimizers; a torch
    # optimizer offloaded is refused unless DeepSpeed may keep it as it is.
    if case.kind == "muon" and (case.stage == 3 or (
            case.offloaded and not compat.muon_offload_reduce_scatter())):
        # ZeRO-3 refuses Muon with reduce_scatter ("Muon and reduce scatter cannot be used
        # together"), and so do ZeRO 1/2 with the optimizer offloaded on some releases
        # (compat.muon_offload_reduce_scatter): each rank orthogonalises whole gradients, so
        # they are all-reduced.
        cfg["zero_optimization"]["reduce_scatter"] = False
    cfg["zero_allow_untested_optimizer"] = True
    if case.kind == "client":
        cfg["zero_force_ds_cpu_optimizer"] = False
    return cfg


class MLP(nn.Module):
    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, HIDDEN, bias=bias)
        self.fc2 = nn.Linear(HIDDEN, OUT, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def param_groups(model: nn.Module, kind: str, *, tamper: str | None = None,
                 plain: bool = False) -> list:
    if plain:
        return list(model.parameters())
    named = dict(model.named_parameters())
    groups = [{"params": [named[n] for n in names], "lr": LR[kind] * factor,
               "weight_decay": wd} for names, factor, wd in GROUPS]
    if tamper == "drop_group_weight_decay":
        # What a lost group setting looks like: the first group falls back to the default 0.
        del groups[0]["weight_decay"]
    return groups


def reference_groups(case: OptCase) -> list[dict[str, Any]]:
    """The groups the reference steps: the cell's, or for a plain cell one group of every
    parameter at the config's lr and weight decay."""
    if case.plain:
        return [{"names": ["fc1.weight", "fc2.weight"], "lr": LR[case.kind],
                 "weight_decay": 0.0}]
    return [{"names": list(names), "lr": LR[case.kind] * factor, "weight_decay": wd}
            for names, factor, wd in GROUPS]


def hyperparameters(case: OptCase) -> dict[str, Any]:
    return {"betas": BETAS, "eps": EPS, **KINDS[case.kind]["params"]}


def _batches(case: OptCase, step: int, rank: int, dev: torch.device) -> list:
    """The micro-batches of one optimizer step on one rank: its own data, from the cell's seed."""
    g = torch.Generator().manual_seed(case.seed * 100003 + step * 101 + rank)
    out = []
    for _ in range(case.grad_accum):
        x = torch.randn(case.micro_batch, IN, generator=g)
        y = torch.randn(case.micro_batch, OUT, generator=g)
        out.append((x.to(dev), y.to(dev)))
    return out


def _stage0_master(engine: Any, p: Any) -> tuple[torch.Tensor, torch.Tensor, tuple] | None:
    """Stage 0's fp16/bf16 wrapper keeps ``p``'s fp32 master apart from the model: (the tensor
    the optimizer steps and keys its state by, ``p``'s master, ``p``'s (offset, numel) in the
    first or None). FP16_Optimizer (a fused optimizer) steps one flat fp32 tensor per group,
    FP16_UnfusedOptimizer one fp32 copy per parameter. None: no such wrapper."""
    opt = engine.optimizer
    for i, group in enumerate(getattr(opt, "fp16_groups", ())):
        offset = 0
        for j, q in enumerate(group):
            if q is p:
                if hasattr(opt, "fp32_groups_flat"):
                    flat = opt.fp32_groups_flat[i]
                    return flat, flat.narrow(0, offset, q.numel()).view_as(q), (offset, q.numel())
                master = opt.fp32_groups[i][j]
                return master, master, None
            offset += q.numel()
    return None


def _full_params(engine: Any, named: list) -> dict[str, torch.Tensor]:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    from dsconform.suite import cpu_fp32

    out = {}
    for n, p in named:
        full = safe_get_full_fp32_param(p)
        wrapped = _stage0_master(engine, p) if full is None else None
        if wrapped is not None:  # stage 0 fp16/bf16: the wrapper's fp32 master
            full = wrapped[1]
        elif full is None:  # no fp32 master behind this parameter (stage 0 fp32): the weight is
            with deepspeed.zero.GatheredParameters([p]):
                full = p.data
        out[n] = cpu_fp32(full)
    return out


def _full_state(engine: Any, named: list, keys: tuple[str, ...]) -> tuple[dict, list[str]]:
    """Every parameter's optimizer state, gathered, and what could not be read (an accessor
    that raises is a finding about DeepSpeed, reported by name, not a crash of the cell)."""
    from deepspeed.utils import safe_get_full_optimizer_state

    from dsconform.suite import cpu_fp32

    out, errors = {}, []
    for n, p in named:
        for k in keys:
            # A collective: every rank must call it or none. Where some rank's fragment of the
            # parameter lacks the state, the call raises there and hangs the others.
            missing = _ranks_missing_state(p, k)
            if missing:
                errors.append(f"safe_get_full_optimizer_state({n!r}, {k!r}) cannot be read: "
                              f"the state is not linked to the parameter's fp32 fragment on "
                              f"rank(s) {missing}")
                continue
            value = safe_get_full_optimizer_state(p, k)
            wrapped = _stage0_master(engine, p) if value is None else None
            if wrapped is not None:  # stage 0 fp16/bf16: the state of the wrapper's master
                stepped, _, part = wrapped
                value = engine.optimizer.optimizer.state[stepped].get(k)
                if value is not None and part is not None:
                    value = value.narrow(0, *part).view_as(p)
            elif value is None:  # stage 0 fp32: the optimizer holds the model's own parameters
                value = engine.optimizer.state[p].get(k)
            if value is None:
                errors.append(f"no optimizer state {k!r} for {n!r}")
                continue
            out[f"{n}/{k}"] = cpu_fp32(value)
    return out, errors


def _ranks_missing_state(p: Any, key: str) -> list[int]:
    """The ranks whose fragment of ``p`` (ZeRO 1/2, bf16 wrapper) carries no optimizer state
    ``key``, agreed on every rank."""
    import torch.distributed as dist

    mapping = getattr(p, "_hp_mapping", None)
    lacks = mapping is not None and key not in (mapping.optim_fragment or {})
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, lacks)
    return [r for r, f in enumerate(flags) if f]


def _engine(case: OptCase, model: nn.Module, tamper: str | None) -> Any:
    import deepspeed

    hyper = hyperparameters(case)
    groups = param_groups(model, case.kind, tamper=tamper, plain=case.plain)
    client = None
    if case.kind == "client":
        client = torch_optimizer("client", groups, hyper)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups,
                                           optimizer=client, config=config(case, hyper))
    if tamper == "perturb_update_rule":
        # A perturbed update rule: the first moment's decay DeepSpeed's optimizer applies.
        for group in engine.basic_optimizer.param_groups:
            if "betas" in group:
                group["betas"] = (group["betas"][0] * 0.98, group["betas"][1])
            else:  # Adagrad: no betas; its eps is its only constant
                group["eps"] = group["eps"] * 1e6
    return engine


MUON_TAMPERS = ("muon_no_momentum", "muon_wrong_ns_coefficient", "muon_sgd")


def _tamper_muon(tamper: str | None) -> dict[str, Any]:
    """Perturb DeepSpeed's Muon for the red tests, returning what to restore (ranks are reused):
    ``muon_no_momentum`` runs every Muon update with momentum 0; ``muon_wrong_ns_coefficient``
    runs Newton-Schulz with a = 3.0 for 3.4445 (DeepSpeed's update eager, so the patched
    iteration is the one it calls); ``muon_sgd`` returns the gradient as the update (no
    momentum, no Newton-Schulz: SGD, what stage 0 did before 0.19.7)."""
    if tamper not in MUON_TAMPERS:
        return {}  # and no import: a release without Muon (compat.MUON) runs the other cells
    from deepspeed.runtime.zero.muon import muon_optimizer, original_muon

    names = ("muon_update", "zeropower_via_gram_newtonschulz", "zeropower_via_newtonschulz5")
    saved = {n: getattr(original_muon, n) for n in names}
    eager = getattr(saved["muon_update"], "_torchdynamo_orig_callable", saved["muon_update"])
    if tamper == "muon_no_momentum":
        def update(grad: torch.Tensor, momentum: torch.Tensor, beta: float = 0.0,
                   **kwargs: Any) -> torch.Tensor:
            return eager(grad, momentum, 0.0, **kwargs)
    elif tamper == "muon_sgd":
        def update(grad: torch.Tensor, momentum: torch.Tensor, beta: float = 0.0,
                   **kwargs: Any) -> torch.Tensor:
            return grad
    else:
        def wrong(g: torch.Tensor, steps: int) -> torch.Tensor:
            return newton_schulz5(g, steps, (3.0, *NS_COEFFS[1:])).to(g.dtype)

        original_muon.zeropower_via_gram_newtonschulz = wrong
        original_muon.zeropower_via_newtonschulz5 = wrong
        update = eager
    original_muon.muon_update = update
    muon_optimizer.muon_update = update
    return saved


def _restore_muon(saved: dict[str, Any]) -> None:
    if not saved:
        return
    from deepspeed.runtime.zero.muon import muon_optimizer, original_muon

    for name, value in saved.items():
        setattr(original_muon, name, value)
    muon_optimizer.muon_update = saved["muon_update"]


def muon_fills_gradients(case: OptCase) -> bool:
    """ZeRO 1/2 with Muon on the device orthogonalise while the gradient partitions fill, in
    backward: there ``safe_get_full_grad`` returns Muon's update, not the gradient, and the
    reference takes the gradient from a plain copy of the model instead."""
    return case.kind == "muon" and case.stage in (1, 2) and not case.offloaded


def _plain_gradients(engine: Any, case: OptCase, step: int, dev: torch.device
                     ) -> dict[str, torch.Tensor]:
    """The gradient of one optimizer step as data parallelism averages it, from a plain copy of
    the engine's model (its weights at the step's start, in its dtype): every rank's
    micro-batches (each rank's are drawn from the cell's seed, so any rank can draw them), each
    loss over micro-batches and ranks."""
    import torch.distributed as dist

    from dsconform.suite import TORCH_DTYPES, cpu_fp32

    dtype = TORCH_DTYPES[case.dtype]
    plain = MLP(bias=not case.plain).to(dev, dtype)
    plain.load_state_dict(engine.module.state_dict())
    world = dist.get_world_size()
    for r in range(world):
        for x, y in _batches(case, step, r, dev):
            (F.mse_loss(plain(x.to(dtype)).float(), y) / (case.grad_accum * world)).backward()
    return {n: cpu_fp32(p.grad) for n, p in plain.named_parameters()}


def _train(engine: Any, case: OptCase, ref: Reference, first: int, last: int,
           dev: torch.device, flat: Reference | None = None,
           kernel_ratios: list | None = None) -> tuple[list, list]:
    from deepspeed.utils import safe_get_full_grad

    from dsconform.suite import TORCH_DTYPES, cpu_fp32, rank

    named = list(engine.module.named_parameters())
    dtype = TORCH_DTYPES[case.dtype]
    per_step, ref_steps = [], []
    for step in range(first, last):
        grads = None
        plain = _plain_gradients(engine, case, step, dev) if muon_fills_gradients(case) \
            else None
        for x, y in _batches(case, step, rank(), dev):
            loss = F.mse_loss(engine(x.to(dtype)).float(), y)
            engine.backward(loss)
            if engine.is_gradient_accumulation_boundary() and plain is None:
                # Collective on stage 3: every rank gathers every gradient, in the same order.
                grads = {n: cpu_fp32(safe_get_full_grad(p)) for n, p in named}
            engine.step()
        if kernel_ratios is not None:  # FusedLamb's trust ratios of its last step() call
            kernel_ratios.append(list(engine.basic_optimizer.get_lamb_coeffs()))
        ref.step(plain if plain is not None else grads)
        per_step.append(_full_params(engine, named))
        ref_steps.append(ref.parameters())
        if flat is not None:
            flat.step(plain if plain is not None else grads)
    return per_step, ref_steps


def _model(case: OptCase, dev: torch.device) -> nn.Module:
    """The cell's model on the device; a zinit cell's built under ``deepspeed.zero.Init``."""
    if not case.zinit:
        return MLP(bias=not case.plain).to(dev)
    import deepspeed

    with deepspeed.zero.Init(config_dict_or_path=config(case, hyperparameters(case))):
        return MLP(bias=not case.plain)


def train_optimizer(case: OptCase, tamper: str | None = None,
                    save_dir: str | None = None) -> dict[str, Any]:
    """Rank entry point: train the cell's engine and its reference side by side.

    Returns {"rank", "class": the optimizer class DeepSpeed built, "params": [engine params per
    step], "reference": [reference params per step], "state" / "reference_state": the optimizer
    state after the last step}. With ``case.resume_at``, the engine is saved after that step
    (under ``save_dir``), a fresh engine loads it and trains on; the reference never stops."""
    from dsconform.suite import compat, device, rank, seed_everything

    if case.kind == "muon":
        # The cells but the plain ones hand Muon parameter groups; a plain cell on ZeRO is held
        # to the tolerance of Newton-Schulz in fp16/fp32 (stage 0 runs none before 0.19.7).
        for feature in (compat.MUON, *(() if case.plain else (compat.MUON_GROUPS,)),
                        *((compat.MUON_GRAM_NS,) if case.plain and case.stage else ()),
                        *((compat.MUON_ZERO3,) if case.stage == 3 else ())):
            compat.require(feature)
    seed_everything(case.seed)
    dev = device()
    model = _model(case, dev)
    saved = _tamper_muon(tamper)
    engine = _engine(case, model, tamper)
    try:
        named = list(engine.module.named_parameters())
        built = type(engine.basic_optimizer).__name__
        ref = Reference(case.kind, reference_groups(case), _full_params(engine, named),
                        hyperparameters(case))
        # ZeRO hands FusedLamb flat partitions: LAMB with one trust ratio per partition, to
        # name that behaviour where the cell departs from LAMB (test_optimizers.judge).
        flat = Reference(case.kind, reference_groups(case), _full_params(engine, named),
                         hyperparameters(case), flat_partitions=(case.stage, case.world_size)) \
            if case.kind == "lamb" and case.stage > 0 else None
        kernel_ratios = [] if flat is not None else None
        split = case.resume_at or case.steps
        params, reference = _train(engine, case, ref, 0, split, dev, flat, kernel_ratios)
        if case.resume_at:
            engine.save_checkpoint(save_dir, tag="resume")
            engine.destroy()
            seed_everything(case.seed + 1)  # a fresh engine, other initial weights
            engine = _engine(case, _model(case, dev), tamper)
            engine.load_checkpoint(save_dir, tag="resume")
            named = list(engine.module.named_parameters())
            more, more_ref = _train(engine, case, ref, split, case.steps, dev, flat,
                                    kernel_ratios)
            params, reference = params + more, reference + more_ref
        state, state_errors = _full_state(engine, named, case.state_keys())
        return {"rank": rank(), "class": built, "params": params,
                "reference": reference, "state": state, "state_errors": state_errors,
                "flat_partition_params": None if flat is None else flat.parameters(),
                "trust_ratios": None if flat is None else
                {"kernel": kernel_ratios, **{k: [r[k] for r in flat.ratios]
                                             for k in ("flat", "per_tensor")}},
                "reference_state": ref.optimizer_state(case.state_keys())}
    finally:
        _restore_muon(saved)
        engine.destroy()
        del engine
