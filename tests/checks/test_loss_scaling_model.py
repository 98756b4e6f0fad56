"""dsconform.checks.lossscale: the reference model and the adapter's dispatch (pure logic, no
ranks);
the loss-scaling arguments of ds_config; the suite's tiers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dsconform.base.pairwise import uncovered_pairs
from dsconform.checks.dsconfig import ds_config
from dsconform.checks.lossscale import ScalerModel, ScalerSettings, read_scaler
from suites.loss_scaling_ranks import INJECTIONS, SCALERS, ScalingCase
from suites.test_loss_scaler import MEASURED_PATTERN, MEASURED_SCALES, MEASURED_SKIPPED
from suites.test_loss_scaling import (
    ACCEPTANCE_AXES,
    OPTIMIZERS,
    STAGES,
    WORLD_SIZES,
    check_convergence,
    check_engine_run,
    curve_summary,
    engine_matrix,
    engine_tier,
)


def scales(s: ScalerSettings, flags: str) -> list[float]:
    return [step.scale_after for step in ScalerModel(s).run([f == "X" for f in flags])]


def test_model_reproduces_the_measured_sequence():
    s = SCALERS["h2"][0]
    steps = ScalerModel(s).run([bool(f) for f in MEASURED_PATTERN])
    assert [st.scale_after for st in steps] == list(MEASURED_SCALES)
    assert [sum(x.skipped for x in steps[:i + 1]) for i in range(len(steps))] == \
        list(MEASURED_SKIPPED)
    assert [st.scale_used for st in steps] == [256] + list(MEASURED_SCALES[:-1])


def test_static_scale_never_moves_but_overflows_skip():
    steps = ScalerModel(ScalerSettings(loss_scale=1024.0)).run([False, True, True, False] * 5)
    assert {st.scale_after for st in steps} == {1024.0}
    assert [st.outcome for st in steps[:4]] == ["applied", "skipped", "skipped", "applied"]
    assert all(st.hysteresis_after is None for st in steps)


def test_window_raises_after_window_clean_steps_then_every_window():
    s = ScalerSettings(initial_scale_power=4, loss_scale_window=3, hysteresis=1)
    # DeepSpeed counts the clean steps before the current one: the 4th clean step raises.
    assert scales(s, "........") == [16, 16, 16, 32, 32, 32, 64, 64]
    assert scales(s, "X.......") == [8, 8, 8, 8, 16, 16, 16, 32]


def test_hysteresis_spends_a_budget_and_the_raise_refills_it():
    s = ScalerSettings(initial_scale_power=4, loss_scale_window=2, hysteresis=3)
    assert scales(s, "XXXX") == [16, 16, 8, 4]
    model = ScalerModel(s)
    model.run([True, True])
    assert model.hysteresis_left == 1
    model.run([False, False, False])  # the third clean step raises and refills
    assert (model.scale, model.hysteresis_left) == (32, 3)


def test_consecutive_hysteresis_refills_on_every_clean_step():
    plain = ScalerSettings(initial_scale_power=8, loss_scale_window=100, hysteresis=2)
    consecutive = ScalerSettings(initial_scale_power=8, loss_scale_window=100, hysteresis=2,
                                 consecutive_hysteresis=True)
    assert scales(plain, "X.X.X") == [256, 256, 128, 128, 64]
    assert scales(consecutive, "X.X.X") == [256, 256, 256, 256, 256]
    assert scales(consecutive, "X.XX") == [256, 256, 256, 128]


def test_floor_clamps_then_ends_the_run():
    s = ScalerSettings(initial_scale_power=2, hysteresis=1, min_loss_scale=3.0)
    steps = ScalerModel(s).run([True] * 5)
    assert [(st.scale_after, st.outcome) for st in steps] == [(3, "skipped"), (3, "error")]
    model = ScalerModel(s)
    model.run([True, True])
    with pytest.raises(RuntimeError, match="ended"):
        model.step(False)
    # With a budget left, an overflow at the floor spends it first.
    s2 = ScalerSettings(initial_scale_power=0, hysteresis=2, min_loss_scale=1.0)
    assert [st.outcome for st in ScalerModel(s2).run([True] * 3)] == ["skipped", "error"]
    # A floor that holds (error_at_min=False) skips on forever.
    held = ScalerSettings(initial_scale_power=1, hysteresis=1, error_at_min=False)
    assert [st.outcome for st in ScalerModel(held).run([True] * 4)] == ["skipped"] * 4


def test_settings_round_trip_through_ds_config():
    s = ScalerSettings(initial_scale_power=5, loss_scale_window=7, hysteresis=3,
                       consecutive_hysteresis=True, min_loss_scale=2.0)
    cfg = ds_config(stage=1, dtype="fp16", optimizer="sgd", lr=0.1, micro_batch=1, grad_accum=1,
                    world_size=1, **s.ds_config_kwargs())
    assert cfg["fp16"]["consecutive_hysteresis"] is True
    assert ScalerSettings.from_fp16_section(cfg["fp16"]) == s
    assert s.initial_scale == 32.0 and ScalerSettings(loss_scale=8.0).initial_scale == 8.0


@pytest.mark.parametrize("changes, argument", [
    (dict(consecutive_hysteresis=1), "consecutive_hysteresis"),
    (dict(consecutive_hysteresis="yes"), "consecutive_hysteresis"),
    (dict(min_loss_scale=0.5), "min_loss_scale"),
    (dict(initial_scale_power=-1), "initial_scale_power"),
    (dict(initial_scale_power=2.0), "initial_scale_power"),
    (dict(initial_scale_power=1, min_loss_scale=4), "initial_scale_power"),
])
def test_ds_config_rejects_scaler_arguments_deepspeed_would_misread(changes, argument):
    with pytest.raises(ValueError, match=rf"^ds_config\({argument}="):
        ds_config(stage=2, dtype="fp16", optimizer="sgd", lr=0.1, micro_batch=1, grad_accum=1,
                  world_size=1, **changes)


def test_consecutive_hysteresis_is_fp16_only():
    with pytest.raises(ValueError, match=r"^ds_config\(consecutive_hysteresis=True\): applies "
                                         r"to dtype='fp16' only"):
        ds_config(stage=2, dtype="bf16", optimizer="sgd", lr=0.1, micro_batch=1, grad_accum=1,
                  world_size=1, consecutive_hysteresis=True)
    # A static scale below the dynamic floor is fine: the floor only applies to dynamic scaling.
    ds_config(stage=2, dtype="fp16", optimizer="sgd", lr=0.1, micro_batch=1, grad_accum=1,
              world_size=1, loss_scale=1.0, initial_scale_power=0, min_loss_scale=4)


# --- the adapter's dispatch, on stand-ins (the real holders: test_loss_scaling_perturbed.py) ---

def test_read_scaler_knows_each_layout():
    zero = SimpleNamespace(overflow=True, loss_scaler=SimpleNamespace(
        update_scale=None, cur_scale=128.0, dynamic=True, cur_hysteresis=1))
    state = read_scaler(zero)
    assert (state.scale, state.dynamic, state.hysteresis_left, state.overflow) == \
        (128.0, True, 1, True)
    stage0 = SimpleNamespace(overflow=False, loss_scale_config=SimpleNamespace(
        use_grad_scaling=True, cur_scale=64.0, dynamic_loss_scale=True))
    assert read_scaler(stage0).hysteresis_left is None and read_scaler(stage0).scale == 64.0
    bf16 = SimpleNamespace(loss_scale_config=SimpleNamespace(use_grad_scaling=False))
    assert read_scaler(bf16).scale is None


def test_read_scaler_names_an_unknown_holder():
    class NewWrapper:
        pass

    with pytest.raises(TypeError, match="NewWrapper keeps no loss-scaling state"):
        read_scaler(NewWrapper())


# --- the suite's tiers and checks, on hand-made traces ---------------------------------------

def test_engine_tier_covers_every_pair_in_few_cells():
    axes = ACCEPTANCE_AXES
    tier = engine_tier()
    by_id = {c.id: c for c in engine_matrix()}
    assert len(by_id) == len(STAGES) * len(WORLD_SIZES) * len(SCALERS) * len(INJECTIONS) * \
        len(OPTIMIZERS)
    assert all(set(values) <= set(getattr_values(k)) for k, values in axes.items())
    cells = [{k: getattr(by_id[i], k) for k in axes} for i in tier]
    assert uncovered_pairs(axes, cells) == set()
    assert len(tier) <= 12
    # Stage 0 meets every acceptance scaler (its known defects show), and on two ranks a scaler
    # it implements (its skip path and consensus are checked).
    assert {c["scaler"] for c in cells if c["stage"] == 0} == set(axes["scaler"])
    assert "z0-ws2-static-loss_inf-sgd" in tier


def getattr_values(axis: str) -> tuple:
    return {"stage": STAGES, "world_size": WORLD_SIZES, "scaler": tuple(SCALERS),
            "inject": INJECTIONS, "optimizer": OPTIMIZERS}[axis]


def _step(i, *, scale_used, scale, skipped=0, error=None, changed=(), unchanged=(),
          masters=None):
    return {"step": i, "injected": False, "loss": 1.0, "scale_used": scale_used, "error": error,
            "state": {"scale": scale, "dynamic": True, "hysteresis_left": None},
            "skipped": skipped, "local_changed": list(changed),
            "masters": masters if masters is not None else {},
            "masters_unchanged": list(unchanged)}


def test_check_engine_run_names_rank_step_and_what_differs():
    case = ScalingCase(stage=2, world_size=1, scaler="floor", inject="loss_inf")
    # floor: pattern 0,1,1,1,0 from 4: clean 4, skip ->2, skip ->1, error.
    good = [_step(0, scale_used=4, scale=4), _step(1, scale_used=4, scale=2, skipped=1),
            _step(2, scale_used=2, scale=1, skipped=1),
            _step(3, scale_used=1, scale=1, error="Exception: Current loss scale already at "
                                                  "minimum")]
    result = {"rank": 0, "wrapper": "W", "steps": good}
    assert check_engine_run(case, [result]) == []
    assert check_engine_run(case, []) == ["0 rank result(s) for 1 ranks: nothing to judge the "
                                          "missing ones by"]
    silent = good[:3] + [_step(3, scale_used=1, scale=1, skipped=1),
                         _step(4, scale_used=1, scale=1)]
    problems = check_engine_run(case, [{**result, "steps": silent}])
    assert problems[0].startswith("rank 0 (W), step 3 (overflow (loss_inf) injected on rank 0):"
                                  " an overflow at min_loss_scale=1 must end the run")
    assert problems[1] == "rank 0: steps after 3 not compared (they follow from this one)"
    assert "ran on to step 4" in check_engine_run(case, [{**result, "steps": good + [
        _step(4, scale_used=1, scale=1)]}])[0]
    leaky = [good[0], _step(1, scale_used=4, scale=2, skipped=1, changed=["master0.0 (x)"])]
    assert "skipped, yet changed this rank's state: master0.0" in \
        check_engine_run(case, [{**result, "steps": leaky}])[0]


def test_check_convergence_is_two_sided():
    from dsconform.checks.tolerances import Tol

    tol = Tol(0.1, 0.0, "test")
    case = SimpleNamespace(dtype="fp16", steps=20)

    def results(low):
        return [{"fp32": {"losses": [1.0] * 10 + [0.5] * 10},
                 "fp16": {"losses": [1.0] * 10 + [low] * 10, "skipped": 3, "wrapper": "W"}}]

    assert check_convergence(case, results(0.46), tol)[1] == []     # within 10 % below
    assert check_convergence(case, results(0.54), tol)[1] == []     # within 10 % above
    problems = check_convergence(case, results(0.56), tol)[1]
    assert problems and "0.56" in problems[0] and "3 skipped steps" in problems[0]
    # a run that skipped more steps than the margin allows for fails on the count alone
    many = results(0.5)
    many[0]["fp16"]["skipped"] = 11
    problems = check_convergence(case, many, tol)[1]
    assert problems == ["rank ?: fp16 skipped 11 of 20 steps (overflows); at most 10 are "
                        "allowed for"], problems
    # far below fp32 on the same task: its updates were larger than fp32's (an lr too high)
    problems = check_convergence(case, results(0.3), tol)[1]
    assert problems and "ended at loss 0.3 " in problems[0] and "-0.2 exceeds" in problems[0]
    assert curve_summary([3.0, 1.0, 2.0], window=2) == {"first_mean": 2.0, "last_mean": 1.5,
                                                         "min": 1.0}
