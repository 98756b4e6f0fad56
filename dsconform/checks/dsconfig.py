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
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dsconform.base import compat
from dsconform.base.removed import ONEBIT_TYPES
from dsconform.checks.aio import AioSettings
from dsconform.checks.schedules import SCHEDULES, Schedule

STAGES = (0, 1, 2, 3)
DTYPES = ("fp32", "bf16", "fp16")
# "adam" is torch.optim.Adam built by DeepSpeed (torch_adam); "fused_adam" is DeepSpeed's FusedAdam
# (CUDA kernel on GPUs, the CPU op on the CPU accelerator); "cpu_adam" is DeepSpeedCPUAdam, which
# DeepSpeed picks only when the optimizer is offloaded.
OPTIMIZERS = ("sgd", "adam", "fused_adam", "cpu_adam")
# The DeepSpeed op each optimizer must be able to load (for requires(op=...)).
OPTIMIZER_OPS = {"sgd": None, "adam": None, "fused_adam": "fused_adam", "cpu_adam": "cpu_adam"}
# DeepSpeed's 1-bit optimizers, by the config "type" DeepSpeed knows them as. GPU-only (their NCCL
# backend compresses with cupy), never with ZeRO, and removed in DeepSpeed 0.19.7 (PR #8490;
# dsconform/base/removed.py). They need no op of their own.
ONEBIT_COMM_BACKENDS = ("nccl", "mpi", "hccl", "compressed")
OPTIMIZER_OPS.update({name: None for name in ONEBIT_TYPES})

# A steps_per_print larger than any run keeps DeepSpeed's per-step log lines out of test output.
_QUIET_STEPS = 1 << 30


def _fail(argument: str, value: Any, reason: str) -> None:
    raise ValueError(f"ds_config({argument}={value!r}): {reason}")


@dataclass(frozen=True)
class DsSettings:
    """Every argument of ``ds_config``, with its default: the one place they are declared."""
    stage: int
    dtype: str
    optimizer: str
    lr: float
    micro_batch: int
    grad_accum: int
    world_size: int
    offload_optimizer: bool = False
    offload_param: bool = False
    gradient_clipping: float = 0.0
    weight_decay: float = 0.0
    momentum: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    # Refill the hysteresis budget on every clean step (DeepSpeed's default: only when the window
    # raises the scale). DeepSpeed has no keys for the raise/lower factors: both are 2.0 in code.
    consecutive_hysteresis: bool = False
    # 1-bit optimizers only (None/defaults elsewhere). freeze_step: uncompressed warmup steps of
    # onebit_adam and onebit_lamb (DeepSpeed's default, 100000, would never compress in a test,
    # so it must be given); var_freeze_step: zero_one_adam's last variance update. The rest are
    # DeepSpeed's defaults, written out into every 1-bit config.
    freeze_step: int | None = None
    var_freeze_step: int | None = None
    var_update_scaler: int = 16
    local_step_scaler: int = 32678
    local_step_clipper: int = 16
    max_coeff: float = 10.0
    min_coeff: float = 0.01
    comm_backend_name: str = "nccl"
    cuda_aware: bool = False
    # ZeRO-Infinity: where offload_optimizer/offload_param put their tensors. "nvme" needs
    # nvme_path (a directory the caller owns: DeepSpeed writes zero_stage_3/... under it) and
    # writes an "aio" section (dsconform.checks.aio.AioSettings; None: DeepSpeed's defaults,
    # written
    # out). nvme_buffer_elements: elements per parameter swap buffer (5 buffers), at least the
    # largest parameter partition; DeepSpeed's default 1e8 allocates 5 x 1e8 elements per rank.
    offload_device: str = "cpu"
    nvme_path: str | None = None
    aio: AioSettings | None = None
    nvme_buffer_elements: int = 100_000_000
    # Checkpointing (the checkpoint suite). lr_warmup_steps > 0 adds DeepSpeed's WarmupLR
    # (linear from 0 to lr over that many steps), so a checkpoint carries scheduler state; 0 adds
    # no scheduler. checkpoint_writer None keeps DeepSpeed's default engine (torch.save); "fast"
    # is FastPersist, the DeepNVMe async_io writer ("checkpoint.writer", with an "aio" section).
    # load_universal: load_checkpoint reads a universal checkpoint (ds_to_universal's output).
    lr_warmup_steps: int = 0
    checkpoint_writer: str | None = None
    load_universal: bool = False
    # The "scheduler" section as a user writes it: one of dsconform.checks.schedules' dataclasses
    # (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle), every parameter written out; None adds
    # none (lr_warmup_steps may add the checkpoint suite's WarmupLR instead).
    scheduler: Schedule | None = None
    # The batch keys written (BATCH_KEYS names them; DeepSpeed infers a key left out), and
    # train_batch, the train_batch_size written (None: micro_batch x grad_accum x world_size).
    batch_keys: tuple[str, ...] = ("train", "micro", "accum")
    train_batch: int | None = None
    # The flops profiler at this global step (None: off), its report written to flops_output.
    flops_profile_step: int | None = None
    flops_output: str | None = None
    # The monitors (None: off): csv_monitor and tensorboard, each under its own directory with
    # the job name "dsconform".
    csv_monitor_dir: str | None = None
    tensorboard_dir: str | None = None


# ds_config's batch_keys -> DeepSpeed's config key.
BATCH_KEYS = {"train": "train_batch_size", "micro": "train_micro_batch_size_per_gpu",
              "accum": "gradient_accumulation_steps"}
MONITOR_JOB = "dsconform"


def _validate_onebit(s: DsSettings) -> None:
    """The 1-bit arguments: each given only to the optimizer that reads it."""
    onebit = s.optimizer in ONEBIT_TYPES
    if onebit and s.stage != 0:
        _fail("stage", s.stage, f"optimizer={s.optimizer!r} is not compatible with ZeRO "
              f"(DeepSpeed asserts it): use stage=0")
    if onebit and s.dtype == "bf16":
        _fail("dtype", s.dtype, f"optimizer={s.optimizer!r} runs in fp32 or fp16 (DeepSpeed "
              f"documents and verified those only)")
    wants = {"freeze_step": s.optimizer in ("onebit_adam", "onebit_lamb"),
             "var_freeze_step": s.optimizer == "zero_one_adam"}
    # The missing argument first: it is what the user meant to give.
    for name, wanted in sorted(wants.items(), key=lambda kv: not kv[1]):
        value = getattr(s, name)
        if wanted and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            _fail(name, value, f"optimizer={s.optimizer!r} needs an integer >= 1 (DeepSpeed's "
                  f"default 100000 would never leave the uncompressed warmup)")
        if not wanted and value is not None:
            _fail(name, value, f"does not apply to optimizer={s.optimizer!r}")
    only = {"zero_one_adam": (("var_update_scaler", 16), ("local_step_scaler", 32678),
                              ("local_step_clipper", 16)),
            "onebit_lamb": (("max_coeff", 10.0), ("min_coeff", 0.01))}
    for owner, fields in only.items():
        for name, default in fields:
            value = getattr(s, name)
            if s.optimizer != owner and value != default:
                _fail(name, value, f"applies to optimizer={owner!r} only "
                      f"(optimizer={s.optimizer!r})")
            if isinstance(default, int) and (isinstance(value, bool) or not isinstance(value, int)
                                             or value < 1):
                _fail(name, value, "must be an integer >= 1")
    if not 0 < s.min_coeff <= s.max_coeff:
        _fail("min_coeff", s.min_coeff, f"must be > 0 and <= max_coeff ({s.max_coeff})")
    if s.comm_backend_name not in ONEBIT_COMM_BACKENDS:
        _fail("comm_backend_name", s.comm_backend_name,
              f"must be one of {ONEBIT_COMM_BACKENDS}")
    if not isinstance(s.cuda_aware, bool):
        _fail("cuda_aware", s.cuda_aware, "must be True or False")
    if not onebit and (s.comm_backend_name != "nccl" or s.cuda_aware):
        name, value = (("cuda_aware", s.cuda_aware) if s.cuda_aware
                       else ("comm_backend_name", s.comm_backend_name))
        _fail(name, value, f"applies to the 1-bit optimizers only (optimizer={s.optimizer!r})")
    if s.optimizer == "onebit_lamb" and s.dtype == "fp16" and s.loss_scale != 0:
        _fail("loss_scale", s.loss_scale, "optimizer='onebit_lamb' needs dynamic loss scaling "
              "(loss_scale=0; DeepSpeed asserts it)")


def _validate_scaler(s: DsSettings) -> None:
    """The fp16 scaler arguments DeepSpeed would reject late, or accept and then misbehave on."""
    if not isinstance(s.consecutive_hysteresis, bool):
        # pydantic turns "yes"/1 into True: a typo would silently change the semantics.
        _fail("consecutive_hysteresis", s.consecutive_hysteresis, "must be True or False")
    if isinstance(s.initial_scale_power, bool) or not isinstance(s.initial_scale_power, int) \
            or s.initial_scale_power < 0:
        _fail("initial_scale_power", s.initial_scale_power, "must be an integer >= 0 (the "
              "first dynamic scale is 2**initial_scale_power)")
    if isinstance(s.min_loss_scale, bool) or float(s.min_loss_scale) != int(s.min_loss_scale):
        # DeepSpeed's fp16.min_loss_scale is an integer field; 0.5 fails deepspeed.initialize.
        _fail("min_loss_scale", s.min_loss_scale, "must be a whole number (DeepSpeed's "
              "fp16.min_loss_scale is an integer)")
    if s.loss_scale == 0 and 2 ** s.initial_scale_power < s.min_loss_scale:
        # DeepSpeed accepts it, and its first overflow then RAISES the scale to the floor.
        _fail("initial_scale_power", s.initial_scale_power, f"2**{s.initial_scale_power} is "
              f"below min_loss_scale={s.min_loss_scale}")


def validate(s: DsSettings) -> None:
    """Raise ValueError naming the first argument that makes the combination invalid."""
    if s.stage not in STAGES:
        _fail("stage", s.stage, f"must be one of {STAGES}")
    if s.dtype not in DTYPES:
        _fail("dtype", s.dtype, f"must be one of {DTYPES}")
    if s.optimizer not in OPTIMIZERS and s.optimizer not in ONEBIT_TYPES:
        _fail("optimizer", s.optimizer, f"must be one of {OPTIMIZERS + tuple(ONEBIT_TYPES)}")
    for name, value in (("micro_batch", s.micro_batch), ("grad_accum", s.grad_accum),
                        ("world_size", s.world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            _fail(name, value, "must be an integer >= 1")
    if not (isinstance(s.lr, (int, float)) and math.isfinite(s.lr) and s.lr > 0):
        _fail("lr", s.lr, "must be a finite number > 0")
    if s.offload_optimizer and s.stage == 0:
        _fail("offload_optimizer", s.offload_optimizer, "needs ZeRO stage 1, 2 or 3 (stage=0)")
    if s.offload_param and s.stage != 3:
        _fail("offload_param", s.offload_param, f"needs ZeRO stage 3 (stage={s.stage})")
    # DeepSpeed silently swaps FusedAdam for DeepSpeedCPUAdam when the optimizer is offloaded and
    # only builds DeepSpeedCPUAdam then: asking for the other would test something else.
    if s.optimizer == "fused_adam" and s.offload_optimizer:
        _fail("optimizer", s.optimizer, "with offload_optimizer=True DeepSpeed runs cpu_adam")
    if s.optimizer == "cpu_adam" and not s.offload_optimizer:
        _fail("optimizer", s.optimizer, "DeepSpeed uses DeepSpeedCPUAdam only with "
              "offload_optimizer=True (use fused_adam)")
    if not (s.gradient_clipping >= 0 and math.isfinite(s.gradient_clipping)):
        _fail("gradient_clipping", s.gradient_clipping, "must be >= 0 (0 disables clipping)")
    if not (s.weight_decay >= 0 and math.isfinite(s.weight_decay)):
        _fail("weight_decay", s.weight_decay, "must be >= 0")
    if s.optimizer == "sgd":
        if not 0 <= s.momentum < 1:
            _fail("momentum", s.momentum, "must be in [0, 1)")
    elif s.momentum != 0.0:
        _fail("momentum", s.momentum,
              f"applies to optimizer='sgd' only (optimizer={s.optimizer!r})")
    if len(s.betas) != 2 or not all(0 <= b < 1 for b in s.betas):
        _fail("betas", s.betas, "must be two numbers in [0, 1)")
    if not s.eps > 0:
        _fail("eps", s.eps, "must be > 0")
    if s.dtype != "fp16":
        # Loss scaling is fp16-only in DeepSpeed; a value here would be silently ignored.
        for name, value, default in (("loss_scale", s.loss_scale, 0.0),
                                     ("initial_scale_power", s.initial_scale_power, 16),
                                     ("loss_scale_window", s.loss_scale_window, 1000),
                                     ("hysteresis", s.hysteresis, 2),
                                     ("min_loss_scale", s.min_loss_scale, 1.0),
                                     ("consecutive_hysteresis", s.consecutive_hysteresis,
                                      False)):
            if value != default:
                _fail(name, value, f"applies to dtype='fp16' only (dtype={s.dtype!r})")
    else:
        if not (s.loss_scale >= 0 and math.isfinite(s.loss_scale)):
            _fail("loss_scale", s.loss_scale, "must be >= 0 (0 means dynamic loss scaling)")
        if s.loss_scale_window < 1:
            _fail("loss_scale_window", s.loss_scale_window, "must be >= 1")
        if s.hysteresis < 1:
            _fail("hysteresis", s.hysteresis, "must be >= 1")
        if not s.min_loss_scale > 0:
            _fail("min_loss_scale", s.min_loss_scale, "must be > 0")
        _validate_scaler(s)
    _validate_onebit(s)
    _validate_nvme(s)
    _validate_checkpoint(s)
    _validate_batch_and_logging(s)


def _validate_batch_and_logging(s: DsSettings) -> None:
    """The batch keys, the flops profiler and the monitors."""
    if not (isinstance(s.batch_keys, tuple) and set(s.batch_keys) <= set(BATCH_KEYS)
            and len(set(s.batch_keys)) == len(s.batch_keys)):
        _fail("batch_keys", s.batch_keys, f"must be a tuple of distinct names from "
              f"{tuple(BATCH_KEYS)}")
    if s.train_batch is not None:
        if isinstance(s.train_batch, bool) or not isinstance(s.train_batch, int) \
                or s.train_batch < 1:
            _fail("train_batch", s.train_batch, "must be an integer >= 1 (or None)")
        if "train" not in s.batch_keys:
            _fail("train_batch", s.train_batch, "is written only with 'train' in batch_keys")
    step = s.flops_profile_step
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        _fail("flops_profile_step", step, "must be an integer >= 0 (or None: no profiler)")
    if s.flops_output is not None and step is None:
        _fail("flops_output", s.flops_output, "needs flops_profile_step")
    for name in ("flops_output", "csv_monitor_dir", "tensorboard_dir"):
        value = getattr(s, name)
        if value is not None and not (isinstance(value, str) and value.startswith("/")):
            _fail(name, value, "must be an absolute path (or None)")


CHECKPOINT_WRITERS = (None, "fast")


def _validate_checkpoint(s: DsSettings) -> None:
    if isinstance(s.lr_warmup_steps, bool) or not isinstance(s.lr_warmup_steps, int) \
            or s.lr_warmup_steps < 0:
        _fail("lr_warmup_steps", s.lr_warmup_steps, "must be an integer >= 0 (0: no scheduler)")
    if s.checkpoint_writer not in CHECKPOINT_WRITERS:
        _fail("checkpoint_writer", s.checkpoint_writer, f"must be one of {CHECKPOINT_WRITERS}")
    if s.checkpoint_writer == "fast" and s.stage != 3:
        # Below stage 3 the writer needs "data_parallel" (without it DeepSpeed 0.19.8 raises
        # AttributeError: 'UniversalParallelInfo' object has no attribute 'dp_rank'), and with it
        # every rank writes a slice file (<name>-<rank>.<n>) that load_checkpoint cannot read.
        _fail("checkpoint_writer", s.checkpoint_writer, f"needs stage=3 (stage={s.stage}): "
              f"below it DeepSpeed's writer splits files load_checkpoint cannot read")
    if not isinstance(s.load_universal, bool):
        _fail("load_universal", s.load_universal, "must be True or False")
    if s.scheduler is not None and not isinstance(s.scheduler, tuple(SCHEDULES.values())):
        _fail("scheduler", s.scheduler, f"must be one of dsconform.checks.schedules' "
              f"{', '.join(SCHEDULES)} (or None)")
    if s.scheduler is not None and s.lr_warmup_steps:
        _fail("scheduler", s.scheduler, f"lr_warmup_steps={s.lr_warmup_steps} adds a scheduler "
              f"too: give one of them")


def _validate_nvme(s: DsSettings) -> None:
    """The ZeRO-Infinity arguments: nvme needs something offloaded and an absolute path."""
    if s.offload_device not in ("cpu", "nvme"):
        _fail("offload_device", s.offload_device, "must be 'cpu' or 'nvme'")
    nvme = s.offload_device == "nvme"
    if nvme and not (s.offload_optimizer or s.offload_param):
        _fail("offload_device", s.offload_device, "needs offload_optimizer=True and/or "
              "offload_param=True")
    if nvme and not (isinstance(s.nvme_path, str) and s.nvme_path.startswith("/")):
        _fail("nvme_path", s.nvme_path, "offload_device='nvme' needs an absolute directory")
    for name, value, default in (("nvme_path", s.nvme_path, None), ("aio", s.aio, None),
                                 ("nvme_buffer_elements", s.nvme_buffer_elements, 100_000_000)):
        if not nvme and value != default:
            _fail(name, value, f"applies to offload_device='nvme' only "
                  f"(offload_device={s.offload_device!r})")
    if s.aio is not None and not isinstance(s.aio, AioSettings):
        _fail("aio", s.aio, "must be a dsconform.storage.nvme.AioSettings (its block() is what the "
              "runtime reads)")
    if isinstance(s.nvme_buffer_elements, bool) or not isinstance(s.nvme_buffer_elements, int) \
            or s.nvme_buffer_elements < 1:
        _fail("nvme_buffer_elements", s.nvme_buffer_elements, "must be an integer >= 1")


def _onebit_params(s: DsSettings) -> dict[str, Any]:
    """Every parameter the 1-bit optimizer reads, written out (DeepSpeed 0.19.6's signatures)."""
    params: dict[str, Any] = {
        "lr": s.lr, "betas": list(s.betas), "eps": s.eps, "weight_decay": s.weight_decay,
        "bias_correction": True, "eps_inside_sqrt": False, "amsgrad": False,
        "cuda_aware": s.cuda_aware, "comm_backend_name": s.comm_backend_name}
    if s.optimizer == "zero_one_adam":
        params.update({"var_freeze_step": s.var_freeze_step,
                       "var_update_scaler": s.var_update_scaler,
                       "local_step_scaler": s.local_step_scaler,
                       "local_step_clipper": s.local_step_clipper})
    else:
        params["freeze_step"] = s.freeze_step
    if s.optimizer == "onebit_lamb":
        # coeff_beta and the factor bounds at DeepSpeed's defaults, written out.
        params.update({"max_coeff": s.max_coeff, "min_coeff": s.min_coeff, "coeff_beta": 0.9,
                       "factor_max": 4.0, "factor_min": 0.5, "factor_threshold": 0.1})
    return params


def ds_config(**kwargs: Any) -> dict[str, Any]:
    """Build a validated DeepSpeed config with every maths-relevant value written out.

    ``loss_scale=0`` means dynamic loss scaling (DeepSpeed's convention); the fp16 scaler
    arguments are written out even then, so an upstream change of their defaults cannot reach
    a test. ``gradient_clipping=0`` disables clipping (plain DDP has none).
    """
    try:
        s = DsSettings(**kwargs)
    except TypeError as e:  # unknown or missing keyword: name it as ds_config's
        raise TypeError(f"ds_config(): {e}".replace("DsSettings.__init__() ", "")) from None
    validate(s)
    if s.stage == 0 and s.dtype == "bf16":  # older releases lack it: skip naming the release
        compat.require(compat.STAGE0_BF16)

    if s.optimizer == "sgd":
        opt = {"type": "SGD", "params": {"lr": s.lr, "momentum": s.momentum, "dampening": 0.0,
                                         "nesterov": False, "weight_decay": s.weight_decay}}
    elif s.optimizer in ONEBIT_TYPES:
        opt = {"type": ONEBIT_TYPES[s.optimizer], "params": _onebit_params(s)}
    else:
        # Type "Adam" builds AdamW unless adam_w_mode is false (ADAM_W_MODE_DEFAULT is True), and
        # torch_adam picks torch.optim.Adam over DeepSpeed's kernels.
        opt = {"type": "Adam", "params": {"lr": s.lr, "betas": list(s.betas), "eps": s.eps,
                                          "weight_decay": s.weight_decay, "adam_w_mode": False,
                                          "torch_adam": s.optimizer == "adam"}}

    zero: dict[str, Any] = {"stage": s.stage}
    if s.stage > 0:
        # Quantized weights/gradients would change the maths; off is the default, pinned anyway.
        zero.update({"zero_quantized_weights": False, "zero_quantized_gradients": False})
    if s.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if s.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    if s.offload_device == "nvme":
        _nvme_offload(s, zero)

    batch = {"train": s.micro_batch * s.grad_accum * s.world_size if s.train_batch is None
             else s.train_batch, "micro": s.micro_batch, "accum": s.grad_accum}
    cfg: dict[str, Any] = {
        **{BATCH_KEYS[k]: batch[k] for k in s.batch_keys},
        "steps_per_print": _QUIET_STEPS,
        "wall_clock_breakdown": False,
        # Default 1.0 since 0.19.3 (0.0 before): the reason this module exists.
        "gradient_clipping": s.gradient_clipping,
        # Gradients are averaged over ranks after the reduction, as DDP does.
        "prescale_gradients": False,
        "gradient_predivide_factor": 1.0,
        # Reduce in the training dtype: what None resolves to today, written out.
        "communication_data_type": s.dtype,
        # Accumulate gradients in the model dtype: what None resolves to today, written out
        # (fp32 accumulation with bf16 switches stage 0/1 to other optimizer wrappers).
        "data_types": {"grad_accum_dtype": s.dtype},
        "optimizer": opt,
        "zero_optimization": zero,
        "torch_autocast": {"enabled": False},
    }
    if s.stage > 0 and s.optimizer == "sgd":
        # torch SGD is not on DeepSpeed's list of ZeRO-tested optimizers.
        cfg["zero_allow_untested_optimizer"] = True
    if s.offload_optimizer and s.optimizer in ("sgd", "adam"):
        # Offloading a torch optimizer is refused unless this is off (for client optimizers).
        cfg["zero_force_ds_cpu_optimizer"] = False
    if s.dtype == "bf16":
        cfg["bf16"] = {"enabled": True, "immediate_grad_update": False,
                       "check_grad_overflow": True}
    elif s.dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "auto_cast": False, "loss_scale": float(s.loss_scale),
                       "initial_scale_power": s.initial_scale_power,
                       "loss_scale_window": s.loss_scale_window, "hysteresis": s.hysteresis,
                       "consecutive_hysteresis": s.consecutive_hysteresis,
                       "min_loss_scale": s.min_loss_scale}
    if s.offload_device == "nvme" or s.checkpoint_writer == "fast":
        cfg["aio"] = (s.aio or AioSettings()).block()
    if s.lr_warmup_steps:
        cfg["scheduler"] = {"type": "WarmupLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": s.lr, "warmup_num_steps": s.lr_warmup_steps,
            "warmup_type": "linear"}}
    if s.scheduler is not None:
        cfg["scheduler"] = s.scheduler.section()
    if s.checkpoint_writer or s.load_universal:
        checkpoint: dict[str, Any] = {"load_universal": s.load_universal}
        if s.checkpoint_writer == "fast":
            # DeepSpeed's defaults written out; not decoupled (a background writer process).
            checkpoint["writer"] = {"type": "fast", "decoupled": False,
                                    "io_buffer_size": 64 * (1 << 20), "io_buffer_double": True,
                                    "io_multiplier": 1, "show_statistics": False}
        cfg["checkpoint"] = checkpoint
    _logging_sections(s, cfg)
    return cfg


def _logging_sections(s: DsSettings, cfg: dict[str, Any]) -> None:
    """The flops profiler and the monitors, DeepSpeed's defaults written out."""
    if s.flops_profile_step is not None:
        cfg["flops_profiler"] = {"enabled": True, "recompute_fwd_factor": 0.0,
                                 "profile_step": s.flops_profile_step, "module_depth": -1,
                                 "top_modules": 1, "detailed": True,
                                 "output_file": s.flops_output}
    for key, path in (("csv_monitor", s.csv_monitor_dir), ("tensorboard", s.tensorboard_dir)):
        if path is not None:
            cfg[key] = {"enabled": True, "output_path": path, "job_name": MONITOR_JOB}


def _nvme_offload(s: DsSettings, zero: dict[str, Any]) -> None:
    """ZeRO-Infinity sections, DeepSpeed's defaults written out except where noted. DeepSpeed
    swaps only tensors of at least max(1 MiB, aio block_size) bytes (MIN_AIO_BYTES in
    runtime/swap_tensor/utils.py): smaller ones stay in CPU memory."""
    if s.offload_optimizer:
        zero["offload_optimizer"].update({
            "device": "nvme", "nvme_path": s.nvme_path, "buffer_count": 4,
            "pipeline_read": False, "pipeline_write": False, "fast_init": False})
    if s.offload_param:
        # max_in_cpu 0 (DeepSpeed's default is 1e9 elements): every swappable parameter
        # partition lives on NVMe, not in CPU memory.
        zero["offload_param"].update({
            "device": "nvme", "nvme_path": s.nvme_path, "buffer_count": 5,
            "buffer_size": s.nvme_buffer_elements, "max_in_cpu": 0})


# What the suite assumes DeepSpeed does when a config says nothing, for the installed release
# (0.19.8). Keys are read by ``read_effective_defaults`` from a minimal engine and DeepSpeed's
# parsed config; a change here is an upstream semantic change that needs a note in
# docs/findings.md#deepspeed-releases.
ASSUMED_DEFAULTS: dict[str, Any] = {
    # 0.0 up to 0.19.0, 1.0 from 0.19.3 (docs/findings.md#deepspeed-releases): ZeRO then clips
    # where DDP does not.
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
    # No config key reaches these (dsconform/checks/lossscale.py): ZeRO 1-3's DynamicLossScaler (as
    # CreateLossScaler builds it) raises and lowers by 2 and raises an error at min_loss_scale;
    # stage 0's LossScaleConfig (FP16_Optimizer / FP16_UnfusedOptimizer) also uses factor 2.
    "fp16.scaler.scale_factor": 2.0,
    "fp16.scaler.raise_error_at_min_scale": True,
    "fp16.stage0.scale_factor": 2.0,
    "fp16.auto_cast": False,
    "bf16.immediate_grad_update": False,
    "bf16.check_grad_overflow": True,
    "zero.zero_quantized_weights": False,
    "zero.zero_quantized_gradients": False,
    # zero_optimization keys that change what a checkpoint holds or restores (suites/
    # zero_ranks.py ZERO_STATE_KEYS): a load initialises the fp32 masters from the checkpoint's
    # fp32 copies, not from the 16-bit weights; no legacy elastic layout; no 16-bit consolidation
    # at save; stage 3's optimizer sub-groups, the parameters small enough to stay whole, and no
    # alignment padding in the flat buffers of stages 1 and 2.
    "zero.load_from_fp32_weights": True,
    "zero.elastic_checkpoint": False,
    "zero.gather_16bit_weights_on_model_save": False,
    "zero.pipeline_loading_checkpoint": False,
    "zero.legacy_stage1": False,
    "zero.sub_group_size": 1_000_000_000,
    "zero.param_persistence_threshold": 100_000,
    "zero.model_persistence_threshold": sys.maxsize,
    "zero.parameter_alignment": False,
    # ...and what is reduced and gathered, and how: reduce-scatter into buckets of 5e8 elements,
    # the ranks' buckets combined into one all-reduce, partitions all-gathered (not broadcast),
    # gradients copied to a contiguous buffer, no round-robin partitioning of offloaded
    # gradients, the global norm computed, no hierarchical (hpZ) partitions, no quantized frozen
    # weights, stage 3 fetching by all-gather, in buckets, unused parameters ignored.
    "zero.reduce_scatter": True,
    "zero.reduce_bucket_size": 500_000_000,
    "zero.use_multi_rank_bucket_allreduce": True,
    "zero.allgather_partitions": True,
    "zero.allgather_bucket_size": 500_000_000,
    "zero.contiguous_gradients": True,
    "zero.round_robin_gradients": False,
    "zero.compute_grad_norm": True,
    "zero.zero_hpz_partition_size": 1,
    "zero.zero_quantized_nontrainable_weights": False,
    "zero.use_all_reduce_for_fetch_params": False,
    "zero.allgather_sequential": False,
    "zero.ignore_unused_parameters": True,
    # Communication overlaps the backward pass on stage 3 only.
    "zero.stage1.overlap_comm": False,
    "zero.stage2.overlap_comm": False,
    "zero.stage3.overlap_comm": True,
    # An offloaded optimizer steps every partition on the CPU (ratio 1: no partial offload).
    "zero.offload_optimizer.ratio": 1.0,
}


def _resolved(dtype: str, stage: int) -> dict[str, Any]:
    """What the engine resolves for one precision and stage when the config names neither
    communication_data_type nor grad_accum_dtype (both None once parsed)."""
    name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
    # Stage 0: the optimizer itself in fp32; torch Adam under bf16/fp16 is wrapped unfused.
    wrapper = ("AdamW" if dtype == "fp32" else "FP16_UnfusedOptimizer", "DeepSpeedZeroOptimizer",
               "DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3")[stage]
    out = {"communication_data_type": name, "grad_accum_dtype": name, "wrapper": wrapper,
           "seq_parallel_communication_data_type": "float32"}
    if stage:  # ZeRO's own copies: gradients reduced and accumulated in the model's dtype
        out |= {"zero.communication_data_type": name, "zero.gradient_accumulation_dtype": name}
    return {f"{dtype}.z{stage}.{k}": v for k, v in out.items()}


# ZERO-DEF-2: the dtypes DeepSpeed 0.19.8 resolves inside the engine where the parsed config
# holds None (read by suites/zero_ranks.py read_resolved_dtypes; fp32 and bf16 read on the CPU
# machine, fp16 from engine.py's resolution where the accelerator runs fp16). Gradients travel
# and accumulate in the model's own dtype: bf16 gradients are reduced in bf16, not fp32.
ASSUMED_RESOLVED: dict[str, Any] = {
    k: v for dtype in ("fp32", "bf16", "fp16") for stage in range(4)
    for k, v in _resolved(dtype, stage).items()}


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
