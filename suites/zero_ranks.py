"""The cells of suites/test_zero.py's matrix, and the code that runs inside its ranks beyond the
ZeRO-vs-DDP run itself (``train_zero_and_ddp``, dsconform/checks/zero_vs_ddp.py, which the
checkpoint, DeepNVMe, loss-scaling and multi-node suites share).

Ranks are pooled and reused: every call re-seeds, and destroys its engine before returning.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch import nn

from dsconform.suite import ZERO_OFFLOADS, ZeroCase


def optimizers_for(offload_optimizer: bool) -> tuple[str, ...]:
    """torch SGD and Adam everywhere; DeepSpeed's own Adam is FusedAdam on the device and
    DeepSpeedCPUAdam when offloaded (DeepSpeed picks one or the other, never both)."""
    return ("sgd", "adam", "cpu_adam" if offload_optimizer else "fused_adam")


def matrix(world_sizes: tuple[int | str, ...] = (1, 2)) -> list[ZeroCase]:
    """Every valid (stage, offload, dtype, optimizer, grad_accum, world_size) cell. Invalid
    combinations (offload on stage 0, parameter offload below stage 3, FusedAdam offloaded) are
    never generated. A world size "all" stays symbolic until the node is known."""
    return [ZeroCase(stage=stage, dtype=dtype, optimizer=opt, grad_accum=gas,
                     world_size=ws, offload_optimizer=off_opt, offload_param=off_param)
            for stage, offloads in ZERO_OFFLOADS.items()
            for off_opt, off_param in offloads
            for dtype in ("fp32", "bf16", "fp16")
            for opt in optimizers_for(off_opt)
            for gas in (1, 4)
            for ws in world_sizes]


# Adam with L2 weight decay: ZeRO-Offload's ``"type": "Adam"`` with ``"weight_decay"`` and
# adam_w_mode false runs DeepSpeedCPUAdam's Adam mode, the decay added to the gradient; DDP's
# reference is torch Adam(weight_decay=...). 0.01 is torch AdamW's default decay.
L2_WEIGHT_DECAY = 0.01


def l2_matrix(world_sizes: tuple[int | str, ...] = (1, 2)) -> list[ZeroCase]:
    """The Adam-with-L2 cells (``...-cpu_adam_l2-...``): DeepSpeedCPUAdam on every ZeRO-Offload
    placement (stages 1-3 with the optimizer offloaded, stage 3 with the parameters too), fp32,
    bf16 and fp16, one micro-batch per step, beside the matrix (whose cells carry no decay)."""
    return [ZeroCase(stage=stage, dtype=dtype, optimizer="cpu_adam", grad_accum=1,
                     world_size=ws, offload_optimizer=True, offload_param=off_param,
                     weight_decay=L2_WEIGHT_DECAY)
            for stage, offloads in ZERO_OFFLOADS.items()
            for off_opt, off_param in offloads if off_opt
            for dtype in ("fp32", "bf16", "fp16")
            for ws in world_sizes]


def read_effective_defaults() -> dict[str, Any]:
    """Rank entry point (world size 1): what DeepSpeed does when a config says nothing.

    Builds a minimal engine whose config names only the batch size and the optimizer type, and
    reads the parsed DeepSpeedConfig for the fp16/bf16/ZeRO sections it does not enable.
    """
    import deepspeed
    from deepspeed.runtime import config as ds_cfg
    from deepspeed.runtime import constants

    from dsconform.suite import compat, device, seed_everything

    compat.require(compat.PRECISION_CONFIG)  # the sections it reads, on an older release

    seed_everything(0)
    model = nn.Linear(4, 4).to(device())
    minimal = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1 << 30,
               "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=minimal)
    try:
        group = engine.basic_optimizer.param_groups[0]
        parsed = ds_cfg.DeepSpeedConfig(minimal)  # what the engine parsed, re-parsed
        found: dict[str, Any] = {
            "gradient_clipping": engine.gradient_clipping(),
            "adam.optimizer_class": type(engine.basic_optimizer).__name__,
            "adam.weight_decay": group["weight_decay"],
            "adam.betas": tuple(group["betas"]),
            "adam.eps": group["eps"],
            "zero_allow_untested_optimizer": engine.zero_allow_untested_optimizer(),
            "zero_force_ds_cpu_optimizer": parsed.zero_force_ds_cpu_optimizer,
            "prescale_gradients": parsed.prescale_gradients,
            "gradient_predivide_factor": parsed.gradient_predivide_factor,
            "communication_data_type": parsed.communication_data_type,
            "grad_accum_dtype": parsed.grad_accum_dtype,
            "torch_autocast_enabled": parsed.torch_autocast_enabled,
        }
    finally:
        engine.destroy()
        del engine
    found["constants.GRADIENT_CLIPPING_DEFAULT"] = constants.GRADIENT_CLIPPING_DEFAULT
    found["constants.ADAM_W_MODE_DEFAULT"] = ds_cfg.ADAM_W_MODE_DEFAULT
    # Sections the minimal engine leaves disabled, parsed from configs that only enable them.
    fp16 = ds_cfg.DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1,
                                   "fp16": {"enabled": True}}).float16_config
    for key in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                "consecutive_hysteresis", "min_loss_scale", "auto_cast"):
        found[f"fp16.{key}"] = getattr(fp16, key)
    # The scaler constants no config key reaches, from the objects DeepSpeed builds with these
    # defaults (ZeRO 1-3: CreateLossScaler; stage 0: LossScaleConfig's profiles).
    from deepspeed.runtime.fp16 import loss_scaler as ds_scaler

    zero_scaler = ds_scaler.CreateLossScaler(dtype=torch.float16, static_loss_scale=0.0,
                                             dynamic_scaling=True,
                                             dynamic_loss_args=fp16.dynamic_loss_scale_args())
    found["fp16.scaler.scale_factor"] = zero_scaler.scale_factor
    found["fp16.scaler.raise_error_at_min_scale"] = zero_scaler.raise_error_at_min_scale
    profiles = compat.loss_scale_profiles(ds_scaler)  # none before 0.18.6: compat.MISSING
    factors = {p.scale_factor for p in profiles.values()} if profiles else set()
    found["fp16.stage0.scale_factor"] = (compat.MISSING if not profiles else factors.pop()
                                         if len(factors) == 1 else sorted(factors))
    bf16 = ds_cfg.DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1,
                                   "bf16": {"enabled": True}}).bfloat16_config
    for key in ("immediate_grad_update", "check_grad_overflow"):
        found[f"bf16.{key}"] = getattr(bf16, key)
    zero = ds_cfg.DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1,
                                   "zero_optimization": {"stage": 1}}).zero_config
    for key in ("zero_quantized_weights", "zero_quantized_gradients"):
        found[f"zero.{key}"] = getattr(zero, key)
    found.update(_zero_defaults())
    gc.collect()
    return found


# The zero_optimization keys that change what a checkpoint holds or restores, or what is reduced
# and gathered and how (deepspeed/runtime/zero/config.py). overlap_comm's default depends on the
# stage (true on stage 3 only): it is read per stage.
ZERO_STATE_KEYS = (
    "load_from_fp32_weights", "elastic_checkpoint", "gather_16bit_weights_on_model_save",
    "pipeline_loading_checkpoint", "legacy_stage1", "sub_group_size",
    "param_persistence_threshold", "model_persistence_threshold", "parameter_alignment",
    "reduce_scatter", "reduce_bucket_size", "use_multi_rank_bucket_allreduce",
    "allgather_partitions", "allgather_bucket_size", "contiguous_gradients",
    "round_robin_gradients", "compute_grad_norm", "zero_hpz_partition_size",
    "zero_quantized_nontrainable_weights", "use_all_reduce_for_fetch_params",
    "allgather_sequential", "ignore_unused_parameters")
# Keys a supported release (0.19.6) does not have yet, and what that release does without them:
# it always computes the gradient norm and never pads parameters to alignment.
ZERO_KEYS_ADDED = {"compute_grad_norm": True, "parameter_alignment": False}


def _zero_defaults() -> dict[str, Any]:
    """What DeepSpeed's parsed zero_optimization section holds for ZERO_STATE_KEYS when a config
    gives only the stage, and the offloaded optimizer's share of the work when it gives only the
    device."""
    from deepspeed.runtime import config as ds_cfg

    def parsed(zero: dict[str, Any]) -> Any:
        return ds_cfg.DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1,
                                       "zero_optimization": zero}).zero_config

    found: dict[str, Any] = {}
    by_stage = {stage: parsed({"stage": stage}) for stage in (1, 2, 3)}
    for key in ZERO_STATE_KEYS:
        found[f"zero.{key}"] = getattr(by_stage[1], key, ZERO_KEYS_ADDED.get(key, "<missing>"))
    for stage, zero in by_stage.items():
        found[f"zero.stage{stage}.overlap_comm"] = zero.overlap_comm
    offloaded = parsed({"stage": 2, "offload_optimizer": {"device": "cpu"}}).offload_optimizer
    found["zero.offload_optimizer.ratio"] = offloaded.ratio
    return found


def _dtype_name(value: Any) -> Any:
    """A dtype as the facts hold it ("bfloat16"); anything else as it is."""
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value


def read_resolved_dtypes(tamper: str | None = None) -> dict[str, Any]:
    """Rank entry point (world size 1): the values DeepSpeed resolves inside the engine where the
    parsed config holds None, for configs that name only the batch size, the optimizer, the
    precision and the ZeRO stage (as users write them), fp32 / bf16 / fp16 x ZeRO 0-3.

    Keys ``<dtype>.z<stage>.<what>``: ``communication_data_type`` (the engine's, and the ZeRO
    optimizer's own copy, ``zero.communication_data_type``), ``grad_accum_dtype`` (the engine's
    get_data_types), ``zero.gradient_accumulation_dtype`` (ZeRO 1-3's accumulation buffers),
    ``wrapper`` (the optimizer class the resolution picks) and
    ``seq_parallel_communication_data_type`` (parsed; the engine adopts it under Ulysses).
    ``unsupported``: the dtypes this accelerator does not run (fp16 on most CPUs), not read.
    ``tamper="comm_fp16"``: the engine carries bf16/fp32 gradients in fp16 (the red test's)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from dsconform.suite import device, seed_everything

    accel = get_accelerator()
    supported = {"fp32": True, "bf16": accel.is_bf16_supported(),
                 "fp16": accel.is_fp16_supported()}
    found: dict[str, Any] = {"unsupported": [d for d, ok in supported.items() if not ok]}
    for dtype in (d for d, ok in supported.items() if ok):
        for stage in (0, 1, 2, 3):
            seed_everything(0)
            model = nn.Linear(4, 4).to(device())
            cfg: dict[str, Any] = {
                "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1 << 30,
                "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
                "zero_optimization": {"stage": stage}}
            if dtype != "fp32":
                cfg[dtype] = {"enabled": True}
            if tamper == "comm_fp16":
                cfg["communication_data_type"] = "fp16"
            engine, _, _, _ = deepspeed.initialize(model=model,
                                                   model_parameters=model.parameters(),
                                                   config=cfg)
            try:
                at = f"{dtype}.z{stage}"
                opt = engine.optimizer
                values = {
                    "communication_data_type": engine.communication_data_type,
                    "grad_accum_dtype": engine.get_data_types()[1],
                    "wrapper": type(opt).__name__,
                    # "<missing>" on a release without it: a moved fact, not a crash
                    "seq_parallel_communication_data_type": getattr(
                        engine._config, "seq_parallel_communication_data_type", "<missing>"),
                }
                if stage > 0:
                    values["zero.communication_data_type"] = getattr(
                        opt, "communication_data_type", "<missing>")
                    values["zero.gradient_accumulation_dtype"] = getattr(
                        opt, "gradient_accumulation_dtype", "<missing>")
                found.update({f"{at}.{k}": _dtype_name(v) for k, v in values.items()})
            finally:
                engine.destroy()
                del engine
    gc.collect()
    return found
