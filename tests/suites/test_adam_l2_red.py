"""Adam with L2 weight decay MUST be checked, and the checks MUST go red when DeepSpeed drops the
L2 term.

- The op checks (OPS-LOAD-1's functional check, dsconform/checks/op_compute.py check_adam_modes) run
  cpu_adam and fused_adam in both modes: AdamW against torch AdamW, and Adam with weight decay
  as an L2 term of the gradient (adamw_mode / adam_w_mode false) against torch
  Adam(weight_decay=0.01). With the op's weight decay zeroed before its first step (the checks'
  ``tamper`` hook, on the real DeepSpeed optimizer) the L2 mode MUST fail at step 1.
- The ZeRO-Offload Adam-with-L2 cells (suites/test_zero.py, ``...-cpu_adam_l2-...``): with
  DeepSpeedCPUAdam.step zeroing its weight decay in the rank (tests/perturbed_ranks.py), ZeRO
  against DDP's torch Adam(weight_decay=0.01) MUST fail, where the same cell passes unperturbed.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from dsconform.checks.equivalence import compare_rank_results
from dsconform.checks.op_compute import check_adam_modes, check_cpu_adam, check_fused_adam
from dsconform.checks.tolerances import tolerance
from dsconform.checks.zero_vs_ddp import ZeroCase, train_zero_and_ddp
from dsconform.harness.api import run_ranks
from suites.zero_ranks import L2_WEIGHT_DECAY, l2_matrix
from tests import perturbed_ranks


def _drop_weight_decay(optimizer: Any) -> None:
    for group in optimizer.param_groups:
        group["weight_decay"] = 0.0


def test_cpu_adam_is_checked_in_both_modes():
    result = check_adam_modes(check_cpu_adam)
    assert [m["adamw_mode"] for m in result["modes"]] == [True, False]
    assert result["reference"] == "AdamW and Adam"
    assert all(m["weight_decay"] == 0.01 for m in result["modes"])


@pytest.mark.parametrize("adamw_mode", [False, True], ids=["adam_l2", "adamw"])
def test_cpu_adam_without_its_weight_decay_fails(adamw_mode):
    with pytest.raises(AssertionError, match=r"cpu_adam: step 1, parameter \d .* max abs diff"):
        check_cpu_adam(adamw_mode=adamw_mode, tamper=_drop_weight_decay)


# Not promised by cpu-ci: a cold JIT build of fused_adam takes 1-4 minutes on the 2-core CI
# machine, so it runs in the nightly tier (-m slow), as the ops tests of tests/ops/test_ops_lib.py.
@pytest.mark.slow
def test_fused_adam_without_its_l2_term_fails():
    assert [m["adamw_mode"] for m in check_adam_modes(check_fused_adam, "cpu")["modes"]] == [
        True, False]
    with pytest.raises(AssertionError, match=r"fused_adam: step 1, parameter \d .* max abs"):
        check_fused_adam("cpu", adamw_mode=False, tamper=_drop_weight_decay)


def _cell(stage: int, offload_param: bool) -> ZeroCase:
    [case] = [c for c in l2_matrix(world_sizes=(2,)) if (c.stage, c.offload_param, c.dtype) ==
              (stage, offload_param, "fp32")]
    assert case.weight_decay == L2_WEIGHT_DECAY and case.id.endswith("-cpu_adam_l2-gas1-ws2")
    return case


@pytest.mark.parametrize("stage, offload_param", [(2, False), (3, True)],
                         ids=["z2-off_opt", "z3-off_param+opt"])
def test_zero_offload_without_the_l2_term_fails(stage, offload_param):
    case = _cell(stage, offload_param)
    tol = tolerance("zero", "fp32", "cpu_adam", accelerator="cpu")
    control = compare_rank_results(
        run_ranks(train_zero_and_ddp, 2, timeout_s=600, args=(case,), accelerator="cpu"), tol,
        label=case.id)
    assert control.ok, control.report()
    cmp = compare_rank_results(
        run_ranks(perturbed_ranks.train_zero_and_ddp_without_l2, 2, timeout_s=600,
                  args=(case,), accelerator="cpu"), tol, label=case.id)
    assert not cmp.ok
    first = cmp.first_divergence
    # Step 0's gradient is taken before any update: the first step without its L2 term shows in
    # step 1's loss and gradients.
    assert first.step == 1, cmp.report()
    with pytest.raises(AssertionError, match=rf"{re.escape(case.id)}: first diverging step 1: "):
        cmp.assert_ok()
