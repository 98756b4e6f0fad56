"""Rank functions for the loss-scaling project tests: the suite's own rank code, run on the CPU
accelerator with fp16 allowed, as is or with one real DeepSpeed object perturbed.

DeepSpeed refuses fp16 engines on a CPU without oneDNN fp16 (``is_fp16_supported()`` is false on
the CI machine) although torch's CPU kernels compute in fp16 fine. The project tests lift that one
refusal, inside the rank and for the duration of one call, so that the real fp16 engine (the real
optimizer wrappers, scaler, overflow check, skip path and reductions over gloo) runs on CPU. The
suite itself never does this: on a node, fp16 is either supported or skipped with its reason.

Each perturbation patches a real DeepSpeed class in the rank process and restores it afterwards
(the pooled rank serves later tests).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from suites import loss_scaling_ranks as ranks


@contextlib.contextmanager
def _patched(owner: type, name: str, value: Any) -> Iterator[None]:
    """``owner.name = value`` for the duration; an inherited attribute is un-shadowed after."""
    own = name in owner.__dict__
    original = owner.__dict__.get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


@contextlib.contextmanager
def cpu_fp16() -> Iterator[None]:
    """DeepSpeed's CPU accelerator answers "fp16 supported" (only the answer changes)."""
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    original = accel.is_fp16_supported
    accel.is_fp16_supported = lambda: True
    try:
        yield
    finally:
        accel.is_fp16_supported = original


# --- perturbations of the real thing --------------------------------------------------------

def _never_lowers() -> contextlib.AbstractContextManager:
    """DynamicLossScaler.update_scale keeps the scale on overflow (it still counts hysteresis,
    iterations and raises): the scaler never lowers its scale."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    original = DynamicLossScaler.update_scale

    def update_scale(self, overflow):
        scale = self.cur_scale
        original(self, overflow)
        if overflow:
            self.cur_scale = scale

    return _patched(DynamicLossScaler, "update_scale", update_scale)


def _step_inner_on_zero_grads(wrapper: Any) -> None:
    """Run the wrapper's inner optimizer on zeroed gradients, as a buggy skip would: SGD's
    momentum still moves the fp32 masters."""
    masters = [p for group in wrapper.optimizer.param_groups for p in group["params"]]
    for p in masters:
        p.grad = torch.zeros_like(p)
    wrapper.optimizer.step()
    for p in masters:
        p.grad = None


def _skip_still_steps() -> contextlib.AbstractContextManager:
    """ZeRO 1/2's skip path still runs the inner optimizer (with zeroed gradients, as a buggy
    skip would): SGD's momentum then moves the fp32 masters although the step was skipped."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    original = DeepSpeedZeroOptimizer.step

    def step(self, closure=None):
        result = original(self, closure)
        if self.overflow:
            _step_inner_on_zero_grads(self)
        return result

    return _patched(DeepSpeedZeroOptimizer, "step", step)


def _clean_step_dropped() -> contextlib.AbstractContextManager:
    """ZeRO 1/2 drops the first clean step after an overflow (a stale overflow flag): the step
    is reported applied but changes nothing."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    original = DeepSpeedZeroOptimizer.step

    def step(self, closure=None):
        if getattr(self, "_dsconform_after_overflow", False):
            self._dsconform_after_overflow = False
            self.zero_grad(set_to_none=True)
            for k in self.averaged_gradients:
                self.averaged_gradients[k] = None
            self._update_scale(False)
            self.overflow = False
            return None
        result = original(self, closure)
        self._dsconform_after_overflow = bool(self.overflow)
        return result

    return _patched(DeepSpeedZeroOptimizer, "step", step)


def _rank0_steps_alone() -> contextlib.AbstractContextManager:
    """Stage 0: every rank votes "overflow" and skips, but rank 0 then runs its inner optimizer
    anyway (zeroed gradients; SGD's momentum moves its replica): the ranks no longer agree and
    their replicated fp32 masters part. No collective is left unmatched."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    original = FP16_UnfusedOptimizer.step

    def step(self, closure=None):
        result = original(self, closure)
        if self.overflow and torch.distributed.get_rank() == 0:
            _step_inner_on_zero_grads(self)
        return result

    return _patched(FP16_UnfusedOptimizer, "step", step)


def _static_scale_moves() -> contextlib.AbstractContextManager:
    """The static LossScaler halves its scale on overflow like a dynamic one."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    def update_scale(self, overflow):
        if overflow:
            self.cur_scale /= 2.0

    return _patched(LossScaler, "update_scale", update_scale)


def _silent_floor() -> contextlib.AbstractContextManager:
    """DynamicLossScaler holds min_loss_scale silently instead of ending the run."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    original = DynamicLossScaler.update_scale

    def update_scale(self, overflow):
        self.raise_error_at_min_scale = False
        return original(self, overflow)

    return _patched(DynamicLossScaler, "update_scale", update_scale)


def _bf16_gets_scaler() -> contextlib.AbstractContextManager:
    """ZeRO 1/2 gives a bf16 run a dynamic loss scaler after all."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    original = DeepSpeedZeroOptimizer.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.dtype == torch.bfloat16:
            self.loss_scaler = DynamicLossScaler(init_scale=2.0**16, scale_window=1000,
                                                 min_scale=1, delayed_shift=2,
                                                 consecutive_hysteresis=False)

    return _patched(DeepSpeedZeroOptimizer, "__init__", __init__)


def _bf16_poisoned() -> contextlib.AbstractContextManager:
    """ZeRO 1/2's fifth step writes NaN into this rank's fp32 master partition."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    original = DeepSpeedZeroOptimizer.step

    def step(self, closure=None):
        result = original(self, closure)
        self._dsconform_steps = getattr(self, "_dsconform_steps", 0) + 1
        if self._dsconform_steps == 5:
            for flat in self.single_partition_of_fp32_groups:
                flat.data.fill_(float("nan"))
        return result

    return _patched(DeepSpeedZeroOptimizer, "step", step)


def _unscale_with_backward_scale() -> contextlib.AbstractContextManager:
    """DS-8588 fixed, for the project's tests: ZeRO 1/2's step unscales the gradients by the
    scale backward used (the one before _update_scale), as it already does for the norm."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    original_update, original_unscale = (DeepSpeedZeroOptimizer._update_scale,
                                         DeepSpeedZeroOptimizer.unscale_and_clip_grads)

    def _update_scale(self, has_overflow=False):
        self._dsconform_backward_scale = self.loss_scale
        return original_update(self, has_overflow)

    def unscale_and_clip_grads(self, grad_groups_flat, total_norm):
        updated = self.loss_scale
        self.loss_scaler.cur_scale = getattr(self, "_dsconform_backward_scale", updated)
        try:
            return original_unscale(self, grad_groups_flat, total_norm)
        finally:
            self.loss_scaler.cur_scale = updated

    stack = contextlib.ExitStack()
    stack.enter_context(_patched(DeepSpeedZeroOptimizer, "_update_scale", _update_scale))
    stack.enter_context(_patched(DeepSpeedZeroOptimizer, "unscale_and_clip_grads",
                                 unscale_and_clip_grads))
    return stack


PERTURBATIONS = {
    "unscale_with_backward_scale": _unscale_with_backward_scale,
    "never_lowers": _never_lowers,
    "skip_still_steps": _skip_still_steps,
    "clean_step_dropped": _clean_step_dropped,
    "rank0_steps_alone": _rank0_steps_alone,
    "static_scale_moves": _static_scale_moves,
    "silent_floor": _silent_floor,
    "bf16_gets_scaler": _bf16_gets_scaler,
    "bf16_poisoned": _bf16_poisoned,
}


def _perturbation(name: str | None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if name is None else PERTURBATIONS[name]()


# --- rank entry points ----------------------------------------------------------------------

def train_with_overflows(case: ranks.ScalingCase, perturb: str | None = None,
                         lr_factor: float = 1.0) -> dict[str, Any]:
    """The suite's engine run on CPU in fp16, optionally with one perturbation (or DeepSpeed's
    lr times ``lr_factor``)."""
    with cpu_fp16(), _perturbation(perturb):
        return ranks.train_with_overflows(case, lr_factor=lr_factor)


def scaler_trace(settings: dict[str, Any], overflows: list[bool],
                 perturb: str | None = None) -> list[dict[str, Any]]:
    """The suite's scaler trace with one perturbation of the real DynamicLossScaler."""
    with _perturbation(perturb):
        return ranks.scaler_trace(settings, overflows)


def train_curve(case: ranks.CurveCase) -> dict[str, Any]:
    """The suite's convergence run on CPU in fp16."""
    with cpu_fp16():
        return ranks.train_curve(case)


def train_bf16(stage: int, world_size: int, perturb: str | None = None) -> dict[str, Any]:
    """The suite's bf16 run (no fp16 needed), optionally with one perturbation."""
    with _perturbation(perturb):
        return ranks.train_bf16(stage, world_size)


def adapter_views() -> dict[str, dict[str, Any]]:
    """read_scaler on each real holder of scaler state that an engine here cannot build
    cheaply: bare scalers as CreateLossScaler makes them, and stage 0's two fp16 wrappers
    constructed directly around torch SGD on fp16 parameters (FP16_Optimizer is what the engine
    builds for FusedAdam, whose op would JIT-build for 40 s here)."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler, LossScaleConfig
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    from dsconform.checks.lossscale import read_scaler

    args = {"init_scale": 256, "scale_window": 2, "delayed_shift": 2,
            "consecutive_hysteresis": False, "min_scale": 1}
    views = {"dynamic": CreateLossScaler(torch.float16, 0, True, args),
             "static": CreateLossScaler(torch.float16, 1024.0, False, None),
             "bf16": CreateLossScaler(torch.bfloat16, 0, False, None)}

    def sgd() -> torch.optim.Optimizer:
        params = [torch.nn.Parameter(torch.randn(8, dtype=torch.float16)) for _ in range(2)]
        return torch.optim.SGD(params, lr=0.1)

    with cpu_fp16():
        views["FP16_Optimizer"] = FP16_Optimizer(sgd(), loss_scale_config=LossScaleConfig(
            torch.float16, True, 1.0, args, initial_dynamic_scale=256), verbose=False)
        views["FP16_UnfusedOptimizer"] = FP16_UnfusedOptimizer(
            sgd(), loss_scale_config=LossScaleConfig(torch.float16, False, 1024.0, None),
            verbose=False)
        views["FP16_UnfusedOptimizer_bf16"] = FP16_UnfusedOptimizer(
            sgd(), loss_scale_config=LossScaleConfig(torch.bfloat16, True, 1.0, args),
            low_precision_dtype=torch.bfloat16, verbose=False)
    return {name: read_scaler(obj).to_dict() for name, obj in views.items()}
