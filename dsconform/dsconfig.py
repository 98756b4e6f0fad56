"""Every DeepSpeed config the suite uses comes from ONE function, ``ds_config``.

Why one function: a DeepSpeed default that changes the maths (``gradient_clipping`` went from 0.0
to 1.0 between 0.19.0 and 0.19.3, torch AdamW's ``weight_decay`` is 0.01, bf16 overflow checks skip
steps) must never reach a test by omission. ``ds_config`` writes every such value explicitly, and
``ASSUMED_DEFAULTS`` states what the suite believes DeepSpeed's own defaults are, so a suite test
(``suites/test_zero.py::test_effective_defaults``) reports the moment an upgrade moves one.

Upstream reference: https://www.deepspeed.ai/docs/config-json/
"""

from __future__ import annotations

import math
from typing import Any, Mapping

STAGES = (0, 1, 2, 3)
DTYPES = ("fp32", "bf16", "fp16")
# "adam" is torch.optim.Adam built by DeepSpeed (torch_adam); "fused_adam" is DeepSpeed's FusedAdam
# (CUDA kernel on GPUs, the CPU op on the CPU accelerator); "cpu_adam" is DeepSpeedCPUAdam, which
# DeepSpeed picks only when the optimizer is offloaded.
OPTIMIZERS = ("sgd", "adam", "fused_adam", "cpu_adam")
# The DeepSpeed op each optimizer must be able to load (for requires(op=...)).
OPTIMIZER_OPS = {"sgd": None, "adam": None, "fused_adam": "fused_adam", "cpu_adam": "cpu_adam"}

# A steps_per_print larger than any run keeps DeepSpeed's per-step log lines out of test output.
_QUIET_STEPS = 1 << 30


def _fail(argument: str, value: Any, reason: str) -> None:
    raise ValueError(f"ds_config({argument}={value!r}): {reason}")


def validate(*, stage: int, dtype: str, optimizer: str, lr: float, micro_batch: int,
             grad_accum: int, world_size: int, offload_optimizer: bool = False,
             offload_param: bool = False, gradient_clipping: float = 0.0,
             weight_decay: float = 0.0, momentum: float = 0.0,
             betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
             loss_scale: float = 0.0, initial_scale_power: int = 16,
             loss_scale_window: int = 1000, hysteresis: int = 2,
             min_loss_scale: float = 1.0) -> None:
    """Raise ValueError naming the first argument that makes the combination invalid."""
    if stage not in STAGES:
        _fail("stage", stage, f"must be one of {STAGES}")
    if dtype not in DTYPES:
        _fail("dtype", dtype, f"must be one of {DTYPES}")
    if optimizer not in OPTIMIZERS:
        _fail("optimizer", optimizer, f"must be one of {OPTIMIZERS}")
    for name, value in (("micro_batch", micro_batch), ("grad_accum", grad_accum),
                        ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            _fail(name, value, "must be an integer >= 1")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        _fail("lr", lr, "must be a finite number > 0")
    if offload_optimizer and stage == 0:
        _fail("offload_optimizer", offload_optimizer, "needs ZeRO stage 1, 2 or 3 (stage=0)")
    if offload_param and stage != 3:
        _fail("offload_param", offload_param, f"needs ZeRO stage 3 (stage={stage})")
    # DeepSpeed silently swaps FusedAdam for DeepSpeedCPUAdam when the optimizer is offloaded and
    # only builds DeepSpeedCPUAdam then: asking for the other would test something else.
    if optimizer == "fused_adam" and offload_optimizer:
        _fail("optimizer", optimizer, "with offload_optimizer=True DeepSpeed runs cpu_adam")
    if optimizer == "cpu_adam" and not offload_optimizer:
        _fail("optimizer", optimizer, "DeepSpeed uses DeepSpeedCPUAdam only with "
              "offload_optimizer=True (use fused_adam)")
    if not (gradient_clipping >= 0 and math.isfinite(gradient_clipping)):
        _fail("gradient_clipping", gradient_clipping, "must be >= 0 (0 disables clipping)")
    if not (weight_decay >= 0 and math.isfinite(weight_decay)):
        _fail("weight_decay", weight_decay, "must be >= 0")
    if optimizer == "sgd":
        if not 0 <= momentum < 1:
            _fail("momentum", momentum, "must be in [0, 1)")
    elif momentum != 0.0:
        _fail("momentum", momentum, f"applies to optimizer='sgd' only (optimizer={optimizer!r})")
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        _fail("betas", betas, "must be two numbers in [0, 1)")
    if not eps > 0:
        _fail("eps", eps, "must be > 0")
    if dtype != "fp16":
        # Loss scaling is fp16-only in DeepSpeed; a value here would be silently ignored.
        for name, value, default in (("loss_scale", loss_scale, 0.0),
                                     ("initial_scale_power", initial_scale_power, 16),
                                     ("loss_scale_window", loss_scale_window, 1000),
                                     ("hysteresis", hysteresis, 2),
                                     ("min_loss_scale", min_loss_scale, 1.0)):
            if value != default:
                _fail(name, value, f"applies to dtype='fp16' only (dtype={dtype!r})")
    else:
        if not (loss_scale >= 0 and math.isfinite(loss_scale)):
            _fail("loss_scale", loss_scale, "must be >= 0 (0 means dynamic loss scaling)")
        if loss_scale_window < 1:
            _fail("loss_scale_window", loss_scale_window, "must be >= 1")
        if hysteresis < 1:
            _fail("hysteresis", hysteresis, "must be >= 1")
        if not min_loss_scale > 0:
            _fail("min_loss_scale", min_loss_scale, "must be > 0")


def ds_config(*, stage: int, dtype: str, optimizer: str, lr: float, micro_batch: int,
              grad_accum: int, world_size: int, offload_optimizer: bool = False,
              offload_param: bool = False, gradient_clipping: float = 0.0,
              weight_decay: float = 0.0, momentum: float = 0.0,
              betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
              loss_scale: float = 0.0, initial_scale_power: int = 16,
              loss_scale_window: int = 1000, hysteresis: int = 2,
              min_loss_scale: float = 1.0) -> dict[str, Any]:
    """Build a validated DeepSpeed config with every maths-relevant value written out.

    ``loss_scale=0`` means dynamic loss scaling (DeepSpeed's convention); the fp16 scaler
    arguments are written out even then, so an upstream change of their defaults cannot reach
    a test. ``gradient_clipping=0`` disables clipping (plain DDP has none).
    """
    validate(stage=stage, dtype=dtype, optimizer=optimizer, lr=lr, micro_batch=micro_batch,
             grad_accum=grad_accum, world_size=world_size, offload_optimizer=offload_optimizer,
             offload_param=offload_param, gradient_clipping=gradient_clipping,
             weight_decay=weight_decay, momentum=momentum, betas=betas, eps=eps,
             loss_scale=loss_scale, initial_scale_power=initial_scale_power,
             loss_scale_window=loss_scale_window, hysteresis=hysteresis,
             min_loss_scale=min_loss_scale)

    if optimizer == "sgd":
        opt = {"type": "SGD", "params": {"lr": lr, "momentum": momentum, "dampening": 0.0,
                                         "nesterov": False, "weight_decay": weight_decay}}
    else:
        # Type "Adam" builds AdamW unless adam_w_mode is false (ADAM_W_MODE_DEFAULT is True), and
        # torch_adam picks torch.optim.Adam over DeepSpeed's kernels.
        opt = {"type": "Adam", "params": {"lr": lr, "betas": list(betas), "eps": eps,
                                          "weight_decay": weight_decay, "adam_w_mode": False,
                                          "torch_adam": optimizer == "adam"}}

    zero: dict[str, Any] = {"stage": stage}
    if stage > 0:
        # Quantized weights/gradients would change the maths; off is the default, pinned anyway.
        zero.update({"zero_quantized_weights": False, "zero_quantized_gradients": False})
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}

    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch * grad_accum * world_size,
        "steps_per_print": _QUIET_STEPS,
        "wall_clock_breakdown": False,
        # Default 1.0 since 0.19.3 (0.0 before): the reason this module exists.
        "gradient_clipping": gradient_clipping,
        # Gradients are averaged over ranks after the reduction, as DDP does.
        "prescale_gradients": False,
        "gradient_predivide_factor": 1.0,
        # Reduce in the training dtype: what None resolves to today, written out.
        "communication_data_type": dtype,
        # Accumulate gradients in the model dtype: what None resolves to today, written out
        # (fp32 accumulation with bf16 switches stage 0/1 to other optimizer wrappers).
        "data_types": {"grad_accum_dtype": dtype},
        "optimizer": opt,
        "zero_optimization": zero,
        "torch_autocast": {"enabled": False},
    }
    if stage > 0 and optimizer == "sgd":
        # torch SGD is not on DeepSpeed's list of ZeRO-tested optimizers.
        cfg["zero_allow_untested_optimizer"] = True
    if offload_optimizer and optimizer in ("sgd", "adam"):
        # Offloading a torch optimizer is refused unless this is off (for client optimizers).
        cfg["zero_force_ds_cpu_optimizer"] = False
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True, "immediate_grad_update": False,
                       "check_grad_overflow": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "auto_cast": False, "loss_scale": float(loss_scale),
                       "initial_scale_power": initial_scale_power,
                       "loss_scale_window": loss_scale_window, "hysteresis": hysteresis,
                       "consecutive_hysteresis": False, "min_loss_scale": min_loss_scale}
    return cfg


# What the suite assumes DeepSpeed does when a config says nothing, for the installed release
# (0.19.8). Keys are read by ``read_effective_defaults`` from a minimal engine and DeepSpeed's
# parsed config; a change here is an upstream semantic change that needs a note in FINDINGS.
ASSUMED_DEFAULTS: dict[str, Any] = {
    # 0.0 up to 0.19.0, 1.0 from 0.19.3 (FINDINGS): ZeRO then clips where DDP does not.
    "gradient_clipping": 1.0,
    "constants.GRADIENT_CLIPPING_DEFAULT": 1.0,
    # Optimizer type "Adam" builds AdamW, and torch's AdamW decays weights by 0.01.
    "constants.ADAM_W_MODE_DEFAULT": True,
    "adam.optimizer_class": "AdamW",
    "adam.weight_decay": 0.01,
    "adam.betas": (0.9, 0.999),
    "adam.eps": 1e-8,
    "zero_allow_untested_optimizer": False,
    "zero_force_ds_cpu_optimizer": True,
    "prescale_gradients": False,
    "gradient_predivide_factor": 1.0,
    "communication_data_type": None,
    "grad_accum_dtype": None,
    "torch_autocast_enabled": False,
    "fp16.loss_scale": 0.0,
    "fp16.initial_scale_power": 16,
    "fp16.loss_scale_window": 1000,
    "fp16.hysteresis": 2,
    "fp16.consecutive_hysteresis": False,
    "fp16.min_loss_scale": 1,
    "fp16.auto_cast": False,
    "bf16.immediate_grad_update": False,
    "bf16.check_grad_overflow": True,
    "zero.zero_quantized_weights": False,
    "zero.zero_quantized_gradients": False,
}


def defaults_mismatches(expected: Mapping[str, Any], found: Mapping[str, Any]) -> list[str]:
    """One line per key whose effective value differs: ``key: expected X, found Y``."""
    lines = []
    for key, want in expected.items():
        got = found.get(key, "<missing>")
        if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
            same = float(got) == want
        elif isinstance(want, tuple) and isinstance(got, (tuple, list)):
            same = tuple(got) == want
        else:
            same = got == want
        if not same:
            lines.append(f"{key}: expected {want!r}, found {got!r}")
    return lines
