"""Code that runs inside the ranks of suites/test_loss_scaling.py.

Three entry points:

* ``scaler_trace``: builds DeepSpeed's own loss scaler exactly as ZeRO stages 1-3 build it
  (``CreateLossScaler`` with the arguments ``deepspeed.initialize`` derives from the config) and
  steps it through a sequence of overflow flags. DeepSpeed's scaler logs through
  ``deepspeed.comm``, so it needs an initialised process group: that is why it runs in a rank.
* ``train_with_overflows``: trains a small MLP with the DeepSpeed engine, injects inf or NaN at
  chosen steps on one rank (into the loss, or into one element of one parameter's gradient), and
  records after every step what the scaler, the engine's skip counter, this rank's optimizer
  partition and the gathered fp32 parameters did, for the parent to hold against the model,
  and the parameters of an fp32 replica trained beside it (``Replica``) after every step.
* ``train_curve``: trains the same regression task in fp32 and in a low-precision dtype from the
  same weights and data and returns both loss curves (and, every step, the scaler's state).

Ranks are pooled and reused: every call seeds itself, and destroys its engines before returning.
"""

from __future__ import annotations

import functools
import gc
import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

# MLP: the ZeRO suite's model, one definition
from dsconform.suite import MLP, TORCH_DTYPES, ScalerSettings, compat, ds_config, read_scaler

# Named scaler configurations of the engine matrix, each with the overflow pattern (one flag per
# optimizer step) that exercises it. Initial scales are small enough (2**8) that the tiny model
# never overflows by itself: only the injected steps overflow.
SCALERS: dict[str, tuple[ScalerSettings, tuple[int, ...]]] = {
    # Every overflow lowers the scale; the window raises it again after three clean steps.
    "h1": (ScalerSettings(initial_scale_power=8, loss_scale_window=2, hysteresis=1),
           (0, 0, 1, 0, 0, 0, 1, 1, 0, 0)),
    # DeepSpeed's default hysteresis: the sequence measured on ZeRO 1-3
    # (docs/findings.md#loss-scaling).
    "h2": (ScalerSettings(initial_scale_power=8, loss_scale_window=2, hysteresis=2),
           (0, 1, 1, 0, 0, 0, 1, 1, 1)),
    # Every clean step refills the budget: isolated overflows never lower the scale, two in a
    # row do (with "h2" semantics the second isolated one would).
    "h2c": (ScalerSettings(initial_scale_power=8, loss_scale_window=2, hysteresis=2,
                           consecutive_hysteresis=True),
            (0, 1, 0, 1, 0, 1, 1, 0)),
    # A static scale: overflows are skipped, the scale never moves.
    "static": (ScalerSettings(loss_scale=1024.0), (0, 1, 0, 1, 1, 0)),
    # Down to the floor: 4 -> 2 -> 1, and the next overflow at 1 must end the run.
    "floor": (ScalerSettings(initial_scale_power=2, loss_scale_window=1000, hysteresis=1,
                             min_loss_scale=1.0),
              (0, 1, 1, 1, 0)),
}
INJECTIONS = ("loss_inf", "loss_nan", "grad_inf", "grad_nan")


@dataclass(frozen=True)
class ScalingCase:
    """One cell of the engine matrix; everything a rank needs to reproduce it."""
    stage: int
    world_size: int
    scaler: str = "h1"
    inject: str = "loss_inf"
    optimizer: str = "sgd"
    seed: int = 1234
    width: int = 53          # odd: ZeRO pads every partition on two ranks
    lr: float = 0.05
    micro_batch: int = 4
    d_in: int = 13
    d_out: int = 7

    def __post_init__(self) -> None:
        if self.scaler not in SCALERS:
            raise ValueError(f"ScalingCase(scaler={self.scaler!r}): one of {sorted(SCALERS)}")
        if self.inject not in INJECTIONS:
            raise ValueError(f"ScalingCase(inject={self.inject!r}): one of {INJECTIONS}")

    @property
    def settings(self) -> ScalerSettings:
        return SCALERS[self.scaler][0]

    @property
    def pattern(self) -> tuple[bool, ...]:
        return tuple(bool(f) for f in SCALERS[self.scaler][1])

    @property
    def inject_rank(self) -> int:
        """The one rank that injects: the last, so rank 0 (which logs) sees only the others'."""
        return self.world_size - 1

    @property
    def id(self) -> str:
        return f"z{self.stage}-ws{self.world_size}-{self.scaler}-{self.inject}-{self.optimizer}"

    def config(self) -> dict[str, Any]:
        momentum = 0.9 if self.optimizer == "sgd" else 0.0
        lr = self.lr if self.optimizer == "sgd" else 1e-3
        return ds_config(stage=self.stage, dtype="fp16", optimizer=self.optimizer, lr=lr,
                         micro_batch=self.micro_batch, grad_accum=1, world_size=self.world_size,
                         gradient_clipping=0.0, momentum=momentum,
                         **self.settings.ds_config_kwargs())

    def params(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class CurveCase:
    """A convergence run: the same task in fp32 and in ``dtype`` (fp16 dynamic scaling with
    DeepSpeed's defaults, or bf16)."""
    stage: int
    dtype: str
    world_size: int = 2
    steps: int = 200
    seed: int = 4321
    width: int = 64
    lr: float = 0.05
    micro_batch: int = 32
    d_in: int = 16
    d_out: int = 4
    settings: ScalerSettings = field(default_factory=ScalerSettings)

    @property
    def id(self) -> str:
        return f"z{self.stage}-{self.dtype}-ws{self.world_size}"

    def config(self, dtype: str) -> dict[str, Any]:
        scaler = self.settings.ds_config_kwargs() if dtype == "fp16" else {}
        return ds_config(stage=self.stage, dtype=dtype, optimizer="sgd", lr=self.lr,
                         micro_batch=self.micro_batch, grad_accum=1, world_size=self.world_size,
                         gradient_clipping=0.0, momentum=0.9, **scaler)

    def params(self) -> dict[str, Any]:
        d = asdict(self)
        d["settings"] = self.settings.describe()
        return d




# ---------------------------------------------------------------------------------------------
# DeepSpeed's own scaler, driven directly
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=256)
def _scaler_arguments(settings: ScalerSettings) -> tuple[float, bool, dict[str, Any]]:
    """What ``deepspeed.initialize`` hands ZeRO for these settings (``engine.loss_scale()``,
    ``dynamic_loss_scale()``, ``dynamic_loss_scale_args()``), parsed by DeepSpeed from the config
    ``ds_config`` writes. Cached: parsing a DeepSpeedConfig takes ~0.1 s, a replay step ~0."""
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = ds_config(stage=2, dtype="fp16", optimizer="sgd", lr=0.1, micro_batch=1, grad_accum=1,
                    world_size=1, **settings.ds_config_kwargs())
    return compat.fp16_scaler_args(DeepSpeedConfig(cfg))


def build_zero_scaler(settings: dict[str, Any]) -> Any:
    """A fresh DeepSpeed scaler as ZeRO stages 1-3 build it: ``CreateLossScaler`` with the
    arguments ``deepspeed.initialize`` derives from the config."""
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler

    static, dynamic, args = _scaler_arguments(ScalerSettings(**settings))
    return CreateLossScaler(dtype=torch.float16, static_loss_scale=static,
                            dynamic_scaling=dynamic, dynamic_loss_args=dict(args))


def scaler_trace(settings: dict[str, Any], overflows: list[bool]) -> list[dict[str, Any]]:
    """Rank entry point: a fresh scaler stepped through ``overflows``; per step the scale it
    held before the step, the error it raised (if any: the run ends there) and its state after.
    Stateless (replayed from scratch on every call), so a restarted pool changes nothing."""
    ds_logger = logging.getLogger("DeepSpeed")
    level = ds_logger.level
    # One "OVERFLOW!" line (INFO for the dynamic scaler, WARNING for the static one) per
    # replayed step would flood the output.
    ds_logger.setLevel(logging.ERROR)
    try:
        scaler = build_zero_scaler(settings)
        trace = []
        for flag in overflows:
            before = read_scaler(scaler).scale
            error = None
            try:
                scaler.update_scale(bool(flag))
            except Exception as exc:  # DeepSpeed raises a bare Exception at the floor
                error = f"{type(exc).__name__}: {exc}"
            trace.append({"scale_used": before, "error": error,
                          "state": read_scaler(scaler).to_dict()})
            if error:
                break
        return trace
    finally:
        ds_logger.setLevel(level)


# ---------------------------------------------------------------------------------------------
# The engine, with injected overflows
# ---------------------------------------------------------------------------------------------

def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN equals the same NaN; -0.0 differs from 0.0)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _inner_optimizer(engine: Any) -> Any:
    # Every DeepSpeed wrapper (FP16_*, ZeRO 1/2/3, BF16_Optimizer) holds the torch optimizer
    # that owns this rank's fp32 masters and moments as .optimizer.
    opt = engine.optimizer
    return getattr(opt, "optimizer", opt)


def local_state(engine: Any) -> dict[str, torch.Tensor]:
    """Everything this rank keeps that an optimizer step may change: the fp32 masters and the
    optimizer state of its partition (step counts included) and its low-precision module
    parameters (its ZeRO-3 partition ``ds_tensor``). Cloned."""
    inner = _inner_optimizer(engine)
    out: dict[str, torch.Tensor] = {}
    for gi, group in enumerate(inner.param_groups):
        if "step" in group:  # FusedAdam counts steps per group
            out[f"group{gi}.step"] = torch.tensor(float(group["step"]))
        for pi, p in enumerate(group["params"]):
            out[f"master{gi}.{pi}"] = p.detach().clone()
            for key, value in inner.state.get(p, {}).items():
                name = f"state{gi}.{pi}.{key}"
                out[name] = (value.detach().clone() if torch.is_tensor(value)
                             else torch.tensor(float(value)))
    for name, p in engine.module.named_parameters():
        held = p.ds_tensor if hasattr(p, "ds_tensor") else p
        out[f"module.{name}"] = held.detach().clone()
    return out


def changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors are not bit-identical, with the largest difference."""
    out = []
    for name in sorted(set(before) | set(after)):
        a, b = before.get(name), after.get(name)
        if a is None or b is None:
            out.append(f"{name} (appeared or vanished)")
        elif not bits_equal(a, b):
            diff = (a.double() - b.double()).abs()
            worst = float(diff.nan_to_num(nan=math.inf).max()) if diff.numel() else 0.0
            out.append(f"{name} (max abs diff {worst:.3g})")
    return out


def full_masters(engine: Any) -> dict[str, torch.Tensor]:
    """The full fp32 master weights, by parameter name, on every rank (collective on ZeRO:
    every rank calls it, in the same order). Stage 0's FP16 wrappers keep full masters per rank
    (no ``safe_get_full_fp32_param`` mapping): read from their groups."""
    from deepspeed.utils import safe_get_full_fp32_param
    from torch._utils import _unflatten_dense_tensors

    opt = engine.optimizer
    by_id: dict[int, torch.Tensor] = {}
    if hasattr(opt, "fp16_groups") and hasattr(opt, "fp32_groups"):  # FP16_UnfusedOptimizer
        for g16, g32 in zip(opt.fp16_groups, opt.fp32_groups):
            by_id.update({id(p16): p32 for p16, p32 in zip(g16, g32)})
    elif hasattr(opt, "fp16_groups") and hasattr(opt, "fp32_groups_flat"):  # FP16_Optimizer
        for g16, flat in zip(opt.fp16_groups, opt.fp32_groups_flat):
            by_id.update({id(p16): p32 for p16, p32
                          in zip(g16, _unflatten_dense_tensors(flat, g16))})
    out = {}
    for name, p in engine.module.named_parameters():
        full = by_id.get(id(p))
        if full is None:
            full = safe_get_full_fp32_param(p)
        if full is None:
            raise RuntimeError(f"no fp32 master found for {name} in {type(opt).__name__}: "
                               f"teach suites/loss_scaling_ranks.py full_masters where it is")
        out[name] = full.detach().to("cpu", torch.float32).clone()
    return out


def _inject_grad_hook(value: float, armed: list[bool]):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        if not armed[0]:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = value
        return grad
    return hook


def _data(seed: int, rank: int, steps: int, micro_batch: int, d_in: int, d_out: int):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return [(torch.randn(micro_batch, d_in, generator=g), torch.randn(micro_batch, d_out,
                                                                         generator=g))
            for _ in range(steps)]


def _skip_unless_fp16(accelerator_name: str) -> None:
    import pytest
    from deepspeed.accelerator import get_accelerator

    if not get_accelerator().is_fp16_supported():
        # Decided identically on every rank. DeepSpeed's CPU accelerator needs oneDNN fp16
        # (AVX512-FP16/AMX); without it deepspeed.initialize refuses fp16.
        pytest.skip(f"Requires: [fp16 (found {accelerator_name} accelerator without fp16 "
                    f"support)]")


class Replica:
    """The run as the model says it should go, in plain torch fp32 on the CPU: the engine's
    initial fp32 masters, every rank's batches at once (the mean of the ranks' losses, whose
    gradient is the mean DeepSpeed reduces to), the torch optimizer the config names with its
    parameters, and a step only where the model applies one (a clean step: every injected
    step is skipped or ends the run). The engine's gathered masters are held against it after
    every applied step (``Tol.update``, ``Tol.gain``), so a step that is applied with the wrong
    size (a loss scale that is not undone, a gradient not averaged) fails."""

    def __init__(self, case: ScalingCase, init: dict[str, torch.Tensor]) -> None:
        self.case = case
        self.model = MLP(case.d_in, case.width, case.d_out)
        self.model.load_state_dict(init)
        self.data = [_data(case.seed, r, len(case.pattern), case.micro_batch, case.d_in,
                           case.d_out) for r in range(case.world_size)]
        params = dict(case.config()["optimizer"]["params"])
        if case.optimizer == "sgd":
            self.opt = torch.optim.SGD(self.model.parameters(), lr=params["lr"],
                                       momentum=params["momentum"],
                                       dampening=params["dampening"],
                                       nesterov=params["nesterov"],
                                       weight_decay=params["weight_decay"])
        else:  # "Adam" with adam_w_mode false: torch Adam is its reference (the ops suite)
            self.opt = torch.optim.Adam(self.model.parameters(), lr=params["lr"],
                                        betas=tuple(params["betas"]), eps=params["eps"],
                                        weight_decay=params["weight_decay"])

    def step(self, i: int) -> dict[str, torch.Tensor]:
        """Step ``i`` (nothing where the pattern overflows); the parameters after it."""
        if not self.case.pattern[i]:
            self.opt.zero_grad(set_to_none=True)
            losses = [F.mse_loss(self.model(x), y) for x, y in (d[i] for d in self.data)]
            torch.stack(losses).mean().backward()
            self.opt.step()
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


def train_with_overflows(case: ScalingCase, lr_factor: float = 1.0) -> dict[str, Any]:
    """Rank entry point: train ``len(case.pattern)`` steps, injecting at the pattern's steps on
    ``case.inject_rank``, and record every step (see the module docstring) with the replica's
    parameters after it (``Replica``). ``lr_factor`` != 1 is a fault injection for the project's
    red tests: DeepSpeed's optimizer gets the config's lr times it, the replica the config's."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from dsconform.suite import device, gather, rank, seed_everything

    _skip_unless_fp16(get_accelerator().device_name())
    seed_everything(case.seed)
    dev = torch.device(device())
    model = MLP(case.d_in, case.width, case.d_out)
    data = _data(case.seed, rank(), len(case.pattern), case.micro_batch, case.d_in, case.d_out)
    config = case.config()
    if lr_factor != 1.0:
        config["optimizer"]["params"]["lr"] *= lr_factor
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    hook_handle = None
    try:
        injecting = rank() == case.inject_rank
        kind, what = case.inject.split("_")
        value = math.inf if what == "inf" else math.nan
        armed = [False]
        if kind == "grad" and injecting:
            # One element of one weight's gradient, as autograd delivers it (before DeepSpeed's
            # own hooks accumulate, reduce and partition it).
            target = dict(engine.module.named_parameters())["fc2.weight"]
            hook_handle = target.register_hook(_inject_grad_hook(value, armed))
        steps = []
        masters = init = full_masters(engine)
        replica = Replica(case, init)
        for i, (x, y) in enumerate(data):
            inject = injecting and case.pattern[i]
            before = read_scaler(engine.optimizer)
            local_before = local_state(engine)
            skipped_before = engine.skipped_steps
            out = engine(x.to(dev, torch.float16))
            loss = F.mse_loss(out.float(), y.to(dev))
            loss_value = loss.item()
            if inject and kind == "loss":
                loss = loss * value
            armed[0] = bool(inject and kind == "grad")
            error = None
            try:
                engine.backward(loss)
                engine.step()
            except Exception as exc:  # DeepSpeed ends a run at the floor with a bare Exception
                error = f"{type(exc).__name__}: {exc}"
            armed[0] = False
            # Every rank learns whether any rank's step raised, so none runs on into a
            # collective the others have left.
            any_error = any(e is not None for e in gather(error))
            record: dict[str, Any] = {
                "step": i, "injected": bool(inject), "loss": loss_value,
                "scale_used": before.scale, "error": error,
                "state": read_scaler(engine.optimizer).to_dict(),
                "skipped": engine.skipped_steps - skipped_before,
                "local_changed": changed(local_before, local_state(engine)),
            }
            if any_error:
                steps.append(record)
                break
            new_masters = full_masters(engine)
            record["masters"] = new_masters
            record["masters_unchanged"] = [n for n in masters
                                           if bits_equal(masters[n], new_masters[n])]
            record["replica"] = replica.step(i)
            masters = new_masters
            steps.append(record)
        return {"rank": rank(), "wrapper": type(engine.optimizer).__name__, "init": init,
                "steps": steps}
    finally:
        if hook_handle is not None:
            hook_handle.remove()
        engine.destroy()
        del engine
        gc.collect()


# ---------------------------------------------------------------------------------------------
# bf16: no scaler, finite training
# ---------------------------------------------------------------------------------------------

def train_bf16(stage: int, world_size: int, steps: int = 12) -> dict[str, Any]:
    """Rank entry point: bf16 training on the convergence task (its loss falls fast at first);
    per step the scaler state as the adapter reads it, the loss, the engine's skip counter and
    whether the gathered fp32 masters are finite."""
    import deepspeed

    from dsconform.suite import device, rank, seed_everything

    case = CurveCase(stage=stage, dtype="bf16", world_size=world_size, steps=steps)
    seed_everything(case.seed)
    dev = torch.device(device())
    model = MLP(case.d_in, case.width, case.d_out)
    data = _curve_data(case, rank())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=case.config("bf16"))
    try:
        records = []
        for x, y in data:
            out = engine(x.to(dev, torch.bfloat16))
            loss = F.mse_loss(out.float(), y.to(dev))
            engine.backward(loss)
            engine.step()
            masters = full_masters(engine)
            records.append({"loss": loss.item(), "state": read_scaler(engine.optimizer).to_dict(),
                            "skipped": engine.skipped_steps,
                            "masters_finite": all(bool(torch.isfinite(t).all())
                                                  for t in masters.values())})
        return {"rank": rank(), "wrapper": type(engine.optimizer).__name__, "steps": records}
    finally:
        engine.destroy()
        del engine
        gc.collect()


# ---------------------------------------------------------------------------------------------
# Convergence
# ---------------------------------------------------------------------------------------------

def _curve_data(case: CurveCase, rank: int):
    """A teacher network's outputs plus a little noise: a task every precision can learn (fp32
    SGD goes from about 0.2 to 0.035 in 200 steps), with a noise floor (1e-4) none reaches."""
    g = torch.Generator().manual_seed(case.seed)
    teacher = MLP(case.d_in, case.width, case.d_out)
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    g = torch.Generator().manual_seed(case.seed * 1000 + rank)
    batches = []
    with torch.no_grad():
        for _ in range(case.steps):
            x = torch.randn(case.micro_batch, case.d_in, generator=g)
            y = teacher(x) + 0.01 * torch.randn(case.micro_batch, case.d_out, generator=g)
            batches.append((x, y))
    return batches


def _train_one_curve(case: CurveCase, dtype: str, weights: dict, data, dev) -> dict[str, Any]:
    import deepspeed

    model = MLP(case.d_in, case.width, case.d_out)
    model.load_state_dict(weights)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=case.config(dtype))
    try:
        losses, scales = [], []
        for x, y in data:
            out = engine(x.to(dev, TORCH_DTYPES[dtype]))
            loss = F.mse_loss(out.float(), y.to(dev))
            losses.append(loss.item())
            engine.backward(loss)
            engine.step()
            scales.append(read_scaler(engine.optimizer).scale)
        return {"losses": losses, "scales": scales, "skipped": engine.skipped_steps,
                "wrapper": type(engine.optimizer).__name__}
    finally:
        engine.destroy()
        del engine
        gc.collect()


def train_curve(case: CurveCase) -> dict[str, Any]:
    """Rank entry point: the fp32 curve and the ``case.dtype`` curve of the same run."""
    from deepspeed.accelerator import get_accelerator

    from dsconform.suite import device, rank, seed_everything

    if case.dtype == "fp16":
        _skip_unless_fp16(get_accelerator().device_name())
    seed_everything(case.seed)
    dev = torch.device(device())
    weights = MLP(case.d_in, case.width, case.d_out).state_dict()
    data = _curve_data(case, rank())
    fp32 = _train_one_curve(case, "fp32", weights, data, dev)
    low = _train_one_curve(case, case.dtype, weights, data, dev)
    return {"rank": rank(), "fp32": fp32, case.dtype: low}


def overflow_flags(overflows: list[bool]) -> str:
    """A pattern of steps as text: X an overflowing step, . a clean one."""
    return "".join("X" if f else "." for f in overflows)
