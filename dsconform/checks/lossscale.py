"""fp16 loss scaling: a reference model of DeepSpeed's documented semantics, and the ONE adapter
that reads a loss scaler's state from whichever DeepSpeed object holds it.

The model (``ScalerModel``) is written from DeepSpeed's configuration documentation
(https://www.deepspeed.ai/docs/config-json/#fp16-training-options) and, where the documentation
is silent (when exactly the window raises the scale, what happens at the floor), from the
behaviour of ``deepspeed/runtime/fp16/loss_scaler.py`` ``DynamicLossScaler`` in 0.19.6 and
0.19.8, which ZeRO stages 1-3 build through ``CreateLossScaler``:

- ``loss_scale`` > 0: a static scale. It never changes; a step whose gradients overflow (inf or
  NaN anywhere, on any rank) is still skipped.
- ``loss_scale`` == 0: dynamic. The scale starts at ``2**initial_scale_power``.
- An overflowing step is skipped. ``hysteresis`` is a budget of tolerated overflows: while more
  than one is left, an overflow spends one and keeps the scale; with one left, the scale is
  divided by the lower factor, but never below ``min_loss_scale``. An overflow when the scale
  already IS ``min_loss_scale`` (and the budget is spent) is an error that ends training
  ("Current loss scale already at minimum"), never an endless run of silent skips.
- A clean step is applied. With ``consecutive_hysteresis`` every clean step refills the budget.
  The scale is multiplied by the raise factor on the clean step that follows
  ``loss_scale_window`` consecutive clean steps, and again every ``loss_scale_window`` clean steps
  while none overflows (DeepSpeed counts the clean steps *before* the current one: the first
  raise after an overflow comes on the ``window + 1``-th clean step). Without
  ``consecutive_hysteresis`` that raise is what refills the budget.
- The raise and lower factors are both 2. DeepSpeed has no configuration key for them
  (``DynamicLossScaler.scale_factor`` and ``LossScaleConfig``'s profiles hard-code 2.0), so the
  model takes them as a setting only to state the assumption; ``ASSUMED_DEFAULTS`` pins it.

The adapter (``read_scaler``) exists because the state lives in different places: ZeRO stages
1-3 keep a ``LossScaler``/``DynamicLossScaler`` in ``optimizer.loss_scaler``; stage 0's
``FP16_Optimizer`` and ``FP16_UnfusedOptimizer`` keep a ``LossScaleConfig`` in
``optimizer.loss_scale_config`` (the unfused one has no ``cur_scale`` attribute at all) and keep
no hysteresis; ``BF16_Optimizer`` has no scaler.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from dsconform.base import compat

#: DeepSpeed's raise and lower factor of the dynamic scale (not configurable; see above).
SCALE_FACTOR = 2.0


@dataclass(frozen=True)
class ScalerSettings:
    """What an fp16 config says about loss scaling (``ds_config``'s arguments of that name),
    plus the two constants DeepSpeed does not let a config change."""
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    scale_factor: float = SCALE_FACTOR
    error_at_min: bool = True

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0

    @property
    def initial_scale(self) -> float:
        return float(2 ** self.initial_scale_power) if self.dynamic else float(self.loss_scale)

    def ds_config_kwargs(self) -> dict[str, Any]:
        """The ``ds_config`` keyword arguments that write these settings into a config."""
        return {"loss_scale": self.loss_scale, "initial_scale_power": self.initial_scale_power,
                "loss_scale_window": self.loss_scale_window, "hysteresis": self.hysteresis,
                "consecutive_hysteresis": self.consecutive_hysteresis,
                "min_loss_scale": self.min_loss_scale}

    @classmethod
    def from_fp16_section(cls, fp16: Mapping[str, Any]) -> ScalerSettings:
        """The settings a DeepSpeed config's ``"fp16"`` section states (missing keys: DeepSpeed's
        documented defaults)."""
        return cls(loss_scale=float(fp16.get("loss_scale", 0.0)),
                   initial_scale_power=int(fp16.get("initial_scale_power", 16)),
                   loss_scale_window=int(fp16.get("loss_scale_window", 1000)),
                   hysteresis=int(fp16.get("hysteresis", 2)),
                   consecutive_hysteresis=bool(fp16.get("consecutive_hysteresis", False)),
                   min_loss_scale=float(fp16.get("min_loss_scale", 1)))

    def describe(self) -> str:
        if not self.dynamic:
            return f"static loss_scale={self.loss_scale:g}"
        return (f"dynamic: initial 2**{self.initial_scale_power}, window "
                f"{self.loss_scale_window}, hysteresis {self.hysteresis}"
                f"{' (consecutive)' if self.consecutive_hysteresis else ''}, min "
                f"{self.min_loss_scale:g}")


@dataclass(frozen=True)
class ModelStep:
    """What the model says one optimizer step does."""
    overflow: bool
    scale_used: float          # the scale this step's loss was multiplied by
    outcome: str               # "applied", "skipped" or "error" (overflow at the floor)
    scale_after: float         # the scale the next step uses (unchanged after an error)
    hysteresis_after: int | None  # overflows still tolerated before lowering (None: static)

    @property
    def skipped(self) -> bool:
        return self.outcome == "skipped"


class ScalerModel:
    """The reference model: feed it each step's overflow flag, it says what must happen."""

    def __init__(self, settings: ScalerSettings) -> None:
        self.settings = settings
        self.scale = settings.initial_scale
        self.hysteresis_left: int | None = settings.hysteresis if settings.dynamic else None
        self.clean_run = 0       # consecutive clean steps since the last overflow (or start)
        self.ended = False       # an overflow at the floor ended the run

    def step(self, overflow: bool) -> ModelStep:
        if self.ended:
            raise RuntimeError("the model's run ended with an overflow at min_loss_scale")
        s, used = self.settings, self.scale
        if not s.dynamic:
            return ModelStep(overflow, used, "skipped" if overflow else "applied", used, None)
        assert self.hysteresis_left is not None
        if overflow:
            self.clean_run = 0
            if self.hysteresis_left > 1:
                self.hysteresis_left -= 1
            elif self.scale == s.min_loss_scale and s.error_at_min:
                self.ended = True
                return ModelStep(True, used, "error", used, self.hysteresis_left)
            else:
                self.scale = max(self.scale / s.scale_factor, s.min_loss_scale)
            return ModelStep(True, used, "skipped", self.scale, self.hysteresis_left)
        if s.consecutive_hysteresis:
            self.hysteresis_left = s.hysteresis
        if self.clean_run > 0 and self.clean_run % s.loss_scale_window == 0:
            self.scale *= s.scale_factor
            if not s.consecutive_hysteresis:
                self.hysteresis_left = s.hysteresis
        self.clean_run += 1
        return ModelStep(False, used, "applied", self.scale, self.hysteresis_left)

    def run(self, overflows: list[bool] | tuple[bool, ...]) -> list[ModelStep]:
        """Every step of a sequence, up to and including an error (which ends the run)."""
        steps = []
        for flag in overflows:
            steps.append(self.step(bool(flag)))
            if self.ended:
                break
        return steps


@dataclass(frozen=True)
class ScalerState:
    """A loss scaler's state as read from a DeepSpeed object, whatever holds it."""
    holder: str                 # the class the state was read from (for messages)
    scale: float | None         # None: this object does no loss scaling at all
    dynamic: bool
    hysteresis_left: int | None  # None where the holder keeps no hysteresis
    overflow: bool | None        # the holder's verdict on its last step, where it keeps one

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_scaler(obj: Any) -> ScalerState:
    """The ONE place that knows where each DeepSpeed object keeps its loss-scaling state.

    ``obj`` is ``engine.optimizer`` (FP16_Optimizer, FP16_UnfusedOptimizer, ZeRO stage 1/2's
    DeepSpeedZeroOptimizer, stage 3's DeepSpeedZeroOptimizer_Stage3, BF16_Optimizer) or a bare
    scaler (LossScaler, DynamicLossScaler). Raises TypeError naming the class when it knows none
    of these layouts, so a new wrapper is named rather than read wrongly.
    """
    name = type(obj).__name__
    overflow = getattr(obj, "overflow", None)
    overflow = None if overflow is None else bool(overflow)
    config = getattr(obj, "loss_scale_config", None)
    if config is not None:
        # Stage 0's FP16 wrappers: a LossScaleConfig, no hysteresis (and the unfused one has no
        # cur_scale attribute of its own).
        if not config.use_grad_scaling:
            return ScalerState(name, None, False, None, overflow)
        return ScalerState(name, float(config.cur_scale), bool(config.dynamic_loss_scale), None,
                           overflow)
    scaler = obj if _is_scaler(obj) else getattr(obj, "loss_scaler", None)
    if scaler is not None and _is_scaler(scaler):
        dynamic = bool(scaler.dynamic)
        hysteresis = int(scaler.cur_hysteresis) if dynamic else None
        return ScalerState(name, float(scaler.cur_scale), dynamic, hysteresis, overflow)
    old = compat.stage0_scaler(obj)  # a release's stage-0 wrapper before LossScaleConfig
    if old is not None:
        return ScalerState(name, old[0], old[1], None, overflow)
    if name == "BF16_Optimizer" or _is_torch_optimizer(obj):
        # bf16 needs no loss scaling; an fp32 stage-0 engine steps the torch optimizer itself.
        return ScalerState(name, None, False, None, overflow)
    raise TypeError(f"read_scaler: {name} keeps no loss-scaling state the suite knows "
                    f"(loss_scale_config, loss_scaler, or a LossScaler itself): teach "
                    f"dsconform/checks/lossscale.py read_scaler where this DeepSpeed version "
                    f"keeps it")


def _is_scaler(obj: Any) -> bool:
    return hasattr(obj, "update_scale") and hasattr(obj, "cur_scale") and hasattr(obj, "dynamic")


def _is_torch_optimizer(obj: Any) -> bool:
    import torch

    return isinstance(obj, torch.optim.Optimizer)
