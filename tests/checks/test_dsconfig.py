"""dsconform.checks.dsconfig: the one DeepSpeed config builder, and the ZeRO matrix built on it."""

from __future__ import annotations

import pytest

from dsconform.checks.dsconfig import ASSUMED_DEFAULTS, OPTIMIZERS, defaults_mismatches, ds_config
from dsconform.checks.zero_vs_ddp import ZERO_OFFLOADS, ZeroCase
from suites.zero_ranks import matrix

BASE = dict(stage=2, dtype="fp32", optimizer="sgd", lr=0.1, micro_batch=4, grad_accum=1,
            world_size=2)


def cfg(**changes):
    return ds_config(**{**BASE, **changes})


def test_every_maths_default_is_written_out():
    c = cfg()
    assert c["gradient_clipping"] == 0.0  # DeepSpeed's own default is 1.0 since 0.19.3
    assert c["prescale_gradients"] is False and c["gradient_predivide_factor"] == 1.0
    assert c["communication_data_type"] == "fp32"
    assert c["data_types"] == {"grad_accum_dtype": "fp32"}
    assert c["torch_autocast"] == {"enabled": False}
    assert c["optimizer"] == {"type": "SGD", "params": {
        "lr": 0.1, "momentum": 0.0, "dampening": 0.0, "nesterov": False, "weight_decay": 0.0}}
    assert c["zero_allow_untested_optimizer"] is True
    assert c["zero_optimization"]["zero_quantized_weights"] is False
    assert c["train_batch_size"] == 4 * 1 * 2


@pytest.mark.parametrize("optimizer, torch_adam", [("adam", True), ("fused_adam", False)])
def test_adam_is_adam_not_adamw_and_decay_is_explicit(optimizer, torch_adam):
    params = cfg(optimizer=optimizer)["optimizer"]["params"]
    assert params["adam_w_mode"] is False
    assert params["torch_adam"] is torch_adam
    assert params["weight_decay"] == 0.0  # torch AdamW's default would be 0.01
    assert params["betas"] == [0.9, 0.999] and params["eps"] == 1e-8


def test_untested_optimizer_flag_only_where_needed():
    assert "zero_allow_untested_optimizer" not in cfg(stage=0)
    assert "zero_allow_untested_optimizer" not in cfg(optimizer="adam")
    assert cfg(stage=1)["zero_allow_untested_optimizer"] is True


def test_offload_sections():
    c = cfg(stage=3, offload_optimizer=True, offload_param=True, optimizer="adam")
    z = c["zero_optimization"]
    assert z["offload_optimizer"]["device"] == "cpu" and z["offload_param"]["device"] == "cpu"
    assert c["zero_force_ds_cpu_optimizer"] is False
    assert "zero_force_ds_cpu_optimizer" not in cfg(stage=1, offload_optimizer=True,
                                                    optimizer="cpu_adam")


def test_fp16_scaler_is_pinned_even_when_dynamic():
    fp16 = cfg(dtype="fp16")["fp16"]
    assert fp16 == {"enabled": True, "auto_cast": False, "loss_scale": 0.0,
                    "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                    "consecutive_hysteresis": False, "min_loss_scale": 1.0}
    assert cfg(dtype="fp16", loss_scale=1024)["fp16"]["loss_scale"] == 1024.0
    bf16 = cfg(dtype="bf16")
    assert bf16["bf16"] == {"enabled": True, "immediate_grad_update": False,
                            "check_grad_overflow": True}
    assert bf16["communication_data_type"] == "bf16" and "fp16" not in bf16


@pytest.mark.parametrize("changes, argument", [
    (dict(stage=4), "stage"),
    (dict(dtype="fp8"), "dtype"),
    (dict(optimizer="lamb"), "optimizer"),
    (dict(lr=0.0), "lr"),
    (dict(lr=float("nan")), "lr"),
    (dict(micro_batch=0), "micro_batch"),
    (dict(grad_accum=True), "grad_accum"),
    (dict(world_size=1.5), "world_size"),
    (dict(stage=0, offload_optimizer=True), "offload_optimizer"),
    (dict(stage=2, offload_param=True), "offload_param"),
    (dict(optimizer="fused_adam", offload_optimizer=True), "optimizer"),
    (dict(optimizer="cpu_adam"), "optimizer"),
    (dict(gradient_clipping=-1.0), "gradient_clipping"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(optimizer="adam", momentum=0.9), "momentum"),
    (dict(momentum=1.0), "momentum"),
    (dict(betas=(0.9, 1.0), optimizer="adam"), "betas"),
    (dict(eps=0.0), "eps"),
    (dict(loss_scale=128.0), "loss_scale"),             # fp32: would be silently ignored
    (dict(dtype="bf16", hysteresis=4), "hysteresis"),
    (dict(dtype="fp16", loss_scale=-1.0), "loss_scale"),
    (dict(dtype="fp16", loss_scale_window=0), "loss_scale_window"),
    (dict(dtype="fp16", min_loss_scale=0), "min_loss_scale"),
])
def test_invalid_combinations_name_the_argument(changes, argument):
    with pytest.raises(ValueError, match=rf"^ds_config\({argument}="):
        cfg(**changes)


def test_keyword_only():
    with pytest.raises(TypeError):
        ds_config(2, "fp32", "sgd", 0.1, 4, 1, 2)  # type: ignore[misc]


def test_defaults_mismatch_lines_say_key_expected_found():
    assert defaults_mismatches(ASSUMED_DEFAULTS, dict(ASSUMED_DEFAULTS)) == []
    # What an upgrade from 0.19.0 to 0.19.3 looks like from either side.
    found = {**ASSUMED_DEFAULTS, "gradient_clipping": 0.0}
    assert defaults_mismatches(ASSUMED_DEFAULTS, found) == [
        "gradient_clipping: expected 1.0, found 0.0"]
    assert defaults_mismatches({"gradient_clipping": 0.0}, {"gradient_clipping": 1.0}) == [
        "gradient_clipping: expected 0.0, found 1.0"]
    assert defaults_mismatches({"adam.betas": (0.9, 0.999)}, {"adam.betas": [0.9, 0.999]}) == []
    assert defaults_mismatches({"x": 1.0}, {}) == ["x: expected 1.0, found '<missing>'"]
    assert defaults_mismatches({"flag": False}, {"flag": 0}) == []  # 0 == False in Python
    assert defaults_mismatches({"dtype": None}, {"dtype": "fp16"}) == [
        "dtype: expected None, found 'fp16'"]


def test_matrix_is_valid_complete_and_unique():
    cases = matrix()
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids))
    for case in cases:
        case.config()  # every generated case is a valid config
    # Never generated: offload on stage 0, parameter offload below stage 3, FusedAdam offloaded.
    assert not [c for c in cases if c.stage == 0 and c.offload != "none"]
    assert not [c for c in cases if c.offload_param and c.stage != 3]
    assert not [c for c in cases if c.optimizer == "fused_adam" and c.offload_optimizer]
    assert not [c for c in cases if c.optimizer == "cpu_adam" and not c.offload_optimizer]
    placements = sum(len(v) for v in ZERO_OFFLOADS.values())
    # placements x dtypes x optimizers (sgd, adam, DeepSpeed's Adam) x gas x world sizes
    assert len(cases) == placements * 3 * 3 * 2 * 2
    assert {c.optimizer for c in cases} == set(OPTIMIZERS)
    assert {(c.stage, c.offload) for c in cases} == {
        (0, "none"), (1, "none"), (1, "opt"), (2, "none"), (2, "opt"),
        (3, "none"), (3, "opt"), (3, "param+opt")}


def test_symbolic_world_size_must_be_resolved():
    case = ZeroCase(stage=3, dtype="bf16", optimizer="sgd", grad_accum=1, world_size="all")
    with pytest.raises(ValueError, match="resolve world_size='all'"):
        case.config()
    assert case.with_(world_size=8).config()["train_batch_size"] == 4 * 8


def test_case_defaults_per_optimizer():
    sgd = ZeroCase(stage=1, dtype="fp32", optimizer="sgd", grad_accum=1, world_size=1)
    adam = ZeroCase(stage=1, dtype="fp32", optimizer="adam", grad_accum=1, world_size=1)
    assert (sgd.lr, sgd.momentum) == (0.05, 0.9)
    assert (adam.lr, adam.momentum) == (1e-3, 0.0)
    assert ZeroCase(stage=1, dtype="fp16", optimizer="sgd", grad_accum=1,
                    world_size=1).config()["fp16"]["loss_scale"] == 1024.0


def test_manual_accumulation_configures_one_step_and_names_itself():
    case = ZeroCase(stage=2, dtype="fp32", optimizer="sgd", grad_accum=4, world_size=2,
                    offload_optimizer=True)
    manual = case.with_(manual_accum=True)
    assert case.config()["gradient_accumulation_steps"] == 4
    assert manual.config()["gradient_accumulation_steps"] == 1
    assert manual.config()["train_batch_size"] == 4 * 2
    assert manual.id == case.id + "-manual"
    assert "manual_accum" not in case.params() and manual.params()["manual_accum"] is True
