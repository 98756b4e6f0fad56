"""State fidelity: every entry of a model's ``state_dict``, parameters and buffers of every dtype
torch models carry, MUST come back through the engine, a checkpoint and ``zero_to_fp32`` with
the dtype and value DeepSpeed documents for the precision mode; and DeepSpeed's accessors of the
full gradient, fp32 parameter and optimizer state MUST equal DDP's and torch's.

The model (suites/state_fidelity_ranks.py ``BufferedMLP``): parameters, BatchNorm's fp32
running statistics and int64 ``num_batches_tracked``, an int64 counter, an fp32 scale, a bf16
and an fp16 table, a bool mask, all persistent, and one non-persistent fp32 buffer.

What DeepSpeed documents, per precision mode (fp32, bf16, fp16), ZeRO stages 0-3:

- the engine's module: parameters in the mode's dtype (fp32 / bf16 / fp16), equal to their fp32
  masters rounded to it; buffers keep the dtype the model gave them, in every mode, unless
  ``data_types.buffer_dtype`` is set (``_mixed_precision_dtypes``, DeepSpeed PR 8066, 0.19.2:
  "buffer_dtype: if None uses the buffers' dtype found when the model was loaded",
  runtime/constants.py), and the values the model's own forward gives them;
  non-persistent buffers stay in the module and out of every ``state_dict``;
- ``save_checkpoint`` / ``load_checkpoint`` into a fresh engine: the same state, bit for bit,
  dtypes included; a non-persistent buffer keeps the fresh module's own value;
- ``get_fp32_state_dict_from_zero_checkpoint`` (documented for "ZeRO 2 or 3" checkpoints; stage
  1 shares stage 2's format, stage 0 is not promised): parameters as their fp32 masters,
  floating buffers "restored to fp32", and
  "Non-floating-point buffers retain their dtype" (``convert_zero_checkpoint_to_state_dict``'s
  docstring, DeepSpeed 0.19.8, PR 8515); no non-persistent buffer.

The accessors (``deepspeed.utils``, https://deepspeed.readthedocs.io/en/latest/zero3.html#debugging):
``safe_get_full_grad`` (at the accumulation boundary, before ``step``) MUST equal DDP's gradient,
``safe_get_full_fp32_param`` torch AdamW's parameter after every step and
``safe_get_full_optimizer_state`` (exp_avg, exp_avg_sq) torch AdamW's state, two parameter
groups (weights: weight decay 0.1; biases: 2x lr, no decay), fp32, on 2 ranks with different
data each. The fp32 parameter and optimizer-state accessors are documented for ZeRO (stages 1-3
and the bf16 optimizer) and return None where no master stands behind a parameter (stage 0
fp32): there the model's parameter and its torch optimizer state are read instead, and the
comparison still holds them to DDP's.

- STATE-BUF-1 (``test_state_round_trip``): the engine's state, the state loaded from its
  checkpoint and ``zero_to_fp32``'s MUST carry every entry with the documented dtype and value,
  exactly (``dsconform/checks/tolerances_state.py`` "state").
- STATE-FULL-1 (``test_full_accessors_equal_ddp``): every step's full gradient and fp32
  parameter and the final optimizer state read through DeepSpeed's accessors MUST equal DDP's
  and torch AdamW's, exactly ("state_full").

Upstream: https://www.deepspeed.ai/docs/config-json/ (``data_types``),
https://github.com/deepspeedai/DeepSpeed/blob/master/deepspeed/utils/zero_to_fp32.py ,
https://deepspeed.readthedocs.io/en/latest/model-checkpointing.html .

Stable ids: STATE-BUF-1, STATE-FULL-1; a case id (``z2-bf16-ws2``) names its cell.
"""

from __future__ import annotations

import pytest

from dsconform.suite import (
    ACCELERATORS,
    Comparison,
    accel_cell,
    axis_values,
    compare_states,
    pairwise,
    requires,
    run_ranks,
    tolerance,
)
from suites.state_fidelity_ranks import PRECISIONS, StateCase, accessors, matrix, round_trip

CAPABILITY = "state_fidelity"
# Per call; the first call on a machine builds the shm comm op inside init_distributed
# (docs/findings.md#op-builds).
TIMEOUT_S = 300
# The covering array below is the GPU acceptance tier (its cells measured on an H200,
# docs/suites.md); the rest of the GPU cells run nightly.
GPU_ACCEPTANCE = True


def runs_on(case: StateCase, accelerator: str) -> bool:
    """fp16 engines are GPU cells: the CPU accelerator refuses them without oneDNN fp16."""
    return accelerator == "cuda" or case.dtype != "fp16"


def _axes(case: StateCase) -> dict:
    return {"stage": case.stage, "dtype": case.dtype, "world_size": case.world_size}


def covering(cases: list[StateCase]) -> list[StateCase]:
    """Every pair of (stage, dtype, world size) values at least once."""
    by_axes = {tuple(_axes(c).items()): c for c in cases}
    chosen = pairwise(axis_values(_axes(c) for c in cases),
                      valid=lambda cell: tuple(cell.items()) in by_axes)
    return [by_axes[tuple(cell.items())] for cell in chosen]


def _needs(case: StateCase) -> list:
    return [requires(bf16=True)] if case.dtype == "bf16" else []


def _round_trip_params() -> list:
    cases = [c.with_world_size(ws) for c in matrix() for ws in (1, 2)]
    params = []
    for accel in ACCELERATORS:
        mine = [c for c in cases if runs_on(c, accel)]
        tier = {c.id for c in covering(mine)}
        if accel == "cuda":
            tier = tier if GPU_ACCEPTANCE else set()
        params += [accel_cell(accel, c, id=c.id, world_size=c.world_size, marks=_needs(c),
                              slow=c.id not in tier) for c in mine]
    return params


def _label(accelerator: str, case: StateCase) -> str:
    return f"{accelerator}-{case.id}"


def judge_round_trip(results: list[dict], case: StateCase, accelerator: str,
                     profile=None) -> Comparison:
    """STATE-BUF-1's judgement of every rank's states against the documented dtype and value."""
    tol = tolerance("state", case.dtype, "adamw", getattr(profile, "tolerances", None),
                    accelerator=accelerator)
    cmp = Comparison(tol=tol, label=_label(accelerator, case))
    param_dtype = PRECISIONS[case.dtype]
    for r in results:
        at = f"rank {r['rank']}"
        transient = set(r["non_persistent_initial"])
        buffers = {k: v for k, v in r["reference"].items() if k not in transient}
        # The engine: parameters in the mode's dtype, their masters rounded to it; buffers as
        # the model's own forward left them, in the model's dtype.
        want = {k: v.to(param_dtype) for k, v in r["masters"].items()} | buffers
        cmp.extend(compare_states(r["engine"], want, tol, where=f"{at}, engine"))
        cmp.extend(compare_states(r["engine_np"], r["non_persistent_initial"], tol,
                                  where=f"{at}, engine non-persistent"))
        # The checkpoint round trip: the very state that was saved.
        cmp.extend(compare_states(r["loaded"], r["engine"], tol, where=f"{at}, loaded"))
        cmp.extend(compare_states(r["loaded_np"], r["non_persistent_initial"], tol,
                                  where=f"{at}, loaded non-persistent"))
        if r["consolidated"] is not None:
            fp32 = {k: v.float() if v.is_floating_point() else v for k, v in buffers.items()}
            cmp.extend(compare_states(r["consolidated"], r["masters"] | fp32, tol,
                                      where=f"{at}, get_fp32_state_dict_from_zero_checkpoint"))
        elif case.stage > 0 and r["rank"] == 0:
            cmp.problems.append(f"{at}: no consolidated state from a ZeRO-{case.stage} checkpoint")
    return cmp


@pytest.mark.parametrize("accelerator, case", _round_trip_params())
def test_state_round_trip(accelerator: str, case: StateCase, profile, scratch):
    """STATE-BUF-1: every parameter and buffer MUST come back through the engine, its
    checkpoint and zero_to_fp32 with the documented dtype and value."""
    results = run_ranks(round_trip, case.world_size, timeout_s=TIMEOUT_S,
                        args=(case, str(scratch / "ckpt")), accelerator=accelerator)
    judge_round_trip(results, case, accelerator, profile).assert_ok()


def _accessor_params() -> list:
    cases = [StateCase(stage) for stage in range(4)]
    return [accel_cell(accel, c, id=c.id, world_size=c.world_size,
                       slow=accel == "cuda" and not GPU_ACCEPTANCE)
            for accel in ACCELERATORS for c in cases]


def judge_accessors(results: list[dict], case: StateCase, accelerator: str,
                    profile=None) -> Comparison:
    """STATE-FULL-1's judgement: the accessors' gradients and parameters every step and the
    optimizer state at the end, against DDP and torch AdamW."""
    tol = tolerance("state_full", case.dtype, "adamw", getattr(profile, "tolerances", None),
                    accelerator=accelerator)
    cmp = Comparison(tol=tol, label=_label(accelerator, case))
    for r in results:
        at = f"rank {r['rank']}"
        if len(r["grads"]) != case.steps or len(r["params"]) != case.steps:
            cmp.problems.append(f"{at}: {len(r['grads'])} steps traced, {case.steps} expected")
        for step in range(min(len(r["grads"]), len(r["params"]))):
            cmp.extend(compare_states(r["grads"][step], r["ddp_grads"][step], tol,
                                      where=f"{at}, safe_get_full_grad", step=step))
            cmp.extend(compare_states(r["params"][step], r["ddp_params"][step], tol,
                                      where=f"{at}, safe_get_full_fp32_param", step=step))
        cmp.problems += [f"{at}: {e}" for e in r["state_errors"]]
        want = {k: v for k, v in r["ddp_state"].items() if k in r["state"]}
        lost = sorted(set(r["ddp_state"]) - set(r["state"]))
        if want:
            cmp.extend(compare_states(r["state"], want, tol, step=case.steps - 1,
                                      where=f"{at}, safe_get_full_optimizer_state"))
        if lost and not r["state_errors"]:
            cmp.problems.append(f"{at}: no optimizer state read for {lost[:4]}")
    return cmp


@pytest.mark.parametrize("accelerator, case", _accessor_params())
def test_full_accessors_equal_ddp(accelerator: str, case: StateCase, profile):
    """STATE-FULL-1: safe_get_full_grad, safe_get_full_fp32_param and
    safe_get_full_optimizer_state MUST equal DDP's gradients and torch AdamW's parameters and
    state, at every ZeRO stage."""
    results = run_ranks(accessors, case.world_size, timeout_s=TIMEOUT_S, args=(case,),
                        accelerator=accelerator)
    judge_accessors(results, case, accelerator, profile).assert_ok()
